//! Delivery mode: the sink forwards each newly accepted message to its
//! destination the way QStash does, signed. Plain HTTP to
//! loopback destinations only: anything else is refused when it is published.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::signing::{self, DEV_CURRENT_SIGNING_KEY};

/// How the sink delivers accepted messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeliveryConfig {
    /// Signs `Upstash-Signature`; the dev server's current key by default.
    pub signing_key: String,
    /// Attempts per message (the first one included); each non-2xx answer,
    /// timeout or connection error uses one.
    pub attempts: u32,
    /// Bound on one attempt, answer body included.
    #[serde(with = "humantime_serde")]
    pub attempt_timeout: Duration,
    /// Pause between attempts (QStash's real backoff is minutes; tests want it short).
    #[serde(with = "humantime_serde")]
    pub retry_delay: Duration,
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            signing_key: DEV_CURRENT_SIGNING_KEY.to_owned(),
            attempts: 3,
            attempt_timeout: Duration::from_secs(5),
            retry_delay: Duration::from_millis(100),
        }
    }
}

/// What became of one delivered message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryOutcome {
    pub message_id: String,
    pub destination: String,
    pub attempts: u32,
    /// The last answer's status, if any answer came.
    pub last_status: Option<u16>,
    pub delivered: bool,
    /// The last failure, when not delivered.
    pub error: Option<String>,
}

/// One message to deliver.
pub(crate) struct Delivery {
    pub message_id: String,
    pub destination: String,
    pub method: http::Method,
    /// `(name, value)` pairs already stripped of `upstash-forward-`.
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
}

pub(crate) struct Deliverer {
    config: DeliveryConfig,
    client: Client<HttpConnector, Full<Bytes>>,
    outcomes: Mutex<Vec<DeliveryOutcome>>,
    tasks: Mutex<JoinSet<()>>,
    done: watch::Sender<usize>,
}

/// `Err(reason)` unless `destination` is `http://` to a loopback host.
pub(crate) fn check_loopback(destination: &str) -> Result<(), String> {
    let uri: http::Uri = destination
        .parse()
        .map_err(|e| format!("destination `{destination}` is not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!(
            "destination `{destination}`: this sink delivers over plain http only"
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
            "destination `{destination}` is not a loopback address; this sink delivers to loopback only"
        ))
    }
}

impl Deliverer {
    pub fn new(config: DeliveryConfig) -> Arc<Self> {
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.set_connect_timeout(Some(config.attempt_timeout));
        let client = Client::builder(TokioExecutor::new()).build(http);
        Arc::new(Deliverer {
            config,
            client,
            outcomes: Mutex::new(Vec::new()),
            tasks: Mutex::new(JoinSet::new()),
            done: watch::channel(0).0,
        })
    }

    pub fn spawn(self: &Arc<Self>, delivery: Delivery) {
        let me = Arc::clone(self);
        let mut tasks = self.tasks.lock().expect("tasks lock");
        while tasks.try_join_next().is_some() {}
        tasks.spawn(async move {
            let outcome = me.deliver(delivery).await;
            let n = {
                let mut outcomes = me.outcomes.lock().expect("outcomes lock");
                outcomes.push(outcome);
                outcomes.len()
            };
            me.done.send_replace(n);
        });
    }

    pub fn outcomes(&self) -> Vec<DeliveryOutcome> {
        self.outcomes.lock().expect("outcomes lock").clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<usize> {
        self.done.subscribe()
    }

    pub fn abort_all(&self) {
        self.tasks.lock().expect("tasks lock").abort_all();
    }

    async fn deliver(&self, d: Delivery) -> DeliveryOutcome {
        let mut outcome = DeliveryOutcome {
            message_id: d.message_id.clone(),
            destination: d.destination.clone(),
            attempts: 0,
            last_status: None,
            delivered: false,
            error: None,
        };
        for retried in 0..self.config.attempts.max(1) {
            if retried > 0 {
                tokio::time::sleep(self.config.retry_delay).await;
            }
            outcome.attempts = retried + 1;
            match tokio::time::timeout(self.config.attempt_timeout, self.attempt(&d, retried)).await
            {
                Ok(Ok(status)) => {
                    outcome.last_status = Some(status.as_u16());
                    if status.is_success() {
                        outcome.delivered = true;
                        outcome.error = None;
                        break;
                    }
                    outcome.error = Some(format!("destination answered {status}"));
                }
                Ok(Err(e)) => outcome.error = Some(e),
                Err(_) => {
                    outcome.error = Some(format!(
                        "no answer within {}",
                        humantime::format_duration(self.config.attempt_timeout)
                    ))
                }
            }
        }
        outcome
    }

    async fn attempt(&self, d: &Delivery, retried: u32) -> Result<http::StatusCode, String> {
        let now = chrono::Utc::now().timestamp();
        let jti = format!("jwt_{}", uuid::Uuid::new_v4().simple());
        // A fresh signature per attempt: one lives 5 minutes, retries may not.
        let claims = signing::SignatureClaims::new(&d.destination, &d.body, now, jti);
        let mut req = http::Request::builder()
            .method(d.method.clone())
            .uri(&d.destination)
            .header("user-agent", "Upstash-QStash")
            .header(
                "upstash-signature",
                signing::sign(&self.config.signing_key, &claims),
            )
            .header("upstash-message-id", &d.message_id)
            .header("upstash-retried", retried.to_string());
        for (name, value) in &d.headers {
            req = req.header(name.as_str(), value.as_str());
        }
        let req = req
            .body(Full::new(d.body.clone()))
            .map_err(|e| format!("cannot build the request: {e}"))?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| format!("request failed: {e}"))?;
        let status = resp.status();
        // Read the answer so the connection can be reused.
        let _ = resp.into_body().collect().await;
        Ok(status)
    }
}

#[cfg(test)]
mod tests {
    use super::check_loopback;

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
}
