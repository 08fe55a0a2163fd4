//! Publishing to QStash with the requests the official SDK sends
//! (docs/qstash-protocol.md):
//! `POST /v2/batch` with many messages per request (the throughput path), or
//! `POST /v2/publish/{destination}` one by one. Its section of the
//! configuration, `[qstash]`, is in [`config`].

pub mod config;

use std::borrow::Cow;

use bytes::Bytes;
use futures_util::future::join_all;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderValue, Method, Request};
use http_body_util::Full;
use outbox_client::row::OutboxRow;
use serde::Serialize;

use self::config::{PublishMode, QstashConfig};
use super::http::{HttpClient, HttpConfig};
use super::{classify, transport_outcome, DeadReason, Outcome, RetryReason, MAX_ERROR_CHARS};
use crate::routes::Route;

/// One message as QStash takes it: destination, lower-case headers, body.
/// The relay's own header names are static: no allocation per message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Message {
    pub destination: String,
    #[serde(serialize_with = "headers_as_object")]
    pub headers: Vec<(Cow<'static, str>, String)>,
    #[serde(serialize_with = "body_as_string")]
    pub body: Vec<u8>,
}

fn headers_as_object<S: serde::Serializer>(
    headers: &[(Cow<'static, str>, String)],
    s: S,
) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut map = s.serialize_map(Some(headers.len()))?;
    for (k, v) in headers {
        map.serialize_entry(k, v)?;
    }
    map.end()
}

fn body_as_string<S: serde::Serializer>(body: &[u8], s: S) -> Result<S::Ok, S::Error> {
    // Bodies are JSON we built or the row's payload: always UTF-8.
    s.serialize_str(&String::from_utf8_lossy(body))
}

#[derive(Clone)]
pub struct QstashSink {
    base: String,
    authorization: HeaderValue,
    mode: PublishMode,
    batch_size: usize,
    /// How much of a batch answer is read: enough for one answer per message.
    batch_answer_bytes: usize,
}

/// Room for one message's answer in a batch answer (a message id, or a URL
/// group's list of them, is about a hundred bytes).
pub(crate) const ANSWER_BYTES_PER_MESSAGE: usize = 1024;

/// Headers that carry the relay's own guarantees: a row cannot set them.
const RELAY_HEADERS: &[&str] = &[
    "upstash-deduplication-id",
    "upstash-content-based-deduplication",
    "upstash-flow-control-key",
    "upstash-flow-control-value",
    "upstash-callback",
    "upstash-failure-callback",
    "upstash-forward-x-outbox-id",
    "upstash-forward-x-event-id",
    "upstash-forward-x-outbox-idempotency-key",
];

impl QstashSink {
    pub fn new(config: &QstashConfig, http: &HttpConfig) -> QstashSink {
        let mut authorization = HeaderValue::from_str(&format!("Bearer {}", config.token.expose()))
            .expect("a Secret is visible ASCII");
        authorization.set_sensitive(true);
        let batch_size = config.batch_size.get();
        QstashSink {
            base: config.url.as_str().trim_end_matches('/').to_owned(),
            authorization,
            mode: config.mode,
            batch_size,
            batch_answer_bytes: http
                .max_response_bytes
                .max(batch_size * ANSWER_BYTES_PER_MESSAGE),
        }
    }

    /// The message for one row, with the headers `processHeaders` would send
    /// for the route's options (telemetry headers aside).
    pub fn message(&self, route: &Route, row: &OutboxRow) -> Result<Message, Outcome> {
        let destination = super::destination(route, row)?;
        let c = &route.config;
        let mut headers: Vec<(Cow<'static, str>, String)> =
            Vec::with_capacity(12 + row.headers.len());
        headers.push(("content-type".into(), super::content_type(route).into()));
        headers.push(("upstash-method".into(), c.method.as_str().to_owned()));
        headers.push((
            "upstash-deduplication-id".into(),
            row.idempotency_key.clone(),
        ));
        if let Some(retries) = c.retries {
            headers.push(("upstash-retries".into(), retries.to_string()));
        }
        if let Some(delay) = c.delay {
            headers.push(("upstash-delay".into(), format!("{}s", delay.as_secs())));
        }
        if let Some(cb) = &c.callback {
            headers.push(("upstash-callback".into(), cb.as_str().to_owned()));
        }
        if let Some(cb) = &c.failure_callback {
            headers.push(("upstash-failure-callback".into(), cb.as_str().to_owned()));
        }
        if let Some((key, value)) = flow_control(route, row) {
            headers.push(("upstash-flow-control-key".into(), key));
            headers.push(("upstash-flow-control-value".into(), value));
        }
        let id = row.id.to_string();
        headers.push(("upstash-forward-x-outbox-id".into(), id.clone()));
        headers.push(("upstash-forward-x-event-id".into(), id));
        // Failure reports echo it: the callback marks only this attempt.
        headers.push((
            "upstash-forward-x-outbox-idempotency-key".into(),
            row.idempotency_key.clone(),
        ));
        // The SDK forwards user headers with the `Upstash-Forward-` prefix,
        // lower-cased, except content-type and upstash-* which pass as they
        // are. A row's header replaces ours of the same name (content-type,
        // delay, retries), except those the relay's guarantees rest on:
        // deduplication, flow control, callbacks and the event id.
        for (name, value) in &row.headers {
            let lower = name.to_ascii_lowercase();
            let name = if lower == "content-type" || lower.starts_with("upstash-") {
                lower
            } else {
                format!("upstash-forward-{lower}")
            };
            if RELAY_HEADERS.contains(&name.as_str()) {
                tracing::debug!(id = row.id, header = %name, "row header ignored: the relay sets it");
                continue;
            }
            match headers.iter_mut().find(|(k, _)| *k == name) {
                Some(slot) => slot.1 = value.clone(),
                None => headers.push((name.into(), value.clone())),
            }
        }
        Ok(Message {
            destination,
            headers,
            body: super::body(route, row),
        })
    }

    pub fn batch_request(&self, messages: &[Message]) -> Request<Full<Bytes>> {
        // Sized for the whole batch up front (escaping a JSON body adds about
        // a tenth): growing it by doubling copied the batch several times.
        let estimate: usize = messages
            .iter()
            .map(|m| {
                let headers: usize = m.headers.iter().map(|(k, v)| k.len() + v.len() + 6).sum();
                m.body.len() + m.body.len() / 8 + m.destination.len() + headers + 48
            })
            .sum();
        let mut body = Vec::with_capacity(estimate + 2);
        serde_json::to_writer(&mut body, messages).expect("messages serialize");
        Request::builder()
            .method(Method::POST)
            .uri(format!("{}/v2/batch", self.base))
            .header(AUTHORIZATION, self.authorization.clone())
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("a valid request")
    }

    /// `POST /v2/publish/{destination}`; the destination is not percent-encoded,
    /// as the SDK sends it.
    pub(crate) fn publish_request(
        &self,
        message: &Message,
    ) -> Result<Request<Full<Bytes>>, Outcome> {
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri(format!("{}/v2/publish/{}", self.base, message.destination))
            .header(AUTHORIZATION, self.authorization.clone());
        for (k, v) in &message.headers {
            builder = builder.header(k.as_ref(), v.as_str());
        }
        builder
            .body(Full::new(Bytes::from(message.body.clone())))
            .map_err(|e| Outcome::Dead {
                reason: DeadReason::BadDestination,
                error: super::truncate(format!("cannot build the request: {e}"), MAX_ERROR_CHARS),
            })
    }

    /// One outcome per row, in order.
    pub async fn deliver(
        &self,
        client: &HttpClient,
        route: &Route,
        rows: &[OutboxRow],
        max_message_bytes: usize,
    ) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; rows.len()];
        let mut messages = Vec::with_capacity(rows.len());
        let mut positions = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            match self.message(route, row) {
                Ok(m) if m.body.len() > max_message_bytes => {
                    outcomes[i] = Some(Outcome::Dead {
                        reason: DeadReason::TooLarge,
                        error: format!(
                            "message of {} bytes is over the {max_message_bytes}-byte limit",
                            m.body.len()
                        ),
                    })
                }
                Ok(m) => {
                    messages.push(m);
                    positions.push(i);
                }
                Err(outcome) => outcomes[i] = Some(outcome),
            }
        }
        let sent = match self.mode {
            PublishMode::Batch => {
                let mut all = Vec::with_capacity(messages.len());
                for chunk in messages.chunks(self.batch_size) {
                    all.extend(self.send_batch(client, chunk).await);
                }
                all
            }
            PublishMode::Single => self.send_each(client, &messages).await,
        };
        for (pos, outcome) in positions.into_iter().zip(sent) {
            outcomes[pos] = Some(outcome);
        }
        outcomes
            .into_iter()
            .map(|o| o.expect("every row has an outcome"))
            .collect()
    }

    async fn send_each(&self, client: &HttpClient, messages: &[Message]) -> Vec<Outcome> {
        join_all(messages.iter().map(|m| async move {
            let request = match self.publish_request(m) {
                Ok(r) => r,
                Err(outcome) => return outcome,
            };
            let result = client.send(request).await;
            super::http::record_request("qstash_publish", &result);
            match result {
                Ok(response) => match classify_qstash(&response) {
                    Outcome::Published => publish_outcome(&response),
                    other => other,
                },
                Err(e) => transport_outcome(&e),
            }
        }))
        .await
    }

    async fn send_batch(&self, client: &HttpClient, messages: &[Message]) -> Vec<Outcome> {
        let result = client
            .send_reading(self.batch_request(messages), self.batch_answer_bytes)
            .await;
        super::http::record_request("qstash_batch", &result);
        let response = match result {
            Ok(r) => r,
            Err(e) => return vec![transport_outcome(&e); messages.len()],
        };
        match classify_qstash(&response) {
            Outcome::Published if response.truncated => vec![
                unreadable(format!(
                    "the batch answer is longer than {} bytes",
                    self.batch_answer_bytes
                ));
                messages.len()
            ],
            Outcome::Published => batch_outcomes(&response.body, messages.len()),
            dead @ Outcome::Dead { .. } if messages.len() == 1 => vec![dead],
            // One bad message must not dead-letter the others with it: send
            // them one by one so each gets its own answer.
            Outcome::Dead { .. } => self.send_each(client, messages).await,
            retry => vec![retry; messages.len()],
        }
    }
}

