//! The outbox's hot path: claims (a read of due rows in one statement),
//! marks (every outcome of a flush in one multi-row UPDATE: the one write an
//! event costs), the drain's progress, and the marks QStash's callbacks ask
//! for. Why each statement is written the way it is: docs/architecture.md,
//! "Claims and their indexes".
//!
//! One write per event. A shard is owned under a fenced lease, so inside it
//! the owner alone reads and marks rows: a claim only reads (no lease is
//! written on the row, no row is locked), the claimer keeps what it handed out
//! in memory ([`crate::actors::inflight`]), and each row is written once, when
//! its outcome is marked. A crash or a lost shard leaves rows unmarked: the
//! next owner reads them again and delivers them under the same deduplication
//! id. The row lease (`locked_until`) is written only to hold a row whose
//! outcome is not known yet: an ordered QStash delivery waiting for its
//! callback, so that no owner, this one or the next, sends the key's next
//! event (or the same one again) before the destination answered.
use std::collections::HashSet;
use std::ops::Range;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::types::Type;
use uuid::Uuid;

use super::{Fence, Session, Sql, Store, StoreError};
use crate::jsonb::{compact_json, parse_headers};
use outbox_client::row::OutboxRow;

/// Every claim starts the same way: the `fence` CTE finds the shard (`$2`)
/// still held under the fencing token `$token`, its lease not ended, and
/// names the shard's range of buckets, `[bucket_lo, bucket_hi)`. A replica
/// that lost the shard reads nothing: the database checks, in the statement
/// itself (the fence is an InitPlan that runs first, so a fenced claim scans
/// nothing), and the lease row, not the relay, says which rows a shard holds,
/// so a relay that has not yet seen a reshard cannot read outside its shard.
/// Literals only: the SQL stays constant.
macro_rules! fence {
    ($token:literal) => {
        concat!(
            "fence AS (
    SELECT bucket_lo, bucket_hi FROM outbox_relay_shard_leases
    WHERE shard = $2 AND token = ",
            $token,
            " AND lease_until > now()
)"
        )
    };
}

/// What a claim returns of each row (see [`claimed`]).
macro_rules! claimed_columns {
    () => {
        "o.id, o.tenant_id, o.aggregate_type, o.aggregate_id, o.event_type,
       o.payload::text, o.headers::text, o.idempotency_key, o.partition_key,
       o.created_at, o.attempt_count, o.available_at, o.bucket,
       o.accepted_at IS NOT NULL"
    };
}

/// Reads up to `$1` ready rows of shard `$2`, after the cursor `($3, $4, $5)`
/// (bucket, available_at, id), leaving out the types an ordered route takes
/// (`$6`, LIKE patterns; none when no route is ordered) and rows held for an
/// outcome (`locked_until`). The scan walks `outbox_bucket_ready_idx` in its
/// order, from the cursor to the end of the shard's range: bucket after
/// bucket, each in ready order (a claim whose order does not match its index
/// sorts the whole backlog). The cursor lets a claimer in a burst start after
/// the rows it already has in flight instead of reading them again on every
/// claim. `$7`: the shard's token.
const CLAIM: Sql = Sql {
    text: concat!(
        "WITH ",
        fence!("$7"),
        "
SELECT ",
        claimed_columns!(),
        "
FROM outbox AS o
WHERE o.bucket >= (SELECT bucket_lo FROM fence) AND o.bucket < (SELECT bucket_hi FROM fence)
  AND o.published_at IS NULL AND o.dead_lettered_at IS NULL
  AND o.available_at <= now()
  AND (o.bucket, o.available_at, o.id) > ($3, $4, $5)
  AND (o.locked_until IS NULL OR o.locked_until < now())
  AND NOT (o.event_type LIKE ANY ($6))
  AND NOT (o.id = ANY ($8))
ORDER BY o.bucket, o.available_at, o.id
LIMIT $1"
    ),
    types: &[
        Type::INT8,
        Type::INT2,
        Type::INT2,
        Type::TIMESTAMPTZ,
        Type::INT8,
        Type::TEXT_ARRAY,
        Type::INT8,
        Type::INT8_ARRAY,
    ],
};

