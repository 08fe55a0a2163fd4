//! Operations against a real PostgreSQL: stats, retention, the janitor,
//! partitions, and the janitor's config keys.

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use chrono::{DateTime, Timelike, Utc};
use outbox_relay::config::{Config, JanitorConfig};
use outbox_relay::janitor::{run_janitor, run_janitor_observed, JanitorSummary};
use outbox_relay::store::mark::Write;
use outbox_relay::store::migrate;
use outbox_relay::store::outbox::{no_cursor, ClaimScope};
use outbox_relay::store::partitions::{self, MaintainOptions, PartitionAction};
use outbox_relay::store::retention::{self as prune, PruneOptions};
use outbox_relay::store::stats::{self, snapshot};
use outbox_relay::store::{Store, StoreError};
use outbox_testkit::TestDb;
use serde_json::Value;
use tokio_postgres::Client;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");
/// A bound on waiting for something that should happen at once; never a sync point.
const PATIENCE: Duration = Duration::from_secs(30);

/// `n` pending rows of `event_type`, created (and available) `ago` seconds ago.
async fn insert(client: &Client, n: i32, event_type: &str, ago: f64) -> Vec<i64> {
    client
        .query(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload,
                                 idempotency_key, created_at, available_at)
             SELECT gen_random_uuid(), 'order', 'o-' || g, $1::text, '{}'::jsonb,
                    $1::text || ':' || gen_random_uuid(),
                    now() - make_interval(secs => $3::float8), now() - make_interval(secs => $3::float8)
             FROM generate_series(1, $2::int4) AS g
             RETURNING id",
            &[&event_type, &n, &ago],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn set(client: &Client, ids: &[i64], assignments: &str) {
    // Test-only: the SET list is a literal of this file, never input.
    let sql = format!("UPDATE outbox SET {assignments} WHERE id = ANY($1)");
    let n = client.execute(&sql, &[&ids]).await.unwrap();
    assert_eq!(n as usize, ids.len());
}

async fn count(client: &Client, sql: &str) -> i64 {
    common::count_on(client, sql).await
}

async fn ids(client: &Client, sql: &str) -> Vec<i64> {
    common::column(client, sql).await
}

/// Flushes this backend's table statistics so other sessions see them now
/// rather than within a second or so.
async fn flush_stats(client: &Client) {
    client
        .batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    client.batch_execute("SELECT 1").await.unwrap();
}

/// Pending, flapping, stuck, leased, backing-off, published and dead rows:
/// each line is `(rows, event type, created this many seconds ago, columns
/// set afterwards)`.
const MIX: &[(i32, &str, f64, &str)] = &[
    // order.placed: 5 pending (the oldest 10 minutes old), 4 published recently, 2 long ago.
    (4, "order.placed", 5.0, ""),
    (1, "order.placed", 600.0, ""),
    (2, "order.placed", 3600.0, "published_at = now() - interval '5 minutes'"),
    (1, "order.placed", 3600.0, "published_at = now() - interval '30 minutes'"),
    (1, "order.placed", 3600.0, "published_at = now()"),
    (2, "order.placed", 4.0 * 3600.0, "published_at = now() - interval '2 hours'"),
    // order.shipped: 7 pending in every lease state: flapping, stuck, leased, backing off.
    (2, "order.shipped", 60.0, "attempt_count = 5"),
    (3, "order.shipped", 120.0, "attempt_count = 1, locked_until = now() - interval '1 minute'"),
    (1, "order.shipped", 60.0, "attempt_count = 1, locked_until = now() + interval '1 minute'"),
    (
        1,
        "order.shipped",
        60.0,
        "attempt_count = 2, locked_until = now() - interval '1 minute', available_at = now() + interval '1 minute'",
    ),
    // invoice.paid: 3 dead letters, one of them published first (QStash's failure callback).
    (
        1,
        "invoice.paid",
        7200.0,
        "dead_lettered_at = now(), attempt_count = 10, published_at = now() - interval '2 hours'",
    ),
    (2, "invoice.paid", 7200.0, "dead_lettered_at = now(), attempt_count = 10"),
];

async fn craft_mix(client: &Client) {
    for &(rows, event_type, ago, assignments) in MIX {
        let ids = insert(client, rows, event_type, ago).await;
        assert_eq!(ids.len(), rows as usize);
        if !assignments.is_empty() {
            set(client, &ids, assignments).await;
        }
    }
}

fn minute_index(window_start: DateTime<Utc>, t: DateTime<Utc>) -> Option<usize> {
    let offset = (t - window_start).num_seconds();
    if offset < 0 {
        return None;
    }
    Some((offset / 60) as usize)
}

#[tokio::test]
async fn stats_match_the_database_for_a_crafted_mix() {
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    craft_mix(&client).await;
    flush_stats(&client).await;

    let snap = snapshot(&client).await.unwrap();
    assert_eq!(snap.backlog, 12, "{snap:?}");
    assert_eq!(snap.flapping, 2, "{snap:?}");
    assert_eq!(snap.stuck_leases, 3, "{snap:?}");
    assert_eq!(snap.dead_letters, 3, "{snap:?}");
    assert!(
        (600.0..660.0).contains(&snap.oldest_pending_age_seconds),
        "{snap:?}"
    );
    let dead_tuples = count(
        &client,
        "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'outbox'",
    )
    .await;
    assert!(dead_tuples > 0, "the UPDATEs left dead tuples");
    assert_eq!(snap.outbox_dead_tuples, dead_tuples);

    let report = stats::stats(&mut client).await.unwrap();
    assert_eq!(report.snapshot.backlog, 12);
    assert_eq!(report.published_per_minute.len(), stats::MINUTES);
    // Expected buckets, computed here from the rows themselves.
    let now = report.snapshot.sampled_at;
    let window_start = report.published_per_minute[0].minute;
    assert_eq!(
        report.published_per_minute.last().unwrap().minute,
        now.with_second(0).unwrap().with_nanosecond(0).unwrap(),
        "the last bucket is the current minute"
    );
    let mut expected = vec![0i64; stats::MINUTES];
    for row in client
        .query(
            "SELECT published_at FROM outbox WHERE published_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
    {
        if let Some(i) = minute_index(window_start, row.get(0)) {
            expected[i] += 1;
        }
    }
    let got: Vec<i64> = report
        .published_per_minute
        .iter()
        .map(|b| b.published)
        .collect();
    assert_eq!(got, expected);
    assert_eq!(got.iter().sum::<i64>(), 4);

    let by_type: BTreeMap<&str, _> = report
        .event_types
        .iter()
        .map(|t| (t.event_type.as_str(), t))
        .collect();
    assert_eq!(
        by_type.keys().copied().collect::<Vec<_>>(),
        ["invoice.paid", "order.placed", "order.shipped"]
    );
    let placed = by_type["order.placed"];
    assert_eq!(
        (placed.pending, placed.dead, placed.published_last_hour),
        (5, 0, 4)
    );
    assert!((600.0..660.0).contains(&placed.oldest_pending_age_seconds.unwrap()));
    let shipped = by_type["order.shipped"];
    assert_eq!(
        (shipped.pending, shipped.dead, shipped.published_last_hour),
        (7, 0, 0)
    );
    assert!((120.0..180.0).contains(&shipped.oldest_pending_age_seconds.unwrap()));
    let paid = by_type["invoice.paid"];
    assert_eq!(
        (paid.pending, paid.dead, paid.published_last_hour),
        (0, 3, 0)
    );
    assert_eq!(paid.oldest_pending_age_seconds, None);

    // The binary says the same, as JSON.
    let out = common::cli_ok(&db, &["stats", "--json"]);
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    let s = &json["snapshot"];
    assert_eq!(s["backlog"], 12);
    assert_eq!(s["flapping"], 2);
    assert_eq!(s["stuck_leases"], 3);
    assert_eq!(s["dead_letters"], 3);
    assert!(s["outbox_dead_tuples"].as_i64().unwrap() > 0);
    assert!(s["oldest_pending_age_seconds"].as_f64().unwrap() >= 600.0);
    assert_eq!(json["published_per_minute"].as_array().unwrap().len(), 60);
    assert_eq!(json["event_types"].as_array().unwrap().len(), 3);
    assert_eq!(json["event_types"][2]["event_type"], "order.shipped");
    assert_eq!(json["event_types"][2]["pending"], 7);

    // ... and as tables for people.
    let out = common::cli_ok(&db, &["stats"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "backlog",
        "stuck leases",
        "order.shipped",
        "published in the last hour: 4",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}

#[tokio::test]
async fn an_empty_outbox_has_zero_everything() {
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    let report = stats::stats(&mut client).await.unwrap();
    let s = &report.snapshot;
    assert_eq!(
        (s.backlog, s.dead_letters, s.flapping, s.stuck_leases),
        (0, 0, 0, 0)
    );
    assert_eq!(s.oldest_pending_age_seconds, 0.0);
    assert!(report.event_types.is_empty());
    assert!(report.published_per_minute.iter().all(|b| b.published == 0));
}

#[tokio::test]
async fn stats_watch_prints_one_json_line_per_sample() {
    let db = common::test_db().await;
    let mut child = tokio::process::Command::new(BIN)
        .args(["stats", "--json", "--watch", "1"])
        .env("DATABASE_URL", &db.url)
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    for _ in 0..2 {
        let line = tokio::time::timeout(PATIENCE, lines.next_line())
            .await
            .expect("a sample every second")
            .unwrap()
            .expect("stats --watch ended early");
        let json: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(json["snapshot"]["backlog"], 0);
    }
    // Ctrl-C ends the watch cleanly.
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let status = tokio::time::timeout(PATIENCE, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// 12 old published, 3 recently published, 2 old pending, 2 old dead (one of
/// them published before it died). Returns (old published, survivors).
async fn craft_retention(client: &Client) -> (Vec<i64>, Vec<i64>) {
    let day = 24.0 * 3600.0;
    let old = insert(client, 12, "order.placed", 9.0 * day).await;
    set(client, &old, "published_at = now() - interval '8 days'").await;
    let recent = insert(client, 3, "order.placed", 9.0 * day).await;
    set(client, &recent, "published_at = now() - interval '1 day'").await;
    let pending = insert(client, 2, "order.placed", 30.0 * day).await;
    let dead = insert(client, 2, "order.placed", 30.0 * day).await;
    set(
        client,
        &dead,
        "dead_lettered_at = now() - interval '20 days'",
    )
    .await;
    set(
        client,
        &dead[..1],
        "published_at = now() - interval '25 days'",
    )
    .await;
    let mut survivors = [recent, pending, dead].concat();
    survivors.sort();
    (old, survivors)
}

/// `n` messages the `billing` consumer handled `days_ago` days ago, named
/// `prefix1`, `prefix2`, ….
async fn add_processed(client: &Client, prefix: &str, n: i32, days_ago: i32) {
    client
        .execute(
            "INSERT INTO processed_messages (consumer, message_id, processed_at)
             SELECT 'billing', $1::text || g, now() - make_interval(days => $3)
             FROM generate_series(1, $2::int4) g",
            &[&prefix, &n, &days_ago],
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn prune_deletes_only_old_published_rows_in_batches() {
    let db = common::test_db().await;
    let client = db.client().await.unwrap();
    let (old, survivors) = craft_retention(&client).await;
    let options = PruneOptions {
        published_older_than: Duration::from_secs(7 * 24 * 3600),
        processed_older_than: None,
        batch: 5,
    };
    let report = prune::prune(&client, &options).await.unwrap();
    assert_eq!(report.outbox.deleted, old.len() as u64);
    // 5 + 5 + 2: the short third batch ends the run.
    assert_eq!(report.outbox.statements, 3);
    assert_eq!(report.processed_messages, None);
    assert_eq!(
        ids(&client, "SELECT id FROM outbox ORDER BY id").await,
        survivors
    );

    // Nothing left to delete: one empty statement.
    let again = prune::prune(&client, &options).await.unwrap();
    assert_eq!((again.outbox.deleted, again.outbox.statements), (0, 1));

    // An exact multiple of the batch needs one more, empty, statement to know it is done.
    let more = insert(&client, 10, "order.placed", 10.0 * 24.0 * 3600.0).await;
    set(&client, &more, "published_at = now() - interval '9 days'").await;
    let report = prune::prune(&client, &options).await.unwrap();
    assert_eq!((report.outbox.deleted, report.outbox.statements), (10, 3));
    assert_eq!(
        ids(&client, "SELECT id FROM outbox ORDER BY id").await,
        survivors
    );
}

#[tokio::test]
async fn prune_from_the_command_line_reports_what_it_deleted() {
    let db = common::test_db().await;
    let client = db.client().await.unwrap();
    let (old, survivors) = craft_retention(&client).await;
    add_processed(&client, "m-", 4, 8).await;
    add_processed(&client, "fresh-", 1, 0).await;
    let out = common::cli_ok(
        &db,
        &[
            "prune",
            "--older-than",
            "7d",
            "--batch",
            "4",
            "--processed-older-than",
            "7d",
            "--json",
        ],
    );
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["outbox"]["deleted"], old.len());
    assert_eq!(json["outbox"]["statements"], 4); // 4 + 4 + 4 + 0
    assert_eq!(json["processed_messages"]["deleted"], 4);
    assert_eq!(json["processed_messages"]["statements"], 2); // 4 + 0
    assert_eq!(
        ids(&client, "SELECT id FROM outbox ORDER BY id").await,
        survivors
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM processed_messages").await,
        1
    );

    let out = common::cli_ok(&db, &["prune", "--older-than", "7d"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("deleted 0 rows older than 7days") && text.contains("in 1 statements"),
        "{text}"
    );
    assert!(text.contains("processed_messages: left alone"), "{text}");

    let out = common::cli(&db, &["prune", "--older-than", "soon"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--older-than"));
}

#[tokio::test]
async fn processed_messages_are_pruned_past_their_ttl_in_batches() {
    let db = common::test_db().await;
    let client = db.client().await.unwrap();
    add_processed(&client, "old-", 7, 8).await;
    add_processed(&client, "new-", 2, 6).await;
    let report = prune::prune_table(
        &client,
        prune::Prunable::Processed,
        Duration::from_secs(7 * 24 * 3600),
        3,
    )
    .await
    .unwrap();
    assert_eq!((report.deleted, report.statements), (7, 3));
    let left: Vec<String> = common::column(
        &client,
        "SELECT message_id FROM processed_messages ORDER BY 1",
    )
    .await;
    assert_eq!(left, ["new-1", "new-2"]);
}

fn janitor_config(interval: Duration) -> JanitorConfig {
    JanitorConfig {
        enabled: true,
        interval,
        batch: 5,
        ..JanitorConfig::default()
    }
}

/// The janitor on `db` with `interval` between passes, sending what
/// `observe` makes of each pass; it stops when the returned sender fires.
fn spawn_janitor<T: Send + 'static>(
    db: &TestDb,
    interval: Duration,
    observe: impl Fn(&Result<prune::PruneReport, StoreError>) -> T + Send + 'static,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::sync::mpsc::UnboundedReceiver<T>,
    tokio::task::JoinHandle<JanitorSummary>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (passes_tx, passes) = tokio::sync::mpsc::unbounded_channel();
    let janitor = tokio::spawn(run_janitor_observed(
        Store::with_pool(common::pool(db, 2)),
        janitor_config(interval),
        async {
            let _ = stopped.await;
        },
        move |pass| {
            let _ = passes_tx.send(observe(pass));
        },
    ));
    (stop, passes, janitor)
}

#[tokio::test]
async fn janitor_prunes_at_start_and_stops_on_shutdown() {
    let db = common::test_db().await;
    let client = db.client().await.unwrap();
    let (old, survivors) = craft_retention(&client).await;
    add_processed(&client, "old-", 1, 8).await;
    add_processed(&client, "new-", 1, 0).await;
    // An hour between passes: only the pass at start can happen in this test.
    let (stop, mut passes, janitor) =
        spawn_janitor(&db, Duration::from_secs(3600), |pass| match pass {
            Ok(report) => Ok(report.clone()),
            Err(e) => Err(e.to_string()),
        });
    let first = tokio::time::timeout(PATIENCE, passes.recv())
        .await
        .expect("the janitor prunes at start")
        .unwrap()
        .unwrap();
    assert_eq!(first.outbox.deleted, old.len() as u64);
    assert_eq!(first.outbox.statements, 3);
    assert_eq!(first.processed_messages.unwrap().deleted, 1);
    stop.send(()).unwrap();
    let summary = tokio::time::timeout(PATIENCE, janitor)
        .await
        .expect("the janitor stops on shutdown")
        .unwrap();
    assert_eq!(summary.passes, 1);
    assert_eq!(summary.failed_passes, 0);
    assert_eq!(summary.outbox_deleted, old.len() as u64);
    assert_eq!(summary.processed_deleted, 1);
    assert_eq!(
        ids(&client, "SELECT id FROM outbox ORDER BY id").await,
        survivors
    );
}

async fn next(passes: &mut tokio::sync::mpsc::UnboundedReceiver<bool>) -> bool {
    tokio::time::timeout(PATIENCE, passes.recv())
        .await
        .expect("a pass every interval")
        .expect("the janitor ended early")
}

#[tokio::test]
async fn janitor_repeats_every_interval_and_survives_errors() {
    let db = common::test_db().await;
    let client = db.client().await.unwrap();
    let (stop, mut passes, janitor) =
        spawn_janitor(&db, Duration::from_millis(20), |pass| pass.is_ok());
    assert!(next(&mut passes).await);
    // A pass that fails (the table is gone) is reported, and the next one runs.
    client
        .batch_execute("ALTER TABLE processed_messages RENAME TO processed_elsewhere")
        .await
        .unwrap();
    while next(&mut passes).await {}
    client
        .batch_execute("ALTER TABLE processed_elsewhere RENAME TO processed_messages")
        .await
        .unwrap();
    while !next(&mut passes).await {}
    stop.send(()).unwrap();
    let summary = tokio::time::timeout(PATIENCE, janitor)
        .await
        .unwrap()
        .unwrap();
    assert!(summary.passes >= 2, "{summary:?}");
    assert!(summary.failed_passes >= 1, "{summary:?}");
}

#[tokio::test]
async fn a_disabled_janitor_returns_at_once() {
    let db = common::test_db().await;
    let summary = tokio::time::timeout(
        PATIENCE,
        run_janitor(
            Store::with_pool(common::pool(&db, 1)),
            JanitorConfig::default(),
            std::future::pending(),
        ),
    )
    .await
    .expect("disabled means no loop");
    assert_eq!(summary, JanitorSummary::default());
}

#[test]
fn janitor_config_errors_name_their_key() {
    let cases = [
        ("[janitor]\ninterval = \"0s\"\n", "janitor.interval"),
        ("[janitor]\ninterval = \"often\"\n", "janitor.interval"),
        (
            "[janitor]\nretain_published = \"0s\"\n",
            "janitor.retain_published",
        ),
        (
            "[janitor]\nretain_processed = \"0s\"\n",
            "janitor.retain_processed",
        ),
        ("[janitor]\nbatch = 0\n", "janitor.batch"),
        ("[janitor]\nbatch = 1000000\n", "janitor.batch"),
        ("[janitor]\nenabled = \"yes\"\n", "janitor.enabled"),
        ("[janitor]\nretain = \"7d\"\n", "retain"),
    ];
    common::assert_config_errors_name(&cases);
    let ok = Config::from_toml_str(
        "[janitor]\nenabled = true\ninterval = \"1m\"\nretain_published = \"3d\"\nbatch = 100\n",
    )
    .unwrap();
    assert!(ok.janitor.enabled);
    assert_eq!(
        ok.janitor.retain_published,
        Duration::from_secs(3 * 24 * 3600)
    );
    assert_eq!(
        ok.janitor.retain_processed,
        Duration::from_secs(7 * 24 * 3600)
    );

    let out = Command::new(BIN)
        .args(["check-config"])
        .env("OUTBOX_RELAY_JANITOR__BATCH", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("janitor.batch"), "{stderr}");
}

// --- partitions ---------------------------------------------------------

/// Inserts one event created `days_ago` days ago the way a producer on a
/// partitioned outbox must: `ON CONFLICT DO NOTHING` without a target.
async fn insert_partitioned(client: &Client, key: &str, days_ago: i32) -> Option<i64> {
    client
        .query_opt(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload,
                                 idempotency_key, created_at, available_at)
             VALUES (gen_random_uuid(), 'order', $1, 'order.placed', '{}', $1,
                     now() - make_interval(days => $2), now() - make_interval(days => $2))
             ON CONFLICT DO NOTHING
             RETURNING id",
            &[&key, &days_ago],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

async fn partitioned_db() -> (TestDb, Client) {
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    let report = partitions::init(&mut client, 3).await.unwrap();
    assert_eq!(report.count(PartitionAction::Created), 4, "{report:?}");
    assert_eq!(report.partitions.len(), 4);
    assert!(partitions::is_partitioned(&client).await.unwrap());
    // Past days, as if the outbox had been partitioned for a while.
    for days_ago in [10, 9, 8, 2] {
        let outcome: String = client
            .query_one(
                "SELECT outbox_create_partition((now() AT TIME ZONE 'UTC')::date - $1::int4)",
                &[&days_ago],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(outcome, "created");
    }
    (db, client)
}

#[tokio::test]
async fn partitioned_outbox_claims_dedupes_prunes_and_drops_old_partitions() {
    let (db, mut client) = partitioned_db().await;

    // Spread over partitions: -10 published, -9 pending and published, -8 dead, -2, today.
    let published_old = insert_partitioned(&client, "k-10", 10).await.unwrap();
    set(
        &client,
        &[published_old],
        "published_at = now() - interval '9 days'",
    )
    .await;
    let pending_old = insert_partitioned(&client, "k-9-pending", 9).await.unwrap();
    let published_9 = insert_partitioned(&client, "k-9-published", 9)
        .await
        .unwrap();
    set(
        &client,
        &[published_9],
        "published_at = now() - interval '8 days'",
    )
    .await;
    let dead_old = insert_partitioned(&client, "k-8-dead", 8).await.unwrap();
    set(
        &client,
        &[dead_old],
        "dead_lettered_at = now() - interval '8 days'",
    )
    .await;
    let recent = insert_partitioned(&client, "k-2", 2).await.unwrap();
    let today = insert_partitioned(&client, "k-0", 0).await.unwrap();
    let places: Vec<(i64, String)> = client
        .query(
            "SELECT id, tableoid::regclass::text FROM outbox ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let distinct: std::collections::BTreeSet<&str> =
        places.iter().map(|(_, p)| p.as_str()).collect();
    assert_eq!(
        distinct.len(),
        5,
        "rows landed in their day's partitions: {places:?}"
    );
    assert!(!distinct.contains("outbox_default"));

    // The idempotency key stays unique across partitions (the trigger's table) ...
    assert_eq!(insert_partitioned(&client, "k-10", 0).await, None);
    assert_eq!(insert_partitioned(&client, "k-0", 3).await, None);
    // ... while the producer's `ON CONFLICT (idempotency_key)` cannot work here.
    let err = client
        .execute(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key)
             VALUES (gen_random_uuid(), 'order', 'x', 'order.placed', '{}', 'k-new')
             ON CONFLICT (idempotency_key) DO NOTHING",
            &[],
        )
        .await
        .unwrap_err();
    assert!(
        err.as_db_error().unwrap().message().contains("ON CONFLICT"),
        "{err:?}"
    );
    // Our producer API uses the portable form: new keys go in, repeats are reported.
    {
        let mut producer = db.client().await.unwrap();
        let tx = producer.transaction().await.unwrap();
        let fresh = outbox_client::NewEvent::new(
            uuid::Uuid::nil(),
            "order",
            "p",
            "order.placed",
            serde_json::json!({}),
            "k-producer",
        );
        assert!(outbox_client::enqueue(&tx, &fresh).await.unwrap().is_new());
        let mut repeat = fresh.clone();
        repeat.idempotency_key = "k-10".into();
        assert_eq!(
            outbox_client::enqueue(&tx, &repeat).await.unwrap(),
            outbox_client::Enqueued::Duplicate
        );
        tx.rollback().await.unwrap();
    }

    // The relay's own claim and mark work across partitions: the claim reads
    // every pending row of the shard, the mark (the one write) publishes them.
    let store = outbox_relay::store::Store::for_command(&db.url).unwrap();
    store.reshard(1).await.unwrap();
    let mut session = store.session();
    let me = outbox_relay::store::shards::Replica::this_process("partition-test");
    let taken = session
        .acquire(&me, Duration::from_secs(60), 1, &[])
        .await
        .unwrap();
    let fence = taken[0].fence;
    let scope = ClaimScope {
        fence,
        routes: &[],
        out: &[],
    };
    let claimed = session.claim_due(&scope, no_cursor(), 10).await.unwrap();
    let mut claimed_ids: Vec<i64> = claimed.iter().map(|c| c.row.id).collect();
    claimed_ids.sort();
    assert_eq!(claimed_ids, [pending_old, recent, today]);
    assert!(claimed.iter().all(|c| c.row.attempt == 1));
    let marks: Vec<_> = claimed
        .iter()
        .map(|c| (c.held(fence), Write::Published))
        .collect();
    let written = session.mark(&marks).await;
    assert_eq!(written.applied.len(), 3, "{written:?}");
    assert!(session
        .claim_due(&scope, no_cursor(), 10)
        .await
        .unwrap()
        .is_empty());
    set(
        &client,
        &[pending_old, recent, today],
        "published_at = NULL, attempt_count = 0",
    )
    .await;

    // Gauges read every partition.
    let snap = snapshot(&client).await.unwrap();
    assert_eq!((snap.backlog, snap.dead_letters), (3, 1));
    assert!(snap.oldest_pending_age_seconds >= 9.0 * 24.0 * 3600.0);

    // Row-level retention works on the partitioned table too.
    let report = prune::prune_table(
        &client,
        prune::Prunable::Published,
        Duration::from_secs(7 * 24 * 3600),
        1,
    )
    .await
    .unwrap();
    assert_eq!((report.deleted, report.statements), (2, 3));
    let published_again = insert_partitioned(&client, "k-10-again", 10).await.unwrap();
    set(
        &client,
        &[published_again],
        "published_at = now() - interval '9 days'",
    )
    .await;

    // Partition retention: -10 goes; -9 keeps a pending row, -8 a dead letter.
    let report = maintain(&mut client, MaintainOptions::default()).await;
    let by_action = |a| {
        report
            .changes
            .iter()
            .filter(|c| c.action == a)
            .map(|c| c.partition.clone())
            .collect::<Vec<_>>()
    };
    let day = |days_ago: i64| {
        partitions::partition_name(
            (report_today(&report) - chrono::Days::new(days_ago as u64)).to_owned(),
        )
    };
    assert_eq!(by_action(PartitionAction::Dropped), [day(10)]);
    assert_eq!(by_action(PartitionAction::HasPending), [day(9)]);
    assert_eq!(by_action(PartitionAction::HasDeadLetters), [day(8)]);
    assert!(by_action(PartitionAction::Created).is_empty());
    assert_eq!(report.partitions.len(), 7);
    assert_eq!(report.default_rows, 0);
    // Keys older than the oldest undelivered row (-9 days) are pruned: those
    // of the dropped partition's rows.
    assert_eq!(report.idempotency_keys_deleted, 2);
    let keys: Vec<String> = common::column(
        &client,
        "SELECT idempotency_key FROM outbox_idempotency_keys ORDER BY 1",
    )
    .await;
    assert_eq!(
        keys,
        ["k-0", "k-2", "k-8-dead", "k-9-pending", "k-9-published"]
    );
    let left = ids(&client, "SELECT id FROM outbox ORDER BY id").await;
    assert_eq!(left, [pending_old, dead_old, recent, today]);
}

/// Partition maintenance three days ahead, dropping days older than a week;
/// the other options from `rest`.
async fn maintain(client: &mut Client, rest: MaintainOptions) -> partitions::MaintainReport {
    let options = MaintainOptions {
        ahead_days: 3,
        retain: Duration::from_secs(7 * 24 * 3600),
        ..rest
    };
    partitions::maintain(client, &options).await.unwrap()
}

/// The UTC day `maintain` called today: the newest created partition minus `ahead`.
fn report_today(report: &partitions::MaintainReport) -> chrono::NaiveDate {
    let newest = report.partitions.last().unwrap();
    chrono::NaiveDate::parse_from_str(&newest["outbox_p".len()..], "%Y%m%d").unwrap()
        - chrono::Days::new(3)
}

#[tokio::test]
async fn partition_maintenance_gives_up_on_a_held_lock_and_keeps_inserts_safe() {
    let (db, mut client) = partitioned_db().await;
    // A row far ahead of every partition lands in the default partition.
    let far = insert_partitioned(&client, "k-future", -30).await.unwrap();
    let place: String = client
        .query_one(
            "SELECT tableoid::regclass::text FROM outbox WHERE id = $1",
            &[&far],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(place, "outbox_default");

    // A long transaction reading the outbox holds ACCESS SHARE on it.
    let mut holder = db.client().await.unwrap();
    let tx = holder.transaction().await.unwrap();
    tx.query("SELECT count(*) FROM outbox", &[]).await.unwrap();
    let report = maintain(
        &mut client,
        MaintainOptions {
            lock_timeout: Duration::from_millis(200),
            ..MaintainOptions::default()
        },
    )
    .await;
    let timed_out: Vec<_> = report
        .changes
        .iter()
        .filter(|c| c.action == PartitionAction::LockTimeout)
        .collect();
    assert_eq!(timed_out.len(), 3, "the three expired days: {report:?}");
    assert_eq!(report.default_rows, 1);
    tx.rollback().await.unwrap();

    // With the lock free, the same run drops them.
    let report = maintain(&mut client, MaintainOptions::default()).await;
    assert_eq!(report.count(PartitionAction::Dropped), 3, "{report:?}");

    // The CLI shows the warning about the default partition.
    let out = common::cli_ok(&db, &["partitions", "maintain", "--ahead", "3"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("outbox_default holds 1 rows"), "{text}");
}

#[tokio::test]
async fn partitioning_refuses_a_non_empty_or_partitioned_outbox() {
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    let out = common::cli(&db, &["partitions", "maintain"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not partitioned"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    insert(&client, 1, "order.placed", 0.0).await;
    let err = partitions::init(&mut client, 1).await.unwrap_err();
    assert!(err.to_string().contains("the outbox has rows"), "{err}");
    assert!(!partitions::is_partitioned(&client).await.unwrap());
    assert_eq!(count(&client, "SELECT count(*) FROM outbox").await, 1);

    client.batch_execute("DELETE FROM outbox").await.unwrap();
    let out = common::cli_ok(&db, &["partitions", "init", "--ahead", "1"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("2 partitions created"));
    let err = partitions::init(&mut client, 1).await.unwrap_err();
    assert!(err.to_string().contains("already partitioned"), "{err}");
}

#[tokio::test]
async fn the_published_at_index_serves_the_throughput_series_and_retention() {
    let db = common::test_db().await;
    let client = db.client().await.unwrap();
    // Enough published history that reading it all would be the planner's worst choice.
    client
        .batch_execute(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload,
                                 idempotency_key, created_at, published_at)
             SELECT gen_random_uuid(), 'order', g::text, 'order.placed', '{}', 'k' || g,
                    now() - g * interval '10 seconds', now() - g * interval '10 seconds'
             FROM generate_series(1, 20000) g;
             ANALYZE outbox;",
        )
        .await
        .unwrap();
    let plan = |sql: &'static str| {
        let client = &client;
        async move {
            client
                .query(&format!("EXPLAIN (COSTS OFF) {sql}"), &[])
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, String>(0))
                .collect::<Vec<_>>()
                .join("\n")
        }
    };
    let series = plan(
        "SELECT date_trunc('minute', published_at), count(*) FROM outbox
         WHERE published_at >= date_trunc('minute', now()) - interval '59 minutes' GROUP BY 1",
    )
    .await;
    assert!(series.contains("outbox_published_at_idx"), "{series}");
    let retention = plan(
        "SELECT id FROM outbox WHERE published_at < now() - interval '1 day'
           AND dead_lettered_at IS NULL ORDER BY published_at LIMIT 5000",
    )
    .await;
    assert!(retention.contains("outbox_published_at_idx"), "{retention}");
}

/// Migration 0014 drops the two indexes no statement reads on a plain outbox
/// (each was an entry per producer insert); on an outbox partitioned before it
/// (whose indexes cannot be dropped concurrently) it runs and leaves them.
#[tokio::test]
async fn migration_0014_drops_two_unread_indexes_and_leaves_a_partitioned_outboxs() {
    const DROPPED: &str = "SELECT indexname::text FROM pg_indexes
        WHERE schemaname = 'public' AND tablename = 'outbox'
          AND indexname IN ('outbox_ready_idx', 'outbox_pending_age_idx') ORDER BY 1";
    let both = vec![
        "outbox_pending_age_idx".to_owned(),
        "outbox_ready_idx".to_owned(),
    ];
    let plain = TestDb::empty().await.unwrap();
    let mut client = plain.client().await.unwrap();
    migrate::run_to(&mut client, 13).await.unwrap();
    assert_eq!(
        common::column::<String, Vec<_>>(&client, DROPPED).await,
        both
    );
    let report = migrate::run(&mut client).await.unwrap();
    assert!(
        common::column::<String, Vec<String>>(&client, DROPPED)
            .await
            .is_empty(),
        "{report:?}"
    );
    drop(client);

    let partitioned = TestDb::empty().await.unwrap();
    let mut client = partitioned.client().await.unwrap();
    migrate::run_to(&mut client, 13).await.unwrap();
    partitions::init(&mut client, 0).await.unwrap();
    // As the script made it before 0014 (it no longer builds the ready index).
    client
        .batch_execute(
            "CREATE INDEX outbox_ready_idx ON outbox (available_at, id)
             WHERE published_at IS NULL AND dead_lettered_at IS NULL",
        )
        .await
        .unwrap();
    migrate::run(&mut client).await.unwrap();
    let version: i32 = client
        .query_one("SELECT max(version) FROM outbox_relay_migrations", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, 14);
    assert_eq!(
        common::column::<String, Vec<_>>(&client, DROPPED).await,
        both
    );
}

/// The optional script rebuilds the outbox from scratch: it must stay in step
/// with every migration that changes the outbox, or `partitions init` would
/// silently drop a column or an index the relay needs.
#[tokio::test]
async fn the_partitioned_outbox_has_every_column_and_index_of_the_migrated_one() {
    const COLUMNS: &str = "SELECT column_name || ' ' || data_type || ' ' || is_nullable || ' ' || coalesce(column_default, '') || ' ' || is_identity
        FROM information_schema.columns WHERE table_schema = 'public' AND table_name = 'outbox' ORDER BY ordinal_position";
    // Index names and their definitions without the ON clause (ONLY / not).
    const INDEXES: &str = "SELECT indexname || ': ' || regexp_replace(indexdef, '^.* USING ', '')
        FROM pg_indexes WHERE schemaname = 'public' AND tablename = 'outbox' ORDER BY 1";
    const TRIGGERS: &str = "SELECT tgname::text FROM pg_trigger
        WHERE tgrelid = 'outbox'::regclass AND NOT tgisinternal ORDER BY 1";
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    let (columns, indexes, triggers) = (
        common::column::<String, Vec<_>>(&client, COLUMNS).await,
        common::column::<String, Vec<_>>(&client, INDEXES).await,
        common::column::<String, Vec<_>>(&client, TRIGGERS).await,
    );
    assert_eq!(columns.len(), 19, "{columns:?}");
    assert!(indexes.len() >= 7, "{indexes:?}");
    assert_eq!(triggers.len(), 1, "{triggers:?}"); // no NOTIFY trigger (migration 0006)
    partitions::init(&mut client, 0).await.unwrap();
    assert_eq!(
        common::column::<String, Vec<_>>(&client, COLUMNS).await,
        columns
    );
    let partitioned_indexes = common::column::<String, Vec<_>>(&client, INDEXES).await;
    for index in &indexes {
        let expected = match index.split(':').next().unwrap() {
            // The two constraints partitioning must change (docs/partitioning.md).
            "outbox_pkey" => "outbox_pkey: btree (id, created_at)".to_owned(),
            "outbox_idempotency_key_key" => {
                "outbox_idempotency_key_idx: btree (idempotency_key)".to_owned()
            }
            _ => index.clone(),
        };
        assert!(
            partitioned_indexes.contains(&expected),
            "{expected} missing from the partitioned outbox: {partitioned_indexes:?}"
        );
    }
    let partitioned_triggers = common::column::<String, Vec<_>>(&client, TRIGGERS).await;
    for trigger in &triggers {
        assert!(partitioned_triggers.contains(trigger), "{trigger}");
    }
}
