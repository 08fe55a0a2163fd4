//! Limits per destination for webhook routes, against the real relay, a
//! real PostgreSQL and the test sink's webhook endpoint on loopback ports
//! (which counts each destination's arrivals and requests in flight): a
//! route's `rate` and `concurrency` are never exceeded and everything is
//! delivered without spending attempts, routes sharing a `[[http.hosts]]`
//! entry share its limit, and a `429` from one host makes every route to
//! that host wait while a route to another host goes on.

mod common;

use std::time::{Duration, Instant};

use common::{assert_config_errors_name, config_toml_with, count, dead_count, webhook_route};
use outbox_relay::Config;
use outbox_testkit::sink::{DestinationLoad, Reply};
use outbox_testkit::TestDb;

const LIMIT: Duration = Duration::from_secs(90);
const SECOND: Duration = Duration::from_secs(1);

/// A webhook route for `event_type` to `sink_url`, with `more` (TOML).
fn route(sink_url: &str, event_type: &str, more: &str) -> String {
    webhook_route(sink_url, more).replace(
        "event_type = \"*\"",
        &format!("event_type = \"{event_type}\""),
    )
}

fn config(db: &TestDb, sink_url: &str, overrides: &str, routes: &str) -> Config {
    Config::from_toml_str(&config_toml_with(db, sink_url, overrides, routes)).expect("test config")
}

/// No row dead-lettered and none spent more than the one attempt that delivered it.
async fn assert_no_attempt_spent(db: &TestDb) {
    assert_eq!(dead_count(db).await, 0);
    let most = count(
        db,
        "SELECT coalesce(max(attempt_count), 0)::int8 FROM outbox",
    )
    .await;
    assert!(
        most <= 1,
        "a limit spent attempts: max attempt_count {most}"
    );
}

/// Whether requests that arrived at `arrivals` were paced one per `interval`
/// by a relay started at `start`: each request holds a slot of its own, the
/// `k`-th (from 0) at `start + k × interval` or later, and a request held up
/// (a busy machine) only comes later still, so the `k`-th arrival cannot be
/// sooner whatever the machine's speed. Any second then holds `rate + 1`
/// requests, and a few more when a stalled process lets several late ones
/// go together: `most_per_second` allows for that.
fn assert_paced(
    load: &DestinationLoad,
    start: Instant,
    interval: Duration,
    most_per_second: usize,
) {
    for (k, at) in load.arrivals.iter().enumerate() {
        assert!(
            *at >= start + interval * k as u32,
            "request {k} came {:?} after the start, before its slot at {:?}",
            *at - start,
            interval * k as u32
        );
    }
    let most = load.max_within(SECOND);
    assert!(
        most <= most_per_second,
        "{most} requests within one second (one every {interval:?})"
    );
}

/// Some request was in flight, and never more than `concurrency` at once.
fn assert_in_flight_within(load: &DestinationLoad, concurrency: u32) {
    assert!(
        (1..=concurrency).contains(&load.max_in_flight),
        "{} in flight (concurrency = {concurrency})",
        load.max_in_flight
    );
}

