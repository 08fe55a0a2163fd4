//! Retention by batched deletes: published outbox rows and consumer dedupe rows
//! past their age, a few thousand rows per statement, each statement its own
//! short transaction, so no lock is held for long and vacuum keeps up between
//! batches. Pending and dead-lettered rows are never deleted.
//!
//! The janitor (`src/janitor.rs`) runs the same from inside the daemon.
//! Several janitors (one per replica) are safe together: they pick the same
//! oldest rows, so the later one waits for the earlier batch, finds its rows
//! gone and stops for this pass.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::Client;

use super::StoreError;

/// What to prune.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PruneOptions {
    /// Delete outbox rows published longer ago than this.
    pub published_older_than: Duration,
    /// Delete `processed_messages` rows older than this; `None` leaves them.
    pub processed_older_than: Option<Duration>,
    /// Rows per DELETE statement (at least 1).
    pub batch: u32,
}

/// What one table's pruning did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TablePrune {
    /// Rows older than this were deleted (the database's clock, taken once).
    pub cutoff: DateTime<Utc>,
    pub deleted: u64,
    /// DELETE statements run, the last one short (or empty): each one a
    /// transaction of at most `batch` rows.
    pub statements: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PruneReport {
    pub outbox: TablePrune,
    /// `None` when `processed_older_than` was not given.
    pub processed_messages: Option<TablePrune>,
}

const CUTOFF_SQL: &str = "SELECT now() - make_interval(secs => $1::float8)";

// Picks the oldest published rows through outbox_published_at_idx and deletes
// them by primary key. The conditions are checked again on the rows being
// deleted, so a row dead-lettered meanwhile (QStash's failure callback marks
// published rows) is left alone. By id rather than ctid: on a partitioned
// outbox a ctid is not unique across partitions.
const DELETE_PUBLISHED_SQL: &str = "
DELETE FROM outbox
WHERE id = ANY(ARRAY(
        SELECT id FROM outbox
        WHERE published_at < $1 AND dead_lettered_at IS NULL
        ORDER BY published_at
        LIMIT $2))
  AND published_at < $1
  AND dead_lettered_at IS NULL";

const DELETE_PROCESSED_SQL: &str = delete_oldest!("processed_messages", "processed_at");

/// Deletes published outbox rows, then (if asked) old `processed_messages`.
/// `client` must not be inside a transaction: every batch commits on its own.
pub async fn prune(client: &Client, options: &PruneOptions) -> Result<PruneReport, StoreError> {
    let outbox = prune_table(
        client,
        Prunable::Published,
        options.published_older_than,
        options.batch,
    )
    .await?;
    let processed_messages = match options.processed_older_than {
        Some(age) => Some(prune_table(client, Prunable::Processed, age, options.batch).await?),
        None => None,
    };
    Ok(PruneReport {
        outbox,
        processed_messages,
    })
}

/// A table pruned oldest rows first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prunable {
    /// Outbox rows published (and not dead-lettered) before the cutoff.
    Published,
    /// Consumers' `processed_messages` rows processed before the cutoff.
    Processed,
}

/// Deletes `table`'s rows older than `now() - older_than`, `batch` at a time,
/// each statement its own transaction.
pub async fn prune_table(
    client: &Client,
    table: Prunable,
    older_than: Duration,
    batch: u32,
) -> Result<TablePrune, StoreError> {
    let sql = match table {
        Prunable::Published => DELETE_PUBLISHED_SQL,
        Prunable::Processed => DELETE_PROCESSED_SQL,
    };
    let cutoff: DateTime<Utc> = client
        .query_one(CUTOFF_SQL, &[&older_than.as_secs_f64()])
        .await?
        .get(0);
    let limit = i64::from(batch.max(1));
    let statement = client.prepare(sql).await?;
    let mut report = TablePrune {
        cutoff,
        deleted: 0,
        statements: 0,
    };
    loop {
        // Autocommit: each statement is its own transaction.
        let n = client.execute(&statement, &[&cutoff, &limit]).await?;
        report.statements += 1;
        report.deleted += n;
        // The cutoff is fixed in the past and new rows are published at now(),
        // so the set only shrinks: a short batch means it is empty.
        if n < limit as u64 {
            return Ok(report);
        }
    }
}
