//! Who owns which shard: shard leases (`outbox_relay_shard_leases`, one row a
//! shard, each tenure under a fencing token from a sequence), the replicas'
//! heartbeats (`outbox_relay_replicas`), the shard count
//! (`outbox_relay_settings`) and resharding. The coordinator runs the lease
//! statements every round; docs/architecture.md, "Shard ownership and
//! fencing", says why time plus token is enough.

use std::time::Duration;

use tokio_postgres::GenericClient;

use super::outbox::BUCKETS;
use super::{migrate, Fence, Session, ShardId, Store, StoreError};

/// Announces this replica; `alive_until` is what the others count it by.
/// The name is this process's (`$4`, its instance token) unless another
/// instance's heartbeat under it is current: then nothing is written and no
/// row returned. `$6`/`$7`: the instance and `seen_at` of a row whose
/// heartbeat stopped moving, taken over (a restart after a crash). A new
/// instance under the name starts a new `started_at` and clears the refusal.
/// It says which release it is and which schema it was built for (`migrate`
/// checks them), and returns the newest schema a migration applied needs
/// relays to be built for (the coordinator stops claiming when this one is
/// older).
const HEARTBEAT: &str = "INSERT INTO outbox_relay_replicas AS r
    (replica, hostname, pid, instance, started_at, seen_at, alive_until, version, built_for)
VALUES ($1, $2, $3, $4, now(), now(), now() + $5::bigint * interval '1 millisecond', $8, $9)
ON CONFLICT (replica) DO UPDATE SET
    hostname = excluded.hostname,
    pid = excluded.pid,
    instance = excluded.instance,
    started_at = CASE WHEN r.instance = excluded.instance THEN r.started_at ELSE now() END,
    seen_at = now(),
    alive_until = excluded.alive_until,
    version = excluded.version,
    built_for = excluded.built_for,
    refused_hostname = CASE WHEN r.instance = excluded.instance THEN r.refused_hostname END,
    refused_pid = CASE WHEN r.instance = excluded.instance THEN r.refused_pid END,
    refused_at = CASE WHEN r.instance = excluded.instance THEN r.refused_at END
WHERE r.instance = excluded.instance
   OR r.alive_until <= now()
   OR (r.instance IS NOT DISTINCT FROM $6::text AND r.seen_at = $7::timestamptz)
RETURNING (SELECT max(relays_from) FROM outbox_relay_migrations)";

/// A heartbeat was refused: records who asked (for `stats`) and returns the
/// process that holds the name.
const REFUSED: &str = "UPDATE outbox_relay_replicas
SET refused_hostname = $2, refused_pid = $3, refused_at = now()
WHERE replica = $1
RETURNING hostname, pid, instance, started_at, seen_at,
          (extract(epoch FROM alive_until - seen_at) * 1000)::int8";

/// The first migration applied that needs relays built for a newer schema
/// than `$1`.
const NEEDS_NEWER_RELAYS: &str = "SELECT version, name, relays_from FROM outbox_relay_migrations
WHERE relays_from > $1 ORDER BY version LIMIT 1";

/// Replicas counted for the fair share, in the order shares are dealt.
const LIVE: &str =
    "SELECT replica FROM outbox_relay_replicas WHERE alive_until > now() ORDER BY replica";

/// Replicas gone for a while leave the list (`stats` shows the recent ones).
const FORGET: &str =
    "DELETE FROM outbox_relay_replicas WHERE alive_until < now() - interval '10 minutes'";

/// Extends the leases still held under their tokens; a shard not returned was
/// lost (its lease ended, or another replica took it).
const RENEW: &str = "UPDATE outbox_relay_shard_leases
SET lease_until = now() + $2::bigint * interval '1 millisecond', renewed_at = now()
WHERE owner = $1 AND token = ANY($3) AND lease_until > now()
RETURNING shard, token";

