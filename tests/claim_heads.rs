//! The ordered claim walks a shard's keys round-robin from a key cursor and
//! wraps around: keys before the cursor whose head became claimable are taken
//! once the walk passes the last key, a key whose head is in flight or waiting
//! for a retry gives nothing (not even its later rows), and a claim stops at
//! its limit instead of taking the oldest heads of the whole shard. (That
//! the claim checks each head through the primary key whatever the
//! statistics say is tested beside the statement, in `src/store/tests.rs`.)

mod common;

use std::time::Duration;

use outbox_relay::store::outbox::{next_key_cursor, ClaimScope};
use outbox_relay::store::{Fence, Session, ShardId, Store};
use tokio_postgres::Client;

struct Claim {
    client: Client,
    session: Session,
    cursor: String,
    /// Shard 0, taken for the test.
    fence: Fence,
}

impl Claim {
    /// One claim of up to `limit` heads; returns `(key, id)` sorted by key and
    /// moves the cursor as the claimer does.
    async fn take(&mut self, limit: i64) -> Vec<(String, i64)> {
        let ordered = ["%".to_owned()];
        let scope = ClaimScope {
            fence: self.fence,
            lease: Duration::from_secs(60),
            ordered: &ordered,
        };
        let rows = self
            .session
            .claim_heads(&scope, &mut self.cursor, limit)
            .await
            .unwrap();
        let mut got: Vec<(String, i64)> = rows
            .into_iter()
            .map(|c| (c.row.partition_key, c.row.id))
            .collect();
        got.sort();
        got
    }
}

fn keys(got: &[(String, i64)]) -> Vec<&str> {
    got.iter().map(|(k, _)| k.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_walk_resumes_after_its_cursor_and_wraps_around() {
    let db = common::test_db().await;
    let client = db.client().await.unwrap();
    // One shard, keys k0..k9 with three events each (ids in key-major order
    // would make age order and key order agree; interleave them instead).
    client
        .batch_execute(
            "UPDATE outbox_relay_settings SET shards = 1;
             INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key, partition_key)
             SELECT gen_random_uuid(), 'order', 'a' || g, 'order.placed', '{}', 'e' || g, 'k' || (9 - g % 10)
             FROM generate_series(0, 29) g;",
        )
        .await
        .unwrap();
    let store = Store::open(&db.url, 2, Duration::from_secs(5)).unwrap();
    let fence = store
        .seize_shard(ShardId::new(0), "test", Duration::from_secs(600))
        .await
        .unwrap();
    let mut claim = Claim {
        client,
        session: store.session(),
        cursor: String::new(),
        fence,
    };
    let head = |key: &str, got: &[(String, i64)]| -> i64 {
        got.iter().find(|(k, _)| k == key).expect("claimed").1
    };

    // Key order from the start, not age order (k9 holds the oldest row).
    let first = claim.take(3).await;
    assert_eq!(keys(&first), ["k0", "k1", "k2"]);
    assert_eq!(claim.cursor, "k2");
    let second = claim.take(3).await;
    assert_eq!(keys(&second), ["k3", "k4", "k5"]);
    assert_eq!(claim.cursor, "k5");

    // k0's head is delivered, k1's waits for a retry: k0's next row is now
    // its head and claimable; k1 has nothing (its later rows stay back).
    claim
        .client
        .execute(
            "UPDATE outbox SET published_at = now(), locked_until = NULL WHERE id = $1",
            &[&head("k0", &first)],
        )
        .await
        .unwrap();
    claim
        .client
        .execute(
            "UPDATE outbox SET available_at = now() + interval '1 hour', locked_until = NULL WHERE id = $1",
            &[&head("k1", &first)],
        )
        .await
        .unwrap();

    // The walk goes on after k5 to the end, then wraps to k0 (k1 waits, k2..k5
    // are in flight): the keys before the cursor are not forgotten.
    let third = claim.take(10).await;
    assert_eq!(keys(&third), ["k0", "k6", "k7", "k8", "k9"]);
    assert!(head("k0", &third) > head("k0", &first), "k0's next event");
    assert_eq!(claim.cursor, "k0", "the last key in walk order (wrapped)");

    // Every head is in flight or waiting: nothing, whatever the cursor.
    assert!(claim.take(10).await.is_empty());
    assert_eq!(claim.cursor, "k0", "an empty claim leaves the cursor");

    // The retry comes due: taken on the next lap, one row for k1 only.
    claim
        .client
        .execute(
            "UPDATE outbox SET available_at = now() WHERE id = $1",
            &[&head("k1", &first)],
        )
        .await
        .unwrap();
    let fourth = claim.take(10).await;
    assert_eq!(fourth, [("k1".to_owned(), head("k1", &first))]);

    // Never two rows of one key leased at once.
    let doubled: i64 = claim
        .client
        .query_one(
            "SELECT count(*) FROM (SELECT partition_key FROM outbox
               WHERE locked_until > now() AND published_at IS NULL
               GROUP BY partition_key HAVING count(*) > 1) d",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(doubled, 0);
}

#[test]
fn the_cursor_is_the_last_key_in_walk_order() {
    assert_eq!(next_key_cursor("", ["b", "a", "c"]), Some("c".into()));
    // Keys after the cursor were walked first, the wrapped ones last.
    assert_eq!(next_key_cursor("m", ["x", "b", "z", "a"]), Some("b".into()));
    assert_eq!(next_key_cursor("m", ["m"]), Some("m".into()));
    assert_eq!(next_key_cursor("m", ["n", "y"]), Some("y".into()));
    assert_eq!(next_key_cursor("m", std::iter::empty::<&str>()), None);
}
