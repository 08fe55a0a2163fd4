//! What a run's figures were taken on: the database server's durability
//! settings, where the sink ran, and the machine's state (load average, the
//! CPU every other process used meanwhile). On shared machines absolute
//! figures move by a factor of three from day to day; a report says what
//! else ran so a reader can judge them.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::procstat::{clock_ticks_per_sec, parse_stat_cpu_ticks};

/// The server's settings that decide what a commit costs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerSettings {
    pub server_version: String,
    pub fsync: String,
    pub synchronous_commit: String,
    pub full_page_writes: String,
    pub autovacuum: String,
    pub shared_buffers: String,
    /// `throwaway cluster` or `DATABASE_URL`.
    pub source: String,
}

impl ServerSettings {
    /// Read from the server `client` is connected to.
    pub async fn read(
        client: &tokio_postgres::Client,
        source: &str,
    ) -> Result<ServerSettings, tokio_postgres::Error> {
        let row = client
            .query_one(
                "SELECT current_setting('server_version'), current_setting('fsync'),
                        current_setting('synchronous_commit'), current_setting('full_page_writes'),
                        current_setting('autovacuum'), current_setting('shared_buffers')",
                &[],
            )
            .await?;
        Ok(ServerSettings {
            server_version: row.get(0),
            fsync: row.get(1),
            synchronous_commit: row.get(2),
            full_page_writes: row.get(3),
            autovacuum: row.get(4),
            shared_buffers: row.get(5),
            source: source.to_owned(),
        })
    }

    /// fsync, synchronous_commit and full_page_writes all on.
    pub fn durable(&self) -> bool {
        self.fsync == "on" && self.synchronous_commit == "on" && self.full_page_writes == "on"
    }

    /// One line: `durable (fsync, synchronous_commit, full_page_writes, autovacuum on; shared_buffers 1GB), throwaway cluster`.
    pub fn describe(&self) -> String {
        let kind = if self.durable() {
            "durable"
        } else {
            "NOT durable (labelled extra)"
        };
        format!(
            "{kind}: fsync {}, synchronous_commit {}, full_page_writes {}, autovacuum {}, shared_buffers {}; PostgreSQL {}, {}",
            self.fsync,
            self.synchronous_commit,
            self.full_page_writes,
            self.autovacuum,
            self.shared_buffers,
            self.server_version,
            self.source
        )
    }
}

/// CPU use of the whole machine and of each process, at one instant.
#[derive(Debug, Clone, Default)]
pub struct MachineSnapshot {
    /// `/proc/loadavg`: 1, 5 and 15 minutes.
    pub load: [f64; 3],
    /// `/proc/stat`'s first line: busy and total ticks of all CPUs.
    busy_ticks: u64,
    total_ticks: u64,
    /// pid -> (command name, utime + stime ticks).
    processes: HashMap<u32, (String, u64)>,
}

impl MachineSnapshot {
    pub fn take() -> MachineSnapshot {
        let load = std::fs::read_to_string("/proc/loadavg")
            .ok()
            .map(|t| parse_loadavg(&t))
            .unwrap_or_default();
        let (busy_ticks, total_ticks) = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|t| parse_cpu_line(&t))
            .unwrap_or_default();
        let mut processes = HashMap::new();
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for entry in dir.flatten() {
                let Some(pid) = entry
                    .file_name()
                    .to_str()
                    .and_then(|n| n.parse::<u32>().ok())
                else {
                    continue;
                };
                let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                    continue;
                };
                if let (Some(comm), Some(ticks)) = (stat_comm(&stat), parse_stat_cpu_ticks(&stat)) {
                    processes.insert(pid, (comm, ticks));
                }
            }
        }
        MachineSnapshot {
            load,
            busy_ticks,
            total_ticks,
            processes,
        }
    }
}

/// The machine over a run: from two snapshots.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MachineState {
    pub cores: usize,
    pub load_before: [f64; 3],
    pub load_after: [f64; 3],
    /// Mean busy cores over the run, every process included.
    pub busy_cores: f64,
    /// CPU seconds of processes other than the run's own (relay, sink,
    /// harness), by command name, largest first (the first 8). `postgres`
    /// counts every cluster's backends, this run's included.
    pub others_cpu_secs: Vec<(String, f64)>,
}

