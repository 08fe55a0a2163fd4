//! Every series exported from start, at 0. A counter that appears only at its
//! first increment has no sample before it, so `increase()` and `rate()` over
//! it miss that increment: an alert on "any dead letter" stays silent for the
//! first one. So at start-up the daemon registers each counter and histogram
//! with every label set it can take, and the process's own gauges.
//!
//! Label values are known at start-up: the routes come from the config, and
//! every other label (reason, cause, outcome, kind, actor, sink) takes values
//! from a fixed list kept next to the code that uses it. The gauges read from
//! the database (backlog, age, dead letters, …) are not registered here: a 0
//! before the first sample would claim an empty, healthy outbox, and would
//! hide a sampler that never succeeds (the `absent()` alert watches for it).
//! They appear with the sampler's first sample, taken as the relay starts.

use metrics::{counter, gauge, histogram};

use super::names;

/// The label values each labelled series can take.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KnownLabels<'a> {
    /// The routes' names as the metrics show them (`<event_type>#<index>`).
    pub(crate) routes: &'a [String],
    pub(crate) retry_reasons: &'a [&'static str],
    /// Every dead-letter reason; `no_route` goes with route `none` only,
    /// the others with each route.
    pub(crate) dead_reasons: &'a [&'static str],
    pub(crate) pause_causes: &'a [&'static str],
    /// Why rows are put back without spending an attempt.
    pub(crate) defer_causes: &'a [&'static str],
    pub(crate) callback_outcomes: &'a [&'static str],
    pub(crate) handover_kinds: &'a [&'static str],
    /// How the ordered routes' key-head claims went: a walk or a recheck.
    pub(crate) key_claim_kinds: &'a [&'static str],
    pub(crate) actors: &'a [&'static str],
    pub(crate) sinks: &'a [&'static str],
}

/// The route label of an event no route takes.
pub(crate) const NO_ROUTE: &str = "none";
/// The dead-letter reason of such an event.
const NO_ROUTE_REASON: &str = "no_route";

/// Registers every counter and histogram at 0, and the process's gauges, so
/// that the first scrape already has them.
pub(crate) fn export_at_zero(labels: &KnownLabels<'_>) {
    for route in labels.routes {
        for name in [names::EVENTS_PUBLISHED_TOTAL, names::EVENTS_HELD_TOTAL] {
            counter!(name, "route" => route.clone()).increment(0);
        }
        for &cause in labels.defer_causes {
            counter!(names::EVENTS_DEFERRED_TOTAL, "route" => route.clone(), "cause" => cause)
                .increment(0);
        }
        for &reason in labels.retry_reasons {
            counter!(names::EVENTS_RETRIED_TOTAL, "route" => route.clone(), "reason" => reason)
                .increment(0);
        }
        for &reason in labels
            .dead_reasons
            .iter()
            .filter(|r| **r != NO_ROUTE_REASON)
        {
            counter!(names::EVENTS_DEAD_LETTERED_TOTAL, "route" => route.clone(), "reason" => reason)
                .increment(0);
        }
        for &cause in labels.pause_causes {
            counter!(names::ROUTE_PAUSES_TOTAL, "route" => route.clone(), "cause" => cause)
                .increment(0);
        }
        gauge!(names::ROUTE_PAUSED, "route" => route.clone()).set(0.0);
    }
    counter!(names::EVENTS_DEAD_LETTERED_TOTAL, "route" => NO_ROUTE, "reason" => NO_ROUTE_REASON)
        .increment(0);
    for &outcome in labels.callback_outcomes {
        counter!(names::CALLBACKS_TOTAL, "outcome" => outcome).increment(0);
    }
    for &kind in labels.handover_kinds {
        counter!(names::SHARD_HANDOVERS_TOTAL, "kind" => kind).increment(0);
    }
    for &kind in labels.key_claim_kinds {
        counter!(names::KEY_CLAIMS_TOTAL, "kind" => kind).increment(0);
    }
    for &actor in labels.actors {
        counter!(names::ACTOR_RESTARTS_TOTAL, "actor" => actor).increment(0);
    }
    for name in [
        names::CLAIMS_TOTAL,
        names::MARKS_FENCED_TOTAL,
        names::MARKS_FAILED_TOTAL,
    ] {
        counter!(name).increment(0);
    }
    for &sink in labels.sinks {
        // Registered, with no observation: exported with counts of 0.
        let _ = histogram!(names::PUBLISH_DURATION_SECONDS, "sink" => sink);
    }
    let _ = histogram!(names::BATCH_SIZE);
    let _ = histogram!(names::COMMIT_TO_ACK_SECONDS);
    gauge!(names::IN_FLIGHT).set(0.0);
    gauge!(names::SHARDS_OWNED).set(0.0);
}
