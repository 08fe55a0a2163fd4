//! A QStash-compatible sink for load tests and the relay's own tests.
//!
//! Speaks QStash's two publish endpoints over HTTP/1.1 and h2c:
//!
//! - `POST /v2/publish/{destination}`: the destination is everything after
//!   `/v2/publish/`, a full `http(s)://` URL, with the request's query string
//!   minus `qstash_token` and `upstash-*` keys (QStash does not document this:
//!   docs/qstash-protocol.md, "The load-test sink").
//!   Fresh message: `200 {"messageId":"msg_…","url":…,"deduplicated":false}`;
//!   repeated `Upstash-Deduplication-Id` within the window (or repeated
//!   content with `Upstash-Content-Based-Deduplication: true`):
//!   `202 {…,"deduplicated":true}` with the first message's id.
//! - `POST /v2/batch`: a JSON array of `{destination, headers, body, queue?}`,
//!   answered `200` with one object per element, in order.
//!
//! Auth: `Authorization: Bearer <token>` or `?qstash_token=`; else `401`.
//!
//! **Batch element errors.** QStash does not document the shape of a failed
//! element. This sink answers a failed element with
//! `{"error": "<reason>", "status": <code>}` in its slot while the other
//! elements succeed: `status` is 400 for poison (never accepted; a relay should
//! dead-letter) and 503 for an injected transient failure (retry). `status` is
//! our extension: a real QStash may send only `error`, so a relay must not
//! depend on it being there.
//!
//! A batch holding a poison message is refused as a whole by default
//! (`400 {"error": …}`, nothing accepted, as QStash answers a request that
//! fails validation), so a relay isolates the poison by resending one by one;
//! with `faults.poison_rejects_batch = false` the poison element fails alone
//! as above.
//!
//! Every accepted message (fresh or deduplicated) becomes a [`Record`];
//! rejected ones only count in [`SinkStats`]. Faults are in [`faults`];
//! delivery mode (forward to the destination, signed) is in [`DeliveryConfig`].
//!
//! Built on hyper directly rather than an axum router: the destination is the
//! raw path and query (a router would decode it), and a reset needs the
//! connection itself.

pub mod delivery;
pub mod faults;
pub mod signing;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;

pub use delivery::{DeliveryConfig, DeliveryOutcome};
pub use faults::FaultConfig;
use faults::{FaultState, RequestFault};
pub use signing::{DEV_CURRENT_SIGNING_KEY, DEV_NEXT_SIGNING_KEY, DEV_TOKEN};

/// Header carrying the outbox row id (the relay forwards `x-outbox-id`).
pub const OUTBOX_ID_HEADER: &str = "upstash-forward-x-outbox-id";
/// Header carrying the partition key (QStash flow control).
pub const FLOW_CONTROL_KEY_HEADER: &str = "upstash-flow-control-key";
pub const DEDUP_ID_HEADER: &str = "upstash-deduplication-id";
const CONTENT_DEDUP_HEADER: &str = "upstash-content-based-deduplication";
const FORWARD_PREFIX: &str = "upstash-forward-";
/// Largest request body the sink reads.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Config(String),
}

/// How the sink listens and behaves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SinkConfig {
    /// `127.0.0.1:0` picks a free port.
    pub bind: SocketAddr,
    /// The bearer token clients must send.
    pub token: String,
    /// A deduplication id seen within this window is answered 202.
    #[serde(with = "humantime_serde")]
    pub dedup_window: Duration,
    pub faults: FaultConfig,
    /// Forward accepted messages to their destinations; off when `None`.
    pub delivery: Option<DeliveryConfig>,
}

impl Default for SinkConfig {
    fn default() -> Self {
        SinkConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            token: DEV_TOKEN.to_owned(),
            dedup_window: Duration::from_secs(600),
            faults: FaultConfig::default(),
            delivery: None,
        }
    }
}

