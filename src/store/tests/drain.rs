//! `drain`'s completion check: it reads the pending rows through their
//! partial index, never the whole table, and keeps drain's meaning (held
//! rows keep it running, rows due later do not).

use std::time::Duration;

use super::{fill, generic_plan};
use crate::store::drain::DRAIN_BUSY;
use crate::store::Store;
use crate::testing::{RelayTestDb as _, TestDb};

/// An outbox of 50,000 rows drained to a few pending, its statistics from
/// before the drain (autoanalyze runs after 2% of the rows changed, and a
/// drain changes them all): the check, run 5 times a second for the whole
/// drain, must not scan the table. (The check of before, counts over the
/// pending rows, was a Parallel Seq Scan on outbox here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_check_reads_only_pending_rows() {
    let db = TestDb::new().await.unwrap();
    let client = db.client().await.unwrap();
    fill(&client, 50_000, 1_000).await;
    client
        .batch_execute("ANALYZE outbox; UPDATE outbox SET published_at = now() WHERE id > 5;")
        .await
        .unwrap();
    let plan = generic_plan(&client, &DRAIN_BUSY, &[&60_000i64]).await;
    assert!(
        !plan.contains("Seq Scan"),
        "the drain check scans the table:\n{plan}"
    );
    assert!(plan.contains("outbox_bucket_ready_idx"), "{plan}");
    assert!(!plan.contains("Sort"), "read in index order:\n{plan}");
}

/// Due rows and held rows keep a drain running; rows scheduled for later do
/// not, unless they are retries due within the horizon.
#[tokio::test]
async fn the_drain_check_waits_for_due_and_held_rows_only() {
    let db = TestDb::new().await.unwrap();
    let client = db.client().await.unwrap();
    let store = Store::with_pool(db.pool(2).unwrap());
    let hour = Duration::from_secs(3_600);
    let busy = |horizon| {
        let store = store.clone();
        async move { store.drain_busy(horizon).await.unwrap() }
    };
    assert!(!busy(hour).await, "an empty outbox");
    fill(&client, 3, 3).await;
    assert!(busy(Duration::ZERO).await, "rows due now");
    let set = |sql: &'static str| {
        let client = &client;
        async move { client.batch_execute(sql).await.unwrap() }
    };
    // A new row scheduled by its producer for later: left for the next run,
    // whatever the horizon.
    set("UPDATE outbox SET published_at = now() WHERE id > 1;
         UPDATE outbox SET available_at = now() + interval '30 minutes' WHERE id = 1")
    .await;
    assert!(!busy(hour).await, "a new row due later");
    // A retry due within the horizon counts as due; one further off does not.
    set("UPDATE outbox SET attempt_count = 1 WHERE id = 1").await;
    assert!(busy(hour).await, "a retry due within the horizon");
    assert!(!busy(Duration::from_secs(60)).await, "a retry due later");
    // Held for a delivery callback (claimed, so due since before the claim):
    // the drain waits for its callback.
    set(
        "UPDATE outbox SET available_at = now() - interval '1 minute',
            accepted_at = now(), locked_until = now() + interval '10 minutes' WHERE id = 1",
    )
    .await;
    assert!(busy(Duration::ZERO).await, "a held row");
    set("UPDATE outbox SET dead_lettered_at = now() WHERE id = 1").await;
    assert!(!busy(hour).await, "everything settled");
}
