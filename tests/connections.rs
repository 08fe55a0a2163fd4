//! The relay's database connections under what real deployments do to them:
//! the parts that share a replica's connections (the delivery callbacks, the
//! gauges' sampler, the janitor) must not starve each other, and a connection
//! that stops answering (a half-open TCP connection: the peer gone, nothing
//! ever answering) must not park the actor that holds it.

mod common;

use std::time::{Duration, Instant};

use common::{config_toml_with, count, insert_events, pending, wait_until};
use outbox_relay::server::callback;
use outbox_relay::store::Store;
use outbox_relay::Relay;
use outbox_testkit::proxy::Proxy;
use outbox_testkit::relay::Output;
use outbox_testkit::sink::DEV_CURRENT_SIGNING_KEY;

/// The smallest pool allowed for one shard, a janitor that is always busy
/// (each pass waits on a row lock this test holds), and an ordered QStash
/// route: every delivery callback is taken at its first try, and each key's
/// next event goes out as soon as its predecessor's callback is in, long
/// before the hold (`callback_timeout`) would have let it go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_janitor_does_not_starve_the_delivery_callbacks() {
    let db = common::test_db().await;
    Store::for_command(&db.url)
        .unwrap()
        .reshard(1)
        .await
        .unwrap();
    // A published row old enough for the janitor, locked for the whole test:
    // every janitor pass waits on it.
    let mut locker = db.client().await.unwrap();
    locker
        .batch_execute(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, idempotency_key, published_at)
             VALUES (gen_random_uuid(), 'old', 'x', 'old.done', '{}', 'old-1', now() - interval '30 days')",
        )
        .await
        .unwrap();
    let lock = locker.transaction().await.unwrap();
    lock.execute(
        "SELECT id FROM outbox WHERE idempotency_key = 'old-1' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();

    let (dest, sink) = common::delivering_qstash().await;
    let listener = free_addr();
    let routes = format!(
        r#"
        [[routes]]
        event_type = "order.*"
        destination = "{}/events"
        ordering = "partition_key"
        callback = "http://{listener}{}"
        callback_timeout = "60s"
        "#,
        dest.url(),
        callback::CALLBACK_PATH
    );
    let overrides = format!(
        r#"
        [database]
        pool_size = 5
        [janitor]
        enabled = true
        interval = "1s"
        retain_published = "1d"
        [server]
        callback_bind = "{listener}"
        [qstash]
        current_signing_key = "{DEV_CURRENT_SIGNING_KEY}"
        "#
    );
    let toml = config_toml_with(&db, &sink.url(), &overrides, &routes);
    let keys = 3;
    insert_events(&db, keys * 3, keys).await;
    let relay = common::spawn_relay(&["run"], &toml, Output::Inherit);
    // The janitor's pass is waiting on the lock, holding its connection.
    let janitor_waits = wait_until(Duration::from_secs(20), || async {
        count(
            &db,
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%DELETE FROM outbox%'",
        )
        .await
            > 0
    })
    .await;
    let started = Instant::now();
    let all_published = wait_until(Duration::from_secs(30), || async {
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND event_type = 'order.placed'",
        )
        .await
            == (keys * 3) as i64
    })
    .await;
    let took = started.elapsed();
    // The last event of each key is published before its callback comes:
    // nothing waits on those three, so they may still be on the way.
    sink.wait_for_callbacks(keys * 3, Duration::from_secs(10))
        .await;
    let callbacks = sink.callbacks();
    relay.terminate(Duration::from_secs(30)).await.unwrap();
    lock.rollback().await.unwrap();
    assert!(
        janitor_waits,
        "the janitor never waited on the lock: nothing was tested"
    );
    assert!(
        all_published,
        "{} of {} events published after {took:?}; callbacks: {callbacks:?}",
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND event_type = 'order.placed'"
        )
        .await,
        keys * 3
    );
    assert_eq!(callbacks.len(), keys * 3, "{callbacks:?}");
    for c in &callbacks {
        assert!(
            c.delivered && c.attempts == 1 && c.last_status == Some(200),
            "a callback was not taken at its first try: {c:?}"
        );
    }
}

