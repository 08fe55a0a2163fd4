//! Faults done to the relay rather than to its destination
//! (`[relay_faults]` of a scenario), timed from the start of the load:
//!
//! - **blackhole**: every database connection the relays have open stops
//!   answering. The relays reach the database through a loopback proxy
//!   (`outbox_testkit::proxy`) that, at that moment, stops forwarding the
//!   connections open through it while keeping their sockets open, as a
//!   network that silently drops packets does; connections made later
//!   forward. The relay must notice, take fresh connections and go on: the
//!   progress check (no route flat for a lease) holds through it.
//! - **twin**: a second relay process started under replica 0's
//!   `relay.replica_id` while replica 0 runs. It must refuse to start,
//!   exiting non-zero with an error that names `relay.replica_id`, and
//!   delivery must go on.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use outbox_testkit::proxy::Proxy;
use outbox_testkit::relay::RelayCommand;

/// How long the twin has to refuse to start.
pub const TWIN_EXIT_WITHIN: Duration = Duration::from_secs(30);

/// `[relay_faults]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayFaultsSpec {
    /// `[[relay_faults.blackhole]]`: when every open relay connection stops answering.
    #[serde(default)]
    pub blackhole: Vec<At>,
    /// `[relay_faults.twin]`: when a second relay starts under replica 0's id.
    #[serde(default)]
    pub twin: Option<At>,
}

/// A moment, from the start of the load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct At {
    #[serde(with = "humantime_serde")]
    pub at: Duration,
}

impl RelayFaultsSpec {
    /// The relays reach the database through the proxy.
    pub fn needs_proxy(&self) -> bool {
        !self.blackhole.is_empty()
    }

    /// Checks the spec against the scenario's `relay_config`: a twin needs
    /// an explicit `relay.replica_id` (the default is unique per process).
    pub fn validate(&self, relay_config: &toml::Table) -> Result<(), String> {
        if self.twin.is_some() {
            let id = relay_config
                .get("relay")
                .and_then(|r| r.get("replica_id"))
                .and_then(|v| v.as_str());
            if id.is_none_or(|id| id.trim().is_empty()) {
                return Err("relay_faults.twin: set relay_config.relay.replica_id (e.g. \"loadtest-{replica}\"); the default is unique per process, so a twin would not share it".into());
            }
        }
        Ok(())
    }
}

/// One blackhole: when, and how many connections stopped answering.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlackholeOutcome {
    /// Seconds since the run's origin.
    pub at_secs: f64,
    /// The same, unix µs.
    pub at_us: i64,
    pub connections: usize,
    /// From the blackhole to the first progress after it; `None` when
    /// nothing was pending then.
    pub resumed_after_secs: Option<f64>,
}

/// What became of the twin.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TwinOutcome {
    pub at_secs: f64,
    /// Its exit status, `None` when it was still running after
    /// [`TWIN_EXIT_WITHIN`] (then killed).
    pub exit: Option<String>,
    pub exited_ok: bool,
    pub exited_after_secs: Option<f64>,
    /// The first line of its log that names `relay.replica_id`.
    pub said: Option<String>,
}

/// What the relay faults did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RelayFaultsReport {
    pub blackholes: Vec<BlackholeOutcome>,
    /// Connections the proxy accepted over the run.
    pub proxy_connections: usize,
    pub twin: Option<TwinOutcome>,
}

impl RelayFaultsReport {
    /// A fault that did not happen, or a twin that was not refused.
    pub fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        for b in &self.blackholes {
            if b.connections == 0 {
                f.push(format!(
                    "the blackhole at {:.1} s found no relay connection open",
                    b.at_secs
                ));
            }
        }
        if let Some(t) = &self.twin {
            match (&t.exit, t.exited_ok) {
                (None, _) => f.push(format!(
                    "a second relay under replica 0's relay.replica_id, started at {:.1} s, was still running {} s later",
                    t.at_secs,
                    TWIN_EXIT_WITHIN.as_secs()
                )),
                (Some(exit), true) => f.push(format!(
                    "a second relay under replica 0's relay.replica_id exited with {exit} instead of refusing to start"
                )),
                (Some(_), false) if t.said.is_none() => f.push(
                    "a second relay under replica 0's relay.replica_id exited without naming relay.replica_id in its log".into(),
                ),
                _ => {}
            }
        }
        f
    }
}

