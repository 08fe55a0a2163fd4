//! The relay as a whole: a crashed publisher restarted, a drain of a relay
//! that gave up, which start errors are worth another try.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use outbox_testkit::sink::{Sink, SinkConfig, SinkHandle};

use super::{Relay, RelayError};
use crate::actors::Hooks;
use crate::config::Config;
use crate::store::StoreError;
use crate::testing::{RelayTestDb, TestDb};

/// A fresh database holding `n` events over 50 keys, a sink, and a
/// relay config for them with short timings.
async fn setup(n: i32) -> (TestDb, SinkHandle, Config) {
    let db = TestDb::new().await.unwrap();
    let sink = Sink::start(SinkConfig::for_tests("test-token"))
        .await
        .unwrap();
    db.client()
        .await
        .unwrap()
        .execute(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key)
             SELECT gen_random_uuid(), 'order', 'k' || (i % 50), 'order.placed', '{}', 'evt-' || i
             FROM generate_series(0, $1 - 1) AS i",
            &[&n],
        )
        .await
        .unwrap();
    let config = Config::from_toml_str(&format!(
        r#"
        [database]
        url = "{}"
        [relay]
        poll_interval = "100ms"
        mark_interval = "5ms"
        shard_lease = "2s"
        lease = "3s"
        [http]
        request_timeout = "1s"
        [qstash]
        url = "{}"
        token = "test-token"
        [server]
        metrics_bind = "127.0.0.1:0"
        [[routes]]
        event_type = "*"
        destination = "http://127.0.0.1:9/hook/{{event_type}}"
        "#,
        db.url,
        sink.url()
    ))
    .unwrap();
    (db, sink, config)
}

async fn pending(db: &TestDb) -> i64 {
    db.client()
        .await
        .unwrap()
        .query_one(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// A publisher that panics on one row is restarted by the supervisor, the
/// row is read again (nothing holds it: a claim wrote nothing), and every
/// event arrives; the crashed attempt never reached the sink, so the row
/// records one attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_publisher_is_restarted_and_its_rows_come_back() {
    let (db, sink, config) = setup(500).await;
    let client = db.client().await.unwrap();
    let victim: i64 = client
        .query_one(
            "SELECT id FROM outbox WHERE idempotency_key = 'evt-77'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // Panic on the victim once.
    let panicked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hooks = Hooks {
        publisher_panics_on: Some(Arc::new(move |row| {
            row.id == victim && !panicked.swap(true, std::sync::atomic::Ordering::SeqCst)
        })),
    };
    let relay = Relay::start_with_hooks(config, hooks).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while pending(&db).await > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(pending(&db).await, 0, "the backlog did not drain");
    let restarts = relay.restarts().await;
    let report = relay.shutdown().await;
    assert_eq!(restarts.get("publisher"), Some(&1), "{restarts:?}");
    assert_eq!(report.counters.published, 500);
    let keys: HashSet<String> = sink.accepted().into_iter().map(|r| r.dedup_id).collect();
    assert_eq!(keys.len(), 500, "nothing lost");
    let attempts: i32 = client
        .query_one("SELECT attempt_count FROM outbox WHERE id = $1", &[&victim])
        .await
        .unwrap()
        .get(0);
    assert_eq!(attempts, 1, "the crashed attempt wrote nothing");
}

/// Publishers that crash on every row exhaust the restart budget: the
/// tree gives up and `drain` says so (the binary then exits 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_reports_a_relay_that_gave_up() {
    let (db, _sink, mut config) = setup(50).await;
    config.relay.max_restarts = 2;
    let hooks = Hooks {
        publisher_panics_on: Some(Arc::new(|_| true)),
    };
    let relay = Relay::start_with_hooks(config, hooks).await.unwrap();
    let report = relay
        .drain_started(
            Some(Duration::from_secs(60)),
            std::time::Instant::now(),
            &Default::default(),
        )
        .await
        .unwrap();
    assert!(report.gave_up, "{report:?}");
    assert_eq!(report.exit_code, 1, "{report:?}");
    assert!(!report.timed_out);
    assert_eq!(report.remaining, 50);
    assert_eq!(pending(&db).await, 50);
}

#[test]
fn only_an_unreachable_database_is_worth_another_try() {
    assert!(RelayError::Store(StoreError::PoolTimeout).is_transient());
    assert!(!RelayError::Config("relay.shards: …".into()).is_transient());
    assert!(!RelayError::Schema("no outbox schema".into()).is_transient());
    assert!(!RelayError::Store(StoreError::BadUrl("x".into())).is_transient());
}
