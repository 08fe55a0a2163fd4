//! The adversarial fault mode's answers ([`super::faults::AdversarialConfig`])
//! and the sink's log of what it answered about each message.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use hyper::body::{Body, Frame, SizeHint};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::faults::{FaultState, OutageKind};

/// What the sink answered about one message, as the relay could read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum AnswerKind {
    /// A readable answer that says this message was accepted (see
    /// [`super::faults::AdversarialConfig`] for what counts).
    Accepted,
    /// Taken (a retry is answered as a duplicate), but the answer saying so
    /// was lost, cut off or unreadable.
    AcceptedUnread,
    /// Refused for itself: a 4xx other than 401, 403, 408 and 429 to a
    /// request carrying this message alone, or an error element (any status)
    /// in its slot of a readable batch answer.
    Rejected { status: u16 },
    /// The request failed as a whole, or the answer about this message could
    /// not be read: `status` is the HTTP status, 0 when there was no answer.
    Failed { status: u16 },
}

impl AnswerKind {
    /// A rejection of this message itself, which may justify a dead letter.
    pub fn is_rejection(&self) -> bool {
        matches!(self, AnswerKind::Rejected { .. })
    }
}

/// One answer about one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnswerEvent {
    /// Wall clock, unix µs, when the sink decided the answer.
    pub at_us: i64,
    pub outbox_id: i64,
    #[serde(flatten)]
    pub kind: AnswerKind,
    /// The outage whose answer this was (every request it hit fails alike),
    /// `None` for an answer the sink gave on its own merits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outage: Option<OutageKind>,
}

/// A status that says "this message is refused", not "try again" or "the
/// sink as a whole refuses you".
pub fn is_permanent_rejection(status: u16) -> bool {
    (400..500).contains(&status) && !matches!(status, 401 | 403 | 408 | 429)
}

/// An outage as it happened, unix µs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutageWindow {
    pub kind: OutageKind,
    pub start_us: i64,
    pub end_us: i64,
    /// The destination path it was limited to; the whole sink when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
}

/// The outage in force.
#[derive(Debug, Clone)]
pub(crate) struct ActiveOutage {
    pub kind: OutageKind,
    /// When it began, unix µs (for its [`OutageWindow`]).
    pub start_us: i64,
    pub until: Instant,
    pub until_wall: SystemTime,
    pub route: Option<String>,
}

impl ActiveOutage {
    /// Its window, ending now.
    pub(crate) fn window(&self) -> OutageWindow {
        OutageWindow {
            kind: self.kind,
            start_us: self.start_us,
            end_us: now_us(),
            route: self.route.clone(),
        }
    }

    /// Does it fail a request carrying messages to `destinations`?
    pub(crate) fn applies<'a>(&self, mut destinations: impl Iterator<Item = &'a str>) -> bool {
        match &self.route {
            None => true,
            Some(route) => destinations.any(|d| destination_path(d) == route),
        }
    }
}

/// The path of a destination URL (`http://host:port/a/b?q` -> `/a/b`).
pub(crate) fn destination_path(destination: &str) -> &str {
    let rest = destination
        .split_once("://")
        .map_or(destination, |(_, r)| r);
    let path = rest.find('/').map_or("", |i| &rest[i..]);
    path.split(['?', '#']).next().unwrap_or(path)
}

pub(crate) fn now_us() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

