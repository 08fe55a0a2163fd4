//! `outbox-relay dlq …`: look at dead-lettered outbox rows, replay them, or
//! purge them (the statements are in `store::dead_letters`).

use std::io::Write;
use std::process::ExitCode;

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::config::Config;
use crate::routes::Router;
use crate::store::dead_letters::Selection;
use crate::store::{Store, StoreError};

/// Which dead rows a replay or purge touches. Filters combine with AND;
/// `all` alone means every dead row.
#[derive(Debug, Clone, Default, PartialEq, Args)]
#[group(required = true, multiple = true)]
pub struct Selector {
    /// This row (repeat for several).
    #[arg(long = "id", value_name = "ID")]
    pub ids: Vec<i64>,
    /// Rows of this event type.
    #[arg(long, value_name = "TYPE")]
    pub event_type: Option<String>,
    /// Dead-lettered at or after: RFC 3339 (2024-05-01T12:00:00Z) or an age (2h, 3days).
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub since: Option<DateTime<Utc>>,
    /// Dead-lettered before: RFC 3339 or an age.
    #[arg(long, value_name = "TIME", value_parser = parse_time)]
    pub until: Option<DateTime<Utc>>,
    /// Every dead row (the other filters still narrow it).
    #[arg(long)]
    pub all: bool,
}

impl Selector {
    pub fn selection(&self) -> Selection {
        Selection {
            ids: self.ids.clone(),
            event_type: self.event_type.clone(),
            since: self.since,
            until: self.until,
            all: self.all,
            ..Selection::default()
        }
    }
}

/// `--since 2h` or `--since 2024-05-01T12:00:00Z`.
pub fn parse_time(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    let age = humantime::parse_duration(s)
        .map_err(|_| format!("{s:?} is neither an RFC 3339 time nor a duration like 2h"))?;
    chrono::Duration::from_std(age)
        .ok()
        .and_then(|age| Utc::now().checked_sub_signed(age))
        .ok_or_else(|| format!("{s:?} reaches too far back"))
}

// ───────────────────────────── the commands ─────────────────────────────

