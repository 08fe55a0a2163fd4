//! Retention commands: `outbox-relay prune` (batched deletes) and
//! `outbox-relay partitions` (a partitioned outbox's upkeep).

use std::path::Path;
use std::time::Duration;

use crate::config::Config;
use crate::store;
use crate::store::partitions::{self, MaintainOptions, MaintainReport, PartitionAction};
use crate::store::retention::{prune, PruneOptions, PruneReport, TablePrune};

#[derive(Debug, clap::Args)]
pub struct PruneArgs {
    /// Delete outbox rows published longer ago than this (`7d`, `36h`).
    /// Pending and dead-lettered rows are never deleted.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub older_than: Duration,
    /// Also delete processed_messages rows older than this.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub processed_older_than: Option<Duration>,
    /// Rows per DELETE statement (default: janitor.batch).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub batch: Option<u32>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `config`: the `--config` file; `database.url` and `janitor.batch` are read.
pub async fn run_prune(args: PruneArgs, config: Option<&Path>) -> anyhow::Result<()> {
    let config = Config::load(config)?;
    let client = store::connect(&config.database.url).await?;
    let options = PruneOptions {
        published_older_than: args.older_than,
        processed_older_than: args.processed_older_than,
        batch: args.batch.unwrap_or(config.janitor.batch),
    };
    let report = prune(&client, &options).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render_prune(&report, &options));
    }
    Ok(())
}

pub(crate) fn render_prune(report: &PruneReport, options: &PruneOptions) -> String {
    fn line(what: &str, older_than: Duration, t: &TablePrune, batch: u32) -> String {
        format!(
            "{what}: deleted {} rows older than {} (before {}) in {} statements of at most {batch}\n",
            t.deleted,
            humantime::format_duration(older_than),
            t.cutoff.format("%Y-%m-%d %H:%M:%S UTC"),
            t.statements,
        )
    }
    let mut out = line(
        "outbox (published)",
        options.published_older_than,
        &report.outbox,
        options.batch,
    );
    match (&report.processed_messages, options.processed_older_than) {
        (Some(p), Some(age)) => out.push_str(&line("processed_messages", age, p, options.batch)),
        _ => out.push_str("processed_messages: left alone (give --processed-older-than)\n"),
    }
    out
}

#[derive(Debug, clap::Subcommand)]
pub enum PartitionsCommand {
    /// Replace the (empty) outbox by one partitioned per day of created_at,
    /// then create today's and the next days' partitions.
    Init {
        /// Days ahead of today to create.
        #[arg(long, default_value_t = 7)]
        ahead: u32,
    },
    /// Create partitions ahead, detach and drop expired ones (never one with
    /// pending or dead-lettered rows), prune old idempotency keys. Run it daily.
    Maintain {
        /// Days ahead of today to create.
        #[arg(long, default_value_t = 7)]
        ahead: u32,
        /// Drop a day's partition once its last instant is older than this.
        #[arg(long, default_value = "7d", value_parser = humantime::parse_duration)]
        retain: Duration,
        /// Give up a partition's DDL after waiting this long for its lock.
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        lock_timeout: Duration,
        /// Rows per DELETE when pruning idempotency keys (default: janitor.batch).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        batch: Option<u32>,
        #[arg(long)]
        json: bool,
    },
    /// List the day partitions.
    List,
}

/// `config`: the `--config` file; `database.url` and `janitor.batch` are read.
pub async fn run_partitions(
    command: PartitionsCommand,
    config: Option<&Path>,
) -> anyhow::Result<()> {
    let config = Config::load(config)?;
    match command {
        PartitionsCommand::Init { ahead } => {
            let mut client = store::connect(&config.database.url).await?;
            let report = partitions::init(&mut client, ahead).await?;
            println!(
                "the outbox is now partitioned by day; {} partitions created",
                report.count(PartitionAction::Created)
            );
            print!("{}", render_maintain(&report));
        }
        PartitionsCommand::Maintain {
            ahead,
            retain,
            lock_timeout,
            batch,
            json,
        } => {
            let mut client = store::connect(&config.database.url).await?;
            let options = MaintainOptions {
                ahead_days: ahead,
                retain,
                lock_timeout,
                batch: batch.unwrap_or(config.janitor.batch),
            };
            let report = partitions::maintain(&mut client, &options).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", render_maintain(&report));
            }
        }
        PartitionsCommand::List => {
            let client = store::connect(&config.database.url).await?;
            for (name, day) in partitions::list(&client).await? {
                println!("{name}\t{day}");
            }
        }
    }
    Ok(())
}

pub(crate) fn render_maintain(report: &MaintainReport) -> String {
    let mut out = String::new();
    for c in &report.changes {
        let what = match c.action {
            PartitionAction::Created => "created",
            PartitionAction::Dropped => "detached and dropped",
            PartitionAction::DefaultHasRows => {
                "not created: rows of this day are in outbox_default"
            }
            PartitionAction::HasPending => "kept past retention: pending rows",
            PartitionAction::HasDeadLetters => "kept past retention: dead letters",
            PartitionAction::LockTimeout => "skipped: lock not granted in time, retry later",
        };
        out.push_str(&format!("{} ({}): {what}\n", c.partition, c.day));
    }
    out.push_str(&format!(
        "{} day partitions ({} .. {}); {} idempotency keys pruned\n",
        report.partitions.len(),
        report.partitions.first().map_or("-", String::as_str),
        report.partitions.last().map_or("-", String::as_str),
        report.idempotency_keys_deleted,
    ));
    if report.default_rows > 0 {
        out.push_str(&format!(
            "warning: outbox_default holds {} rows: partitions were missing when they were written; run maintain more often or with a larger --ahead\n",
            report.default_rows
        ));
    }
    out
}
