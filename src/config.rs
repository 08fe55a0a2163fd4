//! One configuration tree, loaded once at start from a TOML file and the
//! environment, checked before anything connects. Every error names its key.
//!
//! Each part owns its section and the types that check its values as they
//! are read: `[qstash]` is [`crate::sink::qstash::config`], `[http]` is
//! [`crate::sink::http`], `[[routes]]` is [`crate::routes::config`]. This
//! module puts them together with the sections that belong to no part
//! (database, relay, server, janitor), loads them, and checks the rules that
//! span sections.

use std::fmt;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::value::Value;
use figment::Figment;
use serde::{Deserialize, Serialize};

pub use crate::routes::{BodyShape, Ordering, RouteConfig, SinkKind};
pub use crate::sink::http::HttpConfig;
pub use crate::sink::qstash::config::{BatchSize, PublishMode, QstashConfig, DEFAULT_QSTASH_URL};

/// Environment prefix for every key: `OUTBOX_RELAY_RELAY__SHARDS=4` sets `relay.shards`.
pub(crate) const ENV_PREFIX: &str = "OUTBOX_RELAY_";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read or parsed.
    #[error("configuration: {0}")]
    Load(String),
    #[error("configuration key `{key}`: {reason}")]
    Invalid { key: String, reason: String },
    /// More than one source is wrong (a file and an environment variable).
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Several(Vec<ConfigError>),
}

impl ConfigError {
    fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// What figment reports (a value a section's type refused, a wrong
    /// type, an unknown key), named the way the checks below name keys.
    fn from_figment(errors: figment::Error) -> Self {
        let mut all: Vec<ConfigError> = errors.into_iter().map(Self::from_one).collect();
        if all.len() == 1 {
            all.remove(0)
        } else {
            ConfigError::Several(all)
        }
    }

    fn from_one(e: figment::Error) -> Self {
        if e.path.is_empty() {
            return ConfigError::Load(e.to_string());
        }
        let mut path = e.path.clone();
        let mut reason = e.kind.to_string();
        if let figment::error::Kind::MissingField(field) = &e.kind {
            path.push(field.to_string());
            reason = "must be set".to_owned();
        }
        if let Some(origin) = origin(&e) {
            reason = format!("{reason} (in {origin})");
        }
        ConfigError::invalid(key_of(&path), reason)
    }
}

/// `["routes", "0", "destination"]` → `routes[0].destination`.
fn key_of(path: &[String]) -> String {
    let mut key = String::new();
    for part in path {
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            key.push_str(&format!("[{part}]"));
        } else {
            if !key.is_empty() {
                key.push('.');
            }
            key.push_str(part);
        }
    }
    key
}

