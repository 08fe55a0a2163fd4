//! What a claimer reads next, in one place: which rows each kind of claim
//! takes (the plain claim: the rows of unordered routes; one key-head claim
//! per ordered route, among that route's event types), where each one goes
//! on from (the plain claim's cursor, each ordered route's key cursor), how
//! a claim's rows are shared between them, and the rows left out because
//! this relay has them out already. Not an actor: the claimer drives it, one
//! plan per claimer; the statements are in [`crate::store::outbox`].
//!
//! The plain claim's rows are shared between the tenants that have some
//! pending when tenant fairness is on ([`tenants`]).
//!
//! Per-key order is kept within each ordered route: a key's head for a route
//! is the key's oldest pending row among the types that route takes (first
//! matching `[[routes]]` entry), so a paused or failing route holds back its
//! own events only, and events of one key on different routes are
//! independent.

mod key_watch;
mod tenant_rates;
mod tenants;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use self::key_watch::KEY_CLAIM_KINDS;
use self::key_watch::{KeyWatch, Step};
pub(crate) use self::tenant_rates::TenantRates;
pub(crate) use self::tenants::{Fairness, TenantWeights};
use self::tenants::{TenantClaim, TenantPlan};
use super::inflight::{ClaimGuard, InFlight};
use crate::routes::{EventPattern, Router};
use crate::store::outbox::{
    key_cursor_after, no_cursor, no_key_cursor, ClaimScope, Claimed, Cursor, KeyCursor,
    RoutePattern, RouteTypes,
};
use crate::store::{Fence, Session, StoreError};

/// The routes as the claims see them, worked out once from the router.
#[derive(Debug, Clone, Default)]
pub(crate) struct ClaimRoutes {
    /// Every route's pattern, for the plain claim to leave out what an
    /// ordered route takes; empty when no route is ordered.
    patterns: Vec<RoutePattern>,
    /// The ordered routes that can get an event, each with its types.
    ordered: Vec<RouteTypes>,
    /// Some event type is not an ordered route's (an unordered route's, or
    /// no route's: dead-lettered): the plain claim runs.
    plain: bool,
}

impl ClaimRoutes {
    pub(crate) fn new(router: &Router) -> ClaimRoutes {
        let routes = router.routes();
        let mut ordered = Vec::new();
        let mut plain = true;
        for (i, route) in routes.iter().enumerate() {
            let pattern = &route.config.event_type;
            let earlier = &routes[..i];
            // A route behind one that covers it never gets an event.
            if earlier.iter().any(|e| e.config.event_type.covers(pattern)) {
                continue;
            }
            if !route.ordered() {
                continue;
            }
            ordered.push(RouteTypes {
                like: pattern.like(),
                unless: earlier.iter().map(|e| e.config.event_type.like()).collect(),
            });
            // `*` behind ordered routes only: every type is an ordered route's.
            if *pattern == EventPattern::All && earlier.iter().all(|e| e.ordered()) {
                plain = false;
            }
        }
        let patterns = if ordered.is_empty() {
            Vec::new()
        } else {
            routes
                .iter()
                .map(|r| RoutePattern {
                    like: r.config.event_type.like(),
                    ordered: r.ordered(),
                })
                .collect()
        };
        ClaimRoutes {
            patterns,
            ordered,
            plain,
        }
    }
}

/// One claimer's plan: the routes, and where each of its claims goes on from.
pub(crate) struct ClaimPlan {
    routes: Arc<ClaimRoutes>,
    /// `(bucket, available_at, id)` of the last row of the last full plain
    /// batch: the next claim of a burst starts after it. Reset whenever a
    /// plain claim comes back short.
    cursor: Cursor,
    /// Per ordered route (as in `routes.ordered`): the last key its previous
    /// key-head claim took; the next one walks the shard's keys from after
    /// it (round-robin).
    key_cursors: Vec<KeyCursor>,
    /// Which kind of claim gets an odd limit's extra row this time.
    heads_first: bool,
    /// The plain claim's share per tenant, when tenant fairness is on.
    tenants: Option<TenantPlan>,
    /// What the ordered claims know between key walks.
    keys: KeyWatch,
}

