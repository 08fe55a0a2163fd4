//! outbox-relay: the transactional outbox for PostgreSQL, drained by a relay
//! built from actors and delivered to Upstash QStash or any HTTP endpoint.
//!
//! ```text
//! app transaction ── producer::enqueue ──▶ outbox table (no NOTIFY: the relay polls the id sequence)
//!
//!  actors::Supervisor ─┬─ Listener   (own connection, probes the id sequence) ── wakes claimers
//!                      ├─ Coordinator       (shard leases: a fair share among replicas)
//!                      ├─ Claimer × owned shards  (claim a batch under a lease)
//!                      ├─ Publisher × N     (sink::* over one hyper client)
//!                      └─ Marker            (multi-row UPDATEs, fenced by lease and shard token)
//! ```
//!
//! Consumers use [`consumer`] to verify signatures and handle each event once.

pub mod actors;
pub mod backoff;
pub mod cli;
pub mod config;
pub mod consumer;
pub mod daemon;
pub mod db;
pub mod metrics;
pub mod ops;
pub mod producer;
pub mod redact;
pub mod relay;
pub mod routes;
pub mod row;
pub mod server;
pub mod sink;
#[cfg(test)]
mod testing;

pub use config::Config;
pub use daemon::run_until_signal;
pub use producer::{enqueue, enqueue_many, EnqueueError, Enqueued, NewEvent};
pub use relay::{DrainReport, Relay};
