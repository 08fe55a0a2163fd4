//! Prometheus metrics: names, buckets, and the few helpers the hot path uses.
//! A leaf: it knows nothing of the rest of the crate.

pub mod names;
mod zero;

use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub use names::METRIC_NAMES;
pub(crate) use zero::{export_at_zero, KnownLabels, NO_ROUTE};

// Short names for the hot path; the list of record is [`names`].
pub(crate) const PUBLISHED: &str = names::EVENTS_PUBLISHED_TOTAL;
pub(crate) const RETRIED: &str = names::EVENTS_RETRIED_TOTAL;
pub(crate) const DEAD_LETTERED: &str = names::EVENTS_DEAD_LETTERED_TOTAL;
pub(crate) const CLAIMS: &str = names::CLAIMS_TOTAL;
pub(crate) const KEY_CLAIMS: &str = names::KEY_CLAIMS_TOTAL;
pub(crate) const ACTOR_RESTARTS: &str = names::ACTOR_RESTARTS_TOTAL;
pub(crate) const MARKS_FENCED: &str = names::MARKS_FENCED_TOTAL;
pub(crate) const SHARD_HANDOVERS: &str = names::SHARD_HANDOVERS_TOTAL;
pub const SHARDS_OWNED: &str = names::SHARDS_OWNED;
pub(crate) const DEFERRED: &str = names::EVENTS_DEFERRED_TOTAL;
pub(crate) const HELD: &str = names::EVENTS_HELD_TOTAL;
pub(crate) const CALLBACKS: &str = names::CALLBACKS_TOTAL;
pub(crate) const ROUTE_PAUSES: &str = names::ROUTE_PAUSES_TOTAL;
pub(crate) const ROUTE_PAUSED: &str = names::ROUTE_PAUSED;
pub(crate) const MARKS_FAILED: &str = names::MARKS_FAILED_TOTAL;
pub const IN_FLIGHT: &str = names::IN_FLIGHT;
pub(crate) const PUBLISH_DURATION: &str = names::PUBLISH_DURATION_SECONDS;
pub const BATCH_SIZE: &str = names::BATCH_SIZE;
pub(crate) const COMMIT_TO_ACK: &str = names::COMMIT_TO_ACK_SECONDS;

/// Milliseconds to minutes.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];
const BATCH_BUCKETS: &[f64] = &[
    1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0,
];

/// How often the recorder folds the histogram samples recorded since into
/// their buckets.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(1);

/// Installs the global recorder (no listener: the relay's own server renders
/// it) and its upkeep. The recorder keeps each histogram sample (one per
/// event for `commit_to_ack_seconds`) until they are folded into the
/// buckets, which only a scrape or the upkeep does: without the upkeep, a
/// relay nobody scrapes held 16 MB per million events, for as long as it ran.
pub fn install() -> Result<PrometheusHandle, metrics_exporter_prometheus::BuildError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), BATCH_BUCKETS)?
        .install_recorder()?;
    describe();
    let upkeep = handle.clone();
    let run = move || upkeep.run_upkeep();
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(async move {
                let mut every = tokio::time::interval(UPKEEP_INTERVAL);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    every.tick().await;
                    run();
                }
            });
        }
        Err(_) => {
            std::thread::spawn(move || loop {
                std::thread::sleep(UPKEEP_INTERVAL);
                run();
            });
        }
    }
    Ok(handle)
}

fn describe() {
    describe_counter!(PUBLISHED, "Events the destination accepted (2xx)");
    describe_counter!(RETRIED, "Delivery attempts that failed and will be retried");
    describe_counter!(DEAD_LETTERED, "Events dead-lettered, by route and reason");
    describe_counter!(CLAIMS, "Claim statements run");
    describe_counter!(
        KEY_CLAIMS,
        "Ordered routes' key-head claims, by kind: a walk of every key or a recheck of the keys that changed"
    );
    describe_counter!(
        ACTOR_RESTARTS,
        "Actors restarted by the supervisor, by actor"
    );
    describe_counter!(
        MARKS_FENCED,
        "Outcomes not written because the lease was lost"
    );
    describe_counter!(
        SHARD_HANDOVERS,
        "Shard leases this replica acquired, released (handed over) or lost, by kind"
    );
    describe_counter!(
        DEFERRED,
        "Rows put back without spending an attempt because their route was paused"
    );
    describe_counter!(
        ROUTE_PAUSES,
        "Times a route paused because its sink failed every request, by cause"
    );
    describe_counter!(
        HELD,
        "Ordered QStash deliveries held until QStash's callback says what the destination answered"
    );
    describe_counter!(CALLBACKS, "QStash delivery callbacks taken, by outcome");
    describe_counter!(
        MARKS_FAILED,
        "Outcomes the database refused to store; the rows are delivered again"
    );
    describe_gauge!(
        ROUTE_PAUSED,
        "1 while the route is paused by its circuit breaker"
    );
    describe_gauge!(IN_FLIGHT, "Rows claimed and not yet marked");
    describe_gauge!(SHARDS_OWNED, "Shards this replica holds a lease on");
    describe_gauge!(
        names::BACKLOG,
        "Pending rows (not published, not dead-lettered)"
    );
    describe_gauge!(
        names::OLDEST_PENDING_AGE_SECONDS,
        Unit::Seconds,
        "Age of the oldest pending row"
    );
    describe_gauge!(names::DEAD_LETTERS, "Dead-lettered rows in the outbox");
    describe_gauge!(
        names::FLAPPING,
        "Pending rows that failed more than three attempts"
    );
    describe_gauge!(
        names::STUCK_LEASES,
        "Pending rows whose lease ran out without a mark"
    );
    describe_gauge!(names::OUTBOX_DEAD_TUPLES, "Dead tuples in the outbox table");
    describe_histogram!(
        PUBLISH_DURATION,
        Unit::Seconds,
        "HTTP request duration per sink request"
    );
    describe_histogram!(BATCH_SIZE, Unit::Count, "Rows per claim batch");
    describe_histogram!(
        COMMIT_TO_ACK,
        Unit::Seconds,
        "Row created_at to the sink's 2xx"
    );
}

pub(crate) fn record_commit_to_ack(age: Duration) {
    histogram!(COMMIT_TO_ACK).record(age.as_secs_f64());
}

pub(crate) fn count_actor_restart(actor: &'static str) {
    counter!(ACTOR_RESTARTS, "actor" => actor).increment(1);
}
