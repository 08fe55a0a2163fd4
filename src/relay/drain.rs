//! What `drain` did, and how it ended: the status, and the exit code that
//! operators' scripts and cron jobs read.

use crate::actors::CountersSnapshot;

/// How a drain ended. When several hold, the first in this order is the one
/// reported: a relay that gave up explains everything else; a paused route
/// (QStash or the destination refusing all work, e.g. a revoked token)
/// usually also leaves a backlog, and needs a person before another run can
/// help; dead letters are events that will not arrive without a person; a
/// backlog left at `--max-duration` may only need another run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DrainStatus {
    /// Nothing due is left (rows scheduled for later may remain). Exit 0.
    Ok,
    /// The actor tree gave up (restart budget exhausted). Exit 1, as for an
    /// error (configuration, database) before or during the drain.
    GaveUp,
    /// A route was still paused by its circuit breaker at the end. Exit 5.
    RoutePaused,
    /// Events were dead-lettered during the drain. Exit 4.
    DeadLettered,
    /// `--max-duration` passed with events still due or held. Exit 3.
    BacklogLeft,
}

impl DrainStatus {
    /// The process's exit code (2 is clap's, for a usage error).
    pub fn exit_code(self) -> u8 {
        match self {
            DrainStatus::Ok => 0,
            DrainStatus::GaveUp => 1,
            DrainStatus::BacklogLeft => 3,
            DrainStatus::DeadLettered => 4,
            DrainStatus::RoutePaused => 5,
        }
    }
}

/// A route whose circuit breaker had not closed again when the drain ended.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PausedRoute {
    pub route: String,
    /// Why it paused: `route paused (<cause>): <the sink's answer>`.
    pub error: String,
}

/// What `drain` did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DrainReport {
    pub counters: CountersSnapshot,
    pub elapsed_secs: f64,
    /// Rows still pending when it stopped: those scheduled for later (by
    /// their producer, or a retry further off than `relay.backoff_cap`),
    /// plus any left by a timeout, a paused route or a relay that gave up.
    pub remaining: i64,
    /// The earliest time a remaining row becomes due.
    pub next_due: Option<chrono::DateTime<chrono::Utc>>,
    /// Of the remaining rows, those QStash took whose delivery callback had
    /// not come (an ordered QStash route); a later run or the daemon settles
    /// them when it comes, or sends them again when the hold runs out.
    pub held: i64,
    pub timed_out: bool,
    /// The actor tree gave up (restart budget exhausted): `drain` fails.
    pub gave_up: bool,
    /// Routes still paused at the end (their rows wait, attempts unspent).
    pub paused_routes: Vec<PausedRoute>,
    /// Rows QStash's callbacks dead-lettered while the drain served them
    /// (not in `counters`, which are the marker's).
    pub dead_lettered_by_callbacks: u64,
    /// How it ended ([`DrainStatus`]), its exit code, and why, in a sentence.
    pub status: DrainStatus,
    pub exit_code: u8,
    pub reason: String,
}

/// What the drain found when it stopped, before its status is decided.
#[derive(Debug, Clone)]
pub(crate) struct DrainEnd {
    pub(crate) counters: CountersSnapshot,
    pub(crate) elapsed_secs: f64,
    pub(crate) remaining: i64,
    pub(crate) next_due: Option<chrono::DateTime<chrono::Utc>>,
    pub(crate) held: i64,
    pub(crate) timed_out: bool,
    pub(crate) gave_up: bool,
    pub(crate) paused_routes: Vec<PausedRoute>,
    pub(crate) dead_lettered_by_callbacks: u64,
}

impl DrainEnd {
    /// The report, with the status that takes precedence ([`DrainStatus`]).
    pub(crate) fn report(self) -> DrainReport {
        let dead = self.counters.dead_lettered + self.dead_lettered_by_callbacks;
        let (status, reason) = if self.gave_up {
            (
                DrainStatus::GaveUp,
                "the relay's actors kept crashing and it gave up (relay.max_restarts); see the log"
                    .to_owned(),
            )
        } else if !self.paused_routes.is_empty() {
            let routes: Vec<String> = self
                .paused_routes
                .iter()
                .map(|p| format!("`{}` ({})", p.route, p.error))
                .collect();
            (
                DrainStatus::RoutePaused,
                format!(
                    "still paused at the end: route {}; its {} pending events wait without spending attempts",
                    routes.join(", route "),
                    self.remaining
                ),
            )
        } else if dead > 0 {
            (
                DrainStatus::DeadLettered,
                format!("{dead} events were dead-lettered; see `outbox-relay dlq list`"),
            )
        } else if self.timed_out {
            let held = if self.held > 0 {
                format!(
                    ", {} of them held for QStash's delivery callback",
                    self.held
                )
            } else {
                String::new()
            };
            (
                DrainStatus::BacklogLeft,
                format!(
                    "stopped at --max-duration with {} events still pending{held}",
                    self.remaining
                ),
            )
        } else {
            (DrainStatus::Ok, "nothing due is left".to_owned())
        };
        DrainReport {
            counters: self.counters,
            elapsed_secs: self.elapsed_secs,
            remaining: self.remaining,
            next_due: self.next_due,
            held: self.held,
            timed_out: self.timed_out,
            gave_up: self.gave_up,
            paused_routes: self.paused_routes,
            dead_lettered_by_callbacks: self.dead_lettered_by_callbacks,
            status,
            exit_code: status.exit_code(),
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn end() -> DrainEnd {
        DrainEnd {
            counters: CountersSnapshot::default(),
            elapsed_secs: 1.0,
            remaining: 0,
            next_due: None,
            held: 0,
            timed_out: false,
            gave_up: false,
            paused_routes: Vec::new(),
            dead_lettered_by_callbacks: 0,
        }
    }

    #[test]
    fn the_most_serious_end_decides_the_exit_code() {
        assert_eq!(end().report().exit_code, 0);
        let mut e = end();
        e.timed_out = true;
        e.remaining = 3;
        assert_eq!(e.clone().report().status, DrainStatus::BacklogLeft);
        e.dead_lettered_by_callbacks = 1;
        assert_eq!(e.clone().report().status, DrainStatus::DeadLettered);
        e.paused_routes.push(PausedRoute {
            route: "r".into(),
            error: "route paused (unauthorized): HTTP 401".into(),
        });
        let paused = e.clone().report();
        assert_eq!(
            (paused.status, paused.exit_code),
            (DrainStatus::RoutePaused, 5)
        );
        assert!(paused.reason.contains("`r`") && paused.reason.contains("401"));
        e.gave_up = true;
        assert_eq!(e.report().exit_code, 1);
    }
}
