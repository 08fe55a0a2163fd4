//! Connecting like libpq: TLS modes, a provider's CA, client certificates,
//! against a TLS-enabled PostgreSQL these tests start with a CA and
//! certificates made here with the `openssl` command; and connection errors
//! that name their cause (refused, missing database, bad password), as the
//! binary prints them.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use outbox_relay::config::Config;
use outbox_relay::store::{self, Store};
use outbox_testkit::{url_with_dbname, ClusterOptions, ServerTls, TestDb, ThrowawayCluster};

/// The TLS server all these tests share, and the PEM files around it.
struct TlsServer {
    cluster: &'static ThrowawayCluster,
    dir: PathBuf,
}

const HBA: &str = "\
local   all  all                     trust
hostssl all  certuser  127.0.0.1/32  cert
host    all  pwuser    127.0.0.1/32  scram-sha-256
host    all  all       127.0.0.1/32  trust
";

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .expect("the openssl command runs");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA `name`.crt/.key (EC P-256, valid two days).
fn make_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
        ],
    );
}

/// `name`.crt/.key for `cn`, signed by `ca`, with `extensions` (openssl's
/// x509v3 syntax, one a line).
fn make_cert(dir: &Path, ca: &str, name: &str, cn: &str, extensions: &str) {
    std::fs::write(dir.join(format!("{name}.ext")), extensions).unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            &format!("/CN={cn}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.crt"),
        ],
    );
}

fn tls_server() -> &'static TlsServer {
    static SERVER: OnceLock<TlsServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        let dir = tempfile::Builder::new()
            .prefix("outbox-relay-tls-")
            .tempdir()
            .unwrap()
            .keep();
        // The static is never dropped: the files go when the process exits.
        outbox_testkit::postgres::remove_at_exit(dir.clone());
        make_ca(&dir, "ca");
        make_ca(&dir, "other-ca");
        make_cert(
            &dir,
            "ca",
            "server",
            "db.test",
            "subjectAltName=DNS:db.test\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
        );
        make_cert(
            &dir,
            "ca",
            "client",
            "certuser",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n",
        );
        let cluster = ThrowawayCluster::start_with(ClusterOptions {
            tls: Some(ServerTls {
                cert: dir.join("server.crt"),
                key: dir.join("server.key"),
                client_ca: Some(dir.join("ca.crt")),
            }),
            hba: Some(HBA.to_owned()),
            ..ClusterOptions::default()
        })
        .expect("a TLS cluster")
        .keep_until_exit();
        // Called from a test's runtime: the roles are made on a thread of their own.
        let url = cluster.url();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let admin = outbox_testkit::postgres::connect(&url).await.unwrap();
                admin
                    .batch_execute(
                        "CREATE ROLE certuser LOGIN SUPERUSER; CREATE ROLE pwuser LOGIN PASSWORD 'right'",
                    )
                    .await
                    .unwrap();
            })
        })
        .join()
        .unwrap();
        TlsServer { cluster, dir }
    })
}

