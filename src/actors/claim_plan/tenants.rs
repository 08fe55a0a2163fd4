//! Tenant fairness of the plain claim (`relay.tenant_fairness`): when a
//! shard has rows pending for several tenants, each claim shares its rows
//! between them, in proportion to their weights (`[[relay.tenants]]`, 1
//! unless set), and what one tenant leaves goes to those that wanted more.
//! So a tenant's backlog of a million rows takes its share of each claim,
//! and another tenant's new event waits for the next claim, not behind the
//! backlog. With one tenant pending the claim is the plain one, unchanged;
//! after a claim that came back short (it took every due row, so it was fair)
//! the next one is the plain claim too, without listing the tenants.
//!
//! Round-robin: the tenants are walked in id order from after the last one
//! the previous claim started with, so the rows a limit cannot split evenly
//! go to each tenant in turn, and when more tenants are pending than a claim
//! has rows, the next claim goes on with the next ones. Each tenant has its
//! own cursor (like the plain claim's): in a burst, its next share starts
//! after the rows it already has out. The ordered routes' key heads are not
//! shared by tenant: their key walk takes one head per key in turn already.
//!
//! A paced tenant ([`TenantRates`]) takes no more than its bucket holds: its
//! room is the lesser of its room in flight and its budget, and a claim cut
//! short by either waits in memory for it ([`TenantPlan::waits_for_room`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use uuid::Uuid;

use super::tenant_rates::TenantRates;
use super::{next_cursor, Claim};
use crate::actors::inflight::InFlight;
use crate::store::outbox::{no_cursor, Claimed, Cursor};
use crate::store::tenants::TenantShare;
use crate::store::StoreError;

/// Each tenant's weight; a tenant not named weighs 1.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TenantWeights(HashMap<Uuid, u32>);

impl TenantWeights {
    pub(crate) fn new(weights: impl IntoIterator<Item = (Uuid, u32)>) -> TenantWeights {
        TenantWeights(weights.into_iter().collect())
    }

    pub(crate) fn of(&self, tenant: &Uuid) -> u32 {
        self.0.get(tenant).copied().unwrap_or(1).max(1)
    }
}

/// How `limit` rows are shared between tenants of these `weights`, in the
/// order given: each gets its weight's part, rounded down, and the rows left
/// over go one each to the first tenants in that order. Every tenant gets at
/// least one row when `limit` allows one each.
pub(crate) fn shares(weights: &[u32], limit: i64) -> Vec<i64> {
    let limit = limit.max(0);
    let total: i64 = weights.iter().map(|&w| i64::from(w.max(1))).sum();
    if total == 0 {
        return Vec::new();
    }
    let mut shares: Vec<i64> = weights
        .iter()
        .map(|&w| limit * i64::from(w.max(1)) / total)
        .collect();
    let mut left = limit - shares.iter().sum::<i64>();
    // First to those that got nothing (a light tenant beside heavy ones),
    // then to each in order.
    for pass in [true, false] {
        for share in shares.iter_mut() {
            if left == 0 {
                return shares;
            }
            if !pass || *share == 0 {
                *share += 1;
                left -= 1;
            }
        }
    }
    shares
}

/// What a claim's tenant step decided.
pub(super) enum TenantClaim {
    /// The rows, shared between the tenants pending.
    Shared(Vec<Claimed>),
    /// Run the plain claim, for at most `room` rows.
    Plain { room: i64 },
}

/// Each share cut to its tenant's room.
fn within(shares: Vec<i64>, rooms: &[i64]) -> Vec<i64> {
    shares
        .into_iter()
        .zip(rooms)
        .map(|(share, &room)| share.min(room.max(0)))
        .collect()
}

/// The tenants' policy every claimer of this relay follows: their weights
/// in the shares, and their paces (the buckets are shared by the claimers).
#[derive(Debug, Clone)]
pub(crate) struct Fairness {
    pub(crate) weights: Arc<TenantWeights>,
    pub(crate) rates: Arc<TenantRates>,
}

