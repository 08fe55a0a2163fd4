//! Where events go: QStash (`/v2/batch`, `/v2/publish`) or a signed webhook,
//! over one shared keep-alive hyper client. A sink turns rows into requests and
//! answers into one [`Outcome`] per row; it never touches the database.

pub mod breaker;
pub mod cloudevents;
pub mod http;
pub mod limits;
pub mod qstash;
pub mod webhook;

use std::time::{Duration, SystemTime};

use outbox_client::row::OutboxRow;

use crate::backoff::parse_retry_after;
use crate::routes::{BodyShape, Route, SinkKind, TemplateValues};

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
    /// The sink refused our credentials (401/403): a configuration problem.
    Unauthorized,
    /// One message of a QStash batch came back with an error.
    BatchElement,
    /// A 2xx whose body does not say, message by message, what was accepted.
    UnreadableAnswer,
    /// A 3xx: the route's URL points somewhere else (http → https, a moved
    /// endpoint); requests are not followed, so it is a configuration problem.
    Redirect,
}

impl RetryReason {
    /// Every reason: the label values the metrics export from start.
    pub(crate) const ALL: [RetryReason; 9] = [
        RetryReason::ServerError,
        RetryReason::RateLimited,
        RetryReason::Timeout,
        RetryReason::Connect,
        RetryReason::Network,
        RetryReason::Unauthorized,
        RetryReason::BatchElement,
        RetryReason::UnreadableAnswer,
        RetryReason::Redirect,
    ];

    pub fn as_str(&self) -> &'static str {
        match self {
            RetryReason::ServerError => "server_error",
            RetryReason::RateLimited => "rate_limited",
            RetryReason::Timeout => "timeout",
            RetryReason::Connect => "connect",
            RetryReason::Network => "network",
            RetryReason::Unauthorized => "unauthorized",
            RetryReason::BatchElement => "batch_element",
            RetryReason::UnreadableAnswer => "unreadable_answer",
            RetryReason::Redirect => "redirect",
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
    /// QStash took the last allowed attempt of an ordered route's event and
    /// no callback said what the destination answered before the hold ran out.
    Unanswered,
}

impl DeadReason {
    /// Every reason: the label values the metrics export from start.
    pub(crate) const ALL: [DeadReason; 6] = [
        DeadReason::Rejected,
        DeadReason::TooLarge,
        DeadReason::NoRoute,
        DeadReason::BadDestination,
        DeadReason::Exhausted,
        DeadReason::Unanswered,
    ];

    /// The sink answered about this message (rather than the relay giving up
    /// on it before sending).
    pub(crate) fn reached_sink(&self) -> bool {
        matches!(self, DeadReason::Rejected)
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            DeadReason::Rejected => "rejected",
            DeadReason::Unanswered => "unanswered",
            DeadReason::TooLarge => "too_large",
            DeadReason::NoRoute => "no_route",
            DeadReason::BadDestination => "bad_destination",
            DeadReason::Exhausted => "exhausted",
        }
    }
}

/// Longest `last_error` we store.
pub(crate) const MAX_ERROR_CHARS: usize = 2000;

/// Bounds an error text to `max_chars` and makes it safe to store and read:
/// control characters (NUL included, which PostgreSQL refuses in `text`)
/// become spaces and runs of white space fold to one.
pub fn truncate(s: String, max_chars: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max_chars * 4));
    let mut chars = 0;
    let mut space = false;
    for c in s.chars() {
        if chars == max_chars {
            out.push('…');
            break;
        }
        if c.is_control() || c.is_whitespace() {
            if !space && !out.is_empty() {
                out.push(' ');
                chars += 1;
            }
            space = true;
            continue;
        }
        space = false;
        out.push(c);
        chars += 1;
    }
    if out.ends_with(' ') {
        out.pop();
    }
    out
}

/// A response body as a readable, bounded text: the text itself when it is
/// mostly text, else a line that says what it was (compressed or binary).
pub(crate) fn body_text(body: &[u8], max_chars: usize) -> String {
    // Enough bytes for `max_chars` characters of any width; the rest is never read.
    let head = &body[..body.len().min(max_chars * 4)];
    let text = String::from_utf8_lossy(head);
    let odd = text
        .chars()
        .filter(|&c| c == char::REPLACEMENT_CHARACTER || (c.is_control() && !c.is_whitespace()))
        .count();
    let total = text.chars().count().max(1);
    if odd * 10 > total {
        let start: Vec<String> = body.iter().take(8).map(|b| format!("{b:02x}")).collect();
        return format!(
            "(binary body of {} bytes, starting {})",
            body.len(),
            start.join(" ")
        );
    }
    let mut text = truncate(text.into_owned(), max_chars);
    if body.len() > head.len() && !text.ends_with('…') {
        text.push('…');
    }
    text
}

