//! The operator commands behind the `outbox-relay` binary: arguments (clap)
//! and rendering live here, the work in the library modules they call.

pub mod check;
pub mod dlq;
pub mod prune;
pub mod stats;
