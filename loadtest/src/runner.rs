//! Runs one scenario end to end:
//!
//! 1. a fresh database: on the server given (`--database-url`), else on a
//!    throwaway cluster of our own (`outbox_testkit::ThrowawayCluster`);
//! 2. `outbox-relay migrate`;
//! 3. the in-process sink, with the scenario's faults; with `[sink.delivery]`
//!    also the final destination it delivers to;
//! 4. the relay's TOML config (one QStash route through the sink, to its
//!    `/hook` or to the final destination), written to the
//!    output directory: `relay.toml`, or `relay-<i>.toml` per replica when the
//!    scenario runs several (`replicas`), each with its own metrics port;
//! 5. preload (drain), then the relay child processes (one per replica, logs in
//!    `relay.log` / `relay-<i>.log`), sampled from `/proc`;
//! 6. producers (steady, chaos, poison), and for chaos the loop that kills and
//!    restarts random replicas, pauses (SIGSTOP) and continues them, and runs
//!    `pg_terminate_backend`, while they run; with `[relay_faults]`
//!    ([`crate::relay_faults`]) the relays reach the database through a
//!    proxy that blackholes their connections when told, and a second relay
//!    starts under replica 0's `relay.replica_id`;
//! 7. wait until the outbox has no pending row (bounded by `drain_timeout`);
//!    with `hold_snapshot`, a transaction holding vacuum back stays open from
//!    before the relays start until then;
//! 8. scrape each replica's `/metrics` once, SIGTERM every replica (each must
//!    exit 0); with `[vacuum_watch]`, watch the outbox's dead tuples until
//!    autovacuum reclaims them;
//! 9. with `[sink.delivery]`, wait for the deliveries to end and check each
//!    partition key's order at the final destination;
//! 10. verify, report (table, JSON, SVG).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{watch, Mutex};

