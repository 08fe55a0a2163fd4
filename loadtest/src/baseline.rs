//! The seed article's relay (`loadtest/baseline/`, TypeScript on Node) run
//! as a drain on the same kind of cluster and sink as outbox-relay: a
//! scenario with `relay = "seed"`. The harness creates the article's table,
//! preloads the scenario's events into it, runs the article's worker against
//! the sink and times it until no row is pending.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use outbox_testkit::sink::{Sink, SinkConfig};

use crate::environment::{MachineSnapshot, MachineState, RunEnvironment};
use crate::procstat::{RelayUsage, UsageTracker};
use crate::report::cpu_per_million;
use crate::runner::{RunDatabase, RunError, RunOptions};
use crate::scenario::Scenario;
use crate::sink_process::{RunSink, SinkProcess};

/// Where the baseline lives: `LOADTEST_BASELINE_DIR`, else this package's
/// `baseline/`.
pub fn baseline_dir() -> PathBuf {
    std::env::var_os("LOADTEST_BASELINE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/baseline")))
}

/// Why the baseline cannot run here (no `node`, no `npm ci` yet), if so.
pub fn missing() -> Option<String> {
    let node = std::process::Command::new("node").arg("--version").output();
    if !matches!(node, Ok(o) if o.status.success()) {
        return Some("`node` is not on PATH".into());
    }
    let tsx = baseline_dir().join("node_modules/tsx");
    (!tsx.exists()).then(|| {
        format!(
            "{} is missing: run `npm ci` in {}",
            tsx.display(),
            baseline_dir().display()
        )
    })
}

/// What a baseline drain measured.
#[derive(Debug, Clone)]
pub struct BaselineReport {
    pub events: u64,
    pub published: i64,
    pub dead: i64,
    pub pending: i64,
    pub received: usize,
    pub duration_secs: f64,
    pub throughput_per_sec: f64,
    pub usage: RelayUsage,
    pub timed_out: bool,
    pub environment: RunEnvironment,
}

impl BaselineReport {
    pub fn passed(&self) -> bool {
        !self.timed_out && self.pending == 0 && self.dead == 0
    }

    /// The same lines a drain of outbox-relay prints for these figures.
    pub fn table(&self) -> String {
        let rows = [
            (
                "relay",
                "the seed article's (Node, pg, @upstash/qstash)".to_owned(),
            ),
            (
                "result",
                if self.passed() { "PASS" } else { "FAIL" }.to_owned(),
            ),
            ("rows in outbox", self.events.to_string()),
            ("rows published", self.published.to_string()),
            ("rows dead-lettered", self.dead.to_string()),
            ("rows pending", self.pending.to_string()),
            ("messages the sink took", self.received.to_string()),
            ("duration", format!("{:.2} s", self.duration_secs)),
            (
                "throughput",
                format!("{:.0} events/s", self.throughput_per_sec),
            ),
            ("relay CPU", format!("{:.2} s", self.usage.cpu_secs)),
            (
                "relay CPU per 1M events",
                cpu_per_million(self.usage.cpu_secs, self.published.max(0) as u64),
            ),
            (
                "relay peak RSS",
                format!("{:.1} MiB", self.usage.peak_rss_kib as f64 / 1024.0),
            ),
            (
                "relay peak anonymous RSS",
                format!("{:.1} MiB", self.usage.peak_anon_kib as f64 / 1024.0),
            ),
            ("database server", self.environment.server.describe()),
            (
                "sink",
                match self.environment.sink_cpu_secs {
                    Some(cpu) => format!("its own process, {cpu:.2} s CPU"),
                    None => "in the harness's process".to_owned(),
                },
            ),
            ("machine", self.environment.machine.describe()),
        ];
        rows.iter().map(|(k, v)| format!("{k:<24} {v}\n")).collect()
    }
}

const PENDING: &str =
    "SELECT count(*) FILTER (WHERE published_at IS NULL AND dead_lettered_at IS NULL),
       count(*) FILTER (WHERE published_at IS NOT NULL),
       count(*) FILTER (WHERE dead_lettered_at IS NOT NULL)
FROM outbox";