/// Takes up to `$3` shards that nobody holds: released, never taken, lease
/// over, or held under this replica's own name by an earlier process (a
/// restart under a fixed `relay.replica_id`), except those it holds now (`$4`).
/// Each gets a new fencing token. Returns, per shard, the last owner and how
/// long its lease had still to run (an earlier process under this name may
/// send until then).
const ACQUIRE: &str = "WITH free AS (
    SELECT shard, owner, lease_until FROM outbox_relay_shard_leases
    WHERE (owner IS NULL OR owner = $1 OR lease_until IS NULL OR lease_until <= now())
      AND NOT (shard = ANY($4))
    ORDER BY shard
    LIMIT $3
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_relay_shard_leases AS l
SET owner = $1, token = nextval('outbox_relay_shard_token_seq'),
    lease_until = now() + $2::bigint * interval '1 millisecond',
    acquired_at = now(), renewed_at = now()
FROM free
WHERE l.shard = free.shard
RETURNING l.shard, l.token, free.owner,
          greatest(extract(epoch FROM free.lease_until - now()) * 1000, 0)::int8";

/// Gives leases back (handover, shutdown): the next replica takes them at once.
const GIVE_BACK: &str = "UPDATE outbox_relay_shard_leases
SET owner = NULL, lease_until = NULL, renewed_at = now()
WHERE token = ANY($1)";

/// Leaves the replica list on shutdown, so the others rebalance at once.
const LEAVE: &str = "DELETE FROM outbox_relay_replicas WHERE replica = $1 AND instance = $2";

/// Who holds these shards now, for the log of a lease lost.
const HOLDERS: &str = "SELECT shard, owner, lease_until > now()
FROM outbox_relay_shard_leases WHERE shard = ANY($1)";

/// Takes a shard whatever holds it now (tools only).
const SEIZE: &str = "UPDATE outbox_relay_shard_leases
SET owner = $2, token = nextval('outbox_relay_shard_token_seq'),
    lease_until = now() + $3::bigint * interval '1 millisecond',
    acquired_at = now(), renewed_at = now()
WHERE shard = $1
RETURNING token";

/// The number of shards the database hashes rows into.
const SHARD_COUNT: &str = "SELECT shards FROM outbox_relay_settings";

/// A new layout of shards: one lease row each, over an even split of the
/// buckets. Every tenure of the old layout ends with it (its token is gone).
///
/// While a tenure of the old layout may still run (its lease had not ended),
/// the new shards are not free either: they belong to `(reshard)` until the
/// last old lease would have ended. Whoever takes one after that is told it
/// was not handed over cleanly, so it waits for any old request still in the
/// air before it claims; also when the old leases had all ended, since a
/// request started just before its lease ended may still be open. `$3`: when
/// the last old lease ends, or NULL when no shard was ever held (nothing to
/// wait for).
const RESHARD_LEASES: &str = "INSERT INTO outbox_relay_shard_leases
    (shard, bucket_lo, bucket_hi, owner, lease_until)
SELECT k, (k * $2::int / $1::int)::smallint, ((k + 1) * $2::int / $1::int)::smallint,
       CASE WHEN $3::timestamptz IS NOT NULL THEN '(reshard)' END,
       CASE WHEN $3::timestamptz IS NOT NULL THEN greatest($3::timestamptz, now()) END
FROM generate_series(0, $1::int - 1) AS k";
const CLEAR_LEASES: &str = "DELETE FROM outbox_relay_shard_leases RETURNING lease_until";

/// The shard count, locked against a concurrent reshard.
const LOCK_SHARD_COUNT: &str = "SELECT shards FROM outbox_relay_settings FOR UPDATE";

/// Shards the live layout has, for the coordinators' fair share.
const LAYOUT: &str = "SELECT count(*)::int4 FROM outbox_relay_shard_leases";

const SET_SHARD_COUNT: &str = "UPDATE outbox_relay_settings SET shards = $1";

/// The newest migration applied.
const SCHEMA_VERSION: &str = "SELECT max(version) FROM outbox_relay_migrations";

