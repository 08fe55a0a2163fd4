//! Side by side in one run: several relays (the seed article's, older
//! builds, this one) drive the same scenarios on one database cluster, with
//! the same sink program, interleaved and repeated (round 1 in the order
//! given, round 2 reversed, ...), so that each ratio compares figures taken
//! minutes apart on the same machine. Absolute figures on shared machines move
//! by a factor of three from day to day; ratios of one run do not.
//!
//! Each run gets a fresh database on the shared cluster and a fresh sink
//! process (the sink deduplicates by id, and ids restart in each database).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::environment::RunEnvironment;
use crate::runner::{run_scenario, RunError, RunOptions};
use crate::scenario::{RelayUnderTest, Scenario, ScenarioKind};
use outbox_testkit::relay::RelayProgram;

/// One relay of the comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct Contender {
    /// `seed`, or the name given (`dba1103=path`).
    pub name: String,
    /// `None`: the seed article's relay.
    pub program: Option<RelayProgram>,
}

impl Contender {
    /// `seed`, `NAME=PATH` to an `outbox-relay` binary, or `NAME=embedded`
    /// (the engine built into this `loadtest` binary).
    pub fn parse(text: &str) -> Result<Contender, String> {
        if text == "seed" {
            return Ok(Contender {
                name: "seed".into(),
                program: None,
            });
        }
        let (name, path) = text
            .split_once('=')
            .ok_or_else(|| format!("--relay `{text}`: expected `seed` or NAME=PATH"))?;
        if name.is_empty() || name == "seed" {
            return Err(format!(
                "--relay `{text}`: NAME must be non-empty and not `seed`"
            ));
        }
        let program = if path == "embedded" {
            let exe = std::env::current_exe().map_err(|e| format!("--relay `{text}`: {e}"))?;
            RelayProgram::embedded(exe)
        } else {
            let bin = PathBuf::from(path);
            if !bin.is_file() {
                return Err(format!("--relay `{text}`: no relay binary at {path}"));
            }
            RelayProgram::binary(bin)
        };
        Ok(Contender {
            name: name.into(),
            program: Some(program),
        })
    }
}

/// How to compare.
#[derive(Debug, Clone)]
pub struct CompareOptions {
    pub contenders: Vec<Contender>,
    pub rounds: u32,
    /// Each run's files (relay logs, reports) go under here.
    pub work_dir: PathBuf,
    /// The seed relay drains this many events (it runs at a few hundred
    /// events/s: a million would take most of an hour); its mix is the
    /// scenario's.
    pub seed_events: Option<u64>,
    /// Template of every run's options (database URL, sink binary, fsync_off).
    pub run: RunOptions,
}

/// One run's figures.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunFigures {
    pub scenario: String,
    pub relay: String,
    pub round: u32,
    pub passed: bool,
    pub events: u64,
    pub duration_secs: f64,
    pub events_per_sec: f64,
    pub relay_cpu_secs: f64,
    pub cpu_secs_per_million: f64,
    pub peak_rss_mib: f64,
    /// The largest anonymous resident set sampled (heap and stacks, without
    /// the binary's pages).
    #[serde(default)]
    pub peak_anon_mib: f64,
    /// Commit-to-sink latency (outbox-relay runs only).
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub max_ms: Option<f64>,
    pub environment: RunEnvironment,
    pub failures: Vec<String>,
}

/// Every run, in the order run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Comparison {
    pub runs: Vec<RunFigures>,
}

fn per_million(cpu: f64, events: u64) -> f64 {
    if events == 0 {
        0.0
    } else {
        cpu * 1e6 / events as f64
    }
}

/// The order of round `round` (from 0): as given, then reversed, alternating.
pub fn round_order(n: usize, round: u32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    if round % 2 == 1 {
        order.reverse();
    }
    order
}

/// The seed relay's version of `s`: a drain of `events` (default: the
/// scenario's) of the same mix; `None` when `s` is not an unordered drain
/// (the seed relay has no per-key order: an ordered scenario would run it
/// unordered again).
pub fn seed_scenario(s: &Scenario, events: Option<u64>) -> Option<Scenario> {
    if s.kind != ScenarioKind::Drain || s.ordered() {
        return None;
    }
    let mut seed = s.clone();
    seed.relay = RelayUnderTest::Seed;
    seed.name = format!("{}-seed", s.name);
    if let (Some(p), Some(n)) = (seed.preload.as_mut(), events) {
        p.events = p.events.min(n);
    }
    Some(seed)
}

