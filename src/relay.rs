//! Starting and stopping the engine: builds what the actors share, spawns the
//! supervisor, and offers the two ways to run it: until told to stop (the
//! daemon) or until the backlog is empty (`drain`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorRef, ActorStatus};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::actors::supervisor::{ShutdownReport, Supervisor, SupervisorMsg};
use crate::actors::{CountersSnapshot, Directory, Hooks, InFlight, Shared};
use crate::backoff::Backoff;
use crate::config::Config;
use crate::db;
use crate::routes::Router;
use crate::sink::breaker::Breakers;
use crate::sink::{qstash::QstashSink, HttpClient, Sinks};

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Db(#[from] db::DbError),
    #[error("the database schema is not ready: {0} (run `outbox-relay migrate`)")]
    Schema(String),
    #[error("could not start the actor tree: {0}")]
    Spawn(#[from] ractor::SpawnErr),
}

impl RelayError {
    /// The database could not be reached or dropped the connection (as
    /// opposed to a configuration or schema problem, or an error the server
    /// reported): worth trying again.
    pub fn is_transient(&self) -> bool {
        match self {
            RelayError::Db(db::DbError::PoolTimeout) => true,
            RelayError::Db(db::DbError::Postgres(e)) => e.as_db_error().is_none(),
            _ => false,
        }
    }
}

/// A running relay.
pub struct Relay {
    supervisor: ActorRef<SupervisorMsg>,
    join: JoinHandle<()>,
    shared: Arc<Shared>,
}

/// What `drain` did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DrainReport {
    pub counters: CountersSnapshot,
    pub elapsed_secs: f64,
    /// Rows still pending when it stopped: those scheduled for later (by
    /// their producer, or a retry further off than `relay.backoff_cap`),
    /// plus any left by a timeout or a relay that gave up.
    pub remaining: i64,
    /// The earliest time a remaining row becomes due.
    pub next_due: Option<chrono::DateTime<chrono::Utc>>,
    pub timed_out: bool,
    /// The actor tree gave up (restart budget exhausted): `drain` fails.
    pub gave_up: bool,
}

impl Relay {
    pub async fn start(config: Config) -> Result<Relay, RelayError> {
        Self::start_with_hooks(config, Hooks::default()).await
    }

    /// Like [`Relay::start`] with fault injection (tests of the recovery path).
    pub async fn start_with_hooks(config: Config, hooks: Hooks) -> Result<Relay, RelayError> {
        config
            .validate_for_relay()
            .map_err(|e| RelayError::Config(e.to_string()))?;
        let pool = db::pool(
            &config.database.url,
            config.database.pool_size,
            config.database.connect_timeout,
        )?;
        check_schema(&pool, config.relay.shards).await?;
        let router = Router::new(&config.routes).map_err(RelayError::Config)?;
        let client = HttpClient::new(&config.http);
        let shared = Arc::new(Shared {
            sinks: Sinks {
                client,
                qstash: QstashSink::new(&config.qstash, &config.http),
                max_message_bytes: config.http.max_message_bytes,
                breakers: Breakers::new(
                    router.routes().iter().map(|r| r.name.clone()),
                    config.http.request_timeout,
                ),
            },
            backoff: Backoff {
                base: config.relay.backoff_base,
                cap: config.relay.backoff_cap,
            },
            permits: Arc::new(Semaphore::new(config.relay.max_in_flight as usize)),
            in_flight: Arc::new(InFlight::default()),
            directory: Directory::new(
                config.relay.shards as usize,
                config.relay.publishers as usize,
            ),
            counters: Default::default(),
            hooks,
            ownership: Default::default(),
            replica_id: crate::actors::coordinator::replica_id(&config.relay.replica_id),
            router,
            pool,
            config,
        });
        let (supervisor, join) = Actor::spawn(None, Supervisor, Arc::clone(&shared)).await?;
        Ok(Relay {
            supervisor,
            join,
            shared,
        })
    }

    pub fn counters(&self) -> CountersSnapshot {
        self.shared.counters.snapshot()
    }

    /// The live counters (for the readiness sampler).
    pub fn counters_handle(&self) -> Arc<crate::actors::Counters> {
        Arc::clone(&self.shared.counters)
    }

    /// This replica's name among those sharing the database.
    pub fn replica_id(&self) -> &str {
        &self.shared.replica_id
    }

    /// The shards this replica holds a lease on, in order.
    pub fn shards_owned(&self) -> Vec<i16> {
        self.shared
            .ownership
            .shards()
            .into_iter()
            .map(|(s, _)| s)
            .collect()
    }

