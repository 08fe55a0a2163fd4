//! The operator commands behind the `outbox-relay` binary: arguments (clap)
//! and rendering live here, the work in the library modules they call.

pub mod check;
pub mod dlq;
pub mod prune;
pub mod stats;

/// Colour in logs only for a person at a terminal: not in a file or a pipe
/// (a log collector), and not when `NO_COLOR` is set (<https://no-color.org>).
pub fn colour_on_stderr() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}
