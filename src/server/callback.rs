//! QStash's callbacks, on a listener of their own:
//!
//! - `POST /qstash/failure` (a route's `failure_callback`): a message has used
//!   up its retries; the final failure is recorded on the outbox row
//!   (`dead_lettered_at`, `last_error`), so `outbox-relay dlq` sees it.
//! - `POST /qstash/callback` (an ordered QStash route's `callback`): the
//!   destination's answer to one delivery attempt. The relay held the row
//!   (and so its key) since QStash took it; a 2xx publishes it, a failure
//!   QStash will retry keeps holding it, and the last failed attempt
//!   dead-letters it. Either end lets the key's next event go out: the relays
//!   are woken through the outbox's id sequence, which their listeners watch.
//!
//! Reports are signed like any delivery. Before the body is read, the
//! signature must hold and its `sub` must be one of the URLs the routes name
//! for that endpoint (a report QStash made for another endpoint is refused);
//! the body is then read within a size and time bound, and a limited number
//! of reports are handled at once. A report counts only for the attempt it is
//! about: the row's current deduplication id must be the one it names, so a
//! late report never touches a row that was replayed since.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
use base64::Engine;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::Deserialize;
use tokio::sync::Semaphore;

use metrics::counter;

use crate::metrics as m;
use crate::store::callbacks::{DeliveryOutcome, ReportedDead, ReportedOutcome};
use crate::store::{Store, StoreError};
use outbox_client::consumer::qstash::{SignatureError, Verifier};

pub const FAILURE_PATH: &str = "/qstash/failure";
pub const CALLBACK_PATH: &str = "/qstash/callback";

/// `last_error` keeps this many characters of the destination's answer.
pub(crate) const MAX_ERROR_BODY_CHARS: usize = 2000;

/// The `outcome` label values of the delivery callbacks' counter: each
/// [`Verdict`], and `stale`.
pub(crate) const CALLBACK_OUTCOMES: [&str; 4] = ["delivered", "retrying", "failed", "stale"];

/// Reports carry the original message and the response, both base64: room
/// for a 1 MB message and a 1 MB response.
pub(crate) const DEFAULT_MAX_REPORT_BYTES: usize = 4 * 1024 * 1024;

/// How long a client may take to send a report's body.
pub(crate) const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Reports handled at once; more wait for a slot ([`DEFAULT_SLOT_WAIT`]).
pub(crate) const DEFAULT_MAX_CONCURRENT: usize = 8;

/// How long a report waits for a slot before it is answered 503 (QStash
/// retries it). A burst of callbacks (one per key an ordered route has out)
/// queues for the few milliseconds each write takes instead of being turned
/// away, which would leave its row held until QStash's retry of the callback,
/// or, once those run out, until the route's `callback_timeout`.
pub(crate) const DEFAULT_SLOT_WAIT: Duration = Duration::from_secs(5);

/// Connections open at once; more wait to be accepted.
pub(crate) const DEFAULT_MAX_CONNECTIONS: usize = 64;

/// A connection on which nothing moves for this long is closed.
pub(crate) const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Header names (lowercase) that carry the outbox row id, in order of trust.
const ID_HEADERS: &[&str] = &["x-outbox-id", "x-event-id"];

/// Header names (lowercase) that carry the deduplication id of the attempt
/// the report is about: the relay forwards the first with every message.
const KEY_HEADERS: &[&str] = &["x-outbox-idempotency-key", "upstash-deduplication-id"];

