//! The store's own tests: statement plans that must hold whatever the
//! statistics say, marks that one bad value must not hold back, and the
//! ordered claim's key walk (`claim_heads.rs`). Real PostgreSQL, a fresh
//! database each.

mod claim_heads;
mod drain;
mod tenants;

use std::time::Duration;

use super::mark::{Held, Write, MARK};
use super::outbox::{CLAIM_HEADS, CLAIM_TYPED_HEADS};
use super::*;
use crate::testing::{RelayTestDb as _, TestDb};

/// `n` pending `order.placed` rows over `keys` partition keys (`p0`, `p1`, …),
/// row `g` holding key `p{g % keys}` and idempotency key `k{g}`.
async fn fill(client: &tokio_postgres::Client, n: i32, keys: i32) {
    client
        .execute(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key, partition_key)
             SELECT gen_random_uuid(), 'order', 'a' || g, 'order.placed', '{}', 'k' || g, 'p' || (g % $2)
             FROM generate_series(1, $1::int4) g",
            &[&n, &keys],
        )
        .await
        .unwrap();
}

/// The plan PostgreSQL's generic plan for `sql` takes with `params`: what a
/// prepared statement of the relay runs after its fifth execution.
async fn generic_plan(
    client: &tokio_postgres::Client,
    sql: &Sql,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> String {
    client
        .batch_execute("SET plan_cache_mode = force_generic_plan")
        .await
        .unwrap();
    let explain = client
        .prepare_typed(&format!("EXPLAIN {}", sql.text), sql.types)
        .await
        .unwrap();
    let lines: Vec<String> = client
        .query(&explain, params)
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    lines.join("\n")
}

#[test]
fn the_backoff_doubles_to_five_seconds() {
    assert_eq!(reconnect_delay(1), Duration::from_millis(100));
    assert_eq!(reconnect_delay(2), Duration::from_millis(200));
    assert_eq!(reconnect_delay(7), Duration::from_millis(5_000));
    assert_eq!(reconnect_delay(70), Duration::from_millis(5_000));
}

#[test]
fn shard_ids_cover_the_count() {
    let all: Vec<usize> = ShardId::all(3).map(ShardId::index).collect();
    assert_eq!(all, vec![0, 1, 2]);
    assert_eq!(ShardId::new(7).to_string(), "7");
}

/// The marker's UPDATE must find its rows through the primary key whatever the
/// statistics say. Right after a bulk load (no ANALYZE yet) the planner thinks
/// the pending set is tiny; with `published_at IS NULL AND dead_lettered_at IS
/// NULL` in the WHERE clause the generic plan of the prepared statement then
/// scanned every pending row through a partial index and joined it with the
/// batch in a nested loop: O(pending × batch) per mark, about 3 s per 1,000-row
/// mark with 20,000 rows pending, which stalled the whole relay behind its
/// in-flight permits (found by the load-test drain scenario).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mark_update_goes_through_the_primary_key_on_a_fresh_backlog() {
    let db = TestDb::new().await.unwrap();
    let client = db.client().await.unwrap();
    // A backlog written in bulk, as after a COPY or a burst: no ANALYZE ran.
    fill(&client, 20_000, 100).await;
    client
        .batch_execute(
            "UPDATE outbox SET attempt_count = 1, locked_until = now() + interval '1 minute'",
        )
        .await
        .unwrap();
    let ids: Vec<i64> = (1..=1000).collect();
    let attempts = vec![1i32; 1000];
    let kinds = vec![1i16; 1000];
    let delays = vec![0i64; 1000];
    let errors: Vec<Option<&str>> = vec![None; 1000];
    let tokens = vec![1i64; 1000];
    let plan = generic_plan(
        &client,
        &MARK,
        &[&ids, &attempts, &kinds, &delays, &errors, &tokens],
    )
    .await;
    // By primary key (nested loop over the batch), or one hash join over the
    // table when the planner thinks it is small; never the pending set joined
    // row by row with the batch (a nested loop whose join filter compares
    // batch and outbox rows is O(pending × batch)). A filter against the
    // shard leases (at most 1,024 rows: the bucket range) is harmless.
    assert!(
        !plan
            .lines()
            .any(|l| l.contains("Join Filter") && l.contains("o.") && l.contains("u.id")),
        "the mark must not join the batch with a filter:\n{plan}"
    );
    for index in [
        "outbox_pending_age_idx",
        "outbox_ready_idx",
        "outbox_pending_key_idx",
    ] {
        assert!(
            !plan.contains(index),
            "the mark must not walk the pending set ({index}):\n{plan}"
        );
    }
}

