//! Delivery mode: what QStash does with a message after it accepted it. Each
//! fresh message (a publish, or an element of a batch; a deduplicated repeat
//! is not delivered again) is delivered to its destination, retried, flow
//! controlled and reported back the way QStash does. Plain HTTP to loopback
//! destinations only: anything else is refused when it is published.
//!
//! **A delivery** is a request to the destination with the method from
//! `Upstash-Method` (POST by default), the body unchanged, every
//! `Upstash-Forward-X: v` header as `X: v`, the message's `Content-Type`, and
//! the stand-in's own `User-Agent: Upstash-QStash`, `Upstash-Message-Id`,
//! `Upstash-Retried` (0 on the first attempt) and `Upstash-Signature` (a JWT
//! minted for each attempt, [`super::signing`], under
//! [`DeliveryConfig::signing_key`]).
//!
//! **Success and retries.** A 2xx is a success. Anything else, a timeout
//! ([`DeliveryConfig::attempt_timeout`]) or a connection error fails the
//! attempt, and the message is tried again after [`DeliveryConfig::retry_delay`]
//! while retries remain: `Upstash-Retries` of them (else
//! [`DeliveryConfig::retries`]; 3, as QStash). QStash's own delay after the
//! n-th failure is `min(86400, e^(2.5·n))` seconds (`retry_delay = "qstash"`);
//! a test or a scenario wants a short fixed one. After the last failed
//! attempt the message has failed. Status 489 with
//! `Upstash-NonRetryable-Error: true` fails it at once.
//!
//! **Flow control.** Messages with the same `Upstash-Flow-Control-Key` and
//! `Upstash-Flow-Control-Value: parallelism=N` have at most N calls in flight
//! at once; a call is in flight from its request until the destination's
//! answer (or the timeout). Messages over the limit wait in line, in the order
//! they were accepted. A message waiting out its retry delay is not in
//! flight: meanwhile the key's later messages are delivered, so after a
//! failed delivery a later message of a key can reach the destination before
//! an earlier one. That is how QStash behaves, and why order can only be
//! checked at the destination ([`super::destination`]). `rate` and `period`
//! in the value are not enforced.
//!
//! **Callbacks.** With `Upstash-Callback: <url>`, after every attempt the
//! stand-in POSTs a report to that URL; with `Upstash-Failure-Callback: <url>`,
//! it POSTs one after the last attempt failed. Both are signed like a
//! delivery (the JWT's `sub` is the callback URL), carry
//! `Upstash-Callback-Forward-*` / `Upstash-Failure-Callback-Forward-*` headers
//! without that prefix, and are retried [`DeliveryConfig::callback_retries`]
//! times after the same delay when the callback URL does not answer 2xx. The
//! report is JSON:
//!
//! | field | value |
//! |---|---|
//! | `status` | the destination's status; 0 when no answer came (timeout, connection error) |
//! | `header` | the destination's answer headers, name → array of values |
//! | `body` | base64 of the destination's answer body; of the error text when no answer came |
//! | `retried` | how many times the message was retried before this attempt |
//! | `maxRetries` | the retries it was allowed |
//! | `sourceMessageId`, `url`, `method` | the message, its destination, the method |
//! | `sourceHeader` | the headers the destination was sent (forwarded ones without their prefix, `Content-Type`), name → array |
//! | `sourceBody` | base64 of the message's body |
//! | `createdAt` | when the message was accepted, unix ms |
//! | `dlqId` | failure callbacks only: the message's id in the dead-letter queue |
//!
//! Header names in `header` and `sourceHeader` are canonical (`X-Outbox-Id`),
//! as QStash's servers write them. Base64 is standard, padded.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::json;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;

use super::adversary::now_us;
use super::signing::{self, DEV_CURRENT_SIGNING_KEY};
use super::FORWARD_PREFIX;

