//! What a run measured: throughput (overall and per second), end-to-end
//! latency from a row's `created_at` to its first receipt at the sink
//! (HdrHistogram), relay CPU and memory, database dead tuples, retries and
//! dead letters. Printed as a table, written as JSON, drawn as SVG.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::Path;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::adversarial::AdversarialReport;
use crate::environment::RunEnvironment;
use crate::metrics::ReplicaMetrics;
use crate::procstat::RelayUsage;
use crate::producer::ProduceStats;
use crate::relay_faults::RelayFaultsReport;
use crate::verify::{OutboxRow, Verification};
use outbox_testkit::sink::{DestinationReport, Record, SinkStats};

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
}

/// Up to an hour in µs at 3 significant figures.
fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("static bounds are valid")
}

fn record_clamped(h: &mut Histogram<u64>, us: u64) {
    let _ = h.record(us.clamp(1, h.high()));
}

impl LatencySummary {
    pub fn from_histogram(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            count: h.len(),
            mean_us: h.mean(),
            p50_us: h.value_at_quantile(0.50),
            p90_us: h.value_at_quantile(0.90),
            p99_us: h.value_at_quantile(0.99),
            p999_us: h.value_at_quantile(0.999),
            max_us: h.max(),
        }
    }

    /// Summary of raw samples (µs); values below 1 µs count as 1.
    pub fn from_samples(samples: impl IntoIterator<Item = u64>) -> Self {
        let mut h = new_histogram();
        for s in samples {
            record_clamped(&mut h, s);
        }
        Self::from_histogram(&h)
    }
}

/// One second of the run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SecondPoint {
    /// Seconds since the run's origin.
    pub second: u64,
    /// Rows first received in this second.
    pub delivered: u64,
    /// p99 latency of those rows.
    pub p99_us: Option<u64>,
}

/// What the chaos loop did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChaosStats {
    /// SIGKILLs, all replicas.
    pub kills: u64,
    /// SIGSTOP/SIGCONT pauses, all replicas.
    #[serde(default)]
    pub pauses: u64,
    pub backends_terminated: u64,
    /// Replicas that exited without being killed while chaos ran (e.g. a
    /// relay whose startup query lost its connection to a backend cut), each
    /// restarted at once as a process supervisor would: `replica <i>: <status>`.
    /// Not a failure by itself; an exit during the drain or on SIGTERM is.
    #[serde(default)]
    pub exits: Vec<String>,
    /// Per replica, by replica number.
    #[serde(default)]
    pub per_replica: Vec<ReplicaChaos>,
}

/// What the chaos loop did to one replica.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaChaos {
    pub kills: u64,
    pub pauses: u64,
    /// Time spent stopped, summed over its pauses.
    pub paused_ms: u64,
    /// Exits on its own (restarted), see [`ChaosStats::exits`].
    #[serde(default)]
    pub exits: u64,
}

impl ChaosStats {
    pub fn new(replicas: u32) -> Self {
        ChaosStats {
            per_replica: vec![ReplicaChaos::default(); replicas as usize],
            ..Default::default()
        }
    }

    pub fn record_kill(&mut self, replica: usize) {
        self.kills += 1;
        self.per_replica[replica].kills += 1;
    }

    pub fn record_exit(&mut self, replica: usize, status: std::process::ExitStatus) {
        self.exits.push(format!("replica {replica}: {status}"));
        self.per_replica[replica].exits += 1;
    }

    pub fn record_pause(&mut self, replica: usize, paused: std::time::Duration) {
        self.pauses += 1;
        self.per_replica[replica].pauses += 1;
        self.per_replica[replica].paused_ms += paused.as_millis() as u64;
    }
}

