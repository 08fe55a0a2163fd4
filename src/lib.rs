//! outbox-relay: the transactional outbox for PostgreSQL, drained by a relay
//! built from actors and delivered to Upstash QStash or any HTTP endpoint.
//!
//! ```text
//! app transaction ── outbox_client::enqueue ──▶ outbox table (no NOTIFY: the relay polls the id sequence)
//!
//!  actors::Supervisor ─┬─ Listener   (own connection, probes the id sequence) ── wakes claimers
//!                      ├─ Coordinator       (shard leases: a fair share among replicas)
//!                      ├─ Claimer × owned shards  (read due rows of its shard, under the shard lease; queue them as jobs)
//!                      ├─ Publisher × N     (take a job, tenants in turn if fair; sink::* over one hyper client)
//!                      └─ Marker            (multi-row UPDATEs, fenced by lease and shard token)
//!
//!  publisher ── telemetry (a span per delivery, child of the producer's traceparent; OTLP, off by default)
//! ```
//!
//! Applications link the `outbox-client` crate (`crates/client`), not this one:
//! it enqueues events, holds the row and envelope types and the webhook
//! signing this engine shares, and lets consumers verify signatures and
//! handle each event once.

#![warn(unreachable_pub, unnameable_types)]

mod actors;
pub mod backoff;
pub mod cli;
pub mod config;
mod daemon;
pub mod janitor;
mod jsonb;
pub mod metrics;
mod redact;
pub mod relay;
pub mod routes;
pub mod server;
pub mod sink;
pub mod store;
pub mod telemetry;
#[cfg(test)]
mod testing;

pub use actors::supervisor::ShutdownReport;
pub use actors::CountersSnapshot;
pub use config::Config;
pub use daemon::{drain, run_until_signal};
pub use redact::{HttpUrl, Secret};
pub use relay::{DrainReport, Relay};
