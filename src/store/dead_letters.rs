//! Dead-lettered rows: list them, read one, replay them (back to pending under
//! a new idempotency key, `<original>:replay:<n>`, so QStash's deduplication
//! window does not swallow the second delivery) or purge them. In batches of
//! [`BATCH`] rows, each its own short transaction.

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;

use super::{Store, StoreError};

/// Which dead rows a replay or purge touches. Filters combine with AND;
/// `all` alone means every dead row; nothing at all is refused.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selection {
    pub ids: Vec<i64>,
    pub event_type: Option<String>,
    /// Dead-lettered at or after.
    pub since: Option<DateTime<Utc>>,
    /// Dead-lettered before.
    pub until: Option<DateTime<Utc>>,
    pub all: bool,
    /// SQL `LIKE` patterns of the event types that ordered routes take
    /// (`Router::ordered_like_patterns`): a replay of such a row must not
    /// reach the destination after a newer event of its key.
    pub ordered: Vec<String>,
    /// Replay such rows even so.
    pub allow_reorder: bool,
}

impl Selection {
    fn check(&self) -> Result<(), StoreError> {
        let chosen = self.all
            || !self.ids.is_empty()
            || self.event_type.is_some()
            || self.since.is_some()
            || self.until.is_some();
        if chosen {
            Ok(())
        } else {
            Err(StoreError::Refused(
                "choose the rows: --id, --event-type, --since/--until, or --all".into(),
            ))
        }
    }
}

/// Rows one replay or purge statement touches.
pub(crate) const BATCH: i64 = 500;

/// The part of every statement that picks dead rows. `$1` ids (NULL: any),
/// `$2` event type, `$3`/`$4` dead-lettered from (inclusive) / until (exclusive).
macro_rules! dead_rows_where {
    () => {
        "dead_lettered_at IS NOT NULL
  AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
  AND ($2::text IS NULL OR event_type = $2::text)
  AND ($3::timestamptz IS NULL OR dead_lettered_at >= $3::timestamptz)
  AND ($4::timestamptz IS NULL OR dead_lettered_at < $4::timestamptz)"
    };
}

/// What a replay resets besides the deduplication id: the row is pending,
/// due now, with no attempt, hold or error of its earlier life.
macro_rules! replay_resets {
    () => {
        "dead_lettered_at = NULL,
    published_at = NULL,
    available_at = now(),
    attempt_count = 0,
    locked_until = NULL,
    accepted_at = NULL,
    last_error = NULL,
    attempt_log = NULL"
    };
}

const LIST: &str = concat!(
    "SELECT id, event_type, partition_key, attempt_count, dead_lettered_at, last_error
FROM outbox WHERE ",
    dead_rows_where!(),
    "
ORDER BY dead_lettered_at DESC, id DESC
LIMIT $5"
);

const COUNT: &str = concat!("SELECT count(*) FROM outbox WHERE ", dead_rows_where!());

/// The keys of chosen dead rows of ordered routes (`$5`: their event types'
/// `LIKE` patterns) that have a newer row the destination (or QStash)
/// took already: replayed, they would arrive after it. With how many such
/// rows each.
const OVERTAKEN: &str = concat!(
    "SELECT d.partition_key, count(*)
FROM outbox d
WHERE ",
    dead_rows_where!(),
    "
  AND d.event_type LIKE ANY($5::text[])
  AND EXISTS (
    SELECT 1 FROM outbox n
    WHERE n.partition_key = d.partition_key AND n.id > d.id
      AND (n.published_at IS NOT NULL OR n.accepted_at IS NOT NULL))
GROUP BY d.partition_key
ORDER BY d.partition_key"
);

/// Keys named in a refusal; the rest are counted.
const KEYS_NAMED: usize = 10;

// Every column, in table order, whatever columns later migrations add.
const SHOW: &str = "SELECT f.key, f.value
FROM outbox o, json_each(row_to_json(o)) AS f
WHERE o.id = $1";