/// Right after a bulk load (no ANALYZE yet) the planner takes the outbox for a
/// tiny table. The generic plan of the ordered claim then hashed the whole
/// pending set (through `outbox_ready_idx`) to join it with the key heads:
/// 1.1 s per claim at 1,000,000 pending, ~520 events/s until autoanalyze ran.
/// Each head must be checked through the primary key instead, for a route
/// taking every type and for one taking some (whose heads come from the
/// key's types, through the type index).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ordered_claim_goes_through_the_primary_key_on_a_fresh_backlog() {
    let db = TestDb::new().await.unwrap();
    let client = db.client().await.unwrap();
    fill(&client, 20_000, 500).await;
    let out = vec![1i64, 2];
    let every_type = generic_plan(
        &client,
        &CLAIM_HEADS,
        &[&500i64, &0i16, &i16::MIN, &"", &1i64, &out],
    )
    .await;
    assert_heads_read_by_primary_key(&every_type, &["outbox_bucket_key_idx"]);
    let unless = vec!["audit.%".to_owned()];
    let some_types = generic_plan(
        &client,
        &CLAIM_TYPED_HEADS,
        &[&500i64, &0i16, &"%", &unless, &i16::MIN, &"", &1i64, &out],
    )
    .await;
    assert_heads_read_by_primary_key(
        &some_types,
        &["outbox_bucket_key_idx", "outbox_bucket_key_type_idx"],
    );
}

/// The walk goes through the key indexes `walks`; each head is read by
/// primary key, one at a time, never hash-joined with the outbox.
fn assert_heads_read_by_primary_key(plan: &str, walks: &[&str]) {
    assert!(
        !plan.contains("Hash"),
        "the heads are checked one by one, not hash-joined with the outbox:\n{plan}"
    );
    assert!(plan.contains("outbox_pkey"), "{plan}");
    for index in walks {
        assert!(plan.contains(index), "{index}:\n{plan}");
    }
    for index in [
        "outbox_ready_idx",
        "outbox_bucket_ready_idx",
        "outbox_pending_age_idx",
    ] {
        assert!(
            !plan.contains(index),
            "the claim must not walk the pending set ({index}):\n{plan}"
        );
    }
}

/// Every shard leased to `test` under token 7; each row's id (column 0) and
/// shard (column 1), by id.
async fn lease_every_shard(client: &tokio_postgres::Client) -> Vec<tokio_postgres::Row> {
    client
        .batch_execute(
            "UPDATE outbox_relay_shard_leases
                SET owner = 'test', token = 7, lease_until = now() + interval '1 hour';",
        )
        .await
        .unwrap();
    client
        .query(
            "SELECT o.id, l.shard FROM outbox o JOIN outbox_relay_shard_leases l
               ON o.bucket >= l.bucket_lo AND o.bucket < l.bucket_hi ORDER BY o.id",
            &[],
        )
        .await
        .unwrap()
}

/// One mark PostgreSQL cannot store (a NUL in its text) among good ones:
/// the others are written, the bad one is reported, nothing is kept back.
#[tokio::test]
async fn a_mark_the_database_refuses_does_not_hold_back_the_others() {
    let db = TestDb::new().await.unwrap();
    let client = db.client().await.unwrap();
    fill(&client, 5, 5).await;
    client
        .batch_execute(
            "UPDATE outbox SET attempt_count = 1, locked_until = now() + interval '1 hour';",
        )
        .await
        .unwrap();
    let rows = lease_every_shard(&client).await;
    let writes = [
        Write::Published,
        Write::Dead {
            error: "HTTP 500: \0binary",
            attempted: true,
        },
        Write::Retry {
            delay: Duration::from_secs(60),
            error: "HTTP 503",
        },
        Write::Published,
        Write::Published,
    ];
    let marks: Vec<(Held, Write)> = rows
        .iter()
        .zip(writes)
        .map(|(row, write)| {
            let held = Held {
                id: row.get(0),
                attempt: 1,
                fence: Fence {
                    shard: ShardId::from_sql(row.get(1)),
                    token: 7,
                },
            };
            (held, write)
        })
        .collect();
    let store = Store::with_pool(db.pool(2).unwrap());
    let written = store.session().mark(&marks).await;
    assert!(written.error.is_none());
    assert!(written.unwritten.is_empty());
    assert_eq!(written.refused.len(), 1);
    assert_eq!(written.refused[0].0, 1, "the mark with the NUL");
    assert_eq!(written.applied.len(), 4);
    let flags: Vec<(bool, bool)> = client
        .query(
            "SELECT published_at IS NOT NULL, available_at > now() FROM outbox ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        flags,
        vec![
            (true, false),
            (false, false),
            (false, true),
            (true, false),
            (true, false)
        ]
    );
}