/// One accepted message, as the sink saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Acceptance order in this sink, from 0; elements of a batch in order.
    pub seq: u64,
    pub message_id: String,
    pub dedup_id: Option<String>,
    /// From `Upstash-Forward-X-Outbox-Id`, else the body's `id`.
    pub outbox_id: Option<i64>,
    /// From `Upstash-Flow-Control-Key`, else the body's `partitionKey`.
    pub partition_key: Option<String>,
    pub destination: String,
    /// Wall clock when accepted, unix microseconds (UTC).
    pub received_at_us: i64,
    /// Answered as a duplicate (202 / `deduplicated: true`).
    pub deduplicated: bool,
    /// The body's `createdAt` (RFC 3339, or a unix number: s, ms or µs by
    /// magnitude), unix microseconds.
    pub created_at_us: Option<i64>,
    pub via_batch: bool,
}

/// Counters since start.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SinkStats {
    pub requests: u64,
    pub publish_requests: u64,
    pub batch_requests: u64,
    /// Messages accepted, duplicates included.
    pub accepted: u64,
    pub deduplicated: u64,
    pub unauthorized: u64,
    pub bad_requests: u64,
    pub poison_rejected: u64,
    pub element_errors: u64,
    pub server_errors: u64,
    pub rate_limited: u64,
    pub hangs: u64,
    pub resets: u64,
    pub lost_responses: u64,
    pub delivered: u64,
    pub delivery_failures: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    publish_requests: AtomicU64,
    batch_requests: AtomicU64,
    accepted: AtomicU64,
    deduplicated: AtomicU64,
    unauthorized: AtomicU64,
    bad_requests: AtomicU64,
    poison_rejected: AtomicU64,
    element_errors: AtomicU64,
    server_errors: AtomicU64,
    rate_limited: AtomicU64,
    hangs: AtomicU64,
    resets: AtomicU64,
    lost_responses: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct Ledger {
    records: Vec<Record>,
    /// dedup key → (message id, first accepted)
    dedup: HashMap<String, (String, Instant)>,
}

struct Shared {
    token: String,
    dedup_window: Duration,
    faults: Mutex<FaultState>,
    ledger: Mutex<Ledger>,
    counters: Counters,
    recorded: watch::Sender<usize>,
    deliverer: Option<Arc<delivery::Deliverer>>,
    shutdown: watch::Receiver<bool>,
}

/// Starts sinks: `Sink::start(SinkConfig::default()).await?`.
pub struct Sink;

