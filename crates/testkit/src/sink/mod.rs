//! The QStash stand-in of the relay's tests and of the load-test harness.
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
//! rejected ones only count in [`SinkStats`]. Faults are in [`faults`].
//!
//! **Delivery mode** ([`SinkConfig::delivery`], [`delivery`]) does what QStash
//! does after it accepted a message: deliver it to its destination, signed,
//! with flow control (`parallelism` per key), retries after a delay, and
//! callbacks and failure callbacks after the attempts. The final destination
//! a test or scenario delivers to is [`destination`], whose [`check_order`]
//! says whether each partition key's events arrived in order.
//!
//! For tests, [`rules`] decide per message what the sink answers
//! ([`SinkHandle::set_rule`]), and with [`SinkConfig::keep_messages`] every
//! judged message is kept with its headers and body ([`SinkHandle::received`]).
//! The sink also takes webhook POSTs under `/hook` (no token; answered `204`,
//! or as the rule says), so one server stands in for QStash and for a
//! webhook destination; an accepted one is a [`Record`] too (its
//! `webhook-id` as the deduplication id), so a run through a webhook route is
//! verified and timed like one through QStash.
//!
//! Besides the records, the sink logs what it *answered* about each message
//! ([`AnswerEvent`]): accepted readably, taken but answered unreadably, rejected
//! for itself, or failed with the whole request. The adversarial fault mode
//! ([`faults::AdversarialConfig`], [`adversary`]) and its outages
//! ([`SinkHandle::start_outages`]) are checked against that log.
//!
//! Built on hyper directly rather than an axum router: the destination is the
//! raw path and query (a router would decode it), and a reset needs the
//! connection itself.

pub mod adversary;
pub mod delivery;
pub mod destination;
pub mod faults;
pub mod load;
pub mod rules;
pub mod signing;
pub mod undelivered;

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use adversary::AnswerBody;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;

use adversary::{ActiveOutage, Garble};
pub use adversary::{AnswerEvent, AnswerKind, OutageWindow};
pub use delivery::{
    CallbackKind, CallbackOutcome, DeliveryAttempt, DeliveryConfig, DeliveryOutcome, RetryDelay,
};
pub use destination::{
    check_order, Call, Destination, DestinationConfig, DestinationHandle, DestinationReport,
};
pub use faults::{AdversarialConfig, FaultConfig, OutageKind, OutageSpec};
use faults::{FaultState, RequestFault};
pub use load::DestinationLoad;
use rules::Rules;
pub use rules::{RawAnswer, Received, Reply};
pub use signing::{DEV_CURRENT_SIGNING_KEY, DEV_NEXT_SIGNING_KEY, DEV_TOKEN};
pub use undelivered::{undelivered, Undelivered};

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
    /// Keep every request line and every judged message with its headers and
    /// body ([`SinkHandle::received`], [`SinkHandle::requests`]): for tests,
    /// since memory grows with the run.
    pub keep_messages: bool,
}

impl Default for SinkConfig {
    fn default() -> Self {
        SinkConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            token: DEV_TOKEN.to_owned(),
            dedup_window: Duration::from_secs(600),
            faults: FaultConfig::default(),
            delivery: None,
            keep_messages: false,
        }
    }
}

impl SinkConfig {
    /// For a test: a free loopback port, `token`, every message kept.
    pub fn for_tests(token: &str) -> SinkConfig {
        SinkConfig {
            token: token.to_owned(),
            keep_messages: true,
            ..SinkConfig::default()
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
    /// Adversarial faults by kind (`status_503`, `garbled_truncated`,
    /// `cut_off`, `oversized`, `nul_body`, `outage_refused`, …): requests,
    /// or for `nul_body` answers and elements.
    #[serde(default)]
    pub adversarial: BTreeMap<String, u64>,
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
    answers: Vec<AnswerEvent>,
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
    adversarial: Mutex<BTreeMap<String, u64>>,
    outage: Mutex<Option<ActiveOutage>>,
    outage_log: Mutex<Vec<OutageWindow>>,
    /// Bumped to reset every open connection.
    cut_all: watch::Sender<u64>,
    /// Set to close the listener (connections refused), cleared to listen again.
    refuse: watch::Sender<bool>,
    /// Whether the listener is open.
    listening: watch::Sender<bool>,
    rules: Rules,
    /// Arrivals and requests in flight per webhook destination.
    load: load::Load,
    /// How long each webhook answer is held.
    webhook_delay: Mutex<Duration>,
}

/// Starts sinks: `Sink::start(SinkConfig::default()).await?`.
pub struct Sink;

impl Sink {
    /// Binds and serves until [`SinkHandle::stop`] (or the handle is dropped).
    pub async fn start(config: SinkConfig) -> Result<SinkHandle, SinkError> {
        config.faults.validate().map_err(SinkError::Config)?;
        if let Some(d) = &config.delivery {
            d.validate().map_err(SinkError::Config)?;
        }
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
                answers: Vec::new(),
                dedup: HashMap::new(),
            }),
            counters: Counters::default(),
            recorded: watch::channel(0).0,
            deliverer: config.delivery.map(delivery::Deliverer::new),
            shutdown: shutdown_rx,
            adversarial: Mutex::new(BTreeMap::new()),
            outage: Mutex::new(None),
            outage_log: Mutex::new(Vec::new()),
            cut_all: watch::channel(0).0,
            refuse: watch::channel(false).0,
            listening: watch::channel(true).0,
            rules: Rules::new(config.keep_messages),
            load: load::Load::default(),
            webhook_delay: Mutex::new(Duration::ZERO),
        });
        let server = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        Ok(SinkHandle {
            addr,
            shared,
            shutdown: shutdown_tx,
            server: Some(server),
            outages: Mutex::new(None),
        })
    }
}

