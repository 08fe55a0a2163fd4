//! One keep-alive HTTP client for every publisher: hyper-util's pooled client
//! over rustls (ring), HTTP/1.1 and HTTP/2, with the timeouts hyper lacks.
//! Its section of the configuration is `[http]`.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde::{Deserialize, Deserializer, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// The whole exchange: request, response headers and body.
    #[serde(
        serialize_with = "humantime_serde::serialize",
        deserialize_with = "more_than_zero"
    )]
    pub request_timeout: Duration,
    /// Response bodies longer than this are cut (they only feed `last_error`).
    pub max_response_bytes: usize,
    /// A request body over this size is dead-lettered without sending (QStash's
    /// message limit on the smallest plan is 1 MB).
    pub max_message_bytes: usize,
    pub pool_idle_timeout_secs: u64,
    /// `[[http.hosts]]`: limits per destination host, shared by every
    /// webhook route sending there ([`super::limits`]).
    pub hosts: Vec<super::limits::HostLimit>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(15),
            max_response_bytes: 64 * 1024,
            max_message_bytes: 1024 * 1024,
            pool_idle_timeout_secs: 30,
            hosts: Vec::new(),
        }
    }
}

/// A request that may take no time at all would never be answered.
fn more_than_zero<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let timeout: Duration = humantime_serde::deserialize(d)?;
    if timeout.is_zero() {
        return Err(serde::de::Error::custom("must be more than zero"));
    }
    Ok(timeout)
}

pub(crate) type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// An answer from the destination, body cut to the configured size.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The body was longer than the limit and was not read.
    pub truncated: bool,
    pub elapsed: Duration,
}

/// Why no answer came back. Every variant is worth a retry.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("connect: {0}")]
    Connect(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("request: {0}")]
    Request(String),
    #[error("reading the response: {0}")]
    Body(String),
}

#[derive(Clone)]
pub struct HttpClient {
    client: HttpsClient,
    request_timeout: Duration,
    max_response_bytes: usize,
}

/// HTTP and HTTPS (the web's roots), HTTP/1.1 and HTTP/2, no delay, TCP
/// keepalive: the relay's connections to sinks and to the trace collector.
pub(crate) fn https_connector(
    connect_timeout: Duration,
) -> hyper_rustls::HttpsConnector<HttpConnector> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(connect_timeout));
    http.set_nodelay(true);
    http.set_keepalive(Some(Duration::from_secs(60)));
    let roots = rustls::RootCertStore::from_iter(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http)
}

impl HttpClient {
    pub fn new(config: &HttpConfig) -> HttpClient {
        let https = https_connector(config.connect_timeout);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(config.pool_idle_timeout_secs))
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .http2_keep_alive_interval(Duration::from_secs(30))
            .http2_keep_alive_timeout(Duration::from_secs(10))
            .http2_adaptive_window(true)
            .build(https);
        HttpClient {
            client,
            request_timeout: config.request_timeout,
            max_response_bytes: config.max_response_bytes,
        }
    }

    /// Sends a request and reads the whole answer within the request timeout.
    pub async fn send(&self, request: Request<Full<Bytes>>) -> Result<Response, TransportError> {
        self.send_reading(request, self.max_response_bytes).await
    }

    /// Like [`HttpClient::send`], reading up to `limit` bytes of the answer.
    pub(crate) async fn send_reading(
        &self,
        request: Request<Full<Bytes>>,
        limit: usize,
    ) -> Result<Response, TransportError> {
        let started = Instant::now();
        let exchange = async {
            let response = self.client.request(request).await.map_err(|e| {
                if e.is_connect() {
                    TransportError::Connect(error_chain(&e))
                } else {
                    TransportError::Request(error_chain(&e))
                }
            })?;
            let (parts, body) = response.into_parts();
            // A long error page only feeds `last_error`: keep its start and drop
            // the rest, rather than failing the exchange.
            let (body, truncated) = match Limited::new(body, limit).collect().await {
                Ok(collected) => (collected.to_bytes(), false),
                Err(e)
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some() =>
                {
                    (
                        Bytes::from(format!("(response body over the {limit}-byte limit)")),
                        true,
                    )
                }
                Err(e) => return Err(TransportError::Body(e.to_string())),
            };
            Ok(Response {
                status: parts.status,
                headers: parts.headers,
                body,
                truncated,
                elapsed: started.elapsed(),
            })
        };
        match tokio::time::timeout(self.request_timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(TransportError::Timeout(self.request_timeout)),
        }
    }
}

/// `error: cause: cause` — hyper's top-level messages say little on their own.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// The `sink` label values of the request duration.
pub(crate) const SINK_LABELS: [&str; 3] = ["qstash_publish", "qstash_batch", "webhook"];

/// Records how long a sink request took (a timeout counts as its limit).
pub(crate) fn record_request(sink: &'static str, result: &Result<Response, TransportError>) {
    debug_assert!(SINK_LABELS.contains(&sink), "{sink}");
    let elapsed = match result {
        Ok(r) => r.elapsed,
        Err(TransportError::Timeout(d)) => *d,
        Err(_) => return,
    };
    metrics::histogram!(crate::metrics::PUBLISH_DURATION, "sink" => sink)
        .record(elapsed.as_secs_f64());
}
