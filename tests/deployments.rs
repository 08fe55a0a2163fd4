//! What real deployments do to a destination, against the real relay and a
//! real PostgreSQL: a consumer being redeployed answers 404 for a moment, a
//! route's URL points at a path that does not exist, a small route's
//! destination is down for longer than the retry schedule. The route is
//! failing, not the messages: nothing may be dead-lettered for it. A message
//! the destination refuses while it accepts the others is still
//! dead-lettered, with the destination's reason.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::{config, count, dead_count, insert_events, webhook_route, QSTASH_ROUTE};
use outbox_relay::config::Config;
use outbox_testkit::sink::{Received, Reply, SinkHandle};
use outbox_testkit::TestDb;

const LIMIT: Duration = Duration::from_secs(60);

async fn published(db: &TestDb) -> i64 {
    count(
        db,
        "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
    )
    .await
}

/// A fresh database with `events` events over as many keys, and a sink that
/// answers `during` for `outage` from now, then as `after` says.
async fn outage(
    events: usize,
    outage: Duration,
    during: impl Fn(&Received) -> Reply + Send + Sync + 'static,
    after: impl Fn(&Received) -> Reply + Send + Sync + 'static,
) -> (TestDb, SinkHandle) {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    insert_events(&db, events, events).await;
    let started = Instant::now();
    sink.set_rule(move |r| {
        if started.elapsed() < outage {
            during(r)
        } else {
            after(r)
        }
    });
    (db, sink)
}

/// Every event was published, none dead-lettered, and the sink accepted each
/// one.
async fn assert_all_published(db: &TestDb, sink: &SinkHandle, events: usize) {
    let client = db.client().await.unwrap();
    let dead: Vec<String> = common::column(
        &client,
        "SELECT id || ' attempt ' || attempt_count || ': ' || coalesce(last_error, '') FROM outbox
         WHERE dead_lettered_at IS NOT NULL ORDER BY id",
    )
    .await;
    assert!(dead.is_empty(), "{} dead letters: {dead:#?}", dead.len());
    assert_eq!(published(db).await, events as i64);
    let accepted: HashSet<String> = sink.accepted().into_iter().map(|r| r.dedup_id).collect();
    assert_eq!(accepted.len(), events);
}

fn webhook_config(db: &TestDb, sink: &SinkHandle) -> Config {
    config(db, &sink.url(), &webhook_route(&sink.url(), ""))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_second_404_blip_of_a_webhook_dead_letters_nothing() {
    let (db, sink) = outage(
        60,
        Duration::from_secs(2),
        |_| Reply::Status(404, None),
        |_| Reply::Accept,
    )
    .await;
    common::run_until_drained(&db, webhook_config(&db, &sink), LIMIT).await;
    assert_all_published(&db, &sink, 60).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qstash_route_with_a_wrong_path_pauses_rather_than_dead_letters() {
    // Every request 404s (the whole batch, then each message alone) until
    // the path is fixed, 3 s in.
    let (db, sink) = outage(
        600,
        Duration::from_secs(3),
        |_| Reply::Status(404, None),
        |_| Reply::Accept,
    )
    .await;
    let mut cfg = config(&db, &sink.url(), QSTASH_ROUTE);
    cfg.relay.max_attempts = 3;
    common::run_until_drained(&db, cfg, LIMIT).await;
    assert_all_published(&db, &sink, 600).await;
    // No attempt was spent on the 404s: each row's one attempt is its success.
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox WHERE attempt_count <> 1").await,
        0
    );
    // Paused, not a hot loop: most rows were refused at most twice (their
    // batch, then alone), a few more for the probes.
    let refused = sink.received().iter().filter(|r| !r.accepted).count();
    assert!(refused <= 3 * 600, "{refused} messages sent into the 404s");
}

/// A route with `events` pending events whose destination answers 503 for
/// 3 s, much longer than 3 attempts 20–100 ms apart take.
async fn a_small_route_survives_an_outage(events: usize) {
    let (db, sink) = outage(
        events,
        Duration::from_secs(3),
        |_| Reply::Status(503, None),
        |_| Reply::Accept,
    )
    .await;
    let mut cfg = config(&db, &sink.url(), QSTASH_ROUTE);
    cfg.relay.max_attempts = 3;
    common::run_until_drained(&db, cfg, LIMIT).await;
    assert_all_published(&db, &sink, events).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_with_two_events_loses_neither_in_an_outage() {
    a_small_route_survives_an_outage(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_with_six_events_loses_none_in_an_outage() {
    a_small_route_survives_an_outage(6).await;
}

fn is_event(r: &Received, n: usize) -> bool {
    r.dedup_id == format!("evt-{n}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_after_an_outage_is_dead_lettered_with_its_reason() {
    // The destination is down for 2 s; once back it refuses event 3 (and
    // only it) with a 422.
    let (db, sink) = outage(
        6,
        Duration::from_secs(2),
        |_| Reply::Status(503, None),
        |r| {
            if is_event(r, 3) {
                Reply::Status(422, None)
            } else {
                Reply::Accept
            }
        },
    )
    .await;
    let mut cfg = webhook_config(&db, &sink);
    cfg.relay.max_attempts = 3;
    common::run_until_drained(&db, cfg, LIMIT).await;
    assert_eq!(published(&db).await, 5);
    let client = db.client().await.unwrap();
    let dead: Vec<String> = common::column(
        &client,
        "SELECT idempotency_key || ': ' || last_error FROM outbox WHERE dead_lettered_at IS NOT NULL",
    )
    .await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(
        dead[0].starts_with("evt-3: HTTP 422") && dead[0].contains("status 422 from the test sink"),
        "{dead:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_on_a_route_accepting_others_is_dead_lettered() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_rule(|r| {
        if is_event(r, 7) {
            Reply::Status(404, None)
        } else {
            Reply::Accept
        }
    });
    insert_events(&db, 40, 40).await;
    common::run_until_drained(&db, webhook_config(&db, &sink), LIMIT).await;
    assert_eq!(published(&db).await, 39);
    assert_eq!(dead_count(&db).await, 1);
    let client = db.client().await.unwrap();
    let row = client
        .query_one(
            "SELECT idempotency_key, attempt_count, last_error FROM outbox WHERE dead_lettered_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "evt-7");
    assert_eq!(row.get::<_, i32>(1), 1, "one attempt counted");
    assert!(row.get::<_, String>(2).starts_with("HTTP 404"));
    // Sent once, then again once the route had accepted the others (or
    // after it failed alone for the breaker's longest pause).
    let sent = sink.received().iter().filter(|r| is_event(r, 7)).count();
    assert!((1..=3).contains(&sent), "sent {sent} times");
}
