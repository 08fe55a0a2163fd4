//! The schema, applied in order and recorded in `outbox_relay_migrations`.
//!
//! Small on purpose: the migration crates that speak tokio-postgres do not take
//! a lock, and several replicas may start at once. We hold a transaction-scoped
//! advisory lock for the whole run, so concurrent runs queue and the later ones
//! find nothing to do; every migration commits with its record or not at all.

use sha2::{Digest, Sha256};
use tokio_postgres::Client;

/// Every migration the binary knows, in order. Files live in `migrations/`.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "outbox",
        sql: include_str!("../../migrations/0001_outbox.sql"),
    },
    Migration {
        version: 2,
        name: "processed_messages",
        sql: include_str!("../../migrations/0002_processed_messages.sql"),
    },
    Migration {
        version: 3,
        name: "ops",
        sql: include_str!("../../migrations/0003_ops.sql"),
    },
    Migration {
        version: 4,
        name: "shards",
        sql: include_str!("../../migrations/0004_shards.sql"),
    },
    Migration {
        version: 5,
        name: "shard_leases",
        sql: include_str!("../../migrations/0005_shard_leases.sql"),
    },
];

/// Arbitrary, fixed: "outbox-relay migrate" as an advisory lock key.
const MIGRATION_LOCK: i64 = 0x6f75_7462_6f78_6d69;

const CREATE_LEDGER: &str = "CREATE TABLE IF NOT EXISTS outbox_relay_migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)";

#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
}

impl Migration {
    pub fn checksum(&self) -> String {
        let digest = Sha256::digest(self.sql.as_bytes());
        digest.iter().map(|b| format!("{b:02x}")).collect()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("the database has migration {version} ({name}) that this binary does not know; it was migrated by a newer outbox-relay, upgrade this one")]
    UnknownMigration { version: i32, name: String },
    #[error("migration {version} ({name}) was changed after it was applied (checksum {applied} in the database, {expected} in this binary)")]
    ChecksumMismatch {
        version: i32,
        name: String,
        applied: String,
        expected: String,
    },
    #[error("migration {version} ({name}) failed: {source}")]
    Failed {
        version: i32,
        name: &'static str,
        source: tokio_postgres::Error,
    },
    #[error("database: {0}")]
    Postgres(#[from] tokio_postgres::Error),
}

/// What a run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub applied: Vec<i32>,
    pub already: usize,
}

/// Brings the schema up to date. Safe to run from many processes at once.
pub async fn run(client: &mut Client) -> Result<Report, MigrateError> {
    run_to(client, i32::MAX).await
}

/// Applies the migrations up to and including `target` (upgrade tests start
/// from an older schema this way).
pub async fn run_to(client: &mut Client, target: i32) -> Result<Report, MigrateError> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    tx.batch_execute(CREATE_LEDGER).await?;
    let rows = tx
        .query(
            "SELECT version, name, checksum FROM outbox_relay_migrations ORDER BY version",
            &[],
        )
        .await?;
    let mut already = 0;
    for row in &rows {
        let version: i32 = row.get(0);
        let name: String = row.get(1);
        let applied: String = row.get(2);
        let Some(known) = MIGRATIONS.iter().find(|m| m.version == version) else {
            return Err(MigrateError::UnknownMigration { version, name });
        };
        let expected = known.checksum();
        if applied != expected {
            return Err(MigrateError::ChecksumMismatch {
                version,
                name,
                applied,
                expected,
            });
        }
        already += 1;
    }
    let mut applied = Vec::new();
    for m in MIGRATIONS {
        if m.version > target || rows.iter().any(|r| r.get::<_, i32>(0) == m.version) {
            continue;
        }
        tx.batch_execute(m.sql)
            .await
            .map_err(|source| MigrateError::Failed {
                version: m.version,
                name: m.name,
                source,
            })?;
        tx.execute(
            "INSERT INTO outbox_relay_migrations (version, name, checksum) VALUES ($1, $2, $3)",
            &[&m.version, &m.name, &m.checksum()],
        )
        .await?;
        applied.push(m.version);
    }
    tx.commit().await?;
    Ok(Report { applied, already })
}
