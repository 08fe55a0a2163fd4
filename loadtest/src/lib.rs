//! Load-test harness for outbox-relay.
//!
//! ```text
//! producer (enqueue_many / binary COPY) ──▶ outbox ──▶ outbox-relay (child process)
//!                                                          │ /v2/batch, /v2/publish
//!                                                          ▼
//!                  outbox_testkit::sink::Sink (QStash stand-in, faults, records;
//!                  its own `loadtest sink` process in performance scenarios)
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
//! [`compare`] runs several relays (the seed article's, older builds, this
//! one) side by side, interleaved, on one cluster; [`environment`] records
//! what each figure was taken on.

#![warn(unreachable_pub)]

pub mod adversarial;
pub mod baseline;
pub mod ceiling;
pub mod compare;
pub mod environment;
pub mod metrics;
pub mod procstat;
pub mod producer;
pub mod progress;
pub mod relay_faults;
pub mod report;
pub mod rolling;
pub mod runner;
pub mod scenario;
pub mod sink_process;
pub mod verify;
