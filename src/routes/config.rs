//! One `[[routes]]` entry: which events it takes, where and how it sends
//! them. Each value is parsed as it is read (the event-type pattern, the
//! destination template, the URLs, the method, the webhook secret), so a
//! route that exists is usable; [`RouteConfig::validate`] checks the rules
//! between two of its keys.

use std::fmt;
use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::retry::RetrySchedule;
use super::Template;
use crate::redact::{HttpUrl, Secret, REDACTED};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// `order.placed` (exact), `order.*` (prefix), or `*` (everything).
    pub event_type: EventPattern,
    #[serde(default)]
    pub sink: SinkKind,
    /// URL template: `{event_type}`, `{aggregate_type}`, `{aggregate_id}`,
    /// `{tenant_id}`, `{partition_key}` are replaced (percent-encoded).
    pub destination: Template,
    /// QStash `Upstash-Retries` (how often QStash retries delivery).
    #[serde(default)]
    pub retries: Option<u32>,
    #[serde(default)]
    pub ordering: Ordering,
    /// Flow-control parallelism sent with ordered events (1 keeps the order).
    #[serde(default, deserialize_with = "at_least_one")]
    pub parallelism: Option<NonZeroU32>,
    /// Requests per `period`: QStash's flow-control rate for this route's
    /// key on a QStash route; on a webhook route the relay's own pacing
    /// ([`crate::sink::limits`]).
    #[serde(default)]
    pub rate: Option<u32>,
    /// One second unless set (webhook routes).
    #[serde(default, with = "humantime_serde")]
    pub period: Option<Duration>,
    /// Requests in flight at once to a webhook route (QStash routes:
    /// `parallelism`).
    #[serde(default, deserialize_with = "at_least_one")]
    pub concurrency: Option<NonZeroU32>,
    #[serde(default)]
    pub failure_callback: Option<HttpUrl>,
    /// `Upstash-Callback` for an ordered QStash route: where QStash reports
    /// each delivery's outcome to this relay (`POST /qstash/callback` on
    /// `server.callback_bind`, at the URL QStash reaches it by). A key's next
    /// event goes out only once QStash said the destination took this one.
    #[serde(default)]
    pub callback: Option<HttpUrl>,
    /// How long a delivery QStash took is held for its callback; each
    /// "retrying" callback holds it this long again after QStash's next
    /// attempt is due. Then it is sent again under the same deduplication id,
    /// and after `relay.max_attempts` dead-lettered. Under
    /// [`QSTASH_DEDUPLICATION_WINDOW`] by default, so that QStash drops such
    /// a re-send instead of delivering it again.
    #[serde(default = "default_callback_timeout", with = "humantime_serde")]
    pub callback_timeout: Duration,
    #[serde(default, with = "humantime_serde")]
    pub delay: Option<Duration>,
    /// `Upstash-Method` (QStash) or the request method (webhook).
    #[serde(default)]
    pub method: HttpMethod,
    #[serde(default)]
    pub body: BodyShape,
    /// `whsec_…` secret for webhook routes (Standard Webhooks signing); an
    /// empty one is not set. Several (a list, or separated by spaces) during
    /// a rotation: every request is signed with each.
    #[serde(default, deserialize_with = "optional_signing_secret")]
    pub signing_secret: Option<SigningSecret>,
    /// The CloudEvents `source` of a `body = "cloudevents"` (or
    /// `"cloudevents-binary"`) route; `/outbox-relay` unless set.
    #[serde(default)]
    pub cloudevents_source: Option<String>,
    /// Overrides `relay.max_attempts` for this route.
    #[serde(default)]
    pub max_attempts: Option<u32>,
    /// Overrides `relay.backoff_base` for this route.
    #[serde(default, with = "humantime_serde")]
    pub backoff_base: Option<Duration>,
    /// Overrides `relay.backoff_cap` for this route.
    #[serde(default, with = "humantime_serde")]
    pub backoff_cap: Option<Duration>,
    /// The delay before each retry, in order (`["5s", "1m", "10m", "1h"]`):
    /// one attempt more than it has delays ([`super::retry`]).
    #[serde(default)]
    pub retry_schedule: Option<RetrySchedule>,
}