/// A replica as the others see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replica {
    /// `relay.replica_id`, or `<hostname>-<pid>-<first 6 of instance>`.
    pub id: String,
    pub hostname: String,
    pub pid: i32,
    /// Drawn at random for each relay started: tells this one from another
    /// process (or relay) under the same name, whatever its host and pid.
    pub instance: String,
}

impl Replica {
    /// A relay of this process, under `configured` (empty: a name of its own,
    /// `<hostname>-<pid>-<6 hex digits>`: two containers may well share a
    /// host name and pid).
    pub fn this_process(configured: &str) -> Replica {
        let hostname = hostname();
        let pid = std::process::id();
        let instance = format!("{:016x}", rand::random::<u64>());
        Replica {
            id: if configured.is_empty() {
                format!("{hostname}-{pid}-{}", &instance[..6])
            } else {
                configured.to_owned()
            },
            hostname,
            pid: pid as i32,
            instance,
        }
    }
}

/// The process whose heartbeat holds a replica name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub hostname: String,
    pub pid: i32,
    /// `None`: a relay older than instance tokens.
    pub instance: Option<String>,
    pub started_at: chrono::DateTime<chrono::Utc>,
    pub seen_at: chrono::DateTime<chrono::Utc>,
    /// How long each heartbeat keeps it alive (its `relay.shard_lease`).
    pub alive_for: Duration,
}

/// What a heartbeat found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Heartbeat {
    /// This replica is announced; `relays_from`: the newest schema a
    /// migration applied needs relays to be built for.
    Beat { relays_from: Option<i32> },
    /// Another process's heartbeat under this name is current.
    Refused(Holder),
}

/// Who holds a shard now, as the lease table says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseHolder {
    pub shard: ShardId,
    pub owner: Option<String>,
    /// Its lease has not ended.
    pub live: bool,
}

/// This machine's name, for `stats` and the default replica name.
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// A shard just taken, and who held it before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acquired {
    pub fence: Fence,
    pub previous: Option<String>,
    /// How long the previous lease had still to run when it was taken: zero
    /// unless an earlier process under this name held it.
    pub previous_lease_left: Duration,
}

fn millis(d: Duration) -> i64 {
    d.as_millis() as i64
}

/// A migration applied that relays built for an older schema cannot run on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NeedsNewerRelays {
    pub version: i32,
    pub name: String,
    /// Relays must be built for this schema or later.
    pub needs: i32,
}

impl std::fmt::Display for NeedsNewerRelays {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "migration {} ({}) needs relays built for schema {:04} or later; this relay is built for schema {:04}: upgrade it (docs/operations.md, \"Upgrading\")",
            self.version,
            self.name,
            self.needs,
            Store::latest_schema()
        )
    }
}

impl Session {
    /// Says this replica is alive for `alive_for` more, unless another
    /// process holds its name; `silent`: a holder seen not to heartbeat for a
    /// while, whose row this one takes over if it is still as seen. A beat
    /// carries the newest schema a migration applied needs relays to be
    /// built for.
    pub(crate) async fn heartbeat(
        &mut self,
        me: &Replica,
        alive_for: Duration,
        silent: Option<&Holder>,
    ) -> Result<Heartbeat, StoreError> {
        bounded!(self, async {
            let conn = self.conn().await?;
            loop {
                let beat = conn
                    .query_opt(
                        HEARTBEAT,
                        &[
                            &me.id,
                            &me.hostname,
                            &me.pid,
                            &me.instance,
                            &millis(alive_for),
                            &silent.and_then(|h| h.instance.clone()),
                            &silent.map(|h| h.seen_at),
                            &env!("CARGO_PKG_VERSION"),
                            &Store::latest_schema(),
                        ],
                    )
                    .await?;
                if let Some(beat) = beat {
                    return Ok(Heartbeat::Beat {
                        relays_from: beat.get(0),
                    });
                }
                // Refused; unless the holder left meanwhile (then try again).
                if let Some(r) = conn
                    .query_opt(REFUSED, &[&me.id, &me.hostname, &me.pid])
                    .await?
                {
                    return Ok(Heartbeat::Refused(Holder {
                        hostname: r.get(0),
                        pid: r.get(1),
                        instance: r.get(2),
                        started_at: r.get(3),
                        seen_at: r.get(4),
                        alive_for: Duration::from_millis(r.get::<_, i64>(5).max(0) as u64),
                    }));
                }
            }
        })
    }

