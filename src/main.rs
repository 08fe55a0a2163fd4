//! The `outbox-relay` command: thin; each subcommand calls into the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use outbox_relay::config::Config;
use outbox_relay::db;

#[derive(Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Drains a PostgreSQL outbox table and publishes every event at least once to Upstash QStash or an HTTP endpoint.",
    long_about = None
)]
struct Cli {
    /// Log output: `human` for people, `json` for log pipelines.
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "human",
        env = "OUTBOX_RELAY_LOG_FORMAT"
    )]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Create or upgrade the schema in DATABASE_URL (safe to run from several replicas at once).
    Migrate {
        /// Config file; only `database.url` is read (DATABASE_URL overrides it).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Print the GRANTs for the application and relay roles instead of migrating.
        #[arg(long, requires_all = ["app_role", "relay_role"])]
        print_grants: bool,
        /// The application's role (enqueues only), for --print-grants.
        #[arg(long)]
        app_role: Option<String>,
        /// The relay's role (no DDL), for --print-grants.
        #[arg(long)]
        relay_role: Option<String>,
        /// The schema holding the outbox, for --print-grants.
        #[arg(long, default_value = "public")]
        schema: String,
    },
    /// Run the relay as a daemon until SIGTERM or SIGINT.
    Run {
        /// TOML config file (see config/relay.toml); every key can be set from the environment.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Run the relay until the backlog is empty (or --max-duration passes), print what it did, and exit 0. For cron-style deployments.
    Drain {
        #[arg(long)]
        config: Option<PathBuf>,
        /// Stop after this long even if rows are still pending (e.g. 5m).
        #[arg(long, value_parser = humantime::parse_duration)]
        max_duration: Option<std::time::Duration>,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Change how many shards the outbox is hashed into (stop the relays first; set relay.shards to match).
    Reshard {
        /// The new shard count (1-1024).
        shards: i32,
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Check a config file and the environment, print the effective config (secrets hidden), and exit.
    CheckConfig {
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Dead-lettered events: list, show, replay, purge.
    Dlq {
        #[command(subcommand)]
        cmd: outbox_relay::cli::dlq::DlqCommand,
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Backlog, lag, dead letters, throughput per minute and per event type.
    Stats(outbox_relay::cli::stats::StatsArgs),
    /// Delete old published outbox rows (and processed_messages) in small batches.
    Prune(outbox_relay::cli::prune::PruneArgs),
    /// Run a partitioned outbox: set it up, create partitions ahead, drop old ones.
    #[command(subcommand)]
    Partitions(outbox_relay::cli::prune::PartitionsCommand),
}

fn init_tracing(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_env("OUTBOX_RELAY_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
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
    match command {
        Command::Migrate {
            print_grants: true,
            app_role: Some(app),
            relay_role: Some(relay),
            schema,
            ..
        } => {
            print!("{}", db::migrate::grants(&app, &relay, &schema));
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate { config, .. } => {
            let config = Config::load(config.as_deref())?;
            let mut client = db::connect(&config.database.url).await?;
            let report = db::migrate::run(&mut client).await?;
            if report.applied.is_empty() {
                println!("schema is up to date ({} migrations)", report.already);
            } else {
                println!(
                    "applied migrations {:?} ({} were already applied)",
                    report.applied, report.already
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Run { config } => {
            let config = Config::load(config.as_deref())?;
            outbox_relay::run_until_signal(config).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Drain {
            config,
            max_duration,
            json,
        } => {
            let config = Config::load(config.as_deref())?;
            let report = outbox_relay::Relay::drain(config, max_duration).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!(
                    "published {}, retried {}, dead-lettered {} in {:.1}s{}",
                    report.counters.published,
                    report.counters.retried,
                    report.counters.dead_lettered,
                    report.elapsed_secs,
                    if report.timed_out {
                        format!(
                            "; stopped at --max-duration with {} still pending",
                            report.remaining
                        )
                    } else {
                        String::new()
                    }
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Reshard { shards, config } => {
            let config = Config::load(config.as_deref())?;
            let mut client = db::connect(&config.database.url).await?;
            let before = outbox_relay::ops::shards::shards(&client).await?;
            let rows = outbox_relay::ops::shards::reshard(&mut client, shards).await?;
            println!("resharded from {before} to {shards} shards ({rows} rows rewritten); set relay.shards = {shards}");
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckConfig { config } => {
            let config = Config::load(config.as_deref())?;
            println!("{}", serde_json::to_string_pretty(&config.redacted())?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Dlq { cmd, config } => {
            let config = Config::load(config.as_deref())?;
            outbox_relay::cli::dlq::run(cmd, &config).await
        }
        Command::Stats(args) => outbox_relay::cli::stats::run(args)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Prune(args) => outbox_relay::cli::prune::run_prune(args)
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Partitions(command) => outbox_relay::cli::prune::run_partitions(command)
            .await
            .map(|()| ExitCode::SUCCESS),
    }
}
