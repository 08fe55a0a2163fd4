//! The seed article's relay as a load-test baseline (`relay = "seed"`): the
//! harness preloads the article's table, runs the article's worker against
//! the sink and measures it. Skipped, saying why, where `node` or the
//! baseline's `node_modules` (`npm ci` in `loadtest/baseline`) are absent.

mod common;

use loadtest::baseline;
use loadtest::runner::RunOptions;
use loadtest::scenario::Scenario;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_baseline_drains_a_tiny_backlog_through_the_sink() {
    if let Some(why) = baseline::missing() {
        eprintln!("skipped: {why}");
        return;
    }
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../config/loadtest/seed-baseline.toml"
    );
    let mut scenario = Scenario::load(std::path::Path::new(file)).unwrap();
    let preload = scenario.preload.as_mut().unwrap();
    preload.events = 300;
    preload.mix.partition_keys = 30;
    scenario.drain_timeout = std::time::Duration::from_secs(120);
    let out = tempfile::tempdir().unwrap();
    let mut opts = RunOptions::new(out.path());
    opts.database_url = common::server_url().await;
    opts.progress = false;
    let report = baseline::run(&scenario, &opts).await.unwrap();
    let table = report.table();
    assert!(report.passed(), "{table}");
    assert_eq!(report.published, 300, "{table}");
    // Every row went through the SDK to the sink, under the article's
    // deduplication id (one message each).
    assert_eq!(report.received, 300, "{table}");
    assert!(
        report.usage.cpu_secs > 0.0,
        "the process's CPU was not read:\n{table}"
    );
    assert!(table.contains("events/s"), "{table}");
}

#[test]
fn a_seed_scenario_must_be_a_drain() {
    let err = Scenario::from_toml_str(
        r#"name = "x"
kind = "steady"
relay = "seed"
[load]
rate = 10
duration = "1s"
"#,
    )
    .and_then(|s| s.validate().map(|_| s))
    .unwrap_err();
    assert!(err.to_string().contains("relay = \"seed\""), "{err}");
}
