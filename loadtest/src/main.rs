//! The `loadtest` command: thin; each subcommand calls into the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use loadtest::producer::{self, EventMix, LoadSpec, PreloadSpec, Skew};
use loadtest::runner::{run_scenario, RunOptions};
use loadtest::scenario::{RelayUnderTest, Scenario};
use outbox_testkit::relay::RelayProgram;
use outbox_testkit::sink::{DeliveryConfig, FaultConfig, Sink, SinkConfig, DEV_TOKEN};

#[derive(Parser)]
#[command(
    name = "loadtest",
    about = "Load-test harness for outbox-relay: QStash-compatible sink, producers, scenarios"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The whole thing on its own: a throwaway PostgreSQL (unless DATABASE_URL is
    /// set), the sink in-process, the relay, a drain of a preloaded backlog, the report.
    Demo {
        /// Events to preload and drain.
        #[arg(long, default_value_t = 20_000)]
        events: u64,
        #[command(flatten)]
        target: Target,
    },
    /// Serve the QStash-compatible sink until Ctrl-C, then print its stats.
    Sink(SinkArgs),
    /// Insert events through the producer API at a rate (or flat out).
    Produce {
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
        /// Events per second; flat out when absent.
        #[arg(long)]
        rate: Option<f64>,
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        duration: Duration,
        #[arg(long)]
        max_events: Option<u64>,
        #[arg(long, default_value_t = 4)]
        connections: u32,
        #[arg(long, default_value_t = 10)]
        events_per_tx: u32,
        #[command(flatten)]
        mix: MixArgs,
    },
    /// The relay's claim and mark statements alone, no HTTP: drains the pending
    /// rows (after preloading --events, if given) and prints rows/s.
    SqlCeiling {
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
        /// Preload this many events first (binary COPY).
        #[arg(long, default_value_t = 0)]
        events: u64,
        #[arg(long, default_value_t = 500)]
        claim_batch: i64,
        #[arg(long)]
        json: bool,
    },
    /// Write a backlog with binary COPY.
    Preload {
        #[arg(long, env = "DATABASE_URL")]
        database_url: String,
        #[arg(long)]
        events: u64,
        #[arg(long, default_value_t = 2)]
        connections: u32,
        #[command(flatten)]
        mix: MixArgs,
    },
    /// Run a scenario file end to end (needs the relay binary).
    Run {
        scenario: PathBuf,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        keep_database: bool,
        #[arg(long)]
        no_progress: bool,
        /// A throwaway cluster with fsync, synchronous_commit and
        /// full_page_writes off even for a performance scenario (a labelled extra).
        #[arg(long)]
        fsync_off: bool,
    },
    /// Several relays side by side: each scenario run with each relay
    /// (`--relay seed`, `--relay NAME=PATH`), interleaved and repeated, on
    /// one cluster (durable, a throwaway one unless DATABASE_URL is set),
    /// each run with a fresh database and its own sink process; writes
    /// comparison.md and comparison.json.
    Compare(CompareArgs),
    /// An older release's relay delivering while this release's `migrate`
    /// runs, producers inserting; then the relays replaced as `migrate` says.
    /// Prints the steps and the longest delivery gap.
    RollingUpgrade {
        /// The older release's `outbox-relay` (built from an older commit).
        #[arg(long)]
        old_relay_bin: PathBuf,
        /// This release's relay; default: `outbox-relay` next to this binary.
        #[arg(long)]
        new_relay_bin: Option<PathBuf>,
        /// Server to create the run's database on; a throwaway cluster when absent.
        #[arg(long, env = "DATABASE_URL")]
        database_url: Option<String>,
        #[arg(long, default_value_t = 200.0)]
        rate: f64,
        #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
        warmup: Duration,
        /// `migrate --allow-live-older`: leave the older relay on the new schema.
        #[arg(long)]
        force: bool,
        /// With --force, how long the older relay runs on before it is replaced.
        #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
        replace_after: Duration,
        #[arg(long, default_value = "target/loadtest/rolling-upgrade")]
        out: PathBuf,
    },
    /// The relay engine in this process, as `outbox-relay migrate|run` runs it
    /// (what `--relay-bin embedded` starts as the child process).
    #[command(hide = true, name = "embedded-relay")]
    EmbeddedRelay {
        #[command(subcommand)]
        command: EmbeddedRelayCommand,
    },
}

