//! A circuit breaker per route. When failures are about the sink rather than
//! the event (our credentials refused, a quota or rate limit, connections
//! refused, or every request failing), the route pauses with backoff instead
//! of spending every row's attempts: a revoked token or a destination down
//! for ten minutes must not dead-letter the backlog. While a route is paused
//! its rows are put back (deferred) without counting an attempt; when the
//! pause ends one request probes the sink, and its answer closes the breaker
//! or pauses the route again, for twice as long.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use metrics::{counter, gauge};

use super::{Outcome, RetryReason};
use crate::metrics as m;

/// Requests in a row that fail (5xx, timeouts, broken connections,
/// unreadable answers) without one success before the route pauses...
pub(crate) const FAILING_REQUESTS: u32 = 5;
/// ...when they carried at least this many different events. Fewer events
/// failing again and again while nothing else is sent look like poison
/// events (a handler that crashes on them), which spend their own attempts
/// and end dead-lettered, rather than like an outage.
pub const FAILING_EVENTS: usize = 10;
/// The first pause; each failed probe doubles it, up to the breaker's longest
/// pause: half the row lease, within [`PAUSE_MIN`] and [`PAUSE_MAX`], so a
/// sink that comes back is probed again well within a lease.
pub(crate) const PAUSE_MIN: Duration = Duration::from_secs(1);
pub(crate) const PAUSE_MAX: Duration = Duration::from_secs(60);

/// The longest pause for a relay whose row lease is `lease`.
pub(crate) fn longest_pause(lease: Duration) -> Duration {
    (lease / 2).clamp(PAUSE_MIN, PAUSE_MAX)
}

/// What a delivery's outcomes say about the sink.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Health {
    /// The sink answered about the messages themselves (accepted, or refused
    /// one message for its content).
    Up,
    /// The sink refuses all work for now: credentials, quota, no connection.
    Down {
        /// How long the sink asked us to wait.
        after: Option<Duration>,
        cause: &'static str,
        error: String,
    },
    /// Every message of the request failed in a way that may be the sink's.
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
            Outcome::Dead { reason, .. } if reason.reached_sink() => return Health::Up,
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
    },
    /// The pause ended and one delivery is probing the sink.
    Probing {
        since: Instant,
        pause: Duration,
        error: String,
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
}

impl Breaker {
    pub(crate) fn new(route: &str, request_timeout: Duration, longest_pause: Duration) -> Breaker {
        gauge!(m::ROUTE_PAUSED, "route" => route.to_owned()).set(0.0);
        Breaker {
            route: route.to_owned(),
            probe_timeout: request_timeout * 2,
            longest_pause,
            state: Mutex::new(State::closed()),
        }
    }

    pub(crate) fn admit(&self, now: Instant) -> Admit {
        let mut state = self.state.lock().expect("breaker lock");
        match &*state {
            State::Closed { .. } => Admit::Send,
            State::Open {
                until,
                pause,
                error,
            } if now >= *until => {
                *state = State::Probing {
                    since: now,
                    pause: *pause,
                    error: error.clone(),
                };
                Admit::Send
            }
            State::Open { until, error, .. } => Admit::Paused {
                until: *until,
                error: error.clone(),
            },
            State::Probing {
                since,
                pause,
                error,
            } if now >= *since + self.probe_timeout => {
                let (pause, error) = (*pause, error.clone());
                *state = State::Probing {
                    since: now,
                    pause,
                    error,
                };
                Admit::Send
            }
            State::Probing { pause, error, .. } => Admit::Paused {
                until: now + (*pause / 4).max(Duration::from_millis(100)),
                error: error.clone(),
            },
        }
    }

    /// Takes what a delivery of the events `ids` found out; returns when the
    /// route is paused until (with the reason) if it is paused now.
    pub(crate) fn record(
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
                ("failing", error, None)
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
        };
        Some((until, error))
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
mod tests {
    use super::*;
    use crate::sink::DeadReason;

    fn retry(reason: RetryReason) -> Outcome {
        Outcome::Retry {
            after: None,
            reason,
            error: "e".into(),
        }
    }