/// The adversarial scenario's lines of the table.
fn adversarial_rows(
    rows: &mut Vec<(&str, String)>,
    a: &AdversarialReport,
    faults: &BTreeMap<String, u64>,
) {
    let by_kind = |prefix: &str| -> (u64, String) {
        let picked: Vec<(&String, &u64)> = faults
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .collect();
        let total = picked.iter().map(|(_, n)| **n).sum();
        let each: Vec<String> = picked
            .iter()
            .map(|(k, n)| format!("{} {n}", k.trim_start_matches(prefix)))
            .collect();
        (total, each.join(", "))
    };
    for (label, prefix) in [
        ("random statuses", "status_"),
        ("garbled 2xx", "garbled_"),
        ("outage requests", "outage_"),
    ] {
        let (total, each) = by_kind(prefix);
        rows.push((label, format!("{total} ({each})")));
    }
    let get = |k: &str| faults.get(k).copied().unwrap_or(0);
    rows.push((
        "other answers",
        format!(
            "cut off {}, oversized {}, with NUL/invalid UTF-8 {}",
            get("cut_off"),
            get("oversized"),
            get("nul_body")
        ),
    ));
    let outages: Vec<String> = a
        .outages
        .iter()
        .map(|o| {
            format!(
                "{}{} {:.1}-{:.1} s{}",
                o.kind.as_str(),
                o.route
                    .as_deref()
                    .map(|r| format!(" on {r}"))
                    .unwrap_or_default(),
                o.from_secs,
                o.from_secs + o.secs,
                o.resumed_after_secs
                    .map(|r| format!(" (resumed {r:.1} s after)"))
                    .unwrap_or_default()
            )
        })
        .collect();
    rows.push((
        "outages",
        format!("{}: {}", outages.len(), outages.join("; ")),
    ));
    let n = &a.answers;
    rows.push((
        "sink answers/message",
        format!(
            "accepted {}, taken but unreadable {}, rejected {}, failed {}",
            n.accepted, n.accepted_unread, n.rejected, n.failed
        ),
    ));
    rows.push((
        "published unaccepted",
        a.published_unaccepted.len().to_string(),
    ));
    let reasons: Vec<String> = a
        .dead_letter_reasons
        .iter()
        .map(|(r, n)| format!("{r} {n}"))
        .collect();
    rows.push((
        "dead letters",
        format!(
            "{} justified, {} not ({})",
            a.justified_dead_letters.len(),
            a.unjustified_dead_letters.len(),
            reasons.join(", ")
        ),
    ));
    rows.push(("unsettled", a.unsettled.len().to_string()));
    rows.push((
        "longest stall",
        format!(
            "{:.1} s from {:.1} s; per route outside its outages {:.1} s from {:.1} s{} (lease {:.1} s)",
            a.longest_stall.secs,
            a.longest_stall.from_secs,
            a.longest_charged_stall.secs,
            a.longest_charged_stall.from_secs,
            a.longest_charged_stall
                .route
                .as_deref()
                .map(|r| format!(" on {r}"))
                .unwrap_or_default(),
            a.lease_secs
        ),
    ));
}

/// The relay faults' lines of the table.
fn relay_fault_rows(rows: &mut Vec<(&str, String)>, r: &RelayFaultsReport) {
    if !r.blackholes.is_empty() {
        let each: Vec<String> = r
            .blackholes
            .iter()
            .map(|b| {
                format!(
                    "at {:.1} s, {} connections{}",
                    b.at_secs,
                    b.connections,
                    b.resumed_after_secs
                        .map(|s| format!(" (rows settled again {s:.1} s after)"))
                        .unwrap_or_default()
                )
            })
            .collect();
        rows.push((
            "blackholed",
            format!(
                "{}; {} connections through the proxy in all",
                each.join("; "),
                r.proxy_connections
            ),
        ));
    }
    if let Some(t) = &r.twin {
        rows.push((
            "twin replica",
            format!(
                "started at {:.1} s: {}{}",
                t.at_secs,
                match (&t.exit, t.exited_after_secs) {
                    (Some(e), Some(after)) => format!("exited with {e} after {after:.1} s"),
                    (Some(e), None) => e.clone(),
                    (None, _) => "still running, killed".into(),
                },
                t.said
                    .as_deref()
                    .map(|l| format!("; said: {}", l.chars().take(200).collect::<String>()))
                    .unwrap_or_default()
            ),
        ));
    }
}

