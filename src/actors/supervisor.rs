//! Supervisor: owns the tree. Spawns every child linked, restarts a failed
//! child with the same arguments after a backoff (ractor restarts nothing by
//! itself), counts restarts, and gives up when a child exhausts its restart
//! budget. Claimers run for the shards the coordinator holds: it asks for them
//! to be started and stopped. Shutdown runs here: claimers stop first,
//! in-flight work gets the grace period, the marker flushes, undelivered
//! leases are released, and the shard leases are given back last.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

use super::claimer::{Claimer, ClaimerArgs};
use super::coordinator::{Coordinator, CoordinatorArgs, CoordinatorMsg};
use super::listener::Listener;
use super::marker::{Marker, MarkerMsg, FLUSH_TIMEOUT};
use super::publisher::Publisher;
use super::{CountersSnapshot, Shared};
use crate::metrics as m;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Child {
    Marker,
    Publisher(u32),
    Claimer(u32),
    Listener,
    Coordinator,
}

impl Child {
    pub fn label(&self) -> &'static str {
        match self {
            Child::Marker => "marker",
            Child::Publisher(_) => "publisher",
            Child::Claimer(_) => "claimer",
            Child::Listener => "listener",
            Child::Coordinator => "coordinator",
        }
    }
}

pub enum SupervisorMsg {
    Respawn(Child),
    /// The coordinator took `shard` under `token`: run its claimer.
    StartClaimer {
        shard: u32,
        token: i64,
    },
    /// The shard's tenure under `token` is being handed over or was lost:
    /// stop its claimer (and reply once it has stopped, when asked to). A
    /// claimer of a newer tenure of the same shard is left running.
    StopClaimer {
        shard: u32,
        token: i64,
        reply: Option<RpcReplyPort<()>>,
    },
    Shutdown(RpcReplyPort<ShutdownReport>),
    /// How many times each kind of child was restarted.
    Restarts(RpcReplyPort<HashMap<&'static str, u64>>),
}

/// What shutdown did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ShutdownReport {
    /// Rows still in flight when the grace period ended.
    pub in_flight_at_deadline: usize,
    /// Of those, rows whose lease was given back for another relay to take now.
    pub released: u64,
    pub counters: CountersSnapshot,
}

pub struct Supervisor;

