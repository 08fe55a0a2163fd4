//! Load-test harness for outbox-relay.
pub mod sink;
