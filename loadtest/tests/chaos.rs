//! Short chaos runs against the real relay: steady load while the harness
//! SIGKILLs and restarts the relay, terminates its database backends, and the
//! sink answers 5xx and 429, hangs, resets and loses answers. Nothing may be
//! lost, and every receipt (first or duplicate) carries its row's idempotency
//! key as deduplication id. No timing is asserted: the limits are only there
//! so a broken relay fails the test instead of hanging it.
//!
//! The second run has three relay replicas on one database, kills a random one
//! and SIGSTOP-pauses another, with per-key ordering on: besides nothing lost,
//! no key may see a later event before an earlier one. The two runs take the
//! same lock, so they do not share the machine's cores.
//!
//! The relay: `LOADTEST_RELAY_BIN` if set; else `target/<profile>/outbox-relay`
//! next to this test (`cargo test --workspace` builds it before running any
//! test, since the root package's integration tests need it) when no engine
//! source file is newer than it; else the same engine embedded in
//! this package's `loadtest` binary (`CARGO_BIN_EXE_loadtest embedded-relay`),
//! which cargo always builds for this package's tests.

mod common;

use std::time::Duration;

use common::{run_in_test, TestRun};
use loadtest::scenario::Scenario;

const SCENARIO: &str = r#"
name = "chaos-ci"
kind = "chaos"
# Unordered for now: with a backlog and stale statistics the ordered claim's
# NOT EXISTS probe walks outbox_ready_idx instead of outbox_pending_key_idx
# (13 s per claim at 26,000 pending rows, seen in this test); the release-build
# chaos scenario (config/loadtest/chaos.toml) covers ordering meanwhile.
ordering = "none"
drain_timeout = "6m"

[load]
rate = 800.0
duration = "40s"
connections = 2
events_per_tx = 5
tenants = 5
partition_keys = 300
skew = { zipf = 1.0 }
seed = 11

[chaos]
kill_every_min = "6s"
kill_every_max = "12s"
restart_after = "500ms"
terminate_backends_every = "5s"
seed = 11

[sink.faults]
seed = 11
server_error = 0.03
rate_limited = 0.02
retry_after = "1s"
hang = 0.005
hang_for = "3s"
reset = 0.01
lost_response = 0.02
latency = "1ms"
jitter = "3ms"
element_error = 0.01

[relay_config.http]
request_timeout = "2s"

# The lease must outlast the wait of claimed rows in the publishers' queue
# (a debug build on a loaded CI machine is slow): with lease = "5s" a debug
# relay re-claimed rows still queued, every mark was fenced, and it livelocked.
[relay_config.relay]
lease = "30s"
claim_batch = 200
max_in_flight = 2000
backoff_base = "100ms"
backoff_cap = "2s"
max_attempts = 1000
shutdown_grace = "5s"
"#;

/// Three replicas, ordered, sharing eight shards through 2 s shard leases. A
/// killed replica's shards move to the others after that lease, its rows after
/// the row lease (10 s); a pause (2-4 s) often outlasts the shard lease, so the
/// paused replica's shards move and its late marks are fenced.
/// Uniform keys, so ordering (one event of a key in flight) does not throttle
/// a hot key while replicas come and go. 200 events/s: three debug-build
/// relays under this chaos delivered 100-170 ordered events/s on the shared
/// 2-core machine, so a higher rate only lengthens the drain.
const REPLICAS_SCENARIO: &str = r#"
name = "chaos-replicas-ci"
kind = "chaos"
ordering = "partition_key_to_qstash"
replicas = 3
drain_timeout = "4m"

[load]
rate = 200.0
duration = "25s"
connections = 2
events_per_tx = 5
tenants = 5
partition_keys = 1000
skew = "uniform"
seed = 12

[chaos]
kill_every_min = "4s"
kill_every_max = "8s"
restart_after = "500ms"
pause_every_min = "3s"
pause_every_max = "6s"
pause_for = "2s"
pause_for_max = "4s"
terminate_backends_every = "9s"
seed = 12

[sink.faults]
seed = 12
server_error = 0.03
rate_limited = 0.02
retry_after = "1s"
hang = 0.005
hang_for = "3s"
reset = 0.01
lost_response = 0.02
latency = "1ms"
jitter = "3ms"
element_error = 0.01

"#;

