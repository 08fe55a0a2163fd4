//! A circuit breaker per route. When failures are about the sink rather than
//! the event (our credentials refused, a quota or rate limit, connections
//! refused, or every request failing or refused), the route pauses with
//! backoff instead of spending every row's attempts: a revoked token, a
//! consumer being redeployed or a destination down for ten minutes must not
//! dead-letter the backlog. While a route is paused its rows are put back
//! (deferred) without counting an attempt; when the pause ends one request
//! probes the sink, and its answer closes the breaker or pauses the route
//! again, for twice as long: at once when the sink refuses it (credentials, a
//! rate limit, no connection), after [`PROBE_TRIES`] probes in a row when they
//! fail as any request may (a 5xx, a timeout, an unreadable answer), each
//! tried [`probe_gap`] after the last. A final verdict (a 4xx, the last attempt
//! failing) is carried out only once the route accepted another message
//! since the event first failed ([`witness`]).

pub(crate) mod witness;

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use metrics::{counter, gauge};

use super::{Outcome, RetryReason};
use crate::metrics as m;
use witness::{Verdict, Witnesses};

/// Requests in a row that fail (5xx, 4xx about the message, timeouts, broken
/// connections, unreadable answers) without one acceptance before the route
/// pauses...
pub(crate) const FAILING_REQUESTS: u32 = 5;
/// ...when they carried at least this many different events. One event
/// failing alone again and again while nothing else is sent may be that
/// event's fault; two or more failing together, with nothing accepted in
/// between, is the route's (a route with two pending events in an outage
/// pauses too). A busy healthy route is not paused by a stray 5xx: that
/// takes five whole requests in a row failing.
pub const FAILING_EVENTS: usize = 2;
/// The first pause; each failed probe doubles it, up to the breaker's longest
/// pause: half the row lease, within [`PAUSE_MIN`] and [`PAUSE_MAX`], so a
/// sink that comes back is probed again well within a lease.
pub(crate) const PAUSE_MIN: Duration = Duration::from_secs(1);
pub(crate) const PAUSE_MAX: Duration = Duration::from_secs(60);

/// Probes in a row that fail as any request may (not a refusal of the
/// sink's) before the pause doubles: one stray failure of the first request
/// after an outage must not pause a route that is back for twice as long.
pub(crate) const PROBE_TRIES: u32 = 3;

