//! Marker: collects outcomes and writes them in one multi-row UPDATE every
//! `mark_batch` rows or `mark_interval`, whichever comes first. Every write is
//! fenced twice: by the row's lease (`attempt_count`), so a relay whose lease
//! expired and was taken by another cannot overwrite the newer state; and by
//! the shard's fencing token, so a replica that lost the shard (paused past
//! its shard lease, cut off) has its late marks refused by the database.

use std::collections::HashSet;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Arc;
use std::time::Duration;

use metrics::{counter, gauge};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio_postgres::types::Type;
use tokio_postgres::Statement;

use super::{reconnect_delay, Held, Mark, Marked, Shared};
use crate::db::PooledConn;
use crate::metrics as m;

const KIND_PUBLISHED: i16 = 1;
const KIND_RETRY: i16 = 2;
const KIND_DEAD: i16 = 3;
const KIND_RELEASE: i16 = 4;

/// One statement for every kind of outcome; rows whose lease moved on
/// (`attempt_count` differs), whose shard is no longer held under the token
/// they were claimed with (or whose shard lease ended), or that are already
/// final are left alone.
/// "Not final" is written `coalesce(…) IS NULL` on purpose: spelled as two
/// `IS NULL` tests it matches the partial indexes' predicate, and with stale
/// statistics (right after a bulk load) the generic plan walked the whole
/// pending set per mark instead of looking the batch up by primary key
/// (tests/mark_plan.rs).
pub const MARK_SQL: &str = "UPDATE outbox AS o SET
    published_at     = CASE WHEN u.kind = 1 THEN now() ELSE o.published_at END,
    dead_lettered_at = CASE WHEN u.kind = 3 THEN now() ELSE o.dead_lettered_at END,
    available_at     = CASE WHEN u.kind = 2 THEN now() + u.delay_ms * interval '1 millisecond'
                            ELSE o.available_at END,
    attempt_count    = CASE WHEN u.kind = 4 THEN o.attempt_count - 1 ELSE o.attempt_count END,
    last_error       = CASE WHEN u.kind IN (2, 3) THEN u.error
                            WHEN u.kind = 1 THEN NULL
                            ELSE o.last_error END,
    locked_until     = NULL
FROM unnest($1::bigint[], $2::int4[], $3::int2[], $4::int8[], $5::text[], $6::int8[])
     AS u(id, attempt, kind, delay_ms, error, token),
     outbox_relay_shard_leases AS l
WHERE o.id = u.id
  AND o.attempt_count = u.attempt
  AND l.shard = o.shard AND l.token = u.token AND l.lease_until > now()
  AND coalesce(o.published_at, o.dead_lettered_at) IS NULL
RETURNING o.id";

pub const MARK_TYPES: &[Type] = &[
    Type::INT8_ARRAY,
    Type::INT4_ARRAY,
    Type::INT2_ARRAY,
    Type::INT8_ARRAY,
    Type::TEXT_ARRAY,
    Type::INT8_ARRAY,
];

pub enum MarkerMsg {
    Outcomes(Vec<Marked>),
    /// The flush timer fired.
    Flush,
    /// Write everything pending now; replies when written (or given up).
    FlushNow(RpcReplyPort<()>),
    /// Give back the leases of rows that were never delivered; replies with
    /// how many rows it released.
    Release(Vec<Held>, RpcReplyPort<u64>),
}

pub struct Marker;

pub struct MarkerState {
    shared: Arc<Shared>,
    pending: Vec<Marked>,
    conn: Option<(PooledConn, Statement)>,
    flush_scheduled: bool,
    failures: u32,
    wake_after_flush: bool,
}

