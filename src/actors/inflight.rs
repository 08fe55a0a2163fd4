//! Rows in flight: claimed and not yet marked. A semaphore of
//! `relay.max_in_flight` permits bounds them (backpressure: a claimer takes
//! permits before it claims), and a table of what each holds lets a handover
//! or a shutdown release the leases of rows that were never delivered.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::store::outbox::Held;
use crate::store::{Fence, ShardId};

/// How long a claimer waits for a quarter batch of permits before taking
/// whatever is free.
const PERMIT_WAIT: Duration = Duration::from_millis(100);

#[derive(Debug)]
pub struct InFlight {
    permits: Arc<Semaphore>,
    max: usize,
    rows: Mutex<HashMap<i64, Held>>,
}

impl InFlight {
    pub fn new(max: usize) -> Arc<InFlight> {
        Arc::new(InFlight {
            permits: Arc::new(Semaphore::new(max)),
            max,
            rows: Mutex::new(HashMap::new()),
        })
    }

    /// Rows claimed and not yet marked (permits out).
    pub fn count(&self) -> usize {
        self.max.saturating_sub(self.permits.available_permits())
    }

    /// Up to `batch` permits. When few are free it waits (a little) for a
    /// quarter batch: a claim costs about the same for 1 row as for 500, so
    /// claiming as soon as one permit frees up would spend the database on
    /// tiny claims exactly when the relay is busiest. `None` when none is free.
    pub async fn permits(&self, batch: usize) -> Option<Permits> {
        let semaphore = &self.permits;
        let chunk = (batch / 4).max(1) as u32;
        let mut permit = match semaphore.clone().try_acquire_many_owned(chunk) {
            Ok(p) => p,
            Err(_) => {
                match tokio::time::timeout(PERMIT_WAIT, semaphore.clone().acquire_many_owned(chunk))
                    .await
                {
                    Ok(Ok(p)) => p,
                    // Still short after the wait: take what there is, so a slow
                    // destination does not stop the relay altogether.
                    _ => semaphore.clone().try_acquire_owned().ok()?,
                }
            }
        };
        let more = batch
            .saturating_sub(permit.num_permits())
            .min(semaphore.available_permits());
        if more > 0 {
            if let Ok(extra) = semaphore.clone().try_acquire_many_owned(more as u32) {
                permit.merge(extra);
            }
        }
        Some(Permits(permit))
    }

    /// Every row held.
    pub fn snapshot(&self) -> Vec<Held> {
        self.lock().values().copied().collect()
    }

    /// The rows held under `fence` (one tenure of one shard).
    pub fn of(&self, fence: Fence) -> Vec<Held> {
        self.lock()
            .values()
            .filter(|h| h.fence == fence)
            .copied()
            .collect()
    }

    /// Does any row of `shard` remain under `fence`'s tenure?
    pub fn holds_any(&self, fence: Fence) -> bool {
        self.lock().values().any(|h| h.fence == fence)
    }

    pub fn shard_rows(&self, shard: ShardId) -> usize {
        self.lock()
            .values()
            .filter(|h| h.fence.shard == shard)
            .count()
    }

    /// Rows in the table (may briefly differ from [`InFlight::count`]).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Held>> {
        self.rows.lock().expect("in-flight lock")
    }
}

/// Permits taken for a claim; one goes to each claimed row, the rest back.
pub struct Permits(OwnedSemaphorePermit);

impl Permits {
    pub fn count(&self) -> usize {
        self.0.num_permits()
    }

    /// The hold of one claimed row on the relay, leased until `expires`.
    pub fn lease(&mut self, held: Held, expires: Instant, in_flight: &Arc<InFlight>) -> Lease {
        let permit = self.0.split(1).expect("one permit per claimed row");
        in_flight.lock().insert(held.id, held);
        Lease {
            held,
            expires,
            _permit: permit,
            in_flight: Arc::clone(in_flight),
        }
    }
}

/// A claimed row's hold on the relay: its in-flight permit and its place in
/// [`InFlight`]. Dropping it, after the mark or with a crashed actor's state,
/// gives both back.
#[derive(Debug)]
pub struct Lease {
    pub held: Held,
    /// When the database lets another claim take the row (as this process
    /// sees it: the claim's start plus the lease).
    pub expires: Instant,
    _permit: OwnedSemaphorePermit,
    in_flight: Arc<InFlight>,
}

impl Lease {
    pub fn id(&self) -> i64 {
        self.held.id
    }

    pub fn attempt(&self) -> i32 {
        self.held.attempt
    }

    pub fn fence(&self) -> Fence {
        self.held.fence
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut rows = self.in_flight.lock();
        // A newer claim of the same row (after our lease expired) keeps its entry.
        if rows
            .get(&self.held.id)
            .is_some_and(|h| h.attempt == self.held.attempt)
        {
            rows.remove(&self.held.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(id: i64, shard: u32, token: i64) -> Held {
        Held {
            id,
            attempt: 1,
            fence: Fence {
                shard: ShardId::new(shard),
                token,
            },
        }
    }

    #[tokio::test]
    async fn a_lease_holds_a_permit_and_its_row_until_dropped() {
        let in_flight = InFlight::new(4);
        let mut permits = in_flight.permits(3).await.unwrap();
        assert_eq!(permits.count(), 3);
        let later = Instant::now() + Duration::from_secs(60);
        let a = permits.lease(held(1, 0, 7), later, &in_flight);
        let b = permits.lease(held(2, 1, 8), later, &in_flight);
        drop(permits);
        assert_eq!(in_flight.count(), 2, "unused permits go back");
        assert_eq!(in_flight.of(a.fence()), vec![a.held]);
        assert!(in_flight.holds_any(b.fence()));
        drop(a);
        assert_eq!(in_flight.count(), 1);
        assert_eq!(in_flight.snapshot(), vec![b.held]);
        drop(b);
        assert!(in_flight.is_empty());
        assert_eq!(in_flight.count(), 0);
    }
}
