//! How a route retries a failed attempt: `[relay]`'s `max_attempts` and
//! exponential backoff (`backoff_base` doubling up to `backoff_cap`), unless
//! the route overrides them (`routes[].max_attempts`, `backoff_base`,
//! `backoff_cap`) or lists its delays (`routes[].retry_schedule`: one delay
//! per retry, so one attempt more than it has steps).
//!
//! Either way a destination's `Retry-After` is never undercut, and a
//! receiver can stop the retries of one message by refusing it for itself
//! (a 4xx other than 401, 403, 408 and 429: `410 Gone` says so plainly):
//! the row is dead-lettered at once, without spending the attempts left,
//! once the route has accepted another message since (the witness rule of
//! `sink::breaker::witness`, which keeps a whole-route blip of 410s from
//! dead-lettering anything).

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::config::{RouteConfig, RouteError};
use crate::backoff::Backoff;

/// A route's list of delays, one per retry: `["5s", "1m", "10m", "1h"]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetrySchedule(Vec<Duration>);

impl RetrySchedule {
    pub fn new(steps: Vec<Duration>) -> Result<RetrySchedule, String> {
        if steps.is_empty() {
            return Err(
                "must list at least one delay (for no retries at all, set max_attempts = 1)"
                    .to_owned(),
            );
        }
        if let Some(step) = steps
            .iter()
            .find(|step| **step > crate::backoff::MAX_RETRY_AFTER)
        {
            return Err(format!(
                "a delay of {} is longer than a day, the longest the relay waits",
                humantime::format_duration(*step)
            ));
        }
        Ok(RetrySchedule(steps))
    }

    pub fn steps(&self) -> &[Duration] {
        &self.0
    }
}

impl Serialize for RetrySchedule {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(
            self.0
                .iter()
                .map(|d| humantime::format_duration(*d).to_string()),
        )
    }
}

