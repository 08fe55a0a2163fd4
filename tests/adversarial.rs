//! What a real destination or QStash can answer, against the real relay and a
//! real PostgreSQL: no answer may lose an event, publish one the sink did not
//! accept, spend attempts on an outage, or stop delivery for everyone.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{config, count, dead_count, insert_events, pending, wait_until, QSTASH_ROUTE};
use outbox_relay::config::{BatchSize, Config, PublishMode};
use outbox_relay::Relay;
use outbox_testkit::sink::{RawAnswer, Received, Reply, SinkHandle};
use outbox_testkit::TestDb;

const LIMIT: Duration = Duration::from_secs(60);

/// Runs the relay on `cfg` until nothing is pending (see
/// [`common::run_until_drained`]).
async fn run_until_drained(db: &TestDb, cfg: Config) {
    common::run_until_drained(db, cfg, LIMIT).await;
}

/// A 200 whose body is `elements` as a JSON array (a `/v2/batch` answer).
fn batch_answer(elements: &[serde_json::Value]) -> RawAnswer {
    RawAnswer::new(200, serde_json::to_vec(elements).unwrap())
}

fn n_of(r: &Received) -> u64 {
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
    v["payload"]["n"].as_u64().unwrap_or(u64::MAX)
}

/// Every published row's deduplication id was accepted by the sink at least once.
async fn assert_published_only_when_accepted(db: &TestDb, sink: &SinkHandle) {
    let accepted: std::collections::HashSet<String> =
        sink.accepted().into_iter().map(|r| r.dedup_id).collect();
    let client = db.client().await.unwrap();
    let published: Vec<String> = common::column(
        &client,
        "SELECT idempotency_key FROM outbox WHERE published_at IS NOT NULL",
    )
    .await;
    let unaccepted: Vec<String> = published
        .into_iter()
        .filter(|k| !accepted.contains(k))
        .collect();
    assert!(
        unaccepted.is_empty(),
        "{} rows marked published that the sink never accepted, e.g. {:?}",
        unaccepted.len(),
        &unaccepted[..unaccepted.len().min(5)]
    );
}

/// No row's `attempt_count` is above the number of requests that carried it.
async fn assert_attempts_are_requests(db: &TestDb, sink: &SinkHandle) {
    let mut seen: HashMap<String, i32> = HashMap::new();
    for r in sink.received() {
        *seen.entry(r.dedup_id).or_default() += 1;
    }
    let client = db.client().await.unwrap();
    for row in client
        .query("SELECT idempotency_key, attempt_count FROM outbox", &[])
        .await
        .unwrap()
    {
        let key: String = row.get(0);
        let attempts: i32 = row.get(1);
        let sent = seen.get(&key).copied().unwrap_or(0);
        assert!(
            attempts <= sent,
            "{key}: attempt_count {attempts} but the sink saw {sent} requests for it"
        );
    }
}

/// Bodies a broken or hostile destination sends with an error status.
fn hostile_body(i: u64) -> Vec<u8> {
    match i % 4 {
        // gzip magic, NUL bytes, invalid UTF-8
        0 => b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\xff\xfe\x00\x00 oops \xc3\x28".to_vec(),
        // control characters and an escape sequence
        1 => b"line1\r\nline2\x07\x1b[31mred\x1b[0m\x00".to_vec(),
        // megabytes
        2 => vec![0u8; 3 * 1024 * 1024],
        // a lone surrogate's bytes and a NUL in the middle of text
        _ => b"error: \xed\xa0\x80 and \x00 here".to_vec(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_bodies_of_any_bytes_never_stop_delivery() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    // Rows 0..4 always fail with a hostile body (they end dead-lettered with a
    // readable reason); every third row fails once with one, then goes through.
    sink.set_rule(|r| {
        let n = n_of(r);
        if n < 4 || (n.is_multiple_of(3) && r.attempt == 0) {
            Reply::Raw(RawAnswer::new(500, hostile_body(n)))
        } else {
            Reply::Accept
        }
    });
    insert_events(&db, 400, 40).await;
    let mut cfg = config(&db, &sink.url(), QSTASH_ROUTE);
    cfg.qstash.mode = PublishMode::Single;
    cfg.http.max_response_bytes = 4 * 1024 * 1024;
    run_until_drained(&db, cfg).await;
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"
        )
        .await,
        396
    );
    let client = db.client().await.unwrap();
    let dead: Vec<String> = common::column(
        &client,
        "SELECT last_error FROM outbox WHERE dead_lettered_at IS NOT NULL ORDER BY id",
    )
    .await;
    assert_eq!(dead.len(), 4);
    for error in dead {
        assert!(error.contains("HTTP 500"), "{error:?}");
        assert!(
            !error.chars().any(|c| c.is_control()),
            "control characters kept: {error:?}"
        );
        assert!(error.chars().count() <= 2100, "{} chars", error.len());
    }
    assert_published_only_when_accepted(&db, &sink).await;
}