    /// Who holds `shards` now.
    pub(crate) async fn lease_holders(
        &mut self,
        shards: &[ShardId],
    ) -> Result<Vec<LeaseHolder>, StoreError> {
        let shards: Vec<i16> = shards.iter().map(|s| s.sql()).collect();
        bounded!(self, async {
            let rows = self.conn().await?.query(HOLDERS, &[&shards]).await?;
            Ok(rows
                .iter()
                .map(|r| LeaseHolder {
                    shard: ShardId::from_sql(r.get(0)),
                    owner: r.get(1),
                    live: r.get::<_, Option<bool>>(2).unwrap_or(false),
                })
                .collect())
        })
    }

    /// Extends the leases held under `tokens` by `lease`; the tenures still
    /// held. A token not returned was lost.
    pub(crate) async fn renew(
        &mut self,
        me: &Replica,
        lease: Duration,
        tokens: &[i64],
    ) -> Result<Vec<Fence>, StoreError> {
        let rows = bounded!(self, async {
            Ok(self
                .conn()
                .await?
                .query(RENEW, &[&me.id, &millis(lease), &tokens])
                .await?)
        })?;
        Ok(rows
            .iter()
            .map(|r| Fence {
                shard: ShardId::from_sql(r.get(0)),
                token: r.get(1),
            })
            .collect())
    }

    /// The replicas alive now, by name; forgets those gone for long.
    pub(crate) async fn live_replicas(&mut self) -> Result<Vec<String>, StoreError> {
        bounded!(self, async {
            let conn = self.conn().await?;
            let live = conn
                .query(LIVE, &[])
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect();
            conn.execute(FORGET, &[]).await?;
            Ok(live)
        })
    }

    /// How many shards the outbox is split into now (a reshard changes it
    /// while relays run).
    pub async fn layout(&mut self) -> Result<u32, StoreError> {
        bounded!(self, async {
            let n: i32 = self.conn().await?.query_one(LAYOUT, &[]).await?.get(0);
            Ok(n as u32)
        })
    }

    /// Takes up to `want` free shards (not those in `exclude`) for `lease`.
    pub async fn acquire(
        &mut self,
        me: &Replica,
        lease: Duration,
        want: usize,
        exclude: &[ShardId],
    ) -> Result<Vec<Acquired>, StoreError> {
        let exclude: Vec<i16> = exclude.iter().map(|s| s.sql()).collect();
        let rows = bounded!(self, async {
            Ok(self
                .conn()
                .await?
                .query(ACQUIRE, &[&me.id, &millis(lease), &(want as i64), &exclude])
                .await?)
        })?;
        Ok(rows
            .iter()
            .map(|r| Acquired {
                fence: Fence {
                    shard: ShardId::from_sql(r.get(0)),
                    token: r.get(1),
                },
                previous: r.get(2),
                previous_lease_left: Duration::from_millis(r.get::<_, i64>(3) as u64),
            })
            .collect())
    }

    /// Gives the leases held under `tokens` back.
    pub(crate) async fn give_back(&mut self, tokens: &[i64]) -> Result<(), StoreError> {
        bounded!(self, async {
            self.conn().await?.execute(GIVE_BACK, &[&tokens]).await?;
            Ok(())
        })
    }

    /// Leaves the replica list.
    pub async fn leave(&mut self, me: &Replica) -> Result<(), StoreError> {
        bounded!(self, async {
            self.conn()
                .await?
                .execute(LEAVE, &[&me.id, &me.instance])
                .await?;
            Ok(())
        })
    }
}

