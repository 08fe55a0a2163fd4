//! Per-key order under the conditions that used to break it: a handover while
//! requests are still open, a reshard while relays run and producers write,
//! and fairness between ordered and unordered types.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{config, count, ordered_qstash_route, pending, wait_until};
use outbox_client::{enqueue_many, NewEvent};
use outbox_relay::config::PublishMode;
use outbox_relay::store::Store;
use outbox_relay::Relay;
use outbox_testkit::sink::SinkHandle;
use outbox_testkit::TestDb;
use serde_json::json;
use uuid::Uuid;

async fn insert(db: &TestDb, events: Vec<NewEvent>) {
    let mut client = db.client().await.unwrap();
    for chunk in events.chunks(1000) {
        let tx = client.transaction().await.unwrap();
        enqueue_many(&tx, chunk).await.unwrap();
        tx.commit().await.unwrap();
    }
}

fn ordered_event(i: usize, key: usize) -> NewEvent {
    NewEvent::new(
        Uuid::from_u128(1),
        "order",
        format!("k{key}"),
        "order.placed",
        json!({"n": i}),
        format!("evt-{i}"),
    )
}

/// A second replica joins while the first one's requests take 8 s each: the
/// shards it takes over must not see a key's next request (or a second copy
/// of the same one) before the first replica's request for that key ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handover_waits_until_no_request_of_the_shard_is_open() {
    const DELAY: Duration = Duration::from_secs(8);
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_delay(DELAY);
    let keys = 16;
    insert(
        &db,
        (0..keys * 2).map(|i| ordered_event(i, i % keys)).collect(),
    )
    .await;
    let replica = |name: &str| {
        let mut cfg = config(&db, &sink.url(), &ordered_qstash_route("order.*"));
        cfg.qstash.mode = PublishMode::Single;
        cfg.http.request_timeout = Duration::from_secs(10);
        cfg.relay.lease = Duration::from_secs(12);
        cfg.relay.replica_id = name.to_owned();
        cfg
    };
    let a = Relay::start(replica("a")).await.unwrap();
    // Every key's first event is on its way to the sink from replica a.
    assert!(
        wait_until(Duration::from_secs(60), || async {
            sink.requests().len() >= keys
        })
        .await
    );
    let b = Relay::start(replica("b")).await.unwrap();
    let drained = wait_until(Duration::from_secs(90), || async {
        pending(&db).await == 0
    })
    .await;
    assert!(
        !b.shards_owned().is_empty(),
        "b took no shard: nothing was handed over"
    );
    b.shutdown().await;
    a.shutdown().await;
    assert!(drained, "{} pending", pending(&db).await);
    assert_key_order(&sink, DELAY);
}

/// A big ordered backlog across many keys, and unordered events behind it in
/// the same shards: both kinds drain together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ordered_backlog_does_not_starve_unordered_types() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let ordered = 4_000;
    let unordered = 400;
    insert(
        &db,
        (0..ordered).map(|i| ordered_event(i, i % 2_000)).collect(),
    )
    .await;
    insert(
        &db,
        (0..unordered)
            .map(|i| {
                NewEvent::new(
                    Uuid::from_u128(1),
                    "audit",
                    format!("a{i}"),
                    "audit.logged",
                    json!({"n": i}),
                    format!("audit-{i}"),
                )
            })
            .collect(),
    )
    .await;
    let routes = format!(
        "{}\n[[routes]]\nevent_type = \"*\"\ndestination = \"http://127.0.0.1:9/any\"\n",
        ordered_qstash_route("order.*")
    );
    let mut cfg = config(&db, &sink.url(), &routes);
    cfg.relay.claim_batch = 100;
    let relay = Relay::start(cfg).await.unwrap();
    let unordered_pending = || async {
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE event_type = 'audit.logged' AND published_at IS NULL",
        )
        .await
    };
    assert!(
        wait_until(Duration::from_secs(90), || async {
            unordered_pending().await == 0
        })
        .await
    );
    let ordered_left = count(
        &db,
        "SELECT count(*) FROM outbox WHERE event_type = 'order.placed' AND published_at IS NULL",
    )
    .await;
    let drained = wait_until(Duration::from_secs(90), || async {
        pending(&db).await == 0
    })
    .await;
    relay.shutdown().await;
    assert!(drained);
    assert!(
        ordered_left >= ordered as i64 / 4,
        "the unordered events waited for the ordered backlog: only {ordered_left} ordered rows were left when the last unordered one went out"
    );
}

