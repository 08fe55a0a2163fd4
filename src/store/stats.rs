//! The numbers that say whether the outbox is healthy, read from the database.
//!
//! [`snapshot`] is what the relay exports as gauges every `server.stats_interval`:
//! one statement, each figure read through a partial index, so its cost follows
//! the backlog and the dead letters, never the size of the table. [`stats`] adds
//! what a person asks `outbox-relay stats` for: throughput per minute over the
//! last hour and a breakdown per event type.
//!
//! Definitions (the same words as the metrics in `docs/operations.md`):
//! - *pending*: `published_at IS NULL AND dead_lettered_at IS NULL`.
//! - *age* of a pending row: how long it has been deliverable, from
//!   `created_at`, or from `available_at` when that is later and no attempt was
//!   made yet (an event scheduled ahead, a replayed dead letter). A row
//!   scheduled for later and never tried has no age yet: it is not late. A row
//!   backing off after a failed attempt keeps its age from `created_at`.
//! - *flapping*: pending with `attempt_count >` [`FLAPPING_ATTEMPTS`].
//! - *stuck lease*: pending, its lease ended (`locked_until < now()`) and it is
//!   due (`available_at <= now()`), i.e. a relay claimed it and neither marked
//!   it nor let another claim renew it. Every mark clears or moves the lease,
//!   and a healthy relay re-claims an expired lease within one poll interval, so
//!   a count that stays above zero means a relay died holding rows or claiming
//!   stopped. A row backing off (`available_at` in the future) is not stuck.

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::{Client, GenericClient, IsolationLevel};

use super::{Store, StoreError};

/// Pending rows with more failed attempts than this count as flapping.
pub(crate) const FLAPPING_ATTEMPTS: i32 = 3;

/// The gauges, sampled at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Snapshot {
    /// The database's `now()` when sampled; ages are measured from it.
    pub sampled_at: DateTime<Utc>,
    pub backlog: i64,
    /// The age (see the module docs) of the oldest pending row; 0 when none is
    /// due or has failed an attempt.
    pub oldest_pending_age_seconds: f64,
    pub dead_letters: i64,
    pub flapping: i64,
    pub stuck_leases: i64,
    /// `pg_stat_user_tables.n_dead_tup` of the outbox, summed over its
    /// partitions when it is partitioned. PostgreSQL updates it lazily (about
    /// once a second per backend), so it trails the other figures a little.
    pub outbox_dead_tuples: i64,
}

/// Published rows in one minute.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MinuteBucket {
    /// Start of the minute.
    pub minute: DateTime<Utc>,
    pub published: i64,
}

/// One event type's share of the outbox.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventTypeStats {
    pub event_type: String,
    pub pending: i64,
    /// `None` when nothing of this type is pending and due (or failing).
    pub oldest_pending_age_seconds: Option<f64>,
    pub dead: i64,
    /// Within the same window as [`Stats::published_per_minute`].
    pub published_last_hour: i64,
}

/// What `outbox-relay stats` shows; all parts read in one database snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stats {
    pub snapshot: Snapshot,
    /// [`MINUTES`] buckets, oldest first; the last one is the current,
    /// unfinished minute.
    pub published_per_minute: Vec<MinuteBucket>,
    /// Every event type with pending, dead, or recently published rows, by name.
    pub event_types: Vec<EventTypeStats>,
    /// Relay replicas seen in the last ten minutes, by name, with their shards.
    pub replicas: Vec<ReplicaStats>,
    /// Shards no live replica holds a lease on (nobody is claiming there).
    pub unowned_shards: Vec<i16>,
}

/// One relay replica and the shards it holds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplicaStats {
    pub replica: String,
    pub hostname: String,
    pub pid: i32,
    pub started_at: DateTime<Utc>,
    /// Since its last heartbeat.
    pub seen_seconds_ago: f64,
    /// Its heartbeat is current (it counts in the fair share).
    pub alive: bool,
    /// Shards whose lease it holds now, in order.
    pub shards: Vec<i16>,
    /// The last process refused this name while this one held it (two
    /// relays configured with one `relay.replica_id`).
    pub refused: Option<RefusedReplica>,
}

/// A process that asked for a replica name another one held.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RefusedReplica {
    pub hostname: String,
    pub pid: i32,
    pub at: DateTime<Utc>,
}

/// Buckets in [`Stats::published_per_minute`].
pub const MINUTES: usize = 60;

// `pending` and `dead` walk their partial indexes (and the heap rows of pending
// ones, for attempt_count, locked_until and available_at, which the age needs
// too). pg_partition_tree() lists a partitioned outbox's partitions and nothing
// for a plain table, hence the `relid =` as well.
const SNAPSHOT_SQL: &str = "
WITH pending AS (
    SELECT count(*) AS backlog,
           count(*) FILTER (WHERE attempt_count > $1::int4) AS flapping,
           count(*) FILTER (WHERE locked_until < now() AND available_at <= now()) AS stuck_leases,
           min(CASE WHEN attempt_count = 0 THEN greatest(created_at, available_at) ELSE created_at END)
               FILTER (WHERE attempt_count > 0 OR available_at <= now()) AS oldest
    FROM outbox
    WHERE published_at IS NULL AND dead_lettered_at IS NULL
), dead AS (
    SELECT count(*) AS dead_letters FROM outbox WHERE dead_lettered_at IS NOT NULL
), tuples AS (
    SELECT coalesce(sum(n_dead_tup), 0)::int8 AS dead_tuples
    FROM pg_stat_user_tables
    WHERE relid = 'outbox'::regclass
       OR relid IN (SELECT relid FROM pg_partition_tree('outbox'::regclass))
)
SELECT now(),
       pending.backlog,
       coalesce(greatest(extract(epoch FROM now() - pending.oldest), 0), 0)::float8,
       dead.dead_letters,
       pending.flapping,
       pending.stuck_leases,
       tuples.dead_tuples
