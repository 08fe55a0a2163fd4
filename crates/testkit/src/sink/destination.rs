//! The final destination of delivery mode: a loopback HTTP server standing in
//! for the application QStash delivers to. It records every call it gets
//! ([`Call`]: the outbox id and partition key it carries, which attempt it
//! is, when it came in and when it was answered), fails a configurable
//! fraction of calls with a 5xx and adds latency, so a test or a scenario can
//! check order where it matters: at the destination ([`check_order`]).
//!
//! The outbox id is the `X-Outbox-Id` header (the relay forwards it), else
//! the body's `id`; the partition key is the body's `partitionKey` (the
//! relay's envelope). A call without either is counted but cannot be checked.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::adversary::now_us;
use super::SinkError;

/// The status that, with `Upstash-NonRetryable-Error: true`, tells QStash
/// not to retry; the destination adds the header when it answers it.
pub const NON_RETRYABLE: u16 = 489;

/// Largest request body the destination reads.
const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// How the destination answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DestinationConfig {
    /// `127.0.0.1:0` picks a free port.
    pub bind: SocketAddr,
    /// Fraction of calls answered `failure_status`, drawn from a seeded RNG.
    pub failure_rate: f64,
    /// A 5xx (or 489, which fails the message without retries).
    pub failure_status: u16,
    /// Fixed time every call takes before it is answered.
    #[serde(with = "humantime_serde")]
    pub latency: Duration,
    /// Uniform random time in `[0, jitter)` on top of `latency`.
    #[serde(with = "humantime_serde")]
    pub jitter: Duration,
    pub seed: u64,
}

impl Default for DestinationConfig {
    fn default() -> Self {
        DestinationConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            failure_rate: 0.0,
            failure_status: 503,
            latency: Duration::ZERO,
            jitter: Duration::ZERO,
            seed: 0,
        }
    }
}

impl DestinationConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.failure_rate) {
            return Err(format!(
                "destination.failure_rate must be between 0 and 1, got {}",
                self.failure_rate
            ));
        }
        if !(500..=599).contains(&self.failure_status) && self.failure_status != NON_RETRYABLE {
            return Err(format!(
                "destination.failure_status must be a 5xx or 489, got {}",
                self.failure_status
            ));
        }
        Ok(())
    }
}

/// One call the destination got.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Call {
    /// `X-Outbox-Id`, else the body's `id`.
    pub outbox_id: Option<i64>,
    /// The body's `partitionKey`.
    pub partition_key: Option<String>,
    /// `Upstash-Message-Id`.
    pub message_id: Option<String>,
    /// `Upstash-Retried`: 0 on the first attempt.
    pub retried: Option<u32>,
    /// The W3C `traceparent` it carried (the producer's, forwarded).
    pub traceparent: Option<String>,
    pub method: String,
    /// Path and query.
    pub target: String,
    /// What it was answered; 0 while a rule decides, or when the caller
    /// went away before the answer.
    pub status: u16,
    /// Wall clock, unix µs, when the request came in (headers and body read).
    pub in_us: i64,
    /// When the answer went out (or the caller went away); 0 while a rule decides.
    pub out_us: i64,
}