/// A shard of a new layout is taken as "not handed over cleanly" (so its
/// first claim waits for the old owner's requests) whenever the old layout's
/// leases were not all given back, also when they had all ended before the
/// reshard; after a layout whose leases were all given back it is free.
#[tokio::test]
async fn a_reshard_after_leases_that_ended_makes_the_next_owner_wait() {
    let db = TestDb::new().await.unwrap();
    let store = Store::with_pool(db.pool(2).unwrap());
    let me = |id: &str| shards::Replica {
        id: id.to_owned(),
        hostname: "h".to_owned(),
        pid: 1,
        instance: id.to_owned(),
    };
    let mut session = store.session();
    // Never held: nothing to wait for.
    store.reshard(2).await.unwrap();
    let taken = session
        .acquire(&me("a"), Duration::from_secs(60), 2, &[])
        .await
        .unwrap();
    assert!(taken.iter().all(|t| t.previous.is_none()), "{taken:?}");
    // Held, then the lease ended (the owner died) before the reshard.
    db.client()
        .await
        .unwrap()
        .batch_execute(
            "UPDATE outbox_relay_shard_leases SET lease_until = now() - interval '1 minute'",
        )
        .await
        .unwrap();
    store.reshard(3).await.unwrap();
    let taken = session
        .acquire(&me("b"), Duration::from_secs(60), 3, &[])
        .await
        .unwrap();
    assert_eq!(taken.len(), 3);
    assert!(
        taken
            .iter()
            .all(|t| t.previous.as_deref() == Some("(reshard)")),
        "{taken:?}"
    );
    // Given back cleanly: free, no wait.
    let tokens: Vec<i64> = taken.iter().map(|t| t.fence.token).collect();
    db.client()
        .await
        .unwrap()
        .execute(
            "UPDATE outbox_relay_shard_leases SET owner = NULL, lease_until = NULL WHERE token = ANY($1)",
            &[&tokens],
        )
        .await
        .unwrap();
    store.reshard(2).await.unwrap();
    let taken = session
        .acquire(&me("c"), Duration::from_secs(60), 2, &[])
        .await
        .unwrap();
    assert_eq!(taken.len(), 2);
    assert!(taken.iter().all(|t| t.previous.is_none()), "{taken:?}");
}

/// Both claims leave out the rows the claimer has out, so a claim returns
/// only rows it can hand out, however many are in flight.
#[tokio::test]
async fn claims_leave_out_the_rows_in_flight() {
    let db = TestDb::new().await.unwrap();
    let client = db.client().await.unwrap();
    fill(&client, 9, 3).await;
    let store = Store::with_pool(db.pool(2).unwrap());
    store.reshard(1).await.unwrap();
    let fence = store
        .seize_shard(ShardId::new(0), "test", Duration::from_secs(60))
        .await
        .unwrap();
    let mut session = store.session();
    let ids = |claimed: &[outbox::Claimed]| {
        let mut ids: Vec<i64> = claimed.iter().map(|c| c.row.id).collect();
        ids.sort();
        ids
    };
    let scope = |routes, out| outbox::ClaimScope { fence, routes, out };
    let everything = ids(&session
        .claim_due(&scope(&[], &[]), outbox::no_cursor(), 100)
        .await
        .unwrap());
    assert_eq!(everything.len(), 9);
    let out = [everything[0], everything[4], everything[8]];
    let rest = ids(&session
        .claim_due(&scope(&[], &out), outbox::no_cursor(), 100)
        .await
        .unwrap());
    assert_eq!(rest.len(), 6);
    assert!(rest.iter().all(|id| !out.contains(id)), "{rest:?}");
    // Key heads: ids 1..9 over three keys; the heads are 1, 2 and 3. With
    // head 1 out, its key has nothing to claim (its next event waits), and
    // the other two heads come back.
    let ordered = outbox::RouteTypes {
        like: "order.%".to_owned(),
        unless: Vec::new(),
    };
    let first = [everything[0]];
    let got = ids(&session
        .claim_heads(&scope(&[], &first), &ordered, &outbox::no_key_cursor(), 100)
        .await
        .unwrap());
    assert_eq!(got, [everything[1], everything[2]]);
}

