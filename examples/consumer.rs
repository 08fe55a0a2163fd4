//! The example consumer: one endpoint that takes QStash deliveries from the
//! relay, verifies them, and records each event once, with `outbox_client`.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1/app \
//! QSTASH_CURRENT_SIGNING_KEY=sig_… QSTASH_NEXT_SIGNING_KEY=sig_… \
//! cargo run --example consumer -- [CONSUMER_NAME]
//! ```
//!
//! It is the shape a real handler should copy:
//!
//! 1. read the raw body (the signature covers its exact bytes);
//! 2. verify `Upstash-Signature`, including its `sub` against the URL QStash
//!    delivered to → 401 when it does not hold;
//! 3. parse the event → 489 + `Upstash-NonRetryable-Error: true` when it can
//!    never be processed, so QStash dead-letters it at once instead of retrying;
//! 4. [`consume_once`] keyed by the envelope's `id`, which the signature
//!    covers (never by a header it does not cover) → 200 for processed and for
//!    duplicate, 500 when the work fails (QStash retries later).
//!
//! The connection pool is the relay's (`outbox_relay::store`, so `sslmode=require`
//! works) only for brevity: `outbox_client` needs nothing but a
//! `tokio_postgres::Client` per request, from any pool.
//!
//! `tests/consumer.rs` includes this file as a module and runs the handler
//! over real HTTP against a real PostgreSQL.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use outbox_client::consumer::idempotent::{consume_once, ConsumeError, Consumed, OUTBOX_ID_HEADER};
use outbox_client::consumer::qstash::{public_url, request_url, Verifier};
use outbox_relay::store::{Pool, StoreError};
use serde_json::Value;
use tokio_postgres::types::Type;

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
    /// Which URL the JWT's `sub` must name.
    pub subject: SubjectCheck,
}

/// The `sub` check: QStash signs the URL it delivers to, so a delivery made
/// for another endpoint (another service on the same QStash account) is
/// refused here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubjectCheck {
    /// `sub` must be exactly this URL: the route's destination as QStash
    /// calls it, whatever a proxy in front rewrites.
    Exact(String),
    /// `sub` must be the URL rebuilt from the request: `scheme`, `Host` and
    /// the path and query; with `trust_forwarded`, `X-Forwarded-Proto` and
    /// `X-Forwarded-Host` first (only behind a proxy you run that sets them).
    FromRequest {
        scheme: String,
        trust_forwarded: bool,
    },
    /// No `sub` check: any validly signed delivery for this account passes.
    Off,
}

impl SubjectCheck {
    /// The URL `sub` must equal, `Ok(None)` when not checked, `Err` when the
    /// request does not tell.
    fn expected(&self, headers: &HeaderMap, uri: &Uri) -> Result<Option<String>, ()> {
        match self {
            SubjectCheck::Exact(url) => Ok(Some(url.clone())),
            SubjectCheck::FromRequest {
                scheme,
                trust_forwarded: true,
            } => public_url(headers, uri, scheme).map(Some).ok_or(()),
            SubjectCheck::FromRequest {
                scheme,
                trust_forwarded: false,
            } => request_url(headers, uri, scheme).map(Some).ok_or(()),
            SubjectCheck::Off => Ok(None),
        }
    }
}

/// Settings read from the environment by the example binary.
#[derive(Debug, Clone)]
pub struct ExampleConfig {
    pub database_url: String,
    pub current_signing_key: String,
    pub next_signing_key: Option<String>,
    pub consumer: String,
    pub bind: SocketAddr,
    pub subject: SubjectCheck,
    pub clock_tolerance: Duration,
}