    #[test]
    fn outcomes_tell_the_sink_from_the_event() {
        assert_eq!(
            health(&[retry(RetryReason::ServerError), Outcome::Published]),
            Health::Up
        );
        assert_eq!(health(&[retry(RetryReason::BatchElement)]), Health::Up);
        assert!(matches!(
            health(&[
                retry(RetryReason::ServerError),
                retry(RetryReason::Unauthorized)
            ]),
            Health::Down {
                cause: "unauthorized",
                ..
            }
        ));
        assert!(matches!(
            health(&[retry(RetryReason::Timeout)]),
            Health::Failing { .. }
        ));
        let no_route = Outcome::Dead {
            reason: DeadReason::NoRoute,
            error: "x".into(),
        };
        assert_eq!(health(&[no_route]), Health::Unknown);
    }

    #[test]
    fn pauses_probes_and_backs_off() {
        let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
        let t0 = Instant::now();
        let ids: Vec<i64> = (0..FAILING_EVENTS as i64).collect();
        let fail = || Health::Failing {
            error: "500".into(),
        };
        // The same few events failing again and again: poison, not an outage.
        for _ in 0..FAILING_REQUESTS * 3 {
            assert_eq!(b.record(fail(), &ids[..3], t0), None);
        }
        assert_eq!(b.record(Health::Up, &ids, t0), None);
        for _ in 1..FAILING_REQUESTS {
            assert_eq!(b.record(fail(), &ids, t0), None);
        }
        let (until, _) = b.record(fail(), &ids, t0).expect("paused at the threshold");
        assert_eq!(until, t0 + PAUSE_MIN);
        assert!(matches!(b.admit(t0), Admit::Paused { .. }));
        // The pause ends: one probe goes, the others wait for it.
        assert_eq!(b.admit(until), Admit::Send);
        assert!(matches!(b.admit(until), Admit::Paused { .. }));
        // The probe fails: paused twice as long.
        let (again, _) = b.record(fail(), &ids[..1], until).unwrap();
        assert_eq!(again, until + PAUSE_MIN * 2);
        // A probe that never reports is given up after the probe timeout.
        assert_eq!(b.admit(again), Admit::Send);
        assert!(matches!(b.admit(again), Admit::Paused { .. }));
        assert_eq!(b.admit(again + Duration::from_secs(2)), Admit::Send);
        assert_eq!(b.record(Health::Up, &ids, again), None);
        assert_eq!(b.admit(again), Admit::Send);
    }

    #[test]
    fn a_pause_never_outgrows_half_the_lease() {
        assert_eq!(
            longest_pause(Duration::from_secs(10)),
            Duration::from_secs(5)
        );
        assert_eq!(longest_pause(Duration::from_secs(600)), PAUSE_MAX);
        let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(5));
        let mut now = Instant::now();
        let down = || Health::Down {
            after: None,
            cause: "connect",
            error: "refused".into(),
        };
        let mut pauses = Vec::new();
        for _ in 0..6 {
            let (until, _) = b.record(down(), &[1], now).unwrap();
            pauses.push(until - now);
            now = until;
            assert_eq!(b.admit(now), Admit::Send, "the probe");
        }
        assert_eq!(pauses.iter().max(), Some(&Duration::from_secs(5)));
        // A 429 that says when it lifts is believed, even sooner than the backoff.
        let (until, _) = b
            .record(
                Health::Down {
                    after: Some(Duration::from_millis(300)),
                    cause: "rate_limited",
                    error: "429".into(),
                },
                &[1],
                now,
            )
            .unwrap();
        assert_eq!(until, now + Duration::from_millis(300));
    }

    #[test]
    fn a_sink_that_asks_for_longer_is_given_it() {
        let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
        let t0 = Instant::now();
        let (until, error) = b
            .record(
                Health::Down {
                    after: Some(Duration::from_secs(30)),
                    cause: "rate_limited",
                    error: "HTTP 429".into(),
                },
                &[1],
                t0,
            )
            .unwrap();
        assert_eq!(until, t0 + Duration::from_secs(30));
        assert!(error.contains("rate_limited") && error.contains("429"));
        let all = Breakers {
            routes: vec![
                b,
                Breaker::new("s", Duration::from_secs(1), Duration::from_secs(30)),
            ],
        };
        assert_eq!(all.all_paused_until(t0), None, "one route still open");
    }
}