impl Fairness {
    pub(crate) fn new(weights: TenantWeights, rates: TenantRates) -> Fairness {
        Fairness {
            weights: Arc::new(weights),
            rates: Arc::new(rates),
        }
    }
}

/// Where one claimer's tenant walk is, and each tenant's cursor.
pub(crate) struct TenantPlan {
    weights: Arc<TenantWeights>,
    rates: Arc<TenantRates>,
    /// The walk of the next claim starts after this tenant.
    after: Uuid,
    /// Per tenant: the last row of its last full share.
    cursors: HashMap<Uuid, Cursor>,
    /// The last claim came back full. A short claim took every due row, so
    /// it was fair whoever they belonged to: after one, the next claim is
    /// the plain one and the tenants are listed only once claims fill up
    /// again (an idle or lightly loaded relay runs no statement more).
    busy: bool,
    /// The tenants whose room cut the last claim short (they have more due
    /// rows than they may take): the claimer waits for one of them to have
    /// room rather than claim again for nothing.
    held_back: Vec<Uuid>,
}

impl TenantPlan {
    pub(crate) fn new(fairness: Fairness) -> TenantPlan {
        TenantPlan {
            weights: fairness.weights,
            rates: fairness.rates,
            after: Uuid::nil(),
            cursors: HashMap::new(),
            // A claimer may start on a backlog.
            busy: true,
            held_back: Vec::new(),
        }
    }

    /// The plain claim of `limit` rows took `taken`: paced tenants spend
    /// their rows.
    pub(super) fn plain_took(&mut self, taken: &[Claimed], limit: i64) {
        self.spend(taken);
        self.busy = taken.len() as i64 >= limit;
        if !self.busy {
            // It took every due row within the room: nothing was held back.
            self.held_back.clear();
        }
    }

    /// Whether the last claim was cut short by rooms in flight or paces
    /// only, and none of those tenants has room for `rows` more yet (or, if
    /// paced, for a tenth of a second of its pace, when that is fewer: its
    /// claims come ten times a second rather than in bursts of a second's
    /// worth).
    pub(super) fn waits_for_room(&self, in_flight: &InFlight, rows: usize) -> bool {
        let now = Instant::now();
        !self.held_back.is_empty()
            && self.held_back.iter().all(|t| {
                let wanted =
                    self.rates
                        .burst_of(t)
                        .map_or(rows, |b| rows.min((b / 10).max(1))) as i64;
                room(&self.rates, in_flight, t, now) < wanted
            })
    }

    /// Paced tenants spend the rows a claim took of theirs.
    fn spend(&self, taken: &[Claimed]) {
        if !self.rates.any() || taken.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut per: HashMap<Uuid, usize> = HashMap::new();
        for c in taken {
            *per.entry(c.row.tenant_id).or_default() += 1;
        }
        for (tenant, rows) in per {
            self.rates.took(&tenant, rows, now);
        }
    }