impl ExampleConfig {
    /// `DATABASE_URL`, `QSTASH_CURRENT_SIGNING_KEY` (required),
    /// `QSTASH_NEXT_SIGNING_KEY`, `CONSUMER_NAME` (default `example`),
    /// `CONSUMER_BIND` (default `127.0.0.1:3000`), `QSTASH_CLOCK_TOLERANCE`
    /// (seconds, default 5), and for the `sub` check (on unless
    /// `CONSUMER_CHECK_URL=false`): `CONSUMER_PUBLIC_URL`, the exact URL
    /// QStash delivers to, else the URL rebuilt from the request (`Host`, or
    /// `X-Forwarded-*` with `CONSUMER_TRUST_FORWARDED=true`).
    pub fn from_env() -> Result<ExampleConfig, String> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// [`ExampleConfig::from_env`] reading the variables through `lookup`.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<ExampleConfig, String> {
        let var = |name: &str| lookup(name).filter(|v| !v.is_empty());
        let flag = |name: &str, default: bool| match var(name).as_deref() {
            None => Ok(default),
            Some("true" | "1") => Ok(true),
            Some("false" | "0") => Ok(false),
            Some(other) => Err(format!("{name} is {other:?}, want true or false")),
        };
        let subject = if !flag("CONSUMER_CHECK_URL", true)? {
            SubjectCheck::Off
        } else if let Some(url) = var("CONSUMER_PUBLIC_URL") {
            match url.parse::<Uri>() {
                Ok(uri) if matches!(uri.scheme_str(), Some("http" | "https")) => {
                    SubjectCheck::Exact(url)
                }
                _ => return Err(format!("CONSUMER_PUBLIC_URL {url:?} is not an http(s) URL")),
            }
        } else {
            SubjectCheck::FromRequest {
                scheme: "http".into(),
                trust_forwarded: flag("CONSUMER_TRUST_FORWARDED", false)?,
            }
        };
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
            subject,
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
pub async fn prepare(pool: &Pool) -> Result<(), StoreError> {
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

/// Why a verified delivery is not processed.
#[derive(Debug, PartialEq, Eq)]
enum Refused {
    /// It can never be processed.
    Poison(String),
    /// An unsigned header contradicts the signed body: someone altered it.
    Tampered(String),
}

struct Event {
    message_id: String,
    event_type: String,
    body: Value,
}

/// The event in a verified body. Its id comes from the envelope's `id`, which
/// the signature covers: `X-Outbox-Id` is not signed, so it is only checked
/// against the envelope, never trusted on its own.
fn parse_event(headers: &HeaderMap, body: &[u8]) -> Result<Event, Refused> {
    let poison = |reason: String| Refused::Poison(reason);
    let body: Value =
        serde_json::from_slice(body).map_err(|e| poison(format!("body is not JSON: {e}")))?;
    if !body.is_object() {
        return Err(poison("body is not a JSON object".into()));
    }
    let message_id = match body.get("id") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.trim().to_owned(),
        Some(Value::Number(n)) => n.to_string(),
        _ => {
            return Err(poison(
                "body has no `id`: the route must send the envelope (body = \"envelope\")".into(),
            ))
        }
    };
    if let Some(header) = headers.get(OUTBOX_ID_HEADER) {
        if header.to_str().ok().map(str::trim) != Some(message_id.as_str()) {
            return Err(Refused::Tampered(format!(
                "X-Outbox-Id {header:?} is not the signed body's id {message_id:?}"
            )));
        }
    }
    let event_type = body
        .get("type")
        .and_then(Value::as_str)
        .or_else(|| headers.get(EVENT_TYPE_HEADER).and_then(|v| v.to_str().ok()))
        .filter(|t| !t.is_empty())
        .ok_or_else(|| poison("no event type (body `type` or X-Event-Type)".into()))?
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
    let Ok(expected_url) = state.subject.expected(&headers, &uri) else {
        tracing::warn!("cannot tell the URL of this request; rejecting");
        return (StatusCode::UNAUTHORIZED, "cannot check the signature's URL").into_response();
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
        Err(Refused::Poison(reason)) => {
            tracing::warn!(%reason, "delivery can never be processed; telling QStash not to retry");
            return non_retryable(reason);
        }
        Err(Refused::Tampered(reason)) => {
            tracing::warn!(%reason, "rejected a delivery");
            return (StatusCode::UNAUTHORIZED, reason).into_response();
        }
    };
    let message_id = event.message_id.clone();
    let mut conn = match state.pool.get().await {
        Ok(conn) => conn,
        Err(e) => return unavailable(&message_id, &StoreError::from(e)),
    };
    let consumer = state.consumer.clone();
    let outcome = consume_once(&mut *conn, &state.consumer, &message_id, move |tx| {
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
        Err(ConsumeError::Db(e)) => unavailable(&message_id, &e),
    }
}

/// 503: the database could not be reached or did not commit; QStash retries.
fn unavailable(message_id: &str, error: &dyn std::fmt::Display) -> Response {
    tracing::warn!(message_id, %error, "database unavailable; QStash will retry");
    (StatusCode::SERVICE_UNAVAILABLE, "database unavailable").into_response()
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let mut config = ExampleConfig::from_env().map_err(anyhow::Error::msg)?;
    if let Some(name) = std::env::args().nth(1) {
        config.consumer = name;
    }
    let pool = outbox_relay::store::pool(&config.database_url, 8, Duration::from_secs(5))?;
    prepare(&pool).await?;
    let verifier = Verifier::new(
        &config.current_signing_key,
        config.next_signing_key.as_deref(),
    )
    .with_tolerance(config.clock_tolerance);
    let listener = tokio::net::TcpListener::bind(config.bind).await?;
    tracing::info!(addr = %listener.local_addr()?, consumer = %config.consumer, "consumer listening");
    let consumer = ExampleConsumer {
        pool,
        verifier,
        consumer: config.consumer,
        subject: config.subject,
    };
    serve(listener, consumer, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
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
    fn the_id_comes_from_the_signed_body_and_the_header_must_agree() {
        let body = br#"{"id":"7","type":"order.placed"}"#;
        for h in [headers(Some("7")), headers(None)] {
            let ok = parse_event(&h, body).unwrap();
            assert_eq!(
                (ok.message_id.as_str(), ok.event_type.as_str()),
                ("7", "order.placed")
            );
        }
        assert_eq!(
            parse_event(&headers(None), br#"{"id":8,"type":"t"}"#)
                .unwrap()
                .message_id,
            "8"
        );
        assert!(matches!(
            parse_event(&headers(Some("99")), body),
            Err(Refused::Tampered(_))
        ));
    }

    #[test]
    fn poison_bodies_are_named() {
        for body in [
            &b"not json"[..],
            b"[1,2]",
            br#"{"id":"7","data":1}"#,
            br#"{"type":"a"}"#,
            br#"{"id":"","type":"a"}"#,
            br#"{"id":null,"type":"a"}"#,
        ] {
            assert!(
                matches!(parse_event(&headers(None), body), Err(Refused::Poison(_))),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        let mut h = headers(Some("7"));
        h.insert(EVENT_TYPE_HEADER, "order.paid".parse().unwrap());
        assert_eq!(
            parse_event(&h, br#"{"id":"7","data":1}"#)
                .unwrap()
                .event_type,
            "order.paid"
        );
    }

    #[test]
    fn the_url_check_is_on_unless_turned_off() {
        let vars = |extra: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                [
                    ("DATABASE_URL", "postgres://postgres@127.0.0.1/app"),
                    ("QSTASH_CURRENT_SIGNING_KEY", "sig_x"),
                ]
                .iter()
                .chain(extra)
                .rev()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
            }
        };
        let subject = |extra| ExampleConfig::from_lookup(vars(extra)).map(|c| c.subject);
        assert_eq!(
            subject(&[]),
            Ok(SubjectCheck::FromRequest {
                scheme: "http".into(),
                trust_forwarded: false
            })
        );
        assert_eq!(
            subject(&[("CONSUMER_TRUST_FORWARDED", "true")]),
            Ok(SubjectCheck::FromRequest {
                scheme: "http".into(),
                trust_forwarded: true
            })
        );
        assert_eq!(
            subject(&[(
                "CONSUMER_PUBLIC_URL",
                "https://api.example.com/hooks/orders"
            )]),
            Ok(SubjectCheck::Exact(
                "https://api.example.com/hooks/orders".into()
            ))
        );
        assert_eq!(
            subject(&[("CONSUMER_CHECK_URL", "false")]),
            Ok(SubjectCheck::Off)
        );
        for bad in [
            &[("CONSUMER_CHECK_URL", "yes please")][..],
            &[("CONSUMER_PUBLIC_URL", "api.example.com/hooks")],
        ] {
            let err = subject(bad).unwrap_err();
            assert!(err.contains(bad[0].0), "{err}");
        }
    }
}
