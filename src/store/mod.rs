//! The store: every SQL statement the relay runs, and the connections they run
//! on. The actors, the CLI and the operations code all go through it; nothing
//! else in the crate writes SQL.
//!
//! - [`Store`]: the connection pool, for statements run now and then (the
//!   CLI, the gauges, retention, a failure callback).
//! - [`Session`]: one actor's own connection, taken from the pool on first use,
//!   its statements prepared once per connection, dropped after an error and
//!   taken again after a backoff ([`Session::failed`]). The claimers, the
//!   marker and the coordinator each keep one.
//!
//! What the statements do, by table:
//! - [`outbox`]: claims, marks, releases and the drain's progress (the relay's
//!   hot path), and the failure callback's mark.
//! - [`drain`]: `drain`'s check of whether anything is left to do.
//! - [`shards`]: shard leases, replica heartbeats, resharding, the schema check.
//! - [`dead_letters`]: list, show, replay and purge dead-lettered rows.
//! - [`retention`]: batched deletes and a partitioned outbox's upkeep.
//! - [`stats`]: the health figures (gauges, `outbox-relay stats`).
//! - [`probe`]: the listener's cheap look at the outbox's id sequence.
//! - [`pooler`]: the refusal of a transaction pooler between the relay and
//!   PostgreSQL.
//! - [`migrate`]: the schema, created and upgraded online.

/// `DELETE` of at most `$2` rows of `$table` whose `$column` is before `$1`,
/// oldest first, found by `ctid` (tables without a single-column key) and
/// checked again on the row itself: one short statement of a batched prune.
macro_rules! delete_oldest {
    ($table:literal, $column:literal) => {
        concat!(
            "DELETE FROM ",
            $table,
            " WHERE ctid = ANY(ARRAY(SELECT ctid FROM ",
            $table,
            " WHERE ",
            $column,
            " < $1 ORDER BY ",
            $column,
            " LIMIT $2))",
            " AND ",
            $column,
            " < $1"
        )
    };
}

/// `$statement` (a future borrowing `$session`) under the session's
/// deadline: when no answer comes in time the connection is closed and
/// dropped ([`Session::settle`]) and the statement fails as unanswered.
macro_rules! bounded {
    ($session:ident, $statement:expr) => {{
        let limit = $session.deadline();
        let statement = $statement;
        let outcome = match limit {
            Some(limit) => tokio::time::timeout(limit, statement)
                .await
                .map_err(|_| limit),
            None => Ok(statement.await),
        };
        $session.settle(outcome)
    }};
}

#[macro_use]
pub mod attempt_log;
pub mod callbacks;
pub mod conn;
pub mod dead_letters;
pub(crate) mod drain;
pub mod dsn;
pub mod mark;
pub mod migrate;
#[macro_use]
pub mod outbox;
pub(crate) mod key_recheck;
pub mod partitions;
pub mod pooler;
pub mod privileges;
pub mod probe;
pub mod retention;
pub mod shards;
pub mod stats;
pub(crate) mod tenants;
#[cfg(test)]
mod tests;
pub mod tls;

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use tokio_postgres::types::Type;
use tokio_postgres::Statement;

pub use conn::{
    connect, parse_url, parse_with_tls, pool, pool_with, Liveness, Pool, PoolOptions, PooledConn,
    Unanswered,
};

/// The one error of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database URL is not valid: {0}")]
    BadUrl(String),
    #[error("database: {}", describe(.0))]
    Postgres(tokio_postgres::Error),
    #[error("database pool: timed out waiting for a connection")]
    PoolTimeout,
    /// The connection did not answer a statement within the session's
    /// deadline (its peer gone, or the network dropping its packets); it was
    /// closed.
    #[error("database: no answer within {0:?}; the connection was closed")]
    Unanswered(Duration),
    /// The pool timed out while its attempts to connect failed; why.
    #[error("database: {0}")]
    CannotConnect(String),
    /// A TLS setting (`sslrootcert`, `sslcert`, `sslkey`) cannot be used.
    #[error("database TLS: {0}")]
    Tls(String),
    /// A migration could not be applied, or the schema is not this binary's.
    #[error(transparent)]
    Migrate(#[from] migrate::MigrateError),
    /// What was asked for is not in the database.
    #[error("{0}")]
    NotFound(String),
    /// The request is not valid, or the database's state forbids it now.
    #[error("{0}")]
    Refused(String),
}

