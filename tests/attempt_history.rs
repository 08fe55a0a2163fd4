//! The attempt history of dead letters, against the real relay, a real
//! PostgreSQL and the test sink's webhook endpoint on a loopback port: each
//! failed attempt the relay counts is kept on its row (when, which attempt,
//! the status, the first characters of the answer), bounded per row, and
//! `outbox-relay dlq show` lists them; an event accepted at once keeps none,
//! and a replay starts the history over.

mod common;

use std::time::Duration;

use common::{cli_ok, config, webhook_route};
use outbox_client::{enqueue_many, NewEvent};
use outbox_testkit::sink::{RawAnswer, Reply};
use outbox_testkit::TestDb;
use serde_json::{json, Value};
use uuid::Uuid;

const LIMIT: Duration = Duration::from_secs(90);

/// 20 events that are accepted and one, `bad`, that the rule refuses.
async fn insert(db: &TestDb) -> i64 {
    let mut client = db.client().await.unwrap();
    let events: Vec<NewEvent> = (0..21)
        .map(|i| {
            let key = if i == 20 {
                "bad".to_owned()
            } else {
                format!("ok-{i}")
            };
            NewEvent::new(
                Uuid::from_u128(7),
                "order",
                format!("a{i}"),
                "order.placed",
                json!({"n": i}),
                key,
            )
        })
        .collect();
    let tx = client.transaction().await.unwrap();
    enqueue_many(&tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    client
        .query_one("SELECT id FROM outbox WHERE idempotency_key = 'bad'", &[])
        .await
        .unwrap()
        .get(0)
}

/// `dlq show ID --json`'s `attempt_log`.
fn shown_log(db: &TestDb, id: i64) -> Vec<Value> {
    let out = cli_ok(db, &["dlq", "show", &id.to_string(), "--json"]);
    let row: Value = serde_json::from_slice(&out.stdout).unwrap();
    row["attempt_log"]
        .as_array()
        .unwrap_or_else(|| panic!("no attempt_log: {row}"))
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_show_lists_each_failed_attempt_with_its_status_and_answer() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    // The bad event's n-th arrival is answered STATUSES[n] (the last one
    // again for any re-send after that).
    const STATUSES: [u16; 4] = [500, 502, 504, 500];
    sink.set_rule(|r| {
        if r.dedup_id == "bad" {
            Reply::Status(STATUSES[(r.attempt as usize).min(3)], None)
        } else {
            Reply::Accept
        }
    });
    let id = insert(&db).await;
    let routes = webhook_route(&sink.url(), "max_attempts = 4");
    common::run_until_drained(&db, config(&db, &sink.url(), &routes), LIMIT).await;
    assert_eq!(common::dead_count(&db).await, 1);

    let log = shown_log(&db, id);
    assert_eq!(log.len(), 4, "{log:#?}");
    for (i, (entry, status)) in log.iter().zip(STATUSES).enumerate() {
        assert_eq!(entry["attempt"], i + 1, "{entry}");
        assert_eq!(entry["status"], status, "{entry}");
        let error = entry["error"].as_str().unwrap();
        assert!(
            error.contains(&format!("status {status} from the test sink")),
            "{error}"
        );
        assert!(
            entry["at"].as_str().is_some_and(|at| at.len() >= 19),
            "{entry}"
        );
    }
    // The text form: one line per attempt, in order.
    let out = cli_ok(&db, &["dlq", "show", &id.to_string()]);
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("+00:00  attempt "))
        .collect();
    assert_eq!(lines.len(), 4, "{text}");
    for (i, (line, status)) in lines.iter().zip(STATUSES).enumerate() {
        assert!(
            line.contains(&format!("attempt {}  {status}  ", i + 1)),
            "{line}"
        );
    }
    // Accepted at once: nothing kept (the mark of a success writes none).
    assert_eq!(
        common::count(
            &db,
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND attempt_log IS NULL"
        )
        .await,
        20
    );
    // A replay starts the row over, its history too.
    cli_ok(&db, &["dlq", "replay", "--id", &id.to_string()]);
    assert_eq!(
        common::count(
            &db,
            &format!("SELECT count(*) FROM outbox WHERE id = {id} AND attempt_log IS NULL")
        )
        .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_history_keeps_the_last_ten_attempts_and_the_start_of_each_answer() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_rule(|r| {
        if r.dedup_id == "bad" {
            Reply::Raw(RawAnswer::new(500, "x".repeat(1000)))
        } else {
            Reply::Accept
        }
    });
    let id = insert(&db).await;
    let routes = webhook_route(&sink.url(), "max_attempts = 14");
    common::run_until_drained(&db, config(&db, &sink.url(), &routes), LIMIT).await;
    assert_eq!(common::dead_count(&db).await, 1);
    let log = shown_log(&db, id);
    let attempts: Vec<i64> = log.iter().map(|e| e["attempt"].as_i64().unwrap()).collect();
    assert_eq!(attempts, (5..=14).collect::<Vec<_>>());
    for entry in &log {
        let error = entry["error"].as_str().unwrap();
        assert_eq!(error.chars().count(), 200, "{error}");
        assert!(
            error.starts_with("HTTP 500: xxx")
                || error.starts_with("attempt 14 of 14 failed: HTTP 500: xxx"),
            "{error}"
        );
        assert_eq!(entry["status"], 500);
    }
}
