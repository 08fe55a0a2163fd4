//! Tenant fairness end to end (`relay.tenant_fairness`): one tenant's
//! backlog does not hold back another tenant's events by more than about a
//! claim. Measured by order at the sink, not by time: how many of the
//! backlog's events reach the sink after the other tenant's events were
//! committed and before the last of them arrives.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::{config_toml_with, pending, wait_until, QSTASH_ROUTE};
use outbox_relay::config::Config;
use outbox_relay::Relay;

const TENANT_A: &str = "00000000-0000-0000-0000-00000000000a";
const TENANT_B: &str = "00000000-0000-0000-0000-00000000000b";

/// Tenant A's backlog, inserted before the relay starts.
const BACKLOG: i64 = 40_000;
/// Tenant B's events, each on a key of its own (so in buckets all over the
/// shards), committed together once the relay is well into A's backlog.
const B_EVENTS: i64 = 20;
const CLAIM_BATCH: usize = 100;
const MAX_IN_FLIGHT: usize = 200;
/// The test database's shards (the default), a claimer each.
const SHARDS: usize = 8;

/// `n` rows of `tenant` in one statement, each on a key of its own
/// (`{prefix}{i}`).
async fn insert_rows(client: &tokio_postgres::Client, tenant: &str, prefix: &str, n: i64) {
    client
        .execute(
            &format!(
                "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key)
                 SELECT '{tenant}', 'order', '{prefix}' || i, 'order.placed', '{{}}', '{prefix}-' || i
                 FROM generate_series(1, {n}) AS i"
            ),
            &[],
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_backlog_does_not_hold_back_another_tenants_events() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let client = db.client().await.unwrap();
    insert_rows(&client, TENANT_A, "a", BACKLOG).await;
    client.batch_execute("ANALYZE outbox").await.unwrap();
    let toml = config_toml_with(
        &db,
        &sink.url(),
        &format!("[relay]\ntenant_fairness = true\nclaim_batch = {CLAIM_BATCH}\nmax_in_flight = {MAX_IN_FLIGHT}\n"),
        QSTASH_ROUTE,
    );
    let cfg = Config::from_toml_str(&toml).unwrap();
    assert!(cfg.relay.tenant_fairness);
    let relay = Relay::start(cfg).await.unwrap();
    assert!(
        sink.wait_for_records(1_000, Duration::from_secs(120)).await,
        "the backlog's delivery did not start"
    );

    let (a_between, a_pending_at_commit) = b_commits_and_arrives(&db, &sink, &client).await;

    // All of it is delivered in the end, nothing lost.
    drains_and_stops(&db, relay, Duration::from_secs(300)).await;
    eprintln!(
        "{a_between} of A's events arrived between B's commit and B's last event; \
         A had {a_pending_at_commit} pending at B's commit"
    );

    // The rows out when B committed (at most max_in_flight) and one claim
    // of each shard's claimer (8 shards of claim_batch rows; B's claimer
    // competes with the others for the in-flight room), twice over for a
    // slow machine: still a small part of the backlog left at B's commit,
    // which is what B waits behind without fairness.
    let bound = 2 * (MAX_IN_FLIGHT + SHARDS * CLAIM_BATCH);
    assert!(
        a_pending_at_commit as usize >= 10 * bound,
        "B must commit while A has a real backlog left ({a_pending_at_commit} pending)"
    );
    assert!(
        a_between <= bound,
        "{a_between} of tenant A's events reached the sink between tenant B's commit and B's last \
         event (bound {bound}; A had {a_pending_at_commit} pending at B's commit)"
    );
}

/// Waits until nothing is pending (all of it delivered, nothing lost), then
/// stops the relay.
async fn drains_and_stops(db: &outbox_testkit::TestDb, relay: Relay, within: Duration) {
    assert!(
        wait_until(within, || async { pending(db).await == 0 }).await,
        "the backlog did not drain"
    );
    relay.shutdown().await;
}

/// Commits tenant B's events and waits for all of them at the sink: how
/// many of A's events reached the sink between B's commit and B's last
/// event, and how many of A's were pending at B's commit.
async fn b_commits_and_arrives(
    db: &outbox_testkit::TestDb,
    sink: &outbox_testkit::sink::SinkHandle,
    client: &tokio_postgres::Client,
) -> (usize, i64) {
    // Read before B's commit: every record after it may have come after the
    // commit (an overcount of A's arrivals, never an undercount).
    let before_commit = sink.record_count();
    insert_rows(client, TENANT_B, "b", B_EVENTS).await;
    let a_pending_at_commit = common::count(
        db,
        &format!(
            "SELECT count(*) FROM outbox WHERE tenant_id = '{TENANT_A}'
               AND published_at IS NULL AND dead_lettered_at IS NULL"
        ),
    )
    .await;
    let b_ids: HashSet<i64> = common::column::<i64, _>(
        client,
        &format!("SELECT id FROM outbox WHERE tenant_id = '{TENANT_B}'"),
    )
    .await;
    let b_arrived = || {
        sink.records()
            .iter()
            .filter(|r| r.outbox_id.is_some_and(|id| b_ids.contains(&id)))
            .count()
    };
    assert!(
        wait_until(Duration::from_secs(120), || async {
            b_arrived() == B_EVENTS as usize
        })
        .await,
        "tenant B's events did not all arrive"
    );
    let records = sink.records();
    let last_b = records
        .iter()
        .filter(|r| r.outbox_id.is_some_and(|id| b_ids.contains(&id)))
        .map(|r| r.seq)
        .max()
        .unwrap();
    let a_between = records
        .iter()
        .filter(|r| r.seq >= before_commit as u64 && r.seq < last_b)
        .filter(|r| r.outbox_id.is_some_and(|id| !b_ids.contains(&id)))
        .count();
    (a_between, a_pending_at_commit)
}

/// Behind the claim: with the destination slow, the rows out are mostly
/// jobs waiting for a publisher. Tenant B's rows must neither wait for
/// room (tenant A fills at most four fifths of it) nor queue behind A's
/// jobs (the tenants' jobs take turns). Before both, B's events came after
/// about every row A had out when B committed (`MAX_IN_FLIGHT`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_tenants_events_do_not_queue_behind_a_backlogs_claimed_rows() {
    const OUT: usize = 600;
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    // Two publishers, ten rows a request, 200 ms a request: about 100
    // events/s, so the rows out are six seconds of work.
    sink.set_delay(Duration::from_millis(200));
    let client = db.client().await.unwrap();
    insert_rows(&client, TENANT_A, "a", 5_000).await;
    client.batch_execute("ANALYZE outbox").await.unwrap();
    let toml = config_toml_with(
        &db,
        &sink.url(),
        &format!(
            "[relay]\ntenant_fairness = true\nclaim_batch = {CLAIM_BATCH}\nmax_in_flight = {OUT}\npublishers = 2\n[qstash]\nbatch_size = 10\n"
        ),
        QSTASH_ROUTE,
    );
    let relay = Relay::start(Config::from_toml_str(&toml).unwrap())
        .await
        .unwrap();
    // Well into the backlog: A's rows fill their room.
    assert!(
        wait_until(Duration::from_secs(60), || async {
            sink.record_count() >= 200 && relay.in_flight() >= OUT * 3 / 4
        })
        .await,
        "A's rows never filled the room ({} in flight)",
        relay.in_flight()
    );
    let (a_between, a_pending_at_commit) = b_commits_and_arrives(&db, &sink, &client).await;
    sink.set_delay(Duration::ZERO);
    drains_and_stops(&db, relay, Duration::from_secs(120)).await;
    eprintln!(
        "{a_between} of A's events arrived between B's commit and B's last event; \
         A had {a_pending_at_commit} pending at B's commit, {OUT} the room"
    );
    assert!(
        a_pending_at_commit as usize > 2 * OUT,
        "B must commit while A has a backlog ({a_pending_at_commit} pending)"
    );
    // What was in the requests at B's commit (two of ten rows), and about a
    // second and a half of A's events while B's claims ran on a slow
    // machine: half the rows A had out.
    assert!(
        a_between <= OUT / 2,
        "{a_between} of tenant A's events reached the sink between tenant B's commit and B's \
         last event (bound {}; A had up to {OUT} out)",
        OUT / 2
    );
}

