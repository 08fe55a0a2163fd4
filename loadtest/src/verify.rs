//! After every scenario: did the relay keep the outbox contract?
//!
//! From the database's rows and the sink's records:
//! - every committed row that is not poison was received at least once
//!   (`missing` names the others; any missing row fails the run);
//! - duplicates are counted, and every receipt, first or repeated, carries the
//!   row's `idempotency_key` as its deduplication id;
//! - in ordered scenarios, within a partition key, first receipts come in id
//!   order;
//! - every poison row is dead-lettered with a reason and was never accepted;
//! - non-poison rows are not dead-lettered, except those the options allow
//!   (`may_dead_letter`: the adversarial scenario's justified dead letters,
//!   see [`crate::adversarial`]), which then need not be received either;
//! - no pending row (neither published nor dead-lettered) holds a live lease
//!   (`locked_until > now()`). A dead-lettered row is final, so its lease
//!   column is not checked.

use std::collections::{BTreeSet, HashMap};

use futures_util::TryStreamExt;
use serde::{Deserialize, Serialize};

use outbox_testkit::sink::Record;

/// One outbox row, as far as verification and reports care.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxRow {
    pub id: i64,
    pub idempotency_key: String,
    pub partition_key: String,
    /// unix µs, UTC
    pub created_at_us: i64,
    pub published: bool,
    pub dead_lettered: bool,
    pub last_error: Option<String>,
    /// Pending and `locked_until > now()` when read.
    pub live_lease: bool,
    /// The payload has `"poison": true`.
    pub poison_marker: bool,
    pub attempt_count: i32,
}

const LOAD_ROWS: &str = "SELECT id, idempotency_key, partition_key,
       (extract(epoch FROM created_at) * 1000000)::bigint,
       published_at IS NOT NULL, dead_lettered_at IS NOT NULL, last_error,
       coalesce(published_at IS NULL AND dead_lettered_at IS NULL AND locked_until > now(), false),
       payload @> '{\"poison\": true}', attempt_count
FROM outbox ORDER BY id";

/// Reads every outbox row (streamed; fine for millions).
pub async fn load_rows(
    client: &tokio_postgres::Client,
) -> Result<Vec<OutboxRow>, tokio_postgres::Error> {
    let stream = client
        .query_raw(LOAD_ROWS, std::iter::empty::<i64>())
        .await?;
    futures_util::pin_mut!(stream);
    let mut rows = Vec::new();
    while let Some(r) = stream.try_next().await? {
        rows.push(OutboxRow {
            id: r.get(0),
            idempotency_key: r.get(1),
            partition_key: r.get(2),
            created_at_us: r.get(3),
            published: r.get(4),
            dead_lettered: r.get(5),
            last_error: r.get(6),
            live_lease: r.get(7),
            poison_marker: r.get(8),
            attempt_count: r.get(9),
        });
    }
    Ok(rows)
}

/// What the run promised.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VerifyOptions {
    /// Check per-key order of first receipts.
    pub ordered: bool,
    /// Rows that are poison by id (the sink's `poison_ids`).
    pub poison_ids: BTreeSet<i64>,
    /// Rows whose payload has `"poison": true` are poison (the sink's `poison_marker`).
    pub poison_marker: bool,
    /// Rows that may be dead-lettered (and then need not be received): the
    /// adversarial scenario's justified dead letters.
    #[serde(default)]
    pub may_dead_letter: BTreeSet<i64>,
    /// Destinations of unordered routes beside an ordered one: their
    /// receipts are not order-checked. Order is checked per destination
    /// (per route) and partition key.
    #[serde(default)]
    pub unordered_destinations: BTreeSet<String>,
}

/// A receipt whose deduplication id is not its row's idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DedupMismatch {
    pub outbox_id: i64,
    pub expected: String,
    pub found: Option<String>,
    pub duplicate: bool,
}

