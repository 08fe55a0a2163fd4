//! Claimer: one per shard this replica holds. Claims a batch of ready rows
//! under a lease in one statement (no transaction held across the network),
//! hands them to the publishers, and claims again at once while batches come
//! back full; otherwise it waits for the listener's wake-up or its poll
//! ([`super::poll`]: backing off while claims find nothing, never past a
//! time a row the marker wrote comes due). It never has more rows out than
//! the in-flight permits allow (backpressure).
//!
//! [`Claimers`] is how the rest of the tree drives them: the coordinator
//! starts and stops the claimer of a shard as it takes or hands over the
//! shard, the listener and the marker wake them, the supervisor restarts one
//! that crashed.

use std::collections::HashMap;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};

use metrics::{counter, histogram};
use ractor::{Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef};

use super::claim_plan::{ClaimPlan, ClaimRoutes, Fairness};
use super::inflight::{InFlight, Lease};
use super::job_queue::Job;
use super::marker::{Mark, Marked, MarkerPort};
use super::poll::PollSchedule;
use super::publisher::Publishers;
use super::Counters;
use crate::metrics as m;
use crate::routes::Router;
use crate::sink::breaker::Breakers;
use crate::sink::DeadReason;
use crate::store::{Fence, Session, ShardId, Store};
use outbox_client::row::OutboxRow;
use uuid::Uuid;

/// How long a wake-up waits before claiming, to gather a burst of inserts.
const WAKE_COALESCE: Duration = Duration::from_millis(1);

/// How often a claimer whose last claim tenants' rooms cut short looks
/// whether one of them has room again (in memory; no statement).
const ROOM_CHECK: Duration = Duration::from_millis(10);

#[derive(Debug)]
pub(crate) enum ClaimerMsg {
    /// Claim now.
    Claim,
    /// New rows may be ready (the listener saw the id sequence move).
    Wake,
    /// The poll's wait passed since the last idle claim.
    Tick(u64),
    /// A row of the shard comes due then (a retry, a deferral or a hold the
    /// marker wrote): an idle claimer claims no later.
    DueAt(Instant),
}

/// How claims are made.
#[derive(Debug, Clone)]
pub(crate) struct ClaimSettings {
    /// Rows one claim takes at most (`relay.claim_batch`).
    pub batch: usize,
    /// How long a claimed row is ours (`relay.lease`).
    pub lease: Duration,
    /// Claim at least this often without a wake-up (`relay.poll_interval`)...
    pub poll_interval: Duration,
    /// ...backing off to this while claims find nothing (`relay.idle_poll_max`).
    pub idle_poll_max: Duration,
    /// Which rows each kind of claim takes.
    pub routes: Arc<ClaimRoutes>,
    /// Rows per publisher job (`qstash.batch_size`).
    pub job_rows: usize,
    /// The tenants' weights and paces when the plain claim is shared
    /// between tenants (`relay.tenant_fairness`); `None`: it is not.
    pub tenants: Option<Fairness>,
}

/// What every claimer works with, whatever its shard.
#[derive(Clone)]
pub(crate) struct ClaimerContext {
    pub store: Store,
    pub settings: ClaimSettings,
    pub in_flight: Arc<InFlight>,
    pub breakers: Arc<Breakers>,
    pub router: Arc<Router>,
    pub publishers: Publishers,
    pub marker: MarkerPort,
    pub counters: Arc<Counters>,
}

pub(crate) struct Claimer;

pub(crate) struct ClaimerArgs {
    /// The shard and this replica's tenure of it.
    pub fence: Fence,
    /// The first claim waits until then (the shard was not handed over
    /// cleanly: a request of its last owner may still be in the air).
    pub not_before: Option<Instant>,
    pub cx: ClaimerContext,
}

pub(crate) struct ClaimerState {
    fence: Fence,
    cx: ClaimerContext,
    session: Session,
    /// What to read next: the cursors, the ordered routes' heads.
    plan: ClaimPlan,
    claim_queued: bool,
    idle_generation: u64,
    /// The listener said rows arrived since the last claim.
    woken: bool,
    /// When the last claim ran.
    last_claim: Instant,
    /// When the next poll is, while one waits (a `Tick` of `idle_generation`).
    next_poll: Option<Instant>,
    /// How long the next poll waits.
    poll: PollSchedule,
}

