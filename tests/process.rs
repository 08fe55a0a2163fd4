//! The `outbox-relay` binary as a process: signals, crashes and one-shot drains.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::process::RelayProcess;
use common::sink::TestSink;
use common::{config_toml, count, insert_events, pending, wait_until, QSTASH_ROUTE, TOKEN};
use nix::sys::signal::Signal;
use outbox_relay::testkit::TestDb;

fn start(db: &TestDb, sink: &TestSink, args: &[&str]) -> RelayProcess {
    let stdout = std::process::Stdio::piped();
    RelayProcess::spawn(args, &config_toml(db, &sink.url(), QSTASH_ROUTE), stdout)
}

async fn live_leases(db: &TestDb) -> HashSet<String> {
    db.client()
        .await
        .unwrap()
        .query(
            "SELECT idempotency_key FROM outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL AND locked_until > now()",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_drain_then_restart_loses_nothing() {
    let db = TestDb::new().await.unwrap();
    let sink = TestSink::start(TOKEN).await;
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
    let in_flight_at_kill = live_leases(&db).await;
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
    // count) and was in flight when the relay died.
    let duplicates: HashSet<String> = times
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(k, _)| k)
        .collect();
    let unexplained: Vec<_> = duplicates.difference(&in_flight_at_kill).collect();
    assert!(
        unexplained.is_empty(),
        "duplicates not in flight at the kill: {unexplained:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_mid_drain_exits_zero_within_the_grace_and_releases_leases() {
    let db = TestDb::new().await.unwrap();
    let sink = TestSink::start(TOKEN).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_runs_until_the_backlog_is_empty_and_reports() {
    let db = TestDb::new().await.unwrap();
    let sink = TestSink::start(TOKEN).await;
    sink.set_rule(|m| {
        if m.dedup_id == "evt-5" {
            common::sink::Reply::Status(422, None)
        } else {
            common::sink::Reply::Accept
        }
    });
    insert_events(&db, 300, 30).await;
    let mut relay = start(&db, &sink, &["drain", "--json"]);
    let status = relay
        .exit_within(Duration::from_secs(60))
        .await
        .expect("drain exits");
    assert!(status.success());
    let mut out = String::new();
    std::io::Read::read_to_string(relay.child.stdout.as_mut().unwrap(), &mut out).unwrap();
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["counters"]["published"], 299);
    assert_eq!(report["counters"]["dead_lettered"], 1);
    assert_eq!(report["remaining"], 0);
    assert_eq!(pending(&db).await, 0);
}