/// A paced tenant (`[[relay.tenants]] rate`): its backlog reaches the sink no
/// faster than its pace allows (a second's worth at once, then `rate` per
/// second: 1,500 rows at 300/s take at least 4 s from the relay's start),
/// every row of it arrives, and another tenant's events committed meanwhile
/// arrive while the paced backlog is still pending. Measured from the
/// relay's start, so a slow machine can only make it longer; unpaced, the
/// same backlog goes in well under a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paced_tenant_is_sent_no_faster_than_its_rate_and_others_are_not_held_back() {
    const PACED: i64 = 1_500;
    const RATE: i64 = 300;
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let client = db.client().await.unwrap();
    insert_rows(&client, TENANT_A, "a", PACED).await;
    let toml = config_toml_with(
        &db,
        &sink.url(),
        &format!(
            "[relay]\ntenant_fairness = true\nclaim_batch = {CLAIM_BATCH}\n\
             [[relay.tenants]]\nid = \"{TENANT_A}\"\nrate = {RATE}\n"
        ),
        QSTASH_ROUTE,
    );
    let cfg = Config::from_toml_str(&toml).unwrap();
    let started = std::time::Instant::now();
    let started_us = chrono::Utc::now().timestamp_micros();
    let relay = Relay::start(cfg).await.unwrap();
    assert!(
        sink.wait_for_records(1, Duration::from_secs(60)).await,
        "the paced backlog's delivery did not start"
    );
    insert_rows(&client, TENANT_B, "b", B_EVENTS).await;
    let b_ids: HashSet<i64> = common::column::<i64, _>(
        &client,
        &format!("SELECT id FROM outbox WHERE tenant_id = '{TENANT_B}'"),
    )
    .await;
    let is_b = |r: &outbox_testkit::sink::Record| r.outbox_id.is_some_and(|id| b_ids.contains(&id));
    assert!(
        wait_until(Duration::from_secs(60), || async {
            sink.records().iter().filter(|r| is_b(r)).count() == B_EVENTS as usize
        })
        .await,
        "tenant B's events did not all arrive"
    );
    let a_pending_at_b = common::count(
        &db,
        &format!(
            "SELECT count(*) FROM outbox WHERE tenant_id = '{TENANT_A}'
               AND published_at IS NULL AND dead_lettered_at IS NULL"
        ),
    )
    .await;
    drains_and_stops(&db, relay, Duration::from_secs(120)).await;
    let records = sink.records();
    let a: Vec<&outbox_testkit::sink::Record> = records.iter().filter(|r| !is_b(r)).collect();
    let a_ids: HashSet<i64> = a.iter().filter_map(|r| r.outbox_id).collect();
    assert_eq!(a_ids.len() as i64, PACED, "every paced row arrives");
    let last_a_us = a.iter().map(|r| r.received_at_us).max().unwrap();
    let took = Duration::from_micros((last_a_us - started_us).max(0) as u64);
    let least = Duration::from_secs_f64((PACED - RATE) as f64 / RATE as f64);
    eprintln!(
        "the paced backlog's last row arrived {took:?} after the start ({:?} in all); \
         {a_pending_at_b} of it pending when B's {B_EVENTS} had arrived",
        started.elapsed()
    );
    assert!(
        took >= least.mul_f64(0.98),
        "{PACED} rows paced at {RATE}/s were all sent within {took:?} of the start (at least {least:?})"
    );
    assert!(
        a_pending_at_b > 0,
        "tenant B's events waited for the paced backlog to be sent"
    );
}

