//! `loadtest rolling-upgrade`: a relay of an older release delivers while
//! producers insert and this release's `migrate` runs, then the relays are
//! replaced as `migrate` says; the report is how long delivery stopped.
//!
//! The older relay is a binary built from an older commit (`--old-relay-bin`;
//! building one is a full build, so CI does not run this: `tests/upgrade.rs`
//! stands an older relay in by its heartbeat). The database starts at the
//! schema the older binary's own `migrate` makes.
//!
//! What happens, by what `migrate` does with the older relay live:
//! - it refuses (a migration needs newer relays): the older relay keeps
//!   delivering meanwhile; then the procedure it names: stop the older relay,
//!   `migrate`, start the new one;
//! - it migrates (every migration keeps older relays working): roll the
//!   relays: start the new one, then stop the older one;
//! - with `--force` (`migrate --allow-live-older`, or what a `migrate`
//!   without the check did): the older relay keeps running on the new schema
//!   for `--replace-after`, then is replaced; this is the stall the check
//!   prevents.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use outbox_testkit::relay::{Output, RelayCommand, RelayProcess, RelayProgram};
use outbox_testkit::sink::{Sink, SinkConfig};
use serde::Serialize;
use tokio::sync::watch;

use crate::producer::{self, EventMix, LoadSpec};
use crate::runner::RunDatabase;

/// How a run goes.
#[derive(Debug, Clone)]
pub struct RollingOptions {
    /// The older release's `outbox-relay`.
    pub old_relay: PathBuf,
    /// This release's relay (its `migrate` and `run`).
    pub new_relay: RelayProgram,
    /// A server to create the run's database on; a throwaway cluster when `None`.
    pub database_url: Option<String>,
    /// Events per second the producers insert throughout.
    pub rate: f64,
    /// Delivery before `migrate` runs.
    pub warmup: Duration,
    /// After a refusal, how long the older relay goes on before it is stopped.
    pub after_refusal: Duration,
    /// `migrate --allow-live-older`, leaving the older relay on the new schema.
    pub force: bool,
    /// With `force`: how long the older relay runs on before it is replaced.
    pub replace_after: Duration,
    /// Delivery after the new relay started, producers still inserting.
    pub settle: Duration,
    /// relay logs and report.json go here.
    pub out_dir: PathBuf,
}

/// One thing the run did, at seconds since producers started.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub at_secs: f64,
    pub took_secs: f64,
    pub what: String,
}

/// What a run saw.
#[derive(Debug, Clone, Serialize)]
pub struct RollingReport {
    pub old_relay: String,
    pub new_relay: String,
    pub rate: f64,
    pub forced: bool,
    pub schema_before: i32,
    pub schema_after: i32,
    pub steps: Vec<Step>,
    /// What `migrate` said when it refused.
    pub refusal: Option<String>,
    /// Rows in the outbox at the end, inserted over `producing_secs`.
    pub produced: i64,
    pub producing_secs: f64,
    /// Of them, delivered to the sink at least once.
    pub delivered: usize,
    /// Rows neither published nor dead-lettered at the end.
    pub pending_at_end: i64,
    /// The longest time with no new event delivered while producers inserted,
    /// and when it began (seconds since producers started).
    pub longest_gap_secs: f64,
    pub longest_gap_from_secs: f64,
    /// From an event's insert to its first delivery.
    pub p50_latency_secs: f64,
    pub p99_latency_secs: f64,
    pub max_latency_secs: f64,
}

impl RollingReport {
    /// A few lines for the terminal.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "schema {:04} -> {:04}; {} events in {:.1}s ({:.0}/s), {} delivered, {} pending at the end\n",
            self.schema_before,
            self.schema_after,
            self.produced,
            self.producing_secs,
            self.produced as f64 / self.producing_secs.max(f64::EPSILON),
            self.delivered,
            self.pending_at_end
        );
        for step in &self.steps {
            s += &format!(
                "  t={:6.1}s ({:5.1}s) {}\n",
                step.at_secs, step.took_secs, step.what
            );
        }
        s += &format!(
            "longest delivery gap {:.2}s (from t={:.1}s); latency p50 {:.3}s, p99 {:.3}s, max {:.2}s\n",
            self.longest_gap_secs,
            self.longest_gap_from_secs,
            self.p50_latency_secs,
            self.p99_latency_secs,
            self.max_latency_secs
        );
        s
    }
}

/// A config both releases read: a QStash route to the sink, short leases.
fn relay_config(db_url: &str, sink_url: &str, token: &str) -> String {
    format!(
        r#"
[database]
url = "{db_url}"
pool_size = 12
[relay]
claim_batch = 200
max_in_flight = 2000
lease = "5s"
poll_interval = "100ms"
shard_lease = "3s"
shutdown_grace = "10s"
[http]
request_timeout = "2s"
connect_timeout = "1s"
[qstash]
url = "{sink_url}"
token = "{token}"
[server]
metrics_bind = "127.0.0.1:0"
[[routes]]
event_type = "*"
destination = "http://127.0.0.1:9/hook/{{event_type}}"
"#
    )
}

