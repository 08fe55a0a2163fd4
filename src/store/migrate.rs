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
//! * `drop index <name>`: a `DROP INDEX CONCURRENTLY IF EXISTS`, outside a
//!   transaction, unless `<name>` is a partitioned index (a partitioned
//!   outbox's), which cannot be dropped concurrently and is left as it is.
//!
//! A migration is recorded once all its steps are done; every step is written
//! to be run again, so a run killed midway is finished by the next one. A
//! session advisory lock makes concurrent runs queue; the later ones find
//! nothing to do.
//!
//! Rolling upgrades: every migration declares whether relays built for an
//! older schema keep working once it is applied ([`LiveRelays`]). Before it
//! applies one that needs newer relays, the runner looks at the live replicas'
//! heartbeats and refuses while one was built for an older schema
//! ([`relays`]); the ledger records what each migration needs, so a relay
//! refuses to start on, or stops claiming in, a schema it cannot run on.

mod relays;

pub use relays::LiveReplica;

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
        live_relays: LiveRelays::KeepWorking,
    },
    Migration {
        version: 2,
        name: "processed_messages",
        sql: include_str!("../../migrations/0002_processed_messages.sql"),
        also_accepted: &[],
        live_relays: LiveRelays::KeepWorking,
    },
    Migration {
        version: 3,
        name: "ops",
        sql: include_str!("../../migrations/0003_ops.sql"),
        // The same index, built in one transaction (before the online runner).
        also_accepted: &["8cdf583ddcad9e03a0259ad16cfb46ccff5c9839d9f2e1e002ebd7de8634207b"],
        live_relays: LiveRelays::KeepWorking,
    },
    Migration {
        version: 4,
        name: "shards",
        sql: include_str!("../../migrations/0004_shards.sql"),
        // The same schema, built in one transaction (before the online runner),
        // and online with a backfill that joined its batch (bda08bb..743d1ae).
        also_accepted: &[
            "2aa44824a0d248914e7758379d3b1889ddc8a7c59fc31c73b17a4e2818999e84",
            "51c01baa286520cb273dc599c0519fe7a5e6e72cb90a74fe0cd81173c8f74c6d",
        ],
        live_relays: LiveRelays::KeepWorking,
    },
    Migration {
        version: 5,
        name: "shard_leases",
        sql: include_str!("../../migrations/0005_shard_leases.sql"),
        also_accepted: &[],
        live_relays: LiveRelays::KeepWorking,
    },
    Migration {
        version: 6,
        name: "producer_path",
        sql: include_str!("../../migrations/0006_producer_path.sql"),
        also_accepted: &[],
        // Older relays stop hearing NOTIFY and find new rows by their poll.
        live_relays: LiveRelays::KeepWorking,
    },
    Migration {
        version: 7,
        name: "buckets",
        sql: include_str!("../../migrations/0007_buckets.sql"),
        // The same schema, with a backfill that joined its batch (4594811).
        also_accepted: &["66dcd74c5f3b19b1dfa00fb38d43859c0fd425aada0e69fb9f91d66c8b684a21"],
        // Its first step stops filling `shard`, which relays before it claim
        // by (they see no new row), and its last drops the column.
        live_relays: LiveRelays::NeedBuiltFor(7),
    },
    Migration {
        version: 8,
        name: "held",
        sql: include_str!("../../migrations/0008_held.sql"),
        also_accepted: &[],
        live_relays: LiveRelays::KeepWorking,
    },
    Migration {
        version: 9,
        name: "key_types",
        sql: include_str!("../../migrations/0009_key_types.sql"),
        also_accepted: &[],
        // An index: relays before it claim as they did.
        live_relays: LiveRelays::KeepWorking,
    },
    Migration {
        version: 10,
        name: "replica_instance",
        sql: include_str!("../../migrations/0010_replica_instance.sql"),
        also_accepted: &[],
        // Nullable columns of the heartbeat row, which relays before it
        // leave empty.
        live_relays: LiveRelays::KeepWorking,
    },
    Migration {
        version: 11,
        name: "relay_versions",
        sql: include_str!("../../migrations/0011_relay_versions.sql"),
        also_accepted: &[],
        live_relays: LiveRelays::KeepWorking,
    },
    Migration {
        version: 12,
        name: "attempt_log",
        sql: include_str!("../../migrations/0012_attempt_log.sql"),
        also_accepted: &[],
        // A nullable column older relays never name: their marks leave it
        // NULL.
        live_relays: LiveRelays::KeepWorking,
    },
    Migration {
        version: 13,
        name: "tenant_ready",
        sql: include_str!("../../migrations/0013_tenant_ready.sql"),
        also_accepted: &[],
        // An index: relays before it claim as they did.
        live_relays: LiveRelays::KeepWorking,
    },
    Migration {
        version: 14,
        name: "producer_indexes",
        sql: include_str!("../../migrations/0014_producer_indexes.sql"),
        also_accepted: &[],
        // Two indexes no statement needs: older relays' drain check walks
        // another one.
        live_relays: LiveRelays::KeepWorking,
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
    version     integer     PRIMARY KEY,
    name        text        NOT NULL,
    checksum    text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now(),
    relays_from integer
)";

/// `relays_from`: with this migration applied, relays built for an older
/// schema stop working (NULL: they keep working). Ledgers made before it get
/// the column here, a catalog change on a table of a few rows.
const LEDGER_HAS_RELAYS_FROM: &str = "SELECT EXISTS (SELECT 1 FROM pg_attribute
    WHERE attrelid = 'outbox_relay_migrations'::regclass AND attname = 'relays_from'
      AND NOT attisdropped)";
