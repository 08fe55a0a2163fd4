//! The relay child-process paths of the test kit as the harness uses them,
//! against a stand-in script.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::time::Duration;

use loadtest::procstat::UsageTracker;
use outbox_testkit::relay::{Output, RelayCommand, RelayError, RelayProgram};

/// `migrate` fails with a message when asked to; `run` waits for SIGTERM and exits 0.
const STAND_IN: &str = r#"#!/bin/sh
case "$1" in
  migrate)
    [ "$FAIL_MIGRATE" = 1 ] && { echo "cannot reach $DATABASE_URL" >&2; exit 3; }
    exit 0 ;;
  run)
    [ "$2" = "--config" ] && [ -f "$3" ] || exit 4
    [ -n "$QSTASH_URL" ] && [ -n "$QSTASH_TOKEN" ] || exit 5
    trap 'exit 0' TERM
    echo "relay up"
    while :; do sleep 0.05; done ;;
esac
exit 2
"#;

fn stand_in(dir: &tempfile::TempDir, fail_migrate: bool) -> RelayCommand {
    let bin = dir.path().join("outbox-relay");
    let script = if fail_migrate {
        STAND_IN.replace("\"$FAIL_MIGRATE\" = 1", "1 = 1")
    } else {
        STAND_IN.to_owned()
    };
    std::fs::write(&bin, script).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = dir.path().join("relay.toml");
    std::fs::write(&config, "").unwrap();
    let log = dir.path().join("relay.log");
    RelayCommand::new(&RelayProgram::binary(bin), config)
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/x")
        .env("QSTASH_URL", "http://127.0.0.1:1")
        .env("QSTASH_TOKEN", "t")
        .output(Output::Append(log.clone()), Output::Append(log))
}

/// Polls the log until the stand-in said it is up `n` times (its TERM trap is set by then).
async fn wait_until_up(dir: &tempfile::TempDir, n: usize) {
    let log = dir.path().join("relay.log");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::fs::read_to_string(&log)
        .unwrap_or_default()
        .matches("relay up")
        .count()
        < n
    {
        assert!(
            std::time::Instant::now() < deadline,
            "stand-in never came up"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn start_sample_sigterm_and_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = stand_in(&dir, false);
    cmd.migrate().await.unwrap();

    let relay = cmd.spawn().unwrap();
    wait_until_up(&dir, 1).await;
    let mut usage = UsageTracker::default();
    usage.sample(relay.pid());
    let u = usage.usage();
    assert_eq!(u.processes, 1);
    assert!(u.peak_rss_kib > 0);
    let status = relay.terminate(Duration::from_secs(30)).await.unwrap();
    assert!(status.success());

    let relay = cmd.spawn().unwrap();
    wait_until_up(&dir, 2).await;
    let status = relay.kill().await.unwrap();
    assert_eq!(status.signal(), Some(9));
}

#[tokio::test]
async fn a_failing_migrate_reports_its_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let err = stand_in(&dir, true).migrate().await.unwrap_err();
    assert!(matches!(err, RelayError::Migrate { .. }));
    assert!(
        err.to_string().contains("cannot reach postgres://"),
        "{err}"
    );
}

#[tokio::test]
async fn a_missing_binary_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = stand_in(&dir, false);
    cmd.bin = PathBuf::from("/nonexistent/outbox-relay");
    let err = cmd.spawn().err().unwrap();
    assert!(
        err.to_string().contains("/nonexistent/outbox-relay"),
        "{err}"
    );
}

#[test]
fn the_default_relay_is_the_sibling_binary_when_current_else_the_embedded_engine() {
    use outbox_testkit::relay::locate_relay;
    let dir = tempfile::tempdir().unwrap();
    let sources = dir.path().join("ws");
    std::fs::create_dir_all(sources.join("src")).unwrap();
    std::fs::write(sources.join("src/lib.rs"), "").unwrap();
    let profile = dir.path().join("release");
    let deps = profile.join("deps");
    std::fs::create_dir_all(&deps).unwrap();
    let test_exe = deps.join("chaos-0123");
    let loadtest = profile.join("loadtest");
    let src = Some(sources.as_path());
    // No sibling: the engine embedded in the loadtest binary.
    assert_eq!(
        locate_relay(&loadtest, src),
        RelayProgram::embedded(&loadtest)
    );
    // A sibling newer than the sources: that binary, also seen from deps/.
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(profile.join("outbox-relay"), "").unwrap();
    let expected = RelayProgram::binary(profile.join("outbox-relay"));
    assert_eq!(locate_relay(&loadtest, src), expected);
    assert_eq!(locate_relay(&test_exe, src), expected);
    // A source edited after the build: stale, so not used (unless no sources are known).
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(sources.join("src/lib.rs"), "//").unwrap();
    assert!(locate_relay(&loadtest, src).is_embedded());
    assert_eq!(locate_relay(&loadtest, None), expected);
}

/// The state letter of `/proc/<pid>/stat` (`T` = stopped), polled until `want` holds.
async fn wait_for_state(pid: u32, want: impl Fn(char) -> bool) -> char {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        let state = stat[stat.rfind(')').unwrap() + 1..]
            .split_whitespace()
            .next()
            .and_then(|s| s.chars().next())
            .unwrap();
        if want(state) || std::time::Instant::now() >= deadline {
            return state;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn pause_and_resume_and_a_paused_relay_still_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let cmd = stand_in(&dir, false);
    let relay = cmd.spawn().unwrap();
    wait_until_up(&dir, 1).await;
    let pid = relay.pid();

    relay.pause();
    assert_eq!(wait_for_state(pid, |s| s == 'T').await, 'T');
    relay.resume();
    assert_ne!(wait_for_state(pid, |s| s != 'T').await, 'T');

    // SIGTERM alone would stay pending on a stopped process: terminate continues it first.
    relay.pause();
    assert_eq!(wait_for_state(pid, |s| s == 'T').await, 'T');
    let status = relay.terminate(Duration::from_secs(10)).await.unwrap();
    assert!(status.success(), "{status:?}");

    let relay = cmd.spawn().unwrap();
    wait_until_up(&dir, 2).await;
    relay.pause();
    assert_eq!(wait_for_state(relay.pid(), |s| s == 'T').await, 'T');
    let status = relay.kill().await.unwrap();
    assert_eq!(status.signal(), Some(9));
}