/// Every connection the relay has open stops answering (its packets dropped
/// on the way, the sockets open): the claimer, the marker and the shard
/// coordinator each give up on theirs and take a fresh one, so the events
/// that arrive meanwhile are delivered within one `relay.shard_lease` (the
/// shard is never lost), each of them once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivery_resumes_within_a_shard_lease_when_the_connections_stop_answering() {
    let db = common::test_db().await;
    let proxy = Proxy::in_front_of(&db.url).await.unwrap();
    let sink = common::start_sink().await;
    let shard_lease = Duration::from_secs(8);
    let overrides = format!(
        r#"
        [database]
        url = "{}"
        [database.statement_timeout]
        claims = "1s"
        marks = "1s"
        coordinator = "1s"
        [relay]
        shard_lease = "{}s"
        "#,
        proxy.url(),
        shard_lease.as_secs()
    );
    let toml = config_toml_with(&db, &sink.url(), &overrides, common::QSTASH_ROUTE);
    let relay = Relay::start(outbox_relay::Config::from_toml_str(&toml).unwrap())
        .await
        .unwrap();
    insert_events(&db, 20, 5).await;
    let warm = wait_until(Duration::from_secs(30), || async {
        pending(&db).await == 0
    })
    .await;
    assert!(warm, "the first events were not delivered");

    let blackholed = proxy.blackhole_open();
    let started = Instant::now();
    // Twenty more, inserted past the proxy.
    let mut client = db.client().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let more: Vec<_> = (20..40)
        .map(|i| common::event(i, &format!("order:k{}", i % 5)))
        .collect();
    outbox_client::enqueue_many(&tx, &more).await.unwrap();
    tx.commit().await.unwrap();
    let resumed = wait_until(shard_lease, || async { pending(&db).await == 0 }).await;
    let took = started.elapsed();
    let left = pending(&db).await;
    let lost = relay.shards_owned().is_empty();
    relay.shutdown().await;
    assert!(blackholed >= 3, "only {blackholed} connections were open");
    assert!(
        resumed,
        "{left} of 20 events still pending {took:?} after the relay's {blackholed} connections stopped answering"
    );
    assert!(!lost, "the shard was lost");
    let mut keys: Vec<String> = sink.accepted().into_iter().map(|r| r.dedup_id).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 40, "every event delivered");
    assert!(
        proxy.opened() > blackholed,
        "the relay never opened a fresh connection"
    );
}

/// Every connection stops answering at once, as when a network drops
/// packets: the first session to find out waits its deadline; the others,
/// and the connection idle in the pool, are given up without waiting
/// theirs, so the next statement of every other session is answered, on a
/// fresh connection. (Before, each actor found out on its own, one deadline
/// after another: the wake-up probe, then the claims it woke, then the marks
/// of what they claimed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_one_connection_goes_unanswered_the_other_sessions_take_fresh_ones() {
    let db = common::test_db().await;
    let (proxy, store, mut sessions) = three_sessions_through_a_proxy(&db).await;
    // A fourth connection, left idle in the pool.
    drop(store.conn().await.unwrap());
    let blackholed = proxy.blackhole_open();
    assert_eq!(blackholed, 4);

    let first = sessions[0].layout().await;
    assert!(
        matches!(first, Err(outbox_relay::store::StoreError::Unanswered(_))),
        "{first:?}"
    );
    for (i, s) in sessions.iter_mut().enumerate().skip(1) {
        let answered = s.layout().await;
        assert!(answered.is_ok(), "session {i}: {answered:?}");
    }
    sessions[0].failed();
    sessions[0].layout().await.unwrap();
    assert_eq!(
        proxy.opened(),
        blackholed + 3,
        "one fresh connection per session"
    );
}

/// After the first unanswered connection, the pool's idle connections are
/// tried before use; one found dead so was lost with the others already
/// noted, and must not make the sessions that took fresh connections since
/// give those up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_idle_connection_found_later_leaves_fresh_ones_alone() {
    let db = common::test_db().await;
    let (proxy, store, mut sessions) = three_sessions_through_a_proxy(&db).await;
    // Two more, held outside the pool through the blackhole.
    let held = (store.conn().await.unwrap(), store.conn().await.unwrap());
    assert_eq!(proxy.blackhole_open(), 5);
    assert!(sessions[0].layout().await.is_err());
    sessions[0].failed();
    // Session 1 takes a fresh connection while no dead one is idle.
    sessions[1].layout().await.unwrap();
    drop(held);
    // Session 2 finds the two dead ones idle, gives them up, takes a fresh one.
    sessions[2].layout().await.unwrap();
    let opened = proxy.opened();
    sessions[1].layout().await.unwrap();
    sessions[0].layout().await.unwrap();
    assert_eq!(
        proxy.opened(),
        opened + 1,
        "only session 0 connects again: session 1 keeps its fresh connection"
    );
}

