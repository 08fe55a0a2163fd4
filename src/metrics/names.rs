//! The names of every metric the relay exports. Dashboards, alert rules and
//! the exporter all use this list; `tests/ops_config.rs` checks that the
//! dashboards and alerts in `config/` name nothing else.

/// Counters (`_total`), gauges and histograms, in that order.
pub const METRIC_NAMES: &[&str] = &[
    EVENTS_PUBLISHED_TOTAL,
    EVENTS_RETRIED_TOTAL,
    EVENTS_DEAD_LETTERED_TOTAL,
    CLAIMS_TOTAL,
    KEY_CLAIMS_TOTAL,
    ACTOR_RESTARTS_TOTAL,
    MARKS_FENCED_TOTAL,
    SHARD_HANDOVERS_TOTAL,
    EVENTS_DEFERRED_TOTAL,
    ROUTE_PAUSES_TOTAL,
    MARKS_FAILED_TOTAL,
    EVENTS_HELD_TOTAL,
    CALLBACKS_TOTAL,
    BACKLOG,
    OLDEST_PENDING_AGE_SECONDS,
    DEAD_LETTERS,
    FLAPPING,
    STUCK_LEASES,
    OUTBOX_DEAD_TUPLES,
    IN_FLIGHT,
    SHARDS_OWNED,
    ROUTE_PAUSED,
    PUBLISH_DURATION_SECONDS,
    BATCH_SIZE,
    COMMIT_TO_ACK_SECONDS,
];

/// The histograms among [`METRIC_NAMES`]: Prometheus exposes each as
/// `_bucket`, `_sum` and `_count` series.
pub const HISTOGRAMS: &[&str] = &[PUBLISH_DURATION_SECONDS, BATCH_SIZE, COMMIT_TO_ACK_SECONDS];

/// Counter, labels `route`.
pub const EVENTS_PUBLISHED_TOTAL: &str = "outbox_relay_events_published_total";
/// Counter, labels `route`, `reason`.
pub const EVENTS_RETRIED_TOTAL: &str = "outbox_relay_events_retried_total";
/// Counter, labels `route`, `reason`.
pub const EVENTS_DEAD_LETTERED_TOTAL: &str = "outbox_relay_events_dead_lettered_total";
/// Counter: claim statements run.
pub const CLAIMS_TOTAL: &str = "outbox_relay_claims_total";
/// Counter, label `kind` (`walk`, `recheck`): ordered routes' key-head claims.
pub const KEY_CLAIMS_TOTAL: &str = "outbox_relay_key_claims_total";
/// Counter, label `actor`.
pub const ACTOR_RESTARTS_TOTAL: &str = "outbox_relay_actor_restarts_total";
/// Counter: outcomes the database refused because the row's lease had moved
/// on to a newer claim (fencing at work).
pub const MARKS_FENCED_TOTAL: &str = "outbox_relay_marks_fenced_total";
/// Counter, label `kind`: `acquired`, `released` (handed over, or given
/// back on shutdown), `lost` (not renewed in time, or taken by another replica).
pub const SHARD_HANDOVERS_TOTAL: &str = "outbox_relay_shard_handovers_total";
/// Counter, labels `route`, `cause` (`paused`: the route was paused;
/// `no_witness`: a final verdict came while the route accepted nothing
/// else; `limited`: a webhook route's or host's `rate`, `concurrency` or a
/// `429` held it back): rows put back without spending an attempt.
pub const EVENTS_DEFERRED_TOTAL: &str = "outbox_relay_events_deferred_total";
/// Counter, labels `route`, `cause` (`unauthorized`, `rate_limited`,
/// `connect`, `failing`): times a route's circuit breaker opened.
pub const ROUTE_PAUSES_TOTAL: &str = "outbox_relay_route_pauses_total";
/// Counter: outcomes the database refused to store (after isolating them one
/// by one); the row stays pending and is delivered again.
pub const MARKS_FAILED_TOTAL: &str = "outbox_relay_marks_failed_total";
/// Counter, label `route`: ordered QStash deliveries QStash took and the
/// relay holds (their key waits) until a callback says what the destination
/// answered.
pub const EVENTS_HELD_TOTAL: &str = "outbox_relay_events_held_total";
/// Counter, label `outcome`: QStash delivery callbacks the relay took:
/// `delivered` (the destination answered 2xx: published), `retrying` (it did
/// not, and QStash tries again: still held), `failed` (the last attempt
/// failed: dead-lettered), `stale` (about an attempt the row is no longer on).
pub const CALLBACKS_TOTAL: &str = "outbox_relay_callbacks_total";
/// Gauge, label `route`: 1 while the route is paused by its circuit breaker.
pub const ROUTE_PAUSED: &str = "outbox_relay_route_paused";
/// Gauge: shards this replica holds a lease on.
pub const SHARDS_OWNED: &str = "outbox_relay_shards_owned";
/// Gauge: pending rows (not published, not dead-lettered).
pub const BACKLOG: &str = "outbox_relay_backlog";
/// Gauge: age of the oldest pending row; the number to alert on.
pub const OLDEST_PENDING_AGE_SECONDS: &str = "outbox_relay_oldest_pending_age_seconds";
/// Gauge: dead-lettered rows in the outbox.
pub const DEAD_LETTERS: &str = "outbox_relay_dead_letters";
/// Gauge: pending rows that failed more than three attempts.
pub const FLAPPING: &str = "outbox_relay_flapping";
/// Gauge: pending rows whose lease ran out without a mark or a new claim.
pub const STUCK_LEASES: &str = "outbox_relay_stuck_leases";
/// Gauge: `n_dead_tup` of the outbox (all partitions summed).
pub const OUTBOX_DEAD_TUPLES: &str = "outbox_relay_outbox_dead_tuples";
/// Gauge: rows claimed and not yet marked, in this process.
pub const IN_FLIGHT: &str = "outbox_relay_in_flight";
/// Histogram: one publish request (a `/v2/batch` call counts once).
pub const PUBLISH_DURATION_SECONDS: &str = "outbox_relay_publish_duration_seconds";
/// Histogram: rows per claim.
pub const BATCH_SIZE: &str = "outbox_relay_batch_size";
/// Histogram: from the event's `created_at` to the destination's acceptance.
pub const COMMIT_TO_ACK_SECONDS: &str = "outbox_relay_commit_to_ack_seconds";