fn default_callback_timeout() -> Duration {
    Duration::from_secs(9 * 60)
}

/// How long QStash keeps a deduplication id (its documentation): a message
/// sent again later under the same id is a new message, delivered again.
pub const QSTASH_DEDUPLICATION_WINDOW: Duration = Duration::from_secs(600);

/// A rule between two keys of a route that does not hold; `key` is the one
/// to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteError {
    pub key: &'static str,
    pub reason: &'static str,
}

impl RouteConfig {
    /// The rules no single value can break alone.
    pub fn validate(&self) -> Result<(), RouteError> {
        if self.sink == SinkKind::Webhook && self.signing_secret.is_none() {
            return Err(RouteError {
                key: "signing_secret",
                reason: "is required for webhook routes",
            });
        }
        if self.period.is_some() && self.rate.is_none() {
            return Err(RouteError {
                key: "period",
                reason: "needs `rate`",
            });
        }
        let qstash = self.sink == SinkKind::Qstash;
        if qstash && self.concurrency.is_some() {
            return Err(RouteError {
                key: "concurrency",
                reason: "is for webhook routes; a QStash route limits its requests in flight with `parallelism` (QStash flow control)",
            });
        }
        if !qstash && self.rate == Some(0) {
            return Err(RouteError {
                key: "rate",
                reason: "must be at least 1 (requests per `period`); leave it out for no limit",
            });
        }
        if !qstash && self.period.is_some_and(|p| p.is_zero()) {
            return Err(RouteError {
                key: "period",
                reason: "must be more than zero",
            });
        }
        match (self.ordering, qstash, &self.callback) {
            (Ordering::PartitionKey, true, None) => {
                return Err(RouteError {
                    key: "callback",
                    reason: "is required for an ordered QStash route: QStash retries a failed delivery later and delivers the key's next event meanwhile, so the relay holds the key until QStash's callback says the destination took the event. Set it to this relay's callback URL (POST /qstash/callback on server.callback_bind, as QStash reaches it), or set ordering = \"partition_key_to_qstash\" for order only as far as QStash",
                })
            }
            (Ordering::PartitionKeyToQstash, false, _) => {
                return Err(RouteError {
                    key: "ordering",
                    reason: "\"partition_key_to_qstash\" is for QStash routes; a webhook route keeps a key's order at the destination with \"partition_key\"",
                })
            }
            (Ordering::PartitionKey, true, Some(_)) | (_, _, None) => {}
            (_, _, Some(_)) => {
                return Err(RouteError {
                    key: "callback",
                    reason: "is for ordered QStash routes (sink = \"qstash\", ordering = \"partition_key\")",
                })
            }
        }
        if self.body == BodyShape::CloudeventsBinary && self.sink != SinkKind::Webhook {
            return Err(RouteError {
                key: "body",
                reason: "\"cloudevents-binary\" is for webhook routes (its attributes are headers of the request); a QStash route sends body = \"cloudevents\", the structured form",
            });
        }
        if let Some(source) = &self.cloudevents_source {
            if !self.body.cloudevents() {
                return Err(RouteError {
                    key: "cloudevents_source",
                    reason: "is for routes with body = \"cloudevents\" or \"cloudevents-binary\"",
                });
            }
            if source.is_empty() || source.chars().any(|c| c.is_control() || c.is_whitespace()) {
                return Err(RouteError {
                    key: "cloudevents_source",
                    reason: "must be a URI reference (\"/shop/orders\", \"https://shop.example.com\"): not empty, without spaces or control characters",
                });
            }
        }
        if self.callback_timeout.is_zero() {
            return Err(RouteError {
                key: "callback_timeout",
                reason: "must be more than zero",
            });
        }
        Ok(())
    }