// `$6` is a cursor on id, so a row that dies again while we work is not
// replayed twice in one run.
const REPLAY_BATCH: &str = concat!(
    "WITH picked AS (
    SELECT id, idempotency_key FROM outbox
    WHERE ",
    dead_rows_where!(),
    "
      AND id > $6
    ORDER BY id
    LIMIT $5
    FOR UPDATE
), keyed AS (
    SELECT id,
           coalesce(substring(idempotency_key FROM '^(.*):replay:[0-9]{1,18}$'), idempotency_key) AS base,
           coalesce(substring(idempotency_key FROM ':replay:([0-9]{1,18})$')::bigint, 0) + 1 AS n
    FROM picked
)
UPDATE outbox o
SET idempotency_key = k.base || ':replay:' || k.n,
    ",
    replay_resets!(),
    "
FROM keyed k
WHERE o.id = k.id
RETURNING o.id, o.idempotency_key"
);

const PICK_BATCH: &str = concat!(
    "SELECT id, idempotency_key FROM outbox WHERE ",
    dead_rows_where!(),
    "
  AND id > $6
ORDER BY id
LIMIT $5
FOR UPDATE"
);

const KEY_TAKEN: &str = "SELECT EXISTS (SELECT 1 FROM outbox WHERE idempotency_key = $1)";

const REPLAY_ONE: &str = concat!(
    "UPDATE outbox
SET idempotency_key = $2,
    ",
    replay_resets!(),
    "
WHERE id = $1"
);

const PURGE_BATCH: &str = concat!(
    "DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox WHERE ",
    dead_rows_where!(),
    "
      AND id > $6
    ORDER BY id
    LIMIT $5
)
RETURNING id"
);

/// Wakes the relays now rather than at their next poll: their listener
/// watches the outbox's id sequence (one id is spent).
const WAKE_RELAYS: &str = "SELECT nextval(pg_get_serial_sequence('outbox', 'id'))";

/// The `$1`–`$4` parameters of [`dead_rows_where!`].
struct FilterParams {
    ids: Option<Vec<i64>>,
    event_type: Option<String>,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
}

impl FilterParams {
    fn new(
        ids: &[i64],
        event_type: Option<&str>,
        since: Option<DateTime<Utc>>,
        until: Option<DateTime<Utc>>,
    ) -> Self {
        FilterParams {
            ids: (!ids.is_empty()).then(|| ids.to_vec()),
            event_type: event_type.map(str::to_owned),
            since,
            until,
        }
    }

    fn of(selector: &Selection) -> Self {
        Self::new(
            &selector.ids,
            selector.event_type.as_deref(),
            selector.since,
            selector.until,
        )
    }

    /// The four filter parameters followed by `extra`.
    fn with<'a>(
        &'a self,
        extra: &[(&'a (dyn ToSql + Sync), Type)],
    ) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
        let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![
            (&self.ids, Type::INT8_ARRAY),
            (&self.event_type, Type::TEXT),
            (&self.since, Type::TIMESTAMPTZ),
            (&self.until, Type::TIMESTAMPTZ),
        ];
        params.extend_from_slice(extra);
        params
    }
}

/// One line of `dlq list`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadRow {
    pub id: i64,
    pub event_type: String,
    pub partition_key: String,
    pub attempt_count: i32,
    pub dead_lettered_at: DateTime<Utc>,
    pub last_error: Option<String>,
}

/// A replayed row and the idempotency key it will be delivered under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Replayed {
    pub id: i64,
    pub idempotency_key: String,
}

impl Store {
    /// Dead rows, the most recently dead-lettered first.
    pub async fn dead_letters(
        &self,
        event_type: Option<&str>,
        since: Option<DateTime<Utc>>,
        limit: i64,
    ) -> Result<Vec<DeadRow>, StoreError> {
        let filter = FilterParams::new(&[], event_type, since, None);
        let rows = self
            .conn()
            .await?
            .query_typed(LIST, &filter.with(&[(&limit, Type::INT8)]))
            .await?;
        Ok(rows
            .iter()
            .map(|r| DeadRow {
                id: r.get(0),
                event_type: r.get(1),
                partition_key: r.get(2),
                attempt_count: r.get(3),
                dead_lettered_at: r.get(4),
                last_error: r.get(5),
            })
            .collect())
    }

