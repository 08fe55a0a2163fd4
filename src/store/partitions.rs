//! Our own maintenance of a partitioned outbox (docs/partitioning.md): one
//! partition per UTC day of `created_at`, created ahead, detached and dropped
//! once older than the retention and free of pending and dead-lettered rows.
//!
//! The schema is `migrations/optional/partitioned_outbox.sql`, applied by
//! [`init`]; the DDL runs in SQL functions it defines (`outbox_create_partition`,
//! `outbox_drop_partition`), so a scheduler inside the database (pg_cron) can
//! call the same code, and values reach the DDL through `format(%I, %L)`.

use std::time::Duration;

use chrono::{DateTime, NaiveDate, Utc};
use serde::Serialize;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

/// The optional schema script, applied by [`init`].
pub(crate) const PARTITIONED_OUTBOX_SQL: &str =
    include_str!("../../migrations/optional/partitioned_outbox.sql");

const PARTITION_PREFIX: &str = "outbox_p";

use super::StoreError;

fn not_partitioned() -> StoreError {
    StoreError::Refused(
        "the outbox is not partitioned: run `outbox-relay partitions init` first (docs/partitioning.md)"
            .into(),
    )
}

/// How far ahead to create and how long to keep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaintainOptions {
    /// Partitions exist from today (UTC) through today + `ahead_days`.
    pub ahead_days: u32,
    /// A day's partition is dropped once its last instant is older than this.
    pub retain: Duration,
    /// DDL gives up after waiting this long for its lock, so a long
    /// transaction elsewhere never queues the application's inserts behind us.
    pub lock_timeout: Duration,
    /// Rows per DELETE when pruning `outbox_idempotency_keys`.
    pub batch: u32,
}

impl Default for MaintainOptions {
    fn default() -> Self {
        MaintainOptions {
            ahead_days: 7,
            retain: Duration::from_secs(7 * 24 * 3600),
            lock_timeout: Duration::from_secs(2),
            batch: 5000,
        }
    }
}