const CALLBACK_FORWARD_PREFIX: &str = "upstash-callback-forward-";
const FAILURE_CALLBACK_FORWARD_PREFIX: &str = "upstash-failure-callback-forward-";
/// The largest answer body a delivery reads (and reports in a callback).
const MAX_ANSWER_BYTES: usize = 1024 * 1024;

/// How the sink delivers accepted messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeliveryConfig {
    /// Signs `Upstash-Signature`; the dev server's current key by default.
    pub signing_key: String,
    /// Retries of a message that sets no `Upstash-Retries` (QStash's default, 3).
    pub retries: u32,
    /// Bound on one attempt, answer body included.
    #[serde(with = "humantime_serde")]
    pub attempt_timeout: Duration,
    /// Pause before each retry: a duration (`"2s"`), or `"qstash"` for
    /// QStash's `min(86400, e^(2.5·n))` seconds after the n-th failure.
    pub retry_delay: RetryDelay,
    /// With a fixed `retry_delay`: each pause drawn uniformly from
    /// `[retry_delay, retry_delay_max]`.
    #[serde(default, with = "humantime_serde")]
    pub retry_delay_max: Option<Duration>,
    /// Retries of a callback whose URL does not answer 2xx.
    pub callback_retries: u32,
    /// Seed of the RNG the pauses are drawn from.
    pub seed: u64,
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            signing_key: DEV_CURRENT_SIGNING_KEY.to_owned(),
            retries: 3,
            attempt_timeout: Duration::from_secs(5),
            retry_delay: RetryDelay::Fixed(Duration::from_millis(100)),
            retry_delay_max: None,
            callback_retries: 3,
            seed: 0,
        }
    }
}

impl DeliveryConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.signing_key.is_empty() {
            return Err("delivery.signing_key must not be empty".into());
        }
        if self.attempt_timeout.is_zero() {
            return Err("delivery.attempt_timeout must be longer than 0".into());
        }
        match (self.retry_delay, self.retry_delay_max) {
            (RetryDelay::Qstash, Some(_)) => {
                Err("delivery.retry_delay_max goes with a fixed retry_delay, not \"qstash\"".into())
            }
            (RetryDelay::Fixed(lo), Some(hi)) if hi < lo => Err(format!(
                "delivery.retry_delay_max ({}) must not be below retry_delay ({})",
                humantime::format_duration(hi),
                humantime::format_duration(lo)
            )),
            _ => Ok(()),
        }
    }
}

/// The pause before a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryDelay {
    Fixed(Duration),
    /// QStash's default backoff: `min(86400, e^(2.5·n))` seconds after the
    /// n-th failure (12 s, 2 min 28 s, 30 min, 6 h, then a day).
    Qstash,
}

impl RetryDelay {
    /// The pause after the `n`-th failed attempt (`n` ≥ 1).
    pub fn after(&self, n: u32) -> Duration {
        match self {
            RetryDelay::Fixed(d) => *d,
            RetryDelay::Qstash => Duration::from_secs_f64((2.5 * f64::from(n)).exp().min(86400.0)),
        }
    }
}

impl fmt::Display for RetryDelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RetryDelay::Fixed(d) => write!(f, "{}", humantime::format_duration(*d)),
            RetryDelay::Qstash => f.write_str("qstash"),
        }
    }
}

impl Serialize for RetryDelay {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for RetryDelay {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        if text == "qstash" {
            return Ok(RetryDelay::Qstash);
        }
        humantime::parse_duration(&text)
            .map(RetryDelay::Fixed)
            .map_err(|e| {
                serde::de::Error::custom(format!(
                    "retry_delay: `{text}` is neither a duration (\"2s\") nor \"qstash\": {e}"
                ))
            })
    }
}

/// What became of one delivered message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryOutcome {
    pub message_id: String,
    pub destination: String,
    pub outbox_id: Option<i64>,
    pub flow_control_key: Option<String>,
    pub attempts: u32,
    /// The last answer's status, if any answer came.
    pub last_status: Option<u16>,
    pub delivered: bool,
    /// The last failure, when not delivered.
    pub error: Option<String>,
}

