//! Helpers shared by the scenario tests: the relay and database server the
//! scenario runs use.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use outbox_testkit::relay::{compiled_sources, locate_relay, RelayProgram};

/// The relay under test: `LOADTEST_RELAY_BIN` if set (not an
/// `OUTBOX_RELAY_` name: the relay reads every such variable as a
/// configuration key, and refuses an unknown one); else
/// `target/<profile>/outbox-relay` next to the test when no engine source
/// file is newer than it; else the engine embedded in this package's
/// `loadtest` binary, which cargo always builds for this package's tests.
pub fn relay() -> RelayProgram {
    if let Some(bin) = std::env::var_os("LOADTEST_RELAY_BIN") {
        return RelayProgram::binary(PathBuf::from(bin));
    }
    let found = locate_relay(
        &std::env::current_exe().unwrap(),
        compiled_sources().as_deref(),
    );
    if found.is_embedded() {
        RelayProgram::embedded(env!("CARGO_BIN_EXE_loadtest"))
    } else {
        found
    }
}

/// `TEST_DATABASE_URL`, else the local default server when it answers, else
/// `None` (the runner starts a throwaway cluster).
pub async fn server_url() -> Option<String> {
    let url = std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| outbox_testkit::DEFAULT_SERVER_URL.to_owned());
    let probe = tokio::time::timeout(Duration::from_secs(5), outbox_relay::store::connect(&url));
    matches!(probe.await, Ok(Ok(_))).then_some(url)
}

/// A scenario run by a test: its report, its output directory, and the
/// report's table with the last lines of every replica's log (for failure
/// messages).
pub struct TestRun {
    pub report: loadtest::report::Report,
    pub out_dir: PathBuf,
    pub context: String,
    /// Holds `out_dir`: bind it while the files are needed.
    pub dir: tempfile::TempDir,
}

/// Runs `scenario` against [`relay`] and [`server_url`], panicking when it
/// takes longer than `limit`. With `LOADTEST_KEEP_OUT` set, the output
/// directory (every relay's whole log, the report) is kept and named on
/// stderr, to read after a failure.
pub async fn run_in_test(
    scenario: &loadtest::scenario::Scenario,
    limit: Duration,
    log_lines: usize,
) -> TestRun {
    let mut dir = tempfile::tempdir().unwrap();
    if std::env::var_os("LOADTEST_KEEP_OUT").is_some() {
        dir.disable_cleanup(true);
        eprintln!("output kept in {}", dir.path().display());
    }
    let mut opts = loadtest::runner::RunOptions::new(dir.path().join("out"));
    opts.relay = relay();
    opts.progress = false;
    opts.database_url = server_url().await;
    opts.sink_bin = Some(env!("CARGO_BIN_EXE_loadtest").into());
    eprintln!("relay under test: {}", opts.relay.describe());
    let run = tokio::time::timeout(limit, loadtest::runner::run_scenario(scenario, &opts));
    let report = run
        .await
        .unwrap_or_else(|_| panic!("the {} run did not finish within {limit:?}", scenario.name))
        .unwrap();
    let context = format!(
        "{}{}",
        report.table(),
        log_tails(&opts.out_dir, scenario.replicas, log_lines)
    );
    // A log written to a file carries no colour escapes, from the binary or
    // the engine embedded in `loadtest` alike.
    for i in 0..scenario.replicas {
        let name = loadtest::runner::replica_file_name("relay", "log", i, scenario.replicas);
        let log = std::fs::read_to_string(opts.out_dir.join(&name)).unwrap_or_default();
        assert!(
            !log.contains('\u{1b}'),
            "{name} has ANSI escapes: {context}"
        );
    }
    TestRun {
        report,
        out_dir: opts.out_dir,
        context,
        dir,
    }
}

/// The last `n` lines of every replica's log.
pub fn log_tails(dir: &std::path::Path, replicas: u32, n: usize) -> String {
    let mut out = String::new();
    for i in 0..replicas {
        let name = loadtest::runner::replica_file_name("relay", "log", i, replicas);
        let log = std::fs::read_to_string(dir.join(&name)).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        out += &format!(
            "\n{name} (last lines):\n{}",
            lines[lines.len().saturating_sub(n)..].join("\n")
        );
    }
    out
}
