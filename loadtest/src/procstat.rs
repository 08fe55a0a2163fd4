//! CPU time and peak memory of the relay process, read from `/proc` while it
//! runs. Restarts (chaos) are summed: each pid's last CPU reading counts once.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// One reading of `/proc/<pid>/stat` and `/proc/<pid>/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProcSample {
    /// utime + stime, in clock ticks.
    pub cpu_ticks: u64,
    /// `VmHWM`: peak resident set, KiB.
    pub peak_rss_kib: u64,
    /// `VmRSS`: current resident set, KiB.
    pub rss_kib: u64,
    /// `RssAnon`: the resident anonymous memory (heap, stacks), KiB; the rest
    /// of the resident set is file pages, mostly the binary's own code.
    pub anon_kib: u64,
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`).
pub fn clock_ticks_per_sec() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

/// utime + stime from the text of `/proc/<pid>/stat`.
pub fn parse_stat_cpu_ticks(stat: &str) -> Option<u64> {
    // The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); utime is field 14, stime field 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// A `Vm…:   1234 kB` line of `/proc/<pid>/status`, in KiB.
pub fn parse_status_kib(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let value = line.strip_prefix(key)?.strip_prefix(':')?;
        value.split_whitespace().next()?.parse().ok()
    })
}

pub fn read_proc(pid: u32) -> std::io::Result<ProcSample> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "unexpected /proc format");
    Ok(ProcSample {
        cpu_ticks: parse_stat_cpu_ticks(&stat).ok_or_else(bad)?,
        peak_rss_kib: parse_status_kib(&status, "VmHWM").unwrap_or(0),
        rss_kib: parse_status_kib(&status, "VmRSS").unwrap_or(0),
        anon_kib: parse_status_kib(&status, "RssAnon").unwrap_or(0),
    })
}

/// Resource use of the relay over a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RelayUsage {
    pub cpu_secs: f64,
    pub peak_rss_kib: u64,
    /// The largest `RssAnon` sampled: the relay's own memory without the pages
    /// of its binary (a sampled peak, so it can miss a short spike).
    #[serde(default)]
    pub peak_anon_kib: u64,
    /// Relay processes seen (1 + restarts).
    pub processes: u32,
    pub samples: u64,
}

/// Accumulates samples of one or more relay processes.
#[derive(Debug, Default)]
pub struct UsageTracker {
    last: HashMap<u32, ProcSample>,
    samples: u64,
}

impl UsageTracker {
    pub fn record(&mut self, pid: u32, sample: ProcSample) {
        self.samples += 1;
        let entry = self.last.entry(pid).or_default();
        entry.cpu_ticks = entry.cpu_ticks.max(sample.cpu_ticks);
        entry.peak_rss_kib = entry.peak_rss_kib.max(sample.peak_rss_kib);
        entry.rss_kib = sample.rss_kib;
        entry.anon_kib = entry.anon_kib.max(sample.anon_kib);
    }

    /// Reads `pid` now; a process that is gone is ignored.
    pub fn sample(&mut self, pid: u32) {
        if let Ok(s) = read_proc(pid) {
            self.record(pid, s);
        }
    }

    pub fn usage(&self) -> RelayUsage {
        let ticks: u64 = self.last.values().map(|s| s.cpu_ticks).sum();
        RelayUsage {
            cpu_secs: ticks as f64 / clock_ticks_per_sec() as f64,
            peak_rss_kib: self
                .last
                .values()
                .map(|s| s.peak_rss_kib)
                .max()
                .unwrap_or(0),
            peak_anon_kib: self.last.values().map(|s| s.anon_kib).max().unwrap_or(0),
            processes: self.last.len() as u32,
            samples: self.samples,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_a_tricky_command_name() {
        let stat = "4242 (outbox (relay) x) S 1 4242 4242 0 -1 4194560 500 0 0 0 150 50 0 0 20 0 9 0 100 1000000 2000 18446744073709551615";
        assert_eq!(parse_stat_cpu_ticks(stat), Some(200));
    }

    #[test]
    fn parses_status_lines() {
        let status =
            "Name:\toutbox-relay\nVmPeak:\t  100 kB\nVmHWM:\t   12345 kB\nVmRSS:\t    2345 kB\n";
        assert_eq!(parse_status_kib(status, "VmHWM"), Some(12345));
        assert_eq!(parse_status_kib(status, "VmRSS"), Some(2345));
        assert_eq!(parse_status_kib(status, "VmSwap"), None);
    }

    #[test]
    fn reads_this_process_and_sums_restarts() {
        let me = read_proc(std::process::id()).unwrap();
        assert!(me.peak_rss_kib > 0 && me.rss_kib > 0);
        assert!(me.anon_kib > 0 && me.anon_kib <= me.rss_kib);
        let mut t = UsageTracker::default();
        let tck = clock_ticks_per_sec();
        t.record(
            1,
            ProcSample {
                cpu_ticks: tck,
                peak_rss_kib: 10,
                rss_kib: 5,
                anon_kib: 4,
            },
        );
        t.record(
            1,
            ProcSample {
                cpu_ticks: 2 * tck,
                peak_rss_kib: 30,
                rss_kib: 5,
                anon_kib: 3,
            },
        );
        t.record(
            2,
            ProcSample {
                cpu_ticks: tck,
                peak_rss_kib: 20,
                rss_kib: 5,
                anon_kib: 2,
            },
        );
        let u = t.usage();
        assert_eq!(
            (
                u.cpu_secs,
                u.peak_rss_kib,
                u.peak_anon_kib,
                u.processes,
                u.samples
            ),
            (3.0, 30, 4, 2, 3)
        );
    }
}
