//! `outbox-relay dlq …`: look at dead-lettered outbox rows, replay them, or
//! purge them. Library functions first (tests and embedders call them), the
//! clap commands and their output after.
//!
//! A replay gives the row a new idempotency key, `<original>:replay:<n>`, so
//! QStash's deduplication window does not swallow the second delivery.

use std::io::Write;
use std::process::ExitCode;

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use serde::Serialize;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, GenericClient};

use crate::config::Config;
use crate::db;

/// Rows one replay or purge statement touches.
const BATCH: i64 = 500;

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

const LIST: &str = concat!(
    "SELECT id, event_type, partition_key, attempt_count, dead_lettered_at, last_error
FROM outbox WHERE ",
    dead_rows_where!(),
    "
ORDER BY dead_lettered_at DESC, id DESC
LIMIT $5"
);

const COUNT: &str = concat!("SELECT count(*) FROM outbox WHERE ", dead_rows_where!());

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
    dead_lettered_at = NULL,
    published_at = NULL,
    available_at = now(),
    attempt_count = 0,
    locked_until = NULL,
    last_error = NULL
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

const REPLAY_ONE: &str = "UPDATE outbox
SET idempotency_key = $2,
    dead_lettered_at = NULL,
    published_at = NULL,
    available_at = now(),
    attempt_count = 0,
    locked_until = NULL,
    last_error = NULL
WHERE id = $1";

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

#[derive(Debug, thiserror::Error)]
pub enum DlqError {
    #[error("choose the rows: --id, --event-type, --since/--until, or --all")]
    NoSelector,
    #[error("no outbox row {0}")]
    NotFound(i64),
    #[error("cannot find a free replay key for row {id} (tried up to {last:?})")]
    NoFreeKey { id: i64, last: String },
    #[error("database: {0}")]
    Postgres(#[from] tokio_postgres::Error),
}

/// Which dead rows a replay or purge touches. Filters combine with AND;
/// `all` alone means every dead row.
#[derive(Debug, Clone, Default, PartialEq, Args)]
#[group(required = true, multiple = true)]
pub struct Selector {
    /// This row (repeat for several).
    #[arg(long = "id", value_name = "ID")]
    pub ids: Vec<i64>,
    /// Rows of this event type.
    #[arg(long, value_name = "TYPE")]
    pub event_type: Option<String>,
    /// Dead-lettered at or after: RFC 3339 (2024-05-01T12:00:00Z) or an age (2h, 3days).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub since: Option<DateTime<Utc>>,
    /// Dead-lettered before: RFC 3339 or an age.
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub until: Option<DateTime<Utc>>,
    /// Every dead row (the other filters still narrow it).
    #[arg(long)]
    pub all: bool,
}

impl Selector {
    fn check(&self) -> Result<(), DlqError> {
        let chosen = self.all
            || !self.ids.is_empty()
            || self.event_type.is_some()
            || self.since.is_some()
            || self.until.is_some();
        if chosen {
            Ok(())
        } else {
            Err(DlqError::NoSelector)
        }
    }
}

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