impl<'de> Deserialize<'de> for RetrySchedule {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<RetrySchedule, D::Error> {
        let texts = Vec::<String>::deserialize(d)?;
        let steps = texts
            .iter()
            .map(|t| {
                humantime::parse_duration(t.trim())
                    .map_err(|e| format!("`{t}` is not a duration like \"5s\" or \"10m\": {e}"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(serde::de::Error::custom)?;
        RetrySchedule::new(steps).map_err(serde::de::Error::custom)
    }
}

/// When the next attempt of a failed row is due.
#[derive(Debug, Clone, PartialEq)]
pub enum Delays {
    /// Full-jitter exponential backoff.
    Backoff { base: Duration, cap: Duration },
    /// The route's schedule, each step as given (and up to a tenth more, so
    /// that rows failing together do not come back together).
    Schedule(RetrySchedule),
}

/// How one route retries.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    pub delays: Delays,
    /// The attempt that reaches this count and fails dead-letters the row.
    pub max_attempts: u32,
}

impl RetryPolicy {
    /// `[relay]`'s policy.
    pub fn backoff(max_attempts: u32, base: Duration, cap: Duration) -> RetryPolicy {
        RetryPolicy {
            delays: Delays::Backoff { base, cap },
            max_attempts,
        }
    }

    /// This route's policy over `relay` (`[relay]`'s); the error names the
    /// route's key to change.
    pub fn for_route(route: &RouteConfig, relay: &RetryPolicy) -> Result<RetryPolicy, RouteError> {
        if route.max_attempts == Some(0) {
            return Err(RouteError {
                key: "max_attempts",
                reason: "must be at least 1",
            });
        }
        if let Some(schedule) = &route.retry_schedule {
            if route.max_attempts.is_some() {
                return Err(RouteError {
                    key: "max_attempts",
                    reason: "is set by retry_schedule (one attempt more than it has delays): set one of the two",
                });
            }
            if route.backoff_base.is_some() || route.backoff_cap.is_some() {
                return Err(RouteError {
                    key: if route.backoff_base.is_some() {
                        "backoff_base"
                    } else {
                        "backoff_cap"
                    },
                    reason: "does not apply with retry_schedule, which gives every delay: set one of the two",
                });
            }
            return Ok(RetryPolicy {
                max_attempts: u32::try_from(schedule.steps().len() + 1).unwrap_or(u32::MAX),
                delays: Delays::Schedule(schedule.clone()),
            });
        }
        let (relay_base, relay_cap) = match &relay.delays {
            Delays::Backoff { base, cap } => (*base, *cap),
            Delays::Schedule(_) => unreachable!("[relay] has no schedule"),
        };
        let base = route.backoff_base.unwrap_or(relay_base);
        let cap = route.backoff_cap.unwrap_or(relay_cap);
        if cap < base {
            return Err(RouteError {
                key: if route.backoff_cap.is_some() {
                    "backoff_cap"
                } else {
                    "backoff_base"
                },
                reason: "makes backoff_cap shorter than backoff_base (a value the route does not set is relay's)",
            });
        }
        Ok(RetryPolicy {
            delays: Delays::Backoff { base, cap },
            max_attempts: route.max_attempts.unwrap_or(relay.max_attempts),
        })
    }

    /// Each route's policy, in route order; the error says which route.
    pub fn for_routes(
        routes: &[RouteConfig],
        relay: &RetryPolicy,
    ) -> Result<Vec<RetryPolicy>, (usize, RouteError)> {
        routes
            .iter()
            .enumerate()
            .map(|(i, route)| RetryPolicy::for_route(route, relay).map_err(|e| (i, e)))
            .collect()
    }

    /// The delay after failed attempt `attempt` (1 = the first), never
    /// sooner than the destination asked (`retry_after`).
    pub fn next(
        &self,
        attempt: u32,
        retry_after: Option<Duration>,
        rng: &mut impl rand::Rng,
    ) -> Duration {
        match &self.delays {
            Delays::Backoff { base, cap } => Backoff {
                base: *base,
                cap: *cap,
            }
            .next(attempt, retry_after, rng),
            Delays::Schedule(schedule) => {
                let steps = schedule.steps();
                let step = steps[(attempt.max(1) as usize - 1).min(steps.len() - 1)];
                let extra = rng.random_range(0..=(step.as_millis() as u64 / 10));
                let delay = step + Duration::from_millis(extra);
                match retry_after {
                    Some(asked) => delay.max(asked.min(crate::backoff::MAX_RETRY_AFTER)),
                    None => delay,
                }
            }
        }
    }

    /// The longest delay this policy waits (a retry due later than this is
    /// left for the next `drain`).
    pub fn longest(&self) -> Duration {
        match &self.delays {
            Delays::Backoff { cap, .. } => *cap,
            Delays::Schedule(schedule) => {
                schedule.steps().iter().copied().max().unwrap_or_default()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;
    use serde_json::json;

    fn relay() -> RetryPolicy {
        RetryPolicy::backoff(10, Duration::from_secs(1), Duration::from_secs(300))
    }

    fn policy(extra: serde_json::Value) -> Result<RetryPolicy, String> {
        let mut json = json!({"event_type": "*", "destination": "https://a.example.com/"});
        for (k, v) in extra.as_object().unwrap() {
            json[k] = v.clone();
        }
        let route: RouteConfig = serde_json::from_value(json).map_err(|e| e.to_string())?;
        RetryPolicy::for_route(&route, &relay()).map_err(|e| format!("{}: {}", e.key, e.reason))
    }

    #[test]
    fn a_route_without_retry_keys_retries_as_relay_says() {
        assert_eq!(policy(json!({})).unwrap(), relay());
        let p = policy(json!({"max_attempts": 3, "backoff_cap": "20s"})).unwrap();
        assert_eq!(p.max_attempts, 3);
        assert_eq!(
            p.delays,
            Delays::Backoff {
                base: Duration::from_secs(1),
                cap: Duration::from_secs(20)
            }
        );
    }

    #[test]
    fn a_schedule_gives_each_delay_and_the_attempts() {
        let p = policy(json!({"retry_schedule": ["5s", "1m", "10m", "1h"]})).unwrap();
        assert_eq!(p.max_attempts, 5);
        assert_eq!(p.longest(), Duration::from_secs(3600));
        let mut rng = StdRng::seed_from_u64(3);
        for (attempt, step) in [(1, 5), (2, 60), (3, 600), (4, 3600), (9, 3600)] {
            let d = p.next(attempt, None, &mut rng);
            let step = Duration::from_secs(step);
            assert!(d >= step && d <= step + step / 10, "{attempt}: {d:?}");
        }
        // A Retry-After longer than the step wins.
        assert_eq!(
            p.next(1, Some(Duration::from_secs(90)), &mut rng),
            Duration::from_secs(90)
        );
    }

    #[test]
    fn bad_retry_keys_are_refused_naming_the_key() {
        let cases = [
            (
                json!({"max_attempts": 0}),
                "max_attempts: must be at least 1",
            ),
            (
                json!({"retry_schedule": ["5s"], "max_attempts": 3}),
                "max_attempts: is set by retry_schedule",
            ),
            (
                json!({"retry_schedule": ["5s"], "backoff_base": "1s"}),
                "backoff_base: does not apply with retry_schedule",
            ),
            (
                json!({"retry_schedule": ["5s"], "backoff_cap": "1s"}),
                "backoff_cap: does not apply with retry_schedule",
            ),
            (
                json!({"backoff_cap": "500ms"}),
                "backoff_cap: makes backoff_cap shorter",
            ),
            (
                json!({"backoff_base": "10m"}),
                "backoff_base: makes backoff_cap shorter",
            ),
            (
                json!({"retry_schedule": []}),
                "must list at least one delay",
            ),
            (
                json!({"retry_schedule": ["soon"]}),
                "`soon` is not a duration",
            ),
            (json!({"retry_schedule": ["2days"]}), "longer than a day"),
        ];
        for (extra, want) in cases {
            let e = policy(extra.clone()).unwrap_err();
            assert!(e.contains(want), "{extra}: {e}");
        }
    }
}