// Marks the row only while its current deduplication id is the reported one
// and QStash took it (published_at), so a report on an attempt that a replay
// replaced never touches the row again. A second report for the same attempt
// (QStash retries callbacks) keeps the first dead-letter time. Answers the
// row's current key and whether it was marked; no row when the id is unknown.
/// How the listener guards itself before a report is verified.
#[derive(Debug, Clone)]
pub struct CallbackOptions {
    /// The URLs QStash calls the failure endpoint at (the routes'
    /// `failure_callback`): the signature's `sub` must be one of them. None
    /// means every failure report is refused.
    pub urls: Vec<String>,
    /// The same for delivery callbacks (the routes' `callback`).
    pub callback_urls: Vec<String>,
    /// How much longer a row stays held after QStash's next attempt when a
    /// callback says QStash will try the destination again (the longest of
    /// the routes' `callback_timeout`).
    pub hold: Duration,
    /// A longer body is refused (413) without being read to its end.
    pub max_body_bytes: usize,
    /// The whole body must arrive within this (else 408).
    pub read_timeout: Duration,
    /// Reports handled at once; more wait up to `slot_wait` for a slot,
    /// then get 503 with `Retry-After`.
    pub max_concurrent: usize,
    /// How long a report waits for one of the `max_concurrent` slots.
    pub slot_wait: Duration,
    /// Connections open at once ([`serve`]); more wait to be accepted.
    pub max_connections: usize,
    /// A connection that sends and receives nothing for this long is closed
    /// ([`serve`]), headers not yet complete included.
    pub idle_timeout: Duration,
    /// Rows this listener dead-lettered (a failure report, or a delivery
    /// callback on QStash's last failed attempt); `drain` reports them.
    pub dead_lettered: Arc<AtomicU64>,
}

impl CallbackOptions {
    /// The defaults, for reports sent to `urls`.
    pub fn new<S: Into<String>>(urls: impl IntoIterator<Item = S>) -> CallbackOptions {
        CallbackOptions {
            urls: urls.into_iter().map(Into::into).collect(),
            callback_urls: Vec::new(),
            hold: Duration::from_secs(9 * 60),
            max_body_bytes: DEFAULT_MAX_REPORT_BYTES,
            read_timeout: DEFAULT_READ_TIMEOUT,
            max_concurrent: DEFAULT_MAX_CONCURRENT,
            slot_wait: DEFAULT_SLOT_WAIT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            dead_lettered: Arc::default(),
        }
    }
}

/// Serves the failure callback on `addr` until `shutdown` resolves, with the
/// connection limits of `options` (the report limits are the router's).
pub async fn serve(
    addr: std::net::SocketAddr,
    store: Store,
    verifier: Verifier,
    options: CallbackOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let (max_connections, idle_timeout) = (options.max_connections, options.idle_timeout);
    let router = callback_router(store, verifier, options);
    super::guarded::serve(addr, router, max_connections, idle_timeout, shutdown).await
}

struct CallbackState {
    store: Store,
    verifier: Verifier,
    options: CallbackOptions,
    slots: Arc<Semaphore>,
}

/// `POST /qstash/failure` and `POST /qstash/callback`.
pub fn callback_router(store: Store, verifier: Verifier, options: CallbackOptions) -> Router {
    let slots = Arc::new(Semaphore::new(options.max_concurrent.max(1)));
    Router::new()
        .route(FAILURE_PATH, post(failure_callback))
        .route(CALLBACK_PATH, post(delivery_callback))
        .with_state(Arc::new(CallbackState {
            store,
            verifier,
            options,
            slots,
        }))
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
    /// The destination's answer's headers (delivery callbacks).
    #[serde(default)]
    header: HashMap<String, HeaderValues>,
    #[serde(default)]
    source_body: Option<String>,
}