/// QStash's own 401 and 403 mean our token is wrong or lacks rights: no fault
/// of the event, so the route pauses (and alerts fire) rather than the whole
/// backlog being dead-lettered by a configuration slip.
fn classify_qstash(response: &super::Response) -> Outcome {
    match classify(response) {
        Outcome::Retry {
            after,
            reason: RetryReason::Unauthorized,
            error,
        } => Outcome::Retry {
            after,
            reason: RetryReason::Unauthorized,
            error: format!("QStash refused the token: {error}"),
        },
        // Over a limit of the QStash plan (queues, parallelism): the account's
        // problem, like a quota, not the event's.
        Outcome::Dead { error, .. } if response.status.as_u16() == 412 => Outcome::Retry {
            after: None,
            reason: RetryReason::RateLimited,
            error: format!("QStash plan limit: {error}"),
        },
        other => other,
    }
}

fn unreadable(error: String) -> Outcome {
    Outcome::Retry {
        after: None,
        reason: RetryReason::UnreadableAnswer,
        error,
    }
}

/// Flow control: ordered routes key by partition (parallelism 1 unless set);
/// an unordered route with limits shares one key per route.
fn flow_control(route: &Route, row: &OutboxRow) -> Option<(String, String)> {
    let c = &route.config;
    let key = if route.ordered() {
        row.partition_key.clone()
    } else if c.parallelism.is_some() || c.rate.is_some() {
        format!("outbox-relay:{}", route.name)
    } else {
        return None;
    };
    let mut parts = Vec::with_capacity(3);
    let parallelism =
        c.parallelism
            .map(|p| p.get())
            .or(if route.ordered() { Some(1) } else { None });
    if let Some(p) = parallelism {
        parts.push(format!("parallelism={p}"));
    }
    if let Some(rate) = c.rate {
        parts.push(format!("rate={rate}"));
    }
    if let Some(period) = c.period {
        parts.push(format!("period={}s", period.as_secs()));
    }
    Some((key, parts.join(", ")))
}

