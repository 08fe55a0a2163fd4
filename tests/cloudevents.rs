//! CloudEvents bodies, against the real relay, a real PostgreSQL and the
//! test sink on a loopback port: `body = "cloudevents"` sends the structured
//! JSON form (webhook and QStash routes), `body = "cloudevents-binary"` the
//! payload with `ce-*` headers (webhooks). What arrived is decoded by the
//! CloudEvents SDK (`cloudevents-sdk`, its HTTP binding) and compared with
//! the rows in the database.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use cloudevents::event::ExtensionValue;
use cloudevents::{AttributesReader, Data, Event};
use common::{assert_config_errors_name, config, webhook_route};
use outbox_testkit::sink::Received;
use outbox_testkit::TestDb;
use serde_json::Value;

const EVENTS: usize = 5;

/// Each row's id → (created_at, aggregate_id, partition_key, payload).
async fn rows(db: &TestDb) -> HashMap<i64, (DateTime<Utc>, String, String, Value)> {
    db.client()
        .await
        .unwrap()
        .query(
            "SELECT id, created_at, aggregate_id, partition_key, payload FROM outbox",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(4))))
        .collect()
}

/// Delivers [`EVENTS`] events through `routes` (built from the sink's URL)
/// and returns what the sink received with the rows.
async fn deliver(
    routes: impl FnOnce(&str) -> String,
) -> (
    Vec<Received>,
    HashMap<i64, (DateTime<Utc>, String, String, Value)>,
) {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    common::insert_events(&db, EVENTS, EVENTS).await;
    let cfg = config(&db, &sink.url(), &routes(&sink.url()));
    common::run_until_drained(&db, cfg, Duration::from_secs(60)).await;
    let received = sink.received();
    assert_eq!(received.len(), EVENTS);
    (received, rows(&db).await)
}

/// The CloudEvent the SDK reads from a request.
fn decode(r: &Received) -> Event {
    let mut headers = http::HeaderMap::new();
    for (name, value) in &r.headers {
        headers.insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    cloudevents::binding::http::to_event(&headers, r.body.clone().into_bytes())
        .unwrap_or_else(|e| panic!("not a CloudEvent: {e}\n{:?}\n{}", r.headers, r.body))
}

fn data_json(event: &Event) -> Value {
    match event.data().expect("the event has data") {
        Data::Json(v) => v.clone(),
        Data::Binary(b) => serde_json::from_slice(b).unwrap(),
        Data::String(s) => serde_json::from_str(s).unwrap(),
    }
}

/// Every attribute of each event is its row's.
fn assert_events_are_the_rows(
    received: &[Received],
    rows: &HashMap<i64, (DateTime<Utc>, String, String, Value)>,
    source: &str,
) {
    for r in received {
        let event = decode(r);
        let id: i64 = event.id().parse().unwrap();
        let (created_at, aggregate_id, partition_key, payload) = &rows[&id];
        assert_eq!(event.specversion().to_string(), "1.0");
        assert_eq!(event.source(), source);
        assert_eq!(event.ty(), "order.placed");
        assert_eq!(event.subject(), Some(aggregate_id.as_str()));
        assert_eq!(event.time(), Some(created_at));
        assert_eq!(event.datacontenttype(), Some("application/json"));
        assert_eq!(&data_json(&event), payload);
        assert_eq!(
            event.extension("partitionkey"),
            Some(&ExtensionValue::String(partition_key.clone()))
        );
        assert!(event.extension("tenantid").is_some());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_route_sends_structured_cloudevents() {
    let (received, rows) = deliver(|url| {
        webhook_route(
            url,
            "body = \"cloudevents\"\ncloudevents_source = \"/shop/orders\"",
        )
    })
    .await;
    for r in &received {
        assert_eq!(r.headers["content-type"], "application/cloudevents+json");
        assert!(!r.headers.contains_key("ce-id"), "{:?}", r.headers);
        // The signature covers the CloudEvent as sent.
        let mut h = http::HeaderMap::new();
        for name in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
            h.insert(name, r.headers[name].parse().unwrap());
        }
        standardwebhooks::Webhook::new("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .unwrap()
            .verify(r.body.as_bytes(), &h)
            .unwrap();
    }
    assert_events_are_the_rows(&received, &rows, "/shop/orders");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_route_sends_binary_cloudevents() {
    let (received, rows) = deliver(|url| webhook_route(url, "body = \"cloudevents-binary\"")).await;
    for r in &received {
        assert_eq!(r.headers["content-type"], "application/json");
        assert_eq!(r.headers["ce-specversion"], "1.0");
        // The body is the payload alone.
        let id: i64 = r.headers["ce-id"].parse().unwrap();
        assert_eq!(serde_json::from_str::<Value>(&r.body).unwrap(), rows[&id].3);
    }
    assert_events_are_the_rows(&received, &rows, "/outbox-relay");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qstash_route_sends_structured_cloudevents() {
    let (received, rows) = deliver(|_| {
        "[[routes]]\nevent_type = \"*\"\ndestination = \"http://127.0.0.1:9/hook/{event_type}\"\nbody = \"cloudevents\"\n"
            .to_owned()
    })
    .await;
    for r in &received {
        assert_eq!(r.headers["content-type"], "application/cloudevents+json");
    }
    assert_events_are_the_rows(&received, &rows, "/outbox-relay");
}

#[test]
fn cloudevents_keys_that_do_not_fit_are_refused_naming_them() {
    let route = |more: &str| {
        format!(
            "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\n{more}\n"
        )
    };
    let cases = [
        (route("body = \"cloudevents-binary\""), "routes[0].body"),
        (route("body = \"cloudevent\""), "routes[0].body"),
        (
            route("cloudevents_source = \"/shop\""),
            "routes[0].cloudevents_source",
        ),
        (
            route("body = \"cloudevents\"\ncloudevents_source = \"my shop\""),
            "routes[0].cloudevents_source",
        ),
    ];
    let cases: Vec<(&str, &str)> = cases.iter().map(|(t, k)| (t.as_str(), *k)).collect();
    assert_config_errors_name(&cases);
}
