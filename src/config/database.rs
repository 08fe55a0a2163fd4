//! The `[database]` keys of the connections by role: the statement timeout
//! of each role (`[database.statement_timeout]`), the janitor's lock
//! timeout, the callback listener's pool, and how long a connection that
//! stopped answering may go unnoticed (TCP keepalives, `tcp_user_timeout`).
//!
//! Who holds which connections (README, "Database connections"): the actors'
//! pool (`database.pool_size`) gives each claimer, each of the marker's
//! `relay.mark_connections` and the shard coordinator a connection of its own, with one left for the drain's
//! progress and the start-up checks; the callback listener has a pool of
//! `database.callback_pool_size`; the backlog sampler and the janitor have
//! one connection each; the listener one of its own.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use std::fmt;

use super::ConfigError;
use crate::store::{Liveness, PoolOptions};

/// How long one statement of each role may run before the server cancels
/// it. A session whose statement has no answer a little after that (half as
/// long again, at most 1 s more) closes its connection and takes another, so
/// a connection that stopped answering parks its actor no longer than that.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct StatementTimeouts {
    /// A claim. Unset: none (see `config/relay.toml`); at most a quarter of
    /// `relay.shard_lease`.
    #[serde(
        with = "humantime_serde::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub claims: Option<Duration>,
    /// A mark (one multi-row UPDATE). Unset: none; at most a quarter of
    /// `relay.shard_lease`.
    #[serde(
        with = "humantime_serde::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub marks: Option<Duration>,
    /// A statement of the shard coordinator (heartbeat, renewal, takeover).
    /// Unset: none; at most half of `relay.shard_lease`.
    #[serde(
        with = "humantime_serde::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub coordinator: Option<Duration>,
    /// A callback's mark.
    #[serde(with = "humantime_serde")]
    pub callbacks: Duration,
    /// The backlog snapshot of the gauges and `/readyz`.
    #[serde(with = "humantime_serde")]
    pub sampler: Duration,
    /// One batched DELETE of the janitor.
    #[serde(with = "humantime_serde")]
    pub janitor: Duration,
}

impl Default for StatementTimeouts {
    fn default() -> Self {
        StatementTimeouts {
            claims: None,
            marks: None,
            coordinator: None,
            callbacks: Duration::from_secs(5),
            sampler: Duration::from_secs(30),
            janitor: Duration::from_secs(60),
        }
    }
}

impl StatementTimeouts {
    /// The claims' timeout, if set.
    pub fn claims(&self) -> Option<Duration> {
        self.claims
    }

    pub fn marks(&self) -> Option<Duration> {
        self.marks
    }

    pub fn coordinator(&self) -> Option<Duration> {
        self.coordinator
    }
}

impl DatabaseConfig {
    /// The keepalives and `tcp_user_timeout` of every connection.
    pub fn liveness(&self) -> Liveness {
        Liveness {
            keepalives_idle: self.keepalives_idle,
            keepalives_interval: self.keepalives_interval,
            keepalives_retries: self.keepalives_retries,
            tcp_user_timeout: self.tcp_user_timeout,
        }
    }

    /// A pool of `size` connections, each with `statement_timeout` set.
    pub(crate) fn pool_options(
        &self,
        size: u32,
        statement_timeout: Option<Duration>,
    ) -> PoolOptions {
        PoolOptions {
            statement_timeout,
            liveness: self.liveness(),
            idle_timeout: self.idle_timeout,
            ..PoolOptions::new(size, self.connect_timeout)
        }
    }

    /// The callback listener's pool.
    pub(crate) fn callback_pool(&self) -> PoolOptions {
        self.pool_options(
            self.callback_pool_size,
            Some(self.statement_timeout.callbacks),
        )
    }

    /// The backlog sampler's one connection.
    pub(crate) fn sampler_pool(&self) -> PoolOptions {
        self.pool_options(1, Some(self.statement_timeout.sampler))
    }

    /// The janitor's one connection, which also gives up waiting for a lock.
    pub(crate) fn janitor_pool(&self) -> PoolOptions {
        PoolOptions {
            lock_timeout: Some(self.janitor_lock_timeout),
            ..self.pool_options(1, Some(self.statement_timeout.janitor))
        }
    }