impl MachineState {
    /// From `before` to `after`, leaving out `own` pids (and this process).
    pub fn between(before: &MachineSnapshot, after: &MachineSnapshot, own: &[u32]) -> Self {
        let mut own: HashSet<u32> = own.iter().copied().collect();
        own.insert(std::process::id());
        let tck = clock_ticks_per_sec() as f64;
        let mut by_name: HashMap<String, u64> = HashMap::new();
        for (pid, (comm, ticks)) in &after.processes {
            if own.contains(pid) {
                continue;
            }
            let start = before.processes.get(pid).map_or(0, |(_, t)| *t);
            let used = ticks.saturating_sub(start);
            if used > 0 {
                *by_name.entry(comm.clone()).or_default() += used;
            }
        }
        let mut others: Vec<(String, f64)> = by_name
            .into_iter()
            .map(|(name, ticks)| (name, ticks as f64 / tck))
            .collect();
        others.sort_by(|a, b| b.1.total_cmp(&a.1));
        others.truncate(8);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let total = after.total_ticks.saturating_sub(before.total_ticks);
        let busy = after.busy_ticks.saturating_sub(before.busy_ticks);
        MachineState {
            cores,
            load_before: before.load,
            load_after: after.load,
            busy_cores: if total > 0 {
                busy as f64 / total as f64 * cores as f64
            } else {
                0.0
            },
            others_cpu_secs: others,
        }
    }

    /// `load 2.10 -> 3.40 (1 min), 1.9 of 2 cores busy; others: rustc 40.1 s, postgres 12.0 s`.
    pub fn describe(&self) -> String {
        let others: Vec<String> = self
            .others_cpu_secs
            .iter()
            .take(4)
            .map(|(n, s)| format!("{n} {s:.1} s"))
            .collect();
        format!(
            "load {:.2} -> {:.2} (1 min), {:.2} of {} cores busy; other processes: {}",
            self.load_before[0],
            self.load_after[0],
            self.busy_cores,
            self.cores,
            if others.is_empty() {
                "none".to_owned()
            } else {
                others.join(", ")
            }
        )
    }
}

/// Where a run happened.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunEnvironment {
    pub server: ServerSettings,
    /// The sink in a process of its own (else in the harness's).
    pub sink_own_process: bool,
    /// CPU seconds of the sink's process, when it had its own.
    pub sink_cpu_secs: Option<f64>,
    pub machine: MachineState,
}

fn parse_loadavg(text: &str) -> [f64; 3] {
    let mut it = text.split_whitespace().map(|v| v.parse().unwrap_or(0.0));
    [
        it.next().unwrap_or(0.0),
        it.next().unwrap_or(0.0),
        it.next().unwrap_or(0.0),
    ]
}

/// Busy and total ticks from `/proc/stat`'s `cpu` line (idle and iowait are not busy).
fn parse_cpu_line(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal [guest guest_nice: in user]
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

/// The command name of a `/proc/<pid>/stat` line (between the first `(` and the last `)`).
fn stat_comm(stat: &str) -> Option<String> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    (close > open).then(|| stat[open + 1..close].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files() {
        assert_eq!(
            parse_loadavg("2.50 1.25 0.75 3/400 1234\n"),
            [2.5, 1.25, 0.75]
        );
        let stat = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n";
        assert_eq!(parse_cpu_line(stat), Some((150, 1000)));
        assert_eq!(
            stat_comm("42 (rustc (x)) R 1 2 3").as_deref(),
            Some("rustc (x)")
        );
    }

    #[test]
    fn a_server_without_durability_is_labelled_so() {
        let on = ServerSettings {
            fsync: "on".into(),
            synchronous_commit: "on".into(),
            full_page_writes: "on".into(),
            autovacuum: "on".into(),
            ..ServerSettings::default()
        };
        assert!(on.durable());
        assert!(
            on.describe().starts_with("durable: fsync on"),
            "{}",
            on.describe()
        );
        for off in [
            ServerSettings {
                fsync: "off".into(),
                ..on.clone()
            },
            ServerSettings {
                synchronous_commit: "off".into(),
                ..on.clone()
            },
            ServerSettings {
                full_page_writes: "off".into(),
                ..on.clone()
            },
        ] {
            assert!(!off.durable());
            assert!(
                off.describe().starts_with("NOT durable (labelled extra)"),
                "{}",
                off.describe()
            );
        }
    }

    #[test]
    fn counts_only_other_processes_that_used_cpu() {
        let mut before = MachineSnapshot::default();
        let mut after = MachineSnapshot::default();
        let tck = clock_ticks_per_sec();
        before.processes.insert(10, ("rustc".into(), tck));
        after.processes.insert(10, ("rustc".into(), 3 * tck));
        after.processes.insert(11, ("rustc".into(), tck));
        after.processes.insert(12, ("outbox-relay".into(), 9 * tck));
        after.processes.insert(13, ("sleep".into(), 0));
        let m = MachineState::between(&before, &after, &[12]);
        assert_eq!(m.others_cpu_secs, vec![("rustc".to_owned(), 3.0)]);
        assert!(m.describe().contains("rustc 3.0 s"), "{}", m.describe());
    }
}
