//! Test kit for outbox-relay, shared by the engine's tests, its benchmarks and
//! the load-test harness. Nothing here is used by the relay itself.
//!
//! - [`postgres`]: a fresh PostgreSQL database per test ([`TestDb`]) on a
//!   running server, or on a throwaway cluster of our own
//!   ([`ThrowawayCluster`]) when no server answers.
//! - [`sink`]: the QStash stand-in: `/v2/publish`, `/v2/batch`, deduplication,
//!   fault injection, outages, per-message rules for tests, webhook POSTs
//!   under `/hook/…`, and a delivery mode that delivers, retries and calls
//!   back the way QStash does.
//! - [`proxy`]: a loopback TCP proxy in front of PostgreSQL that can stop
//!   forwarding the connections open through it (a half-open connection).
//! - [`pgbouncer`]: a real PgBouncer in front of a test database, in session
//!   or transaction pooling mode.
//! - [`relay`]: the relay (an `outbox-relay` binary, or the engine embedded in
//!   another binary) as a child process: migrate, run, signals, stop.
//!
//! The kit does not depend on the engine crate: the engine's own unit tests
//! use it, and a dependency back onto the engine would give them a second copy
//! of the engine's types. A database gets the relay's schema from the caller
//! ([`TestDb::with_setup`] with the engine's migrations).

#![warn(unreachable_pub)]

pub mod pgbouncer;
pub mod postgres;
pub mod proxy;
pub mod relay;
pub mod sink;

pub use postgres::{
    url_with_dbname, ClusterOptions, ServerTls, TestDb, TestkitError, ThrowawayCluster,
    DEFAULT_SERVER_URL,
};
