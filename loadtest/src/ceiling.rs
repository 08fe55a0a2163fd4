//! `loadtest sql-ceiling`: the relay's own claim (a read) and mark (the one
//! write per event) in a loop on the same database, with no HTTP at all, one
//! claimer per shard as the relay runs them. What it drains per second is the most any relay built on
//! these statements can reach here; reports print the relay's throughput as a
//! fraction of it.

use std::time::{Duration, Instant};

use outbox_relay::store::mark::{Held, Write};
use outbox_relay::store::outbox::{no_cursor, ClaimScope, Claimed};
use outbox_relay::store::{ShardId, Store, StoreError};
use serde::Serialize;

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Ceiling {
    pub rows: u64,
    pub elapsed_secs: f64,
    pub rows_per_sec: f64,
    pub shards: u32,
    pub claim_batch: i64,
    pub statements: u64,
}

/// Claims and marks published every pending row, shard by shard in parallel,
/// until none is left.
pub async fn run(database_url: &str, claim_batch: i64) -> Result<Ceiling, StoreError> {
    let admin = Store::for_command(database_url)?;
    let shards = admin.shard_count().await?;
    let store = Store::open(database_url, shards + 1, Duration::from_secs(10))?;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for shard in ShardId::all(shards) {
        let store = store.clone();
        tasks.spawn(async move {
            let fence = store
                .seize_shard(shard, "sql-ceiling", Duration::from_secs(3600))
                .await?;
            let scope = ClaimScope {
                fence,
                routes: &[],
                out: &[],
            };
            let mut session = store.session();
            let (mut rows, mut statements) = (0u64, 0u64);
            let mut cursor = no_cursor();
            loop {
                let claimed = session.claim_due(&scope, cursor, claim_batch).await?;
                statements += 1;
                if claimed.is_empty() {
                    break;
                }
                cursor = claimed
                    .iter()
                    .map(Claimed::cursor)
                    .max()
                    .expect("not empty");
                let marks: Vec<(Held, Write)> = claimed
                    .iter()
                    .map(|c| (c.held(fence), Write::Published))
                    .collect();
                let written = session.mark(&marks).await;
                if let Some(e) = written.error {
                    return Err(e);
                }
                statements += 1;
                rows += written.applied.len() as u64;
            }
            store.release_shard(fence).await?;
            Ok::<_, StoreError>((rows, statements))
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
