//! Observability of the `outbox-relay` binary: what `/metrics` says agrees with
//! the database, `/readyz` follows a delivery stall and its recovery, and the
//! JSON logs keep secrets out and warn once per dead letter.
//!
//! Every test runs the real binary (so the global metrics recorder is
//! installed) against a fresh database and the test sink, and scrapes it over
//! plain HTTP/1.1 on loopback.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{count, event, insert_events, pending, wait_until};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use outbox_client::{enqueue_many, NewEvent};
use outbox_relay::metrics::names;
use outbox_testkit::sink::{Received, Reply, Sink, SinkConfig, SinkHandle};
use outbox_testkit::TestDb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

// ---------------------------------------------------------------------------
// The relay process

/// What varies between the tests' configs.
struct Settings {
    token: String,
    current_signing_key: String,
    next_signing_key: String,
    mode: &'static str,
    max_attempts: u32,
    /// `[[routes]]` tables, `{sink}` replaced by the sink's URL.
    routes: String,
    with_callback: bool,
}

impl Settings {
    fn new(max_attempts: u32) -> Settings {
        Settings {
            token: common::TOKEN.to_owned(),
            current_signing_key: String::new(),
            next_signing_key: String::new(),
            mode: "single",
            max_attempts,
            routes: ORDER_ROUTE.to_owned(),
            with_callback: false,
        }
    }

    fn toml(
        &self,
        db: &TestDb,
        sink: &SinkHandle,
        metrics: SocketAddr,
        callback: SocketAddr,
    ) -> String {
        let callback_bind = if self.with_callback {
            format!("callback_bind = \"{callback}\"")
        } else {
            String::new()
        };
        let overrides = format!(
            r#"
            [relay]
            shards = 8
            claim_batch = 50
            max_in_flight = 500
            shard_lease = "10s"
            max_attempts = {max_attempts}
            [qstash]
            token = "{token}"
            current_signing_key = "{current}"
            next_signing_key = "{next}"
            mode = "{mode}"
            [server]
            metrics_bind = "{metrics}"
            {callback_bind}
            stats_interval = "200ms"
            ready_max_pending_age = "1s"
            "#,
            max_attempts = self.max_attempts,
            token = self.token,
            current = self.current_signing_key,
            next = self.next_signing_key,
            mode = self.mode,
        );
        common::config_toml_with(
            db,
            &sink.url(),
            &overrides,
            &self.routes.replace("{sink}", &sink.url()),
        )
    }
}

/// Everything of type `order.*` through QStash; nothing else is routed.
const ORDER_ROUTE: &str = r#"
[[routes]]
event_type = "order.*"
destination = "http://127.0.0.1:9/hook/{event_type}"
"#;

struct RelayProcess {
    child: Child,
    metrics: SocketAddr,
    stderr: tempfile::NamedTempFile,
    _config: tempfile::NamedTempFile,
}

/// A port nobody listened on a moment ago (the relay may still lose a race
/// for it; [`RelayProcess::start`] then tries another).
fn free_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

impl RelayProcess {
    /// Starts `outbox-relay [args] run` and waits until `/healthz` answers.
    async fn start(
        db: &TestDb,
        sink: &SinkHandle,
        settings: &Settings,
        args: &[&str],
        log: &str,
    ) -> RelayProcess {
        let mut last_failure = String::new();
        for _ in 0..5 {
            let metrics = free_port();
            let callback = free_port();
            let config = tempfile::NamedTempFile::new().unwrap();
            std::fs::write(config.path(), settings.toml(db, sink, metrics, callback)).unwrap();
            let stderr = tempfile::NamedTempFile::new().unwrap();
            let child = Command::new(BIN)
                .args(args)
                .arg("run")
                .arg("--config")
                .arg(config.path())
                .env("OUTBOX_RELAY_LOG", log)
                .env_remove("OUTBOX_RELAY_LOG_FORMAT")
                .env_remove("DATABASE_URL")
                .env_remove("QSTASH_URL")
                .env_remove("QSTASH_TOKEN")
                .env_remove("QSTASH_CURRENT_SIGNING_KEY")
                .env_remove("QSTASH_NEXT_SIGNING_KEY")
                .stdout(Stdio::null())
                .stderr(stderr.reopen().unwrap())
                .spawn()
                .unwrap();
            let mut relay = RelayProcess {
                child,
                metrics,
                stderr,
                _config: config,
            };
            let poll = Poll::new(Duration::from_secs(30));
            loop {
                if relay.exited() {
                    break;
                }
                if get(metrics, "/healthz")
                    .await
                    .is_some_and(|r| r.status == 200)
                {
                    return relay;
                }
                assert!(
                    poll.again().await,
                    "the relay did not answer /healthz:\n{}",
                    relay.log()
                );
            }
            last_failure = relay.log();
            // Only a lost race for a port is worth another try.
            assert!(
                last_failure.contains("_bind"),
                "the relay did not start:\n{last_failure}"
            );
        }
        panic!("no free port after 5 tries:\n{last_failure}");
    }

