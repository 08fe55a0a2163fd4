//! What the ordered claims know between key walks, so a claim whose keys
//! are all held (for callbacks, for retries, in flight here) costs what
//! changed, not a descent per key ([`crate::store::key_recheck`] says why
//! that is enough). After a walk of every ordered route came back short,
//! the next claims recheck only the keys of the rows above the settled id
//! (`from`: every id up to it is a row the walk or a recheck saw, or an id
//! without a row whose transaction had ended before a walk) and of the heads
//! this relay had out and has no longer. An id missing above `from` is a
//! row not committed yet (it shows up, and is rechecked), an aborted insert,
//! or an id a callback's outcome or a replay took to wake the relays, which
//! changed a key the relay cannot name: once every transaction running when
//! it was seen has ended (a later snapshot's `xmin` passed the `xmax` of the
//! one that saw it missing) and the id is still missing, the claim walks.
//! The listener wakes the claimers then (it waits for the same horizon), so
//! a callback's release is claimed within milliseconds, as before. (A
//! transaction that took an id but had no transaction id yet when it was
//! seen missing could end after that: its change then waits for the next
//! walk, at most the poll interval.) A walk comes too when a time the marker wrote (a retry, a
//! hold) came due, a recheck came back full, more than [`MOST_NEW`] ids
//! are above `from`, or the last walk is older than the claimer's poll
//! interval (what no signal covers: rows inserted with explicit ids, holds
//! a previous owner wrote).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

use metrics::counter;

use crate::metrics as m;
use crate::store::key_recheck::IdWatch;
use crate::store::outbox::Claimed;
use crate::store::{Session, StoreError};

/// Ids below the sequence's position a first walk reads too: an id among
/// them that has no row yet is watched like a new one.
const WINDOW: i64 = 1024;

/// The most ids above `from` a recheck reads; with more, the claim walks (a
/// walk stops at its limit, so it is cheap when many keys are ready).
const MOST_NEW: i64 = 4096;

/// The most due times kept (one comes with each batch of marks that left a
/// row pending for later).
const MOST_DUE: usize = 256;

/// The `kind` label values of the key-head claims' counter.
pub(crate) const KEY_CLAIM_KINDS: [&str; 2] = ["walk", "recheck"];

/// One claimer's knowledge of its shard's ordered keys.
pub(super) struct KeyWatch {
    known: Option<Known>,
    /// The ordered heads out here, by id: their route, bucket and key.
    heads_out: HashMap<i64, (usize, i16, String)>,
    /// Times the marker wrote for rows of the shard that had not come due
    /// at the last walk.
    due: BTreeSet<Instant>,
    walk_every: Duration,
    /// The last heads claim came back short: the next walk may too, so it
    /// reads the ids first (a walk that comes back full, as in a backlog,
    /// does not need them).
    last_short: bool,
    /// Claims that walked and that rechecked, for the tests.
    pub(super) walks: u64,
    pub(super) rechecks: u64,
}

/// Since the walk at `walked`, every key is known but those of the ids
/// above `from`.
#[derive(Debug, Clone, Copy)]
struct Known {
    walked: Instant,
    from: i64,
    /// Some id up to `upto` was missing when the snapshot's next
    /// transaction id was `xmax`; once `xmin` passes it, an id still missing
    /// has no row.
    pending: Option<Pending>,
}

#[derive(Debug, Clone, Copy)]
struct Pending {
    upto: i64,
    xmax: i64,
}

/// What the next heads claim does.
pub(super) enum Step {
    /// Walk every key.
    Walk(Looked),
    /// Read only the keys of the rows above `from` and, per ordered route,
    /// those of `keys`.
    Recheck {
        looked: Looked,
        keys: Vec<Vec<(i16, String)>>,
        walked: Instant,
    },
}

/// What the watch read before the claim, and what it settled.
pub(super) struct Looked {
    watch: Option<IdWatch>,
    pending: Option<Pending>,
    /// Ids up to this one missing now have no row.
    settled: Option<i64>,
}