FROM pending, dead, tuples";

const REPLICAS_SQL: &str = "
SELECT r.replica, r.hostname, r.pid, r.started_at,
       extract(epoch FROM now() - r.seen_at)::float8,
       r.alive_until > now(),
       coalesce(array_agg(l.shard ORDER BY l.shard) FILTER (WHERE l.shard IS NOT NULL),
                '{}'),
       r.refused_hostname, r.refused_pid, r.refused_at
FROM outbox_relay_replicas AS r
LEFT JOIN outbox_relay_shard_leases AS l
       ON l.owner = r.replica AND l.lease_until > now()
GROUP BY r.replica
ORDER BY r.replica";

const UNOWNED_SQL: &str = "
SELECT coalesce(array_agg(shard ORDER BY shard), '{}')
FROM outbox_relay_shard_leases
WHERE owner IS NULL OR lease_until IS NULL OR lease_until <= now()";

// Only rows published inside the window are read, through outbox_published_at_idx.
const PER_MINUTE_SQL: &str = "
WITH published AS (
    SELECT date_trunc('minute', published_at) AS minute, count(*) AS n
    FROM outbox
    WHERE published_at >= date_trunc('minute', now()) - interval '59 minutes'
    GROUP BY 1
)
SELECT m.minute, coalesce(published.n, 0)::int8
FROM generate_series(date_trunc('minute', now()) - interval '59 minutes',
                     date_trunc('minute', now()),
                     interval '1 minute') AS m(minute)
LEFT JOIN published USING (minute)
ORDER BY m.minute";

const PER_EVENT_TYPE_SQL: &str = "
WITH pending AS (
    SELECT event_type, count(*) AS pending,
           min(CASE WHEN attempt_count = 0 THEN greatest(created_at, available_at) ELSE created_at END)
               FILTER (WHERE attempt_count > 0 OR available_at <= now()) AS oldest
    FROM outbox
    WHERE published_at IS NULL AND dead_lettered_at IS NULL
    GROUP BY event_type
), dead AS (
    SELECT event_type, count(*) AS dead
    FROM outbox
    WHERE dead_lettered_at IS NOT NULL
    GROUP BY event_type
), published AS (
    SELECT event_type, count(*) AS published
    FROM outbox
    WHERE published_at >= date_trunc('minute', now()) - interval '59 minutes'
    GROUP BY event_type
)
SELECT event_type,
       coalesce(pending.pending, 0)::int8,
       -- greatest() skips NULLs: keep nothing-pending as NULL, not 0.
       CASE WHEN pending.oldest IS NOT NULL
            THEN greatest(extract(epoch FROM now() - pending.oldest), 0)::float8 END,
       coalesce(dead.dead, 0)::int8,
       coalesce(published.published, 0)::int8
FROM pending
FULL JOIN dead USING (event_type)
FULL JOIN published USING (event_type)
ORDER BY event_type";

/// Samples the gauges in one statement. Works on a client, a pooled
/// connection (`&*conn`) or a transaction, on a plain or partitioned outbox.
pub async fn snapshot<C: GenericClient + Sync>(client: &C) -> Result<Snapshot, StoreError> {
    let row = client
        .query_one(SNAPSHOT_SQL, &[&FLAPPING_ATTEMPTS])
        .await?;
    Ok(Snapshot {
        sampled_at: row.get(0),
        backlog: row.get(1),
        oldest_pending_age_seconds: row.get(2),
        dead_letters: row.get(3),
        flapping: row.get(4),
        stuck_leases: row.get(5),
        outbox_dead_tuples: row.get(6),
    })
}

/// The full report, read in one repeatable-read, read-only transaction so the
/// parts agree with each other.
pub async fn stats(client: &mut Client) -> Result<Stats, StoreError> {
    let tx = client
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    let snapshot = snapshot(&tx).await?;
    let published_per_minute = tx
        .query(PER_MINUTE_SQL, &[])
        .await?
        .iter()
        .map(|r| MinuteBucket {
            minute: r.get(0),
            published: r.get(1),
        })
        .collect();
    let event_types = tx
        .query(PER_EVENT_TYPE_SQL, &[])
        .await?
        .iter()
        .map(|r| EventTypeStats {
            event_type: r.get(0),
            pending: r.get(1),
            oldest_pending_age_seconds: r.get(2),
            dead: r.get(3),
            published_last_hour: r.get(4),
        })
        .collect();
    let replicas = tx
        .query(REPLICAS_SQL, &[])
        .await?
        .iter()
        .map(|r| ReplicaStats {
            replica: r.get(0),
            hostname: r.get(1),
            pid: r.get(2),
            started_at: r.get(3),
            seen_seconds_ago: r.get(4),
            alive: r.get(5),
            shards: r.get(6),
            refused: match (r.get(7), r.get(8), r.get(9)) {
                (Some(hostname), Some(pid), Some(at)) => Some(RefusedReplica { hostname, pid, at }),
                _ => None,
            },
        })
        .collect();
    let unowned_shards = tx.query_one(UNOWNED_SQL, &[]).await?.get(0);
    tx.commit().await?;
    Ok(Stats {
        snapshot,
        published_per_minute,
        event_types,
        replicas,
        unowned_shards,
    })
}

impl Store {
    /// The gauges, sampled now.
    pub async fn snapshot(&self) -> Result<Snapshot, StoreError> {
        snapshot(&*self.conn().await?).await
    }

    /// What `outbox-relay stats` shows.
    pub async fn stats(&self) -> Result<Stats, StoreError> {
        stats(&mut *self.conn().await?).await
    }
}
