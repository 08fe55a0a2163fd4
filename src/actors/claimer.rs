//! Claimer: one per shard. Claims a batch of ready rows under a lease in one
//! statement (no transaction held across the network), hands them to the
//! publishers, and claims again at once while batches come back full;
//! otherwise it waits for the listener's wake-up or the poll interval. It never has more
//! rows out than the in-flight permits allow (backpressure).

use std::collections::HashMap;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use metrics::{counter, gauge, histogram};
use outbox_client::row::OutboxRow;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::OwnedSemaphorePermit;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Statement;
use uuid::Uuid;

use super::{reconnect_delay, Held, Lease, Mark, Marked, MarkerMsg, PublisherMsg, Shared};
use crate::db::PooledConn;
use crate::jsonb::{compact_json, parse_headers};
use crate::metrics as m;
use crate::sink::DeadReason;

/// Every claim ends the same way: lease the rows chosen by its `claimable`
/// CTE (`$2` ms) and return them, if the shard (`$3`) is still held under the
/// fencing token `$token` and its lease has not ended. A replica that lost the
/// shard claims nothing: the database checks, in the statement itself (the
/// `fence` InitPlan runs first, so a fenced claim scans nothing). Literals only:
/// the SQL stays constant.
///
/// The claim commits without waiting for its WAL flush (`synchronous_commit`
/// off for this transaction only, set by the fence). A lease is a hint: if the
/// server crashes before the flush, the rows come back unleased with their old
/// `attempt_count`, the marks of their delivery are refused by the attempt
/// fence, and they are delivered again under the same deduplication id. Never
/// lost, and per-key order of first deliveries holds (the next row of a key is
/// claimable only once the previous one is marked, and a mark waits for its
/// own flush, which covers every earlier commit). Measured at 5,000 events/s:
/// p50 5.70 → 4.40 ms, p99 23.2 → 9.3 ms (loadtest/reports/steady-5k).
macro_rules! claim_statement {
    ($token:literal, $claimable:literal) => {
        concat!(
            "WITH RECURSIVE fence AS (
    SELECT set_config('synchronous_commit', 'off', true)
    FROM outbox_relay_shard_leases
    WHERE shard = $3 AND token = ",
            $token,
            " AND lease_until > now()
), ",
            $claimable,
            "
UPDATE outbox AS o
SET locked_until = now() + $2 * interval '1 millisecond',
    attempt_count = o.attempt_count + 1
FROM claimable
WHERE o.id = claimable.id
  AND EXISTS (SELECT FROM fence)
RETURNING o.id, o.tenant_id, o.aggregate_type, o.aggregate_id, o.event_type,
          o.payload::text, o.headers::text, o.idempotency_key, o.partition_key,
          o.created_at, o.attempt_count, o.available_at"
        )
    };
}

/// Claims up to `$1` ready rows of shard `$3` for `$2` ms, after the cursor
/// `($4, $5)`. The scan walks `outbox_shard_ready_idx` in its order (a claim
/// whose order does not match its index sorts the whole backlog:
/// docs/architecture.md, "Claims and their indexes").
/// The cursor lets a claimer in a burst start after the rows it already has
/// in flight instead of walking past their leases on every claim. `$6`: the
/// shard's fencing token.
pub const CLAIM_SQL: &str = claim_statement!(
    "$6",
    "claimable AS (
    SELECT id FROM outbox
    WHERE shard = $3
      AND published_at IS NULL AND dead_lettered_at IS NULL
      AND available_at <= now()
      AND (available_at, id) > ($4, $5)
      AND (locked_until IS NULL OR locked_until < now())
    ORDER BY shard, available_at, id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
"
);

