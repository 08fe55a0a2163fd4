//! The human log format colours its lines only on a terminal, and never
//! with `NO_COLOR` set: a log written to a file or a pipe carries no ANSI
//! escapes.

mod common;

use std::path::Path;
use std::process::Command;

use common::{config_toml, QSTASH_ROUTE};

const ESCAPE: &str = "\x1b[";

/// A config file for `db` (a route, so `drain` runs; nothing to deliver).
fn config_file(db: &outbox_testkit::TestDb) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        file.path(),
        config_toml(db, "http://127.0.0.1:9", QSTASH_ROUTE),
    )
    .unwrap();
    file
}

/// `outbox-relay drain --config F` with logs at `debug`, stderr to a pipe.
fn drain(config: &Path, no_color: bool) -> String {
    let mut command = Command::new(common::BIN);
    outbox_testkit::relay::without_config_env(&mut command)
        .args(["drain", "--config"])
        .arg(config)
        .env("OUTBOX_RELAY_LOG", "debug")
        .env_remove("NO_COLOR");
    if no_color {
        command.env("NO_COLOR", "1");
    }
    let out = command.output().expect("the relay binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "drain failed: {stderr}");
    assert!(stderr.contains("DEBUG"), "no log lines: {stderr}");
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_to_a_pipe_carry_no_colour_escapes() {
    let db = common::test_db().await;
    let config = config_file(&db);
    let log = drain(config.path(), false);
    assert!(
        !log.contains(ESCAPE),
        "ANSI escapes in a log written to a pipe: {:?}",
        log.lines().find(|l| l.contains(ESCAPE))
    );
}

/// On a terminal (`script` gives the relay a pseudo-terminal): coloured,
/// unless `NO_COLOR` is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_on_a_terminal_are_coloured_unless_no_color_is_set() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: no `script` command (util-linux) to run the relay on a terminal");
        return;
    }
    let db = common::test_db().await;
    let config = config_file(&db);
    let on_a_terminal = |no_color: bool| {
        let line = format!(
            "{}'{}' drain --config '{}'",
            if no_color { "NO_COLOR=1 " } else { "" },
            common::BIN,
            config.path().display()
        );
        let mut command = Command::new("script");
        outbox_testkit::relay::without_config_env(&mut command)
            .args(["-qec", &line, "/dev/null"])
            .env("OUTBOX_RELAY_LOG", "debug")
            .env_remove("NO_COLOR");
        let out = command.output().expect("script runs");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "drain on a terminal failed: {text}");
        assert!(text.contains("DEBUG"), "no log lines: {text}");
        text
    };
    assert!(
        on_a_terminal(false).contains(ESCAPE),
        "no colour on a terminal"
    );
    let plain = on_a_terminal(true);
    assert!(
        !plain.contains(ESCAPE),
        "colour on a terminal with NO_COLOR set: {:?}",
        plain.lines().find(|l| l.contains(ESCAPE))
    );
}