impl Actor for Claimer {
    type Msg = ClaimerMsg;
    type State = ClaimerState;
    type Arguments = ClaimerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<ClaimerMsg>,
        args: ClaimerArgs,
    ) -> Result<ClaimerState, ActorProcessingErr> {
        match args
            .not_before
            .map(|t| t.saturating_duration_since(Instant::now()))
        {
            Some(wait) if !wait.is_zero() => {
                tracing::info!(shard = %args.fence.shard, ?wait, "waiting for the shard's last owner's requests to end before claiming");
                myself.send_after(wait, || ClaimerMsg::Claim);
            }
            _ => myself.cast(ClaimerMsg::Claim)?,
        }
        Ok(ClaimerState {
            fence: args.fence,
            session: args.cx.store.session(),
            plan: ClaimPlan::new(
                Arc::clone(&args.cx.settings.routes),
                args.cx.settings.tenants.clone(),
                args.cx.settings.poll_interval,
            ),
            poll: PollSchedule::new(
                args.cx.settings.poll_interval,
                args.cx.settings.idle_poll_max,
            ),
            cx: args.cx,
            claim_queued: true,
            idle_generation: 0,
            woken: false,
            last_claim: Instant::now(),
            next_poll: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<ClaimerMsg>,
        msg: ClaimerMsg,
        state: &mut ClaimerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ClaimerMsg::Wake => {
                state.woken = true;
                // Producers commit in bursts: wait a moment so one
                // claim (and one request) carries the burst, not one row each.
                if !state.claim_queued {
                    state.claim_queued = true;
                    myself.send_after(WAKE_COALESCE, || ClaimerMsg::Claim);
                }
            }
            ClaimerMsg::Tick(generation) => {
                if generation == state.idle_generation {
                    queue_claim(&myself, state);
                }
            }
            ClaimerMsg::Claim => {
                state.claim_queued = false;
                claim_and_dispatch(&myself, state).await;
            }
            ClaimerMsg::DueAt(at) => {
                state.plan.due_at(at);
                let now = Instant::now();
                if state.poll.due_at(at) && state.next_poll.is_some_and(|next| at < next) {
                    claim_later(&myself, state, at.saturating_duration_since(now));
                }
            }
        }
        Ok(())
    }
}

fn queue_claim(myself: &ActorRef<ClaimerMsg>, state: &mut ClaimerState) {
    if !state.claim_queued {
        state.claim_queued = true;
        let _ = myself.cast(ClaimerMsg::Claim);
    }
}

fn claim_later(myself: &ActorRef<ClaimerMsg>, state: &mut ClaimerState, after: Duration) {
    state.next_poll = Some(Instant::now() + after);
    state.idle_generation += 1;
    let generation = state.idle_generation;
    myself.send_after(after, move || ClaimerMsg::Tick(generation));
}

async fn claim_and_dispatch(myself: &ActorRef<ClaimerMsg>, state: &mut ClaimerState) {
    let cx = state.cx.clone();
    state.next_poll = None;
    let now = Instant::now();
    if let Some(until) = cx.breakers.all_paused_until(now) {
        // Every route is paused: rows claimed now would only be put back.
        claim_later(myself, state, until - now);
        return;
    }
    // Held back by tenants' rooms (tenant fairness): wait for room, unless
    // new rows arrived (another tenant's, maybe) or a poll is due anyway
    // (rows that came due by time).
    // A claim of about a batch once there is room for one: a claim costs
    // about the same for a few rows as for a batch.
    let room_rows = cx.settings.batch.min(cx.in_flight.tenant_most() / 4).max(1);
    let woken = std::mem::take(&mut state.woken);
    if !woken
        && state.last_claim.elapsed() < cx.settings.poll_interval
        && state.plan.waits_for_room(&cx.in_flight, room_rows)
    {
        claim_later(myself, state, ROOM_CHECK);
        return;
    }
    let Some(mut permits) = cx.in_flight.permits(cx.settings.batch).await else {
        // Publishers are full: look again shortly (not a busy loop: we waited).
        queue_claim(myself, state);
        return;
    };
    let wanted = permits.count();
    let started = Instant::now();
    state.last_claim = started;
    // Measured before the statement: the database's lease ends no earlier.
    let expires = Instant::now() + cx.settings.lease;
    let rows = match state
        .plan
        .claim(
            &mut state.session,
            &cx.in_flight,
            state.fence,
            wanted as i64,
        )
        .await
    {
        Ok(rows) => {
            state.session.succeeded();
            rows
        }
        Err(e) => {
            let delay = state.session.failed();
            tracing::warn!(shard = %state.fence.shard, error = %e, retry_in = ?delay, "claim failed");
            claim_later(myself, state, delay);
            return;
        }
    };
    counter!(m::CLAIMS).increment(1);
    cx.counters.claims.fetch_add(1, AtomicOrdering::Relaxed);
    state.poll.claimed(started, rows.len(), woken);
    if !rows.is_empty() {
        // Idle polls would drown "rows per claim" in zeros.
        histogram!(m::BATCH_SIZE).record(rows.len() as f64);
    }
    cx.counters
        .claimed
        .fetch_add(rows.len() as u64, AtomicOrdering::Relaxed);
    tracing::debug!(shard = %state.fence.shard, claimed = rows.len(), wanted, "claim batch");
    let got = rows.len();
    let mut leased = Vec::with_capacity(got);
    for claimed in rows {
        let mut lease = permits.lease(
            claimed.held(state.fence),
            claimed.row.tenant_id,
            expires,
            &cx.in_flight,
        );
        lease.held_before = claimed.held_before;
        leased.push((claimed.row, lease));
    }
    drop(permits); // permits for rows we did not get go back
    cx.in_flight.set_gauge();
    dispatch(&cx, leased);
    if got == wanted {
        // Full: there is probably more right now.
        queue_claim(myself, state);
    } else if state.plan.waits_for_room(&cx.in_flight, room_rows) {
        claim_later(myself, state, ROOM_CHECK);
    } else {
        let wait = state.poll.wait(Instant::now());
        claim_later(myself, state, wait);
    }
}

