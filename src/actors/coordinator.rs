//! Coordinator: this replica's share of the shards. Replicas announce
//! themselves in `outbox_relay_replicas` and own shards through leases in
//! `outbox_relay_shard_leases`; every round (a quarter of `relay.shard_lease`)
//! the coordinator renews what it holds, counts the live replicas, and takes
//! or hands over shards until it holds its fair share. Each takeover draws a
//! new fencing token; claims and marks carry it, so a replica that lost a
//! shard is refused by the database (`store::outbox`).
//!
//! - A shard taken: its claimer starts at once (the lease was free, released,
//!   or over: its old owner can no longer claim or mark in it).
//! - A shard handed over (another replica joined, or shutdown): its tenure is
//!   wound down ([`Winddown::shard`]) while the coordinator keeps renewing the
//!   lease, then the lease is given back so the new owner starts at once.
//! - A shard lost (a renewal found the lease over or taken): its claimer stops;
//!   what it had in flight is dropped by the publishers and refused if marked.
//! - A shard taken from a lease that ended (not handed over): its claimer
//!   waits before its first claim, counted from when the statement that took
//!   it returned (a slow round does not shorten it), and from the end of the
//!   old lease when an earlier process under this name still held it.
//! - The name taken (a heartbeat refused: another process runs under this
//!   `relay.replica_id`, see [`super::identity`]): every shard is dropped as
//!   lost and nothing is taken until the name is free again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::{counter, gauge};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::claimer::Claimers;
use super::identity;
use super::ownership::{Ownership, Tenure};
use super::winddown::Winddown;
use crate::metrics as m;
use crate::store::shards::{Heartbeat, Holder, LeaseHolder, Replica};
use crate::store::{Fence, Session, ShardId, Store, StoreError};

/// The `kind` label values of the shard handovers' counter.
pub(crate) const HANDOVER_KINDS: [&str; 3] = ["acquired", "released", "lost"];

pub(crate) enum CoordinatorMsg {
    /// A round: renew, count replicas, take or hand over shards.
    Tick,
    /// A handover finished winding the tenure down: give the lease back.
    HandedOver(Fence),
    /// Shutdown began: keep renewing, take nothing more.
    Stopping,
    /// Shutdown: give every lease back and leave the replica list.
    Leave(RpcReplyPort<()>),
}

#[derive(Clone)]
pub(crate) struct CoordinatorArgs {
    pub store: Store,
    pub me: Replica,
    /// `relay.shard_lease`.
    pub shard_lease: Duration,
    /// The most shards this replica takes: each claimer keeps a connection.
    pub max_shards: usize,
    pub ownership: Arc<Ownership>,
    pub claimers: Claimers,
    pub winddown: Winddown,
}

pub(crate) struct Coordinator;

pub(crate) struct CoordinatorState {
    args: CoordinatorArgs,
    session: Session,
    /// Tenures on their way out, until the lease is given back.
    handing_over: HashMap<ShardId, i64>,
    stopping: bool,
    /// Left the replica list (shutdown): a round still scheduled must not
    /// announce this replica again.
    left: bool,
    /// Another process holds this replica's name: it takes nothing.
    displaced: bool,
    /// A migration applied needs newer relays (`migrate --allow-live-older`):
    /// hand every shard over, take none, then leave the replica list.
    outdated: bool,
}

