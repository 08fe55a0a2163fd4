//! The example consumer (`cargo run --example consumer`): one endpoint that
//! takes QStash deliveries from the relay, verifies them, and records each
//! event once. It is the shape a real handler should copy:
//!
//! 1. read the raw body (the signature covers its exact bytes);
//! 2. verify `Upstash-Signature` → 401 when it does not hold;
//! 3. parse the event → 489 + `Upstash-NonRetryable-Error: true` when it can
//!    never be processed, so QStash dead-letters it at once instead of retrying;
//! 4. [`consume_once`] keyed by `X-Outbox-Id` → 200 for processed and for
//!    duplicate, 500 when the work fails (QStash retries later).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::Value;
use tokio_postgres::types::Type;

use super::idempotent::{consume_once, ConsumeError, Consumed, OUTBOX_ID_HEADER};
use super::qstash::{public_url, Verifier};
use crate::db::{DbError, Pool};

/// QStash's "do not retry" answer (must come with [`NON_RETRYABLE_HEADER`]).
pub const NON_RETRYABLE_STATUS: u16 = 489;
pub const NON_RETRYABLE_HEADER: &str = "upstash-nonretryable-error";

/// The header a sender may name the event type in when the body has no `type`.
pub const EVENT_TYPE_HEADER: &str = "x-event-type";

/// The example's own table: what a real consumer's business write would be.
pub const CREATE_TABLE: &str = "CREATE TABLE IF NOT EXISTS example_received_events (
    consumer    text        NOT NULL,
    message_id  text        NOT NULL,
    event_type  text        NOT NULL,
    body        jsonb       NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
)";

const RECORD_EVENT: &str =
    "INSERT INTO example_received_events (consumer, message_id, event_type, body)
VALUES ($1, $2, $3, $4)";

/// Everything the handler needs.
#[derive(Debug, Clone)]
pub struct ExampleConsumer {
    pub pool: Pool,
    pub verifier: Verifier,
    /// The dedupe namespace: one per consuming service.
    pub consumer: String,
    /// Check the JWT's `sub` against the URL this request was sent to
    /// (rebuilt from `X-Forwarded-*` behind a proxy).
    pub check_subject: bool,
}

/// Settings read from the environment by the example binary.
#[derive(Debug, Clone)]
pub struct ExampleConfig {
    pub database_url: String,
    pub current_signing_key: String,
    pub next_signing_key: Option<String>,
    pub consumer: String,
    pub bind: SocketAddr,
    pub check_subject: bool,
    pub clock_tolerance: Duration,
}

impl ExampleConfig {
    /// `DATABASE_URL`, `QSTASH_CURRENT_SIGNING_KEY` (required),
    /// `QSTASH_NEXT_SIGNING_KEY`, `CONSUMER_NAME` (default `example`),
    /// `CONSUMER_BIND` (default `127.0.0.1:3000`), `CONSUMER_CHECK_URL`
    /// (`true` to check `sub`), `QSTASH_CLOCK_TOLERANCE` (seconds, default 5).
    pub fn from_env() -> Result<ExampleConfig, String> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let required = |name: &str| var(name).ok_or_else(|| format!("{name} is not set"));
        Ok(ExampleConfig {
            database_url: required("DATABASE_URL")?,
            current_signing_key: required("QSTASH_CURRENT_SIGNING_KEY")?,
            next_signing_key: var("QSTASH_NEXT_SIGNING_KEY"),
            consumer: var("CONSUMER_NAME").unwrap_or_else(|| "example".into()),
            bind: var("CONSUMER_BIND")
                .unwrap_or_else(|| "127.0.0.1:3000".into())
                .parse()
                .map_err(|e| format!("CONSUMER_BIND: {e}"))?,
            check_subject: matches!(var("CONSUMER_CHECK_URL").as_deref(), Some("true" | "1")),
            clock_tolerance: Duration::from_secs(
                var("QSTASH_CLOCK_TOLERANCE")
                    .map(|v| {
                        v.parse()
                            .map_err(|e| format!("QSTASH_CLOCK_TOLERANCE: {e}"))
                    })
                    .transpose()?
                    .unwrap_or(5),
            ),
        })
    }
}

/// Creates the example's table; run once at start.
pub async fn prepare(pool: &Pool) -> Result<(), DbError> {
    let conn = pool.get().await?;
    conn.batch_execute(CREATE_TABLE).await?;
    Ok(())
}

/// `POST /` (and any other path: QStash may deliver to whatever path the
/// route's URL names).
pub fn router(consumer: ExampleConsumer) -> Router {
    Router::new()
        .fallback(axum::routing::post(receive))
        .with_state(Arc::new(consumer))
}

