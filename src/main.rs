//! The `outbox-relay` command: thin; each subcommand calls into the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use outbox_relay::config::Config;
use outbox_relay::store::{self, Store};

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
    /// TOML config file (see config/relay.toml), before or after the command;
    /// every key can be set from the environment. Commands that only talk to
    /// the database read `database.url` (DATABASE_URL overrides it).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
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
        /// Apply a migration that needs newer relays although older relays are
        /// live (they stop delivering until replaced); refused otherwise.
        #[arg(long)]
        allow_live_older: bool,
    },
    /// Run the relay as a daemon until SIGTERM or SIGINT.
    Run,
    /// Run the relay until the backlog is empty (or --max-duration passes) and print what it did. For cron-style deployments. Exits 0 when nothing due is left, 1 when the relay gave up (or on an error), 3 when --max-duration left events pending, 4 when events were dead-lettered, 5 when a route was still paused at the end (the first that applies, in the order 1, 5, 4, 3).
    Drain {
        /// Stop after this long even if rows are still pending (e.g. 5m).
        #[arg(long, value_parser = humantime::parse_duration)]
        max_duration: Option<std::time::Duration>,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Change how many shards the outbox's buckets are split into (relays may keep running).
    Reshard {
        /// The new shard count (1-1024).
        shards: u32,
    },
    /// Check a config file and the environment, print the effective config (secrets hidden), and exit.
    CheckConfig {
        /// Also connect: the database answers, its schema and shard count are what `run` accepts, and the role has the relay's privileges.
        #[arg(long)]
        connect: bool,
    },
    /// Dead-lettered events: list, show, replay, purge.
    Dlq {
        #[command(subcommand)]
        cmd: outbox_relay::cli::dlq::DlqCommand,
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
        .with_writer(std::io::stderr)
        .with_ansi(outbox_relay::cli::colour_on_stderr());
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

#[cfg(feature = "dhat-heap")]
#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

fn main() -> ExitCode {
    // Written out when `main` returns (the daemon's ordinary exit).
    #[cfg(feature = "dhat-heap")]
    let _profiler = dhat::Profiler::new_heap();
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
    match runtime.block_on(dispatch(cli.command, cli.config)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command, config: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    match command {
        Command::Migrate {
            print_grants: true,
            app_role: Some(app),
            relay_role: Some(relay),
            schema,
            ..
        } => {
            print!("{}", store::migrate::grants(&app, &relay, &schema));
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate {
            allow_live_older, ..
        } => {
            let config = Config::load(config.as_deref())?;
            store::pooler::refuse_transaction_pooler(
                &config.database.url,
                config.database.connect_timeout,
            )
            .await?;
            let mut client = store::connect(&config.database.url).await?;
            let options = store::migrate::Options {
                allow_live_older,
                ..Default::default()
            };
            let report = store::migrate::run_with(&mut client, options).await?;
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
        Command::Run => {
            let config = Config::load(config.as_deref())?;
            outbox_relay::run_until_signal(config).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Drain { max_duration, json } => {
            let config = Config::load(config.as_deref())?;
            let report = outbox_relay::drain(config, max_duration).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                let c = &report.counters;
                let mut line = format!(
                    "published {}, retried {}, dead-lettered {} in {:.1}s",
                    c.published, c.retried, c.dead_lettered, report.elapsed_secs
                );
                if c.deferred > 0 {
                    line += &format!("; {} put back while their route was paused", c.deferred);
                }
                if report.remaining > 0 {
                    let why = if report.gave_up {
                        "the relay gave up"
                    } else if !report.paused_routes.is_empty() {
                        "a route is paused"
                    } else if report.timed_out {
                        "stopped at --max-duration"
                    } else {
                        "scheduled for later"
                    };
                    line += &format!("; {} still pending ({why})", report.remaining);
                    if report.held > 0 {
                        line += &format!(
                            ", {} of them taken by QStash and waiting for its delivery callback",
                            report.held
                        );
                    }
                    if let Some(next) = report.next_due {
                        line += &format!(", the next due at {}", next.to_rfc3339());
                    }
                }
                println!("{line}");
            }
            if report.exit_code != 0 {
                eprintln!("drain: exit {}: {}", report.exit_code, report.reason);
            }
            Ok(ExitCode::from(report.exit_code))
        }
        Command::Reshard { shards } => {
            let config = Config::load(config.as_deref())?;
            let store = Store::for_command(&config.database.url)?;
            let before = store.reshard(shards).await?;
            println!("resharded from {before} to {shards} shards; running relays take the new shards on their next round (no outbox row was rewritten)");
            Ok(ExitCode::SUCCESS)
        }
        Command::CheckConfig { connect } => {
            let config = Config::load(config.as_deref())?;
            config.validate_for_relay()?;
            for warning in config.warnings() {
                eprintln!("warning: {warning}");
            }
            if connect {
                eprintln!("{}", outbox_relay::cli::check::connect(&config).await?);
            }
            println!("{}", serde_json::to_string_pretty(&config.redacted())?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Dlq { cmd } => {
            let config = Config::load(config.as_deref())?;
            outbox_relay::cli::dlq::run(cmd, &config).await
        }
        Command::Stats(args) => outbox_relay::cli::stats::run(args, config.as_deref())
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Prune(args) => outbox_relay::cli::prune::run_prune(args, config.as_deref())
            .await
            .map(|()| ExitCode::SUCCESS),
        Command::Partitions(command) => {
            outbox_relay::cli::prune::run_partitions(command, config.as_deref())
                .await
                .map(|()| ExitCode::SUCCESS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Cli, Command};
    use clap::{CommandFactory, Parser};
    use std::path::Path;

    #[test]
    fn the_cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn config_is_read_before_or_after_any_command() {
        for args in [
            &["outbox-relay", "--config", "f.toml", "run"][..],
            &["outbox-relay", "run", "--config", "f.toml"],
            &["outbox-relay", "--config", "f.toml", "dlq", "list"],
            &["outbox-relay", "dlq", "list", "--config", "f.toml"],
            &["outbox-relay", "partitions", "list", "--config", "f.toml"],
            &["outbox-relay", "stats", "--json", "--config", "f.toml"],
        ] {
            let cli = Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
            assert_eq!(cli.config.as_deref(), Some(Path::new("f.toml")), "{args:?}");
        }
        let cli = Cli::try_parse_from(["outbox-relay", "migrate"]).unwrap();
        assert!(cli.config.is_none() && matches!(cli.command, Command::Migrate { .. }));
    }
}
