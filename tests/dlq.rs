//! `outbox-relay dlq`: list, show, replay and purge against a real database
//! holding dead, pending and published rows.

mod common;

use std::process::ExitCode;

use clap::Parser;
use outbox_client::{enqueue, Enqueued, NewEvent};
use outbox_relay::cli::dlq::{self, DlqCommand, Selector};
use outbox_relay::routes::Router;
use outbox_relay::store::{Store, StoreError};
use outbox_testkit::TestDb;
use serde_json::{json, Value};
use tokio_postgres::Client;
use uuid::Uuid;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: DlqCommand,
}

fn parse(args: &[&str]) -> Result<DlqCommand, clap::Error> {
    Cli::try_parse_from(std::iter::once("dlq").chain(args.iter().copied())).map(|c| c.cmd)
}

struct Rows {
    /// order.failed, dead 3 hours ago.
    old_dead: i64,
    /// order.failed, dead 10 minutes ago.
    new_dead: i64,
    /// payment.failed, dead 1 hour ago.
    payment_dead: i64,
    pending: i64,
    published: i64,
}

async fn insert(client: &mut Client, key: &str, event_type: &str) -> i64 {
    insert_keyed(client, key, &format!("order:{key}"), event_type).await
}

/// An event with idempotency key `key` in partition `partition_key`.
async fn insert_keyed(
    client: &mut Client,
    key: &str,
    partition_key: &str,
    event_type: &str,
) -> i64 {
    let tx = client.transaction().await.unwrap();
    let event = NewEvent::new(
        Uuid::new_v4(),
        "order",
        key,
        event_type,
        json!({"orderId": key, "lines": [{"sku": "A", "qty": 2}]}),
        key,
    )
    .with_partition_key(partition_key.to_owned());
    let Enqueued::New { id } = enqueue(&tx, &event).await.unwrap() else {
        panic!("duplicate key {key}");
    };
    tx.commit().await.unwrap();
    id
}

async fn kill(client: &Client, id: i64, ago: &str, error: &str) {
    client
        .execute(
            "UPDATE outbox SET dead_lettered_at = now() - $2::text::interval, attempt_count = 8,
                 last_error = $3, published_at = now() - interval '4 hours',
                 locked_until = now() + interval '1 minute', available_at = now() - interval '1 day'
             WHERE id = $1",
            &[&id, &ago, &error],
        )
        .await
        .unwrap();
}

async fn setup() -> (TestDb, Client, Rows) {
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    let rows = Rows {
        old_dead: insert(&mut client, "k-old", "order.failed").await,
        new_dead: insert(&mut client, "k-new", "order.failed").await,
        payment_dead: insert(&mut client, "k-pay", "payment.failed").await,
        pending: insert(&mut client, "k-pending", "order.failed").await,
        published: insert(&mut client, "k-published", "order.failed").await,
    };
    kill(&client, rows.old_dead, "3 hours", "status 410: gone").await;
    kill(
        &client,
        rows.new_dead,
        "10 minutes",
        "status 400:\nbad request",
    )
    .await;
    kill(&client, rows.payment_dead, "1 hour", &"x".repeat(300)).await;
    client
        .execute(
            "UPDATE outbox SET published_at = now() WHERE id = $1",
            &[&rows.published],
        )
        .await
        .unwrap();
    (db, client, rows)
}

fn store(db: &TestDb) -> Store {
    Store::for_command(&db.url).unwrap()
}

async fn run(store: &Store, args: &[&str]) -> (ExitCode, String) {
    run_for(store, &Router::default(), args).await
}

/// The same for the routes of `router`.
async fn run_for(store: &Store, router: &Router, args: &[&str]) -> (ExitCode, String) {
    let mut out = Vec::new();
    let code = dlq::execute(parse(args).unwrap(), store, router, &mut out)
        .await
        .unwrap();
    (code, String::from_utf8(out).unwrap())
}

