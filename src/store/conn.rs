//! Connections to PostgreSQL: a pool for the relay's actors, dedicated
//! connections where a session matters (the listener, migrations), TLS as
//! the connection string asks for it ([`super::dsn`], [`super::tls`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bb8_postgres::PostgresConnectionManager;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::{dsn, StoreError};

pub type Tls = MakeRustlsConnect;
pub(crate) type Manager = PostgresConnectionManager<Tls>;
pub type Pool = bb8::Pool<Manager>;
pub type PooledConn = bb8::PooledConnection<'static, Manager>;

/// The connection string's settings for tokio-postgres (`sslmode`
/// included), without the TLS parameters it does not know.
pub fn parse_url(url: &str) -> Result<tokio_postgres::Config, StoreError> {
    Ok(dsn::parse(url)?.config)
}

/// The settings and the TLS connector the connection string asks for (its
/// certificate files read).
pub fn parse_with_tls(url: &str) -> Result<(tokio_postgres::Config, Tls), StoreError> {
    let dsn = dsn::parse(url)?;
    Ok((dsn.config, super::tls::connector(&dsn.tls)?))
}

/// A pool that connects lazily; connections are checked by their closed flag,
/// not by an extra round trip on every checkout. Idle ones close after
/// 10 minutes.
pub fn pool(url: &str, size: u32, connect_timeout: Duration) -> Result<Pool, StoreError> {
    pool_with(url, &PoolOptions::new(size, connect_timeout))
}

/// A pool like [`pool`] whose connections close after `idle_timeout` unused
/// (bb8 looks every 30 s, or every `idle_timeout` when shorter), so an idle
/// relay holds only the connections its actors keep.
pub fn pool_closing_idle(
    url: &str,
    size: u32,
    connect_timeout: Duration,
    idle_timeout: Duration,
) -> Result<Pool, StoreError> {
    pool_with(
        url,
        &PoolOptions {
            idle_timeout,
            ..PoolOptions::new(size, connect_timeout)
        },
    )
}

/// How long a connection that stopped answering may go unnoticed: TCP
/// keepalives while it is idle, `tcp_user_timeout` while it waits for an
/// answer (the kernel drops it when what was sent is not acknowledged for that
/// long). A peer that still acknowledges but never answers (a hung proxy) is
/// caught by the sessions' own deadline ([`super::Session`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    pub keepalives_idle: Duration,
    pub keepalives_interval: Duration,
    pub keepalives_retries: u32,
    pub tcp_user_timeout: Duration,
}

impl Default for Liveness {
    fn default() -> Self {
        Liveness {
            keepalives_idle: Duration::from_secs(10),
            keepalives_interval: Duration::from_secs(5),
            keepalives_retries: 3,
            tcp_user_timeout: Duration::from_secs(30),
        }
    }
}

/// Sets the keepalives and `tcp_user_timeout` of `liveness` on `config`.
pub(crate) fn apply_liveness(config: &mut tokio_postgres::Config, liveness: &Liveness) {
    config
        .keepalives(true)
        .keepalives_idle(liveness.keepalives_idle)
        .keepalives_interval(liveness.keepalives_interval)
        .keepalives_retries(liveness.keepalives_retries)
        .tcp_user_timeout(liveness.tcp_user_timeout);
}

/// What a pool's connections are: how many, how they are made, and the
/// session settings each gets when it is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolOptions {
    pub size: u32,
    pub connect_timeout: Duration,
    pub liveness: Liveness,
    /// `statement_timeout` of every connection (the server's default if none).
    pub statement_timeout: Option<Duration>,
    /// `lock_timeout` of every connection (the server's default if none).
    pub lock_timeout: Option<Duration>,
    /// A connection unused this long is closed (`database.idle_timeout`).
    pub idle_timeout: Duration,
}

impl PoolOptions {
    /// `size` connections with the default liveness and no session settings.
    pub fn new(size: u32, connect_timeout: Duration) -> PoolOptions {
        PoolOptions {
            size,
            connect_timeout,
            liveness: Liveness::default(),
            statement_timeout: None,
            lock_timeout: None,
            idle_timeout: Duration::from_secs(600),
        }
    }

    /// The `SET` statements a new connection runs, if any.
    fn settings(&self) -> Option<String> {
        let mut sql = String::new();
        if let Some(t) = self.statement_timeout {
            sql.push_str(&set_statement_timeout(t));
        }
        if let Some(t) = self.lock_timeout {
            sql.push_str(&format!("SET lock_timeout = {};", t.as_millis().max(1)));
        }
        (!sql.is_empty()).then_some(sql)
    }
}

/// `SET statement_timeout` to `t` (in milliseconds; 0 would mean none).
pub(crate) fn set_statement_timeout(t: Duration) -> String {
    format!("SET statement_timeout = {};", t.as_millis().max(1))
}

/// What a pool does with each connection it makes: notes that connecting
/// works again ([`ConnectErrors`]) and runs the pool's session settings.
#[derive(Debug)]
struct OnConnect {
    errors: ConnectErrors,
    settings: Option<String>,
}

impl bb8::CustomizeConnection<tokio_postgres::Client, tokio_postgres::Error> for OnConnect {
    fn on_acquire<'a>(
        &'a self,
        conn: &'a mut tokio_postgres::Client,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<(), tokio_postgres::Error>> + Send + 'a>,
    > {
        self.errors.set(None);
        Box::pin(async move {
            match &self.settings {
                Some(sql) => conn.batch_execute(sql).await,
                None => Ok(()),
            }
        })
    }
}

