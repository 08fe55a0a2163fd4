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
const KIND_DEFER: i16 = 5;

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
    available_at     = CASE WHEN u.kind IN (2, 5) THEN now() + u.delay_ms * interval '1 millisecond'
                            ELSE o.available_at END,
    attempt_count    = CASE WHEN u.kind IN (4, 5) THEN o.attempt_count - 1 ELSE o.attempt_count END,
    last_error       = CASE WHEN u.kind IN (2, 3, 5) THEN u.error
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
    let mut batch = std::mem::take(&mut state.pending);
    let written = write(&mut state.conn, &state.shared.pool, &batch).await;
    // Rows the database refused even alone: the mark is dropped (and so is
    // the lease, which expires); the row stays pending and is delivered again.
    for (i, error) in &written.refused {
        let marked = &batch[*i];
        tracing::error!(
            id = marked.lease.id,
            mark = ?marked.mark,
            %error,
            "the database refused this row's outcome; the row stays pending and will be delivered again"
        );
    }
    counter!(m::MARKS_FAILED).increment(written.refused.len() as u64);
    let refused: HashSet<i64> = written
        .refused
        .iter()
        .map(|(i, _)| batch[*i].lease.id)
        .collect();
    let mut unwritten = vec![false; batch.len()];
    for i in written.unwritten.iter().flat_map(|r| r.clone()) {
        unwritten[i] = true;
    }
    let mut keep = unwritten.iter();
    let (retry, finished): (Vec<Marked>, Vec<Marked>) = batch
        .drain(..)
        .partition(|_| *keep.next().expect("one flag per mark"));
    account(&state.shared, &finished, &written.applied, &refused);
    drop(finished); // leases and permits go back here
    gauge!(m::IN_FLIGHT).set(state.shared.in_flight_count() as f64);
    state.pending = retry;
    match written.error {
        None => {
            state.failures = 0;
            if state.wake_after_flush {
                // An ordered key's next event became claimable just now; do not
                // leave it waiting for the poll interval.
                state.shared.directory.wake_claimers();
            }
            true
        }
        Some(e) => {
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

/// What one flush wrote.
#[derive(Debug, Default)]
struct Written {
    /// Ids whose mark the database applied (the others were fenced).
    applied: HashSet<i64>,
    /// Marks (by position) the database refused even alone, with its error.
    refused: Vec<(usize, String)>,
    /// Marks (by position) not written because the database could not be
    /// reached; kept for the next try.
    unwritten: Vec<std::ops::Range<usize>>,
    error: Option<MarkError>,
}

/// Writes `marks` in one statement. When PostgreSQL refuses the statement
/// for its data (a value it cannot store), the marks are split in halves and
/// written again, down to single rows, so one bad mark never holds back the
/// others; a lost connection stops the flush and leaves the rest for later.
async fn write(
    slot: &mut Option<(PooledConn, Statement)>,
    pool: &crate::db::Pool,
    marks: &[Marked],
) -> Written {
    let mut written = Written::default();
    let mut todo: Vec<std::ops::Range<usize>> = Vec::with_capacity(4);
    todo.push(0..marks.len());
    while let Some(range) = todo.pop() {
        let arrays = MarkArrays::of(&marks[range.clone()]);
        match execute(slot, pool, &arrays).await {
            Ok(applied) => written.applied.extend(applied),
            Err(MarkError::Postgres(e)) if is_data_error(&e) && range.len() > 1 => {
                let mid = range.start + range.len() / 2;
                todo.push(mid..range.end);
                todo.push(range.start..mid);
            }
            Err(MarkError::Postgres(e)) if is_data_error(&e) => {
                written.refused.push((range.start, e.to_string()));
            }
            Err(e) => {
                written.unwritten.push(range);
                written.unwritten.append(&mut todo);
                written.error = Some(e);
                break;
            }
        }
    }
    written
}

/// An error about the values sent (SQLSTATE classes 22 data exception, 23
/// integrity, 54 program limit), not about the connection or the server.
fn is_data_error(e: &tokio_postgres::Error) -> bool {
    e.as_db_error()
        .is_some_and(|db| matches!(&db.code().code()[..2], "22" | "23" | "54"))
}

/// The marker's parallel arrays: id, attempt, kind, delay (ms), error, token.
#[derive(Default)]
struct MarkArrays<'a> {
    ids: Vec<i64>,
    attempts: Vec<i32>,
    kinds: Vec<i16>,
    delays: Vec<i64>,
    errors: Vec<Option<&'a str>>,
    tokens: Vec<i64>,
}

impl<'a> MarkArrays<'a> {
    fn of(marks: &'a [Marked]) -> MarkArrays<'a> {
        let mut a = MarkArrays::default();
        for marked in marks {
            let (kind, delay, error) = match &marked.mark {
                Mark::Published => (KIND_PUBLISHED, 0i64, None),
                Mark::Retry { delay, error, .. } => {
                    (KIND_RETRY, delay.as_millis() as i64, Some(error.as_str()))
                }
                Mark::Dead { error, .. } => (KIND_DEAD, 0, Some(error.as_str())),
                Mark::Release => (KIND_RELEASE, 0, None),
                Mark::Defer { delay, error } => {
                    (KIND_DEFER, delay.as_millis() as i64, Some(error.as_str()))
                }
            };
            a.push(&marked.lease.held(), kind, delay, error);
        }
        a
    }

    fn push(&mut self, held: &Held, kind: i16, delay: i64, error: Option<&'a str>) {
        self.ids.push(held.id);
        self.attempts.push(held.attempt);
        self.kinds.push(kind);
        self.delays.push(delay);
        self.errors.push(error);
        self.tokens.push(held.token);
    }
}

async fn execute(
    slot: &mut Option<(PooledConn, Statement)>,
    pool: &crate::db::Pool,
    a: &MarkArrays<'_>,
) -> Result<HashSet<i64>, MarkError> {
    if slot.is_none() {
        let conn = pool.get_owned().await?;
        let stmt = conn.prepare_typed(MARK_SQL, MARK_TYPES).await?;
        *slot = Some((conn, stmt));
    }
    let (conn, stmt) = slot.as_ref().expect("connected above");
    let rows = conn
        .query(
            stmt,
            &[
                &a.ids,
                &a.attempts,
                &a.kinds,
                &a.delays,
                &a.errors,
                &a.tokens,
            ],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
}

/// Counts what the database took; a mark it did not apply lost its lease
/// (except the `refused` ones, counted apart).
fn account(shared: &Shared, marked: &[Marked], applied: &HashSet<i64>, refused: &HashSet<i64>) {
    let counters = &shared.counters;
    let routes = shared.router.routes();
    let mut fenced = 0u64;
    for marked in marked {
        if !applied.contains(&marked.lease.id) {
            if marked.mark != Mark::Release && !refused.contains(&marked.lease.id) {
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
            Mark::Defer { .. } => {
                counter!(m::DEFERRED, "route" => route).increment(1);
                counters.deferred.fetch_add(1, AtomicOrdering::Relaxed);
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
    let mut arrays = MarkArrays::default();
    for held in rows {
        arrays.push(held, KIND_RELEASE, 0, None);
    }
    let applied = execute(&mut state.conn, &state.shared.pool, &arrays).await?;
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use tokio::sync::Semaphore;

    use super::*;
    use crate::actors::{InFlight, Lease};
    use crate::sink::{DeadReason, RetryReason};
    use crate::testing::{RelayTestDb as _, TestDb};

    /// One mark PostgreSQL cannot store (a NUL in its text) among good ones:
    /// the others are written, the bad one is reported, nothing is kept back.
    #[tokio::test]
    async fn a_mark_the_database_refuses_does_not_hold_back_the_others() {
        let db = TestDb::new().await.unwrap();
        let client = db.client().await.unwrap();
        client
            .batch_execute(
                "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key)
                 SELECT gen_random_uuid(), 'order', 'o' || i, 'order.placed', '{}', 'k' || i
                 FROM generate_series(1, 5) AS i;
                 UPDATE outbox SET attempt_count = 1, locked_until = now() + interval '1 hour';
                 UPDATE outbox_relay_shard_leases
                    SET owner = 'test', token = 7, lease_until = now() + interval '1 hour';",
            )
            .await
            .unwrap();
        let rows = client
            .query("SELECT id, shard FROM outbox ORDER BY id", &[])
            .await
            .unwrap();
        let permits = Arc::new(Semaphore::new(10));
        let in_flight = Arc::new(InFlight::default());
        let marks = [
            Mark::Published,
            Mark::Dead {
                reason: DeadReason::Rejected,
                error: "HTTP 500: \0binary".into(),
            },
            Mark::Retry {
                delay: Duration::from_secs(60),
                reason: RetryReason::ServerError,
                error: "HTTP 503".into(),
            },
            Mark::Published,
            Mark::Published,
        ];
        let batch: Vec<Marked> = rows
            .iter()
            .zip(marks)
            .map(|(row, mark)| {
                let held = Held {
                    id: row.get(0),
                    attempt: 1,
                    shard: row.get(1),
                    token: 7,
                };
                let permit = permits.clone().try_acquire_owned().unwrap();
                Marked {
                    lease: Lease::new(held, Instant::now(), permit, &in_flight),
                    mark,
                    route: None,
                }
            })
            .collect();
        let pool = db.pool(2).unwrap();
        let written = write(&mut None, &pool, &batch).await;
        assert!(written.error.is_none());
        assert!(written.unwritten.is_empty());
        assert_eq!(written.refused.len(), 1);
        assert_eq!(written.refused[0].0, 1, "the mark with the NUL");
        assert_eq!(written.applied.len(), 4);
        let states: Vec<(bool, bool, i64)> = client
            .query(
                "SELECT published_at IS NOT NULL, available_at > now(), id FROM outbox ORDER BY id",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let flags: Vec<(bool, bool)> = states.iter().map(|(p, a, _)| (*p, *a)).collect();
        assert_eq!(
            flags,
            vec![
                (true, false),
                (false, false),
                (false, true),
                (true, false),
                (true, false)
            ]
        );
    }
}
