//! `[telemetry]`: where the relay sends its delivery spans. Off unless
//! `otlp_endpoint` is set.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::redact::HttpUrl;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// An OTLP/HTTP (protobuf) traces endpoint, as a collector serves it:
    /// `http://127.0.0.1:4318/v1/traces`. Unset: no spans are made or sent,
    /// and an event's own `traceparent` passes through unchanged.
    pub otlp_endpoint: Option<HttpUrl>,
    /// `service.name` of the relay's spans.
    pub service_name: String,
    /// Spans wait at most this long before they are sent (batched).
    #[serde(with = "humantime_serde")]
    pub export_interval: Duration,
    /// One export request gives up after this long.
    #[serde(with = "humantime_serde")]
    pub export_timeout: Duration,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            service_name: "outbox-relay".to_owned(),
            export_interval: Duration::from_secs(5),
            export_timeout: Duration::from_secs(10),
        }
    }
}

impl TelemetryConfig {
    /// The ranges its values must be in: the key and why.
    pub(crate) fn validate(&self) -> Result<(), (&'static str, &'static str)> {
        if self.service_name.trim().is_empty() {
            return Err(("telemetry.service_name", "must not be empty"));
        }
        if self.export_interval < Duration::from_millis(10) {
            return Err(("telemetry.export_interval", "must be at least 10ms"));
        }
        if self.export_timeout < Duration::from_millis(100) {
            return Err(("telemetry.export_timeout", "must be at least 100ms"));
        }
        Ok(())
    }
}