/// Ordered routes: reads up to `$1` key heads of shard `$2` — each key's
/// oldest undelivered row — whose type goes to an ordered route (`$3`, LIKE
/// patterns) and which are due and not held for an outcome. A key whose head
/// waits for a retry or for its outcome has nothing to read, so a failing
/// event holds its key back; a key whose head is in flight here is skipped by
/// the claimer (it knows what it handed out), so never two of a key in flight.
///
/// The heads are found by skipping from key to key through
/// `outbox_bucket_key_idx` (a loose index scan over `(bucket, partition_key)`
/// within the shard's range), starting after the key cursor `($4, $5)` (the
/// bucket and key the previous claim took last) and wrapping around to the
/// range's first key once the walk passes its last one. The walk is lazy: it
/// stops as soon as `$1` heads are found, so a claim visits about as many
/// keys as it returns instead of every key of the shard. Fairness is
/// therefore key round-robin (each key in turn, from the cursor on), not age
/// order: a due head waits at most one lap of the shard's keys. The two walks
/// (after the cursor, then up to it) cover every key whatever the cursor is,
/// so a stale or misplaced cursor costs fairness, never a key.
///
/// Each head is checked through the primary key, one at a time (a LATERAL
/// subquery behind `OFFSET 0`, which the planner cannot flatten into a hash
/// join; the pending test is written as `coalesce(..) IS NULL` so no partial
/// index matches it). Right after a bulk load, before ANALYZE, the planner
/// took the outbox for a tiny table and hashed the whole pending set through
/// `outbox_ready_idx` on every claim: 1.1 s per claim with 1,000,000 rows
/// pending, ~520 events/s for the first minute of a drain (until
/// autoanalyze), for the whole drain without it. `$6`: the shard's token.
pub(super) const CLAIM_HEADS: Sql = Sql {
    text: concat!(
        "WITH RECURSIVE ",
        fence!("$6"),
        ", after_cursor (bucket, partition_key, id) AS (
    (SELECT bucket, partition_key, id FROM outbox
     WHERE bucket >= (SELECT bucket_lo FROM fence) AND bucket < (SELECT bucket_hi FROM fence)
       AND published_at IS NULL AND dead_lettered_at IS NULL
       AND (bucket, partition_key) > ($4, $5)
     ORDER BY bucket, partition_key, id
     LIMIT 1)
    UNION ALL
    SELECT next.bucket, next.partition_key, next.id
    FROM after_cursor AS prev, LATERAL (
        SELECT bucket, partition_key, id FROM outbox
        WHERE bucket < (SELECT bucket_hi FROM fence)
          AND published_at IS NULL AND dead_lettered_at IS NULL
          AND (bucket, partition_key) > (prev.bucket, prev.partition_key)
        ORDER BY bucket, partition_key, id
        LIMIT 1) AS next
), up_to_cursor (bucket, partition_key, id) AS (
    (SELECT bucket, partition_key, id FROM outbox
     WHERE bucket >= (SELECT bucket_lo FROM fence) AND bucket < (SELECT bucket_hi FROM fence)
       AND published_at IS NULL AND dead_lettered_at IS NULL
       AND (bucket, partition_key) <= ($4, $5)
     ORDER BY bucket, partition_key, id
     LIMIT 1)
    UNION ALL
    SELECT next.bucket, next.partition_key, next.id
    FROM up_to_cursor AS prev, LATERAL (
        SELECT bucket, partition_key, id FROM outbox
        WHERE published_at IS NULL AND dead_lettered_at IS NULL
          AND (bucket, partition_key) > (prev.bucket, prev.partition_key)
          AND (bucket, partition_key) <= ($4, $5)
        ORDER BY bucket, partition_key, id
        LIMIT 1) AS next
), heads (id) AS (
    SELECT id FROM after_cursor
    UNION ALL
    SELECT id FROM up_to_cursor
)
SELECT head.* FROM heads, LATERAL (
    SELECT ",
        claimed_columns!(),
        "
    FROM outbox AS o
    WHERE o.id = heads.id
      AND coalesce(o.published_at, o.dead_lettered_at) IS NULL
      AND o.available_at <= now()
      AND (o.locked_until IS NULL OR o.locked_until < now())
      AND o.event_type LIKE ANY ($3)
      AND NOT (o.id = ANY ($7))
    OFFSET 0) AS head
LIMIT $1"
    ),
    types: &[
        Type::INT8,
        Type::INT2,
        Type::TEXT_ARRAY,
        Type::INT2,
        Type::TEXT,
        Type::INT8,
        Type::INT8_ARRAY,
    ],
};