    fn exited(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }

    /// What the relay wrote to stderr so far.
    fn log(&self) -> String {
        std::fs::read_to_string(self.stderr.path()).unwrap()
    }

    /// SIGTERM, then waits (bounded) for a clean exit.
    async fn stop(&mut self) {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM).unwrap();
        let poll = Poll::new(Duration::from_secs(15));
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                poll.again().await,
                "the relay did not stop within 15 s of SIGTERM"
            );
        };
        assert!(status.success(), "{status:?}\n{}", self.log());
    }

    async fn scrape(&self) -> Metrics {
        let r = get(self.metrics, "/metrics")
            .await
            .expect("/metrics answers");
        assert_eq!(r.status, 200, "{}", r.body);
        Metrics::parse(&r.body)
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A deadline for polling loops that keep state between rounds (where
/// `common::wait_until`'s closure cannot lend it out).
struct Poll {
    deadline: tokio::time::Instant,
}

impl Poll {
    fn new(limit: Duration) -> Poll {
        Poll {
            deadline: tokio::time::Instant::now() + limit,
        }
    }

    /// Waits a moment before the next round; false once the deadline passed.
    async fn again(&self) -> bool {
        if tokio::time::Instant::now() >= self.deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
        true
    }
}

// ---------------------------------------------------------------------------
// HTTP/1.1 by hand (no client in the dev-dependencies, and a malformed
// request needs a raw socket anyway)

#[derive(Debug)]
struct HttpReply {
    status: u16,
    body: String,
}

async fn get(addr: SocketAddr, path: &str) -> Option<HttpReply> {
    request(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
}

/// Sends `raw` and reads the answer until the server closes; `None` when the
/// connection fails or the answer is not HTTP.
async fn request(addr: SocketAddr, raw: &[u8]) -> Option<HttpReply> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        stream.write_all(raw).await.ok()?;
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await.ok()?;
        let text = String::from_utf8(buf).ok()?;
        let (head, body) = text.split_once("\r\n\r\n")?;
        let status = head
            .lines()
            .next()?
            .strip_prefix("HTTP/1.1 ")?
            .get(..3)?
            .parse()
            .ok()?;
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)?
        } else {
            body.to_owned()
        };
        Some(HttpReply { status, body })
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .ok()
        .flatten()
}

fn dechunk(mut s: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n")?;
        let size = usize::from_str_radix(size.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..size)?);
        s = rest.get(size + 2..)?;
    }
}

// ---------------------------------------------------------------------------
// Prometheus text format: `name{label="value",…} value`

#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

#[derive(Debug)]
struct Metrics {
    samples: Vec<Sample>,
    /// `# TYPE name kind`
    types: HashMap<String, String>,
}

impl Metrics {
    fn parse(text: &str) -> Metrics {
        let mut samples = Vec::new();
        let mut types = HashMap::new();
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
                types.insert(name.to_owned(), kind.to_owned());
                continue;
            }
            if line.starts_with('#') {
                continue;
            }
            samples.push(parse_sample(line).unwrap_or_else(|| panic!("bad line `{line}`")));
        }
        Metrics { samples, types }
    }

    /// The samples of `name` whose labels include every pair of `filter`.
    fn select<'a>(
        &'a self,
        name: &'a str,
        filter: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && filter
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
    }

    /// Sum over the series of `name` matching `filter`; 0 when there are none.
    fn sum(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        self.select(name, filter).map(|s| s.value).sum()
    }

    /// The one unlabelled value of `name`, if exported.
    fn value(&self, name: &str) -> Option<f64> {
        let mut it = self.select(name, &[]).filter(|s| s.labels.is_empty());
        let v = it.next().map(|s| s.value);
        assert!(it.next().is_none(), "{name} has several unlabelled series");
        v
    }

    /// Label sets of `name`, as `k=v,k=v` strings.
    fn label_keys(&self, name: &str) -> BTreeSet<Vec<String>> {
        self.select(name, &[])
            .map(|s| s.labels.keys().cloned().collect())
            .collect()
    }
}