impl Step {
    /// The new ids a recheck reads: `(from, seq]`.
    pub(super) fn ids(&self) -> Option<(i64, i64)> {
        match self {
            Step::Recheck { looked, .. } => looked.watch.as_ref().map(|w| (w.from, w.seq)),
            Step::Walk(_) => None,
        }
    }
}

impl KeyWatch {
    /// Walks at least every `walk_every`.
    pub(super) fn new(walk_every: Duration) -> KeyWatch {
        KeyWatch {
            known: None,
            heads_out: HashMap::new(),
            due: BTreeSet::new(),
            walk_every,
            last_short: false,
            walks: 0,
            rechecks: 0,
        }
    }

    /// A row of the shard comes due at `at` (the marker wrote it). The
    /// latest are forgotten past [`MOST_DUE`]: a walk comes at most
    /// `walk_every` after the last one anyway, so due times only bring it
    /// sooner.
    pub(super) fn due_at(&mut self, at: Instant) {
        self.due.insert(at);
        if self.due.len() > MOST_DUE {
            self.due.pop_last();
        }
    }

    /// Heads of ordered route `route` this claim handed out.
    pub(super) fn took(&mut self, route: usize, rows: &[Claimed]) {
        for c in rows {
            self.heads_out
                .insert(c.row.id, (route, c.bucket, c.row.partition_key.clone()));
        }
    }

    /// What the heads claim starting `now` does over `routes` ordered
    /// routes, with `out` the rows of the shard this relay has out.
    pub(super) async fn step(
        &mut self,
        session: &mut Session,
        out: &[i64],
        routes: usize,
        now: Instant,
    ) -> Result<Step, StoreError> {
        let left = self.left(out, routes);
        // Taken: a claim that fails walks the next time.
        let known = self.known.take().filter(|k| {
            now.duration_since(k.walked) < self.walk_every
                && self.due.first().is_none_or(|first| *first > now)
        });
        if let Some(k) = known {
            let watch = session
                .watch_ids(Some(k.from), WINDOW, MOST_NEW + 1)
                .await?;
            if let Some(w) = watch.filter(|w| w.ids.len() as i64 <= MOST_NEW) {
                let pending = k.pending;
                let settled = pending.filter(|p| w.xmin >= p.xmax).map(|p| p.upto);
                // Some id with no row: what took it changed keys unknown here.
                let changed = settled.is_some_and(|upto| {
                    let below = w.ids.iter().take_while(|id| **id <= upto).count() as i64;
                    below < upto - w.from
                });
                let looked = Looked {
                    watch: Some(w),
                    pending,
                    settled,
                };
                if !changed {
                    self.rechecks += 1;
                    counter!(m::KEY_CLAIMS, "kind" => KEY_CLAIM_KINDS[1]).increment(1);
                    return Ok(Step::Recheck {
                        looked,
                        keys: left,
                        walked: k.walked,
                    });
                }
                return Ok(self.walk(looked, now));
            }
        }
        let watch = if self.last_short {
            session.watch_ids(None, WINDOW, MOST_NEW + 1).await?
        } else {
            None
        };
        let looked = Looked {
            watch: watch.filter(|w| w.ids.len() as i64 <= MOST_NEW),
            pending: None,
            settled: None,
        };
        Ok(self.walk(looked, now))
    }

    fn walk(&mut self, looked: Looked, now: Instant) -> Step {
        self.due = self.due.split_off(&now);
        self.walks += 1;
        counter!(m::KEY_CLAIMS, "kind" => KEY_CLAIM_KINDS[0]).increment(1);
        Step::Walk(looked)
    }

    /// The claim of `step`, which started `now`, came back `short` (every
    /// route looked at all it could and found fewer heads than it may take)
    /// or not: what is known now.
    pub(super) fn claimed(&mut self, step: Step, short: bool, now: Instant) {
        self.last_short = short;
        let (looked, walked) = match step {
            Step::Walk(looked) => (looked, now),
            Step::Recheck { looked, walked, .. } => (looked, walked),
        };
        self.known = match looked.watch {
            Some(w) if short => Some(known_after(&w, looked.pending, looked.settled, walked)),
            _ => None,
        };
    }