/// Runs every scenario with every contender, `rounds` times, interleaved.
/// Writes `comparison.json` and each run's table under `work_dir` as it goes.
pub async fn run(scenarios: &[Scenario], opts: &CompareOptions) -> Result<Comparison, RunError> {
    std::fs::create_dir_all(&opts.work_dir)?;
    let mut all = Comparison::default();
    for s in scenarios {
        for round in 0..opts.rounds {
            for i in round_order(opts.contenders.len(), round) {
                let c = &opts.contenders[i];
                let out = opts
                    .work_dir
                    .join(&s.name)
                    .join(format!("{}-r{}", c.name, round + 1));
                let mut run = opts.run.clone();
                run.out_dir = out.clone();
                run.progress = false;
                // Announced when it runs: the seed relay skips ordered scenarios.
                let announce = || eprintln!("[{}] round {} {} ...", s.name, round + 1, c.name);
                let figures = match &c.program {
                    None => match seed_scenario(s, opts.seed_events) {
                        Some(seed) => {
                            announce();
                            let r = crate::baseline::run(&seed, &run).await?;
                            std::fs::write(out.join("table.txt"), r.table())?;
                            RunFigures {
                                scenario: s.name.clone(),
                                relay: c.name.clone(),
                                round: round + 1,
                                passed: r.passed(),
                                events: r.events,
                                duration_secs: r.duration_secs,
                                events_per_sec: r.throughput_per_sec,
                                relay_cpu_secs: r.usage.cpu_secs,
                                cpu_secs_per_million: per_million(
                                    r.usage.cpu_secs,
                                    r.published.max(0) as u64,
                                ),
                                peak_rss_mib: r.usage.peak_rss_kib as f64 / 1024.0,
                                peak_anon_mib: r.usage.peak_anon_kib as f64 / 1024.0,
                                p50_ms: None,
                                p99_ms: None,
                                max_ms: None,
                                environment: r.environment.clone(),
                                failures: Vec::new(),
                            }
                        }
                        None => continue,
                    },
                    Some(program) => {
                        announce();
                        run.relay = program.clone();
                        let r = run_scenario(s, &run).await?;
                        std::fs::write(out.join("table.txt"), r.table())?;
                        let ms = |us: u64| Some(us as f64 / 1000.0);
                        RunFigures {
                            scenario: s.name.clone(),
                            relay: c.name.clone(),
                            round: round + 1,
                            passed: r.passed,
                            events: r.delivered,
                            duration_secs: r.duration_secs,
                            events_per_sec: r.throughput_per_sec,
                            relay_cpu_secs: r.relay.cpu_secs,
                            cpu_secs_per_million: per_million(r.relay.cpu_secs, r.delivered),
                            peak_rss_mib: r.relay.peak_rss_kib as f64 / 1024.0,
                            peak_anon_mib: r.relay.peak_anon_kib as f64 / 1024.0,
                            p50_ms: ms(r.latency.p50_us),
                            p99_ms: ms(r.latency.p99_us),
                            max_ms: ms(r.latency.max_us),
                            environment: r.environment.clone().unwrap_or_default(),
                            failures: r.failures.clone(),
                        }
                    }
                };
                eprintln!(
                    "[{}] round {} {}: {:.0} events/s, {:.2} s CPU per 1M events, {:.1} MiB peak RSS ({:.1} MiB anonymous){}",
                    s.name,
                    round + 1,
                    c.name,
                    figures.events_per_sec,
                    figures.cpu_secs_per_million,
                    figures.peak_rss_mib,
                    figures.peak_anon_mib,
                    if figures.passed { "" } else { " (FAILED)" }
                );
                all.runs.push(figures);
                std::fs::write(
                    opts.work_dir.join("comparison.json"),
                    serde_json::to_string_pretty(&all).map_err(std::io::Error::other)?,
                )?;
            }
        }
    }
    Ok(all)
}

