//! Scenario files (`config/loadtest/*.toml`) and the relay config generated
//! for a run.

use std::path::Path;
use std::time::Duration;

use outbox_relay::config::Ordering;
use outbox_relay::config::SinkKind;
use serde::{Deserialize, Serialize};

use crate::producer::{LoadSpec, PreloadSpec};
use outbox_testkit::sink::{DeliveryConfig, DestinationConfig, FaultConfig, RetryDelay};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScenarioKind {
    /// Preload a backlog, then start the relay and time it to empty.
    Drain,
    /// A fixed rate for a duration with the relay running.
    Steady,
    /// Steady load while relay replicas are killed and restarted, paused and
    /// continued, their backends terminated, and the sink misbehaves.
    Chaos,
    /// Steady load with a fraction of poison events.
    Poison,
    /// Steady load while the sink runs its adversarial fault mode
    /// (`[sink.faults.adversarial]`): random statuses, unreadable answers,
    /// NUL bodies, hangs, resets and sink-wide outages; checked by
    /// [`crate::adversarial`].
    Adversarial,
}

/// Kill and pause relay replicas and cut their database connections at
/// random intervals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ChaosSpec {
    /// SIGKILL a random replica after a uniform random wait in
    /// `[kill_every_min, kill_every_max]` ...
    #[serde(with = "humantime_serde")]
    pub kill_every_min: Duration,
    #[serde(with = "humantime_serde")]
    pub kill_every_max: Duration,
    /// ... and start it again this much later.
    #[serde(with = "humantime_serde")]
    pub restart_after: Duration,
    /// SIGSTOP a random running, unpaused replica after a uniform random wait in
    /// `[pause_every_min, pause_every_max]` (both set, or neither: no pauses) ...
    #[serde(default, with = "humantime_serde")]
    pub pause_every_min: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub pause_every_max: Option<Duration>,
    /// ... and SIGCONT it after `pause_for`, or after a uniform random wait in
    /// `[pause_for, pause_for_max]` when that is set.
    #[serde(with = "humantime_serde")]
    pub pause_for: Duration,
    #[serde(default, with = "humantime_serde")]
    pub pause_for_max: Option<Duration>,
    /// `pg_terminate_backend` every relay backend this often; never when absent.
    #[serde(default, with = "humantime_serde")]
    pub terminate_backends_every: Option<Duration>,
    pub seed: u64,
}

impl Default for ChaosSpec {
    fn default() -> Self {
        ChaosSpec {
            kill_every_min: Duration::from_secs(3),
            kill_every_max: Duration::from_secs(8),
            restart_after: Duration::from_millis(500),
            pause_every_min: None,
            pause_every_max: None,
            pause_for: Duration::from_secs(5),
            pause_for_max: None,
            terminate_backends_every: Some(Duration::from_secs(5)),
            seed: 1,
        }
    }
}

impl ChaosSpec {
    /// `[pause_every_min, pause_every_max]` when pauses are on.
    pub fn pause_every(&self) -> Option<(Duration, Duration)> {
        self.pause_every_min.zip(self.pause_every_max)
    }

    /// `[pause_for, pause_for_max]` (a single value without `pause_for_max`).
    pub fn pause_for_range(&self) -> (Duration, Duration) {
        (self.pause_for, self.pause_for_max.unwrap_or(self.pause_for))
    }

    fn validate(&self) -> Result<(), String> {
        if self.kill_every_min > self.kill_every_max || self.kill_every_min.is_zero() {
            return Err("chaos: need 0 < kill_every_min <= kill_every_max".into());
        }
        match (self.pause_every_min, self.pause_every_max) {
            (None, None) => {}
            (Some(lo), Some(hi)) if !lo.is_zero() && lo <= hi => {
                let (lo, hi) = self.pause_for_range();
                if lo.is_zero() || lo > hi {
                    return Err("chaos: need 0 < pause_for <= pause_for_max".into());
                }
            }
            (Some(_), Some(_)) => {
                return Err("chaos: need 0 < pause_every_min <= pause_every_max".into())
            }
            _ => {
                return Err(
                    "chaos: set both pause_every_min and pause_every_max, or neither".into(),
                )
            }
        }
        Ok(())
    }
}

/// The sink's side of a scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SinkSpec {
    #[serde(with = "humantime_serde")]
    pub dedup_window: Duration,
    pub faults: FaultConfig,
    /// Delivery mode; off when absent.
    pub delivery: Option<DeliverySpec>,
}

impl Default for SinkSpec {
    fn default() -> Self {
        SinkSpec {
            dedup_window: Duration::from_secs(600),
            faults: FaultConfig::default(),
            delivery: None,
        }
    }
}

