//! What the relay's role may do, checked against what it needs
//! (`docs/roles.md`): `check-config --connect` names what is missing before
//! `run` meets it as a permission error on its first claim.

use super::{Store, StoreError};

/// The relay role's privileges: (object, privileges). The outbox's id
/// sequence, whatever its name, needs SELECT and USAGE too.
pub const RELAY_TABLES: &[(&str, &[&str])] = &[
    ("outbox", &["SELECT", "UPDATE", "DELETE"]),
    ("processed_messages", &["SELECT", "DELETE"]),
    ("outbox_relay_settings", &["SELECT"]),
    ("outbox_relay_migrations", &["SELECT"]),
    (
        "outbox_relay_shard_leases",
        &["SELECT", "INSERT", "UPDATE", "DELETE"],
    ),
    (
        "outbox_relay_replicas",
        &["SELECT", "INSERT", "UPDATE", "DELETE"],
    ),
];
pub const RELAY_SEQUENCES: &[(&str, &[&str])] = &[("outbox_relay_shard_token_seq", &["USAGE"])];
const ID_SEQUENCE: &[&str] = &["SELECT", "USAGE"];

/// Each `(kind, object, privilege)` the role has not, of the objects that
/// exist (a missing schema is the schema check's to report).
const MISSING: &str = "
SELECT p.privilege || ' on ' || p.object
FROM unnest($1::text[], $2::text[], $3::text[]) AS p(kind, object, privilege)
WHERE CASE
    WHEN to_regclass(p.object) IS NULL THEN false
    WHEN p.kind = 'table' THEN NOT has_table_privilege(p.object, p.privilege)
    ELSE NOT has_sequence_privilege(p.object, p.privilege)
END";

impl Store {
    /// The role connected as, and what it lacks of what the relay needs, as
    /// `PRIVILEGE on object` (empty: it has it all).
    pub async fn missing_relay_privileges(&self) -> Result<(String, Vec<String>), StoreError> {
        let conn = self.conn().await?;
        let row = conn
            .query_one(
                "SELECT current_user::text, CASE WHEN to_regclass('outbox') IS NOT NULL
                        THEN pg_get_serial_sequence('outbox', 'id') END",
                &[],
            )
            .await?;
        let (role, id_sequence): (String, Option<String>) = (row.get(0), row.get(1));
        let (mut kinds, mut objects, mut privileges) = (Vec::new(), Vec::new(), Vec::new());
        let sequences = RELAY_SEQUENCES
            .iter()
            .map(|(o, p)| (o.to_string(), *p))
            .chain(id_sequence.map(|s| (s, ID_SEQUENCE)));
        let tables = RELAY_TABLES
            .iter()
            .map(|(o, p)| ("table", o.to_string(), *p));
        for (kind, object, needed) in tables.chain(sequences.map(|(o, p)| ("sequence", o, p))) {
            for privilege in needed {
                kinds.push(kind.to_owned());
                objects.push(object.clone());
                privileges.push(privilege.to_string());
            }
        }
        let missing = conn
            .query(MISSING, &[&kinds, &objects, &privileges])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        Ok((role, missing))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What is checked is what `migrate --print-grants` grants.
    #[test]
    fn the_checked_privileges_are_the_printed_grants() {
        let grants = crate::store::migrate::grants("app", "relay", "public");
        for (object, privileges) in RELAY_TABLES {
            let line = grants
                .lines()
                .find(|l| {
                    l.contains(&format!(" {object} TO \"relay\""))
                        || l.contains(&format!(" {object},"))
                        || l.contains(&format!(", {object} TO \"relay\""))
                })
                .unwrap_or_else(|| panic!("no GRANT names {object}:\n{grants}"));
            assert!(
                line.starts_with(&format!("GRANT {} ON", privileges.join(", "))),
                "{object}: {line}"
            );
        }
        for (object, privileges) in RELAY_SEQUENCES {
            assert!(
                grants.contains(&format!(
                    "GRANT {} ON SEQUENCE {object} TO \"relay\"",
                    privileges.join(", ")
                )),
                "{object}"
            );
        }
        assert!(grants.contains(&format!("GRANT {} ON SEQUENCE %s", ID_SEQUENCE.join(", "))));
    }
}
