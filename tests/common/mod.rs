//! Shared test support: the test kit's fresh databases with the relay's
//! schema, its QStash/webhook stand-in on a loopback port, the relay binary
//! as a child process, relay configs, and database helpers.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use outbox_client::{enqueue_many, NewEvent};
use outbox_relay::config::Config;
use outbox_relay::store::{self, migrate, Pool};
use outbox_testkit::relay::{Output, RelayCommand, RelayProcess, RelayProgram};
use outbox_testkit::sink::{Sink, SinkConfig, SinkHandle};
use outbox_testkit::TestDb;
use serde_json::json;
use uuid::Uuid;

pub const TOKEN: &str = "test-token";

/// The `outbox-relay` binary cargo built for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// A fresh database with the relay's schema.
pub async fn test_db() -> TestDb {
    TestDb::with_setup(migrate::run)
        .await
        .expect("a fresh database with the relay's schema")
}

/// The relay's pool of `size` connections to `db`.
pub fn pool(db: &TestDb, size: u32) -> Pool {
    store::pool(&db.url, size, Duration::from_secs(5)).expect("a pool")
}

/// The QStash stand-in on a free loopback port, taking [`TOKEN`] and keeping
/// every message it judged.
pub async fn start_sink() -> SinkHandle {
    start_sink_on(SocketAddr::from(([127, 0, 0, 1], 0))).await
}

/// The same on `addr` (a destination that comes back after being down).
pub async fn start_sink_on(addr: SocketAddr) -> SinkHandle {
    Sink::start(SinkConfig {
        bind: addr,
        ..SinkConfig::for_tests(TOKEN)
    })
    .await
    .expect("the sink starts")
}

/// `outbox-relay <subcommand…> --config <a file holding config_toml>`,
/// logging warnings to the test's stderr.
pub fn spawn_relay(subcommand: &[&str], config_toml: &str, stdout: Output) -> RelayProcess {
    RelayCommand::with_config_text(&RelayProgram::binary(BIN), config_toml)
        .expect("a config file")
        .env("OUTBOX_RELAY_LOG", "warn")
        .output(stdout, Output::Inherit)
        .spawn_with(subcommand)
        .expect("the relay starts")
}

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
