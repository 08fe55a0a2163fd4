//! How many shards the outbox is hashed into. Every relay must agree with the
//! database; changing the count rewrites each row's shard.

use tokio_postgres::Client;

use crate::relay::SHARDS_SQL;

/// Rows are re-sharded in one transaction that holds off writers; run it with
/// the relays stopped (they refuse to start on a count that differs).
const RESHARD_SQL: &str = "UPDATE outbox SET shard = (hashtext(partition_key) & 2147483647) % $1";

/// Replicas holding a live shard lease (they must be stopped first).
const LIVE_OWNERS_SQL: &str = "SELECT DISTINCT owner FROM outbox_relay_shard_leases
WHERE owner IS NOT NULL AND lease_until > now() ORDER BY owner";

/// One lease row per shard: drop those past the new count, add the missing.
const RESHARD_LEASES_SQL: &str = "WITH gone AS (
    DELETE FROM outbox_relay_shard_leases WHERE shard >= $1::int
)
INSERT INTO outbox_relay_shard_leases (shard)
SELECT generate_series(0, $1::int - 1) ON CONFLICT (shard) DO NOTHING";

/// Current shard count.
pub async fn shards(client: &Client) -> Result<i32, tokio_postgres::Error> {
    Ok(client.query_one(SHARDS_SQL, &[]).await?.get(0))
}

/// Sets the shard count to `n` (1–1024) and re-hashes every row. Returns the
/// number of rows rewritten.
pub async fn reshard(client: &mut Client, n: i32) -> Result<u64, ReshardError> {
    if !(1..=1024).contains(&n) {
        return Err(ReshardError::OutOfRange(n));
    }
    let tx = client.transaction().await?;
    // Inserts wait for the few seconds this takes, so no row is hashed with
    // the old count after the new one is set.
    tx.batch_execute("LOCK TABLE outbox IN SHARE ROW EXCLUSIVE MODE")
        .await?;
    let owners: Vec<String> = tx
        .query(LIVE_OWNERS_SQL, &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if !owners.is_empty() {
        return Err(ReshardError::RelaysRunning(owners.join(", ")));
    }
    tx.execute("UPDATE outbox_relay_settings SET shards = $1", &[&n])
        .await?;
    tx.execute(RESHARD_LEASES_SQL, &[&n]).await?;
    let rows = tx.execute(RESHARD_SQL, &[&n]).await?;
    tx.commit().await?;
    Ok(rows)
}

#[derive(Debug, thiserror::Error)]
pub enum ReshardError {
    #[error("the shard count must be between 1 and 1024, not {0}")]
    OutOfRange(i32),
    #[error("relays are running (replicas holding shard leases: {0}); stop them first")]
    RelaysRunning(String),
    #[error("database: {0}")]
    Postgres(#[from] tokio_postgres::Error),
}