/// The relay settings of the multi-replica runs: eight shards moving through
/// 2 s shard leases, rows through 10 s leases.
const REPLICAS_RELAY_CONFIG: &str = r#"
[relay_config.http]
request_timeout = "2s"

[relay_config.relay]
lease = "10s"
shard_lease = "2s"
shards = 8
publishers = 2
claim_batch = 100
max_in_flight = 1000
backoff_base = "100ms"
backoff_cap = "2s"
max_attempts = 1000
shutdown_grace = "5s"
"#;

/// One chaos run at a time: they would otherwise share two cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_loses_nothing_and_every_duplicate_keeps_its_dedup_id() {
    let _serial = SERIAL.lock().await;
    let scenario = Scenario::from_toml_str(SCENARIO).unwrap();
    let TestRun {
        report, context, ..
    } = run_in_test(&scenario, Duration::from_secs(600), 40).await;

    let v = &report.verification;
    assert!(report.rows > 0 && v.expected == report.rows, "{context}");
    assert!(v.missing.is_empty(), "lost events: {context}");
    assert!(
        v.wrong_dedup_id.is_empty(),
        "unexplained duplicates: {context}"
    );
    assert_eq!(v.unknown_records, 0, "{context}");
    assert!(v.unexpected_dead_letters.is_empty(), "{context}");
    assert!(report.passed, "{context}");
    // The chaos really happened.
    let chaos = report.chaos.expect("chaos stats");
    assert!(chaos.kills >= 2, "only {} kills: {context}", chaos.kills);
    assert!(
        report.relay.processes >= 2 || report.relay.samples == 0,
        "{context}"
    );
    assert!(chaos.backends_terminated >= 1, "{context}");
    let s = &report.sink;
    assert!(
        s.server_errors + s.rate_limited + s.resets + s.lost_responses + s.element_errors > 0,
        "no sink fault was injected: {context}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_killed_and_paused_lose_nothing_and_keep_key_order() {
    let _serial = SERIAL.lock().await;
    let scenario =
        Scenario::from_toml_str(&format!("{REPLICAS_SCENARIO}{REPLICAS_RELAY_CONFIG}")).unwrap();
    let started = std::time::Instant::now();
    let TestRun {
        report,
        context,
        out_dir,
        dir: _dir,
    } = run_in_test(&scenario, Duration::from_secs(600), 15).await;
    eprintln!("{}\nwall time {:.1?}", report.table(), started.elapsed());

    let v = &report.verification;
    assert!(report.rows > 0 && v.expected == report.rows, "{context}");
    assert!(v.missing.is_empty(), "lost events: {context}");
    assert!(v.order_checked, "{context}");
    assert!(v.order_violations.is_empty(), "order violated: {context}");
    assert!(
        v.wrong_dedup_id.is_empty(),
        "unexplained duplicates: {context}"
    );
    assert_eq!(v.unknown_records, 0, "{context}");
    assert!(v.unexpected_dead_letters.is_empty(), "{context}");
    assert!(report.passed, "{context}");

    // Three replicas really ran, each with its own config, log and metrics port.
    assert_eq!(report.replicas, 3, "{context}");
    for i in 0..3 {
        for ext in ["toml", "log"] {
            let f = loadtest::runner::replica_file_name("relay", ext, i, 3);
            assert!(out_dir.join(&f).is_file(), "{f}: {context}");
        }
    }
    let ports: std::collections::BTreeSet<u16> = report
        .replica_metrics
        .iter()
        .map(|m| m.metrics_port)
        .collect();
    assert_eq!(ports.len(), 3, "{context}");
    // Each survived to the end and answered /metrics (the series it exports
    // today; `outbox_relay_shards_owned` is reported when the engine has it).
    assert!(
        report
            .replica_metrics
            .iter()
            .all(|m| m.scraped && m.events_published.is_some()),
        "{:?}\n{context}",
        report.replica_metrics
    );
    let published: f64 = report
        .replica_metrics
        .iter()
        .filter_map(|m| m.events_published)
        .sum();
    assert!(published > 0.0, "{context}");
    // At the end the shards are split among the three: all eight held, each
    // replica its fair share (2 or 3).
    let owned: Vec<f64> = report
        .replica_metrics
        .iter()
        .map(|m| m.shards_owned.unwrap_or(-1.0))
        .collect();
    assert_eq!(owned.iter().sum::<f64>(), 8.0, "{owned:?}\n{context}");
    assert!(
        owned.iter().all(|n| (2.0..=3.0).contains(n)),
        "{owned:?}\n{context}"
    );

    // The chaos really happened: kills and pauses, spread over replicas.
    let chaos = report.chaos.clone().expect("chaos stats");
    assert_eq!(chaos.per_replica.len(), 3, "{context}");
    assert!(chaos.kills >= 2, "only {} kills: {context}", chaos.kills);
    assert!(chaos.pauses >= 2, "only {} pauses: {context}", chaos.pauses);
    assert_eq!(
        chaos.per_replica.iter().map(|r| r.kills).sum::<u64>(),
        chaos.kills
    );
    assert_eq!(
        chaos.per_replica.iter().map(|r| r.pauses).sum::<u64>(),
        chaos.pauses
    );
    let disturbed = chaos
        .per_replica
        .iter()
        .filter(|r| r.kills + r.pauses > 0)
        .count();
    assert!(disturbed >= 2, "chaos hit one replica only: {context}");
    assert!(
        chaos
            .per_replica
            .iter()
            .all(|r| r.pauses == 0 || r.paused_ms > 0),
        "{chaos:?}"
    );
    assert!(
        report.relay.processes >= 5 || report.relay.samples == 0,
        "{context}"
    );
    assert!(chaos.backends_terminated >= 1, "{context}");
    // A replica may exit on its own when a backend cut hits its startup
    // queries (it reports the error and exits 1; the harness restarts it), but
    // never by a signal or a panic.
    assert!(
        chaos.exits.iter().all(|e| e.ends_with("exit status: 1")),
        "{context}"
    );
    let s = &report.sink;
    assert!(
        s.server_errors + s.rate_limited + s.resets + s.lost_responses + s.element_errors > 0,
        "no sink fault was injected: {context}"
    );
}