use crate::adversarial::{self, ProgressSample};
use crate::environment::{MachineSnapshot, MachineState, RunEnvironment, ServerSettings};
use crate::metrics::ReplicaMetrics;
use crate::procstat::UsageTracker;
use crate::producer::{self, ProduceProgress, ProduceStats, APPLICATION_NAME};
use crate::relay_faults::{self, Twin};
use crate::report::{latency_after, ChaosStats, DeadTuplePoint, Report, ReportInput, VacuumReport};
use crate::scenario::{
    replica_config_toml, ChaosSpec, ReplicaPorts, Scenario, ScenarioKind, VacuumWatchSpec,
};
use crate::sink_process::{RunSink, SinkProcess, SinkResult};
use crate::verify::{load_rows, verify, verify_rows, VerifyOptions};
use outbox_testkit::proxy::Proxy;
use outbox_testkit::relay::{Output, RelayCommand, RelayError, RelayProcess, RelayProgram};
use outbox_testkit::sink::{check_order, undelivered, Destination, Sink, SinkConfig};

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Scenario(#[from] crate::scenario::ScenarioError),
    #[error(transparent)]
    Relay(#[from] RelayError),
    #[error(transparent)]
    Produce(#[from] producer::ProduceError),
    #[error("database: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

fn setup(context: &str) -> impl Fn(&dyn std::fmt::Display) -> RunError + '_ {
    move |e| RunError::Setup(format!("{context}: {e}"))
}

/// How to run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// A server to create the run's database on; a throwaway cluster when `None`.
    pub database_url: Option<String>,
    /// The relay under test.
    pub relay: RelayProgram,
    /// `relay.toml`, `relay.log`, `report.json`, `report.svg` go here.
    pub out_dir: PathBuf,
    /// Leave the run's database in place (its URL is printed).
    pub keep_database: bool,
    pub progress: bool,
    /// The relay must exit within this long of SIGTERM.
    pub relay_stop_timeout: Duration,
    /// A throwaway cluster with fsync, synchronous_commit and
    /// full_page_writes off even for a performance scenario (a labelled extra).
    pub fsync_off: bool,
    /// The `loadtest` binary that runs the sink in its own process; the sink
    /// runs in this process when `None`.
    pub sink_bin: Option<PathBuf>,
    /// What the server given is, for the report (e.g. the comparison's own cluster).
    pub server_label: Option<String>,
}

impl RunOptions {
    pub fn new(out_dir: impl Into<PathBuf>) -> Self {
        RunOptions {
            database_url: None,
            relay: outbox_testkit::relay::locate_relay(
                &std::env::current_exe().unwrap_or_default(),
                outbox_testkit::relay::compiled_sources().as_deref(),
            ),
            out_dir: out_dir.into(),
            keep_database: false,
            progress: true,
            relay_stop_timeout: Duration::from_secs(30),
            fsync_off: false,
            sink_bin: crate::sink_process::locate_sink_bin(),
            server_label: None,
        }
    }
}

/// The run's own database, and the cluster under it when we started one.
pub struct RunDatabase {
    pub url: String,
    pub name: String,
    server_url: String,
    cluster: Option<outbox_testkit::ThrowawayCluster>,
}

impl RunDatabase {
    /// A fresh, empty database on `server_url`, or on a new throwaway
    /// cluster started with `cluster`.
    pub async fn create(
        server_url: Option<&str>,
        cluster: outbox_testkit::ClusterOptions,
    ) -> Result<RunDatabase, RunError> {
        let (server_url, cluster) = match server_url {
            Some(url) => (url.to_owned(), None),
            None => {
                let cluster = tokio::task::spawn_blocking(move || {
                    outbox_testkit::ThrowawayCluster::start_with(cluster)
                })
                .await
                .map_err(|e| setup("throwaway cluster")(&e))?
                .map_err(|e| setup("throwaway cluster")(&e))?;
                (cluster.url(), Some(cluster))
            }
        };
        let name = format!("loadtest_{}", uuid::Uuid::new_v4().simple());
        let admin = outbox_relay::store::connect(&server_url)
            .await
            .map_err(|e| setup("connect to the database server")(&e))?;
        // A generated identifier, not input: CREATE DATABASE takes no parameters.
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await?;
        Ok(RunDatabase {
            url: outbox_testkit::url_with_dbname(&server_url, &name),
            name,
            server_url,
            cluster,
        })
    }

    /// Its server's durability settings, and what the server is: `label`,
    /// else whether we started it.
    pub async fn server_settings(&self, label: Option<&str>) -> Result<ServerSettings, RunError> {
        let client = producer::connect(&self.url).await?;
        let source = match (label, &self.cluster) {
            (Some(label), _) => label,
            (None, Some(_)) => "a throwaway cluster of the run's own",
            (None, None) => "the server given (DATABASE_URL)",
        };
        Ok(ServerSettings::read(&client, source).await?)
    }

    /// Drops the database (and stops our cluster, if any).
    pub async fn drop_database(self) -> Result<(), RunError> {
        if self.cluster.is_none() {
            let admin = outbox_relay::store::connect(&self.server_url)
                .await
                .map_err(|e| setup("connect to the database server")(&e))?;
            admin
                .batch_execute(&format!(
                    "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                    self.name
                ))
                .await?;
        }
        Ok(())
    }
}

fn now_us() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

/// `n` distinct free loopback ports for the replicas' metrics listeners,
/// below the ephemeral range when possible: a killed replica restarts on its
/// port, and an outgoing connection must not have taken it meanwhile.
fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let mut rng = StdRng::from_os_rng();
    let mut held = Vec::with_capacity(n);
    let mut ports = Vec::with_capacity(n);
    let mut tries = 0;
    while ports.len() < n {
        tries += 1;
        let candidate = if ephemeral_low > 12000 && tries <= 1000 {
            rng.random_range(10000..ephemeral_low)
        } else {
            0
        };
        let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", candidate)) else {
            continue;
        };
        let port = l.local_addr()?.port();
        if !ports.contains(&port) {
            ports.push(port);
            held.push(l);
        }
    }
    Ok(ports)
}

/// Is any row left to deliver? One probe of the pending index, not a count:
/// the drain loop asks five times a second, and counting a large backlog
/// that often took PostgreSQL time from the relay it measures.
const ANY_PENDING: &str =
    "SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL AND dead_lettered_at IS NULL)";
/// The highest id in the outbox (0 when empty).
const LAST_ID: &str = "SELECT coalesce(max(id), 0) FROM outbox";

const DEAD_TUPLES: &str =
    "SELECT coalesce(max(n_dead_tup), 0) FROM pg_stat_user_tables WHERE relname = 'outbox'";
const TABLE_STATS: &str = "SELECT coalesce(max(n_dead_tup), 0), coalesce(max(n_live_tup), 0),
       coalesce(max(autovacuum_count), 0)
FROM pg_stat_user_tables WHERE relname = 'outbox'";
/// A snapshot and an xid: vacuum keeps every row version deleted after it.
const HOLD_SNAPSHOT: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ;
SELECT txid_current();
SELECT count(*) FROM outbox_relay_settings;";

