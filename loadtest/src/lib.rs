//! Load-test harness for outbox-relay.
pub mod producer;
pub mod sink;
pub mod verify;
