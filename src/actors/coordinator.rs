//! Coordinator: this replica's share of the shards. Replicas announce
//! themselves in `outbox_relay_replicas` and own shards through leases in
//! `outbox_relay_shard_leases`; every round (a quarter of `relay.shard_lease`)
//! the coordinator renews what it holds, counts the live replicas, and takes
//! or hands over shards until it holds its fair share. Each takeover draws a
//! new fencing token; claims and marks carry it, so a replica that lost a shard
//! is refused by the database (claimer.rs, marker.rs).
//!
//! - A shard taken: its claimer starts at once (the lease was free, released,
//!   or over: its old owner can no longer claim or mark in it).
//! - A shard handed over (another replica joined, or shutdown): its claimer
//!   stops, its rows in flight get a moment to finish, the rest are released,
//!   then the lease is given back so the new owner starts at once.
//! - A shard lost (a renewal found the lease over or taken): its claimer stops;
//!   what it had in flight is dropped by the publishers and refused if marked.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::{counter, gauge};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use super::supervisor::SupervisorMsg;
use super::{reconnect_delay, MarkerMsg, Shared, Tenure};
use crate::db::PooledConn;
use crate::metrics as m;

/// Announces this replica; `alive_until` is what the others count it by.
/// A new process under the same name starts a new `started_at`.
const HEARTBEAT_SQL: &str = "INSERT INTO outbox_relay_replicas AS r
    (replica, hostname, pid, started_at, seen_at, alive_until)
VALUES ($1, $2, $3, now(), now(), now() + $4::bigint * interval '1 millisecond')
ON CONFLICT (replica) DO UPDATE SET
    hostname = excluded.hostname,
    pid = excluded.pid,
    started_at = CASE WHEN r.pid = excluded.pid AND r.hostname = excluded.hostname
                      THEN r.started_at ELSE now() END,
    seen_at = now(),
    alive_until = excluded.alive_until";

/// Replicas counted for the fair share, in the order shares are dealt.
const LIVE_SQL: &str =
    "SELECT replica FROM outbox_relay_replicas WHERE alive_until > now() ORDER BY replica";

/// Replicas gone for a while leave the list (`stats` shows the recent ones).
const FORGET_SQL: &str =
    "DELETE FROM outbox_relay_replicas WHERE alive_until < now() - interval '10 minutes'";

/// Extends the leases still held under their tokens; a shard not returned was
/// lost (its lease ended, or another replica took it).
const RENEW_SQL: &str = "UPDATE outbox_relay_shard_leases
SET lease_until = now() + $2::bigint * interval '1 millisecond', renewed_at = now()
WHERE owner = $1 AND token = ANY($3) AND lease_until > now()
RETURNING shard, token";

/// Takes up to `$3` shards that nobody holds: released, never taken, lease
/// over, or held under this replica's own name by an earlier process (a
/// restart under a fixed `relay.replica_id`), except those it holds now (`$4`).
/// Each gets a new fencing token.
const ACQUIRE_SQL: &str = "WITH free AS (
    SELECT shard, owner FROM outbox_relay_shard_leases
    WHERE (owner IS NULL OR owner = $1 OR lease_until IS NULL OR lease_until <= now())
      AND NOT (shard = ANY($4))
    ORDER BY shard
    LIMIT $3
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_relay_shard_leases AS l
SET owner = $1, token = nextval('outbox_relay_shard_token_seq'),
    lease_until = now() + $2::bigint * interval '1 millisecond',
    acquired_at = now(), renewed_at = now()
FROM free
WHERE l.shard = free.shard
RETURNING l.shard, l.token, free.owner";

/// Gives leases back (handover, shutdown): the next replica takes them at once.
const RELEASE_SQL: &str = "UPDATE outbox_relay_shard_leases
SET owner = NULL, lease_until = NULL, renewed_at = now()
WHERE token = ANY($1)";

/// Leaves the replica list on shutdown, so the others rebalance at once.
const LEAVE_SQL: &str =
    "DELETE FROM outbox_relay_replicas WHERE replica = $1 AND hostname = $2 AND pid = $3";

