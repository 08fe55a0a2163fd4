//! Publisher: one of a pool sharing the HTTP client. Delivers a job (rows of
//! one route) through its sink and sends one outcome per row to the marker:
//! published, retry after a jittered backoff, or dead.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::inflight::Lease;
use super::marker::{Mark, Marked, MarkerPort};
use super::ownership::Ownership;
use crate::backoff::Backoff;
use crate::metrics as m;
use crate::routes::Router;
use crate::sink::breaker::{self, Admit};
use crate::sink::{DeadReason, Outcome, RetryReason, Sinks};
use outbox_client::row::OutboxRow;

#[derive(Debug)]
pub(crate) enum PublisherMsg {
    Publish {
        /// Index into the router's routes.
        route: usize,
        rows: Vec<OutboxRow>,
        leases: Vec<Lease>,
    },
}

/// The pool of publishers, round robin; the supervisor puts each new
/// publisher in its place.
#[derive(Clone)]
pub(crate) struct Publishers(Arc<PublishersInner>);

struct PublishersInner {
    slots: RwLock<Vec<Option<ActorRef<PublisherMsg>>>>,
    next: AtomicUsize,
}

impl Publishers {
    pub(crate) fn new(n: usize) -> Publishers {
        Publishers(Arc::new(PublishersInner {
            slots: RwLock::new(vec![None; n]),
            next: AtomicUsize::new(0),
        }))
    }

    /// The next live publisher, round robin.
    pub(crate) fn next(&self) -> Option<ActorRef<PublisherMsg>> {
        let slots = self.0.slots.read().expect("publishers lock");
        let n = slots.len();
        let start = self.0.next.fetch_add(1, Ordering::Relaxed);
        (0..n).find_map(|i| slots[(start + i) % n].clone())
    }

    pub(crate) fn all(&self) -> Vec<ActorRef<PublisherMsg>> {
        let slots = self.0.slots.read().expect("publishers lock");
        slots.iter().flatten().cloned().collect()
    }

    pub(crate) fn set(&self, index: usize, actor: Option<ActorRef<PublisherMsg>>) {
        self.0.slots.write().expect("publishers lock")[index] = actor;
    }
}

/// How failed attempts are retried.
#[derive(Debug, Clone)]
pub(crate) struct RetryPolicy {
    pub backoff: Backoff,
    /// The attempt that reaches this count and fails dead-letters the row.
    pub max_attempts: u32,
}

pub(crate) struct Publisher;

pub(crate) struct PublisherArgs {
    pub sinks: Arc<Sinks>,
    pub router: Arc<Router>,
    pub retry: RetryPolicy,
    pub ownership: Arc<Ownership>,
    /// A row is sent only when its lease outlasts a whole request.
    pub request_timeout: Duration,
    pub marker: MarkerPort,
    #[cfg(test)]
    pub hooks: super::Hooks,
}

pub(crate) struct PublisherState {
    args: Arc<PublisherArgs>,
    rng: rand::rngs::StdRng,
}

impl Actor for Publisher {
    type Msg = PublisherMsg;
    type State = PublisherState;
    type Arguments = Arc<PublisherArgs>;