/// `[sink.delivery]`: the sink delivers what it accepted to a final
/// destination of the harness, as QStash does (flow control, retries after a
/// delay), and the run checks each partition key's order where the events
/// arrive, not only where QStash accepted them. The relay's route points at
/// that destination.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeliverySpec {
    /// Pause before a retry: a duration, or `"qstash"` for QStash's own
    /// `min(86400, e^(2.5·n))` seconds (far longer than a run).
    pub retry_delay: RetryDelay,
    /// Each pause drawn uniformly from `[retry_delay, retry_delay_max]`.
    #[serde(default, with = "humantime_serde")]
    pub retry_delay_max: Option<Duration>,
    /// Retries of a message whose route sets no `retries`.
    pub retries: u32,
    /// Bound on one delivery attempt.
    #[serde(with = "humantime_serde")]
    pub attempt_timeout: Duration,
    /// Fraction of the destination's calls answered 503.
    pub failure_rate: f64,
    /// Time each destination call takes, plus a uniform `[0, jitter)`.
    #[serde(with = "humantime_serde")]
    pub latency: Duration,
    #[serde(with = "humantime_serde")]
    pub jitter: Duration,
    /// Seed of the retry pauses and of the destination's failures.
    pub seed: u64,
    /// Fail the run when, in an ordered scenario, a key's events reach the
    /// destination out of order (else it is only reported).
    pub check_order: bool,
    /// After the drain, how long deliveries and their retries may take to end.
    #[serde(with = "humantime_serde")]
    pub settle_timeout: Duration,
    /// Retries of a callback whose URL does not answer (a replica killed and
    /// not yet restarted), after the same pause as a delivery's.
    pub callback_retries: u32,
}

impl Default for DeliverySpec {
    fn default() -> Self {
        DeliverySpec {
            retry_delay: RetryDelay::Fixed(Duration::from_secs(1)),
            retry_delay_max: None,
            retries: 3,
            attempt_timeout: Duration::from_secs(5),
            failure_rate: 0.0,
            latency: Duration::ZERO,
            jitter: Duration::ZERO,
            seed: 0,
            check_order: true,
            settle_timeout: Duration::from_secs(120),
            callback_retries: 3,
        }
    }
}

impl DeliverySpec {
    /// The sink's delivery settings.
    pub fn delivery(&self) -> DeliveryConfig {
        DeliveryConfig {
            retries: self.retries,
            attempt_timeout: self.attempt_timeout,
            retry_delay: self.retry_delay,
            retry_delay_max: self.retry_delay_max,
            seed: self.seed,
            callback_retries: self.callback_retries,
            ..DeliveryConfig::default()
        }
    }

    /// The final destination's settings.
    pub fn destination(&self) -> DestinationConfig {
        DestinationConfig {
            failure_rate: self.failure_rate,
            latency: self.latency,
            jitter: self.jitter,
            seed: self.seed,
            ..DestinationConfig::default()
        }
    }

    fn validate(&self) -> Result<(), String> {
        self.delivery()
            .validate()
            .map_err(|e| format!("sink.{e}"))?;
        // The destination's keys are delivery keys here.
        self.destination()
            .validate()
            .map_err(|e| format!("sink.{}", e.replacen("destination.", "delivery.", 1)))
    }
}

/// After the outbox is empty: watch its dead tuples until autovacuum has
/// reclaimed them (below `dead_tuples_below`) or `duration` passes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VacuumWatchSpec {
    #[serde(with = "humantime_serde")]
    pub duration: Duration,
    pub dead_tuples_below: i64,
}

impl Default for VacuumWatchSpec {
    fn default() -> Self {
        VacuumWatchSpec {
            duration: Duration::from_secs(120),
            dead_tuples_below: 10_000,
        }
    }
}