/// The server's own message when there is one ("db error" says nothing),
/// else the error with its causes ("error connecting to server: Connection
/// refused"), a certificate problem explained.
fn describe(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.detail() {
            Some(detail) => format!("{} ({detail})", db.message()),
            None => db.message().to_owned(),
        },
        None => {
            let mut text = e.to_string();
            let mut cause = std::error::Error::source(e);
            while let Some(c) = cause {
                text = format!("{text}: {c}");
                cause = c.source();
            }
            match tls::explain(e as &(dyn std::error::Error + 'static)) {
                Some(hint) => format!("{text} ({hint})"),
                None => text,
            }
        }
    }
}

impl From<tokio_postgres::Error> for StoreError {
    fn from(e: tokio_postgres::Error) -> Self {
        StoreError::Postgres(e)
    }
}

impl From<bb8::RunError<tokio_postgres::Error>> for StoreError {
    fn from(e: bb8::RunError<tokio_postgres::Error>) -> Self {
        conn::ConnectErrors::default().explain(e)
    }
}

impl StoreError {
    /// The database could not be reached or dropped the connection (as
    /// opposed to an error the server reported): worth trying again.
    pub(crate) fn is_transient(&self) -> bool {
        match self {
            StoreError::PoolTimeout | StoreError::Unanswered(_) | StoreError::CannotConnect(_) => {
                true
            }
            StoreError::Postgres(e) => e.as_db_error().is_none(),
            _ => false,
        }
    }

    /// PostgreSQL refused the values sent (SQLSTATE classes 22 data
    /// exception, 23 integrity, 54 program limit), not the connection.
    pub(crate) fn is_data_error(&self) -> bool {
        match self {
            StoreError::Postgres(e) => e
                .as_db_error()
                .is_some_and(|db| matches!(&db.code().code()[..2], "22" | "23" | "54")),
            _ => false,
        }
    }

    /// The SQLSTATE the server answered, if it answered.
    pub fn code(&self) -> Option<&tokio_postgres::error::SqlState> {
        match self {
            StoreError::Postgres(e) => e.code(),
            _ => None,
        }
    }
}

/// A shard: the unit of ownership among replicas, one claimer each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShardId(i16);

impl ShardId {
    /// The most shards an outbox can be split into.
    pub(crate) const MAX_SHARDS: u32 = 1024;

    /// `n` must be below [`ShardId::MAX_SHARDS`].
    pub fn new(n: u32) -> ShardId {
        assert!(n < Self::MAX_SHARDS, "shard {n} out of range");
        ShardId(n as i16)
    }

    /// Every shard of an outbox split `count` ways.
    pub fn all(count: u32) -> impl Iterator<Item = ShardId> {
        (0..count.min(Self::MAX_SHARDS)).map(ShardId::new)
    }

    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// As the `smallint` columns hold it.
    pub(crate) fn sql(self) -> i16 {
        self.0
    }

    pub(crate) fn from_sql(v: i16) -> ShardId {
        ShardId(v)
    }
}

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl serde::Serialize for ShardId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i16(self.0)
    }
}

/// A shard as one tenure holds it: the fencing token its claims and marks
/// carry. A replica that lost the shard is refused by the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fence {
    pub shard: ShardId,
    pub token: i64,
}

/// The pool every statement runs on, one connection at a time.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    /// The `statement_timeout` of the sessions this store hands out.
    session_limit: Option<Duration>,
    /// Why the pool last failed to connect (for its time-outs).
    connect_errors: conn::ConnectErrors,
    /// When one of its connections last went unanswered.
    unanswered: conn::Unanswered,
}

impl Store {
    /// A pool of up to `size` connections, made on demand; nothing connects yet.
    pub fn open(url: &str, size: u32, connect_timeout: Duration) -> Result<Store, StoreError> {
        Store::open_with(url, &PoolOptions::new(size, connect_timeout))
    }

