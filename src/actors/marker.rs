//! Marker: collects outcomes and writes them in multi-row UPDATEs every
//! `mark_batch` rows or `mark_interval`, whichever comes first, the one
//! write an event costs; a large flush is split by id over
//! `relay.mark_connections` connections that write in parallel
//! ([`crate::store::mark::mark_split`]). Every
//! write is fenced twice: by the `attempt_count` the claim read, so a mark
//! written twice (after a lost answer) or after a newer attempt applies once;
//! and by the shard's fencing token, so a replica that lost the shard (paused
//! past its shard lease, cut off) has its late marks refused by the database.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::counter;
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::inflight::{InFlight, Lease};
use super::{Counters, DueAt, Slot, Wake};
use crate::metrics as m;
use crate::sink::{DeadReason, RetryReason};
use crate::store::mark::{mark_split, Held, Write, Written};
use crate::store::{Session, ShardId, Store};

/// What the marker writes for a row.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Mark {
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
    /// Not attempted after all (shutdown, handover, a row that waited too
    /// long for a publisher): nothing is written, and the next claim (here or
    /// at the shard's next owner) reads the row again.
    Release,
    /// Not attempted, or failed because of the sink rather than the event:
    /// the route is paused, or a final verdict waits for a witness. Back
    /// after `delay`, the attempt not counted.
    Defer {
        delay: Duration,
        error: String,
        cause: DeferCause,
    },
    /// QStash took it for an ordered route: held for up to `delay` until its
    /// callback says what the destination answered; its key waits meanwhile.
    Hold {
        delay: Duration,
    },
}

impl Mark {
    fn write(&self) -> Write<'_> {
        match self {
            Mark::Published => Write::Published,
            Mark::Retry { delay, error, .. } => Write::Retry {
                delay: *delay,
                error,
            },
            Mark::Dead { reason, error } => Write::Dead {
                error,
                // Settled without a send: not an attempt.
                attempted: *reason != DeadReason::Unanswered,
            },
            Mark::Release => Write::Release,
            Mark::Defer { delay, error, .. } => Write::Defer {
                delay: *delay,
                error,
            },
            Mark::Hold { delay } => Write::Hold { delay: *delay },
        }
    }

    /// How long after its mark the row can be claimed again, for the rows
    /// that stay pending: a retry's or a deferral's delay, a hold's length,
    /// and at once for a row given back unattempted.
    fn comes_due_in(&self) -> Option<Duration> {
        match self {
            Mark::Retry { delay, .. } | Mark::Defer { delay, .. } | Mark::Hold { delay } => {
                Some(*delay)
            }
            Mark::Release => Some(Duration::ZERO),
            Mark::Published | Mark::Dead { .. } => None,
        }
    }
}

/// Why a row was deferred; the `cause` label on the metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeferCause {
    /// Its route is paused by the circuit breaker.
    Paused,
    /// Its final verdict came while the route accepted nothing else
    /// ([`crate::sink::breaker::witness`]).
    NoWitness,
    /// Its webhook route's or destination host's limits (`rate`,
    /// `concurrency`, a `429`) do not let it go now ([`crate::sink::limits`]).
    Limited,
}

impl DeferCause {
    /// Every cause, to export each one's series at 0 from start.
    pub(crate) const ALL: [DeferCause; 3] = [
        DeferCause::Paused,
        DeferCause::NoWitness,
        DeferCause::Limited,
    ];

    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            DeferCause::Paused => "paused",
            DeferCause::NoWitness => "no_witness",
            DeferCause::Limited => "limited",
        }
    }
}

/// A row's outcome on its way to the marker.
#[derive(Debug)]
pub(crate) struct Marked {
    pub lease: Lease,
    pub mark: Mark,
    /// The route's index, for metric labels; `None` when no route matched.
    pub route: Option<usize>,
}

pub(crate) enum MarkerMsg {
    Outcomes(Vec<Marked>),
    /// The flush timer fired.
    Flush,
    /// Write everything pending now; replies when written (or given up).
    FlushNow(RpcReplyPort<()>),
}

/// How long the marker may take to write before a caller stops waiting.
pub(crate) const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

/// The marker, as the claimers, publishers and the shutdown see it: the
/// supervisor puts each new marker in the slot.
#[derive(Clone, Default)]
pub(crate) struct MarkerPort(Arc<Slot<MarkerMsg>>);

impl MarkerPort {
    pub(crate) fn slot(&self) -> &Slot<MarkerMsg> {
        &self.0
    }