pub struct SupervisorState {
    shared: Arc<Shared>,
    children: HashMap<ActorId, Child>,
    recent: HashMap<Child, VecDeque<Instant>>,
    restarts: HashMap<&'static str, u64>,
    /// Shards whose claimers should run, with their fencing tokens.
    claim_tokens: HashMap<u32, i64>,
    stopping: bool,
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        myself: ActorRef<SupervisorMsg>,
        shared: Arc<Shared>,
    ) -> Result<SupervisorState, ActorProcessingErr> {
        let mut state = SupervisorState {
            children: HashMap::new(),
            recent: HashMap::new(),
            restarts: HashMap::new(),
            claim_tokens: HashMap::new(),
            stopping: false,
            shared,
        };
        let relay = &state.shared.config.relay;
        let mut all = vec![Child::Marker];
        all.extend((0..relay.publishers).map(Child::Publisher));
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
                if let Child::Claimer(shard) = child {
                    if !state.claim_tokens.contains_key(&shard) {
                        // The shard was handed over or lost meanwhile.
                        return Ok(());
                    }
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
            SupervisorMsg::StartClaimer { shard, token } => {
                if state.stopping {
                    return Ok(());
                }
                stop_claimer(state, shard).await;
                state.claim_tokens.insert(shard, token);
                if let Err(e) = spawn(&myself, state, Child::Claimer(shard)).await {
                    tracing::warn!(shard, error = %e, "could not start the claimer; retrying");
                    myself.send_after(Duration::from_millis(100), move || {
                        SupervisorMsg::Respawn(Child::Claimer(shard))
                    });
                }
            }
            SupervisorMsg::StopClaimer {
                shard,
                token,
                reply,
            } => {
                if state.claim_tokens.get(&shard) == Some(&token) {
                    state.claim_tokens.remove(&shard);
                    stop_claimer(state, shard).await;
                }
                if let Some(reply) = reply {
                    let _ = reply.send(());
                }
            }
            SupervisorMsg::Shutdown(reply) => {
                state.stopping = true;
                let report = shutdown(state).await;
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
        let Some(child) = state.children.remove(&id) else {
            return Ok(());
        };
        forget(&state.shared, child);
        if state.stopping {
            return Ok(());
        }
        tracing::error!(actor = child.label(), reason = %why, "actor died; its rows' leases will expire");
        m::count_actor_restart(child.label());
        *state.restarts.entry(child.label()).or_default() += 1;
        let window = state.shared.config.relay.restart_window;
        let budget = state.shared.config.relay.max_restarts as usize;
        let recent = state.recent.entry(child).or_default();
        let now = Instant::now();
        recent.push_back(now);
        while recent
            .front()
            .is_some_and(|t| now.duration_since(*t) > window)
        {
            recent.pop_front();
        }
        if recent.len() > budget {
            let reason = format!(
                "{} restarted {} times within {:?}: giving up",
                child.label(),
                recent.len(),
                window
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
    let shared = Arc::clone(&state.shared);
    let cell = myself.get_cell();
    let id = match child {
        Child::Marker => {
            let (actor, _) = Actor::spawn_linked(None, Marker, shared.clone(), cell).await?;
            shared.directory.set_marker(Some(actor.clone()));
            actor.get_id()
        }
        Child::Publisher(i) => {
            let (actor, _) = Actor::spawn_linked(None, Publisher, shared.clone(), cell).await?;
            shared
                .directory
                .set_publisher(i as usize, Some(actor.clone()));
            actor.get_id()
        }
        Child::Claimer(shard) => {
            let Some(&token) = state.claim_tokens.get(&shard) else {
                return Ok(());
            };
            let args = ClaimerArgs {
                shard,
                token,
                shared: shared.clone(),
            };
            let (actor, _) = Actor::spawn_linked(None, Claimer, args, cell).await?;
            shared
                .directory
                .set_claimer(shard as usize, Some(actor.clone()));
            actor.get_id()
        }
        Child::Listener => {
            let (actor, _) = Actor::spawn_linked(None, Listener, shared.clone(), cell).await?;
            actor.get_id()
        }
        Child::Coordinator => {
            let args = CoordinatorArgs {
                shared: shared.clone(),
                supervisor: myself.clone(),
            };
            let (actor, _) = Actor::spawn_linked(None, Coordinator, args, cell).await?;
            shared.directory.set_coordinator(Some(actor.clone()));
            actor.get_id()
        }
    };
    state.children.insert(id, child);
    Ok(())
}

fn forget(shared: &Shared, child: Child) {
    match child {
        Child::Marker => shared.directory.set_marker(None),
        Child::Publisher(i) => shared.directory.set_publisher(i as usize, None),
        Child::Claimer(shard) => shared.directory.set_claimer(shard as usize, None),
        Child::Listener => {}
        Child::Coordinator => shared.directory.set_coordinator(None),
    }
}

/// Stops the shard's claimer, if one runs, without restarting it.
async fn stop_claimer(state: &mut SupervisorState, shard: u32) {
    let Some(actor) = state.shared.directory.claimer(shard as usize) else {
        return;
    };
    state.children.remove(&actor.get_id());
    state.shared.directory.set_claimer(shard as usize, None);
    let _ = actor
        .stop_and_wait(
            Some("shard handed over".into()),
            Some(Duration::from_secs(5)),
        )
        .await;
}

async fn shutdown(state: &mut SupervisorState) -> ShutdownReport {
    let shared = Arc::clone(&state.shared);
    // 0. Take no more shards (leases keep being renewed until step 4).
    let coordinator = shared.directory.coordinator();
    if let Some(c) = &coordinator {
        let _ = c.cast(CoordinatorMsg::Stopping);
    }
    // 1. Stop claiming.
    for claimer in shared.directory.claimers() {
        let _ = claimer
            .stop_and_wait(Some("shutdown".into()), Some(Duration::from_secs(5)))
            .await;
    }
    // 2. No request starts from here (rows not yet sent are put back); the
    //    ones under way and their marks get the grace period, and at least
    //    until every request has ended, so no row is released (and taken by
    //    another replica) while its request may still reach the destination.
    shared.ownership.stop_sending(None, None);
    let grace = shared
        .config
        .relay
        .shutdown_grace
        .max(super::requests_end_within(&shared.config));
    let deadline = Instant::now() + grace;
    while shared.in_flight_count() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let in_flight_at_deadline = shared.in_flight.len();
    // 3. Flush what the marker holds, then give back the leases of rows that
    //    were never delivered, so another relay takes them at once.
    let mut released = 0;
    if let Some(marker) = shared.directory.marker() {
        if !matches!(
            marker.call(MarkerMsg::FlushNow, Some(FLUSH_TIMEOUT)).await,
            Ok(ractor::rpc::CallResult::Success(()))
        ) {
            tracing::warn!("shutdown: the marker did not confirm its last flush; unmarked rows will be claimed again when their leases expire");
        }
        let rest = shared.in_flight.snapshot();
        if !rest.is_empty() {
            let rows = rest.len();
            match marker
                .call(|reply| MarkerMsg::Release(rest, reply), Some(FLUSH_TIMEOUT))
                .await
            {
                Ok(ractor::rpc::CallResult::Success(n)) => released = n,
                _ => tracing::warn!(
                    rows,
                    "shutdown: could not release the leases of undelivered rows; they are claimed again when the leases expire"
                ),
            }
        }
    }
    // 4. Give the shard leases back: the other replicas take them at once.
    if let Some(c) = &coordinator {
        let _ = c.call(CoordinatorMsg::Leave, Some(FLUSH_TIMEOUT)).await;
        let _ = c
            .stop_and_wait(Some("shutdown".into()), Some(Duration::from_secs(5)))
            .await;
    }
    // 5. Everything else. Publishers still waiting on a destination are cut off:
    //    their rows were released above.
    for publisher in shared.directory.publishers() {
        publisher.kill();
    }
    if let Some(marker) = shared.directory.marker() {
        let _ = marker
            .stop_and_wait(Some("shutdown".into()), Some(Duration::from_secs(5)))
            .await;
    }
    ShutdownReport {
        in_flight_at_deadline,
        released,
        counters: shared.counters.snapshot(),
    }
}
