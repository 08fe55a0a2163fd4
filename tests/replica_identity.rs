//! One name, one process: a relay refuses to start under a `relay.replica_id`
//! that another live relay is using (two such relays took each other's shards
//! several times a second and delivered half the backlog), relays left to
//! their default names never collide, and a replica restarted at once after a
//! crash still starts under its name, waiting for its old requests first.

mod common;

use std::time::{Duration, Instant};

use common::{config, count, insert_events, pending, wait_until, QSTASH_ROUTE};
use outbox_relay::config::Config;
use outbox_relay::Relay;
use outbox_testkit::sink::SinkHandle;
use outbox_testkit::TestDb;

fn relay_config(db: &TestDb, sink: &SinkHandle, replica_id: &str) -> Config {
    let mut cfg = config(db, &sink.url(), QSTASH_ROUTE);
    cfg.relay.replica_id = replica_id.to_owned();
    cfg
}

async fn published(db: &TestDb) -> i64 {
    count(
        db,
        "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_relay_under_a_live_replica_id_refuses_to_start() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_delay(Duration::from_millis(20));
    insert_events(&db, 400, 40).await;
    let first = Relay::start(relay_config(&db, &sink, "twin"))
        .await
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || async {
            first.shards_owned().len() == 8
        })
        .await,
        "the first relay took {:?}",
        first.shards_owned()
    );
    let second = Relay::start(relay_config(&db, &sink, "twin")).await;
    let refusal = match second {
        Ok(second) => {
            let drained = wait_until(Duration::from_secs(30), || async {
                pending(&db).await == 0
            })
            .await;
            let left = pending(&db).await;
            second.shutdown().await;
            first.shutdown().await;
            panic!(
                "a second relay started under relay.replica_id \"twin\" while the first ran (drained: {drained}, {left} of 400 pending)"
            );
        }
        Err(e) => e.to_string(),
    };
    let pid = std::process::id().to_string();
    assert!(
        refusal.contains("relay.replica_id") && refusal.contains("twin") && refusal.contains(&pid),
        "the refusal names the key, the name and who holds it: {refusal}"
    );
    // `stats` shows that a second process asked for the name.
    let out = common::cli_ok(&db, &["stats", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let twin = &json["replicas"][0];
    assert_eq!(twin["replica"], "twin", "{json}");
    assert!(
        twin["refused"]["pid"].as_i64() == Some(i64::from(std::process::id() as i32)),
        "stats shows the refused process: {twin}"
    );
    let text = common::cli(&db, &["stats"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("relay.replica_id"), "{text}");
    // The first relay delivers everything, alone.
    let drained = wait_until(Duration::from_secs(60), || async {
        pending(&db).await == 0
    })
    .await;
    assert_eq!(first.shards_owned().len(), 8);
    first.shutdown().await;
    assert!(drained, "{} pending", pending(&db).await);
    assert_eq!(published(&db).await, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_left_to_their_default_names_are_distinct_and_share_the_work() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_delay(Duration::from_millis(20));
    insert_events(&db, 400, 40).await;
    let a = Relay::start(relay_config(&db, &sink, "")).await.unwrap();
    let b = Relay::start(relay_config(&db, &sink, "")).await.unwrap();
    let (id_a, id_b) = (a.replica_id().to_owned(), b.replica_id().to_owned());
    let split = wait_until(Duration::from_secs(30), || async {
        a.shards_owned().len() == 4 && b.shards_owned().len() == 4
    })
    .await;
    let (held_a, held_b) = (a.shards_owned(), b.shards_owned());
    let drained = wait_until(Duration::from_secs(60), || async {
        pending(&db).await == 0
    })
    .await;
    let left = pending(&db).await;
    b.shutdown().await;
    a.shutdown().await;
    assert_ne!(
        id_a, id_b,
        "two relays of one process got the same default name"
    );
    assert!(split, "not split 4/4: {held_a:?} / {held_b:?}");
    assert!(drained, "{left} of 400 pending");
    assert_eq!(published(&db).await, 400);
}

/// A relay stalled long enough to be replaced under its name (here: another
/// process's heartbeat written into its row) finds its next heartbeat
/// refused: it drops every shard instead of taking them back from the other
/// one, and takes its share again once the name is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_name_another_process_took_drops_its_shards_until_the_name_is_free() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let relay = Relay::start(relay_config(&db, &sink, "moved"))
        .await
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || async {
            relay.shards_owned().len() == 8
        })
        .await
    );
    let client = db.client().await.unwrap();
    // The other process heartbeats for 30 s and holds the shards.
    client
        .batch_execute(
            "UPDATE outbox_relay_replicas
             SET instance = 'elsewhere', hostname = 'other-host', pid = 77,
                 seen_at = now(), alive_until = now() + interval '30 seconds'
             WHERE replica = 'moved'",
        )
        .await
        .unwrap();
    let dropped = wait_until(Duration::from_secs(10), || async {
        relay.shards_owned().is_empty()
    })
    .await;
    let held_then = relay.shards_owned();
    // The other process's heartbeat stops: the name is free again.
    client
        .batch_execute(
            "UPDATE outbox_relay_replicas SET alive_until = now() WHERE replica = 'moved'",
        )
        .await
        .unwrap();
    let back = wait_until(Duration::from_secs(20), || async {
        relay.shards_owned().len() == 8
    })
    .await;
    let instance_now: Option<String> = client
        .query_one(
            "SELECT instance FROM outbox_relay_replicas WHERE replica = 'moved'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    relay.shutdown().await;
    assert!(
        dropped,
        "the relay kept shards under a name another process holds: {held_then:?}"
    );
    assert!(back, "the relay did not take its shards again");
    assert_ne!(instance_now.as_deref(), Some("elsewhere"));
}

/// The process that had the name is gone (killed), its heartbeat and its
/// shard leases not yet over: a replica started at once under the name starts
/// within about one heartbeat period, takes the shards back, and claims only
/// once every request the dead one could still have had open is over (its
/// leases' end, then `http.request_timeout` + `relay.mark_interval` + 1 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_restarted_while_its_old_heartbeat_is_current_starts_and_waits_for_its_old_requests(
) {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    insert_events(&db, 400, 40).await;
    let client = db.client().await.unwrap();
    // What a process killed a moment ago leaves: a heartbeat good for 8 s
    // more (a 8 s shard lease) and its leases, 3 s to go.
    client
        .batch_execute(
            "INSERT INTO outbox_relay_replicas (replica, hostname, pid, started_at, seen_at, alive_until)
             VALUES ('solo', 'gone-host', 4242, now() - interval '1 hour', now(), now() + interval '8 seconds');
             UPDATE outbox_relay_shard_leases
             SET owner = 'solo', token = nextval('outbox_relay_shard_token_seq'),
                 lease_until = now() + interval '3 seconds', acquired_at = now(), renewed_at = now()",
        )
        .await
        .unwrap();
    let leases_end = Instant::now() + Duration::from_secs(3);
    let began = Instant::now();
    let relay = Relay::start(relay_config(&db, &sink, "solo"))
        .await
        .expect("a restart under the same name starts");
    let started_in = began.elapsed();
    let drained = wait_until(Duration::from_secs(60), || async {
        pending(&db).await == 0
    })
    .await;
    let owned = relay.shards_owned();
    relay.shutdown().await;
    assert!(
        started_in < Duration::from_secs(7),
        "it waited for the old heartbeat to run out: {started_in:?}"
    );
    assert!(drained, "{} pending", pending(&db).await);
    assert_eq!(owned.len(), 8, "{owned:?}");
    // request_timeout 1 s + mark_interval 5 ms + 1 s after the old leases.
    let wait = Duration::from_millis(2005);
    let first = sink
        .received()
        .iter()
        .map(|r| r.at)
        .min()
        .expect("something was sent");
    assert!(
        first >= leases_end + wait,
        "the first request came {:.3} s after the old leases ended, sooner than {wait:?}",
        seconds_after(first, leases_end)
    );
}

/// `a - b` in seconds, negative when `a` came first.
fn seconds_after(a: Instant, b: Instant) -> f64 {
    match a.checked_duration_since(b) {
        Some(d) => d.as_secs_f64(),
        None => -(b - a).as_secs_f64(),
    }
}