    /// Hands outcomes over. When the marker is restarting they are lost and
    /// their rows' leases expire: claimed again, delivered again.
    pub(crate) fn send(&self, marked: Vec<Marked>) {
        match self.0.get() {
            Some(marker) => {
                if let Err(e) = marker.cast(MarkerMsg::Outcomes(marked)) {
                    tracing::warn!(error = %e, "marker gone; outcomes lost, leases will expire");
                }
            }
            None => tracing::warn!(
                rows = marked.len(),
                "marker restarting; outcomes lost, leases will expire"
            ),
        }
    }

    /// Writes what the marker holds now; false when it did not confirm.
    pub(crate) async fn flush(&self) -> bool {
        let Some(marker) = self.0.get() else {
            return false;
        };
        matches!(
            marker.call(MarkerMsg::FlushNow, Some(FLUSH_TIMEOUT)).await,
            Ok(ractor::rpc::CallResult::Success(()))
        )
    }
}

pub(crate) struct Marker;

#[derive(Clone)]
pub(crate) struct MarkerArgs {
    pub store: Store,
    /// Connections a flush is written over (`relay.mark_connections`).
    pub connections: usize,
    /// Flush after this many outcomes...
    pub batch: usize,
    /// ...or this long after the first one, whichever comes first.
    pub interval: Duration,
    /// Route names by index, for metric labels.
    pub route_names: Arc<[String]>,
    pub counters: Arc<Counters>,
    pub in_flight: Arc<InFlight>,
    /// Called after each successful flush (ordered routes: a key's next
    /// event may have become claimable).
    pub after_flush: Option<Wake>,
    /// Told, per shard, the earliest time a row a flush left pending comes
    /// due (the claimers' poll backs off while claims find nothing).
    pub due_at: DueAt,
}

pub(crate) struct MarkerState {
    args: MarkerArgs,
    /// One per mark connection; a flush writes over all of them at once.
    sessions: Vec<Session>,
    pending: Vec<Marked>,
    flush_scheduled: bool,
}

impl MarkerState {
    /// Failures in a row so far (the same on every session: they fail together).
    fn failures(&self) -> u32 {
        self.sessions
            .iter()
            .map(Session::failures)
            .max()
            .unwrap_or(0)
    }
}

