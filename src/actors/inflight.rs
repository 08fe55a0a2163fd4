//! Rows in flight: claimed and not yet marked. A claim writes nothing on the
//! rows it reads, so this table is what keeps a row from being handed out
//! twice: a claimer skips the rows it finds here, and also the rows that left
//! it while the claim ran. (A claim reads under a snapshot taken when it
//! starts, so a row whose mark committed after that still reads as pending;
//! its lease is dropped only after the commit, so "dropped after the claim
//! started" covers every such row.) A semaphore of `relay.max_in_flight`
//! permits bounds them (backpressure: a claimer takes permits before it
//! claims), and a handover waits until none of its shard's rows is left here.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// Row ids are the database's own sequence, not a caller's input: a fast
// hash, no defence against chosen keys needed (SipHash was 2-3% of a drain's
// relay CPU).
use foldhash::{HashMap, HashSet};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use uuid::Uuid;

use crate::store::mark::Held;
use crate::store::Fence;
#[cfg(test)]
use crate::store::ShardId;

/// The part of `relay.max_in_flight` one tenant may fill when tenant
/// fairness is on (numerator, denominator).
pub(crate) const TENANT_ROOM: (usize, usize) = (4, 5);

/// How long a claimer waits for a quarter batch of permits before taking
/// whatever is free.
const PERMIT_WAIT: Duration = Duration::from_millis(100);

#[derive(Debug)]
pub(crate) struct InFlight {
    permits: Arc<Semaphore>,
    max: usize,
    /// Whether rows are counted per tenant (tenant fairness: [`InFlight::room_of`]).
    per_tenant: bool,
    table: Mutex<Table>,
}

#[derive(Debug, Default)]
struct Table {
    rows: HashMap<i64, Held>,
    /// Each row's tenant, and the rows out per tenant (tenant fairness
    /// keeps room for the others: [`InFlight::room_of`]).
    tenant_of: HashMap<i64, Uuid>,
    per_tenant: HashMap<Uuid, usize>,
    /// The ids out per tenure, which a claim of that tenure leaves out.
    per_fence: HashMap<Fence, HashSet<i64>>,
    /// When each running claim started (a count per instant).
    claims: BTreeMap<Instant, usize>,
    /// Rows whose lease was dropped while a claim ran, by when: kept until
    /// every claim that started before has ended.
    left: VecDeque<(Instant, i64)>,
}

impl Table {
    fn insert(&mut self, held: Held, tenant: Option<Uuid>) {
        if let Some(old) = self.rows.insert(held.id, held) {
            self.forget(old);
        }
        if let Some(tenant) = tenant {
            if let Some(old) = self.tenant_of.insert(held.id, tenant) {
                self.forget_tenant(old);
            }
            *self.per_tenant.entry(tenant).or_default() += 1;
        }
        self.per_fence
            .entry(held.fence)
            .or_default()
            .insert(held.id);
    }

    fn remove(&mut self, id: i64) {
        if let Some(old) = self.rows.remove(&id) {
            self.forget(old);
        }
        if let Some(tenant) = self.tenant_of.remove(&id) {
            self.forget_tenant(tenant);
        }
    }

    fn forget_tenant(&mut self, tenant: Uuid) {
        if let Some(n) = self.per_tenant.get_mut(&tenant) {
            *n -= 1;
            if *n == 0 {
                self.per_tenant.remove(&tenant);
            }
        }
    }

    /// Drops what no running claim can need: rows that left before the
    /// oldest running claim started (all of them when none runs).
    fn prune(&mut self) {
        let oldest = self.claims.keys().next().copied();
        while self
            .left
            .front()
            .is_some_and(|(at, _)| oldest.is_none_or(|o| *at < o))
        {
            self.left.pop_front();
        }
    }

    fn forget(&mut self, held: Held) {
        if let Some(ids) = self.per_fence.get_mut(&held.fence) {
            ids.remove(&held.id);
            if ids.is_empty() {
                self.per_fence.remove(&held.fence);
            }
        }
    }
}

impl InFlight {
    pub(crate) fn new(max: usize) -> Arc<InFlight> {
        Self::build(max, false)
    }

    /// Counting each tenant's rows out, for tenant fairness's rooms.
    pub(crate) fn per_tenant(max: usize) -> Arc<InFlight> {
        Self::build(max, true)
    }

    fn build(max: usize, per_tenant: bool) -> Arc<InFlight> {
        Arc::new(InFlight {
            permits: Arc::new(Semaphore::new(max)),
            max,
            per_tenant,
            table: Mutex::new(Table::default()),
        })
    }

    /// Rows claimed and not yet marked (permits out, a running claim's
    /// unused ones included).
    pub(crate) fn count(&self) -> usize {
        self.max.saturating_sub(self.permits.available_permits())
    }