/// `"<total> (r0 a, r1 b, …)"`, or just the total with one replica.
fn per_replica(total: u64, each: impl Iterator<Item = u64>) -> String {
    let each: Vec<String> = each.enumerate().map(|(i, n)| format!("r{i} {n}")).collect();
    if each.len() > 1 {
        format!("{total} ({})", each.join(", "))
    } else {
        total.to_string()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DbStats {
    /// `pg_stat_user_tables.n_dead_tup` of `outbox` at the end.
    pub outbox_dead_tuples: i64,
    /// Attempts beyond the first, summed over rows.
    pub retries: u64,
    pub dead_letters: u64,
    pub max_attempts: i32,
}

/// The outbox's dead tuples over the run (`pg_stat_user_tables`, sampled
/// every second from the relay's start), and how long autovacuum took to
/// reclaim them once the outbox was empty.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VacuumReport {
    /// A transaction held a snapshot (and an xid) from before the relay
    /// started until the outbox was empty.
    pub held_snapshot: bool,
    pub dead_tuples_below: i64,
    /// Seconds from the relay's start to the moment the outbox was empty.
    pub drain_end_secs: f64,
    /// `n_dead_tup` at the drain's end.
    pub dead_tuples_at_drain_end: i64,
    /// The most `n_dead_tup` seen.
    pub peak_dead_tuples: i64,
    /// Seconds after the drain's end until `n_dead_tup` fell under the
    /// threshold; `None` when it did not within the watch.
    pub secs_until_below: Option<f64>,
    /// Autovacuum runs on the outbox during the drain, and during the watch.
    pub autovacuums_during_drain: i64,
    pub autovacuums_after_drain: i64,
    pub samples: Vec<DeadTuplePoint>,
}

/// One sample of the outbox's table statistics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DeadTuplePoint {
    /// Seconds since the relay's start.
    pub secs: f64,
    pub n_dead_tup: i64,
    pub n_live_tup: i64,
    pub autovacuum_count: i64,
}

/// Everything one run measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub scenario: String,
    pub rows: u64,
    /// Rows received at least once.
    pub delivered: u64,
    /// From the origin (relay start, or load start) to the last first receipt.
    pub duration_secs: f64,
    pub throughput_per_sec: f64,
    pub latency: LatencySummary,
    pub series: Vec<SecondPoint>,
    pub relay: RelayUsage,
    pub db: DbStats,
    pub produced: ProduceStats,
    pub sink: SinkStats,
    #[serde(default)]
    pub chaos: Option<ChaosStats>,
    /// Relay processes run side by side.
    #[serde(default = "one")]
    pub replicas: u32,
    /// Each replica's `/metrics`, scraped once before it was stopped.
    #[serde(default)]
    pub replica_metrics: Vec<ReplicaMetrics>,
    #[serde(default)]
    pub vacuum: Option<VacuumReport>,
    /// The adversarial scenario's checks.
    #[serde(default)]
    pub adversarial: Option<AdversarialReport>,
    /// What the relay faults did (`[relay_faults]`).
    #[serde(default)]
    pub relay_faults: Option<RelayFaultsReport>,
    /// A load over a preloaded backlog: the latency of the load's events
    /// alone (rows after the preload's last id), not the backlog's.
    #[serde(default)]
    pub load_latency: Option<LatencySummary>,
    /// Delivery mode: what reached the final destination, and in which order.
    #[serde(default)]
    pub destination: Option<DestinationReport>,
    /// The server's durability, where the sink ran, the machine's state.
    #[serde(default)]
    pub environment: Option<RunEnvironment>,
    pub passed: bool,
    pub failures: Vec<String>,
    pub verification: Verification,
}

fn one() -> u32 {
    1
}

