//! The `outbox-relay` binary as a child process, for the tests of signals,
//! crashes and replicas.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

pub struct RelayProcess {
    pub child: Child,
    _config: tempfile::NamedTempFile,
}

impl RelayProcess {
    /// `outbox-relay <args> --config <a file holding config_toml>`, logging
    /// warnings to the test's stderr.
    pub fn spawn(args: &[&str], config_toml: &str, stdout: Stdio) -> RelayProcess {
        let config = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(config.path(), config_toml).unwrap();
        let child = Command::new(BIN)
            .args(args)
            .arg("--config")
            .arg(config.path())
            .env("OUTBOX_RELAY_LOG", "warn")
            .stdout(stdout)
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        RelayProcess {
            child,
            _config: config,
        }
    }

    pub fn signal(&self, signal: Signal) {
        kill(Pid::from_raw(self.child.id() as i32), signal).unwrap();
    }

    /// Waits for the process to exit, at most `limit` (then kills it).
    pub async fn exit_within(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        // A stopped process must be continued to die cleanly.
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Clears the variables that override a config file's settings, so a test's
/// config is what the child runs with whatever the test's environment holds.
pub fn without_config_env(command: &mut Command) -> &mut Command {
    for name in [
        "DATABASE_URL",
        "QSTASH_URL",
        "QSTASH_TOKEN",
        "QSTASH_CURRENT_SIGNING_KEY",
        "QSTASH_NEXT_SIGNING_KEY",
        "OUTBOX_RELAY_LOG_FORMAT",
    ] {
        command.env_remove(name);
    }
    command
}
