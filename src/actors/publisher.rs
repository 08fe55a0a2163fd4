//! Publisher: one of a pool sharing the HTTP client. Delivers a job (rows of
//! one route) through its sink and sends one outcome per row to the marker:
//! published, retry after a jittered backoff, or dead. A job comes in its
//! mailbox, or with tenant fairness from the claimers' queue
//! ([`JobQueue`]), where the tenants' jobs take turns.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::claim_plan::TenantWeights;
use super::inflight::Lease;
use super::job_queue::{Job, JobQueue};
use super::marker::{DeferCause, Mark, Marked, MarkerPort};
use super::ownership::Ownership;
use crate::metrics as m;
use crate::routes::{RetryPolicy, Router};
use crate::sink::breaker::witness::Verdict;
use crate::sink::breaker::{Admit, Breaker};
use crate::sink::limits::{Admission, Ticket};
use crate::sink::{DeadReason, Outcome, RetryReason, Sinks};
use crate::telemetry::Telemetry;
use outbox_client::row::OutboxRow;

#[derive(Debug)]
pub(crate) enum PublisherMsg {
    /// Deliver this job (without tenant fairness: each job goes to one
    /// publisher's mailbox, round robin).
    Publish(Job),
    /// A job is queued (tenant fairness): take the next one ([`JobQueue`]),
    /// if another publisher has not.
    Next,
}

/// The pool of publishers, round robin, and with tenant fairness the queue
/// of jobs they take from; the supervisor puts each new publisher in its
/// place.
#[derive(Clone)]
pub(crate) struct Publishers(Arc<PublishersInner>);

struct PublishersInner {
    slots: RwLock<Vec<Option<ActorRef<PublisherMsg>>>>,
    next: AtomicUsize,
    /// With tenant fairness: the tenants' jobs, taking turns.
    jobs: Option<Arc<JobQueue>>,
}

impl Publishers {
    /// `n` publishers; `tenants`: the tenants' weights when their jobs
    /// take turns (tenant fairness).
    pub(crate) fn new(n: usize, tenants: Option<Arc<TenantWeights>>) -> Publishers {
        Publishers(Arc::new(PublishersInner {
            slots: RwLock::new(vec![None; n]),
            next: AtomicUsize::new(0),
            jobs: tenants.map(|t| Arc::new(JobQueue::new(t))),
        }))
    }

    /// Hands `job` out. Without fairness, to the next publisher's mailbox
    /// (with every publisher restarting, or the one picked gone, its leases
    /// are dropped here, so the rows leave the in-flight set and the next
    /// claim reads them again). With fairness, queued behind its tenant's
    /// other jobs, a publisher told, round robin; the first one free takes
    /// the next job in the tenants' turn (a publisher gone meanwhile: the
    /// others take it, each looking again after every job while some are
    /// queued, and a restarted one as it starts).
    pub(crate) fn send(&self, job: Job) {
        let publisher = self.next();
        match &self.0.jobs {
            Some(jobs) => {
                jobs.push(job);
                if let Some(publisher) = publisher {
                    let _ = publisher.cast(PublisherMsg::Next);
                }
            }
            None => {
                let Some(publisher) = publisher else {
                    tracing::warn!(
                        rows = job.rows.len(),
                        "no publisher available; rows not sent (the next claim reads them again)"
                    );
                    return;
                };
                if let Err(e) = publisher.cast(PublisherMsg::Publish(job)) {
                    tracing::warn!(error = %e, "publisher gone; rows not sent (the next claim reads them again)");
                }
            }
        }
    }

    /// The queue the publishers take their jobs from, with tenant fairness.
    pub(crate) fn jobs(&self) -> Option<Arc<JobQueue>> {
        self.0.jobs.clone()
    }