/// Groups rows by route and sends publisher-sized jobs; rows no route takes
/// go straight to the marker as dead letters.
fn dispatch(cx: &ClaimerContext, leased: Vec<(OutboxRow, Lease)>) {
    // A job is rows of one route, and of one tenant when the tenants' jobs
    // take turns.
    let fair = cx.settings.tenants.is_some();
    let mut groups: HashMap<(usize, Uuid), (Vec<OutboxRow>, Vec<Lease>)> = HashMap::new();
    let mut unrouted = Vec::new();
    for (row, lease) in leased {
        match cx.router.route(&row.event_type) {
            Some(route) => {
                let tenant = if fair { row.tenant_id } else { Uuid::nil() };
                let g = groups.entry((route.index, tenant)).or_default();
                g.0.push(row);
                g.1.push(lease);
            }
            None => {
                let error = format!("no route matches event type `{}`", row.event_type);
                tracing::warn!(id = row.id, event_type = %row.event_type, "dead letter: no route");
                unrouted.push(Marked {
                    lease,
                    mark: Mark::Dead {
                        reason: DeadReason::NoRoute,
                        error,
                    },
                    route: None,
                });
            }
        }
    }
    if !unrouted.is_empty() {
        cx.marker.send(unrouted);
    }
    let chunk = cx.settings.job_rows.max(1);
    for ((route, _), (rows, leases)) in groups {
        let mut rows = rows.into_iter();
        let mut leases = leases.into_iter();
        loop {
            let part_rows: Vec<OutboxRow> = rows.by_ref().take(chunk).collect();
            if part_rows.is_empty() {
                break;
            }
            let part_leases: Vec<Lease> = leases.by_ref().take(part_rows.len()).collect();
            cx.publishers.send(Job {
                route,
                rows: part_rows,
                leases: part_leases,
            });
        }
    }
}

/// Asks for a shard's claimer to be started again a little later.
pub(crate) type RetryStart = Arc<dyn Fn(ShardId) + Send + Sync>;

/// The claimers of the shards this replica holds.
#[derive(Clone)]
pub(crate) struct Claimers(Arc<ClaimersInner>);

struct ClaimersInner {
    cx: ClaimerContext,
    /// The supervisor the claimers are linked to (set once it runs), and how
    /// to ask it to try a claimer that could not start again.
    supervisor: OnceLock<(ActorCell, RetryStart)>,
    /// Serialises starts and stops, which wait for actors.
    changing: tokio::sync::Mutex<()>,
    /// Each held shard's tenure and its claimer, when one runs.
    running: RwLock<HashMap<ShardId, Running>>,
}

#[derive(Clone)]
struct Running {
    token: i64,
    not_before: Option<Instant>,
    actor: Option<ActorRef<ClaimerMsg>>,
}

impl Claimers {
    pub(crate) fn new(cx: ClaimerContext) -> Claimers {
        Claimers(Arc::new(ClaimersInner {
            cx,
            supervisor: OnceLock::new(),
            changing: tokio::sync::Mutex::new(()),
            running: RwLock::new(HashMap::new()),
        }))
    }

    /// Links the claimers started from now on to `supervisor`; `retry` asks
    /// it to start a shard's claimer again a little later.
    pub(crate) fn attach(&self, supervisor: ActorCell, retry: RetryStart) {
        let _ = self.0.supervisor.set((supervisor, retry));
    }

    /// Runs a claimer for `fence` (stopping the one of an older tenure of the
    /// shard first), claiming from `not_before` on. When it cannot be started
    /// it is tried again shortly.
    pub(crate) async fn start(&self, fence: Fence, not_before: Option<Instant>) {
        let _changing = self.0.changing.lock().await;
        let old = self.0.running_mut().insert(
            fence.shard,
            Running {
                token: fence.token,
                not_before,
                actor: None,
            },
        );
        if let Some(actor) = old.and_then(|r| r.actor) {
            stop(actor).await;
        }
        self.spawn(fence).await;
    }