async fn table_stats(
    client: &tokio_postgres::Client,
    origin_us: i64,
) -> Result<DeadTuplePoint, RunError> {
    let row = client.query_one(TABLE_STATS, &[]).await?;
    Ok(DeadTuplePoint {
        secs: (now_us() - origin_us).max(0) as f64 / 1e6,
        n_dead_tup: row.get(0),
        n_live_tup: row.get(1),
        autovacuum_count: row.get(2),
    })
}

/// Samples the outbox's table statistics every second until `stop`.
fn sample_table_stats(
    client: tokio_postgres::Client,
    origin_us: i64,
    samples: Arc<StdMutex<Vec<DeadTuplePoint>>>,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<tokio_postgres::Client> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            match table_stats(&client, origin_us).await {
                Ok(p) => samples.lock().expect("samples lock").push(p),
                Err(e) => tracing::warn!(error = %e, "table statistics"),
            }
        }
        client
    })
}

/// After the drain: until `n_dead_tup` is under the threshold or the watch
/// ends. Returns the seconds after `drain_end` it took.
async fn watch_dead_tuples(
    client: &tokio_postgres::Client,
    spec: &VacuumWatchSpec,
    origin_us: i64,
    drain_end: Instant,
    samples: &StdMutex<Vec<DeadTuplePoint>>,
) -> Result<Option<f64>, RunError> {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let p = table_stats(client, origin_us).await?;
        samples.lock().expect("samples lock").push(p);
        if p.n_dead_tup < spec.dead_tuples_below {
            return Ok(Some(drain_end.elapsed().as_secs_f64()));
        }
        if drain_end.elapsed() >= spec.duration {
            return Ok(None);
        }
    }
}

/// Samples settled and pending rows of each route every
/// [`adversarial::SAMPLE_EVERY`] until `stop`.
fn sample_progress(
    client: tokio_postgres::Client,
    query: String,
    samples: Arc<StdMutex<Vec<ProgressSample>>>,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(adversarial::SAMPLE_EVERY);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            match client.query(&query, &[]).await {
                Ok(rows) => {
                    let routes = rows.iter().map(|r| (r.get(0), r.get(1), r.get(2)));
                    let sample = crate::progress::sample(now_us(), routes);
                    samples.lock().expect("samples lock").push(sample);
                }
                Err(e) => tracing::warn!(error = %e, "progress sample"),
            }
        }
    })
}

/// Every client backend of this database but the harness's own.
const TERMINATE_RELAY_BACKENDS: &str = "SELECT count(pg_terminate_backend(pid))
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND backend_type = 'client backend' AND application_name <> $1";

/// One relay replica: its command (config file with its own metrics port,
/// its own log) and the process chaos swaps in and out.
struct Replica {
    index: u32,
    cmd: RelayCommand,
    metrics_port: u16,
    process: Mutex<Option<RelayProcess>>,
    pid: AtomicU32,
}

impl Replica {
    async fn start(&self) -> Result<(), RunError> {
        let p = self.cmd.spawn()?;
        self.pid.store(p.pid(), Ordering::Relaxed);
        *self.process.lock().await = Some(p);
        Ok(())
    }

    async fn take(&self) -> Option<RelayProcess> {
        self.pid.store(0, Ordering::Relaxed);
        self.process.lock().await.take()
    }

    /// `Some(status)` when its process exited without us stopping it.
    async fn exited(&self) -> Option<std::process::ExitStatus> {
        self.process.lock().await.as_mut().and_then(|p| p.exited())
    }
}

/// `relay.toml` / `relay.log` with one replica, `relay-<i>.toml` / `relay-<i>.log` with several.
pub fn replica_file_name(stem: &str, ext: &str, replica: u32, replicas: u32) -> String {
    if replicas == 1 {
        format!("{stem}.{ext}")
    } else {
        format!("{stem}-{replica}.{ext}")
    }
}

/// Runs `scenario`; the report says whether it passed.
pub async fn run_scenario(scenario: &Scenario, opts: &RunOptions) -> Result<Report, RunError> {
    scenario.validate()?;
    std::fs::create_dir_all(&opts.out_dir)?;
    let db = RunDatabase::create(
        opts.database_url.as_deref(),
        scenario.cluster_options(opts.fsync_off),
    )
    .await?;
    let result = run_on(scenario, opts, &db).await;
    if opts.keep_database {
        eprintln!("database kept: {}", db.url);
    } else if let Err(e) = db.drop_database().await {
        tracing::warn!(error = %e, "could not drop the run's database");
    }
    result
}