impl ClaimPlan {
    /// The plan of one claimer; `tenants`: the tenants' weights and paces
    /// when the plain claim is shared between tenants (`relay.tenant_fairness`);
    /// `walk_every`: the ordered claims walk every key at least this often
    /// (the claimer's poll interval), and in between read only what changed.
    pub(crate) fn new(
        routes: Arc<ClaimRoutes>,
        tenants: Option<Fairness>,
        walk_every: Duration,
    ) -> ClaimPlan {
        ClaimPlan {
            key_cursors: vec![no_key_cursor(); routes.ordered.len()],
            routes,
            cursor: no_cursor(),
            heads_first: false,
            tenants: tenants.map(TenantPlan::new),
            keys: KeyWatch::new(walk_every),
        }
    }

    /// A row of the shard comes due at `at` (a retry, a deferral or a hold
    /// the marker wrote): the ordered claims walk their keys again then.
    pub(crate) fn due_at(&mut self, at: Instant) {
        if !self.routes.ordered.is_empty() {
            self.keys.due_at(at);
        }
    }

    /// Up to `limit` rows of `fence`'s shard to hand out, in id order: read
    /// from the database (which writes nothing for a claim), less the rows
    /// this relay has out already.
    pub(crate) async fn claim(
        &mut self,
        session: &mut Session,
        in_flight: &Arc<InFlight>,
        fence: Fence,
        limit: i64,
    ) -> Result<Vec<Claimed>, StoreError> {
        // Its own handle on the routes, so the scope does not borrow the plan.
        let routes = Arc::clone(&self.routes);
        // The guard first: a row that leaves the in-flight set after the ids
        // are read is then known to the guard, so it is not taken twice.
        let guard = in_flight.claim_starts();
        // What this relay has out of the shard: the claims leave it out.
        let out = in_flight.ids_of(fence);
        let scope = ClaimScope {
            fence,
            routes: &routes.patterns,
            out: &out,
        };
        let mut claim = Claim {
            session,
            guard: &guard,
            scope: &scope,
            in_flight,
        };
        let heads = !routes.ordered.is_empty();
        // When both kinds run, each gets half of every claim, and what one
        // leaves the other may take: a large ordered backlog never starves
        // the unordered event types, nor the other way round.
        // An odd limit's extra row goes to each kind in turn.
        self.heads_first = !self.heads_first;
        let heads_share = if routes.plain {
            (limit + i64::from(self.heads_first)) / 2
        } else {
            limit
        };
        let mut rows = Vec::new();
        if heads && heads_share > 0 {
            rows.extend(self.heads(&mut claim, heads_share).await?);
        }
        // Heads may want more than their share (none was asked, or all were taken).
        let heads_want_more = heads && rows.len() as i64 >= heads_share;
        let rest = limit - rows.len() as i64;
        if routes.plain && rest > 0 {
            let taken = self.plain(&mut claim, rest).await?;
            let short = (taken.len() as i64) < rest;
            rows.extend(taken);
            // The unordered types left room: give it to the ordered heads.
            let room = limit - rows.len() as i64;
            if short && room > 0 && heads_want_more {
                rows.extend(self.heads(&mut claim, room).await?);
            }
        }
        rows.sort_unstable_by_key(|c| c.row.id);
        rows.dedup_by_key(|c| c.row.id);
        Ok(rows)
    }

    /// Whether the last claim was cut short only by tenants' rooms in
    /// flight (tenant fairness), none of which has room for `rows` more yet:
    /// claiming again now would find nothing to take.
    pub(crate) fn waits_for_room(&self, in_flight: &InFlight, rows: usize) -> bool {
        self.tenants
            .as_ref()
            .is_some_and(|t| t.waits_for_room(in_flight, rows))
    }

    /// Up to `limit` due rows of the unordered routes: shared between the
    /// tenants with rows pending when tenant fairness is on and there are
    /// several, else from the cursor on.
    async fn plain(
        &mut self,
        claim: &mut Claim<'_>,
        limit: i64,
    ) -> Result<Vec<Claimed>, StoreError> {
        let mut limit = limit;
        if let Some(tenants) = &mut self.tenants {
            match tenants.claim(claim, limit).await? {
                TenantClaim::Shared(rows) => return Ok(rows),
                TenantClaim::Plain { room } => limit = limit.min(room),
            }
            if limit == 0 {
                // The one tenant pending has filled its room.
                return Ok(Vec::new());
            }
        }
        let read = claim
            .session
            .claim_due(claim.scope, self.cursor, limit)
            .await?;
        let (read_len, last_read) = (read.len() as i64, read.last().map(Claimed::cursor));
        let taken = claim.fresh(read, limit);
        // The plain claim's cursor follows its own rows only (key heads are
        // anywhere in the shard).
        self.cursor = next_cursor(limit, read_len, last_read, &taken);
        if let Some(tenants) = &mut self.tenants {
            tenants.plain_took(&taken, limit);
        }
        Ok(taken)
    }

