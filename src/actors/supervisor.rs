//! Supervisor: owns the tree. Spawns every child linked, restarts a failed
//! child with the same arguments after a backoff (ractor restarts nothing by
//! itself), counts restarts, and gives up when a child exhausts its restart
//! budget. Claimers run for the shards the coordinator holds: it starts and
//! stops them through [`Claimers`], and the supervisor restarts one that
//! crashed while its shard is still held. Shutdown runs here: the tenures are
//! wound down ([`Winddown::all`]), then the shard leases are given back.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

use super::claimer::Claimers;
use super::coordinator::{Coordinator, CoordinatorArgs, CoordinatorMsg};
use super::listener::{Listener, ListenerArgs};
use super::marker::{Marker, MarkerArgs, MarkerPort, FLUSH_TIMEOUT};
use super::publisher::{Publisher, PublisherArgs, Publishers};
use super::winddown::Winddown;
use super::{Counters, CountersSnapshot};
use crate::metrics as m;
use crate::store::ShardId;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Child {
    Marker,
    Publisher(usize),
    Claimer(ShardId),
    Listener,
    Coordinator,
}

impl Child {
    /// Every [`Child::label`]: the `actor` label values of the restarts metric.
    pub(crate) const LABELS: [&'static str; 5] =
        ["marker", "publisher", "claimer", "listener", "coordinator"];

    pub(crate) fn label(&self) -> &'static str {
        match self {
            Child::Marker => "marker",
            Child::Publisher(_) => "publisher",
            Child::Claimer(_) => "claimer",
            Child::Listener => "listener",
            Child::Coordinator => "coordinator",
        }
    }
}

pub(crate) enum SupervisorMsg {
    Respawn(Child),
    Shutdown(RpcReplyPort<ShutdownReport>),
    /// How many times each kind of child was restarted.
    Restarts(RpcReplyPort<HashMap<&'static str, u64>>),
}

/// What shutdown did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ShutdownReport {
    /// Rows still in flight when the grace period ended.
    pub in_flight_at_deadline: usize,
    /// Of those, rows left for the next claim to read again (no lease holds
    /// them: another replica takes them as soon as it holds their shard).
    pub released: u64,
    pub counters: CountersSnapshot,
}

/// How often a child may fail before the relay gives up.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RestartBudget {
    /// Restarts allowed within `window`...
    pub max: u32,
    pub window: Duration,
}

/// Everything the tree is made of: each child's arguments (cloned for each
/// start) and the handles that point at the live children.
pub(crate) struct SupervisorArgs {
    pub marker: MarkerArgs,
    pub marker_port: MarkerPort,
    pub publisher: Arc<PublisherArgs>,
    pub publishers: Publishers,
    pub publisher_count: usize,
    pub listener: ListenerArgs,
    pub coordinator: CoordinatorArgs,
    pub claimers: Claimers,
    pub winddown: Winddown,
    pub budget: RestartBudget,
    /// On shutdown, in-flight publishes get this long to finish (at least
    /// until every request has ended).
    pub shutdown_grace: Duration,
    pub counters: Arc<Counters>,
}

pub(crate) struct Supervisor;