    /// Stops the claimer of `fence`'s tenure, if that is the one running, and
    /// waits for it; a newer tenure's claimer is left running.
    pub(crate) async fn stop(&self, fence: Fence) {
        let _changing = self.0.changing.lock().await;
        let actor = {
            let mut running = self.0.running_mut();
            match running.get(&fence.shard) {
                Some(r) if r.token == fence.token => {
                    running.remove(&fence.shard).and_then(|r| r.actor)
                }
                _ => None,
            }
        };
        if let Some(actor) = actor {
            stop(actor).await;
        }
    }

    /// Stops every claimer (shutdown).
    pub(crate) async fn stop_all(&self) {
        let _changing = self.0.changing.lock().await;
        let actors: Vec<_> = self
            .0
            .running_mut()
            .drain()
            .filter_map(|(_, r)| r.actor)
            .collect();
        for actor in actors {
            stop(actor).await;
        }
    }

    /// A row of `shard` comes due at `at`: its claimer polls no later.
    pub(crate) fn due_at(&self, shard: ShardId, at: Instant) {
        if let Some(actor) = self.0.running().get(&shard).and_then(|r| r.actor.as_ref()) {
            let _ = actor.cast(ClaimerMsg::DueAt(at));
        }
    }

    /// New rows may be ready.
    pub(crate) fn wake_all(&self) {
        for r in self.0.running().values() {
            if let Some(actor) = &r.actor {
                let _ = actor.cast(ClaimerMsg::Wake);
            }
        }
    }

    /// The shard whose claimer is `id`, if it is one of the claimers running.
    pub(crate) fn shard_of(&self, id: ActorId) -> Option<ShardId> {
        self.0
            .running()
            .iter()
            .find(|(_, r)| r.actor.as_ref().is_some_and(|a| a.get_id() == id))
            .map(|(s, _)| *s)
    }

    /// A claimer died: forget it (its shard stays wanted until stopped).
    pub(crate) fn died(&self, shard: ShardId) {
        if let Some(r) = self.0.running_mut().get_mut(&shard) {
            r.actor = None;
        }
    }

    /// Starts the shard's claimer again if the shard is still held and none runs.
    pub(crate) async fn respawn(&self, shard: ShardId) {
        let _changing = self.0.changing.lock().await;
        let token = {
            let running = self.0.running();
            match running.get(&shard) {
                Some(r) if r.actor.is_none() => r.token,
                _ => return,
            }
        };
        self.spawn(Fence { shard, token }).await;
    }

    /// When the claimer of `fence` may claim first.
    fn not_before(&self, fence: Fence) -> Option<Instant> {
        self.0
            .running()
            .get(&fence.shard)
            .filter(|r| r.token == fence.token)
            .and_then(|r| r.not_before)
    }

    /// Spawns the claimer of `fence` (its entry made by the caller, who holds
    /// `changing`); a failure is retried shortly.
    async fn spawn(&self, fence: Fence) {
        let Some((supervisor, retry)) = self.0.supervisor.get().cloned() else {
            tracing::warn!(shard = %fence.shard, "no supervisor to start the claimer under");
            return;
        };
        let args = ClaimerArgs {
            fence,
            not_before: self.not_before(fence),
            cx: self.0.cx.clone(),
        };
        match Actor::spawn_linked(None, Claimer, args, supervisor).await {
            Ok((actor, _)) => {
                let stopped_meanwhile = {
                    let mut running = self.0.running_mut();
                    match running
                        .get_mut(&fence.shard)
                        .filter(|r| r.token == fence.token)
                    {
                        Some(r) => {
                            r.actor = Some(actor);
                            None
                        }
                        None => Some(actor),
                    }
                };
                if let Some(actor) = stopped_meanwhile {
                    stop(actor).await;
                }
            }
            Err(e) => {
                tracing::warn!(shard = %fence.shard, error = %e, "could not start the claimer; retrying");
                retry(fence.shard);
            }
        }
    }
}

impl ClaimersInner {
    fn running(&self) -> std::sync::RwLockReadGuard<'_, HashMap<ShardId, Running>> {
        self.running.read().expect("claimers lock")
    }

    fn running_mut(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<ShardId, Running>> {
        self.running.write().expect("claimers lock")
    }
}

async fn stop(actor: ActorRef<ClaimerMsg>) {
    let _ = actor
        .stop_and_wait(
            Some("shard handed over".into()),
            Some(Duration::from_secs(5)),
        )
        .await;
}