/// A running sink.
pub struct SinkHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    server: Option<tokio::task::JoinHandle<()>>,
    outages: Mutex<Option<tokio::task::JoinHandle<()>>>,
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
            adversarial: self.shared.adversarial.lock().expect("counts lock").clone(),
        }
    }

    /// What the sink answered about each message so far, in order.
    pub fn answers(&self) -> Vec<AnswerEvent> {
        self.shared
            .ledger
            .lock()
            .expect("ledger lock")
            .answers
            .clone()
    }

    /// The outages that ran so far (the one in force, if any, is not listed).
    pub fn outages(&self) -> Vec<OutageWindow> {
        self.shared
            .outage_log
            .lock()
            .expect("outage log lock")
            .clone()
    }

    /// Starts the adversarial mode's outage schedule, its `at` times counted
    /// from now. Does nothing without outages; a second call is ignored.
    pub fn start_outages(&self) {
        let specs = {
            let f = self.shared.faults.lock().expect("faults lock");
            f.config
                .adversarial
                .as_ref()
                .map(|a| a.outages.clone())
                .unwrap_or_default()
        };
        let mut task = self.outages.lock().expect("outages lock");
        if specs.is_empty() || task.is_some() {
            return;
        }
        *task = Some(tokio::spawn(run_outages(Arc::clone(&self.shared), specs)));
    }

    /// Finished deliveries (delivery mode only), in completion order.
    pub fn deliveries(&self) -> Vec<DeliveryOutcome> {
        self.read_deliverer(|d| d.outcomes())
    }

    /// Decides what the sink answers about each message from now on (see
    /// [`rules`]); the default accepts everything.
    pub fn set_rule(&self, rule: impl Fn(&Received) -> Reply + Send + Sync + 'static) {
        self.shared.rules.set_rule(Box::new(rule));
    }

    /// Answers `/v2/batch` requests as this says when it returns `Some`: the
    /// answer, and which messages it counts as accepted.
    pub fn set_batch_rule(
        &self,
        rule: impl Fn(&[Received]) -> Option<(RawAnswer, Vec<bool>)> + Send + Sync + 'static,
    ) {
        self.shared.rules.set_batch_rule(Box::new(rule));
    }

    /// Every webhook request is held this long before it is answered.
    pub fn set_webhook_delay(&self, delay: Duration) {
        *self.shared.webhook_delay.lock().expect("delay lock") = delay;
    }

    /// What the webhook destination `/hook/<name>` received so far: each
    /// request's arrival and the most in flight at once.
    pub fn load(&self, destination: &str) -> DestinationLoad {
        self.shared.load.of(destination)
    }

    /// Every QStash request waits this long before it is answered (the
    /// faults' `latency`, kept apart from their random draws).
    pub fn set_delay(&self, delay: Duration) {
        self.shared
            .faults
            .lock()
            .expect("faults lock")
            .config
            .latency = delay;
    }

    /// Every judged message, accepted or not, in the order judged (kept with
    /// [`SinkConfig::keep_messages`]).
    pub fn received(&self) -> Vec<Received> {
        self.shared.rules.received()
    }

    /// The judged messages the sink accepted.
    pub fn accepted(&self) -> Vec<Received> {
        self.received().into_iter().filter(|r| r.accepted).collect()
    }

    /// `METHOD path` of every HTTP request (kept with [`SinkConfig::keep_messages`]).
    pub fn requests(&self) -> Vec<String> {
        self.shared.rules.requests()
    }

    /// Replaces the fault configuration (and reseeds its RNG) from the next request on.
    pub fn set_faults(&self, faults: FaultConfig) -> Result<(), SinkError> {
        faults.validate().map_err(SinkError::Config)?;
        *self.shared.faults.lock().expect("faults lock") = FaultState::new(faults);
        Ok(())
    }

    /// Waits until at least `n` messages were accepted; false on timeout.
    pub async fn wait_for_records(&self, n: usize, timeout: Duration) -> bool {
        count_reaches(self.shared.recorded.subscribe(), n, timeout).await
    }

    /// Every delivery attempt so far (delivery mode only), in the order they ended.
    pub fn delivery_attempts(&self) -> Vec<DeliveryAttempt> {
        self.read_deliverer(|d| d.attempts())
    }

    /// Finished callbacks and failure callbacks (delivery mode only), in
    /// completion order.
    pub fn callbacks(&self) -> Vec<CallbackOutcome> {
        self.read_deliverer(|d| d.callbacks())
    }

    /// Waits until at least `n` callbacks finished (delivered or given up);
    /// false on timeout or when delivery mode is off.
    pub async fn wait_for_callbacks(&self, n: usize, timeout: Duration) -> bool {
        match &self.shared.deliverer {
            Some(d) => count_reaches(d.subscribe_callbacks(), n, timeout).await,
            None => false,
        }
    }

    /// Waits until at least `n` deliveries finished; false on timeout or when
    /// delivery mode is off.
    pub async fn wait_for_deliveries(&self, n: usize, timeout: Duration) -> bool {
        match &self.shared.deliverer {
            Some(d) => count_reaches(d.subscribe(), n, timeout).await,
            None => false,
        }
    }

    /// What `f` reads from the deliverer; nothing when delivery mode is off.
    fn read_deliverer<T>(&self, f: impl FnOnce(&delivery::Deliverer) -> Vec<T>) -> Vec<T> {
        self.shared.deliverer.as_deref().map(f).unwrap_or_default()
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
        if let Some(t) = self.outages.lock().expect("outages lock").take() {
            t.abort();
        }
        if let Some(d) = &self.shared.deliverer {
            d.abort_all();
        }
    }
}