/// One attempt to deliver a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryAttempt {
    pub message_id: String,
    pub outbox_id: Option<i64>,
    pub flow_control_key: Option<String>,
    /// `Upstash-Retried` of this attempt.
    pub retried: u32,
    /// Wall clock, unix µs: the request went out (the key's slot was taken).
    pub started_at_us: i64,
    /// The answer came (or the attempt failed); the slot was given back.
    pub ended_at_us: i64,
    pub status: Option<u16>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallbackKind {
    /// `Upstash-Callback`: after every attempt.
    Callback,
    /// `Upstash-Failure-Callback`: after the last attempt failed.
    Failure,
}

/// What became of one callback.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallbackOutcome {
    pub kind: CallbackKind,
    pub url: String,
    pub source_message_id: String,
    pub outbox_id: Option<i64>,
    /// The `retried` of the attempt it reports.
    pub retried: u32,
    /// The destination's status it reports (0: no answer).
    pub status: u16,
    /// Requests to the callback URL.
    pub attempts: u32,
    pub last_status: Option<u16>,
    pub delivered: bool,
}

/// A callback URL and the headers it gets.
#[derive(Debug, Clone)]
pub(crate) struct Callback {
    url: String,
    headers: Vec<(String, String)>,
}

/// One message to deliver, as its publish headers say.
pub(crate) struct Delivery {
    message_id: String,
    outbox_id: Option<i64>,
    destination: String,
    method: http::Method,
    /// What the destination is sent: forwarded headers without their prefix, `content-type`.
    headers: Vec<(String, String)>,
    body: Bytes,
    retries: u32,
    /// The flow-control key, and its parallelism when the value sets one.
    flow: Option<(String, Option<usize>)>,
    callback: Option<Callback>,
    failure_callback: Option<Callback>,
    created_at_ms: i64,
}

impl Delivery {
    /// The delivery of a message with `headers` (lower-case names), or why
    /// the stand-in refuses it: a destination or callback off the loopback,
    /// an `Upstash-Retries` or flow-control value it cannot read.
    pub(crate) fn plan(
        outbox_id: Option<i64>,
        destination: &str,
        headers: &[(String, String)],
        body: Bytes,
        default_retries: u32,
    ) -> Result<Delivery, String> {
        check_loopback(destination)?;
        let header = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.trim())
        };
        let method = match header("upstash-method") {
            Some(m) => http::Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                .map_err(|_| format!("Upstash-Method `{m}` is not an HTTP method"))?,
            None => http::Method::POST,
        };
        let retries = match header("upstash-retries") {
            Some(r) => r
                .parse()
                .map_err(|_| format!("Upstash-Retries `{r}` is not a number of retries"))?,
            None => default_retries,
        };
        let flow = match header("upstash-flow-control-key") {
            Some(key) => Some((
                key.to_owned(),
                parallelism(header("upstash-flow-control-value").unwrap_or(""))?,
            )),
            None => None,
        };
        let callback = |url_header: &str, prefix: &str| -> Result<Option<Callback>, String> {
            let Some(url) = header(url_header) else {
                return Ok(None);
            };
            check_loopback(url).map_err(|e| format!("{url_header}: {e}"))?;
            Ok(Some(Callback {
                url: url.to_owned(),
                headers: stripped(headers, prefix),
            }))
        };
        let mut sent = stripped(headers, FORWARD_PREFIX);
        if let Some(ct) = header("content-type") {
            sent.push(("content-type".to_owned(), ct.to_owned()));
        }
        Ok(Delivery {
            message_id: String::new(),
            outbox_id,
            destination: destination.to_owned(),
            method,
            headers: sent,
            body,
            retries,
            flow,
            callback: callback("upstash-callback", CALLBACK_FORWARD_PREFIX)?,
            failure_callback: callback(
                "upstash-failure-callback",
                FAILURE_CALLBACK_FORWARD_PREFIX,
            )?,
            created_at_ms: now_us() / 1000,
        })
    }
}