    /// Up to `limit` rows of the unordered routes shared between the
    /// shard's tenants, none beyond its room in flight
    /// ([`InFlight::room_of`]); the plain claim instead when the last claim
    /// was short or at most one tenant has rows pending (it then takes them
    /// as it always did, within that tenant's room).
    pub(super) async fn claim(
        &mut self,
        claim: &mut Claim<'_>,
        limit: i64,
    ) -> Result<TenantClaim, StoreError> {
        let plain = TenantClaim::Plain { room: limit };
        self.held_back.clear();
        if !self.busy {
            return Ok(plain);
        }
        let tenants = claim
            .session
            .tenants_pending(claim.scope.fence, self.after, limit)
            .await?;
        let now = Instant::now();
        let rates = &self.rates;
        let room = |t: &Uuid| room(rates, claim.in_flight, t, now);
        if tenants.len() <= 1 {
            self.cursors.clear();
            let Some(alone) = tenants.first() else {
                return Ok(plain);
            };
            let room = room(alone);
            // Held back by its room, a tenant's backlog stays a backlog:
            // the next claim lists the tenants again.
            self.busy = room < limit;
            if room < limit {
                self.held_back.push(*alone);
            }
            return Ok(TenantClaim::Plain {
                room: room.min(limit),
            });
        }
        // Only the tenants of this walk keep a cursor.
        self.cursors.retain(|t, _| tenants.contains(t));
        let weights: Vec<u32> = tenants.iter().map(|t| self.weights.of(t)).collect();
        let rooms: Vec<i64> = tenants.iter().map(room).collect();
        let first = within(shares(&weights, limit), &rooms);
        self.after = next_walk_start(&tenants, &first, limit);
        let mut rows = self.take(claim, &tenants, &first).await?;
        // What some left, for those that took their whole share and have
        // room for more.
        let left = limit - rows.len() as i64;
        let wanting: Vec<(Uuid, u32, i64)> = tenants
            .iter()
            .zip(&first)
            .zip(&rooms)
            .filter(|((t, &share), _)| share > 0 && taken_by(&rows, t) as i64 >= share)
            .map(|((t, &share), &room)| (*t, self.weights.of(t), room - share))
            .filter(|(_, _, room)| *room > 0)
            .collect();
        let capped = rooms.iter().any(|&r| r < limit);
        if left > 0 && !wanting.is_empty() {
            let more: Vec<Uuid> = wanting.iter().map(|w| w.0).collect();
            let weights: Vec<u32> = wanting.iter().map(|w| w.1).collect();
            let rooms: Vec<i64> = wanting.iter().map(|w| w.2).collect();
            let second = within(shares(&weights, left), &rooms);
            rows.extend(self.take(claim, &more, &second).await?);
        }
        self.spend(&rows);
        self.busy = capped || rows.len() as i64 >= limit;
        if (rows.len() as i64) < limit {
            self.held_back = tenants
                .iter()
                .zip(&rooms)
                .filter(|(_, &room)| room < limit)
                .map(|(t, _)| *t)
                .collect();
        }
        Ok(TenantClaim::Shared(rows))
    }

    /// Each tenant's share of the shard's due rows, from its cursor on.
    async fn take(
        &mut self,
        claim: &mut Claim<'_>,
        tenants: &[Uuid],
        shares: &[i64],
    ) -> Result<Vec<Claimed>, StoreError> {
        let asks: Vec<TenantShare> = tenants
            .iter()
            .zip(shares)
            .filter(|(_, &share)| share > 0)
            .map(|(t, &share)| TenantShare {
                tenant: *t,
                share,
                after: self.cursors.get(t).copied().unwrap_or_else(no_cursor),
            })
            .collect();
        let read = claim.session.claim_tenants(claim.scope, &asks).await?;
        let mut by_tenant: HashMap<Uuid, Vec<Claimed>> = HashMap::new();
        for row in read {
            by_tenant.entry(row.row.tenant_id).or_default().push(row);
        }
        let mut rows = Vec::new();
        for ask in asks {
            let read = by_tenant.remove(&ask.tenant).unwrap_or_default();
            let (read_len, last_read) = (read.len() as i64, read.last().map(Claimed::cursor));
            let taken = claim.fresh(read, ask.share);
            let cursor = next_cursor(ask.share, read_len, last_read, &taken);
            if cursor == no_cursor() {
                self.cursors.remove(&ask.tenant);
            } else {
                self.cursors.insert(ask.tenant, cursor);
            }
            rows.extend(taken);
        }
        Ok(rows)
    }
}

/// How many more rows of `tenant` a claim may take at `now`: its room in
/// flight, within its pace's budget.
fn room(rates: &TenantRates, in_flight: &InFlight, tenant: &Uuid, now: Instant) -> i64 {
    let room = in_flight.room_of(tenant) as i64;
    rates
        .budget(tenant, now)
        .map_or(room, |budget| room.min(budget))
}

fn taken_by(rows: &[Claimed], tenant: &Uuid) -> usize {
    rows.iter().filter(|c| c.row.tenant_id == *tenant).count()
}

