//! The actor tree (docs/architecture.md):
//!
//! ```text
//! Supervisor ─┬─ Listener        probes the id sequence on its own connection; wakes claimers
//!             ├─ Coordinator     lease a fair share of the shards; start and
//!             │                  stop their claimers; hand shards over
//!             ├─ Claimer × owned shards  claim a batch under a lease; hand rows out
//!             ├─ Publisher × N    deliver through a sink; one outcome per row
//!             └─ Marker           write outcomes in multi-row, fenced UPDATEs
//! ```
//!
//! Actors find each other through the [`Directory`], which the supervisor
//! keeps current across restarts. Rows a crashed actor held are not tracked:
//! their leases expire and they are claimed again.

pub mod claimer;
pub mod coordinator;
pub mod listener;
pub mod marker;
pub mod publisher;
pub mod supervisor;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use outbox_client::row::OutboxRow;
use ractor::ActorRef;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::backoff::Backoff;
use crate::config::Config;
use crate::db;
use crate::routes::Router;
use crate::sink::{DeadReason, RetryReason, Sinks};

pub use claimer::ClaimerMsg;
pub use coordinator::CoordinatorMsg;
pub use marker::MarkerMsg;
pub use publisher::PublisherMsg;
pub use supervisor::SupervisorMsg;

/// Everything the actors share, built once at start.
pub struct Shared {
    pub config: Config,
    pub pool: db::Pool,
    pub router: Router,
    pub sinks: Sinks,
    pub backoff: Backoff,
    /// One permit per row that may be in flight (claimed, not yet marked).
    pub permits: Arc<Semaphore>,
    pub in_flight: Arc<InFlight>,
    pub directory: Directory,
    pub counters: Arc<Counters>,
    pub hooks: Hooks,
    /// The shards this replica holds, with their fencing tokens.
    pub ownership: Ownership,
    /// This replica's name in `outbox_relay_replicas` and the shard leases.
    pub replica_id: String,
}

impl Shared {
    /// Rows claimed and not yet marked.
    pub fn in_flight_count(&self) -> usize {
        (self.config.relay.max_in_flight as usize).saturating_sub(self.permits.available_permits())
    }
}

/// A test's choice of rows, by content.
pub type RowPredicate = Arc<dyn Fn(&OutboxRow) -> bool + Send + Sync>;

/// Fault injection for tests of the recovery path; empty in production.
#[derive(Clone, Default)]
pub struct Hooks {
    /// A publisher handed a row for which this returns true panics.
    pub publisher_panics_on: Option<RowPredicate>,
}

/// Totals since start, for `drain`'s summary and readiness.
#[derive(Debug, Default)]
pub struct Counters {
    pub claimed: AtomicU64,
    pub published: AtomicU64,
    pub retried: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub fenced: AtomicU64,
    pub deferred: AtomicU64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CountersSnapshot {
    pub claimed: u64,
    pub published: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    pub fenced: u64,
    /// Rows put back unattempted while their route was paused.
    pub deferred: u64,
}

impl Counters {
    pub fn snapshot(&self) -> CountersSnapshot {
        CountersSnapshot {
            claimed: self.claimed.load(Ordering::Relaxed),
            published: self.published.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            fenced: self.fenced.load(Ordering::Relaxed),
            deferred: self.deferred.load(Ordering::Relaxed),
        }
    }
}

/// A row this relay holds a lease on, with what fences its mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub id: i64,
    /// The row's lease (`attempt_count` when claimed).
    pub attempt: i32,
    pub shard: i16,
    /// The shard's fencing token when the row was claimed.
    pub token: i64,
}

/// Rows this relay holds a lease on, by id. Used on shutdown and handover to
/// release the leases of rows that were not delivered.
#[derive(Debug, Default)]
pub struct InFlight {
    rows: Mutex<HashMap<i64, Held>>,
}

impl InFlight {
    pub fn snapshot(&self) -> Vec<Held> {
        self.rows
            .lock()
            .expect("in-flight lock")
            .values()
            .copied()
            .collect()
    }

    /// The rows of one shard.
    pub fn of_shard(&self, shard: i16) -> Vec<Held> {
        self.rows
            .lock()
            .expect("in-flight lock")
            .values()
            .filter(|h| h.shard == shard)
            .copied()
            .collect()
    }

