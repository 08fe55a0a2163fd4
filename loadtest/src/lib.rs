//! Load-test harness for outbox-relay.
pub mod procstat;
pub mod producer;
pub mod report;
pub mod scenario;
pub mod sink;
pub mod verify;
