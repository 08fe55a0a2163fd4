//! The schema, applied in order and recorded in `outbox_relay_migrations`.
//!
//! Online: the runner is built for an outbox that producers are writing to.
//! A migration file is a list of steps (`-- step: <kind>` lines; a file without
//! one is a single transaction):
//!
//! * `transaction`: its statements in one transaction, under a short
//!   `lock_timeout`; a step that cannot get its lock in time rolls back and is
//!   retried, so producers never queue behind a waiting DDL for longer than that.
//! * `batches`: one statement taking a cursor (`$1`, a bigint, starting below
//!   every id) and returning the next one, or NULL when done; each batch is its
//!   own transaction (backfills).
//! * `index <name>`: a `CREATE INDEX CONCURRENTLY IF NOT EXISTS`, outside a
//!   transaction; an INVALID index of that name (a build that died) is dropped
//!   and built again.
//! * `concurrently`: one statement outside a transaction.
//!
//! A migration is recorded once all its steps are done; every step is written
//! to be run again, so a run killed midway is finished by the next one. A
//! session advisory lock makes concurrent runs queue; the later ones find
//! nothing to do.

use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

/// Every migration the binary knows, in order. Files live in `migrations/`.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "outbox",
        sql: include_str!("../../migrations/0001_outbox.sql"),
        // The same schema; only its comments changed.
        also_accepted: &["fc519f58a93127fc71970fb134f1a0c3e895e24a1df5a2588d7519565cc83c8d"],
    },
    Migration {
        version: 2,
        name: "processed_messages",
        sql: include_str!("../../migrations/0002_processed_messages.sql"),
        also_accepted: &[],
    },
    Migration {
        version: 3,
        name: "ops",
        sql: include_str!("../../migrations/0003_ops.sql"),
        // The same index, built in one transaction (before the online runner).
        also_accepted: &["8cdf583ddcad9e03a0259ad16cfb46ccff5c9839d9f2e1e002ebd7de8634207b"],
    },
    Migration {
        version: 4,
        name: "shards",
        sql: include_str!("../../migrations/0004_shards.sql"),
        // The same schema, built in one transaction (before the online runner).
        also_accepted: &["2aa44824a0d248914e7758379d3b1889ddc8a7c59fc31c73b17a4e2818999e84"],
    },
    Migration {
        version: 5,
        name: "shard_leases",
        sql: include_str!("../../migrations/0005_shard_leases.sql"),
        also_accepted: &[],
    },
    Migration {
        version: 6,
        name: "producer_path",
        sql: include_str!("../../migrations/0006_producer_path.sql"),
        also_accepted: &[],
    },
    Migration {
        version: 7,
        name: "buckets",
        sql: include_str!("../../migrations/0007_buckets.sql"),
        also_accepted: &[],
    },
    Migration {
        version: 8,
        name: "held",
        sql: include_str!("../../migrations/0008_held.sql"),
        also_accepted: &[],
    },
];

/// Arbitrary, fixed: "outbox-relay migrate" as an advisory lock key.
const MIGRATION_LOCK: i64 = 0x6f75_7462_6f78_6d69;

/// How long a step waits for a table lock before it gives up and retries.
/// Producers whose inserts queue behind the waiting lock wait at most this.
pub(crate) const LOCK_TIMEOUT: Duration = Duration::from_millis(200);

/// How long a step keeps retrying for its lock before the run fails.
const LOCK_RETRY_FOR: Duration = Duration::from_secs(600);

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
    /// Checksums of earlier texts of this migration that built the same schema.
    pub also_accepted: &'static [&'static str],
}

impl Migration {
    pub fn checksum(&self) -> String {
        let digest = Sha256::digest(self.sql.as_bytes());
        digest.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The migration's steps, in order.
    pub(crate) fn steps(&self) -> Vec<Step> {
        parse_steps(self.sql)
    }
}

/// One unit of a migration (see the module documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    Transaction(String),
    Batches(String),
    Index { name: String, sql: String },
    Concurrently(String),
}

