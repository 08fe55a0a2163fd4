//! Retries per route, against the real relay, a real PostgreSQL and the
//! test sink's webhook endpoint on a loopback port: a route's own
//! `retry_schedule` or `max_attempts` overrides `[relay]`'s, the other
//! routes keep `[relay]`'s, and a receiver stops the retries of one message
//! with `410 Gone` while a whole-route blip of 410s dead-letters nothing.

mod common;

use std::time::Duration;

use common::{assert_config_errors_name, config, count, dead_count, webhook_route};
use outbox_testkit::sink::{Received, Reply};
use outbox_testkit::TestDb;

const LIMIT: Duration = Duration::from_secs(90);

/// `(attempt_count, last_error)` of the dead letter with this key.
async fn dead_letter(db: &TestDb, key: &str) -> (i32, String) {
    let row = db
        .client()
        .await
        .unwrap()
        .query_one(
            "SELECT attempt_count, coalesce(last_error, '') FROM outbox
             WHERE idempotency_key = $1 AND dead_lettered_at IS NOT NULL",
            &[&key],
        )
        .await
        .unwrap_or_else(|e| panic!("{key} is not dead-lettered: {e}"));
    (row.get(0), row.get(1))
}

async fn published(db: &TestDb) -> i64 {
    count(
        db,
        "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
    )
    .await
}

/// The time between one message's arrivals at the sink.
fn gaps(received: &[Received], key: &str) -> Vec<Duration> {
    let at: Vec<_> = received
        .iter()
        .filter(|r| r.dedup_id == key)
        .map(|r| r.at)
        .collect();
    at.windows(2).map(|w| w[1] - w[0]).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_retries_on_its_own_schedule_and_another_on_relays() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_rule(|r| {
        if r.dedup_id.contains("-bad-") {
            Reply::Status(500, None)
        } else {
            Reply::Accept
        }
    });
    common::insert_typed(&db, "invoice.sent", "inv", 20).await;
    common::insert_typed(&db, "order.placed", "ord", 20).await;
    common::insert_typed(&db, "invoice.sent", "inv-bad", 1).await;
    common::insert_typed(&db, "order.placed", "ord-bad", 1).await;
    // The test config's [relay]: 5 attempts, 20–100 ms apart.
    let routes = format!(
        "{}{}",
        webhook_route(&sink.url(), "retry_schedule = [\"300ms\", \"1s\"]")
            .replace("event_type = \"*\"", "event_type = \"invoice.*\""),
        webhook_route(&sink.url(), "")
    );
    common::run_until_drained(&db, config(&db, &sink.url(), &routes), LIMIT).await;

    assert_eq!(dead_count(&db).await, 2);
    let (attempts, error) = dead_letter(&db, "inv-bad-0").await;
    assert_eq!(attempts, 3, "{error}");
    assert!(
        error.starts_with("attempt 3 of 3 failed: HTTP 500"),
        "{error}"
    );
    let (attempts, error) = dead_letter(&db, "ord-bad-0").await;
    assert_eq!(attempts, 5, "{error}");
    assert!(
        error.starts_with("attempt 5 of 5 failed: HTTP 500"),
        "{error}"
    );
    // The schedule's delays were waited (later sends may also have waited
    // for a witness, which is longer still).
    let received = sink.received();
    let waited = gaps(&received, "inv-bad-0");
    assert!(waited.len() >= 2, "{waited:?}");
    assert!(waited[0] >= Duration::from_millis(300), "{waited:?}");
    assert!(
        waited[1..].iter().all(|g| *g >= Duration::from_secs(1)),
        "{waited:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_for_one_message_dead_letters_it_without_spending_its_attempts() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_rule(|r| {
        if r.dedup_id == "ord-7" {
            Reply::Status(410, None)
        } else {
            Reply::Accept
        }
    });
    common::insert_typed(&db, "order.placed", "ord", 40).await;
    let routes = webhook_route(&sink.url(), "max_attempts = 20");
    common::run_until_drained(&db, config(&db, &sink.url(), &routes), LIMIT).await;
    assert_eq!(dead_count(&db).await, 1);
    let (attempts, error) = dead_letter(&db, "ord-7").await;
    assert_eq!(attempts, 1, "one attempt counted of 20: {error}");
    assert!(error.starts_with("HTTP 410"), "{error}");
    assert_eq!(published(&db).await, 39);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_route_410_blip_dead_letters_nothing_even_with_two_attempts() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let started = std::time::Instant::now();
    sink.set_rule(move |_| {
        if started.elapsed() < Duration::from_secs(2) {
            Reply::Status(410, None)
        } else {
            Reply::Accept
        }
    });
    common::insert_typed(&db, "order.placed", "ord", 30).await;
    let routes = webhook_route(&sink.url(), "max_attempts = 2");
    common::run_until_drained(&db, config(&db, &sink.url(), &routes), LIMIT).await;
    assert_eq!(dead_count(&db).await, 0);
    assert_eq!(published(&db).await, 30);
}

#[test]
fn bad_retry_keys_of_a_route_are_refused_naming_them() {
    let route = |more: &str| {
        format!(
            "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\n{more}\n"
        )
    };
    let cases = [
        (route("max_attempts = 0"), "routes[0].max_attempts"),
        (
            route("retry_schedule = [\"5s\"]\nmax_attempts = 3"),
            "routes[0].max_attempts",
        ),
        (
            route("retry_schedule = [\"5s\"]\nbackoff_cap = \"1m\""),
            "routes[0].backoff_cap",
        ),
        (route("backoff_base = \"1h\""), "routes[0].backoff_base"),
        (route("retry_schedule = []"), "routes[0].retry_schedule"),
        (
            route("retry_schedule = [\"5 parsecs\"]"),
            "routes[0].retry_schedule",
        ),
        (route("retry_schedule = \"5s\""), "routes[0].retry_schedule"),
    ];
    let cases: Vec<(&str, &str)> = cases.iter().map(|(t, k)| (t.as_str(), *k)).collect();
    assert_config_errors_name(&cases);
}