impl Actor for Marker {
    type Msg = MarkerMsg;
    type State = MarkerState;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        _myself: ActorRef<MarkerMsg>,
        shared: Arc<Shared>,
    ) -> Result<MarkerState, ActorProcessingErr> {
        Ok(MarkerState {
            wake_after_flush: shared.config.any_ordered_route(),
            shared,
            pending: Vec::new(),
            conn: None,
            flush_scheduled: false,
            failures: 0,
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
                if state.pending.len() >= state.shared.config.relay.mark_batch as usize {
                    flush(&myself, state).await;
                } else if !state.flush_scheduled {
                    state.flush_scheduled = true;
                    myself.send_after(state.shared.config.relay.mark_interval, || MarkerMsg::Flush);
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
                    tokio::time::sleep(reconnect_delay(state.failures)).await;
                }
                let _ = reply.send(());
            }
            MarkerMsg::Release(rows, reply) => {
                let released = release(state, &rows).await.unwrap_or_else(|e| {
                    tracing::warn!(error = %e, rows = rows.len(), "could not release leases; they will expire");
                    0
                });
                let _ = reply.send(released);
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
    let mut ids = Vec::with_capacity(state.pending.len());
    let mut attempts = Vec::with_capacity(state.pending.len());
    let mut kinds = Vec::with_capacity(state.pending.len());
    let mut delays = Vec::with_capacity(state.pending.len());
    let mut errors: Vec<Option<&str>> = Vec::with_capacity(state.pending.len());
    let mut tokens = Vec::with_capacity(state.pending.len());
    for marked in &state.pending {
        ids.push(marked.lease.id);
        attempts.push(marked.lease.attempt);
        tokens.push(marked.lease.token);
        let (kind, delay, error) = match &marked.mark {
            Mark::Published => (KIND_PUBLISHED, 0i64, None),
            Mark::Retry { delay, error, .. } => {
                (KIND_RETRY, delay.as_millis() as i64, Some(error.as_str()))
            }
            Mark::Dead { error, .. } => (KIND_DEAD, 0, Some(error.as_str())),
            Mark::Release => (KIND_RELEASE, 0, None),
        };
        kinds.push(kind);
        delays.push(delay);
        errors.push(error);
    }
    let result = execute(
        &mut state.conn,
        &state.shared.pool,
        (&ids, &attempts, &kinds, &delays, &errors, &tokens),
    )
    .await;
    drop(errors);
    match result {
        Ok(applied) => {
            state.failures = 0;
            let marked = std::mem::take(&mut state.pending);
            account(&state.shared, &marked, &applied);
            drop(marked); // leases and permits go back here
            gauge!(m::IN_FLIGHT).set(state.shared.in_flight_count() as f64);
            if state.wake_after_flush {
                // An ordered key's next event became claimable just now; do not
                // leave it waiting for the poll interval.
                state.shared.directory.wake_claimers();
            }
            true
        }
        Err(e) => {
            state.failures += 1;
            state.conn = None;
            let delay = reconnect_delay(state.failures);
            tracing::warn!(error = %e, rows = state.pending.len(), retry_in = ?delay, "mark failed; will retry");
            if !state.flush_scheduled {
                state.flush_scheduled = true;
                myself.send_after(delay, || MarkerMsg::Flush);
            }
            false
        }
    }
}

/// The marker's parallel arrays: id, attempt, kind, delay (ms), error, token.
type MarkArrays<'a> = (
    &'a [i64],
    &'a [i32],
    &'a [i16],
    &'a [i64],
    &'a [Option<&'a str>],
    &'a [i64],
);

async fn execute(
    slot: &mut Option<(PooledConn, Statement)>,
    pool: &crate::db::Pool,
    (ids, attempts, kinds, delays, errors, tokens): MarkArrays<'_>,
) -> Result<HashSet<i64>, MarkError> {
    if slot.is_none() {
        let conn = pool.get_owned().await?;
        let stmt = conn.prepare_typed(MARK_SQL, MARK_TYPES).await?;
        *slot = Some((conn, stmt));
    }
    let (conn, stmt) = slot.as_ref().expect("connected above");
    let rows = conn
        .query(stmt, &[&ids, &attempts, &kinds, &delays, &errors, &tokens])
        .await?;
    Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
}

/// Counts what the database took; a mark it refused lost its lease.
fn account(shared: &Shared, marked: &[Marked], applied: &HashSet<i64>) {
    let counters = &shared.counters;
    let routes = shared.router.routes();
    let mut fenced = 0u64;
    for marked in marked {
        if !applied.contains(&marked.lease.id) {
            if marked.mark != Mark::Release {
                fenced += 1;
            }
            continue;
        }
        let route = marked
            .route
            .and_then(|i| routes.get(i))
            .map(|r| r.name.clone())
            .unwrap_or_else(|| "none".to_owned());
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
            Mark::Release => {}
        }
    }
    if fenced > 0 {
        tracing::info!(
            fenced,
            "marks refused: those rows' leases were taken by another claim, or their shard by another replica"
        );
        counter!(m::MARKS_FENCED).increment(fenced);
        counters.fenced.fetch_add(fenced, AtomicOrdering::Relaxed);
    }
}

async fn release(state: &mut MarkerState, rows: &[Held]) -> Result<u64, MarkError> {
    if rows.is_empty() {
        return Ok(0);
    }
    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.attempt).collect();
    let tokens: Vec<i64> = rows.iter().map(|r| r.token).collect();
    let kinds = vec![KIND_RELEASE; rows.len()];
    let delays = vec![0i64; rows.len()];
    let errors: Vec<Option<&str>> = vec![None; rows.len()];
    let applied = execute(
        &mut state.conn,
        &state.shared.pool,
        (&ids, &attempts, &kinds, &delays, &errors, &tokens),
    )
    .await?;
    Ok(applied.len() as u64)
}

#[derive(Debug, thiserror::Error)]
enum MarkError {
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    #[error("no database connection: {0}")]
    Pool(#[from] bb8::RunError<tokio_postgres::Error>),
}

/// How long the marker may take to write before a caller stops waiting.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);