impl Store {
    /// The number of shards the database hashes rows into.
    pub async fn shard_count(&self) -> Result<u32, StoreError> {
        shard_count(&*self.conn().await?).await
    }

    /// The newest migration applied, `None` when there is no schema.
    pub(crate) async fn schema_version(&self) -> Result<Option<i32>, StoreError> {
        match self.conn().await?.query_one(SCHEMA_VERSION, &[]).await {
            Ok(row) => Ok(row.get(0)),
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The first migration applied that this build's relays cannot run on.
    pub(crate) async fn needs_newer_relays(&self) -> Result<Option<NeedsNewerRelays>, StoreError> {
        let row = self
            .conn()
            .await?
            .query_opt(NEEDS_NEWER_RELAYS, &[&Store::latest_schema()])
            .await?;
        Ok(row.map(|r| NeedsNewerRelays {
            version: r.get(0),
            name: r.get(1),
            needs: r.get(2),
        }))
    }

    /// The newest migration this binary knows: the schema it is built for.
    pub(crate) fn latest_schema() -> i32 {
        migrate::MIGRATIONS
            .iter()
            .map(|m| m.version)
            .max()
            .unwrap_or(0)
    }

    /// Takes `shard` for `owner` whatever holds it now, with a new fencing
    /// token, for `lease`. For tools that claim and mark without a relay
    /// (`loadtest sql-ceiling`, tests); a relay never does this.
    pub async fn seize_shard(
        &self,
        shard: ShardId,
        owner: &str,
        lease: Duration,
    ) -> Result<Fence, StoreError> {
        let token = self
            .conn()
            .await?
            .query_one(SEIZE, &[&shard.sql(), &owner, &millis(lease)])
            .await?
            .get(0);
        Ok(Fence { shard, token })
    }

    /// Gives back a shard taken with [`Store::seize_shard`].
    pub async fn release_shard(&self, fence: Fence) -> Result<(), StoreError> {
        self.conn()
            .await?
            .execute(GIVE_BACK, &[&vec![fence.token]])
            .await?;
        Ok(())
    }

    /// Splits the buckets into `n` shards (1–1024); returns the count before.
    /// Only the lease table changes: no outbox row is rewritten, producers are
    /// not held up, and relays may keep running. Their tenures of the old
    /// layout end at once (renewals, claims and marks under the old tokens are
    /// refused), and they take their share of the new shards once the old
    /// leases would have ended, waiting then for requests still in the air.
    pub async fn reshard(&self, n: u32) -> Result<u32, StoreError> {
        if !(1..=ShardId::MAX_SHARDS).contains(&n) {
            return Err(StoreError::Refused(format!(
                "the shard count must be between 1 and {}, not {n}",
                ShardId::MAX_SHARDS
            )));
        }
        let mut conn = self.conn().await?;
        let tx = conn.transaction().await?;
        let before: i32 = tx.query_one(LOCK_SHARD_COUNT, &[]).await?.get(0);
        let (n, buckets) = (n as i32, BUCKETS as i32);
        tx.execute(SET_SHARD_COUNT, &[&n]).await?;
        let last_lease: Option<chrono::DateTime<chrono::Utc>> = tx
            .query(CLEAR_LEASES, &[])
            .await?
            .iter()
            .filter_map(|r| r.get::<_, Option<chrono::DateTime<chrono::Utc>>>(0))
            .max();
        tx.execute(RESHARD_LEASES, &[&n, &buckets, &last_lease])
            .await?;
        tx.commit().await?;
        Ok(before as u32)
    }
}

/// The shard count, on any connection.
pub async fn shard_count(client: &impl GenericClient) -> Result<u32, StoreError> {
    let n: i32 = client.query_one(SHARD_COUNT, &[]).await?.get(0);
    Ok(n as u32)
}
