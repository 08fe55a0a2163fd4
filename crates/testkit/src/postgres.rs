//! Real PostgreSQL for tests, benchmarks and the load-test harness: a fresh
//! database per test on a running server, or a throwaway cluster of our own
//! when no server answers.
//!
//! A database is created empty; the caller gives it a schema
//! ([`TestDb::with_setup`], e.g. with the relay's migrations). Connections are
//! plain TCP: test servers are local.

use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use tokio_postgres::NoTls;

/// Where tests look for a server, in order: `TEST_DATABASE_URL`, then this.
pub const DEFAULT_SERVER_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    #[error("{0}")]
    Cluster(String),
    #[error("database URL `{url}` is not valid: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("database: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("setting up test database {name}: {reason}")]
    Setup { name: String, reason: String },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// What a throwaway cluster starts with beyond the test defaults.
#[derive(Debug, Clone, Default)]
pub struct ClusterOptions {
    /// Serve TLS with these files (`ssl = on`).
    pub tls: Option<ServerTls>,
    /// The whole `pg_hba.conf`, in place of initdb's (trust for everyone).
    pub hba: Option<String>,
    /// Production-like durability for measurements: `fsync`,
    /// `synchronous_commit`, `full_page_writes` and autovacuum on, as a
    /// user's server runs. Off (the default) for tests, which need speed, not
    /// crash safety: fsync, synchronous_commit and full_page_writes off.
    pub durable: bool,
    /// `shared_buffers` (a PostgreSQL size, e.g. `1GB`); 256MB when absent.
    pub shared_buffers: Option<String>,
    /// More `name=value` server settings, e.g.
    /// `shared_preload_libraries=pg_stat_statements`.
    pub settings: Vec<String>,
}

impl ClusterOptions {
    /// The server's `-c` options for these settings (no port, socket or TLS).
    pub fn server_settings(&self) -> String {
        let durability = if self.durable {
            "-c fsync=on -c synchronous_commit=on -c full_page_writes=on -c autovacuum=on"
        } else {
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        };
        let mut opts = format!(
            "{durability} -c max_connections=200 -c shared_buffers={}",
            self.shared_buffers.as_deref().unwrap_or("256MB")
        );
        for setting in &self.settings {
            opts += &format!(" -c {setting}");
        }
        opts
    }
}

/// The server's side of TLS: PEM files, copied into the cluster's directory.
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The CA whose client certificates the server accepts (`ssl_ca_file`).
    pub client_ca: Option<PathBuf>,
}

/// A PostgreSQL cluster in a temporary directory, stopped and removed on drop.
pub struct ThrowawayCluster {
    dir: tempfile::TempDir,
    bin: PathBuf,
    as_postgres_user: bool,
    port: u16,
}

impl ThrowawayCluster {
    /// `initdb` + `pg_ctl start` on a free loopback port, tuned for tests
    /// (no fsync; [`ClusterOptions::durable`] for measurements). Runs the
    /// server as the `postgres` user when we are root, since PostgreSQL
    /// refuses to run as root.
    pub fn start() -> Result<ThrowawayCluster, TestkitError> {
        Self::start_with(ClusterOptions::default())
    }

