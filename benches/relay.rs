//! Hot-path costs: building a QStash batch request, the envelope, signature
//! verification, backoff; and the whole claim → publish → mark cycle against
//! a local PostgreSQL and an in-process sink that accepts everything.

use std::time::Duration;

use chrono::Utc;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use outbox_client::consumer::qstash::{Clock, Verifier};
use outbox_client::row::OutboxRow;
use outbox_relay::backoff::Backoff;
use outbox_relay::config::Config;
use outbox_relay::routes::Router;
use outbox_relay::sink::qstash::QstashSink;
use rand::SeedableRng;
use uuid::Uuid;

fn row(i: i64) -> OutboxRow {
    OutboxRow {
        id: i,
        tenant_id: Uuid::from_u128(i as u128),
        aggregate_type: "order".into(),
        aggregate_id: format!("o-{i}"),
        event_type: "order.placed".into(),
        payload: r#"{"orderId":"o-1","customerId":"c-42","totalCents":12999,"currency":"USD","items":[{"sku":"sku-1","qty":2},{"sku":"sku-2","qty":1}],"note":"leave at the door"}"#.into(),
        headers: vec![("schema-version".into(), "1".into())],
        idempotency_key: format!("order.placed:o-{i}"),
        partition_key: format!("order:o-{i}"),
        created_at: Utc::now(),
        attempt: 1,
    }
}

fn config() -> Config {
    Config::from_toml_str(
        r#"
        [qstash]
        token = "t"
        [[routes]]
        event_type = "order.*"
        destination = "https://api.example.com/events/{event_type}"
        retries = 3
        "#,
    )
    .unwrap()
}

fn request_building(c: &mut Criterion) {
    let cfg = config();
    let router = Router::new(&cfg.routes);
    let route = router.route("order.placed").unwrap();
    let sink = QstashSink::new(&cfg.qstash, &cfg.http);
    let rows: Vec<OutboxRow> = (0..100).map(row).collect();
    let mut g = c.benchmark_group("qstash");
    g.throughput(Throughput::Elements(100));
    g.bench_function("batch_request_100_rows", |b| {
        b.iter(|| {
            let messages: Vec<_> = rows
                .iter()
                .map(|r| sink.message(route, r).unwrap())
                .collect();
            sink.batch_request(&messages)
        })
    });
    g.finish();
    c.bench_function("envelope", |b| {
        let r = row(1);
        b.iter(|| r.envelope())
    });
}

fn signature_verification(c: &mut Criterion) {
    // The test vector of docs/qstash-protocol.md, at a time it is valid.
    let token = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJpc3MiOiJVcHN0YXNoIiwic3ViIjoiaHR0cHM6Ly9leGFtcGxlLmNvbS9hcGkiLCJleHAiOjE3MDAwMDAzMDAsIm5iZiI6MCwiaWF0IjoxNzAwMDAwMDAwLCJqdGkiOiJqd3RfZml4ZWQiLCJib2R5IjoiazZJNWNha1U1ZXJMOEtqU1VWVE5vd25Ed2NjdnU1a1UxSHhnODh0b0ZZZz0ifQ.1IpfJFb5w3fvlKJNdf9nIy4R4eZ13xEuxpq51AJ7J64";
    let verifier = Verifier::new("sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r", None)
        .with_clock(Clock::fixed(1_700_000_100));
    c.bench_function("verify_qstash_signature", |b| {
        b.iter(|| {
            verifier
                .verify(Some(token), br#"{"hello":"world"}"#, None)
                .unwrap()
        })
    });
}

fn backoff(c: &mut Criterion) {
    let b = Backoff {
        base: Duration::from_secs(1),
        cap: Duration::from_secs(300),
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    c.bench_function("backoff_next", |bench| {
        bench.iter(|| b.next(5, Some(Duration::from_secs(2)), &mut rng))
    });
}

/// The whole engine: drain 5,000 rows through a local sink.
fn cycle(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let (db, sink_url) = rt.block_on(async {
        let db = outbox_testkit::TestDb::with_setup(outbox_relay::store::migrate::run)
            .await
            .expect("a PostgreSQL for the cycle bench");
        let app = axum::Router::new().route(
            "/v2/batch",
            axum::routing::post(|body: axum::body::Bytes| async move {
                let n = serde_json::from_slice::<Vec<serde_json::Value>>(&body)
                    .map(|v| v.len())
                    .unwrap_or(0);
                serde_json::to_string(&vec![serde_json::json!({"messageId": "msg"}); n]).unwrap()
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (db, url)
    });
    let mut cfg = config();
    cfg.database.url = db.url.clone();
    cfg.qstash.url = sink_url.parse().expect("the sink's URL");
    cfg.relay.poll_interval = Duration::from_millis(20);
    cfg.server.metrics_bind = None;
    let mut g = c.benchmark_group("engine");
    g.sample_size(10);
    g.throughput(Throughput::Elements(5000));
    g.bench_function("claim_publish_mark_5000", |b| {
        b.iter_batched(
            || {
                rt.block_on(async {
                    let mut client = db.client().await.unwrap();
                    let tx = client.transaction().await.unwrap();
                    let n = Uuid::new_v4();
                    let events: Vec<_> = (0..5000)
                        .map(|i| {
                            outbox_client::NewEvent::new(
                                Uuid::nil(),
                                "order",
                                format!("o-{}", i % 500),
                                "order.placed",
                                serde_json::json!({"i": i, "note": "a payload of a realistic size"}),
                                format!("{n}-{i}"),
                            )
                        })
                        .collect();
                    outbox_client::enqueue_many(&tx, &events).await.unwrap();
                    tx.commit().await.unwrap();
                })
            },
            |()| rt.block_on(outbox_relay::drain(cfg.clone(), Some(Duration::from_secs(60)))).unwrap(),
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(
    benches,
    request_building,
    signature_verification,
    backoff,
    cycle
);
criterion_main!(benches);