/// Whether the count `rx` watches reaches `n` within `timeout`.
async fn count_reaches(mut rx: watch::Receiver<usize>, n: usize, timeout: Duration) -> bool {
    tokio::time::timeout(timeout, rx.wait_for(|count| *count >= n))
        .await
        .is_ok_and(|r| r.is_ok())
}

/// Resolves once the shutdown flag is set (or its sender is gone).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    flag_is(rx, true).await;
}

/// Resolves once the flag is `value` (or its sender is gone).
async fn flag_is(rx: &mut watch::Receiver<bool>, value: bool) {
    let _ = rx.wait_for(|v| *v == value).await;
}

/// Runs the outage schedule (see [`SinkHandle::start_outages`]).
async fn run_outages(shared: Arc<Shared>, specs: Vec<OutageSpec>) {
    let origin = tokio::time::Instant::now();
    let mut shutdown = shared.shutdown.clone();
    for o in specs {
        tokio::select! {
            _ = tokio::time::sleep_until(origin + o.at) => {}
            _ = stopped(&mut shutdown) => return,
        }
        let until = Instant::now() + o.duration;
        *shared.outage.lock().expect("outage lock") = Some(ActiveOutage {
            kind: o.kind,
            start_us: adversary::now_us(),
            until,
            until_wall: SystemTime::now() + o.duration,
            route: o.route.clone(),
        });
        if o.kind == OutageKind::Refused {
            shared.refuse.send_replace(true);
        }
        tracing::info!(kind = o.kind.as_str(), route = ?o.route, duration = ?o.duration, "sink: outage starts");
        tokio::select! {
            _ = tokio::time::sleep_until(until.into()) => {}
            _ = stopped(&mut shutdown) => return,
        }
        let ended = shared.outage.lock().expect("outage lock").take();
        if o.kind == OutageKind::Refused {
            shared.refuse.send_replace(false);
            // The outage lasts until the listener is back.
            let mut listening = shared.listening.subscribe();
            tokio::select! {
                _ = flag_is(&mut listening, true) => {}
                _ = stopped(&mut shutdown) => return,
            }
            if let Some(o) = ended {
                shared.log_outage(&o);
            }
        } else if let Some(o) = ended {
            shared.log_outage(&o);
        }
        tracing::info!(kind = o.kind.as_str(), "sink: outage ends");
    }
}