/// Within `partition_key`, `later_id` was first received before `earlier_id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderViolation {
    pub partition_key: String,
    pub earlier_id: i64,
    pub later_id: i64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoisonAccounting {
    pub expected: u64,
    pub dead_lettered: u64,
    /// Poison rows not dead-lettered.
    pub not_dead_lettered: Vec<i64>,
    /// Dead-lettered poison rows with an empty or missing `last_error`.
    pub without_reason: Vec<i64>,
    /// Poison rows the sink recorded as accepted.
    pub accepted: Vec<i64>,
}

/// The typed result of a verification.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Verification {
    pub rows: u64,
    /// Rows that must be received (all but poison).
    pub expected: u64,
    /// Distinct rows received at least once.
    pub received: u64,
    /// Committed, not poison, never received.
    pub missing: Vec<i64>,
    /// Receipts beyond the first of each row.
    pub duplicates: u64,
    /// Of those, answered as duplicates by the sink (same deduplication id in its window).
    pub duplicates_deduplicated: u64,
    pub wrong_dedup_id: Vec<DedupMismatch>,
    /// Records without an outbox id, or with one not in the table.
    pub unknown_records: u64,
    pub order_checked: bool,
    pub order_violations: Vec<OrderViolation>,
    pub poison: PoisonAccounting,
    /// Non-poison rows dead-lettered.
    pub unexpected_dead_letters: Vec<i64>,
    /// Rows neither published nor dead-lettered.
    pub pending: u64,
    /// Pending rows with `locked_until > now()`.
    pub live_leases: Vec<i64>,
    /// Rows received but not marked published (allowed: a crash between
    /// publish and mark; informative).
    pub received_not_marked: u64,
}

/// Up to 20 ids, and how many in all when there are more.
pub fn sample_ids(ids: &[i64]) -> String {
    const SHOW: usize = 20;
    let shown: Vec<String> = ids.iter().take(SHOW).map(|i| i.to_string()).collect();
    if ids.len() > SHOW {
        format!("{} … ({} in all)", shown.join(", "), ids.len())
    } else {
        shown.join(", ")
    }
}

impl Verification {
    /// Every broken promise, one line each; empty when the run passed.
    pub fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if !self.missing.is_empty() {
            f.push(format!(
                "{} committed events never received: ids {}",
                self.missing.len(),
                sample_ids(&self.missing)
            ));
        }
        if !self.wrong_dedup_id.is_empty() {
            let ids: Vec<i64> = self.wrong_dedup_id.iter().map(|m| m.outbox_id).collect();
            f.push(format!(
                "{} receipts without their row's idempotency key as deduplication id: ids {}",
                ids.len(),
                sample_ids(&ids)
            ));
        }
        if self.unknown_records > 0 {
            f.push(format!(
                "{} receipts name no outbox row",
                self.unknown_records
            ));
        }
        for v in self.order_violations.iter().take(20) {
            f.push(format!(
                "order violated in key {}: id {} received before id {}",
                v.partition_key, v.later_id, v.earlier_id
            ));
        }
        if self.order_violations.len() > 20 {
            f.push(format!(
                "… {} order violations in all",
                self.order_violations.len()
            ));
        }
        let p = &self.poison;
        if !p.not_dead_lettered.is_empty() {
            f.push(format!(
                "poison events not dead-lettered: ids {}",
                sample_ids(&p.not_dead_lettered)
            ));
        }
        if !p.without_reason.is_empty() {
            f.push(format!(
                "poison events dead-lettered without a reason: ids {}",
                sample_ids(&p.without_reason)
            ));
        }
        if !p.accepted.is_empty() {
            f.push(format!(
                "poison events accepted by the sink: ids {}",
                sample_ids(&p.accepted)
            ));
        }
        if !self.unexpected_dead_letters.is_empty() {
            f.push(format!(
                "events dead-lettered that should have been delivered: ids {}",
                sample_ids(&self.unexpected_dead_letters)
            ));
        }
        if !self.live_leases.is_empty() {
            f.push(format!(
                "pending events still under a live lease: ids {}",
                sample_ids(&self.live_leases)
            ));
        }
        f
    }

    pub fn passed(&self) -> bool {
        self.failures().is_empty()
    }
}

