//! `outbox-relay stats [--json] [--watch SECONDS]`: the outbox's health at a
//! glance for people (tables), or as JSON for scripts.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use comfy_table::{presets::UTF8_FULL_CONDENSED, CellAlignment, Table};

use crate::config::Config;
use crate::store;
use crate::store::stats::{stats, Stats};

#[derive(Debug, clap::Args)]
pub struct StatsArgs {
    /// One JSON document (with --watch: one per line).
    #[arg(long)]
    pub json: bool,
    /// Sample again every SECONDS until Ctrl-C.
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
    pub watch: Option<u64>,
}

/// `config`: the `--config` file; only `database.url` is read.
pub async fn run(args: StatsArgs, config: Option<&Path>) -> anyhow::Result<()> {
    let config = Config::load(config)?;
    let mut client = store::connect(&config.database.url).await?;
    let Some(every) = args.watch else {
        let report = stats(&mut client).await?;
        println!("{}", render(&report, args.json)?);
        return Ok(());
    };
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        let report = stats(&mut client).await?;
        let mut out = std::io::stdout().lock();
        if args.json {
            writeln!(out, "{}", serde_json::to_string(&report)?)?;
        } else {
            // Clear the screen and home the cursor, like watch(1).
            writeln!(out, "\x1b[2J\x1b[H{}", render(&report, false)?)?;
        }
        out.flush()?;
        drop(out);
        tokio::select! {
            _ = &mut ctrl_c => return Ok(()),
            _ = tokio::time::sleep(Duration::from_secs(every)) => {}
        }
    }
}

/// The report as printed: pretty JSON, or tables.
pub(crate) fn render(report: &Stats, json: bool) -> anyhow::Result<String> {
    if json {
        return Ok(serde_json::to_string_pretty(report)?);
    }
    Ok(render_tables(report))
}

fn render_tables(report: &Stats) -> String {
    let s = &report.snapshot;
    let mut gauges = Table::new();
    gauges
        .load_style(UTF8_FULL_CONDENSED)
        .set_header(vec![
            "backlog",
            "oldest pending",
            "dead letters",
            "flapping",
            "stuck leases",
            "dead tuples",
        ])
        .add_row(vec![
            s.backlog.to_string(),
            age(Some(s.oldest_pending_age_seconds)),
            s.dead_letters.to_string(),
            s.flapping.to_string(),
            s.stuck_leases.to_string(),
            s.outbox_dead_tuples.to_string(),
        ]);
    right_align(&mut gauges, 0..6);

    let per_minute: Vec<i64> = report
        .published_per_minute
        .iter()
        .map(|b| b.published)
        .collect();
    let total: i64 = per_minute.iter().sum();
    let peak = per_minute.iter().copied().max().unwrap_or(0);
    let last_full = per_minute.iter().rev().nth(1).copied().unwrap_or(0);

    let mut types = Table::new();
    types.load_style(UTF8_FULL_CONDENSED).set_header(vec![
        "event type",
        "pending",
        "oldest pending",
        "dead",
        "published (1h)",
    ]);
    for t in &report.event_types {
        types.add_row(vec![
            t.event_type.clone(),
            t.pending.to_string(),
            age(t.oldest_pending_age_seconds),
            t.dead.to_string(),
            t.published_last_hour.to_string(),
        ]);
    }
    right_align(&mut types, 1..5);

    let mut out = format!(
        "outbox at {}\n{gauges}\n\npublished in the last hour: {total} (last full minute {last_full}/min, peak {peak}/min)\n{}\n",
        s.sampled_at.format("%Y-%m-%d %H:%M:%S UTC"),
        sparkline(&per_minute)
    );
    if report.event_types.is_empty() {
        out.push_str("\nno pending, dead or recently published events\n");
    } else {
        out.push_str(&format!("\n{types}\n"));
    }
    out.push_str(&render_replicas(report));
    out
}

fn render_replicas(report: &Stats) -> String {
    if report.replicas.is_empty() {
        return "\nno relay replica seen in the last 10 minutes\n".to_owned();
    }
    let mut replicas = Table::new();
    replicas
        .load_style(UTF8_FULL_CONDENSED)
        .set_header(vec!["replica", "host", "pid", "up since", "seen", "shards"]);
    for r in &report.replicas {
        let seen = if r.alive {
            format!("{} ago", age(Some(r.seen_seconds_ago)))
        } else {
            format!("{} ago (gone)", age(Some(r.seen_seconds_ago)))
        };
        replicas.add_row(vec![
            r.replica.clone(),
            r.hostname.clone(),
            r.pid.to_string(),
            r.started_at.format("%Y-%m-%d %H:%M:%S UTC").to_string(),
            seen,
            format!("{} {}", r.shards.len(), shard_list(&r.shards)),
        ]);
    }
    let mut refused = String::new();
    for r in &report.replicas {
        if let Some(f) = &r.refused {
            refused.push_str(&format!(
                "replica {}: another process (host {}, pid {}) asked for this name at {} and was refused; give each replica its own relay.replica_id\n",
                r.replica,
                f.hostname,
                f.pid,
                f.at.format("%Y-%m-%d %H:%M:%S UTC")
            ));
        }
    }
    let unowned = if report.unowned_shards.is_empty() {
        "every shard is held".to_owned()
    } else {
        format!(
            "shards held by no live replica: {}",
            shard_list(&report.unowned_shards)
        )
    };
    format!("\n{replicas}\n{refused}{unowned}\n")
}

/// `[0, 1, 2, 5]` as `[0-2, 5]`.
fn shard_list(shards: &[i16]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < shards.len() {
        let start = shards[i];
        let mut end = start;
        while i + 1 < shards.len() && shards[i + 1] == end + 1 {
            i += 1;
            end = shards[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    format!("[{}]", parts.join(", "))
}

fn right_align(table: &mut Table, columns: std::ops::Range<usize>) {
    for i in columns {
        if let Some(c) = table.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
}

fn age(seconds: Option<f64>) -> String {
    match seconds {
        None => "-".to_owned(),
        Some(s) if s < 1.0 => format!("{:.0}ms", s * 1000.0),
        Some(s) => humantime::format_duration(Duration::from_secs(s as u64)).to_string(),
    }
}

/// One character per minute, oldest left; blank for none, `▁`..`█` scaled to the peak.
fn sparkline(values: &[i64]) -> String {
    const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let peak = values.iter().copied().max().unwrap_or(0);
    values
        .iter()
        .map(|&v| {
            if v <= 0 || peak <= 0 {
                ' '
            } else {
                BARS[((v * 8 + peak - 1) / peak - 1).clamp(0, 7) as usize]
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparkline_scales_to_the_peak() {
        assert_eq!(sparkline(&[0, 1, 4, 8]), " ▁▄█");
        assert_eq!(sparkline(&[0, 0]), "  ");
    }

    #[test]
    fn ages_read_like_durations() {
        assert_eq!(age(None), "-");
        assert_eq!(age(Some(0.25)), "250ms");
        assert_eq!(age(Some(192.7)), "3m 12s");
    }

    #[test]
    fn shard_lists_fold_runs() {
        assert_eq!(shard_list(&[]), "[]");
        assert_eq!(shard_list(&[3]), "[3]");
        assert_eq!(shard_list(&[0, 1, 2, 5, 7, 8]), "[0-2, 5, 7-8]");
    }
}