fn parse_sample(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_owned();
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(mut inner) = rest.strip_prefix('{') {
        // `key="value"` pairs separated by commas, up to the closing brace.
        loop {
            inner = inner.trim_start_matches(',').trim_start();
            if let Some(after) = inner.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, after_eq) = inner.split_once('=')?;
            let mut chars = after_eq.strip_prefix('"')?.char_indices();
            let mut value = String::new();
            let end = loop {
                match chars.next()? {
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    (i, '"') => break i,
                    (_, c) => value.push(c),
                }
            };
            labels.insert(key.trim().to_owned(), value);
            inner = &after_eq[1 + end + 1..];
            if !(inner.starts_with(',') || inner.starts_with('}')) {
                return None;
            }
        }
    }
    let mut fields = rest.split_whitespace();
    let value = match fields.next()? {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

#[test]
fn the_prometheus_parser_reads_labels_escapes_and_plain_values() {
    let m = Metrics::parse(
        "# HELP a_total A.\n# TYPE a_total counter\n\
         a_total{route=\"order.*#0\",reason=\"x\\\"y\"} 3\n\
         a_total{route=\"b\",reason=\"z\"} 4\n\
         g 1.5\n\
         h_bucket{le=\"+Inf\"} 7\n",
    );
    assert_eq!(m.types["a_total"], "counter");
    assert_eq!(m.sum("a_total", &[]), 7.0);
    assert_eq!(m.sum("a_total", &[("reason", "x\"y")]), 3.0);
    assert_eq!(m.sum("a_total", &[("route", "order.*#0")]), 3.0);
    assert_eq!(m.value("g"), Some(1.5));
    assert_eq!(m.sum("h_bucket", &[("le", "+Inf")]), 7.0);
    assert!(parse_sample("broken{le=\"1\" 3").is_none());
}

// ---------------------------------------------------------------------------
// Helpers on the database

async fn insert(db: &TestDb, events: &[NewEvent]) {
    let mut client = db.client().await.unwrap();
    let tx = client.transaction().await.unwrap();
    enqueue_many(&tx, events).await.unwrap();
    tx.commit().await.unwrap();
}

/// `evt-17` → 17.
fn number(dedup_id: &str) -> Option<usize> {
    dedup_id.strip_prefix("evt-")?.parse().ok()
}

async fn ids(db: &TestDb, sql: &str) -> BTreeSet<i64> {
    common::column(&db.client().await.unwrap(), sql).await
}

// ---------------------------------------------------------------------------
// /metrics against the database

const REJECTED: &[usize] = &[5, 42, 79, 116];
const EXHAUSTED: &[usize] = &[7, 17, 27];
const METRICS_MAX_ATTEMPTS: u32 = 4;

/// What the sink answers to event `n` on its `attempt`-th arrival (0 first).
fn metrics_rule(n: usize, attempt: u32) -> Reply {
    if REJECTED.contains(&n) {
        return Reply::Status(400, None);
    }
    // Exhausted ones fail every time; others fail their first attempt(s).
    let fails = EXHAUSTED.contains(&n) || attempt < [1, 2, 1].get(n % 10).copied().unwrap_or(0);
    match (fails, n % 10) {
        (false, _) => Reply::Accept,
        (true, 1) => Reply::Status(500, None),
        (true, 2) => Reply::Status(429, None),
        (true, _) => Reply::Status(503, None),
    }
}

fn rule_for(r: &Received) -> Reply {
    number(&r.dedup_id)
        .map(|n| metrics_rule(n, r.attempt))
        .unwrap_or(Reply::Accept)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_agree_with_the_database_after_retries_and_dead_letters() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_rule(rule_for);
    const EVENTS: usize = 300;
    insert_events(&db, EVENTS, 30).await;
    // Two events no route takes, and four scheduled an hour ahead (they stay
    // pending, so the backlog gauge has something to show).
    let mut extra = Vec::new();
    for i in 0..2 {
        let mut e = event(EVENTS + i, "misc:m");
        e.event_type = "misc.unrouted".into();
        extra.push(e);
    }
    for i in 0..4 {
        let mut e = event(EVENTS + 10 + i, "order:later");
        e.available_at = Some(chrono::Utc::now() + chrono::Duration::hours(1));
        extra.push(e);
    }
    insert(&db, &extra).await;

    let relay = RelayProcess::start(
        &db,
        &sink,
        &Settings::new(METRICS_MAX_ATTEMPTS),
        &[],
        "warn",
    )
    .await;
    assert!(
        wait_until(Duration::from_secs(90), || async {
            pending(&db).await == 4
        })
        .await,
        "the relay did not drain: {} pending",
        pending(&db).await
    );

    // What the database says.
    let published = count(
        &db,
        "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
    )
    .await;
    let dead = count(
        &db,
        "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL",
    )
    .await;
    let dead_rejected = count(
        &db,
        "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL AND last_error LIKE 'HTTP 400%'",
    )
    .await;
    let dead_exhausted = count(
        &db,
        "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL AND last_error LIKE 'attempt % of % failed%'",
    )
    .await;
    let dead_no_route = count(
        &db,
        "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL AND last_error LIKE 'no route matches%'",
    )
    .await;
    let backlog = pending(&db).await;
    // Every claim but the last of a finished row was followed by a retry.
    let retried_by_db = count(
        &db,
        "SELECT coalesce(sum(attempt_count - 1), 0)::int8 FROM outbox
         WHERE published_at IS NOT NULL OR dead_lettered_at IS NOT NULL",
    )
    .await;
    let claimed_rows = count(
        &db,
        "SELECT coalesce(sum(attempt_count), 0)::int8 FROM outbox",
    )
    .await;
    // The scenario did what it was meant to (else the comparisons prove little).
    assert_eq!(
        published as usize,
        EVENTS - REJECTED.len() - EXHAUSTED.len()
    );
    assert_eq!(dead_rejected as usize, REJECTED.len());
    assert_eq!(dead_exhausted as usize, EXHAUSTED.len());
    assert_eq!(dead_no_route, 2);
    assert_eq!(dead, dead_rejected + dead_exhausted + dead_no_route);

    // What the sink saw: in single mode one message is one attempt, and the
    // answer is the rule's, so the failed attempts that were not the last
    // allowed one are the retries, split by the answer's status.
    let received = sink.received();
    let mut retried_503_500 = 0;
    let mut retried_429 = 0;
    for r in &received {
        if r.attempt + 1 >= METRICS_MAX_ATTEMPTS {
            continue; // the last allowed attempt dead-letters instead
        }
        match rule_for(r) {
            Reply::Status(429, _) => retried_429 += 1,
            Reply::Status(s, _) if s >= 500 => retried_503_500 += 1,
            _ => {}
        }
    }
    let retried_by_sink = retried_503_500 + retried_429;
    assert_eq!(
        retried_by_sink, retried_by_db,
        "the sink's log and the database disagree on retries"
    );
    assert_eq!(
        sink.accepted().len() as i64,
        published,
        "published twice or lost"
    );

    // The counters are incremented just after the marks commit: poll.
    let expect_counters = |m: &Metrics| {
        m.sum(names::EVENTS_PUBLISHED_TOTAL, &[]) == published as f64
            && m.sum(names::EVENTS_DEAD_LETTERED_TOTAL, &[]) == dead as f64
            && m.sum(names::EVENTS_RETRIED_TOTAL, &[]) == retried_by_db as f64
    };
    // The gauges are sampled every stats_interval (200 ms): poll.
    let expect_gauges = |m: &Metrics| {
        m.value(names::BACKLOG) == Some(backlog as f64)
            && m.value(names::DEAD_LETTERS) == Some(dead as f64)
    };
    let poll = Poll::new(Duration::from_secs(20));
    let (settled, m) = loop {
        let m = relay.scrape().await;
        if expect_counters(&m) && expect_gauges(&m) {
            break (true, m);
        }
        if !poll.again().await {
            break (false, m);
        }
    };
    let show = |name: &str| -> Vec<String> {
        m.select(name, &[])
            .map(|s| format!("{:?} {}", s.labels, s.value))
            .collect()
    };
    assert!(
        settled,
        "metrics never matched the database (published {published}, dead {dead}, retried {retried_by_db}, backlog {backlog}):\n\
         published {:?}\ndead {:?}\nretried {:?}\nbacklog {:?} dead_letters {:?}",
        show(names::EVENTS_PUBLISHED_TOTAL),
        show(names::EVENTS_DEAD_LETTERED_TOTAL),
        show(names::EVENTS_RETRIED_TOTAL),
        m.value(names::BACKLOG),
        m.value(names::DEAD_LETTERS),
    );

    // Labels: the route (or `none` when no route took it) and the reason.
    let route = "order.*#0";
    assert_eq!(
        m.sum(names::EVENTS_PUBLISHED_TOTAL, &[("route", route)]),
        published as f64
    );
    for (reason, expected, route) in [
        ("rejected", dead_rejected, route),
        ("exhausted", dead_exhausted, route),
        ("no_route", dead_no_route, "none"),
    ] {
        assert_eq!(
            m.sum(
                names::EVENTS_DEAD_LETTERED_TOTAL,
                &[("reason", reason), ("route", route)]
            ),
            expected as f64,
            "dead letters with reason {reason}: {:?}",
            show(names::EVENTS_DEAD_LETTERED_TOTAL)
        );
    }
    assert_eq!(
        m.sum(
            names::EVENTS_RETRIED_TOTAL,
            &[("reason", "server_error"), ("route", route)]
        ),
        retried_503_500 as f64
    );
    assert_eq!(
        m.sum(
            names::EVENTS_RETRIED_TOTAL,
            &[("reason", "rate_limited"), ("route", route)]
        ),
        retried_429 as f64
    );
    let route_reason = BTreeSet::from([vec!["reason".to_owned(), "route".to_owned()]]);
    assert_eq!(m.label_keys(names::EVENTS_RETRIED_TOTAL), route_reason);
    assert_eq!(
        m.label_keys(names::EVENTS_DEAD_LETTERED_TOTAL),
        route_reason
    );
    assert_eq!(
        m.label_keys(names::EVENTS_PUBLISHED_TOTAL),
        BTreeSet::from([vec!["route".to_owned()]])
    );

    // Histograms. One publish request per message in single mode; every
    // claim recorded its size, so the sizes add up to the claims the database
    // counted in attempt_count and the rows deferred without counting one (a
    // refusal waits for a witness once; nothing was released: the relay is
    // running).
    let requests = sink.requests().len() as f64;
    assert_eq!(
        m.sum(
            &format!("{}_count", names::PUBLISH_DURATION_SECONDS),
            &[("sink", "qstash_publish")]
        ),
        requests
    );
    assert_eq!(
        m.label_keys(&format!("{}_count", names::PUBLISH_DURATION_SECONDS)),
        BTreeSet::from([vec!["sink".to_owned()]])
    );
    let batch_count = m.sum(&format!("{}_count", names::BATCH_SIZE), &[]);
    assert!(batch_count > 0.0);
    assert_eq!(
        m.sum(&format!("{}_sum", names::BATCH_SIZE), &[]),
        claimed_rows as f64 + m.sum(names::EVENTS_DEFERRED_TOTAL, &[])
    );
    // Every claim statement counts once, empty or not; only non-empty claims
    // are batch_size observations.
    assert!(m.value(names::CLAIMS_TOTAL).unwrap() >= batch_count);
    assert_eq!(
        m.sum(&format!("{}_count", names::COMMIT_TO_ACK_SECONDS), &[]),
        published as f64
    );
    for h in names::HISTOGRAMS {
        assert_eq!(
            m.types.get(*h).map(String::as_str),
            Some("histogram"),
            "{h}"
        );
        assert!(
            m.sum(&format!("{h}_bucket"), &[("le", "+Inf")]) > 0.0,
            "{h} has no +Inf bucket"
        );
    }
    assert_eq!(m.value(names::IN_FLIGHT), Some(0.0));
    assert_eq!(m.value(names::FLAPPING), Some(0.0));
    assert_eq!(m.value(names::STUCK_LEASES), Some(0.0));
    assert!(m.value(names::OLDEST_PENDING_AGE_SECONDS).is_some());
    assert!(m.value(names::OUTBOX_DEAD_TUPLES).is_some());

    // Nothing exported under our prefix is missing from the list of record,
    // and every name on the list was exported (those never incremented in
    // this run at 0).
    for s in &m.samples {
        if s.name.starts_with("outbox_relay_") {
            assert!(
                common::is_known_series(&s.name),
                "{} is exported but not in metric_names",
                s.name
            );
        }
    }
    for name in names::METRIC_NAMES {
        let exported = m.samples.iter().any(|s| {
            s.name == *name
                || (names::HISTOGRAMS.contains(name) && s.name == format!("{name}_count"))
        });
        assert!(exported, "{name} is not exported");
    }
    for (name, kind) in [
        (names::EVENTS_PUBLISHED_TOTAL, "counter"),
        (names::EVENTS_RETRIED_TOTAL, "counter"),
        (names::EVENTS_DEAD_LETTERED_TOTAL, "counter"),
        (names::CLAIMS_TOTAL, "counter"),
        (names::BACKLOG, "gauge"),
        (names::DEAD_LETTERS, "gauge"),
        (names::IN_FLIGHT, "gauge"),
    ] {
        assert_eq!(m.types.get(name).map(String::as_str), Some(kind), "{name}");
    }
}

/// Every metric is exported from start, before any event: a counter that
/// appears only at its first increment has no earlier sample, so
/// `increase()` (the dead-letter alert) misses that first increment.
/// Counters and histograms (at 0) and the process's gauges are in the first
/// scrape, with every label set known at start-up; the gauges read from the
/// database come with the first sample. Every series an alert rule names is
/// then exported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_is_exported_at_zero_before_any_event() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let relay = RelayProcess::start(&db, &sink, &Settings::new(5), &[], "warn").await;
    let first = relay.scrape().await;
    let from_db = [
        names::BACKLOG,
        names::OLDEST_PENDING_AGE_SECONDS,
        names::DEAD_LETTERS,
        names::FLAPPING,
        names::STUCK_LEASES,
        names::OUTBOX_DEAD_TUPLES,
    ];
    let series = |name: &str| {
        if names::HISTOGRAMS.contains(&name) {
            format!("{name}_count")
        } else {
            name.to_owned()
        }
    };
    let missing: Vec<&str> = names::METRIC_NAMES
        .iter()
        .copied()
        .filter(|n| !from_db.contains(n))
        .filter(|n| first.select(&series(n), &[]).next().is_none())
        .collect();
    assert!(missing.is_empty(), "not in the first scrape: {missing:?}");
    // Nothing happened yet: every delivery counter is at 0.
    for name in names::METRIC_NAMES.iter().filter(|n| n.ends_with("_total")) {
        if *name == names::SHARD_HANDOVERS_TOTAL || *name == names::CLAIMS_TOTAL {
            continue; // the coordinator may have taken shards and claimed already
        }
        assert_eq!(first.sum(name, &[]), 0.0, "{name}");
    }
    // Each label set an alert or a dashboard selects on, at 0.
    let route = "order.*#0";
    let expect = |name: &str, labels: &[(&str, &str)]| {
        assert!(
            first.select(name, labels).next().is_some(),
            "{name}{labels:?} is not exported"
        );
    };
    for reason in [
        "rejected",
        "too_large",
        "bad_destination",
        "exhausted",
        "unanswered",
    ] {
        expect(
            names::EVENTS_DEAD_LETTERED_TOTAL,
            &[("route", route), ("reason", reason)],
        );
    }
    expect(
        names::EVENTS_DEAD_LETTERED_TOTAL,
        &[("route", "none"), ("reason", "no_route")],
    );
    for reason in [
        "server_error",
        "rate_limited",
        "timeout",
        "connect",
        "network",
        "unauthorized",
        "batch_element",
        "redirect",
        "unreadable_answer",
    ] {
        expect(
            names::EVENTS_RETRIED_TOTAL,
            &[("route", route), ("reason", reason)],
        );
    }
    for cause in [
        "unauthorized",
        "rate_limited",
        "redirect",
        "connect",
        "failing",
    ] {
        expect(
            names::ROUTE_PAUSES_TOTAL,
            &[("route", route), ("cause", cause)],
        );
    }
    for cause in ["paused", "no_witness", "limited"] {
        expect(
            names::EVENTS_DEFERRED_TOTAL,
            &[("route", route), ("cause", cause)],
        );
    }
    for name in [
        names::EVENTS_PUBLISHED_TOTAL,
        names::EVENTS_HELD_TOTAL,
        names::ROUTE_PAUSED,
    ] {
        expect(name, &[("route", route)]);
    }
    for outcome in ["delivered", "retrying", "failed", "stale"] {
        expect(names::CALLBACKS_TOTAL, &[("outcome", outcome)]);
    }
    for kind in ["acquired", "released", "lost"] {
        expect(names::SHARD_HANDOVERS_TOTAL, &[("kind", kind)]);
    }
    for actor in ["marker", "publisher", "claimer", "listener", "coordinator"] {
        expect(names::ACTOR_RESTARTS_TOTAL, &[("actor", actor)]);
    }
    expect(
        &format!("{}_count", names::PUBLISH_DURATION_SECONDS),
        &[("sink", "qstash_batch")],
    );
    // The database's gauges, once the sampler has read it.
    let poll = Poll::new(Duration::from_secs(30));
    while readyz(&relay).await.1["reason"] == "not checked yet" {
        assert!(poll.again().await, "the sampler never ran");
    }
    let sampled = relay.scrape().await;
    for name in from_db {
        assert!(
            sampled.value(name).is_some(),
            "{name} after the first sample"
        );
    }
    // Every series the shipped alert rules name is exported.
    let rules: serde_norway::Value = serde_norway::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/config/prometheus/alerts.yml"
        ))
        .unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for group in rules["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            for name in common::our_series(rule["expr"].as_str().unwrap()) {
                assert!(
                    sampled.select(&name, &[]).next().is_some(),
                    "{}: {name} is not exported",
                    rule["alert"].as_str().unwrap()
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 10, "{checked} series");
    assert_eq!(pending(&db).await, 0, "no event was ever enqueued");
}