/// What [`Report::build`] needs.
pub struct ReportInput<'a> {
    pub scenario: &'a str,
    /// unix µs the throughput clock starts at.
    pub origin_us: i64,
    pub rows: &'a [OutboxRow],
    pub records: &'a [Record],
    pub relay: RelayUsage,
    pub outbox_dead_tuples: i64,
    pub produced: ProduceStats,
    pub sink: SinkStats,
    pub verification: Verification,
}

/// `12.34 s` of CPU per million `events`, or `-` without events.
pub fn cpu_per_million(cpu_secs: f64, events: u64) -> String {
    if events == 0 {
        return "-".to_owned();
    }
    format!("{:.2} s", cpu_secs * 1e6 / events as f64)
}

/// Commit-to-sink latency (`created_at` to first receipt) of the rows with
/// an id above `after`.
pub fn latency_after(rows: &[OutboxRow], records: &[Record], after: i64) -> LatencySummary {
    let created: HashMap<i64, i64> = rows
        .iter()
        .filter(|r| r.id > after)
        .map(|r| (r.id, r.created_at_us))
        .collect();
    let mut first: HashMap<i64, i64> = HashMap::with_capacity(created.len());
    for (id, at) in records
        .iter()
        .filter_map(|r| r.outbox_id.map(|id| (id, r.received_at_us)))
    {
        if created.contains_key(&id) {
            first
                .entry(id)
                .and_modify(|t| *t = (*t).min(at))
                .or_insert(at);
        }
    }
    let mut h = new_histogram();
    for (id, received) in &first {
        record_clamped(&mut h, (received - created[id]).max(0) as u64);
    }
    LatencySummary::from_histogram(&h)
}

impl Report {
    pub fn build(input: ReportInput<'_>) -> Report {
        let created: HashMap<i64, i64> =
            input.rows.iter().map(|r| (r.id, r.created_at_us)).collect();
        // First receipt per row.
        let mut first: HashMap<i64, i64> = HashMap::with_capacity(created.len());
        for rec in input.records {
            if let Some(id) = rec.outbox_id {
                if created.contains_key(&id) {
                    first
                        .entry(id)
                        .and_modify(|t| *t = (*t).min(rec.received_at_us))
                        .or_insert(rec.received_at_us);
                }
            }
        }
        let mut overall = new_histogram();
        let mut per_second: BTreeMap<u64, Histogram<u64>> = BTreeMap::new();
        let mut last_us = input.origin_us;
        for (id, received) in &first {
            let latency = (received - created[id]).max(0) as u64;
            record_clamped(&mut overall, latency);
            let second = ((received - input.origin_us).max(0) / 1_000_000) as u64;
            record_clamped(
                per_second.entry(second).or_insert_with(new_histogram),
                latency,
            );
            last_us = last_us.max(*received);
        }
        let series = match per_second.keys().next_back() {
            Some(&end) => (0..=end)
                .map(|second| match per_second.get(&second) {
                    Some(h) => SecondPoint {
                        second,
                        delivered: h.len(),
                        p99_us: Some(h.value_at_quantile(0.99)),
                    },
                    None => SecondPoint {
                        second,
                        delivered: 0,
                        p99_us: None,
                    },
                })
                .collect(),
            None => Vec::new(),
        };
        let duration_secs = (last_us - input.origin_us).max(0) as f64 / 1e6;
        let delivered = first.len() as u64;
        let db = DbStats {
            outbox_dead_tuples: input.outbox_dead_tuples,
            retries: input
                .rows
                .iter()
                .map(|r| (r.attempt_count.max(1) - 1) as u64)
                .sum(),
            dead_letters: input.rows.iter().filter(|r| r.dead_lettered).count() as u64,
            max_attempts: input
                .rows
                .iter()
                .map(|r| r.attempt_count)
                .max()
                .unwrap_or(0),
        };
        let failures = input.verification.failures();
        Report {
            scenario: input.scenario.to_owned(),
            rows: input.rows.len() as u64,
            delivered,
            duration_secs,
            throughput_per_sec: if duration_secs > 0.0 {
                delivered as f64 / duration_secs
            } else {
                0.0
            },
            latency: LatencySummary::from_histogram(&overall),
            series,
            relay: input.relay,
            db,
            produced: input.produced,
            sink: input.sink,
            chaos: None,
            replicas: 1,
            replica_metrics: Vec::new(),
            vacuum: None,
            adversarial: None,
            relay_faults: None,
            load_latency: None,
            destination: None,
            environment: None,
            passed: failures.is_empty(),
            failures,
            verification: input.verification,
        }
    }