/// Where a refused value came from: the file or the `OUTBOX_RELAY_…`
/// variables. The defaults and the well-known variables are merged here in
/// code, so figment knows only a line of this file for them: not worth saying.
fn origin(e: &figment::Error) -> Option<String> {
    let md = e.metadata.as_ref()?;
    match &md.source {
        Some(figment::Source::Code(_)) => None,
        Some(source) => Some(format!("{} {source}", md.name)),
        None => Some(md.name.to_string()),
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

#[derive(Clone, Serialize, Deserialize, PartialEq)]
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

/// The URL prints with its password hidden.
impl fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("url", &crate::redact::database_url(&self.url))
            .field("pool_size", &self.pool_size)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// How many shards the relay expects the outbox to be split into (one
    /// claimer each, shared among the replicas). Unset, it follows the
    /// database (8 unless changed with `outbox-relay reshard`, which relays
    /// follow while they run); set, the relay refuses to start on another count.
    pub shards: Option<u32>,
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
pub struct ServerConfig {
    /// `/metrics`, `/healthz`, `/readyz`: keep it on a private address.
    pub metrics_bind: Option<SocketAddr>,
    /// QStash's callbacks (`POST /qstash/failure`, and `POST /qstash/callback`
    /// for ordered QStash routes) must face the internet: they get a listener
    /// of their own. Off unless set.
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
            shards: None,
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

/// The keys of a route in which `${NAME}` is an environment variable.
const ROUTE_KEYS_WITH_ENV: &[&str] = &["destination", "failure_callback", "callback"];

impl Config {
    /// Defaults, then the file (if any), then `OUTBOX_RELAY_…`, then the
    /// well-known variables; checked.
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
        // Each section's types parse and check its values here, so what
        // comes out is usable; what spans sections is checked after.
        let config: Config = expand_route_env(figment)?
            .extract()
            .map_err(ConfigError::from_figment)?;
        config.validate()?;
        Ok(config)
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

    /// Checks that no single value's type can: the ranges of the sections
    /// this module owns, the rules between keys, within a route and across
    /// sections.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let r = &self.relay;
        if self.database.pool_size == 0 {
            return Err(ConfigError::invalid(
                "database.pool_size",
                "must be at least 1",
            ));
        }
        if r.shards.is_some_and(|n| n == 0 || n > 1024) {
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
        if self.server.callback_bind.is_some() && self.qstash.current_signing_key.is_empty() {
            return Err(ConfigError::invalid(
                "qstash.current_signing_key",
                "is required when server.callback_bind is set, to verify QStash's callbacks (set QSTASH_CURRENT_SIGNING_KEY)",
            ));
        }
        // Claimers, the marker and the coordinator each hold a connection;
        // the gauges need one more. (Checked again at start against the
        // database's shard count.)
        let claimers = self.relay.shards.unwrap_or(1);
        if self.database.pool_size < claimers + 3 {
            return Err(ConfigError::invalid(
                "database.pool_size",
                format!(
                    "must be at least relay.shards + 3 ({}): each claimer, the marker and the shard coordinator keep a connection",
                    claimers + 3
                ),
            ));
        }
        self.janitor.validate()?;
        for (i, route) in self.routes.iter().enumerate() {
            route
                .validate()
                .map_err(|e| ConfigError::invalid(format!("routes[{i}].{}", e.key), e.reason))?;
            if route.callback.is_some() && self.server.callback_bind.is_none() {
                return Err(ConfigError::invalid(
                    "server.callback_bind",
                    format!(
                        "is required because routes[{i}] takes QStash's delivery callbacks (routes[{i}].callback): the relay serves POST /qstash/callback there"
                    ),
                ));
            }
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
        self.routes.iter().any(|r| r.ordering.per_key())
    }

    /// A copy fit to print or log. Secrets, URLs and destinations print
    /// without their credentials by themselves (`Serialize`, `Debug`); this
    /// hides the database password (URL or keyword form) too.
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        c.database.url = crate::redact::database_url(&c.database.url);
        c
    }
}

/// `${NAME}` (or `$NAME`) in a route's URLs replaced by the environment
/// variable's value, in the layered values before the routes are parsed (so
/// the URL types check what will be used); `$$` is a literal `$`.
fn expand_route_env(figment: Figment) -> Result<Figment, ConfigError> {
    let Ok(Value::Array(tag, mut routes)) = figment.find_value("routes") else {
        // None, or not a list: extracting says what is wrong.
        return Ok(figment);
    };
    let mut expanded = false;
    for (i, route) in routes.iter_mut().enumerate() {
        let Value::Dict(_, keys) = route else {
            continue;
        };
        for key in ROUTE_KEYS_WITH_ENV {
            if let Some(Value::String(_, s)) = keys.get_mut(*key) {
                if s.contains('$') {
                    *s = expand_env(s, &format!("routes[{i}].{key}"))?;
                    expanded = true;
                }
            }
        }
    }
    Ok(if expanded {
        figment.merge(Serialized::default("routes", Value::Array(tag, routes)))
    } else {
        figment
    })
}

fn expand_env(s: &str, key: &str) -> Result<String, ConfigError> {
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

#[cfg(test)]
mod tests {
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
        assert_eq!(c.qstash.token.expose(), "secret-token");
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
            assert!(
                e.contains("configuration key `qstash.token`"),
                "{bad:?}: {e}"
            );
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
        std::env::set_var("OUTBOXTEST_CB_Q7", "https://relay.example.com");
        let c = Config::from_toml_str(
            "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"${OUTBOXTEST_DEST_Q7}/{event_type}\"\nfailure_callback = \"$OUTBOXTEST_CB_Q7/qstash/failure\"\n",
        )
        .unwrap();
        assert_eq!(
            c.routes[0].destination.as_str(),
            "https://hooks.example.com/in/{event_type}"
        );
        assert_eq!(
            c.routes[0].failure_callback.as_ref().unwrap().as_str(),
            "https://relay.example.com/qstash/failure"
        );
        let c = Config::from_toml_str(
            "[qstash]\ntoken = \"t\"\ncurrent_signing_key = \"k\"\n[server]\ncallback_bind = \"127.0.0.1:0\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\nordering = \"partition_key\"\ncallback = \"${OUTBOXTEST_CB_Q7}/qstash/callback\"\n",
        )
        .unwrap();
        assert_eq!(
            c.routes[0].callback.as_ref().unwrap().as_str(),
            "https://relay.example.com/qstash/callback"
        );
        let e = Config::from_toml_str(
            "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"${OUTBOXTEST_UNSET_Q7}\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("routes[0].destination"), "{e}");
        assert!(e.contains("OUTBOXTEST_UNSET_Q7"), "{e}");
        // What the variable holds is checked like a value written in the file.
        std::env::set_var("OUTBOXTEST_FTP_Q7", "ftp://files.example.com");
        let e = Config::from_toml_str(
            "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\nfailure_callback = \"${OUTBOXTEST_FTP_Q7}/x\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("configuration key `routes[0].failure_callback`: `ftp://files.example.com/x` must start with http:// or https://"),
            "{e}"
        );
    }

    #[test]
    fn values_refused_as_they_are_read_name_their_key_like_the_checks_do() {
        let route = "[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\n";
        for (toml, want) in [
            (
                "[qstash]\nbatch_size = 0\n".to_owned(),
                "configuration key `qstash.batch_size`: must be between 1 and 1000",
            ),
            (
                "[qstash]\nurl = \"qstash.example.com\"\n".to_owned(),
                "configuration key `qstash.url`: `qstash.example.com` must start with http:// or https://",
            ),
            (
                "[http]\nrequest_timeout = \"0s\"\n".to_owned(),
                "configuration key `http.request_timeout`: must be more than zero",
            ),
            (
                format!("[qstash]\ntoken = \"t\"\n{route}{route}parallelism = 0\n"),
                "configuration key `routes[1].parallelism`: must be at least 1",
            ),
            (
                format!("{route}method = \"GET POST\"\n"),
                "configuration key `routes[0].method`: `GET POST` is not an HTTP method",
            ),
            (
                format!("{route}sink = \"webhook\"\nsigning_secret = \"whsec_***\"\n"),
                "configuration key `routes[0].signing_secret`: the part after `whsec_` is not base64",
            ),
            (
                format!("{route}sink = \"webhook\"\nsigning_secret = \"MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\n"),
                "configuration key `routes[0].signing_secret`: must start with `whsec_`",
            ),
            (
                "[[routes]]\nevent_type = \"*\"\n".to_owned(),
                "configuration key `routes[0].destination`: must be set",
            ),
            (
                "[[routes]]\nevent_type = \"*\"\ndestination = \"\"\n".to_owned(),
                "configuration key `routes[0].destination`: must not be empty",
            ),
            (
                format!("[qstash]\ntoken = \"t\"\n{route}period = \"1s\"\n"),
                "configuration key `routes[0].period`: needs `rate`",
            ),
        ] {
            let e = Config::from_toml_str(&toml).expect_err(&toml).to_string();
            assert!(e.contains(want), "{toml:?}:\n{e}\nwanted: {want}");
        }
        // A wrong type says where the value was written.
        let e = Config::from_toml_str("[relay]\nshards = \"two\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("configuration key `relay.shards`: invalid type")
                && e.contains("TOML source string"),
            "{e}"
        );
    }

    #[test]
    fn a_webhook_route_signs_with_the_key_of_its_secret() {
        let c = Config::from_toml_str(
            "[[routes]]\nevent_type = \"*\"\nsink = \"webhook\"\ndestination = \"https://a.example.com/\"\nsigning_secret = \" whsec_AQID\\n\"\n",
        )
        .unwrap();
        let secret = c.routes[0].signing_secret.as_ref().unwrap();
        assert_eq!(secret.key(), [1, 2, 3]);
        // An empty secret is none, as it was before it was set.
        let c = Config::from_toml_str(
            "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\nsigning_secret = \"\"\n",
        )
        .unwrap();
        assert!(c.routes[0].signing_secret.is_none());
    }

    #[test]
    fn neither_debug_nor_serialize_prints_a_secret() {
        const MARK: &str = "Leak";
        let c = Config::from_toml_str(&format!(
            "[database]\nurl = \"postgres://app:db-{MARK}@db.example.com/app\"\n\
             [qstash]\nurl = \"https://u:qs-{MARK}@qstash.example.com/\"\ntoken = \"tok-{MARK}\"\n\
             current_signing_key = \"cur-{MARK}\"\nnext_signing_key = \"next-{MARK}\"\n\
             [[routes]]\nevent_type = \"*\"\nsink = \"webhook\"\n\
             destination = \"https://u:dest-{MARK}@hooks.example.com/{{event_type}}?token=t-{MARK}\"\n\
             failure_callback = \"https://cb-{MARK}@cb.example.com/\"\n\
             signing_secret = \"whsec_TGVha0xlYWtMZWFr\"\n"
        ))
        .unwrap();
        let debug = format!("{c:?}");
        let json = serde_json::to_string(&c.redacted()).unwrap();
        for shown in [&debug, &json] {
            assert!(!shown.contains(MARK), "{shown}");
            assert!(!shown.contains("TGVha0xlYWtMZWFr"), "{shown}");
            assert!(shown.contains("<redacted>"), "{shown}");
            assert!(shown.contains("hooks.example.com"), "{shown}");
        }
        // Unset secrets print as unset.
        let json = serde_json::to_value(Config::default()).unwrap();
        assert_eq!(json["qstash"]["token"], "");
    }
}
