//! The QStash stand-in over real HTTP on loopback.

mod common;

use std::time::Duration;

use common::{bearer, post, Answer, Receiver};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use outbox_testkit::sink::signing::{body_hash, SignatureClaims};
use outbox_testkit::sink::{
    AdversarialConfig, AnswerEvent, AnswerKind, DeliveryConfig, FaultConfig, OutageKind,
    OutageSpec, RawAnswer, Reply, Sink, SinkConfig, SinkHandle, DEV_CURRENT_SIGNING_KEY, DEV_TOKEN,
};
use serde_json::json;

/// Generous: only a hung request ever waits this long.
const T: Duration = Duration::from_secs(10);
const DEST: &str = "http://127.0.0.1:9/hook";

async fn sink(faults: FaultConfig) -> SinkHandle {
    Sink::start(SinkConfig {
        faults,
        ..SinkConfig::default()
    })
    .await
    .unwrap()
}

fn envelope(id: i64, key: &str) -> String {
    json!({
        "id": id, "type": "order.placed", "partitionKey": key,
        "createdAt": "2024-01-02T03:04:05.678901Z", "payload": {"orderId": id}
    })
    .to_string()
}

async fn publish(s: &SinkHandle, id: i64, dedup: &str) -> Answer {
    let auth = bearer(DEV_TOKEN);
    let id_s = id.to_string();
    post(
        s.addr(),
        &format!("/v2/publish/{DEST}"),
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
            ("upstash-deduplication-id", dedup),
            ("upstash-forward-x-outbox-id", &id_s),
            ("upstash-flow-control-key", "pk-1"),
            ("upstash-flow-control-value", "parallelism=1"),
        ],
        envelope(id, "pk-1"),
        T,
    )
    .await
}

#[tokio::test]
async fn publish_answers_like_qstash_and_records_the_message() {
    let s = sink(FaultConfig::default()).await;
    let auth = bearer(DEV_TOKEN);
    let a = post(
        s.addr(),
        "/v2/publish/http://127.0.0.1:9/hook?a=1&b=%20z&upstash-retries=3",
        &[
            ("authorization", &auth),
            ("upstash-deduplication-id", "key-7"),
            ("upstash-forward-x-outbox-id", "7"),
            ("upstash-flow-control-key", "tenant:order-7"),
        ],
        envelope(7, "ignored-when-header-present"),
        T,
    )
    .await;
    assert_eq!(a.status(), 200);
    let msg_id = a.body()["messageId"].as_str().unwrap().to_owned();
    assert!(msg_id.starts_with("msg_"), "{msg_id}");
    assert_eq!(a.body()["url"], "http://127.0.0.1:9/hook?a=1&b=%20z");
    assert_eq!(a.body()["deduplicated"], false);

    let records = s.records();
    assert_eq!(records.len(), 1);
    let r = &records[0];
    assert_eq!(r.message_id, msg_id);
    assert_eq!(r.dedup_id.as_deref(), Some("key-7"));
    assert_eq!(r.outbox_id, Some(7));
    assert_eq!(r.partition_key.as_deref(), Some("tenant:order-7"));
    assert_eq!(r.destination, "http://127.0.0.1:9/hook?a=1&b=%20z");
    assert!(!r.deduplicated && !r.via_batch);
    let created = chrono::DateTime::parse_from_rfc3339("2024-01-02T03:04:05.678901Z").unwrap();
    assert_eq!(r.created_at_us, Some(created.timestamp_micros()));
    let now = chrono::Utc::now().timestamp_micros();
    assert!(r.received_at_us <= now && r.received_at_us > now - 60_000_000);
    s.stop().await;
}

#[tokio::test]
async fn a_repeated_deduplication_id_is_answered_202_with_the_first_id() {
    let s = sink(FaultConfig::default()).await;
    let first = publish(&s, 1, "dup-1").await;
    let second = publish(&s, 1, "dup-1").await;
    let other = publish(&s, 2, "dup-2").await;
    assert_eq!(first.status(), 200);
    assert_eq!(second.status(), 202);
    assert_eq!(second.body()["deduplicated"], true);
    assert_eq!(second.body()["messageId"], first.body()["messageId"]);
    assert_eq!(other.status(), 200);
    assert_ne!(other.body()["messageId"], first.body()["messageId"]);
    let records = s.records();
    assert_eq!(records.len(), 3);
    assert!(records[1].deduplicated && !records[0].deduplicated);
    assert_eq!(s.stats().deduplicated, 1);
    s.stop().await;

    // Outside the window the same id is a fresh message.
    let s = Sink::start(SinkConfig {
        dedup_window: Duration::ZERO,
        ..SinkConfig::default()
    })
    .await
    .unwrap();
    assert_eq!(publish(&s, 1, "dup-1").await.status(), 200);
    assert_eq!(publish(&s, 1, "dup-1").await.status(), 200);
    s.stop().await;
}