/// The CI form of `config/loadtest/chaos-ordered-qstash.toml`: two replicas,
/// ordered at the destination through QStash's callbacks, while the sink's
/// deliveries fail 10% of the time and are retried 0.5-1.5 s later (QStash
/// would deliver the key's next event meanwhile), replicas are killed and
/// paused and their backends cut. Order is checked at the final destination.
const ORDERED_QSTASH_SCENARIO: &str = r#"
name = "chaos-ordered-qstash-ci"
kind = "chaos"
ordering = "partition_key"
replicas = 2
drain_timeout = "4m"

[load]
rate = 100.0
duration = "20s"
connections = 2
events_per_tx = 5
tenants = 5
partition_keys = 100
skew = "uniform"
seed = 33

[chaos]
kill_every_min = "5s"
kill_every_max = "9s"
restart_after = "500ms"
pause_every_min = "6s"
pause_every_max = "10s"
pause_for = "2s"
pause_for_max = "3s"
terminate_backends_every = "9s"
seed = 33

[sink]
dedup_window = "10m"

[sink.delivery]
retry_delay = "500ms"
retry_delay_max = "1500ms"
retries = 8
failure_rate = 0.1
latency = "2ms"
jitter = "5ms"
seed = 33
check_order = true
callback_retries = 10
settle_timeout = "3m"

"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_qstash_routes_keep_key_order_at_the_destination_through_chaos() {
    let _serial = SERIAL.lock().await;
    let scenario =
        Scenario::from_toml_str(&format!("{ORDERED_QSTASH_SCENARIO}{REPLICAS_RELAY_CONFIG}"))
            .unwrap();
    let TestRun {
        report, context, ..
    } = run_in_test(&scenario, Duration::from_secs(600), 15).await;
    eprintln!("{}", report.table());

    let v = &report.verification;
    assert!(report.rows > 0 && v.expected == report.rows, "{context}");
    assert!(v.missing.is_empty(), "lost events: {context}");
    assert!(v.unexpected_dead_letters.is_empty(), "{context}");
    let dest = report.destination.clone().expect("destination report");
    assert!(
        dest.events_delivered >= report.rows,
        "not every event reached the destination: {context}"
    );
    assert!(dest.failed_calls > 0, "no delivery failed: {context}");
    assert_eq!(dest.out_of_order, 0, "{:?}\n{context}", dest.examples);
    assert!(dest.max_in_flight_per_key <= 1, "{context}");
    assert!(report.passed, "{context}");
    let chaos = report.chaos.clone().expect("chaos stats");
    assert!(chaos.kills >= 1, "no kill: {context}");
}