/// Ordered routes: claims up to `$1` key heads of shard `$3` — each key's
/// oldest undelivered row — whose type goes to an ordered route (`$4`, LIKE
/// patterns) and which are due and not leased. A key whose head is in flight
/// or waiting for a retry has nothing claimable: never two of a key in flight,
/// and a failing event holds its key back.
///
/// The heads are found by skipping from key to key through
/// `outbox_shard_key_idx` (a loose index scan), starting after the key cursor
/// `$5` (the last key the previous claim took) and wrapping around to the
/// first key once the walk passes the last one. The walk is lazy: it stops as
/// soon as `$1` claimable heads are found, so a claim visits about as many
/// keys as it returns instead of every key of the shard. Fairness is
/// therefore key round-robin (each key in turn, from the cursor on), not age
/// order: a due head waits at most one lap of the shard's keys. The two walks
/// (after the cursor, then up to it) cover every key whatever `$5` is, so a
/// stale or misplaced cursor costs fairness, never a key.
///
/// Each head is checked and locked through the primary key, one at a time (a
/// LATERAL subquery with its own `FOR UPDATE SKIP LOCKED`, which the planner
/// cannot flatten into a hash join; the pending test is written as
/// `coalesce(..) IS NULL` so no partial index matches it). Right after a bulk
/// load, before ANALYZE, the planner took the outbox for a tiny table and
/// hashed the whole pending set through `outbox_ready_idx` on every claim:
/// 1.1 s per claim with 1,000,000 rows pending, ~520 events/s for the first
/// minute of a drain (until autoanalyze), for the whole drain without it.
/// `$6`: the shard's fencing token.
pub const CLAIM_HEADS_SQL: &str = claim_statement!(
    "$6",
    "after_cursor (partition_key, id) AS (
    (SELECT partition_key, id FROM outbox
     WHERE shard = $3 AND published_at IS NULL AND dead_lettered_at IS NULL
       AND partition_key > $5
     ORDER BY partition_key, id
     LIMIT 1)
    UNION ALL
    SELECT next.partition_key, next.id
    FROM after_cursor AS prev, LATERAL (
        SELECT partition_key, id FROM outbox
        WHERE shard = $3 AND published_at IS NULL AND dead_lettered_at IS NULL
          AND partition_key > prev.partition_key
        ORDER BY partition_key, id
        LIMIT 1) AS next
), up_to_cursor (partition_key, id) AS (
    (SELECT partition_key, id FROM outbox
     WHERE shard = $3 AND published_at IS NULL AND dead_lettered_at IS NULL
       AND partition_key <= $5
     ORDER BY partition_key, id
     LIMIT 1)
    UNION ALL
    SELECT next.partition_key, next.id
    FROM up_to_cursor AS prev, LATERAL (
        SELECT partition_key, id FROM outbox
        WHERE shard = $3 AND published_at IS NULL AND dead_lettered_at IS NULL
          AND partition_key > prev.partition_key AND partition_key <= $5
        ORDER BY partition_key, id
        LIMIT 1) AS next
), heads (id) AS (
    SELECT id FROM after_cursor
    UNION ALL
    SELECT id FROM up_to_cursor
), claimable AS (
    SELECT head.id FROM heads, LATERAL (
        SELECT o.id FROM outbox AS o
        WHERE o.id = heads.id
          AND coalesce(o.published_at, o.dead_lettered_at) IS NULL
          AND o.available_at <= now()
          AND (o.locked_until IS NULL OR o.locked_until < now())
          AND o.event_type LIKE ANY ($4)
        FOR UPDATE SKIP LOCKED) AS head
    LIMIT $1
)
"
);

/// When some routes are ordered and others are not: the plain claim for the
/// types no ordered route takes (`$6`). `$7`: the shard's fencing token.
pub const CLAIM_UNORDERED_TYPES_SQL: &str = claim_statement!(
    "$7",
    "claimable AS (
    SELECT id FROM outbox
    WHERE shard = $3
      AND published_at IS NULL AND dead_lettered_at IS NULL
      AND available_at <= now()
      AND (available_at, id) > ($4, $5)
      AND (locked_until IS NULL OR locked_until < now())
      AND NOT (event_type LIKE ANY ($6))
    ORDER BY shard, available_at, id
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
"
);