#[derive(Debug, Clone, PartialEq, Subcommand)]
pub enum DlqCommand {
    /// List dead-lettered rows, the most recent first.
    List {
        /// Only rows of this event type.
        #[arg(long, value_name = "TYPE")]
        event_type: Option<String>,
        /// Dead-lettered at or after: RFC 3339 or an age (2h, 3days).
        #[arg(long, value_name = "TIME", value_parser = parse_time)]
        since: Option<DateTime<Utc>>,
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Show one outbox row, every column, the payload pretty-printed and
    /// its failed attempts one a line (when, attempt, status, answer).
    Show {
        id: i64,
        #[arg(long)]
        json: bool,
    },
    /// Put dead rows back to pending, with new idempotency keys. On an
    /// ordered route a replayed row goes before its key's newer pending
    /// events; a row whose key has a newer event delivered already is
    /// refused (the keys are named) unless --allow-reorder is given.
    Replay {
        #[command(flatten)]
        selector: Selector,
        /// Replay rows of ordered routes even when a newer event of their key
        /// was delivered already (they arrive after it).
        #[arg(long)]
        allow_reorder: bool,
        #[arg(long)]
        json: bool,
    },
    /// Delete dead rows for good (needs --yes).
    Purge {
        #[command(flatten)]
        selector: Selector,
        /// Really delete.
        #[arg(long)]
        yes: bool,
        #[arg(long)]
        json: bool,
    },
}

/// Entry point for `outbox-relay dlq`.
pub async fn run(cmd: DlqCommand, config: &Config) -> anyhow::Result<ExitCode> {
    let store = Store::for_command(&config.database.url)?;
    let mut stdout = std::io::stdout().lock();
    execute(cmd, &store, &Router::new(&config.routes), &mut stdout).await
}

/// Runs a command against `store`, for the routes of `router` (a replay
/// keeps the order of their ordered keys), writing what a person or script
/// reads to `out`.
pub async fn execute(
    cmd: DlqCommand,
    store: &Store,
    router: &Router,
    out: &mut dyn Write,
) -> anyhow::Result<ExitCode> {
    match cmd {
        DlqCommand::List {
            event_type,
            since,
            limit,
            json,
        } => {
            let rows = store
                .dead_letters(event_type.as_deref(), since, limit)
                .await?;
            if json {
                write_json(out, &rows)?;
            } else if rows.is_empty() {
                writeln!(out, "no dead-lettered rows")?;
            } else {
                let cells = rows
                    .iter()
                    .map(|r| {
                        vec![
                            r.id.to_string(),
                            r.event_type.clone(),
                            r.partition_key.clone(),
                            r.attempt_count.to_string(),
                            r.dead_lettered_at
                                .to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                            one_line(r.last_error.as_deref().unwrap_or(""), 80),
                        ]
                    })
                    .collect::<Vec<_>>();
                write!(
                    out,
                    "{}",
                    table(
                        &[
                            "ID",
                            "TYPE",
                            "PARTITION KEY",
                            "ATTEMPTS",
                            "DEAD-LETTERED AT",
                            "LAST ERROR"
                        ],
                        &cells
                    )
                )?;
            }
        }
        DlqCommand::Show { id, json } => {
            let columns = store.row_columns(id).await?;
            if json {
                let map: serde_json::Map<String, serde_json::Value> = columns.into_iter().collect();
                write_json(out, &map)?;
            } else {
                let width = columns.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
                for (name, value) in columns {
                    let text = match &value {
                        serde_json::Value::Array(attempts) if name == "attempt_log" => {
                            attempt_lines(attempts)
                        }
                        serde_json::Value::Null => "-".to_owned(),
                        serde_json::Value::String(s) => s.clone(),
                        serde_json::Value::Object(_) | serde_json::Value::Array(_) => {
                            serde_json::to_string_pretty(&value)?
                        }
                        other => other.to_string(),
                    };
                    writeln!(
                        out,
                        "{name:width$}  {}",
                        text.replace('\n', &format!("\n{:width$}  ", ""))
                    )?;
                }
            }
        }
        DlqCommand::Replay {
            selector,
            allow_reorder,
            json,
        } => {
            let selection = Selection {
                ordered: router.ordered_like_patterns(),
                allow_reorder,
                ..selector.selection()
            };
            let replayed = match store.replay_dead(&selection).await {
                Ok(replayed) => replayed,
                Err(StoreError::Refused(why)) => {
                    writeln!(out, "refusing to replay: {why}")?;
                    return Ok(ExitCode::from(2));
                }
                Err(e) => return Err(e.into()),
            };
            if json {
                write_json(
                    out,
                    &serde_json::json!({"replayed": replayed.len(), "rows": replayed}),
                )?;
            } else {
                writeln!(out, "replayed {} dead-lettered rows", replayed.len())?;
            }
        }
        DlqCommand::Purge {
            selector,
            yes,
            json,
        } => {
            if !yes {
                let n = store.count_dead(&selector.selection()).await?;
                writeln!(
                    out,
                    "refusing to delete {n} dead-lettered rows without --yes"
                )?;
                return Ok(ExitCode::from(2));
            }
            let purged = store.purge_dead(&selector.selection()).await?;
            if json {
                write_json(
                    out,
                    &serde_json::json!({"purged": purged.len(), "ids": purged}),
                )?;
            } else {
                writeln!(out, "purged {} dead-lettered rows", purged.len())?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn write_json(out: &mut dyn Write, value: &impl Serialize) -> anyhow::Result<()> {
    serde_json::to_writer_pretty(&mut *out, value)?;
    writeln!(out)?;
    Ok(())
}

/// At most `max` characters on one line.
fn one_line(s: &str, max: usize) -> String {
    let flat: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= max {
        flat
    } else {
        let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}

/// Left-aligned columns separated by two spaces.
fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                text.push_str("  ");
            }
            text.push_str(cell);
            let pad = widths[i].saturating_sub(cell.chars().count());
            text.extend(std::iter::repeat_n(' ', pad));
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut headers.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

/// A row's attempt history (`store::attempt_log`), one failed attempt a
/// line: when, which attempt, the status (`-` without an answer), and the
/// first characters of the answer.
fn attempt_lines(attempts: &[serde_json::Value]) -> String {
    attempts
        .iter()
        .map(|a| {
            let status = a["status"]
                .as_i64()
                .map_or_else(|| "-".to_owned(), |s| s.to_string());
            format!(
                "{}  attempt {}  {status:>3}  {}",
                a["at"].as_str().unwrap_or("?"),
                a["attempt"].as_i64().unwrap_or(0),
                a["error"].as_str().unwrap_or("")
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns_by_characters() {
        let t = table(
            &["ID", "TYPE"],
            &[vec!["1".into(), "é".into()], vec!["100".into(), "x".into()]],
        );
        assert_eq!(t, "ID   TYPE\n1    é\n100  x\n");
    }

    #[test]
    fn times_are_rfc3339_or_ages() {
        assert_eq!(
            parse_time("2024-05-01T12:00:00Z").unwrap(),
            DateTime::parse_from_rfc3339("2024-05-01T12:00:00+00:00").unwrap()
        );
        let two_hours_ago = parse_time("2h").unwrap();
        let age = Utc::now() - two_hours_ago;
        assert!(
            age >= chrono::Duration::hours(2)
                && age < chrono::Duration::hours(2) + chrono::Duration::minutes(1)
        );
        assert!(parse_time("yesterday-ish").is_err());
    }
}
