//! The ordered claims between key walks. A key walk ([`super::outbox`])
//! visits every key of the shard with a pending row, held or not, so with
//! thousands of keys held for callbacks a walk that finds nothing still
//! costs a descent per key. After a walk that came back short (it visited
//! every key and found fewer heads than it could take), the claimer knows
//! the other keys cannot be claimed until something changes them, and what
//! changes a key is seen: a new row moves the id sequence; every write the
//! relay does not make itself (a callback's outcome, an operator's replay)
//! takes an id from it too, without a row; the relay's own marks it sees
//! leave; times the marker wrote (retries, holds) come due. So until then a
//! claim reads only the keys that may have changed
//! ([`Session::recheck_heads`]); [`Session::watch_ids`] lists the ids that
//! appeared, and the claimer walks again when an id without a row has
//! settled ([`crate::actors::claim_plan`]'s `key_watch`).
use tokio_postgres::types::Type;

use super::outbox::{ClaimScope, Claimed, RouteTypes};
use super::{Session, Sql, StoreError};

/// The id sequence's position, the statement snapshot's transaction
/// horizon (`xmin`: the oldest transaction still running; `xmax`: the next
/// to be assigned) and the ids of the visible rows from `$1` (default: `$2`
/// below the position, not below 0) up to the position, at most `$3` of them, in order.
/// An id missing among them is a row not committed yet, an aborted insert,
/// or an id a callback's outcome or a replay took to wake the relays.
const WATCH_IDS: Sql = Sql {
    text: "WITH s AS (
    SELECT pg_sequence_last_value(pg_get_serial_sequence('outbox', 'id')::regclass) AS seq,
           pg_snapshot_xmin(pg_current_snapshot())::text::bigint AS xmin,
           pg_snapshot_xmax(pg_current_snapshot())::text::bigint AS xmax
), w AS (
    SELECT s.*, coalesce($1, greatest(s.seq - $2, 0)) AS from_id FROM s
)
SELECT w.seq, w.xmin, w.xmax, w.from_id,
       ARRAY(SELECT id FROM outbox WHERE id > w.from_id AND id <= w.seq ORDER BY id LIMIT $3)
FROM w",
    types: &[Type::INT8, Type::INT8, Type::INT8],
};

/// The keys a recheck looks at, `keys (bucket, partition_key, id)` with
/// `id` the key's oldest pending row: those of the shard's pending rows with
/// ids in `($since, $upto]` (new since the last look) and the keys
/// `($buckets, $keys)` (whose heads this relay had out and has no longer),
/// within the shard's range (a lost shard: none).
macro_rules! recheck_keys {
    ($since:literal, $upto:literal, $buckets:literal, $keys:literal) => {
        concat!(
            "cand (bucket, partition_key) AS (
    SELECT DISTINCT c.bucket, c.partition_key FROM (
        SELECT o.bucket, o.partition_key FROM outbox AS o
        WHERE o.id > ",
            $since,
            " AND o.id <= ",
            $upto,
            "
          AND o.bucket >= (SELECT bucket_lo FROM fence) AND o.bucket < (SELECT bucket_hi FROM fence)
          AND o.published_at IS NULL AND o.dead_lettered_at IS NULL
        UNION ALL
        SELECT u.bucket, u.partition_key
        FROM unnest(",
            $buckets,
            "::int2[], ",
            $keys,
            "::text[]) AS u(bucket, partition_key)
        WHERE u.bucket >= (SELECT bucket_lo FROM fence) AND u.bucket < (SELECT bucket_hi FROM fence)
    ) AS c
), keys (bucket, partition_key, id) AS (
    SELECT c.bucket, c.partition_key, h.id FROM cand AS c, LATERAL (
        SELECT id FROM outbox
        WHERE bucket = c.bucket AND partition_key = c.partition_key
          AND published_at IS NULL AND dead_lettered_at IS NULL
        ORDER BY id
        LIMIT 1) AS h
)"
        )
    };
}

