//! The scenario runner end to end, with a naive shell stand-in for the relay
//! (psql + curl, one publish per row, in id order): the engine is not here
//! yet, but every path of the harness around it runs.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use loadtest::runner::{run_scenario, RunOptions};
use loadtest::scenario::Scenario;

const STAND_IN: &str = r#"#!/bin/sh
MIGRATIONS="__MIGRATIONS__"
case "$1" in
  migrate)
    exec psql "$DATABASE_URL" -q -v ON_ERROR_STOP=1 -f "$MIGRATIONS/0001_outbox.sql" -f "$MIGRATIONS/0002_processed_messages.sql" ;;
  run)
    trap 'exit 0' TERM
    while :; do
      psql "$DATABASE_URL" -Atc "SELECT id || ' ' || idempotency_key || ' ' || partition_key FROM outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL ORDER BY id LIMIT 100" |
      while read -r id key pk; do
        code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 -X POST \
          -H "Authorization: Bearer $QSTASH_TOKEN" -H "Upstash-Deduplication-Id: $key" \
          -H "Upstash-Forward-X-Outbox-Id: $id" -H "Upstash-Flow-Control-Key: $pk" \
          --data '{}' "$QSTASH_URL/v2/publish/http://127.0.0.1:9/hook")
        case "$code" in
          2*) psql "$DATABASE_URL" -qc "UPDATE outbox SET published_at = now(), attempt_count = attempt_count + 1 WHERE id = $id" ;;
        esac
      done
      sleep 0.1
    done ;;
esac
exit 2
"#;

#[tokio::test]
async fn a_drain_scenario_runs_end_to_end_with_a_stand_in_relay() {
    if which("psql").is_none() || which("curl").is_none() {
        eprintln!("skipped: needs psql and curl for the stand-in relay");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let migrations = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../migrations");
    let bin = dir.path().join("outbox-relay");
    std::fs::write(
        &bin,
        STAND_IN.replace("__MIGRATIONS__", &migrations.display().to_string()),
    )
    .unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();

    let scenario = Scenario::from_toml_str(
        r#"
name = "mini-drain"
kind = "drain"
ordering = "partition_key_to_qstash"
drain_timeout = "120s"
[preload]
events = 30
connections = 2
partition_keys = 4
"#,
    )
    .unwrap();
    let mut opts = RunOptions::new(dir.path().join("out"));
    opts.relay = outbox_testkit::relay::RelayProgram::binary(bin);
    opts.progress = false;
    opts.database_url = Some(
        std::env::var("TEST_DATABASE_URL")
            .unwrap_or_else(|_| outbox_testkit::DEFAULT_SERVER_URL.to_owned()),
    );
    let report = run_scenario(&scenario, &opts).await.unwrap();
    assert!(report.passed, "{}", report.table());
    assert_eq!((report.rows, report.delivered), (30, 30));
    assert!(report.verification.order_checked);
    assert_eq!(report.latency.count, 30);
    assert!(report.relay.processes >= 1 || report.relay.samples == 0);
    for file in ["relay.toml", "relay.log", "report.json", "report.svg"] {
        assert!(opts.out_dir.join(file).is_file(), "{file}");
    }
    let relay_toml = std::fs::read_to_string(opts.out_dir.join("relay.toml")).unwrap();
    assert!(
        relay_toml.contains("ordering = \"partition_key_to_qstash\""),
        "{relay_toml}"
    );
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}