/// One statement for every kind of outcome, the one write a delivery costs:
/// published, retry, dead and held (an ordered QStash delivery QStash took,
/// waiting for the destination's answer) count the attempt; deferred (its
/// route paused) and dead without a send (kind 7) do not. A release writes nothing (the row was never
/// written when it was claimed).
///
/// Fenced three ways: the row's `attempt_count` must still be the one the
/// claim read (so a mark written twice, after a lost answer, applies once),
/// the shard must still be held under the token the row was claimed with
/// (its lease not ended, not taken, not replaced by a reshard: the row's
/// bucket must lie in that tenure's range), and the row must not be final.
/// "Not final" is written `coalesce(…) IS NULL` on purpose: spelled as two
/// `IS NULL` tests it matches the partial indexes' predicate, and with stale
/// statistics (right after a bulk load) the generic plan walked the whole
/// pending set per mark instead of looking the batch up by primary key.
pub(super) const MARK: Sql = Sql {
    text: "UPDATE outbox AS o SET
    published_at     = CASE WHEN u.kind = 1 THEN now() ELSE o.published_at END,
    dead_lettered_at = CASE WHEN u.kind IN (3, 7) THEN now() ELSE o.dead_lettered_at END,
    available_at     = CASE WHEN u.kind IN (2, 5) THEN now() + u.delay_ms * interval '1 millisecond'
                            ELSE o.available_at END,
    attempt_count    = CASE WHEN u.kind IN (5, 7) THEN o.attempt_count ELSE o.attempt_count + 1 END,
    last_error       = CASE WHEN u.kind IN (2, 3, 5, 7) THEN u.error
                            WHEN u.kind IN (1, 6) THEN NULL
                            ELSE o.last_error END,
    locked_until     = CASE WHEN u.kind = 6 THEN now() + u.delay_ms * interval '1 millisecond' END,
    accepted_at      = CASE WHEN u.kind = 6 THEN now() ELSE o.accepted_at END
FROM unnest($1::bigint[], $2::int4[], $3::int2[], $4::int8[], $5::text[], $6::int8[])
     AS u(id, attempt, kind, delay_ms, error, token),
     outbox_relay_shard_leases AS l
WHERE o.id = u.id
  AND o.attempt_count = u.attempt
  AND l.token = u.token AND l.lease_until > now()
  AND o.bucket >= l.bucket_lo AND o.bucket < l.bucket_hi
  AND coalesce(o.published_at, o.dead_lettered_at) IS NULL
RETURNING o.id",
    types: &[
        Type::INT8_ARRAY,
        Type::INT4_ARRAY,
        Type::INT2_ARRAY,
        Type::INT8_ARRAY,
        Type::TEXT_ARRAY,
        Type::INT8_ARRAY,
    ],
};

/// Pending rows that are due (a retry counts as due when it comes within
/// `$1` ms), all pending rows, and the earliest future `available_at`.
const DRAIN_STATE: &str = "SELECT
    count(*) FILTER (WHERE NOT (accepted_at IS NOT NULL AND locked_until > now())
        AND available_at <= now()
        + CASE WHEN attempt_count > 0 THEN $1::int8 * interval '1 millisecond'
               ELSE interval '0' END),
    count(*),
    min(available_at) FILTER (WHERE available_at > now()),
    count(*) FILTER (WHERE accepted_at IS NOT NULL AND locked_until > now())
FROM outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL";