async fn state(client: &Client, id: i64) -> Value {
    client
        .query_one(
            "SELECT jsonb_build_object(
                'key', idempotency_key, 'dead', dead_lettered_at IS NOT NULL,
                'published', published_at IS NOT NULL, 'attempts', attempt_count,
                'locked', locked_until IS NOT NULL, 'error', last_error,
                'available_now', available_at > now() - interval '1 minute' AND available_at <= now())
             FROM outbox WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn list_shows_dead_rows_newest_first_with_filters() {
    let (db, _client, rows) = setup().await;
    let store = store(&db);
    let all = store.dead_letters(None, None, 100).await.unwrap();
    let ids: Vec<i64> = all.iter().map(|r| r.id).collect();
    assert_eq!(ids, vec![rows.new_dead, rows.payment_dead, rows.old_dead]);
    assert_eq!(all[0].event_type, "order.failed");
    assert_eq!(all[0].partition_key, "order:k-new");
    assert_eq!(all[0].attempt_count, 8);
    assert_eq!(
        all[0].last_error.as_deref(),
        Some("status 400:\nbad request")
    );

    let orders = store
        .dead_letters(Some("order.failed"), None, 100)
        .await
        .unwrap();
    assert_eq!(
        orders.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![rows.new_dead, rows.old_dead]
    );
    let recent = store
        .dead_letters(None, Some(dlq::parse_time("2h").unwrap()), 100)
        .await
        .unwrap();
    assert_eq!(
        recent.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![rows.new_dead, rows.payment_dead]
    );
    assert_eq!(store.dead_letters(None, None, 1).await.unwrap().len(), 1);

    // Human output: one aligned table, errors on one line.
    let (_, text) = run(&store, &["list"]).await;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    let error_column = lines[0].find("LAST ERROR").unwrap();
    let type_column = lines[0].find("TYPE").unwrap();
    assert!(lines[1].starts_with(&rows.new_dead.to_string()));
    assert_eq!(&lines[1][type_column..type_column + 12], "order.failed");
    assert_eq!(&lines[1][error_column..], "status 400: bad request");
    assert!(lines[2][error_column..].ends_with('…'));
    assert_eq!(lines[2][error_column..].chars().count(), 80);

    // JSON output, filtered through the command line.
    let (_, text) = run(
        &store,
        &["list", "--event-type", "payment.failed", "--json"],
    )
    .await;
    let json: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json.as_array().unwrap().len(), 1);
    assert_eq!(json[0]["id"], json!(rows.payment_dead));
    assert_eq!(json[0]["last_error"], json!("x".repeat(300)));
    assert!(json[0]["dead_lettered_at"].is_string());
}

#[tokio::test]
async fn show_prints_the_whole_row() {
    let (db, _client, rows) = setup().await;
    let store = store(&db);
    let (_, text) = run(&store, &["show", &rows.old_dead.to_string()]).await;
    for column in [
        "tenant_id",
        "idempotency_key",
        "partition_key",
        "dead_lettered_at",
        "attempt_count",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(column)),
            "{column} in {text}"
        );
    }
    assert!(text.contains("status 410: gone"));
    // The payload is pretty-printed over several lines.
    assert!(text.contains("\"sku\": \"A\""), "{text}");
    let (_, text) = run(&store, &["show", &rows.old_dead.to_string(), "--json"]).await;
    let json: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["id"], json!(rows.old_dead));
    assert_eq!(json["payload"]["lines"][0]["qty"], json!(2));
    assert_eq!(json["idempotency_key"], json!("k-old"));
    assert!(matches!(
        store.row_columns(123_456).await,
        Err(StoreError::NotFound(why)) if why == "no outbox row 123456"
    ));
}

