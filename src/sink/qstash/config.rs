//! The `[qstash]` section: where QStash is, the token the relay publishes
//! with, the keys its failure callbacks are signed with, and how events are
//! sent. Every value is checked as it is read.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

use crate::redact::{HttpUrl, Secret};

/// The default QStash endpoint (the official SDKs' default region).
pub const DEFAULT_QSTASH_URL: &str = "https://qstash.upstash.io";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct QstashConfig {
    /// `QSTASH_URL` overrides it.
    pub url: HttpUrl,
    /// `QSTASH_TOKEN` overrides it. Never logged.
    pub token: Secret,
    /// Used by the failure-callback endpoint. `QSTASH_CURRENT_SIGNING_KEY`.
    pub current_signing_key: Secret,
    /// `QSTASH_NEXT_SIGNING_KEY`.
    pub next_signing_key: Secret,
    /// `batch` sends many events per `POST /v2/batch`; `single` one `POST /v2/publish` each.
    pub mode: PublishMode,
    /// Messages per `/v2/batch` request.
    pub batch_size: BatchSize,
}

impl Default for QstashConfig {
    fn default() -> Self {
        QstashConfig {
            url: DEFAULT_QSTASH_URL.parse().expect("the default URL is one"),
            token: Secret::default(),
            current_signing_key: Secret::default(),
            next_signing_key: Secret::default(),
            mode: PublishMode::Batch,
            batch_size: BatchSize::DEFAULT,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum PublishMode {
    Batch,
    Single,
}

/// Messages per `/v2/batch` request: 1 to [`BatchSize::MAX`].
#[derive(Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct BatchSize(u32);

impl BatchSize {
    /// What one QStash batch request takes at most.
    pub const MAX: u32 = 1000;
    pub const DEFAULT: BatchSize = BatchSize(100);

    pub fn new(n: u32) -> Result<BatchSize, String> {
        if (1..=Self::MAX).contains(&n) {
            Ok(BatchSize(n))
        } else {
            Err(format!("must be between 1 and {}", Self::MAX))
        }
    }

    pub fn get(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Debug for BatchSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl<'de> Deserialize<'de> for BatchSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<BatchSize, D::Error> {
        BatchSize::new(u32::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}