    /// Up to `limit` key heads over the ordered routes, shared evenly
    /// between them; what one route leaves goes to the next. A walk of every
    /// key, or, while nothing but new rows and this relay's own marks changed
    /// since a walk that visited them all, a recheck of those keys only.
    async fn heads(
        &mut self,
        claim: &mut Claim<'_>,
        limit: i64,
    ) -> Result<Vec<Claimed>, StoreError> {
        let routes = Arc::clone(&self.routes);
        let count = routes.ordered.len();
        let now = Instant::now();
        let step = self
            .keys
            .step(claim.session, claim.scope.out, count, now)
            .await?;
        let mut rows = Vec::new();
        // Every route looked at all it could and found fewer than it may take.
        let mut short = true;
        for (i, types) in routes.ordered.iter().enumerate() {
            let left = limit - rows.len() as i64;
            let share = (left + (count - i) as i64 - 1) / (count - i) as i64;
            if share <= 0 {
                short = false;
                continue;
            }
            let (taken, read) = match (&step, step.ids()) {
                (Step::Recheck { keys, .. }, Some(ids)) => {
                    let read = claim
                        .session
                        .recheck_heads(claim.scope, types, ids, &keys[i], share)
                        .await?;
                    let n = read.len();
                    (claim.fresh(read, share), n)
                }
                _ => self.route_heads(claim, i, types, share).await?,
            };
            short &= (read as i64) < share;
            self.keys.took(i, &taken);
            rows.extend(taken);
        }
        self.keys.claimed(step, short, now);
        Ok(rows)
    }

    /// Up to `limit` key heads of ordered route `i` this relay does not have
    /// out (the claim leaves them out), and how many the walk read; its key
    /// walk goes on after the last one taken, or after the last one read
    /// when every head read had left meanwhile.
    async fn route_heads(
        &mut self,
        claim: &mut Claim<'_>,
        i: usize,
        types: &RouteTypes,
        limit: i64,
    ) -> Result<(Vec<Claimed>, usize), StoreError> {
        let cursor = &self.key_cursors[i];
        let read = claim
            .session
            .claim_heads(claim.scope, types, cursor, limit)
            .await?;
        let all_read = key_cursor_after(cursor, &read);
        let n = read.len();
        let taken = claim.fresh(read, limit);
        self.key_cursors[i] = if taken.is_empty() {
            all_read
        } else {
            key_cursor_after(cursor, &taken)
        };
        Ok((taken, n))
    }
}

/// Where a plain claim of `limit` rows that read `read_len` of them (the last
/// one at `last_read`) and kept `taken` goes on from: full, after what it
/// took (or read, when all of it was out already); short, from the
/// beginning again.
fn next_cursor(limit: i64, read_len: i64, last_read: Option<Cursor>, taken: &[Claimed]) -> Cursor {
    let full = read_len == limit;
    match (full, taken.last().map(Claimed::cursor), last_read) {
        (true, Some(last), _) if taken.len() as i64 == limit => last,
        (true, _, Some(last)) => last,
        _ => no_cursor(),
    }
}

/// One claim in progress: the connection, what it leaves out, and the guard
/// that tells the rows whose outcome was written while it ran.
struct Claim<'a> {
    session: &'a mut Session,
    guard: &'a ClaimGuard,
    scope: &'a ClaimScope<'a>,
    in_flight: &'a InFlight,
}