pub const CLAIM_TYPES: &[Type] = &[
    Type::INT8,
    Type::INT8,
    Type::INT2,
    Type::TIMESTAMPTZ,
    Type::INT8,
    Type::INT8,
];
pub const CLAIM_HEADS_TYPES: &[Type] = &[
    Type::INT8,
    Type::INT8,
    Type::INT2,
    Type::TEXT_ARRAY,
    Type::TEXT,
    Type::INT8,
];

/// Where the key walk of [`CLAIM_HEADS_SQL`] resumes after a claim that took
/// `claimed` keys, starting after `cursor`: the last of them in walk order
/// (keys after the cursor come first, then the wrapped ones up to it). `None`
/// when nothing was claimed (the cursor stays). Keys compare bytewise here;
/// under a database collation that orders differently the resume point may
/// be off by some keys, which costs fairness only (see `CLAIM_HEADS_SQL`).
pub fn next_key_cursor<'a>(
    cursor: &str,
    claimed: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    let mut after: Option<&str> = None;
    let mut wrapped: Option<&str> = None;
    for key in claimed {
        let slot = if key > cursor {
            &mut after
        } else {
            &mut wrapped
        };
        if slot.is_none_or(|k| key > k) {
            *slot = Some(key);
        }
    }
    wrapped.or(after).map(str::to_owned)
}
const CLAIM_UNORDERED_TYPES_TYPES: &[Type] = &[
    Type::INT8,
    Type::INT8,
    Type::INT2,
    Type::TIMESTAMPTZ,
    Type::INT8,
    Type::TEXT_ARRAY,
    Type::INT8,
];

/// Where a claim starts when there is no cursor: the beginning of the shard.
pub fn no_cursor() -> (DateTime<Utc>, i64) {
    // Year 1: before any real `available_at`, and inside PostgreSQL's range.
    let start = chrono::NaiveDate::from_ymd_opt(1, 1, 1)
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .expect("a valid date")
        .and_utc();
    (start, i64::MIN)
}

/// How long a wake-up waits before claiming, to gather a burst of inserts.
const WAKE_COALESCE: Duration = Duration::from_millis(1);

/// How long a claimer waits for an in-flight permit before looking again.
const PERMIT_WAIT: Duration = Duration::from_millis(100);

#[derive(Debug)]
pub enum ClaimerMsg {
    /// Claim now.
    Claim,
    /// New rows may be ready (the listener saw the id sequence move).
    Wake,
    /// The poll interval passed since the last idle claim.
    Tick(u64),
}

pub struct Claimer;

pub struct ClaimerArgs {
    pub shard: u32,
    /// The shard's fencing token: this replica's tenure of it.
    pub token: i64,
    pub shared: Arc<Shared>,
}