    fn of(selector: &Selector) -> Self {
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

/// `--since 2h` or `--since 2024-05-01T12:00:00Z`.
pub fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    let age = humantime::parse_duration(s)
        .map_err(|_| format!("{s:?} is neither an RFC 3339 time nor a duration like 2h"))?;
    chrono::Duration::from_std(age)
        .ok()
        .and_then(|age| Utc::now().checked_sub_signed(age))
        .ok_or_else(|| format!("{s:?} reaches too far back"))
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

/// Dead rows, the most recently dead-lettered first.
pub async fn list(
    client: &impl GenericClient,
    event_type: Option<&str>,
    since: Option<DateTime<Utc>>,
    limit: i64,
) -> Result<Vec<DeadRow>, DlqError> {
    let filter = FilterParams::new(&[], event_type, since, None);
    let rows = client
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
pub async fn count(client: &impl GenericClient, selector: &Selector) -> Result<i64, DlqError> {
    selector.check()?;
    let filter = FilterParams::of(selector);
    Ok(client
        .query_typed_one(COUNT, &filter.with(&[]))
        .await?
        .get(0))
}

/// Every column of one outbox row (dead or not), in table order.
pub async fn show(
    client: &impl GenericClient,
    id: i64,
) -> Result<Vec<(String, serde_json::Value)>, DlqError> {
    let rows = client.query_typed(SHOW, &[(&id, Type::INT8)]).await?;
    if rows.is_empty() {
        return Err(DlqError::NotFound(id));
    }
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// A replayed row and the idempotency key it will be delivered under.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Replayed {
    pub id: i64,
    pub idempotency_key: String,
}

/// Puts the chosen dead rows back to pending with new idempotency keys.
pub async fn replay(client: &mut Client, selector: &Selector) -> Result<Vec<Replayed>, DlqError> {
    selector.check()?;
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

async fn replay_batch_one_by_one(
    tx: &tokio_postgres::Transaction<'_>,
    filter: &FilterParams,
    after: i64,
) -> Result<Vec<Replayed>, DlqError> {
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
                return Err(DlqError::NoFreeKey {
                    id,
                    last: candidate,
                })
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

/// Deletes the chosen dead rows; returns their ids.
pub async fn purge(client: &mut Client, selector: &Selector) -> Result<Vec<i64>, DlqError> {
    selector.check()?;
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

// ───────────────────────────── the commands ─────────────────────────────

#[derive(Debug, Clone, PartialEq, Subcommand)]
pub enum DlqCommand {
    /// List dead-lettered rows, the most recent first.
    List {
        /// Only rows of this event type.
        #[arg(long, value_name = "TYPE")]
        event_type: Option<String>,
        /// Dead-lettered at or after: RFC 3339 or an age (2h, 3days).
        #[arg(long, value_name = "TIME", value_parser = parse_time)]
        since: Option<DateTime<Utc>>,
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Show one outbox row, every column, the payload pretty-printed.
    Show {
        id: i64,
        #[arg(long)]
        json: bool,
    },
    /// Put dead rows back to pending, with new idempotency keys.
    Replay {
        #[command(flatten)]
        selector: Selector,
        #[arg(long)]
        json: bool,
    },
    /// Delete dead rows for good (needs --yes).
    Purge {
        #[command(flatten)]
        selector: Selector,
        /// Really delete.
        #[arg(long)]
        yes: bool,
        #[arg(long)]
        json: bool,
    },
}

/// Entry point for `outbox-relay dlq`.
pub async fn run(cmd: DlqCommand, config: &Config) -> anyhow::Result<ExitCode> {
    let mut client = db::connect(&config.database.url).await?;
    let mut stdout = std::io::stdout().lock();
    execute(cmd, &mut client, &mut stdout).await
}

/// Runs a command against `client`, writing what a person or script reads to `out`.
pub async fn execute(
    cmd: DlqCommand,
    client: &mut Client,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    match cmd {
        DlqCommand::List {
            event_type,
            since,
            limit,
            json,
        } => {
            let rows = list(&*client, event_type.as_deref(), since, limit).await?;
            if json {
                write_json(out, &rows)?;
            } else if rows.is_empty() {
                writeln!(out, "no dead-lettered rows")?;
            } else {
                let cells = rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.id.to_string(),
                            r.event_type.clone(),
                            r.partition_key.clone(),
                            r.attempt_count.to_string(),
                            r.dead_lettered_at
                                .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                            one_line(r.last_error.as_deref().unwrap_or(""), 80),
                        ]
                    })
                    .collect::<Vec<_>>();
                write!(
                    out,
                    "{}",
                    table(
                        &[
                            "ID",
                            "TYPE",
                            "PARTITION KEY",
                            "ATTEMPTS",
                            "DEAD-LETTERED AT",
                            "LAST ERROR"
                        ],
                        &cells
                    )
                )?;
            }
        }
        DlqCommand::Show { id, json } => {
            let columns = show(&*client, id).await?;
            if json {
                let map: serde_json::Map<String, serde_json::Value> = columns.into_iter().collect();
                write_json(out, &map)?;
            } else {
                let width = columns.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
                for (name, value) in columns {
                    let text = match &value {
                        serde_json::Value::Null => "-".to_owned(),
                        serde_json::Value::String(s) => s.clone(),
                        serde_json::Value::Object(_) | serde_json::Value::Array(_) => {
                            serde_json::to_string_pretty(&value)?
                        }
                        other => other.to_string(),
                    };
                    writeln!(
                        out,
                        "{name:width$}  {}",
                        text.replace('\n', &format!("\n{:width$}  ", ""))
                    )?;
                }
            }
        }
        DlqCommand::Replay { selector, json } => {
            let replayed = replay(client, &selector).await?;
            if json {
                write_json(
                    out,
                    &serde_json::json!({"replayed": replayed.len(), "rows": replayed}),
                )?;
            } else {
                writeln!(out, "replayed {} dead-lettered rows", replayed.len())?;
            }
        }
        DlqCommand::Purge {
            selector,
            yes,
            json,
        } => {
            if !yes {
                let n = count(&*client, &selector).await?;
                writeln!(
                    out,
                    "refusing to delete {n} dead-lettered rows without --yes"
                )?;
                return Ok(ExitCode::from(2));
            }
            let purged = purge(client, &selector).await?;
            if json {
                write_json(
                    out,
                    &serde_json::json!({"purged": purged.len(), "ids": purged}),
                )?;
            } else {
                writeln!(out, "purged {} dead-lettered rows", purged.len())?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn write_json(out: &mut dyn Write, value: &impl Serialize) -> anyhow::Result<()> {
    serde_json::to_writer_pretty(&mut *out, value)?;
    writeln!(out)?;
    Ok(())
}

/// At most `max` characters on one line.
fn one_line(s: &str, max: usize) -> String {
    let flat: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= max {
        flat
    } else {
        let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}

/// Left-aligned columns separated by two spaces.
fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                text.push_str("  ");
            }
            text.push_str(cell);
            let pad = widths[i].saturating_sub(cell.chars().count());
            text.extend(std::iter::repeat_n(' ', pad));
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
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
    fn table_aligns_columns_by_characters() {
        let t = table(
            &["ID", "TYPE"],
            &[vec!["1".into(), "é".into()], vec!["100".into(), "x".into()]],
        );
        assert_eq!(t, "ID   TYPE\n1    é\n100  x\n");
    }

    #[test]
    fn times_are_rfc3339_or_ages() {
        assert_eq!(
            parse_time("2024-05-01T12:00:00Z").unwrap(),
            DateTime::parse_from_rfc3339("2024-05-01T12:00:00+00:00").unwrap()
        );
        let two_hours_ago = parse_time("2h").unwrap();
        let age = Utc::now() - two_hours_ago;
        assert!(
            age >= chrono::Duration::hours(2)
                && age < chrono::Duration::hours(2) + chrono::Duration::minutes(1)
        );
        assert!(parse_time("yesterday-ish").is_err());
    }
}
