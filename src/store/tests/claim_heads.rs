//! The ordered claim walks a shard's keys round-robin from a key cursor and
//! wraps around: keys before the cursor whose head became claimable are taken
//! once the walk passes the last key, a key whose head waits for a retry (or
//! is held for its outcome) gives nothing (not even its later rows), a head
//! already in flight is read again but skipped as the claimer skips it, and a
//! claim stops at its limit instead of taking the oldest heads of the whole
//! shard. (That
//! the claim checks each head through the primary key whatever the
//! statistics say is tested beside the other plans, in `tests/mod.rs`.)

use std::collections::HashSet;

use tokio_postgres::Client;

use crate::store::outbox::{
    key_cursor_after, next_key_cursor, no_key_cursor, ClaimScope, KeyCursor, RouteTypes,
};
use crate::store::{Fence, Session};
use crate::testing::{RelayTestDb as _, TestDb};

struct Claim {
    client: Client,
    session: Session,
    cursor: KeyCursor,
    /// Shard 0, taken for the test.
    fence: Fence,
    /// What the test has "in flight": a claim writes nothing on the rows, so
    /// skipping these is the claimer's part, done here the same way.
    out: HashSet<i64>,
}

impl Claim {
    /// One claim of up to `limit` heads, as the claimer makes it: read that
    /// many more than are out, skip those, move the cursor after the ones
    /// taken. Returns `(key, id)` sorted by key.
    async fn take(&mut self, limit: i64) -> Vec<(String, i64)> {
        let scope = ClaimScope {
            fence: self.fence,
            routes: &[],
            out: &[],
        };
        let every_type = RouteTypes {
            like: "%".to_owned(),
            unless: Vec::new(),
        };
        let read = self
            .session
            .claim_heads(
                &scope,
                &every_type,
                &self.cursor,
                limit + self.out.len() as i64,
            )
            .await
            .unwrap();
        let all_read = key_cursor_after(&self.cursor, &read);
        let taken: Vec<_> = read
            .into_iter()
            .filter(|c| !self.out.contains(&c.row.id))
            .take(limit as usize)
            .collect();
        self.cursor = if taken.is_empty() {
            all_read
        } else {
            key_cursor_after(&self.cursor, &taken)
        };
        self.out.extend(taken.iter().map(|c| c.row.id));
        let mut got: Vec<(String, i64)> = taken
            .into_iter()
            .map(|c| (c.row.partition_key, c.row.id))
            .collect();
        got.sort();
        got
    }

    /// The outcome of `id` is written: it is no longer out.
    async fn mark(&mut self, id: i64, set: &str) {
        self.out.remove(&id);
        self.client
            .execute(&format!("UPDATE outbox SET {set} WHERE id = $1"), &[&id])
            .await
            .unwrap();
    }
}