/// One scenario file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    #[serde(default)]
    pub description: String,
    pub kind: ScenarioKind,
    /// The route's ordering; `partition_key` also turns on the order check.
    #[serde(default)]
    pub ordering: Ordering,
    /// Backlog written before the relay starts (drain).
    #[serde(default)]
    pub preload: Option<PreloadSpec>,
    /// Load while the relay runs (steady, chaos, poison).
    #[serde(default)]
    pub load: Option<LoadSpec>,
    #[serde(default)]
    pub sink: SinkSpec,
    #[serde(default)]
    pub chaos: Option<ChaosSpec>,
    /// Relay processes run side by side against the run's database, each with
    /// its own config file (its own metrics port) and log. Chaos picks its
    /// victims among them at random.
    #[serde(default = "default_replicas")]
    pub replicas: u32,
    /// Hold vacuum back for the whole run: a REPEATABLE READ transaction with
    /// an xid, opened in the run's database before the relay starts and
    /// committed once the outbox is empty (a long report query, a forgotten
    /// `BEGIN` in psql, a replica with hot_standby_feedback).
    #[serde(default)]
    pub hold_snapshot: bool,
    /// Watch the outbox's dead tuples after the drain (`[vacuum_watch]`).
    #[serde(default)]
    pub vacuum_watch: Option<VacuumWatchSpec>,
    /// Give up waiting for the outbox to empty after this long.
    #[serde(default = "default_drain_timeout", with = "humantime_serde")]
    pub drain_timeout: Duration,
    /// A second route beside the main one (`[second_route]`).
    #[serde(default)]
    pub second_route: Option<SecondRoute>,
    /// Faults done to the relay itself (`[relay_faults]`): its database
    /// connections blackholed, a second relay under one `relay.replica_id`.
    #[serde(default)]
    pub relay_faults: Option<crate::relay_faults::RelayFaultsSpec>,
    /// Merged over the generated relay config, e.g. `[relay_config.relay] claim_batch = 1000`.
    #[serde(default)]
    pub relay_config: toml::Table,
    /// The relay under test: outbox-relay, or the seed article's
    /// (`loadtest/baseline/`, a drain only).
    #[serde(default)]
    pub relay: RelayUnderTest,
    /// The throwaway cluster the run starts when no server is given (`[cluster]`).
    #[serde(default)]
    pub cluster: ClusterSpec,
    /// What the main route publishes to: QStash through the sink (default), or
    /// the sink's `/hook` as a webhook destination (`sink = "webhook"`).
    #[serde(default)]
    pub route_sink: SinkKind,
}

/// `[cluster]`: the throwaway cluster of a run without a database URL.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterSpec {
    /// fsync, synchronous_commit, full_page_writes and autovacuum on, as a
    /// user's server runs. Default: on for the performance kinds (drain,
    /// steady), off for the others (chaos, poison, adversarial), which test
    /// correctness and need speed.
    pub durable: Option<bool>,
    /// `shared_buffers`; default sized for the data: 1 MiB per 1,000 events
    /// preloaded or produced, 256MB to 2GB.
    pub shared_buffers: Option<String>,
    /// More `name=value` server settings.
    pub settings: Vec<String>,
}

/// Which relay a scenario runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RelayUnderTest {
    #[default]
    OutboxRelay,
    /// The seed article's TypeScript relay (`crate::baseline`).
    Seed,
}

/// A second QStash route, listed before the main `event_type = "*"` route
/// (the first match wins), to its own destination path on the sink, so the
/// sink's outages can take one route down (`route = "<path>"`) while the
/// other keeps flowing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecondRoute {
    /// `prefix.*` or an exact type among the producer's (`order.placed`,
    /// `order.paid`, `order.shipped`, `invoice.issued`).
    pub event_type: String,
    /// Its destination's path on the sink, under `/hook/`.
    pub path: String,
    #[serde(default)]
    pub ordering: Ordering,
}

impl SecondRoute {
    /// Its destination URL on the sink listening on `sink_port`.
    pub fn destination(&self, sink_port: u16) -> String {
        format!("http://127.0.0.1:{sink_port}{}", self.path)
    }
}

fn default_replicas() -> u32 {
    1
}

fn default_drain_timeout() -> Duration {
    Duration::from_secs(300)
}

/// More relay processes than this on one machine measures the machine.
pub const MAX_REPLICAS: u32 = 32;

#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("scenario `{name}`: {message}")]
    Invalid { name: String, message: String },
    #[error("generated relay config: {0}")]
    RelayConfig(String),
}

impl Scenario {
    pub fn load(path: &Path) -> Result<Scenario, ScenarioError> {
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let s = Self::from_toml_str(&text).map_err(|e| match e {
            ScenarioError::Parse { message, .. } => ScenarioError::Parse {
                path: path.display().to_string(),
                message,
            },
            other => other,
        })?;
        Ok(s)
    }

    pub fn from_toml_str(text: &str) -> Result<Scenario, ScenarioError> {
        let s: Scenario = toml::from_str(text).map_err(|e| ScenarioError::Parse {
            path: "<string>".into(),
            message: e.to_string(),
        })?;
        s.validate()?;
        Ok(s)
    }

