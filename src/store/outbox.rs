//! The outbox's hot path, its claims: a read of due rows in one statement
//! (the plain claim), and the ordered routes' key-head claims. The marks are
//! in [`super::mark`], the drain's progress in [`super::drain`], the marks
//! QStash's callbacks ask for in [`super::callbacks`]. Why each statement is
//! written the way it is: docs/architecture.md, "Claims and their indexes".
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
use chrono::{DateTime, Utc};
use tokio_postgres::types::{ToSql, Type};
use uuid::Uuid;

use super::mark::Held;
use super::{Fence, Session, Sql, StoreError};
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

/// What the plain claims take of a row `o`: pending and due, not held for
/// an outcome, not an ordered route's (its type's first match among the
/// patterns `$patterns`, whose routes are ordered as `$ordered` says; a row
/// no route takes is read, it is dead-lettered) and not out here (`$out`).
macro_rules! unordered_due {
    ($patterns:literal, $ordered:literal, $out:literal) => {
        concat!(
            "o.published_at IS NULL AND o.dead_lettered_at IS NULL
  AND o.available_at <= now()
  AND (o.locked_until IS NULL OR o.locked_until < now())
  AND NOT coalesce((
      SELECT r.ordered FROM unnest(",
            $patterns,
            "::text[], ",
            $ordered,
            "::bool[]) WITH ORDINALITY AS r(pattern, ordered, n)
      WHERE o.event_type LIKE r.pattern
      ORDER BY r.n
      LIMIT 1), false)
  AND NOT (o.id = ANY (",
            $out,
            "))"
        )
    };
}

/// Reads up to `$1` ready rows of shard `$2`, after the cursor `($3, $4, $5)`
/// (bucket, available_at, id), leaving out the rows an ordered route takes
/// and rows held for an outcome (`locked_until`). Which route takes a row is
/// its type's first match among `$6` (every route's LIKE pattern, in
/// `[[routes]]` order) with `$9` saying whether that route is ordered; a row
/// no route takes is read (it is dead-lettered). The scan walks
/// `outbox_bucket_ready_idx` in its order, from the cursor to the end of the
/// shard's range: bucket after bucket, each in ready order (a claim whose
/// order does not match its index sorts the whole backlog). The cursor lets a
/// claimer in a burst start after the rows it already has in flight instead
/// of reading them again on every claim. `$7`: the shard's token.
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
  AND (o.bucket, o.available_at, o.id) > ($3, $4, $5)
  AND ",
        unordered_due!("$6", "$9", "$8"),
        "
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
        Type::BOOL_ARRAY,
    ],
};

/// The key walk of the ordered claims: `after_cursor` then `up_to_cursor`
/// name every key of the shard with a pending row, `(bucket, partition_key,
/// id)` with `id` the key's oldest pending row of any type, starting after
/// the key cursor (`$b`, `$k`: the bucket and key the previous claim took
/// last) and wrapping around to the range's first key once the walk passes
/// its last one. It skips from key to key through `outbox_bucket_key_idx` (a
/// loose index scan over `(bucket, partition_key)` within the shard's range)
/// and is lazy: it stops as soon as the claim has its heads, so a claim
/// visits about as many keys as it returns instead of every key of the
/// shard. Fairness is therefore key round-robin (each key in turn, from the
/// cursor on), not age order: a due head waits at most one lap of the
/// shard's keys. The two walks cover every key whatever the cursor is, so a
/// stale or misplaced cursor costs fairness, never a key.
macro_rules! key_walk {
    ($b:literal, $k:literal) => {
        concat!(
            "after_cursor (bucket, partition_key, id) AS (
    (SELECT bucket, partition_key, id FROM outbox
     WHERE bucket >= (SELECT bucket_lo FROM fence) AND bucket < (SELECT bucket_hi FROM fence)
       AND published_at IS NULL AND dead_lettered_at IS NULL
       AND (bucket, partition_key) > (",
            $b,
            ", ",
            $k,
            ")
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
       AND (bucket, partition_key) <= (",
            $b,
            ", ",
            $k,
            ")
     ORDER BY bucket, partition_key, id
     LIMIT 1)
    UNION ALL
    SELECT next.bucket, next.partition_key, next.id
    FROM up_to_cursor AS prev, LATERAL (
        SELECT bucket, partition_key, id FROM outbox
        WHERE published_at IS NULL AND dead_lettered_at IS NULL
          AND (bucket, partition_key) > (prev.bucket, prev.partition_key)
          AND (bucket, partition_key) <= (",
            $b,
            ", ",
            $k,
            ")
        ORDER BY bucket, partition_key, id
        LIMIT 1) AS next
), keys AS (
    SELECT bucket, partition_key, id FROM after_cursor
    UNION ALL
    SELECT bucket, partition_key, id FROM up_to_cursor
)"
        )
    };
}

/// The end of an ordered claim: each head found (`heads (id)`) is read
/// through the primary key, one at a time (a LATERAL subquery behind `OFFSET
/// 0`, which the planner cannot flatten into a hash join; the pending test
/// is written as `coalesce(..) IS NULL` so no partial index matches it), and
/// taken if it is due, not held for an outcome and not out here (`$out`),
/// up to `$1` of them. Right after a bulk load, before ANALYZE, the planner
/// took the outbox for a tiny table and hashed the whole pending set through
/// `outbox_ready_idx` on every claim: 1.1 s per claim with 1,000,000 rows
/// pending, ~520 events/s for the first minute of a drain (until
/// autoanalyze), for the whole drain without it.
macro_rules! checked_heads {
    ($out:literal) => {
        concat!(
            "
SELECT head.* FROM heads, LATERAL (
    SELECT ",
            claimed_columns!(),
            "
    FROM outbox AS o
    WHERE o.id = heads.id
      AND coalesce(o.published_at, o.dead_lettered_at) IS NULL
      AND o.available_at <= now()
      AND (o.locked_until IS NULL OR o.locked_until < now())
      AND NOT (o.id = ANY (",
            $out,
            "))
    OFFSET 0) AS head
LIMIT $1"
        )
    };
}

/// An ordered route that takes every event type (`*`, no route before it):
/// reads up to `$1` key heads of shard `$2` — each key's oldest undelivered
/// row, the row `key_walk!` names — that are due and not held for an
/// outcome. A key whose head waits for a retry or for its outcome has
/// nothing to read, so a failing event holds its key back; a key whose head
/// is in flight here gives nothing either (`$6`, the rows out), so never two
/// of a key in flight. `($3, $4)`: the key cursor; `$5`: the shard's token.
pub(super) const CLAIM_HEADS: Sql = Sql {
    text: concat!(
        "WITH RECURSIVE ",
        fence!("$5"),
        ", ",
        key_walk!("$3", "$4"),
        ", heads (id) AS (SELECT id FROM keys)",
        checked_heads!("$6")
    ),
    types: &[
        Type::INT8,
        Type::INT2,
        Type::INT2,
        Type::TEXT,
        Type::INT8,
        Type::INT8_ARRAY,
    ],
};

/// The heads of the keys in `keys (bucket, partition_key)` for an ordered
/// route that takes the event types matching `$like` and none of `$unless`
/// (see [`CLAIM_TYPED_HEADS`]): `heads (id)`, each key's oldest pending row
/// among those types, found through `outbox_bucket_key_type_idx` one pending
/// type at a time, whatever the key's backlog.
macro_rules! typed_heads {
    ($like:literal, $unless:literal) => {
        concat!(
            "heads (id) AS (
    SELECT h.id FROM keys AS k, LATERAL (
        WITH RECURSIVE types (event_type, id) AS (
            (SELECT event_type, id FROM outbox
             WHERE bucket = k.bucket AND partition_key = k.partition_key
               AND published_at IS NULL AND dead_lettered_at IS NULL
             ORDER BY event_type, id
             LIMIT 1)
            UNION ALL
            SELECT next.event_type, next.id
            FROM types AS prev, LATERAL (
                SELECT event_type, id FROM outbox
                WHERE bucket = k.bucket AND partition_key = k.partition_key
                  AND published_at IS NULL AND dead_lettered_at IS NULL
                  AND event_type > prev.event_type
                ORDER BY event_type, id
                LIMIT 1) AS next
        )
        SELECT min(id) AS id FROM types
        WHERE event_type LIKE ",
            $like,
            " AND NOT (event_type LIKE ANY (",
            $unless,
            "))
    ) AS h
    WHERE h.id IS NOT NULL
)"
        )
    };
}

/// An ordered route that takes some event types only: the types matching
/// `$3` and none of `$4` (LIKE patterns; `$4` are the patterns of the routes
/// before it, which take their matches first). A key's head for this route
/// is its oldest pending row among those types, so another route's rows (a
/// paused route's, a backlog of unordered types) never hold this route's
/// events back, and a key's events on different routes are independent.
///
/// For each key of the walk, the head is found without reading the key's
/// rows one by one (a paused route's backlog would make that a scan of all
/// its pending rows on every lap): a second loose index scan, through
/// `outbox_bucket_key_type_idx` (`(bucket, partition_key, event_type, id)`),
/// visits the key's pending event types, one index descent each, and the
/// head is the lowest of their first ids among this route's types. The cost
/// per key is its number of pending types, whatever its backlog.
/// `($5, $6)`: the key cursor; `$7`: the shard's token; `$8`: the rows out.
pub(super) const CLAIM_TYPED_HEADS: Sql = Sql {
    text: concat!(
        "WITH RECURSIVE ",
        fence!("$7"),
        ", ",
        key_walk!("$5", "$6"),
        ", ",
        typed_heads!("$3", "$4"),
        checked_heads!("$8")
    ),
    types: &[
        Type::INT8,
        Type::INT2,
        Type::TEXT,
        Type::TEXT_ARRAY,
        Type::INT2,
        Type::TEXT,
        Type::INT8,
        Type::INT8_ARRAY,
    ],
};

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
    /// Every route, in `[[routes]]` order: the plain claim leaves out the
    /// rows whose first matching route is ordered (empty: it reads every row).
    pub routes: &'a [RoutePattern],
    /// Rows of the shard the claimer has out (handed out, not yet marked):
    /// both claims leave them out, so a claim reads only rows it can take.
    pub out: &'a [i64],
}

/// A route's event types as a claim sees them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePattern {
    /// The types the route matches, as a LIKE pattern.
    pub like: String,
    pub ordered: bool,
}

/// The event types one ordered route takes: those matching `like` and none
/// of `unless` (the patterns of the routes before it, which take their
/// matches first). Its key heads are found among these types only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteTypes {
    pub like: String,
    pub unless: Vec<String>,
}

impl RouteTypes {
    /// Every event type: the key's head is its oldest pending row.
    pub(crate) fn all(&self) -> bool {
        self.like == "%" && self.unless.is_empty()
    }
}

impl Session {
    /// Reads up to `limit` due rows of the scope's shard after `after`, in
    /// index order, leaving out the rows an ordered route takes. Nothing is
    /// written: the caller keeps what it handed out.
    pub async fn claim_due(
        &mut self,
        scope: &ClaimScope<'_>,
        after: Cursor,
        limit: i64,
    ) -> Result<Vec<Claimed>, StoreError> {
        let shard = scope.fence.shard.sql();
        let (after_bucket, after_available, after_id) = after;
        let patterns: Vec<&str> = scope.routes.iter().map(|r| r.like.as_str()).collect();
        let ordered: Vec<bool> = scope.routes.iter().map(|r| r.ordered).collect();
        bounded!(self, async {
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
                        &patterns,
                        &scope.fence.token,
                        &scope.out,
                        &ordered,
                    ],
                )
                .await?;
            Ok(rows.iter().map(claimed).collect())
        })
    }

    /// Reads up to `limit` key heads of one ordered route, whose types are
    /// `types`, walking the shard's keys from after `key_cursor` (wrapping
    /// around); where the next walk starts is [`next_key_cursor`] of the
    /// heads the caller keeps.
    pub(crate) async fn claim_heads(
        &mut self,
        scope: &ClaimScope<'_>,
        types: &RouteTypes,
        key_cursor: &KeyCursor,
        limit: i64,
    ) -> Result<Vec<Claimed>, StoreError> {
        let shard = scope.fence.shard.sql();
        self.query_heads(
            types,
            (&CLAIM_HEADS, &CLAIM_TYPED_HEADS),
            (limit, shard),
            &[&key_cursor.0, &key_cursor.1, &scope.fence.token, &scope.out],
        )
        .await
    }

    /// Runs a heads statement of one ordered route: `all` when the route
    /// takes every type, else `typed`, whose parameters after the limit and
    /// the shard are the route's type patterns; `rest` come after those.
    pub(super) async fn query_heads(
        &mut self,
        types: &RouteTypes,
        (all, typed): (&Sql, &Sql),
        (limit, shard): (i64, i16),
        rest: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Claimed>, StoreError> {
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&limit, &shard];
        let sql = if types.all() {
            all
        } else {
            params.extend([&types.like as &(dyn ToSql + Sync), &types.unless]);
            typed
        };
        params.extend_from_slice(rest);
        bounded!(self, async {
            let (conn, statement) = self.prepared(sql).await?;
            let rows = conn.query(&statement, &params).await?;
            Ok(rows.iter().map(claimed).collect())
        })
    }
}

/// Where the key walk of the ordered claims (`key_walk!`) resumes after a claim that took
/// `claimed` keys (with their buckets), starting after `cursor`: the last of
/// them in walk order (keys after the cursor come first, then the wrapped
/// ones up to it). `None` when nothing was claimed (the cursor stays). Keys
/// compare bytewise here; under a database collation that orders differently
/// the resume point may be off by some keys, which costs fairness only (see
/// `key_walk!`).
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

pub(super) fn claimed(r: &tokio_postgres::Row) -> Claimed {
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