// ---------------------------------------------------------------------------
// /healthz and /readyz

async fn readyz(relay: &RelayProcess) -> (u16, serde_json::Value) {
    let r = get(relay.metrics, "/readyz")
        .await
        .expect("/readyz answers");
    let body = serde_json::from_str(&r.body)
        .unwrap_or_else(|e| panic!("/readyz body is not JSON ({e}): {}", r.body));
    (r.status, body)
}

async fn assert_healthy(relay: &RelayProcess) {
    let r = get(relay.metrics, "/healthz")
        .await
        .expect("/healthz answers");
    assert_eq!(r.status, 200, "/healthz: {r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_turns_unready_while_delivery_is_stalled_and_ready_after_recovery() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    // Never exhausted during the test, so nothing counts as delivered while
    // the sink is down.
    let relay = RelayProcess::start(&db, &sink, &Settings::new(10_000), &[], "warn").await;

    // Ready once the first sample is taken.
    let poll = Poll::new(Duration::from_secs(10));
    let last = loop {
        let last = readyz(&relay).await;
        if last.0 == 200 {
            break last;
        }
        assert!(poll.again().await, "never ready: {last:?}");
    };
    assert_eq!(last.1["ready"], true, "{last:?}");
    assert_eq!(last.1["database"], true, "{last:?}");
    assert_eq!(last.1["reason"], "ok", "{last:?}");
    assert_healthy(&relay).await;

    // Malformed requests get a 4xx and the server keeps serving.
    for (raw, expected) in [
        (
            "POST /readyz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            405,
        ),
        (
            "DELETE /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            405,
        ),
        (
            "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            404,
        ),
        (
            "GET /readyz/extra HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            404,
        ),
        ("NOT HTTP AT ALL\r\n\r\n", 400),
        ("GET /readyz HTTP/1.1\r\nHost x\r\n\r\n", 400),
    ] {
        let r = request(relay.metrics, raw.as_bytes())
            .await
            .unwrap_or_else(|| panic!("{raw:?}: no HTTP answer"));
        assert_eq!(r.status, expected, "{raw:?}: {r:?}");
    }
    assert_healthy(&relay).await;

    // The sink goes down: every publish fails and is retried.
    sink.set_rule(|_| Reply::Status(503, None));
    insert_events(&db, 20, 5).await;
    let poll = Poll::new(Duration::from_secs(30));
    let mut health_checks = 0;
    let last = loop {
        assert_healthy(&relay).await;
        health_checks += 1;
        let last = readyz(&relay).await;
        if last.0 == 503 {
            break last;
        }
        assert!(poll.again().await, "never unready while stalled: {last:?}");
    };
    // It was ready for a while with rows pending: not on the first look.
    assert!(health_checks > 1);
    let body = &last.1;
    assert_eq!(body["ready"], false, "{body}");
    assert_eq!(body["database"], true, "{body}");
    assert_eq!(body["delivered_since_last_check"], 0, "{body}");
    assert!(
        body["oldest_pending_age_seconds"].as_f64().unwrap() > 1.0,
        "{body}"
    );
    let reason = body["reason"].as_str().unwrap();
    assert!(
        reason.contains("oldest pending event") && reason.contains("nothing was delivered"),
        "{reason}"
    );
    // It was a stall: the relay kept trying and nothing got through.
    assert!(sink.received().len() >= 20, "the relay was not even trying");
    assert!(sink.accepted().is_empty());
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"
        )
        .await,
        0
    );

    // The sink recovers: delivery resumes, the backlog drains, ready again.
    sink.set_rule(|_| Reply::Accept);
    let poll = Poll::new(Duration::from_secs(30));
    let last = loop {
        assert_healthy(&relay).await;
        let last = readyz(&relay).await;
        if last.0 == 200 && pending(&db).await == 0 {
            break last;
        }
        assert!(poll.again().await, "not ready after recovery: {last:?}");
    };
    assert_eq!(last.1["ready"], true, "{last:?}");
    // Ready because delivery moved, then stays ready with nothing pending.
    let stays_ready = wait_until(Duration::from_secs(10), || async {
        let (status, body) = readyz(&relay).await;
        status == 200 && body["oldest_pending_age_seconds"] == 0.0
    })
    .await;
    assert!(stays_ready, "ready did not settle with an empty backlog");
    assert_healthy(&relay).await;
}

