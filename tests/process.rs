//! The `outbox-relay` binary as a process: signals, crashes and one-shot drains.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::{config_toml, count, insert_events, pending, wait_until, QSTASH_ROUTE, TOKEN};
use nix::sys::signal::Signal;
use outbox_testkit::relay::{Output, RelayProcess};
use outbox_testkit::sink::SinkHandle;
use outbox_testkit::TestDb;

fn start(db: &TestDb, sink: &SinkHandle, args: &[&str]) -> RelayProcess {
    let toml = config_toml(db, &sink.url(), QSTASH_ROUTE);
    common::spawn_relay(args, &toml, Output::Captured)
}

async fn keys(db: &TestDb, sql: &str) -> HashSet<String> {
    common::column(&db.client().await.unwrap(), sql).await
}

async fn live_leases(db: &TestDb) -> HashSet<String> {
    keys(
        db,
        "SELECT idempotency_key FROM outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL AND locked_until > now()",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_drain_then_restart_loses_nothing() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_delay(Duration::from_millis(20));
    insert_events(&db, 4000, 200).await;
    let mut relay = start(&db, &sink, &["run"]);
    assert!(
        wait_until(Duration::from_secs(60), || async {
            sink.accepted().len() >= 600
        })
        .await
    );
    relay.signal(Signal::SIGKILL);
    relay
        .exit_within(Duration::from_secs(10))
        .await
        .expect("killed");
    // What may arrive twice: rows it had sent (the sink saw them) and not
    // marked when it died. (A claim writes nothing, so rows it had read but
    // not sent are read again and sent once.)
    let sent: HashSet<String> = sink.received().into_iter().map(|r| r.dedup_id).collect();
    let in_flight_at_kill: HashSet<String> = keys(
        &db,
        "SELECT idempotency_key FROM outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL",
    )
    .await
    .intersection(&sent)
    .cloned()
    .collect();
    assert!(
        pending(&db).await > 0,
        "the kill came too late to test anything"
    );
    let mut relay = start(&db, &sink, &["run"]);
    assert!(
        wait_until(Duration::from_secs(120), || async {
            pending(&db).await == 0
        })
        .await,
        "the restarted relay did not finish"
    );
    relay.signal(Signal::SIGTERM);
    assert!(relay
        .exit_within(Duration::from_secs(15))
        .await
        .unwrap()
        .success());
    let mut times: HashMap<String, usize> = HashMap::new();
    for r in sink.accepted() {
        *times.entry(r.dedup_id).or_default() += 1;
    }
    let expected: HashSet<String> = (0..4000).map(|i| format!("evt-{i}")).collect();
    let got: HashSet<String> = times.keys().cloned().collect();
    let missing: Vec<_> = expected.difference(&got).collect();
    assert!(missing.is_empty(), "lost events: {missing:?}");
    // Every duplicate carries its original dedup id (by construction of the
    // count) and was sent but not marked when the relay died.
    let duplicates: HashSet<String> = times
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(k, _)| k)
        .collect();
    let unexplained: Vec<_> = duplicates.difference(&in_flight_at_kill).collect();
    assert!(
        unexplained.is_empty(),
        "duplicates not sent and unmarked at the kill: {unexplained:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_drain_exits_zero_within_the_grace_and_releases_leases() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_delay(Duration::from_millis(50));
    insert_events(&db, 4000, 200).await;
    let mut relay = start(&db, &sink, &["run"]);
    assert!(
        wait_until(Duration::from_secs(60), || async {
            sink.accepted().len() >= 300
        })
        .await
    );
    let asked = Instant::now();
    relay.signal(Signal::SIGTERM);
    // Grace is 5 s in the test config.
    let status = relay
        .exit_within(Duration::from_secs(10))
        .await
        .expect("exited");
    assert!(status.success(), "{status:?}");
    assert!(
        asked.elapsed() < Duration::from_secs(7),
        "took {:?}",
        asked.elapsed()
    );
    assert!(pending(&db).await > 0, "stopped mid-drain, not after it");
    assert!(live_leases(&db).await.is_empty(), "leases left behind");
    // What it took, it either marked published or gave back.
    let accepted: HashSet<String> = sink.accepted().into_iter().map(|r| r.dedup_id).collect();
    let published = count(
        &db,
        "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
    )
    .await;
    assert_eq!(published as usize, accepted.len());
}

/// A drain that dead-lettered an event emptied the backlog, but an event
/// will not arrive without a person: it exits 4 and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_dead_letters_exits_with_the_dead_letter_code() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_rule(|m| {
        if m.dedup_id == "evt-5" {
            outbox_testkit::sink::Reply::Status(422, None)
        } else {
            outbox_testkit::sink::Reply::Accept
        }
    });
    insert_events(&db, 300, 30).await;
    let mut relay = start(&db, &sink, &["drain", "--json"]);
    let status = relay
        .exit_within(Duration::from_secs(60))
        .await
        .expect("drain exits");
    let out = relay.read_stdout().await.unwrap();
    assert_eq!(status.code(), Some(4), "{status:?}: {out}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["counters"]["published"], 299);
    assert_eq!(report["counters"]["dead_lettered"], 1);
    assert_eq!(report["remaining"], 0);
    assert_eq!(report["status"], "dead_lettered", "{report}");
    assert_eq!(report["exit_code"], 4);
    assert!(
        report["reason"]
            .as_str()
            .is_some_and(|r| r.contains("dead-lettered")),
        "{report}"
    );
    assert_eq!(pending(&db).await, 0);
}