    /// The same with TLS or a `pg_hba.conf` of the caller's.
    pub fn start_with(options: ClusterOptions) -> Result<ThrowawayCluster, TestkitError> {
        let bin = find_pg_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("outbox-relay-pg-")
            .tempdir()?;
        let as_postgres_user = unsafe { libc::geteuid() } == 0;
        if as_postgres_user {
            run(Command::new("chown")
                .arg("-R")
                .arg("postgres:")
                .arg(dir.path()))?;
        }
        let port = free_port()?;
        let data = dir.path().join("data");
        let cluster = ThrowawayCluster {
            dir,
            bin,
            as_postgres_user,
            port,
        };
        run(cluster.pg_command("initdb").arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ]))?;
        let mut opts = format!(
            "-c listen_addresses=127.0.0.1 -p {port} -k {} {}",
            cluster.dir.path().display(),
            options.server_settings()
        );
        if let Some(tls) = &options.tls {
            opts += " -c ssl=on";
            let files = [
                ("ssl_cert_file", Some(&tls.cert)),
                ("ssl_key_file", Some(&tls.key)),
                ("ssl_ca_file", tls.client_ca.as_ref()),
            ];
            for (setting, file) in files {
                if let Some(file) = file {
                    let copy = cluster.own_file(setting, &std::fs::read(file)?)?;
                    opts += &format!(" -c {setting}={}", copy.display());
                }
            }
        }
        if let Some(hba) = &options.hba {
            let file = cluster.own_file("pg_hba.conf", hba.as_bytes())?;
            opts += &format!(" -c hba_file={}", file.display());
        }
        run(cluster
            .pg_command("pg_ctl")
            .arg("-D")
            .arg(&data)
            .args(["-o", &opts, "-w", "-t", "60", "-l"])
            .arg(cluster.dir.path().join("server.log"))
            .arg("start"))?;
        Ok(cluster)
    }

    /// This cluster for the rest of the process (a test binary's shared
    /// server): stopped and removed when the process exits, since statics are
    /// never dropped.
    pub fn keep_until_exit(self) -> &'static ThrowawayCluster {
        let cluster: &'static ThrowawayCluster = Box::leak(Box::new(self));
        at_exit(AtExit::Stop(cluster));
        cluster
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// `contents` in a file of the cluster's directory that only the
    /// server's user can read (PostgreSQL refuses a key others can read).
    fn own_file(&self, name: &str, contents: &[u8]) -> Result<PathBuf, TestkitError> {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.path().join(name);
        std::fs::write(&path, contents)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
        if self.as_postgres_user {
            run(Command::new("chown").arg("postgres:").arg(&path))?;
        }
        Ok(path)
    }

    fn pg_command(&self, tool: &str) -> Command {
        let path = self.bin.join(tool);
        if self.as_postgres_user {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    fn stop(&self) {
        let _ = self
            .pg_command("pg_ctl")
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-m", "immediate", "-w", "stop"])
            .output();
    }
}

impl Drop for ThrowawayCluster {
    fn drop(&mut self) {
        self.stop();
    }
}

enum AtExit {
    Stop(&'static ThrowawayCluster),
    Remove(PathBuf),
}

/// Runs `what` when the process exits (statics are never dropped).
fn at_exit(what: AtExit) {
    static TODO: std::sync::Mutex<Vec<AtExit>> = std::sync::Mutex::new(Vec::new());
    extern "C" fn run_all() {
        if let Ok(todo) = TODO.lock() {
            for what in todo.iter() {
                match what {
                    AtExit::Stop(cluster) => {
                        cluster.stop();
                        let _ = std::fs::remove_dir_all(cluster.dir.path());
                    }
                    AtExit::Remove(dir) => {
                        let _ = std::fs::remove_dir_all(dir);
                    }
                }
            }
        }
    }
    let mut todo = TODO.lock().unwrap_or_else(|e| e.into_inner());
    if todo.is_empty() {
        unsafe { libc::atexit(run_all) };
    }
    todo.push(what);
}

/// Removes `dir` when the process exits: files a test binary's shared
/// fixture keeps in a static.
pub fn remove_at_exit(dir: PathBuf) {
    at_exit(AtExit::Remove(dir));
}

fn run(cmd: &mut Command) -> Result<(), TestkitError> {
    let out = cmd
        .output()
        .map_err(|e| TestkitError::Cluster(format!("cannot run {cmd:?}: {e}")))?;
    if !out.status.success() {
        return Err(TestkitError::Cluster(format!(
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(())
}

pub(crate) fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `initdb` on the PATH, else the newest `/usr/lib/postgresql/*/bin`.
fn find_pg_bin() -> Result<PathBuf, TestkitError> {
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("initdb").is_file() && dir.join("pg_ctl").is_file() {
                return Ok(dir);
            }
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    found.retain(|p| p.join("initdb").is_file());
    found.sort_by_key(|p| {
        p.parent()
            .and_then(Path::file_name)
            .and_then(|n| n.to_str())
            .and_then(|n| n.parse::<u32>().ok())
            .unwrap_or(0)
    });
    found.pop().ok_or_else(|| {
        TestkitError::Cluster(
            "no PostgreSQL server answers and no initdb was found: install PostgreSQL (apt-get install postgresql) or set TEST_DATABASE_URL".into(),
        )
    })
}

fn parse_url(url: &str) -> Result<tokio_postgres::Config, TestkitError> {
    url.parse()
        .map_err(|e: tokio_postgres::Error| TestkitError::BadUrl {
            url: url.to_owned(),
            reason: e.to_string(),
        })
}

/// A connection to `url`, its driver task spawned.
pub async fn connect(url: &str) -> Result<tokio_postgres::Client, TestkitError> {
    let (client, connection) = parse_url(url)?.connect(NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "test database connection closed");
        }
    });
    Ok(client)
}

async fn answers(url: &str) -> bool {
    let Ok(mut config) = parse_url(url) else {
        return false;
    };
    config.connect_timeout(Duration::from_secs(2));
    matches!(
        tokio::time::timeout(Duration::from_secs(3), config.connect(NoTls)).await,
        Ok(Ok(_))
    )
}

/// The server tests create their databases on, decided once per process.
async fn server_url() -> Result<String, TestkitError> {
    static SERVER: OnceLock<String> = OnceLock::new();
    static CLUSTER: OnceLock<ThrowawayCluster> = OnceLock::new();
    if let Some(url) = SERVER.get() {
        return Ok(url.clone());
    }
    let candidate =
        std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_SERVER_URL.to_owned());
    let url = if answers(&candidate).await {
        candidate
    } else {
        let cluster = tokio::task::spawn_blocking(ThrowawayCluster::start)
            .await
            .map_err(|e| TestkitError::Cluster(e.to_string()))??;
        let url = cluster.url();
        if CLUSTER.set(cluster).is_ok() {
            // Statics are never dropped: stop the cluster when the process exits.
            extern "C" fn stop_cluster() {
                if let Some(c) = CLUSTER.get() {
                    c.stop();
                }
            }
            unsafe { libc::atexit(stop_cluster) };
        }
        CLUSTER.get().map(|c| c.url()).unwrap_or(url)
    };
    Ok(SERVER.get_or_init(|| url).clone())
}

/// A database of its own, created empty, dropped on drop.
pub struct TestDb {
    pub name: String,
    pub url: String,
    server_url: String,
}

impl TestDb {
    /// A fresh, empty database.
    pub async fn empty() -> Result<TestDb, TestkitError> {
        let server_url = server_url().await?;
        let name = format!("outbox_test_{}", uuid::Uuid::new_v4().simple());
        let admin = connect(&server_url).await?;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await?;
        let url = url_with_dbname(&server_url, &name);
        Ok(TestDb {
            name,
            url,
            server_url,
        })
    }

    /// A fresh database that `setup` was run on (given a connection to it)
    /// before it is handed out: the schema under test. With the relay's
    /// migrations, `TestDb::with_setup(outbox_relay::store::migrate::run)`. A
    /// database whose setup fails is dropped.
    pub async fn with_setup<T, E: Display>(
        setup: impl AsyncFnOnce(&mut tokio_postgres::Client) -> Result<T, E>,
    ) -> Result<TestDb, TestkitError> {
        let db = Self::empty().await?;
        let mut client = db.client().await?;
        setup(&mut client).await.map_err(|e| TestkitError::Setup {
            name: db.name.clone(),
            reason: e.to_string(),
        })?;
        Ok(db)
    }

    pub async fn client(&self) -> Result<tokio_postgres::Client, TestkitError> {
        connect(&self.url).await
    }
}

/// Replaces the database name in a `postgres://…/name?…` URL.
pub fn url_with_dbname(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_part = match base[scheme_end..].find('/') {
        Some(i) => &base[..scheme_end + i],
        None => base,
    };
    match query {
        Some(q) => format!("{host_part}/{name}?{q}"),
        None => format!("{host_part}/{name}"),
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let server = self.server_url.clone();
        let name = self.name.clone();
        // Drop runs outside async; a short-lived runtime on its own thread drops
        // the database (FORCE ends the test's leftover connections).
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async move {
                let admin = connect(&server).await.ok()?;
                admin
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await
                    .ok()
            })
        })
        .join();
    }
}
