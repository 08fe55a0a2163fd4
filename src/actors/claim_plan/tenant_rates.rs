//! Tenants' paces (`relay.tenant_rate`, `[[relay.tenants]] rate`): the most
//! rows of one tenant the plain claims of this relay take per second, so a
//! tenant's backlog drains no faster than the database can take beside the
//! other tenants' events. Shares ([`super::tenants`]) split each claim
//! between the tenants pending; a pace also spaces one tenant's claims out
//! over time, which shares cannot: a backlog drained as fast as the database
//! goes leaves every other tenant's statements queueing behind its own.
//!
//! A token bucket per paced tenant, shared by every claimer of this relay: it
//! holds up to one second of the tenant's rate and starts full; each row the
//! plain claims take spends one. A claim the pace was not asked before (the
//! plain claim after a short one, which lists no tenants) may overspend;
//! the tenant then waits the debt out. The pace is this relay's: with
//! several replicas, a tenant may be claimed at each one's pace.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use uuid::Uuid;

/// The buckets kept at most before the full ones are forgotten (a full
/// bucket is the same as none).
const KEPT: usize = 10_000;

/// Each paced tenant's rate and bucket.
#[derive(Debug, Default)]
pub(crate) struct TenantRates {
    /// Rows per second of the tenants with a rate of their own.
    rates: HashMap<Uuid, u32>,
    /// Every other tenant's rate; `None`: they are not paced.
    default: Option<u32>,
    buckets: Mutex<HashMap<Uuid, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    /// Rows the tenant may take at `at` (negative: a debt to wait out).
    tokens: f64,
    at: Instant,
}

impl TenantRates {
    pub(crate) fn new(rates: impl IntoIterator<Item = (Uuid, u32)>, default: Option<u32>) -> Self {
        TenantRates {
            rates: rates.into_iter().collect(),
            default,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Whether any tenant is paced.
    pub(crate) fn any(&self) -> bool {
        self.default.is_some() || !self.rates.is_empty()
    }

    fn rate_of(&self, tenant: &Uuid) -> Option<u32> {
        self.rates.get(tenant).copied().or(self.default)
    }

    /// The most rows `tenant`'s bucket holds (one second of its rate);
    /// `None`: it is not paced.
    pub(crate) fn burst_of(&self, tenant: &Uuid) -> Option<usize> {
        self.rate_of(tenant).map(|r| r.max(1) as usize)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, Bucket>> {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many rows of `tenant` the claims may take at `now`; `None`: as
    /// many as they like.
    pub(crate) fn budget(&self, tenant: &Uuid, now: Instant) -> Option<i64> {
        let rate = self.rate_of(tenant)?;
        let tokens = self
            .lock()
            .get(tenant)
            .map_or(f64::from(rate), |b| refilled(*b, rate, now).tokens);
        Some(tokens.floor().max(0.0) as i64)
    }

    /// The claims took `rows` rows of `tenant` at `now`.
    pub(crate) fn took(&self, tenant: &Uuid, rows: usize, now: Instant) {
        let Some(rate) = self.rate_of(tenant) else {
            return;
        };
        if rows == 0 {
            return;
        }
        let mut buckets = self.lock();
        if buckets.len() >= KEPT && !buckets.contains_key(tenant) {
            buckets.retain(|t, b| {
                self.rate_of(t)
                    .is_some_and(|r| refilled(*b, r, now).tokens < f64::from(r))
            });
        }
        let bucket = buckets.entry(*tenant).or_insert(Bucket {
            tokens: f64::from(rate),
            at: now,
        });
        let mut b = refilled(*bucket, rate, now);
        b.tokens -= rows as f64;
        *bucket = b;
    }
}

/// `b` at `now`: refilled at `rate` rows per second, up to one second's worth.
fn refilled(b: Bucket, rate: u32, now: Instant) -> Bucket {
    let rate = f64::from(rate.max(1));
    let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
    Bucket {
        tokens: (b.tokens + elapsed * rate).min(rate),
        at: now.max(b.at),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_paced_tenant_gets_a_seconds_worth_then_its_rate() {
        let a = Uuid::from_u128(1);
        let b = Uuid::from_u128(2);
        let rates = TenantRates::new([(a, 100)], None);
        let t0 = Instant::now();
        assert!(rates.any());
        assert_eq!(rates.budget(&b, t0), None, "not paced");
        assert_eq!(rates.budget(&a, t0), Some(100), "starts full");
        rates.took(&a, 100, t0);
        assert_eq!(rates.budget(&a, t0), Some(0));
        assert_eq!(rates.budget(&a, t0 + Duration::from_millis(250)), Some(25));
        // Never more than a second's worth, however long it waited.
        assert_eq!(rates.budget(&a, t0 + Duration::from_secs(60)), Some(100));
        assert_eq!(rates.burst_of(&a), Some(100));
        assert_eq!(rates.burst_of(&b), None);
    }

    #[test]
    fn an_overspent_bucket_is_a_debt_waited_out() {
        let a = Uuid::from_u128(1);
        let rates = TenantRates::new([], Some(10));
        let t0 = Instant::now();
        rates.took(&a, 30, t0); // 10 held, 30 taken: 20 owed
        assert_eq!(rates.budget(&a, t0 + Duration::from_secs(1)), Some(0));
        assert_eq!(rates.budget(&a, t0 + Duration::from_millis(2500)), Some(5));
    }

    #[test]
    fn full_buckets_are_forgotten_and_debts_kept() {
        let rates = TenantRates::new([], Some(1000));
        let t0 = Instant::now();
        let owing = Uuid::from_u128(u128::MAX);
        rates.took(&owing, 5000, t0);
        for i in 0..KEPT as u128 {
            rates.took(&Uuid::from_u128(i), 1, t0);
        }
        // A second later every small spend is refilled; the debt is not.
        let t1 = t0 + Duration::from_secs(1);
        rates.took(&Uuid::from_u128(KEPT as u128 + 1), 1, t1);
        assert!(rates.lock().len() < 10, "{} kept", rates.lock().len());
        assert_eq!(rates.budget(&owing, t1), Some(0));
    }
}