    /// Settings that are allowed but probably wrong: the key and why.
    pub fn warnings(&self) -> Vec<RouteError> {
        let mut warnings = Vec::new();
        if self
            .callback_hold()
            .is_some_and(|hold| hold > QSTASH_DEDUPLICATION_WINDOW)
        {
            warnings.push(RouteError {
                key: "callback_timeout",
                reason: "is longer than QStash's deduplication window (10 minutes): an event whose callback is lost is sent again after QStash has forgotten its deduplication id, so QStash delivers it again as a new message, and the key waits that long for each attempt; 9 minutes (the default) or less lets QStash drop the first re-send. Each callback that says QStash retries holds the key until QStash's next attempt anyway",
            });
        }
        if self.sink == SinkKind::Webhook && self.parallelism.is_some() {
            warnings.push(RouteError {
                key: "parallelism",
                reason: "is QStash flow control and does nothing on a webhook route; limit its requests in flight with `concurrency`",
            });
        }
        warnings
    }

    /// How long a delivery QStash took is held for its callback, for a route
    /// that waits for one.
    pub(crate) fn callback_hold(&self) -> Option<Duration> {
        self.callback.as_ref().map(|_| self.callback_timeout)
    }

    /// Does this route take events of `event_type`?
    pub fn matches(&self, event_type: &str) -> bool {
        self.event_type.matches(event_type)
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SinkKind {
    #[default]
    Qstash,
    Webhook,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Ordering {
    #[default]
    None,
    /// Per partition key, in id order, at the destination: a webhook route
    /// waits for each answer; a QStash route waits for QStash's callback.
    PartitionKey,
    /// Per partition key, in id order, as far as QStash: QStash takes a key's
    /// events in order, one at a time (flow control, parallelism 1), but a
    /// delivery it retries can reach the destination after the next one.
    PartitionKeyToQstash,
}

impl Ordering {
    /// Are a key's events claimed one at a time, in id order?
    pub fn per_key(self) -> bool {
        self != Ordering::None
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum BodyShape {
    /// `{id, type, aggregateType, aggregateId, tenantId, partitionKey, payload, createdAt}`
    #[default]
    Envelope,
    /// The row's `payload` alone.
    Payload,
    /// A CloudEvent in the structured JSON form (`application/cloudevents+json`).
    Cloudevents,
    /// A CloudEvent in the binary form: the payload, with the attributes in
    /// `ce-*` headers (webhook routes).
    #[serde(rename = "cloudevents-binary")]
    CloudeventsBinary,
}

impl BodyShape {
    pub fn cloudevents(self) -> bool {
        matches!(self, BodyShape::Cloudevents | BodyShape::CloudeventsBinary)
    }
}

/// The event types a route takes: `*`, a prefix (`order.*` takes every type
/// that starts with `order.`), or one exact type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventPattern {
    All,
    /// The prefix with its final `.`: `order.` for `order.*`.
    Prefix(String),
    Exact(String),
}

impl EventPattern {
    pub fn parse(p: &str) -> Result<EventPattern, String> {
        if p == "*" {
            return Ok(EventPattern::All);
        }
        if !p.is_empty() && !p.contains('*') {
            return Ok(EventPattern::Exact(p.to_owned()));
        }
        match p.strip_suffix('*') {
            Some(prefix) if prefix.ends_with('.') && !prefix.contains('*') => {
                Ok(EventPattern::Prefix(prefix.to_owned()))
            }
            _ => Err(format!("`{p}` is not `exact.type`, `prefix.*` or `*`")),
        }
    }

    pub fn matches(&self, event_type: &str) -> bool {
        match self {
            EventPattern::All => true,
            EventPattern::Prefix(prefix) => event_type.starts_with(prefix.as_str()),
            EventPattern::Exact(exact) => exact == event_type,
        }
    }
}

impl fmt::Display for EventPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventPattern::All => f.write_str("*"),
            EventPattern::Prefix(prefix) => write!(f, "{prefix}*"),
            EventPattern::Exact(exact) => f.write_str(exact),
        }
    }
}

impl Serialize for EventPattern {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for EventPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<EventPattern, D::Error> {
        EventPattern::parse(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// A request method, upper-cased (`post` is sent as `POST`); `POST` unless set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpMethod(http::Method);

impl HttpMethod {
    pub fn parse(s: &str) -> Result<HttpMethod, String> {
        let not_one = || format!("`{s}` is not an HTTP method");
        http::Method::from_bytes(s.as_bytes()).map_err(|_| not_one())?;
        http::Method::from_bytes(s.to_ascii_uppercase().as_bytes())
            .map(HttpMethod)
            .map_err(|_| not_one())
    }

    pub fn method(&self) -> &http::Method {
        &self.0
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl Default for HttpMethod {
    fn default() -> Self {
        HttpMethod(http::Method::POST)
    }
}

impl Serialize for HttpMethod {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for HttpMethod {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<HttpMethod, D::Error> {
        HttpMethod::parse(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// A webhook route's `whsec_…` secrets (Standard Webhooks), decoded to
/// their keys when read: one, or several during a rotation (the current one
/// first). Each request carries a signature by every one of them, so a
/// receiver that knows any of them accepts it. They never print: `Debug` and
/// `Serialize` show `<redacted>`.
#[derive(Clone, PartialEq, Eq)]
pub struct SigningSecret {
    keys: Vec<Vec<u8>>,
}

impl SigningSecret {
    pub fn new(secret: &Secret) -> Result<SigningSecret, String> {
        Ok(SigningSecret {
            keys: vec![decode(secret)?],
        })
    }

    /// Several secrets, the current one first; at least one.
    pub fn several(secrets: &[Secret]) -> Result<SigningSecret, String> {
        if secrets.is_empty() {
            return Err("needs at least one secret".to_owned());
        }
        let n = secrets.len();
        let keys = secrets
            .iter()
            .enumerate()
            .map(|(i, secret)| {
                decode(secret).map_err(|e| {
                    if n == 1 {
                        e
                    } else {
                        format!("secret {} of {n}: {e}", i + 1)
                    }
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(SigningSecret { keys })
    }

    /// The HMAC key of the current (first) secret.
    pub fn key(&self) -> &[u8] {
        &self.keys[0]
    }

    /// Every secret's HMAC key, the current one first.
    pub fn keys(&self) -> &[Vec<u8>] {
        &self.keys
    }
}

fn decode(secret: &Secret) -> Result<Vec<u8>, String> {
    let s = secret.expose();
    if !s.starts_with(outbox_client::signing::SECRET_PREFIX) {
        return Err("must start with `whsec_`".to_owned());
    }
    outbox_client::signing::decode_secret(s).map_err(|e| e.to_string())
}

impl fmt::Debug for SigningSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(REDACTED, f)
    }
}

impl Serialize for SigningSecret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

/// One secret, several separated by spaces, or a list of them; an empty
/// string or list (or none) is not set; any other secret must decode.
fn optional_signing_secret<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<SigningSecret>, D::Error> {
    /// Refused without echoing what it was (it may be a secret).
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        One(String),
        Many(Vec<String>),
        Other(serde::de::IgnoredAny),
    }
    let texts: Vec<String> = match Option::<Raw>::deserialize(d)? {
        None => return Ok(None),
        Some(Raw::One(s)) => s.split_whitespace().map(str::to_owned).collect(),
        Some(Raw::Many(list)) => list,
        Some(Raw::Other(_)) => {
            return Err(serde::de::Error::custom(
                "must be a `whsec_…` secret, several separated by spaces, or a list of them",
            ))
        }
    };
    if texts.is_empty() {
        return Ok(None);
    }
    let secrets = texts
        .iter()
        .map(|t| t.parse::<Secret>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(serde::de::Error::custom)?;
    SigningSecret::several(&secrets)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

fn at_least_one<'de, D: Deserializer<'de>>(d: D) -> Result<Option<NonZeroU32>, D::Error> {
    match Option::<u32>::deserialize(d)? {
        None => Ok(None),
        Some(n) => NonZeroU32::new(n)
            .map(Some)
            .ok_or_else(|| serde::de::Error::custom("must be at least 1")),
    }
}