/// A store reaching `db` through a proxy, with a 1 s statement timeout, and
/// three sessions that have each taken a connection.
async fn three_sessions_through_a_proxy(
    db: &outbox_testkit::TestDb,
) -> (Proxy, Store, Vec<outbox_relay::store::Session>) {
    let proxy = Proxy::in_front_of(&db.url).await.unwrap();
    let store = Store::open(proxy.url(), 6, Duration::from_secs(5))
        .unwrap()
        .with_session_limit(Duration::from_secs(1));
    let mut sessions: Vec<_> = (0..3).map(|_| store.session()).collect();
    for s in &mut sessions {
        s.layout().await.unwrap();
    }
    (proxy, store, sessions)
}

/// A loopback address nothing listens on yet.
fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Each new `[database]` key is checked as it is read, and its error names it.
#[test]
fn the_connection_keys_are_checked_naming_their_key() {
    let route = "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\n";
    for (toml, want) in [
        (
            "[database]\ncallback_pool_size = 0\n",
            "configuration key `database.callback_pool_size`: must be between 1 and 64",
        ),
        (
            "[database]\nkeepalives_idle = \"500ms\"\n",
            "configuration key `database.keepalives_idle`: must be at least 1s",
        ),
        (
            "[database]\nkeepalives_interval = \"0s\"\n",
            "configuration key `database.keepalives_interval`: must be at least 1s",
        ),
        (
            "[database]\nkeepalives_retries = 0\n",
            "configuration key `database.keepalives_retries`: must be between 1 and 100",
        ),
        (
            "[database]\ntcp_user_timeout = \"0s\"\n",
            "configuration key `database.tcp_user_timeout`: must be at least 1s",
        ),
        (
            "[relay]\nshard_lease = \"8s\"\n[database.statement_timeout]\nclaims = \"3s\"\n",
            "configuration key `database.statement_timeout.claims`: must be at most a quarter of relay.shard_lease (2s)",
        ),
        (
            "[database.statement_timeout]\nmarks = \"5ms\"\n",
            "configuration key `database.statement_timeout.marks`: must be at least 10ms",
        ),
        (
            "[relay]\nshard_lease = \"8s\"\n[database.statement_timeout]\ncoordinator = \"5s\"\n",
            "configuration key `database.statement_timeout.coordinator`: must be at most half of relay.shard_lease (4s)",
        ),
        (
            "[database.statement_timeout]\ncallbacks = \"0s\"\n",
            "configuration key `database.statement_timeout.callbacks`: must be at least 10ms",
        ),
        (
            "[database.statement_timeout]\nsampler = \"1ms\"\n",
            "configuration key `database.statement_timeout.sampler`: must be at least 10ms",
        ),
        (
            "[database.statement_timeout]\njanitor = \"1s\"\n",
            "configuration key `database.janitor_lock_timeout`: must not be longer than database.statement_timeout.janitor",
        ),
        (
            "[database.statement_timeout]\nclaim = \"1s\"\n",
            "configuration key `database.statement_timeout.claim`: unknown field",
        ),
        (
            "[database]\npool_size = 3\n",
            "configuration key `database.pool_size`: must be at least relay.shards + relay.mark_connections + 2 (5): each claimer, each of the marker's relay.mark_connections and the shard coordinator keep a connection of this pool, and one is left for the drain's progress and the start-up checks (the callback listener, the backlog sampler and the janitor have pools of their own: database.callback_pool_size, 1 and 1)",
        ),
    ] {
        let toml = format!("{toml}{route}");
        let e = outbox_relay::Config::from_toml_str(&toml)
            .expect_err(&toml)
            .to_string();
        assert!(e.contains(want), "{toml:?}:\n{e}\nwanted: {want}");
    }
    // The defaults hold, and a lease of two seconds (the tests') is fine with them.
    for toml in ["", "[relay]\nshard_lease = \"2s\"\n"] {
        outbox_relay::Config::from_toml_str(&format!("{toml}{route}")).expect(toml);
    }
}