#[derive(Debug)]
enum Rejection {
    Busy,
    Unauthorized(String),
    TooLarge(usize),
    SlowBody(Duration),
    BadReport(String),
    UnknownRow(i64),
    /// The report is about an attempt the row no longer is on.
    Stale(String),
    Database(StoreError),
}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        match self {
            Rejection::Busy => {
                let mut r =
                    (StatusCode::SERVICE_UNAVAILABLE, "too many reports at once").into_response();
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                r
            }
            Rejection::Unauthorized(why) => (StatusCode::UNAUTHORIZED, why).into_response(),
            Rejection::TooLarge(max) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("a report is at most {max} bytes"),
            )
                .into_response(),
            Rejection::SlowBody(limit) => (
                StatusCode::REQUEST_TIMEOUT,
                format!("the report's body did not arrive within {limit:?}"),
            )
                .into_response(),
            Rejection::BadReport(why) => (StatusCode::BAD_REQUEST, why).into_response(),
            Rejection::UnknownRow(id) => {
                (StatusCode::NOT_FOUND, format!("no outbox row {id}")).into_response()
            }
            Rejection::Stale(why) => (StatusCode::CONFLICT, why).into_response(),
            // QStash retries the callback: the row gets marked once the database is back.
            Rejection::Database(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "database unavailable").into_response()
            }
        }
    }
}

async fn failure_callback(State(state): State<Arc<CallbackState>>, request: Request) -> Response {
    match record_failure(&state, request).await {
        Ok(id) => (StatusCode::OK, format!("outbox row {id} dead-lettered")).into_response(),
        Err(rejection) => {
            match &rejection {
                Rejection::Busy => tracing::warn!("failure callback: too many reports at once"),
                Rejection::Unauthorized(why) => {
                    tracing::warn!(reason = %why, "failure callback: bad signature")
                }
                Rejection::TooLarge(max) => {
                    tracing::warn!(max, "failure callback: report too large")
                }
                Rejection::SlowBody(limit) => {
                    tracing::warn!(?limit, "failure callback: report body too slow")
                }
                Rejection::BadReport(why) => {
                    tracing::warn!(reason = %why, "failure callback: malformed report")
                }
                Rejection::UnknownRow(id) => {
                    tracing::warn!(id, "failure callback: no such outbox row")
                }
                Rejection::Stale(why) => {
                    tracing::warn!(reason = %why, "failure callback: report on a replaced attempt")
                }
                Rejection::Database(e) => {
                    tracing::warn!(error = %e, "failure callback: database error")
                }
            }
            rejection.into_response()
        }
    }
}

async fn record_failure(state: &CallbackState, request: Request) -> Result<i64, Rejection> {
    let (_slot, body) = take_verified(state, &state.options.urls, request).await?;
    let report = parse_failure_report(&body).map_err(|e| Rejection::BadReport(e.0))?;
    let marked = state
        .store
        .reported_dead(
            report.outbox_id,
            &report.last_error,
            &report.deduplication_id,
        )
        .await
        .map_err(Rejection::Database)?;
    match marked {
        ReportedDead::Marked => {
            state.options.dead_lettered.fetch_add(1, Ordering::Relaxed);
        }
        ReportedDead::Unknown => return Err(Rejection::UnknownRow(report.outbox_id)),
        ReportedDead::Replaced { current } => {
            return Err(Rejection::Stale(format!(
                "outbox row {} is now on deduplication id {current:?}, the report is about {:?}: not marked",
                report.outbox_id, report.deduplication_id
            )))
        }
        ReportedDead::NotPublished => {
            return Err(Rejection::Stale(format!(
                "outbox row {} is not published under {:?} yet: not marked",
                report.outbox_id, report.deduplication_id
            )))
        }
    }
    tracing::info!(
        id = report.outbox_id,
        status = report.status,
        source_message_id = report.source_message_id.as_deref().unwrap_or(""),
        url = report.url.as_deref().unwrap_or(""),
        "QStash gave up on an outbox row; dead-lettered"
    );
    Ok(report.outbox_id)
}

async fn delivery_callback(State(state): State<Arc<CallbackState>>, request: Request) -> Response {
    match record_outcome(&state, request).await {
        Ok((id, outcome)) => {
            (StatusCode::OK, format!("outbox row {id}: {outcome}")).into_response()
        }
        Err(rejection) => {
            if let Rejection::Stale(_) = rejection {
                counter!(m::CALLBACKS, "outcome" => "stale").increment(1);
            }
            tracing::warn!(rejection = ?rejection, "delivery callback refused");
            rejection.into_response()
        }
    }
}

