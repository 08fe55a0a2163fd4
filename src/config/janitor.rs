//! `[janitor]`: retention inside the daemon.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConfigError;

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
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
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