async fn run_on(s: &Scenario, opts: &RunOptions, db: &RunDatabase) -> Result<Report, RunError> {
    let run_tag = format!(
        "{}-{}",
        s.name,
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let admin = producer::connect(&db.url).await?;
    let server = db.server_settings(opts.server_label.as_deref()).await?;

    // Delivery mode: the final destination the sink delivers to.
    let destination = match &s.sink.delivery {
        Some(d) => Some(
            Destination::start(d.destination())
                .await
                .map_err(|e| setup("destination")(&e))?,
        ),
        None => None,
    };
    let sink = match (&opts.sink_bin, s.sink_in_own_process()) {
        (Some(bin), true) => RunSink::Process(Box::new(
            SinkProcess::start(bin, s.sink.dedup_window, &opts.out_dir.join("sink.log")).await?,
        )),
        _ => RunSink::InProcess(
            Sink::start(SinkConfig {
                dedup_window: s.sink.dedup_window,
                faults: s.sink.faults.clone(),
                delivery: s.sink.delivery.as_ref().map(|d| d.delivery()),
                ..SinkConfig::default()
            })
            .await
            .map_err(|e| setup("sink")(&e))?,
        ),
    };
    let route_destination = match &destination {
        Some(d) => format!("{}/events", d.url()),
        None => format!("{}/hook", sink.url()),
    };
    let faults = s.relay_faults.clone().unwrap_or_default();
    let proxy = if faults.needs_proxy() {
        let p = Proxy::in_front_of(&db.url)
            .await
            .map_err(|e| setup("database proxy")(&e))?;
        Some(Arc::new(p))
    } else {
        None
    };
    let relay_db_url = proxy
        .as_ref()
        .map_or_else(|| db.url.clone(), |p| p.url().to_owned());
    let mut replicas = Vec::with_capacity(s.replicas as usize);
    let mut lease = Duration::ZERO;
    let callback_ports = if s.takes_callbacks() {
        free_ports(s.replicas as usize)?
            .into_iter()
            .map(Some)
            .collect()
    } else {
        vec![None; s.replicas as usize]
    };
    // One more metrics port than replicas, for a twin.
    let mut metrics_ports = free_ports(s.replicas as usize + 1)?;
    let twin_port = metrics_ports.pop().expect("one port more");
    for ((i, port), callback) in (0..s.replicas).zip(metrics_ports).zip(callback_ports) {
        let config = opts
            .out_dir
            .join(replica_file_name("relay", "toml", i, s.replicas));
        let ports = ReplicaPorts {
            metrics: port,
            callback,
        };
        let text = replica_config_toml(s, sink.port(), &route_destination, ports, i)?;
        let parsed: outbox_relay::Config =
            toml::from_str(&text).map_err(|e| setup("relay config")(&e))?;
        lease = lease.max(parsed.relay.lease);
        std::fs::write(&config, text)?;
        let log = opts
            .out_dir
            .join(replica_file_name("relay", "log", i, s.replicas));
        let cmd = RelayCommand::new(&opts.relay, config)
            .env("DATABASE_URL", &relay_db_url)
            .env("QSTASH_URL", sink.url())
            .env("QSTASH_TOKEN", sink.token())
            .output(Output::Append(log.clone()), Output::Append(log));
        replicas.push(Replica {
            index: i,
            cmd,
            metrics_port: port,
            process: Mutex::new(None),
            pid: AtomicU32::new(0),
        });
    }
    let replicas = Arc::new(replicas);
    replicas[0].cmd.migrate().await?;
    let twin = match faults.twin {
        Some(_) => {
            let ports = ReplicaPorts {
                metrics: twin_port,
                callback: None,
            };
            let text = replica_config_toml(s, sink.port(), &route_destination, ports, 0)?;
            let config = opts.out_dir.join("relay-twin.toml");
            std::fs::write(&config, text)?;
            let log = opts.out_dir.join("relay-twin.log");
            let cmd = RelayCommand::new(&opts.relay, config)
                .env("DATABASE_URL", &relay_db_url)
                .env("QSTASH_URL", sink.url())
                .env("QSTASH_TOKEN", sink.token())
                .output(Output::Append(log.clone()), Output::Append(log.clone()));
            Some(Twin { cmd, log })
        }
        None => None,
    };

    let bar = if opts.progress {
        let expected = s.expected_events();
        let bar = ProgressBar::new(expected.max(1));
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} received  {msg}",
            )
            .expect("static template"),
        );
        bar
    } else {
        ProgressBar::hidden()
    };

    let progress = Arc::new(ProduceProgress::default());
    let mut produced = ProduceStats::default();
    // The preload's last id, when a load follows it: the load's events are
    // the rows after it.
    let mut preloaded_through: Option<i64> = None;
    if let Some(p) = &s.preload {
        bar.set_message("preloading");
        produced = producer::preload(&db.url, p, &run_tag, Some(Arc::clone(&progress))).await?;
        let client = producer::connect(&db.url).await?;
        preloaded_through = Some(client.query_one(LAST_ID, &[]).await?.get(0));
    }

    // Opened before the relays start: nothing they write can be vacuumed away
    // until this commits (at the drain's end).
    let held = if s.hold_snapshot {
        let client = producer::connect(&db.url).await?;
        client.batch_execute(HOLD_SNAPSHOT).await?;
        Some(client)
    } else {
        None
    };
    let watch_vacuum = s.hold_snapshot || s.vacuum_watch.is_some();

    // The relays, their /proc sampler and the progress ticker.
    let machine_before = MachineSnapshot::take();
    let origin_us = now_us();
    for r in replicas.iter() {
        r.start().await?;
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let table_samples = Arc::new(StdMutex::new(Vec::new()));
    let (stats_stop_tx, stats_stop_rx) = watch::channel(false);
    let stats_sampler = if watch_vacuum {
        let client = producer::connect(&db.url).await?;
        let first = table_stats(&client, origin_us).await?;
        table_samples.lock().expect("samples lock").push(first);
        Some(sample_table_stats(
            client,
            origin_us,
            Arc::clone(&table_samples),
            stats_stop_rx,
        ))
    } else {
        None
    };
    let usage = Arc::new(StdMutex::new(UsageTracker::default()));
    let sampler = {
        let replicas = Arc::clone(&replicas);
        let usage = Arc::clone(&usage);
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop.wait_for(|s| *s) => break,
                }
                for r in replicas.iter() {
                    let pid = r.pid.load(Ordering::Relaxed);
                    if pid != 0 {
                        usage.lock().expect("usage lock").sample(pid);
                    }
                }
            }
        })
    };
    let adversarial = s.kind == ScenarioKind::Adversarial;
    let progress_samples = Arc::new(StdMutex::new(Vec::new()));
    let progress_sampler = if adversarial {
        let client = producer::connect(&db.url).await?;
        Some(sample_progress(
            client,
            crate::progress::progress_query(s.second_route.as_ref()),
            Arc::clone(&progress_samples),
            stop_rx.clone(),
        ))
    } else {
        None
    };
    // Chaos lasts as long as the load; the drain after it runs undisturbed.
    let (chaos_tx, chaos_rx) = watch::channel(false);
    let chaos = match (&s.kind, &s.chaos) {
        (ScenarioKind::Chaos, Some(spec)) => Some(tokio::spawn(chaos_loop(
            spec.clone(),
            Arc::clone(&replicas),
            db.url.clone(),
            chaos_rx,
        ))),
        _ => None,
    };

    let mut failures = Vec::new();
    let mut twin = twin;
    let mut relay_faults_task = None;
    if let Some(load) = &s.load {
        bar.set_message("producing");
        // The outage schedule counts from the start of the load.
        if let Some(h) = sink.in_process() {
            h.start_outages();
        }
        if faults != Default::default() {
            relay_faults_task = Some(tokio::spawn(relay_faults::play(
                faults.clone(),
                proxy.clone(),
                twin.take(),
                Instant::now(),
                origin_us,
            )));
        }
        let producing = producer::produce(
            &db.url,
            load,
            &run_tag,
            Some(Arc::clone(&progress)),
            Some(stop_rx.clone()),
        );
        tokio::pin!(producing);
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let stats = loop {
            tokio::select! {
                r = &mut producing => break r?,
                _ = tick.tick() => bar.set_position(sink.record_count() as u64),
            }
        };
        produced.events += stats.events;
        produced.transactions += stats.transactions;
        produced.poison += stats.poison;
        produced.elapsed_secs += stats.elapsed_secs;
    }

    chaos_tx.send_replace(true);
    let chaos_stats = match chaos {
        Some(task) => Some(task.await.map_err(|e| setup("chaos task")(&e))??),
        None => None,
    };

    // Wait for the outbox to empty (polling a condition, bounded).
    bar.set_message("draining");
    let deadline = Instant::now() + s.drain_timeout;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    loop {
        tick.tick().await;
        bar.set_position(sink.record_count() as u64);
        let pending: bool = admin.query_one(ANY_PENDING, &[]).await?.get(0);
        if !pending {
            break;
        }
        let mut exited = false;
        for r in replicas.iter() {
            if let Some(status) = r.exited().await {
                failures.push(format!(
                    "relay replica {} exited on its own with {status}",
                    r.index
                ));
                exited = true;
            }
        }
        if exited {
            break;
        }
        if Instant::now() >= deadline {
            failures.push(format!(
                "{pending} events still pending after drain_timeout ({})",
                humantime::format_duration(s.drain_timeout)
            ));
            break;
        }
    }
    bar.finish_and_clear();
    let mut own_pids: Vec<u32> = replicas
        .iter()
        .map(|r| r.pid.load(Ordering::Relaxed))
        .collect();
    own_pids.extend(sink.pid());
    let machine = MachineState::between(&machine_before, &MachineSnapshot::take(), &own_pids);
    let drain_end = Instant::now();
    let drain_end_secs = (now_us() - origin_us).max(0) as f64 / 1e6;
    if let Some(held) = held {
        held.batch_execute("COMMIT").await?;
    }

    let mut relay_faults_report = match relay_faults_task {
        Some(task) => Some(task.await.map_err(|e| setup("relay faults task")(&e))?),
        None => None,
    };
    stop_tx.send_replace(true);
    let _ = sampler.await;
    if let Some(task) = progress_sampler {
        let _ = task.await;
    }
    // One scrape of each replica's /metrics, then SIGTERM them all at once.
    let replica_metrics = futures_util::future::join_all(replicas.iter().map(|r| async move {
        let text = crate::metrics::scrape(r.metrics_port, Duration::from_secs(3)).await;
        ReplicaMetrics::from_scrape(r.index, r.metrics_port, text.as_deref())
    }))
    .await;
    let stops = futures_util::future::join_all(replicas.iter().map(|r| async move {
        match r.take().await {
            Some(p) => p
                .terminate(opts.relay_stop_timeout)
                .await
                .err()
                .map(|e| format!("relay replica {}: {e}", r.index)),
            None => None,
        }
    }))
    .await;
    failures.extend(stops.into_iter().flatten());

    let vacuum = match stats_sampler {
        Some(task) => {
            stats_stop_tx.send_replace(true);
            let client = task.await.map_err(|e| setup("table statistics task")(&e))?;
            let at_end = table_stats(&client, origin_us).await?;
            let spec = s.vacuum_watch.clone().unwrap_or_default();
            let secs_until_below = match &s.vacuum_watch {
                Some(spec) => {
                    watch_dead_tuples(&client, spec, origin_us, drain_end, &table_samples).await?
                }
                None => None,
            };
            let samples = std::mem::take(&mut *table_samples.lock().expect("samples lock"));
            let count_at = |secs: f64| {
                samples
                    .iter()
                    .filter(|p| p.secs <= secs)
                    .map(|p| p.autovacuum_count)
                    .max()
            };
            let first = samples.first().map_or(0, |p| p.autovacuum_count);
            let at_drain_end = count_at(drain_end_secs).unwrap_or(first);
            let last = samples
                .iter()
                .map(|p| p.autovacuum_count)
                .max()
                .unwrap_or(0);
            Some(VacuumReport {
                held_snapshot: s.hold_snapshot,
                dead_tuples_below: spec.dead_tuples_below,
                drain_end_secs,
                dead_tuples_at_drain_end: at_end.n_dead_tup,
                peak_dead_tuples: samples.iter().map(|p| p.n_dead_tup).max().unwrap_or(0),
                secs_until_below,
                autovacuums_during_drain: at_drain_end - first,
                autovacuums_after_drain: last - at_drain_end,
                samples,
            })
        }
        None => None,
    };

    // Delivery mode: the deliveries (and their retries) still under way end
    // before the destination is checked.
    let destination_report = match (&destination, &s.sink.delivery, sink.in_process()) {
        (Some(dest), Some(spec), Some(sink)) => {
            let fresh = sink.records().iter().filter(|r| !r.deduplicated).count();
            if !sink.wait_for_deliveries(fresh, spec.settle_timeout).await {
                failures.push(format!(
                    "{} of {fresh} deliveries still under way after settle_timeout ({})",
                    fresh - sink.deliveries().len().min(fresh),
                    humantime::format_duration(spec.settle_timeout)
                ));
            }
            let calls = dest.calls();
            let gaps = undelivered(&sink.records(), &sink.deliveries(), &calls);
            if gaps.missing > 0 {
                failures.push(format!(
                    "{} of {} accepted events never reached the destination with a 2xx: {}",
                    gaps.missing,
                    gaps.accepted,
                    gaps.examples.join("; ")
                ));
            }
            let checked = check_order(&calls, s.ordered().then_some(1));
            if s.ordered() && spec.check_order && checked.out_of_order > 0 {
                failures.push(format!(
                    "{} events reached the destination out of order in {} keys: {}",
                    checked.out_of_order,
                    checked.out_of_order_keys,
                    checked.examples.join("; ")
                ));
            }
            if checked.over_parallelism_keys > 0 {
                failures.push(format!(
                    "{} keys had more calls in flight at the destination than parallelism 1",
                    checked.over_parallelism_keys
                ));
            }
            Some(checked)
        }
        _ => None,
    };
    let sink_port = sink.port();
    let sink_own_process = sink.pid().is_some();
    let SinkResult {
        records,
        stats: sink_stats,
        answers,
        outages,
        cpu_secs: sink_cpu_secs,
    } = sink.finish().await?;
    if let Some(dest) = destination {
        dest.stop().await;
    }
    let mut opts_verify = VerifyOptions {
        ordered: s.ordered(),
        poison_ids: s.sink.faults.poison_ids.clone(),
        poison_marker: s.sink.faults.poison_marker,
        may_dead_letter: Default::default(),
        unordered_destinations: s
            .second_route
            .iter()
            .filter(|r| !r.ordering.per_key())
            .map(|r| r.destination(sink_port))
            .collect(),
    };
    let (verification, rows, adversarial_report) = if adversarial {
        let rows = load_rows(&admin).await?;
        let dead_lettered_at: Vec<(i64, i64)> = admin
            .query(adversarial::DEAD_LETTERED_AT, &[])
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let samples = std::mem::take(&mut *progress_samples.lock().expect("samples lock"));
        if let Some(r) = relay_faults_report.as_mut() {
            for b in &mut r.blackholes {
                b.resumed_after_secs = crate::progress::resumed_after(&samples, b.at_us);
            }
        }
        let checked = adversarial::check(&adversarial::CheckInput {
            rows: &rows,
            dead_lettered_at: &dead_lettered_at,
            answers: &answers,
            outages: &outages,
            samples: &samples,
            lease,
            origin_us,
        });
        opts_verify.may_dead_letter = adversarial::justified(&checked);
        (
            verify_rows(&rows, &records, &opts_verify),
            rows,
            Some(checked),
        )
    } else {
        let (v, rows) = verify(&admin, &records, &opts_verify).await?;
        (v, rows, None)
    };
    let dead_tuples: i64 = admin.query_one(DEAD_TUPLES, &[]).await?.get(0);
    let relay_usage = usage.lock().expect("usage lock").usage();
    let mut report = Report::build(ReportInput {
        scenario: &s.name,
        origin_us,
        rows: &rows,
        records: &records,
        relay: relay_usage,
        outbox_dead_tuples: dead_tuples,
        produced,
        sink: sink_stats,
        verification,
    });
    report.chaos = chaos_stats;
    report.replicas = s.replicas;
    if s.load.is_some() {
        report.load_latency = preloaded_through.map(|after| latency_after(&rows, &records, after));
    }
    report.replica_metrics = replica_metrics;
    report.vacuum = vacuum;
    report.destination = destination_report;
    report.environment = Some(RunEnvironment {
        server,
        sink_own_process,
        sink_cpu_secs,
        machine,
    });
    if let Some(a) = adversarial_report {
        failures.extend(a.failures());
        report.adversarial = Some(a);
    }
    if let Some(r) = relay_faults_report {
        failures.extend(r.failures());
        report.relay_faults = Some(r);
    }
    if !failures.is_empty() {
        report.failures.extend(failures);
        report.passed = false;
    }
    report.write_json(&opts.out_dir.join("report.json"))?;
    report.write_svg(&opts.out_dir.join("report.svg"))?;
    Ok(report)
}