/// Writes what a delivery callback says; the outbox id and what was done.
async fn record_outcome(
    state: &CallbackState,
    request: Request,
) -> Result<(i64, &'static str), Rejection> {
    let (_slot, body) = take_verified(state, &state.options.callback_urls, request).await?;
    let report = parse_delivery_report(&body).map_err(|e| Rejection::BadReport(e.0))?;
    let outcome = match report.verdict {
        Verdict::Delivered => DeliveryOutcome::Delivered,
        // Held until QStash's next attempt, and its callback's wait after it.
        Verdict::Retrying => DeliveryOutcome::Retrying {
            hold: qstash_next_attempt_in(report.retried) + state.options.hold,
        },
        Verdict::Failed => DeliveryOutcome::Failed,
    };
    let marked = state
        .store
        .reported_outcome(
            report.outbox_id,
            &report.deduplication_id,
            outcome,
            &report.last_error,
        )
        .await
        .map_err(Rejection::Database)?;
    let label = report.verdict.as_str();
    debug_assert!(CALLBACK_OUTCOMES.contains(&label));
    match marked {
        ReportedOutcome::Marked => {
            counter!(m::CALLBACKS, "outcome" => label).increment(1);
            if report.verdict == Verdict::Failed {
                state.options.dead_lettered.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(id = report.outbox_id, status = report.status, error = %report.last_error, "QStash's last delivery attempt failed; dead-lettered");
            }
            Ok((report.outbox_id, label))
        }
        // QStash sent it again, or it came after the row was settled: done.
        ReportedOutcome::Final => Ok((report.outbox_id, "already final")),
        ReportedOutcome::Unknown => Err(Rejection::UnknownRow(report.outbox_id)),
        ReportedOutcome::Replaced { current } => Err(Rejection::Stale(format!(
            "outbox row {} is now on deduplication id {current:?}, the callback is about {:?}: not marked",
            report.outbox_id, report.deduplication_id
        ))),
    }
}

/// A request slot (refused when none frees within `slot_wait`) and the
/// verified body: the slot is held while the report is written.
async fn take_verified(
    state: &CallbackState,
    urls: &[String],
    request: Request,
) -> Result<(tokio::sync::OwnedSemaphorePermit, bytes::Bytes), Rejection> {
    let slot = tokio::time::timeout(state.options.slot_wait, state.slots.clone().acquire_owned())
        .await
        .map_err(|_| Rejection::Busy)?
        .map_err(|_| Rejection::Busy)?;
    let (parts, body) = request.into_parts();
    let body = read_verified(state, urls, &parts.headers, body).await?;
    Ok((slot, body))
}

/// The signature (key, times, and `sub` among `urls`) before a byte of the
/// body is read; then the body within the size and time bounds; then its
/// hash against the signature.
async fn read_verified(
    state: &CallbackState,
    urls: &[String],
    headers: &HeaderMap,
    body: axum::body::Body,
) -> Result<bytes::Bytes, Rejection> {
    let unauthorized = |e: SignatureError| Rejection::Unauthorized(e.to_string());
    let token = state
        .verifier
        .verify_token_headers(headers, None)
        .map_err(unauthorized)?;
    let subject = token.claims().subject.as_deref();
    if !subject.is_some_and(|s| urls.iter().any(|url| url == s)) {
        return Err(unauthorized(SignatureError::WrongSubject {
            found: subject.map(str::to_owned),
            expected: urls.join(" or "),
        }));
    }
    let max = state.options.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(Rejection::TooLarge(max));
    }
    let limit = state.options.read_timeout;
    let collected = tokio::time::timeout(limit, Limited::new(body, max).collect())
        .await
        .map_err(|_| Rejection::SlowBody(limit))?;
    let body = match collected {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => return Err(Rejection::TooLarge(max)),
        Err(e) => return Err(Rejection::BadReport(format!("cannot read the body: {e}"))),
    };
    token.check_body(&body).map_err(unauthorized)?;
    Ok(body)
}