impl Actor for Coordinator {
    type Msg = CoordinatorMsg;
    type State = CoordinatorState;
    type Arguments = CoordinatorArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<CoordinatorMsg>,
        args: CoordinatorArgs,
    ) -> Result<CoordinatorState, ActorProcessingErr> {
        myself.cast(CoordinatorMsg::Tick)?;
        Ok(CoordinatorState {
            session: args.store.session(),
            args,
            handing_over: HashMap::new(),
            stopping: false,
            left: false,
            displaced: false,
            outdated: false,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<CoordinatorMsg>,
        msg: CoordinatorMsg,
        state: &mut CoordinatorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CoordinatorMsg::Tick => {
                if state.left {
                    return Ok(());
                }
                let next = match round(&myself, state).await {
                    Ok(next) => {
                        state.session.succeeded();
                        next
                    }
                    Err(e) => {
                        let delay = state.session.failed();
                        tracing::warn!(error = %e, retry_in = ?delay, "shard lease round failed");
                        // Leases run out on their own; the publishers stop
                        // sending for a shard whose lease this process could
                        // not renew (Ownership::holds).
                        delay
                    }
                };
                myself.send_after(next, || CoordinatorMsg::Tick);
            }
            CoordinatorMsg::HandedOver(fence) => {
                if state.handing_over.get(&fence.shard) != Some(&fence.token) {
                    // Lost meanwhile (and maybe taken again under a new
                    // token): nothing of this tenure to give back.
                    return Ok(());
                }
                state.handing_over.remove(&fence.shard);
                match state.session.give_back(&[fence.token]).await {
                    Ok(()) => {
                        counter!(m::SHARD_HANDOVERS, "kind" => "released").increment(1);
                        tracing::info!(shard = %fence.shard, token = fence.token, "shard handed over");
                    }
                    Err(e) => {
                        state.session.failed();
                        tracing::warn!(shard = %fence.shard, error = %e, "could not give the shard lease back; it ends on its own");
                    }
                }
                gauge!(m::SHARDS_OWNED).set(holding(state) as f64);
            }
            CoordinatorMsg::Stopping => state.stopping = true,
            CoordinatorMsg::Leave(reply) => {
                state.stopping = true;
                state.left = true;
                if let Err(e) = leave(state).await {
                    state.session.failed();
                    tracing::warn!(error = %e, "could not give the shard leases back; they end on their own");
                }
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}

/// One round; returns when the next is due.
async fn round(
    myself: &ActorRef<CoordinatorMsg>,
    state: &mut CoordinatorState,
) -> Result<Duration, StoreError> {
    let lease = state.args.shard_lease;
    let relays_from = match state.session.heartbeat(&state.args.me, lease, None).await? {
        Heartbeat::Beat { relays_from } if state.displaced => {
            state.displaced = false;
            tracing::info!(replica = %state.args.me.id, "the replica name is free again: taking shards");
            relays_from
        }
        Heartbeat::Beat { relays_from } => relays_from,
        Heartbeat::Refused(holder) => {
            displaced(state, &holder);
            return Ok(lease / 4);
        }
    };
    if !state.outdated && relays_from.is_some_and(|n| n > Store::latest_schema()) {
        state.outdated = true;
        let why = match state.args.store.needs_newer_relays().await? {
            Some(needs) => needs.to_string(),
            None => "a migration applied needs newer relays".to_owned(),
        };
        tracing::error!("{why}; this relay stops claiming: it hands its shards over and leaves");
    }

    // 1. Renew what we hold. Each lease's end as this process sees it is
    //    measured before the statement: the database's is no earlier.
    let held = state.args.ownership.fences();
    if !held.is_empty() {
        let tokens: Vec<i64> = held.iter().map(|f| f.token).collect();
        let asked = Instant::now();
        let renewed = state.session.renew(&state.args.me, lease, &tokens).await?;
        let (kept, gone): (Vec<Fence>, Vec<Fence>) =
            held.into_iter().partition(|f| renewed.contains(f));
        for fence in kept {
            state.args.ownership.renew(fence, asked + lease);
        }
        if !gone.is_empty() {
            // Only to say who took them; the claimers stop either way.
            let shards: Vec<ShardId> = gone.iter().map(|f| f.shard).collect();
            let holders = state.session.lease_holders(&shards).await.ok();
            for fence in gone {
                let why = why_lost(&state.args.me, fence.shard, holders.as_deref());
                lost(state, fence, &why);
            }
        }
    }

    // 2. Our fair share among the live replicas, of the shards there are now
    //    (`reshard` may have changed them while we ran).
    let live = state.session.live_replicas().await?;
    let shards = state.session.layout().await? as usize;
    let mut share = fair_share(shards, &live, &state.args.me.id);
    if share > state.args.max_shards {
        tracing::warn!(
            share,
            max = state.args.max_shards,
            "this replica's share of the shards needs more connections than database.pool_size leaves for claimers; it takes fewer (raise database.pool_size or run more replicas)"
        );
        share = state.args.max_shards;
    }
    let held_now: Vec<ShardId> = state
        .args
        .ownership
        .shards()
        .into_iter()
        .filter(|s| !state.handing_over.contains_key(s))
        .collect();

    if state.outdated {
        share = 0;
        if held_now.is_empty() && state.handing_over.is_empty() {
            state.session.leave(&state.args.me).await?;
            state.left = true;
            gauge!(m::SHARDS_OWNED).set(0.0);
            tracing::error!("this relay is too old for the schema: it holds no shard and left the replica list; replace it with a relay of the release that migrated");
            return Ok(lease);
        }
    }

    // 3. Take or hand over the difference.
    if state.stopping {
        // Shutdown releases everything; nothing to take.
    } else if held_now.len() > share {
        // The highest shards go: every replica agrees on nothing more than
        // "some", and the lowest are the ones a newcomer tries first.
        for &shard in held_now.iter().rev().take(held_now.len() - share) {
            hand_over(myself, state, shard);
        }
    } else if held_now.len() < share {
        let mut exclude: Vec<ShardId> = held_now.clone();
        exclude.extend(state.handing_over.keys());
        let asked = Instant::now();
        let taken = state
            .session
            .acquire(&state.args.me, lease, share - held_now.len(), &exclude)
            .await?;
        // The database took them before this: a wait counted from here is
        // no shorter than one counted from the takeover.
        let returned = Instant::now();
        for acquired in taken {
            let fence = acquired.fence;
            // Taken from a lease that ended rather than one given back: its
            // last owner may have requests in the air (a claim wrote nothing
            // that would keep their rows from being read again), so the first
            // claim waits until every such request is over. An earlier
            // process under this name may send until its lease ends.
            let not_before = acquired.previous.is_some().then(|| {
                returned + acquired.previous_lease_left + state.args.winddown.requests_end_within
            });
            state
                .args
                .ownership
                .set(fence.shard, Tenure::new(fence.token, asked + lease));
            counter!(m::SHARD_HANDOVERS, "kind" => "acquired").increment(1);
            tracing::info!(
                shard = %fence.shard,
                token = fence.token,
                previous = acquired.previous.as_deref().unwrap_or("-"),
                "shard taken"
            );
            let claimers = state.args.claimers.clone();
            tokio::spawn(async move { claimers.start(fence, not_before).await });
        }
    }
    let now_holding = holding(state);
    gauge!(m::SHARDS_OWNED).set(now_holding as f64);
    // Short of our share (joining, or a replica just left): look again soon,
    // the others hand shards over on their own rounds.
    let every = if now_holding < share && !state.stopping {
        lease / 20
    } else {
        lease / 4
    };
    Ok(every.max(Duration::from_millis(50)))
}

/// Shards for the replica `me` among `live` (sorted): an even split, the first
/// `shards % n` replicas taking one more. `me` counts even if its heartbeat is
/// not visible yet.
pub(crate) fn fair_share(shards: usize, live: &[String], me: &str) -> usize {
    let mut live: Vec<&str> = live.iter().map(String::as_str).collect();
    if !live.contains(&me) {
        live.push(me);
        live.sort_unstable();
    }
    let n = live.len();
    let index = live.iter().position(|r| *r == me).expect("added above");
    shards / n + usize::from(index < shards % n)
}

/// Why the lease of `shard` was not renewed, from who holds it now
/// (`holders`: the lease rows of the shards lost, `None` if not known).
fn why_lost(me: &Replica, shard: ShardId, holders: Option<&[LeaseHolder]>) -> String {
    let Some(holders) = holders else {
        return "not renewed in time, or taken by another replica".to_owned();
    };
    let Some(now) = holders.iter().find(|h| h.shard == shard) else {
        return "the outbox was resharded: the shard is gone".to_owned();
    };
    match now.owner.as_deref() {
        Some(owner) if now.live && owner == me.id => {
            "taken by another process under this replica's name".to_owned()
        }
        Some("(reshard)") => "the outbox was resharded".to_owned(),
        Some(owner) if now.live => format!("taken by replica {owner}"),
        _ => "its lease ended before it was renewed".to_owned(),
    }
}

/// Another process holds this replica's name: drop every shard (its
/// heartbeat, not this one's, now keeps the name live; it takes them).
fn displaced(state: &mut CoordinatorState, holder: &Holder) {
    if !state.displaced {
        tracing::error!(
            "{}; this relay stops claiming until the name is free",
            identity::name_taken(&state.args.me, holder)
        );
    }
    state.displaced = true;
    let why = format!(
        "relay.replica_id is in use by host {} pid {}",
        holder.hostname, holder.pid
    );
    let mut fences = state.args.ownership.fences();
    fences.extend(
        state
            .handing_over
            .iter()
            .map(|(&shard, &token)| Fence { shard, token }),
    );
    for fence in fences {
        lost(state, fence, &why);
    }
    gauge!(m::SHARDS_OWNED).set(0.0);
}

/// The lease ended or was taken: stop claiming there at once.
fn lost(state: &mut CoordinatorState, fence: Fence, why: &str) {
    state.args.ownership.remove_if(fence);
    // A handover in progress finds it gone and gives nothing back.
    state.handing_over.remove(&fence.shard);
    counter!(m::SHARD_HANDOVERS, "kind" => "lost").increment(1);
    tracing::warn!(
        shard = %fence.shard,
        token = fence.token,
        "shard lease lost ({why}); its claimer stops"
    );
    // Beside the round, which must go on renewing the other shards.
    let claimers = state.args.claimers.clone();
    tokio::spawn(async move { claimers.stop(fence).await });
}

/// Winds the tenure down beside the coordinator, which keeps renewing the
/// lease meanwhile, then asks for the lease to be given back: the next owner
/// can start a key's next event only after this replica's request for the
/// previous one has ended.
fn hand_over(myself: &ActorRef<CoordinatorMsg>, state: &mut CoordinatorState, shard: ShardId) {
    let Some(tenure) = state.args.ownership.get(shard) else {
        return;
    };
    let fence = Fence {
        shard,
        token: tenure.token,
    };
    state.handing_over.insert(shard, fence.token);
    tracing::info!(%shard, "handing the shard over");
    let winddown = state.args.winddown.clone();
    let coordinator = myself.clone();
    tokio::spawn(async move {
        let wound = winddown.shard(fence).await;
        if wound.in_flight_at_deadline > 0 {
            tracing::warn!(%shard, rows = wound.in_flight_at_deadline, "handover: rows were still out when their requests had to be over; the next owner reads them again");
        }
        let _ = coordinator.cast(CoordinatorMsg::HandedOver(fence));
    });
}

/// Shards held and not on their way out.
fn holding(state: &CoordinatorState) -> usize {
    state
        .args
        .ownership
        .shards()
        .iter()
        .filter(|s| !state.handing_over.contains_key(s))
        .count()
}

/// Shutdown: the claimers are stopped and the rows released by now.
async fn leave(state: &mut CoordinatorState) -> Result<(), StoreError> {
    let mut tokens: Vec<i64> = state
        .args
        .ownership
        .fences()
        .iter()
        .map(|f| f.token)
        .collect();
    tokens.extend(state.handing_over.values());
    let released = tokens.len();
    for fence in state.args.ownership.fences() {
        state.args.ownership.remove_if(fence);
    }
    state.handing_over.clear();
    state.session.give_back(&tokens).await?;
    gauge!(m::SHARDS_OWNED).set(0.0);
    counter!(m::SHARD_HANDOVERS, "kind" => "released").increment(released as u64);
    state.session.leave(&state.args.me).await?;
    tracing::info!(shards = released, "shard leases given back");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{fair_share, why_lost};
    use crate::store::shards::{LeaseHolder, Replica};
    use crate::store::ShardId;

    #[test]
    fn a_lost_lease_is_explained_by_who_holds_the_shard_now() {
        let me = Replica::this_process("me");
        let held = |owner: Option<&str>, live: bool| LeaseHolder {
            shard: ShardId::new(3),
            owner: owner.map(str::to_owned),
            live,
        };
        let why = |now: Option<&[LeaseHolder]>| why_lost(&me, ShardId::new(3), now);
        assert_eq!(why(Some(&[held(Some("b"), true)])), "taken by replica b");
        assert_eq!(
            why(Some(&[held(Some("me"), true)])),
            "taken by another process under this replica's name"
        );
        assert_eq!(
            why(Some(&[held(Some("(reshard)"), true)])),
            "the outbox was resharded"
        );
        assert_eq!(
            why(Some(&[held(Some("b"), false)])),
            "its lease ended before it was renewed"
        );
        assert_eq!(
            why(Some(&[])),
            "the outbox was resharded: the shard is gone"
        );
        assert!(why(None).contains("not renewed in time"));
    }

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("r{i}")).collect()
    }

    #[test]
    fn shares_add_up_to_the_shard_count_and_differ_by_at_most_one() {
        for shards in [1usize, 2, 7, 8, 16, 1024] {
            for n in 1..=5 {
                let live = names(n);
                let shares: Vec<usize> = live
                    .iter()
                    .map(|me| fair_share(shards, &live, me))
                    .collect();
                assert_eq!(
                    shares.iter().sum::<usize>(),
                    shards,
                    "{shards} shards, {n} replicas"
                );
                let (lo, hi) = (shares.iter().min().unwrap(), shares.iter().max().unwrap());
                assert!(hi - lo <= 1, "{shares:?}");
            }
        }
        // Three replicas split sixteen shards 6/5/5.
        let live = names(3);
        assert_eq!(fair_share(16, &live, "r0"), 6);
        assert_eq!(fair_share(16, &live, "r2"), 5);
    }

    #[test]
    fn a_replica_not_yet_listed_counts_itself() {
        let live = names(2);
        assert_eq!(fair_share(16, &live, "r9"), 5);
        assert_eq!(fair_share(16, &[], "alone"), 16);
    }
}
