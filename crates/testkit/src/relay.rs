//! The relay under test as a child process: an `outbox-relay` binary (or the
//! engine embedded in another binary, [`RelayProgram`]), started as
//! `<subcommand…> --config <file>` ([`RelayCommand`]) with what the test or
//! the harness puts in its environment; `run` must exit 0 on SIGTERM.
//! `migrate` creates the schema. [`RelayProcess`] sends it signals (kill,
//! pause, continue, terminate) and waits for its exit.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::kill;
pub use nix::sys::signal::Signal;
use nix::unistd::Pid;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("cannot start {bin}: {source}")]
    Spawn { bin: String, source: std::io::Error },
    #[error("`{bin} migrate` failed ({status}): {stderr}")]
    Migrate {
        bin: String,
        status: ExitStatus,
        stderr: String,
    },
    #[error("the relay did not exit within {0:?} of SIGTERM (killed)")]
    StopTimeout(Duration),
    #[error("the relay exited with {0} on SIGTERM, not 0")]
    BadExit(ExitStatus),
    #[error("cannot write the relay's config file: {0}")]
    Config(std::io::Error),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// The hidden subcommand of the `loadtest` binary that runs the relay engine
/// (`outbox_relay::run_until_signal`, the daemon `outbox-relay run` runs) in
/// that process: `loadtest embedded-relay migrate|run --config <file>`.
pub const EMBEDDED_RELAY_SUBCOMMAND: &str = "embedded-relay";

/// A program that behaves as `outbox-relay`: `<bin> <args…> migrate` and
/// `<bin> <args…> run --config <file>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayProgram {
    pub bin: PathBuf,
    /// Put before `migrate` / `run` (the embedded relay's subcommand).
    pub args: Vec<String>,
}

impl RelayProgram {
    /// The `outbox-relay` binary at `bin`.
    pub fn binary(bin: impl Into<PathBuf>) -> Self {
        RelayProgram {
            bin: bin.into(),
            args: Vec::new(),
        }
    }

    /// The relay engine run by a `loadtest` binary (always built from the
    /// same sources as the harness, so never stale or missing).
    pub fn embedded(loadtest_bin: impl Into<PathBuf>) -> Self {
        RelayProgram {
            bin: loadtest_bin.into(),
            args: vec![EMBEDDED_RELAY_SUBCOMMAND.to_owned()],
        }
    }

    pub fn is_embedded(&self) -> bool {
        !self.args.is_empty()
    }

    pub fn describe(&self) -> String {
        if self.is_embedded() {
            format!(
                "{} {} (embedded relay engine)",
                self.bin.display(),
                self.args.join(" ")
            )
        } else {
            self.bin.display().to_string()
        }
    }
}

/// The relay for a run when none is named: the `outbox-relay` built next to
/// `loadtest_bin` (`target/<profile>/`, also seen from `target/<profile>/deps/`)
/// when it exists and, if the engine's `sources` (the workspace root) are at
/// hand, no source file is newer than it; else the relay engine embedded in
/// `loadtest_bin`, which is built from the same sources as the harness.
pub fn locate_relay(loadtest_bin: &Path, sources: Option<&Path>) -> RelayProgram {
    let mut dir = loadtest_bin
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    let sibling = dir.join("outbox-relay");
    let current = mtime(&sibling).is_some_and(|built| {
        sources
            .and_then(newest_source)
            .is_none_or(|newest| newest <= built)
    });
    if current {
        RelayProgram::binary(sibling)
    } else {
        RelayProgram::embedded(loadtest_bin)
    }
}

/// The workspace root this kit was compiled from, if it is still there.
pub fn compiled_sources() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()?
        .parent()?
        .to_path_buf();
    root.join("src/main.rs").is_file().then_some(root)
}

fn mtime(p: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// The newest mtime of the engine's inputs: `Cargo.toml`, `Cargo.lock`,
/// `src/**`, `migrations/**`.
fn newest_source(root: &Path) -> Option<std::time::SystemTime> {
    fn walk(p: &Path, newest: &mut Option<std::time::SystemTime>) {
        if p.is_dir() {
            for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
                walk(&e.path(), newest);
            }
        } else if let Some(t) = mtime(p) {
            *newest = (*newest).max(Some(t));
        }
    }
    let mut newest = None;
    for part in ["Cargo.toml", "Cargo.lock", "src", "migrations"] {
        walk(&root.join(part), &mut newest);
    }
    newest
}

