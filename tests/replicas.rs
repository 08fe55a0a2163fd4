//! Several `outbox-relay` processes against one database: shard ownership
//! through leases, handover on SIGTERM, takeover after SIGKILL, fencing of a
//! replica paused past its lease, and a replica joining mid-drain. Plus the
//! fencing itself, statement by statement, on the rows.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use common::{config_toml, count, insert_events, pending, wait_until};
use nix::sys::signal::Signal;
use outbox_relay::store::mark::{Held, Write};
use outbox_relay::store::outbox::{no_cursor, ClaimScope};
use outbox_relay::store::{Fence, ShardId, Store};
use outbox_testkit::relay::{Output, RelayProcess};
use outbox_testkit::sink::{Received, SinkHandle};
use outbox_testkit::TestDb;

const SHARDS: u32 = 16;

/// The engine tests' config, with 16 shards, a name, a metrics port, a 2 s
/// shard lease, and the row lease and request timeout given.
fn replica_toml(
    db: &TestDb,
    sink: &SinkHandle,
    name: &str,
    metrics_port: u16,
    lease: &str,
    request_timeout: &str,
) -> String {
    // Each replica's sessions carry its name (the listener's excepted), so a
    // test can tell when a stopped replica has no statement left running.
    let sep = if db.url.contains('?') { '&' } else { '?' };
    let url = format!("{}{sep}application_name=replica-{name}", db.url);
    config_toml(db, &sink.url(), &common::ordered_qstash_route("*"))
        .replace(
            &format!("url = \"{}\"", db.url),
            &format!("url = \"{url}\""),
        )
        .replace("pool_size = 12", "pool_size = 20")
        .replace("lease = \"3s\"", &format!("lease = \"{lease}\""))
        .replace(
            "request_timeout = \"1s\"",
            &format!("request_timeout = \"{request_timeout}\""),
        )
        .replace(
            "metrics_bind = \"127.0.0.1:0\"",
            &format!("metrics_bind = \"127.0.0.1:{metrics_port}\""),
        )
        .replace(
            "shard_lease = \"2s\"",
            &format!("shard_lease = \"2s\"\n        replica_id = \"{name}\""),
        )
}

struct Replica {
    name: String,
    process: RelayProcess,
    metrics_port: u16,
}

impl Replica {
    fn start(db: &TestDb, sink: &SinkHandle, name: &str, lease: &str, timeout: &str) -> Replica {
        let metrics_port = free_port();
        let toml = replica_toml(db, sink, name, metrics_port, lease, timeout);
        Replica {
            name: name.to_owned(),
            process: common::spawn_relay(&["run"], &toml, Output::Null),
            metrics_port,
        }
    }

    fn signal(&self, signal: Signal) {
        self.process.signal(signal);
    }

    async fn stop(&mut self) {
        self.signal(Signal::SIGTERM);
        let status = self
            .process
            .exit_within(Duration::from_secs(20))
            .await
            .unwrap_or_else(|| panic!("{} did not exit on SIGTERM", self.name));
        assert!(status.success(), "{}: {status:?}", self.name);
    }