pub(crate) struct SupervisorState {
    args: SupervisorArgs,
    children: HashMap<ActorId, Child>,
    coordinator: Option<ActorRef<CoordinatorMsg>>,
    recent: HashMap<Child, VecDeque<Instant>>,
    restarts: HashMap<&'static str, u64>,
    stopping: bool,
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        args: SupervisorArgs,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let retry = {
            let myself = myself.clone();
            Arc::new(move |shard| {
                myself.send_after(Duration::from_millis(100), move || {
                    SupervisorMsg::Respawn(Child::Claimer(shard))
                });
            })
        };
        args.claimers.attach(myself.get_cell(), retry);
        let mut state = SupervisorState {
            children: HashMap::new(),
            coordinator: None,
            recent: HashMap::new(),
            restarts: HashMap::new(),
            stopping: false,
            args,
        };
        let mut all = vec![Child::Marker];
        all.extend((0..state.args.publisher_count).map(Child::Publisher));
        all.push(Child::Listener);
        // Claimers start as the coordinator takes shards.
        all.push(Child::Coordinator);
        for child in all {
            if let Err(e) = spawn(&myself, &mut state, child).await {
                // Not fatal: try again shortly.
                tracing::warn!(actor = child.label(), error = %e, "could not start; retrying");
                myself.send_after(Duration::from_millis(100), move || {
                    SupervisorMsg::Respawn(child)
                });
            }
        }
        Ok(state)
    }

    async fn handle(
        &self,
        myself: ActorRef<SupervisorMsg>,
        msg: SupervisorMsg,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Respawn(child) => {
                if state.stopping {
                    return Ok(());
                }
                match spawn(&myself, state, child).await {
                    Ok(()) => tracing::info!(actor = child.label(), "restarted"),
                    Err(e) => {
                        let delay = restart_delay(state.recent.get(&child).map_or(0, |r| r.len()));
                        tracing::warn!(actor = child.label(), error = %e, retry_in = ?delay, "restart failed; retrying");
                        myself.send_after(delay, move || SupervisorMsg::Respawn(child));
                    }
                }
            }
            SupervisorMsg::Shutdown(reply) => {
                state.stopping = true;
                let report = shutdown(state).await;
                // Whatever still runs stops before the reply (the listener,
                // whose wake handle reaches the claimers and through them the
                // pool): a relay shut down leaves no task or connection behind.
                myself
                    .stop_children_and_wait(Some("shutdown".into()), Some(Duration::from_secs(5)))
                    .await;
                let _ = reply.send(report);
                myself.stop(Some("shutdown".into()));
            }
            SupervisorMsg::Restarts(reply) => {
                let _ = reply.send(state.restarts.clone());
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupervisorMsg>,
        event: SupervisionEvent,
        state: &mut SupervisorState,
    ) -> Result<(), ActorProcessingErr> {
        let (id, why) = match event {
            SupervisionEvent::ActorFailed(cell, err) => (cell.get_id(), err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => (
                cell.get_id(),
                reason.unwrap_or_else(|| "stopped".to_owned()),
            ),
            _ => return Ok(()),
        };
        let child = match state.children.remove(&id) {
            Some(child) => child,
            None => match state.args.claimers.shard_of(id) {
                // A claimer that stopped by itself or crashed (the ones the
                // coordinator stops leave the claimers' table first).
                Some(shard) => Child::Claimer(shard),
                None => return Ok(()),
            },
        };
        forget(state, child);
        if state.stopping {
            return Ok(());
        }
        tracing::error!(actor = child.label(), reason = %why, "actor died; its rows' leases will expire");
        debug_assert!(Child::LABELS.contains(&child.label()));
        m::count_actor_restart(child.label());
        *state.restarts.entry(child.label()).or_default() += 1;
        let budget = state.args.budget;
        let recent = state.recent.entry(child).or_default();
        let now = Instant::now();
        recent.push_back(now);
        while recent
            .front()
            .is_some_and(|t| now.duration_since(*t) > budget.window)
        {
            recent.pop_front();
        }
        if recent.len() > budget.max as usize {
            let reason = format!(
                "{} restarted {} times within {:?}: giving up",
                child.label(),
                recent.len(),
                budget.window
            );
            tracing::error!("{reason}");
            myself.stop(Some(reason));
            return Ok(());
        }
        let delay = restart_delay(recent.len());
        myself.send_after(delay, move || SupervisorMsg::Respawn(child));
        Ok(())
    }
}

/// 50 ms, doubling with each recent restart, at most 5 s: a crash loop is
/// visible and bounded instead of spinning.
fn restart_delay(recent: usize) -> Duration {
    Duration::from_millis((50u64 << recent.min(7)).min(5_000))
}

async fn spawn(
    myself: &ActorRef<SupervisorMsg>,
    state: &mut SupervisorState,
    child: Child,
) -> Result<(), ractor::SpawnErr> {
    let cell = myself.get_cell();
    let args = &state.args;
    let id = match child {
        Child::Marker => {
            let (actor, _) = Actor::spawn_linked(None, Marker, args.marker.clone(), cell).await?;
            args.marker_port.slot().set(Some(actor.clone()));
            actor.get_id()
        }
        Child::Publisher(i) => {
            let (actor, _) =
                Actor::spawn_linked(None, Publisher, Arc::clone(&args.publisher), cell).await?;
            args.publishers.set(i, Some(actor.clone()));
            actor.get_id()
        }
        Child::Claimer(shard) => {
            // Only if its shard is still held; the claimers' table knows it.
            args.claimers.respawn(shard).await;
            return Ok(());
        }
        Child::Listener => {
            let (actor, _) =
                Actor::spawn_linked(None, Listener, args.listener.clone(), cell).await?;
            actor.get_id()
        }
        Child::Coordinator => {
            let (actor, _) =
                Actor::spawn_linked(None, Coordinator, args.coordinator.clone(), cell).await?;
            state.coordinator = Some(actor.clone());
            actor.get_id()
        }
    };
    state.children.insert(id, child);
    Ok(())
}

fn forget(state: &mut SupervisorState, child: Child) {
    match child {
        Child::Marker => state.args.marker_port.slot().set(None),
        Child::Publisher(i) => state.args.publishers.set(i, None),
        Child::Claimer(shard) => state.args.claimers.died(shard),
        Child::Listener => {}
        Child::Coordinator => state.coordinator = None,
    }
}

async fn shutdown(state: &mut SupervisorState) -> ShutdownReport {
    // 0. Take no more shards (leases keep being renewed until step 2).
    let coordinator = state.coordinator.clone();
    if let Some(c) = &coordinator {
        let _ = c.cast(CoordinatorMsg::Stopping);
    }
    // 1. Stop claiming; no request starts from here (rows not yet sent are
    //    put back); the ones under way and their marks get the grace period,
    //    and at least until every request has ended, so no row is released
    //    (and taken by another replica) while its request may still reach the
    //    destination; what was answered is written, the rest released.
    let wound = state.args.winddown.all(state.args.shutdown_grace).await;
    // 2. Give the shard leases back: the other replicas take them at once.
    if let Some(c) = &coordinator {
        let _ = c.call(CoordinatorMsg::Leave, Some(FLUSH_TIMEOUT)).await;
        let _ = c
            .stop_and_wait(Some("shutdown".into()), Some(Duration::from_secs(5)))
            .await;
    }
    // 3. Everything else. Publishers still waiting on a destination are cut off:
    //    their rows were released above.
    for publisher in state.args.publishers.all() {
        publisher.kill();
    }
    if let Some(marker) = state.args.marker_port.slot().get() {
        let _ = marker
            .stop_and_wait(Some("shutdown".into()), Some(Duration::from_secs(5)))
            .await;
    }
    ShutdownReport {
        in_flight_at_deadline: wound.in_flight_at_deadline,
        released: wound.in_flight_at_deadline as u64,
        counters: state.args.counters.snapshot(),
    }
}