/// Why a report cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportError(pub String);

impl std::fmt::Display for ReportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ReportError {}

/// What a failure report says, as the listener uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedReport {
    pub outbox_id: i64,
    /// The deduplication id of the attempt QStash gave up on.
    pub deduplication_id: String,
    /// The destination's last status (never 2xx).
    pub status: u16,
    /// What goes into the row's `last_error`.
    pub last_error: String,
    pub source_message_id: Option<String>,
    pub url: Option<String>,
}

/// Parses a failure report's body (the signature is checked elsewhere): a
/// report of a success, or one that does not name the outbox row and the
/// attempt, is an error naming what is wrong.
pub fn parse_failure_report(body: &[u8]) -> Result<ParsedReport, ReportError> {
    let report: FailureReport = serde_json::from_slice(body)
        .map_err(|e| ReportError(format!("not a QStash failure report: {e}")))?;
    if (200..300).contains(&report.status) {
        return Err(ReportError(format!(
            "status {} is a success, not a failure: only failure reports are taken",
            report.status
        )));
    }
    let outbox_id = outbox_id(&report)?;
    let deduplication_id = header_value(&report, KEY_HEADERS)
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| {
            ReportError("no X-Outbox-Idempotency-Key in sourceHeader: cannot tell which attempt the report is about".into())
        })?
        .to_owned();
    let last_error = describe(&report)?;
    Ok(ParsedReport {
        outbox_id,
        deduplication_id,
        status: report.status,
        last_error,
        source_message_id: report.source_message_id,
        url: report.url,
    })
}

/// What a delivery callback says of one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The destination answered 2xx.
    Delivered,
    /// It did not, and QStash will try again.
    Retrying,
    /// It did not, and that was the last attempt (retries used up, or the
    /// destination said not to retry: 489 with `Upstash-NonRetryable-Error`).
    Failed,
}

impl Verdict {
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Delivered => "delivered",
            Verdict::Retrying => "retrying",
            Verdict::Failed => "failed",
        }
    }
}

/// What a delivery callback says, as the listener uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedOutcome {
    pub outbox_id: i64,
    /// The deduplication id of the attempt the callback is about.
    pub deduplication_id: String,
    pub status: u16,
    pub verdict: Verdict,
    /// Retries QStash made so far (`retried`), when the report says.
    pub retried: Option<u32>,
    /// What goes into the row's `last_error` when it was not delivered.
    pub last_error: String,
}

/// How long QStash waits after retry number `retried` before its next
/// attempt, by its default schedule (the relay sends no
/// `Upstash-Retry-Delay`): e^(2.5·n) seconds for retry n, at most a day
/// (12 s, 2 min 28 s, 30 min, 6 h, then a day). A report without `retried`
/// counts as the first failure.
pub(crate) fn qstash_next_attempt_in(retried: Option<u32>) -> Duration {
    let n = retried.unwrap_or(0).saturating_add(1).min(100);
    Duration::from_secs_f64((2.5 * f64::from(n)).exp().min(86_400.0))
}

