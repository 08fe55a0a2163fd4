//! Traces from the producer's transaction to the consumer's handler.
//!
//! `outbox-client` records the producer's W3C `traceparent` (and
//! `tracestate`) in the event's headers, and the sinks forward an event's
//! headers with it, so without anything here a consumer continues the
//! producer's trace. With `[telemetry] otlp_endpoint` set, each delivery of
//! an event is a span of its own: a child of the producer's span (a new
//! trace when the event carries none), from the moment a publisher takes the
//! event until the destination's answer, sent over OTLP/HTTP. The event then
//! goes out with the delivery span's `traceparent`, so the consumer's span
//! is the delivery span's child: producer → relay → consumer, one trace.
//!
//! The span ends at the destination's answer; the mark that records it is
//! batched with other events' in one UPDATE, so it has no span per event.

pub mod config;

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::{
    Span as _, SpanKind, Status, TraceContextExt, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{BatchConfigBuilder, SdkTracerProvider, Tracer};
use opentelemetry_sdk::Resource;
use outbox_client::row::OutboxRow;
use outbox_client::trace::{TraceContext, TRACEPARENT, TRACESTATE};

pub use config::TelemetryConfig;

use crate::sink::Outcome;

/// The relay's tracer, or nothing when telemetry is off (the default: no
/// span is made and an event's headers pass as they are).
#[derive(Clone, Default)]
pub struct Telemetry {
    inner: Option<Arc<Inner>>,
}

struct Inner {
    provider: SdkTracerProvider,
    tracer: Tracer,
}

/// Why the exporter could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("telemetry.otlp_endpoint: {0}")]
pub struct TelemetryError(String);

impl Telemetry {
    /// As `config` says: off, or spans batched to its OTLP endpoint. Needs
    /// a tokio runtime (the exporter's task and connections run on it).
    pub fn start(config: &TelemetryConfig) -> Result<Telemetry, TelemetryError> {
        let Some(endpoint) = &config.otlp_endpoint else {
            return Ok(Telemetry::default());
        };
        let client = opentelemetry_http::hyper::HyperClient::new(
            crate::sink::http::https_connector(config.export_timeout),
            config.export_timeout,
            None,
        );
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_endpoint(endpoint.as_str())
            .with_timeout(config.export_timeout)
            .build()
            .map_err(|e| TelemetryError(e.to_string()))?;
        let batch = BatchConfigBuilder::default()
            .with_scheduled_delay(config.export_interval)
            .with_max_export_timeout(config.export_timeout)
            .build();
        let processor =
            opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
                exporter,
                opentelemetry_sdk::runtime::Tokio,
            )
            .with_batch_config(batch)
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(
                Resource::builder()
                    .with_service_name(config.service_name.clone())
                    .build(),
            )
            .build();
        Ok(Telemetry::with_provider(provider))
    }

    /// Spans made by `provider` (an in-memory exporter's, in tests).
    pub fn with_provider(provider: SdkTracerProvider) -> Telemetry {
        let tracer = provider.tracer("outbox-relay");
        Telemetry {
            inner: Some(Arc::new(Inner { provider, tracer })),
        }
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Starts one delivery span per row, each a child of the row's own trace
    /// context, and gives each row the span's `traceparent` to send.
    pub(crate) fn start_deliveries(
        &self,
        route: &str,
        rows: &mut [OutboxRow],
    ) -> Option<Deliveries> {
        let inner = self.inner.as_ref()?;
        let spans = rows
            .iter_mut()
            .map(|row| {
                let parent = producer_context(row)
                    .map(|c| Context::new().with_remote_span_context(c.span_context()))
                    .unwrap_or_default();
                let span = inner
                    .tracer
                    .span_builder(format!("publish {}", row.event_type))
                    .with_kind(SpanKind::Producer)
                    .with_attributes([
                        KeyValue::new("messaging.system", "outbox-relay"),
                        KeyValue::new("messaging.operation.type", "send"),
                        KeyValue::new("messaging.destination.name", row.event_type.clone()),
                        KeyValue::new("messaging.message.id", row.id),
                        KeyValue::new("outbox.route", route.to_owned()),
                        KeyValue::new("outbox.attempt", i64::from(row.attempt)),
                        KeyValue::new("outbox.partition_key", row.partition_key.clone()),
                    ])
                    .start_with_context(&inner.tracer, &parent);
                if let Some(own) = TraceContext::from_span_context(span.span_context()) {
                    set_trace_headers(row, &own);
                }
                span
            })
            .collect();
        Some(Deliveries(spans))
    }

    /// Sends what is left to send, within `within`.
    pub async fn shutdown(&self, within: Duration) {
        let Some(inner) = &self.inner else {
            return;
        };
        let provider = inner.provider.clone();
        let done = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(within));
        match tokio::time::timeout(within + Duration::from_secs(1), done).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => {
                tracing::warn!(error = %e, "telemetry: the last spans were not all sent")
            }
            Ok(Err(_)) | Err(_) => {
                tracing::warn!("telemetry: the last spans were not all sent in time")
            }
        }
    }
}

/// The delivery spans of one request's rows, ended with their outcomes.
pub(crate) struct Deliveries(Vec<opentelemetry_sdk::trace::Span>);

impl Deliveries {
    /// Ends each span with its row's outcome (`None`: not sent, the route
    /// paused).
    pub(crate) fn end(self, outcomes: Option<&[Outcome]>) {
        for (i, mut span) in self.0.into_iter().enumerate() {
            let (outcome, status) = match outcomes.and_then(|o| o.get(i)) {
                Some(Outcome::Published) => ("published", Status::Ok),
                Some(Outcome::Retry { error, .. }) => ("retry", Status::error(error.clone())),
                Some(Outcome::Dead { error, .. }) => ("rejected", Status::error(error.clone())),
                None => ("deferred", Status::Unset),
            };
            span.set_attribute(KeyValue::new("outbox.outcome", outcome));
            span.set_status(status);
            span.end();
        }
    }
}

/// The producer's context the row carries, if its `traceparent` is valid.
fn producer_context(row: &OutboxRow) -> Option<TraceContext> {
    let header = |name: &str| {
        row.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    };
    let context = TraceContext::parse(header(TRACEPARENT)?).ok()?;
    Some(match header(TRACESTATE) {
        Some(state) => context.with_tracestate(state),
        None => context,
    })
}

/// The row's `traceparent` (and `tracestate`) replaced by `context`'s.
fn set_trace_headers(row: &mut OutboxRow, context: &TraceContext) {
    row.headers.retain(|(n, _)| {
        !n.eq_ignore_ascii_case(TRACEPARENT) && !n.eq_ignore_ascii_case(TRACESTATE)
    });
    for (name, value) in context.headers() {
        row.headers.push((name.to_owned(), value));
    }
}