    pub fn validate(&self) -> Result<(), ScenarioError> {
        let invalid = |message: String| ScenarioError::Invalid {
            name: self.name.clone(),
            message,
        };
        if self.relay == RelayUnderTest::Seed && self.kind != ScenarioKind::Drain {
            return Err(invalid(
                "`relay = \"seed\"` runs a drain only: set kind = \"drain\"".into(),
            ));
        }
        match self.kind {
            ScenarioKind::Drain if self.preload.is_none() => {
                return Err(invalid("a drain scenario needs [preload]".into()))
            }
            ScenarioKind::Steady
            | ScenarioKind::Chaos
            | ScenarioKind::Poison
            | ScenarioKind::Adversarial
                if self.load.is_none() =>
            {
                return Err(invalid(format!("a {:?} scenario needs [load]", self.kind)))
            }
            ScenarioKind::Chaos if self.chaos.is_none() => {
                return Err(invalid("a chaos scenario needs [chaos]".into()))
            }
            ScenarioKind::Adversarial if self.sink.faults.adversarial.is_none() => {
                return Err(invalid(
                    "an adversarial scenario needs [sink.faults.adversarial]".into(),
                ))
            }
            ScenarioKind::Poison => {
                let fraction = self.load.as_ref().map_or(0.0, |l| l.mix.poison_fraction);
                if fraction <= 0.0 && self.sink.faults.poison_ids.is_empty() {
                    return Err(invalid(
                        "a poison scenario needs load.poison_fraction > 0 or sink.faults.poison_ids".into(),
                    ));
                }
            }
            _ => {}
        }
        if let Some(l) = &self.load {
            l.validate().map_err(|m| invalid(format!("load: {m}")))?;
        }
        if let Some(p) = &self.preload {
            p.mix
                .validate()
                .map_err(|m| invalid(format!("preload: {m}")))?;
        }
        if let Some(w) = &self.vacuum_watch {
            if w.duration.is_zero() || w.dead_tuples_below <= 0 {
                return Err(invalid(
                    "vacuum_watch: need duration > 0 and dead_tuples_below > 0".into(),
                ));
            }
        }
        if let Some(c) = &self.chaos {
            c.validate().map_err(invalid)?;
        }
        if !(1..=MAX_REPLICAS).contains(&self.replicas) {
            return Err(invalid(format!(
                "replicas: need 1 <= replicas <= {MAX_REPLICAS}"
            )));
        }
        if let Some(r) = &self.second_route {
            if !r.path.starts_with("/hook/") {
                return Err(invalid(format!(
                    "second_route.path: `{}` must start with /hook/ (the sink's webhook paths)",
                    r.path
                )));
            }
            if r.ordering == Ordering::PartitionKey {
                return Err(invalid(
                    "second_route.ordering: \"partition_key\" needs callbacks; use \"partition_key_to_qstash\" or \"none\"".into(),
                ));
            }
        }
        if let Some(f) = &self.relay_faults {
            f.validate(&self.relay_config).map_err(invalid)?;
        }
        self.sink.faults.validate().map_err(invalid)?;
        if let Some(d) = &self.sink.delivery {
            d.validate().map_err(invalid)?;
        }
        if self.takes_callbacks() && self.sink.delivery.is_none() {
            return Err(invalid(
                "ordering = \"partition_key\" holds each key until QStash's callback: it needs [sink.delivery] (the sink delivers and calls back); use \"partition_key_to_qstash\" without it".into(),
            ));
        }
        Ok(())
    }

    pub fn ordered(&self) -> bool {
        self.ordering.per_key()
    }

    /// A performance scenario (drain, steady): its figures are what users
    /// compare, so its cluster is durable and its sink runs in a process of
    /// its own unless the scenario needs the sink's in-process features.
    pub fn is_performance(&self) -> bool {
        matches!(self.kind, ScenarioKind::Drain | ScenarioKind::Steady)
    }

    /// Events preloaded plus those the load produces at most.
    pub fn expected_events(&self) -> u64 {
        self.preload.as_ref().map_or(0, |p| p.events)
            + self.load.as_ref().map_or(0, |l| {
                l.max_events
                    .unwrap_or(u64::MAX)
                    .min(l.rate.map_or(0, |r| (r * l.duration.as_secs_f64()) as u64))
            })
    }

    /// The throwaway cluster's settings; `fsync_off` forces the fast,
    /// non-durable settings (a labelled extra, never the headline figure).
    pub fn cluster_options(&self, fsync_off: bool) -> outbox_testkit::ClusterOptions {
        let mib = (self.expected_events() / 1000).clamp(256, 2048);
        outbox_testkit::ClusterOptions {
            durable: !fsync_off && self.cluster.durable.unwrap_or(self.is_performance()),
            shared_buffers: Some(
                self.cluster
                    .shared_buffers
                    .clone()
                    .unwrap_or_else(|| format!("{mib}MB")),
            ),
            settings: self.cluster.settings.clone(),
            ..outbox_testkit::ClusterOptions::default()
        }
    }

    /// Does the sink run in a process of its own? For performance scenarios
    /// whose sink needs nothing but counting: no faults, no delivery (the
    /// in-process sink's outage schedule, answers and deliveries are read
    /// by the harness while it runs).
    pub fn sink_in_own_process(&self) -> bool {
        self.is_performance()
            && self.sink.delivery.is_none()
            && self.sink.faults == FaultConfig::default()
    }
}