pub struct ClaimerState {
    shard: i16,
    token: i64,
    /// `(available_at, id)` of the last row of the last full batch: the next
    /// claim of a burst starts after it. Reset whenever a claim comes back short.
    cursor: (DateTime<Utc>, i64),
    /// Ordered claims: the last key the previous key-head claim took; the
    /// next one walks the shard's keys from after it (round-robin).
    key_cursor: String,
    shared: Arc<Shared>,
    conn: Option<Connected>,
    ordered_patterns: Vec<String>,
    /// An ordered route takes every type (`*`): there is no plain claim to run.
    all_ordered: bool,
    /// Which kind of claim gets an odd limit's extra row this time.
    heads_first: bool,
    claim_queued: bool,
    idle_generation: u64,
    failures: u32,
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
        let ordered_patterns = args.shared.router.ordered_like_patterns();
        let all_ordered = ordered_patterns.iter().any(|p| p == "%");
        myself.cast(ClaimerMsg::Claim)?;
        Ok(ClaimerState {
            shard: args.shard as i16,
            token: args.token,
            cursor: no_cursor(),
            key_cursor: String::new(),
            shared: args.shared,
            conn: None,
            ordered_patterns,
            all_ordered,
            heads_first: false,
            claim_queued: true,
            idle_generation: 0,
            failures: 0,
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
    state.idle_generation += 1;
    let generation = state.idle_generation;
    myself.send_after(after, move || ClaimerMsg::Tick(generation));
}

async fn claim_and_dispatch(myself: &ActorRef<ClaimerMsg>, state: &mut ClaimerState) {
    let shared = Arc::clone(&state.shared);
    let now = std::time::Instant::now();
    if let Some(until) = shared.sinks.breakers.all_paused_until(now) {
        // Every route is paused: rows claimed now would only be put back.
        claim_later(myself, state, until - now);
        return;
    }
    let batch = shared.config.relay.claim_batch as usize;
    let Some(mut permit) = take_permits(&shared, batch).await else {
        // Publishers are full: look again shortly (not a busy loop: we waited).
        queue_claim(myself, state);
        return;
    };
    let wanted = permit.num_permits();
    // Measured before the statement: the database's lease ends no earlier.
    let expires = std::time::Instant::now() + shared.config.relay.lease;
    let rows = match claim(state, wanted as i64).await {
        Ok(rows) => {
            state.failures = 0;
            rows
        }
        Err(e) => {
            state.failures += 1;
            let delay = reconnect_delay(state.failures);
            tracing::warn!(shard = state.shard, error = %e, retry_in = ?delay, "claim failed");
            state.conn = None;
            claim_later(myself, state, delay);
            return;
        }
    };
    counter!(m::CLAIMS).increment(1);
    if !rows.is_empty() {
        // Idle polls would drown "rows per claim" in zeros.
        histogram!(m::BATCH_SIZE).record(rows.len() as f64);
    }
    shared
        .counters
        .claimed
        .fetch_add(rows.len() as u64, AtomicOrdering::Relaxed);
    tracing::debug!(
        shard = state.shard,
        claimed = rows.len(),
        wanted,
        "claim batch"
    );
    let got = rows.len();
    let rows: Vec<OutboxRow> = rows.into_iter().map(|(r, _)| r).collect();
    let mut leases = Vec::with_capacity(got);
    for row in &rows {
        let one = permit.split(1).expect("one permit per claimed row");
        let held = Held {
            id: row.id,
            attempt: row.attempt,
            shard: state.shard,
            token: state.token,
        };
        leases.push(Lease::new(held, expires, one, &shared.in_flight));
    }
    drop(permit); // permits for rows we did not get go back
    gauge!(m::IN_FLIGHT).set(shared.in_flight_count() as f64);
    dispatch(&shared, rows, leases);
    if got == wanted {
        // Full: there is probably more right now.
        queue_claim(myself, state);
    } else {
        claim_later(myself, state, shared.config.relay.poll_interval);
    }
}

/// Up to `batch` in-flight permits. When few are free it waits (a little) for
/// a quarter batch: a claim costs about the same for 1 row as for 500, so
/// claiming as soon as one permit frees up would spend the database on tiny
/// claims exactly when the relay is busiest.
async fn take_permits(shared: &Shared, batch: usize) -> Option<OwnedSemaphorePermit> {
    let semaphore = &shared.permits;
    let chunk = (batch / 4).max(1) as u32;
    let mut permit = match semaphore.clone().try_acquire_many_owned(chunk) {
        Ok(p) => p,
        Err(_) => {
            match tokio::time::timeout(PERMIT_WAIT, semaphore.clone().acquire_many_owned(chunk))
                .await
            {
                Ok(Ok(p)) => p,
                // Still short after the wait: take what there is, so a slow
                // destination does not stop the relay altogether.
                _ => semaphore.clone().try_acquire_owned().ok()?,
            }
        }
    };
    let more = batch
        .saturating_sub(permit.num_permits())
        .min(semaphore.available_permits());
    if more > 0 {
        if let Ok(extra) = semaphore.clone().try_acquire_many_owned(more as u32) {
            permit.merge(extra);
        }
    }
    Some(permit)
}

/// A claimer's connection and the statements it prepared on it.
pub struct Connected {
    conn: PooledConn,
    /// The plain claim (all types, or the types no ordered route takes).
    plain: Option<Statement>,
    /// The key-head claim, when a route is ordered.
    heads: Option<Statement>,
}

/// A key-head claim's parameters besides its limit.
struct HeadsClaim<'a> {
    statement: &'a Statement,
    lease_ms: i64,
    shard: i16,
    patterns: &'a [String],
    token: i64,
}

impl HeadsClaim<'_> {
    /// Claims up to `limit` key heads, moving the key cursor on.
    async fn run(
        &self,
        conn: &PooledConn,
        limit: i64,
        key_cursor: &mut String,
    ) -> Result<Vec<tokio_postgres::Row>, ClaimError> {
        let rows = conn
            .query(
                self.statement,
                &[
                    &limit,
                    &self.lease_ms,
                    &self.shard,
                    &self.patterns,
                    &*key_cursor,
                    &self.token,
                ],
            )
            .await?;
        if let Some(next) = next_key_cursor(key_cursor, rows.iter().map(|r| r.get::<_, &str>(8))) {
            *key_cursor = next;
        }
        Ok(rows)
    }
}

