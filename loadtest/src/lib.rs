//! Load-test harness for outbox-relay.
//!
//! ```text
//! producer (enqueue_many / binary COPY) ──▶ outbox ──▶ outbox-relay (child process)
//!                                                          │ /v2/batch, /v2/publish
//!                                                          ▼
//!                  outbox_testkit::sink::Sink (QStash stand-in, faults, records)
//!                                                          │ [sink.delivery]: delivered, retried, flow controlled
//!                                                          ▼
//!                  outbox_testkit::sink::Destination (records each call; order checked per key)
//!                                                          │
//!                  verify (rows + records) ──▶ report (table, JSON, SVG)
//! ```
//!
//! [`runner::run_scenario`] ties them together for a [`scenario::Scenario`]
//! file. The sink, the relay child process and the throwaway PostgreSQL
//! cluster are the workspace's test kit (`crates/testkit`, `outbox_testkit`).

#![warn(unreachable_pub)]

pub mod adversarial;
pub mod ceiling;
pub mod metrics;
pub mod procstat;
pub mod producer;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod verify;