/// How long an ordered QStash route waits for a callback before it sends
/// the event again: 20 s, or 20 s more than the destination's slowest
/// answer when that is longer, so a slow destination's events are held,
/// not sent again while their delivery is still going on.
fn callback_timeout(delivery: Option<&DeliverySpec>) -> Duration {
    let slowest = delivery.map_or(Duration::ZERO, |d| d.latency + d.jitter);
    let timeout = Duration::from_secs(20) + slowest;
    Duration::from_secs(timeout.as_secs_f64().ceil() as u64)
}

/// The relay config for a run, as TOML: defaults, one QStash route
/// `event_type = "*"` to `http://127.0.0.1:<sink_port>/hook` with the scenario's
/// ordering, the metrics listener on `metrics_port`, then the scenario's
/// `relay_config` merged over it. Secrets and the database URL are left out:
/// the relay reads DATABASE_URL, QSTASH_URL and QSTASH_TOKEN from its environment.
pub fn relay_config_toml(
    scenario: &Scenario,
    sink_port: u16,
    metrics_port: u16,
) -> Result<String, ScenarioError> {
    let destination = format!("http://127.0.0.1:{sink_port}/hook");
    let ports = ReplicaPorts {
        metrics: metrics_port,
        callback: None,
    };
    replica_config_toml(scenario, sink_port, &destination, ports, 0)
}

/// The loopback ports one replica listens on.
#[derive(Debug, Clone, Copy)]
pub struct ReplicaPorts {
    pub metrics: u16,
    /// QStash's callbacks (`server.callback_bind`): needed by a scenario
    /// ordered at the destination (`ordering = "partition_key"`), whose route
    /// takes delivery callbacks.
    pub callback: Option<u16>,
}

impl Scenario {
    /// Does the route hold each key until QStash's callback (and so need a
    /// callback listener per replica)?
    pub fn takes_callbacks(&self) -> bool {
        self.ordering == Ordering::PartitionKey && self.route_sink == SinkKind::Qstash
    }
}

/// The webhook route's signing secret (Standard Webhooks `whsec_` + base64):
/// the sink does not verify it.
const WEBHOOK_SECRET: &str = "whsec_bG9hZHRlc3Qtd2ViaG9vay1zZWNyZXQ=";

/// [`relay_config_toml`] for replica `replica` (0-based) of the run: every
/// `{replica}` in a string value of the scenario's `relay_config` becomes the
/// replica's number, so replicas can differ, e.g. in a log prefix or (once
/// the engine has it) `relay.replica_id = "loadtest-{replica}"`. The route's
/// destination is `destination` (the sink's `/hook`, or the final destination
/// in delivery mode). A scenario ordered at the destination gets the
/// callback listener on `ports.callback`, verified with the stand-in's
/// signing key, and its route names that listener as its `callback`.
pub fn replica_config_toml(
    scenario: &Scenario,
    sink_port: u16,
    destination: &str,
    ports: ReplicaPorts,
    replica: u32,
) -> Result<String, ScenarioError> {
    let err = |e: &dyn std::fmt::Display| ScenarioError::RelayConfig(e.to_string());
    let mut config = outbox_relay::Config::default();
    config.server.metrics_bind = Some(std::net::SocketAddr::from(([127, 0, 0, 1], ports.metrics)));
    let callback = match (scenario.takes_callbacks(), ports.callback) {
        (true, Some(port)) => {
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            config.server.callback_bind = Some(addr);
            Some(format!(
                "http://{addr}{}",
                outbox_relay::server::callback::CALLBACK_PATH
            ))
        }
        (true, None) => {
            return Err(ScenarioError::RelayConfig(
                "an ordering = \"partition_key\" scenario takes QStash's callbacks: it needs a callback port".into(),
            ))
        }
        (false, _) => None,
    };
    let mut value = toml::Value::try_from(&config).map_err(|e| err(&e))?;
    let table = value
        .as_table_mut()
        .expect("a struct serializes to a table");
    let mut route = toml::Table::new();
    route.insert("event_type".into(), "*".into());
    match scenario.route_sink {
        SinkKind::Qstash => {
            route.insert("sink".into(), "qstash".into());
        }
        SinkKind::Webhook => {
            route.insert("sink".into(), "webhook".into());
            route.insert("signing_secret".into(), WEBHOOK_SECRET.into());
        }
    }
    route.insert("destination".into(), destination.into());
    let ordering = toml::Value::try_from(scenario.ordering).map_err(|e| err(&e))?;
    route.insert("ordering".into(), ordering);
    if scenario.ordered() {
        route.insert("parallelism".into(), 1.into());
    }
    if let Some(url) = callback {
        route.insert("callback".into(), url.into());
        // A callback that never comes (a killed replica's, retried in vain)
        // costs this long before the event is sent again.
        let timeout = callback_timeout(scenario.sink.delivery.as_ref());
        route.insert(
            "callback_timeout".into(),
            format!("{}s", timeout.as_secs()).into(),
        );
    }
    let mut routes = Vec::new();
    if let Some(second) = &scenario.second_route {
        let mut r = toml::Table::new();
        r.insert("event_type".into(), second.event_type.as_str().into());
        r.insert("sink".into(), "qstash".into());
        r.insert("destination".into(), second.destination(sink_port).into());
        r.insert(
            "ordering".into(),
            toml::Value::try_from(second.ordering).map_err(|e| err(&e))?,
        );
        if second.ordering.per_key() {
            r.insert("parallelism".into(), 1.into());
        }
        routes.push(r.into());
    }
    routes.push(route.into());
    table.insert("routes".into(), toml::Value::Array(routes));
    if scenario.takes_callbacks() {
        // Written as text: the config's own serialisation prints secrets
        // redacted, which would leave the relay verifying with "<redacted>".
        if let Some(toml::Value::Table(qstash)) = table.get_mut("qstash") {
            qstash.insert(
                "current_signing_key".into(),
                outbox_testkit::sink::DEV_CURRENT_SIGNING_KEY.into(),
            );
        }
    }
    let mut overrides = scenario.relay_config.clone();
    substitute_replica(&mut overrides, replica);
    merge(table, &overrides);
    // Only what differs from the defaults: a relay built from an older
    // commit (a side-by-side run's `before`) refuses keys it does not know.
    let defaults = toml::Value::try_from(outbox_relay::Config::default()).map_err(|e| err(&e))?;
    if let Some(defaults) = defaults.as_table() {
        prune_defaults(table, defaults);
    }
    let text = toml::to_string_pretty(&value).map_err(|e| err(&e))?;
    // Check it the way the relay will, with the secrets it gets from the environment.
    let mut check: outbox_relay::Config = toml::from_str(&text).map_err(|e| err(&e))?;
    check.database.url = "postgres://check@127.0.0.1/check".into();
    check.qstash.url = format!("http://127.0.0.1:{sink_port}")
        .parse()
        .map_err(|e: String| err(&e))?;
    check.qstash.token = "check".parse().map_err(|e: String| err(&e))?;
    check.validate().map_err(|e| err(&e))?;
    Ok(text)
}