impl Comparison {
    fn of<'a>(
        &'a self,
        scenario: &'a str,
        relay: &'a str,
    ) -> impl Iterator<Item = &'a RunFigures> + 'a {
        self.runs
            .iter()
            .filter(move |r| r.scenario == scenario && r.relay == relay)
    }

    fn round_of(&self, scenario: &str, relay: &str, round: u32) -> Option<&RunFigures> {
        self.runs
            .iter()
            .find(|r| r.scenario == scenario && r.relay == relay && r.round == round)
    }

    /// Per-round ratios of `pick(relay)` to `pick(reference)`, as `a–b×`
    /// (lowest–highest over the rounds), or `-`.
    fn ratio(
        &self,
        scenario: &str,
        relay: &str,
        reference: &str,
        pick: impl Fn(&RunFigures) -> f64,
    ) -> String {
        let ratios: Vec<f64> = self
            .of(scenario, relay)
            .filter_map(|r| {
                let base = self.round_of(scenario, reference, r.round)?;
                let b = pick(base);
                (b > 0.0).then(|| pick(r) / b)
            })
            .collect();
        span(&ratios, "×", 2)
    }

    /// The Markdown report: each run's figures, then per relay the spread
    /// over the rounds and the per-round ratios to the seed and to `before`.
    pub fn markdown(&self, before: Option<&str>, command: &str) -> String {
        let mut md = String::new();
        let _ = writeln!(md, "Command:\n\n```sh\n{command}\n```\n");
        let mut scenarios: Vec<&str> = Vec::new();
        for r in &self.runs {
            if !scenarios.contains(&r.scenario.as_str()) {
                scenarios.push(&r.scenario);
            }
        }
        for s in &scenarios {
            let s = *s;
            let _ = writeln!(md, "## {s}\n");
            let _ = writeln!(
                md,
                "| round | relay | result | events | events/s | relay CPU s | CPU s / 1M events | peak RSS MiB | of it anonymous | p50 ms | p99 ms | max ms | load 1m before→after | busy cores | other processes' CPU |"
            );
            let _ = writeln!(
                md,
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
            );
            for r in self.runs.iter().filter(|r| r.scenario == s) {
                let opt = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
                let m = &r.environment.machine;
                let others: Vec<String> = m
                    .others_cpu_secs
                    .iter()
                    .take(3)
                    .map(|(n, c)| format!("{n} {c:.0} s"))
                    .collect();
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {:.0} | {:.2} | {:.2} | {:.1} | {:.1} | {} | {} | {} | {:.2}→{:.2} | {:.2} of {} | {} |",
                    r.round,
                    r.relay,
                    if r.passed { "pass" } else { "FAIL" },
                    r.events,
                    r.events_per_sec,
                    r.relay_cpu_secs,
                    r.cpu_secs_per_million,
                    r.peak_rss_mib,
                    r.peak_anon_mib,
                    opt(r.p50_ms),
                    opt(r.p99_ms),
                    opt(r.max_ms),
                    m.load_before[0],
                    m.load_after[0],
                    m.busy_cores,
                    m.cores,
                    others.join(", ")
                );
            }
            let mut relays: Vec<&str> = Vec::new();
            for r in self.runs.iter().filter(|r| r.scenario == s) {
                if !relays.contains(&r.relay.as_str()) {
                    relays.push(&r.relay);
                }
            }
            let has_seed = relays.contains(&"seed");
            let _ = writeln!(
                md,
                "\n| relay | events/s (rounds) | × seed, same round | × {b}, same round | CPU s / 1M events | CPU per event × {b} | peak RSS MiB | of it anonymous | p99 ms |",
                b = before.unwrap_or("before")
            );
            let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|");
            for relay in &relays {
                let runs: Vec<&RunFigures> = self.of(s, relay).collect();
                let eps: Vec<f64> = runs.iter().map(|r| r.events_per_sec).collect();
                let cpu: Vec<f64> = runs.iter().map(|r| r.cpu_secs_per_million).collect();
                let rss: Vec<f64> = runs.iter().map(|r| r.peak_rss_mib).collect();
                let anon: Vec<f64> = runs.iter().map(|r| r.peak_anon_mib).collect();
                let p99: Vec<f64> = runs.iter().filter_map(|r| r.p99_ms).collect();
                let x_seed = if has_seed && *relay != "seed" {
                    self.ratio(s, relay, "seed", |r| r.events_per_sec)
                } else {
                    "-".into()
                };
                let (x_before, cpu_before) = match before {
                    Some(b) if b != *relay && relays.contains(&b) => (
                        self.ratio(s, relay, b, |r| r.events_per_sec),
                        self.ratio(s, relay, b, |r| r.cpu_secs_per_million),
                    ),
                    _ => ("-".into(), "-".into()),
                };
                let _ = writeln!(
                    md,
                    "| {relay} | {} | {x_seed} | {x_before} | {} | {cpu_before} | {} | {} | {} |",
                    span(&eps, "", 0),
                    span(&cpu, "", 2),
                    span(&rss, "", 1),
                    span(&anon, "", 1),
                    span(&p99, "", 1),
                );
            }
            if let Some(first) = self.runs.iter().find(|r| r.scenario == s) {
                let e = &first.environment;
                let _ = writeln!(
                    md,
                    "\nDatabase server: {}. Sink: {}. Peak RSS is the kernel's high-water mark; \"of it anonymous\" is the largest resident anonymous memory sampled (heap and stacks), the rest being file pages, mostly the binary's code.\n",
                    e.server.describe(),
                    if e.sink_own_process {
                        "a process of its own (`loadtest sink`), a fresh one per run"
                    } else {
                        "in the harness's process"
                    }
                );
            }
        }
        if let Some((first, rest)) = scenarios.split_first() {
            if !rest.is_empty() {
                md += &self.across(first, rest);
            }
        }
        md
    }

    /// Each later scenario's events/s over the first's, per relay, same round.
    fn across(&self, first: &str, rest: &[&str]) -> String {
        let mut md = format!(
            "## Scenarios against {first}\n\n| relay | scenario | events/s ÷ {first}'s, same relay, same round |\n|---|---|---|\n"
        );
        let mut relays: Vec<&str> = Vec::new();
        for r in &self.runs {
            if !relays.contains(&r.relay.as_str()) {
                relays.push(&r.relay);
            }
        }
        for relay in relays {
            for s in rest {
                let ratios: Vec<f64> = self
                    .of(s, relay)
                    .filter_map(|r| {
                        let base = self.round_of(first, relay, r.round)?.events_per_sec;
                        (base > 0.0).then(|| r.events_per_sec / base)
                    })
                    .collect();
                if !ratios.is_empty() {
                    let _ = writeln!(md, "| {relay} | {s} | {} |", span(&ratios, "×", 2));
                }
            }
        }
        md
    }
}

