//! Helpers shared by the integration tests: one-shot HTTP over loopback and a
//! capturing receiver for delivery mode.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
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