    /// A pool as `options` say, made on demand; nothing connects yet.
    pub fn open_with(url: &str, options: &PoolOptions) -> Result<Store, StoreError> {
        let (pool, connect_errors) = conn::pool_noting_errors(url, options)?;
        Ok(Store {
            pool,
            session_limit: None,
            connect_errors,
            unanswered: Default::default(),
        })
    }

    /// A store on a pool made elsewhere.
    pub fn with_pool(pool: Pool) -> Store {
        Store {
            pool,
            session_limit: None,
            connect_errors: Default::default(),
            unanswered: Default::default(),
        }
    }

    /// The same pool, handing out sessions whose statements get
    /// `statement_timeout` (set on each connection a session takes) and
    /// whose connection is closed when a statement has no answer a little
    /// after that ([`Session::deadline`]).
    pub fn with_session_limit(&self, statement_timeout: Duration) -> Store {
        Store {
            pool: self.pool.clone(),
            session_limit: Some(statement_timeout),
            connect_errors: self.connect_errors.clone(),
            unanswered: self.unanswered.clone(),
        }
    }

    /// Connects once, now: a database that cannot be reached says why at
    /// once (refused, unknown host, authentication, missing database, TLS),
    /// where the pool would retry until its time-out. The connection joins
    /// the pool.
    pub async fn connect_now(&self) -> Result<(), StoreError> {
        let conn = self.pool.dedicated_connection().await?;
        let _ = self.pool.add(conn);
        Ok(())
    }

    /// A small store for one command (the CLI).
    pub fn for_command(url: &str) -> Result<Store, StoreError> {
        Store::open(url, 2, Duration::from_secs(10))
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// A connection for a few statements; back to the pool when dropped.
    pub async fn conn(&self) -> Result<PooledConn, StoreError> {
        self.pool
            .get_owned()
            .await
            .map_err(|e| self.connect_errors.explain(e))
    }

    /// A connection of one's own, for an actor.
    pub fn session(&self) -> Session {
        Session {
            pool: self.pool.clone(),
            connect_errors: self.connect_errors.clone(),
            unanswered: self.unanswered.clone(),
            conn: None,
            failures: 0,
            limit: self.session_limit,
        }
    }

    /// Where this store's sessions note a connection that went unanswered,
    /// for a connection of its own that watches the same server (the
    /// wake-up probe).
    pub fn unanswered(&self) -> conn::Unanswered {
        self.unanswered.clone()
    }
}

/// A statement and its parameter types, prepared once per session connection.
pub(crate) struct Sql {
    pub text: &'static str,
    pub types: &'static [Type],
}

struct Prepared {
    conn: PooledConn,
    /// When the session took it from the pool.
    taken: std::time::Instant,
    /// By the address of the statement's text (each is a `&'static str`).
    statements: HashMap<usize, Statement>,
}

/// One actor's connection: taken on first use, kept while it works, dropped
/// after an error. The caller reports an error with [`Session::failed`], which
/// says how long to wait before the next try, and a success with
/// [`Session::succeeded`].
pub struct Session {
    pool: Pool,
    connect_errors: conn::ConnectErrors,
    unanswered: conn::Unanswered,
    conn: Option<Prepared>,
    failures: u32,
    /// The statement timeout of this session's role, if it has one.
    limit: Option<Duration>,
}

impl Session {
    /// The connection and `sql` prepared on it.
    pub(crate) async fn prepared(
        &mut self,
        sql: &Sql,
    ) -> Result<(&PooledConn, Statement), StoreError> {
        self.connect().await?;
        let p = self.conn.as_mut().expect("connected above");
        let key = sql.text.as_ptr() as usize;
        let statement = match p.statements.get(&key) {
            Some(s) => s.clone(),
            None => {
                let s = p.conn.prepare_typed(sql.text, sql.types).await?;
                p.statements.insert(key, s.clone());
                s
            }
        };
        Ok((&p.conn, statement))
    }

    /// The connection, for statements that are not prepared.
    pub(crate) async fn conn(&mut self) -> Result<&PooledConn, StoreError> {
        self.connect().await?;
        Ok(&self.conn.as_ref().expect("connected above").conn)
    }