impl TlsServer {
    fn file(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// A URL to database `postgres` as `user`, naming the server `host`
    /// (what the certificate is checked against) and reaching it on
    /// 127.0.0.1, with the extra parameters `params`.
    fn url(&self, user: &str, host: &str, params: &str) -> String {
        format!(
            "postgres://{user}@{host}:{}/postgres?hostaddr=127.0.0.1&{params}",
            self.cluster.port()
        )
    }
}

/// Whether the session runs over TLS, as the server sees it.
async fn encrypted(url: &str) -> Result<bool, String> {
    let client = store::connect(url).await.map_err(|e| e.to_string())?;
    let row = client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .map_err(|e| e.to_string())?;
    Ok(row.get(0))
}

async fn refused(url: &str) -> String {
    match encrypted(url).await {
        Ok(tls) => panic!("{url} connected (tls: {tls}); it should have been refused"),
        Err(e) => {
            eprintln!("{url}: {e}");
            e
        }
    }
}

#[tokio::test]
async fn verify_full_trusts_the_given_ca_and_checks_the_host_name() {
    let s = tls_server();
    let ca = s.file("ca.crt");
    let url = s.url(
        "postgres",
        "db.test",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    assert_eq!(encrypted(&url).await, Ok(true), "{url}");
    // The same as keywords.
    let dsn = format!(
        "host=db.test hostaddr=127.0.0.1 port={} user=postgres dbname=postgres sslmode=verify-full sslrootcert='{ca}'",
        s.cluster.port()
    );
    assert_eq!(encrypted(&dsn).await, Ok(true), "{dsn}");

    let other = s.file("other-ca.crt");
    let e = refused(&s.url(
        "postgres",
        "db.test",
        &format!("sslmode=verify-full&sslrootcert={other}"),
    ))
    .await;
    assert!(
        e.contains("UnknownIssuer") && e.contains("sslrootcert"),
        "a wrong CA: {e}"
    );
    let e = refused(&s.url(
        "postgres",
        "other.test",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await;
    assert!(
        e.contains("certificate") && e.contains("other.test"),
        "a wrong host name: {e}"
    );
    // Without sslrootcert, the public web roots: this CA is not among them.
    let e = refused(&s.url("postgres", "db.test", "sslmode=verify-full")).await;
    assert!(
        e.contains("UnknownIssuer") && e.contains("sslrootcert"),
        "no sslrootcert: {e}"
    );
}

#[tokio::test]
async fn verify_ca_checks_the_chain_but_not_the_host_name() {
    let s = tls_server();
    let ca = s.file("ca.crt");
    let url = s.url(
        "postgres",
        "other.test",
        &format!("sslmode=verify-ca&sslrootcert={ca}"),
    );
    assert_eq!(encrypted(&url).await, Ok(true), "{url}");
    let other = s.file("other-ca.crt");
    let e = refused(&s.url(
        "postgres",
        "db.test",
        &format!("sslmode=verify-ca&sslrootcert={other}"),
    ))
    .await;
    assert!(
        e.contains("UnknownIssuer") && e.contains("sslrootcert"),
        "{e}"
    );
}

#[tokio::test]
async fn require_encrypts_and_verifies_only_with_a_root_certificate_like_libpq() {
    let s = tls_server();
    // No CA given: encrypted, nothing verified (libpq's require).
    assert_eq!(
        encrypted(&s.url("postgres", "other.test", "sslmode=require")).await,
        Ok(true)
    );
    // A CA given: the chain is checked (libpq's require with a root file is verify-ca).
    let ca = s.file("ca.crt");
    let other = s.file("other-ca.crt");
    assert_eq!(
        encrypted(&s.url(
            "postgres",
            "other.test",
            &format!("sslmode=require&sslrootcert={ca}")
        ))
        .await,
        Ok(true)
    );
    let e = refused(&s.url(
        "postgres",
        "db.test",
        &format!("sslmode=require&sslrootcert={other}"),
    ))
    .await;
    assert!(
        e.contains("UnknownIssuer") && e.contains("sslrootcert"),
        "{e}"
    );
}

#[tokio::test]
async fn prefer_takes_tls_when_offered_and_disable_never_does() {
    let s = tls_server();
    assert_eq!(
        encrypted(&s.url("postgres", "db.test", "sslmode=prefer")).await,
        Ok(true)
    );
    // No sslmode is prefer, as in libpq.
    assert_eq!(encrypted(&s.url("postgres", "db.test", "")).await, Ok(true));
    assert_eq!(
        encrypted(&s.url("postgres", "db.test", "sslmode=disable")).await,
        Ok(false)
    );
    // With a root certificate the chain is checked, as libpq does.
    let other = s.file("other-ca.crt");
    let e = refused(&s.url(
        "postgres",
        "db.test",
        &format!("sslmode=prefer&sslrootcert={other}"),
    ))
    .await;
    assert!(e.contains("UnknownIssuer"), "{e}");
    // A server without TLS (one of our own: the test server may offer TLS,
    // as Debian's default cluster does): prefer falls back to plain TCP.
    let plain = tokio::task::spawn_blocking(outbox_testkit::postgres::ThrowawayCluster::start)
        .await
        .unwrap()
        .unwrap();
    let plain_url = plain.url();
    let sep = if plain_url.contains('?') { '&' } else { '?' };
    assert_eq!(
        encrypted(&format!("{plain_url}{sep}sslmode=prefer")).await,
        Ok(false)
    );
    let e = refused(&format!("{plain_url}{sep}sslmode=require")).await;
    assert!(
        e.contains("TLS"),
        "require against a server without TLS: {e}"
    );
}

#[tokio::test]
async fn a_client_certificate_is_presented_and_accepted() {
    let s = tls_server();
    let ca = s.file("ca.crt");
    let (cert, key) = (s.file("client.crt"), s.file("client.key"));
    let url = s.url(
        "certuser",
        "db.test",
        &format!("sslmode=verify-full&sslrootcert={ca}&sslcert={cert}&sslkey={key}"),
    );
    let client = store::connect(&url)
        .await
        .expect("certuser with its certificate");
    let user: String = client
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(user, "certuser");
    // Without it the server refuses the role.
    let e = refused(&s.url(
        "certuser",
        "db.test",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await;
    assert!(e.contains("certificate"), "{e}");
    // A certificate without its key is refused before connecting, naming both.
    let e = store::parse_url(&s.url("certuser", "db.test", &format!("sslcert={cert}")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("sslcert") && e.contains("sslkey"), "{e}");
}

/// `database.sslmode`, `database.sslrootcert`, `database.sslcert` and
/// `database.sslkey` add to the URL (or override its parameters), in the
/// library and in the binary.
#[tokio::test]
async fn the_config_keys_set_tls_for_the_url() {
    let s = tls_server();
    let plain_url = format!(
        "postgres://certuser@db.test:{}/postgres?hostaddr=127.0.0.1&sslmode=disable",
        s.cluster.port()
    );
    let config = Config::from_toml_str(&format!(
        "[database]\nurl = \"{plain_url}\"\nsslmode = \"verify-full\"\nsslrootcert = \"{}\"\nsslcert = \"{}\"\nsslkey = \"{}\"\n",
        s.file("ca.crt"),
        s.file("client.crt"),
        s.file("client.key"),
    ))
    .unwrap();
    assert_eq!(
        encrypted(&config.database.url).await,
        Ok(true),
        "{}",
        config.database.url
    );

    // The binary: `migrate` over verify-full into a fresh database, the CA
    // and the client certificate from the environment.
    let name = format!("tls_{}", uuid::Uuid::new_v4().simple());
    let admin = outbox_testkit::postgres::connect(&s.cluster.url())
        .await
        .unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let url = url_with_dbname(
        &format!(
            "postgres://certuser@db.test:{}/x?hostaddr=127.0.0.1&sslmode=verify-full",
            s.cluster.port()
        ),
        &name,
    );
    let out = Command::new(common::BIN)
        .arg("migrate")
        .env("DATABASE_URL", &url)
        .env("OUTBOX_RELAY_DATABASE__SSLROOTCERT", s.file("ca.crt"))
        .env("OUTBOX_RELAY_DATABASE__SSLCERT", s.file("client.crt"))
        .env("OUTBOX_RELAY_DATABASE__SSLKEY", s.file("client.key"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let migrated = outbox_testkit::postgres::connect(&url_with_dbname(&s.cluster.url(), &name))
        .await
        .unwrap();
    let outbox: i64 = migrated
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE tablename = 'outbox'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(outbox, 1, "migrate created the outbox");
    drop(migrated);
    admin
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await
        .unwrap();
}

/// `run`, `drain` and `migrate` against `url` each fail printing `want`
/// (compared in lower case), not the pool's time-out.
fn each_command_names(url: &str, want: &str) {
    let config = common::relay_config();
    let path = config.path().to_str().unwrap();
    for args in [
        &["run", "--config", path][..],
        &["drain", "--config", path],
        &["migrate"],
    ] {
        let started = Instant::now();
        let out = common::cli_url(url, args);
        let took = started.elapsed();
        let stderr = String::from_utf8_lossy(&out.stderr).to_lowercase();
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(
            stderr.contains(want) && !stderr.contains("timed out waiting"),
            "{args:?} should name {want:?}: {stderr}"
        );
        eprintln!("{args:?}: failed after {took:?}");
    }
}

#[tokio::test]
async fn a_wrong_port_is_named_connection_refused() {
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        common::free_port()
    );
    each_command_names(&url, "connection refused");
}

#[tokio::test]
async fn a_missing_database_is_named() {
    let db = TestDb::empty().await.unwrap();
    let url = url_with_dbname(&db.url, "no_such_database_h7");
    each_command_names(&url, "database \"no_such_database_h7\" does not exist");
}

#[tokio::test]
async fn a_wrong_password_is_named_authentication() {
    let s = tls_server();
    let url = format!(
        "postgres://pwuser:wrong@127.0.0.1:{}/postgres?sslmode=disable",
        s.cluster.port()
    );
    each_command_names(&url, "password authentication failed for user \"pwuser\"");
}

/// What the pool says when it cannot connect (what `/readyz` reports): the
/// attempt's own error, not only that the wait timed out.
#[tokio::test]
async fn the_pool_names_why_it_cannot_connect() {
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        common::free_port()
    );
    let store = Store::open(&url, 2, Duration::from_millis(500)).unwrap();
    let e = store
        .snapshot()
        .await
        .unwrap_err()
        .to_string()
        .to_lowercase();
    assert!(e.contains("connection refused"), "{e}");
}