fn merged(loads: &[DestinationLoad]) -> DestinationLoad {
    let mut arrivals: Vec<Instant> = loads.iter().flat_map(|l| l.arrivals.clone()).collect();
    arrivals.sort();
    DestinationLoad {
        arrivals,
        max_in_flight: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_limited_to_n_per_second_is_sent_no_more_and_gets_everything() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    common::insert_typed(&db, "order.placed", "ord", 30).await;
    let routes = route(&sink.url(), "order.*", "rate = 5");
    let start = Instant::now();
    common::run_until_drained(&db, config(&db, &sink.url(), "", &routes), LIMIT).await;

    let load = sink.load("/hook/order.placed");
    assert_eq!(load.arrivals.len(), 30, "each event sent once");
    // Unlimited, the 30 come within a fraction of a second.
    assert_paced(&load, start, Duration::from_millis(200), 10);
    assert_no_attempt_spent(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routes_concurrency_is_never_exceeded() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_webhook_delay(Duration::from_millis(150));
    common::insert_typed(&db, "order.placed", "ord", 24).await;
    let routes = route(&sink.url(), "order.*", "concurrency = 2");
    common::run_until_drained(&db, config(&db, &sink.url(), "", &routes), LIMIT).await;

    let load = sink.load("/hook/order.placed");
    assert_eq!(load.arrivals.len(), 24, "each event sent once");
    assert_in_flight_within(&load, 2);
    assert_no_attempt_spent(&db).await;
}

/// A full `concurrency` limit is a queue: the rows over it wait in the
/// publisher for a request slot instead of going back to the database to be
/// claimed again (which, at a few hundred rows per job, cost an ordered
/// webhook drain capped at 64 requests in flight five sixths of its speed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_over_a_full_concurrency_limit_queue_for_a_slot_instead_of_being_deferred() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_webhook_delay(Duration::from_millis(10));
    // Loaded before the relay starts, so one claim takes them all and
    // nine find every slot taken.
    common::insert_typed(&db, "order.placed", "ord", 12).await;
    // Counts the writes to the outbox: a claim writes nothing, a mark one
    // write per row, a deferral one more each time.
    db.client()
        .await
        .unwrap()
        .batch_execute(
            "CREATE TABLE row_writes (id int8);
             CREATE FUNCTION count_write() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN INSERT INTO row_writes VALUES (NEW.id); RETURN NULL; END $$;
             CREATE TRIGGER count_writes AFTER UPDATE ON outbox
               FOR EACH ROW EXECUTE FUNCTION count_write();",
        )
        .await
        .unwrap();
    let routes = route(&sink.url(), "order.*", "concurrency = 3");
    common::run_until_drained(&db, config(&db, &sink.url(), "", &routes), LIMIT).await;

    let load = sink.load("/hook/order.placed");
    assert_eq!(load.arrivals.len(), 12, "each event sent once");
    assert_in_flight_within(&load, 3);
    assert_no_attempt_spent(&db).await;
    let writes = count(&db, "SELECT count(*) FROM row_writes").await;
    assert_eq!(writes, 12, "one write per row (its mark), no deferral");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_route_keeps_each_keys_order_under_its_limits() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_webhook_delay(Duration::from_millis(50));
    // 24 events over 4 keys, interleaved: many are deferred, some several times.
    common::insert_events(&db, 24, 4).await;
    let routes = route(
        &sink.url(),
        "order.*",
        "ordering = \"partition_key\"\nrate = 10\nconcurrency = 2",
    );
    common::run_until_drained(&db, config(&db, &sink.url(), "", &routes), LIMIT).await;

    let mut by_key: std::collections::BTreeMap<String, Vec<i64>> = Default::default();
    for r in sink.received() {
        let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        let key = body["partitionKey"].as_str().unwrap().to_owned();
        by_key.entry(key).or_default().push(r.outbox_id.unwrap());
    }
    assert_eq!(by_key.len(), 4, "{by_key:?}");
    for (key, ids) in &by_key {
        assert_eq!(ids.len(), 6, "key {key}: {ids:?}");
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "key {key} out of order: {ids:?}"
        );
    }
    assert!(sink.load("/hook/order.placed").max_in_flight <= 2);
    assert_no_attempt_spent(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_routes_to_one_host_share_its_limit() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    common::insert_typed(&db, "order.placed", "ord", 15).await;
    common::insert_typed(&db, "invoice.sent", "inv", 15).await;
    let host = format!(
        "[[http.hosts]]\nhost = \"{}\"\nrate = 4\nperiod = \"1s\"\n",
        sink.addr()
    );
    let routes = format!(
        "{}{}",
        route(&sink.url(), "order.*", ""),
        route(&sink.url(), "invoice.*", "")
    );
    let start = Instant::now();
    common::run_until_drained(&db, config(&db, &sink.url(), &host, &routes), LIMIT).await;

    let loads = [
        sink.load("/hook/order.placed"),
        sink.load("/hook/invoice.sent"),
    ];
    assert_eq!(loads[0].arrivals.len() + loads[1].arrivals.len(), 30);
    // Each route alone is unlimited: only the host's rate paces them.
    assert_paced(&merged(&loads), start, Duration::from_millis(250), 8);
    assert_no_attempt_spent(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_from_one_host_slows_its_routes_and_no_other_host() {
    let db = common::test_db().await;
    let host_a = common::start_sink().await;
    let host_b = common::start_sink().await;
    // Host A asks for four seconds once. Neither host has an [[http.hosts]]
    // entry: the 429 alone makes host A a destination to wait for.
    host_a.set_rule(|r| {
        if r.destination.starts_with("/hook/first.") && r.attempt == 0 {
            Reply::Status(429, Some("4".into()))
        } else {
            Reply::Accept
        }
    });
    let routes = format!(
        "{}{}{}",
        route(&host_a.url(), "first.*", ""),
        route(&host_a.url(), "second.*", ""),
        route(&host_b.url(), "other.*", "")
    );
    let relay = outbox_relay::Relay::start(config(&db, &host_a.url(), "", &routes))
        .await
        .unwrap();
    common::insert_typed(&db, "first.x", "first", 1).await;
    // The relay took the 429 in (it does before the row's mark is written).
    let marked = common::wait_until(LIMIT, || async {
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE last_error IS NOT NULL",
        )
        .await
            > 0
    })
    .await;
    assert!(marked, "the 429 never reached the first event's row");
    let limited_at = host_a.load("/hook/first.x").arrivals[0];
    common::insert_typed(&db, "second.x", "second", 5).await;
    common::insert_typed(&db, "other.x", "other", 5).await;
    let drained = common::wait_until(LIMIT, || async { common::pending(&db).await == 0 }).await;
    relay.shutdown().await;
    assert!(drained, "{} rows still pending", common::pending(&db).await);

    let other = host_b.load("/hook/other.x");
    let second = host_a.load("/hook/second.x");
    assert_eq!((other.arrivals.len(), second.arrivals.len()), (5, 5));
    assert_eq!(
        host_a.load("/hook/first.x").arrivals.len(),
        2,
        "429, then accepted"
    );
    // Host B was not slowed: all its events went while host A was waited for.
    assert!(
        other.arrivals.last() < second.arrivals.first(),
        "host B's last event came after host A's second route resumed"
    );
    // The other route to host A waited for the 429's four seconds.
    let second_first = second.arrivals[0] - limited_at;
    assert!(
        second_first >= Duration::from_secs(3),
        "host A's second route sent {second_first:?} after its 429"
    );
    assert_no_attempt_spent(&db).await;
}

#[test]
fn limit_errors_name_the_key() {
    let qstash = "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://api.example.com/e\"\n";
    let webhook = "[[routes]]\nevent_type = \"*\"\nsink = \"webhook\"\ndestination = \"https://api.example.com/e\"\nsigning_secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\n";
    let hosts = |entry: &str| format!("[[http.hosts]]\n{entry}\n{webhook}");
    assert_config_errors_name(&[
        (
            &format!("{qstash}concurrency = 2\n"),
            "routes[0].concurrency",
        ),
        (&format!("{qstash}concurrency = 2\n"), "parallelism"),
        (
            &format!("{webhook}concurrency = 0\n"),
            "routes[0].concurrency",
        ),
        (&format!("{webhook}rate = 0\n"), "routes[0].rate"),
        (
            &format!("{webhook}rate = 3\nperiod = \"0s\"\n"),
            "routes[0].period",
        ),
        (
            &hosts("host = \"https://api.example.com\"\nrate = 3"),
            "http.hosts[0].host",
        ),
        (&hosts("host = \"api.example.com\""), "http.hosts[0].rate"),
        (&hosts("host = \"api.example.com\"\nrate = 0"), "http.hosts"),
        (
            &hosts("host = \"api.example.com\"\nconcurrency = 1\nperiod = \"1s\""),
            "http.hosts[0].period",
        ),
        (
            &hosts("host = \"a\"\nrate = 1\n[[http.hosts]]\nhost = \"A\"\nrate = 2"),
            "http.hosts[1].host",
        ),
    ]);
    // A QStash route keeps rate and period as flow control.
    Config::from_toml_str(&format!("{qstash}rate = 10\nperiod = \"1m\"\n")).expect("QStash rate");
    // `parallelism` is QStash's: a webhook route is told to use `concurrency`.
    let warned = Config::from_toml_str(&format!("{webhook}parallelism = 2\n"))
        .expect("a warning, not an error")
        .warnings();
    assert!(
        warned.len() == 1
            && warned[0].contains("routes[0].parallelism")
            && warned[0].contains("concurrency"),
        "{warned:?}"
    );
}

/// The README's example and the commented-out ones in `config/relay.toml`
/// parse, and say what they mean.
#[test]
fn the_documented_limits_examples_are_valid() {
    let read = |doc: &str| {
        std::fs::read_to_string(format!("{}/{doc}", env!("CARGO_MANIFEST_DIR"))).unwrap()
    };
    let readme = read("README.md");
    let block = readme
        .split("```toml\n")
        .find(|b| b.starts_with("[[http.hosts]]"))
        .and_then(|b| b.split("```").next())
        .expect("the README's limits example");
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let readme = Config::from_toml_str(&block.replace("whsec_...", secret)).unwrap();
    let host = &readme.http.hosts[0];
    assert_eq!(
        (host.host.as_str(), host.rate.map(|r| r.get()), host.period),
        ("hooks.partner.example", Some(50), Some(SECOND))
    );
    assert_eq!(host.concurrency.map(|c| c.get()), Some(8));
    let route = &readme.routes[0];
    assert_eq!(
        (route.rate, route.concurrency.map(|c| c.get())),
        (Some(20), Some(4))
    );

    // config/relay.toml: the [[http.hosts]] entry, and a route's limits.
    let example = read("config/relay.toml");
    let uncommented = |from: &str, keys: &[&str]| -> String {
        example
            .lines()
            .skip_while(|l| !l.starts_with(from))
            .take_while(|l| l.starts_with("# ") && !l.starts_with("# [[routes]]"))
            .map(|l| &l[2..])
            .filter(|l| keys.iter().any(|k| l.starts_with(k)))
            .map(|l| format!("{l}\n"))
            .collect()
    };
    let hosts = uncommented(
        "# [[http.hosts]]",
        &["[[http.hosts]]", "host", "rate", "period", "concurrency"],
    );
    let limits = uncommented("# Limits of this route", &["rate", "period", "concurrency"]);
    let webhook = format!("[[routes]]\nevent_type = \"*\"\nsink = \"webhook\"\ndestination = \"https://hooks.partner.example/e\"\nsigning_secret = \"{secret}\"\n");
    let parsed = Config::from_toml_str(&format!("{hosts}{webhook}{limits}")).unwrap();
    assert_eq!(parsed.http.hosts.len(), 1, "{hosts}");
    assert!(parsed.http.hosts[0].rate.is_some() && parsed.http.hosts[0].concurrency.is_some());
    let route = &parsed.routes[0];
    assert!(
        route.rate.is_some() && route.period.is_some() && route.concurrency.is_some(),
        "{limits}"
    );
}
