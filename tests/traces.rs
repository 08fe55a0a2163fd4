//! Trace context end to end: a producer's span, recorded with the event in
//! its transaction, continues in the relay's delivery span (exported over
//! OTLP/HTTP to a receiver this test runs) and in the consumer's handler
//! span, through a webhook; through QStash the producer's `traceparent`
//! reaches the destination as it was.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{config_toml_with, run_until_drained, webhook_route};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::trace::v1::{span::SpanKind, status::StatusCode, Span};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use outbox_client::consumer::WebhookVerifier;
use outbox_client::trace::TraceContext;
use outbox_client::{enqueue, NewEvent};
use outbox_relay::Config;
use outbox_testkit::TestDb;
use prost::Message;
use tracing_subscriber::layer::SubscriberExt;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// The application's tracing: spans through tracing-opentelemetry into an
/// in-memory exporter.
struct AppTracing {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
    _guard: tracing::subscriber::DefaultGuard,
}

fn app_tracing() -> AppTracing {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("app")));
    AppTracing {
        exporter,
        provider,
        _guard: tracing::subscriber::set_default(subscriber),
    }
}

impl AppTracing {
    fn spans(&self) -> Vec<opentelemetry_sdk::trace::SpanData> {
        let _ = self.provider.force_flush();
        self.exporter.get_finished_spans().unwrap()
    }
}

/// Enqueues `n` events inside the span "place order" (each in its own
/// transaction, as a request handler would), and returns the span's context.
async fn produce_in_a_span(db: &TestDb, n: usize) -> TraceContext {
    let mut client = db.client().await.unwrap();
    let span = tracing::info_span!("place order");
    let producer = {
        let _entered = span.enter();
        TraceContext::current().expect("the producer's span has a trace context")
    };
    for i in 0..n {
        let event = {
            let _entered = span.enter();
            common::event(i, &format!("order:k{i}")).with_current_trace()
        };
        let tx = client.transaction().await.unwrap();
        enqueue(&tx, &event).await.unwrap();
        tx.commit().await.unwrap();
    }
    drop(span);
    producer
}

/// An OTLP/HTTP traces receiver on a loopback port: every span it was sent.
struct Receiver {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Span>>>,
}