/// Why an event can never be processed.
#[derive(Debug, PartialEq, Eq)]
struct Poison(String);

struct Event {
    message_id: String,
    event_type: String,
    body: Value,
}

fn parse_event(headers: &HeaderMap, body: &[u8]) -> Result<Event, Poison> {
    let message_id = headers
        .get(OUTBOX_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .ok_or_else(|| Poison("no X-Outbox-Id header".into()))?
        .to_owned();
    let body: Value =
        serde_json::from_slice(body).map_err(|e| Poison(format!("body is not JSON: {e}")))?;
    if !body.is_object() {
        return Err(Poison("body is not a JSON object".into()));
    }
    let event_type = body
        .get("type")
        .and_then(Value::as_str)
        .or_else(|| headers.get(EVENT_TYPE_HEADER).and_then(|v| v.to_str().ok()))
        .filter(|t| !t.is_empty())
        .ok_or_else(|| Poison("no event type (body `type` or X-Event-Type)".into()))?
        .to_owned();
    Ok(Event {
        message_id,
        event_type,
        body,
    })
}

async fn receive(
    State(state): State<Arc<ExampleConsumer>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let expected_url = if state.check_subject {
        match public_url(&headers, &uri, "http") {
            Some(url) => Some(url),
            None => {
                tracing::warn!("cannot tell the public URL of this request; rejecting");
                return (StatusCode::UNAUTHORIZED, "cannot check the signature's URL")
                    .into_response();
            }
        }
    } else {
        None
    };
    if let Err(e) = state
        .verifier
        .verify_headers(&headers, &body, expected_url.as_deref())
    {
        tracing::warn!(error = %e, "rejected a delivery");
        return (StatusCode::UNAUTHORIZED, e.to_string()).into_response();
    }
    let event = match parse_event(&headers, &body) {
        Ok(event) => event,
        Err(Poison(reason)) => {
            tracing::warn!(%reason, "delivery can never be processed; telling QStash not to retry");
            return non_retryable(reason);
        }
    };
    let message_id = event.message_id.clone();
    let consumer = state.consumer.clone();
    let outcome = consume_once(&state.pool, &state.consumer, &message_id, move |tx| {
        Box::pin(async move {
            tx.execute_typed(
                RECORD_EVENT,
                &[
                    (&consumer, Type::TEXT),
                    (&event.message_id, Type::TEXT),
                    (&event.event_type, Type::TEXT),
                    (&event.body, Type::JSONB),
                ],
            )
            .await
        })
    })
    .await;
    match outcome {
        Ok(Consumed::Processed(_)) => (StatusCode::OK, "processed").into_response(),
        Ok(Consumed::Duplicate) => (StatusCode::OK, "duplicate").into_response(),
        Err(ConsumeError::Work(e)) => {
            tracing::warn!(message_id, error = %e, "handler failed; QStash will retry");
            (StatusCode::INTERNAL_SERVER_ERROR, "handler failed").into_response()
        }
        Err(ConsumeError::Db(e)) => {
            tracing::warn!(message_id, error = %e, "database unavailable; QStash will retry");
            (StatusCode::SERVICE_UNAVAILABLE, "database unavailable").into_response()
        }
    }
}

fn non_retryable(reason: String) -> Response {
    let status = StatusCode::from_u16(NON_RETRYABLE_STATUS).unwrap_or(StatusCode::BAD_REQUEST);
    let mut response = (status, reason).into_response();
    response
        .headers_mut()
        .insert(NON_RETRYABLE_HEADER, HeaderValue::from_static("true"));
    response
}

/// Serves `router` on `listener` until the future `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    consumer: ExampleConsumer,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(consumer))
        .with_graceful_shutdown(shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(id: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(id) = id {
            h.insert(OUTBOX_ID_HEADER, id.parse().unwrap());
        }
        h
    }

    #[test]
    fn poison_bodies_are_named() {
        let ok = parse_event(&headers(Some("7")), br#"{"type":"order.placed"}"#).unwrap();
        assert_eq!(
            (ok.message_id.as_str(), ok.event_type.as_str()),
            ("7", "order.placed")
        );
        for (h, body) in [
            (headers(None), &br#"{"type":"a"}"#[..]),
            (headers(Some("7")), b"not json"),
            (headers(Some("7")), b"[1,2]"),
            (headers(Some("7")), br#"{"data":1}"#),
        ] {
            assert!(parse_event(&h, body).is_err());
        }
        let mut h = headers(Some("7"));
        h.insert(EVENT_TYPE_HEADER, "order.paid".parse().unwrap());
        assert_eq!(
            parse_event(&h, br#"{"data":1}"#).unwrap().event_type,
            "order.paid"
        );
    }
}