    /// The next live publisher, round robin.
    fn next(&self) -> Option<ActorRef<PublisherMsg>> {
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

pub(crate) struct Publisher;

pub(crate) struct PublisherArgs {
    pub sinks: Arc<Sinks>,
    pub router: Arc<Router>,
    /// Each route's, by route index.
    pub retry: Vec<RetryPolicy>,
    pub ownership: Arc<Ownership>,
    /// A row is sent only when its lease outlasts a whole request.
    pub request_timeout: Duration,
    pub marker: MarkerPort,
    /// With tenant fairness, where the claimers' jobs wait for a free
    /// publisher.
    pub jobs: Option<Arc<JobQueue>>,
    /// Delivery spans, when `[telemetry]` exports them.
    pub telemetry: Telemetry,
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

    async fn post_start(
        &self,
        myself: ActorRef<PublisherMsg>,
        state: &mut PublisherState,
    ) -> Result<(), ActorProcessingErr> {
        if state.args.jobs.is_some() {
            // Jobs may be queued whose word went to a publisher that crashed.
            myself.cast(PublisherMsg::Next)?;
        }
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<PublisherMsg>,
        msg: PublisherMsg,
        state: &mut PublisherState,
    ) -> Result<(), ActorProcessingErr> {
        let job = match msg {
            PublisherMsg::Publish(job) => job,
            PublisherMsg::Next => {
                let Some(job) = state.args.jobs.as_ref().and_then(|q| q.pop()) else {
                    return Ok(());
                };
                job
            }
        };
        publish(state, job).await;
        if state.args.jobs.as_ref().is_some_and(|q| !q.is_empty()) {
            // Every queued job has had its word sent, but a publisher that
            // crashed took its words with it: look again after each job.
            myself.cast(PublisherMsg::Next)?;
        }
        Ok(())
    }
}

/// Delivers one job and hands its outcomes to the marker.
async fn publish(state: &mut PublisherState, job: Job) {
    let Job {
        route,
        rows,
        leases,
    } = job;
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
        return;
    }
    let route = &args.router.routes()[route];
    let (rows, leases) = settle_unanswered(&args, route, rows, leases);
    // One instant for the limits and the breaker: the limits pass over a
    // route the breaker holds, and only then.
    let now = Instant::now();
    let (mut rows, leases, tickets) = defer_limited(&args, route, rows, leases, now);
    if rows.is_empty() {
        return;
    }
    let spans = args.telemetry.start_deliveries(&route.name, &mut rows);
    let breaker = args.sinks.breakers.route(route.index);
    let sent = Instant::now();
    let (outcomes, paused) = match breaker.admit(now) {
        Admit::Send => {
            let outcomes = args.sinks.deliver(route, &rows, tickets).await;
            args.sinks.limits.record(route, &rows, &outcomes);
            let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
            let paused = breaker.record(&outcomes, &ids, sent, Instant::now());
            (Some(outcomes), paused)
        }
        Admit::Paused { until, error } => (None, Some((until, error))),
    };
    if let Some(spans) = spans {
        spans.end(outcomes.as_deref());
    }
    let mut outcomes = outcomes.map(Vec::into_iter);
    let marked: Vec<Marked> = rows
        .iter()
        .zip(leases)
        .map(|(row, lease)| {
            let outcome = outcomes.as_mut().and_then(Iterator::next);
            Marked {
                mark: decide(
                    &args.retry[route.index],
                    route.config.callback_hold(),
                    row,
                    &lease,
                    outcome,
                    &Judge {
                        breaker,
                        sent,
                        paused: &paused,
                    },
                    &mut state.rng,
                ),
                route: Some(route.index),
                lease,
            }
        })
        .collect();
    log_unwitnessed(&route.name, &marked);
    args.marker.send(marked);
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
/// after QStash took the route's last attempt (`max_attempts`): dead-lettered
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
    let max = args.retry[route.index].max_attempts;
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

/// Rows a webhook route's or its host's limits do not let go now
/// ([`crate::sink::limits`]): deferred here without spending an attempt,
/// each until its promised slot. The others come back with their tickets;
/// one whose slot is so late that its lease would not outlast the request
/// is given back unsent (as [`drop_expired`] does). A paused route's rows
/// are left to the breaker (taking slots for them would waste them).
fn defer_limited(
    args: &PublisherArgs,
    route: &crate::routes::Route,
    rows: Vec<OutboxRow>,
    leases: Vec<Lease>,
    now: Instant,
) -> (Vec<OutboxRow>, Vec<Lease>, Vec<Ticket>) {
    let paused = args.sinks.breakers.route(route.index).paused_until(now);
    if paused.is_some() {
        let tickets = rows.iter().map(|_| Ticket::now()).collect();
        return (rows, leases, tickets);
    }
    let admissions = args.sinks.limits.admit(route, &rows, now);
    let mut kept = (Vec::new(), Vec::new(), Vec::new());
    let mut put_back = Vec::new();
    for ((row, lease), admission) in rows.into_iter().zip(leases).zip(admissions) {
        let mark = match admission {
            Admission::Go(mut ticket) if lease.expires > ticket.at + args.request_timeout => {
                // A row queued for a request slot goes only while its
                // lease outlasts the request.
                ticket.by = Some(lease.expires - args.request_timeout);
                kept.0.push(row);
                kept.1.push(lease);
                kept.2.push(ticket);
                continue;
            }
            Admission::Go(_) => Mark::Release,
            Admission::Wait { delay, error } => Mark::Defer {
                delay,
                error,
                cause: DeferCause::Limited,
            },
        };
        put_back.push(Marked {
            mark,
            route: Some(route.index),
            lease,
        });
    }
    if !put_back.is_empty() {
        tracing::debug!(route = %route.name, rows = put_back.len(), "rows deferred by the route's limits");
        args.marker.send(put_back);
    }
    kept
}

/// What `decide` asks about the route: whether it is paused (until when,
/// and why), and whether a final verdict in the answer to the request sent
/// at `sent` has a witness.
struct Judge<'a> {
    breaker: &'a Breaker,
    sent: Instant,
    paused: &'a Option<(Instant, String)>,
}

/// Turns a sink's outcome into what the marker writes: a retry on the last
/// allowed attempt dead-letters instead; while the route is paused a row
/// that was not sent, or failed with the sink rather than for itself, is
/// deferred without counting the attempt; a final verdict (a rejection, the
/// last attempt failing) is carried out only when the route accepted another
/// message since the row first failed, else deferred too.
/// (Counting happens in the marker, for the rows whose mark the database took.)
fn decide(
    retry: &RetryPolicy,
    hold: Option<Duration>,
    row: &OutboxRow,
    lease: &Lease,
    outcome: Option<Outcome>,
    judge: &Judge<'_>,
    rng: &mut impl rand::Rng,
) -> Mark {
    let outcome = match (outcome, judge.paused) {
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
            return Mark::Defer {
                delay: spread(until.saturating_duration_since(Instant::now()), rng),
                error: error.clone(),
                cause: DeferCause::Paused,
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
                final_verdict(judge, row, DeadReason::Exhausted, error, rng)
            } else {
                let delay = retry.next(attempt as u32, after, rng);
                tracing::debug!(id = row.id, attempt, ?delay, %error, "retry");
                Mark::Retry {
                    delay,
                    reason,
                    error,
                }
            }
        }
        (Outcome::Dead { reason, error }, _) if reason.reached_sink() => {
            final_verdict(judge, row, reason, error, rng)
        }
        (Outcome::Dead { reason, error }, _) => dead(row, reason, error),
    }
}

