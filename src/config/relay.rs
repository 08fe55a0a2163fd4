//! `[relay]`: the engine's sizes, leases, retries and replica identity.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::tenants::TenantWeight;

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
    /// While claims find nothing, a claimer's poll doubles from
    /// `poll_interval` up to this (a due retry, a wake-up or rows found
    /// bring it back): what an idle claim over held keys costs, and the
    /// longest a row only the poll can find (due by a time an earlier
    /// process wrote) waits. Not above `poll_interval`: no backoff.
    #[serde(with = "humantime_serde")]
    pub idle_poll_max: Duration,
    /// The listener probes for new rows every 1 ms while they arrive, backing
    /// off to this while none do: the longest wait of the first row after a
    /// quiet spell, and about what an idle listener costs the database.
    #[serde(with = "humantime_serde")]
    pub idle_probe_max: Duration,
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
    /// Connections a large flush of marks is split over, written in parallel.
    pub mark_connections: u32,
    /// On SIGTERM, in-flight publishes get this long to finish.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Restarts allowed per actor within `restart_window` before the relay gives up.
    pub max_restarts: u32,
    #[serde(with = "humantime_serde")]
    pub restart_window: Duration,
    /// This replica's name among those sharing the database; empty means
    /// `<hostname>-<pid>-<6 hex digits>`, new for each start. One live
    /// process per name (a second one refuses to start); a replica restarted
    /// under the same name takes its shards back once the old process's
    /// heartbeat stopped, instead of waiting for their leases to end.
    pub replica_id: String,
    /// How long a replica owns a shard without renewing (renewed every
    /// quarter of it). A replica that dies loses its shards after this long.
    #[serde(with = "humantime_serde")]
    pub shard_lease: Duration,
    /// Share each claim's rows between the tenants (`outbox.tenant_id`)
    /// with rows pending, so one tenant's backlog does not hold back
    /// another's events by more than a claim.
    pub tenant_fairness: bool,
    /// The most rows of one tenant the plain claims of this relay take per
    /// second, for tenants without a `rate` of their own; unset: no pace.
    /// Only with `tenant_fairness`.
    pub tenant_rate: Option<u32>,
    /// Tenants whose share is not 1 or whose pace is their own
    /// (`[[relay.tenants]]`: `id`, `weight`, `rate`).
    pub tenants: Vec<TenantWeight>,
}

impl RelayConfig {
    /// Connections of the actors' pool besides the claimers': the marker's,
    /// the coordinator's, and one for the drain's progress and start-up checks.
    pub(crate) fn others_in_pool(&self) -> u32 {
        self.mark_connections + 2
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
            idle_poll_max: Duration::from_secs(5),
            idle_probe_max: Duration::from_secs(1),
            max_attempts: 10,
            backoff_base: Duration::from_secs(1),
            backoff_cap: Duration::from_secs(300),
            mark_batch: 1000,
            mark_interval: Duration::from_millis(5),
            mark_connections: 2,
            shutdown_grace: Duration::from_secs(10),
            max_restarts: 10,
            restart_window: Duration::from_secs(60),
            replica_id: String::new(),
            shard_lease: Duration::from_secs(10),
            tenant_fairness: false,
            tenant_rate: None,
            tenants: Vec::new(),
        }
    }
}