/// A batch answer, per message, that a 2xx may carry.
fn garbled_answer(request: usize, msgs: &[Received]) -> (RawAnswer, Vec<bool>) {
    let n = msgs.len();
    let ok = |i: usize| serde_json::json!({"messageId": format!("msg_{request}_{i}")});
    match request % 6 {
        // Cut off in the middle.
        0 => (
            RawAnswer::new(200, br#"[{"messageId":"msg_1"},{"messag"#.to_vec()),
            vec![false; n],
        ),
        // One element short: which message is which cannot be told.
        1 => {
            let v: Vec<_> = (0..n - 1).map(ok).collect();
            (batch_answer(&v), vec![false; n])
        }
        // Elements that are not publish answers.
        2 => (
            RawAnswer::new(200, serde_json::to_vec(&vec![1; n]).unwrap()),
            vec![false; n],
        ),
        // Every other element an error, the rest accepted.
        3 => {
            let v: Vec<_> = (0..n)
                .map(|i| {
                    if i % 2 == 0 {
                        serde_json::json!({"error": "quota for this destination"})
                    } else {
                        ok(i)
                    }
                })
                .collect();
            let accepted = (0..n).map(|i| i % 2 == 1).collect();
            (batch_answer(&v), accepted)
        }
        // Not JSON at all.
        4 => (RawAnswer::new(200, b"\x00\xffOK".to_vec()), vec![false; n]),
        // Objects without a message id.
        _ => (
            RawAnswer::new(
                200,
                serde_json::to_vec(&vec![serde_json::json!({}); n]).unwrap(),
            ),
            vec![false; n],
        ),
    }
}

/// A fresh database and a sink whose `/v2/batch` answers `answer` makes,
/// told how many batch requests came before each; the count is returned too.
async fn with_batch_rule(
    answer: impl Fn(usize, &[Received]) -> Option<(RawAnswer, Vec<bool>)> + Send + Sync + 'static,
) -> (TestDb, SinkHandle, Arc<AtomicUsize>) {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let requests = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&requests);
    sink.set_batch_rule(move |msgs| answer(counter.fetch_add(1, Ordering::SeqCst), msgs));
    (db, sink, requests)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answer_that_cannot_be_read_publishes_nothing() {
    // The first 30 batch requests get garbled 2xx answers; then QStash behaves.
    let (db, sink, requests) =
        with_batch_rule(|i, msgs| (i < 30).then(|| garbled_answer(i, msgs))).await;
    insert_events(&db, 1_000, 50).await;
    // An unreadable answer costs each row it carried an attempt (the request
    // reached QStash). With more attempts than garbled answers no row can run
    // out of them, whichever rows the route's probes happen to carry, so a
    // dead letter here can only be a wrong one.
    let mut cfg = config(&db, &sink.url(), QSTASH_ROUTE);
    cfg.relay.max_attempts = 40;
    run_until_drained(&db, cfg).await;
    assert!(requests.load(Ordering::SeqCst) > 30);
    assert_published_only_when_accepted(&db, &sink).await;
    let dead: Vec<String> = common::column(
        &db.client().await.unwrap(),
        "SELECT id || ' attempt ' || attempt_count || ': ' || last_error FROM outbox
         WHERE dead_lettered_at IS NOT NULL ORDER BY id",
    )
    .await;
    assert!(dead.is_empty(), "{} dead letters: {dead:#?}", dead.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_batch_answer_is_read_whole() {
    // 400 messages a request, each answered with a long message id: about
    // 100 KiB, more than http.max_response_bytes. The first message of every
    // first-time request is refused with a per-element error.
    let (db, sink, _) = with_batch_rule(|round, msgs| {
        let v: Vec<_> = msgs
            .iter()
            .enumerate()
            .map(|(i, _)| {
                if i == 0 && round < 3 {
                    serde_json::json!({"error": "this one was refused"})
                } else {
                    serde_json::json!({"messageId": format!("msg_{}_{i}", "x".repeat(220))})
                }
            })
            .collect();
        let accepted = (0..msgs.len()).map(|i| i != 0 || round >= 3).collect();
        Some((batch_answer(&v), accepted))
    })
    .await;
    insert_events(&db, 2_000, 50).await;
    let mut cfg = config(&db, &sink.url(), QSTASH_ROUTE);
    cfg.qstash.batch_size = BatchSize::new(400).unwrap();
    cfg.relay.claim_batch = 400;
    run_until_drained(&db, cfg).await;
    assert_published_only_when_accepted(&db, &sink).await;
}

/// Runs 600 events through the QStash route against a sink that fails as
/// `outage` says for the first three seconds, with only 3 attempts allowed per
/// row; nothing may be dead-lettered and no attempt may be counted that was
/// not a request.
async fn survives_an_outage(
    outage: impl Fn(&Received) -> Reply + Send + Sync + 'static,
) -> (TestDb, SinkHandle) {
    let for_how_long = Duration::from_secs(3);
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let started = Instant::now();
    sink.set_rule(move |r| {
        if started.elapsed() < for_how_long {
            outage(r)
        } else {
            Reply::Accept
        }
    });
    insert_events(&db, 600, 60).await;
    let mut c = config(&db, &sink.url(), QSTASH_ROUTE);
    c.relay.max_attempts = 3;
    run_until_drained(&db, c).await;
    assert_eq!(
        dead_count(&db).await,
        0,
        "rows dead-lettered by an outage of the sink"
    );
    assert_attempts_are_requests(&db, &sink).await;
    assert_published_only_when_accepted(&db, &sink).await;
    (db, sink)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_pauses_the_route_instead_of_dead_lettering() {
    let (_db, sink) = survives_an_outage(|_| Reply::Status(401, None)).await;
    // Paused with backoff: not a hot loop of requests through the outage.
    let refused = sink.received().iter().filter(|r| !r.accepted).count();
    assert!(refused <= 600, "{refused} messages sent into a 401 outage");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qstash_down_pauses_the_route_instead_of_dead_lettering() {
    survives_an_outage(|_| Reply::Status(503, None)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_429_pauses_the_route_instead_of_dead_lettering() {
    survives_an_outage(|_| Reply::Status(429, None)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirecting_destination_pauses_the_route_instead_of_dead_lettering() {
    survives_an_outage(|_| {
        Reply::Raw(RawAnswer::new(301, b"moved".to_vec()).header("location", "https://elsewhere/"))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_refusing_connections_pauses_the_route() {
    let db = common::test_db().await;
    // A port nobody listens on until the destination "comes back".
    let addr: SocketAddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    insert_events(&db, 300, 30).await;
    let routes = format!(
        r#"
        [[routes]]
        event_type = "*"
        sink = "webhook"
        destination = "http://{addr}/hook/{{event_type}}"
        signing_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
        "#
    );
    let mut cfg = config(&db, "http://127.0.0.1:9", &routes);
    cfg.relay.max_attempts = 3;
    let relay = Relay::start(cfg).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await; // the outage itself
    assert_eq!(
        dead_count(&db).await,
        0,
        "dead-lettered while the destination was down"
    );
    let sink = common::start_sink_on(addr).await;
    let drained = wait_until(LIMIT, || async { pending(&db).await == 0 }).await;
    relay.shutdown().await;
    assert!(drained, "{} rows still pending", pending(&db).await);
    assert_eq!(dead_count(&db).await, 0);
    let accepted: std::collections::HashSet<String> =
        sink.accepted().into_iter().map(|r| r.dedup_id).collect();
    assert_eq!(accepted.len(), 300);
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// QStash's quota answers: the reset is a unix time in a header.
async fn honours_reset_header(header: &'static str) {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let reset_at = unix_now() + 3;
    let answered = Arc::new(AtomicUsize::new(0));
    let a = Arc::clone(&answered);
    sink.set_rule(move |_| {
        if a.fetch_add(1, Ordering::SeqCst) == 0 {
            Reply::Raw(
                RawAnswer::new(429, br#"{"error":"Exceeded daily rate limit"}"#.to_vec())
                    .header("ratelimit-limit", "500000")
                    .header(header, reset_at.to_string()),
            )
        } else {
            Reply::Accept
        }
    });
    insert_events(&db, 1, 1).await;
    let mut cfg = config(&db, &sink.url(), QSTASH_ROUTE);
    cfg.qstash.mode = PublishMode::Single;
    run_until_drained(&db, cfg).await;
    let received = sink.received();
    assert_eq!(received.len(), 2, "one refused, one accepted");
    let retried_at = SystemTime::now() - received[1].at.elapsed();
    let retried_unix = retried_at.duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
    assert!(
        retried_unix >= reset_at as f64 - 0.05,
        "retried at {retried_unix:.2}, before the {header} of {reset_at}"
    );
    assert_eq!(dead_count(&db).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ratelimit_reset_is_honoured() {
    honours_reset_header("ratelimit-reset").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_ratelimit_reset_is_honoured() {
    honours_reset_header("burst-ratelimit-reset").await;
}

fn row_with_headers(headers: &[(&str, &str)]) -> outbox_client::row::OutboxRow {
    outbox_client::row::OutboxRow {
        id: 42,
        tenant_id: uuid::Uuid::nil(),
        aggregate_type: "order".into(),
        aggregate_id: "o-1".into(),
        event_type: "order.placed".into(),
        payload: r#"{"a":1}"#.into(),
        headers: headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        idempotency_key: "evt-42".into(),
        partition_key: "order:o-1".into(),
        created_at: chrono::Utc::now(),
        attempt: 1,
    }
}

/// A config with a QStash token (then `qstash_more`, which may open further
/// tables) and one catch-all QStash route (then `route_more`).
fn one_qstash_route(qstash_more: &str, route_more: &str) -> Result<Config, String> {
    Config::from_toml_str(&format!(
        r#"
        [qstash]
        token = "t"
        {qstash_more}
        [[routes]]
        event_type = "*"
        destination = "https://api.example.com/e"
        {route_more}
        "#
    ))
    .map_err(|e| e.to_string())
}

const ORDERED_WITH_CALLBACK: &str = r#"ordering = "partition_key"
    callback = "https://relay.example.com/qstash/callback""#;

/// Every value of header `name` (lower case) in a QStash message's headers.
fn header_values<'a>(
    headers: &'a [(std::borrow::Cow<'static, str>, String)],
    name: &str,
) -> Vec<&'a str> {
    headers
        .iter()
        .filter(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .collect()
}

#[test]
fn a_row_cannot_override_deduplication_flow_control_or_callbacks() {
    let cfg = one_qstash_route(
        "",
        r#"ordering = "partition_key_to_qstash"
        failure_callback = "https://relay.example.com/qstash/failure""#,
    )
    .unwrap();
    let router = outbox_relay::routes::Router::new(&cfg.routes);
    let sink = outbox_relay::sink::qstash::QstashSink::new(&cfg.qstash, &cfg.http);
    let row = row_with_headers(&[
        ("Upstash-Deduplication-Id", "forged"),
        ("upstash-content-based-deduplication", "true"),
        ("Upstash-Flow-Control-Key", "everyone"),
        ("upstash-flow-control-value", "parallelism=100"),
        ("Upstash-Failure-Callback", "https://evil.example.com/"),
        ("Upstash-Callback", "https://evil.example.com/"),
        ("X-Outbox-Id", "999"),
        ("Content-Type", "application/cloudevents+json"),
        ("Upstash-Retries", "1"),
        ("schema-version", "2"),
    ]);
    let message = sink.message(&router.routes()[0], &row).unwrap();
    let get = |name: &str| header_values(&message.headers, name);
    assert_eq!(get("upstash-deduplication-id"), ["evt-42"]);
    assert!(get("upstash-content-based-deduplication").is_empty());
    assert_eq!(get("upstash-flow-control-key"), ["order:o-1"]);
    assert_eq!(get("upstash-flow-control-value"), ["parallelism=1"]);
    assert_eq!(
        get("upstash-failure-callback"),
        ["https://relay.example.com/qstash/failure"]
    );
    assert!(get("upstash-callback").is_empty());
    assert_eq!(get("upstash-forward-x-outbox-id"), ["42"]);
    // What a row may set: its content type (replacing ours), retries, its own headers.
    assert_eq!(get("content-type"), ["application/cloudevents+json"]);
    assert_eq!(get("upstash-retries"), ["1"]);
    assert_eq!(get("upstash-forward-schema-version"), ["2"]);

    // A route ordered at the destination sends its own callback, whatever the row says.
    let cfg = one_qstash_route(
        r#"current_signing_key = "sig_k"
        [server]
        callback_bind = "127.0.0.1:0""#,
        ORDERED_WITH_CALLBACK,
    )
    .unwrap();
    let router = outbox_relay::routes::Router::new(&cfg.routes);
    let message = sink.message(&router.routes()[0], &row).unwrap();
    assert_eq!(
        header_values(&message.headers, "upstash-callback"),
        ["https://relay.example.com/qstash/callback"]
    );
}

#[test]
fn a_route_taking_callbacks_needs_the_listener_they_come_to() {
    let e =
        one_qstash_route(r#"current_signing_key = "sig_k""#, ORDERED_WITH_CALLBACK).unwrap_err();
    assert!(e.contains("server.callback_bind"), "{e}");
    let e = one_qstash_route("", r#"ordering = "partition_key""#).unwrap_err();
    assert!(e.contains("routes[0].callback"), "{e}");
}

#[test]
fn a_webhook_row_header_replaces_and_never_forges() {
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let cfg = Config::from_toml_str(&format!(
        r#"
        [[routes]]
        event_type = "*"
        sink = "webhook"
        destination = "https://hooks.example.com/in"
        signing_secret = "{secret}"
        "#
    ))
    .unwrap();
    let router = outbox_relay::routes::Router::new(&cfg.routes);
    let key = outbox_client::signing::decode_secret(secret).unwrap();
    let row = row_with_headers(&[
        ("Content-Type", "application/cloudevents+json"),
        ("Host", "evil.example.com"),
        ("webhook-id", "forged"),
        ("Webhook-Signature", "v1,forged"),
        ("content-length", "1"),
        ("X-Event-Id", "1"),
        ("schema-version", "2"),
    ]);
    let request =
        outbox_relay::sink::webhook::request(&router.routes()[0], &row, &key, 1 << 20).unwrap();
    let h = request.headers();
    let all = |name: &str| -> Vec<String> {
        h.get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(all("content-type"), ["application/cloudevents+json"]);
    assert!(all("host").is_empty());
    assert!(all("content-length").is_empty());
    assert_eq!(all("webhook-id"), ["evt-42"]);
    assert_eq!(all("x-event-id"), ["42"]);
    assert_eq!(all("schema-version"), ["2"]);
    // The receiver's official verifier accepts what was sent.
    let wh = standardwebhooks::Webhook::new(secret).unwrap();
    let mut hm = http::HeaderMap::new();
    for name in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
        hm.insert(name, h.get(name).unwrap().clone());
    }
    assert_eq!(all("webhook-signature").len(), 1);
    let body_sent = outbox_relay::sink::body(&router.routes()[0], &row);
    wh.verify(&body_sent, &hm).expect("a valid signature");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_ends_when_only_rows_scheduled_for_later_remain() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    insert_events(&db, 50, 5).await;
    {
        let mut client = db.client().await.unwrap();
        let tx = client.transaction().await.unwrap();
        let mut later = common::event(1_000, "order:later");
        later.available_at = Some(chrono::Utc::now() + chrono::Duration::hours(1));
        outbox_client::enqueue(&tx, &later).await.unwrap();
        tx.commit().await.unwrap();
    }
    let started = Instant::now();
    let report = outbox_relay::drain(
        config(&db, &sink.url(), QSTASH_ROUTE),
        Some(Duration::from_secs(30)),
    )
    .await
    .unwrap();
    assert!(!report.timed_out, "waited for a row due in an hour");
    assert!(started.elapsed() < Duration::from_secs(25));
    assert_eq!(report.counters.published, 50);
    assert_eq!(report.remaining, 1);
    assert!(report.next_due.is_some());
    assert!(!report.gave_up);
    // Rows scheduled for later are not a failure: exit 0.
    assert_eq!(report.exit_code, 0, "{report:?}");
}