impl Call {
    pub fn succeeded(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

type Rule = Box<dyn Fn(&Call) -> Option<u16> + Send + Sync>;

struct Shared {
    config: DestinationConfig,
    rng: Mutex<StdRng>,
    rule: Mutex<Option<Rule>>,
    calls: Mutex<Vec<Call>>,
    answered: watch::Sender<usize>,
}

/// Starts destinations: `Destination::start(DestinationConfig::default()).await?`.
pub struct Destination;

impl Destination {
    /// Binds and serves until [`DestinationHandle::stop`] (or the handle is dropped).
    pub async fn start(config: DestinationConfig) -> Result<DestinationHandle, SinkError> {
        config.validate().map_err(SinkError::Config)?;
        let bind = |source| SinkError::Bind {
            addr: config.bind,
            source,
        };
        let listener = TcpListener::bind(config.bind).await.map_err(bind)?;
        let addr = listener.local_addr().map_err(bind)?;
        let shared = Arc::new(Shared {
            rng: Mutex::new(StdRng::seed_from_u64(config.seed)),
            config,
            rule: Mutex::new(None),
            calls: Mutex::new(Vec::new()),
            answered: watch::channel(0).0,
        });
        let (shutdown, stopped) = watch::channel(false);
        let server = tokio::spawn(serve(listener, Arc::clone(&shared), stopped));
        Ok(DestinationHandle {
            addr,
            shared,
            shutdown,
            server: Some(server),
        })
    }
}

/// A running destination.
pub struct DestinationHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl DestinationHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`; any path is served.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every call answered so far, in the order answered.
    pub fn calls(&self) -> Vec<Call> {
        self.shared.calls.lock().expect("calls lock").clone()
    }

    /// Decides a call's status before the random draw: `Some(status)` answers
    /// with it (a test's deterministic failures), `None` leaves the call to
    /// `failure_rate`. The call's `status` and `out_us` are 0 here.
    pub fn set_rule(&self, rule: impl Fn(&Call) -> Option<u16> + Send + Sync + 'static) {
        *self.shared.rule.lock().expect("rule lock") = Some(Box::new(rule));
    }

    /// Waits until at least `n` calls were answered; false on timeout.
    pub async fn wait_for_calls(&self, n: usize, timeout: Duration) -> bool {
        super::count_reaches(self.shared.answered.subscribe(), n, timeout).await
    }

    /// Stops listening and drops open connections.
    pub async fn stop(mut self) {
        self.shutdown.send_replace(true);
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
    }
}

impl Drop for DestinationHandle {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
    }
}

async fn serve(listener: TcpListener, shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = super::stopped(&mut stopped) => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let shared = Arc::clone(&shared);
                while conns.try_join_next().is_some() {}
                conns.spawn(async move {
                    let svc = service_fn(move |req| answer(Arc::clone(&shared), req));
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        }
    }
    conns.shutdown().await;
}

async fn answer(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = Limited::new(body, MAX_BODY_BYTES)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let header = |name: &str| {
        parts
            .headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.trim().to_owned())
    };
    let json: Option<Value> = serde_json::from_slice(&body).ok();
    let call = Call {
        outbox_id: header("x-outbox-id")
            .and_then(|v| v.parse().ok())
            .or_else(|| {
                json.as_ref()
                    .and_then(|j| j.get("id"))
                    .and_then(super::json_i64)
            }),
        partition_key: json
            .as_ref()
            .and_then(|j| j.get("partitionKey"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        message_id: header("upstash-message-id"),
        retried: header("upstash-retried").and_then(|v| v.parse().ok()),
        traceparent: header("traceparent"),
        method: parts.method.to_string(),
        target: parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned()),
        status: 0,
        in_us: now_us(),
        out_us: 0,
    };
    let ruled = shared
        .rule
        .lock()
        .expect("rule lock")
        .as_ref()
        .and_then(|rule| rule(&call));
    // Recorded however the call ends: a caller that gives up mid-call was
    // still in flight until then.
    let mut open = OpenCall {
        shared: &shared,
        call: Some(call),
    };
    let (status, delay) = {
        let c = &shared.config;
        let mut rng = shared.rng.lock().expect("rng lock");
        let fails = c.failure_rate > 0.0 && rng.random::<f64>() < c.failure_rate;
        let extra = if c.jitter.is_zero() {
            Duration::ZERO
        } else {
            Duration::from_micros(rng.random_range(0..c.jitter.as_micros().max(1) as u64))
        };
        let status = ruled.unwrap_or(if fails { c.failure_status } else { 200 });
        (status, c.latency + extra)
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let text = if status.is_success() {
        r#"{"ok":true}"#.to_owned()
    } else {
        format!(
            r#"{{"error":"the destination answered {}"}}"#,
            status.as_u16()
        )
    };
    open.close(status.as_u16());
    let mut resp = Response::builder()
        .status(status)
        .header("content-type", "application/json");
    if status.as_u16() == NON_RETRYABLE {
        resp = resp.header("upstash-nonretryable-error", "true");
    }
    Ok(resp
        .body(Full::new(Bytes::from(text)))
        .expect("static response parts are valid"))
}

/// A call being answered; recorded when answered or dropped.
struct OpenCall<'a> {
    shared: &'a Shared,
    call: Option<Call>,
}

impl OpenCall<'_> {
    fn close(&mut self, status: u16) {
        let Some(mut call) = self.call.take() else {
            return;
        };
        call.status = status;
        call.out_us = now_us();
        let n = {
            let mut calls = self.shared.calls.lock().expect("calls lock");
            calls.push(call);
            calls.len()
        };
        self.shared.answered.send_replace(n);
    }
}

impl Drop for OpenCall<'_> {
    fn drop(&mut self) {
        self.close(0);
    }
}

/// Whether each partition key's events reached the destination in order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DestinationReport {
    pub calls: u64,
    pub failed_calls: u64,
    /// Calls without an outbox id or a partition key: not checked.
    pub unidentified_calls: u64,
    /// Distinct events with a successful call.
    pub events_delivered: u64,
    /// Events delivered more than once (at least once allows it).
    pub events_delivered_twice: u64,
    pub keys: u64,
    /// Events whose first successful call came after that of a later event
    /// (a higher outbox id) of their key.
    pub out_of_order: u64,
    pub out_of_order_keys: u64,
    /// The most calls of one key in flight at once, over all keys.
    pub max_in_flight_per_key: u64,
    /// Keys with more calls in flight at once than the parallelism allowed.
    pub over_parallelism_keys: u64,
    /// Up to [`MAX_EXAMPLES`] of each kind of violation, in words.
    pub examples: Vec<String>,
}

/// How many violations of each kind a report spells out.
pub const MAX_EXAMPLES: usize = 10;

impl DestinationReport {
    /// No event out of order and no key over its parallelism.
    pub fn passed(&self) -> bool {
        self.out_of_order == 0 && self.over_parallelism_keys == 0
    }
}

/// Checks `calls` (in any order) per partition key: the first successful
/// call of each event must come in outbox id order (by the time it came in),
/// and with `parallelism`, no key may have more calls in flight at once (a
/// call is in flight from the time it came in to the time it was answered;
/// one ending when the next begins does not overlap it).
pub fn check_order(calls: &[Call], parallelism: Option<u64>) -> DestinationReport {
    let mut report = DestinationReport {
        calls: calls.len() as u64,
        failed_calls: calls.iter().filter(|c| !c.succeeded()).count() as u64,
        ..DestinationReport::default()
    };
    let mut by_key: BTreeMap<&str, Vec<&Call>> = BTreeMap::new();
    for c in calls {
        match (&c.partition_key, c.outbox_id) {
            (Some(key), Some(_)) => by_key.entry(key).or_default().push(c),
            _ => report.unidentified_calls += 1,
        }
    }
    report.keys = by_key.len() as u64;
    let mut order_examples = Vec::new();
    let mut overlap_examples = Vec::new();
    for (key, mut key_calls) in by_key {
        key_calls.sort_by_key(|c| (c.in_us, c.out_us));
        // Order: each event's first success, in arrival order.
        let mut seen = BTreeSet::new();
        let mut twice = BTreeSet::new();
        let mut highest: Option<i64> = None;
        let mut key_out_of_order = 0;
        for c in key_calls.iter().filter(|c| c.succeeded()) {
            let id = c.outbox_id.expect("identified");
            if !seen.insert(id) {
                twice.insert(id);
                continue;
            }
            match highest {
                Some(h) if id < h => {
                    key_out_of_order += 1;
                    if order_examples.len() < MAX_EXAMPLES {
                        order_examples.push(format!(
                            "key {key}: event {id} reached the destination after event {h}"
                        ));
                    }
                }
                _ => highest = Some(id),
            }
        }
        report.events_delivered += seen.len() as u64;
        report.events_delivered_twice += twice.len() as u64;
        report.out_of_order += key_out_of_order;
        report.out_of_order_keys += u64::from(key_out_of_order > 0);
        // Parallelism: the most calls open at once (an end before a start at
        // the same instant).
        let mut edges: Vec<(i64, i8)> = key_calls
            .iter()
            .flat_map(|c| [(c.in_us, 1), (c.out_us, -1)])
            .collect();
        edges.sort();
        let (mut open, mut most) = (0i64, 0i64);
        for (_, step) in edges {
            open += i64::from(step);
            most = most.max(open);
        }
        report.max_in_flight_per_key = report.max_in_flight_per_key.max(most as u64);
        if parallelism.is_some_and(|p| most as u64 > p) {
            report.over_parallelism_keys += 1;
            if overlap_examples.len() < MAX_EXAMPLES {
                overlap_examples.push(format!(
                    "key {key}: {most} calls in flight at once, parallelism {}",
                    parallelism.unwrap_or(0)
                ));
            }
        }
    }
    report.examples = order_examples;
    report.examples.extend(overlap_examples);
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(id: i64, key: &str, status: u16, in_us: i64, out_us: i64) -> Call {
        Call {
            outbox_id: Some(id),
            partition_key: Some(key.to_owned()),
            message_id: None,
            retried: None,
            traceparent: None,
            method: "POST".into(),
            target: "/".into(),
            status,
            in_us,
            out_us,
        }
    }

    /// What `check_order` says of each run of calls (id, key, status, in, out).
    #[test]
    fn order_and_parallelism_per_key() {
        struct Case {
            what: &'static str,
            calls: Vec<Call>,
            parallelism: Option<u64>,
            /// out_of_order, over_parallelism_keys, max_in_flight_per_key
            says: (u64, u64, u64),
        }
        let cases = [
            Case {
                what: "in order, a failure retried before the next event; another key overlapping",
                calls: vec![
                    call(1, "a", 200, 0, 10),
                    call(2, "a", 503, 10, 20),
                    call(2, "a", 200, 30, 40),
                    call(3, "a", 200, 40, 50),
                    call(7, "b", 200, 5, 45),
                ],
                parallelism: Some(1),
                says: (0, 0, 1),
            },
            Case {
                what: "event 1 fails, 2 gets through, 1's retry comes last",
                calls: vec![
                    call(1, "a", 503, 0, 10),
                    call(2, "a", 200, 10, 20),
                    call(1, "a", 200, 1000, 1010),
                ],
                parallelism: Some(1),
                says: (1, 0, 1),
            },
            Case {
                what: "two calls of a key overlap; touching is not overlapping",
                calls: vec![
                    call(1, "a", 200, 0, 10),
                    call(2, "a", 200, 5, 15),
                    call(3, "a", 200, 15, 20),
                ],
                parallelism: Some(1),
                says: (0, 1, 2),
            },
            Case {
                what: "the same overlap under parallelism 2",
                calls: vec![call(1, "a", 200, 0, 10), call(2, "a", 200, 5, 15)],
                parallelism: Some(2),
                says: (0, 0, 2),
            },
            Case {
                what: "a second delivery of an event is no violation",
                calls: vec![
                    call(1, "a", 200, 0, 10),
                    call(2, "a", 200, 10, 20),
                    call(1, "a", 200, 20, 30),
                ],
                parallelism: None,
                says: (0, 0, 1),
            },
        ];
        for case in cases {
            let r = check_order(&case.calls, case.parallelism);
            assert_eq!(
                (
                    r.out_of_order,
                    r.over_parallelism_keys,
                    r.max_in_flight_per_key
                ),
                case.says,
                "{}: {r:?}",
                case.what
            );
            assert_eq!(r.passed(), case.says.0 + case.says.1 == 0, "{}", case.what);
            assert_eq!(r.examples.len() as u64, case.says.0 + case.says.1);
        }
    }

    #[test]
    fn counts_calls_events_and_what_cannot_be_checked() {
        let mut anonymous = call(9, "x", 200, 0, 1);
        anonymous.partition_key = None;
        let calls = [
            call(1, "a", 200, 0, 10),
            call(2, "a", 503, 10, 20),
            call(2, "a", 200, 20, 30),
            call(1, "a", 200, 30, 40),
            call(5, "b", 200, 0, 1),
            anonymous,
        ];
        let r = check_order(&calls, Some(1));
        assert_eq!((r.calls, r.failed_calls, r.unidentified_calls), (6, 1, 1));
        assert_eq!(
            (r.keys, r.events_delivered, r.events_delivered_twice),
            (2, 3, 1)
        );
    }
}