fn keys(got: &[(String, i64)]) -> Vec<&str> {
    got.iter().map(|(k, _)| k.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_walk_resumes_after_its_cursor_and_wraps_around() {
    let db = TestDb::new().await.unwrap();
    let client = db.client().await.unwrap();
    // Keys k0..k9 with three events each (ids in key-major order would make
    // age order and walk order agree; interleave them instead).
    client
        .batch_execute(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key, partition_key)
             SELECT gen_random_uuid(), 'order', 'a' || g, 'order.placed', '{}', 'e' || g, 'k' || (9 - g % 10)
             FROM generate_series(0, 29) g;",
        )
        .await
        .unwrap();
    // One shard over every bucket.
    let (store, fence) = db.one_shard().await;
    // The walk's order: by bucket, then key.
    let walk: Vec<String> = client
        .query(
            "SELECT partition_key FROM outbox GROUP BY bucket, partition_key ORDER BY bucket, partition_key",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(walk.len(), 10);
    let w = |range: std::ops::Range<usize>| -> Vec<&str> {
        let mut keys: Vec<&str> = walk[range].iter().map(String::as_str).collect();
        keys.sort();
        keys
    };
    let mut claim = Claim {
        client,
        session: store.session(),
        cursor: no_key_cursor(),
        fence,
        out: HashSet::new(),
    };
    let head = |key: &str, got: &[(String, i64)]| -> i64 {
        got.iter().find(|(k, _)| k == key).expect("claimed").1
    };

    // Walk order from the start, not age order (k9 holds the oldest row).
    let first = claim.take(3).await;
    assert_eq!(keys(&first), w(0..3));
    assert_eq!(claim.cursor.1, walk[2]);
    let second = claim.take(3).await;
    assert_eq!(keys(&second), w(3..6));
    assert_eq!(claim.cursor.1, walk[5]);

    // walk[0]'s head is delivered, walk[1]'s waits for a retry: walk[0]'s next
    // row is now its head and claimable; walk[1] has nothing (its later rows
    // stay back).
    claim
        .mark(head(&walk[0], &first), "published_at = now()")
        .await;
    claim
        .mark(
            head(&walk[1], &first),
            "available_at = now() + interval '1 hour'",
        )
        .await;

    // The walk goes on after walk[5] to the end, then wraps to walk[0]
    // (walk[1] waits, walk[2..6] are in flight): the keys before the cursor
    // are not forgotten.
    let third = claim.take(10).await;
    let mut expected = w(6..10);
    expected.push(&walk[0]);
    expected.sort();
    assert_eq!(keys(&third), expected);
    assert!(
        head(&walk[0], &third) > head(&walk[0], &first),
        "walk[0]'s next event"
    );
    assert_eq!(
        claim.cursor.1, walk[0],
        "the last key in walk order (wrapped)"
    );

    // Every head is in flight or waiting: nothing, whatever the cursor.
    assert!(claim.take(10).await.is_empty());
    assert_eq!(claim.cursor.1, walk[0], "an empty claim leaves the cursor");

    // The retry comes due: taken on the next lap, one row for walk[1] only.
    claim
        .mark(head(&walk[1], &first), "available_at = now()")
        .await;
    let fourth = claim.take(10).await;
    assert_eq!(fourth, [(walk[1].clone(), head(&walk[1], &first))]);

    // A head held for its outcome (an ordered QStash delivery waiting for
    // its callback) gives nothing either, even when it is not out here (a
    // new owner of the shard must not send it again, nor its key's next).
    let held = head(&walk[6], &third);
    claim
        .mark(held, "locked_until = now() + interval '1 hour'")
        .await;
    claim
        .mark(head(&walk[7], &third), "published_at = now()")
        .await;
    let fifth = claim.take(10).await;
    assert!(
        fifth.iter().all(|(k, _)| *k != walk[6]),
        "a held head was read: {fifth:?}"
    );
    assert!(fifth.iter().any(|(k, _)| *k == walk[7]), "{fifth:?}");

    // Never two rows of one key out at once.
    let out: Vec<i64> = claim.out.iter().copied().collect();
    let doubled: i64 = claim
        .client
        .query_one(
            "SELECT count(*) FROM (SELECT partition_key FROM outbox WHERE id = ANY($1)
               GROUP BY partition_key HAVING count(*) > 1) d",
            &[&out],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(doubled, 0);
}

#[test]
fn the_cursor_is_the_last_key_in_walk_order() {
    let key = |b: i16, k: &str| Some((b, k.to_owned()));
    assert_eq!(
        next_key_cursor((0, ""), [(1, "b"), (1, "a"), (1, "c")]),
        key(1, "c")
    );
    // Keys after the cursor were walked first, the wrapped ones last.
    assert_eq!(
        next_key_cursor((1, "m"), [(1, "x"), (1, "b"), (1, "z"), (1, "a")]),
        key(1, "b")
    );
    assert_eq!(next_key_cursor((1, "m"), [(1, "m")]), key(1, "m"));
    assert_eq!(next_key_cursor((1, "m"), [(1, "n"), (1, "y")]), key(1, "y"));
    // The bucket comes first: a later bucket is later whatever its key.
    assert_eq!(next_key_cursor((1, "m"), [(2, "a"), (1, "z")]), key(2, "a"));
    assert_eq!(next_key_cursor((3, "m"), [(2, "z"), (1, "a")]), key(2, "z"));
    assert_eq!(next_key_cursor((1, "m"), std::iter::empty()), None);
}

/// A key's head is kept per route: for an ordered route it is the oldest
/// pending row of the key among the types that route takes. A key whose
/// oldest row belongs to another route (here an unordered `audit.*`, paused
/// with its row pending) does not hide its next row from this route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_routes_oldest_row_does_not_hide_a_keys_head() {
    let db = TestDb::new().await.unwrap();
    let client = db.client().await.unwrap();
    // Key `a`: an audit row, then two order rows. Key `b`: one order row.
    client
        .batch_execute(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key, partition_key)
             VALUES (gen_random_uuid(), 'order', '1', 'audit.logged', '{}', 'e1', 'a'),
                    (gen_random_uuid(), 'order', '1', 'order.placed', '{}', 'e2', 'a'),
                    (gen_random_uuid(), 'order', '1', 'order.paid',   '{}', 'e3', 'a'),
                    (gen_random_uuid(), 'order', '2', 'order.placed', '{}', 'e4', 'b');",
        )
        .await
        .unwrap();
    let id = |key: &'static str| {
        let client = &client;
        async move {
            client
                .query_one("SELECT id FROM outbox WHERE idempotency_key = $1", &[&key])
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    let (store, fence) = db.one_shard().await;
    let mut session = store.session();
    // The routes `audit.*` (unordered) then `*` (ordered): the ordered
    // route takes every type but the audit ones.
    let scope = ClaimScope {
        fence,
        routes: &[],
        out: &[],
    };
    let types = RouteTypes {
        like: "%".to_owned(),
        unless: vec!["audit.%".to_owned()],
    };
    let heads = |claimed: Vec<crate::store::outbox::Claimed>| {
        let mut ids: Vec<i64> = claimed.iter().map(|c| c.row.id).collect();
        ids.sort();
        ids
    };
    let got = heads(
        session
            .claim_heads(&scope, &types, &no_key_cursor(), 10)
            .await
            .unwrap(),
    );
    assert_eq!(
        got,
        [id("e2").await, id("e4").await],
        "key a's head for the order route is its first order row"
    );
    // With that head out, key a has nothing more for this route (its
    // `order.paid` waits behind it), whatever the audit row does.
    let out = [id("e2").await];
    let scope = ClaimScope { out: &out, ..scope };
    let got = heads(
        session
            .claim_heads(&scope, &types, &no_key_cursor(), 10)
            .await
            .unwrap(),
    );
    assert_eq!(got, [id("e4").await]);
}