/// Runs the scenario's drain with the article's relay.
pub async fn run(s: &Scenario, opts: &RunOptions) -> Result<BaselineReport, RunError> {
    s.validate()?;
    if let Some(why) = missing() {
        return Err(RunError::Setup(format!(
            "the seed baseline cannot run: {why}"
        )));
    }
    let preload = s
        .preload
        .as_ref()
        .ok_or_else(|| RunError::Setup("relay = \"seed\" needs a [preload]".into()))?;
    std::fs::create_dir_all(&opts.out_dir)?;
    let db = RunDatabase::create(
        opts.database_url.as_deref(),
        s.cluster_options(opts.fsync_off),
    )
    .await?;
    let result = drain(s, preload, opts, &db).await;
    if let Err(e) = db.drop_database().await {
        tracing::warn!(error = %e, "could not drop the run's database");
    }
    result
}

async fn drain(
    s: &Scenario,
    preload: &crate::producer::PreloadSpec,
    opts: &RunOptions,
    db: &RunDatabase,
) -> Result<BaselineReport, RunError> {
    let client = crate::producer::connect(&db.url).await?;
    let schema = std::fs::read_to_string(baseline_dir().join("schema.sql"))?;
    client.batch_execute(&schema).await?;
    let events = preload.events as i64;
    let keys = i64::from(preload.mix.partition_keys.max(1));
    // The article's call site: an `order.placed` per order, keyed by order.
    client
        .execute(
            "INSERT INTO outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, headers, idempotency_key)
             SELECT gen_random_uuid(), 'order', 'o' || (g % $2), 'order.placed',
                    jsonb_build_object('orderId', 'o' || (g % $2), 'totalCents', g, 'currency', 'USD'),
                    '{\"schema-version\": \"1\"}', 'order.placed:' || g
             FROM generate_series(1, $1::int8) g",
            &[&events, &keys],
        )
        .await?;
    client.batch_execute("ANALYZE outbox").await?;

    let server = db.server_settings(opts.server_label.as_deref()).await?;
    let sink = match &opts.sink_bin {
        Some(bin) => RunSink::Process(Box::new(
            SinkProcess::start(bin, s.sink.dedup_window, &opts.out_dir.join("sink.log")).await?,
        )),
        None => RunSink::InProcess(
            Sink::start(SinkConfig {
                dedup_window: s.sink.dedup_window,
                ..SinkConfig::default()
            })
            .await
            .map_err(|e| RunError::Setup(format!("sink: {e}")))?,
        ),
    };
    let log = std::fs::File::create(opts.out_dir.join("seed-relay.log"))?;
    let machine_before = MachineSnapshot::take();
    let started = Instant::now();
    let mut child = tokio::process::Command::new("node")
        .args(["--import", "tsx", "relay.ts"])
        .current_dir(baseline_dir())
        .env("DATABASE_URL", &db.url)
        .env("QSTASH_URL", sink.url())
        .env("QSTASH_TOKEN", sink.token())
        .env("CONSUMER_BASE_URL", format!("{}/hook", sink.url()))
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()?;
    let pid = child.id().unwrap_or(0);
    let mut usage = UsageTracker::default();
    let deadline = started + s.drain_timeout;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    let (pending, published, dead, timed_out) = loop {
        tick.tick().await;
        usage.sample(pid);
        let row = client.query_one(PENDING, &[]).await?;
        let (pending, published, dead): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        if pending == 0 {
            break (pending, published, dead, false);
        }
        if Instant::now() >= deadline {
            break (pending, published, dead, true);
        }
        if let Some(status) = child.try_wait()? {
            return Err(RunError::Setup(format!(
                "the seed relay exited ({status}) with {pending} rows pending; see {}",
                opts.out_dir.join("seed-relay.log").display()
            )));
        }
    };
    let duration_secs = started.elapsed().as_secs_f64();
    usage.sample(pid);
    let own: Vec<u32> = [pid].into_iter().chain(sink.pid()).collect();
    let machine = MachineState::between(&machine_before, &MachineSnapshot::take(), &own);
    let _ = child.kill().await;
    let sink_own_process = sink.pid().is_some();
    let seen = sink.finish().await?;
    Ok(BaselineReport {
        events: preload.events,
        published,
        dead,
        pending,
        received: seen.records.len(),
        duration_secs,
        throughput_per_sec: published as f64 / duration_secs,
        usage: usage.usage(),
        timed_out,
        environment: RunEnvironment {
            server,
            sink_own_process,
            sink_cpu_secs: seen.cpu_secs,
            machine,
        },
    })
}
