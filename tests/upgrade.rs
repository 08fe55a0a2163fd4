//! Rolling upgrades: which relays may keep running while `migrate` changes the
//! schema, and what a relay does on a schema newer than it was built for.
//! (`loadtest rolling-upgrade --old-relay-bin PATH` runs a real older release
//! through `migrate`; these tests stand an older relay in by its heartbeat.)

mod common;

use std::time::Duration;

use common::{cli, cli_ok, column, config, count, wait_until, QSTASH_ROUTE};
use outbox_relay::store::migrate::{self, MigrateError};
use outbox_relay::Relay;
use outbox_testkit::TestDb;

/// The newest migration this build knows.
fn latest() -> i32 {
    migrate::MIGRATIONS.last().unwrap().version
}

/// A database at schema `version`.
async fn at(version: i32) -> TestDb {
    let db = TestDb::empty().await.unwrap();
    let mut client = db.client().await.unwrap();
    migrate::run_to(&mut client, version).await.unwrap();
    db
}

/// A replica's heartbeat as every relay since 0005 writes it (no version:
/// relays before 0011 record none), live for `alive_secs` more (negative:
/// ended that long ago).
async fn heartbeat_of_an_older_relay(db: &TestDb, id: &str, host: &str, alive_secs: i64) {
    db.client()
        .await
        .unwrap()
        .execute(
            "INSERT INTO outbox_relay_replicas (replica, hostname, pid, started_at, seen_at, alive_until)
             VALUES ($1, $2, 4242, now(), now(), now() + $3::bigint * interval '1 second')",
            &[&id, &host, &alive_secs],
        )
        .await
        .unwrap();
}

async fn schema_version(db: &TestDb) -> i32 {
    count(db, "SELECT max(version)::int8 FROM outbox_relay_migrations").await as i32
}

#[tokio::test]
async fn migrate_refuses_a_breaking_migration_while_an_older_relay_is_live() {
    // 0007 stops filling `shard` and drops it: a relay built for 0006 claims
    // by it, so it would see no new row and then fail every statement.
    let db = at(6).await;
    heartbeat_of_an_older_relay(&db, "relay-a", "host-a", 60).await;
    heartbeat_of_an_older_relay(&db, "relay-b", "host-b", 60).await;

    let mut client = db.client().await.unwrap();
    let err = migrate::run(&mut client).await.unwrap_err();
    assert!(
        matches!(err, MigrateError::OlderRelaysLive { version: 7, .. }),
        "{err}"
    );
    let message = err.to_string();
    for part in [
        "migration 7 (buckets)",
        "relay-a (host host-a, pid 4242",
        "relay-b (host host-b",
        "before 0011",
        "stop",
        "--allow-live-older",
    ] {
        assert!(message.contains(part), "`{part}` missing from: {message}");
    }
    assert_eq!(schema_version(&db).await, 6, "nothing may be applied");

    // The command says the same and fails; with the override it migrates.
    let refused = cli(&db, &["migrate"]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("relay-a") && stderr.contains("--allow-live-older"),
        "{stderr}"
    );
    assert_eq!(schema_version(&db).await, 6);
    cli_ok(&db, &["migrate", "--allow-live-older"]);
    assert_eq!(schema_version(&db).await, latest());
}

#[tokio::test]
async fn a_replica_whose_heartbeat_ended_does_not_hold_migrate_back() {
    let db = at(6).await;
    heartbeat_of_an_older_relay(&db, "gone", "host-a", -5).await;
    let mut client = db.client().await.unwrap();
    migrate::run(&mut client).await.unwrap();
    assert_eq!(schema_version(&db).await, latest());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compatible_migration_runs_while_the_relays_of_0008_are_live() {
    // Today's installs are at 0008 with relays built for it: what comes after
    // must let them run on.
    let db = at(8).await;
    heartbeat_of_an_older_relay(&db, "relay-0008", "host-a", 60).await;
    let mut client = db.client().await.unwrap();
    let report = migrate::run(&mut client).await.unwrap();
    assert_eq!(report.applied.last(), Some(&latest()), "{report:?}");
    for m in migrate::MIGRATIONS.iter().filter(|m| m.version > 8) {
        assert!(
            m.live_relays.keeps(8),
            "migration {} must keep relays built for 0008 working",
            m.version
        );
    }
    // The 0008 relay's heartbeat, word for word, still runs.
    client
        .execute(
            "INSERT INTO outbox_relay_replicas AS r
                 (replica, hostname, pid, started_at, seen_at, alive_until)
             VALUES ($1, $2, $3, now(), now(), now() + $4::bigint * interval '1 millisecond')
             ON CONFLICT (replica) DO UPDATE SET
                 hostname = excluded.hostname, pid = excluded.pid,
                 started_at = CASE WHEN r.pid = excluded.pid AND r.hostname = excluded.hostname
                                   THEN r.started_at ELSE now() END,
                 seen_at = now(), alive_until = excluded.alive_until",
            &[&"relay-0008", &"host-a", &4242i32, &60_000i64],
        )
        .await
        .unwrap();

    // A relay of this build says which schema it was built for.
    let sink = common::start_sink().await;
    let relay = Relay::start(config(&db, &sink.url(), QSTASH_ROUTE))
        .await
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || async {
            count(
                &db,
                &format!(
                    "SELECT count(*) FROM outbox_relay_replicas WHERE built_for = {} AND version = '{}'",
                    latest(),
                    env!("CARGO_PKG_VERSION")
                ),
            )
            .await
                == 1
        })
        .await,
        "the relay's heartbeat must record its version and schema"
    );
    relay.shutdown().await;
}

