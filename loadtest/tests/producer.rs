//! Producers against a real PostgreSQL (a fresh database per test).

use std::sync::Arc;
use std::time::Duration;

use loadtest::producer::{
    preload, produce, EventMix, LoadSpec, PreloadSpec, ProduceProgress, Skew,
};
use outbox_relay::store::migrate;
use outbox_testkit::TestDb;

async fn count(db: &TestDb, sql: &str) -> i64 {
    db.client()
        .await
        .unwrap()
        .query_one(sql, &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn paced_load_honours_the_rate() {
    let db = TestDb::with_setup(migrate::run).await.unwrap();
    let spec = LoadSpec {
        rate: Some(500.0),
        duration: Duration::from_secs(2),
        connections: 2,
        events_per_tx: 5,
        ..LoadSpec::default()
    };
    let stats = produce(&db.url, &spec, "rate", None, None).await.unwrap();
    // Transaction i is due at i·5/500 s; those due before 2 s run, even late.
    assert_eq!(stats.events, 1000);
    assert_eq!(stats.transactions, 200);
    assert_eq!(count(&db, "SELECT count(*) FROM outbox").await, 1000);
    // Never faster than asked (the last transaction is due at 1.99 s).
    assert!(stats.elapsed_secs >= 1.9, "{}", stats.elapsed_secs);
    assert!(
        stats.events_per_sec() <= 530.0,
        "{}",
        stats.events_per_sec()
    );
}

#[tokio::test]
async fn flat_out_load_stops_at_an_exact_count() {
    let db = TestDb::with_setup(migrate::run).await.unwrap();
    let progress = Arc::new(ProduceProgress::default());
    let spec = LoadSpec {
        rate: None,
        duration: Duration::from_secs(120),
        max_events: Some(1234),
        connections: 3,
        events_per_tx: 10,
        mix: EventMix {
            tenants: 3,
            partition_keys: 20,
            skew: Skew::Zipf(1.1),
            poison_fraction: 0.1,
            seed: 9,
        },
        ..LoadSpec::default()
    };
    let stats = produce(&db.url, &spec, "flat", Some(Arc::clone(&progress)), None)
        .await
        .unwrap();
    assert_eq!(stats.events, 1234);
    assert_eq!(
        progress.events.load(std::sync::atomic::Ordering::Relaxed),
        1234
    );
    assert_eq!(count(&db, "SELECT count(*) FROM outbox").await, 1234);
    assert_eq!(
        count(&db, "SELECT count(DISTINCT tenant_id) FROM outbox").await,
        3
    );
    assert!(count(&db, "SELECT count(DISTINCT partition_key) FROM outbox").await <= 20);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE payload @> '{\"poison\": true}'"
        )
        .await,
        stats.poison as i64
    );
    assert!(stats.poison > 50 && stats.poison < 250, "{}", stats.poison);
}

#[tokio::test]
async fn copy_preload_writes_exactly_the_count() {
    let db = TestDb::with_setup(migrate::run).await.unwrap();
    let spec = PreloadSpec {
        events: 20_001,
        connections: 2,
        mix: EventMix {
            poison_fraction: 0.01,
            ..EventMix::default()
        },
    };
    let stats = preload(&db.url, &spec, "pre", None).await.unwrap();
    assert_eq!(stats.events, 20_001);
    assert_eq!(count(&db, "SELECT count(*) FROM outbox").await, 20_001);
    assert_eq!(
        count(&db, "SELECT count(DISTINCT idempotency_key) FROM outbox").await,
        20_001
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE payload @> '{\"poison\": true}'"
        )
        .await,
        stats.poison as i64
    );
    // Rows look like the producer API's: partition key set, headers an object, deliverable now.
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE partition_key LIKE 'account:acct-%' AND headers = '{}'::jsonb AND available_at <= now() AND published_at IS NULL"
        )
        .await,
        20_001
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_ceiling_claims_and_marks_every_pending_row() {
    let db = TestDb::with_setup(migrate::run).await.unwrap();
    let spec = loadtest::producer::PreloadSpec {
        events: 3000,
        ..Default::default()
    };
    loadtest::producer::preload(&db.url, &spec, "ceiling", None)
        .await
        .unwrap();
    let ceiling = loadtest::ceiling::run(&db.url, 250).await.unwrap();
    assert_eq!(ceiling.rows, 3000);
    assert!(ceiling.rows_per_sec > 0.0);
    let client = db.client().await.unwrap();
    let published: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND locked_until IS NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(published, 3000);
}