/// Parses a delivery callback's body (the signature is checked elsewhere):
/// the same report as a failure callback's, about any attempt. A failure
/// without `retried` and `maxRetries` is taken as one QStash retries (the row
/// stays held; if nothing else comes, its hold runs out and it is sent again).
pub fn parse_delivery_report(body: &[u8]) -> Result<ParsedOutcome, ReportError> {
    let report: FailureReport = serde_json::from_slice(body)
        .map_err(|e| ReportError(format!("not a QStash callback report: {e}")))?;
    let outbox_id = outbox_id(&report)?;
    let deduplication_id = header_value(&report, KEY_HEADERS)
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| {
            ReportError("no X-Outbox-Idempotency-Key in sourceHeader: cannot tell which attempt the callback is about".into())
        })?
        .to_owned();
    let non_retryable = report.status == 489
        && report.header.iter().any(|(name, values)| {
            name.eq_ignore_ascii_case("upstash-nonretryable-error")
                && values
                    .first()
                    .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
        });
    let verdict = if (200..300).contains(&report.status) {
        Verdict::Delivered
    } else if non_retryable
        || matches!((report.retried, report.max_retries), (Some(r), Some(max)) if r >= max)
    {
        Verdict::Failed
    } else {
        Verdict::Retrying
    };
    let last_error = if verdict == Verdict::Delivered {
        String::new()
    } else {
        describe(&report)?
    };
    Ok(ParsedOutcome {
        outbox_id,
        deduplication_id,
        status: report.status,
        verdict,
        retried: report.retried,
        last_error,
    })
}

/// The first of `names` (lowercase, in order) found in `sourceHeader`, any case.
fn header_value<'a>(report: &'a FailureReport, names: &[&str]) -> Option<&'a str> {
    names.iter().find_map(|wanted| {
        report
            .source_header
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(wanted))
            .and_then(|(_, v)| v.first())
    })
}

/// The outbox id the relay forwarded: a header first, else the `id` of the
/// JSON envelope in the original body.
fn outbox_id(report: &FailureReport) -> Result<i64, ReportError> {
    if let Some(value) = header_value(report, ID_HEADERS) {
        return value
            .trim()
            .parse()
            .map_err(|_| ReportError(format!("outbox id header {value:?} is not an outbox id")));
    }
    let Some(encoded) = &report.source_body else {
        return Err(ReportError(
            "no X-Outbox-Id in sourceHeader and no sourceBody".into(),
        ));
    };
    let source =
        decode_base64(encoded).ok_or_else(|| ReportError("sourceBody is not base64".into()))?;
    let envelope: serde_json::Value = serde_json::from_slice(&source).map_err(|_| {
        ReportError("no X-Outbox-Id in sourceHeader and sourceBody is not JSON".into())
    })?;
    match envelope.get("id") {
        Some(serde_json::Value::Number(n)) => n.as_i64(),
        Some(serde_json::Value::String(s)) => s.trim().parse().ok(),
        _ => None,
    }
    .ok_or_else(|| {
        ReportError("no X-Outbox-Id in sourceHeader and no numeric `id` in sourceBody".into())
    })
}

