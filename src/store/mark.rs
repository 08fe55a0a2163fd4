//! Marks: every outcome of a flush written in multi-row UPDATEs, the one
//! write an event costs, fenced by the attempt the claim read and by the
//! shard's token. A large flush is split over several sessions (the
//! marker's `relay.mark_connections`) that write in parallel: on a durable
//! database one connection's mark was about 80% of a drain's time, CPU in
//! that backend (each published row is a non-HOT update entering the primary
//! key, the idempotency key and the published-at index), so one backend
//! bounded the drain. Each part is fenced as a whole flush is; a row's
//! marks all go to one part (the batch is split by id), so two parts never
//! wait on each other's row locks.
use std::collections::HashSet;
use std::ops::Range;
use std::time::Duration;

use tokio_postgres::types::Type;

use super::{Fence, Session, Sql, StoreError};

/// A row this relay holds a lease on, with what fences its mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub id: i64,
    /// The row's `attempt_count` as the claim read it: the mark applies only
    /// while it is unchanged.
    pub attempt: i32,
    pub fence: Fence,
}

/// What a mark writes on a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Write<'a> {
    /// Delivered: final.
    Published,
    /// Due again after `delay`; the attempt counts.
    Retry { delay: Duration, error: &'a str },
    /// Final, with the reason; the attempt counts when one was made.
    Dead { error: &'a str, attempted: bool },
    /// Not attempted: nothing to write (the claim wrote nothing); the row is
    /// read again by the next claim.
    Release,
    /// Not attempted (its route is paused): due again after `delay`, the
    /// attempt not counted.
    Defer { delay: Duration, error: &'a str },
    /// Taken by QStash for an ordered route; held (no claim reads it) for up
    /// to `delay` until a callback says what the destination answered.
    Hold { delay: Duration },
}

impl Write<'_> {
    /// `(kind, delay ms, error)` as the mark statement takes them.
    fn columns(&self) -> (i16, i64, Option<&str>) {
        match *self {
            Write::Published => (1, 0, None),
            Write::Retry { delay, error } => (2, delay.as_millis() as i64, Some(error)),
            Write::Dead {
                error,
                attempted: true,
            } => (3, 0, Some(error)),
            Write::Dead {
                error,
                attempted: false,
            } => (7, 0, Some(error)),
            Write::Release => unreachable!("a release writes nothing"),
            Write::Defer { delay, error } => (5, delay.as_millis() as i64, Some(error)),
            Write::Hold { delay } => (6, delay.as_millis() as i64, None),
        }
    }
}

/// What one [`Session::mark`] wrote.
#[derive(Debug, Default)]
pub struct Written {
    /// Ids whose mark the database applied (the others were fenced).
    pub applied: HashSet<i64>,
    /// Marks (by position) the database refused even alone, with its error.
    pub refused: Vec<(usize, String)>,
    /// Marks (by position) not written because the database could not be
    /// reached; kept for the next try.
    pub unwritten: Vec<Range<usize>>,
    pub error: Option<StoreError>,
}

/// One statement for every kind of outcome, the one write a delivery costs:
/// published, retry, dead and held (an ordered QStash delivery QStash took,
/// waiting for the destination's answer) count the attempt; deferred (its
/// route paused) and dead without a send (kind 7) do not. A release writes nothing (the row was never
/// written when it was claimed).
///
/// Fenced three ways: the row's `attempt_count` must still be the one the
/// claim read (so a mark written twice, after a lost answer, applies once),
/// the shard must still be held under the token the row was claimed with
/// (its lease not ended, not taken, not replaced by a reshard: the row's
/// bucket must lie in that tenure's range), and the row must not be final.
/// A mark never shortens a hold (`locked_until`) that a delivery callback
/// extended meanwhile: a "retrying" callback can come before the hold's own
/// mark (marks are batched), or while the row is out again after its hold ran
/// out (the first copy's callback, before the re-send's outcome); QStash still
/// has the message then, so the key must keep waiting. A hold keeps the later
/// end, a retry or a deferral keeps a hold that has not ended; only a final
/// mark clears it. A failed attempt that counts (a retry, a dead letter after
/// a send) is added to the row's attempt history ([`super::attempt_log`]).
/// "Not final" is written `coalesce(…) IS NULL` on purpose: spelled as two
/// `IS NULL` tests it matches the partial indexes' predicate, and with stale
/// statistics (right after a bulk load) the generic plan walked the whole
/// pending set per mark instead of looking the batch up by primary key.
pub(super) const MARK: Sql = Sql {
    text: concat!("UPDATE outbox AS o SET
    published_at     = CASE WHEN u.kind = 1 THEN now() ELSE o.published_at END,
    dead_lettered_at = CASE WHEN u.kind IN (3, 7) THEN now() ELSE o.dead_lettered_at END,
    available_at     = CASE WHEN u.kind IN (2, 5) THEN now() + u.delay_ms * interval '1 millisecond'
                            ELSE o.available_at END,
    attempt_count    = CASE WHEN u.kind IN (5, 7) THEN o.attempt_count ELSE o.attempt_count + 1 END,
    last_error       = CASE WHEN u.kind IN (2, 3, 5, 7) THEN u.error
                            WHEN u.kind IN (1, 6) THEN NULL
                            ELSE o.last_error END,
    locked_until     = CASE WHEN u.kind = 6
                                THEN greatest(o.locked_until, now() + u.delay_ms * interval '1 millisecond')
                            WHEN u.kind IN (2, 5) AND o.locked_until > now() THEN o.locked_until
                       END,
    accepted_at      = CASE WHEN u.kind = 6 THEN now() ELSE o.accepted_at END,
    attempt_log      = CASE WHEN u.kind IN (2, 3) THEN ",
        attempt_log_append!(),
        " ELSE o.attempt_log END
FROM unnest($1::bigint[], $2::int4[], $3::int2[], $4::int8[], $5::text[], $6::int8[])
     AS u(id, attempt, kind, delay_ms, error, token),
     outbox_relay_shard_leases AS l
WHERE o.id = u.id
  AND o.attempt_count = u.attempt
  AND l.token = u.token AND l.lease_until > now()
  AND o.bucket >= l.bucket_lo AND o.bucket < l.bucket_hi
  AND coalesce(o.published_at, o.dead_lettered_at) IS NULL
RETURNING o.id"),
    types: &[
        Type::INT8_ARRAY,
        Type::INT4_ARRAY,
        Type::INT2_ARRAY,
        Type::INT8_ARRAY,
        Type::TEXT_ARRAY,
        Type::INT8_ARRAY,
    ],
};

impl Session {
    /// Writes `marks` in one statement. When PostgreSQL refuses the statement
    /// for its data (a value it cannot store), the marks are split in halves
    /// and written again, down to single rows, so one bad mark never holds
    /// back the others; a lost connection stops the flush and leaves the rest
    /// for later.
    pub async fn mark(&mut self, marks: &[(Held, Write<'_>)]) -> Written {
        let mut written = Written::default();
        let mut todo: Vec<Range<usize>> = Vec::with_capacity(4);
        todo.push(0..marks.len());
        while let Some(range) = todo.pop() {
            match self.write(&marks[range.clone()]).await {
                Ok(applied) => written.applied.extend(applied),
                Err(e) if e.is_data_error() && range.len() > 1 => {
                    let mid = range.start + range.len() / 2;
                    todo.push(mid..range.end);
                    todo.push(range.start..mid);
                }
                Err(e) if e.is_data_error() => {
                    written.refused.push((range.start, e.to_string()));
                }
                Err(e) => {
                    written.unwritten.push(range);
                    written.unwritten.append(&mut todo);
                    written.error = Some(e);
                    break;
                }
            }
        }
        written
    }

    async fn write(&mut self, marks: &[(Held, Write<'_>)]) -> Result<HashSet<i64>, StoreError> {
        let n = marks.len();
        let (mut ids, mut attempts, mut kinds, mut delays, mut errors, mut tokens) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        // A release writes nothing: the claim wrote nothing to undo.
        for (held, write) in marks.iter().filter(|(_, w)| *w != Write::Release) {
            let (kind, delay, error) = write.columns();
            ids.push(held.id);
            attempts.push(held.attempt);
            kinds.push(kind);
            delays.push(delay);
            errors.push(error);
            tokens.push(held.fence.token);
        }
        if ids.is_empty() {
            return Ok(HashSet::new());
        }
        bounded!(self, async {
            let (conn, statement) = self.prepared(&MARK).await?;
            let rows = conn
                .query(
                    &statement,
                    &[&ids, &attempts, &kinds, &delays, &errors, &tokens],
                )
                .await?;
            Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
        })
    }
}

/// A flush is split over several sessions only when each part gets at least
/// this many rows: below it, one statement's round trip costs more than the
/// parallel write saves.
pub(crate) const MIN_PART_ROWS: usize = 100;

/// Writes `marks` over `sessions` in parallel: split by id into as many
/// parts as there are sessions (fewer when the flush is small, see
/// [`MIN_PART_ROWS`]), each part written by [`Session::mark`] on its own
/// session. What each part wrote is reported at its positions in `marks`.
pub async fn mark_split(sessions: &mut [Session], marks: &[(Held, Write<'_>)]) -> Written {
    let bounds = parts(marks, sessions.len());
    let writes = sessions
        .iter_mut()
        .zip(bounds.iter().cloned())
        .map(|(session, range)| async move { (range.start, session.mark(&marks[range]).await) });
    let mut all = Written::default();
    for (offset, part) in futures_util::future::join_all(writes).await {
        all.applied.extend(part.applied);
        all.refused.extend(
            part.refused
                .into_iter()
                .map(|(i, error)| (i + offset, error)),
        );
        all.unwritten.extend(
            part.unwritten
                .into_iter()
                .map(|r| r.start + offset..r.end + offset),
        );
        if all.error.is_none() {
            all.error = part.error;
        }
    }
    all
}

/// Up to `sessions` ranges of `marks` (sorted by id): about equal, at least
/// [`MIN_PART_ROWS`] each, never splitting one row's marks.
fn parts(marks: &[(Held, Write<'_>)], sessions: usize) -> Vec<Range<usize>> {
    debug_assert!(marks.windows(2).all(|w| w[0].0.id <= w[1].0.id));
    let n = (marks.len() / MIN_PART_ROWS).clamp(1, sessions.max(1));
    let mut bounds = Vec::with_capacity(n);
    let mut start = 0;
    for k in 1..=n {
        let mut end = if k == n {
            marks.len()
        } else {
            marks.len() * k / n
        };
        while end < marks.len() && end > 0 && marks[end].0.id == marks[end - 1].0.id {
            end += 1;
        }
        if end > start {
            bounds.push(start..end);
            start = end;
        }
    }
    bounds
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::ShardId;

    fn held(id: i64) -> (Held, Write<'static>) {
        let fence = Fence {
            shard: ShardId::new(0),
            token: 1,
        };
        (
            Held {
                id,
                attempt: 0,
                fence,
            },
            Write::Published,
        )
    }

    #[test]
    fn a_flush_is_split_evenly_and_never_between_marks_of_one_row() {
        let small: Vec<_> = (0..150).map(held).collect();
        assert_eq!(parts(&small, 4), vec![0..150_usize], "too small to split");
        let big: Vec<_> = (0..1000).map(held).collect();
        assert_eq!(parts(&big, 2), [0..500, 500..1000]);
        assert_eq!(parts(&big, 1), vec![0..1000_usize]);
        // Row 499 twice, at the boundary: both marks go to the first part.
        let mut twice: Vec<_> = (0..1000).map(held).collect();
        twice.insert(500, held(499));
        assert_eq!(parts(&twice, 2), [0..501, 501..1001]);
    }
}