/// A listener on `addr` again, retried until it binds (a refused outage
/// gave the port up for a while).
async fn rebind(addr: SocketAddr, shutdown: &mut watch::Receiver<bool>) -> Option<TcpListener> {
    loop {
        let bound = tokio::net::TcpSocket::new_v4().and_then(|s| {
            s.set_reuseaddr(true)?;
            s.bind(addr)?;
            s.listen(1024)
        });
        match bound {
            Ok(l) => return Some(l),
            Err(e) => {
                tracing::warn!(error = %e, %addr, "sink: cannot listen again yet");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                    _ = stopped(shutdown) => return None,
                }
            }
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut shutdown = shared.shutdown.clone();
    let mut refuse = shared.refuse.subscribe();
    let addr = listener.local_addr().ok();
    let mut listener = Some(listener);
    let mut conns = JoinSet::new();
    loop {
        let Some(l) = &listener else {
            tokio::select! {
                _ = stopped(&mut shutdown) => break,
                _ = flag_is(&mut refuse, false) => {
                    let Some(addr) = addr else { break };
                    listener = rebind(addr, &mut shutdown).await;
                    shared.listening.send_replace(listener.is_some());
                }
            }
            continue;
        };
        tokio::select! {
            _ = stopped(&mut shutdown) => break,
            _ = flag_is(&mut refuse, true) => {
                // Closed: new connections are refused; open ones are reset.
                listener = None;
                shared.listening.send_replace(false);
                shared.cut_all.send_modify(|g| *g += 1);
            }
            accepted = l.accept() => match accepted {
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
    let mut cut = shared.cut_all.subscribe();
    let svc = {
        let kill = Arc::clone(&kill);
        service_fn(move |req| handle(Arc::clone(&shared), req, Arc::clone(&kill)))
    };
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    tokio::select! {
        _ = &mut conn => return,
        _ = kill.notified() => {}
        _ = cut.changed() => {}
        _ = stopped(&mut shutdown) => return,
    }
    // Linger 0 turns the close into an RST: the client sees a reset,
    // not a clean end of stream. The fd is still open (conn owns it).
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
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

type Resp = Response<AnswerBody>;

fn json_response(status: StatusCode, body: &Value) -> Resp {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(AnswerBody::whole(Bytes::from(body.to_string())))
        .expect("static response parts are valid")
}

fn error_response(status: StatusCode, message: &str) -> Resp {
    json_response(status, &json!({ "error": message }))
}

enum Endpoint {
    Publish,
    Batch,
}

/// What the rules made of a request's messages.
enum Ruled {
    /// They answered it.
    Answered(Resp),
    /// They let every message go on; the judged messages when rules are active.
    Pass {
        messages: Vec<Message>,
        received: Option<Vec<Received>>,
    },
}

/// The request body, up to [`MAX_BODY_BYTES`]; else the 400 to answer.
async fn read_body(shared: &Shared, body: Incoming) -> Result<Bytes, Resp> {
    match Limited::new(body, MAX_BODY_BYTES).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => {
            bump(&shared.counters.bad_requests);
            Err(error_response(
                StatusCode::BAD_REQUEST,
                &format!("cannot read the body: {e}"),
            ))
        }
    }
}

/// A webhook POST under `/hook/…`: judged by the rule, answered `204` when
/// accepted. No token, faults or deduplication: this is a destination, not QStash.
async fn webhook(
    shared: &Shared,
    parts: http::request::Parts,
    body: Incoming,
) -> Result<Resp, Infallible> {
    let _in_flight = shared.load.arrived(parts.uri.path());
    let body = match read_body(shared, body).await {
        Ok(b) => b,
        Err(refused) => return Ok(refused),
    };
    let delay = *shared.webhook_delay.lock().expect("delay lock");
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let (msg, reply) =
        shared
            .rules
            .judge(Received::webhook(parts.uri.path(), &parts.headers, &body));
    if reply == Reply::Accept {
        shared.record_webhook(&msg);
    }
    shared.rules.record(vec![msg]);
    Ok(reply.refusal().unwrap_or_else(|| {
        Response::builder()
            .status(StatusCode::NO_CONTENT)
            .body(AnswerBody::whole(Bytes::new()))
            .expect("static response parts are valid")
    }))
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    kill: Arc<Notify>,
) -> Result<Resp, Infallible> {
    bump(&shared.counters.requests);
    let (parts, body) = req.into_parts();
    let path = parts.uri.path();
    shared.rules.note_request(&parts.method, path);
    if path == "/hook" || path.starts_with("/hook/") {
        return webhook(&shared, parts, body).await;
    }
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
    let body = match read_body(&shared, body).await {
        Ok(b) => b,
        Err(refused) => return Ok(refused),
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
    let ids: Vec<Option<i64>> = messages.iter().map(|m| m.outbox_id(None)).collect();
    let batch = matches!(endpoint, Endpoint::Batch);
    if let Some(outage) = shared
        .active_outage()
        .filter(|o| o.applies(messages.iter().map(|m| m.destination.as_str())))
    {
        return shared.outage_answer(outage, &ids, &kill).await;
    }

    let (fault, delay) = {
        let mut f = shared.faults.lock().expect("faults lock");
        (f.draw_request(), f.draw_delay())
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let c = &shared.counters;
    let failed = |status: u16| move |_: usize| AnswerKind::Failed { status };
    match fault {
        RequestFault::Reset => {
            bump(&c.resets);
            shared.log_answers(&ids, failed(0));
            return reset(&kill).await;
        }
        RequestFault::Hang => {
            bump(&c.hangs);
            shared.log_answers(&ids, failed(0));
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
            shared.log_answers(&ids, failed(503));
            return Ok(
                shared.error_answer(StatusCode::SERVICE_UNAVAILABLE, "injected server error")
            );
        }
        RequestFault::RateLimited => {
            bump(&c.rate_limited);
            shared.log_answers(&ids, failed(429));
            return Ok(shared.rate_limited(None));
        }
        RequestFault::Status => {
            let status = shared.draw_status();
            shared.note(&format!("status_{}", status.as_u16()));
            let own = ids.len() == 1 && adversary::is_permanent_rejection(status.as_u16());
            shared.log_answers(&ids, |_| {
                if own {
                    AnswerKind::Rejected {
                        status: status.as_u16(),
                    }
                } else {
                    AnswerKind::Failed {
                        status: status.as_u16(),
                    }
                }
            });
            if status == StatusCode::TOO_MANY_REQUESTS {
                return Ok(shared.rate_limited(None));
            }
            return Ok(shared.error_answer(status, &format!("injected {}", status.as_u16())));
        }
        _ => {}
    }

    let (messages, mut received) = match shared.apply_rules(batch, messages, &ids) {
        Ruled::Answered(resp) => return Ok(resp),
        Ruled::Pass { messages, received } => (messages, received),
    };
    if batch && shared.poison_rejects_batch() {
        if let Some(error) = messages.iter().find_map(|m| shared.poison_error(m)) {
            let mut refused = received.take().unwrap_or_default();
            refused.iter_mut().for_each(|r| r.accepted = false);
            shared.rules.record(refused);
            // Refused as a whole, as QStash refuses a batch that fails validation:
            // nothing in it is accepted, and the relay resends them one by one.
            bump(&c.poison_rejected);
            let one = ids.len() == 1;
            shared.log_answers(&ids, |_| {
                if one {
                    AnswerKind::Rejected { status: 400 }
                } else {
                    AnswerKind::Failed { status: 400 }
                }
            });
            return Ok(
                shared.error_answer(StatusCode::BAD_REQUEST, &format!("{error}; batch refused"))
            );
        }
    }
    let outcomes: Vec<Outcome> = messages
        .into_iter()
        .map(|m| shared.accept(m, batch))
        .collect();
    if let Some(mut received) = received {
        for (r, o) in received.iter_mut().zip(&outcomes) {
            r.accepted = matches!(o, Outcome::Accepted { .. });
        }
        shared.rules.record(received);
    }
    // What each message's answer says, before the answer is spoilt.
    let mut kinds: Vec<AnswerKind> = outcomes
        .iter()
        .map(|o| match o {
            Outcome::Accepted { .. } => AnswerKind::Accepted,
            Outcome::Rejected { status, .. }
                if batch || adversary::is_permanent_rejection(status.as_u16()) =>
            {
                AnswerKind::Rejected {
                    status: status.as_u16(),
                }
            }
            Outcome::Rejected { status, .. } => AnswerKind::Failed {
                status: status.as_u16(),
            },
        })
        .collect();
    let unread = |kinds: &mut [AnswerKind], which: &dyn Fn(usize) -> bool, status: u16| {
        for (i, k) in kinds.iter_mut().enumerate() {
            if which(i) {
                *k = match k {
                    AnswerKind::Accepted | AnswerKind::AcceptedUnread => AnswerKind::AcceptedUnread,
                    _ => AnswerKind::Failed { status },
                };
            }
        }
    };
    if fault == RequestFault::LostResponse {
        bump(&c.lost_responses);
        unread(&mut kinds, &|_| true, 0);
        shared.log_answers(&ids, |i| kinds[i]);
        return reset(&kill).await;
    }
    let (status, body) = match endpoint {
        Endpoint::Publish => match outcomes.into_iter().next().expect("one message") {
            Outcome::Accepted {
                message_id,
                url,
                deduplicated,
            } => (
                if deduplicated {
                    StatusCode::ACCEPTED
                } else {
                    StatusCode::OK
                },
                json!({"messageId": message_id, "url": url, "deduplicated": deduplicated}),
            ),
            Outcome::Rejected { status, error } => {
                shared.log_answers(&ids, |i| kinds[i]);
                return Ok(shared.error_answer(status, &error));
            }
        },
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
                        json!({"error": shared.element_error_text(error), "status": status.as_u16()})
                    }
                })
                .collect();
            (StatusCode::OK, Value::Array(elements))
        }
    };
    let resp = match fault {
        RequestFault::Garbled => {
            let out = {
                let mut f = shared.faults.lock().expect("faults lock");
                let g = Garble::draw(&mut f);
                shared.note(g.as_str());
                adversary::garble(&mut f, g, status, &body)
            };
            // On /v2/publish the status is the answer; in a batch, the element.
            if batch {
                unread(&mut kinds, &|i| !out.readable[i], out.status.as_u16());
            }
            bytes_response(out.status, out.body, None)
        }
        RequestFault::CutOff => {
            shared.note("cut_off");
            unread(&mut kinds, &|_| true, 0);
            let whole = Bytes::from(body.to_string());
            let (prefix, len) =
                adversary::cut_off_prefix(&mut shared.faults.lock().expect("faults lock"), &whole);
            bytes_response(status, prefix, Some(len))
        }
        RequestFault::Oversized => {
            shared.note("oversized");
            if batch {
                unread(&mut kinds, &|_| true, status.as_u16());
            }
            let bytes = shared.adversarial_config().map_or(0, |a| a.oversized_bytes);
            bytes_response(status, adversary::oversize(&body, bytes), None)
        }
        _ => json_response(status, &body),
    };
    shared.log_answers(&ids, |i| kinds[i]);
    Ok(resp)
}

/// `body` with `status`; with `announced`, the body is a prefix of an answer
/// that long, and the connection breaks after it.
fn bytes_response(status: StatusCode, body: Bytes, announced: Option<usize>) -> Resp {
    let body = match announced {
        Some(len) => AnswerBody::cut_off(body, len as u64),
        None => AnswerBody::whole(body),
    };
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(body)
        .expect("static response parts are valid")
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
    /// Lowercased names; `/v2/publish`: every request header.
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

    /// From `Upstash-Forward-X-Outbox-Id`, else the body's `id` (`json`: the
    /// body, parsed by the caller; parsed here when `None`).
    fn outbox_id(&self, json: Option<&Value>) -> Option<i64> {
        if let Some(id) = self
            .header(OUTBOX_ID_HEADER)
            .and_then(|v| v.trim().parse::<i64>().ok())
        {
            return Some(id);
        }
        let parsed;
        let json = match json {
            Some(j) => j,
            None => {
                parsed = serde_json::from_slice::<Value>(&self.body).ok()?;
                &parsed
            }
        };
        json.get("id").and_then(json_i64)
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
    /// An accepted webhook POST in the ledger, as a message QStash took: its
    /// `webhook-id` as the deduplication id (not deduplicated: a webhook
    /// destination takes every call), the body's `partitionKey` and
    /// `createdAt`. So a run through a webhook route is verified and timed
    /// like one through QStash.
    fn record_webhook(&self, msg: &Received) {
        let json: Option<Value> = serde_json::from_str(&msg.body).ok();
        let field = |k: &str| json.as_ref().and_then(|j| j.get(k));
        let partition_key = field("partitionKey")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let created_at_us = field("createdAt").and_then(timestamp_us);
        let n = {
            let mut ledger = self.ledger.lock().expect("ledger lock");
            let seq = ledger.records.len() as u64;
            ledger.records.push(Record {
                seq,
                message_id: format!("msg_{}", uuid::Uuid::new_v4().simple()),
                dedup_id: (!msg.dedup_id.is_empty()).then(|| msg.dedup_id.clone()),
                outbox_id: msg.outbox_id,
                partition_key,
                destination: msg.destination.clone(),
                received_at_us: chrono::Utc::now().timestamp_micros(),
                deduplicated: false,
                created_at_us,
                via_batch: false,
            });
            ledger.records.len()
        };
        bump(&self.counters.accepted);
        self.recorded.send_replace(n);
    }

    /// Judges the messages by the rules (when active): a batch rule's answer,
    /// or the first refusal, answers the request; else they go on.
    fn apply_rules(&self, batch: bool, messages: Vec<Message>, ids: &[Option<i64>]) -> Ruled {
        if !self.rules.active() {
            return Ruled::Pass {
                messages,
                received: None,
            };
        }
        let (mut received, replies): (Vec<Received>, Vec<Reply>) = messages
            .iter()
            .map(|m| self.rules.judge(Received::of(m)))
            .unzip();
        if batch {
            if let Some((answer, accepted)) = self.rules.batch_answer(&received) {
                for ((m, r), a) in messages.into_iter().zip(&mut received).zip(accepted) {
                    r.accepted = a && matches!(self.accept(m, true), Outcome::Accepted { .. });
                }
                self.log_answers(ids, |i| {
                    if received[i].accepted {
                        AnswerKind::Accepted
                    } else {
                        AnswerKind::Failed {
                            status: answer.status,
                        }
                    }
                });
                self.rules.record(received);
                return Ruled::Answered(answer.response());
            }
        }
        let Some(refused) = replies.iter().find(|r| **r != Reply::Accept) else {
            return Ruled::Pass {
                messages,
                received: Some(received),
            };
        };
        let status = refused.status();
        let own = ids.len() == 1 && adversary::is_permanent_rejection(status);
        self.log_answers(ids, |_| {
            if own {
                AnswerKind::Rejected { status }
            } else {
                AnswerKind::Failed { status }
            }
        });
        let answer = refused.refusal().expect("a refusal");
        received.iter_mut().for_each(|r| r.accepted = false);
        self.rules.record(received);
        Ruled::Answered(answer)
    }

    fn adversarial_config(&self) -> Option<AdversarialConfig> {
        self.faults
            .lock()
            .expect("faults lock")
            .config
            .adversarial
            .clone()
    }

    /// Counts one adversarial fault of `kind`.
    fn note(&self, kind: &str) {
        *self
            .adversarial
            .lock()
            .expect("counts lock")
            .entry(kind.to_owned())
            .or_insert(0) += 1;
    }

    /// Logs one answer per message with an outbox id; `kind(i)` for message `i`.
    fn log_answers(&self, ids: &[Option<i64>], kind: impl Fn(usize) -> AnswerKind) {
        self.log_answers_of(ids, kind, None);
    }

    /// [`Self::log_answers`], saying which outage (if any) gave them.
    fn log_answers_of(
        &self,
        ids: &[Option<i64>],
        kind: impl Fn(usize) -> AnswerKind,
        outage: Option<OutageKind>,
    ) {
        let at_us = adversary::now_us();
        let mut ledger = self.ledger.lock().expect("ledger lock");
        for (i, id) in ids.iter().enumerate() {
            if let Some(outbox_id) = *id {
                ledger.answers.push(AnswerEvent {
                    at_us,
                    outbox_id,
                    kind: kind(i),
                    outage,
                });
            }
        }
    }

    /// The outage in force, if any. One whose time is up ends here, before
    /// the schedule's timer fires: whoever gets an answer after an outage
    /// also finds it in [`SinkHandle::outages`]. (A refused outage ends
    /// only in the schedule, once the listener is back.)
    fn active_outage(&self) -> Option<ActiveOutage> {
        let mut o = self.outage.lock().expect("outage lock");
        if o.as_ref()
            .is_some_and(|a| a.kind != OutageKind::Refused && Instant::now() >= a.until)
        {
            if let Some(ended) = o.take() {
                self.log_outage(&ended);
            }
        }
        o.clone()
    }

    /// Records an outage that has just ended.
    fn log_outage(&self, o: &ActiveOutage) {
        self.outage_log
            .lock()
            .expect("outage log lock")
            .push(o.window());
    }

    /// Every request in an outage fails the same way.
    async fn outage_answer(
        &self,
        o: ActiveOutage,
        ids: &[Option<i64>],
        kill: &Notify,
    ) -> Result<Resp, Infallible> {
        self.note(&format!("outage_{}", o.kind.as_str()));
        let status = match o.kind {
            OutageKind::ServerError => StatusCode::SERVICE_UNAVAILABLE,
            OutageKind::Unauthorized => StatusCode::UNAUTHORIZED,
            OutageKind::Forbidden => StatusCode::FORBIDDEN,
            OutageKind::NotFound => StatusCode::NOT_FOUND,
            OutageKind::Gone => StatusCode::GONE,
            OutageKind::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            OutageKind::Reset | OutageKind::Refused => {
                self.log_answers_of(ids, |_| AnswerKind::Failed { status: 0 }, Some(o.kind));
                return reset(kill).await;
            }
        };
        let status_code = status.as_u16();
        self.log_answers_of(
            ids,
            |_| AnswerKind::Failed {
                status: status_code,
            },
            Some(o.kind),
        );
        Ok(match o.kind {
            OutageKind::RateLimited => self.rate_limited(Some(o.until_wall)),
            OutageKind::Unauthorized => self.error_answer(status, "Unauthorized"),
            OutageKind::Forbidden => self.error_answer(status, "Forbidden: quota or plan"),
            OutageKind::NotFound => self.error_answer(status, "not found (deploy in progress)"),
            OutageKind::Gone => self.error_answer(status, "gone (deploy in progress)"),
            _ => self.error_answer(status, "service unavailable (outage)"),
        })
    }

    /// `{"error": text}` with `status`; in the adversarial mode, NUL bytes and
    /// invalid UTF-8 after it as `nul_bodies` draws.
    fn error_answer(&self, status: StatusCode, text: &str) -> Resp {
        let body = {
            let mut f = self.faults.lock().expect("faults lock");
            if f.config.adversarial.is_none() {
                return error_response(status, text);
            }
            adversary::error_body(&mut f, text)
        };
        if body.contains(&0) {
            self.note("nul_body");
        }
        bytes_response(status, body, None)
    }

    /// An element error's text, with a NUL in it as `nul_bodies` draws.
    fn element_error_text(&self, text: String) -> String {
        let text =
            adversary::element_error_text(&mut self.faults.lock().expect("faults lock"), text);
        if text.contains('\0') {
            self.note("nul_body");
        }
        text
    }

    /// A 429 lifting at `until` (else `retry_after` from now): `Retry-After`
    /// in seconds, or in the adversarial mode any of the rate-limit headers.
    fn rate_limited(&self, until: Option<SystemTime>) -> Resp {
        let mut resp = self.error_answer(StatusCode::TOO_MANY_REQUESTS, "injected rate limit");
        let headers = {
            let mut f = self.faults.lock().expect("faults lock");
            let retry_after = f.config.retry_after;
            if f.config.adversarial.is_none() {
                vec![(
                    "retry-after",
                    http::HeaderValue::from(retry_after.as_secs()),
                )]
            } else {
                let until = until.unwrap_or_else(|| SystemTime::now() + retry_after);
                adversary::rate_limit_headers(&mut f, until)
            }
        };
        for (name, value) in headers {
            resp.headers_mut().insert(name, value);
        }
        resp
    }

    /// A status from `adversarial.statuses`.
    fn draw_status(&self) -> StatusCode {
        let mut f = self.faults.lock().expect("faults lock");
        let statuses = f
            .config
            .adversarial
            .as_ref()
            .map(|a| a.statuses.clone())
            .unwrap_or_default();
        let code = match statuses.len() {
            0 => 503,
            n => statuses[f.pick(n)],
        };
        StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE)
    }

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
        let outbox_id = json.as_ref().and_then(|j| msg.outbox_id(Some(j)));
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
        let outbox_id = json.as_ref().and_then(|j| msg.outbox_id(Some(j)));
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
        let delivery = match &self.deliverer {
            Some(d) => match delivery::Delivery::plan(
                outbox_id,
                &msg.destination,
                &msg.headers,
                msg.body.clone(),
                d.default_retries(),
            ) {
                Ok(plan) => Some(plan),
                Err(reason) => {
                    bump(&c.bad_requests);
                    return Outcome::Rejected {
                        status: StatusCode::BAD_REQUEST,
                        error: reason,
                    };
                }
            },
            None => None,
        };
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
        if let (Some(deliverer), Some(delivery), false) = (&self.deliverer, delivery, deduplicated)
        {
            deliverer.spawn(&message_id, delivery);
        }
        Outcome::Accepted {
            message_id,
            url: msg.destination,
            deduplicated,
        }
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

    /// An outage whose time is up is over for the next request even when
    /// the schedule's timer has not fired yet; it must be in the log then.
    #[tokio::test]
    async fn an_outage_a_request_finds_over_is_logged_at_once() {
        let sink = Sink::start(SinkConfig::default()).await.unwrap();
        let start_us = adversary::now_us();
        *sink.shared.outage.lock().unwrap() = Some(ActiveOutage {
            kind: OutageKind::Unauthorized,
            start_us,
            until: Instant::now(),
            until_wall: SystemTime::now(),
            route: None,
        });
        assert!(sink.shared.active_outage().is_none());
        let log = sink.outages();
        assert_eq!(log.len(), 1, "{log:?}");
        assert_eq!(log[0].kind, OutageKind::Unauthorized);
        assert!(log[0].start_us == start_us && log[0].end_us >= start_us);
        assert!(sink.shared.active_outage().is_none());
        assert_eq!(sink.outages().len(), 1, "logged once");
        sink.stop().await;
    }

    #[test]
    fn query_token_is_percent_decoded() {
        assert_eq!(percent_decode("a%3Db+c"), "a=b c");
        assert_eq!(percent_decode("abc%"), "abc%");
    }
}