/// `a–b` over `values` (or `a` when all equal), with `suffix`; `-` if none.
fn span(values: &[f64], suffix: &str, decimals: usize) -> String {
    if values.is_empty() {
        return "-".into();
    }
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if format!("{lo:.decimals$}") == format!("{hi:.decimals$}") {
        format!("{lo:.decimals$}{suffix}")
    } else {
        format!("{lo:.decimals$}–{hi:.decimals$}{suffix}")
    }
}

/// Reads every scenario file.
pub fn load_scenarios(paths: &[PathBuf]) -> Result<Vec<Scenario>, RunError> {
    paths
        .iter()
        .map(|p| Scenario::load(Path::new(p)).map_err(RunError::from))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_alternate_and_contenders_parse() {
        assert_eq!(round_order(3, 0), vec![0, 1, 2]);
        assert_eq!(round_order(3, 1), vec![2, 1, 0]);
        assert_eq!(Contender::parse("seed").unwrap().program, None);
        let e = Contender::parse("main").unwrap_err();
        assert!(e.contains("NAME=PATH"), "{e}");
        let e = Contender::parse("x=/nonexistent/outbox-relay").unwrap_err();
        assert!(e.contains("no relay binary"), "{e}");
        assert!(Contender::parse("seed=/bin/sh").is_err());
    }

    #[test]
    fn ratios_pair_runs_of_the_same_round() {
        let fig = |relay: &str, round: u32, eps: f64| RunFigures {
            scenario: "d".into(),
            relay: relay.into(),
            round,
            passed: true,
            events: 100,
            duration_secs: 1.0,
            events_per_sec: eps,
            relay_cpu_secs: 1.0,
            cpu_secs_per_million: eps / 100.0,
            peak_rss_mib: 10.0,
            peak_anon_mib: 4.0,
            p50_ms: None,
            p99_ms: None,
            max_ms: None,
            environment: RunEnvironment::default(),
            failures: Vec::new(),
        };
        let c = Comparison {
            runs: vec![
                fig("seed", 1, 100.0),
                fig("old", 1, 1000.0),
                fig("new", 1, 2000.0),
                fig("new", 2, 3000.0),
                fig("old", 2, 1000.0),
                fig("seed", 2, 200.0),
            ],
        };
        assert_eq!(
            c.ratio("d", "new", "seed", |r| r.events_per_sec),
            "15.00–20.00×"
        );
        assert_eq!(
            c.ratio("d", "new", "old", |r| r.events_per_sec),
            "2.00–3.00×"
        );
        let md = c.markdown(Some("old"), "loadtest compare ...");
        assert!(
            md.contains("| new | 2000–3000 | 15.00–20.00× | 2.00–3.00× |"),
            "{md}"
        );
        assert!(
            md.contains("| 20.00–30.00 | 2.00–3.00× | 10.0 | 4.0 | - |"),
            "{md}"
        );
    }
}
