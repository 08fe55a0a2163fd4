//! The actor tree (docs/architecture.md):
//!
//! ```text
//! Supervisor ─┬─ Listener        probes the id sequence on its own connection; wakes claimers
//!             ├─ Coordinator     leases a fair share of the shards; starts and
//!             │                  stops their claimers; hands shards over
//!             ├─ Claimer × owned shards  claims a batch under a lease; queues it as jobs
//!             ├─ Publisher × N    takes a job (tenants in turn, if fair); delivers it
//!             │                  through a sink; one outcome per row
//!             └─ Marker           writes outcomes in multi-row, fenced UPDATEs
//! ```
//!
//! Each actor gets the few values and handles it needs as arguments: the
//! store, its settings, and handles to the actors it talks to
//! ([`marker::MarkerPort`], [`publisher::Publishers`], [`claimer::Claimers`]),
//! which the supervisor keeps pointing at the live actors across restarts.
//! With tenant fairness the claimers' jobs wait in one queue
//! ([`job_queue`]) that a free publisher takes from, the tenants in turn.
//! Rows a crashed actor held are not tracked: their leases expire and they
//! are claimed again.

pub(crate) mod claim_plan;
pub(crate) mod claimer;
pub(crate) mod coordinator;
pub(crate) mod identity;
pub(crate) mod inflight;
pub(crate) mod job_queue;
pub(crate) mod listener;
pub(crate) mod marker;
pub(crate) mod ownership;
pub(crate) mod poll;
pub(crate) mod publisher;
pub(crate) mod supervisor;
pub(crate) mod winddown;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use ractor::ActorRef;

/// Something to call when new rows may be ready: wakes the claimers.
pub(crate) type Wake = Arc<dyn Fn() + Send + Sync>;

/// Something to call when a row of a shard comes due at a time (a retry, a
/// deferral or a hold the marker wrote): that shard's claimer polls then.
pub(crate) type DueAt = Arc<dyn Fn(crate::store::ShardId, std::time::Instant) + Send + Sync>;

/// The current actor of one kind, replaced by the supervisor when it restarts
/// the actor; senders look it up on every send.
pub(crate) struct Slot<M>(RwLock<Option<ActorRef<M>>>);

impl<M> Default for Slot<M> {
    fn default() -> Self {
        Slot(RwLock::new(None))
    }
}

impl<M> Slot<M> {
    pub(crate) fn get(&self) -> Option<ActorRef<M>> {
        self.0.read().expect("slot lock").clone()
    }

    pub(crate) fn set(&self, actor: Option<ActorRef<M>>) {
        *self.0.write().expect("slot lock") = actor;
    }
}

/// Totals since start, for `drain`'s summary and readiness.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub claims: AtomicU64,
    pub claimed: AtomicU64,
    pub published: AtomicU64,
    pub retried: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub fenced: AtomicU64,
    pub deferred: AtomicU64,
    pub held: AtomicU64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CountersSnapshot {
    /// Claim statements the claimers ran (found something or not).
    pub claims: u64,
    /// Rows they claimed.
    pub claimed: u64,
    pub published: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    pub fenced: u64,
    /// Rows put back unattempted while their route was paused.
    pub deferred: u64,
    /// Ordered QStash deliveries taken by QStash and held for their callback.
    pub held: u64,
}

impl Counters {
    pub(crate) fn snapshot(&self) -> CountersSnapshot {
        CountersSnapshot {
            claims: self.claims.load(Ordering::Relaxed),
            claimed: self.claimed.load(Ordering::Relaxed),
            published: self.published.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            fenced: self.fenced.load(Ordering::Relaxed),
            deferred: self.deferred.load(Ordering::Relaxed),
            held: self.held.load(Ordering::Relaxed),
        }
    }
}

/// A test's choice of rows, by content.
#[cfg(test)]
pub(crate) type RowPredicate = Arc<dyn Fn(&outbox_client::row::OutboxRow) -> bool + Send + Sync>;

/// Fault injection for tests of the recovery path.
#[cfg(test)]
#[derive(Clone, Default)]
pub(crate) struct Hooks {
    /// A publisher handed a row for which this returns true panics.
    pub publisher_panics_on: Option<RowPredicate>,
}