/// A replica whose lease round is held up (its heartbeat waits on a row lock
/// for seconds) takes the shards of a replica that could not renew: its first
/// claim there waits the full `http.request_timeout` + `relay.mark_interval` +
/// 1 s from when it took them, not from when its round began, so no key sees
/// its next event (or a second copy) while the last owner's request is open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_in_a_slow_round_waits_from_the_acquisition() {
    const DELAY: Duration = Duration::from_millis(2500);
    // request_timeout 3 s + mark_interval 5 ms + 1 s.
    const WAIT: Duration = Duration::from_millis(4005);
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_delay(DELAY);
    let keys = 24;
    insert(
        &db,
        (0..keys * 4).map(|i| ordered_event(i, i % keys)).collect(),
    )
    .await;
    let replica = |name: &str, shard_lease: u64| {
        let mut cfg = config(&db, &sink.url(), &ordered_qstash_route("order.*"));
        cfg.qstash.mode = PublishMode::Single;
        cfg.http.request_timeout = Duration::from_secs(3);
        cfg.relay.lease = Duration::from_secs(6);
        cfg.relay.replica_id = name.to_owned();
        cfg.relay.shard_lease = Duration::from_secs(shard_lease);
        // Its sessions carry its name, to see its heartbeat wait.
        let sep = if db.url.contains('?') { '&' } else { '?' };
        cfg.database.url = format!("{}{sep}application_name=replica-{name}", db.url);
        cfg
    };
    // a renews every 0.5 s; b's rounds come every 2 s.
    let a = Relay::start(replica("a", 2)).await.unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || async {
            sink.requests().len() >= keys
        })
        .await
    );
    let b = Relay::start(replica("b", 8)).await.unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || async {
            a.shards_owned().len() == 4 && b.shards_owned().len() == 4
        })
        .await,
        "not split: {:?} / {:?}",
        a.shards_owned(),
        b.shards_owned()
    );
    let a_shards: Vec<i16> = a.shards_owned().iter().map(|s| s.index() as i16).collect();
    // b's next round stops at its heartbeat...
    let mut hold_b = db.client().await.unwrap();
    let hold_b = hold_b.transaction().await.unwrap();
    hold_b
        .execute(
            "SELECT 1 FROM outbox_relay_replicas WHERE replica = 'b' FOR UPDATE",
            &[],
        )
        .await
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || heartbeat_waits(&db, "b")).await,
        "b's heartbeat did not wait on the lock"
    );
    let b_stalled = Instant::now();
    // ...then a can no longer renew either, and its leases end.
    let mut hold_a = db.client().await.unwrap();
    let hold_a = hold_a.transaction().await.unwrap();
    hold_a
        .execute(
            "SELECT 1 FROM outbox_relay_replicas WHERE replica = 'a' FOR UPDATE",
            &[],
        )
        .await
        .unwrap();
    let a_leases_ended = || async {
        count_shards(
            &db,
            "SELECT count(*) FROM outbox_relay_shard_leases
             WHERE shard = ANY($1) AND owner = 'a' AND lease_until > now()",
            &a_shards,
        )
        .await
            == 0
    };
    assert!(wait_until(Duration::from_secs(10), a_leases_ended).await);
    // b's round has been held up for at least 1.5 s when it goes on.
    tokio::time::sleep(
        (b_stalled + Duration::from_millis(1500)).saturating_duration_since(Instant::now()),
    )
    .await;
    hold_b.commit().await.unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || async {
            b.shards_owned().len() == 8
        })
        .await,
        "b did not take a's shards: {:?}",
        b.shards_owned()
    );
    let acquired = acquisitions(&db, &a_shards).await;
    hold_a.commit().await.unwrap();
    let drained = wait_until(Duration::from_secs(90), || async {
        pending(&db).await == 0
    })
    .await;
    b.shutdown().await;
    a.shutdown().await;
    assert!(drained, "{} pending", pending(&db).await);
    // Requests for rows of the shards b took that started after it took
    // them: b's. The sink judges a request (`at`) once its delay is over.
    let client = db.client().await.unwrap();
    let mut checked = 0;
    for (shard, taken_at) in acquired {
        let rows: Vec<i64> = client
            .query(
                "SELECT o.id FROM outbox o JOIN outbox_relay_shard_leases l
                   ON o.bucket >= l.bucket_lo AND o.bucket < l.bucket_hi
                 WHERE l.shard = $1",
                &[&shard],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let first = sink
            .received()
            .iter()
            .filter(|r| r.outbox_id.is_some_and(|id| rows.contains(&id)))
            .map(|r| r.at - DELAY)
            .filter(|started| *started >= taken_at)
            .min();
        if let Some(first) = first {
            checked += 1;
            eprintln!(
                "shard {shard}: first request {:?} after the takeover",
                first - taken_at
            );
            assert!(
                first >= taken_at + WAIT,
                "shard {shard}: the first request came {:?} after the takeover, sooner than {WAIT:?}",
                first - taken_at
            );
        }
    }
    assert!(checked > 0, "no request in the shards b took");
    assert_key_order(&sink, DELAY);
}

