//! Handle each message once: the dedupe row in `processed_messages` and the
//! handler's own writes commit in one transaction, so a redelivered message
//! finds the row and is skipped, and a failed handler leaves no row behind.

use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, GenericClient, Transaction};

/// The header the relay forwards the outbox row id in; consumers key on it.
pub const OUTBOX_ID_HEADER: &str = "x-outbox-id";

/// What [`consume_once`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Consumed<T> {
    /// The work ran and committed with the dedupe row.
    Processed(T),
    /// Another delivery of this message already committed; the work did not run.
    Duplicate,
}

impl<T> Consumed<T> {
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Consumed::Duplicate)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConsumeError<E> {
    /// The work failed; its writes and the dedupe row were rolled back.
    #[error("handler failed: {0}")]
    Work(E),
    /// Opening, writing or committing the dedupe transaction failed; nothing
    /// of it committed, so the delivery can be retried.
    #[error("database: {0}")]
    Db(#[from] tokio_postgres::Error),
}

// A concurrent delivery of the same message blocks on the primary key until
// the first transaction ends: then it conflicts (committed) or inserts
// (rolled back), so exactly one delivery runs the work to commit.
const CLAIM_MESSAGE: &str = "INSERT INTO processed_messages (consumer, message_id)
VALUES ($1, $2)
ON CONFLICT (consumer, message_id) DO NOTHING";

/// Runs `work` at most once to commit per `(consumer, message_id)`.
///
/// `client` is any `tokio_postgres` connection: a [`Client`] (from a pool,
/// `&mut *pooled`), on which a transaction is opened and committed here, or a
/// [`Transaction`] the caller already has open, in which the dedupe row and
/// the work go into a savepoint and commit when the caller commits.
///
/// `work` gets the transaction holding the dedupe row; whatever it writes
/// through it commits or rolls back together with that row:
///
/// ```no_run
/// # async fn f(client: &mut tokio_postgres::Client) {
/// use outbox_client::consumer::{consume_once, Consumed};
/// let r = consume_once(client, "billing", "42", |tx| {
///     Box::pin(async move {
///         tx.execute("UPDATE accounts SET n = n + 1", &[]).await
///     })
/// })
/// .await;
/// # }
/// ```
pub async fn consume_once<C, T, E, F>(
    client: &mut C,
    consumer: &str,
    message_id: &str,
    work: F,
) -> Result<Consumed<T>, ConsumeError<E>>
where
    C: GenericClient,
    F: for<'a> FnOnce(&'a Transaction<'a>) -> BoxFuture<'a, Result<T, E>>,
{
    let tx = client.transaction().await?;
    let inserted = tx
        .execute_typed(
            CLAIM_MESSAGE,
            &[(&consumer, Type::TEXT), (&message_id, Type::TEXT)],
        )
        .await?;
    if inserted == 0 {
        tx.rollback().await?;
        return Ok(Consumed::Duplicate);
    }
    match work(&tx).await {
        Ok(value) => {
            tx.commit().await?;
            Ok(Consumed::Processed(value))
        }
        Err(e) => {
            // A failed rollback still discards the transaction server-side
            // (dropping it rolls back too); the work error matters more.
            if let Err(rollback) = tx.rollback().await {
                tracing::debug!(error = %rollback, "rollback after a failed handler");
            }
            Err(ConsumeError::Work(e))
        }
    }
}

const PRUNE_CUTOFF: &str = "SELECT now() - make_interval(secs => $1)";

const PRUNE_BATCH: &str = "DELETE FROM processed_messages
WHERE (consumer, message_id) IN (
    SELECT consumer, message_id FROM processed_messages
    WHERE processed_at < $1
    LIMIT $2
)";

/// Deletes dedupe rows older than `older_than`, `batch` rows per statement
/// (each its own short transaction on `client`, no long lock), until none is
/// left; returns how many. Keep `older_than` well past the longest
/// redelivery window (QStash retries for up to days): a message redelivered
/// after its row is pruned runs again.
pub async fn prune_processed(
    client: &Client,
    older_than: Duration,
    batch: i64,
) -> Result<u64, tokio_postgres::Error> {
    let batch = batch.max(1);
    // One cutoff for the whole run, on the database's clock (the one that
    // wrote processed_at), so rows that age meanwhile are left alone.
    let cutoff: chrono::DateTime<chrono::Utc> = client
        .query_typed_one(PRUNE_CUTOFF, &[(&older_than.as_secs_f64(), Type::FLOAT8)])
        .await?
        .get(0);
    let mut total = 0;
    loop {
        let deleted = client
            .execute_typed(
                PRUNE_BATCH,
                &[(&cutoff, Type::TIMESTAMPTZ), (&batch, Type::INT8)],
            )
            .await?;
        total += deleted;
        if deleted < batch as u64 {
            return Ok(total);
        }
    }
}