/// How soon after a probe that failed so the next one goes.
pub(crate) fn probe_gap(pause: Duration) -> Duration {
    (pause / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// The longest pause for a relay whose row lease is `lease`.
pub(crate) fn longest_pause(lease: Duration) -> Duration {
    (lease / 2).clamp(PAUSE_MIN, PAUSE_MAX)
}

/// The `cause` label values of a pause: the reasons that pause a route at
/// once ([`health`]'s `Down`), and `failing`.
pub(crate) const PAUSE_CAUSES: [&str; 5] = [
    "unauthorized",
    "rate_limited",
    "connect",
    "redirect",
    FAILING_CAUSE,
];
const FAILING_CAUSE: &str = "failing";

/// What a delivery's outcomes say about the sink.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Health {
    /// The sink accepted a message, or answered about each message on its own
    /// (a QStash batch element's error).
    Up,
    /// The sink refuses all work for now: credentials, quota, no connection.
    Down {
        /// How long the sink asked us to wait.
        after: Option<Duration>,
        cause: &'static str,
        error: String,
    },
    /// Every message of the request failed or was refused (a 4xx about the
    /// message): the sink's fault when it happens to several events in a row.
    Failing { error: String },
    /// Nothing reached the sink (no request was made).
    Unknown,
}

/// Reads a delivery's outcomes.
pub(crate) fn health(outcomes: &[Outcome]) -> Health {
    let mut down: Option<Health> = None;
    let mut failing: Option<String> = None;
    for outcome in outcomes {
        match outcome {
            Outcome::Published => return Health::Up,
            Outcome::Dead { reason, error } if reason.reached_sink() => {
                failing.get_or_insert_with(|| error.clone());
            }
            Outcome::Dead { .. } => {}
            Outcome::Retry {
                after,
                reason,
                error,
            } => match reason {
                RetryReason::BatchElement => return Health::Up,
                RetryReason::Unauthorized
                | RetryReason::RateLimited
                | RetryReason::Connect
                | RetryReason::Redirect => {
                    let later = match &down {
                        Some(Health::Down { after: a, .. }) => *a < *after,
                        _ => true,
                    };
                    if later {
                        down = Some(Health::Down {
                            after: *after,
                            cause: reason.as_str(),
                            error: error.clone(),
                        });
                    }
                }
                RetryReason::ServerError
                | RetryReason::Timeout
                | RetryReason::Network
                | RetryReason::UnreadableAnswer => {
                    failing.get_or_insert_with(|| error.clone());
                }
            },
        }
    }
    match (down, failing) {
        (Some(down), _) => down,
        (None, Some(error)) => Health::Failing { error },
        (None, None) => Health::Unknown,
    }
}

/// The kind of a failure, for [`witness`]: a retry's reason; a verdict's
/// reason and what its error starts with (`HTTP 404`, `qstash`).
pub(crate) fn failure_kind(outcome: &Outcome) -> witness::Kind {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    match outcome {
        Outcome::Published => 0u8.hash(&mut h),
        Outcome::Retry { reason, .. } => (1u8, reason.as_str()).hash(&mut h),
        Outcome::Dead { reason, error } => {
            let head = error.split(':').next().unwrap_or_default();
            (2u8, reason.as_str(), head).hash(&mut h)
        }
    }
    h.finish()
}

/// May a delivery go ahead?
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Admit {
    Send,
    /// The route is paused until then: defer the rows.
    Paused {
        until: Instant,
        error: String,
    },
}

#[derive(Debug)]
enum State {
    Closed {
        failures: u32,
        /// Events the failing requests carried (up to [`FAILING_EVENTS`]).
        events: HashSet<i64>,
    },
    Open {
        until: Instant,
        pause: Duration,
        error: String,
        /// Probes of this pause that failed so far ([`PROBE_TRIES`]).
        misses: u32,
    },
    /// The pause ended and one delivery is probing the sink.
    Probing {
        since: Instant,
        pause: Duration,
        error: String,
        misses: u32,
    },
}

impl State {
    fn closed() -> State {
        State::Closed {
            failures: 0,
            events: HashSet::new(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Breaker {
    route: String,
    /// A probe that never reports (its publisher crashed) is given up after this.
    probe_timeout: Duration,
    longest_pause: Duration,
    state: Mutex<State>,
    witnesses: Mutex<Witnesses>,
}

impl Breaker {
    pub(crate) fn new(route: &str, request_timeout: Duration, longest_pause: Duration) -> Breaker {
        gauge!(m::ROUTE_PAUSED, "route" => route.to_owned()).set(0.0);
        Breaker {
            route: route.to_owned(),
            probe_timeout: request_timeout * 2,
            longest_pause,
            state: Mutex::new(State::closed()),
            witnesses: Mutex::new(Witnesses::default()),
        }
    }

    /// Takes what a delivery of the events `ids`, sent at `sent` and
    /// answered at `now`, found out (`outcomes`, one per event): what it says
    /// about the sink, and which events the route accepted and which failed.
    /// Returns when the route is paused until (with the reason) if it is
    /// paused now.
    pub(crate) fn record(
        &self,
        outcomes: &[Outcome],
        ids: &[i64],
        sent: Instant,
        now: Instant,
    ) -> Option<(Instant, String)> {
        let unexplained = {
            let mut witnesses = self.witnesses.lock().expect("witness lock");
            let mut beside = false;
            for (id, outcome) in ids.iter().zip(outcomes) {
                if *outcome == Outcome::Published {
                    witnesses.accepted(*id, sent, now);
                    beside = true;
                }
            }
            for (id, outcome) in ids.iter().zip(outcomes) {
                let failed = match outcome {
                    Outcome::Published => false,
                    Outcome::Retry { .. } => true,
                    Outcome::Dead { reason, .. } => reason.reached_sink(),
                };
                if failed {
                    // An acceptance in this same answer witnesses the others,
                    // and so does an error element of a readable batch
                    // answer: the sink judged that message on its own.
                    let judged = matches!(
                        outcome,
                        Outcome::Retry {
                            reason: RetryReason::BatchElement,
                            ..
                        }
                    );
                    witnesses.failed(*id, now, failure_kind(outcome), beside || judged);
                }
            }
            witnesses.unexplained(ids)
        };
        let health = health(outcomes);
        if matches!(health, Health::Failing { .. }) && unexplained.is_empty() {
            // Only events that failed while the route accepted others: their
            // failures are their own (they spend their attempts and end
            // dead-lettered), not the route's. A probe that fails so still
            // pauses the route again.
            if matches!(
                *self.state.lock().expect("breaker lock"),
                State::Closed { .. }
            ) {
                return None;
            }
        }
        self.record_health(health, &unexplained, now)
    }

    /// Event `id` reached a final verdict (refused for itself, or its last
    /// attempt failed) in the answer to a request sent at `sent`: carry it
    /// out, or defer it until it has a witness ([`witness`]).
    pub(crate) fn verdict(&self, id: i64, sent: Instant, now: Instant) -> Verdict {
        self.witnesses
            .lock()
            .expect("witness lock")
            .verdict(id, sent, now, self.longest_pause)
    }

    pub(crate) fn admit(&self, now: Instant) -> Admit {
        let mut state = self.state.lock().expect("breaker lock");
        match &*state {
            State::Closed { .. } => Admit::Send,
            State::Open {
                until,
                pause,
                error,
                misses,
            } if now >= *until => {
                *state = State::Probing {
                    since: now,
                    pause: *pause,
                    error: error.clone(),
                    misses: *misses,
                };
                Admit::Send
            }
            State::Open { until, error, .. } => Admit::Paused {
                until: *until,
                error: error.clone(),
            },
            State::Probing { since, .. } if now >= *since + self.probe_timeout => {
                if let State::Probing { since, .. } = &mut *state {
                    *since = now;
                }
                Admit::Send
            }
            State::Probing { pause, error, .. } => Admit::Paused {
                until: now + (*pause / 4).max(Duration::from_millis(100)),
                error: error.clone(),
            },
        }
    }

    /// Takes what a delivery of the events `ids` says about the sink; returns
    /// when the route is paused until (with the reason) if it is paused now.
    fn record_health(
        &self,
        health: Health,
        ids: &[i64],
        now: Instant,
    ) -> Option<(Instant, String)> {
        let mut state = self.state.lock().expect("breaker lock");
        let last_pause = match &*state {
            State::Open { pause, .. } | State::Probing { pause, .. } => Some(*pause),
            State::Closed { .. } => None,
        };
        let probe_misses = match &*state {
            State::Probing { misses, .. } => Some(*misses),
            _ => None,
        };
        let (cause, error, after) = match health {
            Health::Unknown => {
                return match &*state {
                    State::Open { until, error, .. } => Some((*until, error.clone())),
                    _ => None,
                }
            }
            Health::Up => {
                if last_pause.is_some() {
                    tracing::info!(route = %self.route, "route resumed: the sink answers again");
                    gauge!(m::ROUTE_PAUSED, "route" => self.route.clone()).set(0.0);
                }
                *state = State::closed();
                return None;
            }
            Health::Failing { error } => {
                if let State::Closed { failures, events } = &mut *state {
                    *failures += 1;
                    for id in ids {
                        if events.len() < FAILING_EVENTS {
                            events.insert(*id);
                        }
                    }
                    if *failures < FAILING_REQUESTS || events.len() < FAILING_EVENTS {
                        return None;
                    }
                }
                if let (Some(misses), Some(pause)) = (probe_misses, last_pause) {
                    if misses + 1 < PROBE_TRIES {
                        // Paused still, under the pause's own error; the
                        // next probe goes soon.
                        let until = now + probe_gap(pause);
                        let State::Probing { error: paused, .. } = &*state else {
                            unreachable!("probing")
                        };
                        let paused = paused.clone();
                        tracing::debug!(route = %self.route, %error, retry_in = ?(until - now), "probe failed; trying again");
                        *state = State::Open {
                            until,
                            pause,
                            error: paused.clone(),
                            misses: misses + 1,
                        };
                        return Some((until, paused));
                    }
                }
                (FAILING_CAUSE, error, None)
            }
            Health::Down {
                after,
                cause,
                error,
            } => (cause, error, after),
        };
        if let State::Open { until, error, .. } = &*state {
            // Already paused by another delivery that failed alongside.
            return Some((*until, error.clone()));
        }
        let pause = match last_pause {
            Some(p) => (p * 2).min(self.longest_pause),
            None => PAUSE_MIN.min(self.longest_pause),
        };
        // A sink that says when it takes work again (a 429's reset) is taken
        // at its word, even when that is sooner than the backoff.
        let until = now + after.unwrap_or(pause);
        let error = super::truncate(format!("route paused ({cause}): {error}"), 500);
        tracing::warn!(
            route = %self.route,
            cause,
            pause = ?(until - now),
            %error,
            "route paused: the sink fails every request; its rows wait without spending attempts"
        );
        counter!(m::ROUTE_PAUSES, "route" => self.route.clone(), "cause" => cause).increment(1);
        gauge!(m::ROUTE_PAUSED, "route" => self.route.clone()).set(1.0);
        *state = State::Open {
            until,
            pause,
            error: error.clone(),
            misses: 0,
        };
        Some((until, error))
    }

    /// While the route has not resumed (paused, or probing the sink after a
    /// pause): the error that paused it.
    pub(crate) fn pause_error(&self) -> Option<String> {
        match &*self.state.lock().expect("breaker lock") {
            State::Closed { .. } => None,
            State::Open { error, .. } | State::Probing { error, .. } => Some(error.clone()),
        }
    }

    /// When the route is paused and no probe is due, until when.
    pub(crate) fn paused_until(&self, now: Instant) -> Option<Instant> {
        match &*self.state.lock().expect("breaker lock") {
            State::Open { until, .. } if *until > now => Some(*until),
            _ => None,
        }
    }
}

/// One breaker per route, by route index.
#[derive(Debug, Default)]
pub(crate) struct Breakers {
    routes: Vec<Breaker>,
}

impl Breakers {
    pub(crate) fn new(
        names: impl IntoIterator<Item = String>,
        request_timeout: Duration,
        lease: Duration,
    ) -> Breakers {
        Breakers {
            routes: names
                .into_iter()
                .map(|n| Breaker::new(&n, request_timeout, longest_pause(lease)))
                .collect(),
        }
    }

    pub(crate) fn route(&self, index: usize) -> &Breaker {
        &self.routes[index]
    }

    /// The routes that have not resumed since their last pause, by name,
    /// with the error that paused each.
    pub(crate) fn paused(&self) -> Vec<(String, String)> {
        self.routes
            .iter()
            .filter_map(|b| b.pause_error().map(|e| (b.route.clone(), e)))
            .collect()
    }

    /// When every route is paused: the earliest end of a pause (claiming
    /// before then would only put rows back).
    pub(crate) fn all_paused_until(&self, now: Instant) -> Option<Instant> {
        if self.routes.is_empty() {
            return None;
        }
        self.routes
            .iter()
            .map(|b| b.paused_until(now))
            .collect::<Option<Vec<_>>>()?
            .into_iter()
            .min()
    }
}

#[cfg(test)]
mod tests;