/// The headers with `prefix`, without it.
fn stripped(headers: &[(String, String)], prefix: &str) -> Vec<(String, String)> {
    headers
        .iter()
        .filter_map(|(n, v)| n.strip_prefix(prefix).map(|n| (n.to_owned(), v.clone())))
        .collect()
}

/// `parallelism=N` from a flow-control value (`parallelism=1, rate=10, period=1s`).
fn parallelism(value: &str) -> Result<Option<usize>, String> {
    for part in value.split(',') {
        let Some((name, n)) = part.split_once('=') else {
            continue;
        };
        if name.trim().eq_ignore_ascii_case("parallelism") {
            return match n.trim().parse::<usize>() {
                Ok(n) if n > 0 => Ok(Some(n)),
                _ => Err(format!(
                    "Upstash-Flow-Control-Value `{value}`: parallelism must be a number above 0"
                )),
            };
        }
    }
    Ok(None)
}

/// `Err(reason)` unless `url` is `http://` to a loopback host.
pub(crate) fn check_loopback(url: &str) -> Result<(), String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("destination `{url}` is not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!(
            "destination `{url}`: this sink delivers over plain http only"
        ));
    }
    let host = uri.host().unwrap_or("");
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if loopback {
        Ok(())
    } else {
        Err(format!(
            "destination `{url}` is not a loopback address; this sink delivers to loopback only"
        ))
    }
}

/// `X-Outbox-Id` from `x-outbox-id`, as Go's servers write header names.
fn canonical(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut upper = true;
    for c in name.chars() {
        out.push(if upper {
            c.to_ascii_uppercase()
        } else {
            c.to_ascii_lowercase()
        });
        upper = c == '-';
    }
    out
}

/// Headers as a report carries them: canonical name → values.
fn header_arrays<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> BTreeMap<String, Vec<String>> {
    let mut map: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (n, v) in headers {
        map.entry(canonical(n)).or_default().push(v.to_owned());
    }
    map
}

/// Flow control: per key, how many calls are in flight and who waits, in order.
#[derive(Default)]
struct Gates {
    keys: Mutex<HashMap<String, Gate>>,
}

struct Gate {
    parallelism: usize,
    in_flight: usize,
    waiting: VecDeque<oneshot::Sender<()>>,
}

impl Gate {
    /// Lets waiters in while there is room.
    fn admit(&mut self) {
        while self.in_flight < self.parallelism {
            let Some(next) = self.waiting.pop_front() else {
                break;
            };
            if next.send(()).is_ok() {
                self.in_flight += 1;
            }
        }
    }
}

/// A place in a key's line.
struct Ticket {
    gates: Arc<Gates>,
    key: String,
    /// Granted at once when `None`.
    wait: Option<oneshot::Receiver<()>>,
    /// Whether it holds a slot (given back on drop).
    holds: bool,
}

impl Gates {
    /// Joins `key`'s line now (so the line is in the order of the calls),
    /// the limit being `parallelism` (the latest message's value wins).
    fn enter(self: &Arc<Self>, key: &str, parallelism: usize) -> Ticket {
        let mut keys = self.keys.lock().expect("gates lock");
        let gate = keys.entry(key.to_owned()).or_insert(Gate {
            parallelism,
            in_flight: 0,
            waiting: VecDeque::new(),
        });
        gate.parallelism = parallelism;
        let ticket = |wait, holds| Ticket {
            gates: Arc::clone(self),
            key: key.to_owned(),
            wait,
            holds,
        };
        if gate.waiting.is_empty() && gate.in_flight < gate.parallelism {
            gate.in_flight += 1;
            ticket(None, true)
        } else {
            let (tx, rx) = oneshot::channel();
            gate.waiting.push_back(tx);
            gate.admit();
            ticket(Some(rx), false)
        }
    }