/// The twin's command and log.
pub struct Twin {
    pub cmd: RelayCommand,
    pub log: PathBuf,
}

/// Plays `spec` from `load_start`: blackholes through `proxy`, starts
/// `twin`. `origin_us` is the run's origin (unix µs) the report counts from.
pub async fn play(
    spec: RelayFaultsSpec,
    proxy: Option<Arc<Proxy>>,
    twin: Option<Twin>,
    load_start: Instant,
    origin_us: i64,
) -> RelayFaultsReport {
    let secs = move || (now_us() - origin_us) as f64 / 1e6;
    let blackholes = async {
        let mut out = Vec::new();
        let Some(proxy) = proxy.as_ref() else {
            return out;
        };
        let mut times: Vec<Duration> = spec.blackhole.iter().map(|b| b.at).collect();
        times.sort();
        for at in times {
            tokio::time::sleep_until((load_start + at).into()).await;
            let connections = proxy.blackhole_open();
            tracing::info!(connections, "blackholed the relay's database connections");
            let at_us = now_us();
            out.push(BlackholeOutcome {
                at_secs: (at_us - origin_us) as f64 / 1e6,
                at_us,
                connections,
                resumed_after_secs: None,
            });
        }
        out
    };
    let twin_run = async {
        let (Some(at), Some(twin)) = (spec.twin, twin) else {
            return None;
        };
        tokio::time::sleep_until((load_start + at.at).into()).await;
        let at_secs = secs();
        let started = Instant::now();
        let mut process = match twin.cmd.spawn() {
            Ok(p) => p,
            Err(e) => {
                return Some(TwinOutcome {
                    at_secs,
                    exit: Some(format!("not started: {e}")),
                    exited_ok: false,
                    exited_after_secs: None,
                    said: None,
                })
            }
        };
        let status = process.exit_within(TWIN_EXIT_WITHIN).await;
        let log = std::fs::read_to_string(&twin.log).unwrap_or_default();
        Some(TwinOutcome {
            at_secs,
            exit: status.map(|s| s.to_string()),
            exited_ok: status.is_some_and(|s| s.success()),
            exited_after_secs: status.map(|_| started.elapsed().as_secs_f64()),
            said: log
                .lines()
                .find(|l| l.contains("relay.replica_id"))
                .map(|l| strip_ansi(l).chars().take(300).collect()),
        })
    };
    let (blackholes, twin) = tokio::join!(blackholes, twin_run);
    RelayFaultsReport {
        blackholes,
        proxy_connections: proxy.map_or(0, |p| p.opened()),
        twin,
    }
}

fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// `line` without terminal colour codes.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_twin_needs_a_replica_id_and_must_be_refused() {
        let spec: RelayFaultsSpec = toml::from_str("[twin]\nat = \"20s\"").unwrap();
        let err = spec.validate(&toml::Table::new()).unwrap_err();
        assert!(err.contains("relay_config.relay.replica_id"), "{err}");
        let config: toml::Table = toml::from_str("[relay]\nreplica_id = \"lt-{replica}\"").unwrap();
        spec.validate(&config).unwrap();

        let twin = |exit: Option<&str>, ok, said: Option<&str>| RelayFaultsReport {
            twin: Some(TwinOutcome {
                at_secs: 20.0,
                exit: exit.map(str::to_owned),
                exited_ok: ok,
                exited_after_secs: exit.map(|_| 1.0),
                said: said.map(str::to_owned),
            }),
            ..RelayFaultsReport::default()
        };
        let refused = twin(
            Some("exit status: 1"),
            false,
            Some("relay.replica_id \"lt-0\" is live"),
        );
        assert_eq!(refused.failures(), Vec::<String>::new());
        assert!(twin(None, false, None).failures()[0].contains("still running"));
        assert!(
            twin(Some("exit status: 0"), true, None).failures()[0].contains("instead of refusing")
        );
        assert!(twin(Some("exit status: 1"), false, None).failures()[0].contains("without naming"));
        assert_eq!(strip_ansi("\u{1b}[2mx\u{1b}[0m y"), "x y");
    }
}
