//! Schema, migrations, producer API and config, against a real PostgreSQL.

mod common;

use std::process::Command;

use outbox_client::{enqueue, enqueue_many, EnqueueError, Enqueued, NewEvent};
use outbox_relay::config::Config;
use outbox_relay::store::migrate;
use outbox_testkit::TestDb;
use serde_json::json;
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

fn event(key: &str) -> NewEvent {
    NewEvent::new(
        Uuid::new_v4(),
        "order",
        "o-1",
        "order.placed",
        json!({"orderId": "o-1", "totalCents": 1299}),
        key,
    )
}

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn migrations_apply_once_and_are_a_no_op_after() {
    let db = TestDb::empty().await.unwrap();
    let mut client = db.client().await.unwrap();
    let first = migrate::run(&mut client).await.unwrap();
    let all: Vec<i32> = migrate::MIGRATIONS.iter().map(|m| m.version).collect();
    assert_eq!(first.applied, all);
    let schema_before: Vec<String> = common::column(&client, "SELECT table_name || '.' || column_name || ':' || data_type FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1").await;
    let second = migrate::run(&mut client).await.unwrap();
    assert_eq!(second.applied, Vec::<i32>::new());
    assert_eq!(second.already, migrate::MIGRATIONS.len());
    let schema_after: Vec<String> = common::column(&client, "SELECT table_name || '.' || column_name || ':' || data_type FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1").await;
    assert_eq!(schema_before, schema_after);
    assert!(schema_after.contains(&"outbox.partition_key:text".to_owned()));
}

#[tokio::test]
async fn migrate_from_two_processes_at_once() {
    let db = TestDb::empty().await.unwrap();
    let spawn = || {
        Command::new(BIN)
            .arg("migrate")
            .env("DATABASE_URL", &db.url)
            .env_remove("OUTBOX_RELAY_LOG")
            .output()
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(spawn);
        let b = s.spawn(spawn);
        (a.join().unwrap().unwrap(), b.join().unwrap().unwrap())
    });
    for out in [&a, &b] {
        assert!(
            out.status.success(),
            "migrate failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let outputs = [
        String::from_utf8_lossy(&a.stdout).to_string(),
        String::from_utf8_lossy(&b.stdout).to_string(),
    ];
    // Exactly one of them applied the migrations; the other found them done.
    assert_eq!(
        outputs
            .iter()
            .filter(|o| o.contains("applied migrations"))
            .count(),
        1,
        "{outputs:?}"
    );
    assert_eq!(
        outputs.iter().filter(|o| o.contains("up to date")).count(),
        1,
        "{outputs:?}"
    );
    let client = db.client().await.unwrap();
    assert_eq!(
        count(&client, "SELECT count(*) FROM outbox_relay_migrations").await,
        migrate::MIGRATIONS.len() as i64
    );
}

