//! Starting and stopping the engine: builds what the actors share, spawns the
//! supervisor, and offers the two ways to run it: until told to stop (the
//! daemon) or until the backlog is empty (`drain`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorRef, ActorStatus};
use tokio::task::JoinHandle;

use crate::actors::claim_plan::{ClaimRoutes, Fairness, TenantRates, TenantWeights};
use crate::actors::claimer::{ClaimSettings, ClaimerContext, Claimers};
use crate::actors::coordinator::CoordinatorArgs;
use crate::actors::identity;
use crate::actors::inflight::InFlight;
use crate::actors::listener::ListenerArgs;
use crate::actors::marker::{MarkerArgs, MarkerPort};
use crate::actors::ownership::Ownership;
use crate::actors::publisher::{PublisherArgs, Publishers};
use crate::actors::supervisor::{
    RestartBudget, ShutdownReport, Supervisor, SupervisorArgs, SupervisorMsg,
};
use crate::actors::winddown::Winddown;
use crate::actors::{Counters, CountersSnapshot, Wake};
use crate::config::Config;
use crate::routes::{RetryPolicy, Router};
use crate::sink::breaker::Breakers;
use crate::sink::{qstash::QstashSink, HttpClient, Sinks};
use crate::store::shards::Replica;
use crate::store::{ShardId, Store, StoreError};
use crate::telemetry::Telemetry;

mod drain;

pub use drain::{DrainReport, DrainStatus, PausedRoute};

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the database schema is not ready: {0} (run `outbox-relay migrate`)")]
    Schema(String),
    #[error("this relay is too old for the database schema: {0}")]
    TooOld(String),
    #[error("could not start the actor tree: {0}")]
    Spawn(#[from] ractor::SpawnErr),
}

impl RelayError {
    /// The database could not be reached or dropped the connection (as
    /// opposed to a configuration or schema problem, or an error the server
    /// reported): worth trying again.
    pub(crate) fn is_transient(&self) -> bool {
        matches!(self, RelayError::Store(e) if e.is_transient())
    }
}

/// A running relay.
pub struct Relay {
    supervisor: ActorRef<SupervisorMsg>,
    join: JoinHandle<()>,
    store: Store,
    counters: Arc<Counters>,
    in_flight: Arc<InFlight>,
    ownership: Arc<Ownership>,
    replica: Replica,
    shutdown_grace: Duration,
    /// The delivery spans' exporter, flushed at shutdown.
    telemetry: Telemetry,
    /// How often `drain` looks whether it is done.
    drain_poll: Duration,
    /// A retry due within this counts as due for `drain` (`relay.backoff_cap`,
    /// or the breaker's longest pause if longer: a deferred row waits that long).
    drain_horizon: Duration,
    /// The routes' circuit breakers: `drain` reports the routes still paused.
    breakers: Arc<Breakers>,
}

/// How long after publishers stop starting requests every request has ended
/// (answered or cut off by `http.request_timeout`) and its outcome is marked.
pub(crate) fn requests_end_within(config: &Config) -> Duration {
    config.http.request_timeout + config.relay.mark_interval + Duration::from_secs(1)
}

impl Relay {
    pub async fn start(config: Config) -> Result<Relay, RelayError> {
        let telemetry =
            Telemetry::start(&config.telemetry).map_err(|e| RelayError::Config(e.to_string()))?;
        Self::start_tree(config, move |p| p.telemetry = telemetry).await
    }

    /// Starts the relay with its delivery spans made by `telemetry` (an
    /// application's own tracer provider) instead of `[telemetry]`'s.
    pub async fn start_with_telemetry(
        config: Config,
        telemetry: Telemetry,
    ) -> Result<Relay, RelayError> {
        Self::start_tree(config, move |p| p.telemetry = telemetry).await
    }

    /// Starts the relay with fault injection (tests of the recovery path).
    #[cfg(test)]
    pub(crate) async fn start_with_hooks(
        config: Config,
        hooks: crate::actors::Hooks,
    ) -> Result<Relay, RelayError> {
        Self::start_tree(config, move |p| p.hooks = hooks).await
    }

