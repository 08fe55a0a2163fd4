//! Load-test harness for outbox-relay.
pub mod procstat;
pub mod producer;
pub mod relay;
pub mod report;
pub mod runner;
pub mod scenario;
pub mod sink;
pub mod verify;