/// The replica's heartbeat is waiting for a lock.
async fn heartbeat_waits(db: &TestDb, name: &str) -> bool {
    let client = db.client().await.unwrap();
    let app = format!("replica-{name}");
    client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
             WHERE application_name = $1 AND wait_event_type = 'Lock'
               AND query LIKE '%outbox_relay_replicas%'",
            &[&app],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
        > 0
}

async fn count_shards(db: &TestDb, sql: &str, shards: &[i16]) -> i64 {
    let client = db.client().await.unwrap();
    client.query_one(sql, &[&shards]).await.unwrap().get(0)
}

/// When each of `shards` was taken, as this process's clock reads it (no
/// later than the database's time of the takeover).
async fn acquisitions(db: &TestDb, shards: &[i16]) -> Vec<(i16, Instant)> {
    let client = db.client().await.unwrap();
    let before = Instant::now();
    client
        .query(
            "SELECT shard, extract(epoch FROM now() - acquired_at)::float8
             FROM outbox_relay_shard_leases WHERE shard = ANY($1)",
            &[&shards],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), before - Duration::from_secs_f64(r.get(1))))
        .collect()
}

/// Each answer came `delay` after its request arrived: asserts that no key's
/// requests overlapped, and that each key's events first reached the sink in
/// id order.
fn assert_key_order(sink: &SinkHandle, delay: Duration) {
    let mut by_key: BTreeMap<String, Vec<(Instant, i64)>> = BTreeMap::new();
    for r in sink.received() {
        by_key
            .entry(r.partition_key())
            .or_default()
            .push((r.at, r.outbox_id.expect("the relay forwards the outbox id")));
    }
    let slack = Duration::from_millis(300);
    for (key, mut seen) in by_key {
        seen.sort();
        for pair in seen.windows(2) {
            let gap = pair[1].0 - pair[0].0;
            assert!(
                gap + slack >= delay,
                "key {key}: two requests overlapped ({gap:?} between their answers)"
            );
        }
        // First deliveries in id order (a redelivery may repeat an old id).
        let mut first = Vec::new();
        for (_, id) in &seen {
            if !first.contains(id) {
                first.push(*id);
            }
        }
        assert!(
            first.windows(2).all(|w| w[0] < w[1]),
            "key {key}: first deliveries out of order: {first:?}"
        );
    }
}

/// A reshard while a relay drains an ordered backlog: no relay is stopped, no
/// outbox row is rewritten, the relay takes the new shards on its next round,
/// every event arrives, and no key ever sees a later event first or two
/// requests at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reshard_while_the_relay_runs_keeps_every_key_in_order() {
    const DELAY: Duration = Duration::from_millis(150);
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_delay(DELAY);
    let keys = 40;
    insert(
        &db,
        (0..keys * 10).map(|i| ordered_event(i, i % keys)).collect(),
    )
    .await;
    let mut cfg = config(&db, &sink.url(), &ordered_qstash_route("order.*"));
    cfg.qstash.mode = PublishMode::Single;
    let relay = Relay::start(cfg).await.unwrap();
    assert!(
        wait_until(Duration::from_secs(60), || async {
            sink.received().len() >= keys
        })
        .await
    );
    let before = Store::for_command(&db.url)
        .unwrap()
        .reshard(3)
        .await
        .expect("a reshard while relays run");
    assert_eq!(before, 8);
    let drained = wait_until(Duration::from_secs(120), || async {
        pending(&db).await == 0
    })
    .await;
    let owned = relay.shards_owned();
    relay.shutdown().await;
    assert!(drained, "{} pending", pending(&db).await);
    assert_eq!(owned.len(), 3, "the relay took the new layout: {owned:?}");
    assert_key_order(&sink, DELAY);
}