    /// The keys of this module; `shard_lease` is `relay.shard_lease`.
    pub(super) fn validate_connections(&self, shard_lease: Duration) -> Result<(), ConfigError> {
        if self.callback_pool_size == 0 || self.callback_pool_size > 64 {
            return Err(ConfigError::invalid(
                "database.callback_pool_size",
                "must be between 1 and 64",
            ));
        }
        // The kernel counts these in whole seconds.
        for (key, value) in [
            ("database.keepalives_idle", self.keepalives_idle),
            ("database.keepalives_interval", self.keepalives_interval),
            ("database.tcp_user_timeout", self.tcp_user_timeout),
        ] {
            if value < Duration::from_secs(1) {
                return Err(ConfigError::invalid(key, "must be at least 1s"));
            }
        }
        if self.keepalives_retries == 0 || self.keepalives_retries > 100 {
            return Err(ConfigError::invalid(
                "database.keepalives_retries",
                "must be between 1 and 100",
            ));
        }
        let t = &self.statement_timeout;
        // A claimer, the marker or the coordinator whose connection stopped
        // answering must be back on a fresh one well within the shard lease:
        // a claim and then a mark may each find theirs dead, one after the
        // other, and the coordinator must renew before the lease ends.
        for (key, value, part, name) in [
            (
                "database.statement_timeout.claims",
                t.claims,
                4,
                "a quarter",
            ),
            ("database.statement_timeout.marks", t.marks, 4, "a quarter"),
            (
                "database.statement_timeout.coordinator",
                t.coordinator,
                2,
                "half",
            ),
        ] {
            match value {
                Some(v) if v < Duration::from_millis(10) => {
                    return Err(ConfigError::invalid(key, "must be at least 10ms"))
                }
                Some(v) if v > shard_lease / part => {
                    return Err(ConfigError::invalid(
                        key,
                        format!(
                            "must be at most {name} of relay.shard_lease ({})",
                            humantime::format_duration(shard_lease / part)
                        ),
                    ))
                }
                _ => {}
            }
        }
        for (key, value) in [
            ("database.statement_timeout.callbacks", t.callbacks),
            ("database.statement_timeout.sampler", t.sampler),
            ("database.statement_timeout.janitor", t.janitor),
            ("database.janitor_lock_timeout", self.janitor_lock_timeout),
        ] {
            if value < Duration::from_millis(10) {
                return Err(ConfigError::invalid(key, "must be at least 10ms"));
            }
        }
        if self.janitor_lock_timeout > t.janitor {
            return Err(ConfigError::invalid(
                "database.janitor_lock_timeout",
                "must not be longer than database.statement_timeout.janitor",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sessions_timeouts_are_off_unless_set() {
        let t = StatementTimeouts::default();
        assert_eq!((t.claims(), t.marks(), t.coordinator()), (None, None, None));
        let set = StatementTimeouts {
            claims: Some(Duration::from_millis(300)),
            ..StatementTimeouts::default()
        };
        assert_eq!(set.claims(), Some(Duration::from_millis(300)));
    }

    #[test]
    fn each_pool_gets_its_roles_settings() {
        let db = DatabaseConfig::default();
        let callbacks = db.callback_pool();
        assert_eq!(callbacks.size, 4);
        assert_eq!(callbacks.statement_timeout, Some(Duration::from_secs(5)));
        assert_eq!(callbacks.lock_timeout, None);
        let janitor = db.janitor_pool();
        assert_eq!(janitor.size, 1);
        assert_eq!(janitor.lock_timeout, Some(Duration::from_secs(5)));
        assert_eq!(db.sampler_pool().liveness, Liveness::default());
    }
}

#[derive(Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// A libpq-style URL or keyword DSN, libpq's TLS parameters included
    /// (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`). `DATABASE_URL`
    /// overrides it.
    pub url: String,
    /// The actors' pool: a connection for each claimer, each of the marker's
    /// `relay.mark_connections` and the shard coordinator, and one for the
    /// drain's progress and start-up checks.
    pub pool_size: u32,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// The callback listener's own pool (QStash's callbacks).
    pub callback_pool_size: u32,
    /// TCP keepalives on every connection: first probe after this long idle ...
    #[serde(with = "humantime_serde")]
    pub keepalives_idle: Duration,
    /// ... then one every this long ...
    #[serde(with = "humantime_serde")]
    pub keepalives_interval: Duration,
    /// ... and the connection is dropped after this many unanswered.
    pub keepalives_retries: u32,
    /// A connection whose sent data goes unacknowledged this long is dropped.
    #[serde(with = "humantime_serde")]
    pub tcp_user_timeout: Duration,
    /// Per role (`[database.statement_timeout]`).
    pub statement_timeout: StatementTimeouts,
    /// The janitor gives up a pass that waits this long for a lock.
    #[serde(with = "humantime_serde")]
    pub janitor_lock_timeout: Duration,
    /// libpq's TLS parameters as keys: each set one replaces the URL's
    /// (`store::dsn::TLS_PARAMETERS`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sslmode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sslrootcert: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sslcert: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sslkey: Option<String>,
    /// A pooled connection nobody has used for this long is closed (within
    /// another 30 s at most). The claimers, the marker and the coordinator
    /// keep theirs for good, and the listener has its own.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
}

impl DatabaseConfig {
    /// The `database.ssl…` keys laid over the URL's parameters, so that the
    /// URL is what every connection is made from.
    pub(super) fn apply_tls_keys(&mut self) -> Result<(), ConfigError> {
        let set: Vec<(&str, &str)> = [
            ("sslmode", &self.sslmode),
            ("sslrootcert", &self.sslrootcert),
            ("sslcert", &self.sslcert),
            ("sslkey", &self.sslkey),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_deref().map(|v| (k, v)))
        .collect();
        if set.is_empty() || self.url.trim().is_empty() {
            return Ok(());
        }
        self.url = crate::store::dsn::with_parameters(&self.url, &set)
            .map_err(|e| ConfigError::invalid("database.url", e.to_string()))?;
        Ok(())
    }

    /// What connecting would refuse, without connecting: the URL, its
    /// parameters, the TLS files it names.
    pub fn validate_connection(&self) -> Result<(), ConfigError> {
        let key = |param: &str| {
            let field = match param {
                "sslmode" => &self.sslmode,
                "sslrootcert" => &self.sslrootcert,
                "sslcert" => &self.sslcert,
                "sslkey" => &self.sslkey,
                _ => &None,
            };
            if field.is_some() {
                format!("database.{param}")
            } else {
                "database.url".to_owned()
            }
        };
        match crate::store::parse_with_tls(&self.url) {
            Ok(_) => Ok(()),
            Err(e) => {
                let text = e.to_string();
                let named = crate::store::dsn::TLS_PARAMETERS
                    .iter()
                    .find(|p| text.contains(*p))
                    .map_or_else(|| "database.url".to_owned(), |p| key(p));
                Err(ConfigError::invalid(named, text))
            }
        }
    }
}

/// The URL prints with its password hidden.
impl fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("url", &crate::redact::database_url(&self.url))
            .field("pool_size", &self.pool_size)
            .field("connect_timeout", &self.connect_timeout)
            .field("callback_pool_size", &self.callback_pool_size)
            .field("liveness", &self.liveness())
            .field("statement_timeout", &self.statement_timeout)
            .field("janitor_lock_timeout", &self.janitor_lock_timeout)
            .field("sslmode", &self.sslmode)
            .field("sslrootcert", &self.sslrootcert)
            .field("sslcert", &self.sslcert)
            .field("sslkey", &self.sslkey)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: String::new(),
            pool_size: 12,
            connect_timeout: Duration::from_secs(5),
            callback_pool_size: 4,
            keepalives_idle: Duration::from_secs(10),
            keepalives_interval: Duration::from_secs(5),
            keepalives_retries: 3,
            tcp_user_timeout: Duration::from_secs(30),
            statement_timeout: StatementTimeouts::default(),
            janitor_lock_timeout: Duration::from_secs(5),
            sslmode: None,
            sslrootcert: None,
            sslcert: None,
            sslkey: None,
            idle_timeout: Duration::from_secs(10 * 60),
        }
    }
}
