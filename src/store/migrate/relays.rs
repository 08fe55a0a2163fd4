//! The live relays a migration would strand: before the runner applies a
//! migration that needs relays built for a newer schema
//! ([`LiveRelays::NeedBuiltFor`]), it reads the replicas' heartbeats and
//! refuses while one of them is older, naming each and the way out.

use std::fmt;

use tokio_postgres::Client;

use super::{LiveRelays, MigrateError, Migration};

/// Does the replica table exist, and has it the columns of 0011?
const REPLICA_TABLE: &str = "SELECT to_regclass('outbox_relay_replicas') IS NOT NULL,
    EXISTS (SELECT 1 FROM pg_attribute
            WHERE attrelid = to_regclass('outbox_relay_replicas') AND attname = 'built_for'
              AND NOT attisdropped)";

/// Live replicas (heartbeat current), with what they were built for.
const LIVE: &str = "SELECT replica, hostname, pid, version, built_for
    FROM outbox_relay_replicas WHERE alive_until > now() ORDER BY replica";
/// The same before 0011, when no relay recorded its version.
const LIVE_BEFORE_VERSIONS: &str = "SELECT replica, hostname, pid, NULL::text, NULL::int4
    FROM outbox_relay_replicas WHERE alive_until > now() ORDER BY replica";

/// A relay whose heartbeat is current, as `migrate` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveReplica {
    pub id: String,
    pub hostname: String,
    pub pid: i32,
    /// Its release; `None` for relays before 0011, which record none.
    pub version: Option<String>,
    /// The newest migration it knows; `None` before 0011.
    pub built_for: Option<i32>,
}

impl LiveReplica {
    /// Does it keep working once a migration that says `rule` is applied?
    /// A relay that records nothing is older than any rule that needs one.
    fn survives(&self, rule: LiveRelays) -> bool {
        rule.needs().is_none() || self.built_for.is_some_and(|s| rule.keeps(s))
    }
}

impl fmt::Display for LiveReplica {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (host {}, pid {}, ", self.id, self.hostname, self.pid)?;
        match (&self.version, self.built_for) {
            (Some(v), Some(s)) => write!(f, "version {v}, built for schema {s:04})"),
            _ => write!(
                f,
                "a relay from before 0011, which records no version or schema)"
            ),
        }
    }
}

/// The replicas whose heartbeat is current; none before 0005.
pub(super) async fn live(client: &Client) -> Result<Vec<LiveReplica>, tokio_postgres::Error> {
    let row = client.query_one(REPLICA_TABLE, &[]).await?;
    let (table, versions): (bool, bool) = (row.get(0), row.get(1));
    if !table {
        return Ok(Vec::new());
    }
    let sql = if versions { LIVE } else { LIVE_BEFORE_VERSIONS };
    Ok(client
        .query(sql, &[])
        .await?
        .iter()
        .map(|r| LiveReplica {
            id: r.get(0),
            hostname: r.get(1),
            pid: r.get(2),
            version: r.get(3),
            built_for: r.get(4),
        })
        .collect())
}

/// The first of `pending` that a replica of `live` would not survive, and
/// those replicas.
fn stranded<'a>(
    pending: &[&'a Migration],
    live: &[LiveReplica],
) -> Option<(&'a Migration, Vec<LiveReplica>)> {
    pending.iter().find_map(|m| {
        let older: Vec<LiveReplica> = live
            .iter()
            .filter(|r| !r.survives(m.live_relays))
            .cloned()
            .collect();
        (!older.is_empty()).then_some((*m, older))
    })
}

/// Refuses (or, with `allow_live_older`, warns) when applying `pending`
/// would leave a live relay on a schema it cannot run on.
pub(super) async fn check(
    client: &Client,
    pending: &[&Migration],
    allow_live_older: bool,
) -> Result<(), MigrateError> {
    if pending.iter().all(|m| m.live_relays.needs().is_none()) {
        return Ok(());
    }
    let live = live(client).await?;
    let Some((m, older)) = stranded(pending, &live) else {
        return Ok(());
    };
    let needs = m.live_relays.needs().unwrap_or(m.version);
    if allow_live_older {
        let names: Vec<String> = older.iter().map(ToString::to_string).collect();
        tracing::warn!(
            version = m.version,
            name = m.name,
            replicas = %names.join("; "),
            "--allow-live-older: applying a migration these live relays cannot run across; they stop delivering until they are replaced"
        );
        return Ok(());
    }
    Err(MigrateError::OlderRelaysLive {
        version: m.version,
        name: m.name,
        needs,
        replicas: older,
    })
}

/// What `migrate` says when it refuses.
pub(super) fn refusal(version: i32, name: &str, needs: i32, replicas: &[LiveReplica]) -> String {
    let names: Vec<String> = replicas.iter().map(|r| format!("  {r}")).collect();
    format!(
        "migration {version} ({name}) needs relays built for schema {needs:04} or later, and {} live relay(s) are older:\n{}\n\
         Relays older than {needs:04} stop delivering once it is applied. Upgrade this way: stop those relays, \
         run `outbox-relay migrate`, then start relays of this release (docs/operations.md, \"Upgrading\"). \
         A relay that stopped without leaving counts as live until its heartbeat ends (relay.shard_lease); \
         `migrate --allow-live-older` applies it anyway.",
        replicas.len(),
        names.join("\n"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(id: &str, built_for: Option<i32>) -> LiveReplica {
        LiveReplica {
            id: id.into(),
            hostname: "h".into(),
            pid: 1,
            version: built_for.map(|_| "0.1.0".into()),
            built_for,
        }
    }

    fn migration(version: i32, live_relays: LiveRelays) -> Migration {
        Migration {
            version,
            name: "m",
            sql: "",
            also_accepted: &[],
            live_relays,
        }
    }

    #[test]
    fn a_migration_strands_the_relays_built_for_an_older_schema_than_it_needs() {
        let keep = migration(12, LiveRelays::KeepWorking);
        let contract = migration(13, LiveRelays::NeedBuiltFor(12));
        let live = [
            replica("new", Some(12)),
            replica("old", Some(11)),
            replica("unrecorded", None),
        ];
        assert!(stranded(&[&keep], &live).is_none());
        let (m, older) = stranded(&[&keep, &contract], &live).unwrap();
        assert_eq!(m.version, 13);
        let ids: Vec<&str> = older.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["old", "unrecorded"]);
        assert!(stranded(&[&contract], &[replica("newer", Some(14))]).is_none());
    }

    #[test]
    fn every_contract_needs_a_schema_no_newer_than_itself() {
        for m in super::super::MIGRATIONS {
            if let Some(needs) = m.live_relays.needs() {
                assert!(
                    needs <= m.version,
                    "migration {} needs relays built for {needs}, which no relay running before it can be",
                    m.version
                );
            }
        }
    }
}
