//! One configuration tree, loaded once at start from a TOML file and the
//! environment, checked before anything connects. Every error names its key.
//!
//! Each part owns its section and the types that check its values as they
//! are read: `[qstash]` is [`crate::sink::qstash::config`], `[http]` is
//! [`crate::sink::http`], `[[routes]]` is [`crate::routes::config`]. This
//! module puts them together with the sections that belong to no part
//! (database, relay, server, janitor: a file each), loads them (`env` adds the
//! environment), and checks the rules that span sections (`validate`).

use std::path::Path;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Serialize};

use env::{expand_route_env, WELL_KNOWN_ENV};

mod database;
mod env;
mod error;
mod janitor;
mod relay;
mod server;
mod tenants;
mod validate;

pub use crate::routes::{BodyShape, Ordering, RetryPolicy, RouteConfig, SinkKind};
pub use crate::sink::http::HttpConfig;
pub use crate::sink::qstash::config::{BatchSize, PublishMode, QstashConfig, DEFAULT_QSTASH_URL};
pub use crate::telemetry::TelemetryConfig;
pub use database::{DatabaseConfig, StatementTimeouts};
pub use error::ConfigError;
pub use janitor::JanitorConfig;
pub use relay::RelayConfig;
pub use server::ServerConfig;
pub use tenants::{TenantPolicy, TenantWeight, MAX_TENANT_WEIGHT};
pub(crate) use validate::ACTORS_POOL;

/// Environment prefix for every key: `OUTBOX_RELAY_RELAY__SHARDS=4` sets `relay.shards`.
pub(crate) const ENV_PREFIX: &str = "OUTBOX_RELAY_";

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub database: DatabaseConfig,
    pub relay: RelayConfig,
    pub qstash: QstashConfig,
    pub http: HttpConfig,
    pub server: ServerConfig,
    pub janitor: JanitorConfig,
    pub telemetry: TelemetryConfig,
    pub routes: Vec<RouteConfig>,
}

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
        let mut config: Config = expand_route_env(figment)?
            .extract()
            .map_err(ConfigError::from_figment)?;
        config.database.apply_tls_keys()?;
        config.validate()?;
        Ok(config)
    }

    /// What is allowed but probably wrong, each naming its key
    /// (``configuration key `routes[0].callback_timeout`: …``). The relay
    /// logs them at start and `check-config` prints them.
    pub fn warnings(&self) -> Vec<String> {
        self.routes
            .iter()
            .enumerate()
            .flat_map(|(i, route)| {
                route.warnings().into_iter().map(move |w| {
                    format!("configuration key `routes[{i}].{}`: {}", w.key, w.reason)
                })
            })
            .collect()
    }

    /// Checks what running the relay needs beyond [`Config::validate`]: a
    /// database URL it can use, and at least one route (without one every
    /// event would be dead-lettered).
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
        self.database.validate_connection()
    }

    /// Each route's retry policy, in route order: `[relay]`'s, with what
    /// the route overrides (`routes::retry`).
    pub fn retry_policies(&self) -> Result<Vec<RetryPolicy>, ConfigError> {
        let r = &self.relay;
        let relay = RetryPolicy::backoff(r.max_attempts, r.backoff_base, r.backoff_cap);
        RetryPolicy::for_routes(&self.routes, &relay)
            .map_err(|(i, e)| ConfigError::invalid(format!("routes[{i}].{}", e.key), e.reason))
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

#[cfg(test)]
mod tests;
