//! Prometheus metrics: names, buckets, and the few helpers the hot path uses.

use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::sink::{Response, TransportError};

pub const PUBLISHED: &str = "outbox_relay_events_published_total";
pub const RETRIED: &str = "outbox_relay_events_retried_total";
pub const DEAD_LETTERED: &str = "outbox_relay_events_dead_lettered_total";
pub const CLAIMS: &str = "outbox_relay_claims_total";
pub const ACTOR_RESTARTS: &str = "outbox_relay_actor_restarts_total";
pub const MARKS_FENCED: &str = "outbox_relay_marks_fenced_total";
pub const IN_FLIGHT: &str = "outbox_relay_in_flight";
pub const PUBLISH_DURATION: &str = "outbox_relay_publish_duration_seconds";
pub const BATCH_SIZE: &str = "outbox_relay_batch_size";
pub const COMMIT_TO_ACK: &str = "outbox_relay_commit_to_ack_seconds";

/// Milliseconds to minutes.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];
const BATCH_BUCKETS: &[f64] = &[
    1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0,
];

/// Installs the global recorder (no listener: the relay's own server renders it).
pub fn install() -> Result<PrometheusHandle, metrics_exporter_prometheus::BuildError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)?
        .set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), BATCH_BUCKETS)?
        .install_recorder()?;
    describe();
    Ok(handle)
}

fn describe() {
    describe_counter!(PUBLISHED, "Events the destination accepted (2xx)");
    describe_counter!(RETRIED, "Delivery attempts that failed and will be retried");
    describe_counter!(DEAD_LETTERED, "Events dead-lettered, by route and reason");
    describe_counter!(CLAIMS, "Claim statements run");
    describe_counter!(
        ACTOR_RESTARTS,
        "Actors restarted by the supervisor, by actor"
    );
    describe_counter!(
        MARKS_FENCED,
        "Outcomes not written because the lease was lost"
    );
    describe_gauge!(IN_FLIGHT, "Rows claimed and not yet marked");
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

pub fn record_request(sink: &'static str, result: &Result<Response, TransportError>) {
    let elapsed = match result {
        Ok(r) => r.elapsed,
        Err(TransportError::Timeout(d)) => *d,
        Err(_) => return,
    };
    histogram!(PUBLISH_DURATION, "sink" => sink).record(elapsed.as_secs_f64());
}

pub fn record_commit_to_ack(age: Duration) {
    histogram!(COMMIT_TO_ACK).record(age.as_secs_f64());
}

pub fn count_actor_restart(actor: &'static str) {
    counter!(ACTOR_RESTARTS, "actor" => actor).increment(1);
}