/// QStash refuses the relay's token (401): the route pauses, every event is
/// put back without spending an attempt, and the drain ends with nothing
/// delivered. It exits 5 naming the paused route, not 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_whose_qstash_token_is_refused_exits_with_the_paused_code() {
    let db = common::test_db().await;
    let sink = outbox_testkit::sink::Sink::start(outbox_testkit::sink::SinkConfig::for_tests(
        "another-token",
    ))
    .await
    .unwrap();
    insert_events(&db, 40, 8).await;
    let mut relay = start(&db, &sink, &["drain", "--json", "--max-duration", "30s"]);
    let status = relay
        .exit_within(Duration::from_secs(60))
        .await
        .expect("drain exits");
    let out = relay.read_stdout().await.unwrap();
    assert_eq!(status.code(), Some(5), "{status:?}: {out}");
    assert!(sink.stats().unauthorized > 0, "QStash was never asked");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["status"], "route_paused", "{report}");
    assert_eq!(report["exit_code"], 5);
    assert_eq!(report["counters"]["published"], 0);
    assert_eq!(report["remaining"], 40);
    let paused = report["paused_routes"].as_array().expect("paused_routes");
    assert_eq!(paused.len(), 1, "{report}");
    assert!(
        paused[0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("unauthorized")),
        "{report}"
    );
    assert!(
        report["reason"]
            .as_str()
            .is_some_and(|r| r.contains("paused")),
        "{report}"
    );
    // Nothing was lost or spent: every event is pending, no attempt counted.
    assert_eq!(pending(&db).await, 40);
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox WHERE attempt_count > 0").await,
        0
    );
}

/// `--max-duration` ends a drain whose destination keeps failing one event:
/// exit 3. Unless, by then, that event's requests were the route's only ones
/// for a while: five failing in a row with nothing accepted pause the route
/// (its breaker cannot tell a lone failing event from a failing route), the
/// drain stops once nothing else is due, and exits 5 naming the route. Which
/// comes first depends on how fast the machine sends the others; either way
/// the exit is non-zero, its report says why, and what is left is pending.
/// (`a_drain_whose_callbacks_go_elsewhere_reports_the_events_still_held`
/// checks exit 3 where nothing can pause.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_stopped_at_max_duration_exits_with_the_backlog_code() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    // One event always fails: it retries, never dead-letters within the
    // attempts 3 s allow (backoff_cap 100 ms, 5 attempts, 2 s backoff below).
    sink.set_rule(|m| {
        if m.dedup_id == "evt-3" {
            outbox_testkit::sink::Reply::Status(503, None)
        } else {
            outbox_testkit::sink::Reply::Accept
        }
    });
    insert_events(&db, 20, 4).await;
    let toml = common::config_toml_with(
        &db,
        &sink.url(),
        "[relay]\nmax_attempts = 1000\n",
        QSTASH_ROUTE,
    );
    let mut relay = common::spawn_relay(
        &["drain", "--json", "--max-duration", "3s"],
        &toml,
        Output::Captured,
    );
    let status = relay
        .exit_within(Duration::from_secs(60))
        .await
        .expect("drain exits");
    let out = relay.read_stdout().await.unwrap();
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    match status.code() {
        Some(3) => {
            assert_eq!(report["timed_out"], true, "{report}");
            assert_eq!(report["status"], "backlog_left", "{report}");
        }
        Some(5) => {
            assert_eq!(report["status"], "route_paused", "{report}");
            let paused = report["paused_routes"].as_array().unwrap();
            assert_eq!(paused.len(), 1, "{report}");
            assert!(
                paused[0]["error"].as_str().unwrap().contains("503"),
                "{report}"
            );
        }
        other => panic!("exit {other:?}, expected 3 or 5: {out}"),
    }
    // How many of the others went out in 3 s depends on the machine; the
    // failing one never does, and what is left is exactly what is pending.
    let left = pending(&db).await;
    assert!(left >= 1, "{report}");
    assert_eq!(report["remaining"], left, "{report}");
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE idempotency_key = 'evt-3' AND published_at IS NULL AND dead_lettered_at IS NULL",
        )
        .await,
        1,
        "{report}"
    );
}