/// Checks `records` against `rows` (see the module doc).
pub fn verify_rows(rows: &[OutboxRow], records: &[Record], opts: &VerifyOptions) -> Verification {
    let by_id: HashMap<i64, &OutboxRow> = rows.iter().map(|r| (r.id, r)).collect();
    let is_poison =
        |r: &OutboxRow| opts.poison_ids.contains(&r.id) || (opts.poison_marker && r.poison_marker);
    let mut v = Verification {
        rows: rows.len() as u64,
        order_checked: opts.ordered,
        ..Verification::default()
    };

    let mut sorted: Vec<&Record> = records.iter().collect();
    sorted.sort_by_key(|r| r.seq);
    let mut receipts: HashMap<i64, u64> = HashMap::with_capacity(rows.len());
    // Per key: the highest id first-received so far.
    let mut key_high: HashMap<(&str, &str), i64> = HashMap::new();
    let mut poison_accepted = BTreeSet::new();
    for rec in sorted {
        let Some(row) = rec.outbox_id.and_then(|id| by_id.get(&id)) else {
            v.unknown_records += 1;
            continue;
        };
        let n = receipts.entry(row.id).or_insert(0);
        *n += 1;
        let duplicate = *n > 1;
        if duplicate {
            v.duplicates += 1;
            if rec.deduplicated {
                v.duplicates_deduplicated += 1;
            }
        }
        if rec.dedup_id.as_deref() != Some(row.idempotency_key.as_str()) {
            v.wrong_dedup_id.push(DedupMismatch {
                outbox_id: row.id,
                expected: row.idempotency_key.clone(),
                found: rec.dedup_id.clone(),
                duplicate,
            });
        }
        if is_poison(row) {
            poison_accepted.insert(row.id);
        }
        if opts.ordered && !duplicate && !opts.unordered_destinations.contains(&rec.destination) {
            let high = key_high
                .entry((rec.destination.as_str(), row.partition_key.as_str()))
                .or_insert(row.id);
            if row.id < *high {
                v.order_violations.push(OrderViolation {
                    partition_key: row.partition_key.clone(),
                    earlier_id: row.id,
                    later_id: *high,
                });
            } else {
                *high = row.id;
            }
        }
    }
    v.poison.accepted = poison_accepted.into_iter().collect();

    for row in rows {
        let received = receipts.contains_key(&row.id);
        if received {
            v.received += 1;
            if !row.published {
                v.received_not_marked += 1;
            }
        }
        let pending = !row.published && !row.dead_lettered;
        if pending {
            v.pending += 1;
        }
        if row.live_lease {
            v.live_leases.push(row.id);
        }
        if is_poison(row) {
            v.poison.expected += 1;
            if row.dead_lettered {
                v.poison.dead_lettered += 1;
                if row
                    .last_error
                    .as_deref()
                    .is_none_or(|e| e.trim().is_empty())
                {
                    v.poison.without_reason.push(row.id);
                }
            } else {
                v.poison.not_dead_lettered.push(row.id);
            }
        } else {
            v.expected += 1;
            let excused = row.dead_lettered && opts.may_dead_letter.contains(&row.id);
            if !received && !excused {
                v.missing.push(row.id);
            }
            if row.dead_lettered && !excused {
                v.unexpected_dead_letters.push(row.id);
            }
        }
    }
    v
}

/// Loads the rows and checks them against `records`.
pub async fn verify(
    client: &tokio_postgres::Client,
    records: &[Record],
    opts: &VerifyOptions,
) -> Result<(Verification, Vec<OutboxRow>), tokio_postgres::Error> {
    let rows = load_rows(client).await?;
    let v = verify_rows(&rows, records, opts);
    Ok((v, rows))
}