/// What happened to one day's partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionAction {
    Created,
    /// Rows of that day are in the default partition; the day stays there.
    DefaultHasRows,
    Dropped,
    /// Kept past retention: it still holds rows to deliver.
    HasPending,
    /// Kept past retention: it holds dead letters (replay or purge them first).
    HasDeadLetters,
    /// Another session held a conflicting lock past `lock_timeout`; retried next run.
    LockTimeout,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PartitionChange {
    pub partition: String,
    pub day: NaiveDate,
    pub action: PartitionAction,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MaintainReport {
    /// Everything that was created, dropped or deliberately left alone.
    pub changes: Vec<PartitionChange>,
    /// Day partitions attached after the run, oldest first.
    pub partitions: Vec<String>,
    /// Rows in `outbox_default` (counted up to 1,000,001); more than zero means
    /// partitions were missing when those rows were written.
    pub default_rows: i64,
    pub idempotency_keys_deleted: u64,
}

impl MaintainReport {
    pub fn count(&self, action: PartitionAction) -> usize {
        self.changes.iter().filter(|c| c.action == action).count()
    }
}

const IS_PARTITIONED_SQL: &str =
    "SELECT coalesce((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass('outbox')), false)";

const TODAY_SQL: &str = "SELECT (now() AT TIME ZONE 'UTC')::date, now()";

const LIST_SQL: &str = "
SELECT c.relname::text
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'outbox'::regclass
ORDER BY 1";

const SET_LOCK_TIMEOUT_SQL: &str = "SELECT set_config('lock_timeout', $1, true)";
const CREATE_SQL: &str = "SELECT outbox_create_partition($1)";
const DROP_SQL: &str = "SELECT outbox_drop_partition($1)";

const DEFAULT_ROWS_SQL: &str =
    "SELECT count(*) FROM (SELECT 1 FROM outbox_default LIMIT 1000001) AS d";

// A key may go once its row is past retention; never while a row with an older
// created_at is still pending or dead, since that row's key must keep rejecting
// duplicates until it is delivered or purged.
const KEYS_CUTOFF_SQL: &str = "
SELECT least($1::timestamptz,
             (SELECT min(created_at) FROM outbox
              WHERE published_at IS NULL AND dead_lettered_at IS NULL),
             (SELECT min(created_at) FROM outbox WHERE dead_lettered_at IS NOT NULL))";

const DELETE_KEYS_SQL: &str = delete_oldest!("outbox_idempotency_keys", "created_at");

/// Is the `outbox` table partitioned?
pub async fn is_partitioned(client: &Client) -> Result<bool, tokio_postgres::Error> {
    Ok(client.query_one(IS_PARTITIONED_SQL, &[]).await?.get(0))
}

/// Replaces the (empty) outbox by the partitioned one, in one transaction,
/// and creates today's and the next `ahead_days` partitions.
pub async fn init(client: &mut Client, ahead_days: u32) -> Result<MaintainReport, StoreError> {
    let tx = client.transaction().await?;
    tx.batch_execute(PARTITIONED_OUTBOX_SQL).await?;
    tx.commit().await?;
    maintain(
        client,
        &MaintainOptions {
            ahead_days,
            // Nothing can be old yet; keep everything.
            retain: Duration::from_secs(u32::MAX as u64),
            ..MaintainOptions::default()
        },
    )
    .await
}

/// Day partitions attached to the outbox, oldest first (`outbox_default` aside).
pub async fn list(client: &Client) -> Result<Vec<(String, NaiveDate)>, StoreError> {
    if !is_partitioned(client).await? {
        return Err(not_partitioned());
    }
    Ok(client
        .query(LIST_SQL, &[])
        .await?
        .iter()
        .filter_map(|r| {
            let name: String = r.get(0);
            let day = partition_day(&name)?;
            Some((name, day))
        })
        .collect())
}

/// Creates the partitions ahead, drops the expired ones, prunes the keys.
/// Each partition's DDL is its own short transaction.
pub async fn maintain(
    client: &mut Client,
    options: &MaintainOptions,
) -> Result<MaintainReport, StoreError> {
    if !is_partitioned(&*client).await? {
        return Err(not_partitioned());
    }
    let row = client.query_one(TODAY_SQL, &[]).await?;
    let today: NaiveDate = row.get(0);
    let now: DateTime<Utc> = row.get(1);
    let retention_cutoff =
        now - chrono::Duration::from_std(options.retain).unwrap_or(chrono::Duration::MAX / 2);
    let mut changes = Vec::new();

    for offset in 0..=options.ahead_days {
        let Some(day) = today.checked_add_days(chrono::Days::new(offset.into())) else {
            break;
        };
        let outcome = partition_ddl(client, CREATE_SQL, day, options.lock_timeout).await?;
        let action = match outcome.as_deref() {
            Some("created") => PartitionAction::Created,
            Some("default_has_rows") => PartitionAction::DefaultHasRows,
            None => PartitionAction::LockTimeout,
            Some(_) => continue, // exists
        };
        changes.push(PartitionChange {
            partition: partition_name(day),
            day,
            action,
        });
    }

    for (name, day) in list(&*client).await? {
        let Some(next_day) = day.succ_opt() else {
            continue;
        };
        let end = next_day.and_hms_opt(0, 0, 0).map(|t| t.and_utc());
        if end.is_none_or(|end| end > retention_cutoff) {
            continue;
        }
        let outcome = partition_ddl(client, DROP_SQL, day, options.lock_timeout).await?;
        let action = match outcome.as_deref() {
            Some("dropped") => PartitionAction::Dropped,
            Some("has_pending") => PartitionAction::HasPending,
            Some("has_dead_letters") => PartitionAction::HasDeadLetters,
            None => PartitionAction::LockTimeout,
            Some(_) => continue, // missing: dropped by someone else meanwhile
        };
        changes.push(PartitionChange {
            partition: name,
            day,
            action,
        });
    }

    let keys_cutoff: DateTime<Utc> = client
        .query_one(KEYS_CUTOFF_SQL, &[&retention_cutoff])
        .await?
        .get(0);
    let limit = i64::from(options.batch.max(1));
    let delete_keys = client.prepare(DELETE_KEYS_SQL).await?;
    let mut idempotency_keys_deleted = 0;
    loop {
        let n = client
            .execute(&delete_keys, &[&keys_cutoff, &limit])
            .await?;
        idempotency_keys_deleted += n;
        if n < limit as u64 {
            break;
        }
    }

    let default_rows = client.query_one(DEFAULT_ROWS_SQL, &[]).await?.get(0);
    let partitions = list(&*client).await?.into_iter().map(|(n, _)| n).collect();
    Ok(MaintainReport {
        changes,
        partitions,
        default_rows,
        idempotency_keys_deleted,
    })
}

/// Runs one partition function in its own transaction under `lock_timeout`;
/// `None` when the lock could not be had in time.
async fn partition_ddl(
    client: &mut Client,
    sql: &str,
    day: NaiveDate,
    lock_timeout: Duration,
) -> Result<Option<String>, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let timeout = format!("{}ms", lock_timeout.as_millis().max(1));
    tx.execute(SET_LOCK_TIMEOUT_SQL, &[&timeout]).await?;
    match tx.query_one(sql, &[&day]).await {
        Ok(row) => {
            let outcome: String = row.get(0);
            tx.commit().await?;
            Ok(Some(outcome))
        }
        // Dropping `tx` rolls it back.
        Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
            tracing::warn!(%day, "partition maintenance gave up waiting for a lock");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// `outbox_p20260131` for 2026-01-31 (the name the SQL functions use).
pub fn partition_name(day: NaiveDate) -> String {
    format!("{PARTITION_PREFIX}{}", day.format("%Y%m%d"))
}

fn partition_day(name: &str) -> Option<NaiveDate> {
    let digits = name.strip_prefix(PARTITION_PREFIX)?;
    if digits.len() != 8 {
        return None;
    }
    NaiveDate::parse_from_str(digits, "%Y%m%d").ok()
}