/// The usual reading of an HTTP answer.
pub(crate) fn classify(response: &Response) -> Outcome {
    let status = response.status;
    if status.is_success() {
        return Outcome::Published;
    }
    let error = format!(
        "HTTP {}: {}",
        status.as_u16(),
        body_text(&response.body, MAX_ERROR_CHARS)
    );
    let reason = match status.as_u16() {
        408 => Some(RetryReason::Timeout),
        429 => Some(RetryReason::RateLimited),
        // The destination refuses our credentials: a problem of the route
        // (a revoked token, a rotated secret), not of the event.
        401 | 403 => Some(RetryReason::Unauthorized),
        300..=399 => Some(RetryReason::Redirect),
        _ if status.is_server_error() => Some(RetryReason::ServerError),
        _ => None,
    };
    if let Some(reason) = reason {
        Outcome::Retry {
            after: wait_asked(&response.headers, SystemTime::now()),
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

/// How long an answer asks us to wait: the longest of `Retry-After` and
/// QStash's quota resets (`RateLimit-Reset` for the daily quota,
/// `Burst-RateLimit-Reset` for the per-second one), capped at a day.
pub(crate) fn wait_asked(headers: &::http::HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let retry_after = value("retry-after").and_then(|v| parse_retry_after(v, now));
    let resets = ["ratelimit-reset", "burst-ratelimit-reset"]
        .into_iter()
        .filter_map(|name| value(name).and_then(|v| parse_reset(v, now)));
    retry_after.into_iter().chain(resets).max()
}

/// A rate-limit reset: a unix time in seconds (or milliseconds), or, when
/// too small to be one, a number of seconds from now.
pub(crate) fn parse_reset(value: &str, now: SystemTime) -> Option<Duration> {
    let n: f64 = value.trim().parse().ok()?;
    if !n.is_finite() || n < 0.0 {
        return None;
    }
    let since_epoch = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .ok()?
        .as_secs_f64();
    let secs = if n >= 1e12 {
        n / 1000.0 - since_epoch
    } else if n >= 1e9 {
        n - since_epoch
    } else {
        n
    };
    Some(Duration::from_secs_f64(secs.max(0.0)).min(crate::backoff::MAX_RETRY_AFTER))
}

pub(crate) fn transport_outcome(e: &TransportError) -> Outcome {
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
        BodyShape::Payload | BodyShape::CloudeventsBinary => row.payload.clone().into_bytes(),
        BodyShape::Cloudevents => cloudevents::structured(row, cloudevents_source(route)),
    }
}

/// The `content-type` of the body a route sends.
pub fn content_type(route: &Route) -> &'static str {
    match route.config.body {
        BodyShape::Cloudevents => cloudevents::STRUCTURED_CONTENT_TYPE,
        _ => "application/json",
    }
}

/// The CloudEvents `source` of a route's events.
pub(crate) fn cloudevents_source(route: &Route) -> &str {
    route
        .config
        .cloudevents_source
        .as_deref()
        .unwrap_or(cloudevents::DEFAULT_SOURCE)
}

/// The route's destination for a row, checked to be a URL.
pub fn destination(route: &Route, row: &OutboxRow) -> Result<String, Outcome> {
    let tenant = row.tenant_id.hyphenated().to_string();
    let url = route.config.destination.render(&TemplateValues {
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
                format!(
                    "destination `{}` is not a valid URL",
                    crate::redact::url(&url)
                ),
                MAX_ERROR_CHARS,
            ),
        }),
    }
}

/// Every sink the routes use, sharing one client, with a circuit breaker per route.
pub(crate) struct Sinks {
    pub client: HttpClient,
    pub qstash: qstash::QstashSink,
    pub max_message_bytes: usize,
    pub breakers: std::sync::Arc<breaker::Breakers>,
    /// Webhook routes' and destination hosts' limits.
    pub limits: limits::Limits,
}

impl Sinks {
    /// Delivers rows that all belong to `route`, each when its ticket says
    /// (webhook routes, [`limits`]); one outcome per row, in order.
    pub(crate) async fn deliver(
        &self,
        route: &Route,
        rows: &[OutboxRow],
        tickets: Vec<limits::Ticket>,
    ) -> Vec<Outcome> {
        match route.config.sink {
            SinkKind::Qstash => {
                self.qstash
                    .deliver(&self.client, route, rows, self.max_message_bytes)
                    .await
            }
            SinkKind::Webhook => {
                webhook::deliver_paced(&self.client, route, rows, self.max_message_bytes, tickets)
                    .await
            }
        }
    }
}
