//! A small QStash stand-in for the engine's tests: speaks `/v2/publish/…` and
//! `/v2/batch`, answers what the test's rule says per message, and records
//! every message it accepted. Also takes webhook POSTs under `/hook/…`.
//! (The load-test harness has the full emulator with fault injection.)

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;

/// One message as the sink saw it.
#[derive(Debug, Clone)]
pub struct Received {
    pub dedup_id: String,
    pub outbox_id: i64,
    pub destination: String,
    /// Lower-case header names.
    pub headers: BTreeMap<String, String>,
    pub body: String,
    /// How many times this dedup id reached the sink before (0 = first).
    pub attempt: u32,
    pub at: Instant,
    pub accepted: bool,
}

impl Received {
    pub fn partition_key(&self) -> String {
        let v: serde_json::Value = serde_json::from_str(&self.body).unwrap_or_default();
        v["partitionKey"].as_str().unwrap_or_default().to_owned()
    }
}

/// What to answer for a message.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Accept,
    Status(u16, Option<String>),
    /// Any status, headers and body bytes (not accepted, whatever the status).
    Raw(RawAnswer),
}

/// An answer exactly as given: status, headers, body bytes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RawAnswer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawAnswer {
    pub fn new(status: u16, body: impl Into<Vec<u8>>) -> RawAnswer {
        RawAnswer {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    pub fn header(mut self, name: &str, value: impl Into<String>) -> RawAnswer {
        self.headers.push((name.to_owned(), value.into()));
        self
    }

    fn response(&self) -> Response {
        let mut r = (
            StatusCode::from_u16(self.status).unwrap(),
            self.body.clone(),
        )
            .into_response();
        for (k, v) in &self.headers {
            r.headers_mut().insert(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        r
    }
}

type Rule = Box<dyn Fn(&Received) -> Reply + Send + Sync>;
/// Answers a whole `/v2/batch` request: given the messages (judged one by one
/// by the rule first), the answer, and which messages it counts as accepted.
type BatchRule = Box<dyn Fn(&[Received]) -> Option<(RawAnswer, Vec<bool>)> + Send + Sync>;

struct Inner {
    token: String,
    rule: Mutex<Rule>,
    batch_rule: Mutex<Option<BatchRule>>,
    seen: Mutex<HashMap<String, u32>>,
    received: Mutex<Vec<Received>>,
    requests: Mutex<Vec<String>>,
    delay: Mutex<std::time::Duration>,
}

#[derive(Clone)]
pub struct TestSink {
    pub addr: SocketAddr,
    inner: Arc<Inner>,
}

impl TestSink {
    pub async fn start(token: &str) -> TestSink {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(token, listener)
    }

    /// A sink on a given address (a destination that comes back after being down).
    pub async fn start_on(token: &str, addr: SocketAddr) -> TestSink {
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        Self::serve(token, listener)
    }

    fn serve(token: &str, listener: tokio::net::TcpListener) -> TestSink {
        let inner = Arc::new(Inner {
            token: token.to_owned(),
            rule: Mutex::new(Box::new(|_| Reply::Accept)),
            batch_rule: Mutex::new(None),
            seen: Mutex::new(HashMap::new()),
            received: Mutex::new(Vec::new()),
            requests: Mutex::new(Vec::new()),
            delay: Mutex::new(std::time::Duration::ZERO),
        });
        let app = Router::new()
            .route("/v2/batch", post(batch))
            .route("/v2/publish/{*destination}", post(publish))
            .route("/hook/{*rest}", post(webhook))
            .with_state(Arc::clone(&inner));
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        TestSink { addr, inner }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request waits this long before it is answered.
    pub fn set_delay(&self, delay: std::time::Duration) {
        *self.inner.delay.lock().unwrap() = delay;
    }

    pub fn set_rule(&self, rule: impl Fn(&Received) -> Reply + Send + Sync + 'static) {
        *self.inner.rule.lock().unwrap() = Box::new(rule);
    }

    /// Answer `/v2/batch` requests as this says (when it returns `Some`).
    pub fn set_batch_rule(
        &self,
        rule: impl Fn(&[Received]) -> Option<(RawAnswer, Vec<bool>)> + Send + Sync + 'static,
    ) {
        *self.inner.batch_rule.lock().unwrap() = Some(Box::new(rule));
    }

    /// Every message answered, accepted or not, in arrival order.
    pub fn received(&self) -> Vec<Received> {
        self.inner.received.lock().unwrap().clone()
    }

    pub fn accepted(&self) -> Vec<Received> {
        self.received().into_iter().filter(|r| r.accepted).collect()
    }

    /// `METHOD path` of every HTTP request.
    pub fn requests(&self) -> Vec<String> {
        self.inner.requests.lock().unwrap().clone()
    }
}

fn header_map(h: &HeaderMap) -> BTreeMap<String, String> {
    h.iter()
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
        .collect()
}

fn authorized(inner: &Inner, headers: &HeaderMap) -> bool {
    headers.get("authorization").and_then(|v| v.to_str().ok())
        == Some(&format!("Bearer {}", inner.token))
}

fn judge(
    inner: &Inner,
    dedup_id: String,
    destination: String,
    headers: BTreeMap<String, String>,
    body: String,
) -> (Received, Reply) {
    let outbox_id = headers
        .get("upstash-forward-x-outbox-id")
        .or_else(|| headers.get("x-outbox-id"))
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1);
    let attempt = {
        let mut seen = inner.seen.lock().unwrap();
        let n = seen.entry(dedup_id.clone()).or_insert(0);
        *n += 1;
        *n - 1
    };
    let mut msg = Received {
        dedup_id,
        outbox_id,
        destination,
        headers,
        body,
        attempt,
        at: Instant::now(),
        accepted: false,
    };
    let reply = (inner.rule.lock().unwrap())(&msg);
    msg.accepted = reply == Reply::Accept;
    (msg, reply)
}

fn record(inner: &Inner, msgs: Vec<Received>) {
    inner.received.lock().unwrap().extend(msgs);
}

fn error_response(status: u16, retry_after: Option<String>) -> Response {
    let mut r = (
        StatusCode::from_u16(status).unwrap(),
        format!("{{\"error\":\"status {status} from the test sink\"}}"),
    )
        .into_response();
    if let Some(ra) = retry_after {
        r.headers_mut().insert("retry-after", ra.parse().unwrap());
    }
    r
}

async fn publish(
    State(inner): State<Arc<Inner>>,
    Path(destination): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    inner
        .requests
        .lock()
        .unwrap()
        .push(format!("POST /v2/publish/{destination}"));
    pause(&inner).await;
    if !authorized(&inner, &headers) {
        return (StatusCode::UNAUTHORIZED, "{\"error\":\"bad token\"}").into_response();
    }
    let h = header_map(&headers);
    let dedup = h
        .get("upstash-deduplication-id")
        .cloned()
        .unwrap_or_default();
    let (msg, reply) = judge(
        &inner,
        dedup,
        destination,
        h,
        String::from_utf8_lossy(&body).into_owned(),
    );
    record(&inner, vec![msg]);
    match reply {
        Reply::Accept => (StatusCode::OK, "{\"messageId\":\"msg_test\"}").into_response(),
        Reply::Status(s, ra) => error_response(s, ra),
        Reply::Raw(raw) => raw.response(),
    }
}

async fn pause(inner: &Inner) {
    let delay = *inner.delay.lock().unwrap();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
}

async fn batch(State(inner): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> Response {
    inner.requests.lock().unwrap().push("POST /v2/batch".into());
    pause(&inner).await;
    if !authorized(&inner, &headers) {
        return (StatusCode::UNAUTHORIZED, "{\"error\":\"bad token\"}").into_response();
    }
    let Ok(items) = serde_json::from_slice::<Vec<serde_json::Value>>(&body) else {
        return (StatusCode::BAD_REQUEST, "{\"error\":\"not a JSON array\"}").into_response();
    };
    // The whole request fails with the first failing message's status, as a
    // server that validates a batch up front would.
    let mut failure = None;
    let mut msgs = Vec::new();
    for item in items {
        let h: BTreeMap<String, String> = item["headers"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let dedup = h
            .get("upstash-deduplication-id")
            .cloned()
            .unwrap_or_default();
        let dest = item["destination"].as_str().unwrap_or_default().to_owned();
        let body = item["body"].as_str().unwrap_or_default().to_owned();
        let (msg, reply) = judge(&inner, dedup, dest, h, body);
        match (reply, &failure) {
            (Reply::Status(s, ra), None) => failure = Some(error_response(s, ra)),
            (Reply::Raw(raw), None) => failure = Some(raw.response()),
            _ => {}
        }
        msgs.push(msg);
    }
    let n = msgs.len();
    if let Some(rule) = &*inner.batch_rule.lock().unwrap() {
        if let Some((answer, accepted)) = rule(&msgs) {
            for (m, a) in msgs.iter_mut().zip(accepted) {
                m.accepted = a;
            }
            record(&inner, msgs);
            return answer.response();
        }
    }
    if failure.is_some() {
        for m in &mut msgs {
            m.accepted = false;
        }
    }
    record(&inner, msgs);
    match failure {
        Some(response) => response,
        None => {
            let answers = vec![serde_json::json!({"messageId": "msg_test"}); n];
            (StatusCode::OK, serde_json::to_string(&answers).unwrap()).into_response()
        }
    }
}

async fn webhook(
    State(inner): State<Arc<Inner>>,
    Path(rest): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    inner
        .requests
        .lock()
        .unwrap()
        .push(format!("POST /hook/{rest}"));
    let h = header_map(&headers);
    let dedup = h.get("webhook-id").cloned().unwrap_or_default();
    let (msg, reply) = judge(
        &inner,
        dedup,
        format!("/hook/{rest}"),
        h,
        String::from_utf8_lossy(&body).into_owned(),
    );
    record(&inner, vec![msg]);
    match reply {
        Reply::Accept => StatusCode::NO_CONTENT.into_response(),
        Reply::Status(s, ra) => error_response(s, ra),
        Reply::Raw(raw) => raw.response(),
    }
}
