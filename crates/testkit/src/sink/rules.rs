//! Per-message rules for tests: what the sink answers about each message is
//! decided by a closure the test sets ([`SinkHandle::set_rule`],
//! [`SinkHandle::set_batch_rule`]), and every message the sink judged is kept
//! with its headers and body ([`Received`], with
//! [`SinkConfig::keep_messages`](super::SinkConfig::keep_messages)).
//!
//! A rule judges each message of `/v2/publish`, `/v2/batch` and the webhook
//! endpoint `/hook/…` once the request got past authentication, parsing, an
//! outage and the request faults (a request those cut short is not judged).
//! [`Reply::Accept`] lets the message go on as QStash would take it
//! (deduplication, records, delivery); any other reply refuses it. On
//! `/v2/batch` one refusal fails the whole request with that message's answer
//! and nothing in it is accepted, as a server that validates a batch up front
//! would; a batch rule, when it answers, decides the whole batch instead.
//!
//! [`SinkHandle::set_rule`]: super::SinkHandle::set_rule
//! [`SinkHandle::set_batch_rule`]: super::SinkHandle::set_batch_rule

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Instant;

use bytes::Bytes;
use http::StatusCode;
use serde_json::Value;

use super::adversary::AnswerBody;
use super::{Message, Resp, DEDUP_ID_HEADER};

/// One message as the sink saw it, whatever it answered.
#[derive(Debug, Clone)]
pub struct Received {
    /// `Upstash-Deduplication-Id`, or a webhook's `webhook-id`; empty when absent.
    pub dedup_id: String,
    /// From `Upstash-Forward-X-Outbox-Id` or `X-Outbox-Id`, else the body's `id`.
    pub outbox_id: Option<i64>,
    /// The destination URL (QStash endpoints), or the request path `/hook/…`.
    pub destination: String,
    /// Lower-case header names, `authorization` included.
    pub headers: BTreeMap<String, String>,
    /// The body, invalid UTF-8 replaced.
    pub body: String,
    /// How many times this dedup id reached the sink before (0 = first).
    pub attempt: u32,
    /// When it was judged.
    pub at: Instant,
    /// Whether the sink accepted it.
    pub accepted: bool,
}

impl Received {
    fn new(
        dedup_id: String,
        destination: String,
        headers: BTreeMap<String, String>,
        body: &[u8],
    ) -> Received {
        let outbox_id = headers
            .get(super::OUTBOX_ID_HEADER)
            .or_else(|| headers.get("x-outbox-id"))
            .and_then(|v| v.trim().parse().ok())
            .or_else(|| {
                serde_json::from_slice::<Value>(body)
                    .ok()
                    .and_then(|j| j.get("id").and_then(super::json_i64))
            });
        Received {
            dedup_id,
            outbox_id,
            destination,
            headers,
            body: String::from_utf8_lossy(body).into_owned(),
            attempt: 0,
            at: Instant::now(),
            accepted: false,
        }
    }

    /// A message of `/v2/publish` or `/v2/batch`.
    pub(super) fn of(msg: &Message) -> Received {
        let headers: BTreeMap<String, String> = msg.headers.iter().cloned().collect();
        let dedup = headers.get(DEDUP_ID_HEADER).cloned().unwrap_or_default();
        Received::new(dedup, msg.destination.clone(), headers, &msg.body)
    }

    /// A webhook POST to `path`.
    pub(crate) fn webhook(path: &str, headers: &http::HeaderMap, body: &[u8]) -> Received {
        let headers: BTreeMap<String, String> = headers
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect();
        let dedup = headers.get("webhook-id").cloned().unwrap_or_default();
        Received::new(dedup, path.to_owned(), headers, body)
    }

    /// The body's `partitionKey`; empty when it has none.
    pub fn partition_key(&self) -> String {
        let v: Value = serde_json::from_str(&self.body).unwrap_or_default();
        v["partitionKey"].as_str().unwrap_or_default().to_owned()
    }
}

/// What to answer for a message.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Accept,
    /// This status, with `Retry-After` when given, and a JSON error body.
    Status(u16, Option<String>),
    /// Any status, headers and body bytes (not accepted, whatever the status).
    Raw(RawAnswer),
}