/// The claimed rows with their `available_at`, in id order.
async fn claim(
    state: &mut ClaimerState,
    limit: i64,
) -> Result<Vec<(OutboxRow, DateTime<Utc>)>, ClaimError> {
    let ordered = !state.ordered_patterns.is_empty();
    if state.conn.is_none() {
        let conn = state.shared.pool.get_owned().await?;
        let plain = match (ordered, state.all_ordered) {
            (false, _) => Some(conn.prepare_typed(CLAIM_SQL, CLAIM_TYPES).await?),
            (true, false) => Some(
                conn.prepare_typed(CLAIM_UNORDERED_TYPES_SQL, CLAIM_UNORDERED_TYPES_TYPES)
                    .await?,
            ),
            (true, true) => None,
        };
        let heads = if ordered {
            Some(
                conn.prepare_typed(CLAIM_HEADS_SQL, CLAIM_HEADS_TYPES)
                    .await?,
            )
        } else {
            None
        };
        state.conn = Some(Connected { conn, plain, heads });
    }
    let c = state.conn.as_ref().expect("connected above");
    let lease_ms = state.shared.config.relay.lease.as_millis() as i64;
    // When both kinds run, each gets half of every claim, and what one leaves
    // the other may take: a large ordered backlog never starves the
    // unordered event types, nor the other way round.
    // An odd limit's extra row goes to each kind in turn.
    state.heads_first = !state.heads_first;
    let heads_share = if c.plain.is_some() {
        (limit + i64::from(state.heads_first)) / 2
    } else {
        limit
    };
    let heads = c.heads.as_ref().map(|statement| HeadsClaim {
        statement,
        lease_ms,
        shard: state.shard,
        patterns: &state.ordered_patterns,
        token: state.token,
    });
    let mut rows = Vec::new();
    if let (Some(h), true) = (&heads, heads_share > 0) {
        rows.extend(h.run(&c.conn, heads_share, &mut state.key_cursor).await?);
    }
    // Heads may want more than their share (none was asked, or all were taken).
    let heads_want_more = heads.is_some() && rows.len() as i64 >= heads_share;
    let rest = limit - rows.len() as i64;
    if let (Some(plain), true) = (&c.plain, rest > 0) {
        let (after_available, after_id) = state.cursor;
        // The types-not-ordered claim takes the ordered patterns before the token.
        let mut params: Vec<&(dyn ToSql + Sync)> =
            vec![&rest, &lease_ms, &state.shard, &after_available, &after_id];
        if ordered {
            params.push(&state.ordered_patterns);
        }
        params.push(&state.token);
        let plain_rows = c.conn.query(plain, &params).await?;
        // The plain claim's cursor follows its own rows only (key heads are
        // anywhere in the shard): full, the next claim goes on after them;
        // short, it starts again from the beginning.
        state.cursor = match plain_rows
            .iter()
            .map(|r| (r.get::<_, DateTime<Utc>>(11), r.get::<_, i64>(0)))
            .max()
        {
            Some(last) if plain_rows.len() as i64 == rest => last,
            _ => no_cursor(),
        };
        let short = (plain_rows.len() as i64) < rest;
        rows.extend(plain_rows);
        // The unordered types left room: give it to the ordered heads.
        let room = limit - rows.len() as i64;
        if let (true, true, Some(h)) = (short && room > 0, heads_want_more, &heads) {
            rows.extend(h.run(&c.conn, room, &mut state.key_cursor).await?);
        }
    }
    let mut out: Vec<(OutboxRow, DateTime<Utc>)> = rows
        .iter()
        .map(|r| {
            let row = OutboxRow {
                id: r.get(0),
                tenant_id: r.get::<_, Uuid>(1),
                aggregate_type: r.get(2),
                aggregate_id: r.get(3),
                event_type: r.get(4),
                payload: compact_json(r.get::<_, &str>(5)),
                headers: parse_headers(r.get::<_, &str>(6)),
                idempotency_key: r.get(7),
                partition_key: r.get(8),
                created_at: r.get::<_, DateTime<Utc>>(9),
                attempt: r.get(10),
            };
            (row, r.get::<_, DateTime<Utc>>(11))
        })
        .collect();
    // RETURNING has no order; publish in id order.
    out.sort_unstable_by_key(|(r, _)| r.id);
    Ok(out)
}