    pub fn len(&self) -> usize {
        self.rows.lock().expect("in-flight lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A claimed row's hold on the relay: its in-flight permit and its place in
/// [`InFlight`]. Dropping it, after the mark or with a crashed actor's state,
/// gives both back.
#[derive(Debug)]
pub struct Lease {
    pub id: i64,
    pub attempt: i32,
    pub shard: i16,
    /// The shard's fencing token the row was claimed under.
    pub token: i64,
    /// When the database lets another claim take the row (as this process
    /// sees it: the claim's start plus the lease).
    pub expires: std::time::Instant,
    _permit: OwnedSemaphorePermit,
    in_flight: Arc<InFlight>,
}

impl Lease {
    pub fn new(
        held: Held,
        expires: std::time::Instant,
        permit: OwnedSemaphorePermit,
        in_flight: &Arc<InFlight>,
    ) -> Lease {
        in_flight
            .rows
            .lock()
            .expect("in-flight lock")
            .insert(held.id, held);
        Lease {
            id: held.id,
            attempt: held.attempt,
            shard: held.shard,
            token: held.token,
            expires,
            _permit: permit,
            in_flight: Arc::clone(in_flight),
        }
    }
}

impl Lease {
    /// What fences this row's mark.
    pub fn held(&self) -> Held {
        Held {
            id: self.id,
            attempt: self.attempt,
            shard: self.shard,
            token: self.token,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut rows = self.in_flight.rows.lock().expect("in-flight lock");
        // A newer claim of the same row (after our lease expired) keeps its entry.
        if rows
            .get(&self.id)
            .is_some_and(|h| h.attempt == self.attempt)
        {
            rows.remove(&self.id);
        }
    }
}

/// The shards this replica holds: shard → its fencing token and when its
/// lease ends as this process sees it (measured before the statement that
/// took or renewed it, so never later than the database's). Publishers check
/// it before sending: a replica paused past its lease drops what it held.
#[derive(Debug, Default)]
pub struct Ownership {
    shards: Mutex<HashMap<i16, Tenure>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tenure {
    pub token: i64,
    pub until: std::time::Instant,
    /// False once the shard is on its way out (handover, shutdown): the lease
    /// is still renewed, but no publisher starts a request for its rows.
    pub sending: bool,
}

impl Tenure {
    pub fn new(token: i64, until: std::time::Instant) -> Tenure {
        Tenure {
            token,
            until,
            sending: true,
        }
    }
}

impl Ownership {
    /// May a request for a row of `shard` claimed under `token` start now:
    /// is it still this replica's tenure, not over, and not on its way out?
    pub fn holds(&self, shard: i16, token: i64) -> bool {
        self.shards
            .lock()
            .expect("ownership lock")
            .get(&shard)
            .is_some_and(|t| t.token == token && t.sending && t.until > std::time::Instant::now())
    }

    pub fn set(&self, shard: i16, tenure: Tenure) {
        self.shards
            .lock()
            .expect("ownership lock")
            .insert(shard, tenure);
    }

    /// Extends the tenure under `token` (keeping whether it still sends).
    pub fn renew(&self, shard: i16, token: i64, until: std::time::Instant) {
        if let Some(t) = self
            .shards
            .lock()
            .expect("ownership lock")
            .get_mut(&shard)
            .filter(|t| t.token == token)
        {
            t.until = until;
        }
    }

    /// No request starts for the shard's rows from now on (it is being
    /// handed over); `None` stops every shard (shutdown).
    pub fn stop_sending(&self, shard: Option<i16>, token: Option<i64>) {
        for (s, t) in self.shards.lock().expect("ownership lock").iter_mut() {
            if shard.is_none_or(|x| x == *s) && token.is_none_or(|x| x == t.token) {
                t.sending = false;
            }
        }
    }

    pub fn remove(&self, shard: i16) -> Option<Tenure> {
        self.shards.lock().expect("ownership lock").remove(&shard)
    }

    /// Removes the shard's tenure if it is still the one under `token`.
    pub fn remove_if(&self, shard: i16, token: i64) {
        let mut shards = self.shards.lock().expect("ownership lock");
        if shards.get(&shard).is_some_and(|t| t.token == token) {
            shards.remove(&shard);
        }
    }

    pub fn get(&self, shard: i16) -> Option<Tenure> {
        self.shards
            .lock()
            .expect("ownership lock")
            .get(&shard)
            .copied()
    }

    /// Shards held, in order.
    pub fn shards(&self) -> Vec<(i16, Tenure)> {
        let mut v: Vec<_> = self
            .shards
            .lock()
            .expect("ownership lock")
            .iter()
            .map(|(s, t)| (*s, *t))
            .collect();
        v.sort_unstable_by_key(|(s, _)| *s);
        v
    }

    pub fn len(&self) -> usize {
        self.shards.lock().expect("ownership lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What the marker writes for a row.
#[derive(Debug, Clone, PartialEq)]
pub enum Mark {
    Published,
    Retry {
        delay: Duration,
        reason: RetryReason,
        error: String,
    },
    Dead {
        reason: DeadReason,
        error: String,
    },
    /// Not attempted after all (shutdown, a lease too short to send): the
    /// lease is given back and the attempt not counted.
    Release,
    /// Not attempted, or failed because of the sink rather than the event:
    /// the route is paused. Back after `delay`, the attempt not counted.
    Defer {
        delay: Duration,
        error: String,
    },
}

/// A row's outcome on its way to the marker.
#[derive(Debug)]
pub struct Marked {
    pub lease: Lease,
    pub mark: Mark,
    /// The route's index, for metric labels; `None` when no route matched.
    pub route: Option<usize>,
}

/// Where the live actors are. The supervisor replaces an entry when it
/// restarts an actor; senders look up on every send.
#[derive(Default)]
pub struct Directory {
    claimers: RwLock<Vec<Option<ActorRef<ClaimerMsg>>>>,
    publishers: RwLock<Vec<Option<ActorRef<PublisherMsg>>>>,
    marker: RwLock<Option<ActorRef<MarkerMsg>>>,
    coordinator: RwLock<Option<ActorRef<CoordinatorMsg>>>,
    next_publisher: AtomicUsize,
}

impl Directory {
    pub(crate) fn new(shards: usize, publishers: usize) -> Directory {
        Directory {
            claimers: RwLock::new(vec![None; shards]),
            publishers: RwLock::new(vec![None; publishers]),
            marker: RwLock::new(None),
            coordinator: RwLock::new(None),
            next_publisher: AtomicUsize::new(0),
        }
    }

    pub fn marker(&self) -> Option<ActorRef<MarkerMsg>> {
        self.marker.read().expect("directory lock").clone()
    }

    pub fn coordinator(&self) -> Option<ActorRef<CoordinatorMsg>> {
        self.coordinator.read().expect("directory lock").clone()
    }

    /// The claimer of `shard`, if one runs.
    pub fn claimer(&self, shard: usize) -> Option<ActorRef<ClaimerMsg>> {
        self.claimers
            .read()
            .expect("directory lock")
            .get(shard)
            .cloned()
            .flatten()
    }

    pub fn claimers(&self) -> Vec<ActorRef<ClaimerMsg>> {
        self.claimers
            .read()
            .expect("directory lock")
            .iter()
            .flatten()
            .cloned()
            .collect()
    }

    pub fn publishers(&self) -> Vec<ActorRef<PublisherMsg>> {
        self.publishers
            .read()
            .expect("directory lock")
            .iter()
            .flatten()
            .cloned()
            .collect()
    }

    /// The next live publisher, round robin.
    pub fn next_publisher(&self) -> Option<ActorRef<PublisherMsg>> {
        let publishers = self.publishers.read().expect("directory lock");
        let n = publishers.len();
        let start = self.next_publisher.fetch_add(1, Ordering::Relaxed);
        (0..n).find_map(|i| publishers[(start + i) % n].clone())
    }

    fn set_claimer(&self, shard: usize, actor: Option<ActorRef<ClaimerMsg>>) {
        self.claimers.write().expect("directory lock")[shard] = actor;
    }

    fn set_publisher(&self, index: usize, actor: Option<ActorRef<PublisherMsg>>) {
        self.publishers.write().expect("directory lock")[index] = actor;
    }

    fn set_marker(&self, actor: Option<ActorRef<MarkerMsg>>) {
        *self.marker.write().expect("directory lock") = actor;
    }

    fn set_coordinator(&self, actor: Option<ActorRef<CoordinatorMsg>>) {
        *self.coordinator.write().expect("directory lock") = actor;
    }

    /// Wakes every claimer (new rows may be ready, or the listener reconnected).
    pub fn wake_claimers(&self) {
        for claimer in self.claimers() {
            let _ = claimer.cast(ClaimerMsg::Wake);
        }
    }
}

/// How long after publishers stop starting requests every request has ended
/// (answered or cut off by `http.request_timeout`) and its outcome is marked.
pub(crate) fn requests_end_within(config: &Config) -> Duration {
    config.http.request_timeout + config.relay.mark_interval + Duration::from_secs(1)
}

/// Backoff for reconnecting to the database after an error.
pub(crate) fn reconnect_delay(failures: u32) -> Duration {
    let ms = 50u64.saturating_mul(1 << failures.min(7));
    Duration::from_millis(ms.min(5_000))
}

#[cfg(test)]
mod tests {
    use super::{Ownership, Tenure};
    use std::time::{Duration, Instant};

    #[test]
    fn a_tenure_is_held_under_its_token_until_it_ends() {
        let ownership = Ownership::default();
        let later = Instant::now() + Duration::from_secs(60);
        ownership.set(3, Tenure::new(7, later));
        assert!(ownership.holds(3, 7));
        assert!(!ownership.holds(3, 6), "an older token");
        assert!(!ownership.holds(4, 7), "another shard");
        ownership.set(3, Tenure::new(7, Instant::now() - Duration::from_millis(1)));
        assert!(!ownership.holds(3, 7), "the lease ended");
        ownership.set(3, Tenure::new(7, later));
        ownership.stop_sending(Some(3), Some(7));
        assert!(!ownership.holds(3, 7), "on its way out");
        ownership.renew(3, 7, later + Duration::from_secs(1));
        assert!(!ownership.holds(3, 7), "a renewal does not undo it");
        assert_eq!(
            ownership.get(3).unwrap().until,
            later + Duration::from_secs(1)
        );
    }

    #[test]
    fn removing_an_old_tenure_leaves_a_newer_one() {
        let ownership = Ownership::default();
        let later = Instant::now() + Duration::from_secs(60);
        ownership.set(3, Tenure::new(9, later));
        ownership.remove_if(3, 7);
        assert!(ownership.holds(3, 9));
        ownership.remove_if(3, 9);
        assert!(ownership.is_empty());
    }
}