/// QStash gave up on a message: the row is dead-lettered if it is still on
/// the deduplication id the report is about and was published under it.
/// Returns the row's current key, whether it is published, and whether it
/// was marked.
/// "Taken by QStash" is `published_at` (a route without callbacks) or
/// `accepted_at` (an ordered route holding the row for its callback).
const REPORTED_DEAD: &str = "WITH target AS (
    SELECT id, idempotency_key, published_at IS NOT NULL OR accepted_at IS NOT NULL AS taken
    FROM outbox WHERE id = $1
), marked AS (
    UPDATE outbox o
    SET dead_lettered_at = coalesce(o.dead_lettered_at, now()),
        last_error = $2,
        locked_until = NULL
    FROM target t
    WHERE o.id = t.id AND t.idempotency_key = $3 AND t.taken
    RETURNING o.id
), wake AS (
    SELECT nextval(pg_get_serial_sequence('outbox', 'id'))
    WHERE EXISTS (SELECT FROM marked)
)
SELECT t.idempotency_key, t.taken, EXISTS (SELECT 1 FROM marked), (SELECT count(*) FROM wake)
FROM target t";

/// A delivery callback's outcome on a held row (`$2`: 1 delivered, 2 QStash
/// tries again, 3 the last attempt failed), for the attempt under
/// deduplication id `$3`: published, held `$5` ms longer with `$4` as the
/// error, or dead-lettered with it. Only while the row is still on that id
/// and not final. A row whose key may move on wakes the relays (their
/// listeners watch the id sequence). Answers the row's current key, whether
/// it was final already, and whether it was marked; no row when the id is
/// unknown.
const REPORTED_OUTCOME: &str = "WITH target AS (
    SELECT id, idempotency_key, coalesce(published_at, dead_lettered_at) IS NOT NULL AS final
    FROM outbox WHERE id = $1
), marked AS (
    UPDATE outbox o
    SET published_at     = CASE WHEN $2 = 1 THEN now() ELSE o.published_at END,
        dead_lettered_at = CASE WHEN $2 = 3 THEN now() ELSE o.dead_lettered_at END,
        locked_until     = CASE WHEN $2 = 2
                                THEN greatest(o.locked_until, now() + $5 * interval '1 millisecond')
                           END,
        last_error       = CASE WHEN $2 = 1 THEN NULL ELSE $4 END
    FROM target t
    WHERE o.id = t.id AND t.idempotency_key = $3 AND NOT t.final
    RETURNING o.id
), wake AS (
    SELECT nextval(pg_get_serial_sequence('outbox', 'id'))
    WHERE $2 IN (1, 3) AND EXISTS (SELECT FROM marked)
)
SELECT t.idempotency_key, t.final, EXISTS (SELECT 1 FROM marked), (SELECT count(*) FROM wake)
FROM target t";

/// Buckets rows are hashed into (`migrations/0007_buckets.sql`); a shard is
/// a range of them.
pub(crate) const BUCKETS: u32 = 4096;

/// `(bucket, available_at, id)`: where a plain claim goes on from.
pub(crate) type Cursor = (i16, DateTime<Utc>, i64);

/// Where a claim starts when there is no cursor: the beginning of the shard.
pub fn no_cursor() -> Cursor {
    // Year 1: before any real `available_at`, and inside PostgreSQL's range.
    let start = chrono::NaiveDate::from_ymd_opt(1, 1, 1)
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .expect("a valid date")
        .and_utc();
    (i16::MIN, start, i64::MIN)
}

/// Where the key walk of an ordered claim resumes: `(bucket, partition_key)`.
pub(crate) type KeyCursor = (i16, String);

/// The key walk from the start of the shard.
pub(crate) fn no_key_cursor() -> KeyCursor {
    (i16::MIN, String::new())
}

/// A claimed row, when it was due, and its bucket. `row.attempt` is the
/// attempt this delivery will be (one more than the attempts recorded).
#[derive(Debug, Clone)]
pub struct Claimed {
    pub row: OutboxRow,
    pub available_at: DateTime<Utc>,
    pub bucket: i16,
    /// QStash took an earlier attempt and no outcome came back before the
    /// hold ran out (an ordered QStash route whose callback never arrived).
    pub held_before: bool,
}

impl Claimed {
    /// What fences this row's mark, claimed under `fence`.
    pub fn held(&self, fence: Fence) -> Held {
        Held {
            id: self.row.id,
            attempt: self.row.attempt - 1,
            fence,
        }
    }