/// Everything delivered: exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_runs_until_the_backlog_is_empty_and_reports() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    insert_events(&db, 300, 30).await;
    let mut relay = start(&db, &sink, &["drain", "--json"]);
    let status = relay
        .exit_within(Duration::from_secs(60))
        .await
        .expect("drain exits");
    let out = relay.read_stdout().await.unwrap();
    assert!(status.success(), "{status:?}: {out}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["counters"]["published"], 300);
    assert_eq!(report["remaining"], 0);
    assert_eq!(report["status"], "ok", "{report}");
    assert_eq!(report["exit_code"], 0);
    assert_eq!(pending(&db).await, 0);
}

/// README's "Use it with your database", as a new user follows it: the
/// shipped config, the well-known variables, an outbox filled with plain
/// INSERTs of the original table's columns. Every event must arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_steps_with_the_shipped_config_deliver_every_event() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let client = db.client().await.unwrap();
    client
        .batch_execute(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, headers, idempotency_key)
             SELECT gen_random_uuid(), 'order', 'o-' || (i % 50), 'order.placed',
                    jsonb_build_object('n', i), '{}'::jsonb, 'readme-' || i
             FROM generate_series(1, 500) AS i
             ON CONFLICT (idempotency_key) DO NOTHING",
        )
        .await
        .unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/config/relay.toml");
    let run = |args: &[&str]| {
        std::process::Command::new(common::BIN)
            .args(args)
            .env("DATABASE_URL", &db.url)
            .env("QSTASH_URL", sink.url())
            .env("QSTASH_TOKEN", format!("{TOKEN}\n")) // as read from a secret file
            .env(
                "OUTBOX_DESTINATION_URL",
                "https://api.example.com/events/{event_type}",
            )
            .env("OUTBOX_RELAY_SERVER__METRICS_BIND", "127.0.0.1:0")
            .env("OUTBOX_RELAY_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .unwrap()
    };
    assert!(run(&["migrate"]).wait().unwrap().success());
    let mut relay = run(&["run", "--config", config]);
    let delivered = wait_until(Duration::from_secs(60), || async {
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
        )
        .await
            == 500
    })
    .await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(relay.id() as i32),
        Signal::SIGTERM,
    )
    .unwrap();
    assert!(relay.wait().unwrap().success());
    assert!(
        delivered,
        "{} published, {} dead-lettered (e.g. {:?})",
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"
        )
        .await,
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL"
        )
        .await,
        db.client()
            .await
            .unwrap()
            .query_opt(
                "SELECT last_error FROM outbox WHERE dead_lettered_at IS NOT NULL LIMIT 1",
                &[]
            )
            .await
            .unwrap()
            .map(|r| r.get::<_, Option<String>>(0))
    );
    let destinations: HashSet<String> =
        sink.accepted().into_iter().map(|r| r.destination).collect();
    assert_eq!(
        destinations,
        HashSet::from(["https://api.example.com/events/order.placed".to_owned()])
    );
}

#[test]
fn run_without_a_route_stops_at_start_saying_how_to_add_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.toml");
    std::fs::write(
        &path,
        "[database]\nurl = \"postgres://postgres@127.0.0.1:1/x\"\n[qstash]\ntoken = \"t\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(common::BIN)
        .args(["run", "--config"])
        .arg(&path)
        .env("OUTBOX_RELAY_SERVER__METRICS_BIND", "127.0.0.1:0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("`routes`") && stderr.contains("[[routes]]"),
        "{stderr}"
    );
}

#[test]
fn config_is_one_flag_before_or_after_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relay.toml");
    std::fs::write(
        &path,
        "[database]\nurl = \"postgres://postgres@127.0.0.1:1/x\"\n[qstash]\ntoken = \"t\"\n\
         [[routes]]\nevent_type = \"*\"\ndestination = \"https://example.com/from-the-file\"\n",
    )
    .unwrap();
    let path = path.to_str().unwrap();
    for args in [
        ["check-config", "--config", path],
        ["--config", path, "check-config"],
    ] {
        let out = std::process::Command::new(common::BIN)
            .args(args)
            .env_remove("DATABASE_URL")
            .env_remove("QSTASH_URL")
            .env_remove("QSTASH_TOKEN")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {stderr}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("https://example.com/from-the-file"),
            "{args:?} did not read the file: {stdout}"
        );
    }
}
