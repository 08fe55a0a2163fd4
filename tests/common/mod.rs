//! Shared test support: a programmable QStash/webhook stand-in on a loopback
//! port, relay configs, and database helpers.
#![allow(dead_code)]

pub mod process;
pub mod sink;

use std::time::Duration;

use outbox_client::{enqueue_many, NewEvent};
use outbox_relay::config::Config;
use outbox_relay::testkit::TestDb;
use serde_json::json;
use uuid::Uuid;

pub const TOKEN: &str = "test-token";

/// A JWT (an `Upstash-Signature`) from the `jsonwebtoken` crate, not from our code.
pub fn jwt(key: &str, claims: &serde_json::Value, alg: jsonwebtoken::Algorithm) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(alg),
        claims,
        &jsonwebtoken::EncodingKey::from_secret(key.as_bytes()),
    )
    .unwrap()
}

/// A relay config for tests: short lease and poll so recovery paths run fast.
pub fn config(db: &TestDb, sink_url: &str, routes: &str) -> Config {
    Config::from_toml_str(&config_toml(db, sink_url, routes)).expect("test config")
}

/// The same config as TOML text, for the binary.
pub fn config_toml(db: &TestDb, sink_url: &str, routes: &str) -> String {
    format!(
        r#"
        [database]
        url = "{db}"
        pool_size = 12
        [relay]

        publishers = 3
        claim_batch = 200
        max_in_flight = 1000
        lease = "3s"
        poll_interval = "100ms"
        max_attempts = 5
        backoff_base = "20ms"
        backoff_cap = "100ms"
        mark_interval = "5ms"
        shutdown_grace = "5s"
        shard_lease = "2s"
        [qstash]
        url = "{sink}"
        token = "{TOKEN}"
        batch_size = 50
        [http]
        request_timeout = "1s"
        connect_timeout = "1s"
        [server]
        metrics_bind = "127.0.0.1:0"
        {routes}
        "#,
        db = db.url,
        sink = sink_url,
    )
}

pub const QSTASH_ROUTE: &str = r#"
[[routes]]
event_type = "*"
destination = "http://127.0.0.1:9/hook/{event_type}"
"#;

pub fn event(i: usize, key: &str) -> NewEvent {
    let (agg_type, agg_id) = key.split_once(':').unwrap_or(("order", key));
    NewEvent::new(
        Uuid::from_u128(7),
        agg_type,
        agg_id,
        "order.placed",
        json!({"n": i, "note": "an event payload of a realistic size, with some text in it"}),
        format!("evt-{i}"),
    )
}

/// Inserts `n` events spread over `keys` partition keys, in batches.
pub async fn insert_events(db: &TestDb, n: usize, keys: usize) {
    let mut client = db.client().await.unwrap();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let events: Vec<NewEvent> = chunk
            .iter()
            .map(|&i| event(i, &format!("order:k{}", i % keys)))
            .collect();
        let tx = client.transaction().await.unwrap();
        enqueue_many(&tx, &events).await.unwrap();
        tx.commit().await.unwrap();
    }
}

pub async fn count(db: &TestDb, sql: &str) -> i64 {
    db.client()
        .await
        .unwrap()
        .query_one(sql, &[])
        .await
        .unwrap()
        .get(0)
}

/// Polls `check` until it holds or `limit` passes (the condition is what the
/// test waits for; the limit only keeps a broken run from hanging).
pub async fn wait_until<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn pending(db: &TestDb) -> i64 {
    count(
        db,
        "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL",
    )
    .await
}
