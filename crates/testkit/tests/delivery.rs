//! Delivery mode over real HTTP on loopback: the stand-in delivers what it
//! accepted to a final destination as QStash does (flow control, retries
//! after a delay, callbacks, failure callbacks), and the destination's order
//! check sees what that does to per-key order.

mod common;

use std::time::Duration;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use common::{bearer, post, Answer, Receiver};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use outbox_testkit::sink::signing::{body_hash, SignatureClaims};
use outbox_testkit::sink::{
    check_order, Call, CallbackKind, DeliveryConfig, Destination, DestinationConfig,
    DestinationHandle, RetryDelay, Sink, SinkConfig, SinkHandle, DEV_CURRENT_SIGNING_KEY,
    DEV_TOKEN,
};
use serde_json::{json, Value};

/// Generous: a broken run fails on it instead of hanging.
const T: Duration = Duration::from_secs(30);

async fn sink(delivery: DeliveryConfig) -> SinkHandle {
    Sink::start(SinkConfig {
        delivery: Some(delivery),
        ..SinkConfig::default()
    })
    .await
    .unwrap()
}

async fn destination(config: DestinationConfig) -> DestinationHandle {
    Destination::start(config).await.unwrap()
}

fn envelope(id: i64, key: &str) -> String {
    json!({"id": id.to_string(), "type": "order.placed", "partitionKey": key, "payload": {"n": id}})
        .to_string()
}

/// One `/v2/batch` of `(outbox id, partition key)` messages to `dest`, each
/// with flow control on its key at parallelism 1, as an ordered route sends them.
async fn publish_ordered(s: &SinkHandle, dest: &str, events: &[(i64, &str)]) -> Answer {
    let elements: Vec<Value> = events
        .iter()
        .map(|(id, key)| {
            json!({
                "destination": dest,
                "headers": {
                    "content-type": "application/json",
                    "upstash-deduplication-id": format!("d-{id}"),
                    "upstash-forward-x-outbox-id": id.to_string(),
                    "upstash-flow-control-key": key,
                    "upstash-flow-control-value": "parallelism=1",
                },
                "body": envelope(*id, key),
            })
        })
        .collect();
    post(
        s.addr(),
        "/v2/batch",
        &[("authorization", &bearer(DEV_TOKEN))],
        Value::Array(elements).to_string(),
        T,
    )
    .await
}

/// One `/v2/publish` of event `id` to `dest` with `headers` on top of the usual ones.
async fn publish(s: &SinkHandle, dest: &str, id: i64, headers: &[(&str, &str)]) -> Answer {
    let auth = bearer(DEV_TOKEN);
    let id_s = id.to_string();
    let dedup = format!("d-{id}");
    let mut all = vec![
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
        ("upstash-deduplication-id", dedup.as_str()),
        ("upstash-forward-x-outbox-id", id_s.as_str()),
    ];
    all.extend_from_slice(headers);
    post(
        s.addr(),
        &format!("/v2/publish/{dest}"),
        &all,
        envelope(id, "k"),
        T,
    )
    .await
}

/// The most calls open at once among `calls`.
fn most_in_flight(calls: &[Call]) -> usize {
    let mut edges: Vec<(i64, i32)> = calls
        .iter()
        .flat_map(|c| [(c.in_us, 1), (c.out_us, -1)])
        .collect();
    edges.sort();
    let (mut open, mut most) = (0, 0);
    for (_, step) in edges {
        open += step;
        most = most.max(open);
    }
    most as usize
}

/// The claims of an `Upstash-Signature`, checked with an independent JWT
/// library under the dev current key: HS256, `iss`, `exp`, `nbf` required.
fn verified_claims(jwt: &str) -> SignatureClaims {
    let mut validation = Validation::new(Algorithm::HS256);
    validation.set_issuer(&["Upstash"]);
    validation.set_required_spec_claims(&["iss", "sub", "exp", "nbf"]);
    jsonwebtoken::decode::<SignatureClaims>(
        jwt,
        &DecodingKey::from_secret(DEV_CURRENT_SIGNING_KEY.as_bytes()),
        &validation,
    )
    .expect("signed with the current key")
    .claims
}