async fn otlp_receiver() -> Receiver {
    use axum::body::Bytes;
    use axum::http::StatusCode as Http;
    let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
    let kept = Arc::clone(&spans);
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let kept = Arc::clone(&kept);
            async move {
                let Ok(request) = ExportTraceServiceRequest::decode(body) else {
                    return (Http::BAD_REQUEST, Vec::new());
                };
                let mut kept = kept.lock().unwrap();
                for resource in request.resource_spans {
                    for scope in resource.scope_spans {
                        kept.extend(scope.spans);
                    }
                }
                (Http::OK, Vec::new())
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    Receiver { addr, spans }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producers_trace_continues_in_the_relays_span_and_the_webhook_consumers() {
    let app = app_tracing();
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let receiver = otlp_receiver().await;
    let producer = produce_in_a_span(&db, 3).await;

    let overrides = format!(
        "[telemetry]\notlp_endpoint = \"http://{}/v1/traces\"\nexport_interval = \"100ms\"\nservice_name = \"relay-under-test\"\n",
        receiver.addr
    );
    let toml = config_toml_with(
        &db,
        &sink.url(),
        &overrides,
        &webhook_route(&sink.url(), ""),
    );
    let config = Config::from_toml_str(&toml).unwrap();
    // Shutting down sends the spans still batched.
    run_until_drained(&db, config, Duration::from_secs(30)).await;

    let relay_spans = receiver.spans.lock().unwrap().clone();
    let received = sink.received();
    assert_eq!(received.len(), 3, "{received:?}");
    let verifier = WebhookVerifier::new(&[SECRET]).unwrap();
    for request in &received {
        // What the webhook was sent: the producer's trace, the relay's span.
        let sent = TraceContext::parse(&request.headers["traceparent"]).unwrap();
        assert_eq!(sent.trace_id(), producer.trace_id(), "{request:?}");
        assert_ne!(sent.span_id(), producer.span_id(), "{request:?}");
        let id = request.outbox_id.expect("the event id");
        let span = relay_spans
            .iter()
            .find(|s| s.span_id == sent.span_id())
            .unwrap_or_else(|| panic!("no relay span {} in {relay_spans:?}", hex(&sent.span_id())));
        assert_eq!(span.name, "publish order.placed");
        assert_eq!(span.trace_id, producer.trace_id());
        assert_eq!(span.parent_span_id, producer.span_id());
        assert_eq!(span.kind, SpanKind::Producer as i32);
        assert_eq!(
            span.status.as_ref().map(|s| s.code),
            Some(StatusCode::Ok as i32)
        );
        assert!(span
            .attributes
            .iter()
            .any(|kv| kv.key == "messaging.message.id"
                && format!("{:?}", kv.value).contains(&id.to_string())));

        // The consumer verifies the delivery and continues the trace.
        let mut headers = http::HeaderMap::new();
        for (name, value) in &request.headers {
            headers.insert(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        verifier
            .verify(&headers, request.body.as_bytes())
            .expect("the signature covers what was sent");
        let context = TraceContext::from_headers(&headers).unwrap();
        let handler = tracing::info_span!("handle order.placed", outbox.id = id);
        context.set_parent_of(&handler);
        handler.in_scope(|| {});
        drop(handler);
    }

    let app_spans = app.spans();
    let handlers: Vec<_> = app_spans
        .iter()
        .filter(|s| s.name == "handle order.placed")
        .collect();
    assert_eq!(handlers.len(), 3, "{app_spans:?}");
    for handler in handlers {
        assert_eq!(
            handler.span_context.trace_id().to_bytes(),
            producer.trace_id()
        );
        let parent = handler.parent_span_id.to_bytes();
        assert!(
            relay_spans.iter().any(|s| s.span_id == parent),
            "the handler's parent is a relay span"
        );
    }
    // The resource names the relay as configured.
    assert!(!relay_spans.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_qstash_the_producers_traceparent_reaches_the_destination() {
    let _app = app_tracing();
    let db = common::test_db().await;
    let (dest, sink) = common::delivering_qstash().await;
    let producer = produce_in_a_span(&db, 2).await;
    let routes = format!(
        "[[routes]]\nevent_type = \"*\"\ndestination = \"{}/events\"\n",
        dest.url()
    );
    let toml = config_toml_with(&db, &sink.url(), "", &routes);
    run_until_drained(
        &db,
        Config::from_toml_str(&toml).unwrap(),
        Duration::from_secs(30),
    )
    .await;

    // QStash was asked to forward it ...
    for message in sink.received() {
        assert_eq!(
            message.headers.get("upstash-forward-traceparent"),
            Some(&producer.traceparent()),
            "{message:?}"
        );
    }
    // ... and the destination got it without the prefix.
    assert!(dest.wait_for_calls(2, Duration::from_secs(20)).await);
    let calls = dest.calls();
    assert!(!calls.is_empty());
    for call in calls {
        assert_eq!(
            call.traceparent.as_deref(),
            Some(producer.traceparent().as_str()),
            "{call:?}"
        );
    }
}

#[test]
fn telemetry_keys_out_of_range_are_refused_by_name() {
    common::assert_config_errors_name(&[
        (
            "[telemetry]\notlp_endpoint = \"grpc://127.0.0.1:4317\"\n",
            "telemetry.otlp_endpoint",
        ),
        (
            "[telemetry]\nexport_interval = \"1ms\"\n",
            "telemetry.export_interval",
        ),
        (
            "[telemetry]\nservice_name = \" \"\n",
            "telemetry.service_name",
        ),
    ]);
}

/// An event without trace context is delivered as before when telemetry is
/// off: no `traceparent` appears from nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_telemetry_an_untraced_event_gets_no_traceparent() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let mut client = db.client().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let event: NewEvent = common::event(1, "order:k1");
    enqueue(&tx, &event).await.unwrap();
    tx.commit().await.unwrap();
    let toml = config_toml_with(&db, &sink.url(), "", &webhook_route(&sink.url(), ""));
    run_until_drained(
        &db,
        Config::from_toml_str(&toml).unwrap(),
        Duration::from_secs(30),
    )
    .await;
    let received = sink.received();
    assert_eq!(received.len(), 1);
    assert!(
        !received[0].headers.contains_key("traceparent"),
        "{received:?}"
    );
}
