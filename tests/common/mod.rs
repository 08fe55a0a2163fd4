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

/// A destination that accepts every call, and the QStash stand-in in delivery
/// mode (delivering, retrying and calling back the way QStash does).
pub async fn delivering_qstash() -> (outbox_testkit::sink::DestinationHandle, SinkHandle) {
    use outbox_testkit::sink::{DeliveryConfig, Destination, DestinationConfig};
    let dest = Destination::start(DestinationConfig::default())
        .await
        .expect("the destination starts");
    let sink = Sink::start(SinkConfig {
        delivery: Some(DeliveryConfig::default()),
        ..SinkConfig::for_tests(TOKEN)
    })
    .await
    .expect("the sink starts");
    (dest, sink)
}

/// Each `(toml, key)`: the config is refused with an error naming `key`.
pub fn assert_config_errors_name(cases: &[(&str, &str)]) {
    for &(toml, key) in cases {
        let err = Config::from_toml_str(toml).expect_err(toml).to_string();
        assert!(
            err.contains(key),
            "error for {toml:?} should name `{key}`: {err}"
        );
    }
}

/// `outbox-relay ARGS` against `db` (its `DATABASE_URL`, no config file),
/// run to the end.
pub fn cli(db: &TestDb, args: &[&str]) -> std::process::Output {
    cli_url(&db.url, args)
}

/// `outbox-relay ARGS` with `DATABASE_URL` set to `url`, run to the end.
pub fn cli_url(url: &str, args: &[&str]) -> std::process::Output {
    std::process::Command::new(BIN)
        .args(args)
        .env("DATABASE_URL", url)
        .env_remove("OUTBOX_RELAY_LOG")
        .output()
        .expect("the relay binary runs")
}

/// The same, which must succeed (its stderr shown when it does not).
pub fn cli_ok(db: &TestDb, args: &[&str]) -> std::process::Output {
    let out = cli(db, args);
    assert!(
        out.status.success(),
        "`outbox-relay {}`: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    out
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

/// [`config_toml`] with `overrides` (TOML) laid over it key by key, routes
/// last.
pub fn config_toml_with(db: &TestDb, sink_url: &str, overrides: &str, routes: &str) -> String {
    fn lay(base: &mut toml::Table, over: toml::Table) {
        for (key, value) in over {
            match (base.get_mut(&key), value) {
                (Some(toml::Value::Table(b)), toml::Value::Table(o)) => lay(b, o),
                (_, value) => {
                    base.insert(key, value);
                }
            }
        }
    }
    let mut base: toml::Table = config_toml(db, sink_url, "")
        .parse()
        .expect("the test config is TOML");
    lay(
        &mut base,
        overrides.parse().expect("the overrides are TOML"),
    );
    format!("{base}\n{routes}")
}

pub const QSTASH_ROUTE: &str = r#"
[[routes]]
event_type = "*"
destination = "http://127.0.0.1:9/hook/{event_type}"
"#;

/// A QStash route for `event_type` keeping each partition key's order as far
/// as QStash (`partition_key_to_qstash`).
pub fn ordered_qstash_route(event_type: &str) -> String {
    format!(
        r#"
[[routes]]
event_type = "{event_type}"
destination = "http://127.0.0.1:9/hook/{{event_type}}"
ordering = "partition_key_to_qstash"
"#
    )
}

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

/// `n` events of `event_type` in one transaction, idempotency keys
/// `{prefix}-0…`, one partition key each (`order:{prefix}0…`).
pub async fn insert_typed(db: &TestDb, event_type: &str, prefix: &str, n: usize) {
    let mut client = db.client().await.unwrap();
    let events: Vec<NewEvent> = (0..n)
        .map(|i| {
            NewEvent::new(
                Uuid::from_u128(7),
                "order",
                format!("{prefix}{i}"),
                event_type,
                json!({"n": i}),
                format!("{prefix}-{i}"),
            )
        })
        .collect();
    let tx = client.transaction().await.unwrap();
    enqueue_many(&tx, &events).await.unwrap();
    tx.commit().await.unwrap();
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

/// The first column of every row `sql` returns, collected as the caller asks.
pub async fn column<T, C>(client: &tokio_postgres::Client, sql: &str) -> C
where
    T: for<'a> tokio_postgres::types::FromSql<'a>,
    C: FromIterator<T>,
{
    client
        .query(sql, &[])
        .await
        .expect("the query runs")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

pub async fn count(db: &TestDb, sql: &str) -> i64 {
    count_on(&db.client().await.unwrap(), sql).await
}

/// The single number `sql` returns, on `client`.
pub async fn count_on(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client
        .query_one(sql, &[])
        .await
        .expect("the query runs")
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

/// Is `series` (as written in PromQL) one of ours, allowing the histogram suffixes?
pub fn is_known_series(series: &str) -> bool {
    if outbox_relay::metrics::names::METRIC_NAMES.contains(&series) {
        return true;
    }
    ["_bucket", "_sum", "_count"].iter().any(|suffix| {
        series
            .strip_suffix(suffix)
            .is_some_and(|base| outbox_relay::metrics::names::HISTOGRAMS.contains(&base))
    })
}

/// Every `outbox_relay_…` identifier in a PromQL expression.
pub fn our_series(expr: &str) -> Vec<String> {
    const PREFIX: &str = "outbox_relay_";
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut found = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find(PREFIX) {
        let starts_word = rest[..at].chars().next_back().is_none_or(|c| !is_ident(c));
        let tail = &rest[at..];
        let end = tail.find(|c: char| !is_ident(c)).unwrap_or(tail.len());
        if starts_word {
            found.push(tail[..end].to_owned());
        }
        rest = &tail[end.max(1)..];
    }
    found
}

/// A relay config (one route) whose database is `DATABASE_URL`.
pub fn relay_config() -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        file.path(),
        "[database]\nconnect_timeout = \"2s\"\n[qstash]\ntoken = \"t\"\n[server]\nmetrics_bind = \"127.0.0.1:0\"\n\
         [[routes]]\nevent_type = \"*\"\ndestination = \"http://127.0.0.1:9/hook\"\n",
    )
    .unwrap();
    file
}

/// A loopback port nothing listens on (just freed).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub async fn dead_count(db: &TestDb) -> i64 {
    count(
        db,
        "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL",
    )
    .await
}

/// Runs the relay on `cfg` until nothing is pending, stops it, and fails the
/// test when delivery stopped before that (`limit`).
pub async fn run_until_drained(db: &TestDb, cfg: Config, limit: Duration) {
    let relay = outbox_relay::Relay::start(cfg).await.unwrap();
    let drained = wait_until(limit, || async { pending(db).await == 0 }).await;
    relay.shutdown().await;
    assert!(
        drained,
        "delivery stopped: {} rows still pending ({} dead-lettered)",
        pending(db).await,
        dead_count(db).await
    );
}

/// A webhook route taking every event type to the test sink's `/hook`
/// endpoint at `sink_url`, with `more` (TOML) added to the route.
pub fn webhook_route(sink_url: &str, more: &str) -> String {
    format!(
        r#"
[[routes]]
event_type = "*"
sink = "webhook"
destination = "{sink_url}/hook/{{event_type}}"
signing_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
{more}
"#
    )
}
