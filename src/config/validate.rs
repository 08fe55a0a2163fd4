//! The rules no single value's type can check: ranges of the sections this
//! module owns, rules between keys, within a route and across sections.

use std::time::Duration;

use super::{Config, ConfigError, SinkKind};

/// The keys that set what an idle relay costs the database.
fn check_idle_costs(c: &Config) -> Result<(), ConfigError> {
    if c.relay.idle_probe_max < Duration::from_millis(1) {
        return Err(ConfigError::invalid(
            "relay.idle_probe_max",
            "must be at least 1ms (the listener's interval while rows arrive)",
        ));
    }
    if c.database.idle_timeout < Duration::from_secs(1) {
        return Err(ConfigError::invalid(
            "database.idle_timeout",
            "must be at least 1s",
        ));
    }
    Ok(())
}

/// What `database.pool_size` is for, in its errors.
pub(crate) const ACTORS_POOL: &str = "each claimer, each of the marker's relay.mark_connections and the shard coordinator keep a connection of this pool, and one is left for the drain's progress and the start-up checks (the callback listener, the backlog sampler and the janitor have pools of their own: database.callback_pool_size, 1 and 1)";

impl Config {
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
        if r.mark_connections == 0 || r.mark_connections > 16 {
            return Err(ConfigError::invalid(
                "relay.mark_connections",
                "must be between 1 and 16",
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
        check_idle_costs(self)?;
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
        // (Checked again at start against the database's shard count.)
        let claimers = self.relay.shards.unwrap_or(1);
        let needed = claimers + self.relay.others_in_pool();
        if self.database.pool_size < needed {
            return Err(ConfigError::invalid(
                "database.pool_size",
                format!(
                    "must be at least relay.shards + relay.mark_connections + 2 ({needed}): {ACTORS_POOL}"
                ),
            ));
        }
        self.database.validate_connections(r.shard_lease)?;
        r.tenant_policy()?;
        self.janitor.validate()?;
        self.retry_policies()?;
        self.telemetry
            .validate()
            .map_err(|(key, reason)| ConfigError::invalid(key, reason))?;
        crate::sink::limits::validate_hosts(&self.http.hosts).map_err(|(i, key, reason)| {
            ConfigError::invalid(format!("http.hosts[{i}].{key}"), reason)
        })?;
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
}
