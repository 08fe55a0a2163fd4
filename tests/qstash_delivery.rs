//! The relay against the QStash stand-in in delivery mode: what QStash does
//! after it accepted an event (delivering it, retrying, calling the failure
//! callback) reaches the relay the way the real one would, so the relay's
//! failure-callback endpoint reads the stand-in's reports.

mod common;

use std::time::Duration;

use common::{config, count, insert_events, wait_until};
use outbox_client::consumer::qstash::Verifier;
use outbox_relay::server::callback::{self, CallbackOptions};
use outbox_relay::Relay;
use outbox_testkit::sink::{
    DeliveryConfig, Destination, DestinationConfig, RetryDelay, Sink, SinkConfig,
    DEV_CURRENT_SIGNING_KEY, DEV_NEXT_SIGNING_KEY,
};

const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_that_fails_every_retry_comes_back_as_a_dead_letter() {
    let db = common::test_db().await;
    let dest = Destination::start(DestinationConfig {
        failure_rate: 1.0,
        ..DestinationConfig::default()
    })
    .await
    .unwrap();
    let sink = Sink::start(SinkConfig {
        delivery: Some(DeliveryConfig {
            retry_delay: RetryDelay::Fixed(Duration::from_millis(100)),
            ..DeliveryConfig::default()
        }),
        ..SinkConfig::for_tests(common::TOKEN)
    })
    .await
    .unwrap();
    // The failure callback, served as the daemon serves it.
    let callback_addr = free_addr();
    let callback_url = format!("http://{callback_addr}{}", callback::FAILURE_PATH);
    let stop = serve_callbacks(
        &db,
        callback_addr,
        CallbackOptions::new([callback_url.clone()]),
    )
    .await;
    let routes = format!(
        r#"
        [[routes]]
        event_type = "*"
        destination = "{}/events"
        retries = 1
        failure_callback = "{callback_url}"
        ordering = "partition_key_to_qstash"
        "#,
        dest.url()
    );
    insert_events(&db, 5, 5).await;
    let relay = Relay::start(config(&db, &sink.url(), &routes))
        .await
        .unwrap();
    let dead = || async {
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL",
        )
        .await
    };
    let all_dead = wait_until(LIMIT, || async { dead().await == 5 }).await;
    relay.shutdown().await;
    let _ = stop.send(());
    assert!(all_dead, "{} of 5 dead-lettered", dead().await);

    let client = db.client().await.unwrap();
    for row in client
        .query("SELECT last_error FROM outbox ORDER BY id", &[])
        .await
        .unwrap()
    {
        let error: String = row.get(0);
        assert!(
            error.starts_with("qstash: status 503 after 1 retries")
                && error.contains("the destination answered 503")
                && error.contains("dlqId"),
            "{error}"
        );
    }
    // Two attempts each at the destination, then one report each, taken.
    let calls = dest.calls();
    assert_eq!(calls.len(), 10);
    assert!(calls.iter().all(|c| !c.succeeded()));
    let reports = sink.callbacks();
    assert_eq!(reports.len(), 5);
    assert!(reports
        .iter()
        .all(|r| r.delivered && r.last_status == Some(200) && r.retried == 1));
}