/// Where one of the child's output streams goes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Output {
    /// Discarded.
    #[default]
    Null,
    /// To this process's own stream (a test's output).
    Inherit,
    /// Kept in a pipe: read stdout with [`RelayProcess::read_stdout`].
    Captured,
    /// Appended to this file (one file over restarts; stdout and stderr may share it).
    Append(PathBuf),
}

impl Output {
    fn stdio(&self) -> Result<Stdio, RelayError> {
        Ok(match self {
            Output::Null => Stdio::null(),
            Output::Inherit => Stdio::inherit(),
            Output::Captured => Stdio::piped(),
            Output::Append(path) => std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?
                .into(),
        })
    }
}

/// The environment variables that override a config file's settings
/// (besides `OUTBOX_RELAY_<SECTION>__<KEY>`).
pub const CONFIG_ENV: &[&str] = &[
    "DATABASE_URL",
    "QSTASH_URL",
    "QSTASH_TOKEN",
    "QSTASH_CURRENT_SIGNING_KEY",
    "QSTASH_NEXT_SIGNING_KEY",
    "OUTBOX_RELAY_LOG_FORMAT",
];

/// Clears [`CONFIG_ENV`] from `command`, so a test's config file is what the
/// child runs with, whatever the test's environment holds.
pub fn without_config_env(command: &mut std::process::Command) -> &mut std::process::Command {
    for name in CONFIG_ENV {
        command.env_remove(name);
    }
    command
}

/// How to start the relay: the program, its config file, what is set in its
/// environment and where its output goes.
#[derive(Debug, Clone)]
pub struct RelayCommand {
    pub bin: PathBuf,
    /// Arguments before the subcommand (see [`RelayProgram::args`]).
    pub args: Vec<String>,
    pub config: PathBuf,
    /// Set in the child's environment, on top of what it inherits.
    pub env: Vec<(String, String)>,
    pub stdout: Output,
    pub stderr: Output,
    /// A config file written for this command, removed when the command and
    /// every process started from it are gone.
    config_file: Option<Arc<tempfile::TempPath>>,
}

impl RelayCommand {
    /// `program` with the config file `config`; the environment inherited,
    /// the output discarded.
    pub fn new(program: &RelayProgram, config: impl Into<PathBuf>) -> RelayCommand {
        RelayCommand {
            bin: program.bin.clone(),
            args: program.args.clone(),
            config: config.into(),
            env: Vec::new(),
            stdout: Output::Null,
            stderr: Output::Null,
            config_file: None,
        }
    }

    /// `program` with `toml` as its config, in a temporary file.
    pub fn with_config_text(
        program: &RelayProgram,
        toml: &str,
    ) -> Result<RelayCommand, RelayError> {
        let file = tempfile::Builder::new()
            .prefix("outbox-relay-")
            .suffix(".toml")
            .tempfile()
            .map_err(RelayError::Config)?;
        std::fs::write(file.path(), toml).map_err(RelayError::Config)?;
        let path = file.into_temp_path();
        let mut cmd = RelayCommand::new(program, path.to_path_buf());
        cmd.config_file = Some(Arc::new(path));
        Ok(cmd)
    }