#[derive(Subcommand)]
enum EmbeddedRelayCommand {
    /// `outbox-relay migrate`: the schema in DATABASE_URL.
    Migrate,
    /// `outbox-relay run --config <file>`: until SIGTERM or SIGINT.
    Run {
        #[arg(long)]
        config: PathBuf,
    },
}

#[derive(Args)]
struct CompareArgs {
    scenarios: Vec<PathBuf>,
    /// `seed` (the article's relay) or NAME=PATH of an `outbox-relay` binary; repeatable.
    #[arg(long = "relay", required = true)]
    relays: Vec<String>,
    #[arg(long, default_value_t = 2)]
    rounds: u32,
    /// The seed relay drains at most this many events of each drain scenario.
    #[arg(long)]
    seed_events: Option<u64>,
    /// The relay the ratios are taken against besides the seed; default:
    /// the first NAME=PATH given.
    #[arg(long)]
    before: Option<String>,
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// fsync, synchronous_commit and full_page_writes off (a labelled extra).
    #[arg(long)]
    fsync_off: bool,
    #[arg(long, default_value = "target/loadtest/compare")]
    out: PathBuf,
}

/// Where a run happens: its database server, the relay it drives, its files.
#[derive(Args)]
struct Target {
    /// Server to create the run's database on; a throwaway cluster when absent.
    #[arg(long, env = "DATABASE_URL")]
    database_url: Option<String>,
    /// The relay binary, or `embedded` for the relay engine built into this
    /// binary. Default: `demo` runs `embedded`; `run` runs `outbox-relay` next
    /// to this binary if it is at least as new as the library, else `embedded`.
    #[arg(long)]
    relay_bin: Option<PathBuf>,
    /// Where relay.toml, relay.log (relay-<i>.toml, relay-<i>.log per
    /// replica when the scenario runs several), report.json and report.svg go.
    #[arg(long, default_value = "target/loadtest")]
    out: PathBuf,
}