/// QStash's "retrying" callback extends a held row's `locked_until`; the
/// relay's own mark of that row can land after it (the mark is batched, and
/// the callback may come first; or the row was sent again when its hold ran
/// out, and the first copy's callback comes before the re-send's outcome).
/// No mark may shorten or clear that hold: the key would move on, or the row
/// be sent again, while QStash still retries it.
#[tokio::test]
async fn a_mark_never_shortens_a_hold_a_callback_extended() {
    let db = TestDb::new().await.unwrap();
    let client = db.client().await.unwrap();
    fill(&client, 3, 3).await;
    // Rows 2 and 3: held once, and the hold ran out (so they are claimed
    // again for another send).
    client
        .batch_execute(
            "UPDATE outbox SET attempt_count = 1, accepted_at = now() - interval '2 hours',
                    locked_until = now() - interval '1 hour'
              WHERE idempotency_key IN ('k2', 'k3')",
        )
        .await
        .unwrap();
    let store = Store::with_pool(db.pool(2).unwrap());
    store.reshard(1).await.unwrap();
    let fence = store
        .seize_shard(ShardId::new(0), "test", Duration::from_secs(60))
        .await
        .unwrap();
    let mut session = store.session();
    let scope = outbox::ClaimScope {
        fence,
        routes: &[],
        out: &[],
    };
    let mut claimed = session
        .claim_due(&scope, outbox::no_cursor(), 100)
        .await
        .unwrap();
    claimed.sort_by_key(|c| c.row.id);
    assert_eq!(claimed.len(), 3);
    // The callbacks come first: each says QStash will retry, hold an hour.
    for (c, key) in claimed.iter().zip(["k1", "k2", "k3"]) {
        let marked = store
            .reported_outcome(
                c.row.id,
                key,
                callbacks::DeliveryOutcome::Retrying {
                    hold: Duration::from_secs(3600),
                },
                "qstash: status 500 after 1 retries",
            )
            .await
            .unwrap();
        assert_eq!(marked, callbacks::ReportedOutcome::Marked);
    }
    // Then the relay's marks: QStash took row 1 (hold for a minute); the
    // re-send of row 2 failed (retry), row 3's route paused (defer).
    let marks = [
        Write::Hold {
            delay: Duration::from_secs(60),
        },
        Write::Retry {
            delay: Duration::from_millis(100),
            error: "HTTP 503",
        },
        Write::Defer {
            delay: Duration::from_millis(100),
            error: "route paused",
        },
    ];
    let marks: Vec<(Held, Write)> = claimed.iter().map(|c| c.held(fence)).zip(marks).collect();
    let written = session.mark(&marks).await;
    assert!(written.error.is_none(), "{:?}", written.error);
    assert_eq!(written.applied.len(), 3);
    let holds: Vec<(String, bool)> = client
        .query(
            "SELECT idempotency_key, coalesce(locked_until > now() + interval '50 minutes', false)
               FROM outbox ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        holds,
        [
            ("k1".to_owned(), true),
            ("k2".to_owned(), true),
            ("k3".to_owned(), true)
        ],
        "a mark shortened or cleared the hour a callback asked for"
    );
}

/// A flush split over two connections writes each part as one flush would:
/// fenced by token (the rows claimed under a token that is not the shard's
/// are refused, in both parts) and by attempt (a row marked twice in the
/// flush, its two marks side by side at the split, applies once), and a bad
/// value refused in one part is reported at its place in the whole flush.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_split_over_two_connections_is_fenced_like_one() {
    let db = TestDb::new().await.unwrap();
    let client = db.client().await.unwrap();
    fill(&client, 1000, 50).await;
    let rows = lease_every_shard(&client).await;
    // Odd ids under a stale token; id 500 twice (the split falls on it);
    // id 900 with a value PostgreSQL cannot store.
    let mut marks: Vec<(Held, Write)> = Vec::new();
    for row in &rows {
        let id: i64 = row.get(0);
        let held = Held {
            id,
            attempt: 0,
            fence: Fence {
                shard: ShardId::from_sql(row.get(1)),
                token: if id % 2 == 1 { 6 } else { 7 },
            },
        };
        let write = if id == 900 {
            Write::Dead {
                error: "\0",
                attempted: true,
            }
        } else {
            Write::Published
        };
        marks.push((held, write));
        if id == 500 {
            marks.push((held, Write::Published));
        }
    }
    let store = Store::with_pool(db.pool(3).unwrap());
    let mut sessions = vec![store.session(), store.session()];
    let written = crate::store::mark::mark_split(&mut sessions, &marks).await;
    assert!(written.error.is_none() && written.unwritten.is_empty());
    let refused: Vec<usize> = written.refused.iter().map(|(i, _)| *i).collect();
    let at_900 = marks.iter().position(|(h, _)| h.id == 900).unwrap();
    assert_eq!(
        refused,
        [at_900],
        "the bad value, at its place in the flush"
    );
    let mut applied: Vec<i64> = written.applied.iter().copied().collect();
    applied.sort_unstable();
    let even: Vec<i64> = (1..=1000).filter(|id| id % 2 == 0 && *id != 900).collect();
    assert_eq!(applied, even, "only the current token's rows");
    let counts: (i64, i64) = {
        let row = client
            .query_one(
                "SELECT count(*) FILTER (WHERE published_at IS NOT NULL),
                        count(*) FILTER (WHERE attempt_count > 1)
                 FROM outbox",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(
        counts,
        (499, 0),
        "published once each; row 500 counted once"
    );
    // Both connections wrote.
    assert!(sessions.iter().all(|s| s.failures() == 0));
}