// ---------------------------------------------------------------------------
// Logs

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_hide_secrets_and_warn_once_per_dead_letter() {
    const TOKEN: &str = "qstash-token-Zq8vObsSecret41";
    const CURRENT: &str = "sig_current_Kp3ObsSecret77";
    const NEXT: &str = "sig_next_Wr6ObsSecret19";
    let db = common::test_db().await;
    let sink = Sink::start(SinkConfig::for_tests(TOKEN)).await.unwrap();
    sink.set_rule(|r| match number(&r.dedup_id) {
        Some(3 | 11 | 25) => Reply::Status(422, None),
        Some(8) => Reply::Status(502, None),
        Some(n) if n % 7 == 0 && r.attempt == 0 => Reply::Status(503, None),
        _ => Reply::Accept,
    });
    insert_events(&db, 60, 6).await;
    let mut unrouted = event(60, "misc:m");
    unrouted.event_type = "misc.unrouted".into();
    insert(&db, &[unrouted]).await;
    let mut settings = Settings::new(3);
    settings.token = TOKEN.into();
    settings.current_signing_key = CURRENT.into();
    settings.next_signing_key = NEXT.into();
    settings.with_callback = true;
    // debug: the most the relay would ever write.
    let mut relay =
        RelayProcess::start(&db, &sink, &settings, &["--log-format", "json"], "debug").await;
    assert!(
        wait_until(Duration::from_secs(60), || async {
            pending(&db).await == 0
        })
        .await,
        "the relay did not drain"
    );
    relay.stop().await;
    let log = relay.log();

    for secret in [TOKEN, CURRENT, NEXT] {
        assert!(!log.contains(secret), "a secret is in the log");
    }
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("not a JSON log line ({e}): {l}"));
            assert!(v.is_object(), "not a JSON object: {l}");
            assert!(v["level"].is_string() && v["timestamp"].is_string(), "{l}");
            v
        })
        .collect();
    // The config was logged, redacted (so the secrets were there to leak).
    let starting = lines
        .iter()
        .find(|l| l["message"] == "outbox-relay starting")
        .expect("the start line");
    let config = starting["config"].as_str().expect("config field");
    assert!(
        config.matches("<redacted>").count() >= 3,
        "token and both signing keys redacted: {config}"
    );

    // One warn line per dead letter, naming its row.
    let warned: Vec<i64> = lines
        .iter()
        .filter(|l| {
            l["level"] == "WARN"
                && l["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("dead letter"))
        })
        .map(|l| l["id"].as_i64().expect("dead letter line names the id"))
        .collect();
    let dead = ids(
        &db,
        "SELECT id FROM outbox WHERE dead_lettered_at IS NOT NULL",
    )
    .await;
    assert_eq!(dead.len(), 5, "3 rejected, 1 exhausted, 1 without a route");
    let mut warned_sorted = warned.clone();
    warned_sorted.sort_unstable();
    assert_eq!(
        warned_sorted,
        dead.iter().copied().collect::<Vec<_>>(),
        "dead letter warnings {warned:?} vs dead rows {dead:?}"
    );
}

