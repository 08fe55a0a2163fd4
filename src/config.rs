//! One configuration tree, loaded once at start from a TOML file and the
//! environment, validated before anything connects. Every error names its key.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

/// Environment prefix for every key: `OUTBOX_RELAY_RELAY__SHARDS=4` sets `relay.shards`.
pub const ENV_PREFIX: &str = "OUTBOX_RELAY_";

/// The default QStash endpoint (the official SDKs' default region).
pub const DEFAULT_QSTASH_URL: &str = "https://qstash.upstash.io";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Parsing, an unknown key or a wrong type; figment's message names the key.
    #[error("configuration: {0}")]
    Load(String),
    #[error("configuration key `{key}`: {reason}")]
    Invalid { key: String, reason: String },
}

impl ConfigError {
    fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            reason: reason.into(),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub database: DatabaseConfig,
    pub relay: RelayConfig,
    pub qstash: QstashConfig,
    pub http: HttpConfig,
    pub server: ServerConfig,
    pub janitor: JanitorConfig,
    pub routes: Vec<RouteConfig>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// A libpq-style URL; `sslmode=require` (or `verify-full`) connects over TLS.
    /// `DATABASE_URL` overrides it.
    pub url: String,
    /// Pooled connections for claimers, the marker and the gauges.
    pub pool_size: u32,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// Shards, one claimer each; a row's shard is a hash of its partition key.
    /// Must equal the database's count (`outbox_relay_settings`, 8 unless
    /// changed with `outbox-relay reshard`).
    pub shards: u32,
    /// Publisher actors sharing the HTTP client.
    pub publishers: u32,
    /// Rows one claim statement takes.
    pub claim_batch: u32,
    /// Rows claimed but not yet marked, over all claimers (backpressure bound).
    pub max_in_flight: u32,
    /// How long a claimed row is ours; another relay may claim it after that.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// Claim at least this often when the listener has not woken the claimers.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// The attempt that reaches this count and fails dead-letters the row.
    pub max_attempts: u32,
    #[serde(with = "humantime_serde")]
    pub backoff_base: Duration,
    #[serde(with = "humantime_serde")]
    pub backoff_cap: Duration,
    /// The marker flushes after this many outcomes ...
    pub mark_batch: u32,
    /// ... or after this long, whichever comes first.
    #[serde(with = "humantime_serde")]
    pub mark_interval: Duration,
    /// On SIGTERM, in-flight publishes get this long to finish.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Restarts allowed per actor within `restart_window` before the relay gives up.
    pub max_restarts: u32,
    #[serde(with = "humantime_serde")]
    pub restart_window: Duration,
    /// This replica's name among those sharing the database; empty means
    /// `<hostname>-<pid>`. A replica restarted under the same name takes its
    /// shards back at once instead of waiting for their leases to end.
    pub replica_id: String,
    /// How long a replica owns a shard without renewing (renewed every
    /// quarter of it). A replica that dies loses its shards after this long.
    #[serde(with = "humantime_serde")]
    pub shard_lease: Duration,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct QstashConfig {
    /// `QSTASH_URL` overrides it.
    pub url: String,
    /// `QSTASH_TOKEN` overrides it. Never logged.
    pub token: String,
    /// Used by the failure-callback endpoint. `QSTASH_CURRENT_SIGNING_KEY`.
    pub current_signing_key: String,
    /// `QSTASH_NEXT_SIGNING_KEY`.
    pub next_signing_key: String,
    /// `batch` sends many events per `POST /v2/batch`; `single` one `POST /v2/publish` each.
    pub mode: PublishMode,
    /// Messages per `/v2/batch` request.
    pub batch_size: u32,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum PublishMode {
    Batch,
    Single,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// The whole exchange: request, response headers and body.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Response bodies longer than this are cut (they only feed `last_error`).
    pub max_response_bytes: usize,
    /// A request body over this size is dead-lettered without sending (QStash's
    /// message limit on the smallest plan is 1 MB).
    pub max_message_bytes: usize,
    pub pool_idle_timeout_secs: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// `/metrics`, `/healthz`, `/readyz`: keep it on a private address.
    pub metrics_bind: Option<SocketAddr>,
    /// QStash's failure callback (`POST /qstash/failure`) must face the internet:
    /// it gets a listener of its own. Off unless set.
    pub callback_bind: Option<SocketAddr>,
    /// `/readyz` fails when the oldest pending event is older than this and
    /// nothing was delivered since the last check.
    #[serde(with = "humantime_serde")]
    pub ready_max_pending_age: Duration,
    /// Gauges sampled from the database this often.
    #[serde(with = "humantime_serde")]
    pub stats_interval: Duration,
    /// Clock tolerance when verifying QStash signatures.
    #[serde(with = "humantime_serde")]
    pub signature_tolerance: Duration,
}

/// Retention inside the daemon: batched deletes of old published outbox rows
/// and old consumer dedupe rows (`ops::prune`). Off by default, since many
/// teams prune from cron or by dropping partitions instead.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct JanitorConfig {
    pub enabled: bool,
    /// Time between two pruning passes (the first runs at start).
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Published outbox rows older than this (by `published_at`) are deleted.
    #[serde(with = "humantime_serde")]
    pub retain_published: Duration,
    /// `processed_messages` rows older than this are deleted; keep it longer
    /// than the longest redelivery horizon, or a late retry is processed twice.
    #[serde(with = "humantime_serde")]
    pub retain_processed: Duration,
    /// Rows per DELETE statement; each statement is its own short transaction.
    pub batch: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// `order.placed` (exact), `order.*` (prefix), or `*` (everything).
    pub event_type: String,
    #[serde(default)]
    pub sink: SinkKind,
    /// URL template: `{event_type}`, `{aggregate_type}`, `{aggregate_id}`,
    /// `{tenant_id}`, `{partition_key}` are replaced (percent-encoded).
    pub destination: String,
    /// QStash `Upstash-Retries` (how often QStash retries delivery).
    #[serde(default)]
    pub retries: Option<u32>,
    #[serde(default)]
    pub ordering: Ordering,
    /// Flow-control parallelism sent with ordered events (1 keeps the order).
    #[serde(default)]
    pub parallelism: Option<u32>,
    /// Flow-control rate per period for this route's key.
    #[serde(default)]
    pub rate: Option<u32>,
    #[serde(default, with = "humantime_serde")]
    pub period: Option<Duration>,
    #[serde(default)]
    pub failure_callback: Option<String>,
    #[serde(default, with = "humantime_serde")]
    pub delay: Option<Duration>,
    /// `Upstash-Method` (QStash) or the request method (webhook).
    #[serde(default = "default_method")]
    pub method: String,
    #[serde(default)]
    pub body: BodyShape,
    /// `whsec_…` secret for webhook routes (Standard Webhooks signing).
    #[serde(default)]
    pub signing_secret: Option<String>,
}

fn default_method() -> String {
    "POST".to_owned()
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SinkKind {
    #[default]
    Qstash,
    Webhook,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Ordering {
    #[default]
    None,
    PartitionKey,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum BodyShape {
    /// `{id, type, aggregateType, aggregateId, tenantId, partitionKey, payload, createdAt}`
    #[default]
    Envelope,
    /// The row's `payload` alone.
    Payload,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: String::new(),
            pool_size: 12,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            shards: 8,
            publishers: 4,
            claim_batch: 500,
            max_in_flight: 5000,
            lease: Duration::from_secs(60),
            poll_interval: Duration::from_secs(1),
            max_attempts: 10,
            backoff_base: Duration::from_secs(1),
            backoff_cap: Duration::from_secs(300),
            mark_batch: 1000,
            mark_interval: Duration::from_millis(5),
            shutdown_grace: Duration::from_secs(10),
            max_restarts: 10,
            restart_window: Duration::from_secs(60),
            replica_id: String::new(),
            shard_lease: Duration::from_secs(10),
        }
    }
}

impl Default for QstashConfig {
    fn default() -> Self {
        QstashConfig {
            url: DEFAULT_QSTASH_URL.to_owned(),
            token: String::new(),
            current_signing_key: String::new(),
            next_signing_key: String::new(),
            mode: PublishMode::Batch,
            batch_size: 100,
        }
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(15),
            max_response_bytes: 64 * 1024,
            max_message_bytes: 1024 * 1024,
            pool_idle_timeout_secs: 30,
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            metrics_bind: Some(SocketAddr::from(([127, 0, 0, 1], 9464))),
            callback_bind: None,
            ready_max_pending_age: Duration::from_secs(300),
            stats_interval: Duration::from_secs(5),
            signature_tolerance: Duration::from_secs(30),
        }
    }
}

impl Default for JanitorConfig {
    fn default() -> Self {
        JanitorConfig {
            enabled: false,
            interval: Duration::from_secs(5 * 60),
            retain_published: Duration::from_secs(7 * 24 * 3600),
            retain_processed: Duration::from_secs(7 * 24 * 3600),
            batch: 5000,
        }
    }
}

impl JanitorConfig {
    /// Checked whether or not the janitor is enabled, so a typo shows at once.
    fn validate(&self) -> Result<(), ConfigError> {
        if self.interval.is_zero() {
            return Err(ConfigError::invalid(
                "janitor.interval",
                "must be more than zero",
            ));
        }
        if self.retain_published.is_zero() {
            return Err(ConfigError::invalid(
                "janitor.retain_published",
                "must be more than zero",
            ));
        }
        if self.retain_processed.is_zero() {
            return Err(ConfigError::invalid(
                "janitor.retain_processed",
                "must be more than zero",
            ));
        }
        // Past this a batch is a long transaction again, which is what batching avoids.
        if self.batch == 0 || self.batch > 100_000 {
            return Err(ConfigError::invalid(
                "janitor.batch",
                "must be between 1 and 100000",
            ));
        }
        Ok(())
    }
}

/// Well-known variables that other tools already use, mapped onto our keys.
const WELL_KNOWN_ENV: &[(&str, &str)] = &[
    ("DATABASE_URL", "database.url"),
    ("QSTASH_URL", "qstash.url"),
    ("QSTASH_TOKEN", "qstash.token"),
    ("QSTASH_CURRENT_SIGNING_KEY", "qstash.current_signing_key"),
    ("QSTASH_NEXT_SIGNING_KEY", "qstash.next_signing_key"),
];

impl Config {
    /// Defaults, then the file (if any), then `OUTBOX_RELAY_…`, then the
    /// well-known variables; validated.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        if let Some(path) = path {
            if !path.exists() {
                return Err(ConfigError::Load(format!(
                    "file {} does not exist",
                    path.display()
                )));
            }
            figment = figment.merge(Toml::file_exact(path));
        }
        Self::from_figment(figment)
    }

    /// Like [`Config::load`] with the TOML given as a string (tests, embedding).
    pub fn from_toml_str(toml: &str) -> Result<Config, ConfigError> {
        Self::from_figment(
            Figment::from(Serialized::defaults(Config::default())).merge(Toml::string(toml)),
        )
    }

    fn from_figment(figment: Figment) -> Result<Config, ConfigError> {
        // OUTBOX_RELAY_LOG and OUTBOX_RELAY_LOG_FORMAT steer logging, not config.
        let mut figment = figment.merge(
            Env::prefixed(ENV_PREFIX)
                .ignore(&["log", "log_format"])
                .split("__"),
        );
        for (var, key) in WELL_KNOWN_ENV {
            if let Ok(value) = std::env::var(var) {
                if !value.is_empty() {
                    figment = figment.merge(Serialized::default(key, value));
                }
            }
        }
        let mut config: Config = figment.extract().map_err(|e| {
            // figment can report several errors; name each with its key.
            ConfigError::Load(
                e.into_iter()
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>()
                    .join("; "),
            )
        })?;
        config.resolve()?;
        config.validate()?;
        Ok(config)
    }

    /// What the file and environment say, made usable: secrets trimmed of
    /// the white space a file or a Kubernetes secret leaves around them
    /// (a token ending in a newline would be sent as a bare `Bearer`), and
    /// `${VAR}` in route URLs replaced by the environment variable's value.
    fn resolve(&mut self) -> Result<(), ConfigError> {
        for secret in [
            &mut self.qstash.token,
            &mut self.qstash.current_signing_key,
            &mut self.qstash.next_signing_key,
        ] {
            let trimmed = secret.trim();
            if trimmed.len() != secret.len() {
                *secret = trimmed.to_owned();
            }
        }
        for (i, route) in self.routes.iter_mut().enumerate() {
            if let Some(s) = &mut route.signing_secret {
                *s = s.trim().to_owned();
            }
            route.destination =
                expand_env(&route.destination, &format!("routes[{i}].destination"))?;
            if let Some(cb) = &mut route.failure_callback {
                *cb = expand_env(cb, &format!("routes[{i}].failure_callback"))?;
            }
        }
        Ok(())
    }

    /// Checks what running the relay needs beyond [`Config::validate`]: at
    /// least one route (without one every event would be dead-lettered).
    pub fn validate_for_relay(&self) -> Result<(), ConfigError> {
        self.validate()?;
        if self.routes.is_empty() {
            return Err(ConfigError::invalid(
                "routes",
                "no route is configured, so every event would be dead-lettered with \"no route\"; \
                 add one to the config file, for example\n\n[[routes]]\nevent_type = \"*\"\n\
                 destination = \"https://api.example.com/events/{event_type}\"\n\n\
                 (config/relay.toml has a catch-all route whose destination is the \
                 OUTBOX_DESTINATION_URL environment variable)",
            ));
        }
        Ok(())
    }

    /// Checks that no parser can: ranges, relations between keys, routes.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let r = &self.relay;
        if self.database.pool_size == 0 {
            return Err(ConfigError::invalid(
                "database.pool_size",
                "must be at least 1",
            ));
        }
        if r.shards == 0 || r.shards > 1024 {
            return Err(ConfigError::invalid(
                "relay.shards",
                "must be between 1 and 1024",
            ));
        }
        if r.publishers == 0 {
            return Err(ConfigError::invalid(
                "relay.publishers",
                "must be at least 1",
            ));
        }
        if r.claim_batch == 0 {
            return Err(ConfigError::invalid(
                "relay.claim_batch",
                "must be at least 1",
            ));
        }
        if r.max_in_flight < r.claim_batch {
            return Err(ConfigError::invalid(
                "relay.max_in_flight",
                format!("must be at least relay.claim_batch ({})", r.claim_batch),
            ));
        }
        if r.max_attempts == 0 {
            return Err(ConfigError::invalid(
                "relay.max_attempts",
                "must be at least 1",
            ));
        }
        if r.mark_batch == 0 {
            return Err(ConfigError::invalid(
                "relay.mark_batch",
                "must be at least 1",
            ));
        }
        if r.poll_interval.is_zero() {
            return Err(ConfigError::invalid(
                "relay.poll_interval",
                "must be more than zero",
            ));
        }
        if r.shard_lease < Duration::from_secs(1) {
            return Err(ConfigError::invalid(
                "relay.shard_lease",
                "must be at least 1s",
            ));
        }
        if r.replica_id.len() > 200 || r.replica_id.chars().any(char::is_control) {
            return Err(ConfigError::invalid(
                "relay.replica_id",
                "must be at most 200 characters, none of them control characters",
            ));
        }
        if r.backoff_cap < r.backoff_base {
            return Err(ConfigError::invalid(
                "relay.backoff_cap",
                "must not be shorter than relay.backoff_base",
            ));
        }
        // A lease that ends while its publish may still be running would let a
        // second relay publish the same row concurrently, breaking per-key order.
        if r.lease <= self.http.request_timeout + self.relay.mark_interval {
            return Err(ConfigError::invalid(
                "relay.lease",
                format!(
                    "must be longer than http.request_timeout ({})",
                    humantime::format_duration(self.http.request_timeout)
                ),
            ));
        }
        if self.http.request_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "http.request_timeout",
                "must be more than zero",
            ));
        }
        for (key, value) in [
            ("qstash.token", &self.qstash.token),
            (
                "qstash.current_signing_key",
                &self.qstash.current_signing_key,
            ),
            ("qstash.next_signing_key", &self.qstash.next_signing_key),
        ] {
            check_secret(key, value)?;
        }
        if self.qstash.batch_size == 0 || self.qstash.batch_size > 1000 {
            return Err(ConfigError::invalid(
                "qstash.batch_size",
                "must be between 1 and 1000",
            ));
        }
        parse_http_url(&self.qstash.url).map_err(|e| ConfigError::invalid("qstash.url", e))?;
        if self.server.callback_bind.is_some() && self.qstash.current_signing_key.is_empty() {
            return Err(ConfigError::invalid(
                "qstash.current_signing_key",
                "is required when server.callback_bind is set, to verify QStash's callbacks (set QSTASH_CURRENT_SIGNING_KEY)",
            ));
        }
        // Claimers, the marker and the coordinator each hold a connection;
        // the gauges need one more.
        if self.database.pool_size < self.relay.shards + 3 {
            return Err(ConfigError::invalid(
                "database.pool_size",
                format!(
                    "must be at least relay.shards + 3 ({}): each claimer, the marker and the shard coordinator keep a connection",
                    self.relay.shards + 3
                ),
            ));
        }
        self.janitor.validate()?;
        for (i, route) in self.routes.iter().enumerate() {
            route.validate(&format!("routes[{i}]"))?;
            if route.sink == SinkKind::Qstash && self.qstash.token.is_empty() {
                return Err(ConfigError::invalid(
                    "qstash.token",
                    format!(
                        "is required because routes[{i}] delivers through QStash (set QSTASH_TOKEN)"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// True when at least one route asks for per-key ordering.
    pub fn any_ordered_route(&self) -> bool {
        self.routes
            .iter()
            .any(|r| r.ordering == Ordering::PartitionKey)
    }
}

impl RouteConfig {
    fn validate(&self, at: &str) -> Result<(), ConfigError> {
        let p = &self.event_type;
        let pattern_ok = !p.is_empty()
            && (!p.contains('*') || p == "*" || (p.ends_with(".*") && p.matches('*').count() == 1));
        if !pattern_ok {
            return Err(ConfigError::invalid(
                format!("{at}.event_type"),
                format!("`{p}` is not `exact.type`, `prefix.*` or `*`"),
            ));
        }
        if self.destination.is_empty() {
            return Err(ConfigError::invalid(
                format!("{at}.destination"),
                "must not be empty",
            ));
        }
        crate::routes::check_template(&self.destination).map_err(|e| {
            ConfigError::invalid(
                format!("{at}.destination"),
                crate::redact::url_in(&e, &self.destination),
            )
        })?;
        if self.sink == SinkKind::Webhook {
            match &self.signing_secret {
                Some(s) if s.starts_with("whsec_") => {
                    outbox_client::signing::decode_secret(s).map_err(|e| {
                        ConfigError::invalid(format!("{at}.signing_secret"), e.to_string())
                    })?;
                }
                Some(_) => {
                    return Err(ConfigError::invalid(
                        format!("{at}.signing_secret"),
                        "must start with `whsec_`",
                    ))
                }
                None => {
                    return Err(ConfigError::invalid(
                        format!("{at}.signing_secret"),
                        "is required for webhook routes",
                    ))
                }
            }
        }
        if let Some(0) = self.parallelism {
            return Err(ConfigError::invalid(
                format!("{at}.parallelism"),
                "must be at least 1",
            ));
        }
        if self.period.is_some() && self.rate.is_none() {
            return Err(ConfigError::invalid(format!("{at}.period"), "needs `rate`"));
        }
        if http::Method::from_bytes(self.method.as_bytes()).is_err() {
            return Err(ConfigError::invalid(
                format!("{at}.method"),
                format!("`{}` is not an HTTP method", self.method),
            ));
        }
        if let Some(cb) = &self.failure_callback {
            parse_http_url(cb)
                .map_err(|e| ConfigError::invalid(format!("{at}.failure_callback"), e))?;
        }
        Ok(())
    }

    /// Does this route take events of `event_type`?
    pub fn matches(&self, event_type: &str) -> bool {
        match self.event_type.as_str() {
            "*" => true,
            p if p.ends_with(".*") => event_type.starts_with(&p[..p.len() - 1]),
            p => p == event_type,
        }
    }
}

/// A secret is sent in a header: only visible ASCII (no inner white space,
/// no control characters) can be.
fn check_secret(key: &str, value: &str) -> Result<(), ConfigError> {
    match value.chars().position(|c| !c.is_ascii_graphic()) {
        None => Ok(()),
        Some(at) => Err(ConfigError::invalid(
            key,
            format!(
                "has {} at character {at}; a secret must be printable ASCII without spaces \
                 (was it read from a file with more than one line?)",
                match value.chars().nth(at) {
                    Some(c) if c.is_control() => format!("a control character ({:?})", c),
                    Some(c) if c.is_whitespace() => "white space".to_owned(),
                    _ => "a non-ASCII character".to_owned(),
                }
            ),
        )),
    }
}

/// `${NAME}` (or `$NAME`) replaced by the environment variable's value;
/// `$$` is a literal `$`.
fn expand_env(s: &str, key: &str) -> Result<String, ConfigError> {
    if !s.contains('$') {
        return Ok(s.to_owned());
    }
    shellexpand::env(s).map(|c| c.into_owned()).map_err(|e| {
        ConfigError::invalid(
            key,
            format!(
                "environment variable `{}` is not set ({})",
                e.var_name, e.cause
            ),
        )
    })
}

/// Errors name the URL with its credentials hidden.
fn parse_http_url(s: &str) -> Result<http::Uri, String> {
    let shown = crate::redact::url(s);
    let uri: http::Uri = s
        .parse()
        .map_err(|e| format!("`{shown}` is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => Ok(uri),
        _ => Err(format!("`{shown}` must start with http:// or https://")),
    }
}

use crate::redact::REDACTED;

impl Config {
    /// A copy fit to print or log: tokens, keys, secrets, and the credentials
    /// in the database URL (URL or keyword form) and in every HTTP URL hidden.
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        for secret in [
            &mut c.qstash.token,
            &mut c.qstash.current_signing_key,
            &mut c.qstash.next_signing_key,
        ] {
            if !secret.is_empty() {
                *secret = REDACTED.to_owned();
            }
        }
        for route in &mut c.routes {
            if route.signing_secret.is_some() {
                route.signing_secret = Some(REDACTED.to_owned());
            }
            route.destination = crate::redact::url(&route.destination);
            route.failure_callback = route.failure_callback.as_deref().map(crate::redact::url);
        }
        c.qstash.url = crate::redact::url(&c.qstash.url);
        c.database.url = crate::redact::database_url(&c.database.url);
        c
    }
}

#[cfg(test)]
mod resolve_tests {
    use super::*;

    fn with_token(token: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(&format!(
            "[qstash]\ntoken = {}\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\n",
            toml_string(token)
        ))
    }

    fn toml_string(s: &str) -> String {
        serde_json::to_string(s).unwrap()
    }

    #[test]
    fn a_token_read_from_a_file_is_trimmed() {
        let c = with_token("  secret-token\n").unwrap();
        assert_eq!(c.qstash.token, "secret-token");
        // And it is sent whole, not as a bare `Bearer`.
        let sink = crate::sink::qstash::QstashSink::new(&c.qstash, &c.http);
        let request = sink.batch_request(&[]);
        assert_eq!(
            request.headers()["authorization"].to_str().unwrap(),
            "Bearer secret-token"
        );
    }

    #[test]
    fn a_token_with_an_inner_control_character_stops_the_relay_naming_the_key() {
        for bad in ["first\nsecond", "tab\there", "nul\0", "späce", "two words"] {
            let e = with_token(bad).unwrap_err().to_string();
            assert!(e.contains("qstash.token"), "{bad:?}: {e}");
            assert!(!e.contains(bad), "the error must not print the secret: {e}");
        }
    }

    #[test]
    fn a_relay_without_routes_is_refused_with_how_to_add_one() {
        let c = Config::from_toml_str("[qstash]\ntoken = \"t\"\n").unwrap();
        let e = c.validate_for_relay().unwrap_err().to_string();
        assert!(e.contains("`routes`"), "{e}");
        assert!(e.contains("[[routes]]"), "{e}");
    }

    #[test]
    fn route_urls_take_environment_variables() {
        std::env::set_var("OUTBOXTEST_DEST_Q7", "https://hooks.example.com/in");
        let c = Config::from_toml_str(
            "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"${OUTBOXTEST_DEST_Q7}/{event_type}\"\n",
        )
        .unwrap();
        assert_eq!(
            c.routes[0].destination,
            "https://hooks.example.com/in/{event_type}"
        );
        let e = Config::from_toml_str(
            "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"${OUTBOXTEST_UNSET_Q7}\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("routes[0].destination"), "{e}");
        assert!(e.contains("OUTBOXTEST_UNSET_Q7"), "{e}");
    }
}