    /// An aligned two-column table for the terminal.
    pub fn table(&self) -> String {
        let ms = |us: u64| format!("{:.2} ms", us as f64 / 1000.0);
        let v = &self.verification;
        let mut rows: Vec<(&str, String)> = vec![
            ("scenario", self.scenario.clone()),
            (
                "result",
                if self.passed {
                    "PASS".into()
                } else {
                    "FAIL".into()
                },
            ),
            ("relay replicas", self.replicas.to_string()),
            ("rows in outbox", self.rows.to_string()),
            ("rows delivered", self.delivered.to_string()),
            ("duration", format!("{:.2} s", self.duration_secs)),
            (
                "throughput",
                format!("{:.0} events/s", self.throughput_per_sec),
            ),
            ("latency p50", ms(self.latency.p50_us)),
            ("latency p90", ms(self.latency.p90_us)),
            ("latency p99", ms(self.latency.p99_us)),
            ("latency p99.9", ms(self.latency.p999_us)),
            ("latency max", ms(self.latency.max_us)),
        ];
        if let Some(l) = &self.load_latency {
            rows.extend([
                ("load events (after the preload)", l.count.to_string()),
                ("load latency p50", ms(l.p50_us)),
                ("load latency p90", ms(l.p90_us)),
                ("load latency p99", ms(l.p99_us)),
                ("load latency max", ms(l.max_us)),
            ]);
        }
        rows.extend([
            ("relay CPU", format!("{:.2} s", self.relay.cpu_secs)),
            (
                "relay CPU per 1M events",
                cpu_per_million(self.relay.cpu_secs, self.delivered),
            ),
            (
                "relay peak RSS",
                format!("{:.1} MiB", self.relay.peak_rss_kib as f64 / 1024.0),
            ),
            (
                "relay peak anonymous RSS",
                format!(
                    "{:.1} MiB (heap and stacks, sampled; the rest is file pages, mostly the binary's code)",
                    self.relay.peak_anon_kib as f64 / 1024.0
                ),
            ),
            ("relay processes", self.relay.processes.to_string()),
            ("outbox dead tuples", self.db.outbox_dead_tuples.to_string()),
            ("retries", self.db.retries.to_string()),
            ("dead letters", self.db.dead_letters.to_string()),
            (
                "duplicates",
                format!(
                    "{} ({} deduplicated by the sink)",
                    v.duplicates, v.duplicates_deduplicated
                ),
            ),
            ("missing", v.missing.len().to_string()),
            (
                "order violations",
                if v.order_checked {
                    v.order_violations.len().to_string()
                } else {
                    "not checked".into()
                },
            ),
            (
                "poison dead-lettered",
                format!("{}/{}", v.poison.dead_lettered, v.poison.expected),
            ),
            (
                "produced",
                format!(
                    "{} events in {:.2} s",
                    self.produced.events, self.produced.elapsed_secs
                ),
            ),
            (
                "sink requests",
                format!(
                    "{} ({} faults injected)",
                    self.sink.requests,
                    self.sink.server_errors
                        + self.sink.rate_limited
                        + self.sink.hangs
                        + self.sink.resets
                        + self.sink.lost_responses
                        + self.sink.element_errors
                        + self
                            .sink
                            .adversarial
                            .iter()
                            .filter(|(k, _)| *k != "nul_body")
                            .map(|(_, n)| n)
                            .sum::<u64>()
                ),
            ),
        ]);
        if let Some(e) = &self.environment {
            rows.push(("database server", e.server.describe()));
            rows.push((
                "sink",
                match e.sink_cpu_secs {
                    Some(cpu) if e.sink_own_process => {
                        format!("its own process, {cpu:.2} s CPU")
                    }
                    _ => "in the harness's process".to_owned(),
                },
            ));
            rows.push(("machine", e.machine.describe()));
        }
        if let Some(d) = &self.destination {
            rows.push((
                "destination calls",
                format!(
                    "{} ({} failed), {} events delivered ({} more than once)",
                    d.calls, d.failed_calls, d.events_delivered, d.events_delivered_twice
                ),
            ));
            rows.push((
                "destination order",
                format!(
                    "{} events out of order in {} of {} keys; most calls of a key in flight at once: {}",
                    d.out_of_order, d.out_of_order_keys, d.keys, d.max_in_flight_per_key
                ),
            ));
        }
        if let Some(c) = &self.chaos {
            rows.push((
                "chaos kills",
                per_replica(c.kills, c.per_replica.iter().map(|r| r.kills)),
            ));
            rows.push((
                "chaos pauses",
                per_replica(c.pauses, c.per_replica.iter().map(|r| r.pauses)),
            ));
            if c.pauses > 0 {
                let paused: u64 = c.per_replica.iter().map(|r| r.paused_ms).sum();
                rows.push(("time paused", format!("{:.1} s", paused as f64 / 1000.0)));
            }
            rows.push(("backends terminated", c.backends_terminated.to_string()));
            if !c.exits.is_empty() {
                rows.push((
                    "exits during chaos",
                    format!("{} restarted: {}", c.exits.len(), c.exits.join("; ")),
                ));
            }
        }
        let shown = |m: &ReplicaMetrics, v: Option<f64>| match v {
            Some(v) => format!("r{} {v}", m.replica),
            None if m.scraped => format!("r{} -", m.replica),
            None => format!("r{} unreachable", m.replica),
        };
        let metrics = &self.replica_metrics;
        if metrics.iter().any(|m| m.shards_owned.is_some()) {
            let each: Vec<String> = metrics.iter().map(|m| shown(m, m.shards_owned)).collect();
            rows.push(("shards owned", each.join(", ")));
            let each: Vec<String> = metrics
                .iter()
                .map(|m| {
                    let kinds: Vec<String> = m
                        .shard_handovers
                        .iter()
                        .map(|(k, v)| format!("{k} {v}"))
                        .collect();
                    format!("r{} [{}]", m.replica, kinds.join(" "))
                })
                .collect();
            rows.push(("shard handovers", each.join(", ")));
        }
        if metrics.iter().any(|m| m.events_published.is_some()) {
            let each: Vec<String> = metrics
                .iter()
                .map(|m| shown(m, m.events_published))
                .collect();
            rows.push(("published (last process)", each.join(", ")));
        }
        if let Some(vac) = &self.vacuum {
            rows.push((
                "held snapshot",
                if vac.held_snapshot {
                    "yes (REPEATABLE READ + xid, whole drain)".into()
                } else {
                    "no".into()
                },
            ));
            rows.push(("drain ended at", format!("{:.1} s", vac.drain_end_secs)));
            rows.push((
                "dead tuples",
                format!(
                    "{} at drain end, peak {}",
                    vac.dead_tuples_at_drain_end, vac.peak_dead_tuples
                ),
            ));
            rows.push((
                "autovacuums",
                format!(
                    "{} during the drain, {} after",
                    vac.autovacuums_during_drain, vac.autovacuums_after_drain
                ),
            ));
            rows.push((
                "dead tuples reclaimed",
                match vac.secs_until_below {
                    Some(s) => {
                        format!("under {} {:.1} s after the drain", vac.dead_tuples_below, s)
                    }
                    None => format!("NOT under {} within the watch", vac.dead_tuples_below),
                },
            ));
        }
        if let Some(a) = &self.adversarial {
            adversarial_rows(&mut rows, a, &self.sink.adversarial);
        }
        if let Some(r) = &self.relay_faults {
            relay_fault_rows(&mut rows, r);
        }
        let width = rows
            .iter()
            .map(|(k, _)| k.chars().count())
            .max()
            .unwrap_or(0);
        let mut out = String::new();
        for (k, val) in rows {
            let _ = writeln!(out, "{k:<width$}  {val}");
        }
        for f in &self.failures {
            let _ = writeln!(out, "FAILURE: {f}");
        }
        out
    }

    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        let json = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(path, json)
    }

    /// Throughput and p99 latency per second, two panels, as an SVG document.
    pub fn svg(&self) -> Result<String, String> {
        use plotters::prelude::*;
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (900, 600)).into_drawing_area();
            root.fill(&WHITE).map_err(|e| e.to_string())?;
            let (top, bottom) = root.split_vertically(300);
            let end = self.series.last().map(|p| p.second + 1).unwrap_or(1);
            line_panel(
                &top,
                &format!("{}: delivered events/s", self.scenario),
                end,
                self.series.iter().map(|p| (p.second, p.delivered as f64)),
                &BLUE,
            )?;
            line_panel(
                &bottom,
                "latency p99 (ms)",
                end,
                self.series
                    .iter()
                    .filter_map(|p| p.p99_us.map(|v| (p.second, v as f64 / 1000.0))),
                &RED,
            )?;
            root.present().map_err(|e| e.to_string())?;
        }
        Ok(svg)
    }

    pub fn write_svg(&self, path: &Path) -> std::io::Result<()> {
        let svg = self.svg().map_err(std::io::Error::other)?;
        std::fs::write(path, svg)
    }
}

