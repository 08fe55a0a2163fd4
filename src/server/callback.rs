//! QStash's failure callback: when a message has used up its retries, QStash
//! POSTs a report here and we record the final failure on the outbox row
//! (`dead_lettered_at`, `last_error`), so `outbox-relay dlq` sees it.
//!
//! Set the route's failure callback to `https://<this server>/qstash/failure`.
//! The report is signed like any delivery; `sub` is not checked here (the
//! public URL depends on the proxy in front), the body hash is.

use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
use base64::Engine;
use serde::Deserialize;
use tokio_postgres::types::Type;

use crate::consumer::qstash::Verifier;
use crate::db::{self, Pool};

pub const FAILURE_PATH: &str = "/qstash/failure";

/// `last_error` keeps this many characters of the destination's answer.
pub const MAX_ERROR_BODY_CHARS: usize = 2000;

/// Reports carry the original message and the response, both base64: allow
/// a 1 MB message with room to spare.
const MAX_REPORT_BYTES: usize = 8 * 1024 * 1024;

/// Header names (lowercase) that carry the outbox row id, in order of trust.
const ID_HEADERS: &[&str] = &["x-outbox-id", "x-event-id"];

// A second report for the same row (QStash retries callbacks) keeps the
// first dead-letter time.
const MARK_DEAD: &str = "UPDATE outbox
SET dead_lettered_at = coalesce(dead_lettered_at, now()),
    last_error = $2,
    locked_until = NULL
WHERE id = $1";

#[derive(Clone)]
struct CallbackState {
    pool: Pool,
    verifier: Verifier,
}

/// `POST /qstash/failure`.
pub fn failure_callback_router(pool: Pool, verifier: Verifier) -> Router {
    Router::new()
        .route(FAILURE_PATH, post(failure_callback))
        .layer(DefaultBodyLimit::max(MAX_REPORT_BYTES))
        .with_state(CallbackState { pool, verifier })
}

/// A header value as QStash sends it (an array) or as its docs show it (a string).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum HeaderValues {
    Many(Vec<String>),
    One(String),
}

impl HeaderValues {
    fn first(&self) -> Option<&str> {
        match self {
            HeaderValues::Many(v) => v.first().map(String::as_str),
            HeaderValues::One(s) => Some(s),
        }
    }
}

/// The failure-callback report (docs/qstash-protocol.md, "Failure callbacks");
/// only what we use.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FailureReport {
    status: u16,
    #[serde(default)]
    body: Option<String>,
    #[serde(default)]
    retried: Option<u32>,
    #[serde(default)]
    max_retries: Option<u32>,
    #[serde(default)]
    dlq_id: Option<String>,
    #[serde(default)]
    source_message_id: Option<String>,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    source_header: HashMap<String, HeaderValues>,
    #[serde(default)]
    source_body: Option<String>,
}

#[derive(Debug)]
enum Rejection {
    Unauthorized(String),
    BadReport(String),
    UnknownRow(i64),
    Database(db::DbError),
}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        match self {
            Rejection::Unauthorized(why) => (StatusCode::UNAUTHORIZED, why).into_response(),
            Rejection::BadReport(why) => (StatusCode::BAD_REQUEST, why).into_response(),
            Rejection::UnknownRow(id) => {
                (StatusCode::NOT_FOUND, format!("no outbox row {id}")).into_response()
            }
            // QStash retries the callback: the row gets marked once the database is back.
            Rejection::Database(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "database unavailable").into_response()
            }
        }
    }
}

async fn failure_callback(
    State(state): State<CallbackState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match record_failure(&state, &headers, &body).await {
        Ok(id) => (StatusCode::OK, format!("outbox row {id} dead-lettered")).into_response(),
        Err(rejection) => {
            match &rejection {
                Rejection::Unauthorized(why) => {
                    tracing::warn!(reason = %why, "failure callback: bad signature")
                }
                Rejection::BadReport(why) => {
                    tracing::warn!(reason = %why, "failure callback: malformed report")
                }
                Rejection::UnknownRow(id) => {
                    tracing::warn!(id, "failure callback: no such outbox row")
                }
                Rejection::Database(e) => {
                    tracing::warn!(error = %e, "failure callback: database error")
                }
            }
            rejection.into_response()
        }
    }
}