#[tokio::test]
async fn refuses_a_database_migrated_by_a_newer_binary() {
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    client
        .execute("INSERT INTO outbox_relay_migrations (version, name, checksum) VALUES (99, 'future', 'x')", &[])
        .await
        .unwrap();
    let err = migrate::run(&mut client).await.unwrap_err();
    assert!(
        matches!(
            err,
            migrate::MigrateError::UnknownMigration { version: 99, .. }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("migration 99 (future)"));
}

#[tokio::test]
async fn enqueue_in_a_rolled_back_transaction_leaves_no_row() {
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let r = enqueue(&tx, &event("k-rollback")).await.unwrap();
    assert!(r.is_new());
    tx.rollback().await.unwrap();
    assert_eq!(count(&client, "SELECT count(*) FROM outbox").await, 0);

    let tx = client.transaction().await.unwrap();
    enqueue(&tx, &event("k-commit")).await.unwrap();
    tx.commit().await.unwrap();
    let row = client
        .query_one(
            "SELECT partition_key, attempt_count, published_at IS NULL FROM outbox",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "order:o-1");
    assert_eq!(row.get::<_, i32>(1), 0);
    assert!(row.get::<_, bool>(2));
}

#[tokio::test]
async fn duplicate_idempotency_key_is_reported_not_an_error() {
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let first = enqueue(&tx, &event("dup")).await.unwrap();
    let second = enqueue(&tx, &event("dup")).await.unwrap();
    tx.commit().await.unwrap();
    assert!(matches!(first, Enqueued::New { .. }));
    assert_eq!(second, Enqueued::Duplicate);
    assert_eq!(count(&client, "SELECT count(*) FROM outbox").await, 1);
}

#[tokio::test]
async fn enqueue_many_in_one_round_trip_reports_each_event() {
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    let tx = client.transaction().await.unwrap();
    enqueue(&tx, &event("b")).await.unwrap();
    let events = vec![
        event("a").with_partition_key("custom-key"),
        event("b"),
        event("c").with_header("schema-version", "2"),
        event("a"),
    ];
    let results = enqueue_many(&tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    assert!(results[0].is_new());
    assert_eq!(results[1], Enqueued::Duplicate);
    assert!(results[2].is_new());
    assert_eq!(results[3], Enqueued::Duplicate);
    let rows = client
        .query(
            "SELECT idempotency_key, partition_key, headers FROM outbox ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    let got: Vec<(String, String, serde_json::Value)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        got,
        vec![
            ("b".into(), "order:o-1".into(), json!({})),
            ("a".into(), "custom-key".into(), json!({})),
            (
                "c".into(),
                "order:o-1".into(),
                json!({"schema-version": "2"})
            ),
        ]
    );
}

#[tokio::test]
async fn bad_events_get_typed_errors_before_the_database() {
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let mut e = event("x");
    e.payload = json!([1, 2]);
    assert!(matches!(
        enqueue(&tx, &e).await,
        Err(EnqueueError::PayloadNotObject { found: "an array" })
    ));
    let mut e = event("x");
    e.headers = json!("nope");
    assert!(matches!(
        enqueue(&tx, &e).await,
        Err(EnqueueError::HeadersNotObject { .. })
    ));
    let mut e = event("x");
    e.headers = json!({"x-n": 5});
    match enqueue(&tx, &e).await {
        Err(EnqueueError::HeaderNotString { name, found }) => {
            assert_eq!(name, "x-n");
            assert_eq!(found, "a number");
        }
        other => panic!("expected HeaderNotString, got {other:?}"),
    }
    let e = event("  ");
    assert!(matches!(
        enqueue(&tx, &e).await,
        Err(EnqueueError::EmptyIdempotencyKey)
    ));
    let bad = vec![event("ok"), event("")];
    match enqueue_many(&tx, &bad).await {
        Err(EnqueueError::InBatch { index: 1, source }) => {
            assert!(matches!(*source, EnqueueError::EmptyIdempotencyKey))
        }
        other => panic!("expected InBatch, got {other:?}"),
    }
    tx.commit().await.unwrap();
    assert_eq!(count(&client, "SELECT count(*) FROM outbox").await, 0);
}

#[tokio::test]
async fn an_application_using_only_the_classic_outbox_columns_still_works() {
    let db = common::test_db().await;
    let client = db.client().await.unwrap();
    // The classic outbox enqueue: seven columns, jsonb from text.
    client
        .execute(
            "INSERT INTO outbox
               (tenant_id, aggregate_type, aggregate_id, event_type, payload, headers, idempotency_key)
             VALUES ($1, $2, $3, $4, $5::text::jsonb, $6::text::jsonb, $7)
             ON CONFLICT (idempotency_key) DO NOTHING",
            &[&Uuid::new_v4(), &"order", &"42", &"order.placed", &r#"{"orderId":"42"}"#, &r#"{"schema-version":"1"}"#, &"order.placed:42"],
        )
        .await
        .unwrap();
    // ... and the classic claim: ORDER BY id, a 30 s lease, attempt_count + 1.
    let claimed = client
        .query(
            "WITH claimed AS (
               SELECT id FROM outbox
               WHERE published_at IS NULL AND dead_lettered_at IS NULL
                 AND available_at <= now() AND (locked_until IS NULL OR locked_until < now())
               ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED)
             UPDATE outbox o SET locked_until = now() + ($2::int * interval '1 second'),
                                 attempt_count = o.attempt_count + 1
             FROM claimed WHERE o.id = claimed.id
             RETURNING o.id, o.partition_key, o.attempt_count",
            &[&10i64, &30i32],
        )
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].get::<_, String>(1), "order:42");
    assert_eq!(claimed[0].get::<_, i32>(2), 1);
}

#[test]
fn config_errors_name_their_key() {
    let cases = [
        ("[relay]\nshards = 0\n", "relay.shards"),
        ("[relay]\nshards = \"two\"\n", "relay.shards"),
        ("[relay]\nshardz = 2\n", "shardz"),
        ("[relay]\nlease = \"5s\"\n[http]\nrequest_timeout = \"10s\"\n", "relay.lease"),
        (
            "[[routes]]\nevent_type = \"order.*\"\ndestination = \"https://x.example/{event_type}\"\n",
            "qstash.token",
        ),
        (
            "[[routes]]\nevent_type = \"order*\"\ndestination = \"https://x.example/\"\nsink = \"webhook\"\nsigning_secret = \"whsec_AQID\"\n",
            "routes[0].event_type",
        ),
        (
            "[[routes]]\nevent_type = \"a\"\ndestination = \"https://x.example/\"\nsink = \"webhook\"\n",
            "routes[0].signing_secret",
        ),
        ("[relay]\nlease = \"forever\"\n", "relay.lease"),
        (
            "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"a\"\ndestination = \"https://x.example/\"\nordering = \"partition_key\"\n",
            "routes[0].callback",
        ),
        (
            "[[routes]]\nevent_type = \"a\"\ndestination = \"https://x.example/\"\nsink = \"webhook\"\nsigning_secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\nordering = \"partition_key_to_qstash\"\n",
            "routes[0].ordering",
        ),
    ];
    common::assert_config_errors_name(&cases);
    let ok = Config::from_toml_str(
        "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"order.*\"\ndestination = \"https://x.example/{event_type}\"\nordering = \"partition_key_to_qstash\"\n",
    )
    .unwrap();
    assert!(ok.any_ordered_route());
}