    /// The plain claim's cursor just after this row.
    pub fn cursor(&self) -> Cursor {
        (self.bucket, self.available_at, self.row.id)
    }
}

/// What a claim asks for, besides its limit and where it starts.
#[derive(Debug, Clone, Copy)]
pub struct ClaimScope<'a> {
    pub fence: Fence,
    /// LIKE patterns of the event types an ordered route takes: the plain
    /// claim leaves them out, the key-head claim takes only them.
    pub ordered: &'a [String],
    /// Rows of the shard the claimer has out (handed out, not yet marked):
    /// both claims leave them out, so a claim reads only rows it can take.
    pub out: &'a [i64],
}

/// A row this relay holds a lease on, with what fences its mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub id: i64,
    /// The row's `attempt_count` as the claim read it: the mark applies only
    /// while it is unchanged.
    pub attempt: i32,
    pub fence: Fence,
}

/// What a mark writes on a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write<'a> {
    /// Delivered: final.
    Published,
    /// Due again after `delay`; the attempt counts.
    Retry { delay: Duration, error: &'a str },
    /// Final, with the reason; the attempt counts when one was made.
    Dead { error: &'a str, attempted: bool },
    /// Not attempted: nothing to write (the claim wrote nothing); the row is
    /// read again by the next claim.
    Release,
    /// Not attempted (its route is paused): due again after `delay`, the
    /// attempt not counted.
    Defer { delay: Duration, error: &'a str },
    /// Taken by QStash for an ordered route; held (no claim reads it) for up
    /// to `delay` until a callback says what the destination answered.
    Hold { delay: Duration },
}

impl Write<'_> {
    /// `(kind, delay ms, error)` as the mark statement takes them.
    fn columns(&self) -> (i16, i64, Option<&str>) {
        match *self {
            Write::Published => (1, 0, None),
            Write::Retry { delay, error } => (2, delay.as_millis() as i64, Some(error)),
            Write::Dead {
                error,
                attempted: true,
            } => (3, 0, Some(error)),
            Write::Dead {
                error,
                attempted: false,
            } => (7, 0, Some(error)),
            Write::Release => unreachable!("a release writes nothing"),
            Write::Defer { delay, error } => (5, delay.as_millis() as i64, Some(error)),
            Write::Hold { delay } => (6, delay.as_millis() as i64, None),
        }
    }
}

/// What one [`Session::mark`] wrote.
#[derive(Debug, Default)]
pub struct Written {
    /// Ids whose mark the database applied (the others were fenced).
    pub applied: HashSet<i64>,
    /// Marks (by position) the database refused even alone, with its error.
    pub refused: Vec<(usize, String)>,
    /// Marks (by position) not written because the database could not be
    /// reached; kept for the next try.
    pub unwritten: Vec<Range<usize>>,
    pub error: Option<StoreError>,
}

/// How far the drain has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DrainState {
    /// Pending rows due now (or retrying within the horizon asked for),
    /// leaving out those held for a delivery callback.
    pub due: i64,
    pub pending: i64,
    /// Rows QStash took for an ordered route, held until its delivery
    /// callback says what the destination answered.
    pub held: i64,
    /// The earliest time a row scheduled for later becomes due.
    pub next_due: Option<DateTime<Utc>>,
}

/// What a delivery callback says of the destination's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryOutcome {
    /// It answered 2xx: published, the key moves on.
    Delivered,
    /// It did not, and QStash tries again: still held, for `hold` more.
    Retrying { hold: Duration },
    /// The last attempt failed: dead-lettered, the key moves on.
    Failed,
}

/// What a delivery callback's mark found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReportedOutcome {
    Marked,
    /// No such row.
    Unknown,
    /// The row has moved on to another deduplication id (a replay).
    Replaced {
        current: String,
    },
    /// Published or dead-lettered already (a callback QStash sent again, or
    /// one that came after the hold ran out and the row was settled).
    Final,
}

/// What a failure callback's mark found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReportedDead {
    /// The row was dead-lettered (or already was).
    Marked,
    /// No such row.
    Unknown,
    /// The row has moved on to another deduplication id (a replay).
    Replaced { current: String },
    /// Not taken by QStash under that id yet: the report is early or forged.
    NotPublished,
}