impl Actor for Marker {
    type Msg = MarkerMsg;
    type State = MarkerState;
    type Arguments = MarkerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<MarkerMsg>,
        args: MarkerArgs,
    ) -> Result<MarkerState, ActorProcessingErr> {
        Ok(MarkerState {
            sessions: (0..args.connections.max(1))
                .map(|_| args.store.session())
                .collect(),
            args,
            pending: Vec::new(),
            flush_scheduled: false,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<MarkerMsg>,
        msg: MarkerMsg,
        state: &mut MarkerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            MarkerMsg::Outcomes(marked) => {
                state.pending.extend(marked);
                if state.pending.len() >= state.args.batch {
                    flush(&myself, state).await;
                } else if !state.flush_scheduled {
                    state.flush_scheduled = true;
                    myself.send_after(state.args.interval, || MarkerMsg::Flush);
                }
            }
            MarkerMsg::Flush => {
                state.flush_scheduled = false;
                flush(&myself, state).await;
            }
            MarkerMsg::FlushNow(reply) => {
                // During shutdown: try a few times, the database may be blinking.
                for _ in 0..5 {
                    if state.pending.is_empty() || flush(&myself, state).await {
                        break;
                    }
                    tokio::time::sleep(crate::store::reconnect_delay(state.failures())).await;
                }
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}

/// Writes what is pending. On failure keeps it and tries again later
/// (in-flight permits bound how much can pile up). True when written.
async fn flush(myself: &ActorRef<MarkerMsg>, state: &mut MarkerState) -> bool {
    if state.pending.is_empty() {
        return true;
    }
    let mut batch = std::mem::take(&mut state.pending);
    // By id: the parts of a split flush never share a row.
    batch.sort_by_key(|m| m.lease.id());
    let writes: Vec<(Held, Write)> = batch
        .iter()
        .map(|m| (m.lease.held, m.mark.write()))
        .collect();
    let written: Written = mark_split(&mut state.sessions, &writes).await;
    drop(writes);
    // Rows the database refused even alone: the mark is dropped (and so is
    // the lease, which expires); the row stays pending and is delivered again.
    for (i, error) in &written.refused {
        let marked = &batch[*i];
        tracing::error!(
            id = marked.lease.id(),
            mark = ?marked.mark,
            %error,
            "the database refused this row's outcome; the row stays pending and will be delivered again"
        );
    }
    counter!(m::MARKS_FAILED).increment(written.refused.len() as u64);
    let refused: HashSet<i64> = written
        .refused
        .iter()
        .map(|(i, _)| batch[*i].lease.id())
        .collect();
    let mut unwritten = vec![false; batch.len()];
    for i in written.unwritten.iter().flat_map(|r| r.clone()) {
        unwritten[i] = true;
    }
    let mut keep = unwritten.iter();
    let (retry, finished): (Vec<Marked>, Vec<Marked>) = batch
        .drain(..)
        .partition(|_| *keep.next().expect("one flag per mark"));
    account(&state.args, &finished, &written.applied, &refused);
    tell_due(&state.args, &finished, &written.applied);
    drop(finished); // leases and permits go back here
    state.args.in_flight.set_gauge();
    state.pending = retry;
    match written.error {
        None => {
            state.sessions.iter_mut().for_each(Session::succeeded);
            if let Some(wake) = &state.args.after_flush {
                wake();
            }
            true
        }
        Some(e) => {
            // Every session takes a fresh connection next time.
            let delay = state
                .sessions
                .iter_mut()
                .map(Session::failed)
                .max()
                .unwrap_or_default();
            tracing::warn!(error = %e, rows = state.pending.len(), retry_in = ?delay, "mark failed; will retry");
            if !state.flush_scheduled {
                state.flush_scheduled = true;
                myself.send_after(delay, || MarkerMsg::Flush);
            }
            false
        }
    }
}

/// Tells each shard's claimer when the earliest of the rows just marked
/// that stay pending comes due: written retries, deferrals and holds (a
/// fenced one is another tenure's), and rows given back unattempted.
fn tell_due(args: &MarkerArgs, finished: &[Marked], applied: &HashSet<i64>) {
    let now = Instant::now();
    let mut earliest: HashMap<ShardId, Instant> = HashMap::new();
    for marked in finished {
        let Some(delay) = marked.mark.comes_due_in() else {
            continue;
        };
        if !matches!(marked.mark, Mark::Release) && !applied.contains(&marked.lease.id()) {
            continue;
        }
        let at = now + delay;
        earliest
            .entry(marked.lease.held.fence.shard)
            .and_modify(|t| *t = (*t).min(at))
            .or_insert(at);
    }
    for (shard, at) in earliest {
        (args.due_at)(shard, at);
    }
}

/// Counts what the database took; a mark it did not apply lost its lease
/// (except the `refused` ones, counted apart).
fn account(args: &MarkerArgs, marked: &[Marked], applied: &HashSet<i64>, refused: &HashSet<i64>) {
    let counters = &args.counters;
    let mut fenced = 0u64;
    for marked in marked {
        if !applied.contains(&marked.lease.id()) {
            if marked.mark != Mark::Release && !refused.contains(&marked.lease.id()) {
                fenced += 1;
            }
            continue;
        }
        let route = marked
            .route
            .and_then(|i| args.route_names.get(i))
            .cloned()
            .unwrap_or_else(|| m::NO_ROUTE.to_owned());
        match &marked.mark {
            Mark::Published => {
                counter!(m::PUBLISHED, "route" => route).increment(1);
                counters.published.fetch_add(1, AtomicOrdering::Relaxed);
            }
            Mark::Retry { reason, .. } => {
                counter!(m::RETRIED, "route" => route, "reason" => reason.as_str()).increment(1);
                counters.retried.fetch_add(1, AtomicOrdering::Relaxed);
            }
            Mark::Dead { reason, .. } => {
                counter!(m::DEAD_LETTERED, "route" => route, "reason" => reason.as_str())
                    .increment(1);
                counters.dead_lettered.fetch_add(1, AtomicOrdering::Relaxed);
            }
            Mark::Defer { cause, .. } => {
                counter!(m::DEFERRED, "route" => route, "cause" => cause.as_str()).increment(1);
                counters.deferred.fetch_add(1, AtomicOrdering::Relaxed);
            }
            Mark::Hold { .. } => {
                counter!(m::HELD, "route" => route).increment(1);
                counters.held.fetch_add(1, AtomicOrdering::Relaxed);
            }
            Mark::Release => {}
        }
    }
    if fenced > 0 {
        tracing::info!(
            fenced,
            "marks refused: those rows were marked already (an answer written twice), or their shard lease ended or went to another replica"
        );
        counter!(m::MARKS_FENCED).increment(fenced);
        counters.fenced.fetch_add(fenced, AtomicOrdering::Relaxed);
    }
}