/// `<bin> migrate [--allow-live-older]` against `db_url`: success, and stderr.
async fn migrate(program: &RelayProgram, db_url: &str, force: bool) -> (bool, String) {
    let mut c = tokio::process::Command::new(&program.bin);
    c.args(&program.args).arg("migrate");
    if force {
        c.arg("--allow-live-older");
    }
    let out = c
        .env("DATABASE_URL", db_url)
        .env("OUTBOX_RELAY_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .output()
        .await;
    match out {
        Ok(out) => (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ),
        Err(e) => (
            false,
            format!("could not run {}: {e}", program.bin.display()),
        ),
    }
}

fn spawn(
    program: &RelayProgram,
    config: &str,
    log: &Path,
) -> Result<RelayProcess, Box<dyn std::error::Error>> {
    Ok(RelayCommand::with_config_text(program, config)?
        .env("OUTBOX_RELAY_LOG", "info")
        .output(Output::Append(log.into()), Output::Append(log.into()))
        .spawn()?)
}

/// Stops `relay` with SIGTERM; a relay whose statements fail may not exit
/// cleanly, which the report notes.
async fn stop(relay: RelayProcess) -> String {
    match relay.terminate(Duration::from_secs(30)).await {
        Ok(_) => "exited 0".to_owned(),
        Err(e) => format!("did not stop cleanly: {e}"),
    }
}

async fn scalar(db_url: &str, sql: &str) -> Result<i64, Box<dyn std::error::Error>> {
    let client = producer::connect(db_url).await?;
    Ok(client.query_one(sql, &[]).await?.get(0))
}

const PENDING: &str =
    "SELECT count(*) FROM outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL";

/// Runs the upgrade; the report is also written to `out_dir/report.json`.
pub async fn run(opts: &RollingOptions) -> Result<RollingReport, Box<dyn std::error::Error>> {
    std::fs::create_dir_all(&opts.out_dir)?;
    let old = RelayProgram::binary(&opts.old_relay);
    // A correctness run: the fast test settings.
    let db = RunDatabase::create(
        opts.database_url.as_deref(),
        outbox_testkit::ClusterOptions::default(),
    )
    .await?;
    let url = db.url.clone();
    let (ok, err) = migrate(&old, &url, false).await;
    if !ok {
        return Err(format!("the older relay's migrate failed: {err}").into());
    }
    let schema = "SELECT max(version)::int8 FROM outbox_relay_migrations";
    let schema_before = scalar(&url, schema).await? as i32;
    let sink = Sink::start(SinkConfig::default()).await?;
    let config = relay_config(&url, &sink.url(), sink.token());
    let mut relay = spawn(&old, &config, &opts.out_dir.join("old-relay.log"))?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let spec = LoadSpec {
        rate: Some(opts.rate),
        duration: Duration::from_secs(24 * 3600),
        max_events: None,
        connections: 2,
        events_per_tx: 1,
        synchronous_commit: false,
        mix: EventMix::default(),
    };
    let producer_url = url.clone();
    let producers = tokio::spawn(async move {
        producer::produce(&producer_url, &spec, "rolling", None, Some(stop_rx)).await
    });
    let t0 = Instant::now();
    let started_us = chrono::Utc::now().timestamp_micros();
    let mut steps = Vec::new();
    let mut step = |at: Instant, what: String| {
        eprintln!("t={:.1}s {what}", at.duration_since(t0).as_secs_f64());
        steps.push(Step {
            at_secs: at.duration_since(t0).as_secs_f64(),
            took_secs: at.elapsed().as_secs_f64(),
            what,
        });
    };
    tokio::time::sleep(opts.warmup).await;

    let at = Instant::now();
    let (migrated, said) = migrate(&opts.new_relay, &url, opts.force).await;
    let mut refusal = None;
    let log = opts.out_dir.join("new-relay.log");
    if !migrated && !said.contains("--allow-live-older") {
        return Err(format!("migrate failed: {said}").into());
    }
    if !migrated && !opts.force {
        step(at, "new migrate, older relay live: refused".into());
        refusal = Some(said);
        tokio::time::sleep(opts.after_refusal).await;
        let at = Instant::now();
        let how = stop(relay).await;
        step(at, format!("stop the older relay (SIGTERM): {how}"));
        let at = Instant::now();
        let (ok, said) = migrate(&opts.new_relay, &url, false).await;
        if !ok {
            return Err(format!("migrate failed with no relay live: {said}").into());
        }
        step(at, "new migrate".into());
        let at = Instant::now();
        relay = spawn(&opts.new_relay, &config, &log)?;
        step(at, "start the new relay".into());
    } else if migrated && !opts.force {
        step(at, "new migrate, older relay live: applied".into());
        let at = Instant::now();
        let new = spawn(&opts.new_relay, &config, &log)?;
        step(at, "start the new relay".into());
        tokio::time::sleep(Duration::from_secs(5)).await;
        let at = Instant::now();
        let how = stop(relay).await;
        step(at, format!("stop the older relay (SIGTERM): {how}"));
        relay = new;
    } else {
        if !migrated {
            return Err(format!("migrate --allow-live-older failed: {said}").into());
        }
        step(
            at,
            "new migrate --allow-live-older, older relay live: applied".into(),
        );
        tokio::time::sleep(opts.replace_after).await;
        let at = Instant::now();
        let how = stop(relay).await;
        step(at, format!("stop the older relay (SIGTERM): {how}"));
        let at = Instant::now();
        relay = spawn(&opts.new_relay, &config, &log)?;
        step(at, "start the new relay".into());
    }
    tokio::time::sleep(opts.settle).await;
    stop_tx.send(true)?;
    let producing_until_us = chrono::Utc::now().timestamp_micros();
    producers.await??;
    let at = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(120);
    while scalar(&url, PENDING).await? > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    step(
        at,
        "producers stopped; wait for the backlog to drain".into(),
    );
    let how = stop(relay).await;
    step(Instant::now(), format!("stop the new relay: {how}"));

    let produced = scalar(&url, "SELECT count(*) FROM outbox").await?;
    let pending_at_end = scalar(&url, PENDING).await?;
    let schema_after = scalar(&url, schema).await? as i32;
    let timing = delivery_timing(&sink.records(), started_us, producing_until_us);
    sink.stop().await;
    db.drop_database().await?;

    let report = RollingReport {
        old_relay: opts.old_relay.display().to_string(),
        new_relay: opts.new_relay.describe(),
        rate: opts.rate,
        forced: opts.force,
        schema_before,
        schema_after,
        steps,
        refusal,
        produced,
        producing_secs: (producing_until_us - started_us) as f64 / 1e6,
        delivered: timing.delivered,
        pending_at_end,
        longest_gap_secs: timing.longest_gap_secs,
        longest_gap_from_secs: timing.longest_gap_from_secs,
        p50_latency_secs: timing.p50,
        p99_latency_secs: timing.p99,
        max_latency_secs: timing.max,
    };
    std::fs::write(
        opts.out_dir.join("report.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    Ok(report)
}

#[derive(Debug, Default, PartialEq)]
struct Timing {
    delivered: usize,
    longest_gap_secs: f64,
    longest_gap_from_secs: f64,
    p50: f64,
    p99: f64,
    max: f64,
}

/// From the sink's records: each event's first delivery; the longest time
/// between two first deliveries in `[from_us, until_us]` (while producers
/// inserted), and the latencies.
fn delivery_timing(
    records: &[outbox_testkit::sink::Record],
    from_us: i64,
    until_us: i64,
) -> Timing {
    let mut first: std::collections::HashMap<i64, (i64, Option<i64>)> = Default::default();
    for r in records {
        if let Some(id) = r.outbox_id {
            first
                .entry(id)
                .and_modify(|e| e.0 = e.0.min(r.received_at_us))
                .or_insert((r.received_at_us, r.created_at_us));
        }
    }
    let mut at: Vec<i64> = first.values().map(|v| v.0).collect();
    at.push(from_us);
    at.push(until_us);
    at.retain(|&t| (from_us..=until_us).contains(&t));
    at.sort_unstable();
    let (gap, from) = at
        .windows(2)
        .map(|w| (w[1] - w[0], w[0]))
        .max()
        .unwrap_or((0, from_us));
    let mut latencies: Vec<i64> = first
        .values()
        .filter_map(|&(got, created)| created.map(|c| got - c))
        .collect();
    latencies.sort_unstable();
    let pick = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .map_or(0.0, |&us| us as f64 / 1e6)
    };
    Timing {
        delivered: first.len(),
        longest_gap_secs: gap as f64 / 1e6,
        longest_gap_from_secs: (from - from_us) as f64 / 1e6,
        p50: pick(0.5),
        p99: pick(0.99),
        max: latencies.last().map_or(0.0, |&us| us as f64 / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_testkit::sink::Record;

    fn record(id: i64, at_s: i64, created_s: i64) -> Record {
        Record {
            seq: 0,
            message_id: String::new(),
            dedup_id: None,
            outbox_id: Some(id),
            partition_key: None,
            destination: String::new(),
            received_at_us: at_s * 1_000_000,
            deduplicated: false,
            created_at_us: Some(created_s * 1_000_000),
            via_batch: false,
        }
    }

    #[test]
    fn the_gap_is_the_longest_time_without_a_first_delivery_while_producing() {
        // Event 2 delivered again at 9 s: a redelivery, not a first delivery.
        let records = [
            record(1, 1, 1),
            record(2, 2, 2),
            record(3, 8, 3),
            record(2, 9, 2),
            record(4, 10, 9),
        ];
        let t = delivery_timing(&records, 0, 12_000_000);
        assert_eq!(t.delivered, 4);
        assert_eq!((t.longest_gap_secs, t.longest_gap_from_secs), (6.0, 2.0));
        assert_eq!(t.max, 5.0);
    }
}