#[derive(Args)]
struct MixArgs {
    #[arg(long, default_value_t = 10)]
    tenants: u32,
    #[arg(long, default_value_t = 1000)]
    partition_keys: u32,
    /// Zipf exponent for key skew; uniform when absent.
    #[arg(long)]
    zipf: Option<f64>,
    #[arg(long, default_value_t = 0.0)]
    poison_fraction: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

impl MixArgs {
    fn mix(&self) -> EventMix {
        EventMix {
            tenants: self.tenants,
            partition_keys: self.partition_keys,
            skew: self.zipf.map_or(Skew::Uniform, Skew::Zipf),
            poison_fraction: self.poison_fraction,
            seed: self.seed,
        }
    }
}

#[derive(Args)]
struct SinkArgs {
    #[arg(long, default_value = "127.0.0.1:8080")]
    bind: SocketAddr,
    #[arg(long, env = "QSTASH_TOKEN", default_value = DEV_TOKEN)]
    token: String,
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    dedup_window: Duration,
    /// A TOML file of fault settings (keys of `FaultConfig`); the flags below override it.
    #[arg(long)]
    faults: Option<PathBuf>,
    #[arg(long)]
    server_error: Option<f64>,
    #[arg(long)]
    rate_limited: Option<f64>,
    #[arg(long)]
    hang: Option<f64>,
    #[arg(long)]
    reset: Option<f64>,
    #[arg(long)]
    lost_response: Option<f64>,
    #[arg(long)]
    element_error: Option<f64>,
    #[arg(long, value_parser = humantime::parse_duration)]
    latency: Option<Duration>,
    #[arg(long, value_parser = humantime::parse_duration)]
    jitter: Option<Duration>,
    /// An outbox id always rejected with 400 (repeatable).
    #[arg(long)]
    poison_id: Vec<i64>,
    #[arg(long)]
    seed: Option<u64>,
    /// Forward accepted messages to their (loopback) destinations, signed.
    #[arg(long)]
    deliver: bool,
    /// Write every record as JSON lines here on exit.
    #[arg(long)]
    records_out: Option<PathBuf>,
}

impl SinkArgs {
    fn config(&self) -> anyhow::Result<SinkConfig> {
        let mut f: FaultConfig = match &self.faults {
            Some(path) => toml::from_str(&std::fs::read_to_string(path)?)?,
            None => FaultConfig::default(),
        };
        let set = |dst: &mut f64, v: Option<f64>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        set(&mut f.server_error, self.server_error);
        set(&mut f.rate_limited, self.rate_limited);
        set(&mut f.hang, self.hang);
        set(&mut f.reset, self.reset);
        set(&mut f.lost_response, self.lost_response);
        set(&mut f.element_error, self.element_error);
        if let Some(l) = self.latency {
            f.latency = l;
        }
        if let Some(j) = self.jitter {
            f.jitter = j;
        }
        if let Some(s) = self.seed {
            f.seed = s;
        }
        f.poison_ids.extend(self.poison_id.iter().copied());
        Ok(SinkConfig {
            bind: self.bind,
            token: self.token.clone(),
            dedup_window: self.dedup_window,
            faults: f,
            delivery: self.deliver.then(DeliveryConfig::default),
            ..SinkConfig::default()
        })
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The embedded relay logs as `outbox-relay` does (OUTBOX_RELAY_LOG, info).
    let (var, default) = match cli.command {
        Command::EmbeddedRelay { .. } => ("OUTBOX_RELAY_LOG", "info"),
        _ => ("LOADTEST_LOG", "warn"),
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env(var)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(outbox_relay::cli::colour_on_stderr())
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command) -> anyhow::Result<ExitCode> {
    let tag = || uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    match command {
        Command::Sink(args) => {
            let sink = Sink::start(args.config()?).await?;
            println!("QSTASH_URL={}", sink.url());
            println!("QSTASH_TOKEN={}", sink.token());
            tokio::signal::ctrl_c().await?;
            let stats = sink.stats();
            if let Some(path) = &args.records_out {
                let mut out = String::new();
                for r in sink.records() {
                    out.push_str(&serde_json::to_string(&r)?);
                    out.push('\n');
                }
                std::fs::write(path, out)?;
            }
            sink.stop().await;
            println!("{}", serde_json::to_string_pretty(&stats)?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Produce {
            database_url,
            rate,
            duration,
            max_events,
            connections,
            events_per_tx,
            mix,
        } => {
            let spec = LoadSpec {
                rate,
                duration,
                max_events,
                connections,
                events_per_tx,
                synchronous_commit: false,
                mix: mix.mix(),
            };
            let stats = producer::produce(&database_url, &spec, &tag(), None, None).await?;
            println!(
                "{} events in {} transactions, {:.2} s ({:.0} events/s)",
                stats.events,
                stats.transactions,
                stats.elapsed_secs,
                stats.events_per_sec()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::SqlCeiling {
            database_url,
            events,
            claim_batch,
            json,
        } => {
            if events > 0 {
                let spec = PreloadSpec {
                    events,
                    ..PreloadSpec::default()
                };
                producer::preload(&database_url, &spec, &tag(), None).await?;
            }
            let ceiling = loadtest::ceiling::run(&database_url, claim_batch).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&ceiling)?);
            } else {
                println!(
                    "sql ceiling: {} rows claimed and marked in {:.2} s = {:.0} rows/s ({} shards, claim batch {}, {} statements)",
                    ceiling.rows,
                    ceiling.elapsed_secs,
                    ceiling.rows_per_sec,
                    ceiling.shards,
                    ceiling.claim_batch,
                    ceiling.statements
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Preload {
            database_url,
            events,
            connections,
            mix,
        } => {
            let spec = PreloadSpec {
                events,
                connections,
                mix: mix.mix(),
            };
            let stats = producer::preload(&database_url, &spec, &tag(), None).await?;
            println!(
                "{} rows copied in {:.2} s ({:.0} rows/s)",
                stats.events,
                stats.elapsed_secs,
                stats.events_per_sec()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Run {
            scenario,
            target:
                Target {
                    database_url,
                    relay_bin,
                    out,
                },
            keep_database,
            no_progress,
            fsync_off,
        } => {
            let scenario = Scenario::load(&scenario)?;
            let mut opts = RunOptions::new(out.join(&scenario.name));
            opts.database_url = database_url;
            opts.fsync_off = fsync_off;
            opts.keep_database = keep_database;
            opts.progress = !no_progress;
            if let Some(bin) = relay_bin {
                opts.relay = relay_program(bin)?;
            }
            run_and_report(&scenario, &opts).await
        }
        Command::Demo {
            events,
            target:
                Target {
                    database_url,
                    relay_bin,
                    out,
                },
        } => {
            let scenario = Scenario::from_toml_str(&demo_scenario(events))?;
            let mut opts = RunOptions::new(out.join(&scenario.name));
            opts.relay = match relay_bin {
                Some(bin) => relay_program(bin)?,
                None => RelayProgram::embedded(std::env::current_exe()?),
            };
            match &database_url {
                Some(url) => eprintln!("database server: {}", redact(url)),
                None => eprintln!(
                    "database server: a throwaway PostgreSQL cluster (initdb + pg_ctl; set DATABASE_URL to use yours)"
                ),
            }
            opts.database_url = database_url;
            eprintln!("draining {events} preloaded events ...");
            run_and_report(&scenario, &opts).await
        }
        Command::Compare(args) => {
            let command = std::env::args().collect::<Vec<_>>().join(" ");
            compare(args, &command).await
        }
        Command::RollingUpgrade {
            old_relay_bin,
            new_relay_bin,
            database_url,
            rate,
            warmup,
            force,
            replace_after,
            out,
        } => {
            anyhow::ensure!(
                old_relay_bin.is_file(),
                "no relay binary at {}",
                old_relay_bin.display()
            );
            let new_relay = match new_relay_bin {
                Some(bin) => relay_program(bin)?,
                None => relay_program(std::env::current_exe()?.with_file_name("outbox-relay"))?,
            };
            let opts = loadtest::rolling::RollingOptions {
                old_relay: old_relay_bin,
                new_relay,
                database_url,
                rate,
                warmup,
                after_refusal: Duration::from_secs(5),
                force,
                replace_after,
                settle: Duration::from_secs(15),
                out_dir: out,
            };
            let report = loadtest::rolling::run(&opts)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            print!("{}", report.summary());
            if let Some(refusal) = &report.refusal {
                println!("migrate said:\n{refusal}");
            }
            println!("report: {}", opts.out_dir.join("report.json").display());
            Ok(ExitCode::SUCCESS)
        }
        Command::EmbeddedRelay { command } => match command {
            EmbeddedRelayCommand::Migrate => {
                let config = outbox_relay::Config::load(None)?;
                let mut client = outbox_relay::store::connect(&config.database.url).await?;
                let report = outbox_relay::store::migrate::run(&mut client).await?;
                println!("applied migrations {:?}", report.applied);
                Ok(ExitCode::SUCCESS)
            }
            EmbeddedRelayCommand::Run { config } => {
                let config = outbox_relay::Config::load(Some(&config))?;
                outbox_relay::run_until_signal(config).await?;
                Ok(ExitCode::SUCCESS)
            }
        },
    }
}

/// Runs `scenario`, prints its table and where the report went; fails the
/// process when the run did not pass.
async fn run_and_report(scenario: &Scenario, opts: &RunOptions) -> anyhow::Result<ExitCode> {
    if scenario.relay == RelayUnderTest::Seed {
        let report = loadtest::baseline::run(scenario, opts).await?;
        print!("{}", report.table());
        return Ok(if report.passed() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    eprintln!("relay: {}", opts.relay.describe());
    let report = run_scenario(scenario, opts).await?;
    print!("{}", report.table());
    println!("report: {}", opts.out_dir.join("report.json").display());
    Ok(if report.passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `loadtest compare`: one cluster for every run, then the Markdown report.
async fn compare(args: CompareArgs, command: &str) -> anyhow::Result<ExitCode> {
    use loadtest::compare::{self, CompareOptions, Contender};
    let CompareArgs {
        scenarios,
        relays,
        rounds,
        seed_events,
        before,
        database_url,
        fsync_off,
        out,
    } = args;
    anyhow::ensure!(rounds >= 1, "--rounds: need at least 1");
    let scenarios = compare::load_scenarios(&scenarios)?;
    anyhow::ensure!(!scenarios.is_empty(), "name at least one scenario file");
    let contenders = relays
        .iter()
        .map(|r| Contender::parse(r))
        .collect::<Result<Vec<_>, _>>()
        .map_err(anyhow::Error::msg)?;
    let before = before.or_else(|| {
        contenders
            .iter()
            .find(|c| c.program.is_some())
            .map(|c| c.name.clone())
    });
    let mut run = RunOptions::new(&out);
    run.fsync_off = fsync_off;
    // One cluster for the whole comparison, sized for its largest scenario.
    let cluster = match &database_url {
        Some(url) => {
            run.database_url = Some(url.clone());
            None
        }
        None => {
            let biggest = scenarios
                .iter()
                .max_by_key(|s| s.expected_events())
                .expect("at least one scenario");
            let mut options = biggest.cluster_options(fsync_off);
            options.durable = !fsync_off;
            let cluster = tokio::task::spawn_blocking(move || {
                outbox_testkit::ThrowawayCluster::start_with(options)
            })
            .await??;
            run.database_url = Some(cluster.url());
            run.server_label = Some("the comparison's throwaway cluster".into());
            Some(cluster)
        }
    };
    let opts = CompareOptions {
        contenders,
        rounds,
        work_dir: out.clone(),
        seed_events,
        run,
    };
    let result = compare::run(&scenarios, &opts).await;
    drop(cluster);
    let comparison = result?;
    let md = comparison.markdown(before.as_deref(), command);
    std::fs::write(out.join("comparison.md"), &md)?;
    print!("{md}");
    Ok(if comparison.runs.iter().all(|r| r.passed) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `embedded`, or a path to an `outbox-relay` binary.
fn relay_program(bin: PathBuf) -> anyhow::Result<RelayProgram> {
    if bin.as_os_str() == "embedded" {
        return Ok(RelayProgram::embedded(std::env::current_exe()?));
    }
    anyhow::ensure!(bin.is_file(), "no relay binary at {}", bin.display());
    Ok(RelayProgram::binary(bin))
}

/// The URL without its password.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let userinfo = &url[s + 3..at];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{}{user}@{}", &url[..s + 3], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

/// A short drain: `events` preloaded with COPY, then the relay empties the outbox.
fn demo_scenario(events: u64) -> String {
    format!(
        r#"
name = "demo"
description = "{events} events preloaded; relay started; time until the outbox is empty"
kind = "drain"
ordering = "none"
drain_timeout = "10m"

[preload]
events = {events}
connections = 2
tenants = 10
partition_keys = 1000

[relay_config.relay]
claim_batch = 1000
max_in_flight = 10000
"#
    )
}