impl Reply {
    /// The answer to a request this reply refuses (`None` for `Accept`).
    pub(crate) fn refusal(&self) -> Option<Resp> {
        match self {
            Reply::Accept => None,
            Reply::Status(status, retry_after) => {
                let raw = RawAnswer::new(
                    *status,
                    format!("{{\"error\":\"status {status} from the test sink\"}}"),
                )
                .header("content-type", "application/json");
                Some(
                    match retry_after {
                        Some(ra) => raw.header("retry-after", ra.clone()),
                        None => raw,
                    }
                    .response(),
                )
            }
            Reply::Raw(raw) => Some(raw.response()),
        }
    }

    /// The status it answers with.
    pub(crate) fn status(&self) -> u16 {
        match self {
            Reply::Accept => 200,
            Reply::Status(status, _) => *status,
            Reply::Raw(raw) => raw.status,
        }
    }
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

    /// The response; a status or header that HTTP cannot carry panics (a
    /// test's mistake).
    pub(crate) fn response(&self) -> Resp {
        let mut r = http::Response::builder()
            .status(StatusCode::from_u16(self.status).expect("a valid HTTP status"));
        for (k, v) in &self.headers {
            r = r.header(k.as_str(), v.as_str());
        }
        r.body(AnswerBody::whole(Bytes::from(self.body.clone())))
            .expect("valid header names and values")
    }
}

pub(crate) type Rule = Box<dyn Fn(&Received) -> Reply + Send + Sync>;
/// Answers a whole `/v2/batch` request: given the messages (judged one by one
/// by the rule first), the answer, and which messages it counts as accepted.
pub(crate) type BatchRule =
    Box<dyn Fn(&[Received]) -> Option<(RawAnswer, Vec<bool>)> + Send + Sync>;

/// The rules and the log of what they judged.
pub(crate) struct Rules {
    keep: bool,
    rule: Mutex<Option<Rule>>,
    batch_rule: Mutex<Option<BatchRule>>,
    seen: Mutex<HashMap<String, u32>>,
    received: Mutex<Vec<Received>>,
    requests: Mutex<Vec<String>>,
}

impl Rules {
    pub(crate) fn new(keep: bool) -> Rules {
        Rules {
            keep,
            rule: Mutex::new(None),
            batch_rule: Mutex::new(None),
            seen: Mutex::new(HashMap::new()),
            received: Mutex::new(Vec::new()),
            requests: Mutex::new(Vec::new()),
        }
    }

    /// Whether messages are judged at all: a rule is set or messages are kept.
    pub(crate) fn active(&self) -> bool {
        self.keep
            || self.rule.lock().expect("rule lock").is_some()
            || self.batch_rule.lock().expect("rule lock").is_some()
    }

    pub(crate) fn set_rule(&self, rule: Rule) {
        *self.rule.lock().expect("rule lock") = Some(rule);
    }

    pub(crate) fn set_batch_rule(&self, rule: BatchRule) {
        *self.batch_rule.lock().expect("rule lock") = Some(rule);
    }

    /// Logs `METHOD path` of a request (when messages are kept).
    pub(crate) fn note_request(&self, method: &http::Method, path: &str) {
        if self.keep {
            self.requests
                .lock()
                .expect("requests lock")
                .push(format!("{method} {path}"));
        }
    }

    /// Counts the attempt and asks the rule; `accepted` says whether the
    /// rule accepts (the caller settles it once the sink decided).
    pub(crate) fn judge(&self, mut msg: Received) -> (Received, Reply) {
        msg.attempt = {
            let mut seen = self.seen.lock().expect("seen lock");
            let n = seen.entry(msg.dedup_id.clone()).or_insert(0);
            *n += 1;
            *n - 1
        };
        msg.at = Instant::now();
        let reply = match &*self.rule.lock().expect("rule lock") {
            Some(rule) => rule(&msg),
            None => Reply::Accept,
        };
        msg.accepted = reply == Reply::Accept;
        (msg, reply)
    }

    /// The batch rule's answer, when it gives one.
    pub(crate) fn batch_answer(&self, msgs: &[Received]) -> Option<(RawAnswer, Vec<bool>)> {
        self.batch_rule
            .lock()
            .expect("rule lock")
            .as_ref()
            .and_then(|rule| rule(msgs))
    }

    /// Keeps judged messages (when messages are kept).
    pub(crate) fn record(&self, msgs: Vec<Received>) {
        if self.keep {
            self.received.lock().expect("received lock").extend(msgs);
        }
    }

    pub(crate) fn received(&self) -> Vec<Received> {
        self.received.lock().expect("received lock").clone()
    }

    pub(crate) fn requests(&self) -> Vec<String> {
        self.requests.lock().expect("requests lock").clone()
    }
}