/// Unix seconds of `at`, rounded up.
fn unix_secs_ceil(at: SystemTime) -> u64 {
    let d = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// The headers of a 429 that lifts at `until`, in one of the forms QStash
/// and destinations use, chosen at random: `Retry-After` in seconds or as an
/// HTTP date, the daily limit's `RateLimit-Reset`, the burst limit's
/// `Burst-RateLimit-Reset` (unix seconds), or a `Retry-After` that does not
/// parse (the relay must fall back to its own backoff).
pub(crate) fn rate_limit_headers(
    f: &mut FaultState,
    until: SystemTime,
) -> Vec<(&'static str, HeaderValue)> {
    let wait = until
        .duration_since(SystemTime::now())
        .unwrap_or_default()
        .as_secs_f64()
        .ceil() as u64;
    let reset = HeaderValue::from(unix_secs_ceil(until));
    match f.pick(5) {
        0 => vec![("retry-after", HeaderValue::from(wait))],
        1 => {
            let date = httpdate(until + Duration::from_secs(1));
            vec![(
                "retry-after",
                HeaderValue::from_str(&date).expect("an HTTP date is a valid header"),
            )]
        }
        2 => vec![
            ("ratelimit-limit", HeaderValue::from(1000)),
            ("ratelimit-remaining", HeaderValue::from(0)),
            ("ratelimit-reset", reset),
        ],
        3 => vec![
            ("burst-ratelimit-limit", HeaderValue::from(100)),
            ("burst-ratelimit-remaining", HeaderValue::from(0)),
            ("burst-ratelimit-reset", reset),
        ],
        _ => {
            let junk = ["soon", "-1", "1.5", "", "9999999999999999999999"];
            vec![(
                "retry-after",
                HeaderValue::from_static(junk[f.pick(junk.len())]),
            )]
        }
    }
}

/// RFC 7231 IMF-fixdate.
fn httpdate(at: SystemTime) -> String {
    chrono::DateTime::<chrono::Utc>::from(at)
        .format("%a, %d %b %Y %H:%M:%S GMT")
        .to_string()
}

/// An error body: `{"error": text}`, followed (as `nul_bodies` draws) by NUL
/// bytes and invalid UTF-8.
pub(crate) fn error_body(f: &mut FaultState, text: &str) -> Bytes {
    let mut body = json!({ "error": text }).to_string().into_bytes();
    if f.chance(nul_fraction(f)) {
        body.extend_from_slice(b"\0\xff\xfe\0 \xc3\x28 trailing\0");
    }
    Bytes::from(body)
}

/// The text of an element error, with a NUL and a control character inside
/// the JSON string as `nul_bodies` draws (valid JSON: `\u0000`).
pub(crate) fn element_error_text(f: &mut FaultState, text: String) -> String {
    if f.chance(nul_fraction(f)) {
        format!("{text}\u{0}\u{1b}[0m\u{fffd}\u{0}")
    } else {
        text
    }
}

fn nul_fraction(f: &FaultState) -> f64 {
    f.config.adversarial.as_ref().map_or(0.0, |a| a.nul_bodies)
}

/// How a 2xx body is made unreadable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Garble {
    /// Valid JSON cut short (the length header matches what is sent).
    Truncated,
    /// NUL and invalid UTF-8 bytes inside.
    NulBytes,
    /// A batch array one element short or one too long.
    WrongLength,
    /// Some batch elements replaced by strings, numbers, `null`, `true`.
    NotObjects,
    /// An object, `null`, a string or nothing where an array belongs.
    NotArray,
    /// `204 No Content`, empty.
    NoContent,
}

const GARBLES: [Garble; 6] = [
    Garble::Truncated,
    Garble::NulBytes,
    Garble::WrongLength,
    Garble::NotObjects,
    Garble::NotArray,
    Garble::NoContent,
];

impl Garble {
    pub(crate) fn draw(f: &mut FaultState) -> Garble {
        GARBLES[f.pick(GARBLES.len())]
    }

    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            Garble::Truncated => "garbled_truncated",
            Garble::NulBytes => "garbled_nul_bytes",
            Garble::WrongLength => "garbled_wrong_length",
            Garble::NotObjects => "garbled_not_objects",
            Garble::NotArray => "garbled_not_array",
            Garble::NoContent => "garbled_no_content",
        }
    }
}

/// A garbled answer: status and body, and for a batch which elements stay
/// readable (`readable[i]`: element `i` is what the sink meant for message `i`).
pub(crate) struct Garbled {
    pub status: StatusCode,
    pub body: Bytes,
    pub readable: Vec<bool>,
}