#[tokio::test]
async fn replay_resets_rows_to_pending_with_new_unique_keys() {
    let (db, client, rows) = setup().await;
    let store = store(&db);
    let selector = Selector {
        ids: vec![rows.old_dead, rows.pending, rows.published],
        ..Selector::default()
    };
    // As if QStash had taken it for an ordered route before it died.
    client
        .execute(
            "UPDATE outbox SET accepted_at = now() WHERE id = $1",
            &[&rows.old_dead],
        )
        .await
        .unwrap();
    let replayed = store.replay_dead(&selector.selection()).await.unwrap();
    // Only the dead row among them.
    assert_eq!(replayed.len(), 1);
    assert_eq!(replayed[0].id, rows.old_dead);
    assert_eq!(replayed[0].idempotency_key, "k-old:replay:1");
    assert_eq!(
        state(&client, rows.old_dead).await,
        json!({"key": "k-old:replay:1", "dead": false, "published": false, "attempts": 0,
               "locked": false, "error": null, "available_now": true})
    );
    let accepted: bool = client
        .query_one(
            "SELECT accepted_at IS NOT NULL FROM outbox WHERE id = $1",
            &[&rows.old_dead],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        !accepted,
        "a replayed row kept an earlier attempt's acceptance"
    );
    assert_eq!(
        state(&client, rows.pending).await["key"],
        json!("k-pending")
    );
    assert_eq!(
        state(&client, rows.published).await["published"],
        json!(true)
    );

    // Dead again, replayed again: the count goes up from the original key.
    kill(&client, rows.old_dead, "1 minute", "again").await;
    let again = store.replay_dead(&selector.selection()).await.unwrap();
    assert_eq!(again[0].idempotency_key, "k-old:replay:2");

    // By event type and time window, through the command line.
    let (_, text) = run(
        &store,
        &[
            "replay",
            "--event-type",
            "order.failed",
            "--since",
            "1h",
            "--json",
        ],
    )
    .await;
    let json: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["replayed"], json!(1));
    assert_eq!(json["rows"][0]["id"], json!(rows.new_dead));
    assert_eq!(json["rows"][0]["idempotency_key"], json!("k-new:replay:1"));
    let (_, text) = run(&store, &["replay", "--all"]).await;
    assert_eq!(text, "replayed 1 dead-lettered rows\n");
    assert_eq!(
        state(&client, rows.payment_dead).await["key"],
        json!("k-pay:replay:1")
    );
    assert!(store
        .dead_letters(None, None, 100)
        .await
        .unwrap()
        .is_empty());

    // Keys stay unique across the table.
    let duplicates: i64 = client
        .query_one(
            "SELECT count(*) - count(DISTINCT idempotency_key) FROM outbox",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(duplicates, 0);
}

#[tokio::test]
async fn replay_skips_a_derived_key_that_is_already_taken() {
    let (db, mut client, rows) = setup().await;
    let store = store(&db);
    // A producer already used the key a replay would derive.
    let squatter = insert(&mut client, "k-old:replay:1", "order.failed").await;
    let replayed = store
        .replay_dead(
            &Selector {
                all: true,
                ..Selector::default()
            }
            .selection(),
        )
        .await
        .unwrap();
    let keys: Vec<(i64, &str)> = replayed
        .iter()
        .map(|r| (r.id, r.idempotency_key.as_str()))
        .collect();
    assert_eq!(
        keys,
        vec![
            (rows.old_dead, "k-old:replay:2"),
            (rows.new_dead, "k-new:replay:1"),
            (rows.payment_dead, "k-pay:replay:1"),
        ]
    );
    assert_eq!(
        state(&client, squatter).await["key"],
        json!("k-old:replay:1")
    );
    assert_eq!(state(&client, rows.old_dead).await["dead"], json!(false));
}

#[tokio::test]
async fn replay_and_purge_need_a_selector() {
    let (db, _client, _rows) = setup().await;
    let store = store(&db);
    for args in [&["replay"][..], &["purge", "--yes"], &["replay", "--json"]] {
        assert!(parse(args).is_err(), "{args:?} parsed");
    }
    assert!(parse(&["replay", "--id", "1", "--id", "2"]).is_ok());
    assert!(matches!(
        store.replay_dead(&Selector::default().selection()).await,
        Err(StoreError::Refused(why)) if why.starts_with("choose the rows")
    ));
    assert!(matches!(
        store.purge_dead(&Selector::default().selection()).await,
        Err(StoreError::Refused(why)) if why.starts_with("choose the rows")
    ));
    assert!(parse(&["list", "--since", "last tuesday"]).is_err());
}