#[tokio::test]
async fn content_based_deduplication() {
    let s = sink(FaultConfig::default()).await;
    let auth = bearer(DEV_TOKEN);
    let send = |body: &'static str| {
        let auth = auth.clone();
        let addr = s.addr();
        async move {
            post(
                addr,
                &format!("/v2/publish/{DEST}"),
                &[
                    ("authorization", &auth),
                    ("upstash-content-based-deduplication", "true"),
                ],
                body,
                T,
            )
            .await
        }
    };
    assert_eq!(send(r#"{"a":1}"#).await.status(), 200);
    assert_eq!(send(r#"{"a":1}"#).await.status(), 202);
    assert_eq!(send(r#"{"a":2}"#).await.status(), 200);
    s.stop().await;
}

#[tokio::test]
async fn batch_answers_per_element_and_a_poison_element_fails_alone() {
    let s = sink(FaultConfig {
        poison_rejects_batch: false,
        ..FaultConfig::default()
    })
    .await;
    let auth = bearer(DEV_TOKEN);
    let batch = json!([
        {"destination": DEST, "headers": {"upstash-deduplication-id": "b-1", "upstash-forward-x-outbox-id": "11", "content-type": "application/json"}, "body": envelope(11, "k-a")},
        {"destination": DEST, "headers": {"upstash-deduplication-id": "b-2", "upstash-forward-x-outbox-id": "12"}, "body": json!({"id": 12, "payload": {"poison": true}}).to_string()},
        {"destination": DEST, "headers": {"Upstash-Deduplication-Id": "b-3"}, "body": envelope(13, "k-b"), "queue": "q1"},
        {"destination": DEST, "headers": {"upstash-deduplication-id": "b-1", "upstash-forward-x-outbox-id": "11"}, "body": envelope(11, "k-a")}
    ]);
    let a = post(
        s.addr(),
        "/v2/batch",
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        batch.to_string(),
        T,
    )
    .await;
    assert_eq!(a.status(), 200);
    let el = a.body().as_array().unwrap();
    assert_eq!(el.len(), 4);
    assert!(el[0]["messageId"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(el[0]["url"], DEST);
    assert_eq!(el[1]["status"], 400);
    assert!(el[1]["error"].as_str().unwrap().contains("poison event 12"));
    assert_eq!(el[2]["deduplicated"], false);
    assert_eq!(el[3]["deduplicated"], true);
    assert_eq!(el[3]["messageId"], el[0]["messageId"]);

    let records = s.records();
    assert_eq!(records.len(), 3);
    assert!(records.iter().all(|r| r.via_batch));
    assert_eq!(records[0].partition_key.as_deref(), Some("k-a"));
    assert_eq!(records[1].outbox_id, Some(13), "body id when no header");
    assert_eq!(
        records[1].dedup_id.as_deref(),
        Some("b-3"),
        "header names are case-insensitive"
    );
    assert_eq!(s.stats().poison_rejected, 1);

    let bad = post(
        s.addr(),
        "/v2/batch",
        &[("authorization", &auth)],
        "{\"not\":\"an array\"}",
        T,
    )
    .await;
    assert_eq!(bad.status(), 400);
    s.stop().await;
}

#[tokio::test]
async fn requests_without_the_token_get_401() {
    let s = sink(FaultConfig::default()).await;
    let path = format!("/v2/publish/{DEST}");
    let none = post(s.addr(), &path, &[], "{}", T).await;
    assert_eq!(none.status(), 401);
    assert!(none.body()["error"].is_string());
    let wrong = post(
        s.addr(),
        &path,
        &[("authorization", "Bearer nope")],
        "{}",
        T,
    )
    .await;
    assert_eq!(wrong.status(), 401);
    let batch = post(s.addr(), "/v2/batch", &[], "[]", T).await;
    assert_eq!(batch.status(), 401);
    let query = post(
        s.addr(),
        &format!("{path}?qstash_token={}", DEV_TOKEN.replace('=', "%3D")),
        &[],
        "{}",
        T,
    )
    .await;
    assert_eq!(query.status(), 200);
    assert_eq!(
        query.body()["url"],
        DEST,
        "qstash_token is not part of the destination"
    );
    assert_eq!(s.stats().unauthorized, 3);
    assert_eq!(s.records().len(), 1);
    s.stop().await;
}

#[tokio::test]
async fn poison_is_rejected_with_400_by_marker_or_by_id_and_never_recorded() {
    let s = sink(FaultConfig {
        poison_ids: [5].into(),
        ..FaultConfig::default()
    })
    .await;
    assert_eq!(publish(&s, 5, "p-5").await.status(), 400);
    let auth = bearer(DEV_TOKEN);
    let marked = post(
        s.addr(),
        &format!("/v2/publish/{DEST}"),
        &[
            ("authorization", &auth),
            ("upstash-forward-x-outbox-id", "6"),
        ],
        json!({"id": 6, "payload": {"poison": true}}).to_string(),
        T,
    )
    .await;
    assert_eq!(marked.status(), 400);
    assert!(marked.body()["error"].as_str().unwrap().contains('6'));
    assert_eq!(publish(&s, 7, "p-7").await.status(), 200);
    let records = s.records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].outbox_id, Some(7));
    // A poison message never enters the dedup window: a retry is rejected again.
    assert_eq!(publish(&s, 5, "p-5").await.status(), 400);
    assert_eq!(s.stats().poison_rejected, 3);
    s.stop().await;
}

#[tokio::test]
async fn injected_server_errors_and_rate_limits() {
    let s = sink(FaultConfig {
        server_error: 1.0,
        ..FaultConfig::default()
    })
    .await;
    let a = publish(&s, 1, "e-1").await;
    assert_eq!(a.status(), 503);
    assert!(a.body()["error"].is_string());
    s.set_faults(FaultConfig {
        rate_limited: 1.0,
        retry_after: Duration::from_secs(7),
        ..FaultConfig::default()
    })
    .unwrap();
    let a = publish(&s, 1, "e-1").await;
    assert_eq!(a.status(), 429);
    assert_eq!(a.header("retry-after").as_deref(), Some("7"));
    assert!(s.records().is_empty());
    s.set_faults(FaultConfig::default()).unwrap();
    assert_eq!(
        publish(&s, 1, "e-1").await.status(),
        200,
        "a rejected message is not in the dedup window"
    );
    let st = s.stats();
    assert_eq!((st.server_errors, st.rate_limited, st.accepted), (1, 1, 1));
    s.stop().await;
}

#[tokio::test]
async fn element_errors_fail_messages_not_requests() {
    let s = sink(FaultConfig {
        element_error: 1.0,
        ..FaultConfig::default()
    })
    .await;
    assert_eq!(publish(&s, 1, "x-1").await.status(), 503);
    let auth = bearer(DEV_TOKEN);
    let batch = json!([{"destination": DEST, "body": "{}"}, {"destination": DEST, "body": "{}"}]);
    let a = post(
        s.addr(),
        "/v2/batch",
        &[("authorization", &auth)],
        batch.to_string(),
        T,
    )
    .await;
    assert_eq!(a.status(), 200);
    for el in a.body().as_array().unwrap() {
        assert_eq!(el["status"], 503);
        assert!(el["error"].is_string());
    }
    assert_eq!(s.stats().element_errors, 3);
    assert!(s.records().is_empty());
    s.stop().await;
}

#[tokio::test]
async fn a_reset_drops_the_connection_without_an_answer() {
    let s = sink(FaultConfig {
        reset: 1.0,
        ..FaultConfig::default()
    })
    .await;
    match publish(&s, 1, "r-1").await {
        Answer::ConnectionError(_) => {}
        other => panic!("expected a connection error, got {other:?}"),
    }
    assert!(s.records().is_empty());
    assert_eq!(s.stats().resets, 1);
    s.stop().await;
}

#[tokio::test]
async fn a_lost_response_is_recorded_but_never_answered() {
    let s = sink(FaultConfig {
        lost_response: 1.0,
        ..FaultConfig::default()
    })
    .await;
    assert!(matches!(
        publish(&s, 1, "l-1").await,
        Answer::ConnectionError(_)
    ));
    s.set_faults(FaultConfig::default()).unwrap();
    // The relay retries: a duplicate, collapsed by the deduplication id.
    let again = publish(&s, 1, "l-1").await;
    assert_eq!(again.status(), 202);
    let records = s.records();
    assert_eq!(records.len(), 2);
    assert_eq!(records[0].message_id, records[1].message_id);
    s.stop().await;
}

#[tokio::test]
async fn a_hung_request_outlives_the_client_timeout() {
    let s = sink(FaultConfig {
        hang: 1.0,
        hang_for: Duration::from_secs(120),
        ..FaultConfig::default()
    })
    .await;
    let auth = bearer(DEV_TOKEN);
    let a = post(
        s.addr(),
        &format!("/v2/publish/{DEST}"),
        &[("authorization", &auth)],
        "{}",
        Duration::from_millis(300),
    )
    .await;
    assert!(matches!(a, Answer::TimedOut), "{a:?}");
    assert_eq!(s.stats().hangs, 1);
    assert!(s.records().is_empty());
    // Stopping releases the hung handler at once (bounded by the test's own timeout).
    tokio::time::timeout(T, s.stop())
        .await
        .expect("stop is prompt");
}

#[tokio::test]
async fn latency_delays_every_answer() {
    let latency = Duration::from_millis(150);
    let s = sink(FaultConfig {
        latency,
        jitter: Duration::from_millis(20),
        ..FaultConfig::default()
    })
    .await;
    let started = std::time::Instant::now();
    assert_eq!(publish(&s, 1, "d-1").await.status(), 200);
    assert!(started.elapsed() >= latency);
    s.stop().await;
}

#[tokio::test]
async fn delivery_mode_forwards_signed_like_qstash() {
    // The destination answers 500 once, then 200: the second attempt is `Upstash-Retried: 1`.
    let mut receiver = Receiver::start(vec![500]).await;
    let s = Sink::start(SinkConfig {
        delivery: Some(DeliveryConfig::default()),
        ..SinkConfig::default()
    })
    .await
    .unwrap();
    let destination = format!("http://{}/hook?x=1", receiver.addr);
    let auth = bearer(DEV_TOKEN);
    let body = r#"{"id":3,"payload":{"orderId":"o-3"}}"#;
    let a = post(
        s.addr(),
        &format!("/v2/publish/{destination}"),
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
            ("upstash-method", "PUT"),
            ("upstash-forward-x-outbox-id", "3"),
            ("upstash-forward-x-custom", "v"),
            ("upstash-deduplication-id", "k-3"),
        ],
        body,
        T,
    )
    .await;
    assert_eq!(a.status(), 200);
    let message_id = a.body()["messageId"].as_str().unwrap().to_owned();

    for retried in 0..2 {
        let got = receiver.next(T).await.expect("a delivery attempt");
        assert_eq!(got.method, http::Method::PUT);
        assert_eq!(got.uri.path(), "/hook");
        assert_eq!(got.uri.query(), Some("x=1"));
        assert_eq!(got.body.as_ref(), body.as_bytes());
        let h = |n: &str| got.headers.get(n).map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(h("x-outbox-id").as_deref(), Some("3"));
        assert_eq!(h("x-custom").as_deref(), Some("v"));
        assert_eq!(h("content-type").as_deref(), Some("application/json"));
        assert_eq!(h("upstash-message-id"), Some(message_id.clone()));
        assert_eq!(h("upstash-retried"), Some(retried.to_string()));
        assert_eq!(h("user-agent").as_deref(), Some("Upstash-QStash"));
        assert!(h("upstash-forward-x-custom").is_none());
        assert!(h("upstash-deduplication-id").is_none());

        let jwt = h("upstash-signature").expect("signed");
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_issuer(&["Upstash"]);
        validation.set_required_spec_claims(&["iss", "sub", "exp", "nbf"]);
        let claims = jsonwebtoken::decode::<SignatureClaims>(
            &jwt,
            &DecodingKey::from_secret(DEV_CURRENT_SIGNING_KEY.as_bytes()),
            &validation,
        )
        .expect("verifies with the dev current key")
        .claims;
        assert_eq!(claims.sub, destination);
        assert_eq!(claims.nbf, 0);
        assert_eq!(claims.exp, claims.iat + 300);
        assert!(claims.jti.starts_with("jwt_"));
        assert_eq!(claims.body, body_hash(body.as_bytes()));
        // A wrong key fails.
        assert!(jsonwebtoken::decode::<SignatureClaims>(
            &jwt,
            &DecodingKey::from_secret(b"sig_wrong"),
            &validation
        )
        .is_err());
    }
    assert!(s.wait_for_deliveries(1, T).await);
    let outcome = &s.deliveries()[0];
    assert!(outcome.delivered);
    assert_eq!((outcome.attempts, outcome.last_status), (2, Some(200)));

    // A duplicate is accepted but not delivered again.
    let dup = post(
        s.addr(),
        &format!("/v2/publish/{destination}"),
        &[
            ("authorization", &auth),
            ("upstash-deduplication-id", "k-3"),
        ],
        body,
        T,
    )
    .await;
    assert_eq!(dup.status(), 202);

    // Delivery mode refuses destinations off the loopback (nothing is sent).
    let refused = post(
        s.addr(),
        "/v2/publish/http://192.0.2.1/hook",
        &[("authorization", &auth)],
        "{}",
        T,
    )
    .await;
    assert_eq!(refused.status(), 400);
    assert!(refused.body()["error"]
        .as_str()
        .unwrap()
        .contains("loopback"));
    s.stop().await;
    assert!(
        receiver.next(Duration::from_millis(100)).await.is_none(),
        "no second delivery of the duplicate"
    );
}

#[tokio::test]
async fn by_default_a_batch_holding_poison_is_refused_whole() {
    let s = sink(FaultConfig::default()).await;
    let auth = bearer(DEV_TOKEN);
    let batch = json!([
        {"destination": DEST, "headers": {"upstash-deduplication-id": "c-1", "upstash-forward-x-outbox-id": "21"}, "body": envelope(21, "k-a")},
        {"destination": DEST, "headers": {"upstash-deduplication-id": "c-2", "upstash-forward-x-outbox-id": "22"}, "body": json!({"id": 22, "payload": {"poison": true}}).to_string()}
    ]);
    let a = post(
        s.addr(),
        "/v2/batch",
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        batch.to_string(),
        T,
    )
    .await;
    assert_eq!(a.status(), 400);
    assert!(a.body()["error"]
        .as_str()
        .unwrap()
        .contains("poison event 22"));
    assert!(
        s.records().is_empty(),
        "nothing of a refused batch is accepted"
    );
    assert_eq!(s.stats().poison_rejected, 1);
    s.stop().await;
}

fn adversarial(a: AdversarialConfig) -> FaultConfig {
    FaultConfig {
        seed: 9,
        adversarial: Some(a),
        ..FaultConfig::default()
    }
}

/// A `/v2/batch` of `ids`, each message deduplicated by `d-<id>`.
async fn batch(s: &SinkHandle, ids: &[i64]) -> Answer {
    let auth = bearer(DEV_TOKEN);
    let elements: Vec<serde_json::Value> = ids
        .iter()
        .map(|id| json!({"destination": DEST, "headers": {"upstash-deduplication-id": format!("d-{id}"), "upstash-forward-x-outbox-id": id.to_string()}, "body": envelope(*id, "k")}))
        .collect();
    post(
        s.addr(),
        "/v2/batch",
        &[("authorization", &auth)],
        serde_json::Value::Array(elements).to_string(),
        T,
    )
    .await
}

#[tokio::test]
async fn garbled_batch_answers_are_logged_as_unread_and_the_retry_as_accepted() {
    let s = sink(adversarial(AdversarialConfig {
        garbled: 1.0,
        ..AdversarialConfig::default()
    }))
    .await;
    for round in 0..40 {
        let ids = [round * 3 + 1, round * 3 + 2, round * 3 + 3];
        let a = batch(&s, &ids).await;
        assert!(a.status().is_success(), "{a:?}");
        let log: Vec<AnswerEvent> = s
            .answers()
            .into_iter()
            .filter(|e| ids.contains(&e.outbox_id))
            .collect();
        assert_eq!(log.len(), 3);
        // A slot is logged accepted exactly when the answer is a right-length
        // array whose element there is an object.
        let items = a.body().as_array().filter(|items| items.len() == 3);
        for (i, e) in log.iter().enumerate() {
            let readable = items.is_some_and(|items| items[i].is_object());
            let expected = if readable {
                AnswerKind::Accepted
            } else {
                AnswerKind::AcceptedUnread
            };
            assert_eq!(e.kind, expected, "slot {i} of {:?}", a.raw());
        }
    }
    let garbles: Vec<String> = s.stats().adversarial.into_keys().collect();
    assert_eq!(garbles.len(), 6, "every garble drawn: {garbles:?}");
    // Retried whole: answered readably, as duplicates.
    s.set_faults(FaultConfig::default()).unwrap();
    let again = batch(&s, &[1, 2, 3]).await;
    let items = again.body().as_array().unwrap();
    assert!(items.iter().all(|e| e["deduplicated"] == true), "{items:?}");
    let last: Vec<AnswerKind> = s.answers().iter().rev().take(3).map(|e| e.kind).collect();
    assert_eq!(last, vec![AnswerKind::Accepted; 3]);
    s.stop().await;
}

#[tokio::test]
async fn cut_off_and_oversized_answers_and_nul_bodies() {
    let s = sink(adversarial(AdversarialConfig {
        cut_off: 1.0,
        ..AdversarialConfig::default()
    }))
    .await;
    match publish(&s, 1, "c-1").await {
        Answer::ConnectionError(e) => assert!(!e.is_empty()),
        other => panic!("expected the answer to break off, got {other:?}"),
    }
    assert_eq!(s.answers()[0].kind, AnswerKind::AcceptedUnread);
    assert_eq!(s.records().len(), 1, "taken all the same");

    s.set_faults(adversarial(AdversarialConfig {
        oversized: 1.0,
        oversized_bytes: 100_000,
        ..AdversarialConfig::default()
    }))
    .unwrap();
    let big = batch(&s, &[2, 3]).await;
    assert_eq!(big.status(), 200);
    assert!(big.raw().len() >= 100_000);
    assert_eq!(
        big.body().as_array().unwrap().len(),
        2,
        "valid, only too big"
    );
    // On /v2/publish the status is the answer; in a batch the body is.
    let single = publish(&s, 4, "c-4").await;
    assert_eq!(single.status(), 200);
    let kinds: Vec<(i64, AnswerKind)> = s.answers().iter().map(|e| (e.outbox_id, e.kind)).collect();
    assert_eq!(
        kinds[1..],
        [
            (2, AnswerKind::AcceptedUnread),
            (3, AnswerKind::AcceptedUnread),
            (4, AnswerKind::Accepted)
        ]
    );

    s.set_faults(adversarial(AdversarialConfig {
        status: 1.0,
        statuses: vec![422],
        nul_bodies: 1.0,
        ..AdversarialConfig::default()
    }))
    .unwrap();
    let refused = publish(&s, 5, "c-5").await;
    assert_eq!(refused.status(), 422);
    assert!(refused.raw().contains(&0) && std::str::from_utf8(refused.raw()).is_err());
    let in_batch = batch(&s, &[6, 7]).await;
    assert_eq!(in_batch.status(), 422);
    let kinds: Vec<AnswerKind> = s.answers()[4..].iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        [
            AnswerKind::Rejected { status: 422 },
            AnswerKind::Failed { status: 422 },
            AnswerKind::Failed { status: 422 }
        ],
        "a 4xx rejects a message only when the request carries it alone"
    );
    assert!(s.stats().adversarial["nul_body"] >= 2);
    s.stop().await;
}

/// Polls `probe` every 20 ms until it is true; false after `limit`.
async fn eventually(limit: Duration, mut probe: impl AsyncFnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if probe().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test]
async fn outages_refuse_connections_then_listen_again_and_rate_limits_say_when_they_lift() {
    let outage = |at: u64, kind| OutageSpec {
        at: Duration::from_millis(at),
        duration: Duration::from_millis(800),
        kind,
        route: None,
    };
    let s = sink(adversarial(AdversarialConfig {
        outages: vec![
            outage(0, OutageKind::Refused),
            outage(1000, OutageKind::RateLimited),
            outage(2000, OutageKind::Unauthorized),
        ],
        ..AdversarialConfig::default()
    }))
    .await;
    let addr = s.addr();
    assert_eq!(publish(&s, 1, "o-1").await.status(), 200);
    s.start_outages();
    let refused = || async {
        tokio::net::TcpStream::connect(addr)
            .await
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
    };
    assert!(eventually(T, refused).await, "connections refused");
    let limited = eventually(T, async || {
        let a = publish(&s, 2, "o-2").await;
        if !matches!(a, Answer::Response { .. }) || a.status() != 429 {
            return false;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        // Whichever header was drawn, it points no further than the outage's end.
        for name in ["ratelimit-reset", "burst-ratelimit-reset"] {
            if let Some(v) = a.header(name) {
                let at: u64 = v.parse().unwrap();
                assert!(at >= now && at <= now + 2, "{name}: {v}");
            }
        }
        true
    })
    .await;
    assert!(limited, "a 429 outage after the refused one");
    let unauthorized = eventually(T, async || {
        matches!(publish(&s, 3, "o-3").await, a @ Answer::Response { .. } if a.status() == 401)
    })
    .await;
    assert!(unauthorized);
    let back = eventually(T, async || {
        matches!(publish(&s, 4, "o-4").await, a @ Answer::Response { .. } if a.status() == 200)
    })
    .await;
    assert!(back, "answers again after the last outage");
    let windows = s.outages();
    let kinds: Vec<OutageKind> = windows.iter().map(|w| w.kind).collect();
    assert_eq!(
        kinds,
        [
            OutageKind::Refused,
            OutageKind::RateLimited,
            OutageKind::Unauthorized
        ]
    );
    assert!(windows.iter().all(|w| w.end_us - w.start_us >= 700_000));
    assert!(windows.windows(2).all(|w| w[0].end_us <= w[1].start_us));
    s.stop().await;
}

#[tokio::test]
async fn a_route_outage_answers_its_destination_path_only() {
    let s = sink(adversarial(AdversarialConfig {
        outages: vec![OutageSpec {
            at: Duration::ZERO,
            duration: Duration::from_secs(30),
            kind: OutageKind::Gone,
            route: Some("/hook/invoices".into()),
        }],
        ..AdversarialConfig::default()
    }))
    .await;
    s.start_outages();
    let auth = bearer(DEV_TOKEN);
    let to = |path: &'static str, id: i64| {
        let auth = auth.clone();
        let s = &s;
        async move {
            let id_s = id.to_string();
            post(
                s.addr(),
                &format!("/v2/publish/http://127.0.0.1:9{path}"),
                &[
                    ("authorization", &auth),
                    ("upstash-deduplication-id", &format!("r-{id}")),
                    ("upstash-forward-x-outbox-id", &id_s),
                ],
                envelope(id, "pk-1"),
                T,
            )
            .await
            .status()
        }
    };
    assert!(eventually(T, async || to("/hook/invoices", 1).await == 410).await);
    assert_eq!(to("/hook", 2).await, 200);
    assert_eq!(to("/hook/invoices", 3).await, 410);
    let answers = s.answers();
    let of = |id| answers.iter().find(|a| a.outbox_id == id).map(|a| a.kind);
    assert_eq!(of(2), Some(AnswerKind::Accepted));
    assert_eq!(of(3), Some(AnswerKind::Failed { status: 410 }));
    s.stop().await;
}

async fn kept(token: &str) -> SinkHandle {
    Sink::start(SinkConfig::for_tests(token)).await.unwrap()
}

#[tokio::test]
async fn a_rule_refusing_one_message_fails_its_batch_whole_and_attempts_are_counted() {
    let s = kept(DEV_TOKEN).await;
    // d-2 is refused on its first attempt, asking for a retry in 2 s.
    s.set_rule(|r| {
        if r.dedup_id == "d-2" && r.attempt == 0 {
            Reply::Status(503, Some("2".into()))
        } else {
            Reply::Accept
        }
    });
    let refused = batch(&s, &[1, 2]).await;
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.header("retry-after").as_deref(), Some("2"));
    assert!(
        s.records().is_empty(),
        "nothing of a refused batch is taken"
    );
    let again = batch(&s, &[1, 2]).await;
    assert_eq!(again.status(), 200);
    assert!(again.body()[0]["messageId"].is_string() && again.body()[1]["messageId"].is_string());
    assert_eq!(s.records().len(), 2);

    let received = s.received();
    let seen: Vec<(&str, u32, bool, Option<i64>)> = received
        .iter()
        .map(|r| (r.dedup_id.as_str(), r.attempt, r.accepted, r.outbox_id))
        .collect();
    assert_eq!(
        seen,
        vec![
            ("d-1", 0, false, Some(1)),
            ("d-2", 0, false, Some(2)),
            ("d-1", 1, true, Some(1)),
            ("d-2", 1, true, Some(2)),
        ]
    );
    assert_eq!(received[0].partition_key(), "k");
    assert_eq!(received[0].destination, DEST);
    assert_eq!(s.accepted().len(), 2);
    assert_eq!(s.requests(), vec!["POST /v2/batch"; 2]);
    // The answer log says the whole request failed, not that a message was refused.
    assert!(s
        .answers()
        .iter()
        .take(2)
        .all(|a| a.kind == AnswerKind::Failed { status: 503 }));
}

#[tokio::test]
async fn a_batch_rule_answers_the_whole_batch_and_takes_what_it_accepts() {
    let s = kept(DEV_TOKEN).await;
    s.set_batch_rule(|msgs| {
        let answer = RawAnswer::new(200, br#"[{"messageId":"m1"},{"error":"no"}]"#.to_vec());
        Some((answer, (0..msgs.len()).map(|i| i == 0).collect()))
    });
    let a = batch(&s, &[1, 2]).await;
    assert_eq!(a.status(), 200);
    assert_eq!(a.raw().as_ref(), br#"[{"messageId":"m1"},{"error":"no"}]"#);
    let records = s.records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].outbox_id, Some(1));
    let accepted: Vec<bool> = s.received().iter().map(|r| r.accepted).collect();
    assert_eq!(accepted, vec![true, false]);
}

#[tokio::test]
async fn a_publish_refused_by_a_rule_gets_exactly_the_raw_answer() {
    let s = kept(DEV_TOKEN).await;
    s.set_rule(|_| {
        Reply::Raw(RawAnswer::new(301, b"moved".to_vec()).header("location", "https://elsewhere/"))
    });
    let a = publish(&s, 5, "d-5").await;
    assert_eq!(a.status(), 301);
    assert_eq!(a.header("location").as_deref(), Some("https://elsewhere/"));
    assert_eq!(a.raw().as_ref(), b"moved");
    assert!(s.records().is_empty());
    let r = &s.received()[0];
    assert!(!r.accepted);
    assert_eq!(r.headers["authorization"], bearer(DEV_TOKEN));
    assert_eq!(r.headers["upstash-flow-control-key"], "pk-1");
    assert_eq!(s.requests(), vec![format!("POST /v2/publish/{DEST}")]);
}

#[tokio::test]
async fn webhook_posts_under_hook_are_judged_without_a_token() {
    let s = kept("another-token").await;
    s.set_rule(|r| {
        if r.attempt == 0 {
            Reply::Status(500, None)
        } else {
            Reply::Accept
        }
    });
    let addr = s.addr();
    let hook = |id: &'static str| async move {
        post(
            addr,
            "/hook/order/k1",
            &[("webhook-id", id), ("x-outbox-id", "42")],
            r#"{"id":"42","partitionKey":"order:k1"}"#,
            T,
        )
        .await
    };
    assert_eq!(hook("evt-42").await.status(), 500);
    let ok = hook("evt-42").await;
    assert_eq!(ok.status(), 204);
    assert!(ok.raw().is_empty());
    let received = s.received();
    assert_eq!(received.len(), 2);
    assert_eq!(received[1].dedup_id, "evt-42");
    assert_eq!(received[1].destination, "/hook/order/k1");
    assert_eq!(received[1].outbox_id, Some(42));
    assert_eq!(received[1].partition_key(), "order:k1");
    assert_eq!((received[0].accepted, received[1].accepted), (false, true));
    // The accepted call is a record, as a message QStash took, so a run
    // through a webhook route is verified and timed like one through QStash.
    let records = s.records();
    assert_eq!(records.len(), 1, "only the accepted call: {records:?}");
    assert_eq!(records[0].dedup_id.as_deref(), Some("evt-42"));
    assert_eq!(records[0].outbox_id, Some(42));
    assert_eq!(records[0].partition_key.as_deref(), Some("order:k1"));
    assert_eq!(records[0].destination, "/hook/order/k1");
    assert!(!records[0].deduplicated);
    assert_eq!(s.stats().unauthorized, 0);
}

#[tokio::test]
async fn without_keep_messages_nothing_is_kept_and_rules_still_apply() {
    let s = sink(FaultConfig::default()).await;
    assert_eq!(publish(&s, 1, "d-1").await.status(), 200);
    s.set_rule(|_| Reply::Status(400, None));
    let refused = publish(&s, 2, "d-2").await;
    assert_eq!(refused.status(), 400);
    assert!(refused.body()["error"]
        .as_str()
        .unwrap()
        .contains("status 400"));
    assert!(s.received().is_empty() && s.requests().is_empty());
    assert_eq!(s.records().len(), 1);
}