    async fn start_tree(
        config: Config,
        adjust: impl FnOnce(&mut PublisherArgs),
    ) -> Result<Relay, RelayError> {
        config
            .validate_for_relay()
            .map_err(|e| RelayError::Config(e.to_string()))?;
        crate::store::pooler::refuse_transaction_pooler(
            &config.database.url,
            config.database.connect_timeout,
        )
        .await?;
        for warning in config.warnings() {
            tracing::warn!("{warning}");
        }
        let db = &config.database;
        let store = Store::open_with(&db.url, &db.pool_options(db.pool_size, None))?;
        store.connect_now().await?;
        check_schema(&store, &config).await?;
        let router = Arc::new(Router::new(&config.routes));
        let r = &config.relay;
        let retry = config
            .retry_policies()
            .map_err(|e| RelayError::Config(e.to_string()))?;
        let tenants = r
            .tenant_policy()
            .map_err(|e| RelayError::Config(e.to_string()))?
            .map(|p| {
                Fairness::new(
                    TenantWeights::new(p.weights),
                    TenantRates::new(p.rates, p.default_rate),
                )
            });
        // Each role's sessions on the actors' pool, with its statement timeout.
        let timeouts = &db.statement_timeout;
        let limited = |t: Option<Duration>| match t {
            Some(t) => store.with_session_limit(t),
            None => store.clone(),
        };
        let breakers = Arc::new(Breakers::new(
            router.routes().iter().map(|r| r.name.clone()),
            config.http.request_timeout,
            r.lease,
        ));
        let sinks = Arc::new(Sinks {
            client: HttpClient::new(&config.http),
            qstash: QstashSink::new(&config.qstash, &config.http),
            max_message_bytes: config.http.max_message_bytes,
            breakers: Arc::clone(&breakers),
            limits: crate::sink::limits::Limits::new(router.routes(), &config.http.hosts),
        });
        let counters = Arc::new(Counters::default());
        // Rows are counted per tenant only where the rooms use them.
        let in_flight = if tenants.is_some() {
            InFlight::per_tenant(r.max_in_flight as usize)
        } else {
            InFlight::new(r.max_in_flight as usize)
        };
        let ownership = Arc::new(Ownership::default());
        let replica = Replica::this_process(&r.replica_id);
        // One live process per name: refused while another one's heartbeat
        // under it moves on.
        if let Err(holder) = identity::claim_name(&store, &replica, r.shard_lease).await? {
            return Err(RelayError::Config(identity::name_taken(&replica, &holder)));
        }
        let marker_port = MarkerPort::default();
        let publishers = Publishers::new(
            r.publishers as usize,
            tenants.as_ref().map(|t| Arc::clone(&t.weights)),
        );
        let claimers = Claimers::new(ClaimerContext {
            store: limited(timeouts.claims()),
            settings: ClaimSettings {
                batch: r.claim_batch as usize,
                lease: r.lease,
                poll_interval: r.poll_interval,
                idle_poll_max: r.idle_poll_max,
                routes: Arc::new(ClaimRoutes::new(&router)),
                job_rows: config.qstash.batch_size.get(),
                tenants,
            },
            in_flight: Arc::clone(&in_flight),
            breakers: Arc::clone(&breakers),
            router: Arc::clone(&router),
            publishers: publishers.clone(),
            marker: marker_port.clone(),
            counters: Arc::clone(&counters),
        });
        let wake: Wake = {
            let claimers = claimers.clone();
            Arc::new(move || claimers.wake_all())
        };
        let winddown = Winddown {
            claimers: claimers.clone(),
            ownership: Arc::clone(&ownership),
            in_flight: Arc::clone(&in_flight),
            marker: marker_port.clone(),
            requests_end_within: requests_end_within(&config),
        };
        let mut publisher = PublisherArgs {
            sinks,
            router: Arc::clone(&router),
            retry: retry.clone(),
            ownership: Arc::clone(&ownership),
            request_timeout: config.http.request_timeout,
            marker: marker_port.clone(),
            jobs: publishers.jobs(),
            telemetry: Telemetry::default(),
            #[cfg(test)]
            hooks: Default::default(),
        };
        adjust(&mut publisher);
        let telemetry = publisher.telemetry.clone();
        let args = SupervisorArgs {
            marker: MarkerArgs {
                store: limited(timeouts.marks()),
                connections: r.mark_connections as usize,
                batch: r.mark_batch as usize,
                interval: r.mark_interval,
                route_names: router.routes().iter().map(|r| r.name.clone()).collect(),
                counters: Arc::clone(&counters),
                in_flight: Arc::clone(&in_flight),
                // An ordered key's next event becomes claimable with its
                // predecessor's mark: do not leave it waiting for the poll.
                after_flush: config.any_ordered_route().then(|| Arc::clone(&wake)),
                due_at: {
                    let claimers = claimers.clone();
                    Arc::new(move |shard, at| claimers.due_at(shard, at))
                },
            },
            marker_port,
            publisher: Arc::new(publisher),
            publishers,
            publisher_count: r.publishers as usize,
            listener: ListenerArgs {
                url: config.database.url.clone(),
                connect_timeout: config.database.connect_timeout,
                idle_probe_max: r.idle_probe_max,
                liveness: config.database.liveness(),
                // The probe is cheaper than any claim.
                probe_timeout: timeouts.claims().unwrap_or(Duration::from_secs(5)),
                wake,
                unanswered: store.unanswered(),
            },
            coordinator: CoordinatorArgs {
                store: limited(timeouts.coordinator()),
                me: replica.clone(),
                shard_lease: r.shard_lease,
                // The marker's, the coordinator's and the drain's progress's.
                max_shards: (config.database.pool_size as usize)
                    .saturating_sub(r.others_in_pool() as usize)
                    .max(1),
                ownership: Arc::clone(&ownership),
                claimers: claimers.clone(),
                winddown: winddown.clone(),
            },
            claimers,
            winddown,
            budget: RestartBudget {
                max: r.max_restarts,
                window: r.restart_window,
            },
            shutdown_grace: r.shutdown_grace,
            counters: Arc::clone(&counters),
        };
        let (supervisor, join) = Actor::spawn(None, Supervisor, args).await?;
        Ok(Relay {
            supervisor,
            join,
            store,
            counters,
            in_flight,
            ownership,
            replica,
            shutdown_grace: r.shutdown_grace,
            telemetry,
            drain_poll: r.poll_interval.min(Duration::from_millis(200)),
            drain_horizon: retry
                .iter()
                .map(RetryPolicy::longest)
                .fold(r.backoff_cap, Duration::max)
                .max(crate::sink::breaker::longest_pause(r.lease)),
            breakers,
        })
    }