#[derive(Debug, thiserror::Error)]
enum ClaimError {
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    #[error("no database connection: {0}")]
    Pool(#[from] bb8::RunError<tokio_postgres::Error>),
}

/// Groups rows by route and sends publisher-sized jobs; rows no route takes
/// go straight to the marker as dead letters.
fn dispatch(shared: &Shared, rows: Vec<OutboxRow>, leases: Vec<Lease>) {
    let mut groups: HashMap<Option<usize>, (Vec<OutboxRow>, Vec<Lease>)> = HashMap::new();
    let mut unrouted = Vec::new();
    for (row, lease) in rows.into_iter().zip(leases) {
        match shared.router.route(&row.event_type) {
            Some(route) => {
                let g = groups.entry(Some(route.index)).or_default();
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
        send_to_marker(shared, unrouted);
    }
    let chunk = shared.config.qstash.batch_size as usize;
    for (route, (rows, leases)) in groups {
        let route = route.expect("grouped by route");
        let mut rows = rows.into_iter();
        let mut leases = leases.into_iter();
        loop {
            let part_rows: Vec<OutboxRow> = rows.by_ref().take(chunk).collect();
            if part_rows.is_empty() {
                break;
            }
            let part_leases: Vec<Lease> = leases.by_ref().take(part_rows.len()).collect();
            let Some(publisher) = shared.directory.next_publisher() else {
                // All publishers are restarting: the leases expire and the rows
                // are claimed again.
                tracing::warn!(
                    rows = part_rows.len(),
                    "no publisher available; rows wait for their lease to expire"
                );
                continue;
            };
            let job = PublisherMsg::Publish {
                route,
                rows: part_rows,
                leases: part_leases,
            };
            if let Err(e) = publisher.cast(job) {
                tracing::warn!(error = %e, "publisher gone; rows wait for their lease to expire");
            }
        }
    }
}

pub(crate) fn send_to_marker(shared: &Shared, marked: Vec<Marked>) {
    match shared.directory.marker() {
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