/// A pool as `options` say, connecting lazily; connections are checked by
/// their closed flag, not by an extra round trip on every checkout.
pub fn pool_with(url: &str, options: &PoolOptions) -> Result<Pool, StoreError> {
    Ok(pool_noting_errors(url, options)?.0)
}

/// The same, and where the pool notes why it last failed to connect. Each
/// connection gets the TLS the connection string asks for, the keepalives
/// and `tcp_user_timeout` of `options.liveness`, and `options`' session
/// settings.
pub(crate) fn pool_noting_errors(
    url: &str,
    options: &PoolOptions,
) -> Result<(Pool, ConnectErrors), StoreError> {
    let dsn = dsn::parse(url)?;
    warn_if_unverified(&dsn.tls);
    let tls = super::tls::connector(&dsn.tls)?;
    let mut config = dsn.config;
    config.connect_timeout(options.connect_timeout);
    apply_liveness(&mut config, &options.liveness);
    if config.get_application_name().is_none() {
        config.application_name("outbox-relay");
    }
    let manager = PostgresConnectionManager::new(config, tls);
    let errors = ConnectErrors::default();
    let pool = bb8::Pool::builder()
        .max_size(options.size)
        .connection_timeout(options.connect_timeout)
        .test_on_check_out(false)
        .idle_timeout(Some(options.idle_timeout))
        .reaper_rate(options.idle_timeout.min(Duration::from_secs(30)))
        .error_sink(Box::new(errors.clone()))
        .connection_customizer(Box::new(OnConnect {
            errors: errors.clone(),
            settings: options.settings(),
        }))
        .build_unchecked(manager);
    Ok((pool, errors))
}

/// Closes a pooled connection that stopped answering, so that the pool
/// drops it instead of handing it out again (its closed flag is what the
/// pool checks). `tokio-postgres` offers no public way to close a client
/// that has a request outstanding; this is the one its blocking `postgres`
/// wrapper uses.
pub(crate) fn close(conn: &mut PooledConn) {
    conn.__private_api_close();
}

/// `sslmode=require` without `sslrootcert` checks no certificate (libpq's
/// meaning): said once per process, since it was asked for explicitly.
fn warn_if_unverified(tls: &dsn::TlsSettings) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    if tls.mode == dsn::TlsMode::Require && tls.root_cert.is_none() {
        ONCE.call_once(|| {
            tracing::warn!("database.url: sslmode=require encrypts but does not check the server's certificate (as in libpq); sslmode=verify-full with sslrootcert checks it");
        });
    }
}

/// A connection outside the pool, its driver task spawned; for sessions that
/// must not be shared (migrations' advisory lock, CLI commands).
pub async fn connect(url: &str) -> Result<tokio_postgres::Client, StoreError> {
    let (mut config, tls) = parse_with_tls(url)?;
    apply_liveness(&mut config, &Liveness::default());
    let (client, connection) = config.connect(tls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "database connection closed");
        }
    });
    Ok(client)
}

/// Why a pool's last attempt to connect failed, until one succeeds: bb8
/// retries a failed connect until its timeout and then says only that it
/// timed out; this is what it met meanwhile (refused, authentication, TLS).
#[derive(Debug, Clone, Default)]
pub(crate) struct ConnectErrors(Arc<Mutex<Option<String>>>);

impl ConnectErrors {
    /// A pool's `RunError` as the store reports it: a time-out says what the
    /// attempts to connect met, if they failed.
    pub(crate) fn explain(&self, e: bb8::RunError<tokio_postgres::Error>) -> StoreError {
        match e {
            bb8::RunError::User(e) => StoreError::Postgres(e),
            bb8::RunError::TimedOut => match self.last() {
                Some(cause) => StoreError::CannotConnect(cause),
                None => StoreError::PoolTimeout,
            },
        }
    }

    fn last(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set(&self, error: Option<String>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = error;
    }
}

impl bb8::ErrorSink<tokio_postgres::Error> for ConnectErrors {
    fn sink(&self, error: tokio_postgres::Error) {
        tracing::debug!(error = %super::describe(&error), "database connection attempt failed");
        self.set(Some(super::describe(&error)));
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<tokio_postgres::Error>> {
        Box::new(self.clone())
    }
}

/// When a connection of a store last went unanswered past its deadline. A
/// network that drops packets silently (a dead NAT entry, a partition, a
/// proxy that hangs) takes every connection of the moment with it, and
/// each actor would otherwise find out on its own, one deadline after the
/// other (the wake-up probe, then the claims it wakes, then the marks of what
/// they claimed): a session whose connection is older than the latest
/// unanswered statement takes a fresh one before its next statement, and
/// a connection taken from the pool soon after is tried with a short
/// deadline first.
#[derive(Debug, Clone, Default)]
pub struct Unanswered(Arc<Mutex<Option<Instant>>>);

/// How long after an unanswered statement the connections the pool hands
/// out are tried first, and how long that try may take at most (a quarter
/// of the session's deadline when it has one).
pub(crate) const SUSPECT_FOR: Duration = Duration::from_secs(30);
pub(crate) const TRY_WITHIN: Duration = Duration::from_secs(1);

impl Unanswered {
    /// A statement went unanswered now.
    pub fn note(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }

    /// Some statement went unanswered after `t`.
    pub(crate) fn after(&self, t: Instant) -> bool {
        self.last().is_some_and(|at| at > t)
    }

    /// One went unanswered within [`SUSPECT_FOR`] of `now`.
    pub(crate) fn recently(&self, now: Instant) -> bool {
        self.last()
            .is_some_and(|at| now.saturating_duration_since(at) < SUSPECT_FOR)
    }

    fn last(&self) -> Option<Instant> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}