    /// Per route, the keys of the heads that were out here and are no
    /// longer (marked, or their lease ran out): their next rows may be heads.
    fn left(&mut self, out: &[i64], routes: usize) -> Vec<Vec<(i16, String)>> {
        let mut left = vec![Vec::new(); routes];
        if self.heads_out.is_empty() {
            return left;
        }
        let out: HashSet<i64> = out.iter().copied().collect();
        self.heads_out.retain(|id, (route, bucket, key)| {
            let still = out.contains(id);
            if !still {
                if let Some(keys) = left.get_mut(*route) {
                    keys.push((*bucket, std::mem::take(key)));
                }
            }
            still
        });
        left
    }
}

/// What is known after a claim that read `w` and saw every row it lists:
/// `from` moves up over the ids seen and those settled as having no row
/// (up to `settled`); an id still missing above it is watched (`pending`,
/// kept while an earlier one has not settled).
fn known_after(
    w: &IdWatch,
    pending: Option<Pending>,
    settled: Option<i64>,
    walked: Instant,
) -> Known {
    let settled = settled.unwrap_or(i64::MIN);
    let mut from = w.from;
    let mut ids = w.ids.iter().copied().peekable();
    while from < w.seq {
        let next = from + 1;
        if ids.peek() == Some(&next) {
            ids.next();
        } else if next > settled {
            break;
        }
        from = next;
    }
    let pending = if from == w.seq {
        None
    } else {
        match pending {
            Some(p) if p.upto > settled && p.upto > from => Some(p),
            _ => Some(Pending {
                upto: w.seq,
                xmax: w.xmax,
            }),
        }
    };
    Known {
        walked,
        from,
        pending,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::super::{ClaimPlan, ClaimRoutes};
    use crate::actors::inflight::{InFlight, Lease};
    use crate::routes::Router;
    use crate::store::outbox::Claimed;
    use crate::testing::{self, RelayTestDb as _, TestDb};

    /// With every key's head held for its callback, a claim after the walk
    /// that found them all held reads only what changed, and still gets
    /// every key that can move on: a new key, a key whose head this relay
    /// marked, a key a callback released (it moves the id sequence), a row
    /// committed after a later one; never a held key's next row.
    async fn rechecks_what_changed(event_type: &str) {
        let db = TestDb::new().await.unwrap();
        let client = db.client().await.unwrap();
        // 40 keys, two rows each; each key's first row is held.
        client
            .batch_execute(
                "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key, partition_key)
                 SELECT gen_random_uuid(), 'order', g::text, 'order.placed', '{}', 'e' || g, 'k' || (g % 40)
                 FROM generate_series(1, 80) AS g;
                 UPDATE outbox SET locked_until = now() + interval '1 hour', accepted_at = now()
                 WHERE id IN (SELECT min(id) FROM outbox GROUP BY partition_key);",
            )
            .await
            .unwrap();
        let (store, fence) = db.one_shard().await;
        let routes = Arc::new(ClaimRoutes::new(&Router::new(&testing::routes(&format!(
            r#"
            [[routes]]
            event_type = "{event_type}"
            destination = "https://a.example/all"
            ordering = "partition_key_to_qstash"
            "#
        )))));
        let mut plan = ClaimPlan::new(routes, None, Duration::from_secs(3600));
        let mut session = store.session();
        let in_flight = InFlight::new(100);
        let mut leases: Vec<Lease> = Vec::new();
        let later = Instant::now() + Duration::from_secs(3600);
        // One claim; what it takes stays out (leased), as the claimer keeps it.
        let mut claim = async |plan: &mut ClaimPlan, leases: &mut Vec<Lease>| -> Vec<String> {
            let rows: Vec<Claimed> = plan
                .claim(&mut session, &in_flight, fence, 50)
                .await
                .unwrap();
            let mut permits = in_flight.permits(rows.len().max(1)).await.unwrap();
            for c in &rows {
                leases.push(permits.lease(c.held(fence), c.row.tenant_id, later, &in_flight));
            }
            rows.iter().map(|c| c.row.aggregate_id.clone()).collect()
        };
        let steps = |plan: &ClaimPlan| (plan.keys.walks, plan.keys.rechecks);
        let insert = async |key: &str, aggregate: &str| {
            client
                .execute(
                    "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key, partition_key)
                     VALUES (gen_random_uuid(), 'order', $1, 'order.placed', '{}', $1, $2)",
                    &[&aggregate, &key],
                )
                .await
                .unwrap();
        };

        assert!(
            claim(&mut plan, &mut leases).await.is_empty(),
            "every head is held"
        );
        assert_eq!(steps(&plan), (1, 0), "the first claim walks every key");
        // Having come back short, the next walks again, after reading the
        // ids it can recheck from; then nothing changed: a recheck.
        assert!(claim(&mut plan, &mut leases).await.is_empty());
        assert_eq!(steps(&plan), (2, 0));
        assert!(claim(&mut plan, &mut leases).await.is_empty());
        assert_eq!(steps(&plan), (2, 1), "nothing changed: a recheck, no walk");

        // A new key's row comes; a held key's next row does not.
        insert("k1", "held-next").await;
        insert("fresh", "fresh-1").await;
        assert_eq!(claim(&mut plan, &mut leases).await, ["fresh-1"]);
        assert_eq!(steps(&plan), (2, 2));

        // The new key's next row waits while its head is out here, and comes
        // once this relay marked the head.
        insert("fresh", "fresh-2").await;
        assert!(claim(&mut plan, &mut leases).await.is_empty());
        client
            .execute(
                "UPDATE outbox SET published_at = now() WHERE aggregate_id = 'fresh-1'",
                &[],
            )
            .await
            .unwrap();
        leases.clear();
        assert_eq!(claim(&mut plan, &mut leases).await, ["fresh-2"]);
        assert_eq!(steps(&plan), (2, 4), "rechecks, still no walk");

        // A callback publishes a held head and takes an id to wake the
        // relays: the claim that sees the id missing rechecks (the id's
        // transaction may still be running); the next one, every transaction
        // of then having ended, walks, and the key moves on.
        client
            .batch_execute(
                "UPDATE outbox SET published_at = now(), locked_until = NULL
                 WHERE id = (SELECT min(id) FROM outbox WHERE partition_key = 'k2');
                 SELECT nextval(pg_get_serial_sequence('outbox', 'id'));",
            )
            .await
            .unwrap();
        assert!(claim(&mut plan, &mut leases).await.is_empty());
        assert_eq!(steps(&plan), (2, 5));
        assert_eq!(claim(&mut plan, &mut leases).await, ["42"], "k2's next row");
        assert_eq!(steps(&plan), (3, 5), "an id without a row brings a walk");

        // A row whose transaction took its id before a later row committed
        // is claimed once it commits too.
        let mut slow = db.client().await.unwrap();
        let tx = slow.transaction().await.unwrap();
        tx.execute(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key, partition_key)
             VALUES (gen_random_uuid(), 'order', 'late', 'order.placed', '{}', 'late', 'late')",
            &[],
        )
        .await
        .unwrap();
        insert("early", "early").await;
        assert_eq!(claim(&mut plan, &mut leases).await, ["early"]);
        assert!(claim(&mut plan, &mut leases).await.is_empty());
        tx.commit().await.unwrap();
        assert_eq!(claim(&mut plan, &mut leases).await, ["late"]);
        assert_eq!(steps(&plan), (3, 8), "a row committed late is rechecked");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_route_of_every_type_rechecks_only_what_changed_while_its_keys_are_held() {
        rechecks_what_changed("*").await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_route_of_some_types_rechecks_only_what_changed_while_its_keys_are_held() {
        rechecks_what_changed("order.*").await;
    }
}