impl Claim<'_> {
    /// The first `limit` of `read` that this relay does not have out, nor had
    /// out while the claim ran.
    fn fresh(&self, read: Vec<Claimed>, limit: i64) -> Vec<Claimed> {
        let new = self.guard.fresh(read.iter().map(|c| c.row.id));
        read.into_iter()
            .filter(|c| new.contains(&c.row.id))
            .take(limit.max(0) as usize)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::testing::{self, RelayTestDb as _, TestDb};

    fn routes(toml: &str) -> ClaimRoutes {
        ClaimRoutes::new(&Router::new(&testing::routes(toml)))
    }

    fn types(like: &str, unless: &[&str]) -> RouteTypes {
        RouteTypes {
            like: like.to_owned(),
            unless: unless.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn each_ordered_route_claims_its_own_types_behind_the_routes_before_it() {
        // The issue's layout: an unordered route first, `*` ordered behind it.
        let r = routes(
            r#"
            [[routes]]
            event_type = "audit.*"
            destination = "https://a.example/audit"
            [[routes]]
            event_type = "*"
            destination = "https://a.example/all"
            ordering = "partition_key_to_qstash"
            "#,
        );
        assert_eq!(r.ordered, [types("%", &["audit.%"])]);
        assert!(r.plain, "the audit rows are the plain claim's");
        assert_eq!(
            r.patterns,
            [
                RoutePattern {
                    like: "audit.%".into(),
                    ordered: false
                },
                RoutePattern {
                    like: "%".into(),
                    ordered: true
                },
            ]
        );

        // Ordered routes only, `*` last: no plain claim; a route behind one
        // that covers it gets nothing, so it has no head claim.
        let r = routes(
            r#"
            [[routes]]
            event_type = "order.*"
            destination = "https://a.example/orders"
            ordering = "partition_key_to_qstash"
            [[routes]]
            event_type = "order.placed"
            destination = "https://a.example/placed"
            ordering = "partition_key_to_qstash"
            [[routes]]
            event_type = "*"
            destination = "https://a.example/all"
            ordering = "partition_key_to_qstash"
            "#,
        );
        assert_eq!(
            r.ordered,
            [
                types("order.%", &[]),
                types("%", &["order.%", "order.placed"])
            ]
        );
        assert!(!r.plain);

        // No ordered route: the plain claim reads everything, unfiltered.
        let r = routes(
            r#"
            [[routes]]
            event_type = "*"
            destination = "https://a.example/all"
            "#,
        );
        assert!(r.ordered.is_empty() && r.patterns.is_empty() && r.plain);
    }

    /// One claim takes each ordered route's heads among its own types and
    /// the unordered rows; a key's head on one route does not hold back its
    /// head on another, and a head out here holds back its key on its route
    /// until it is marked.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_takes_each_routes_heads_and_the_unordered_rows() {
        let db = TestDb::new().await.unwrap();
        let client = db.client().await.unwrap();
        client
            .batch_execute(
                "INSERT INTO outbox (id, tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key, partition_key)
                 VALUES (1, gen_random_uuid(), 'order', '1', 'audit.logged', '{}', 'e1', 'a'),
                        (2, gen_random_uuid(), 'order', '1', 'order.placed', '{}', 'e2', 'a'),
                        (3, gen_random_uuid(), 'order', '1', 'order.paid',   '{}', 'e3', 'a'),
                        (4, gen_random_uuid(), 'order', '2', 'order.placed', '{}', 'e4', 'b'),
                        (5, gen_random_uuid(), 'user',  '3', 'user.created', '{}', 'e5', 'c');",
            )
            .await
            .unwrap();
        let (store, fence) = db.one_shard().await;
        let routes = Arc::new(routes(
            r#"
            [[routes]]
            event_type = "audit.*"
            destination = "https://a.example/audit"
            ordering = "partition_key_to_qstash"
            [[routes]]
            event_type = "order.*"
            destination = "https://a.example/orders"
            ordering = "partition_key_to_qstash"
            [[routes]]
            event_type = "*"
            destination = "https://a.example/all"
            "#,
        ));
        let mut plan = ClaimPlan::new(routes, None, Duration::from_secs(60));
        let mut session = store.session();
        let in_flight = InFlight::new(100);
        let mut claim = async |plan: &mut ClaimPlan| -> Vec<Claimed> {
            plan.claim(&mut session, &in_flight, fence, 10)
                .await
                .unwrap()
        };
        let ids = |rows: &[Claimed]| rows.iter().map(|c| c.row.id).collect::<Vec<_>>();

        let first = claim(&mut plan).await;
        assert_eq!(ids(&first), [1, 2, 4, 5]);
        // Out here: nothing more (row 3 waits behind row 2 on its route).
        let mut permits = in_flight.permits(10).await.unwrap();
        let later = Instant::now() + Duration::from_secs(60);
        let mut leases: Vec<_> = first
            .iter()
            .map(|c| permits.lease(c.held(fence), c.row.tenant_id, later, &in_flight))
            .collect();
        drop(permits);
        assert!(claim(&mut plan).await.is_empty());
        // Row 2 is delivered: its key's next row on the order route comes.
        client
            .execute("UPDATE outbox SET published_at = now() WHERE id = 2", &[])
            .await
            .unwrap();
        leases.retain(|l| l.id() != 2);
        assert_eq!(ids(&claim(&mut plan).await), [3]);
    }
}