/// `qstash: status 500 after 3 retries: <response body> (dlqId …)`.
fn describe(report: &FailureReport) -> Result<String, ReportError> {
    let response = match &report.body {
        None => String::new(),
        Some(encoded) => {
            let bytes =
                decode_base64(encoded).ok_or_else(|| ReportError("body is not base64".into()))?;
            crate::sink::body_text(&bytes, MAX_ERROR_BODY_CHARS)
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
    // Storable and readable whatever the destination answered: no control
    // characters (PostgreSQL refuses NUL in text), bounded.
    Ok(crate::sink::truncate(text, MAX_ERROR_BODY_CHARS + 200))
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
        assert!(outbox_id(&r).is_err());
        let r = report(serde_json::json!({"status": 500}));
        assert!(outbox_id(&r).is_err());
    }

    #[test]
    fn last_error_is_truncated_and_names_the_dlq_entry() {
        let long = "é".repeat(3000);
        let r = report(serde_json::json!({
            "status": 502, "retried": 3, "body": STANDARD.encode(&long), "dlqId": "17-0"
        }));
        let text = describe(&r).unwrap();
        assert!(text.starts_with("qstash: status 502 after 3 retries: éé"));
        assert!(text.ends_with("é… (dlqId 17-0)"), "{text}");
        assert_eq!(text.matches('é').count(), MAX_ERROR_BODY_CHARS);
    }

    #[test]
    fn last_error_from_a_binary_answer_is_storable_text() {
        let r = report(serde_json::json!({
            "status": 500, "retried": 3,
            "body": STANDARD.encode(b"oops\x00 \x1b[31m\xff\xfe"), "dlqId": "1\u{0}7"
        }));
        let text = describe(&r).unwrap();
        // PostgreSQL refuses NUL in text: the dead letter would not be recorded.
        assert!(!text.chars().any(char::is_control), "{text:?}");
        assert!(
            text.starts_with("qstash: status 500 after 3 retries: (binary body of 13 bytes"),
            "{text:?}"
        );
    }

    fn delivery(json: serde_json::Value) -> Result<ParsedOutcome, ReportError> {
        parse_delivery_report(&serde_json::to_vec(&json).unwrap())
    }

    fn about(status: u16, retried: u32) -> serde_json::Value {
        serde_json::json!({
            "status": status, "retried": retried, "maxRetries": 3,
            "body": STANDARD.encode(b"answer"),
            "sourceHeader": {"X-Outbox-Id": ["7"], "X-Outbox-Idempotency-Key": ["k-7"]}
        })
    }

    /// A "retrying" callback holds the row past QStash's next attempt, so a
    /// short `callback_timeout` does not run out while QStash waits 30
    /// minutes before its third retry (and re-send a second copy).
    #[test]
    fn a_retrying_callback_holds_until_after_qstashs_next_attempt() {
        let secs = |retried| qstash_next_attempt_in(retried).as_secs();
        assert_eq!(secs(None), 12);
        assert_eq!(secs(Some(0)), 12);
        assert_eq!(secs(Some(1)), 148);
        assert_eq!(secs(Some(2)), 1808);
        assert_eq!(secs(Some(3)), 22026);
        assert_eq!(secs(Some(4)), 86_400);
        assert_eq!(secs(Some(u32::MAX)), 86_400);
        assert_eq!(delivery(about(503, 2)).unwrap().retried, Some(2));
    }

    #[test]
    fn a_delivery_callback_says_delivered_retrying_or_failed() {
        let ok = delivery(about(204, 1)).unwrap();
        assert_eq!(
            (ok.outbox_id, ok.deduplication_id.as_str(), ok.verdict),
            (7, "k-7", Verdict::Delivered)
        );
        assert!(ok.last_error.is_empty());
        let again = delivery(about(503, 1)).unwrap();
        assert_eq!(again.verdict, Verdict::Retrying);
        assert!(again
            .last_error
            .starts_with("qstash: status 503 after 1 retries: answer"));
        assert_eq!(delivery(about(503, 3)).unwrap().verdict, Verdict::Failed);
        // No answer at all (QStash reports status 0): a failure like any other.
        assert_eq!(delivery(about(0, 2)).unwrap().verdict, Verdict::Retrying);
        // 489 with Upstash-NonRetryable-Error: QStash stops at once.
        let mut stop = about(489, 0);
        stop["header"] = serde_json::json!({"Upstash-NonRetryable-Error": ["true"]});
        assert_eq!(delivery(stop).unwrap().verdict, Verdict::Failed);
        assert_eq!(delivery(about(489, 0)).unwrap().verdict, Verdict::Retrying);
        // Without the counts, a failure is taken as one QStash retries.
        let mut unknown = about(500, 3);
        unknown.as_object_mut().unwrap().remove("maxRetries");
        assert_eq!(delivery(unknown).unwrap().verdict, Verdict::Retrying);
    }

    #[test]
    fn a_delivery_callback_must_say_which_attempt_it_is_about() {
        let mut no_key = about(200, 0);
        no_key["sourceHeader"] = serde_json::json!({"X-Outbox-Id": ["7"]});
        let e = delivery(no_key).unwrap_err();
        assert!(e.0.contains("X-Outbox-Idempotency-Key"), "{e}");
        assert!(parse_delivery_report(b"not json").is_err());
    }
}