    /// How many dead rows `selector` picks.
    pub(crate) async fn count_dead(&self, selector: &Selection) -> Result<i64, StoreError> {
        selector.check()?;
        let filter = FilterParams::of(selector);
        Ok(self
            .conn()
            .await?
            .query_typed_one(COUNT, &filter.with(&[]))
            .await?
            .get(0))
    }

    /// Every column of one outbox row (dead or not), in table order.
    pub async fn row_columns(
        &self,
        id: i64,
    ) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        let rows = self
            .conn()
            .await?
            .query_typed(SHOW, &[(&id, Type::INT8)])
            .await?;
        if rows.is_empty() {
            return Err(StoreError::NotFound(format!("no outbox row {id}")));
        }
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// The keys (with how many rows each) of the chosen dead rows of ordered
    /// routes that a newer event of their key, already delivered, would
    /// overtake if they were replayed.
    pub async fn overtaken_keys(
        &self,
        selector: &Selection,
    ) -> Result<Vec<(String, i64)>, StoreError> {
        selector.check()?;
        if selector.ordered.is_empty() {
            return Ok(Vec::new());
        }
        let filter = FilterParams::of(selector);
        let rows = self
            .conn()
            .await?
            .query_typed(
                OVERTAKEN,
                &filter.with(&[(&selector.ordered, Type::TEXT_ARRAY)]),
            )
            .await?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    /// Puts the chosen dead rows back to pending with new idempotency keys.
    /// A row goes back as its key's oldest pending row, so on an ordered
    /// route it is delivered before the key's newer pending events; when a
    /// newer event of its key was delivered already, the replay is refused
    /// (naming the keys) unless `allow_reorder` says otherwise.
    pub async fn replay_dead(&self, selector: &Selection) -> Result<Vec<Replayed>, StoreError> {
        selector.check()?;
        if !selector.allow_reorder {
            let overtaken = self.overtaken_keys(selector).await?;
            if !overtaken.is_empty() {
                return Err(StoreError::Refused(overtaken_refusal(&overtaken)));
            }
        }
        let mut conn = self.conn().await?;
        let client: &mut Client = &mut conn;
        let filter = FilterParams::of(selector);
        let mut replayed = Vec::new();
        let mut after: i64 = i64::MIN;
        loop {
            let tx = client.transaction().await?;
            let attempt = tx
                .query_typed(
                    REPLAY_BATCH,
                    &filter.with(&[(&BATCH, Type::INT8), (&after, Type::INT8)]),
                )
                .await;
            let batch = match attempt {
                Ok(rows) => {
                    tx.commit().await?;
                    rows.iter()
                        .map(|r| Replayed {
                            id: r.get(0),
                            idempotency_key: r.get(1),
                        })
                        .collect::<Vec<_>>()
                }
                // The derived key of some row is taken (a producer reused a key
                // after an earlier replay): redo this batch row by row.
                Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => {
                    tx.rollback().await?;
                    let tx = client.transaction().await?;
                    let batch = replay_batch_one_by_one(&tx, &filter, after).await?;
                    tx.commit().await?;
                    batch
                }
                Err(e) => return Err(e.into()),
            };
            let done = (batch.len() as i64) < BATCH;
            after = batch.iter().map(|r| r.id).max().unwrap_or(after);
            replayed.extend(batch);
            if done {
                break;
            }
        }
        if !replayed.is_empty() {
            client.execute(WAKE_RELAYS, &[]).await?;
        }
        replayed.sort_by_key(|r| r.id);
        Ok(replayed)
    }

    /// Deletes the chosen dead rows; returns their ids.
    pub async fn purge_dead(&self, selector: &Selection) -> Result<Vec<i64>, StoreError> {
        selector.check()?;
        let client = self.conn().await?;
        let filter = FilterParams::of(selector);
        let mut purged = Vec::new();
        let mut after: i64 = i64::MIN;
        loop {
            let rows = client
                .query_typed(
                    PURGE_BATCH,
                    &filter.with(&[(&BATCH, Type::INT8), (&after, Type::INT8)]),
                )
                .await?;
            let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
            let done = (ids.len() as i64) < BATCH;
            after = ids.iter().copied().max().unwrap_or(after);
            purged.extend(ids);
            if done {
                break;
            }
        }
        purged.sort_unstable();
        Ok(purged)
    }
}

/// Why a replay that would reorder keys is refused.
fn overtaken_refusal(overtaken: &[(String, i64)]) -> String {
    let rows: i64 = overtaken.iter().map(|(_, n)| n).sum();
    let mut keys: Vec<String> = overtaken
        .iter()
        .take(KEYS_NAMED)
        .map(|(key, n)| format!("{key} ({n})"))
        .collect();
    if overtaken.len() > KEYS_NAMED {
        keys.push(format!("and {} more keys", overtaken.len() - KEYS_NAMED));
    }
    format!(
        "{rows} dead rows of ordered routes would reach the destination after newer events of their key that were delivered already: {}; leave them out (--id, --event-type, --since/--until) or pass --allow-reorder",
        keys.join(", ")
    )
}

async fn replay_batch_one_by_one(
    tx: &tokio_postgres::Transaction<'_>,
    filter: &FilterParams,
    after: i64,
) -> Result<Vec<Replayed>, StoreError> {
    let rows = tx
        .query_typed(
            PICK_BATCH,
            &filter.with(&[(&BATCH, Type::INT8), (&after, Type::INT8)]),
        )
        .await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let id: i64 = row.get(0);
        let key: String = row.get(1);
        let (base, n) = split_replay_key(&key);
        let mut candidate = String::new();
        for n in n + 1..n + 1000 {
            candidate = format!("{base}:replay:{n}");
            let taken: bool = tx
                .query_typed_one(KEY_TAKEN, &[(&candidate, Type::TEXT)])
                .await?
                .get(0);
            if !taken {
                break;
            }
        }
        let updated = tx
            .execute_typed(REPLAY_ONE, &[(&id, Type::INT8), (&candidate, Type::TEXT)])
            .await;
        match updated {
            Ok(_) => out.push(Replayed {
                id,
                idempotency_key: candidate,
            }),
            Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => {
                return Err(StoreError::Refused(format!(
                    "cannot find a free replay key for row {id} (tried up to {candidate:?})"
                )))
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(out)
}

/// `"k:replay:3"` → `("k", 3)`; any other key → `(key, 0)`. Mirrors the SQL
/// in [`REPLAY_BATCH`].
fn split_replay_key(key: &str) -> (&str, u64) {
    if let Some((base, n)) = key.rsplit_once(":replay:") {
        if !n.is_empty() && n.len() <= 18 && n.bytes().all(|b| b.is_ascii_digit()) {
            if let Ok(n) = n.parse() {
                return (base, n);
            }
        }
    }
    (key, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_keys_count_up_from_the_original() {
        assert_eq!(split_replay_key("order-1"), ("order-1", 0));
        assert_eq!(split_replay_key("order-1:replay:3"), ("order-1", 3));
        assert_eq!(split_replay_key("a:replay:x"), ("a:replay:x", 0));
        assert_eq!(split_replay_key("a:replay:"), ("a:replay:", 0));
    }

    #[test]
    fn a_refusal_names_the_keys_and_counts_the_rest() {
        let overtaken: Vec<(String, i64)> = (0..12).map(|i| (format!("order:k{i}"), 2)).collect();
        let why = overtaken_refusal(&overtaken);
        assert!(why.starts_with("24 dead rows"), "{why}");
        assert!(why.contains("order:k0 (2), order:k1 (2)"), "{why}");
        assert!(!why.contains("order:k10"), "{why}");
        assert!(
            why.contains("and 2 more keys") && why.contains("--allow-reorder"),
            "{why}"
        );
    }

    #[test]
    fn nothing_chosen_is_refused() {
        assert!(Selection::default().check().is_err());
        assert!(Selection {
            all: true,
            ..Default::default()
        }
        .check()
        .is_ok());
        assert!(Selection {
            ids: vec![3],
            ..Default::default()
        }
        .check()
        .is_ok());
    }
}
