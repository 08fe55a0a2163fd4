//! Fault injection: what the sink does wrong on purpose, drawn from a seeded RNG
//! so a run can be replayed.
//!
//! Whole-request faults are drawn once per HTTP request, in this order of
//! precedence from one uniform draw: `reset`, `hang`, `server_error`,
//! `rate_limited`, `lost_response` (their fractions add up; the sum should stay
//! ≤ 1). Element faults (`element_error`) are drawn once per message: on
//! `/v2/publish` the message is the request, on `/v2/batch` each element.
//!
//! With `[adversarial]` (see [`AdversarialConfig`]) the same draw also picks
//! `status` (a random non-2xx status), `garbled` (a 2xx whose body cannot be
//! read), `cut_off` (an answer that breaks off mid-body) and `oversized` (a
//! 2xx bigger than a client reads), and the sink runs scheduled outages.
//!
//! Poison events are not random: an event is poison when its outbox id is in
//! `poison_ids`, or (with `poison_marker`, on by default) when its JSON body has
//! `"poison": true` at the top level or inside `payload` (the relay's envelope
//! puts the row's payload there). Poison is always rejected with 400.

use std::collections::BTreeSet;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Fault fractions and parameters; all zero by default (a well-behaved QStash).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultConfig {
    /// Seed of the RNG the fractions are drawn from.
    pub seed: u64,
    /// Requests answered `503 {"error": …}`.
    pub server_error: f64,
    /// Requests answered `429` with `Retry-After: <retry_after seconds>`.
    pub rate_limited: f64,
    #[serde(with = "humantime_serde")]
    pub retry_after: Duration,
    /// Requests never answered: held for `hang_for`, then the connection is dropped.
    pub hang: f64,
    /// How long a hung request is held (bounded so a run always ends). Make it
    /// longer than the relay's `http.request_timeout`.
    #[serde(with = "humantime_serde")]
    pub hang_for: Duration,
    /// Requests whose connection is reset (RST, no answer) before anything is accepted.
    pub reset: f64,
    /// Requests that are fully accepted and recorded, then reset instead of
    /// answered: the relay cannot know it succeeded and publishes again.
    pub lost_response: f64,
    /// Fixed delay added before every answer.
    #[serde(with = "humantime_serde")]
    pub latency: Duration,
    /// Uniform random delay in `[0, jitter)` added on top of `latency`.
    #[serde(with = "humantime_serde")]
    pub jitter: Duration,
    /// Messages rejected as a transient failure: `503` on `/v2/publish`, an
    /// element `{"error": …, "status": 503}` in a batch.
    pub element_error: f64,
    /// Outbox ids always rejected with 400.
    pub poison_ids: BTreeSet<i64>,
    /// Treat bodies with `"poison": true` (top level or in `payload`) as poison.
    pub poison_marker: bool,
    /// A `/v2/batch` holding poison is refused whole with 400 (nothing
    /// accepted); when false, only the poison element fails, in a 200 answer.
    pub poison_rejects_batch: bool,
    /// The adversarial fault mode; off when absent.
    pub adversarial: Option<AdversarialConfig>,
}

/// The adversarial fault mode: everything a destination or QStash may answer
/// besides the plain faults above, and sink-wide outages.
///
/// **What the sink counts as an accepting answer.** On `/v2/publish` the
/// status line is the answer: a 2xx delivered whole accepts the message
/// whatever its body says. On `/v2/batch` each message's own element is: a
/// message is accepted only by an object with a `messageId` and no `error` in
/// its slot of a well-formed, right-length JSON array delivered whole and no
/// bigger than `oversized_bytes`. A message the sink took but answered
/// otherwise (lost, cut off, garbled, wrong length, not an object, oversized)
/// is taken (a retry is answered as a duplicate) but not *answered* as
/// accepted. See [`super::AnswerKind`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdversarialConfig {
    /// Requests answered with a status drawn uniformly from `statuses`, before
    /// anything is accepted.
    pub status: f64,
    pub statuses: Vec<u16>,
    /// 2xx answers whose body cannot be read: cut JSON, NUL and invalid UTF-8,
    /// a batch array of the wrong length, elements that are not objects, not
    /// an array at all, an empty 204.
    pub garbled: f64,
    /// Answers that announce their full length and break off mid-body.
    pub cut_off: f64,
    /// 2xx answers padded to `oversized_bytes` of valid JSON.
    pub oversized: f64,
    /// Make it larger than any answer the relay reads whole (its
    /// `http.max_response_bytes`, and what it allows a batch answer).
    pub oversized_bytes: usize,
    /// Error answers (and element error texts) carrying NUL and invalid
    /// UTF-8 after the JSON.
    pub nul_bodies: f64,
    /// Sink-wide outages, from [`super::SinkHandle::start_outages`].
    pub outages: Vec<OutageSpec>,
}