impl Session {
    /// Reads up to `limit` due rows of the scope's shard after `after`, in
    /// index order, leaving out the types an ordered route takes. Nothing is
    /// written: the caller keeps what it handed out.
    pub async fn claim_due(
        &mut self,
        scope: &ClaimScope<'_>,
        after: Cursor,
        limit: i64,
    ) -> Result<Vec<Claimed>, StoreError> {
        let shard = scope.fence.shard.sql();
        let (after_bucket, after_available, after_id) = after;
        let (conn, statement) = self.prepared(&CLAIM).await?;
        let rows = conn
            .query(
                &statement,
                &[
                    &limit,
                    &shard,
                    &after_bucket,
                    &after_available,
                    &after_id,
                    &scope.ordered,
                    &scope.fence.token,
                    &scope.out,
                ],
            )
            .await?;
        Ok(rows.iter().map(claimed).collect())
    }

    /// Reads up to `limit` key heads of the ordered types, walking the
    /// shard's keys from after `key_cursor` (wrapping around); where the next
    /// walk starts is [`next_key_cursor`] of the heads the caller keeps.
    pub(crate) async fn claim_heads(
        &mut self,
        scope: &ClaimScope<'_>,
        key_cursor: &KeyCursor,
        limit: i64,
    ) -> Result<Vec<Claimed>, StoreError> {
        let shard = scope.fence.shard.sql();
        let (conn, statement) = self.prepared(&CLAIM_HEADS).await?;
        let rows = conn
            .query(
                &statement,
                &[
                    &limit,
                    &shard,
                    &scope.ordered,
                    &key_cursor.0,
                    &key_cursor.1,
                    &scope.fence.token,
                    &scope.out,
                ],
            )
            .await?;
        Ok(rows.iter().map(claimed).collect())
    }

