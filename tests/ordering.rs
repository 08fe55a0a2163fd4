//! Per-key order under the conditions that used to break it: a handover while
//! requests are still open, and fairness between ordered and unordered types.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{config, count, pending, wait_until};
use outbox_client::{enqueue_many, NewEvent};
use outbox_relay::config::PublishMode;
use outbox_relay::Relay;
use outbox_testkit::TestDb;
use serde_json::json;
use uuid::Uuid;

const ORDERED: &str = r#"
[[routes]]
event_type = "order.*"
destination = "http://127.0.0.1:9/ordered/{event_type}"
ordering = "partition_key"
"#;

async fn insert(db: &TestDb, events: Vec<NewEvent>) {
    let mut client = db.client().await.unwrap();
    for chunk in events.chunks(1000) {
        let tx = client.transaction().await.unwrap();
        enqueue_many(&tx, chunk).await.unwrap();
        tx.commit().await.unwrap();
    }
}

fn ordered_event(i: usize, key: usize) -> NewEvent {
    NewEvent::new(
        Uuid::from_u128(1),
        "order",
        format!("k{key}"),
        "order.placed",
        json!({"n": i}),
        format!("evt-{i}"),
    )
}

/// A second replica joins while the first one's requests take 8 s each: the
/// shards it takes over must not see a key's next request (or a second copy
/// of the same one) before the first replica's request for that key ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handover_waits_until_no_request_of_the_shard_is_open() {
    const DELAY: Duration = Duration::from_secs(8);
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_delay(DELAY);
    let keys = 16;
    insert(
        &db,
        (0..keys * 2).map(|i| ordered_event(i, i % keys)).collect(),
    )
    .await;
    let replica = |name: &str| {
        let mut cfg = config(&db, &sink.url(), ORDERED);
        cfg.qstash.mode = PublishMode::Single;
        cfg.http.request_timeout = Duration::from_secs(10);
        cfg.relay.lease = Duration::from_secs(12);
        cfg.relay.replica_id = name.to_owned();
        cfg
    };
    let a = Relay::start(replica("a")).await.unwrap();
    // Every key's first event is on its way to the sink from replica a.
    assert!(
        wait_until(Duration::from_secs(60), || async {
            sink.requests().len() >= keys
        })
        .await
    );
    let b = Relay::start(replica("b")).await.unwrap();
    let drained = wait_until(Duration::from_secs(90), || async {
        pending(&db).await == 0
    })
    .await;
    assert!(
        !b.shards_owned().is_empty(),
        "b took no shard: nothing was handed over"
    );
    b.shutdown().await;
    a.shutdown().await;
    assert!(drained, "{} pending", pending(&db).await);
    // Each answer came DELAY after its request arrived: a key's requests
    // overlap when two answers are less than DELAY apart.
    let mut by_key: BTreeMap<String, Vec<Instant>> = BTreeMap::new();
    for r in sink.received() {
        by_key.entry(r.partition_key()).or_default().push(r.at);
    }
    let slack = Duration::from_millis(300);
    for (key, mut times) in by_key {
        times.sort();
        for pair in times.windows(2) {
            let gap = pair[1] - pair[0];
            assert!(
                gap + slack >= DELAY,
                "key {key}: two requests overlapped ({gap:?} between their answers)"
            );
        }
    }
}

/// A big ordered backlog across many keys, and unordered events behind it in
/// the same shards: both kinds drain together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_backlog_does_not_starve_unordered_types() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let ordered = 4_000;
    let unordered = 400;
    insert(
        &db,
        (0..ordered).map(|i| ordered_event(i, i % 2_000)).collect(),
    )
    .await;
    insert(
        &db,
        (0..unordered)
            .map(|i| {
                NewEvent::new(
                    Uuid::from_u128(1),
                    "audit",
                    format!("a{i}"),
                    "audit.logged",
                    json!({"n": i}),
                    format!("audit-{i}"),
                )
            })
            .collect(),
    )
    .await;
    let routes = format!(
        "{ORDERED}\n[[routes]]\nevent_type = \"*\"\ndestination = \"http://127.0.0.1:9/any\"\n"
    );
    let mut cfg = config(&db, &sink.url(), &routes);
    cfg.relay.claim_batch = 100;
    let relay = Relay::start(cfg).await.unwrap();
    let unordered_pending = || async {
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE event_type = 'audit.logged' AND published_at IS NULL",
        )
        .await
    };
    assert!(
        wait_until(Duration::from_secs(90), || async {
            unordered_pending().await == 0
        })
        .await
    );
    let ordered_left = count(
        &db,
        "SELECT count(*) FROM outbox WHERE event_type = 'order.placed' AND published_at IS NULL",
    )
    .await;
    let drained = wait_until(Duration::from_secs(90), || async {
        pending(&db).await == 0
    })
    .await;
    relay.shutdown().await;
    assert!(drained);
    assert!(
        ordered_left >= ordered as i64 / 4,
        "the unordered events waited for the ordered backlog: only {ordered_left} ordered rows were left when the last unordered one went out"
    );
}
