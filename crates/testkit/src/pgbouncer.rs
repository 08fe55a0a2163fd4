//! A real PgBouncer in front of a test database, for the tests of what works
//! through a connection pooler: its own ini and userlist in a temporary
//! directory, `auth_type = trust`, a free loopback port, every database
//! name passed through to the server the test database lives on. Stopped
//! (killed) on drop.
//!
//! [`PgBouncer::binary`] says why there is none when the `pgbouncer` binary
//! is absent, so a test can skip with that reason.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::postgres::{free_port, TestkitError};

/// How PgBouncer gives server connections to its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// One server connection per client connection, for the client's whole
    /// session.
    Session,
    /// A server connection per transaction (or per statement outside one):
    /// what most providers' pooled URLs are.
    Transaction,
}

impl PoolMode {
    fn ini(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        }
    }
}

/// A running PgBouncer.
pub struct PgBouncer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl PgBouncer {
    /// The `pgbouncer` binary on the PATH (or in `/usr/sbin`), or why there
    /// is none.
    pub fn binary() -> Result<PathBuf, String> {
        let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        dirs.extend(["/usr/sbin".into(), "/usr/local/sbin".into()]);
        dirs.into_iter()
            .map(|d| d.join("pgbouncer"))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                "no pgbouncer binary on the PATH or in /usr/sbin (apt-get install pgbouncer)".into()
            })
    }

    /// PgBouncer in `mode` in front of the server `db_url` names, with
    /// `pool_size` server connections per database and user. Returns once
    /// it accepts connections.
    pub fn start(db_url: &str, mode: PoolMode, pool_size: u32) -> Result<PgBouncer, TestkitError> {
        let bin = Self::binary().map_err(TestkitError::Cluster)?;
        let server: tokio_postgres::Config =
            db_url
                .parse()
                .map_err(|e: tokio_postgres::Error| TestkitError::BadUrl {
                    url: db_url.to_owned(),
                    reason: e.to_string(),
                })?;
        let host = match server.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            _ => "127.0.0.1".to_owned(),
        };
        let server_port = server.get_ports().first().copied().unwrap_or(5432);
        let user = server.get_user().unwrap_or("postgres").to_owned();
        let dir = tempfile::Builder::new()
            .prefix("outbox-relay-pgbouncer-")
            .tempdir()?;
        let port = free_port()?;
        let ini = dir.path().join("pgbouncer.ini");
        let userlist = dir.path().join("userlist.txt");
        std::fs::write(&userlist, format!("\"{user}\" \"\"\n"))?;
        std::fs::write(
            &ini,
            format!(
                "[databases]\n\
                 * = host={host} port={server_port}\n\
                 [pgbouncer]\n\
                 listen_addr = 127.0.0.1\n\
                 listen_port = {port}\n\
                 unix_socket_dir =\n\
                 auth_type = trust\n\
                 auth_file = {userlist}\n\
                 pool_mode = {mode}\n\
                 default_pool_size = {pool_size}\n\
                 max_client_conn = 1000\n\
                 max_db_connections = {pool_size}\n\
                 ignore_startup_parameters = extra_float_digits,options\n\
                 logfile = {log}\n\
                 log_connections = 0\n\
                 log_disconnections = 0\n",
                userlist = userlist.display(),
                mode = mode.ini(),
                log = dir.path().join("pgbouncer.log").display(),
            ),
        )?;
        let mut command = Command::new(&bin);
        // PgBouncer refuses to run as root: it runs as `postgres` then.
        if unsafe { libc::geteuid() } == 0 {
            let (uid, gid) = postgres_user()?;
            for path in [dir.path(), &ini, &userlist] {
                std::os::unix::fs::chown(path, Some(uid), Some(gid))?;
            }
            command.uid(uid).gid(gid);
        }
        let child = command
            .arg(&ini)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let log = dir.path().join("pgbouncer.log");
        let mut bouncer = PgBouncer {
            child,
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = bouncer.child.try_wait()? {
                return Err(TestkitError::Cluster(format!(
                    "pgbouncer exited with {status} at start: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )));
            }
            if Instant::now() > deadline {
                return Err(TestkitError::Cluster(format!(
                    "pgbouncer did not listen on 127.0.0.1:{port} within 20 s"
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(bouncer)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `db_url` with its host and port replaced by this PgBouncer's.
    pub fn url_for(&self, db_url: &str) -> String {
        let scheme_end = db_url.find("://").map(|i| i + 3).unwrap_or(0);
        let rest = &db_url[scheme_end..];
        let (userinfo, after) = match rest.find('@') {
            Some(at) if rest.find('/').is_none_or(|slash| at < slash) => {
                (&rest[..=at], &rest[at + 1..])
            }
            _ => ("", rest),
        };
        let path = after.find(['/', '?']).map(|i| &after[i..]).unwrap_or("");
        format!(
            "{}{userinfo}127.0.0.1:{}{path}",
            &db_url[..scheme_end],
            self.port
        )
    }
}

/// The uid and gid of the `postgres` user.
fn postgres_user() -> Result<(u32, u32), TestkitError> {
    // SAFETY: getpwnam with a NUL-terminated name; the record is read at once.
    let entry = unsafe { libc::getpwnam(c"postgres".as_ptr()) };
    if entry.is_null() {
        return Err(TestkitError::Cluster(
            "running as root and there is no postgres user to run pgbouncer as".into(),
        ));
    }
    // SAFETY: not null, so it points at a passwd record.
    let entry = unsafe { &*entry };
    Ok((entry.pw_uid, entry.pw_gid))
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn url_for_keeps_the_user_database_and_parameters() {
        let fake = super::PgBouncer {
            child: std::process::Command::new("true").spawn().unwrap(),
            port: 6432,
            _dir: tempfile::tempdir().unwrap(),
        };
        assert_eq!(
            fake.url_for("postgres://postgres@127.0.0.1:5432/db?sslmode=disable"),
            "postgres://postgres@127.0.0.1:6432/db?sslmode=disable"
        );
        assert_eq!(
            fake.url_for("postgres://u:p@db.example:5432/x"),
            "postgres://u:p@127.0.0.1:6432/x"
        );
    }
}