/// An event scheduled for later (`available_at` ahead) is not late: it must
/// neither make the relay unready nor count as the oldest pending event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_event_is_not_lag() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let mut later = event(0, "order:later");
    later.available_at = Some(chrono::Utc::now() + chrono::Duration::hours(1));
    insert(&db, &[later]).await;
    let relay = RelayProcess::start(&db, &sink, &Settings::new(5), &[], "warn").await;
    // ready_max_pending_age is 1 s and the sampler runs every 200 ms: watch
    // until the row is three times that old by the database's clock.
    let age = || async {
        db.client()
            .await
            .unwrap()
            .query_one(
                "SELECT extract(epoch FROM now() - created_at)::float8 FROM outbox",
                &[],
            )
            .await
            .unwrap()
            .get::<_, f64>(0)
    };
    // Ready once the first sample is taken ...
    let poll = Poll::new(Duration::from_secs(10));
    while readyz(&relay).await.0 != 200 {
        assert!(
            poll.again().await,
            "never ready: {:?}",
            readyz(&relay).await
        );
    }
    // ... and stays ready.
    let poll = Poll::new(Duration::from_secs(30));
    while age().await < 3.0 {
        let (status, body) = readyz(&relay).await;
        assert_eq!(status, 200, "unready because of a scheduled event: {body}");
        assert!(poll.again().await);
    }
    let (status, body) = readyz(&relay).await;
    assert_eq!(status, 200, "{body}");
    let m = relay.scrape().await;
    assert_eq!(m.value(names::BACKLOG), Some(1.0), "it is still pending");
    assert_eq!(m.value(names::OLDEST_PENDING_AGE_SECONDS), Some(0.0));
    assert!(sink.received().is_empty(), "delivered before its time");
}