    /// Sets `name` in the child's environment.
    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> RelayCommand {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Where stdout and stderr go.
    pub fn output(mut self, stdout: Output, stderr: Output) -> RelayCommand {
        self.stdout = stdout;
        self.stderr = stderr;
        self
    }

    fn command(&self, subcommand: &[&str]) -> Result<Command, RelayError> {
        let mut c = Command::new(&self.bin);
        c.args(&self.args)
            .args(subcommand)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(self.stdout.stdio()?)
            .stderr(self.stderr.stdio()?)
            .kill_on_drop(true);
        Ok(c)
    }

    /// `<bin> <args…> migrate`, waiting for it to finish.
    pub async fn migrate(&self) -> Result<(), RelayError> {
        let mut c = self.command(&["migrate"])?;
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        let out = c.output().await.map_err(|source| RelayError::Spawn {
            bin: self.bin.display().to_string(),
            source,
        })?;
        if out.status.success() {
            Ok(())
        } else {
            Err(RelayError::Migrate {
                bin: self.bin.display().to_string(),
                status: out.status,
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            })
        }
    }

    /// `<bin> <args…> run --config <file>`.
    pub fn spawn(&self) -> Result<RelayProcess, RelayError> {
        self.spawn_with(&["run"])
    }

    /// `<bin> <args…> <subcommand…> --config <file>`, e.g. `["drain", "--json"]`.
    pub fn spawn_with(&self, subcommand: &[&str]) -> Result<RelayProcess, RelayError> {
        let config = self.config.display().to_string();
        let mut command = self.command(&[subcommand, &["--config", &config]].concat())?;
        let child = spawn_when_not_busy(&mut command).map_err(|source| RelayError::Spawn {
            bin: self.bin.display().to_string(),
            source,
        })?;
        let pid = child.id().unwrap_or(0);
        Ok(RelayProcess {
            child,
            pid,
            _config: self.config_file.clone(),
        })
    }
}

/// Spawns `command`, again a few times while the kernel says the binary is
/// being written (ETXTBSY): a binary a test has just written can stay open
/// for writing a moment in a child another thread of the test process forked
/// meanwhile. Any other error, or a busy file for a second, is returned.
fn spawn_when_not_busy(command: &mut Command) -> std::io::Result<Child> {
    let mut tries = 0;
    loop {
        match command.spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 20 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

/// A running relay. Dropping it kills the process (continued first, so no
/// stopped process is left behind).
pub struct RelayProcess {
    child: Child,
    pid: u32,
    _config: Option<Arc<tempfile::TempPath>>,
}

impl RelayProcess {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The exit status if it already exited (a crash, when we did not stop it).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Sends `signal`; harmless if the process already exited (it stays a
    /// zombie until waited, so the pid is not reused).
    pub fn signal(&self, signal: Signal) {
        let _ = kill(Pid::from_raw(self.pid as i32), signal);
    }

    /// SIGSTOP: the process is frozen (its sockets and leases stay as they
    /// are) until [`resume`](Self::resume).
    pub fn pause(&self) {
        self.signal(Signal::SIGSTOP);
    }

    /// SIGCONT; harmless when the process is not stopped.
    pub fn resume(&self) {
        self.signal(Signal::SIGCONT);
    }

    /// Waits for the process to exit, at most `limit` (then kills it: `None`).
    pub async fn exit_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        match tokio::time::timeout(limit, self.child.wait()).await {
            Ok(status) => status.ok(),
            Err(_) => {
                self.resume();
                let _ = self.child.kill().await;
                None
            }
        }
    }

    /// Everything the process wrote to stdout ([`Output::Captured`]), read to
    /// its end; empty when stdout was not captured.
    pub async fn read_stdout(&mut self) -> Result<String, RelayError> {
        let mut out = String::new();
        if let Some(stdout) = self.child.stdout.as_mut() {
            stdout.read_to_string(&mut out).await?;
        }
        Ok(out)
    }

    /// SIGCONT (a stopped process does not act on SIGTERM until continued),
    /// SIGTERM and wait; the relay must exit 0 within `timeout`, else it is killed.
    pub async fn terminate(mut self, timeout: Duration) -> Result<ExitStatus, RelayError> {
        if let Some(status) = self.exited() {
            return if status.success() {
                Ok(status)
            } else {
                Err(RelayError::BadExit(status))
            };
        }
        self.resume();
        self.signal(Signal::SIGTERM);
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => {
                let status = status?;
                if status.success() {
                    Ok(status)
                } else {
                    Err(RelayError::BadExit(status))
                }
            }
            Err(_) => {
                let _ = self.child.kill().await;
                Err(RelayError::StopTimeout(timeout))
            }
        }
    }

    /// SIGKILL (a crash at any instruction) and reap it. A paused process is
    /// continued first, so no stopped process is ever left behind.
    pub async fn kill(mut self) -> Result<ExitStatus, RelayError> {
        self.resume();
        self.signal(Signal::SIGKILL);
        Ok(self.child.wait().await?)
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if self.exited().is_none() {
            self.resume();
            let _ = self.child.start_kill();
        }
    }
}
