//! The marks QStash's callbacks ask for: a delivery callback's outcome on a
//! row held for it, and a failure callback's dead letter. Each one row, on
//! the callback pool, checked against the deduplication id QStash names.
use std::time::Duration;

use tokio_postgres::types::Type;

use super::{Store, StoreError};

/// QStash gave up on a message: the row is dead-lettered if it is still on
/// the deduplication id the report is about and was published under it.
/// Returns the row's current key, whether it is published, and whether it
/// was marked.
/// "Taken by QStash" is `published_at` (a route without callbacks) or
/// `accepted_at` (an ordered route holding the row for its callback).
const REPORTED_DEAD: &str = "WITH target AS (
    SELECT id, idempotency_key, published_at IS NOT NULL OR accepted_at IS NOT NULL AS taken
    FROM outbox WHERE id = $1
), marked AS (
    UPDATE outbox o
    SET dead_lettered_at = coalesce(o.dead_lettered_at, now()),
        last_error = $2,
        locked_until = NULL
    FROM target t
    WHERE o.id = t.id AND t.idempotency_key = $3 AND t.taken
    RETURNING o.id
), wake AS (
    SELECT nextval(pg_get_serial_sequence('outbox', 'id'))
    WHERE EXISTS (SELECT FROM marked)
)
SELECT t.idempotency_key, t.taken, EXISTS (SELECT 1 FROM marked), (SELECT count(*) FROM wake)
FROM target t";

/// A delivery callback's outcome on a held row (`$2`: 1 delivered, 2 QStash
/// tries again, 3 the last attempt failed), for the attempt under
/// deduplication id `$3`: published, held `$5` ms longer with `$4` as the
/// error, or dead-lettered with it (a report that QStash retries also
/// records that QStash took the row, `accepted_at`, when it comes before the
/// hold's own mark). Only while the row is still on that id
/// and not final. A row whose key may move on wakes the relays (their
/// listeners watch the id sequence). Answers the row's current key, whether
/// it was final already, and whether it was marked; no row when the id is
/// unknown.
const REPORTED_OUTCOME: &str = "WITH target AS (
    SELECT id, idempotency_key, coalesce(published_at, dead_lettered_at) IS NOT NULL AS final
    FROM outbox WHERE id = $1
), marked AS (
    UPDATE outbox o
    SET published_at     = CASE WHEN $2 = 1 THEN now() ELSE o.published_at END,
        dead_lettered_at = CASE WHEN $2 = 3 THEN now() ELSE o.dead_lettered_at END,
        locked_until     = CASE WHEN $2 = 2
                                THEN greatest(o.locked_until, now() + $5 * interval '1 millisecond')
                           END,
        accepted_at      = CASE WHEN $2 = 2 THEN coalesce(o.accepted_at, now())
                                ELSE o.accepted_at END,
        last_error       = CASE WHEN $2 = 1 THEN NULL ELSE $4 END
    FROM target t
    WHERE o.id = t.id AND t.idempotency_key = $3 AND NOT t.final
    RETURNING o.id
), wake AS (
    SELECT nextval(pg_get_serial_sequence('outbox', 'id'))
    WHERE $2 IN (1, 3) AND EXISTS (SELECT FROM marked)
)
SELECT t.idempotency_key, t.final, EXISTS (SELECT 1 FROM marked), (SELECT count(*) FROM wake)
FROM target t";

/// What a delivery callback says of the destination's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryOutcome {
    /// It answered 2xx: published, the key moves on.
    Delivered,
    /// It did not, and QStash tries again: still held, for `hold` more.
    Retrying { hold: Duration },
    /// The last attempt failed: dead-lettered, the key moves on.
    Failed,
}

/// What a delivery callback's mark found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReportedOutcome {
    Marked,
    /// No such row.
    Unknown,
    /// The row has moved on to another deduplication id (a replay).
    Replaced {
        current: String,
    },
    /// Published or dead-lettered already (a callback QStash sent again, or
    /// one that came after the hold ran out and the row was settled).
    Final,
}

/// What a failure callback's mark found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReportedDead {
    /// The row was dead-lettered (or already was).
    Marked,
    /// No such row.
    Unknown,
    /// The row has moved on to another deduplication id (a replay).
    Replaced { current: String },
    /// Not taken by QStash under that id yet: the report is early or forged.
    NotPublished,
}

impl Store {
    /// QStash reports it gave up delivering row `id` under `deduplication_id`:
    /// dead-letter it with `error`, unless the row has moved on since.
    pub(crate) async fn reported_dead(
        &self,
        id: i64,
        error: &str,
        deduplication_id: &str,
    ) -> Result<ReportedDead, StoreError> {
        let row = self
            .conn()
            .await?
            .query_typed_opt(
                REPORTED_DEAD,
                &[
                    (&id, Type::INT8),
                    (&error, Type::TEXT),
                    (&deduplication_id, Type::TEXT),
                ],
            )
            .await?;
        let Some(row) = row else {
            return Ok(ReportedDead::Unknown);
        };
        let (current, taken, marked): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
        Ok(if marked {
            ReportedDead::Marked
        } else if current != deduplication_id {
            ReportedDead::Replaced { current }
        } else {
            debug_assert!(!taken);
            ReportedDead::NotPublished
        })
    }

    /// QStash's delivery callback for row `id` under `deduplication_id`:
    /// write the destination's answer on the held row, unless the row has
    /// moved on since.
    pub(crate) async fn reported_outcome(
        &self,
        id: i64,
        deduplication_id: &str,
        outcome: DeliveryOutcome,
        error: &str,
    ) -> Result<ReportedOutcome, StoreError> {
        let (kind, hold_ms): (i32, i64) = match outcome {
            DeliveryOutcome::Delivered => (1, 0),
            DeliveryOutcome::Retrying { hold } => (2, hold.as_millis() as i64),
            DeliveryOutcome::Failed => (3, 0),
        };
        let row = self
            .conn()
            .await?
            .query_typed_opt(
                REPORTED_OUTCOME,
                &[
                    (&id, Type::INT8),
                    (&kind, Type::INT4),
                    (&deduplication_id, Type::TEXT),
                    (&error, Type::TEXT),
                    (&hold_ms, Type::INT8),
                ],
            )
            .await?;
        let Some(row) = row else {
            return Ok(ReportedOutcome::Unknown);
        };
        let (current, final_, marked): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
        Ok(if marked {
            ReportedOutcome::Marked
        } else if current != deduplication_id {
            ReportedOutcome::Replaced { current }
        } else {
            debug_assert!(final_);
            ReportedOutcome::Final
        })
    }
}