    fn release(&self, key: &str) {
        let mut keys = self.keys.lock().expect("gates lock");
        if let Some(gate) = keys.get_mut(key) {
            gate.in_flight = gate.in_flight.saturating_sub(1);
            gate.admit();
            if gate.in_flight == 0 && gate.waiting.is_empty() {
                keys.remove(key);
            }
        }
    }
}

impl Ticket {
    /// Waits for a slot; it is given back when the ticket is dropped.
    async fn slot(mut self) -> Ticket {
        // Waited on in place: a task stopped meanwhile drops the ticket with
        // its receiver, and a grant that came is given back.
        if let Some(wait) = self.wait.as_mut() {
            let granted = wait.await.is_ok();
            self.wait = None;
            self.holds = granted;
        }
        self
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // A grant that arrived after its task stopped waiting is given back too.
        if let Some(mut wait) = self.wait.take() {
            wait.close();
            self.holds = wait.try_recv().is_ok();
        }
        if self.holds {
            self.gates.release(&self.key);
        }
    }
}

/// The destination's answer to one attempt.
struct Answer {
    status: http::StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
}

pub(crate) struct Deliverer {
    config: DeliveryConfig,
    client: Client<HttpConnector, Full<Bytes>>,
    gates: Arc<Gates>,
    rng: Mutex<StdRng>,
    dlq_seq: AtomicU64,
    outcomes: Mutex<Vec<DeliveryOutcome>>,
    attempts: Mutex<Vec<DeliveryAttempt>>,
    callbacks: Mutex<Vec<CallbackOutcome>>,
    tasks: Mutex<JoinSet<()>>,
    done: watch::Sender<usize>,
    called_back: watch::Sender<usize>,
}

