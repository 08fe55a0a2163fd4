//! The marker's UPDATE must find its rows through the primary key whatever the
//! statistics say. Right after a bulk load (no ANALYZE yet) the planner thinks
//! the pending set is tiny; with `published_at IS NULL AND dead_lettered_at IS
//! NULL` in the WHERE clause the generic plan of the prepared statement then
//! scanned every pending row through a partial index and joined it with the
//! batch in a nested loop: O(pending × batch) per mark, about 3 s per 1,000-row
//! mark with 20,000 rows pending, which stalled the whole relay behind its
//! in-flight permits (found by the load-test drain scenario).

mod common;

use outbox_relay::actors::marker::{MARK_SQL, MARK_TYPES};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mark_update_goes_through_the_primary_key_on_a_fresh_backlog() {
    let db = common::test_db().await;
    let client = db.client().await.unwrap();
    // A backlog written in bulk, as after a COPY or a burst: no ANALYZE ran.
    client
        .batch_execute(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key, partition_key)
             SELECT gen_random_uuid(), 'order', 'a' || g, 'order.placed', '{}', 'k' || g, 'p' || (g % 100)
             FROM generate_series(1, 20000) g;
             UPDATE outbox SET attempt_count = 1, locked_until = now() + interval '1 minute';",
        )
        .await
        .unwrap();
    // The relay's prepared statement switches to the generic plan after five runs.
    client
        .batch_execute("SET plan_cache_mode = force_generic_plan")
        .await
        .unwrap();
    let explain = format!("EXPLAIN {MARK_SQL}");
    let stmt = client.prepare_typed(&explain, MARK_TYPES).await.unwrap();
    let ids: Vec<i64> = (1..=1000).collect();
    let attempts = vec![1i32; 1000];
    let kinds = vec![1i16; 1000];
    let delays = vec![0i64; 1000];
    let errors: Vec<Option<&str>> = vec![None; 1000];
    let tokens = vec![1i64; 1000];
    let plan: Vec<String> = client
        .query(&stmt, &[&ids, &attempts, &kinds, &delays, &errors, &tokens])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let plan = plan.join("\n");
    // By primary key (nested loop over the batch), or one hash join over the
    // table when the planner thinks it is small; never the pending set joined
    // row by row (a nested loop with a join filter is O(pending × batch)).
    // (A filter on the shard-lease side, a handful of rows, is harmless.)
    assert!(
        !plan
            .lines()
            .any(|l| l.contains("Join Filter") && l.contains("o.")),
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