/// One panel of [`Report::svg`]: `points` (second, value) as a line over
/// `0..end` seconds, the y axis a tenth above the largest value.
fn line_panel<DB: plotters::prelude::DrawingBackend>(
    area: &plotters::prelude::DrawingArea<DB, plotters::coord::Shift>,
    caption: &str,
    end: u64,
    points: impl Iterator<Item = (u64, f64)> + Clone,
    color: &plotters::prelude::RGBColor,
) -> Result<(), String> {
    use plotters::prelude::*;
    let max = points.clone().map(|(_, v)| v).fold(0.0, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(0u64..end, 0f64..(max * 1.1).max(1.0))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("s")
        .draw()
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(LineSeries::new(points, color))
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_shows_chaos_per_replica_and_shards_only_when_exported() {
        let mut chaos = ChaosStats::new(3);
        chaos.record_kill(0);
        chaos.record_kill(2);
        chaos.record_pause(1, std::time::Duration::from_millis(4500));
        let today = |replica| ReplicaMetrics {
            replica,
            metrics_port: 9000 + replica as u16,
            scraped: replica != 2,
            events_published: (replica != 2).then_some(10.0),
            ..Default::default()
        };
        let mut report = Report {
            replicas: 3,
            chaos: Some(chaos),
            replica_metrics: (0..3).map(today).collect(),
            ..Default::default()
        };
        let t = report.table();
        assert!(t.contains("relay replicas            3"), "{t}");
        assert!(
            t.contains("chaos kills               2 (r0 1, r1 0, r2 1)"),
            "{t}"
        );
        assert!(
            t.contains("chaos pauses              1 (r0 0, r1 1, r2 0)"),
            "{t}"
        );
        assert!(t.contains("time paused               4.5 s"), "{t}");
        assert!(t.contains("r0 10, r1 10, r2 unreachable"), "{t}");
        assert!(!t.contains("shards owned"), "{t}");

        report.replica_metrics[0].shards_owned = Some(3.0);
        report.replica_metrics[0]
            .shard_handovers
            .insert("acquired".into(), 4.0);
        report.replica_metrics[1].shards_owned = Some(5.0);
        let t = report.table();
        assert!(
            t.contains("shards owned              r0 3, r1 5, r2 unreachable"),
            "{t}"
        );
        assert!(t.contains("r0 [acquired 4]"), "{t}");
    }
}
