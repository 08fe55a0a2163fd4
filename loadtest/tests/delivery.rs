//! Delivery mode end to end against the real relay: the sink delivers what it
//! accepted to the harness's final destination, which fails a fifth of its
//! calls; the run waits for the retries and checks each key at the
//! destination. No timing is asserted: the limit only keeps a broken run from
//! hanging.
//!
//! The relay is chosen as in the chaos tests (`common::relay`).

mod common;

use std::time::Duration;

use common::run_in_test;
use loadtest::scenario::Scenario;

const SCENARIO: &str = r#"
name = "delivery-ci"
kind = "drain"
ordering = "partition_key_to_qstash"
drain_timeout = "3m"

[preload]
events = 300
connections = 2
tenants = 2
partition_keys = 10
skew = "uniform"
seed = 5

[sink.delivery]
retry_delay = "100ms"
retry_delay_max = "300ms"
# Nine attempts at a fifth failing each: every event gets through.
retries = 8
failure_rate = 0.2
latency = "1ms"
jitter = "3ms"
seed = 5
# Reported, not enforced: a relay that waits only for QStash's acceptance
# may see a retried event overtaken at the destination.
check_order = false
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_destination_gets_every_event_through_retries_one_call_of_a_key_at_a_time() {
    let scenario = Scenario::from_toml_str(SCENARIO).unwrap();
    let run = run_in_test(&scenario, Duration::from_secs(300), 20).await;
    let report = &run.report;
    assert!(report.passed, "{}", run.context);
    let d = report.destination.as_ref().expect("a destination report");
    assert_eq!(d.events_delivered, 300, "{}", run.context);
    assert!(d.failed_calls > 0, "the destination failed no call");
    assert!(d.calls >= d.failed_calls + d.events_delivered);
    assert_eq!(d.keys, 10);
    assert_eq!(d.unidentified_calls, 0);
    assert_eq!(
        (d.max_in_flight_per_key, d.over_parallelism_keys),
        (1, 0),
        "flow control: one call of a key in flight"
    );
    assert_eq!(report.sink.delivered, 300);
    assert_eq!(report.sink.delivery_failures, 0);
    assert!(run.context.contains("destination order"), "{}", run.context);
    let relay_toml = std::fs::read_to_string(run.out_dir.join("relay.toml")).unwrap();
    assert!(relay_toml.contains("/events"), "{relay_toml}");
}
