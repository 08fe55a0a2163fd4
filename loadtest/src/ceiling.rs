//! `loadtest sql-ceiling`: the relay's own claim and mark statements in a loop
//! on the same database, with no HTTP at all, one claimer per shard as the
//! relay runs them. What it drains per second is the most any relay built on
//! these statements can reach here; reports print the relay's throughput as a
//! fraction of it.

use std::time::Instant;

use outbox_relay::actors::claimer::{no_cursor, CLAIM_SQL, CLAIM_TYPES};
use outbox_relay::actors::marker::{MARK_SQL, MARK_TYPES};
use serde::Serialize;

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Ceiling {
    pub rows: u64,
    pub elapsed_secs: f64,
    pub rows_per_sec: f64,
    pub shards: i32,
    pub claim_batch: i64,
    pub statements: u64,
}

/// Claims and marks published every pending row, shard by shard in parallel,
/// until none is left.
pub async fn run(
    database_url: &str,
    claim_batch: i64,
) -> Result<Ceiling, outbox_relay::db::DbError> {
    let admin = outbox_relay::db::connect(database_url).await?;
    let shards: i32 = admin
        .query_one(outbox_relay::relay::SHARDS_SQL, &[])
        .await?
        .get(0);
    let lease_ms: i64 = 60_000;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for shard in 0..shards as i16 {
        let url = database_url.to_owned();
        tasks.spawn(async move {
            let client = outbox_relay::db::connect(&url).await?;
            let token = outbox_relay::actors::coordinator::seize_shard(
                &client,
                shard,
                "sql-ceiling",
                std::time::Duration::from_secs(3600),
            )
            .await?;
            let claim = client.prepare_typed(CLAIM_SQL, CLAIM_TYPES).await?;
            let mark = client.prepare_typed(MARK_SQL, MARK_TYPES).await?;
            let (mut rows, mut statements) = (0u64, 0u64);
            let mut cursor = no_cursor();
            loop {
                let claimed = client
                    .query(
                        &claim,
                        &[
                            &claim_batch,
                            &lease_ms,
                            &shard,
                            &cursor.0,
                            &cursor.1,
                            &token,
                        ],
                    )
                    .await?;
                statements += 1;
                if claimed.is_empty() {
                    break;
                }
                let ids: Vec<i64> = claimed.iter().map(|r| r.get(0)).collect();
                let attempts: Vec<i32> = claimed.iter().map(|r| r.get(10)).collect();
                cursor = claimed
                    .iter()
                    .map(|r| (r.get(11), r.get::<_, i64>(0)))
                    .max()
                    .expect("not empty");
                let kinds = vec![1i16; ids.len()];
                let delays = vec![0i64; ids.len()];
                let errors: Vec<Option<&str>> = vec![None; ids.len()];
                let tokens = vec![token; ids.len()];
                client
                    .query(&mark, &[&ids, &attempts, &kinds, &delays, &errors, &tokens])
                    .await?;
                statements += 1;
                rows += ids.len() as u64;
            }
            outbox_relay::actors::coordinator::release_shard(&client, token).await?;
            Ok::<_, outbox_relay::db::DbError>((rows, statements))
        });
    }
    let (mut rows, mut statements) = (0, 0);
    while let Some(done) = tasks.join_next().await {
        let (r, s) = done.expect("ceiling task panicked")?;
        rows += r;
        statements += s;
    }
    let elapsed_secs = started.elapsed().as_secs_f64();
    Ok(Ceiling {
        rows,
        elapsed_secs,
        rows_per_sec: rows as f64 / elapsed_secs.max(1e-9),
        shards,
        claim_batch,
        statements,
    })
}