/// Drains `keys` × 6 ordered events through the stand-in, which delivers to a
/// destination failing 30% of calls and retries them 300 ms later, the way
/// QStash does: meanwhile a key's next event may be delivered. With
/// `callbacks`, the route is ordered at the destination (the relay holds a
/// key until QStash's callback reports the destination's answer); without,
/// it is ordered only as far as QStash. The destination's report, once every
/// event arrived.
async fn ordered_through_qstash(callbacks: bool) -> outbox_testkit::sink::DestinationReport {
    let db = common::test_db().await;
    let dest = Destination::start(DestinationConfig {
        failure_rate: 0.3,
        latency: Duration::from_millis(5),
        seed: 11,
        ..DestinationConfig::default()
    })
    .await
    .unwrap();
    let sink = Sink::start(SinkConfig {
        delivery: Some(DeliveryConfig {
            retries: 10,
            retry_delay: RetryDelay::Fixed(Duration::from_millis(300)),
            seed: 11,
            ..DeliveryConfig::default()
        }),
        ..SinkConfig::for_tests(common::TOKEN)
    })
    .await
    .unwrap();
    let callback_addr = free_addr();
    let callback_url = format!("http://{callback_addr}{}", callback::CALLBACK_PATH);
    let mut options = CallbackOptions::new(Vec::<String>::new());
    options.callback_urls = vec![callback_url.clone()];
    let stop = serve_callbacks(&db, callback_addr, options).await;
    let ordering = if callbacks {
        format!("ordering = \"partition_key\"\n        callback = \"{callback_url}\"")
    } else {
        "ordering = \"partition_key_to_qstash\"".to_owned()
    };
    let routes = format!(
        r#"
        [[routes]]
        event_type = "*"
        destination = "{}/events"
        retries = 10
        {ordering}
        "#,
        dest.url()
    );
    let keys = 20;
    insert_events(&db, keys * 6, keys).await;
    // A route taking callbacks needs the listener they come to, and the key
    // that verifies them.
    let toml = common::config_toml(&db, &sink.url(), &routes);
    let toml = with_callback_listener(&toml, callback_addr);
    let cfg = outbox_relay::Config::from_toml_str(&toml).unwrap();
    let relay = Relay::start(cfg).await.unwrap();
    let delivered = || {
        let dest = &dest;
        async move {
            outbox_testkit::sink::check_order(&dest.calls(), Some(1)).events_delivered
                >= (keys * 6) as u64
        }
    };
    let all = wait_until(Duration::from_secs(120), delivered).await;
    let settled = wait_until(LIMIT, || async {
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL",
        )
        .await
            == 0
    })
    .await;
    relay.shutdown().await;
    let _ = stop.send(());
    assert!(all, "not every event reached the destination");
    assert!(settled, "rows left unsettled");
    let report = outbox_testkit::sink::check_order(&dest.calls(), Some(1));
    assert!(
        report.failed_calls > 0,
        "no delivery failed: nothing was tested"
    );
    assert_eq!(report.over_parallelism_keys, 0, "{report:?}");
    report
}

/// With callbacks, no key sees a later event before an earlier one at the
/// destination, however often QStash retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_qstash_route_keeps_each_keys_order_at_the_destination() {
    let report = ordered_through_qstash(true).await;
    assert_eq!(report.out_of_order, 0, "{:?}", report.examples);
}

/// Without them (order as far as QStash only), a retried delivery reaches the
/// destination after its key's next event: what the callbacks are for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_callbacks_a_retried_delivery_arrives_after_the_next_one() {
    let report = ordered_through_qstash(false).await;
    assert!(report.out_of_order > 0, "{report:?}");
}

