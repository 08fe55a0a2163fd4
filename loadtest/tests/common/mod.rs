//! Helpers shared by the integration tests: one-shot HTTP over loopback, a
//! capturing receiver for delivery mode, and the relay and database server
//! the scenario runs use.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::sync::mpsc;

/// An answer, or why there was none.
#[derive(Debug)]
pub enum Answer {
    Response {
        status: StatusCode,
        headers: HeaderMap,
        /// The body as JSON, `Null` when it is not.
        body: Value,
        /// The body as sent.
        raw: Bytes,
    },
    /// The connection failed or closed without an answer.
    ConnectionError(String),
    /// No answer within the client timeout.
    TimedOut,
}

impl Answer {
    pub fn status(&self) -> StatusCode {
        match self {
            Answer::Response { status, .. } => *status,
            other => panic!("expected a response, got {other:?}"),
        }
    }

    pub fn body(&self) -> &Value {
        match self {
            Answer::Response { body, .. } => body,
            other => panic!("expected a response, got {other:?}"),
        }
    }

    pub fn raw(&self) -> &Bytes {
        match self {
            Answer::Response { raw, .. } => raw,
            other => panic!("expected a response, got {other:?}"),
        }
    }

    pub fn header(&self, name: &str) -> Option<String> {
        match self {
            Answer::Response { headers, .. } => {
                headers.get(name).map(|v| v.to_str().unwrap().to_owned())
            }
            other => panic!("expected a response, got {other:?}"),
        }
    }
}

/// POSTs on a fresh connection (no pooling, so a reset is seen as is).
pub async fn post(
    addr: SocketAddr,
    path_and_query: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
    timeout: Duration,
) -> Answer {
    let body = body.into();
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method("POST")
            .uri(path_and_query)
            .header("host", addr.to_string());
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        let resp = sender
            .send_request(req.body(Full::new(body)).unwrap())
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Ok::<_, String>(Answer::Response {
            status,
            headers,
            body,
            raw: bytes,
        })
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => Answer::ConnectionError(e),
        Err(_) => Answer::TimedOut,
    }
}

pub fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// A request the receiver got.
#[derive(Debug, Clone)]
pub struct Captured {
    pub method: http::Method,
    pub uri: http::Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// An HTTP server on a free loopback port that captures every request and
/// answers with the next status from `statuses` (200 once they run out).
pub struct Receiver {
    pub addr: SocketAddr,
    pub rx: mpsc::UnboundedReceiver<Captured>,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    pub async fn start(statuses: Vec<u16>) -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        let statuses = Arc::new(Mutex::new(statuses.into_iter()));
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let tx = tx.clone();
                let statuses = Arc::clone(&statuses);
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                        let tx = tx.clone();
                        let statuses = Arc::clone(&statuses);
                        async move {
                            let (parts, body) = req.into_parts();
                            let body = body.collect().await.unwrap().to_bytes();
                            let _ = tx.send(Captured {
                                method: parts.method,
                                uri: parts.uri,
                                headers: parts.headers,
                                body,
                            });
                            let status = statuses.lock().unwrap().next().unwrap_or(200);
                            Ok::<_, Infallible>(
                                Response::builder()
                                    .status(status)
                                    .body(Full::new(Bytes::from_static(b"ok")))
                                    .unwrap(),
                            )
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Receiver { addr, rx, task }
    }

    pub async fn next(&mut self, timeout: Duration) -> Option<Captured> {
        tokio::time::timeout(timeout, self.rx.recv())
            .await
            .ok()
            .flatten()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The relay under test: `OUTBOX_RELAY_BIN` if set; else
/// `target/<profile>/outbox-relay` next to the test when no engine source
/// file is newer than it; else the engine embedded in this package's
/// `loadtest` binary, which cargo always builds for this package's tests.
pub fn relay() -> loadtest::relay::RelayProgram {
    use loadtest::relay::{locate_relay, RelayProgram};
    if let Some(bin) = std::env::var_os("OUTBOX_RELAY_BIN") {
        return RelayProgram::binary(PathBuf::from(bin));
    }
    let found = locate_relay(
        &std::env::current_exe().unwrap(),
        loadtest::relay::compiled_sources().as_deref(),
    );
    if found.is_embedded() {
        RelayProgram::embedded(env!("CARGO_BIN_EXE_loadtest"))
    } else {
        found
    }
}

/// `TEST_DATABASE_URL`, else the local default server when it answers, else
/// `None` (the runner starts a throwaway cluster).
pub async fn server_url() -> Option<String> {
    let url = std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| outbox_relay::testkit::DEFAULT_SERVER_URL.to_owned());
    let probe = tokio::time::timeout(Duration::from_secs(5), outbox_relay::store::connect(&url));
    matches!(probe.await, Ok(Ok(_))).then_some(url)
}

/// A scenario run by a test: its report, its output directory, and the
/// report's table with the last lines of every replica's log (for failure
/// messages).
pub struct TestRun {
    pub report: loadtest::report::Report,
    pub out_dir: PathBuf,
    pub context: String,
    /// Holds `out_dir`: bind it while the files are needed.
    pub dir: tempfile::TempDir,
}

/// Runs `scenario` against [`relay`] and [`server_url`], panicking when it
/// takes longer than `limit`.
pub async fn run_in_test(
    scenario: &loadtest::scenario::Scenario,
    limit: Duration,
    log_lines: usize,
) -> TestRun {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = loadtest::runner::RunOptions::new(dir.path().join("out"));
    opts.relay = relay();
    opts.progress = false;
    opts.database_url = server_url().await;
    eprintln!("relay under test: {}", opts.relay.describe());
    let run = tokio::time::timeout(limit, loadtest::runner::run_scenario(scenario, &opts));
    let report = run
        .await
        .unwrap_or_else(|_| panic!("the {} run did not finish within {limit:?}", scenario.name))
        .unwrap();
    let context = format!(
        "{}{}",
        report.table(),
        log_tails(&opts.out_dir, scenario.replicas, log_lines)
    );
    TestRun {
        report,
        out_dir: opts.out_dir,
        context,
        dir,
    }
}

/// The last `n` lines of every replica's log.
pub fn log_tails(dir: &std::path::Path, replicas: u32, n: usize) -> String {
    let mut out = String::new();
    for i in 0..replicas {
        let name = loadtest::runner::replica_file_name("relay", "log", i, replicas);
        let log = std::fs::read_to_string(dir.join(&name)).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        out += &format!(
            "\n{name} (last lines):\n{}",
            lines[lines.len().saturating_sub(n)..].join("\n")
        );
    }
    out
}
