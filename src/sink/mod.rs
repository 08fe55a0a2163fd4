//! Where events go: QStash (`/v2/batch`, `/v2/publish`) or a signed webhook,
//! over one shared keep-alive hyper client. A sink turns rows into requests and
//! answers into one [`Outcome`] per row; it never touches the database.

pub mod http;
pub mod qstash;
pub mod webhook;

use std::time::{Duration, SystemTime};

use crate::backoff::parse_retry_after;
use crate::config::{BodyShape, SinkKind};
use crate::routes::{Route, TemplateValues};
use crate::row::OutboxRow;

pub use self::http::{HttpClient, Response, TransportError};

/// What became of one row's delivery attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The destination accepted it (2xx).
    Published,
    /// Worth another try: 408, 429, 5xx, a timeout, a broken connection.
    Retry {
        /// What the destination asked for (`Retry-After`).
        after: Option<Duration>,
        reason: RetryReason,
        error: String,
    },
    /// It will never be accepted; stop trying.
    Dead { reason: DeadReason, error: String },
}

/// Why an attempt will be retried; the `reason` label on the metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryReason {
    /// 5xx.
    ServerError,
    /// 429.
    RateLimited,
    /// 408, or no answer within the request timeout.
    Timeout,
    /// Could not connect.
    Connect,
    /// The connection broke or the answer could not be read.
    Network,
    /// QStash refused our token (401/403): a configuration problem.
    Unauthorized,
    /// One message of a QStash batch came back with an error.
    BatchElement,
}

impl RetryReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            RetryReason::ServerError => "server_error",
            RetryReason::RateLimited => "rate_limited",
            RetryReason::Timeout => "timeout",
            RetryReason::Connect => "connect",
            RetryReason::Network => "network",
            RetryReason::Unauthorized => "unauthorized",
            RetryReason::BatchElement => "batch_element",
        }
    }
}

/// Why a row was dead-lettered; the `reason` label on the metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadReason {
    /// The destination answered a 4xx other than 408 and 429.
    Rejected,
    /// The message is larger than the sink accepts.
    TooLarge,
    /// No route takes this event type.
    NoRoute,
    /// The route's destination rendered to something that is not a URL.
    BadDestination,
    /// The last allowed attempt failed.
    Exhausted,
}

impl DeadReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            DeadReason::Rejected => "rejected",
            DeadReason::TooLarge => "too_large",
            DeadReason::NoRoute => "no_route",
            DeadReason::BadDestination => "bad_destination",
            DeadReason::Exhausted => "exhausted",
        }
    }
}

/// Longest `last_error` we store.
pub const MAX_ERROR_CHARS: usize = 2000;

pub fn truncate(mut s: String, max_chars: usize) -> String {
    if let Some((cut, _)) = s.char_indices().nth(max_chars) {
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// The usual reading of an HTTP answer.
pub fn classify(response: &Response) -> Outcome {
    let status = response.status;
    if status.is_success() {
        return Outcome::Published;
    }
    let error = truncate(
        format!(
            "HTTP {}: {}",
            status.as_u16(),
            String::from_utf8_lossy(&response.body).trim()
        ),
        MAX_ERROR_CHARS,
    );
    let reason = match status.as_u16() {
        408 => Some(RetryReason::Timeout),
        429 => Some(RetryReason::RateLimited),
        _ if status.is_server_error() => Some(RetryReason::ServerError),
        _ => None,
    };
    if let Some(reason) = reason {
        let after = response
            .headers
            .get(::http::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        Outcome::Retry {
            after,
            reason,
            error,
        }
    } else {
        Outcome::Dead {
            reason: DeadReason::Rejected,
            error,
        }
    }
}

pub fn transport_outcome(e: &TransportError) -> Outcome {
    Outcome::Retry {
        after: None,
        reason: match e {
            TransportError::Connect(_) => RetryReason::Connect,
            TransportError::Timeout(_) => RetryReason::Timeout,
            TransportError::Request(_) | TransportError::Body(_) => RetryReason::Network,
        },
        error: truncate(e.to_string(), MAX_ERROR_CHARS),
    }
}

/// The request body a route sends for a row.
pub fn body(route: &Route, row: &OutboxRow) -> Vec<u8> {
    match route.config.body {
        BodyShape::Envelope => row.envelope(),
        BodyShape::Payload => row.payload.clone().into_bytes(),
    }
}

/// The route's destination for a row, checked to be a URL.
pub fn destination(route: &Route, row: &OutboxRow) -> Result<String, Outcome> {
    let tenant = row.tenant_id.hyphenated().to_string();
    let url = route.destination.render(&TemplateValues {
        id: row.id,
        event_type: &row.event_type,
        aggregate_type: &row.aggregate_type,
        aggregate_id: &row.aggregate_id,
        tenant_id: &tenant,
        partition_key: &row.partition_key,
    });
    match url.parse::<::http::Uri>() {
        Ok(uri) if uri.host().is_some() => Ok(url),
        _ => Err(Outcome::Dead {
            reason: DeadReason::BadDestination,
            error: truncate(
                format!("destination `{url}` is not a valid URL"),
                MAX_ERROR_CHARS,
            ),
        }),
    }
}

/// Every sink the routes use, sharing one client.
#[derive(Clone)]
pub struct Sinks {
    pub client: HttpClient,
    pub qstash: qstash::QstashSink,
    pub max_message_bytes: usize,
}

impl Sinks {
    /// Delivers rows that all belong to `route`; one outcome per row, in order.
    pub async fn deliver(&self, route: &Route, rows: &[OutboxRow]) -> Vec<Outcome> {
        match route.config.sink {
            SinkKind::Qstash => {
                self.qstash
                    .deliver(&self.client, route, rows, self.max_message_bytes)
                    .await
            }
            SinkKind::Webhook => {
                webhook::deliver(&self.client, route, rows, self.max_message_bytes).await
            }
        }
    }
}
