//! The sink of a run: in the harness's process, or in a process of its own
//! (`loadtest sink`) so that its CPU, allocations and threads do not share a
//! process with the harness's producers and checks. Performance scenarios use
//! their own process ([`crate::scenario::Scenario::sink_in_own_process`]);
//! the process writes every record it took as JSON lines when it is stopped,
//! and the run reads them back to verify and time each event.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use outbox_testkit::sink::{AnswerEvent, OutageWindow, Record, SinkHandle, SinkStats};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};

use crate::runner::RunError;

fn setup(what: &str, e: impl std::fmt::Display) -> RunError {
    RunError::Setup(format!("sink process: {what}: {e}"))
}

/// A `loadtest sink` child process on a free loopback port.
pub struct SinkProcess {
    child: tokio::process::Child,
    stdout: BufReader<tokio::process::ChildStdout>,
    url: String,
    token: String,
    port: u16,
    records_path: PathBuf,
    _dir: tempfile::TempDir,
}

impl SinkProcess {
    /// Starts `bin sink` (a `loadtest` binary), its stderr to `log`, and
    /// waits until it says where it listens.
    pub async fn start(
        bin: &Path,
        dedup_window: Duration,
        log: &Path,
    ) -> Result<SinkProcess, RunError> {
        let dir = tempfile::Builder::new()
            .prefix("loadtest-sink-")
            .tempdir()?;
        let records_path = dir.path().join("records.jsonl");
        let mut child = tokio::process::Command::new(bin)
            .arg("sink")
            .args(["--bind", "127.0.0.1:0"])
            .arg("--dedup-window")
            .arg(format!("{}s", dedup_window.as_secs().max(1)))
            .arg("--records-out")
            .arg(&records_path)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(log)?)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| setup(&format!("cannot start {}", bin.display()), e))?;
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
        let (mut url, mut token) = (None, None);
        let read = async {
            let mut line = String::new();
            while url.is_none() || token.is_none() {
                line.clear();
                if stdout.read_line(&mut line).await? == 0 {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "it exited before saying where it listens",
                    ));
                }
                if let Some(v) = line.trim().strip_prefix("QSTASH_URL=") {
                    url = Some(v.to_owned());
                } else if let Some(v) = line.trim().strip_prefix("QSTASH_TOKEN=") {
                    token = Some(v.to_owned());
                }
            }
            Ok(())
        };
        tokio::time::timeout(Duration::from_secs(30), read)
            .await
            .map_err(|_| setup("start", "no address within 30 s"))?
            .map_err(|e| setup("start", format!("{e}; see {}", log.display())))?;
        let url = url.expect("read until set");
        let port = url
            .rsplit(':')
            .next()
            .and_then(|p| p.trim_end_matches('/').parse().ok())
            .ok_or_else(|| setup("start", format!("no port in {url}")))?;
        Ok(SinkProcess {
            child,
            stdout,
            url,
            token: token.expect("read until set"),
            port,
            records_path,
            _dir: dir,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// SIGINT, then its records and counters.
    pub async fn finish(mut self) -> Result<(Vec<Record>, SinkStats), RunError> {
        let pid = self.pid();
        if pid != 0 {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGINT) };
        }
        let mut rest = String::new();
        let status = tokio::time::timeout(Duration::from_secs(120), async {
            self.stdout.read_to_string(&mut rest).await?;
            self.child.wait().await
        })
        .await
        .map_err(|_| setup("stop", "did not exit within 120 s of SIGINT"))??;
        if !status.success() {
            return Err(setup("stop", format!("exited with {status}")));
        }
        let stats: SinkStats =
            serde_json::from_str(rest.trim()).map_err(|e| setup("its counters", e))?;
        let file = std::fs::File::open(&self.records_path)?;
        let mut records = Vec::new();
        for line in std::io::BufReader::new(file).lines() {
            let line = line?;
            if !line.is_empty() {
                records.push(serde_json::from_str(&line).map_err(|e| setup("a record", e))?);
            }
        }
        Ok((records, stats))
    }
}

/// The run's sink, wherever it runs.
pub enum RunSink {
    InProcess(SinkHandle),
    Process(Box<SinkProcess>),
}

/// What the sink saw, once it stopped.
pub struct SinkResult {
    pub records: Vec<Record>,
    pub stats: SinkStats,
    pub answers: Vec<AnswerEvent>,
    pub outages: Vec<OutageWindow>,
    /// CPU seconds of the sink's own process.
    pub cpu_secs: Option<f64>,
}

impl RunSink {
    pub fn url(&self) -> String {
        match self {
            RunSink::InProcess(h) => h.url(),
            RunSink::Process(p) => p.url.clone(),
        }
    }

    pub fn token(&self) -> String {
        match self {
            RunSink::InProcess(h) => h.token().to_owned(),
            RunSink::Process(p) => p.token.clone(),
        }
    }

    pub fn port(&self) -> u16 {
        match self {
            RunSink::InProcess(h) => h.addr().port(),
            RunSink::Process(p) => p.port,
        }
    }

    /// Messages taken so far (the progress bar); 0 for a separate process,
    /// which says only at the end.
    pub fn record_count(&self) -> usize {
        match self {
            RunSink::InProcess(h) => h.record_count(),
            RunSink::Process(_) => 0,
        }
    }

    pub fn in_process(&self) -> Option<&SinkHandle> {
        match self {
            RunSink::InProcess(h) => Some(h),
            RunSink::Process(_) => None,
        }
    }

    pub fn pid(&self) -> Option<u32> {
        match self {
            RunSink::InProcess(_) => None,
            RunSink::Process(p) => Some(p.pid()),
        }
    }

    /// Stops it and returns what it saw.
    pub async fn finish(self) -> Result<SinkResult, RunError> {
        match self {
            RunSink::InProcess(h) => {
                let result = SinkResult {
                    records: h.records(),
                    stats: h.stats(),
                    answers: h.answers(),
                    outages: h.outages(),
                    cpu_secs: None,
                };
                h.stop().await;
                Ok(result)
            }
            RunSink::Process(p) => {
                let pid = p.pid();
                let cpu = crate::procstat::read_proc(pid).ok();
                let (records, stats) = p.finish().await?;
                let tck = crate::procstat::clock_ticks_per_sec() as f64;
                Ok(SinkResult {
                    records,
                    stats,
                    answers: Vec::new(),
                    outages: Vec::new(),
                    cpu_secs: cpu.map(|c| c.cpu_ticks as f64 / tck),
                })
            }
        }
    }
}

/// The `loadtest` binary to run the sink with: `LOADTEST_BIN`, this
/// process when it is `loadtest`, else `loadtest` in this binary's directory
/// or its parent (a test binary's `deps/`).
pub fn locate_sink_bin() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os("LOADTEST_BIN") {
        return Some(PathBuf::from(bin));
    }
    let exe = std::env::current_exe().ok()?;
    if exe.file_name().is_some_and(|n| n == "loadtest") {
        return Some(exe);
    }
    let dir = exe.parent()?;
    [dir.join("loadtest"), dir.parent()?.join("loadtest")]
        .into_iter()
        .find(|p| p.is_file())
}