/// A verdict the destination's answers reached: dead-lettered when it has a
/// witness (the route accepted another message since this row first
/// failed); otherwise the route itself may be failing (a redeploy's 404s, a
/// wrong path, an outage), and the row is deferred, its attempt not counted.
fn final_verdict(
    judge: &Judge<'_>,
    row: &OutboxRow,
    reason: DeadReason,
    error: String,
    rng: &mut impl rand::Rng,
) -> Mark {
    let now = Instant::now();
    match judge.breaker.verdict(row.id, judge.sent, now) {
        Verdict::Carry => dead(row, reason, error),
        Verdict::Defer { delay } => {
            let paused = judge
                .paused
                .as_ref()
                .map(|(until, _)| until.saturating_duration_since(now))
                .unwrap_or_default();
            Mark::Defer {
                delay: spread(delay.max(paused), rng),
                error: crate::sink::truncate(
                    format!(
                        "{error} (not dead-lettered: the route accepted no other message since this one first failed)"
                    ),
                    crate::sink::MAX_ERROR_CHARS,
                ),
                cause: DeferCause::NoWitness,
            }
        }
    }
}

/// `wait` and up to a tenth more, so that deferred rows do not all come back
/// in one burst.
fn spread(wait: Duration, rng: &mut impl rand::Rng) -> Duration {
    let extra = rng.random_range(0..=(wait.as_millis() as u64 / 10).max(1));
    wait + Duration::from_millis(extra)
}

/// One line per delivery whose verdicts wait for a witness, naming the
/// route and what the destination answered.
fn log_unwitnessed(route: &str, marked: &[Marked]) {
    let mut deferred = marked.iter().filter_map(|m| match &m.mark {
        Mark::Defer {
            error,
            cause: DeferCause::NoWitness,
            ..
        } => Some(error),
        _ => None,
    });
    if let Some(error) = deferred.next() {
        tracing::warn!(
            route,
            rows = 1 + deferred.count(),
            %error,
            "verdicts deferred: the route accepted no other message since these rows first failed, so the route is failing rather than the messages; they are sent again later without spending attempts"
        );
    }
}

fn dead(row: &OutboxRow, reason: DeadReason, error: String) -> Mark {
    tracing::warn!(id = row.id, event_type = %row.event_type, reason = reason.as_str(), %error, "dead letter");
    Mark::Dead { reason, error }
}
