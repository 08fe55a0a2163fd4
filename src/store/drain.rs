//! `drain`'s completion check, run every `drain_poll` for the whole drain:
//! is anything due (or retrying within the horizon) or held for a delivery
//! callback? It reads the pending rows through `outbox_bucket_ready_idx` and stops
//! at the first one that keeps the drain running; the counts of what is left
//! ([`Store::drain_state`]) are read once, when the drain stops.

use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::types::Type;

use super::{Sql, Store, StoreError};

/// True while a pending row is due now (or, after a failed attempt or a
/// deferral before its first counted attempt, which leaves a `last_error`,
/// within `$1` ms) or held for a delivery callback. A held row is one that was
/// claimed, so its `available_at` is in the past (a hold never moves it):
/// both kinds have `available_at` up to now + `$1`, which the index tests
/// without reading the heap, so a row scheduled further off costs one index
/// entry, not a heap visit. A scalar subquery in the order of
/// `outbox_bucket_ready_idx` (the claim's own index: no index is kept for
/// this check alone, migration 0014), so even statistics from before the
/// drain (every row pending) cannot make it a scan of the table; it stops at
/// the first row that keeps the drain running.
pub(crate) const DRAIN_BUSY: Sql = Sql {
    text: "SELECT (SELECT id FROM outbox
    WHERE published_at IS NULL AND dead_lettered_at IS NULL
      AND available_at <= now() + $1::int8 * interval '1 millisecond'
      AND (attempt_count > 0 OR last_error IS NOT NULL OR available_at <= now()
           OR (accepted_at IS NOT NULL AND locked_until > now()))
    ORDER BY bucket, available_at, id LIMIT 1) IS NOT NULL",
    types: &[Type::INT8],
};

impl Store {
    /// Whether a drain has work left: a row due (a retry due within
    /// `horizon` counts) or held for a delivery callback. Rows scheduled
    /// for later do not count.
    pub(crate) async fn drain_busy(&self, horizon: Duration) -> Result<bool, StoreError> {
        let horizon_ms = horizon.as_millis() as i64;
        let row = self
            .conn()
            .await?
            .query_typed(DRAIN_BUSY.text, &[(&horizon_ms, Type::INT8)])
            .await?;
        Ok(row[0].get(0))
    }
}

/// Pending rows that are due (a retry, or a row deferred before its first
/// counted attempt, which has a `last_error`, counts as due when it comes
/// within `$1` ms), all pending rows, and the earliest future `available_at`.
pub(crate) const DRAIN_STATE: &str = "SELECT
    count(*) FILTER (WHERE NOT (accepted_at IS NOT NULL AND locked_until > now())
        AND available_at <= now()
        + CASE WHEN attempt_count > 0 OR last_error IS NOT NULL
               THEN $1::int8 * interval '1 millisecond'
               ELSE interval '0' END),
    count(*),
    min(available_at) FILTER (WHERE available_at > now()),
    count(*) FILTER (WHERE accepted_at IS NOT NULL AND locked_until > now())
FROM outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL";

/// How far the drain has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DrainState {
    /// Pending rows due now (or retrying within the horizon asked for),
    /// leaving out those held for a delivery callback.
    pub due: i64,
    pub pending: i64,
    /// Rows QStash took for an ordered route, held until its delivery
    /// callback says what the destination answered.
    pub held: i64,
    /// The earliest time a row scheduled for later becomes due.
    pub next_due: Option<DateTime<Utc>>,
}

impl Store {
    /// How far a drain has come; a retry due within `horizon` counts as due.
    pub(crate) async fn drain_state(&self, horizon: Duration) -> Result<DrainState, StoreError> {
        let horizon_ms = horizon.as_millis() as i64;
        let row = self
            .conn()
            .await?
            .query_one(DRAIN_STATE, &[&horizon_ms])
            .await?;
        Ok(DrainState {
            due: row.get(0),
            pending: row.get(1),
            next_due: row.get(2),
            held: row.get(3),
        })
    }
}