impl Sink {
    /// Binds and serves until [`SinkHandle::stop`] (or the handle is dropped).
    pub async fn start(config: SinkConfig) -> Result<SinkHandle, SinkError> {
        config.faults.validate().map_err(SinkError::Config)?;
        let listener = TcpListener::bind(config.bind)
            .await
            .map_err(|source| SinkError::Bind {
                addr: config.bind,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| SinkError::Bind {
            addr: config.bind,
            source,
        })?;
        let (shutdown_tx, shutdown_rx) = watch::channel(false);
        let shared = Arc::new(Shared {
            token: config.token,
            dedup_window: config.dedup_window,
            faults: Mutex::new(FaultState::new(config.faults)),
            ledger: Mutex::new(Ledger {
                records: Vec::new(),
                dedup: HashMap::new(),
            }),
            counters: Counters::default(),
            recorded: watch::channel(0).0,
            deliverer: config.delivery.map(delivery::Deliverer::new),
            shutdown: shutdown_rx,
        });
        let server = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(SinkHandle {
            addr,
            shared,
            shutdown: shutdown_tx,
            server: Some(server),
        })
    }
}

/// A running sink.
pub struct SinkHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl SinkHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL to give a QStash client as `QSTASH_URL`: `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn token(&self) -> &str {
        &self.shared.token
    }

    /// Every accepted message so far, in acceptance order.
    pub fn records(&self) -> Vec<Record> {
        self.shared
            .ledger
            .lock()
            .expect("ledger lock")
            .records
            .clone()
    }

    pub fn record_count(&self) -> usize {
        *self.shared.recorded.borrow()
    }

    pub fn stats(&self) -> SinkStats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let outcomes = self.deliveries();
        SinkStats {
            requests: get(&c.requests),
            publish_requests: get(&c.publish_requests),
            batch_requests: get(&c.batch_requests),
            accepted: get(&c.accepted),
            deduplicated: get(&c.deduplicated),
            unauthorized: get(&c.unauthorized),
            bad_requests: get(&c.bad_requests),
            poison_rejected: get(&c.poison_rejected),
            element_errors: get(&c.element_errors),
            server_errors: get(&c.server_errors),
            rate_limited: get(&c.rate_limited),
            hangs: get(&c.hangs),
            resets: get(&c.resets),
            lost_responses: get(&c.lost_responses),
            delivered: outcomes.iter().filter(|o| o.delivered).count() as u64,
            delivery_failures: outcomes.iter().filter(|o| !o.delivered).count() as u64,
        }
    }

    /// Finished deliveries (delivery mode only), in completion order.
    pub fn deliveries(&self) -> Vec<DeliveryOutcome> {
        self.shared
            .deliverer
            .as_ref()
            .map(|d| d.outcomes())
            .unwrap_or_default()
    }

    /// Replaces the fault configuration (and reseeds its RNG) from the next request on.
    pub fn set_faults(&self, faults: FaultConfig) -> Result<(), SinkError> {
        faults.validate().map_err(SinkError::Config)?;
        *self.shared.faults.lock().expect("faults lock") = FaultState::new(faults);
        Ok(())
    }

    /// Waits until at least `n` messages were accepted; false on timeout.
    pub async fn wait_for_records(&self, n: usize, timeout: Duration) -> bool {
        let mut rx = self.shared.recorded.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|count| *count >= n))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Waits until at least `n` deliveries finished; false on timeout or when
    /// delivery mode is off.
    pub async fn wait_for_deliveries(&self, n: usize, timeout: Duration) -> bool {
        let Some(d) = &self.shared.deliverer else {
            return false;
        };
        let mut rx = d.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|count| *count >= n))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Stops listening, drops open connections and pending deliveries.
    pub async fn stop(mut self) {
        self.shutdown.send_replace(true);
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
        if let Some(d) = &self.shared.deliverer {
            d.abort_all();
        }
    }
}

impl Drop for SinkHandle {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
        if let Some(d) = &self.shared.deliverer {
            d.abort_all();
        }
    }
}

/// Resolves once the shutdown flag is set (or its sender is gone).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut shutdown = shared.shutdown.clone();
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = stopped(&mut shutdown) => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    while conns.try_join_next().is_some() {}
                    conns.spawn(serve_connection(stream, Arc::clone(&shared)));
                }
                Err(e) => {
                    // Out of descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "sink: accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    }
    conns.shutdown().await;
}

async fn serve_connection(stream: tokio::net::TcpStream, shared: Arc<Shared>) {
    let _ = stream.set_nodelay(true);
    let fd = stream.as_raw_fd();
    let kill = Arc::new(Notify::new());
    let mut shutdown = shared.shutdown.clone();
    let svc = {
        let kill = Arc::clone(&kill);
        service_fn(move |req| handle(Arc::clone(&shared), req, Arc::clone(&kill)))
    };
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    tokio::select! {
        _ = &mut conn => {}
        _ = kill.notified() => {
            // Linger 0 turns the close into an RST: the client sees a reset,
            // not a clean end of stream. The fd is still open (conn owns it).
            let linger = libc::linger { l_onoff: 1, l_linger: 0 };
            // SAFETY: `fd` belongs to the stream inside `conn`, alive until the end of this scope.
            unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    &linger as *const libc::linger as *const libc::c_void,
                    std::mem::size_of::<libc::linger>() as libc::socklen_t,
                );
            }
        }
        _ = stopped(&mut shutdown) => {}
    }
}

type Resp = Response<Full<Bytes>>;

fn json_response(status: StatusCode, body: &Value) -> Resp {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("static response parts are valid")
}

fn error_response(status: StatusCode, message: &str) -> Resp {
    json_response(status, &json!({ "error": message }))
}

enum Endpoint {
    Publish,
    Batch,
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    kill: Arc<Notify>,
) -> Result<Resp, Infallible> {
    bump(&shared.counters.requests);
    let (parts, body) = req.into_parts();
    let path = parts.uri.path();
    let endpoint = if path.starts_with("/v2/publish/") {
        Endpoint::Publish
    } else if path == "/v2/batch" {
        Endpoint::Batch
    } else {
        return Ok(error_response(StatusCode::NOT_FOUND, "not found"));
    };
    if parts.method != http::Method::POST {
        return Ok(error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "method not allowed",
        ));
    }
    if !authorized(&shared.token, &parts) {
        bump(&shared.counters.unauthorized);
        return Ok(error_response(StatusCode::UNAUTHORIZED, "Unauthorized"));
    }
    let body = match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            bump(&shared.counters.bad_requests);
            return Ok(error_response(
                StatusCode::BAD_REQUEST,
                &format!("cannot read the body: {e}"),
            ));
        }
    };
    let messages = match endpoint {
        Endpoint::Publish => {
            bump(&shared.counters.publish_requests);
            publish_message(&parts, body).map(|m| vec![m])
        }
        Endpoint::Batch => {
            bump(&shared.counters.batch_requests);
            batch_messages(&body)
        }
    };
    let messages = match messages {
        Ok(m) => m,
        Err(reason) => {
            bump(&shared.counters.bad_requests);
            return Ok(error_response(StatusCode::BAD_REQUEST, &reason));
        }
    };

    let (fault, delay) = {
        let mut f = shared.faults.lock().expect("faults lock");
        (f.draw_request(), f.draw_delay())
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let c = &shared.counters;
    match fault {
        RequestFault::Reset => {
            bump(&c.resets);
            return reset(&kill).await;
        }
        RequestFault::Hang => {
            bump(&c.hangs);
            let hang_for = shared.faults.lock().expect("faults lock").config.hang_for;
            let mut shutdown = shared.shutdown.clone();
            tokio::select! {
                _ = tokio::time::sleep(hang_for) => {}
                _ = stopped(&mut shutdown) => {}
            }
            return reset(&kill).await;
        }
        RequestFault::ServerError => {
            bump(&c.server_errors);
            return Ok(error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "injected server error",
            ));
        }
        RequestFault::RateLimited => {
            bump(&c.rate_limited);
            let secs = shared
                .faults
                .lock()
                .expect("faults lock")
                .config
                .retry_after
                .as_secs();
            let mut resp = error_response(StatusCode::TOO_MANY_REQUESTS, "injected rate limit");
            resp.headers_mut()
                .insert("retry-after", http::HeaderValue::from(secs));
            return Ok(resp);
        }
        RequestFault::None | RequestFault::LostResponse => {}
    }

    if matches!(endpoint, Endpoint::Batch) && shared.poison_rejects_batch() {
        if let Some(error) = messages.iter().find_map(|m| shared.poison_error(m)) {
            // Refused as a whole, as QStash refuses a batch that fails validation:
            // nothing in it is accepted, and the relay resends them one by one.
            bump(&c.poison_rejected);
            return Ok(error_response(
                StatusCode::BAD_REQUEST,
                &format!("{error}; batch refused"),
            ));
        }
    }
    let outcomes: Vec<Outcome> = messages
        .into_iter()
        .map(|m| shared.accept(m, matches!(endpoint, Endpoint::Batch)))
        .collect();
    if fault == RequestFault::LostResponse {
        bump(&c.lost_responses);
        return reset(&kill).await;
    }
    Ok(match endpoint {
        Endpoint::Publish => {
            let outcome = outcomes.into_iter().next().expect("one message");
            match outcome {
                Outcome::Accepted {
                    message_id,
                    url,
                    deduplicated,
                } => json_response(
                    if deduplicated {
                        StatusCode::ACCEPTED
                    } else {
                        StatusCode::OK
                    },
                    &json!({"messageId": message_id, "url": url, "deduplicated": deduplicated}),
                ),
                Outcome::Rejected { status, error } => error_response(status, &error),
            }
        }
        Endpoint::Batch => {
            let elements: Vec<Value> = outcomes
                .into_iter()
                .map(|o| match o {
                    Outcome::Accepted {
                        message_id,
                        url,
                        deduplicated,
                    } => json!({"messageId": message_id, "url": url, "deduplicated": deduplicated}),
                    Outcome::Rejected { status, error } => {
                        json!({"error": error, "status": status.as_u16()})
                    }
                })
                .collect();
            json_response(StatusCode::OK, &Value::Array(elements))
        }
    })
}

/// Drops the connection without an answer (see [`serve_connection`]).
async fn reset(kill: &Notify) -> Result<Resp, Infallible> {
    kill.notify_one();
    std::future::pending().await
}

fn authorized(token: &str, parts: &http::request::Parts) -> bool {
    let bearer = parts
        .headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if bearer == Some(token) {
        return true;
    }
    parts.uri.query().is_some_and(|q| {
        q.split('&')
            .filter_map(|kv| kv.split_once('='))
            .any(|(k, v)| k == "qstash_token" && percent_decode(v) == token)
    })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(if bytes[i] == b'+' { b' ' } else { bytes[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One message to accept, from either endpoint.
struct Message {
    destination: String,
    /// Lowercased names.
    headers: Vec<(String, String)>,
    body: Bytes,
}

impl Message {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

fn publish_message(parts: &http::request::Parts, body: Bytes) -> Result<Message, String> {
    let path = parts
        .uri
        .path()
        .strip_prefix("/v2/publish/")
        .unwrap_or_default();
    let mut destination = path.to_owned();
    if let Some(query) = parts.uri.query() {
        let kept: Vec<&str> = query
            .split('&')
            .filter(|kv| {
                let key = kv.split('=').next().unwrap_or("").to_ascii_lowercase();
                key != "qstash_token" && !key.starts_with("upstash-")
            })
            .collect();
        if !kept.is_empty() {
            destination.push('?');
            destination.push_str(&kept.join("&"));
        }
    }
    check_destination(&destination)?;
    let headers = parts
        .headers
        .iter()
        .filter(|(name, _)| *name != http::header::AUTHORIZATION)
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect();
    Ok(Message {
        destination,
        headers,
        body,
    })
}

#[derive(Deserialize)]
struct BatchElement {
    destination: String,
    #[serde(default)]
    headers: Option<HashMap<String, String>>,
    #[serde(default)]
    body: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    queue: Option<String>,
}

fn batch_messages(body: &[u8]) -> Result<Vec<Message>, String> {
    let elements: Vec<BatchElement> = serde_json::from_slice(body)
        .map_err(|e| format!("the batch must be a JSON array of messages: {e}"))?;
    elements
        .into_iter()
        .enumerate()
        .map(|(i, e)| {
            check_destination(&e.destination).map_err(|r| format!("message {i}: {r}"))?;
            Ok(Message {
                destination: e.destination,
                headers: e
                    .headers
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k.to_ascii_lowercase(), v))
                    .collect(),
                body: Bytes::from(e.body.unwrap_or_default()),
            })
        })
        .collect()
}

fn check_destination(destination: &str) -> Result<(), String> {
    if destination.starts_with("http://") || destination.starts_with("https://") {
        Ok(())
    } else {
        Err(format!(
            "destination `{destination}` must be a URL starting with http:// or https:// (URL groups are not supported by this sink)"
        ))
    }
}

enum Outcome {
    Accepted {
        message_id: String,
        url: String,
        deduplicated: bool,
    },
    Rejected {
        status: StatusCode,
        error: String,
    },
}

impl Shared {
    fn poison_rejects_batch(&self) -> bool {
        self.faults
            .lock()
            .expect("faults lock")
            .config
            .poison_rejects_batch
    }

    /// The rejection text when `msg` is poison.
    fn poison_error(&self, msg: &Message) -> Option<String> {
        let json: Option<Value> = serde_json::from_slice(&msg.body).ok();
        let outbox_id = msg
            .header(OUTBOX_ID_HEADER)
            .and_then(|v| v.trim().parse::<i64>().ok())
            .or_else(|| json.as_ref().and_then(|j| j.get("id")).and_then(json_i64));
        let f = self.faults.lock().expect("faults lock");
        f.is_poison(outbox_id, json.as_ref()).then(|| {
            format!(
                "poison event{} rejected",
                outbox_id.map(|id| format!(" {id}")).unwrap_or_default()
            )
        })
    }

    fn accept(&self, msg: Message, via_batch: bool) -> Outcome {
        let c = &self.counters;
        let json: Option<Value> = serde_json::from_slice(&msg.body).ok();
        let outbox_id = msg
            .header(OUTBOX_ID_HEADER)
            .and_then(|v| v.trim().parse::<i64>().ok())
            .or_else(|| json.as_ref().and_then(|j| j.get("id")).and_then(json_i64));
        let element_error = {
            let mut f = self.faults.lock().expect("faults lock");
            if f.is_poison(outbox_id, json.as_ref()) {
                bump(&c.poison_rejected);
                return Outcome::Rejected {
                    status: StatusCode::BAD_REQUEST,
                    error: format!(
                        "poison event{} rejected",
                        outbox_id.map(|id| format!(" {id}")).unwrap_or_default()
                    ),
                };
            }
            f.draw_element_error()
        };
        if element_error {
            bump(&c.element_errors);
            return Outcome::Rejected {
                status: StatusCode::SERVICE_UNAVAILABLE,
                error: "injected message failure".to_owned(),
            };
        }
        if self.deliverer.is_some() {
            if let Err(reason) = delivery::check_loopback(&msg.destination) {
                bump(&c.bad_requests);
                return Outcome::Rejected {
                    status: StatusCode::BAD_REQUEST,
                    error: reason,
                };
            }
        }
        let dedup_id = msg.header(DEDUP_ID_HEADER).map(str::to_owned);
        let dedup_key = match &dedup_id {
            Some(id) => Some(format!("id:{id}")),
            None if msg.header(CONTENT_DEDUP_HEADER) == Some("true") => {
                Some(format!("content:{}", content_hash(&msg)))
            }
            None => None,
        };
        let partition_key = msg
            .header(FLOW_CONTROL_KEY_HEADER)
            .map(str::to_owned)
            .or_else(|| {
                json.as_ref()
                    .and_then(|j| j.get("partitionKey"))
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            });
        let created_at_us = json
            .as_ref()
            .and_then(|j| j.get("createdAt"))
            .and_then(timestamp_us);
        let now = Instant::now();
        let (message_id, deduplicated, n) = {
            let mut ledger = self.ledger.lock().expect("ledger lock");
            let existing = dedup_key.as_ref().and_then(|k| {
                ledger
                    .dedup
                    .get(k)
                    .filter(|(_, at)| now.duration_since(*at) < self.dedup_window)
                    .map(|(id, _)| id.clone())
            });
            let (message_id, deduplicated) = match existing {
                Some(id) => (id, true),
                None => {
                    let id = format!("msg_{}", uuid::Uuid::new_v4().simple());
                    if let Some(k) = dedup_key {
                        ledger.dedup.insert(k, (id.clone(), now));
                    }
                    (id, false)
                }
            };
            let seq = ledger.records.len() as u64;
            ledger.records.push(Record {
                seq,
                message_id: message_id.clone(),
                dedup_id,
                outbox_id,
                partition_key,
                destination: msg.destination.clone(),
                received_at_us: chrono::Utc::now().timestamp_micros(),
                deduplicated,
                created_at_us,
                via_batch,
            });
            (message_id, deduplicated, ledger.records.len())
        };
        bump(&c.accepted);
        if deduplicated {
            bump(&c.deduplicated);
        }
        self.recorded.send_replace(n);
        if let (Some(deliverer), false) = (&self.deliverer, deduplicated) {
            deliverer.spawn(to_delivery(&msg, &message_id));
        }
        Outcome::Accepted {
            message_id,
            url: msg.destination,
            deduplicated,
        }
    }
}

fn to_delivery(msg: &Message, message_id: &str) -> delivery::Delivery {
    let method = msg
        .header("upstash-method")
        .and_then(|m| http::Method::from_bytes(m.as_bytes()).ok())
        .unwrap_or(http::Method::POST);
    let mut headers = Vec::new();
    for (name, value) in &msg.headers {
        if let Some(forwarded) = name.strip_prefix(FORWARD_PREFIX) {
            headers.push((forwarded.to_owned(), value.clone()));
        } else if name == "content-type" {
            headers.push((name.clone(), value.clone()));
        }
    }
    delivery::Delivery {
        message_id: message_id.to_owned(),
        destination: msg.destination.clone(),
        method,
        headers,
        body: msg.body.clone(),
    }
}

/// Destination, body, content type and forwarded headers, as QStash's
/// content-based deduplication hashes them.
fn content_hash(msg: &Message) -> String {
    let mut h = Sha256::new();
    h.update(msg.destination.as_bytes());
    h.update([0]);
    let mut headers: Vec<&(String, String)> = msg
        .headers
        .iter()
        .filter(|(n, _)| n == "content-type" || n.starts_with(FORWARD_PREFIX))
        .collect();
    headers.sort();
    for (n, v) in headers {
        h.update(n.as_bytes());
        h.update([b':']);
        h.update(v.as_bytes());
        h.update([0]);
    }
    h.update(&msg.body);
    format!("{:x}", h.finalize())
}

fn json_i64(v: &Value) -> Option<i64> {
    v.as_i64()
        .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

/// RFC 3339 string, or a unix number read as seconds, milliseconds or
/// microseconds by its magnitude.
pub fn timestamp_us(v: &Value) -> Option<i64> {
    if let Some(s) = v.as_str() {
        return chrono::DateTime::parse_from_rfc3339(s)
            .ok()
            .map(|t| t.timestamp_micros());
    }
    let n = v.as_f64()?;
    let abs = n.abs();
    Some(if abs < 1e11 {
        (n * 1e6) as i64
    } else if abs < 1e14 {
        (n * 1e3) as i64
    } else {
        n as i64
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_in_any_unit() {
        let us = 1_700_000_000_123_456_i64;
        assert_eq!(
            timestamp_us(&json!("2023-11-14T22:13:20.123456Z")),
            Some(us)
        );
        assert_eq!(
            timestamp_us(&json!(1_700_000_000)),
            Some(1_700_000_000_000_000)
        );
        assert_eq!(
            timestamp_us(&json!(1_700_000_000_123_i64)),
            Some(1_700_000_000_123_000)
        );
        assert_eq!(timestamp_us(&json!(us)), Some(us));
        assert_eq!(timestamp_us(&json!(null)), None);
    }

    #[test]
    fn query_token_is_percent_decoded() {
        assert_eq!(percent_decode("a%3Db+c"), "a=b c");
        assert_eq!(percent_decode("abc%"), "abc%");
    }
}
