//! When to try again: exponential backoff with full jitter, and the
//! destination's own `Retry-After` when it gives one.

use std::time::{Duration, SystemTime};

use rand::Rng;

/// Longest delay a `Retry-After` may ask for (QStash caps it at one day too).
pub(crate) const MAX_RETRY_AFTER: Duration = Duration::from_secs(86_400);

/// Exponential backoff with full jitter: a uniform delay in
/// `[0, min(cap, base · 2^(attempt-1))]`. Jitter spreads a burst of failures
/// so they do not come back as a burst.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
}

impl Backoff {
    /// The ceiling for `attempt` (1 = the first attempt failed).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(32);
        self.base
            .checked_mul(1u32 << exp.min(31))
            .unwrap_or(self.cap)
            .min(self.cap)
    }

    pub fn delay(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        let ceiling = self.ceiling(attempt);
        if ceiling.is_zero() {
            return ceiling;
        }
        Duration::from_micros(rng.random_range(0..=ceiling.as_micros() as u64))
    }

    /// The delay before the next attempt: the jittered backoff, but never
    /// sooner than the destination asked for.
    pub fn next(
        &self,
        attempt: u32,
        retry_after: Option<Duration>,
        rng: &mut impl Rng,
    ) -> Duration {
        let jittered = self.delay(attempt, rng);
        match retry_after {
            Some(asked) => asked.min(MAX_RETRY_AFTER).max(jittered.min(asked)),
            None => jittered,
        }
    }
}

/// `Retry-After: <seconds>` or `Retry-After: <HTTP-date>`.
pub(crate) fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs).min(MAX_RETRY_AFTER));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(now)
            .unwrap_or(Duration::ZERO)
            .min(MAX_RETRY_AFTER),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn ceiling_doubles_and_caps() {
        let b = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
        };
        assert_eq!(b.ceiling(1), Duration::from_millis(100));
        assert_eq!(b.ceiling(2), Duration::from_millis(200));
        assert_eq!(b.ceiling(4), Duration::from_millis(800));
        assert_eq!(b.ceiling(5), Duration::from_secs(1));
        assert_eq!(b.ceiling(500), Duration::from_secs(1));
    }

    #[test]
    fn jitter_stays_within_the_ceiling_and_spreads() {
        let b = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(10),
        };
        let mut rng = StdRng::seed_from_u64(7);
        let delays: Vec<Duration> = (0..1000).map(|_| b.delay(3, &mut rng)).collect();
        assert!(delays.iter().all(|d| *d <= Duration::from_millis(400)));
        let distinct: std::collections::HashSet<_> = delays.iter().collect();
        assert!(distinct.len() > 900, "full jitter should rarely repeat");
        assert!(delays.iter().any(|d| *d < Duration::from_millis(100)));
        assert!(delays.iter().any(|d| *d > Duration::from_millis(300)));
    }

    #[test]
    fn retry_after_is_never_undercut() {
        let b = Backoff {
            base: Duration::from_millis(1),
            cap: Duration::from_millis(10),
        };
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..100 {
            assert_eq!(
                b.next(1, Some(Duration::from_secs(3)), &mut rng),
                Duration::from_secs(3)
            );
        }
    }

    #[test]
    fn parses_both_retry_after_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(120));
        assert_eq!(
            parse_retry_after(&later, now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("999999999", now), Some(MAX_RETRY_AFTER));
    }
}