/// Garbles the answer `body` (a JSON object for a publish, an array of
/// `elements` for a batch) the way `garble` says.
pub(crate) fn garble(
    f: &mut FaultState,
    garble: Garble,
    status: StatusCode,
    body: &Value,
) -> Garbled {
    let n = body.as_array().map_or(1, Vec::len);
    let none = vec![false; n];
    let text = body.to_string().into_bytes();
    let garbled = |status, body: Vec<u8>, readable| Garbled {
        status,
        body: Bytes::from(body),
        readable,
    };
    match garble {
        Garble::Truncated => {
            let cut = 1 + f.pick(text.len().max(2) - 1);
            garbled(status, text[..cut.min(text.len() - 1)].to_vec(), none)
        }
        Garble::NulBytes => {
            let at = f.pick(text.len());
            let mut b = text;
            b.splice(at..at, b"\0\xff\xc3\x28\0".iter().copied());
            garbled(status, b, none)
        }
        Garble::WrongLength => match body.as_array() {
            Some(items) => {
                let mut items = items.clone();
                if items.len() > 1 && f.chance(0.5) {
                    items.remove(f.pick(items.len()));
                } else {
                    items
                        .push(json!({"messageId": "msg_extra", "url": "http://127.0.0.1:9/extra"}));
                }
                garbled(status, Value::Array(items).to_string().into_bytes(), none)
            }
            None => garbled(status, b"[]".to_vec(), none),
        },
        Garble::NotObjects => match body.as_array() {
            Some(items) => {
                let junk = [json!("ok"), json!(42), Value::Null, json!(true), json!("")];
                let mut readable = vec![true; n];
                let mut items = items.clone();
                for (i, item) in items.iter_mut().enumerate() {
                    if i == 0 || f.chance(0.5) {
                        *item = junk[f.pick(junk.len())].clone();
                        readable[i] = false;
                    }
                }
                garbled(
                    status,
                    Value::Array(items).to_string().into_bytes(),
                    readable,
                )
            }
            None => garbled(status, b"\"ok\"".to_vec(), none),
        },
        Garble::NotArray => {
            let shapes: [&[u8]; 4] = [b"{}", b"null", b"\"accepted\"", b""];
            garbled(status, shapes[f.pick(shapes.len())].to_vec(), none)
        }
        Garble::NoContent => garbled(StatusCode::NO_CONTENT, Vec::new(), none),
    }
}

/// `body` (an object or an array of them) with a `pad` field added to every
/// object until the whole is at least `bytes` long: valid, just too big.
pub(crate) fn oversize(body: &Value, bytes: usize) -> Bytes {
    let mut body = body.clone();
    let objects = body.as_array().map_or(1, Vec::len).max(1);
    let pad = "x".repeat(bytes / objects + 1);
    let mut add = |v: &mut Value| {
        if let Some(o) = v.as_object_mut() {
            o.insert("pad".into(), Value::String(pad.clone()));
        }
    };
    match body.as_array_mut() {
        Some(items) => items.iter_mut().for_each(&mut add),
        None => add(&mut body),
    }
    Bytes::from(body.to_string())
}

/// A response body: all of it, or a prefix behind a `content-length` of the
/// whole, after which the body fails and hyper drops the connection, so the
/// client sees the answer end mid-body.
pub struct AnswerBody {
    data: Option<Bytes>,
    announced: u64,
    cut: bool,
}

impl AnswerBody {
    pub fn whole(data: Bytes) -> Self {
        AnswerBody {
            announced: data.len() as u64,
            data: Some(data),
            cut: false,
        }
    }

    pub fn cut_off(prefix: Bytes, announced: u64) -> Self {
        AnswerBody {
            data: Some(prefix),
            announced,
            cut: true,
        }
    }
}