/// [`super::outbox::CLAIM_HEADS`] over the rechecked keys only: `($3, $4]`
/// the new ids, `($5, $6)` the keys, `$7` the token, `$8` the rows out.
const RECHECK_HEADS: Sql = Sql {
    text: concat!(
        "WITH ",
        fence!("$7"),
        ", ",
        recheck_keys!("$3", "$4", "$5", "$6"),
        ", heads (id) AS (SELECT id FROM keys)",
        checked_heads!("$8")
    ),
    types: &[
        Type::INT8,
        Type::INT2,
        Type::INT8,
        Type::INT8,
        Type::INT2_ARRAY,
        Type::TEXT_ARRAY,
        Type::INT8,
        Type::INT8_ARRAY,
    ],
};

/// [`super::outbox::CLAIM_TYPED_HEADS`] over the rechecked keys only: `$3`,
/// `$4` the route's types, `($5, $6]` the new ids, `($7, $8)` the keys, `$9`
/// the token, `$10` the rows out.
const RECHECK_TYPED_HEADS: Sql = Sql {
    text: concat!(
        "WITH ",
        fence!("$9"),
        ", ",
        recheck_keys!("$5", "$6", "$7", "$8"),
        ", ",
        typed_heads!("$3", "$4"),
        checked_heads!("$10")
    ),
    types: &[
        Type::INT8,
        Type::INT2,
        Type::TEXT,
        Type::TEXT_ARRAY,
        Type::INT8,
        Type::INT8,
        Type::INT2_ARRAY,
        Type::TEXT_ARRAY,
        Type::INT8,
        Type::INT8_ARRAY,
    ],
};

/// What [`Session::watch_ids`] read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IdWatch {
    /// The id sequence's position.
    pub seq: i64,
    /// The snapshot's oldest running transaction, and the next to come.
    pub xmin: i64,
    pub xmax: i64,
    /// The ids above this one were read.
    pub from: i64,
    /// The visible rows' ids in `(from, seq]`, in order (at most the limit).
    pub ids: Vec<i64>,
}

impl Session {
    /// The id sequence's position and the visible ids from `from` (default:
    /// `window` ids below the position) to it, at most `most`; `None` when
    /// `outbox.id` has no sequence or it was never used.
    pub(crate) async fn watch_ids(
        &mut self,
        from: Option<i64>,
        window: i64,
        most: i64,
    ) -> Result<Option<IdWatch>, StoreError> {
        bounded!(self, async {
            let (conn, statement) = self.prepared(&WATCH_IDS).await?;
            let row = conn.query_one(&statement, &[&from, &window, &most]).await?;
            let seq: Option<i64> = row.get(0);
            Ok(seq.map(|seq| IdWatch {
                seq,
                xmin: row.get(1),
                xmax: row.get(2),
                from: row.get(3),
                ids: row.get(4),
            }))
        })
    }

    /// Up to `limit` heads of one ordered route among the keys that may have
    /// changed since its last walk: those of new rows (ids in `(since,
    /// upto]`) and `keys`.
    pub(crate) async fn recheck_heads(
        &mut self,
        scope: &ClaimScope<'_>,
        types: &RouteTypes,
        (since, upto): (i64, i64),
        keys: &[(i16, String)],
        limit: i64,
    ) -> Result<Vec<Claimed>, StoreError> {
        let shard = scope.fence.shard.sql();
        let buckets: Vec<i16> = keys.iter().map(|k| k.0).collect();
        let names: Vec<&str> = keys.iter().map(|k| k.1.as_str()).collect();
        self.query_heads(
            types,
            (&RECHECK_HEADS, &RECHECK_TYPED_HEADS),
            (limit, shard),
            &[
                &since,
                &upto,
                &buckets,
                &names,
                &scope.fence.token,
                &scope.out,
            ],
        )
        .await
    }
}