    pub fn counters(&self) -> CountersSnapshot {
        self.counters.snapshot()
    }

    /// The live counters (for the readiness sampler).
    pub(crate) fn counters_handle(&self) -> Arc<Counters> {
        Arc::clone(&self.counters)
    }

    /// This replica's name among those sharing the database.
    pub fn replica_id(&self) -> &str {
        &self.replica.id
    }

    /// The shards this replica holds a lease on, in order.
    pub fn shards_owned(&self) -> Vec<ShardId> {
        self.ownership.shards()
    }

    /// Rows claimed and not yet marked.
    pub fn in_flight(&self) -> usize {
        self.in_flight.count()
    }

    pub fn store(&self) -> &Store {
        &self.store
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
    pub(crate) fn is_running(&self) -> bool {
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
        let report = match self
            .supervisor
            .call(
                SupervisorMsg::Shutdown,
                Some(self.shutdown_grace + Duration::from_secs(70)),
            )
            .await
        {
            Ok(ractor::rpc::CallResult::Success(report)) => report,
            _ => ShutdownReport {
                counters: self.counters.snapshot(),
                ..Default::default()
            },
        };
        let _ = self.join.await;
        self.telemetry.shutdown(Duration::from_secs(5)).await;
        report
    }

    /// Runs this relay until nothing is due or held for a delivery callback
    /// (the caller serves the callbacks: `crate::drain`), then stops it
    /// gracefully. Rows
    /// scheduled for later do not hold it up: a row whose producer set a
    /// future `available_at`, or whose retry is due further off than
    /// `relay.backoff_cap`, is left for the next run and reported.
    pub(crate) async fn drain_started(
        self,
        max_duration: Option<Duration>,
        started: Instant,
        dead_by_callbacks: &AtomicU64,
    ) -> Result<DrainReport, RelayError> {
        let mut timed_out = false;
        let mut gave_up = false;
        loop {
            tokio::time::sleep(self.drain_poll).await;
            // Stops at the first row left to do; what is left is counted
            // once, below.
            let busy = match self.store.drain_busy(self.drain_horizon).await {
                Ok(busy) => busy,
                Err(e) => {
                    // Not left running behind the error.
                    self.shutdown().await;
                    return Err(e.into());
                }
            };
            if !busy && self.in_flight() == 0 {
                break;
            }
            if max_duration.is_some_and(|d| started.elapsed() >= d) {
                timed_out = true;
                break;
            }
            if !self.is_running() {
                gave_up = true;
                break;
            }
        }
        let state = match self.store.drain_state(self.drain_horizon).await {
            Ok(state) => state,
            Err(e) => {
                self.shutdown().await;
                return Err(e.into());
            }
        };
        let paused_routes = self
            .breakers
            .paused()
            .into_iter()
            .map(|(route, error)| drain::PausedRoute { route, error })
            .collect();
        let report = self.shutdown().await;
        Ok(drain::DrainEnd {
            counters: report.counters,
            elapsed_secs: started.elapsed().as_secs_f64(),
            remaining: state.pending,
            next_due: state.next_due,
            held: state.held,
            timed_out,
            gave_up,
            paused_routes,
            dead_lettered_by_callbacks: dead_by_callbacks.load(Ordering::Relaxed),
        }
        .report())
    }
}

/// What `run` refuses to start on: a schema older than this binary's, a
/// shard count other than `relay.shards`, a pool too small for the shards.
pub(crate) async fn check_schema(store: &Store, config: &Config) -> Result<(), RelayError> {
    let latest = Store::latest_schema();
    match store.schema_version().await? {
        None => Err(RelayError::Schema(
            "no outbox schema in this database".into(),
        )),
        Some(v) if v < latest => Err(RelayError::Schema(format!(
            "schema is at migration {v}, this relay needs {latest}"
        ))),
        Some(v) => {
            if let Some(needs) = store.needs_newer_relays().await? {
                return Err(RelayError::TooOld(needs.to_string()));
            }
            if v > latest {
                tracing::warn!(
                    schema = v,
                    built_for = latest,
                    "the schema is newer than this relay; the migrations after {latest} keep older relays working"
                );
            }
            let in_db = store.shard_count().await?;
            match config.relay.shards {
                Some(shards) if shards != in_db => {
                    return Err(RelayError::Config(format!(
                        "configuration key `relay.shards`: is {shards}, but the outbox is split into {in_db} shards; remove the key to follow the database, set relay.shards = {in_db}, or change the database with `outbox-relay reshard {shards}`"
                    )));
                }
                _ => {}
            }
            let pool = config.database.pool_size;
            let needed = in_db + config.relay.others_in_pool();
            if pool < needed {
                return Err(RelayError::Config(format!(
                    "configuration key `database.pool_size`: is {pool}, but the outbox has {in_db} shards; a replica holding all of them needs {}: {}",
                    needed,
                    crate::config::ACTORS_POOL
                )));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests;