#[tokio::test]
async fn purge_refuses_without_yes_and_deletes_only_dead_rows_with_it() {
    let (db, client, rows) = setup().await;
    let cli = |args: &[&str]| common::cli(&db, &[&["dlq"], args].concat());
    let refused = cli(&["purge", "--all"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stdout).contains("refusing to delete 3"));
    let count = |sql: &'static str| {
        let client = &client;
        async move { client.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(count("SELECT count(*) FROM outbox").await, 5);

    let purged = cli(&[
        "purge",
        "--event-type",
        "order.failed",
        "--until",
        "1h",
        "--yes",
        "--json",
    ]);
    assert!(
        purged.status.success(),
        "{}",
        String::from_utf8_lossy(&purged.stderr)
    );
    let json: Value = serde_json::from_slice(&purged.stdout).unwrap();
    assert_eq!(json, json!({"purged": 1, "ids": [rows.old_dead]}));

    let purged = cli(&["purge", "--all", "--yes"]);
    assert_eq!(
        String::from_utf8_lossy(&purged.stdout),
        "purged 2 dead-lettered rows\n"
    );
    let left: Vec<i64> = common::column(&client, "SELECT id FROM outbox ORDER BY id").await;
    assert_eq!(left, vec![rows.pending, rows.published]);

    // The binary's list sees an empty dead-letter queue.
    let listed = cli(&["list"]);
    assert!(listed.status.success());
    assert_eq!(
        String::from_utf8_lossy(&listed.stdout),
        "no dead-lettered rows\n"
    );
}

/// On an ordered route, a replayed dead row goes out before its key's newer
/// pending events; a replay that would deliver it after a newer event of its
/// key that was delivered already is refused, naming the key, unless
/// `--allow-reorder` is given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_keeps_each_key_in_order_or_refuses() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let mut client = db.client().await.unwrap();
    // Key a: a-1 dead, a-2 published. Key b: b-1 dead, b-2 pending.
    let a1 = insert_keyed(&mut client, "a-1", "order:a", "order.placed").await;
    let a2 = insert_keyed(&mut client, "a-2", "order:a", "order.placed").await;
    let b1 = insert_keyed(&mut client, "b-1", "order:b", "order.placed").await;
    insert_keyed(&mut client, "b-2", "order:b", "order.placed").await;
    kill(&client, a1, "1 minute", "HTTP 404").await;
    kill(&client, b1, "1 minute", "HTTP 404").await;
    client
        .execute(
            "UPDATE outbox SET published_at = now() WHERE id = $1",
            &[&a2],
        )
        .await
        .unwrap();
    let routes = common::webhook_route(&sink.url(), r#"ordering = "partition_key""#);
    let cfg = common::config(&db, &sink.url(), &routes);
    let router = Router::new(&cfg.routes);
    let store = store(&db);

    let (code, text) = run_for(&store, &router, &["replay", "--all"]).await;
    assert_eq!(code, ExitCode::from(2), "{text}");
    assert!(
        text.starts_with("refusing to replay: 1 dead rows") && text.contains("order:a (1)"),
        "{text}"
    );
    assert!(!text.contains("order:b"), "{text}");
    assert_eq!(state(&client, a1).await["dead"], json!(true));
    assert_eq!(
        state(&client, b1).await["dead"],
        json!(true),
        "nothing replayed"
    );
    // An unordered route keeps no order: the same replay goes through.
    let (code, _) = run_for(
        &store,
        &Router::default(),
        &["replay", "--id", &a1.to_string()],
    )
    .await;
    assert_eq!(code, ExitCode::SUCCESS);
    kill(&client, a1, "1 minute", "HTTP 404").await;

    // Key b alone: its dead row goes out before its pending one.
    let (code, text) = run_for(&store, &router, &["replay", "--id", &b1.to_string()]).await;
    assert_eq!(
        (code, text.as_str()),
        (ExitCode::SUCCESS, "replayed 1 dead-lettered rows\n")
    );
    common::run_until_drained(&db, cfg, std::time::Duration::from_secs(60)).await;
    let b: Vec<String> = sink
        .accepted()
        .into_iter()
        .filter(|r| r.partition_key() == "order:b" || r.dedup_id.starts_with("b-"))
        .map(|r| r.dedup_id)
        .collect();
    assert_eq!(b, ["b-1:replay:1", "b-2"]);

    // Told to, it replays key a's row after all.
    let (code, text) = run_for(
        &store,
        &router,
        &[
            "replay",
            "--id",
            &a1.to_string(),
            "--allow-reorder",
            "--json",
        ],
    )
    .await;
    assert_eq!(code, ExitCode::SUCCESS, "{text}");
    assert_eq!(state(&client, a1).await["key"], json!("a-1:replay:2"));
}
