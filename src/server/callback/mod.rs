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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::sync::Semaphore;

use metrics::counter;

use crate::metrics as m;
use crate::store::callbacks::{DeliveryOutcome, ReportedDead, ReportedOutcome};
use crate::store::{Store, StoreError};
use outbox_client::consumer::qstash::{SignatureError, Verifier};

mod report;

use report::qstash_next_attempt_in;
pub use report::{
    parse_delivery_report, parse_failure_report, ParsedOutcome, ParsedReport, ReportError, Verdict,
};

pub const FAILURE_PATH: &str = "/qstash/failure";
pub const CALLBACK_PATH: &str = "/qstash/callback";

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
