//! The relay engine against a real PostgreSQL and a real HTTP sink on loopback.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};

use std::time::Duration;

use common::{config, count, insert_events, pending, wait_until, QSTASH_ROUTE};
use outbox_client::{enqueue, NewEvent};
use outbox_relay::Relay;
use outbox_testkit::sink::Reply;
use outbox_testkit::TestDb;
use serde_json::json;
use uuid::Uuid;

const DRAIN_LIMIT: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drains_ten_thousand_events_across_a_hundred_keys() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    insert_events(&db, 10_000, 100).await;
    let relay = Relay::start(config(&db, &sink.url(), QSTASH_ROUTE))
        .await
        .unwrap();
    assert!(
        wait_until(DRAIN_LIMIT, || async { pending(&db).await == 0 }).await,
        "backlog did not drain"
    );
    let report = relay.shutdown().await;
    assert_eq!(report.counters.published, 10_000);
    let keys: HashSet<String> = sink.accepted().into_iter().map(|r| r.dedup_id).collect();
    let expected: HashSet<String> = (0..10_000).map(|i| format!("evt-{i}")).collect();
    assert_eq!(keys, expected, "the sink must see every idempotency key");
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND locked_until IS NULL AND last_error IS NULL").await,
        10_000
    );
    // The throughput path: batches, not one request per event.
    let requests = sink.requests();
    assert!(
        requests.iter().all(|r| r == "POST /v2/batch"),
        "{:?}",
        &requests[..3]
    );
    assert!(
        requests.len() <= 10_000 / 10,
        "{} requests for 10,000 events",
        requests.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qstash_headers_are_those_the_official_sdk_sends() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let routes = r#"
        [[routes]]
        event_type = "order.*"
        destination = "https://example.com/api/x?a=1"
        retries = 2
        delay = "10s"
        method = "PUT"
        failure_callback = "https://cb.example.com/fail"
        ordering = "partition_key_to_qstash"
    "#;
    let mut cfg = config(&db, &sink.url(), routes);
    cfg.qstash.mode = outbox_relay::config::PublishMode::Single;
    let mut client = db.client().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let created = enqueue(
        &tx,
        &NewEvent::new(
            Uuid::nil(),
            "order",
            "o1",
            "order.placed",
            json!({"hello": "world"}),
            "d1",
        )
        .with_header("X-Custom", "v")
        .with_header("Authorization", "Bearer dest")
        .with_header("Upstash-Foo", "bar")
        .with_partition_key("k1"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let outbox_client::Enqueued::New { id } = created else {
        panic!()
    };
    let relay = Relay::start(cfg).await.unwrap();
    assert!(wait_until(DRAIN_LIMIT, || async { pending(&db).await == 0 }).await);
    relay.shutdown().await;
    let got = sink.accepted();
    assert_eq!(got.len(), 1);
    let msg = &got[0];
    // QStash delivers to the destination with the publish request's query.
    assert_eq!(msg.destination, "https://example.com/api/x?a=1");
    assert_eq!(
        sink.requests(),
        vec!["POST /v2/publish/https://example.com/api/x".to_owned()]
    );
    // What the official JS SDK sends for the same options
    // (docs/qstash-protocol.md, "Headers the relay sends per message"): no
    // telemetry, no callback/label/redact/timeout/not-before, which routes do
    // not set; flow control as an ordered route asks for it.
    let id = id.to_string();
    let mut expected: BTreeMap<&str, &str> = BTreeMap::from([
        ("authorization", "Bearer test-token"),
        ("content-type", "application/json"),
        ("upstash-deduplication-id", "d1"),
        ("upstash-delay", "10s"),
        ("upstash-failure-callback", "https://cb.example.com/fail"),
        ("upstash-flow-control-key", "k1"),
        ("upstash-flow-control-value", "parallelism=1"),
        ("upstash-foo", "bar"),
        ("upstash-forward-authorization", "Bearer dest"),
        ("upstash-forward-x-custom", "v"),
        ("upstash-method", "PUT"),
        ("upstash-retries", "2"),
    ]);
    expected.insert("upstash-forward-x-outbox-id", &id);
    expected.insert("upstash-forward-x-event-id", &id);
    expected.insert("upstash-forward-x-outbox-idempotency-key", "d1");
    let upstash: BTreeMap<&str, &str> = msg
        .headers
        .iter()
        .filter(|(k, _)| k.starts_with("upstash-") || *k == "authorization" || *k == "content-type")
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(upstash, expected);
    let body: serde_json::Value = serde_json::from_str(&msg.body).unwrap();
    assert_eq!(body["id"], id);
    assert_eq!(body["type"], "order.placed");
    assert_eq!(body["aggregateType"], "order");
    assert_eq!(body["aggregateId"], "o1");
    assert_eq!(body["tenantId"], Uuid::nil().to_string());
    assert_eq!(body["partitionKey"], "k1");
    assert_eq!(body["payload"], json!({"hello": "world"}));
    assert!(body["createdAt"].as_str().unwrap().ends_with('Z'));
    assert!(!msg.body.contains(": "), "compact JSON: {}", msg.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_after_503_honouring_retry_after() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    // Two failures per message, the second asking for 1 s. Fewer events than
    // the circuit breaker wants to call it an outage (tests/adversarial.rs
    // and tests/deployments.rs have the outages), so each failure is an
    // attempt of its own.
    sink.set_rule(|m| match m.attempt {
        0 => Reply::Status(503, None),
        1 => Reply::Status(503, Some("1".into())),
        _ => Reply::Accept,
    });
    let n = outbox_relay::sink::breaker::FAILING_EVENTS - 1;
    insert_events(&db, n, n).await;
    let relay = Relay::start(config(&db, &sink.url(), QSTASH_ROUTE))
        .await
        .unwrap();
    assert!(wait_until(DRAIN_LIMIT, || async { pending(&db).await == 0 }).await);
    let report = relay.shutdown().await;
    assert_eq!(report.counters.published, n as u64);
    assert_eq!(report.counters.retried, 2 * n as u64);
    let c = db.client().await.unwrap();
    let rows = c
        .query(
            "SELECT attempt_count, published_at IS NOT NULL, last_error IS NULL FROM outbox",
            &[],
        )
        .await
        .unwrap();
    for r in &rows {
        assert_eq!(r.get::<_, i32>(0), 3, "two failures and a success");
        assert!(r.get::<_, bool>(1));
        assert!(r.get::<_, bool>(2), "a publish clears last_error");
    }
    // Retry-After: the third attempt came no sooner than 1 s after the second.
    let received = sink.received();
    for key in (0..n).map(|i| format!("evt-{i}")) {
        let times: Vec<_> = received
            .iter()
            .filter(|r| r.dedup_id == key)
            .map(|r| r.at)
            .collect();
        assert_eq!(times.len(), 3, "{key}");
        let gap = times[2].duration_since(times[1]);
        assert!(
            gap >= Duration::from_millis(990),
            "{key}: retried after {gap:?} despite Retry-After: 1"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backoff_sets_available_at_and_keeps_the_error() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_rule(|_| Reply::Status(500, None));
    insert_events(&db, 1, 1).await;
    let mut cfg = config(&db, &sink.url(), QSTASH_ROUTE);
    cfg.relay.backoff_base = Duration::from_secs(30);
    cfg.relay.backoff_cap = Duration::from_secs(30);
    let relay = Relay::start(cfg).await.unwrap();
    assert!(
        wait_until(DRAIN_LIMIT, || async {
            count(
                &db,
                "SELECT count(*) FROM outbox WHERE last_error IS NOT NULL",
            )
            .await
                == 1
        })
        .await
    );
    relay.shutdown().await;
    let c = db.client().await.unwrap();
    let row = c
        .query_one(
            "SELECT attempt_count, locked_until IS NULL, extract(epoch FROM available_at - now())::float8, last_error FROM outbox",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 1);
    assert!(
        row.get::<_, bool>(1),
        "the lease is given back with the retry"
    );
    let wait: f64 = row.get(2);
    assert!(
        (0.0..=30.0).contains(&wait),
        "available_at in [now, now+30s], got +{wait}s"
    );
    assert!(row.get::<_, String>(3).contains("HTTP 500"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_dead_letters_at_once_and_alone() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_rule(|m| {
        if m.dedup_id == "evt-3" {
            Reply::Status(400, None)
        } else {
            Reply::Accept
        }
    });
    insert_events(&db, 10, 10).await;
    let relay = Relay::start(config(&db, &sink.url(), QSTASH_ROUTE))
        .await
        .unwrap();
    assert!(wait_until(DRAIN_LIMIT, || async { pending(&db).await == 0 }).await);
    let report = relay.shutdown().await;
    assert_eq!(report.counters.published, 9);
    assert_eq!(report.counters.dead_lettered, 1);
    assert_eq!(report.counters.retried, 0);
    let c = db.client().await.unwrap();
    let row = c
        .query_one(
            "SELECT attempt_count, last_error FROM outbox WHERE dead_lettered_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        row.get::<_, i32>(0),
        1,
        "dead-lettered on the first attempt"
    );
    let error: String = row.get(1);
    assert!(
        error.contains("HTTP 400") && error.contains("status 400 from the test sink"),
        "{error}"
    );
    // The poison event took no innocent event of its batch with it.
    let accepted: HashSet<String> = sink.accepted().into_iter().map(|r| r.dedup_id).collect();
    assert_eq!(accepted.len(), 9);
    assert!(!accepted.contains("evt-3"));
}

/// Inserts one more event every 50 ms (numbered from 1000) until dropped:
/// a route that goes on accepting others, which a final verdict needs.
async fn keep_the_route_busy(db: &TestDb) -> tokio::task::JoinHandle<()> {
    let mut client = db.client().await.unwrap();
    tokio::spawn(async move {
        for i in 1000.. {
            let tx = client.transaction().await.unwrap();
            outbox_client::enqueue(&tx, &common::event(i, &format!("order:busy{i}")))
                .await
                .unwrap();
            tx.commit().await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausting_max_attempts_dead_letters() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    // Three events always fail while the route accepts others, so their
    // failures are theirs (tests/deployments.rs has a route failing them all).
    let failing = |dedup_id: &str| ["evt-0", "evt-1", "evt-2"].contains(&dedup_id);
    sink.set_rule(move |m| {
        if failing(&m.dedup_id) {
            Reply::Status(502, None)
        } else {
            Reply::Accept
        }
    });
    insert_events(&db, 3, 3).await;
    let busy = keep_the_route_busy(&db).await;
    let mut cfg = config(&db, &sink.url(), QSTASH_ROUTE);
    cfg.qstash.mode = outbox_relay::config::PublishMode::Single;
    let relay = Relay::start(cfg).await.unwrap();
    let dead = || async {
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL",
        )
        .await
    };
    assert!(wait_until(DRAIN_LIMIT, || async { dead().await == 3 }).await);
    busy.abort();
    let report = relay.shutdown().await;
    assert_eq!(report.counters.dead_lettered, 3);
    let c = db.client().await.unwrap();
    for r in c
        .query(
            "SELECT attempt_count, last_error FROM outbox WHERE dead_lettered_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
    {
        assert_eq!(r.get::<_, i32>(0), 5);
        let e: String = r.get(1);
        assert!(e.starts_with("attempt 5 of 5 failed: HTTP 502"), "{e}");
    }
    // Each failing event was sent at least five times (more when its last
    // attempt came before the route accepted another event after it).
    for key in ["evt-0", "evt-1", "evt-2"] {
        let sent = sink.received().iter().filter(|r| r.dedup_id == key).count();
        assert!(sent >= 5, "{key} sent {sent} times");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_no_route_takes_is_dead_lettered_with_the_reason() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let routes = r#"
        [[routes]]
        event_type = "user.*"
        destination = "https://example.com/users"
    "#;
    insert_events(&db, 2, 2).await; // order.placed
    let relay = Relay::start(config(&db, &sink.url(), routes))
        .await
        .unwrap();
    assert!(wait_until(DRAIN_LIMIT, || async { pending(&db).await == 0 }).await);
    relay.shutdown().await;
    let c = db.client().await.unwrap();
    for r in c
        .query(
            "SELECT last_error FROM outbox WHERE dead_lettered_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
    {
        assert_eq!(
            r.get::<_, String>(0),
            "no route matches event type `order.placed`"
        );
    }
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL"
        )
        .await,
        2
    );
    assert!(sink.received().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_keys_hold_back_behind_a_failing_event_and_others_flow() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let routes = r#"
        [[routes]]
        event_type = "order.*"
        destination = "https://example.com/orders"
        ordering = "partition_key_to_qstash"
    "#;
    // Key "slow" has events 0..5; its first fails twice. Keys k0..k9 have 5 each.
    let mut client = db.client().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let mut events = Vec::new();
    for round in 0..5 {
        events.push(common::event(1000 + round, "order:slow"));
        for k in 0..10 {
            events.push(common::event(round * 10 + k, &format!("order:k{k}")));
        }
    }
    outbox_client::enqueue_many(&tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    sink.set_rule(|m| {
        if m.dedup_id == "evt-1000" && m.attempt < 2 {
            // Retry-After makes the failing key slow for sure (full jitter alone
            // may pick a tiny delay).
            Reply::Status(503, Some("1".into()))
        } else {
            Reply::Accept
        }
    });
    let mut cfg = config(&db, &sink.url(), routes);
    cfg.relay.backoff_base = Duration::from_secs(1);
    cfg.relay.backoff_cap = Duration::from_secs(1);
    // Only the NOTIFY and the marker's wake-ups move the other keys along
    // quickly; the poll brings the failing key's retries back.
    cfg.relay.poll_interval = Duration::from_secs(1);
    // One answer per message, so a failure is that message's alone.
    cfg.qstash.mode = outbox_relay::config::PublishMode::Single;
    let relay = Relay::start(cfg).await.unwrap();
    assert!(wait_until(DRAIN_LIMIT, || async { pending(&db).await == 0 }).await);
    relay.shutdown().await;
    let received = sink.received();
    let accepted: Vec<_> = received.iter().filter(|r| r.accepted).collect();
    assert_eq!(accepted.len(), 55);
    // Per key: first receipts in id order, and never two of a key in flight.
    let mut by_key: HashMap<String, Vec<i64>> = HashMap::new();
    for r in &accepted {
        by_key
            .entry(r.partition_key())
            .or_default()
            .push(r.outbox_id.expect("an outbox id"));
    }
    for (key, ids) in &by_key {
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(ids, &sorted, "key {key} delivered out of order");
    }
    // Other keys were not held up: all of them finished before "slow" got its
    // first event through.
    let slow_first_ok = accepted
        .iter()
        .position(|r| r.dedup_id == "evt-1000")
        .unwrap();
    let others_done = accepted
        .iter()
        .rposition(|r| r.partition_key() != "order:slow")
        .unwrap();

    assert!(
        others_done < slow_first_ok,
        "other keys waited for the failing key"
    );
    // The held-back events of "slow" were never sent before the head succeeded.
    let first_slow_attempts: Vec<&str> = received
        .iter()
        .filter(|r| r.partition_key() == "order:slow")
        .map(|r| r.dedup_id.as_str())
        .take(3)
        .collect();
    assert_eq!(first_slow_attempts, vec!["evt-1000"; 3]);
    let flow: HashSet<_> = accepted
        .iter()
        .map(|r| {
            (
                r.headers["upstash-flow-control-key"].clone(),
                r.headers["upstash-flow-control-value"].clone(),
            )
        })
        .filter(|(k, _)| k == "order:slow")
        .collect();
    assert_eq!(
        flow,
        HashSet::from([("order:slow".to_owned(), "parallelism=1".to_owned())])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovers_when_its_database_connections_are_terminated() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let relay = Relay::start(config(&db, &sink.url(), QSTASH_ROUTE))
        .await
        .unwrap();
    insert_events(&db, 200, 20).await;
    assert!(wait_until(DRAIN_LIMIT, || async { pending(&db).await == 0 }).await);
    let admin = db.client().await.unwrap();
    let killed: i64 = admin
        .query_one(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()) t",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        killed >= 2,
        "expected the relay's connections (claimers, marker, listener), got {killed}"
    );
    let admin = db.client().await.unwrap();
    // Inserted after the kill: delivered only if claimers and marker reconnected.
    let mut client = db.client().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let events: Vec<_> = (5000..5200)
        .map(|i| common::event(i, &format!("order:k{}", i % 20)))
        .collect();
    outbox_client::enqueue_many(&tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    assert!(
        wait_until(DRAIN_LIMIT, || async { pending(&db).await == 0 }).await,
        "the relay did not recover"
    );
    // And the listener is back: a NOTIFY arrives on a fresh LISTEN connection.
    assert!(
        wait_until(Duration::from_secs(20), || async {
            admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'outbox-relay listener'",
                    &[],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 1
        })
        .await
    );
    let report = relay.shutdown().await;
    assert_eq!(report.counters.published, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_routes_post_signed_events_and_retry_themselves() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let routes = format!(
        r#"
        [[routes]]
        event_type = "*"
        sink = "webhook"
        destination = "{}/hook/{{aggregate_type}}/{{aggregate_id}}"
        signing_secret = "{secret}"
        "#,
        sink.url()
    );
    sink.set_rule(|m| {
        if m.attempt == 0 {
            Reply::Status(503, None)
        } else {
            Reply::Accept
        }
    });
    insert_events(&db, 5, 5).await;
    let relay = Relay::start(config(&db, &sink.url(), &routes))
        .await
        .unwrap();
    assert!(wait_until(DRAIN_LIMIT, || async { pending(&db).await == 0 }).await);
    let report = relay.shutdown().await;
    assert_eq!(report.counters.published, 5);
    assert_eq!(report.counters.retried, 5);
    let verifier = standardwebhooks::Webhook::new(secret).unwrap();
    for r in sink.accepted() {
        assert!(
            r.destination.starts_with("/hook/order/k"),
            "{}",
            r.destination
        );
        let mut headers = http::HeaderMap::new();
        for name in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
            headers.insert(name, r.headers[name].parse().unwrap());
        }
        verifier
            .verify(r.body.as_bytes(), &headers)
            .expect("the official Standard Webhooks library verifies our signature");
        assert_eq!(r.headers["webhook-id"], r.dedup_id);
        assert!(r.headers.contains_key("x-outbox-id"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_dead_letters_are_published_again_with_new_dedup_ids() {
    use outbox_relay::store::dead_letters::Selection;
    use outbox_relay::store::Store;
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    // The destination rejects five events at first. It takes the others,
    // which come once the five were refused: a witness that the refusals are
    // the events' own.
    let first_five: HashSet<String> = (0..5).map(|i| format!("evt-{i}")).collect();
    sink.set_rule(move |m| {
        if first_five.contains(&m.dedup_id) {
            Reply::Status(400, None)
        } else {
            Reply::Accept
        }
    });
    insert_events(&db, 5, 5).await;
    let relay = Relay::start(config(&db, &sink.url(), QSTASH_ROUTE))
        .await
        .unwrap();
    assert!(
        wait_until(DRAIN_LIMIT, || async {
            count(&db, "SELECT count(*) FROM outbox WHERE last_error IS NOT NULL OR dead_lettered_at IS NOT NULL").await == 5
        })
        .await
    );
    {
        let mut client = db.client().await.unwrap();
        let tx = client.transaction().await.unwrap();
        let more: Vec<_> = (5..10)
            .map(|i| common::event(i, &format!("order:k{i}")))
            .collect();
        outbox_client::enqueue_many(&tx, &more).await.unwrap();
        tx.commit().await.unwrap();
    }
    assert!(wait_until(DRAIN_LIMIT, || async { pending(&db).await == 0 }).await);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL"
        )
        .await,
        5
    );
    // Fixed now; the operator replays every dead letter while the relay runs.
    sink.set_rule(|_| Reply::Accept);
    let replayed = Store::for_command(&db.url)
        .unwrap()
        .replay_dead(&Selection {
            all: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(replayed.len(), 5);
    assert!(
        wait_until(DRAIN_LIMIT, || async {
            count(
                &db,
                "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
            )
            .await
                == 10
        })
        .await
    );
    relay.shutdown().await;
    let accepted: HashSet<String> = sink
        .accepted()
        .into_iter()
        .map(|r| r.dedup_id)
        .filter(|k| k.contains(":replay:"))
        .collect();
    let expected: HashSet<String> = (0..5).map(|i| format!("evt-{i}:replay:1")).collect();
    assert_eq!(
        accepted, expected,
        "replays carry a new, derived deduplication id"
    );
}

/// Every row's id, bucket and version (`xmin`): a rewrite changes the version.
async fn row_versions(client: &tokio_postgres::Client) -> Vec<(i64, i16, String)> {
    client
        .query("SELECT id, bucket, xmin::text FROM outbox ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shard_count_is_the_databases_and_reshard_changes_it() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    insert_events(&db, 300, 50).await;
    let mut cfg = config(&db, &sink.url(), QSTASH_ROUTE);
    cfg.relay.shards = Some(3);
    let err = Relay::start(cfg.clone())
        .await
        .err()
        .expect("a mismatch is refused");
    let text = err.to_string();
    assert!(
        text.contains("relay.shards") && text.contains("split into 8 shards"),
        "{text}"
    );
    let client = db.client().await.unwrap();
    let rows_before = row_versions(&client).await;
    let before = outbox_relay::store::Store::for_command(&db.url)
        .unwrap()
        .reshard(3)
        .await
        .unwrap();
    assert_eq!(before, 8);
    // No row was rewritten (same version of every row), and the three
    // shards' ranges cover the buckets without gap or overlap.
    let rows_after = row_versions(&client).await;
    assert_eq!(rows_after, rows_before);
    let ranges: Vec<(i16, i16, i16)> = client
        .query(
            "SELECT shard, bucket_lo, bucket_hi FROM outbox_relay_shard_leases ORDER BY shard",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(ranges, vec![(0, 0, 1365), (1, 1365, 2730), (2, 2730, 4096)]);
    insert_events_from(&db, 300, 100).await;
    let relay = Relay::start(cfg).await.unwrap();
    assert!(wait_until(DRAIN_LIMIT, || async { pending(&db).await == 0 }).await);
    assert_eq!(relay.shards_owned().len(), 3);
    assert_eq!(relay.shutdown().await.counters.published, 400);
}

async fn insert_events_from(db: &TestDb, start: usize, n: usize) {
    let mut client = db.client().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let events: Vec<_> = (start..start + n)
        .map(|i| common::event(i, &format!("order:k{}", i % 50)))
        .collect();
    outbox_client::enqueue_many(&tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    // New rows land in their fixed bucket whatever the shard count.
    assert_eq!(
        count(
            db,
            "SELECT count(*) FROM outbox WHERE bucket <> (hashtext(partition_key) & 2147483647) % 4096"
        )
        .await,
        0
    );
}

/// A drain whose progress query fails returns the error, and the relay it
/// ran is stopped with it: no actor or connection of it is left behind (the
/// library's caller goes on living).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_fails_stops_its_relay() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    // The sink is down: the rows stay due and the drain keeps polling.
    sink.set_rule(|_| Reply::Status(503, None));
    insert_events(&db, 20, 2).await;
    let drain = tokio::spawn(outbox_relay::drain(
        config(&db, &sink.url(), QSTASH_ROUTE),
        None,
    ));
    assert!(
        wait_until(Duration::from_secs(30), || async {
            !sink.received().is_empty()
        })
        .await,
        "the drain never sent"
    );
    let client = db.client().await.unwrap();
    client
        .batch_execute("ALTER TABLE outbox RENAME TO outbox_elsewhere")
        .await
        .unwrap();
    let result = tokio::time::timeout(Duration::from_secs(60), drain)
        .await
        .expect("the drain returns")
        .unwrap();
    assert!(result.is_err(), "{result:?}");
    assert_no_relay_connection_stays(&client).await;
}

/// Within a few seconds, no connection of a relay (pool or listener) is open
/// on the test database any more.
async fn assert_no_relay_connection_stays(client: &tokio_postgres::Client) {
    let relay_backends = || async {
        common::count_on(
            client,
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND application_name LIKE 'outbox-relay%'",
        )
        .await
    };
    assert!(
        wait_until(Duration::from_secs(20), || async {
            relay_backends().await == 0
        })
        .await,
        "{} connections of the stopped relay are still open",
        relay_backends().await
    );
}

/// A relay shut down (here at the end of a drain) closes its pool and its
/// listener's connection: an application embedding it keeps none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_shut_down_leaves_no_connection_open() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    insert_events(&db, 20, 2).await;
    let report = outbox_relay::drain(config(&db, &sink.url(), QSTASH_ROUTE), None)
        .await
        .unwrap();
    assert_eq!(report.counters.published, 20);
    assert_no_relay_connection_stays(&db.client().await.unwrap()).await;
}

/// An idle relay's listener backs off to `relay.idle_probe_max`: the database
/// sees a few transactions a second from it, not a hundred. A row inserted
/// then still arrives without waiting for the claimers' poll (two minutes
/// here): the backed-off listener sees it within its ceiling and wakes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_listener_backs_off_and_still_wakes_the_claimers_for_a_new_row() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let mut cfg = config(&db, &sink.url(), QSTASH_ROUTE);
    cfg.relay.idle_probe_max = Duration::from_secs(2);
    cfg.relay.poll_interval = Duration::from_secs(120);
    // Coordinator rounds every 5 s.
    cfg.relay.shard_lease = Duration::from_secs(20);
    let relay = Relay::start(cfg).await.unwrap();
    let admin = db.client().await.unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || async {
            relay.shards_owned().len() == 8
        })
        .await
    );
    // At the ceiling after 1 + 2 + 4 + … + 1024 ms. PostgreSQL counts an
    // idle backend's transactions when it reports them, up to 10 s late: a
    // window that starts sooner counts the start-up's claims and rounds too
    // (76 in one run beside the rest of the suite; 17 alone, from 12 s on).
    tokio::time::sleep(Duration::from_secs(12)).await;
    let xacts = || async {
        admin
            .query_one(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let before = xacts().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let idle = xacts().await - before;
    eprintln!("{idle} transactions in 5 s of idling");
    // About 3 probes, 1 coordinator round and our own reads; probing every
    // 10 ms (the fixed ceiling before) made about 450.
    assert!(idle < 60, "{idle} transactions in 5 s of idling");

    insert_events(&db, 1, 1).await;
    let inserted = std::time::Instant::now();
    assert!(
        wait_until(Duration::from_secs(30), || async {
            !sink.accepted().is_empty()
        })
        .await,
        "the row was not delivered within 30 s (the poll is 120 s away)"
    );
    eprintln!(
        "first row after the idle spell delivered in {:?}",
        inserted.elapsed()
    );
    let report = relay.shutdown().await;
    assert_eq!(report.counters.published, 1);
}