    /// Takes a connection when the session has none, with the session's
    /// statement timeout set on it. A connection the session took before
    /// another went unanswered is given up first: the network that lost that
    /// one most likely lost it too ([`conn::Unanswered`]).
    async fn connect(&mut self) -> Result<(), StoreError> {
        if let Some(p) = &mut self.conn {
            if !self.unanswered.after(p.taken) {
                return Ok(());
            }
            tracing::debug!("a connection of the pool went unanswered since this one was taken: taking a fresh one");
            conn::close(&mut p.conn);
            self.conn = None;
        }
        // Right after an unanswered statement the pool's idle connections
        // are suspect too: each is tried first within a short deadline, and
        // one that does not answer is closed and the next one taken.
        let suspect = self.unanswered.recently(std::time::Instant::now());
        let mut tries = if suspect {
            self.pool.state().connections + 1
        } else {
            1
        };
        loop {
            let taken = std::time::Instant::now();
            let mut conn = self
                .pool
                .get_owned()
                .await
                .map_err(|e| self.connect_errors.explain(e))?;
            // The session's statement timeout is set on it (within the
            // deadline); a suspect one is tried even without (an empty
            // statement), within a quarter of the deadline, which also
            // bounds this (the statement's, connecting included): a few dead
            // ones in a row still leave it time.
            let sql = self
                .limit
                .map(conn::set_statement_timeout)
                .unwrap_or_default();
            let within = match (self.limit.map(deadline), suspect) {
                (Some(d), true) => Some((d / 4).min(conn::TRY_WITHIN)),
                (None, true) => Some(conn::TRY_WITHIN),
                (d, false) => d,
            };
            if let Some(within) = within {
                match tokio::time::timeout(within, conn.batch_execute(&sql)).await {
                    Ok(done) => done?,
                    Err(_) => {
                        conn::close(&mut conn);
                        // A suspect one that does not answer was lost with
                        // the others already noted: noting it again would
                        // only make the sessions that took fresh ones since
                        // give those up too.
                        if !suspect {
                            self.unanswered.note();
                        }
                        tries -= 1;
                        if tries == 0 {
                            return Err(StoreError::Unanswered(within));
                        }
                        continue;
                    }
                }
            }
            self.conn = Some(Prepared {
                conn,
                taken,
                statements: HashMap::new(),
            });
            return Ok(());
        }
    }

    /// How long a statement of this session may go unanswered before its
    /// connection is given up: the statement timeout, and half as long
    /// again (at most a second) for the server's own cancellation to arrive.
    pub(crate) fn deadline(&self) -> Option<Duration> {
        self.limit.map(deadline)
    }

    /// A bounded statement's outcome ([`bounded!`]): past the deadline, the
    /// connection is closed, so that the pool drops it rather than handing
    /// it out again, and the statement fails as unanswered.
    pub(crate) fn settle<T>(
        &mut self,
        outcome: Result<Result<T, StoreError>, Duration>,
    ) -> Result<T, StoreError> {
        match outcome {
            Ok(result) => result,
            Err(limit) => {
                if let Some(mut p) = self.conn.take() {
                    conn::close(&mut p.conn);
                }
                self.unanswered.note();
                Err(StoreError::Unanswered(limit))
            }
        }
    }

    /// A statement failed: the connection is dropped (the next use takes a
    /// fresh one) and the wait before trying again grows with each failure in
    /// a row: 100 ms doubling to 5 s.
    pub fn failed(&mut self) -> Duration {
        self.conn = None;
        self.failures = self.failures.saturating_add(1);
        reconnect_delay(self.failures)
    }

    /// A statement went through: the next failure starts the backoff afresh.
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }

    /// Failures in a row so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

/// A statement timeout and the grace for the server's cancellation to arrive.
fn deadline(statement_timeout: Duration) -> Duration {
    statement_timeout + (statement_timeout / 2).min(Duration::from_secs(1))
}

/// The backoff after `failures` failures in a row.
pub(crate) fn reconnect_delay(failures: u32) -> Duration {
    let ms = 50u64.saturating_mul(1 << failures.min(7));
    Duration::from_millis(ms.min(5_000))
}