impl Deliverer {
    pub(crate) fn new(config: DeliveryConfig) -> Arc<Self> {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(config.attempt_timeout));
        let client = Client::builder(TokioExecutor::new()).build(http);
        Arc::new(Deliverer {
            rng: Mutex::new(StdRng::seed_from_u64(config.seed)),
            config,
            client,
            gates: Arc::default(),
            dlq_seq: AtomicU64::new(0),
            outcomes: Mutex::new(Vec::new()),
            attempts: Mutex::new(Vec::new()),
            callbacks: Mutex::new(Vec::new()),
            tasks: Mutex::new(JoinSet::new()),
            done: watch::channel(0).0,
            called_back: watch::channel(0).0,
        })
    }

    pub(crate) fn default_retries(&self) -> u32 {
        self.config.retries
    }

    /// Delivers `delivery` (accepted as `message_id`) in the background; its
    /// first call joins its key's line now, in acceptance order.
    pub(crate) fn spawn(self: &Arc<Self>, message_id: &str, mut delivery: Delivery) {
        delivery.message_id = message_id.to_owned();
        let ticket = self.ticket(&delivery);
        let me = Arc::clone(self);
        self.run(async move {
            let outcome = me.deliver(delivery, ticket).await;
            let n = {
                let mut outcomes = me.outcomes.lock().expect("outcomes lock");
                outcomes.push(outcome);
                outcomes.len()
            };
            me.done.send_replace(n);
        });
    }

    fn run(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut tasks = self.tasks.lock().expect("tasks lock");
        while tasks.try_join_next().is_some() {}
        tasks.spawn(task);
    }

    fn ticket(&self, d: &Delivery) -> Option<Ticket> {
        match &d.flow {
            Some((key, Some(parallelism))) => Some(self.gates.enter(key, *parallelism)),
            _ => None,
        }
    }

    pub(crate) fn outcomes(&self) -> Vec<DeliveryOutcome> {
        self.outcomes.lock().expect("outcomes lock").clone()
    }

    pub(crate) fn attempts(&self) -> Vec<DeliveryAttempt> {
        self.attempts.lock().expect("attempts lock").clone()
    }

    pub(crate) fn callbacks(&self) -> Vec<CallbackOutcome> {
        self.callbacks.lock().expect("callbacks lock").clone()
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<usize> {
        self.done.subscribe()
    }

    pub(crate) fn subscribe_callbacks(&self) -> watch::Receiver<usize> {
        self.called_back.subscribe()
    }

    pub(crate) fn abort_all(&self) {
        self.tasks.lock().expect("tasks lock").abort_all();
    }

    /// The pause after the `n`-th failed attempt.
    fn pause(&self, n: u32) -> Duration {
        let base = self.config.retry_delay.after(n);
        match (self.config.retry_delay, self.config.retry_delay_max) {
            (RetryDelay::Fixed(lo), Some(hi)) if hi > lo => {
                let span = (hi - lo).as_micros() as u64;
                lo + Duration::from_micros(
                    self.rng.lock().expect("rng lock").random_range(0..=span),
                )
            }
            _ => base,
        }
    }

    async fn deliver(self: &Arc<Self>, d: Delivery, mut ticket: Option<Ticket>) -> DeliveryOutcome {
        let mut outcome = DeliveryOutcome {
            message_id: d.message_id.clone(),
            destination: d.destination.clone(),
            outbox_id: d.outbox_id,
            flow_control_key: d.flow.as_ref().map(|(k, _)| k.clone()),
            attempts: 0,
            last_status: None,
            delivered: false,
            error: None,
        };
        for retried in 0..=d.retries {
            if retried > 0 {
                tokio::time::sleep(self.pause(retried)).await;
                ticket = self.ticket(&d);
            }
            let slot = match ticket.take() {
                Some(t) => Some(t.slot().await),
                None => None,
            };
            let started_at_us = now_us();
            let result =
                match tokio::time::timeout(self.config.attempt_timeout, self.attempt(&d, retried))
                    .await
                {
                    Ok(r) => r,
                    Err(_) => Err(format!(
                        "no answer within {}",
                        humantime::format_duration(self.config.attempt_timeout)
                    )),
                };
            drop(slot);
            let ended_at_us = now_us();
            outcome.attempts = retried + 1;
            let (status, error) = match &result {
                Ok(a) if a.status.is_success() => (Some(a.status.as_u16()), None),
                Ok(a) => (
                    Some(a.status.as_u16()),
                    Some(format!("destination answered {}", a.status)),
                ),
                Err(e) => (None, Some(e.clone())),
            };
            self.attempts
                .lock()
                .expect("attempts lock")
                .push(DeliveryAttempt {
                    message_id: d.message_id.clone(),
                    outbox_id: d.outbox_id,
                    flow_control_key: outcome.flow_control_key.clone(),
                    retried,
                    started_at_us,
                    ended_at_us,
                    status,
                    error: error.clone(),
                });
            outcome.last_status = status;
            outcome.delivered = error.is_none();
            outcome.error = error;
            let non_retryable = result.as_ref().is_ok_and(|a| {
                a.status.as_u16() == 489
                    && a.headers
                        .get("upstash-nonretryable-error")
                        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
            });
            let last = outcome.delivered || non_retryable || retried == d.retries;
            if let Some(cb) = &d.callback {
                self.call_back(CallbackKind::Callback, cb, &d, retried, &result);
            }
            if last {
                if !outcome.delivered {
                    if let Some(cb) = &d.failure_callback {
                        self.call_back(CallbackKind::Failure, cb, &d, retried, &result);
                    }
                }
                break;
            }
        }
        outcome
    }

    async fn attempt(&self, d: &Delivery, retried: u32) -> Result<Answer, String> {
        let resp = self
            .send(
                &d.destination,
                d.method.clone(),
                &d.headers,
                &d.message_id,
                retried,
                &d.body,
            )
            .await?;
        let (parts, body) = resp.into_parts();
        // The status is the answer; a body too long or broken off is only reported so.
        let body = match http_body_util::Limited::new(body, MAX_ANSWER_BYTES)
            .collect()
            .await
        {
            Ok(b) => b.to_bytes(),
            Err(e) => Bytes::from(format!("(the answer's body could not be read: {e})")),
        };
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    /// One signed request, as QStash makes it.
    async fn send(
        &self,
        url: &str,
        method: http::Method,
        headers: &[(String, String)],
        message_id: &str,
        retried: u32,
        body: &Bytes,
    ) -> Result<http::Response<hyper::body::Incoming>, String> {
        let now = chrono::Utc::now().timestamp();
        let jti = format!("jwt_{}", uuid::Uuid::new_v4().simple());
        // A fresh signature per attempt: one lives 5 minutes, retries may not.
        let claims = signing::SignatureClaims::new(url, body, now, jti);
        let mut req = http::Request::builder()
            .method(method)
            .uri(url)
            .header("user-agent", "Upstash-QStash")
            .header(
                "upstash-signature",
                signing::sign(&self.config.signing_key, &claims),
            )
            .header("upstash-message-id", message_id)
            .header("upstash-retried", retried.to_string());
        for (name, value) in headers {
            req = req.header(name.as_str(), value.as_str());
        }
        let req = req
            .body(Full::new(body.clone()))
            .map_err(|e| format!("cannot build the request: {e}"))?;
        self.client
            .request(req)
            .await
            .map_err(|e| format!("request failed: {e}"))
    }

    /// Reports attempt `retried` of `d` to `cb` in the background.
    fn call_back(
        self: &Arc<Self>,
        kind: CallbackKind,
        cb: &Callback,
        d: &Delivery,
        retried: u32,
        result: &Result<Answer, String>,
    ) {
        let (status, header, answer) = match result {
            Ok(a) => (
                a.status.as_u16(),
                header_arrays(
                    a.headers
                        .iter()
                        .filter_map(|(n, v)| Some((n.as_str(), v.to_str().ok()?))),
                ),
                a.body.clone(),
            ),
            Err(e) => (0, BTreeMap::new(), Bytes::from(e.clone())),
        };
        let mut report = json!({
            "status": status,
            "header": header,
            "body": STANDARD.encode(&answer),
            "retried": retried,
            "maxRetries": d.retries,
            "sourceMessageId": d.message_id,
            "url": d.destination,
            "method": d.method.as_str(),
            "sourceHeader": header_arrays(d.headers.iter().map(|(n, v)| (n.as_str(), v.as_str()))),
            "sourceBody": STANDARD.encode(&d.body),
            "createdAt": d.created_at_ms,
        });
        if kind == CallbackKind::Failure {
            let seq = self.dlq_seq.fetch_add(1, Ordering::Relaxed);
            report["dlqId"] = json!(format!("{}-{seq}", now_us() / 1000));
        }
        let body = Bytes::from(report.to_string());
        let mut headers = cb.headers.clone();
        headers.push(("content-type".into(), "application/json".into()));
        let mut outcome = CallbackOutcome {
            kind,
            url: cb.url.clone(),
            source_message_id: d.message_id.clone(),
            outbox_id: d.outbox_id,
            retried,
            status,
            attempts: 0,
            last_status: None,
            delivered: false,
        };
        let me = Arc::clone(self);
        self.run(async move {
            // The callback is a message of its own.
            let message_id = format!("msg_{}", uuid::Uuid::new_v4().simple());
            for attempt in 0..=me.config.callback_retries {
                if attempt > 0 {
                    tokio::time::sleep(me.pause(attempt)).await;
                }
                outcome.attempts = attempt + 1;
                let sent = tokio::time::timeout(
                    me.config.attempt_timeout,
                    me.send(
                        &outcome.url,
                        http::Method::POST,
                        &headers,
                        &message_id,
                        attempt,
                        &body,
                    ),
                )
                .await;
                if let Ok(Ok(resp)) = sent {
                    let status = resp.status();
                    let _ = resp.into_body().collect().await;
                    outcome.last_status = Some(status.as_u16());
                    if status.is_success() {
                        outcome.delivered = true;
                        break;
                    }
                }
            }
            let n = {
                let mut callbacks = me.callbacks.lock().expect("callbacks lock");
                callbacks.push(outcome);
                callbacks.len()
            };
            me.called_back.send_replace(n);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_http() {
        assert!(check_loopback("http://127.0.0.1:8080/hook").is_ok());
        assert!(check_loopback("http://127.9.9.9/hook?a=1").is_ok());
        assert!(check_loopback("http://localhost:1/x").is_ok());
        assert!(check_loopback("http://[::1]:1/x").is_ok());
        assert!(check_loopback("https://127.0.0.1/x").is_err());
        assert!(check_loopback("http://10.0.0.1/x").is_err());
        assert!(check_loopback("http://example.com/x").is_err());
    }

    #[test]
    fn qstash_backoff_grows_to_a_day() {
        let secs = |n| RetryDelay::Qstash.after(n).as_secs();
        assert_eq!((secs(1), secs(2), secs(3), secs(4)), (12, 148, 1808, 22026));
        assert_eq!(secs(5), 86400);
        assert_eq!(secs(40), 86400);
        assert_eq!(
            RetryDelay::Fixed(Duration::from_secs(2)).after(7),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn retry_delay_reads_a_duration_or_qstash_and_names_bad_input() {
        #[derive(Deserialize)]
        struct T {
            d: RetryDelay,
        }
        let d = |s: &str| serde_json::from_value::<T>(json!({ "d": s })).map(|t| t.d);
        assert_eq!(
            d("1500ms").unwrap(),
            RetryDelay::Fixed(Duration::from_millis(1500))
        );
        assert_eq!(d("qstash").unwrap(), RetryDelay::Qstash);
        let err = d("soon").err().unwrap().to_string();
        assert!(err.contains("`soon`") && err.contains("qstash"), "{err}");
        assert_eq!(RetryDelay::Qstash.to_string(), "qstash");
        assert_eq!(RetryDelay::Fixed(Duration::from_secs(2)).to_string(), "2s");
    }

    #[test]
    fn parallelism_from_the_flow_control_value() {
        assert_eq!(parallelism("parallelism=1"), Ok(Some(1)));
        assert_eq!(
            parallelism("rate=10, parallelism=4, period=1s"),
            Ok(Some(4))
        );
        assert_eq!(parallelism("rate=10"), Ok(None));
        assert_eq!(parallelism(""), Ok(None));
        assert!(parallelism("parallelism=0").is_err());
        assert!(parallelism("parallelism=x").is_err());
    }

    #[test]
    fn canonical_header_names() {
        assert_eq!(canonical("x-outbox-id"), "X-Outbox-Id");
        assert_eq!(canonical("CONTENT-TYPE"), "Content-Type");
    }

    #[tokio::test]
    async fn a_key_admits_in_line_order_and_no_more_than_its_parallelism() {
        let gates = Arc::new(Gates::default());
        let first = gates.enter("k", 1);
        let second = gates.enter("k", 1);
        let third = gates.enter("k", 1);
        let other = gates.enter("other", 1);
        assert!(first.holds && other.holds, "free slots are taken at once");
        assert!(!second.holds && !third.holds);
        // A waiter that gives up keeps nobody out.
        drop(second);
        drop(first);
        let third = third.slot().await;
        assert!(third.holds);
        assert_eq!(gates.keys.lock().unwrap()["k"].in_flight, 1);
        drop(third);
        drop(other);
        assert!(gates.keys.lock().unwrap().is_empty());
    }
}