#[test]
fn tenant_fairness_config_errors_name_their_key() {
    let base = "[database]\nurl = \"postgres://localhost/x\"\n[qstash]\ntoken = \"t\"\n";
    let route = "[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example/x\"\n";
    let cases: Vec<(String, &str)> = vec![
        (
            format!("{base}[relay]\ntenant_fairness = false\n[[relay.tenants]]\nid = \"{TENANT_A}\"\nweight = 2\n{route}"),
            "relay.tenants",
        ),
        (
            format!("{base}[relay]\ntenant_fairness = true\n[[relay.tenants]]\nid = \"tenant-a\"\nweight = 2\n{route}"),
            "relay.tenants[0].id",
        ),
        (
            format!("{base}[relay]\ntenant_fairness = true\n[[relay.tenants]]\nid = \"{TENANT_A}\"\nweight = 0\n{route}"),
            "relay.tenants[0].weight",
        ),
        (
            format!("{base}[relay]\ntenant_fairness = true\n[[relay.tenants]]\nid = \"{TENANT_A}\"\nweight = 1001\n{route}"),
            "relay.tenants[0].weight",
        ),
        (
            format!(
                "{base}[relay]\ntenant_fairness = true\n[[relay.tenants]]\nid = \"{TENANT_A}\"\nweight = 2\n[[relay.tenants]]\nid = \"{}\"\nweight = 3\n{route}",
                TENANT_A.to_uppercase()
            ),
            "relay.tenants[1].id",
        ),
        (
            format!("{base}[relay]\ntenant_fairness = \"yes\"\n{route}"),
            "relay.tenant_fairness",
        ),
        (
            format!("{base}[relay]\ntenant_rate = 100\n{route}"),
            "relay.tenant_rate",
        ),
        (
            format!("{base}[relay]\ntenant_fairness = true\ntenant_rate = 0\n{route}"),
            "relay.tenant_rate",
        ),
        (
            format!("{base}[relay]\ntenant_fairness = true\ntenant_rate = -5\n{route}"),
            "relay.tenant_rate",
        ),
        (
            format!("{base}[relay]\ntenant_fairness = true\n[[relay.tenants]]\nid = \"{TENANT_A}\"\nrate = 0\n{route}"),
            "relay.tenants[0].rate",
        ),
    ];
    let cases: Vec<(&str, &str)> = cases.iter().map(|(t, k)| (t.as_str(), *k)).collect();
    common::assert_config_errors_name(&cases);
    // And weights that are fine load.
    let ok = format!(
        "{base}[relay]\ntenant_fairness = true\n[[relay.tenants]]\nid = \"{TENANT_A}\"\nweight = 3\n[[relay.tenants]]\nid = \"{TENANT_B}\"\nweight = 1000\n{route}"
    );
    let cfg = Config::from_toml_str(&ok).unwrap();
    assert_eq!(cfg.relay.tenants.len(), 2);
    // A pace alone (the weight is then 1), and a pace for every tenant.
    let ok = format!(
        "{base}[relay]\ntenant_fairness = true\ntenant_rate = 2000\n[[relay.tenants]]\nid = \"{TENANT_A}\"\nrate = 50\n{route}"
    );
    let policy = Config::from_toml_str(&ok)
        .unwrap()
        .relay
        .tenant_policy()
        .unwrap()
        .unwrap();
    assert_eq!(
        policy.weights,
        [(uuid::Uuid::parse_str(TENANT_A).unwrap(), 1)]
    );
    assert_eq!(
        policy.rates,
        [(uuid::Uuid::parse_str(TENANT_A).unwrap(), 50)]
    );
    assert_eq!(policy.default_rate, Some(2000));
}
