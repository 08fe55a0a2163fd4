//! The relay under test as a child process: the real `outbox-relay` binary,
//! `run --config <file>` with DATABASE_URL, QSTASH_URL and QSTASH_TOKEN in its
//! environment; it must exit 0 on SIGTERM. `outbox-relay migrate` creates the schema.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

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

/// The workspace root this harness was compiled from, if it is still there.
pub fn compiled_sources() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
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

/// How to start the relay.
#[derive(Debug, Clone)]
pub struct RelayCommand {
    pub bin: PathBuf,
    /// Arguments before the subcommand (see [`RelayProgram::args`]).
    pub args: Vec<String>,
    pub config: PathBuf,
    pub database_url: String,
    pub qstash_url: String,
    pub qstash_token: String,
    /// stdout and stderr are appended here (one file over restarts).
    pub log: Option<PathBuf>,
}

impl RelayCommand {
    fn command(&self, args: &[&str]) -> Result<Command, RelayError> {
        let mut c = Command::new(&self.bin);
        c.args(&self.args)
            .args(args)
            .env("DATABASE_URL", &self.database_url)
            .env("QSTASH_URL", &self.qstash_url)
            .env("QSTASH_TOKEN", &self.qstash_token)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        match &self.log {
            Some(path) => {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?;
                c.stdout(f.try_clone()?).stderr(f);
            }
            None => {
                c.stdout(Stdio::null()).stderr(Stdio::null());
            }
        }
        Ok(c)
    }

    /// `outbox-relay migrate`, waiting for it to finish.
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

    /// `outbox-relay run --config <file>`.
    pub fn spawn(&self) -> Result<RelayProcess, RelayError> {
        let config = self.config.display().to_string();
        let child = self
            .command(&["run", "--config", &config])?
            .spawn()
            .map_err(|source| RelayError::Spawn {
                bin: self.bin.display().to_string(),
                source,
            })?;
        let pid = child.id().unwrap_or(0);
        Ok(RelayProcess { child, pid })
    }
}

/// A running relay.
pub struct RelayProcess {
    child: Child,
    pid: u32,
}

impl RelayProcess {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The exit status if it already exited (a crash, when we did not stop it).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid; harmless if it already exited
        // (it stays a zombie until waited, so the pid is not reused).
        unsafe {
            libc::kill(self.pid as libc::pid_t, sig);
        }
    }

    /// SIGSTOP: the process is frozen (its sockets and leases stay as they
    /// are) until [`resume`](Self::resume).
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT; harmless when the process is not stopped.
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
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
        self.signal(libc::SIGTERM);
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
        self.signal(libc::SIGKILL);
        Ok(self.child.wait().await?)
    }
}