fn unbase64(v: &Value) -> Vec<u8> {
    STANDARD
        .decode(v.as_str().expect("a base64 string"))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallelism_one_never_overlaps_two_calls_of_a_key_and_keys_run_side_by_side() {
    let dest = destination(DestinationConfig {
        latency: Duration::from_millis(50),
        jitter: Duration::from_millis(10),
        seed: 3,
        ..DestinationConfig::default()
    })
    .await;
    let s = sink(DeliveryConfig::default()).await;
    let keys = ["a", "b", "c"];
    let events: Vec<(i64, &str)> = (0..24).map(|i| (i + 1, keys[i as usize % 3])).collect();
    assert_eq!(
        publish_ordered(&s, &dest.url(), &events).await.status(),
        200
    );
    assert!(s.wait_for_deliveries(events.len(), T).await);
    assert!(s.deliveries().iter().all(|o| o.delivered));

    let calls = dest.calls();
    assert_eq!(calls.len(), events.len(), "no failures, so one call each");
    let report = check_order(&calls, Some(1));
    assert!(report.passed(), "{report:?}");
    assert_eq!(report.max_in_flight_per_key, 1);
    assert_eq!((report.keys, report.events_delivered), (3, 24));
    // The limit is per key: calls of different keys were in flight together.
    assert!(most_in_flight(&calls) > 1, "the keys waited for each other");
    // The calls carried what QStash adds.
    let first = calls.iter().find(|c| c.outbox_id == Some(1)).unwrap();
    assert_eq!(first.retried, Some(0));
    assert!(first.message_id.as_deref().unwrap().starts_with("msg_"));
    assert_eq!(first.partition_key.as_deref(), Some("a"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_delivery_is_retried_after_the_delay_and_the_keys_next_event_goes_first() {
    let dest = destination(DestinationConfig::default()).await;
    // Event 1's first call fails; everything else succeeds.
    dest.set_rule(|c| (c.outbox_id == Some(1) && c.retried == Some(0)).then_some(503));
    let delay = Duration::from_secs(1);
    let s = sink(DeliveryConfig {
        retry_delay: RetryDelay::Fixed(delay),
        ..DeliveryConfig::default()
    })
    .await;
    let a = publish_ordered(&s, &format!("{}/orders", dest.url()), &[(1, "k"), (2, "k")]).await;
    assert_eq!(a.status(), 200);
    assert!(s.wait_for_deliveries(2, T).await);

    let calls = dest.calls();
    let seen: Vec<(Option<i64>, u16, Option<u32>)> = calls
        .iter()
        .map(|c| (c.outbox_id, c.status, c.retried))
        .collect();
    assert_eq!(
        seen,
        vec![
            (Some(1), 503, Some(0)),
            (Some(2), 200, Some(0)),
            (Some(1), 200, Some(1)),
        ],
        "flow control lets the key's next event in while the failed one waits"
    );
    assert_eq!(calls[0].target, "/orders");
    assert!(
        calls[1].in_us >= calls[0].out_us,
        "parallelism 1: the next call began after the failed one ended"
    );
    assert!(
        calls[2].in_us - calls[0].out_us >= delay.as_micros() as i64,
        "retried {} µs after the failure, before the {delay:?} delay",
        calls[2].in_us - calls[0].out_us
    );
    let attempts = s.delivery_attempts();
    assert_eq!(attempts.len(), 3);
    assert!(attempts
        .iter()
        .all(|a| a.flow_control_key.as_deref() == Some("k")));
    let outcome = s
        .deliveries()
        .into_iter()
        .find(|o| o.outbox_id == Some(1))
        .unwrap();
    assert_eq!((outcome.attempts, outcome.delivered), (2, true));

    // The destination saw event 2 before event 1.
    let report = check_order(&calls, Some(1));
    assert!(!report.passed());
    assert_eq!((report.out_of_order, report.out_of_order_keys), (1, 1));
    assert_eq!(
        report.examples,
        vec!["key k: event 1 reached the destination after event 2"]
    );
    assert_eq!(report.over_parallelism_keys, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callbacks_after_every_attempt_are_signed_and_say_what_happened() {
    let dest = destination(DestinationConfig::default()).await;
    dest.set_rule(|c| (c.retried == Some(0)).then_some(503));
    let mut receiver = Receiver::start(Vec::new()).await;
    let s = sink(DeliveryConfig::default()).await;
    let cb_url = format!("http://{}/qstash/callback", receiver.addr);
    let dest_url = format!("{}/orders?x=1", dest.url());
    let a = publish(
        &s,
        &dest_url,
        7,
        &[
            ("upstash-method", "PUT"),
            ("upstash-retries", "2"),
            ("upstash-callback", &cb_url),
            ("upstash-callback-forward-x-hook-secret", "s3"),
            ("upstash-forward-x-custom", "v"),
        ],
    )
    .await;
    assert_eq!(a.status(), 200);
    let message_id = a.body()["messageId"].as_str().unwrap().to_owned();
    assert!(s.wait_for_callbacks(2, T).await);

    let mut reports = Vec::new();
    for _ in 0..2 {
        let got = receiver.next(T).await.expect("a callback");
        let h = |n: &str| got.headers.get(n).map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(got.method, http::Method::POST);
        assert_eq!(got.uri.path(), "/qstash/callback");
        assert_eq!(h("content-type").as_deref(), Some("application/json"));
        assert_eq!(h("x-hook-secret").as_deref(), Some("s3"));
        assert_eq!(h("user-agent").as_deref(), Some("Upstash-QStash"));
        assert_eq!(h("upstash-retried").as_deref(), Some("0"));
        let callback_id = h("upstash-message-id").unwrap();
        assert!(callback_id.starts_with("msg_") && callback_id != message_id);
        let claims = verified_claims(&h("upstash-signature").expect("signed"));
        assert_eq!(claims.sub, cb_url);
        assert_eq!(claims.body, body_hash(&got.body));
        reports.push(serde_json::from_slice::<Value>(&got.body).unwrap());
    }
    reports.sort_by_key(|r| r["retried"].as_u64());
    for (report, (status, retried)) in reports.iter().zip([(503, 0), (200, 1)]) {
        assert_eq!(report["status"], status);
        assert_eq!(report["retried"], retried);
        assert_eq!(report["maxRetries"], 2);
        assert_eq!(report["sourceMessageId"], message_id.as_str());
        assert_eq!(report["url"], dest_url.as_str());
        assert_eq!(report["method"], "PUT");
        assert_eq!(unbase64(&report["sourceBody"]), envelope(7, "k").as_bytes());
        assert_eq!(report["sourceHeader"]["X-Outbox-Id"], json!(["7"]));
        assert_eq!(report["sourceHeader"]["X-Custom"], json!(["v"]));
        assert_eq!(
            report["header"]["Content-Type"],
            json!(["application/json"])
        );
        assert!(report["createdAt"].as_i64().unwrap() > 1_700_000_000_000);
        assert!(report.get("dlqId").is_none(), "not a failure callback");
        let answered = String::from_utf8(unbase64(&report["body"])).unwrap();
        if status == 200 {
            assert_eq!(answered, r#"{"ok":true}"#);
        } else {
            assert!(answered.contains("503"), "{answered}");
        }
    }
    let outcomes = s.callbacks();
    assert!(outcomes
        .iter()
        .all(|c| c.kind == CallbackKind::Callback && c.delivered && c.attempts == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_failure_callback_comes_after_the_last_retry_and_is_itself_retried() {
    let dest = destination(DestinationConfig {
        failure_rate: 1.0,
        ..DestinationConfig::default()
    })
    .await;
    // The failure callback's URL fails once: the stand-in tries it again.
    let mut receiver = Receiver::start(vec![500]).await;
    let s = sink(DeliveryConfig::default()).await;
    let fail_url = format!("http://{}/qstash/failure", receiver.addr);
    let a = publish(
        &s,
        &dest.url(),
        9,
        &[
            ("upstash-retries", "2"),
            ("upstash-failure-callback", &fail_url),
            ("upstash-failure-callback-forward-x-tag", "t"),
        ],
    )
    .await;
    assert_eq!(a.status(), 200);
    let message_id = a.body()["messageId"].as_str().unwrap().to_owned();

    let first = receiver.next(T).await.expect("a failure callback");
    assert_eq!(
        dest.calls().len(),
        3,
        "the report was sent once all three attempts had been answered"
    );
    let second = receiver.next(T).await.expect("the failure callback, again");
    assert_eq!(first.body, second.body, "the same report, retried");
    let retried = |c: &common::Captured| c.headers["upstash-retried"].to_str().unwrap().to_owned();
    assert_eq!(
        (retried(&first), retried(&second)),
        ("0".into(), "1".into())
    );
    assert_eq!(second.headers["x-tag"], "t");
    let claims = verified_claims(second.headers["upstash-signature"].to_str().unwrap());
    assert_eq!(claims.sub, fail_url);
    assert_eq!(claims.body, body_hash(&second.body));

    let report: Value = serde_json::from_slice(&second.body).unwrap();
    assert_eq!(report["status"], 503);
    assert_eq!(report["retried"], 2);
    assert_eq!(report["maxRetries"], 2);
    assert_eq!(report["sourceMessageId"], message_id.as_str());
    assert!(!report["dlqId"].as_str().unwrap().is_empty());
    assert_eq!(report["sourceHeader"]["X-Outbox-Id"], json!(["9"]));

    assert!(s.wait_for_callbacks(1, T).await);
    let cb = &s.callbacks()[0];
    assert_eq!(cb.kind, CallbackKind::Failure);
    assert_eq!((cb.retried, cb.status), (2, 503));
    assert_eq!(
        (cb.attempts, cb.last_status, cb.delivered),
        (2, Some(200), true)
    );
    let outcome = &s.deliveries()[0];
    assert_eq!((outcome.attempts, outcome.delivered), (3, false));
    assert_eq!(outcome.last_status, Some(503));
    assert!(
        receiver.next(Duration::from_millis(300)).await.is_none(),
        "one failure callback, no success callback"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_retryable_answer_fails_the_message_at_once() {
    let dest = destination(DestinationConfig::default()).await;
    dest.set_rule(|_| Some(489));
    let mut receiver = Receiver::start(Vec::new()).await;
    let s = sink(DeliveryConfig::default()).await;
    let fail_url = format!("http://{}/fail", receiver.addr);
    let a = publish(
        &s,
        &dest.url(),
        4,
        &[("upstash-failure-callback", &fail_url)],
    )
    .await;
    assert_eq!(a.status(), 200);
    let report = receiver.next(T).await.expect("a failure callback");
    let report: Value = serde_json::from_slice(&report.body).unwrap();
    assert_eq!(
        (report["status"].as_u64(), report["retried"].as_u64()),
        (Some(489), Some(0))
    );
    assert_eq!(report["maxRetries"], 3, "the default retries, unused");
    assert_eq!(dest.calls().len(), 1);
}

#[tokio::test]
async fn delivery_mode_refuses_what_it_cannot_deliver_and_bad_settings() {
    let s = sink(DeliveryConfig::default()).await;
    let dest = "http://127.0.0.1:9/x";
    for (headers, says) in [
        (
            [("upstash-callback", "http://192.0.2.1/cb")],
            "upstash-callback: destination `http://192.0.2.1/cb` is not a loopback address",
        ),
        ([("upstash-retries", "many")], "Upstash-Retries"),
        (
            [("upstash-flow-control-key", "k")],
            "Upstash-Flow-Control-Value",
        ),
    ] {
        let mut headers = headers.to_vec();
        if headers[0].0 == "upstash-flow-control-key" {
            headers.push(("upstash-flow-control-value", "parallelism=0"));
        }
        let a = publish(&s, dest, 1, &headers).await;
        assert_eq!(a.status(), 400, "{headers:?}");
        let error = a.body()["error"].as_str().unwrap();
        assert!(error.contains(says), "{error}");
    }
    assert!(s.records().is_empty());
    let err = Sink::start(SinkConfig {
        delivery: Some(DeliveryConfig {
            retry_delay: RetryDelay::Qstash,
            retry_delay_max: Some(Duration::from_secs(3)),
            ..DeliveryConfig::default()
        }),
        ..SinkConfig::default()
    })
    .await
    .err()
    .expect("refused");
    assert!(
        err.to_string().contains("delivery.retry_delay_max"),
        "{err}"
    );
}