fn parse_steps(sql: &str) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut kind: Option<String> = None;
    let mut body = String::new();
    let mut flush = |kind: Option<String>, body: &mut String| {
        let text = std::mem::take(body);
        if text.lines().all(|l| {
            let l = l.trim();
            l.is_empty() || l.starts_with("--")
        }) {
            return;
        }
        let kind = kind.unwrap_or_else(|| "transaction".to_owned());
        let step = match kind.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["transaction"] => Step::Transaction(text),
            ["batches"] => Step::Batches(text.trim().trim_end_matches(';').to_owned()),
            ["concurrently"] => Step::Concurrently(text),
            ["index", name] => Step::Index {
                name: (*name).to_owned(),
                sql: text,
            },
            other => panic!("unknown migration step kind {other:?}"),
        };
        steps.push(step);
    };
    for line in sql.lines() {
        if let Some(k) = line.trim().strip_prefix("-- step:") {
            flush(kind.take(), &mut body);
            kind = Some(k.trim().to_owned());
        } else {
            body.push_str(line);
            body.push('\n');
        }
    }
    flush(kind, &mut body);
    steps
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
    #[error("migration {version} ({name}) failed at step {step}: {source}")]
    Failed {
        version: i32,
        name: &'static str,
        step: usize,
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

/// Brings the schema up to date. Safe to run from many processes at once,
/// and while producers write to the outbox.
pub async fn run(client: &mut Client) -> Result<Report, MigrateError> {
    run_to(client, i32::MAX).await
}

/// Applies the migrations up to and including `target` (upgrade tests start
/// from an older schema this way).
pub async fn run_to(client: &mut Client, target: i32) -> Result<Report, MigrateError> {
    // Try, not wait: a session blocked in pg_advisory_lock holds a snapshot,
    // and the holder's CREATE INDEX CONCURRENTLY would wait for it (deadlock).
    let mut waited = 0u32;
    while !client
        .query_one("SELECT pg_try_advisory_lock($1)", &[&MIGRATION_LOCK])
        .await?
        .get::<_, bool>(0)
    {
        if waited.is_multiple_of(50) {
            tracing::info!("another migration is running; waiting for it");
        }
        waited += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let result = run_locked(client, target).await;
    // On error the session may be gone, and the lock with it.
    let unlocked = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
        .await;
    let report = result?;
    unlocked?;
    Ok(report)
}

async fn run_locked(client: &mut Client, target: i32) -> Result<Report, MigrateError> {
    client.batch_execute(CREATE_LEDGER).await?;
    let rows = client
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
        if applied != expected && !known.also_accepted.contains(&applied.as_str()) {
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
        for (i, step) in m.steps().iter().enumerate() {
            run_step(client, step)
                .await
                .map_err(|source| MigrateError::Failed {
                    version: m.version,
                    name: m.name,
                    step: i + 1,
                    source,
                })?;
        }
        client
            .execute(
                "INSERT INTO outbox_relay_migrations (version, name, checksum) VALUES ($1, $2, $3)",
                &[&m.version, &m.name, &m.checksum()],
            )
            .await?;
        tracing::info!(version = m.version, name = m.name, "migration applied");
        applied.push(m.version);
    }
    Ok(Report { applied, already })
}

fn lock_timeout_sql(timeout: Duration) -> String {
    format!("SET lock_timeout = '{}ms'", timeout.as_millis())
}

/// A lock we did not get in time (or a deadlock with a producer): retry.
fn is_lock_conflict(e: &tokio_postgres::Error) -> bool {
    matches!(
        e.code(),
        Some(c) if *c == SqlState::LOCK_NOT_AVAILABLE || *c == SqlState::T_R_DEADLOCK_DETECTED
    )
}

/// Runs `attempt` until it succeeds, fails otherwise than on a lock, or has
/// been retried for `LOCK_RETRY_FOR`.
async fn retrying<T, F, Fut>(mut attempt: F) -> Result<T, tokio_postgres::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tokio_postgres::Error>>,
{
    let started = Instant::now();
    let mut tries = 0u32;
    loop {
        match attempt().await {
            Err(e) if is_lock_conflict(&e) && started.elapsed() < LOCK_RETRY_FOR => {
                tries += 1;
                // Let the producers that queued behind us through, then try again.
                let pause = Duration::from_millis(50u64 << tries.min(4));
                tracing::info!(
                    tries,
                    ?pause,
                    "migration step could not take its lock in time; retrying"
                );
                tokio::time::sleep(pause).await;
            }
            other => return other,
        }
    }
}

async fn run_step(client: &Client, step: &Step) -> Result<(), tokio_postgres::Error> {
    match step {
        Step::Transaction(sql) => {
            client
                .batch_execute(&lock_timeout_sql(LOCK_TIMEOUT))
                .await?;
            // One simple-query message: PostgreSQL runs it as one implicit
            // transaction, rolled back whole on any error.
            retrying(|| client.batch_execute(sql)).await
        }
        Step::Batches(sql) => {
            client
                .batch_execute(&lock_timeout_sql(LOCK_TIMEOUT))
                .await?;
            let statement = client.prepare(sql).await?;
            let mut cursor = i64::MIN;
            loop {
                let next: Option<i64> = retrying(|| async {
                    Ok(client.query_one(&statement, &[&cursor]).await?.get(0))
                })
                .await?;
                match next {
                    Some(next) => cursor = next,
                    None => return Ok(()),
                }
            }
        }
        Step::Index { name, sql } => {
            // Concurrent builds wait for older transactions; that wait blocks
            // no producer, so it has no timeout.
            client.batch_execute("SET lock_timeout = 0").await?;
            let valid: Option<bool> = client
                .query_opt(
                    "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                     WHERE c.relname = $1 AND pg_table_is_visible(c.oid)",
                    &[name],
                )
                .await?
                .map(|r| r.get(0));
            if valid == Some(false) {
                tracing::warn!(index = %name, "dropping an invalid index left by an interrupted build");
                client
                    .batch_execute(&format!("DROP INDEX CONCURRENTLY IF EXISTS {name}"))
                    .await?;
            }
            client.batch_execute(sql).await
        }
        Step::Concurrently(sql) => {
            client.batch_execute("SET lock_timeout = 0").await?;
            client.batch_execute(sql).await
        }
    }
}

/// A role or schema name as an SQL identifier.
fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The GRANTs for the two roles that run beside the migrate role (the owner
/// of the schema, which runs them): `app` may only enqueue (and use
/// `processed_messages`), `relay` reads and marks the outbox and keeps its
/// leases, without DDL. `outbox-relay migrate --print-grants` prints this.
pub fn grants(app: &str, relay: &str, schema: &str) -> String {
    let app = ident(app);
    let relay = ident(relay);
    let schema_id = ident(schema);
    let relay_literal = relay.replace('\'', "''");
    format!(
        "-- Run as the role that ran `outbox-relay migrate` (it owns the schema).
GRANT USAGE ON SCHEMA {schema_id} TO {app}, {relay};
SET search_path = {schema_id};

-- Application: enqueue (INSERT, and the columns enqueue returns) and
-- consumer-side deduplication. The outbox's triggers need nothing else.
GRANT INSERT, SELECT (id, idempotency_key) ON outbox TO {app};
GRANT SELECT, INSERT, DELETE ON processed_messages TO {app};

-- Relay: claim, mark, retry, dead-letter, prune; leases and heartbeats.
GRANT SELECT, UPDATE, DELETE ON outbox TO {relay};
GRANT SELECT, DELETE ON processed_messages TO {relay};
GRANT SELECT ON outbox_relay_settings, outbox_relay_migrations TO {relay};
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_relay_shard_leases, outbox_relay_replicas TO {relay};
GRANT USAGE ON SEQUENCE outbox_relay_shard_token_seq TO {relay};
-- The relay finds new rows by reading the outbox's id sequence (and
-- `dlq replay` moves it to wake the relays).
DO $$ BEGIN
    EXECUTE format('GRANT SELECT, USAGE ON SEQUENCE %s TO %s', pg_get_serial_sequence('outbox', 'id'), '{relay_literal}');
END $$;

-- With the partitioned outbox (`outbox-relay partitions setup`), also:
--   GRANT INSERT ON outbox_idempotency_keys TO {app};
--   GRANT SELECT, DELETE ON outbox_idempotency_keys TO {relay};
"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Statements that take a lock on the outbox that producers' inserts
    /// wait for (ACCESS EXCLUSIVE, SHARE ROW EXCLUSIVE, SHARE). `VALIDATE
    /// CONSTRAINT` takes SHARE UPDATE EXCLUSIVE, which inserts pass.
    fn blocks_inserts(statement: &str) -> bool {
        let s = statement.to_ascii_lowercase();
        let on_outbox = |prefix: &str| {
            s.contains(prefix)
                && (s.contains(&format!("{prefix} outbox "))
                    || s.contains(&format!("{prefix} outbox\n"))
                    || s.contains(&format!("{prefix} if exists outbox ")))
        };
        (on_outbox("alter table") && !s.contains("validate constraint"))
            || on_outbox("lock table")
            || ((s.contains("create trigger") || s.contains("drop trigger"))
                && s.contains(" on outbox"))
            || (s.contains("create index")
                && !s.contains("concurrently")
                && s.contains(" on outbox"))
    }

    /// Does `sql` run `verb` on the outbox itself (not on another table whose
    /// name starts with `outbox`)?
    fn names_outbox(sql: &str, verb: &str) -> bool {
        let pattern = format!("{verb} outbox");
        sql.match_indices(&pattern).any(|(at, _)| {
            !sql[at + pattern.len()..]
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        })
    }

    /// Work that reads or writes every row of the outbox.
    fn scans_rows(statement: &str) -> bool {
        let s = statement.to_ascii_lowercase();
        s.contains("update outbox ")
            || s.contains("update outbox\n")
            || s.contains("delete from outbox")
            || s.contains("insert into outbox ")
            || (s.contains("add constraint") && !s.contains("not valid"))
            || (s.contains("alter column") && s.contains(" type "))
    }

    /// The online promise, checked on the migration files themselves: a step
    /// that takes a lock producers wait for does nothing else that takes time
    /// (a backfill, a validation, a rewrite, an index build), and NOT NULL is
    /// set only after a validated CHECK lets it skip the scan. (The upgrade
    /// test in tests/livedb.rs runs them under load and prints how long
    /// producers waited.)
    #[test]
    fn no_step_holds_a_lock_producers_wait_for_while_it_works_through_rows() {
        for m in MIGRATIONS.iter().filter(|m| m.version >= 3) {
            let mut validated = false;
            for (i, step) in m.steps().iter().enumerate() {
                let at = format!("migration {} ({}) step {}", m.version, m.name, i + 1);
                let (sql, in_transaction) = match step {
                    Step::Transaction(sql) => (sql.as_str(), true),
                    Step::Batches(sql) | Step::Concurrently(sql) => (sql.as_str(), false),
                    Step::Index { sql, .. } => (sql.as_str(), false),
                };
                let code: String = sql
                    .lines()
                    .filter(|l| !l.trim_start().starts_with("--"))
                    .collect::<Vec<_>>()
                    .join("\n");
                let statements: Vec<&str> = code.split(';').collect();
                let locking = statements.iter().any(|s| blocks_inserts(s));
                let scanning = statements.iter().any(|s| scans_rows(s));
                assert!(
                    !(in_transaction && locking && scanning),
                    "{at} works through the outbox's rows under a lock producers wait for:\n{code}"
                );
                let lower = code.to_ascii_lowercase();
                if lower.contains("set not null") && names_outbox(&lower, "alter table") {
                    assert!(
                        validated,
                        "{at} sets NOT NULL without a validated CHECK before it"
                    );
                }
                validated |= lower.contains("validate constraint");
                assert!(
                    !(lower.contains("create index")
                        && lower.contains(" on outbox")
                        && !lower.contains("concurrently")),
                    "{at} builds an index on the outbox without CONCURRENTLY"
                );
            }
        }
    }

    #[test]
    fn the_lint_knows_a_blocking_rewrite_when_it_sees_one() {
        assert!(blocks_inserts("ALTER TABLE outbox ADD COLUMN x int"));
        assert!(!blocks_inserts("ALTER TABLE outbox VALIDATE CONSTRAINT c"));
        assert!(blocks_inserts("CREATE INDEX i ON outbox (x)"));
        assert!(!blocks_inserts("CREATE INDEX CONCURRENTLY i ON outbox (x)"));
        assert!(blocks_inserts(
            "LOCK TABLE outbox IN SHARE ROW EXCLUSIVE MODE"
        ));
        assert!(scans_rows("UPDATE outbox SET shard = 1"));
        assert!(scans_rows(
            "ALTER TABLE outbox ADD CONSTRAINT c CHECK (x > 0)"
        ));
        assert!(!scans_rows(
            "ALTER TABLE outbox ADD CONSTRAINT c CHECK (x > 0) NOT VALID"
        ));
    }

    #[test]
    fn every_migration_parses_into_steps() {
        for m in MIGRATIONS {
            assert!(!m.steps().is_empty(), "migration {}", m.version);
        }
        let steps = MIGRATIONS[3].steps();
        assert!(matches!(steps[0], Step::Transaction(_)));
        assert!(matches!(steps[1], Step::Batches(ref s) if s.contains("$1")));
        assert!(steps
            .iter()
            .any(|s| matches!(s, Step::Index { name, .. } if name == "outbox_shard_ready_idx")));
    }

    #[test]
    fn a_file_without_steps_is_one_transaction() {
        assert_eq!(
            parse_steps("-- c\nCREATE TABLE t ();\n"),
            vec![Step::Transaction("-- c\nCREATE TABLE t ();\n".into())]
        );
    }
}