/// `{replica}` -> `replica` in every string, at any depth.
fn substitute_replica(table: &mut toml::Table, replica: u32) {
    fn walk(v: &mut toml::Value, replica: &str) {
        match v {
            toml::Value::String(s) if s.contains("{replica}") => {
                *s = s.replace("{replica}", replica);
            }
            toml::Value::Array(a) => a.iter_mut().for_each(|v| walk(v, replica)),
            toml::Value::Table(t) => t.iter_mut().for_each(|(_, v)| walk(v, replica)),
            _ => {}
        }
    }
    let replica = replica.to_string();
    table.iter_mut().for_each(|(_, v)| walk(v, &replica));
}

/// Removes every key of `table` whose value equals `defaults`' (tables key
/// by key; a table left empty goes too).
fn prune_defaults(table: &mut toml::Table, defaults: &toml::Table) {
    table.retain(|k, v| match (v, defaults.get(k)) {
        (toml::Value::Table(t), Some(toml::Value::Table(d))) => {
            prune_defaults(t, d);
            !t.is_empty()
        }
        (v, Some(d)) => v != d,
        (_, None) => true,
    });
}

/// Deep merge: tables merge key by key, anything else is replaced.
fn merge(base: &mut toml::Table, over: &toml::Table) {
    for (k, v) in over {
        match (base.get_mut(k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            _ => {
                base.insert(k.clone(), v.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORDERED: &str = r#"
name = "t"
kind = "steady"
ordering = "partition_key_to_qstash"
[load]
rate = 100.0
duration = "2s"
[relay_config.relay]
claim_batch = 50
[relay_config.qstash]
mode = "single"
"#;

    #[test]
    fn a_second_route_comes_first_to_its_own_path() {
        let text = format!(
            "{ORDERED}\n[second_route]\nevent_type = \"invoice.*\"\npath = \"/hook/invoices\"\n"
        );
        let s = Scenario::from_toml_str(&text).unwrap();
        let c: outbox_relay::Config =
            toml::from_str(&relay_config_toml(&s, 4321, 4322).unwrap()).unwrap();
        assert_eq!(c.routes.len(), 2);
        assert_eq!(c.routes[0].event_type.to_string(), "invoice.*");
        assert_eq!(
            c.routes[0].destination.as_str(),
            "http://127.0.0.1:4321/hook/invoices"
        );
        assert_eq!(c.routes[0].ordering, Ordering::None);
        assert_eq!(c.routes[1].ordering, Ordering::PartitionKeyToQstash);
        let bad = text.replace("/hook/invoices", "/elsewhere");
        let e = Scenario::from_toml_str(&bad).unwrap_err().to_string();
        assert!(e.contains("second_route.path"), "{e}");
    }

    #[test]
    fn a_slow_destination_gets_a_callback_timeout_longer_than_its_answers() {
        let mut d = DeliverySpec::default();
        assert_eq!(callback_timeout(None), Duration::from_secs(20));
        assert_eq!(callback_timeout(Some(&d)), Duration::from_secs(20));
        d.latency = Duration::from_secs(150);
        d.jitter = Duration::from_millis(500);
        assert_eq!(callback_timeout(Some(&d)), Duration::from_secs(171));
    }

    #[test]
    fn generated_relay_config_has_the_route_and_overrides() {
        let s = Scenario::from_toml_str(ORDERED).unwrap();
        let text = relay_config_toml(&s, 4321, 4322).unwrap();
        let c: outbox_relay::Config = toml::from_str(&text).unwrap();
        assert_eq!(c.routes.len(), 1);
        assert_eq!(
            c.routes[0].destination.as_str(),
            "http://127.0.0.1:4321/hook"
        );
        assert_eq!(c.routes[0].event_type.to_string(), "*");
        assert_eq!(c.routes[0].ordering, Ordering::PartitionKeyToQstash);
        assert_eq!(c.routes[0].parallelism.map(|p| p.get()), Some(1));
        assert_eq!(c.relay.claim_batch, 50);
        assert_eq!(
            c.relay.shards,
            outbox_relay::config::RelayConfig::default().shards,
            "untouched keys keep their defaults"
        );
        assert_eq!(c.qstash.mode, outbox_relay::config::PublishMode::Single);
        assert_eq!(c.server.metrics_bind.unwrap().port(), 4322);
        assert!(c.qstash.token.is_empty() && c.database.url.is_empty());
    }

    const CHAOS: &str = r#"
name = "c"
kind = "chaos"
replicas = 3
[load]
rate = 100.0
duration = "2s"
[chaos]
kill_every_min = "5s"
kill_every_max = "15s"
pause_every_min = "7s"
pause_every_max = "15s"
pause_for = "4s"
pause_for_max = "6s"
[relay_config.relay]
claim_batch = 50
[relay_config.qstash]
current_signing_key = "sig-replica-{replica}"
"#;

    #[test]
    fn replicas_and_pauses_parse_validate_and_default() {
        let s = Scenario::from_toml_str(CHAOS).unwrap();
        assert_eq!(s.replicas, 3);
        let c = s.chaos.as_ref().unwrap();
        assert_eq!(
            c.pause_every(),
            Some((Duration::from_secs(7), Duration::from_secs(15)))
        );
        assert_eq!(
            c.pause_for_range(),
            (Duration::from_secs(4), Duration::from_secs(6))
        );
        let one = Scenario::from_toml_str(ORDERED).unwrap();
        assert_eq!(one.replicas, 1);
        assert_eq!(ChaosSpec::default().pause_every(), None);

        for (from, to, why) in [
            ("replicas = 3", "replicas = 0", "replicas"),
            ("pause_every_max = \"15s\"", "", "both"),
            (
                "pause_every_min = \"7s\"",
                "pause_every_min = \"20s\"",
                "pause_every_min",
            ),
            (
                "pause_for_max = \"6s\"",
                "pause_for_max = \"3s\"",
                "pause_for",
            ),
            ("pause_for = \"4s\"", "pause_for = \"0s\"", "pause_for"),
        ] {
            let e = Scenario::from_toml_str(&CHAOS.replace(from, to)).unwrap_err();
            assert!(e.to_string().contains(why), "{from} -> {to}: {e}");
        }
    }

    #[test]
    fn a_scenario_ordered_at_the_destination_routes_callbacks_to_each_replica() {
        let at_the_door = ORDERED.replace(
            "ordering = \"partition_key_to_qstash\"",
            "ordering = \"partition_key\"",
        );
        let e = Scenario::from_toml_str(&at_the_door).unwrap_err();
        assert!(e.to_string().contains("[sink.delivery]"), "{e}");
        let s = Scenario::from_toml_str(&format!(
            "{at_the_door}[sink.delivery]\nretry_delay = \"1s\"\n"
        ))
        .unwrap();
        assert!(s.takes_callbacks());
        let ports = ReplicaPorts {
            metrics: 4330,
            callback: Some(4340),
        };
        let text = replica_config_toml(&s, 4321, "http://127.0.0.1:4322/events", ports, 0).unwrap();
        let c: outbox_relay::Config = toml::from_str(&text).unwrap();
        assert_eq!(
            c.routes[0].callback.as_ref().map(|u| u.as_str()),
            Some("http://127.0.0.1:4340/qstash/callback")
        );
        assert_eq!(c.server.callback_bind.unwrap().port(), 4340);
        assert_eq!(
            c.qstash.current_signing_key.expose(),
            outbox_testkit::sink::DEV_CURRENT_SIGNING_KEY,
            "the relay must verify callbacks with the stand-in's key"
        );
        let none = ReplicaPorts {
            metrics: 4330,
            callback: None,
        };
        assert!(replica_config_toml(&s, 4321, "http://127.0.0.1:4322/events", none, 0).is_err());
    }

    #[test]
    fn each_replica_gets_its_number_in_overrides() {
        let s = Scenario::from_toml_str(CHAOS).unwrap();
        for replica in [0, 2] {
            let ports = ReplicaPorts {
                metrics: 4330 + replica as u16,
                callback: None,
            };
            let text = replica_config_toml(&s, 4321, "http://127.0.0.1:4321/hook", ports, replica)
                .unwrap();
            let c: toml::Table = toml::from_str(&text).unwrap();
            assert_eq!(
                c["qstash"]["current_signing_key"].as_str(),
                Some(format!("sig-replica-{replica}").as_str()),
                "{text}"
            );
            assert_eq!(
                c["server"]["metrics_bind"].as_str(),
                Some(format!("127.0.0.1:{}", 4330 + replica).as_str())
            );
        }
    }

    #[test]
    fn performance_scenarios_get_a_durable_cluster_sized_for_their_data() {
        // steady, 100 events/s for 2 s: a performance scenario.
        let steady = Scenario::from_toml_str(ORDERED).unwrap();
        let o = steady.cluster_options(false);
        assert!(o.durable);
        assert_eq!(o.shared_buffers.as_deref(), Some("256MB"));
        assert!(
            o.server_settings().contains("-c fsync=on"),
            "{}",
            o.server_settings()
        );
        assert!(o.server_settings().contains("-c autovacuum=on"));
        // --fsync-off: the fast settings, whatever the scenario says.
        let fast = steady.cluster_options(true);
        assert!(!fast.durable);
        assert!(fast.server_settings().contains("-c fsync=off"));
        // Correctness scenarios keep the fast settings unless they ask.
        let chaos = Scenario::from_toml_str(CHAOS).unwrap();
        assert!(!chaos.cluster_options(false).durable);
        let asked = format!("{CHAOS}\n[cluster]\ndurable = true\nsettings = [\"work_mem=8MB\"]\n");
        let asked = Scenario::from_toml_str(&asked)
            .unwrap()
            .cluster_options(false);
        assert!(asked.durable);
        assert!(asked.server_settings().ends_with(" -c work_mem=8MB"));
        // 1 MiB per 1,000 events, up to 2GB.
        let big = ORDERED
            .replace("rate = 100.0", "rate = 300000.0")
            .replace("\"2s\"", "\"1s\"");
        let big = Scenario::from_toml_str(&big).unwrap();
        assert_eq!(
            big.cluster_options(false).shared_buffers.as_deref(),
            Some("300MB")
        );
        let huge = ORDERED.replace("\"2s\"", "\"100000s\"");
        let huge = Scenario::from_toml_str(&huge).unwrap();
        assert_eq!(
            huge.cluster_options(false).shared_buffers.as_deref(),
            Some("2048MB")
        );
    }

    #[test]
    fn the_generated_config_names_only_what_differs_from_the_defaults() {
        let s = Scenario::from_toml_str(ORDERED).unwrap();
        let text = relay_config_toml(&s, 4321, 4322).unwrap();
        let c: toml::Table = toml::from_str(&text).unwrap();
        // An older relay refuses keys it does not know: none of the
        // defaults is written, only the route, the ports and the overrides.
        assert!(c.get("database").is_none(), "{text}");
        assert_eq!(c["relay"].as_table().unwrap().len(), 1, "{text}");
        assert_eq!(c["relay"]["claim_batch"].as_integer(), Some(50));
        assert_eq!(c["server"]["metrics_bind"].as_str(), Some("127.0.0.1:4322"));
        assert_eq!(c["routes"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn bad_overrides_and_missing_sections_are_refused() {
        let bad = ORDERED.replace("claim_batch = 50", "claim_batchh = 50");
        let s = Scenario::from_toml_str(&bad).unwrap();
        assert!(relay_config_toml(&s, 1, 2).is_err());
        let e = Scenario::from_toml_str("name = \"d\"\nkind = \"drain\"").unwrap_err();
        assert!(e.to_string().contains("[preload]"), "{e}");
        let e = Scenario::from_toml_str("name = \"x\"\nkind = \"steady\"\nspeed = 1").unwrap_err();
        assert!(e.to_string().contains("speed"), "{e}");
    }
}