/// Chaos's view of one replica.
#[derive(Debug, Clone, Copy, Default)]
struct ReplicaChaosState {
    /// Killed; started again at this instant.
    restart_at: Option<Instant>,
    /// SIGSTOPped at `.0`; SIGCONT at `.1`.
    paused: Option<(Instant, Instant)>,
}

fn draw(rng: &mut StdRng, (lo, hi): (Duration, Duration)) -> Duration {
    Duration::from_millis(rng.random_range(lo.as_millis() as u64..=hi.as_millis() as u64))
}

/// Until `stop`: SIGKILLs a random replica and restarts it `restart_after`
/// later, SIGSTOPs a random running replica and SIGCONTs it `pause_for` later,
/// and cuts every relay backend. A paused replica is continued before it is
/// killed. A replica that exits on its own is counted and restarted, as a
/// process supervisor would. Returns with every replica running, none stopped.
async fn chaos_loop(
    spec: ChaosSpec,
    replicas: Arc<Vec<Replica>>,
    db_url: String,
    mut stop: watch::Receiver<bool>,
) -> Result<ChaosStats, RunError> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let mut stats = ChaosStats::new(replicas.len() as u32);
    let mut state = vec![ReplicaChaosState::default(); replicas.len()];
    let admin = producer::connect(&db_url).await?;
    let mut next_kill = Instant::now() + draw(&mut rng, (spec.kill_every_min, spec.kill_every_max));
    let mut next_pause = spec
        .pause_every()
        .map(|range| Instant::now() + draw(&mut rng, range));
    let mut next_cut = spec.terminate_backends_every.map(|d| Instant::now() + d);
    let result = async {
        loop {
            let wake = [Some(next_kill), next_pause, next_cut]
                .into_iter()
                .chain(state.iter().map(|s| s.restart_at))
                .chain(state.iter().map(|s| s.paused.map(|(_, until)| until)))
                .flatten()
                .min()
                .expect("next_kill is always set");
            tokio::select! {
                _ = tokio::time::sleep_until(wake.into()) => {}
                _ = stop.wait_for(|s| *s) => break,
            }
            let now = Instant::now();
            for (i, r) in replicas.iter().enumerate() {
                if let Some((since, until)) = state[i].paused {
                    if now >= until {
                        if let Some(p) = r.process.lock().await.as_ref() {
                            p.resume();
                        }
                        state[i].paused = None;
                        stats.record_pause(i, now - since);
                    }
                }
                if state[i].restart_at.is_some_and(|at| now >= at) {
                    r.start().await?;
                    state[i].restart_at = None;
                }
                if let Some(status) = r.exited().await {
                    tracing::warn!(replica = i, %status, "relay replica exited on its own; restarting it");
                    stats.record_exit(i, status);
                    r.take().await;
                    r.start().await?;
                }
            }
            if now >= next_kill {
                let running: Vec<usize> = (0..replicas.len())
                    .filter(|&i| state[i].restart_at.is_none())
                    .collect();
                if !running.is_empty() {
                    let i = running[rng.random_range(0..running.len())];
                    if let Some((since, _)) = state[i].paused.take() {
                        stats.record_pause(i, now - since);
                    }
                    if let Some(p) = replicas[i].take().await {
                        // kill() continues a paused process before SIGKILL.
                        p.kill().await?;
                        stats.record_kill(i);
                    }
                    state[i].restart_at = Some(Instant::now() + spec.restart_after);
                }
                next_kill = now + draw(&mut rng, (spec.kill_every_min, spec.kill_every_max));
            }
            if let (Some(at), Some(every)) = (next_pause, spec.pause_every()) {
                if now >= at {
                    let candidates: Vec<usize> = (0..replicas.len())
                        .filter(|&i| state[i].restart_at.is_none() && state[i].paused.is_none())
                        .collect();
                    if !candidates.is_empty() {
                        let i = candidates[rng.random_range(0..candidates.len())];
                        if let Some(p) = replicas[i].process.lock().await.as_ref() {
                            p.pause();
                            state[i].paused =
                                Some((now, now + draw(&mut rng, spec.pause_for_range())));
                        }
                    }
                    next_pause = Some(now + draw(&mut rng, every));
                }
            }
            if let (Some(cut), Some(every)) = (next_cut, spec.terminate_backends_every) {
                if now >= cut {
                    let n: i64 = admin
                        .query_one(TERMINATE_RELAY_BACKENDS, &[&APPLICATION_NAME])
                        .await?
                        .get(0);
                    stats.backends_terminated += n as u64;
                    next_cut = Some(now + every);
                }
            }
        }
        Ok::<(), RunError>(())
    }
    .await;
    // Whatever happened: continue every paused replica, start every killed one.
    let now = Instant::now();
    for (i, r) in replicas.iter().enumerate() {
        if let Some((since, _)) = state[i].paused.take() {
            if let Some(p) = r.process.lock().await.as_ref() {
                p.resume();
            }
            stats.record_pause(i, now - since);
        }
        if r.process.lock().await.is_none() {
            r.start().await?;
        }
    }
    result?;
    Ok(stats)
}