    async fn pre_start(
        &self,
        _myself: ActorRef<PublisherMsg>,
        args: Arc<PublisherArgs>,
    ) -> Result<PublisherState, ActorProcessingErr> {
        use rand::SeedableRng;
        Ok(PublisherState {
            args,
            rng: rand::rngs::StdRng::from_os_rng(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<PublisherMsg>,
        msg: PublisherMsg,
        state: &mut PublisherState,
    ) -> Result<(), ActorProcessingErr> {
        let PublisherMsg::Publish {
            route,
            rows,
            leases,
        } = msg;
        let args = Arc::clone(&state.args);
        #[cfg(test)]
        if let Some(panics_on) = &args.hooks.publisher_panics_on {
            if let Some(row) = rows.iter().find(|r| panics_on(r)) {
                panic!("injected publisher fault on row {}", row.id);
            }
        }
        // A row that waited here past its lease may already be another claim's,
        // and a row of a shard this replica no longer holds is the new owner's:
        // publishing it now would only make a duplicate whose mark is refused
        // (and, for an ordered key, could reach the destination after a later
        // event). Drop it; its new claim (or the next) delivers it.
        let (rows, leases) = drop_expired(&args, rows, leases);
        if rows.is_empty() {
            return Ok(());
        }
        let route = &args.router.routes()[route];
        let (rows, leases) = settle_unanswered(&args, route, rows, leases);
        if rows.is_empty() {
            return Ok(());
        }
        let breaker = args.sinks.breakers.route(route.index);
        let (outcomes, paused) = match breaker.admit(Instant::now()) {
            Admit::Send => {
                let outcomes = args.sinks.deliver(route, &rows).await;
                let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
                let paused = breaker.record(breaker::health(&outcomes), &ids, Instant::now());
                (Some(outcomes), paused)
            }
            Admit::Paused { until, error } => (None, Some((until, error))),
        };
        let mut outcomes = outcomes.map(Vec::into_iter);
        let marked = rows
            .iter()
            .zip(leases)
            .map(|(row, lease)| {
                let outcome = outcomes.as_mut().and_then(Iterator::next);
                Marked {
                    mark: decide(
                        &args.retry,
                        route.config.callback_hold(),
                        row,
                        &lease,
                        outcome,
                        &paused,
                        &mut state.rng,
                    ),
                    route: Some(route.index),
                    lease,
                }
            })
            .collect();
        args.marker.send(marked);
        Ok(())
    }
}

/// Keeps the rows whose lease outlasts a whole request started now, so no row
/// is ever being published after another claim may have taken it, and whose
/// shard this replica still holds (and is not handing over) under the token
/// they were claimed with. The others are not sent: their leases are given
/// back so the claim does not count as an attempt and the next claim (here
/// or at the shard's next owner) takes them at once. (A release the database
/// refuses, because the lease or the shard moved on, changes nothing.)
fn drop_expired(
    args: &PublisherArgs,
    rows: Vec<OutboxRow>,
    leases: Vec<Lease>,
) -> (Vec<OutboxRow>, Vec<Lease>) {
    let cutoff = std::time::Instant::now() + args.request_timeout;
    let ownership = &args.ownership;
    let keep = |lease: &Lease| lease.expires > cutoff && ownership.holds(lease.fence());
    if leases.iter().all(keep) {
        return (rows, leases);
    }
    let (kept, dropped): (Vec<_>, Vec<_>) = rows
        .into_iter()
        .zip(leases)
        .partition(|(_, lease)| keep(lease));
    let not_ours = dropped
        .iter()
        .filter(|(_, l)| !ownership.holds(l.fence()))
        .count();
    if not_ours > 0 {
        tracing::info!(
            rows = not_ours,
            "rows of a shard this replica no longer holds or is handing over; not sent (the next owner delivers them)"
        );
    }
    if dropped.len() > not_ours {
        tracing::warn!(
            rows = dropped.len() - not_ours,
            "rows waited for a publisher longer than their lease; skipped (raise relay.lease or lower relay.max_in_flight)"
        );
    }
    let released: Vec<Marked> = dropped
        .into_iter()
        .map(|(_, lease)| Marked {
            lease,
            mark: Mark::Release,
            route: None,
        })
        .collect();
    args.marker.send(released);
    kept.into_iter().unzip()
}

/// Rows of an ordered QStash route whose last hold ran out with no callback
/// after QStash took the attempt numbered `relay.max_attempts`: dead-lettered
/// here, without sending them again. Dead-lettering when QStash takes that
/// last copy instead would let the key's next event overtake it.
fn settle_unanswered(
    args: &PublisherArgs,
    route: &crate::routes::Route,
    rows: Vec<OutboxRow>,
    leases: Vec<Lease>,
) -> (Vec<OutboxRow>, Vec<Lease>) {
    let Some(hold) = route.config.callback_hold() else {
        return (rows, leases);
    };
    let max = args.retry.max_attempts;
    let unanswered = |lease: &Lease| lease.held_before && lease.attempt() as u32 > max;
    if !leases.iter().any(unanswered) {
        return (rows, leases);
    }
    let (settled, kept): (Vec<_>, Vec<_>) = rows
        .into_iter()
        .zip(leases)
        .partition(|(_, lease)| unanswered(lease));
    let error = format!(
        "no callback reported the destination's answer within {} of QStash taking attempt {max} of {max} (check routes[].callback and server.callback_bind)",
        humantime::format_duration(hold)
    );
    let marked = settled
        .into_iter()
        .map(|(row, lease)| Marked {
            mark: dead(&row, DeadReason::Unanswered, error.clone()),
            route: Some(route.index),
            lease,
        })
        .collect();
    args.marker.send(marked);
    kept.into_iter().unzip()
}

/// Turns a sink's outcome into what the marker writes: a retry on the last
/// allowed attempt dead-letters instead; while the route is paused (`paused`:
/// until when, and why) a row that was not sent, or failed with the sink
/// rather than for itself, is deferred without counting the attempt.
/// (Counting happens in the marker, for the rows whose mark the database took.)
#[allow(clippy::too_many_arguments)]
fn decide(
    retry: &RetryPolicy,
    hold: Option<Duration>,
    row: &OutboxRow,
    lease: &Lease,
    outcome: Option<Outcome>,
    paused: &Option<(Instant, String)>,
    rng: &mut impl rand::Rng,
) -> Mark {
    let outcome = match (outcome, paused) {
        (Some(o @ (Outcome::Published | Outcome::Dead { .. })), _) => o,
        (
            Some(
                o @ Outcome::Retry {
                    reason: RetryReason::BatchElement,
                    ..
                },
            ),
            _,
        ) => o,
        (Some(o), None) => o,
        (_, Some((until, error))) => {
            // Spread the rows over a tenth of the pause, so they do not all
            // come back in one burst.
            let wait = until.saturating_duration_since(Instant::now());
            let spread = rng.random_range(0..=(wait.as_millis() as u64 / 10).max(1));
            return Mark::Defer {
                delay: wait + Duration::from_millis(spread),
                error: error.clone(),
            };
        }
        // Not sent and not paused: cannot happen; give the lease back.
        (None, None) => return Mark::Release,
    };
    match (outcome, hold) {
        // An ordered QStash route: QStash took it, its callback will say what
        // the destination answered; the key waits until then, also after the
        // last attempt (a hold that runs out then is settled by
        // `settle_unanswered`, without sending again).
        (Outcome::Published, Some(hold)) => Mark::Hold { delay: hold },
        (Outcome::Published, None) => {
            if let Ok(age) = (chrono::Utc::now() - row.created_at).to_std() {
                m::record_commit_to_ack(age);
            }
            Mark::Published
        }
        (
            Outcome::Retry {
                after,
                reason,
                error,
            },
            _,
        ) => {
            let max = retry.max_attempts;
            let attempt = lease.attempt();
            if attempt as u32 >= max {
                let error = format!("attempt {attempt} of {max} failed: {error}");
                dead(row, DeadReason::Exhausted, error)
            } else {
                let delay = retry.backoff.next(attempt as u32, after, rng);
                tracing::debug!(id = row.id, attempt, ?delay, %error, "retry");
                Mark::Retry {
                    delay,
                    reason,
                    error,
                }
            }
        }
        (Outcome::Dead { reason, error }, _) => dead(row, reason, error),
    }
}

fn dead(row: &OutboxRow, reason: DeadReason, error: String) -> Mark {
    tracing::warn!(id = row.id, event_type = %row.event_type, reason = reason.as_str(), %error, "dead letter");
    Mark::Dead { reason, error }
}