impl Body for AnswerBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if let Some(data) = self.data.take().filter(|d| !d.is_empty()) {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if std::mem::take(&mut self.cut) {
            return Poll::Ready(Some(Err(std::io::Error::other("answer cut off"))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.data.as_ref().is_none_or(Bytes::is_empty) && !self.cut
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.announced)
    }
}

/// A prefix of `body` (shorter than it) and the length to announce.
pub(crate) fn cut_off_prefix(f: &mut FaultState, body: &Bytes) -> (Bytes, usize) {
    let keep = f.pick(body.len().max(1));
    (body.slice(..keep.min(body.len())), body.len().max(1))
}

#[cfg(test)]
mod tests {
    use super::super::faults::{AdversarialConfig, FaultConfig};
    use super::*;

    fn state() -> FaultState {
        FaultState::new(FaultConfig {
            seed: 5,
            adversarial: Some(AdversarialConfig {
                nul_bodies: 1.0,
                ..AdversarialConfig::default()
            }),
            ..FaultConfig::default()
        })
    }

    fn batch(n: usize) -> Value {
        Value::Array(
            (0..n)
                .map(
                    |i| json!({"messageId": format!("msg_{i}"), "url": "u", "deduplicated": false}),
                )
                .collect(),
        )
    }

    #[test]
    fn every_garble_is_unreadable_where_it_says() {
        let mut f = state();
        for g in GARBLES {
            for _ in 0..50 {
                let out = garble(&mut f, g, StatusCode::OK, &batch(4));
                assert_eq!(out.readable.len(), 4);
                let parsed = serde_json::from_slice::<Value>(&out.body).ok();
                let items = parsed.as_ref().and_then(Value::as_array);
                match items {
                    Some(items) if items.len() == 4 => {
                        assert_eq!(g, Garble::NotObjects);
                        for (i, item) in items.iter().enumerate() {
                            assert_eq!(out.readable[i], item.is_object(), "{g:?} {i}");
                        }
                        assert!(out.readable.iter().any(|r| !r));
                    }
                    _ => assert!(out.readable.iter().all(|r| !r), "{g:?}"),
                }
            }
        }
    }

    #[test]
    fn nul_bodies_and_oversized_answers() {
        let mut f = state();
        let body = error_body(&mut f, "injected 503 for message 7");
        assert!(body.contains(&0) && std::str::from_utf8(&body).is_err());
        let text = element_error_text(&mut f, "x".into());
        let encoded = json!({ "error": text }).to_string();
        let back: Value = serde_json::from_str(&encoded).unwrap();
        assert!(back["error"].as_str().unwrap().contains('\0'));
        let big = oversize(&batch(3), 10_000);
        assert!(big.len() >= 10_000);
        let back: Value = serde_json::from_slice(&big).unwrap();
        assert_eq!(back.as_array().unwrap().len(), 3);
        assert!(is_permanent_rejection(422) && !is_permanent_rejection(429));
        assert!(!is_permanent_rejection(503) && !is_permanent_rejection(401));
    }

    #[test]
    fn a_route_outage_fails_only_requests_to_its_destination_path() {
        let o = ActiveOutage {
            kind: OutageKind::NotFound,
            start_us: now_us(),
            until: Instant::now(),
            until_wall: SystemTime::now(),
            route: Some("/hook/invoices".into()),
        };
        let to = |d: &'static [&'static str]| o.applies(d.iter().copied());
        assert!(to(&["http://127.0.0.1:9/hook/invoices"]));
        assert!(to(&[
            "http://127.0.0.1:9/hook",
            "http://h/hook/invoices?x=1"
        ]));
        assert!(!to(&["http://127.0.0.1:9/hook"]));
        assert!(!to(&["http://127.0.0.1:9/hook/invoices/more"]));
        let sink_wide = ActiveOutage { route: None, ..o };
        assert!(sink_wide.applies(["http://127.0.0.1:9/hook"].into_iter()));
        assert_eq!(destination_path("https://a.example"), "");
    }
}