pub enum CoordinatorMsg {
    /// A round: renew, count replicas, take or hand over shards.
    Tick,
    /// A handover finished with the shard's rows in flight: give the lease back.
    HandedOver { shard: i16, token: i64 },
    /// Shutdown began: keep renewing, take nothing more.
    Stopping,
    /// Shutdown: give every lease back and leave the replica list.
    Leave(RpcReplyPort<()>),
}

pub struct CoordinatorArgs {
    pub shared: Arc<Shared>,
    pub supervisor: ActorRef<SupervisorMsg>,
}

pub struct Coordinator;

pub struct CoordinatorState {
    shared: Arc<Shared>,
    supervisor: ActorRef<SupervisorMsg>,
    conn: Option<PooledConn>,
    hostname: String,
    pid: i32,
    /// Shards on their way out: shard → token, until the lease is given back.
    handing_over: HashMap<i16, i64>,
    stopping: bool,
    failures: u32,
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
            shared: args.shared,
            supervisor: args.supervisor,
            conn: None,
            hostname: hostname(),
            pid: std::process::id() as i32,
            handing_over: HashMap::new(),
            stopping: false,
            failures: 0,
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
                let next = match round(&myself, state).await {
                    Ok(next) => {
                        state.failures = 0;
                        next
                    }
                    Err(e) => {
                        state.failures += 1;
                        state.conn = None;
                        let delay = reconnect_delay(state.failures);
                        tracing::warn!(error = %e, retry_in = ?delay, "shard lease round failed");
                        // Leases run out on their own; the publishers stop
                        // sending for a shard whose lease this process could
                        // not renew (Ownership::holds).
                        delay
                    }
                };
                myself.send_after(next, || CoordinatorMsg::Tick);
            }
            CoordinatorMsg::HandedOver { shard, token } => {
                if state.handing_over.get(&shard) != Some(&token) {
                    // Lost meanwhile (and maybe taken again under a new
                    // token): nothing of this tenure to give back.
                    return Ok(());
                }
                state.handing_over.remove(&shard);
                match give_back(state, &[token]).await {
                    Ok(()) => {
                        counter!(m::SHARD_HANDOVERS, "kind" => "released").increment(1);
                        tracing::info!(shard, token, "shard handed over");
                    }
                    Err(e) => {
                        state.conn = None;
                        tracing::warn!(shard, error = %e, "could not give the shard lease back; it ends on its own");
                    }
                }
            }
            CoordinatorMsg::Stopping => state.stopping = true,
            CoordinatorMsg::Leave(reply) => {
                state.stopping = true;
                if let Err(e) = leave(state).await {
                    state.conn = None;
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
) -> Result<Duration, CoordinatorError> {
    let shared = Arc::clone(&state.shared);
    let lease = shared.config.relay.shard_lease;
    let lease_ms = lease.as_millis() as i64;
    let me = shared.replica_id.as_str();
    // Taken for the round and put back at its end; a failed round drops it
    // and the next one connects afresh.
    let conn = match state.conn.take() {
        Some(conn) => conn,
        None => shared.pool.get_owned().await?,
    };
    // Measured before the statements: the database's leases end no earlier.
    let started = Instant::now();
    conn.execute(
        HEARTBEAT_SQL,
        &[&me, &state.hostname, &state.pid, &lease_ms],
    )
    .await?;

    // 1. Renew what we hold.
    let held = shared.ownership.shards();
    if !held.is_empty() {
        let tokens: Vec<i64> = held.iter().map(|(_, t)| t.token).collect();
        let renewed: HashMap<i16, i64> = conn
            .query(RENEW_SQL, &[&me, &lease_ms, &tokens])
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        for (shard, tenure) in held {
            if renewed.get(&shard) == Some(&tenure.token) {
                shared.ownership.renew(shard, tenure.token, started + lease);
            } else {
                lost(state, shard, tenure.token);
            }
        }
    }

    // 2. Our fair share among the live replicas.
    let live: Vec<String> = conn
        .query(LIVE_SQL, &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    conn.execute(FORGET_SQL, &[]).await?;
    let shards = shared.config.relay.shards as usize;
    let share = fair_share(shards, &live, me);
    let held_now: Vec<i16> = shared
        .ownership
        .shards()
        .into_iter()
        .map(|(s, _)| s)
        .filter(|s| !state.handing_over.contains_key(s))
        .collect();

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
        let mut exclude: Vec<i16> = held_now.clone();
        exclude.extend(state.handing_over.keys());
        let want = (share - held_now.len()) as i64;
        let taken = conn
            .query(ACQUIRE_SQL, &[&me, &lease_ms, &want, &exclude])
            .await?;
        for row in taken {
            let shard: i16 = row.get(0);
            let token: i64 = row.get(1);
            let previous: Option<String> = row.get(2);
            shared
                .ownership
                .set(shard, Tenure::new(token, started + lease));
            counter!(m::SHARD_HANDOVERS, "kind" => "acquired").increment(1);
            tracing::info!(
                shard,
                token,
                previous = previous.as_deref().unwrap_or("-"),
                "shard taken"
            );
            let _ = state.supervisor.cast(SupervisorMsg::StartClaimer {
                shard: shard as u32,
                token,
            });
        }
    }
    state.conn = Some(conn);
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
pub fn fair_share(shards: usize, live: &[String], me: &str) -> usize {
    let mut live: Vec<&str> = live.iter().map(String::as_str).collect();
    if !live.contains(&me) {
        live.push(me);
        live.sort_unstable();
    }
    let n = live.len();
    let index = live.iter().position(|r| *r == me).expect("added above");
    shards / n + usize::from(index < shards % n)
}

/// The lease ended or was taken: stop claiming there at once.
fn lost(state: &mut CoordinatorState, shard: i16, token: i64) {
    state.shared.ownership.remove_if(shard, token);
    // A handover in progress finds it gone and gives nothing back.
    state.handing_over.remove(&shard);
    counter!(m::SHARD_HANDOVERS, "kind" => "lost").increment(1);
    tracing::warn!(
        shard,
        token,
        "shard lease lost (not renewed in time, or taken by another replica); its claimer stops"
    );
    let _ = state.supervisor.cast(SupervisorMsg::StopClaimer {
        shard: shard as u32,
        token,
        reply: None,
    });
}

/// Stops the shard's claimer and its publishing, waits until none of its
/// requests can still be open, releases what was not sent, then tells the
/// coordinator to give the lease back. Runs beside the coordinator, which
/// keeps renewing the lease meanwhile: the next owner can start a key's next
/// event only after this replica's request for the previous one has ended.
fn hand_over(myself: &ActorRef<CoordinatorMsg>, state: &mut CoordinatorState, shard: i16) {
    let Some(tenure) = state.shared.ownership.get(shard) else {
        return;
    };
    state.handing_over.insert(shard, tenure.token);
    tracing::info!(shard, "handing the shard over");
    let shared = Arc::clone(&state.shared);
    let supervisor = state.supervisor.clone();
    let coordinator = myself.clone();
    let token = tenure.token;
    tokio::spawn(async move {
        let stopped = supervisor
            .call(
                |reply| SupervisorMsg::StopClaimer {
                    shard: shard as u32,
                    token,
                    reply: Some(reply),
                },
                Some(Duration::from_secs(5)),
            )
            .await;
        if !matches!(stopped, Ok(ractor::rpc::CallResult::Success(()))) {
            // Its claims are refused once the lease is given back below.
            tracing::warn!(shard, "handover: the claimer did not confirm it stopped");
        }
        // Rows not yet sent are put back by the publishers; those being sent
        // end within the request timeout, answered or cut off.
        shared.ownership.stop_sending(Some(shard), Some(token));
        let deadline = Instant::now() + super::requests_end_within(&shared.config);
        while shared
            .in_flight
            .of_shard(shard)
            .iter()
            .any(|h| h.token == token)
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // From here no publisher starts a row of this tenure. (If the shard
        // was lost meanwhile and taken again, the new tenure stays.)
        shared.ownership.remove_if(shard, token);
        if let Some(marker) = shared.directory.marker() {
            let _ = marker
                .call(MarkerMsg::FlushNow, Some(super::marker::FLUSH_TIMEOUT))
                .await;
            let rest: Vec<_> = shared
                .in_flight
                .of_shard(shard)
                .into_iter()
                .filter(|h| h.token == token)
                .collect();
            if !rest.is_empty() {
                let _ = marker
                    .call(
                        |reply| MarkerMsg::Release(rest, reply),
                        Some(super::marker::FLUSH_TIMEOUT),
                    )
                    .await;
            }
        }
        let _ = coordinator.cast(CoordinatorMsg::HandedOver { shard, token });
    });
}

async fn give_back(state: &mut CoordinatorState, tokens: &[i64]) -> Result<(), CoordinatorError> {
    if state.conn.is_none() {
        state.conn = Some(state.shared.pool.get_owned().await?);
    }
    let conn = state.conn.as_ref().expect("connected above");
    conn.execute(RELEASE_SQL, &[&tokens]).await?;
    gauge!(m::SHARDS_OWNED).set(holding(state) as f64);
    Ok(())
}

/// Shards held and not on their way out.
fn holding(state: &CoordinatorState) -> usize {
    state
        .shared
        .ownership
        .shards()
        .iter()
        .filter(|(s, _)| !state.handing_over.contains_key(s))
        .count()
}

/// Shutdown: the claimers are stopped and the rows released by now.
async fn leave(state: &mut CoordinatorState) -> Result<(), CoordinatorError> {
    let mut tokens: Vec<i64> = state
        .shared
        .ownership
        .shards()
        .iter()
        .map(|(_, t)| t.token)
        .collect();
    tokens.extend(state.handing_over.values());
    let released = tokens.len();
    for (shard, _) in state.shared.ownership.shards() {
        state.shared.ownership.remove(shard);
    }
    state.handing_over.clear();
    give_back(state, &tokens).await?;
    counter!(m::SHARD_HANDOVERS, "kind" => "released").increment(released as u64);
    let conn = state.conn.as_ref().expect("connected in give_back");
    conn.execute(
        LEAVE_SQL,
        &[&state.shared.replica_id, &state.hostname, &state.pid],
    )
    .await?;
    tracing::info!(shards = released, "shard leases given back");
    Ok(())
}

/// Takes `shard` for `owner` whatever holds it now, with a new fencing token,
/// for `lease`. For tools that claim and mark without a relay (`loadtest
/// sql-ceiling`, tests); a relay never does this.
pub async fn seize_shard(
    client: &impl tokio_postgres::GenericClient,
    shard: i16,
    owner: &str,
    lease: Duration,
) -> Result<i64, tokio_postgres::Error> {
    const SEIZE_SQL: &str = "UPDATE outbox_relay_shard_leases
SET owner = $2, token = nextval('outbox_relay_shard_token_seq'),
    lease_until = now() + $3::bigint * interval '1 millisecond',
    acquired_at = now(), renewed_at = now()
WHERE shard = $1
RETURNING token";
    let lease_ms = lease.as_millis() as i64;
    Ok(client
        .query_one(SEIZE_SQL, &[&shard, &owner, &lease_ms])
        .await?
        .get(0))
}

/// Gives back a shard taken with [`seize_shard`].
pub async fn release_shard(
    client: &impl tokio_postgres::GenericClient,
    token: i64,
) -> Result<(), tokio_postgres::Error> {
    client.execute(RELEASE_SQL, &[&vec![token]]).await?;
    Ok(())
}

/// This machine's name, for `stats` and the default replica name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// `relay.replica_id`, or `<hostname>-<pid>`.
pub fn replica_id(configured: &str) -> String {
    if configured.is_empty() {
        format!("{}-{}", hostname(), std::process::id())
    } else {
        configured.to_owned()
    }
}

#[derive(Debug, thiserror::Error)]
enum CoordinatorError {
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    #[error("no database connection: {0}")]
    Pool(#[from] bb8::RunError<tokio_postgres::Error>),
}

#[cfg(test)]
mod tests {
    use super::fair_share;

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