/// A producer in a REPEATABLE READ transaction whose snapshot predates a
/// reshard, and another with rows not yet committed while it runs: the
/// reshard waits for neither (it writes no outbox row), and their rows are
/// delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_that_straddle_a_reshard_are_not_lost_nor_blocking() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let mut early = db.client().await.unwrap();
    let mut open = db.client().await.unwrap();
    // The snapshot is taken before the reshard...
    let early_tx = early
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await
        .unwrap();
    early_tx.query_one("SELECT 1", &[]).await.unwrap();
    // ...and this one holds uncommitted rows while it runs.
    let open_tx = open.transaction().await.unwrap();
    enqueue_many(&open_tx, &[ordered_event(1, 1)])
        .await
        .unwrap();
    let resharded = tokio::time::timeout(Duration::from_secs(60), async {
        Store::for_command(&db.url).unwrap().reshard(5).await
    })
    .await
    .expect("the reshard waited for a producer's transaction");
    assert_eq!(resharded.unwrap(), 8);
    enqueue_many(&early_tx, &[ordered_event(2, 2)])
        .await
        .unwrap();
    early_tx.commit().await.unwrap();
    open_tx.commit().await.unwrap();
    let report = outbox_relay::drain(
        config(&db, &sink.url(), &ordered_qstash_route("order.*")),
        Some(Duration::from_secs(60)),
    )
    .await
    .unwrap();
    assert_eq!(report.remaining, 0, "{report:?}");
    assert_eq!(report.counters.published, 2);
    let published = count(
        &db,
        "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
    )
    .await;
    assert_eq!(published, 2);
}

/// Two routes on the same aggregates: `audit.*` (unordered) to a destination
/// that refuses connections, so its route stays paused, and `*` (ordered) to
/// a working sink. The paused route's rows are the oldest of every key, yet
/// they hold back nothing of the ordered route: a key's order is kept among
/// the events one route delivers. The audit rows stay pending (deferred,
/// never dead-lettered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_route_does_not_hold_another_routes_ordered_keys() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    // A loopback port with nothing listening: every connection is refused.
    let refused = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let keys = 4;
    let mut events = Vec::new();
    for i in 0..20 {
        events.push(NewEvent::new(
            Uuid::from_u128(1),
            "order",
            format!("k{}", i % keys),
            "audit.logged",
            json!({"n": i}),
            format!("audit-{i}"),
        ));
        events.push(ordered_event(i, i % keys));
    }
    insert(&db, events).await;
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let routes = format!(
        r#"
[[routes]]
event_type = "audit.*"
sink = "webhook"
destination = "http://{refused}/audit"
signing_secret = "{secret}"

[[routes]]
event_type = "*"
sink = "webhook"
destination = "{sink}/hook/{{partition_key}}"
signing_secret = "{secret}"
ordering = "partition_key"
"#,
        sink = sink.url()
    );
    let relay = Relay::start(config(&db, &sink.url(), &routes))
        .await
        .unwrap();
    let published = || async {
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE event_type = 'order.placed' AND published_at IS NOT NULL",
        )
        .await
    };
    let all_out = wait_until(Duration::from_secs(20), || async {
        published().await == 20
    })
    .await;
    let audit_pending = count(
        &db,
        "SELECT count(*) FROM outbox WHERE event_type = 'audit.logged'
           AND published_at IS NULL AND dead_lettered_at IS NULL",
    )
    .await;
    relay.shutdown().await;
    assert!(
        all_out,
        "{} of the 20 ordered events published while the audit route is paused",
        published().await
    );
    assert_eq!(audit_pending, 20, "the paused route's rows stay pending");
    // Each key's ordered events reached the sink in id order.
    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in sink.accepted() {
        by_key
            .entry(r.destination.clone())
            .or_default()
            .push(r.outbox_id.expect("the relay sends the outbox id"));
    }
    assert_eq!(by_key.len(), keys, "{by_key:?}");
    for (key, ids) in by_key {
        assert_eq!(ids.len(), 20 / keys, "{key}: {ids:?}");
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{key}: {ids:?}");
    }
}