/// Where the next claim's tenant walk starts after: past the last tenant
/// given rows when the walk was cut at `limit` tenants (the next ones come
/// next), else past the first one, so the rows a limit cannot split evenly
/// go to each tenant in turn.
fn next_walk_start(tenants: &[Uuid], shares: &[i64], limit: i64) -> Uuid {
    let cut = tenants.len() as i64 >= limit;
    let pick = if cut {
        tenants.iter().zip(shares).rev().find(|(_, &s)| s > 0)
    } else {
        tenants.iter().zip(shares).next()
    };
    pick.map(|(t, _)| *t).unwrap_or_else(Uuid::nil)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actors::claim_plan::{ClaimPlan, ClaimRoutes};
    use crate::actors::inflight::InFlight;
    use crate::routes::Router;
    use crate::testing::{self, RelayTestDb as _, TestDb};

    /// `n` pending rows of `tenant`, each on a key of its own.
    async fn rows_of(client: &tokio_postgres::Client, tenant: u128, n: i32) {
        client
            .execute(
                "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key)
                 SELECT $1::text::uuid, 'order', $1::text || '-' || g, 'order.placed', '{}', $1::text || '-' || g
                 FROM generate_series(1, $2::int4) g",
                &[&Uuid::from_u128(tenant).to_string(), &n],
            )
            .await
            .unwrap();
    }

    /// A claimer's plan with one unordered route taking every type.
    fn plan_of(weights: Option<TenantWeights>) -> ClaimPlan {
        plan_with(weights.map(|w| Fairness::new(w, TenantRates::default())))
    }

    /// The same with tenants' weights and paces.
    fn plan_with(fairness: Option<Fairness>) -> ClaimPlan {
        let routes = Arc::new(ClaimRoutes::new(&Router::new(&testing::routes(
            "[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example/all\"\n",
        ))));
        ClaimPlan::new(routes, fairness, std::time::Duration::from_secs(1))
    }

    /// Rows per tenant, by the low bits of its id.
    fn per_tenant(rows: &[Claimed]) -> HashMap<u128, usize> {
        let mut per = HashMap::new();
        for r in rows {
            *per.entry(r.row.tenant_id.as_u128()).or_default() += 1;
        }
        per
    }

    /// Rows per tenant (by the low bits of its id) that one claim of
    /// `limit` takes, with `weights`.
    async fn one_claim(
        db: &TestDb,
        weights: Option<TenantWeights>,
        limit: i64,
    ) -> (Vec<i64>, HashMap<u128, usize>) {
        let (store, fence) = db.one_shard().await;
        let mut plan = plan_of(weights);
        let mut session = store.session();
        let in_flight = InFlight::new(1000);
        let rows = plan
            .claim(&mut session, &in_flight, fence, limit)
            .await
            .unwrap();
        (rows.iter().map(|c| c.row.id).collect(), per_tenant(&rows))
    }

    /// Two tenants, one with a backlog: the other's three rows come in the
    /// first claim, and the room they leave goes back to the backlog.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_shares_between_tenants_and_the_room_left_goes_to_the_others() {
        let db = TestDb::new().await.unwrap();
        let client = db.client().await.unwrap();
        rows_of(&client, 1, 1_000).await;
        rows_of(&client, 2, 3).await;
        let (_, per) = one_claim(&db, Some(TenantWeights::default()), 10).await;
        assert_eq!(per, HashMap::from([(1, 7), (2, 3)]));
        // Without fairness the claim is the backlog's, in its order.
        let (_, per) = one_claim(&db, None, 10).await;
        assert_eq!(per.get(&2), None, "{per:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn weights_set_the_shares_of_a_claim() {
        let db = TestDb::new().await.unwrap();
        let client = db.client().await.unwrap();
        for tenant in [1, 2, 3] {
            rows_of(&client, tenant, 100).await;
        }
        let weights = TenantWeights::new([(Uuid::from_u128(1), 3)]);
        let (_, per) = one_claim(&db, Some(weights), 10).await;
        assert_eq!(per, HashMap::from([(1, 6), (2, 2), (3, 2)]));
    }

    /// A paced tenant's backlog takes no more of the claims than its bucket
    /// holds, the other tenant's rows come all the same, and the claimer is
    /// told to wait for the pace instead of claiming again for nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paced_tenant_takes_no_more_than_its_bucket_and_the_others_come_all_the_same() {
        let db = TestDb::new().await.unwrap();
        let client = db.client().await.unwrap();
        rows_of(&client, 1, 1_000).await;
        rows_of(&client, 2, 3).await;
        let (store, fence) = db.one_shard().await;
        let rates = TenantRates::new([(Uuid::from_u128(1), 100)], None);
        let mut plan = plan_with(Some(Fairness::new(TenantWeights::default(), rates)));
        let mut session = store.session();
        let in_flight = InFlight::new(1000);
        let first = plan
            .claim(&mut session, &in_flight, fence, 500)
            .await
            .unwrap();
        assert_eq!(per_tenant(&first), HashMap::from([(1, 100), (2, 3)]));
        assert!(
            plan.waits_for_room(&in_flight, 500),
            "the pace cut the claim short: wait for it"
        );
        // At once again: the bucket is (all but) empty.
        let again = plan
            .claim(&mut session, &in_flight, fence, 500)
            .await
            .unwrap();
        let a_again = per_tenant(&again).get(&1).copied().unwrap_or(0);
        assert!(
            a_again <= 5,
            "{a_again} more of the paced tenant's rows at once"
        );
        // A tenant without a pace is not held back by another's.
        assert_eq!(
            plan.claim(&mut session, &in_flight, fence, 500)
                .await
                .unwrap()
                .iter()
                .filter(|c| c.row.tenant_id.as_u128() == 2)
                .count(),
            3,
            "the unpaced tenant's rows (not out: read again) come with every claim"
        );
    }

    /// One claim of up to 10 rows (as many as permits are free), leased: the rows' tenants and leases.
    async fn claim_leased(
        plan: &mut ClaimPlan,
        session: &mut crate::store::Session,
        in_flight: &Arc<InFlight>,
        fence: crate::store::Fence,
    ) -> (Vec<u128>, Vec<crate::actors::inflight::Lease>) {
        let later = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut permits = in_flight.permits(10).await.unwrap();
        let limit = permits.count() as i64;
        let rows = plan.claim(session, in_flight, fence, limit).await.unwrap();
        let leased = rows
            .iter()
            .map(|c| permits.lease(c.held(fence), c.row.tenant_id, later, in_flight))
            .collect();
        let tenants = rows.iter().map(|c| c.row.tenant_id.as_u128()).collect();
        (tenants, leased)
    }

    /// A tenant whose rows fill its room (four fifths of the in-flight
    /// room) gets no more; the other tenants' shares are claimed, and so is
    /// a lone tenant's within what is left of its room.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tenant_that_filled_its_room_gets_no_more_and_the_others_theirs() {
        let db = TestDb::new().await.unwrap();
        let client = db.client().await.unwrap();
        rows_of(&client, 1, 100).await;
        let (store, fence) = db.one_shard().await;
        let mut plan = plan_of(Some(TenantWeights::default()));
        let mut session = store.session();
        // Room for 20 rows in flight: 16 of one tenant.
        let in_flight = InFlight::per_tenant(20);
        let mut leases = Vec::new();
        // Alone, the tenant gets full claims, then what is left of its room.
        for want in [10, 6, 0] {
            let (tenants, leased) = claim_leased(&mut plan, &mut session, &in_flight, fence).await;
            assert_eq!(tenants.len(), want, "{tenants:?}");
            leases.extend(leased);
        }
        rows_of(&client, 2, 5).await;
        let (tenants, leased) = claim_leased(&mut plan, &mut session, &in_flight, fence).await;
        assert_eq!(
            tenants, [2; 4],
            "only the other tenant has room (4 permits are free)"
        );
        leases.extend(leased);
        // Three of the first tenant's rows are marked: three permits free,
        // shared: two for the first tenant, one for the other's last row.
        leases.drain(..3);
        let (tenants, _) = claim_leased(&mut plan, &mut session, &in_flight, fence).await;
        let first = tenants.iter().filter(|&&t| t == 1).count();
        assert_eq!((first, tenants.len() - first), (2, 1), "{tenants:?}");
    }

    /// With one tenant pending, fairness changes nothing: the plain claim's
    /// rows, in its order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_tenant_gets_the_plain_claim() {
        let db = TestDb::new().await.unwrap();
        let client = db.client().await.unwrap();
        rows_of(&client, 1, 50).await;
        let fair = one_claim(&db, Some(TenantWeights::default()), 20).await;
        let plain = one_claim(&db, None, 20).await;
        assert_eq!(fair.0.len(), 20);
        assert_eq!(fair, plain);
    }

    /// A burst: each tenant's next share starts after what it has out, so
    /// successive claims (nothing marked meanwhile) never take a row twice
    /// and keep sharing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn successive_claims_go_on_after_each_tenants_rows_out() {
        let db = TestDb::new().await.unwrap();
        let client = db.client().await.unwrap();
        rows_of(&client, 1, 100).await;
        rows_of(&client, 2, 100).await;
        let (store, fence) = db.one_shard().await;
        let mut plan = plan_of(Some(TenantWeights::default()));
        let mut session = store.session();
        let in_flight = InFlight::new(1000);
        let later = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut seen = std::collections::HashSet::new();
        let mut leases = Vec::new();
        for _ in 0..5 {
            let rows = plan
                .claim(&mut session, &in_flight, fence, 10)
                .await
                .unwrap();
            assert_eq!(rows.len(), 10);
            assert_eq!(taken_by(&rows, &Uuid::from_u128(1)), 5);
            let mut permits = in_flight.permits(10).await.unwrap();
            for c in &rows {
                assert!(seen.insert(c.row.id), "row {} taken twice", c.row.id);
                leases.push(permits.lease(c.held(fence), c.row.tenant_id, later, &in_flight));
            }
        }
    }

    #[test]
    fn equal_tenants_share_a_claim_evenly_and_the_extra_rows_go_in_order() {
        assert_eq!(shares(&[1, 1], 10), [5, 5]);
        assert_eq!(shares(&[1, 1, 1], 10), [4, 3, 3]);
        assert_eq!(shares(&[1, 1, 1], 2), [1, 1, 0]);
        assert_eq!(shares(&[1, 1], 0), [0, 0]);
    }

    #[test]
    fn one_tenant_takes_everything() {
        assert_eq!(shares(&[1], 500), [500]);
        assert_eq!(shares(&[7], 3), [3]);
    }

    #[test]
    fn weights_share_in_proportion_and_a_light_tenant_still_gets_a_row() {
        assert_eq!(shares(&[3, 1], 100), [75, 25]);
        assert_eq!(shares(&[2, 1, 1], 8), [4, 2, 2]);
        // 1000:1 over 10 rows: the light tenant's part rounds to nothing, it
        // gets one of the rows left over before the heavy one does.
        assert_eq!(shares(&[1000, 1], 10), [9, 1]);
        // A weight of 0 is taken as 1 (validation refuses it anyway).
        assert_eq!(shares(&[0, 1], 4), [2, 2]);
        for (weights, limit) in [(&[5u32, 3, 1][..], 17i64), (&[1, 1, 1, 1], 3), (&[9, 1], 1)] {
            assert_eq!(shares(weights, limit).iter().sum::<i64>(), limit);
        }
    }

    #[test]
    fn the_walk_goes_round_the_tenants() {
        let t: Vec<Uuid> = (1..=4).map(Uuid::from_u128).collect();
        // All of them fit: the next walk starts after the first, so the
        // first one's extra row goes to the next tenant next time.
        assert_eq!(next_walk_start(&t, &[1, 1, 1, 1], 10), t[0]);
        // Cut at the limit: the next walk goes on after the last one served.
        assert_eq!(next_walk_start(&t, &[1, 1, 0, 0], 4), t[1]);
        assert_eq!(next_walk_start(&[], &[], 4), Uuid::nil());
    }

    #[test]
    fn a_tenant_not_named_weighs_one() {
        let w = TenantWeights::new([(Uuid::from_u128(1), 5)]);
        assert_eq!(w.of(&Uuid::from_u128(1)), 5);
        assert_eq!(w.of(&Uuid::from_u128(2)), 1);
    }
}
