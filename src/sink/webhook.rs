//! The webhook sink: POSTs the event straight to a URL, signed with Standard
//! Webhooks (<https://www.standardwebhooks.com>, [`outbox_client::signing`])
//! so the receiver can verify it came from us. The key is the route's
//! `signing_secret` ([`crate::routes::SigningSecret`]), decoded when the
//! configuration is read.

use bytes::Bytes;
use futures_util::future::join_all;
use http::header::{CONTENT_TYPE, USER_AGENT};
use http::{HeaderName, HeaderValue, Request};
use http_body_util::Full;
use outbox_client::row::OutboxRow;
use outbox_client::signing::sign;

use super::http::HttpClient;
use super::{classify, transport_outcome, DeadReason, Outcome};
use crate::routes::Route;

/// POSTs each row to the route's URL, signed; one outcome per row, in order.
/// The relay does the retries (no QStash in between).
pub async fn deliver(
    client: &HttpClient,
    route: &Route,
    rows: &[OutboxRow],
    max_message_bytes: usize,
) -> Vec<Outcome> {
    let key = route
        .config
        .signing_secret
        .as_ref()
        .map(|s| s.key())
        .unwrap_or_default();
    join_all(rows.iter().map(|row| async move {
        let request = match request(route, row, key, max_message_bytes) {
            Ok(r) => r,
            Err(outcome) => return outcome,
        };
        let result = client.send(request).await;
        super::http::record_request("webhook", &result);
        match result {
            Ok(response) => classify(&response),
            Err(e) => transport_outcome(&e),
        }
    }))
    .await
}

/// The signed request for one row.
pub fn request(
    route: &Route,
    row: &OutboxRow,
    key: &[u8],
    max_message_bytes: usize,
) -> Result<Request<Full<Bytes>>, Outcome> {
    let url = super::destination(route, row)?;
    let body = super::body(route, row);
    if body.len() > max_message_bytes {
        return Err(Outcome::Dead {
            reason: DeadReason::TooLarge,
            error: format!(
                "message of {} bytes is over the {max_message_bytes}-byte limit",
                body.len()
            ),
        });
    }
    let timestamp = chrono::Utc::now().timestamp();
    let method = route.config.method.method().clone();
    let id = row.id.to_string();
    let mut request = Request::builder().method(method).uri(&url);
    let headers = request.headers_mut().expect("a fresh builder");
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(USER_AGENT, HeaderValue::from_static("outbox-relay"));
    // A row's header replaces ours of the same name (content-type, user-agent)
    // rather than adding a second one; the signature's headers, the event id
    // and the connection's own headers (host, length, encoding) stay ours.
    for (name, value) in &row.headers {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) else {
            continue;
        };
        if relay_owned(&name) {
            tracing::debug!(id = row.id, header = %name, "row header ignored: the relay sets it");
            continue;
        }
        headers.insert(name, value);
    }
    let signed = [
        ("webhook-id", row.idempotency_key.clone()),
        ("webhook-timestamp", timestamp.to_string()),
        (
            "webhook-signature",
            sign(key, &row.idempotency_key, timestamp, &body),
        ),
        ("x-outbox-id", id.clone()),
        ("x-event-id", id),
    ];
    for (name, value) in signed {
        match HeaderValue::from_str(&value) {
            Ok(v) => {
                headers.insert(name, v);
            }
            Err(e) => {
                return Err(Outcome::Dead {
                    reason: DeadReason::BadDestination,
                    error: super::truncate(
                        format!("cannot send header `{name}`: {e}"),
                        super::MAX_ERROR_CHARS,
                    ),
                })
            }
        }
    }
    request
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| Outcome::Dead {
            reason: DeadReason::BadDestination,
            error: super::truncate(
                format!(
                    "cannot build a request to `{}`: {e}",
                    crate::redact::url(&url)
                ),
                super::MAX_ERROR_CHARS,
            ),
        })
}

/// Headers a row may not set on a webhook: the Standard Webhooks trio the
/// signature covers, the event id, and what belongs to the connection.
fn relay_owned(name: &HeaderName) -> bool {
    let n = name.as_str();
    n.starts_with("webhook-")
        || matches!(
            n,
            "x-outbox-id"
                | "x-event-id"
                | "host"
                | "content-length"
                | "transfer-encoding"
                | "connection"
                | "keep-alive"
                | "te"
                | "trailer"
                | "upgrade"
                | "proxy-connection"
        )
}