#[test]
fn the_documented_example_config_is_valid_and_complete() {
    let example =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config/relay.toml")).unwrap();
    // The shipped catch-all route's destination comes from the environment.
    std::env::set_var(
        "OUTBOX_DESTINATION_URL",
        "https://api.example.com/events/{event_type}",
    );
    // ... and a QStash route needs a token (QSTASH_TOKEN, in production).
    let example = example.replacen("token = \"\"", "token = \"t\"", 1);
    let parsed = Config::from_toml_str(&example).unwrap();
    assert_eq!(
        parsed.routes[0].destination.as_str(),
        "https://api.example.com/events/{event_type}"
    );
    // Every default is written out in the example (routes aside, which have none).
    let mut defaults = Config {
        routes: parsed.routes.clone(),
        ..Config::default()
    };
    defaults.qstash.token = parsed.qstash.token.clone();
    defaults.database.url = parsed.database.url.clone();
    assert_eq!(
        parsed, defaults,
        "config/relay.toml drifted from the defaults"
    );
}

#[test]
fn the_binary_stops_at_start_naming_the_bad_key() {
    let out = Command::new(BIN)
        .args(["check-config"])
        .env("OUTBOX_RELAY_RELAY__PUBLISHERS", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("relay.publishers"), "{stderr}");

    let dir = tempfile::tempdir().unwrap();
    let with_route = dir.path().join("relay.toml");
    std::fs::write(
        &with_route,
        "[[routes]]\nevent_type = \"*\"\ndestination = \"https://api.example.com/e\"\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["check-config", "--config"])
        .arg(&with_route)
        .env("OUTBOX_RELAY_RELAY__SHARDS", "6")
        .env("QSTASH_TOKEN", "secret-token-value")
        .env("DATABASE_URL", "postgres://u:pw@db.example/x")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("\"shards\": 6"), "{stdout}");
    assert!(
        !stdout.contains("secret-token-value") && !stdout.contains(":pw@"),
        "{stdout}"
    );
}

/// An ordered QStash route holds each event QStash took for its callback for
/// `callback_timeout`; when the hold runs out the event is sent again under
/// the same deduplication id. QStash keeps an id for 10 minutes, so a hold
/// longer than that re-sends every event whose callback was lost as a new
/// message (delivered again). The default is under the window, and a route
/// that sets more is warned about, naming the key: at `check-config`, and
/// by the relay at start.
#[test]
fn callback_timeout_defaults_below_qstash_deduplication_window_and_warns_above() {
    let window = std::time::Duration::from_secs(600);
    let route = |timeout: &str| {
        format!(
            "[qstash]\ntoken = \"t\"\ncurrent_signing_key = \"k\"\n[server]\ncallback_bind = \"127.0.0.1:0\"\n\
             [[routes]]\nevent_type = \"order.*\"\ndestination = \"https://x.example/{{event_type}}\"\n\
             ordering = \"partition_key\"\ncallback = \"https://relay.example/qstash/callback\"\n{timeout}"
        )
    };
    let default = Config::from_toml_str(&route("")).unwrap();
    assert!(
        default.routes[0].callback_timeout < window,
        "default callback_timeout {:?} is not under QStash's deduplication window",
        default.routes[0].callback_timeout
    );
    let dir = tempfile::tempdir().unwrap();
    let check = |toml: String| {
        let path = dir.path().join("relay.toml");
        std::fs::write(&path, toml).unwrap();
        let out = Command::new(BIN)
            .args(["check-config", "--config"])
            .arg(&path)
            .env_remove("OUTBOX_RELAY_LOG")
            // check-config refuses an empty database.url (it is parsed as
            // `run` would); nothing connects.
            .env("DATABASE_URL", "postgres://relay@127.0.0.1:1/relay")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "a warning, not an error: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let quiet = check(route("callback_timeout = \"10m\"\n"));
    assert!(!quiet.contains("callback_timeout"), "{quiet}");
    let warned = check(route("callback_timeout = \"1h\"\n"));
    assert!(
        warned.contains("routes[0].callback_timeout") && warned.contains("10 minutes"),
        "{warned}"
    );
}