    /// Writes `marks` in one statement. When PostgreSQL refuses the statement
    /// for its data (a value it cannot store), the marks are split in halves
    /// and written again, down to single rows, so one bad mark never holds
    /// back the others; a lost connection stops the flush and leaves the rest
    /// for later.
    pub async fn mark(&mut self, marks: &[(Held, Write<'_>)]) -> Written {
        let mut written = Written::default();
        let mut todo: Vec<Range<usize>> = Vec::with_capacity(4);
        todo.push(0..marks.len());
        while let Some(range) = todo.pop() {
            match self.write(&marks[range.clone()]).await {
                Ok(applied) => written.applied.extend(applied),
                Err(e) if e.is_data_error() && range.len() > 1 => {
                    let mid = range.start + range.len() / 2;
                    todo.push(mid..range.end);
                    todo.push(range.start..mid);
                }
                Err(e) if e.is_data_error() => {
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

    async fn write(&mut self, marks: &[(Held, Write<'_>)]) -> Result<HashSet<i64>, StoreError> {
        let n = marks.len();
        let (mut ids, mut attempts, mut kinds, mut delays, mut errors, mut tokens) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        // A release writes nothing: the claim wrote nothing to undo.
        for (held, write) in marks.iter().filter(|(_, w)| *w != Write::Release) {
            let (kind, delay, error) = write.columns();
            ids.push(held.id);
            attempts.push(held.attempt);
            kinds.push(kind);
            delays.push(delay);
            errors.push(error);
            tokens.push(held.fence.token);
        }
        if ids.is_empty() {
            return Ok(HashSet::new());
        }
        let (conn, statement) = self.prepared(&MARK).await?;
        let rows = conn
            .query(
                &statement,
                &[&ids, &attempts, &kinds, &delays, &errors, &tokens],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
    }
}

impl Store {
    /// How far a drain has come; a retry due within `horizon` counts as due.
    pub(crate) async fn drain_state(&self, horizon: Duration) -> Result<DrainState, StoreError> {
        let horizon_ms = horizon.as_millis() as i64;
        let row = self
            .conn()
            .await?
            .query_one(DRAIN_STATE, &[&horizon_ms])
            .await?;
        Ok(DrainState {
            due: row.get(0),
            pending: row.get(1),
            next_due: row.get(2),
            held: row.get(3),
        })
    }

    /// QStash reports it gave up delivering row `id` under `deduplication_id`:
    /// dead-letter it with `error`, unless the row has moved on since.
    pub(crate) async fn reported_dead(
        &self,
        id: i64,
        error: &str,
        deduplication_id: &str,
    ) -> Result<ReportedDead, StoreError> {
        let row = self
            .conn()
            .await?
            .query_typed_opt(
                REPORTED_DEAD,
                &[
                    (&id, Type::INT8),
                    (&error, Type::TEXT),
                    (&deduplication_id, Type::TEXT),
                ],
            )
            .await?;
        let Some(row) = row else {
            return Ok(ReportedDead::Unknown);
        };
        let (current, taken, marked): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
        Ok(if marked {
            ReportedDead::Marked
        } else if current != deduplication_id {
            ReportedDead::Replaced { current }
        } else {
            debug_assert!(!taken);
            ReportedDead::NotPublished
        })
    }

    /// QStash's delivery callback for row `id` under `deduplication_id`:
    /// write the destination's answer on the held row, unless the row has
    /// moved on since.
    pub(crate) async fn reported_outcome(
        &self,
        id: i64,
        deduplication_id: &str,
        outcome: DeliveryOutcome,
        error: &str,
    ) -> Result<ReportedOutcome, StoreError> {
        let (kind, hold_ms): (i32, i64) = match outcome {
            DeliveryOutcome::Delivered => (1, 0),
            DeliveryOutcome::Retrying { hold } => (2, hold.as_millis() as i64),
            DeliveryOutcome::Failed => (3, 0),
        };
        let row = self
            .conn()
            .await?
            .query_typed_opt(
                REPORTED_OUTCOME,
                &[
                    (&id, Type::INT8),
                    (&kind, Type::INT4),
                    (&deduplication_id, Type::TEXT),
                    (&error, Type::TEXT),
                    (&hold_ms, Type::INT8),
                ],
            )
            .await?;
        let Some(row) = row else {
            return Ok(ReportedOutcome::Unknown);
        };
        let (current, final_, marked): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
        Ok(if marked {
            ReportedOutcome::Marked
        } else if current != deduplication_id {
            ReportedOutcome::Replaced { current }
        } else {
            debug_assert!(final_);
            ReportedOutcome::Final
        })
    }
}

/// Where the key walk of [`CLAIM_HEADS`] resumes after a claim that took
/// `claimed` keys (with their buckets), starting after `cursor`: the last of
/// them in walk order (keys after the cursor come first, then the wrapped
/// ones up to it). `None` when nothing was claimed (the cursor stays). Keys
/// compare bytewise here; under a database collation that orders differently
/// the resume point may be off by some keys, which costs fairness only (see
/// `CLAIM_HEADS`).
pub(crate) fn next_key_cursor<'a>(
    cursor: (i16, &str),
    claimed: impl IntoIterator<Item = (i16, &'a str)>,
) -> Option<KeyCursor> {
    next_key(cursor, claimed).map(|(bucket, key)| (bucket, key.to_owned()))
}

/// The key cursor after `claimed` heads: [`next_key_cursor`] of them, or the
/// cursor as it was when there are none.
pub(crate) fn key_cursor_after(cursor: &KeyCursor, claimed: &[Claimed]) -> KeyCursor {
    next_key_cursor(
        (cursor.0, &cursor.1),
        claimed
            .iter()
            .map(|c| (c.bucket, c.row.partition_key.as_str())),
    )
    .unwrap_or_else(|| cursor.clone())
}

fn next_key<'a>(
    cursor: (i16, &str),
    claimed: impl IntoIterator<Item = (i16, &'a str)>,
) -> Option<(i16, &'a str)> {
    let mut after: Option<(i16, &str)> = None;
    let mut wrapped: Option<(i16, &str)> = None;
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
    wrapped.or(after)
}

fn claimed(r: &tokio_postgres::Row) -> Claimed {
    Claimed {
        row: OutboxRow {
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
            attempt: r.get::<_, i32>(10) + 1,
        },
        available_at: r.get(11),
        bucket: r.get(12),
        held_before: r.get(13),
    }
}