    /// Sets the in-flight gauge to the rows leased now. Read and set under
    /// the table's lock, so of the claimers and the marker setting it, the
    /// last one sets the latest count (a count read before another actor's
    /// change, set after it, would stay until the next claim or mark); a
    /// running claim's permits that have no row yet are not counted.
    pub(crate) fn set_gauge(&self) {
        let table = self.lock();
        metrics::gauge!(crate::metrics::IN_FLIGHT).set(table.rows.len() as f64);
    }

    /// Up to `batch` permits. When few are free it waits (a little) for a
    /// quarter batch: a claim costs about the same for 1 row as for 500, so
    /// claiming as soon as one permit frees up would spend the database on
    /// tiny claims exactly when the relay is busiest. `None` when none is free.
    pub(crate) async fn permits(&self, batch: usize) -> Option<Permits> {
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
    #[cfg(test)]
    fn snapshot(&self) -> Vec<Held> {
        self.lock().rows.values().copied().collect()
    }

    /// How many more rows of `tenant` may go out while tenant fairness is
    /// on: one tenant may fill at most [`TENANT_ROOM`] of the room, so that
    /// a row of another tenant that commits while one has a backlog finds
    /// room at the next claim instead of waiting for rows to be marked.
    /// (Made with [`InFlight::new`], rows are not counted per tenant and
    /// every tenant has that whole part.)
    pub(crate) fn room_of(&self, tenant: &Uuid) -> usize {
        let out = self.lock().per_tenant.get(tenant).copied().unwrap_or(0);
        self.tenant_most().saturating_sub(out)
    }

    /// The most rows one tenant may have out with tenant fairness on.
    pub(crate) fn tenant_most(&self) -> usize {
        (self.max * TENANT_ROOM.0 / TENANT_ROOM.1).max(1)
    }

    /// How many rows are out under `fence` (one tenure of one shard).
    pub(crate) fn count_of(&self, fence: Fence) -> usize {
        self.lock().per_fence.get(&fence).map_or(0, HashSet::len)
    }

    /// The ids of the rows out under `fence`, for a claim to leave out.
    pub(crate) fn ids_of(&self, fence: Fence) -> Vec<i64> {
        self.lock()
            .per_fence
            .get(&fence)
            .map(|ids| ids.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Does any row remain out under `fence`'s tenure?
    pub(crate) fn holds_any(&self, fence: Fence) -> bool {
        self.count_of(fence) > 0
    }

    /// A claim begins: until the returned guard drops, rows that leave the
    /// table are remembered, so [`ClaimGuard::fresh`] can tell a row whose
    /// outcome was written during the claim.
    pub(crate) fn claim_starts(self: &Arc<Self>) -> ClaimGuard {
        let started = Instant::now();
        *self.lock().claims.entry(started).or_default() += 1;
        ClaimGuard {
            in_flight: Arc::clone(self),
            started,
        }
    }

    /// Is row `id` out now?
    #[cfg(test)]
    fn contains(&self, id: i64) -> bool {
        self.lock().rows.contains_key(&id)
    }

    /// Rows in the table (may briefly differ from [`InFlight::count`]).
    pub(crate) fn len(&self) -> usize {
        self.lock().rows.len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().expect("in-flight lock")
    }
}

/// Permits taken for a claim; one goes to each claimed row, the rest back.
pub(crate) struct Permits(OwnedSemaphorePermit);

impl Permits {
    pub(crate) fn count(&self) -> usize {
        self.0.num_permits()
    }

    /// The hold of one claimed row on the relay; a publisher drops it
    /// unsent after `expires`.
    pub(crate) fn lease(
        &mut self,
        held: Held,
        tenant: Uuid,
        expires: Instant,
        in_flight: &Arc<InFlight>,
    ) -> Lease {
        let permit = self.0.split(1).expect("one permit per claimed row");
        let tenant = in_flight.per_tenant.then_some(tenant);
        in_flight.lock().insert(held, tenant);
        Lease {
            held,
            expires,
            held_before: false,
            _permit: permit,
            in_flight: Arc::clone(in_flight),
        }
    }
}

/// A claimed row's hold on the relay: its in-flight permit and its place in
/// [`InFlight`]. Dropping it, after the mark or with a crashed actor's state,
/// gives both back.
#[derive(Debug)]
pub(crate) struct Lease {
    pub held: Held,
    /// How long the row may wait for a publisher (the claim's start plus
    /// `relay.lease`); after that it is put back unsent and read again.
    pub expires: Instant,
    /// QStash took an earlier attempt and no outcome came back in time.
    pub held_before: bool,
    _permit: OwnedSemaphorePermit,
    in_flight: Arc<InFlight>,
}

impl Lease {
    pub(crate) fn id(&self) -> i64 {
        self.held.id
    }

    /// The attempt this delivery is, counting from 1 (one more than the
    /// attempts the row records).
    pub(crate) fn attempt(&self) -> i32 {
        self.held.attempt + 1
    }

    pub(crate) fn fence(&self) -> Fence {
        self.held.fence
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut table = self.in_flight.lock();
        // A newer claim of the same row (another tenure) keeps its entry.
        if table.rows.get(&self.held.id) == Some(&self.held) {
            table.remove(self.held.id);
            if !table.claims.is_empty() {
                table.left.push_back((Instant::now(), self.held.id));
            }
        }
    }
}

/// A claim in progress (see [`InFlight::claim_starts`]).
pub(crate) struct ClaimGuard {
    in_flight: Arc<InFlight>,
    started: Instant,
}

impl ClaimGuard {
    /// Of the rows this claim read, those to hand out: not out now, and not
    /// out at any time since the claim started (such a row may read as
    /// pending although its outcome is written).
    pub(crate) fn fresh(&self, ids: impl IntoIterator<Item = i64>) -> HashSet<i64> {
        let table = self.in_flight.lock();
        let since: HashSet<i64> = table
            .left
            .iter()
            .filter(|(at, _)| *at >= self.started)
            .map(|(_, id)| *id)
            .collect();
        ids.into_iter()
            .filter(|id| !table.rows.contains_key(id) && !since.contains(id))
            .collect()
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        let mut table = self.in_flight.lock();
        if let Some(n) = table.claims.get_mut(&self.started) {
            *n -= 1;
            if *n == 0 {
                table.claims.remove(&self.started);
            }
        }
        table.prune();
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
        let a = permits.lease(held(1, 0, 7), Uuid::nil(), later, &in_flight);
        let b = permits.lease(held(2, 1, 8), Uuid::nil(), later, &in_flight);
        drop(permits);
        assert_eq!(in_flight.count(), 2, "unused permits go back");
        assert_eq!(in_flight.count_of(a.fence()), 1);
        assert_eq!(in_flight.ids_of(a.fence()), vec![1]);
        assert!(in_flight.holds_any(b.fence()));
        assert!(in_flight.contains(1) && !in_flight.contains(3));
        let claim = in_flight.claim_starts();
        assert_eq!(claim.fresh([1, 2, 3]), HashSet::from_iter([3]));
        drop(a);
        assert_eq!(in_flight.count(), 1);
        assert!(in_flight.ids_of(held(1, 0, 7).fence).is_empty());
        assert_eq!(in_flight.snapshot(), vec![b.held]);
        // Row 1 left while the claim ran: it may read as pending although
        // marked, so that claim does not hand it out; a later claim does.
        assert_eq!(claim.fresh([1, 3]), HashSet::from_iter([3]));
        drop(claim);
        assert_eq!(
            in_flight.claim_starts().fresh([1, 3]),
            HashSet::from_iter([1, 3])
        );
        drop(b);
        assert!(in_flight.is_empty());
        assert_eq!(in_flight.count(), 0);
        assert!(!in_flight.holds_any(Fence {
            shard: ShardId::new(1),
            token: 8
        }));
    }

    /// The gauge counts rows leased, not the permits a running claim took
    /// ahead of its rows: set while a claim held ten permits for two rows,
    /// it said 10 (a marker's flush during a claim left that for good once
    /// the claims came back empty).
    #[tokio::test]
    async fn the_gauge_counts_leased_rows_not_a_claims_permits() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let in_flight = InFlight::new(20);
        let mut permits = in_flight.permits(10).await.unwrap();
        let later = Instant::now() + Duration::from_secs(60);
        let _a = permits.lease(held(1, 0, 7), Uuid::nil(), later, &in_flight);
        let _b = permits.lease(held(2, 0, 7), Uuid::nil(), later, &in_flight);
        metrics::with_local_recorder(&recorder, || in_flight.set_gauge());
        let rendered = handle.render();
        let line = rendered
            .lines()
            .find(|l| l.starts_with(crate::metrics::IN_FLIGHT))
            .expect("the gauge is set");
        assert_eq!(line, format!("{} 2", crate::metrics::IN_FLIGHT));
        drop(permits);
    }

    /// A tenant may fill four fifths of the room; its rows leaving give
    /// its room back, and another tenant's rows do not take it.
    #[tokio::test]
    async fn a_tenant_fills_at_most_its_part_of_the_room() {
        let in_flight = InFlight::per_tenant(10);
        let (a, b) = (Uuid::from_u128(1), Uuid::from_u128(2));
        assert_eq!(in_flight.room_of(&a), 8);
        let mut permits = in_flight.permits(10).await.unwrap();
        let later = Instant::now() + Duration::from_secs(60);
        let mut leases: Vec<Lease> = (1..=8)
            .map(|id| permits.lease(held(id, 0, 7), a, later, &in_flight))
            .collect();
        let of_b = permits.lease(held(9, 0, 7), b, later, &in_flight);
        assert_eq!((in_flight.room_of(&a), in_flight.room_of(&b)), (0, 7));
        leases.truncate(5);
        assert_eq!(in_flight.room_of(&a), 3);
        // A newer claim of the same row counts it once.
        let again = permits.lease(held(1, 0, 8), a, later, &in_flight);
        assert_eq!(in_flight.room_of(&a), 3);
        drop((leases, of_b, again));
        assert_eq!((in_flight.room_of(&a), in_flight.room_of(&b)), (8, 8));
    }
}
