//! The webhook sink: POSTs the event straight to a URL, signed with Standard
//! Webhooks (<https://www.standardwebhooks.com>, [`outbox_client::signing`])
//! so the receiver can verify it came from us. The keys are the route's
//! `signing_secret` ([`crate::routes::SigningSecret`]), decoded when the
//! configuration is read: several during a rotation, each signing every
//! request.

use bytes::Bytes;
use futures_util::future::join_all;
use http::header::{CONTENT_TYPE, USER_AGENT};
use http::{HeaderName, HeaderValue, Request};
use http_body_util::Full;
use outbox_client::row::OutboxRow;
use outbox_client::signing::sign;

use super::http::HttpClient;
use super::limits::Ticket;
use super::{classify, transport_outcome, DeadReason, Outcome, RetryReason};
use crate::routes::{BodyShape, Route};

/// POSTs each row to the route's URL, signed; one outcome per row, in order.
/// The relay does the retries (no QStash in between).
pub async fn deliver(
    client: &HttpClient,
    route: &Route,
    rows: &[OutboxRow],
    max_message_bytes: usize,
) -> Vec<Outcome> {
    let tickets = rows.iter().map(|_| Ticket::now()).collect();
    deliver_paced(client, route, rows, max_message_bytes, tickets).await
}

/// [`deliver`], each row sent at its ticket's time, once it has the request
/// slots it queues for, and holding them until its answer is in
/// ([`super::limits`]).
pub(crate) async fn deliver_paced(
    client: &HttpClient,
    route: &Route,
    rows: &[OutboxRow],
    max_message_bytes: usize,
    tickets: Vec<Ticket>,
) -> Vec<Outcome> {
    let keys = route
        .config
        .signing_secret
        .as_ref()
        .map(|s| s.keys())
        .unwrap_or_default();
    join_all(
        rows.iter()
            .zip(tickets)
            .map(|(row, mut ticket)| async move {
                // Signed when it goes, so its timestamp is the sending time.
                tokio::time::sleep_until(ticket.at.into()).await;
                if let Err(error) = ticket.ready().await {
                    return Outcome::Retry {
                        after: None,
                        reason: RetryReason::Timeout,
                        error,
                    };
                }
                let request = match signed_request(route, row, keys, max_message_bytes) {
                    Ok(r) => r,
                    Err(outcome) => return outcome,
                };
                let result = client.send(request).await;
                drop(ticket);
                super::http::record_request("webhook", &result);
                match result {
                    Ok(response) => classify(&response),
                    Err(e) => transport_outcome(&e),
                }
            }),
    )
    .await
}

/// The request for one row, signed with `key`.
pub fn request(
    route: &Route,
    row: &OutboxRow,
    key: &[u8],
    max_message_bytes: usize,
) -> Result<Request<Full<Bytes>>, Outcome> {
    signed_request(route, row, &[key], max_message_bytes)
}

/// The request for one row, signed with each of `keys` (the route's
/// secrets during a rotation): `webhook-signature` holds one `v1,…` entry
/// per key, separated by spaces, as Standard Webhooks allows, so a receiver
/// that knows any one of the secrets accepts it.
pub fn signed_request<K: AsRef<[u8]>>(
    route: &Route,
    row: &OutboxRow,
    keys: &[K],
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
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static(super::content_type(route)),
    );
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
    let mut ours: Vec<(String, String)> = vec![
        ("webhook-id".into(), row.idempotency_key.clone()),
        ("webhook-timestamp".into(), timestamp.to_string()),
        (
            "webhook-signature".into(),
            keys.iter()
                .map(|key| sign(key.as_ref(), &row.idempotency_key, timestamp, &body))
                .collect::<Vec<_>>()
                .join(" "),
        ),
        ("x-outbox-id".into(), id.clone()),
        ("x-event-id".into(), id),
    ];
    // A CloudEvent's attributes are the relay's, as its signature is.
    if route.config.body == BodyShape::CloudeventsBinary {
        ours.extend(super::cloudevents::binary_headers(
            row,
            super::cloudevents_source(route),
        ));
    }
    for (name, value) in ours {
        match (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            (Ok(n), Ok(v)) => {
                headers.insert(n, v);
            }
            (_, Err(_)) | (Err(_), _) => {
                return Err(Outcome::Dead {
                    reason: DeadReason::BadDestination,
                    error: super::truncate(
                        format!("cannot send header `{name}`: not a valid header value"),
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