/// A callback that never comes: each hold runs out, the event is sent again
/// under the same deduplication id, and after the attempt numbered
/// `relay.max_attempts` it is dead-lettered when that last hold runs out,
/// without another send. The key's next event goes to QStash only then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callback_that_never_comes_dead_letters_after_the_last_hold_in_key_order() {
    let db = common::test_db().await;
    // Takes every message and never calls back.
    let sink = Sink::start(SinkConfig::for_tests(common::TOKEN))
        .await
        .unwrap();
    let callback_addr = free_addr();
    let routes = format!(
        r#"
        [[routes]]
        event_type = "*"
        destination = "http://127.0.0.1:9/events"
        ordering = "partition_key"
        callback = "http://{callback_addr}{}"
        callback_timeout = "300ms"
        "#,
        callback::CALLBACK_PATH
    );
    let keys = 2;
    insert_events(&db, keys * 2, keys).await;
    let toml = common::config_toml(&db, &sink.url(), &routes)
        .replace("max_attempts = 5", "max_attempts = 2");
    let toml = with_callback_listener(&toml, callback_addr);
    let relay = Relay::start(outbox_relay::Config::from_toml_str(&toml).unwrap())
        .await
        .unwrap();
    let settled = wait_until(LIMIT, || async {
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL",
        )
        .await
            == (keys * 2) as i64
    })
    .await;
    relay.shutdown().await;
    assert!(settled, "rows were not dead-lettered");
    let errors = db
        .client()
        .await
        .unwrap()
        .query(
            "SELECT last_error, attempt_count, published_at IS NULL FROM outbox ORDER BY id",
            &[],
        )
        .await
        .unwrap();
    for row in &errors {
        let (error, attempts, unpublished): (String, i32, bool) =
            (row.get(0), row.get(1), row.get(2));
        assert!(error.starts_with("no callback reported"), "{error}");
        assert_eq!(attempts, 2, "{error}");
        assert!(unpublished);
    }
    let received = sink.received();
    let ids: std::collections::BTreeSet<i64> =
        received.iter().filter_map(|r| r.outbox_id).collect();
    assert_eq!(ids.len(), keys * 2, "{ids:?}");
    for id in &ids {
        let sends = received.iter().filter(|r| r.outbox_id == Some(*id)).count();
        assert_eq!(
            sends, 2,
            "event {id} was sent {sends} times, not max_attempts"
        );
    }
    // Event i has key i % keys: the second event of each key went out only
    // after the first one's last send.
    let by_id: Vec<i64> = ids.into_iter().collect();
    for k in 0..keys {
        let (first, second) = (by_id[k], by_id[k + keys]);
        let last_of_first = received
            .iter()
            .filter(|r| r.outbox_id == Some(first))
            .map(|r| r.at)
            .max()
            .unwrap();
        let first_of_second = received
            .iter()
            .filter(|r| r.outbox_id == Some(second))
            .map(|r| r.at)
            .min()
            .unwrap();
        // The last copy QStash took had its whole hold to be delivered
        // before the key moved on.
        assert!(
            first_of_second >= last_of_first + Duration::from_millis(300),
            "key {k}: event {second} went out {:?} after event {first}'s last send, within its hold",
            first_of_second - last_of_first
        );
    }
}

/// A loopback address nothing listens on yet.
fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// The callback endpoints served on `addr` as the daemon serves them, until
/// the returned sender is used or dropped.
async fn serve_callbacks(
    db: &outbox_testkit::TestDb,
    addr: std::net::SocketAddr,
    options: CallbackOptions,
) -> tokio::sync::oneshot::Sender<()> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    callback::serve(
        addr,
        outbox_relay::store::Store::with_pool(common::pool(db, 2)),
        Verifier::new(DEV_CURRENT_SIGNING_KEY, Some(DEV_NEXT_SIGNING_KEY)),
        options,
        async {
            let _ = stopped.await;
        },
    )
    .await
    .unwrap();
    stop
}

/// The test config `toml` with the callback listener on `addr` and the key
/// that verifies the stand-in's callbacks: what a route taking delivery
/// callbacks needs.
fn with_callback_listener(toml: &str, addr: std::net::SocketAddr) -> String {
    toml.replace(
        "metrics_bind = \"127.0.0.1:0\"",
        &format!("metrics_bind = \"127.0.0.1:0\"\n        callback_bind = \"{addr}\""),
    )
    .replace(
        "[qstash]",
        &format!("[qstash]\n        current_signing_key = \"{DEV_CURRENT_SIGNING_KEY}\""),
    )
}

/// `drain --max-duration <max>` with an ordered QStash route on 60 events,
/// against the stand-in delivering to a destination that accepts all; the
/// route's callback URL is the drain's own listener when `reachable`, else a
/// port nobody listens on. The drain's JSON report (with its exit code as
/// `status_code`) and how long it ran.
async fn drain_ordered_qstash(reachable: bool, max: &str) -> (serde_json::Value, Duration, i64) {
    let (report, took, db) = drain_ordered_qstash_with(
        60,
        DestinationConfig::default(),
        DeliveryConfig::default(),
        reachable,
        max,
    )
    .await;
    let published = count(
        &db,
        "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
    )
    .await;
    (report, took, published)
}