const ADD_RELAYS_FROM: &str =
    "ALTER TABLE outbox_relay_migrations ADD COLUMN IF NOT EXISTS relays_from integer";
/// What an applied migration needs, recorded when an older runner applied it.
const RECORD_RELAYS_FROM: &str = "UPDATE outbox_relay_migrations SET relays_from = $2
    WHERE version = $1 AND relays_from IS NULL";

/// Whether relays built for an older schema keep working once a migration is
/// applied: the rule each migration states, for this one and every later one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LiveRelays {
    /// Expand: new tables, nullable columns, indexes, triggers that still fill
    /// what older relays read. Roll the relays after `migrate`, in any order.
    KeepWorking,
    /// Contract: relays built for a schema before this version stop working
    /// (a column they read is dropped or no longer filled). Stop them,
    /// migrate, start relays built for this version or later.
    NeedBuiltFor(i32),
}

impl LiveRelays {
    /// Does a relay built for schema `built_for` keep working across it?
    pub fn keeps(self, built_for: i32) -> bool {
        self.needs().is_none_or(|v| built_for >= v)
    }

    /// The oldest schema a relay may be built for, when there is one.
    pub fn needs(self) -> Option<i32> {
        match self {
            LiveRelays::KeepWorking => None,
            LiveRelays::NeedBuiltFor(v) => Some(v),
        }
    }
}

/// How a run goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Apply the migrations up to and including this one.
    pub target: i32,
    /// Apply a migration that needs newer relays although an older relay is
    /// live (`migrate --allow-live-older`): that relay stops delivering.
    pub allow_live_older: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            target: i32::MAX,
            allow_live_older: false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
    /// Checksums of earlier texts of this migration that built the same schema.
    pub also_accepted: &'static [&'static str],
    /// Whether relays built for an older schema keep working across it.
    pub live_relays: LiveRelays,
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
    DropIndex { name: String, sql: String },
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
            ["drop", "index", name] => Step::DropIndex {
                name: (*name).to_owned(),
                sql: text,
            },
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
    #[error("{}", relays::refusal(*.version, name, *.needs, replicas))]
    OlderRelaysLive {
        version: i32,
        name: &'static str,
        /// Relays must be built for this schema or later.
        needs: i32,
        replicas: Vec<LiveReplica>,
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
    run_with(
        client,
        Options {
            target,
            ..Options::default()
        },
    )
    .await
}

/// A run as `options` say; refuses a migration that needs newer relays while
/// an older one is live, unless told otherwise.
pub async fn run_with(client: &mut Client, options: Options) -> Result<Report, MigrateError> {
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
    let result = run_locked(client, options).await;
    // On error the session may be gone, and the lock with it.
    let unlocked = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
        .await;
    let report = result?;
    unlocked?;
    Ok(report)
}

async fn run_locked(client: &mut Client, options: Options) -> Result<Report, MigrateError> {
    client.batch_execute(CREATE_LEDGER).await?;
    if !client
        .query_one(LEDGER_HAS_RELAYS_FROM, &[])
        .await?
        .get::<_, bool>(0)
    {
        client.batch_execute(ADD_RELAYS_FROM).await?;
    }
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
        if let Some(needs) = known.live_relays.needs() {
            client
                .execute(RECORD_RELAYS_FROM, &[&version, &needs])
                .await?;
        }
        already += 1;
    }
    let pending: Vec<&Migration> = MIGRATIONS
        .iter()
        .filter(|m| {
            m.version <= options.target && !rows.iter().any(|r| r.get::<_, i32>(0) == m.version)
        })
        .collect();
    relays::check(client, &pending, options.allow_live_older).await?;
    let mut applied = Vec::new();
    for m in pending {
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
                "INSERT INTO outbox_relay_migrations (version, name, checksum, relays_from)
                 VALUES ($1, $2, $3, $4)",
                &[&m.version, &m.name, &m.checksum(), &m.live_relays.needs()],
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
            if index_state(client, name).await?.is_some_and(|i| !i.valid) {
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
        Step::DropIndex { name, sql } => {
            if index_state(client, name)
                .await?
                .is_some_and(|i| i.partitioned)
            {
                tracing::info!(index = %name, "a partitioned outbox keeps this index");
                return Ok(());
            }
            // Like a concurrent build, the drop waits for older transactions
            // without blocking producers.
            client.batch_execute("SET lock_timeout = 0").await?;
            client.batch_execute(sql).await
        }
    }
}

/// What an index step needs to know of an index that exists.
struct IndexState {
    /// False for what an interrupted concurrent build left.
    valid: bool,
    /// A partitioned table's index (a partitioned outbox's).
    partitioned: bool,
}

/// The index `name` on the search path, if there is one.
async fn index_state(
    client: &Client,
    name: &str,
) -> Result<Option<IndexState>, tokio_postgres::Error> {
    Ok(client
        .query_opt(
            "SELECT i.indisvalid, c.relkind = 'I' FROM pg_index i
             JOIN pg_class c ON c.oid = i.indexrelid
             WHERE c.relname = $1 AND pg_table_is_visible(c.oid)",
            &[&name],
        )
        .await?
        .map(|r| IndexState {
            valid: r.get(0),
            partitioned: r.get(1),
        }))
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
mod tests;