    /// Rows claimed and not yet marked.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight_count()
    }

    pub fn pool(&self) -> &db::Pool {
        &self.shared.pool
    }

    /// Restarts per kind of actor since start.
    pub async fn restarts(&self) -> HashMap<&'static str, u64> {
        match self
            .supervisor
            .call(SupervisorMsg::Restarts, Some(Duration::from_secs(5)))
            .await
        {
            Ok(ractor::rpc::CallResult::Success(r)) => r,
            _ => HashMap::new(),
        }
    }

    /// True while the actor tree runs (false after it gave up on a crash loop).
    pub fn is_running(&self) -> bool {
        matches!(
            self.supervisor.get_status(),
            ActorStatus::Running | ActorStatus::Starting | ActorStatus::Upgrading
        )
    }

    /// Resolves when the actor tree stops by itself (restart budget exhausted).
    pub async fn stopped(&mut self) {
        let _ = (&mut self.join).await;
    }

    /// Graceful stop: claimers first, in-flight work within the grace period,
    /// the marker flushed, undelivered leases released.
    pub async fn shutdown(self) -> ShutdownReport {
        let grace = self.shared.config.relay.shutdown_grace;
        let report = match self
            .supervisor
            .call(
                SupervisorMsg::Shutdown,
                Some(grace + Duration::from_secs(70)),
            )
            .await
        {
            Ok(ractor::rpc::CallResult::Success(report)) => report,
            _ => ShutdownReport {
                counters: self.shared.counters.snapshot(),
                ..Default::default()
            },
        };
        let _ = self.join.await;
        report
    }

    /// Runs until no row is due (or `max_duration` passes), then stops
    /// gracefully. For cron-style deployments.
    pub async fn drain(
        config: Config,
        max_duration: Option<Duration>,
    ) -> Result<DrainReport, RelayError> {
        let started = Instant::now();
        Relay::start(config)
            .await?
            .drain_started(max_duration, started)
            .await
    }

    /// Runs this relay until nothing is due, then stops it gracefully. Rows
    /// scheduled for later do not hold it up: a row whose producer set a
    /// future `available_at`, or whose retry is due further off than
    /// `relay.backoff_cap`, is left for the next run and reported.
    pub async fn drain_started(
        self,
        max_duration: Option<Duration>,
        started: Instant,
    ) -> Result<DrainReport, RelayError> {
        let poll = self
            .shared
            .config
            .relay
            .poll_interval
            .min(Duration::from_millis(200));
        let horizon_ms = self.shared.config.relay.backoff_cap.as_millis() as i64;
        let client = self.shared.pool.get().await.map_err(db::DbError::from)?;
        let mut timed_out = false;
        let mut gave_up = false;
        let (remaining, next_due) = loop {
            tokio::time::sleep(poll).await;
            let row = client
                .query_one(DRAIN_STATE_SQL, &[&horizon_ms])
                .await
                .map_err(db::DbError::from)?;
            let (due, pending): (i64, i64) = (row.get(0), row.get(1));
            let next_due = row.get(2);
            if due == 0 && self.in_flight() == 0 {
                break (pending, next_due);
            }
            if max_duration.is_some_and(|d| started.elapsed() >= d) {
                timed_out = true;
                break (pending, next_due);
            }
            if !self.is_running() {
                gave_up = true;
                break (pending, next_due);
            }
        };
        drop(client);
        let report = self.shutdown().await;
        Ok(DrainReport {
            counters: report.counters,
            elapsed_secs: started.elapsed().as_secs_f64(),
            remaining,
            next_due,
            timed_out,
            gave_up,
        })
    }
}

/// Pending rows that are due (a retry counts as due when it comes within
/// `$1` ms), all pending rows, and the earliest future `available_at`.
const DRAIN_STATE_SQL: &str = "SELECT
    count(*) FILTER (WHERE available_at <= now()
        + CASE WHEN attempt_count > 0 THEN $1::int8 * interval '1 millisecond'
               ELSE interval '0' END),
    count(*),
    min(available_at) FILTER (WHERE available_at > now())
FROM outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL";

/// The number of shards the database hashes rows into.
pub const SHARDS_SQL: &str = "SELECT shards FROM outbox_relay_settings";

async fn check_schema(pool: &db::Pool, shards: u32) -> Result<(), RelayError> {
    let client = pool.get().await.map_err(db::DbError::from)?;
    let latest = db::migrate::MIGRATIONS
        .iter()
        .map(|m| m.version)
        .max()
        .unwrap_or(0);
    let applied: Option<i32> = match client
        .query_one("SELECT max(version) FROM outbox_relay_migrations", &[])
        .await
    {
        Ok(row) => row.get(0),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => None,
        Err(e) => return Err(db::DbError::from(e).into()),
    };
    match applied {
        None => Err(RelayError::Schema(
            "no outbox schema in this database".into(),
        )),
        Some(v) if v < latest => Err(RelayError::Schema(format!(
            "schema is at migration {v}, this relay needs {latest}"
        ))),
        Some(_) => {
            let in_db: i32 = client
                .query_one(SHARDS_SQL, &[])
                .await
                .map_err(db::DbError::from)?
                .get(0);
            if in_db as u32 != shards {
                return Err(RelayError::Config(format!(
                    "configuration key `relay.shards`: is {shards}, but the outbox is sharded {in_db} ways; set relay.shards = {in_db}, or change the database with `outbox-relay reshard {shards}`"
                )));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::RelayError;
    use crate::db::DbError;

    #[test]
    fn only_an_unreachable_database_is_worth_another_try() {
        assert!(RelayError::Db(DbError::PoolTimeout).is_transient());
        assert!(!RelayError::Config("relay.shards: …".into()).is_transient());
        assert!(!RelayError::Schema("no outbox schema".into()).is_transient());
        assert!(!RelayError::Db(DbError::BadUrl("x".into())).is_transient());
    }
}