    /// One series of its /metrics, summed over labels; `None` when absent.
    async fn metric(&self, name: &str) -> Option<f64> {
        let body = scrape(self.metrics_port).await?;
        let values: Vec<f64> = body
            .lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn scrape(port: u16) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .ok()?;
    let mut body = String::new();
    stream.read_to_string(&mut body).await.ok()?;
    Some(body)
}

/// A fresh database sharded 16 ways with `n` events over `keys` keys, and a
/// sink answering after `delay_ms`.
async fn backlog(n: usize, keys: usize, delay_ms: u64) -> (TestDb, SinkHandle) {
    let db = common::test_db().await;
    reshard(&db).await;
    let sink = common::start_sink().await;
    sink.set_delay(Duration::from_millis(delay_ms));
    insert_events(&db, n, keys).await;
    (db, sink)
}

/// Starts the `names` replicas and waits until they split the shards evenly
/// and the sink accepted at least `min_accepted` events.
async fn start_split(
    db: &TestDb,
    sink: &SinkHandle,
    names: &[&str],
    lease: &str,
    request_timeout: &str,
    min_accepted: usize,
) -> Vec<Replica> {
    let replicas: Vec<Replica> = names
        .iter()
        .map(|n| Replica::start(db, sink, n, lease, request_timeout))
        .collect();
    assert!(
        wait_until(Duration::from_secs(30), || async {
            split_evenly(&owners(db).await, names) && sink.accepted().len() >= min_accepted
        })
        .await,
        "not split evenly among {names:?}: {:?}",
        owners(db).await
    );
    replicas
}

/// Waits (at most `limit`) until `names` split the shards evenly.
async fn wait_split(db: &TestDb, names: &[&str], limit: Duration) {
    assert!(
        wait_until(limit, || async { split_evenly(&owners(db).await, names) }).await,
        "not split evenly among {names:?}: {:?}",
        owners(db).await
    );
}

fn store(db: &TestDb) -> Store {
    Store::for_command(&db.url).unwrap()
}

async fn reshard(db: &TestDb) {
    store(db).reshard(SHARDS).await.unwrap();
}

/// Live shard leases by owner.
async fn owners(db: &TestDb) -> BTreeMap<String, Vec<i16>> {
    let rows = db
        .client()
        .await
        .unwrap()
        .query(
            "SELECT owner, shard FROM outbox_relay_shard_leases
             WHERE owner IS NOT NULL AND lease_until > now() ORDER BY shard",
            &[],
        )
        .await
        .unwrap();
    let mut by_owner: BTreeMap<String, Vec<i16>> = BTreeMap::new();
    for r in rows {
        by_owner.entry(r.get(0)).or_default().push(r.get(1));
    }
    by_owner
}

/// Every shard held, split among exactly `names` with shares differing by at
/// most one.
fn split_evenly(owners: &BTreeMap<String, Vec<i16>>, names: &[&str]) -> bool {
    let held: usize = owners.values().map(Vec::len).sum();
    let sizes: Vec<usize> = names
        .iter()
        .map(|n| owners.get(*n).map_or(0, Vec::len))
        .collect();
    held == SHARDS as usize
        && owners.len() == names.len()
        && sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1
}

/// Per key, the first receipts of its events come in id order.
fn order_violations(received: &[Received]) -> Vec<String> {
    let mut seen: HashSet<String> = HashSet::new();
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut violations = Vec::new();
    for r in received.iter().filter(|r| r.accepted) {
        if !seen.insert(r.dedup_id.clone()) {
            continue;
        }
        let key = r.partition_key();
        let id = r.outbox_id.expect("an outbox id");
        if let Some(prev) = last.get(&key) {
            if *prev > id {
                violations.push(format!("key {key}: id {id} after id {prev}"));
            }
        }
        last.insert(key, id);
    }
    violations
}

/// Waits for the backlog to drain, then checks that the sink has every one of
/// the `n` events and that each key's first receipts came in id order.
async fn assert_drained_in_order(db: &TestDb, sink: &SinkHandle, n: usize) {
    assert!(
        wait_until(Duration::from_secs(120), || async {
            pending(db).await == 0
        })
        .await,
        "not drained; pending {}",
        pending(db).await
    );
    let delivered: HashSet<String> = sink.accepted().into_iter().map(|r| r.dedup_id).collect();
    let missing: Vec<String> = (0..n)
        .map(|i| format!("evt-{i}"))
        .filter(|k| !delivered.contains(k))
        .collect();
    assert!(missing.is_empty(), "lost: {missing:?}");
    let violations = order_violations(&sink.received());
    assert!(violations.is_empty(), "{violations:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_split_sixteen_shards_and_deliver_everything_in_order() {
    let (db, sink) = backlog(6000, 300, 5).await;
    let names = ["a", "b", "c"];
    let mut replicas = start_split(&db, &sink, &names, "10s", "1s", 0).await;
    for r in &replicas {
        // The database has the leases as soon as the acquiring statement
        // commits; the replica sets its gauge when that statement has
        // answered, a moment later (longer on a busy machine).
        let owned = || async { r.metric("outbox_relay_shards_owned").await.unwrap_or(-1.0) };
        let settled = wait_until(Duration::from_secs(10), || async {
            (5.0..=6.0).contains(&owned().await)
        })
        .await;
        assert!(settled, "{}: shards_owned {}", r.name, owned().await);
        let owned = owned().await;
        let acquired = r
            .metric("outbox_relay_shard_handovers_total")
            .await
            .unwrap_or(0.0);
        assert!(acquired >= owned, "{}: handovers {acquired}", r.name);
    }
    // `stats` shows the replicas and what each holds.
    let out = common::cli_ok(&db, &["stats", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let listed: Vec<(String, usize, bool)> = json["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["replica"].as_str().unwrap().to_owned(),
                r["shards"].as_array().unwrap().len(),
                r["alive"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(listed.len(), 3, "{listed:?}");
    for (name, shards, alive) in &listed {
        assert!(names.contains(&name.as_str()) && *alive, "{listed:?}");
        assert!((5..=6).contains(shards), "{listed:?}");
    }
    let text = common::cli(&db, &["stats"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("replica") && text.contains("every shard is held"),
        "{text}"
    );
    assert_drained_in_order(&db, &sink, 6000).await;
    // SIGTERM hands the shards over: the others take them at once, and the
    // last one gives everything back.
    replicas[0].stop().await;
    wait_split(&db, &["b", "c"], Duration::from_secs(10)).await;
    for r in &mut replicas[1..] {
        r.stop().await;
    }
    assert!(owners(&db).await.is_empty(), "leases left behind");
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox_relay_replicas").await,
        0,
        "replicas left the list"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_shards_move_after_one_lease_and_nothing_is_lost() {
    let (db, sink) = backlog(6000, 300, 20).await;
    let names = ["a", "b", "c"];
    let mut replicas = start_split(&db, &sink, &names, "4s", "1s", 500).await;
    let victim_shards = owners(&db).await.remove("b").unwrap();
    replicas[1].signal(Signal::SIGKILL);
    replicas[1]
        .process
        .exit_within(Duration::from_secs(5))
        .await
        .unwrap();
    let killed_at = Instant::now();
    // What may arrive twice: rows of its shards that it had sent but not
    // marked when it died. A claim writes nothing, so the rows it had read
    // and not sent are simply read again by the new owner. What it sent is
    // told by time, not by a snapshot of the sink now: requests it had
    // written may still sit in the sink's socket buffers and be read after
    // its exit (a snapshot here once missed 20 such rows and called their
    // second delivery unexplained). Until its shard leases end no other
    // replica sends its shards' rows, so a row of theirs the sink first saw
    // before then came from the dead one.
    let client = db.client().await.unwrap();
    let before_read = Instant::now();
    let leases_left: f64 = client
        .query_one(
            "SELECT extract(epoch FROM min(lease_until) - now())::float8
             FROM outbox_relay_shard_leases WHERE shard = ANY($1)",
            &[&victim_shards],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        leases_left > 0.0,
        "its leases ended before the kill was seen"
    );
    let handover = before_read + Duration::from_secs_f64(leases_left);
    let pending_at_kill: HashSet<String> = client
        .query(
            "SELECT idempotency_key FROM outbox o JOIN outbox_relay_shard_leases l
               ON o.bucket >= l.bucket_lo AND o.bucket < l.bucket_hi
             WHERE l.shard = ANY($1)
             AND published_at IS NULL AND dead_lettered_at IS NULL",
            &[&victim_shards],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect();
    assert!(pending(&db).await > 0, "the kill came too late");
    wait_split(&db, &["a", "c"], Duration::from_secs(15)).await;
    // Not before its lease (2 s) could have ended.
    assert!(killed_at.elapsed() >= Duration::from_millis(1000));
    assert_drained_in_order(&db, &sink, 6000).await;
    let mut first_seen: HashMap<String, Instant> = HashMap::new();
    for r in sink.received() {
        let at = first_seen.entry(r.dedup_id).or_insert(r.at);
        *at = (*at).min(r.at);
    }
    let in_flight_at_kill = |k: &String| {
        pending_at_kill.contains(k) && first_seen.get(k).is_some_and(|&at| at < handover)
    };
    let mut times: HashMap<String, usize> = HashMap::new();
    for r in sink.accepted() {
        *times.entry(r.dedup_id).or_default() += 1;
    }
    let unexplained: Vec<_> = times
        .iter()
        .filter(|(k, n)| **n > 1 && !in_flight_at_kill(k))
        .collect();
    assert!(
        unexplained.is_empty(),
        "duplicates not sent and unmarked at the kill: {unexplained:?}"
    );
    for i in [0, 2] {
        replicas[i].stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_paused_past_its_lease_has_its_late_marks_refused() {
    // A sink slow enough that the paused replica has requests in flight.
    let (db, sink) = backlog(3000, 300, 300).await;
    let names = ["a", "b", "c"];
    // The shard leases (2 s) do not outlast the pause: only the shard's
    // fencing token can refuse the paused replica's marks.
    let mut replicas = start_split(&db, &sink, &names, "20s", "2s", 200).await;
    // It has rows out when it stops (the sink answers after 300 ms).
    assert!(
        wait_until(Duration::from_secs(15), || async {
            replicas[1]
                .metric("outbox_relay_in_flight")
                .await
                .unwrap_or(0.0)
                > 0.0
        })
        .await,
        "the replica to pause had nothing in flight"
    );
    replicas[1].signal(Signal::SIGSTOP);
    wait_split(&db, &["a", "c"], Duration::from_secs(15)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    replicas[1].signal(Signal::SIGCONT);
    // Its answers come in now; the database refuses what it tries to mark.
    assert!(
        wait_until(Duration::from_secs(15), || async {
            replicas[1]
                .metric("outbox_relay_marks_fenced_total")
                .await
                .unwrap_or(0.0)
                > 0.0
        })
        .await,
        "no mark of the paused replica was refused"
    );
    assert_drained_in_order(&db, &sink, 3000).await;
    // Each row was written once, by whoever held its shard then: one
    // attempt each (the sink accepts everything; a refused mark writes
    // nothing, and the new owner's delivery of the same row is its first
    // recorded attempt).
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox WHERE attempt_count <> 1").await,
        0
    );
    for r in &mut replicas {
        r.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_joining_mid_drain_takes_shards_without_a_pause_in_delivery() {
    let (db, sink) = backlog(8000, 400, 20).await;
    let mut replicas = start_split(&db, &sink, &["a", "b"], "10s", "1s", 300).await;
    let joined_at = Instant::now();
    replicas.push(Replica::start(&db, &sink, "c", "10s", "1s"));
    wait_split(&db, &["a", "b", "c"], Duration::from_secs(15)).await;
    let split_at = Instant::now();
    assert!(pending(&db).await > 0, "drained before the split");
    assert_drained_in_order(&db, &sink, 8000).await;
    // Delivery went on while shards moved: no gap of two seconds or more
    // between receipts from the join until the split was done (the shards
    // that moved were handed over, not left to expire: a lease is 2 s, and
    // the other shards never stopped).
    let mut times: Vec<Instant> = sink
        .accepted()
        .iter()
        .map(|r| r.at)
        .filter(|t| *t >= joined_at && *t <= split_at)
        .collect();
    times.sort();
    let longest = times
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    assert!(
        !times.is_empty(),
        "nothing delivered while the shards moved"
    );
    assert!(
        longest < Duration::from_secs(2),
        "delivery paused for {longest:?}"
    );
    for r in &mut replicas {
        r.stop().await;
    }
}

/// The relay's claim and mark statements, run by hand on one shard.
struct ByHand {
    store: Store,
    shard: ShardId,
}

impl ByHand {
    /// Up to 10 rows under `token`; `(id, attempt count read)` each.
    async fn claim(&self, token: i64) -> Vec<(i64, i32)> {
        let fence = Fence {
            shard: self.shard,
            token,
        };
        let scope = ClaimScope {
            fence,
            routes: &[],
            out: &[],
        };
        self.store
            .session()
            .claim_due(&scope, no_cursor(), 10)
            .await
            .unwrap()
            .iter()
            .map(|c| (c.row.id, c.held(fence).attempt))
            .collect()
    }

    /// Marks `rows` published under `token`; how many the database took.
    async fn publish(&self, rows: &[(i64, i32)], token: i64) -> usize {
        let fence = Fence {
            shard: self.shard,
            token,
        };
        let marks: Vec<(Held, Write)> = rows
            .iter()
            .map(|&(id, attempt)| (Held { id, attempt, fence }, Write::Published))
            .collect();
        let written = self.store.session().mark(&marks).await;
        assert!(written.error.is_none(), "{:?}", written.error);
        written.applied.len()
    }

    async fn seize(&self, owner: &str) -> i64 {
        self.store
            .seize_shard(self.shard, owner, Duration::from_secs(60))
            .await
            .unwrap()
            .token
    }
}

/// The fencing itself: a claim or mark under a token that is no longer the
/// shard's changes no row.
#[tokio::test]
async fn claims_and_marks_under_a_superseded_token_change_no_row() {
    let db = common::test_db().await;
    insert_events(&db, 200, 1).await; // one key: one shard
    let client = db.client().await.unwrap();
    let shard: i16 = client
        .query_one(
            "SELECT DISTINCT l.shard FROM outbox o JOIN outbox_relay_shard_leases l
               ON o.bucket >= l.bucket_lo AND o.bucket < l.bucket_hi",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // One connection: the claims below run on the one whose setting is checked.
    let store = Store::open(&db.url, 1, Duration::from_secs(5)).unwrap();
    store
        .conn()
        .await
        .unwrap()
        .batch_execute("SET synchronous_commit = on")
        .await
        .unwrap();
    let by_hand = ByHand {
        store,
        shard: ShardId::new(shard as u32),
    };
    let old = by_hand.seize("old").await;
    let claimed = by_hand.claim(old).await;
    assert_eq!(claimed.len(), 10);
    // The claim committed without waiting for its WAL flush, and left the
    // session's setting alone (it is set for the claim's transaction only).
    let setting: String = by_hand
        .store
        .conn()
        .await
        .unwrap()
        .query_one("SHOW synchronous_commit", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(setting, "on");

    // Another replica takes the shard (its lease ended, say).
    let new = by_hand.seize("new").await;
    assert!(new > old, "tokens increase");
    assert_eq!(
        by_hand.publish(&claimed, old).await,
        0,
        "a mark under the old token was applied"
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"
        )
        .await,
        0
    );
    assert!(
        by_hand.claim(old).await.is_empty(),
        "a claim under the old token read rows"
    );
    // A claim writes nothing on the rows it reads.
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE locked_until IS NOT NULL OR attempt_count > 0"
        )
        .await,
        0,
        "a claim wrote on its rows"
    );

    // The new owner's claims and marks work.
    assert_eq!(by_hand.publish(&claimed, new).await, claimed.len());
    let fresh = by_hand.claim(new).await;
    assert_eq!(fresh.len(), 10);

    // A lease that ended refuses its own owner's writes too.
    client
        .execute(
            "UPDATE outbox_relay_shard_leases SET lease_until = now() - interval '1 second' WHERE shard = $1",
            &[&shard],
        )
        .await
        .unwrap();
    assert_eq!(
        by_hand.publish(&fresh, new).await,
        0,
        "a mark after the lease ended was applied"
    );
    assert!(by_hand.claim(new).await.is_empty());
}
