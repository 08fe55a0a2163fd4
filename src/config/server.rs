//! `[server]`: the metrics and callback listeners and what they check.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

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