/// Reads a 2xx batch answer: a JSON array in request order, one element per
/// message: a publish answer (`{"messageId": …}`), a URL group's array of
/// them, or an `{"error": …}` that fails that message alone. A message counts
/// as published only when its own element says so; an answer that cannot be
/// read, is of the wrong length or holds anything else is retried (under the
/// same deduplication id, so nothing is published twice).
pub(crate) fn batch_outcomes(body: &[u8], expected: usize) -> Vec<Outcome> {
    let items = match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Array(items)) if items.len() == expected => items,
        Ok(serde_json::Value::Array(items)) => {
            let error = format!(
                "the batch answer has {} elements for {expected} messages",
                items.len()
            );
            return vec![unreadable(error); expected];
        }
        _ => {
            let error = format!(
                "the batch answer is not a JSON array: {}",
                super::body_text(body, 200)
            );
            return vec![unreadable(error); expected];
        }
    };
    items.iter().map(element_outcome).collect()
}

/// A 2xx answer to `/v2/publish`: published only when it names the message.
pub(crate) fn publish_outcome(response: &super::Response) -> Outcome {
    if response.truncated {
        return unreadable("the publish answer is over the size limit".into());
    }
    match serde_json::from_slice::<serde_json::Value>(&response.body) {
        Ok(answer) => element_outcome(&answer),
        Err(_) => unreadable(format!(
            "the publish answer is not JSON: {}",
            super::body_text(&response.body, 200)
        )),
    }
}

