//! Load-test harness for outbox-relay.
//!
//! ```text
//! producer (enqueue_many / binary COPY) ──▶ outbox ──▶ outbox-relay (child process)
//!                                                          │ /v2/batch, /v2/publish
//!                                                          ▼
//!                               sink::Sink (QStash-compatible, faults, records)
//!                                                          │
//!                  verify (rows + records) ──▶ report (table, JSON, SVG)
//! ```
//!
//! [`runner::run_scenario`] ties them together for a [`scenario::Scenario`]
//! file; [`sink`] is usable on its own by the relay's tests.

pub mod adversarial;
pub mod ceiling;
pub mod metrics;
pub mod procstat;
pub mod producer;
pub mod relay;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod sink;
pub mod verify;