impl Default for AdversarialConfig {
    fn default() -> Self {
        AdversarialConfig {
            status: 0.0,
            statuses: vec![
                400, 401, 403, 404, 408, 409, 413, 422, 429, 500, 502, 503, 504,
            ],
            garbled: 0.0,
            cut_off: 0.0,
            oversized: 0.0,
            oversized_bytes: 1024 * 1024,
            nul_bodies: 0.0,
            outages: Vec::new(),
        }
    }
}

/// One outage: from `at` after the outages start, for `duration`, every
/// request (or connection) fails the same way. With `route`, only requests
/// carrying a message to that destination path (e.g. `/hook/invoices`) fail,
/// as a route's destination does during a deploy (404, 410, 503 for a few
/// seconds) or while it is down; the rest are answered as usual.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutageSpec {
    #[serde(with = "humantime_serde")]
    pub at: Duration,
    #[serde(with = "humantime_serde")]
    pub duration: Duration,
    pub kind: OutageKind,
    /// The destination path whose requests fail; the whole sink when absent.
    #[serde(default)]
    pub route: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutageKind {
    /// Every request answered 503 (bodies as `nul_bodies` says).
    ServerError,
    /// Every request answered 401: the token is refused.
    Unauthorized,
    /// Every request answered 403.
    Forbidden,
    /// Every request answered 404 (a destination mid-deploy).
    NotFound,
    /// Every request answered 410.
    Gone,
    /// Every request answered 429, with `Retry-After`, `RateLimit-Reset` or
    /// `Burst-RateLimit-Reset` saying when the outage ends.
    RateLimited,
    /// Every request's connection reset before an answer.
    Reset,
    /// The listener closed: connections refused, open ones reset.
    Refused,
}

impl OutageKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            OutageKind::ServerError => "server_error",
            OutageKind::Unauthorized => "unauthorized",
            OutageKind::Forbidden => "forbidden",
            OutageKind::NotFound => "not_found",
            OutageKind::Gone => "gone",
            OutageKind::RateLimited => "rate_limited",
            OutageKind::Reset => "reset",
            OutageKind::Refused => "refused",
        }
    }
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            seed: 0,
            server_error: 0.0,
            rate_limited: 0.0,
            retry_after: Duration::from_secs(1),
            hang: 0.0,
            hang_for: Duration::from_secs(30),
            reset: 0.0,
            lost_response: 0.0,
            latency: Duration::ZERO,
            jitter: Duration::ZERO,
            element_error: 0.0,
            poison_ids: BTreeSet::new(),
            poison_marker: true,
            poison_rejects_batch: true,
            adversarial: None,
        }
    }
}

impl FaultConfig {
    /// Checks fractions are in `[0, 1]` and the request faults add up to at most 1.
    pub fn validate(&self) -> Result<(), String> {
        let fractions = [
            ("server_error", self.server_error),
            ("rate_limited", self.rate_limited),
            ("hang", self.hang),
            ("reset", self.reset),
            ("lost_response", self.lost_response),
            ("element_error", self.element_error),
        ];
        for (name, f) in fractions {
            if !(0.0..=1.0).contains(&f) {
                return Err(format!("faults.{name} must be between 0 and 1, got {f}"));
            }
        }
        if let Some(a) = &self.adversarial {
            for (name, f) in [
                ("status", a.status),
                ("garbled", a.garbled),
                ("cut_off", a.cut_off),
                ("oversized", a.oversized),
                ("nul_bodies", a.nul_bodies),
            ] {
                if !(0.0..=1.0).contains(&f) {
                    return Err(format!(
                        "faults.adversarial.{name} must be between 0 and 1, got {f}"
                    ));
                }
            }
            if a.status > 0.0
                && (a.statuses.is_empty() || a.statuses.iter().any(|s| !(300..=599).contains(s)))
            {
                return Err(
                    "faults.adversarial.statuses: need one or more statuses in 300..=599".into(),
                );
            }
            let mut end = Duration::ZERO;
            for o in &a.outages {
                if o.duration.is_zero() || o.at < end {
                    return Err(
                        "faults.adversarial.outages: need durations > 0, in order, not overlapping"
                            .into(),
                    );
                }
                end = o.at + o.duration;
                if let Some(route) = &o.route {
                    if !route.starts_with('/') {
                        return Err(format!(
                            "faults.adversarial.outages: route `{route}` must be a destination path starting with /"
                        ));
                    }
                    if matches!(o.kind, OutageKind::Reset | OutageKind::Refused) {
                        return Err(format!(
                            "faults.adversarial.outages: a {} outage cannot be limited to a route (the sink does not know the route before it reads the request)",
                            o.kind.as_str()
                        ));
                    }
                }
            }
        }
        let sum = self.request_fractions().iter().map(|(f, _)| f).sum::<f64>();
        if sum > 1.0 + 1e-9 {
            return Err(format!(
                "faults: server_error + rate_limited + hang + reset + lost_response (+ adversarial status + garbled + cut_off + oversized) must be ≤ 1, got {sum}"
            ));
        }
        Ok(())
    }

