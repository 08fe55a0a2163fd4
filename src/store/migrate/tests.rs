//! The online promise and the step parser, checked on the migration files.

use super::*;

/// Statements that take a lock on the outbox that producers' inserts
/// wait for (ACCESS EXCLUSIVE, SHARE ROW EXCLUSIVE, SHARE). `VALIDATE
/// CONSTRAINT` takes SHARE UPDATE EXCLUSIVE, which inserts pass.
fn blocks_inserts(statement: &str) -> bool {
    let s = statement.to_ascii_lowercase();
    let on_outbox = |prefix: &str| {
        s.contains(prefix)
            && (s.contains(&format!("{prefix} outbox "))
                || s.contains(&format!("{prefix} outbox\n"))
                || s.contains(&format!("{prefix} if exists outbox ")))
    };
    (on_outbox("alter table") && !s.contains("validate constraint"))
        || on_outbox("lock table")
        || ((s.contains("create trigger") || s.contains("drop trigger"))
            && s.contains(" on outbox"))
        || (s.contains("create index") && !s.contains("concurrently") && s.contains(" on outbox"))
}

/// Does `sql` run `verb` on the outbox itself (not on another table whose
/// name starts with `outbox`)?
fn names_outbox(sql: &str, verb: &str) -> bool {
    let pattern = format!("{verb} outbox");
    sql.match_indices(&pattern).any(|(at, _)| {
        !sql[at + pattern.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// Work that reads or writes every row of the outbox.
fn scans_rows(statement: &str) -> bool {
    let s = statement.to_ascii_lowercase();
    s.contains("update outbox ")
        || s.contains("update outbox\n")
        || s.contains("delete from outbox")
        || s.contains("insert into outbox ")
        || (s.contains("add constraint") && !s.contains("not valid"))
        || (s.contains("alter column") && s.contains(" type "))
}

/// The online promise, checked on the migration files themselves: a step
/// that takes a lock producers wait for does nothing else that takes time
/// (a backfill, a validation, a rewrite, an index build), and NOT NULL is
/// set only after a validated CHECK lets it skip the scan. (The upgrade
/// test in tests/livedb.rs runs them under load and prints how long
/// producers waited.)
#[test]
fn no_step_holds_a_lock_producers_wait_for_while_it_works_through_rows() {
    for m in MIGRATIONS.iter().filter(|m| m.version >= 3) {
        let mut validated = false;
        for (i, step) in m.steps().iter().enumerate() {
            let at = format!("migration {} ({}) step {}", m.version, m.name, i + 1);
            let (sql, in_transaction) = match step {
                Step::Transaction(sql) => (sql.as_str(), true),
                Step::Batches(sql) | Step::Concurrently(sql) => (sql.as_str(), false),
                Step::Index { sql, .. } | Step::DropIndex { sql, .. } => (sql.as_str(), false),
            };
            let code: String = sql
                .lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                .collect::<Vec<_>>()
                .join("\n");
            let statements: Vec<&str> = code.split(';').collect();
            let locking = statements.iter().any(|s| blocks_inserts(s));
            let scanning = statements.iter().any(|s| scans_rows(s));
            assert!(
                !(in_transaction && locking && scanning),
                "{at} works through the outbox's rows under a lock producers wait for:\n{code}"
            );
            let lower = code.to_ascii_lowercase();
            if lower.contains("set not null") && names_outbox(&lower, "alter table") {
                assert!(
                    validated,
                    "{at} sets NOT NULL without a validated CHECK before it"
                );
            }
            validated |= lower.contains("validate constraint");
            assert!(
                !(lower.contains("create index")
                    && lower.contains(" on outbox")
                    && !lower.contains("concurrently")),
                "{at} builds an index on the outbox without CONCURRENTLY"
            );
        }
    }
}

#[test]
fn the_lint_knows_a_blocking_rewrite_when_it_sees_one() {
    assert!(blocks_inserts("ALTER TABLE outbox ADD COLUMN x int"));
    assert!(!blocks_inserts("ALTER TABLE outbox VALIDATE CONSTRAINT c"));
    assert!(blocks_inserts("CREATE INDEX i ON outbox (x)"));
    assert!(!blocks_inserts("CREATE INDEX CONCURRENTLY i ON outbox (x)"));
    assert!(blocks_inserts(
        "LOCK TABLE outbox IN SHARE ROW EXCLUSIVE MODE"
    ));
    assert!(scans_rows("UPDATE outbox SET shard = 1"));
    assert!(scans_rows(
        "ALTER TABLE outbox ADD CONSTRAINT c CHECK (x > 0)"
    ));
    assert!(!scans_rows(
        "ALTER TABLE outbox ADD CONSTRAINT c CHECK (x > 0) NOT VALID"
    ));
}

#[test]
fn every_migration_parses_into_steps() {
    for m in MIGRATIONS {
        assert!(!m.steps().is_empty(), "migration {}", m.version);
    }
    let steps = MIGRATIONS[3].steps();
    assert!(matches!(steps[0], Step::Transaction(_)));
    assert!(matches!(steps[1], Step::Batches(ref s) if s.contains("$1")));
    assert!(steps
        .iter()
        .any(|s| matches!(s, Step::Index { name, .. } if name == "outbox_shard_ready_idx")));
}

#[test]
fn a_file_without_steps_is_one_transaction() {
    assert_eq!(
        parse_steps("-- c\nCREATE TABLE t ();\n"),
        vec![Step::Transaction("-- c\nCREATE TABLE t ();\n".into())]
    );
}