/// Records a migration `version` applied by a newer build, which keeps relays
/// built for `needs` onwards working (`None`: every relay).
async fn applied_by_a_newer_build(db: &TestDb, version: i32, needs: Option<i32>) {
    db.client()
        .await
        .unwrap()
        .execute(
            "INSERT INTO outbox_relay_migrations (version, name, checksum, relays_from)
             VALUES ($1, 'future', 'x', $2)",
            &[&version, &needs],
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_refuses_to_start_on_a_schema_that_needs_newer_relays() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    // A newer migration that older relays run across: this one starts.
    applied_by_a_newer_build(&db, 98, None).await;
    let relay = Relay::start(config(&db, &sink.url(), QSTASH_ROUTE))
        .await
        .expect("a compatible newer schema must not stop the relay");
    relay.shutdown().await;

    applied_by_a_newer_build(&db, 99, Some(99)).await;
    let err = Relay::start(config(&db, &sink.url(), QSTASH_ROUTE))
        .await
        .err()
        .expect("a relay built for an older schema than migration 99 needs must not start");
    let message = err.to_string();
    for part in [
        "migration 99",
        &format!("built for schema {:04}", latest()),
        "upgrade",
    ] {
        assert!(message.contains(part), "`{part}` missing from: {message}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_relay_stops_claiming_when_a_migration_needs_newer_relays() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let relay = Relay::start(config(&db, &sink.url(), QSTASH_ROUTE))
        .await
        .unwrap();
    let held = "SELECT count(*) FROM outbox_relay_shard_leases WHERE owner IS NOT NULL AND lease_until > now()";
    assert!(
        wait_until(Duration::from_secs(20), || async {
            count(&db, held).await > 0
        })
        .await,
        "the relay never took a shard"
    );
    // `migrate --allow-live-older` applied a migration this relay cannot run on.
    applied_by_a_newer_build(&db, 99, Some(99)).await;
    assert!(
        wait_until(Duration::from_secs(20), || async {
            count(&db, held).await == 0
                && count(&db, "SELECT count(*) FROM outbox_relay_replicas").await == 0
        })
        .await,
        "the relay must give its shards back and leave the replica list"
    );
    let owners: Vec<Option<String>> = column(
        &db.client().await.unwrap(),
        "SELECT owner FROM outbox_relay_shard_leases",
    )
    .await;
    assert!(owners.iter().all(Option::is_none), "{owners:?}");
    relay.shutdown().await;
}

#[tokio::test]
async fn a_schema_migrated_by_an_earlier_release_is_accepted() {
    // 0004 as bda08bb..743d1ae shipped it (the backfill joined its batch; now
    // it looks the batch up by primary key), 0007 as 4594811 shipped it: the
    // same schema, so `migrate` of this release must go on from there.
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    for (version, checksum) in [
        (
            4,
            "51c01baa286520cb273dc599c0519fe7a5e6e72cb90a74fe0cd81173c8f74c6d",
        ),
        (
            7,
            "66dcd74c5f3b19b1dfa00fb38d43859c0fd425aada0e69fb9f91d66c8b684a21",
        ),
    ] {
        client
            .execute(
                "UPDATE outbox_relay_migrations SET checksum = $2 WHERE version = $1",
                &[&version, &checksum],
            )
            .await
            .unwrap();
    }
    migrate::run(&mut client).await.unwrap();
}