    /// Each whole-request fault with its fraction, in the order they are drawn.
    fn request_fractions(&self) -> Vec<(f64, RequestFault)> {
        let mut v = vec![
            (self.reset, RequestFault::Reset),
            (self.hang, RequestFault::Hang),
            (self.server_error, RequestFault::ServerError),
            (self.rate_limited, RequestFault::RateLimited),
            (self.lost_response, RequestFault::LostResponse),
        ];
        if let Some(a) = &self.adversarial {
            v.extend([
                (a.status, RequestFault::Status),
                (a.garbled, RequestFault::Garbled),
                (a.cut_off, RequestFault::CutOff),
                (a.oversized, RequestFault::Oversized),
            ]);
        }
        v
    }
}

/// What happens to a whole request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestFault {
    None,
    Reset,
    Hang,
    ServerError,
    RateLimited,
    LostResponse,
    /// A random status from `adversarial.statuses`.
    Status,
    Garbled,
    CutOff,
    Oversized,
}

/// The configuration and the RNG it is drawn with.
pub(crate) struct FaultState {
    pub config: FaultConfig,
    rng: StdRng,
}

impl FaultState {
    pub(crate) fn new(config: FaultConfig) -> Self {
        let rng = StdRng::seed_from_u64(config.seed);
        FaultState { config, rng }
    }

    pub(crate) fn draw_request(&mut self) -> RequestFault {
        let fractions = self.config.request_fractions();
        if fractions.iter().all(|(f, _)| *f <= 0.0) {
            return RequestFault::None;
        }
        let u: f64 = self.rng.random();
        let mut edge = 0.0;
        for (fraction, fault) in fractions {
            edge += fraction;
            if u < edge {
                return fault;
            }
        }
        RequestFault::None
    }

    /// True with probability `p`.
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.random::<f64>() < p
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn pick(&mut self, n: usize) -> usize {
        self.rng.random_range(0..n)
    }

    pub(crate) fn draw_element_error(&mut self) -> bool {
        let p = self.config.element_error;
        self.chance(p)
    }

    pub(crate) fn draw_delay(&mut self) -> Duration {
        let c = &self.config;
        if c.jitter.is_zero() {
            return c.latency;
        }
        let extra = self.rng.random_range(0..c.jitter.as_micros().max(1) as u64);
        c.latency + Duration::from_micros(extra)
    }

    /// Poison by id, or by the body marker.
    pub(crate) fn is_poison(
        &self,
        outbox_id: Option<i64>,
        body: Option<&serde_json::Value>,
    ) -> bool {
        if let Some(id) = outbox_id {
            if self.config.poison_ids.contains(&id) {
                return true;
            }
        }
        self.config.poison_marker && body.is_some_and(has_poison_marker)
    }
}

/// `"poison": true` at the top level or inside `payload`.
pub fn has_poison_marker(body: &serde_json::Value) -> bool {
    let flag = |v: &serde_json::Value| v.get("poison") == Some(&serde_json::Value::Bool(true));
    flag(body) || body.get("payload").is_some_and(flag)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_are_roughly_honoured_and_replayable() {
        let config = FaultConfig {
            seed: 7,
            server_error: 0.25,
            reset: 0.25,
            ..FaultConfig::default()
        };
        let draw = |c: &FaultConfig| {
            let mut s = FaultState::new(c.clone());
            (0..4000).map(|_| s.draw_request()).collect::<Vec<_>>()
        };
        let a = draw(&config);
        assert_eq!(a, draw(&config));
        let errors = a
            .iter()
            .filter(|f| **f == RequestFault::ServerError)
            .count();
        let resets = a.iter().filter(|f| **f == RequestFault::Reset).count();
        assert!((800..1200).contains(&errors), "{errors}");
        assert!((800..1200).contains(&resets), "{resets}");
    }

    #[test]
    fn validation_names_the_key() {
        let c = FaultConfig {
            hang: 1.5,
            ..FaultConfig::default()
        };
        assert!(c.validate().unwrap_err().contains("faults.hang"));
        let c = FaultConfig {
            hang: 0.6,
            reset: 0.6,
            ..FaultConfig::default()
        };
        assert!(c.validate().is_err());
    }

    #[test]
    fn poison_marker_top_level_or_in_payload() {
        let s = FaultState::new(FaultConfig::default());
        assert!(s.is_poison(None, Some(&serde_json::json!({"poison": true}))));
        assert!(s.is_poison(
            None,
            Some(&serde_json::json!({"payload": {"poison": true}}))
        ));
        assert!(!s.is_poison(
            None,
            Some(&serde_json::json!({"payload": {"poison": false}}))
        ));
        let s = FaultState::new(FaultConfig {
            poison_ids: [42].into(),
            poison_marker: false,
            ..FaultConfig::default()
        });
        assert!(s.is_poison(Some(42), None));
        assert!(!s.is_poison(None, Some(&serde_json::json!({"poison": true}))));
    }
}