/// The age behind the gauge and `/readyz`, row kind by row kind.
#[tokio::test]
async fn the_oldest_pending_age_counts_from_when_a_row_became_deliverable() {
    use outbox_relay::store::stats::snapshot;
    let db = common::test_db().await;
    let client = db.client().await.unwrap();
    // created, available (both seconds from now), attempt_count
    let row = |key: &str, created: f64, available: f64, attempts: i32| {
        let client = &client;
        let key = key.to_owned();
        async move {
            client
                .query_one(
                    "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload,
                                         idempotency_key, created_at, available_at, attempt_count)
                     VALUES (gen_random_uuid(), 'order', $1, 'order.placed', '{}', $1,
                             now() + make_interval(secs => $2), now() + make_interval(secs => $3), $4)
                     RETURNING id",
                    &[&key, &created, &available, &attempts],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    let age = || async { snapshot(&client).await.unwrap().oldest_pending_age_seconds };
    // Scheduled an hour ahead ten minutes ago, never tried: not late at all.
    row("scheduled", -600.0, 3600.0, 0).await;
    assert_eq!(age().await, 0.0);
    // Replayed a minute ago (a day-old dead letter): late by a minute.
    let replayed = row("replayed", -86_400.0, -60.0, 0).await;
    assert!((60.0..90.0).contains(&age().await), "{}", age().await);
    // Failed twice and backing off: late since it was created.
    let failing = row("failing", -300.0, 30.0, 2).await;
    assert!((300.0..330.0).contains(&age().await), "{}", age().await);
    client
        .execute(
            "UPDATE outbox SET published_at = now() WHERE id = ANY($1)",
            &[&vec![replayed, failing]],
        )
        .await
        .unwrap();
    let snap = snapshot(&client).await.unwrap();
    assert_eq!((snap.backlog, snap.oldest_pending_age_seconds), (1, 0.0));
}

/// Every `outbox-relay …` command an alert tells the on-call person to run
/// exists with those flags (placeholders `ID` and `T` filled in).
#[test]
fn the_commands_in_the_alert_rules_parse() {
    let rules = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/config/prometheus/alerts.yml"
    ))
    .unwrap();
    let commands: Vec<&str> = rules
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| s.starts_with("outbox-relay "))
        .collect();
    assert!(
        commands
            .iter()
            .any(|c| c.starts_with("outbox-relay dlq list")),
        "{commands:?}"
    );
    for command in commands {
        let args: Vec<&str> = command
            .split_whitespace()
            .skip(1)
            .map(|a| match a {
                "ID" => "1",
                "T" => "order.placed",
                a => a,
            })
            .collect();
        let out = Command::new(BIN)
            .args(&args)
            .arg("--help")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "`{command}`: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The operations guide and the README's metrics section name every metric.
#[test]
fn every_metric_is_documented() {
    for doc in ["docs/operations.md", "README.md"] {
        let text =
            std::fs::read_to_string(format!("{}/{doc}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        for name in names::METRIC_NAMES {
            assert!(
                text.contains(&format!("| `{name}` |")),
                "{doc} has no table row for {name}"
            );
        }
    }
}