async fn record_failure(
    state: &CallbackState,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<i64, Rejection> {
    state
        .verifier
        .verify_headers(headers, body, None)
        .map_err(|e| Rejection::Unauthorized(e.to_string()))?;
    let report: FailureReport = serde_json::from_slice(body)
        .map_err(|e| Rejection::BadReport(format!("not a QStash failure report: {e}")))?;
    let id = outbox_id(&report)?;
    let last_error = describe(&report)?;
    let conn = state
        .pool
        .get()
        .await
        .map_err(|e| Rejection::Database(e.into()))?;
    let updated = conn
        .execute_typed(MARK_DEAD, &[(&id, Type::INT8), (&last_error, Type::TEXT)])
        .await
        .map_err(|e| Rejection::Database(e.into()))?;
    if updated == 0 {
        return Err(Rejection::UnknownRow(id));
    }
    tracing::info!(
        id,
        status = report.status,
        source_message_id = report.source_message_id.as_deref().unwrap_or(""),
        url = report.url.as_deref().unwrap_or(""),
        "QStash gave up on an outbox row; dead-lettered"
    );
    Ok(id)
}

/// The outbox id the relay forwarded: a header first, else the `id` of the
/// JSON envelope in the original body.
fn outbox_id(report: &FailureReport) -> Result<i64, Rejection> {
    for wanted in ID_HEADERS {
        let value = report
            .source_header
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(wanted))
            .and_then(|(_, v)| v.first());
        if let Some(value) = value {
            return value.trim().parse().map_err(|_| {
                Rejection::BadReport(format!("{wanted} {value:?} is not an outbox id"))
            });
        }
    }
    let Some(encoded) = &report.source_body else {
        return Err(Rejection::BadReport(
            "no X-Outbox-Id in sourceHeader and no sourceBody".into(),
        ));
    };
    let source = decode_base64(encoded)
        .ok_or_else(|| Rejection::BadReport("sourceBody is not base64".into()))?;
    let envelope: serde_json::Value = serde_json::from_slice(&source).map_err(|_| {
        Rejection::BadReport("no X-Outbox-Id in sourceHeader and sourceBody is not JSON".into())
    })?;
    match envelope.get("id") {
        Some(serde_json::Value::Number(n)) => n.as_i64(),
        Some(serde_json::Value::String(s)) => s.trim().parse().ok(),
        _ => None,
    }
    .ok_or_else(|| {
        Rejection::BadReport(
            "no X-Outbox-Id in sourceHeader and no numeric `id` in sourceBody".into(),
        )
    })
}

/// `qstash: status 500 after 3 retries: <response body> (dlqId …)`.
fn describe(report: &FailureReport) -> Result<String, Rejection> {
    let response = match &report.body {
        None => String::new(),
        Some(encoded) => {
            let bytes = decode_base64(encoded)
                .ok_or_else(|| Rejection::BadReport("body is not base64".into()))?;
            String::from_utf8_lossy(&bytes)
                .chars()
                .take(MAX_ERROR_BODY_CHARS)
                .collect()
        }
    };
    let mut text = format!(
        "qstash: status {} after {} retries: {}",
        report.status,
        report
            .retried
            .or(report.max_retries)
            .map_or_else(|| "?".to_owned(), |n| n.to_string()),
        response
    );
    if let Some(dlq_id) = &report.dlq_id {
        text.push_str(&format!(" (dlqId {dlq_id})"));
    }
    Ok(text)
}

/// QStash uses standard base64; accept the URL-safe and unpadded forms too.
fn decode_base64(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(s).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(json: serde_json::Value) -> FailureReport {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn finds_the_outbox_id_in_headers_then_the_body() {
        let r = report(serde_json::json!({"status": 500, "sourceHeader": {"X-OUTBOX-ID": ["41"]}}));
        assert_eq!(outbox_id(&r).unwrap(), 41);
        let r = report(serde_json::json!({"status": 500, "sourceHeader": {"x-event-id": "42"}}));
        assert_eq!(outbox_id(&r).unwrap(), 42);
        let body = STANDARD.encode(br#"{"id": 43, "type": "t"}"#);
        let r = report(serde_json::json!({"status": 500, "sourceBody": body}));
        assert_eq!(outbox_id(&r).unwrap(), 43);
        let r = report(serde_json::json!({"status": 500, "sourceHeader": {"X-Outbox-Id": ["x"]}}));
        assert!(matches!(outbox_id(&r), Err(Rejection::BadReport(_))));
        let r = report(serde_json::json!({"status": 500}));
        assert!(matches!(outbox_id(&r), Err(Rejection::BadReport(_))));
    }

    #[test]
    fn last_error_is_truncated_and_names_the_dlq_entry() {
        let long = "é".repeat(3000);
        let r = report(serde_json::json!({
            "status": 502, "retried": 3, "body": STANDARD.encode(&long), "dlqId": "17-0"
        }));
        let text = describe(&r).unwrap();
        assert!(text.starts_with("qstash: status 502 after 3 retries: éé"));
        assert!(text.ends_with("é (dlqId 17-0)"));
        assert_eq!(text.matches('é').count(), MAX_ERROR_BODY_CHARS);
    }
}