/// The same on `events` events over 6 keys, with this destination and
/// delivery; the database too.
async fn drain_ordered_qstash_with(
    events: usize,
    destination: DestinationConfig,
    delivery: DeliveryConfig,
    reachable: bool,
    max: &str,
) -> (serde_json::Value, Duration, outbox_testkit::TestDb) {
    let db = common::test_db().await;
    let dest = Destination::start(destination).await.unwrap();
    let sink = Sink::start(SinkConfig {
        delivery: Some(delivery),
        ..SinkConfig::for_tests(common::TOKEN)
    })
    .await
    .unwrap();
    let listener = free_addr();
    let called = if reachable { listener } else { free_addr() };
    let routes = format!(
        r#"
        [[routes]]
        event_type = "*"
        destination = "{}/events"
        ordering = "partition_key"
        callback = "http://{called}{}"
        "#,
        dest.url(),
        callback::CALLBACK_PATH
    );
    insert_events(&db, events, 6).await;
    let toml = with_callback_listener(&common::config_toml(&db, &sink.url(), &routes), listener);
    let started = std::time::Instant::now();
    let mut relay = common::spawn_relay(
        &["drain", "--json", "--max-duration", max],
        &toml,
        outbox_testkit::relay::Output::Captured,
    );
    let status = relay
        .exit_within(Duration::from_secs(90))
        .await
        .expect("drain exits");
    let mut report: serde_json::Value =
        serde_json::from_str(&relay.read_stdout().await.unwrap()).unwrap();
    report["status_code"] = status.code().into();
    (report, started.elapsed(), db)
}

/// `drain` (the cron-style one-shot) with an ordered QStash route: the events
/// QStash took are held for their delivery callbacks, so `drain` must receive
/// those callbacks itself and end once they are in, not run into
/// `--max-duration` with every row still held (or, without one, forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_receives_the_delivery_callbacks_of_an_ordered_qstash_route() {
    let (report, took, published) = drain_ordered_qstash(true, "40s").await;
    assert_eq!(report["timed_out"], false, "{report}");
    assert_eq!(report["remaining"], 0, "{report}");
    assert_eq!(report["held"], 0, "{report}");
    assert!(took < Duration::from_secs(30), "{took:?}: {report}");
    assert_eq!(report["status_code"], 0, "{report}");
    assert_eq!(published, 60);
}

/// Callbacks that cannot reach the drain: it stops at `--max-duration` and
/// says how many events wait for theirs, none of them published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_whose_callbacks_go_elsewhere_reports_the_events_still_held() {
    let (report, _, published) = drain_ordered_qstash(false, "6s").await;
    assert_eq!(report["timed_out"], true, "{report}");
    assert_eq!(report["remaining"], 60, "{report}");
    // One event of each of the six keys went out and is held.
    assert_eq!(report["held"], 6, "{report}");
    // Stopped at --max-duration with events left: exit 3.
    assert_eq!(report["status_code"], 3, "{report}");
    assert_eq!(report["status"], "backlog_left", "{report}");
    assert_eq!(published, 0);
}

/// `drain` with an ordered QStash route whose destination fails every
/// attempt: QStash's last failed attempt comes back as a delivery callback
/// that dead-letters each event. Those dead letters are the drain's too:
/// it exits 4 and counts them, although its marker dead-lettered nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_whose_callbacks_dead_letter_exits_with_the_dead_letter_code() {
    let (report, _, db) = drain_ordered_qstash_with(
        6,
        DestinationConfig {
            failure_rate: 1.0,
            ..DestinationConfig::default()
        },
        DeliveryConfig {
            retries: 1,
            retry_delay: RetryDelay::Fixed(Duration::from_millis(100)),
            ..DeliveryConfig::default()
        },
        true,
        "40s",
    )
    .await;
    assert_eq!(report["status_code"], 4, "{report}");
    assert_eq!(report["status"], "dead_lettered", "{report}");
    assert_eq!(report["timed_out"], false, "{report}");
    assert_eq!(report["counters"]["dead_lettered"], 0, "{report}");
    assert_eq!(report["dead_lettered_by_callbacks"], 6, "{report}");
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL"
        )
        .await,
        6
    );
}