/// One message's answer.
fn element_outcome(item: &serde_json::Value) -> Outcome {
    use serde_json::Value;
    let accepted = |v: &Value| {
        v.get("messageId")
            .and_then(Value::as_str)
            .is_some_and(|id| !id.is_empty())
            && v.get("error").is_none()
    };
    let error_of = |v: &Value| v.get("error").cloned();
    match item {
        Value::Object(_) if accepted(item) => Outcome::Published,
        Value::Array(group) if !group.is_empty() && group.iter().all(accepted) => {
            Outcome::Published
        }
        _ => {
            let error = match item {
                Value::Object(_) => error_of(item),
                Value::Array(group) => group.iter().find_map(error_of),
                _ => None,
            };
            match error {
                Some(err) => Outcome::Retry {
                    after: None,
                    reason: RetryReason::BatchElement,
                    error: super::truncate(
                        format!(
                            "qstash: {}",
                            err.as_str()
                                .map(str::to_owned)
                                .unwrap_or_else(|| err.to_string())
                        ),
                        MAX_ERROR_CHARS,
                    ),
                },
                None => unreadable(super::truncate(
                    format!("qstash answered something that is not a publish answer: {item}"),
                    MAX_ERROR_CHARS,
                )),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_answers_fail_only_their_element() {
        let body = br#"[{"messageId":"msg_1"},{"error":"bad destination"},[{"messageId":"msg_3","url":"u"}]]"#;
        let outcomes = batch_outcomes(body, 3);
        assert_eq!(outcomes[0], Outcome::Published);
        assert!(
            matches!(&outcomes[1], Outcome::Retry { error, .. } if error.contains("bad destination"))
        );
        assert_eq!(outcomes[2], Outcome::Published);
    }

    fn unread(o: &Outcome) -> bool {
        matches!(
            o,
            Outcome::Retry {
                reason: RetryReason::UnreadableAnswer,
                ..
            }
        )
    }

    #[test]
    fn only_an_answer_that_names_each_message_publishes_it() {
        assert!(batch_outcomes(b"not json", 2).iter().all(unread));
        assert!(batch_outcomes(br#"[{"messageId":"a"}]"#, 2)
            .iter()
            .all(unread));
        assert!(batch_outcomes(b"[1, null]", 2).iter().all(unread));
        let mixed = batch_outcomes(
            br#"[{}, {"messageId":""}, [], [{"messageId":"a"},{"error":"x"}]]"#,
            4,
        );
        assert!(unread(&mixed[0]) && unread(&mixed[1]) && unread(&mixed[2]));
        assert!(
            matches!(&mixed[3], Outcome::Retry { reason: RetryReason::BatchElement, error, .. } if error.contains('x'))
        );
    }
}
