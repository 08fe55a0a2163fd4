//! The plans of tenant fairness's statements on a fresh backlog (no ANALYZE
//! yet, the planner's worst guess): both go through the tenant index, never
//! through the shard's ready order, which would read the other tenants' rows.

use super::super::tenants::{CLAIM_TENANTS, TENANTS};
use super::*;
use chrono::{DateTime, Utc};
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tenant_statements_go_through_the_tenant_index_on_a_fresh_backlog() {
    let db = TestDb::new().await.unwrap();
    let client = db.client().await.unwrap();
    fill(&client, 20_000, 500).await;
    let listing = generic_plan(&client, &TENANTS, &[&500i64, &0i16, &Uuid::nil(), &1i64]).await;
    assert!(listing.contains("outbox_tenant_ready_idx"), "{listing}");
    let start: DateTime<Utc> = DateTime::UNIX_EPOCH;
    let tenants = vec![Uuid::from_u128(1), Uuid::from_u128(2)];
    let claim = generic_plan(
        &client,
        &CLAIM_TENANTS,
        &[
            &tenants,
            &0i16,
            &vec![250i64, 250],
            &vec![i16::MIN, i16::MIN],
            &vec![start, start],
            &vec![i64::MIN, i64::MIN],
            &1i64,
            &vec!["%".to_owned()],
            &vec![1i64, 2],
            &vec![false],
        ],
    )
    .await;
    assert!(claim.contains("outbox_tenant_ready_idx"), "{claim}");
    for index in [
        "outbox_bucket_ready_idx",
        "outbox_ready_idx",
        "outbox_pending_age_idx",
    ] {
        assert!(
            !claim.contains(index) && !listing.contains(index),
            "the tenant statements must not walk the pending set ({index}):\n{listing}\n{claim}"
        );
    }
    assert!(!claim.contains("Sort"), "read in index order:\n{claim}");
}
