//! The `outbox-relay` binary keeps secrets out of what it prints, and its
//! failure-callback listener checks the URL QStash signed for.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::process::{Command, Stdio};
use std::time::Duration;

use base64::engine::general_purpose::{STANDARD, URL_SAFE};
use base64::Engine;
use common::BIN;
use jsonwebtoken::Algorithm;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use outbox_client::{enqueue, Enqueued, NewEvent};
use outbox_testkit::relay::without_config_env;
use outbox_testkit::TestDb;
use serde_json::json;
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// Every secret below contains this, so one search finds any leak.
const MARK: &str = "Leak";

/// A keyword DSN for `db`, with a password (trust auth ignores it).
fn keyword_dsn(db: &TestDb, password: &str) -> String {
    let config: tokio_postgres::Config = db.url.parse().unwrap();
    let host = match &config.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        other => panic!("{other:?}"),
    };
    format!(
        "host={host} port={} user={} password={password} dbname={}",
        config.get_ports().first().copied().unwrap_or(5432),
        config.get_user().unwrap_or("postgres"),
        db.name
    )
}

/// Routes whose destination, failure callback and QStash URL carry credentials.
fn routes_with_credentials(callback_url: &str) -> String {
    format!(
        r#"
        [qstash]
        url = "https://qstash.example.com/?qstash_token=qs-{MARK}-9"
        token = "tok-{MARK}-0"
        current_signing_key = "sig_cur_{MARK}_1"
        next_signing_key = "sig_next_{MARK}_2"
        [[routes]]
        event_type = "order.*"
        destination = "https://hookuser:dest-{MARK}-5@hooks.example.com/in/{{event_type}}?a=1&token=dest-{MARK}-6"
        failure_callback = "{callback_url}"
        [[routes]]
        event_type = "user.*"
        sink = "webhook"
        destination = "https://api-key-{MARK}-7@hooks.example.com/users?Signature=dest-{MARK}-8"
        signing_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
        "#
    )
}

fn check_config(database_url: &str) -> String {
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        config.path(),
        routes_with_credentials(&format!(
            "https://cbuser:cb-{MARK}-3@cb.example.com/qstash/failure?key=cb-{MARK}-4"
        )),
    )
    .unwrap();
    let out = without_config_env(&mut Command::new(BIN))
        .args(["check-config", "--config"])
        .arg(config.path())
        .env("DATABASE_URL", database_url)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn check_config_redacts_every_form_of_credential() {
    for (database_url, kept) in [
        (
            format!("host=db.example.com user=app password=dsn-{MARK}-a dbname=app"),
            "host=db.example.com user=app",
        ),
        (
            format!("host=db.example.com password = 'dsn {MARK} \\' b' dbname=app"),
            "dbname=app",
        ),
        (
            format!("postgres://app@db.example.com/app?sslmode=require&password=url-{MARK}-c"),
            "sslmode=require",
        ),
        (
            format!("postgresql://app:ui-{MARK}-d@db.example.com:5433/app"),
            "app:<redacted>@db.example.com:5433/app",
        ),
    ] {
        let stdout = check_config(&database_url);
        assert!(
            !stdout.contains(MARK),
            "a secret is printed for {database_url:?}:\n{stdout}"
        );
        assert!(stdout.contains(kept), "{kept:?} is gone:\n{stdout}");
        // What is not secret stays readable.
        for kept in [
            "hooks.example.com/in/{event_type}?a=1",
            "cb.example.com/qstash/failure",
            "qstash.example.com",
        ] {
            assert!(stdout.contains(kept), "{kept:?} is gone:\n{stdout}");
        }
    }
}

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// `outbox-relay --log-format json run` on `config`, its stderr in a file.
struct Daemon {
    child: std::process::Child,
    stderr: tempfile::NamedTempFile,
    _config: tempfile::NamedTempFile,
}

impl Daemon {
    fn start(config_toml: &str, database_url: &str) -> Daemon {
        let config = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(config.path(), config_toml).unwrap();
        let stderr = tempfile::NamedTempFile::new().unwrap();
        let child = without_config_env(&mut Command::new(BIN))
            .args(["--log-format", "json", "run", "--config"])
            .arg(config.path())
            .env("DATABASE_URL", database_url)
            .env("OUTBOX_RELAY_LOG", "debug")
            .stdout(Stdio::null())
            .stderr(stderr.reopen().unwrap())
            .spawn()
            .unwrap();
        Daemon {
            child,
            stderr,
            _config: config,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.stderr.path()).unwrap()
    }

    async fn wait_running(&mut self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !self.log().contains("\"outbox-relay running\"") {
            let exited = self.child.try_wait().unwrap().is_some();
            assert!(
                !exited && std::time::Instant::now() < deadline,
                "the daemon did not start:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn stop(&mut self) {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "the daemon did not stop:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn daemon_toml(callback_bind: SocketAddr, callback_url: &str) -> String {
    format!(
        r#"
        [relay]
        poll_interval = "100ms"
        shutdown_grace = "2s"
        [server]
        metrics_bind = "127.0.0.1:0"
        callback_bind = "{callback_bind}"
        {}
        "#,
        routes_with_credentials(callback_url)
    )
}

#[tokio::test]
async fn the_json_startup_log_redacts_every_form_of_credential() {
    let db = common::test_db().await;
    let callback = free_port();
    let mut daemon = Daemon::start(
        &daemon_toml(
            callback,
            &format!("http://cb:cb-{MARK}-3@{callback}/qstash/failure?key=cb-{MARK}-4"),
        ),
        &keyword_dsn(&db, &format!("dsn-{MARK}-a")),
    );
    daemon.wait_running().await;
    daemon.stop().await;
    let log = daemon.log();
    let starting = log
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect(l))
        .find(|l| l["message"] == "outbox-relay starting")
        .unwrap_or_else(|| panic!("no start line:\n{log}"));
    assert!(
        starting["config"]
            .as_str()
            .is_some_and(|c| c.contains("hooks.example.com")),
        "{starting}"
    );
    assert!(!log.contains(MARK), "a secret is in the log:\n{log}");
}

// ───────────────────── the failure callback checks `sub` ─────────────────────

const CURRENT: &str = "sig_cur_Leak_1";

fn sign(key: &str, subject: &str, body: &[u8]) -> String {
    let now = chrono::Utc::now().timestamp();
    common::jwt(
        key,
        &json!({"iss": "Upstash", "sub": subject, "exp": now + 300, "nbf": 0, "iat": now,
                "jti": format!("jwt_{}", Uuid::new_v4().simple()),
                "body": URL_SAFE.encode(Sha256::digest(body))}),
        Algorithm::HS256,
    )
}

async fn post(url: &str, signature: &str, body: &[u8]) -> (u16, String) {
    use http_body_util::{BodyExt, Full};
    let client: hyper_util::client::legacy::Client<_, Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let request = http::Request::post(url)
        .header("upstash-signature", signature)
        .body(Full::new(bytes::Bytes::copy_from_slice(body)))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn the_daemons_failure_callback_accepts_only_its_own_url() {
    let db = common::test_db().await;
    let mut client = db.client().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let Enqueued::New { id } = enqueue(
        &tx,
        &NewEvent::new(
            Uuid::new_v4(),
            "invoice",
            "i-1",
            "invoice.sent",
            json!({}),
            "k-sub-1",
        ),
    )
    .await
    .unwrap() else {
        panic!("not new")
    };
    tx.commit().await.unwrap();
    // As the relay leaves it once QStash accepted it (the claimer skips it).
    client
        .execute(
            "UPDATE outbox SET published_at = now() WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let callback = free_port();
    let callback_url = format!("http://{callback}/qstash/failure");
    let mut daemon = Daemon::start(&daemon_toml(callback, &callback_url), &db.url);
    daemon.wait_running().await;
    let report = serde_json::to_vec(&json!({
        "status": 500,
        "retried": 3,
        "sourceMessageId": "msg_sub",
        "sourceHeader": {"X-Outbox-Id": [id.to_string()],
                         "X-Outbox-Idempotency-Key": ["k-sub-1"]},
        "sourceBody": STANDARD.encode(format!(r#"{{"id":"{id}"}}"#)),
    }))
    .unwrap();
    // A genuine report QStash made for another endpoint of the same account.
    let elsewhere = sign(
        CURRENT,
        "https://other-service.example.com/qstash/failure",
        &report,
    );
    let (status, body) = post(&callback_url, &elsewhere, &report).await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("subject"), "{body}");
    assert!(!dead(&client, id).await);
    let (status, body) = post(
        &callback_url,
        &sign(CURRENT, &callback_url, &report),
        &report,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(dead(&client, id).await);
    daemon.stop().await;
}

async fn dead(client: &tokio_postgres::Client, id: i64) -> bool {
    client
        .query_one(
            "SELECT dead_lettered_at IS NOT NULL FROM outbox WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0)
}

#[test]
fn a_rejected_url_is_named_without_its_credentials() {
    for (key, toml) in [
        (
            "qstash.url",
            format!("[qstash]\nurl = \"ftp://u:qs-{MARK}-1@qstash.example.com/\"\ntoken = \"t\""),
        ),
        (
            "routes[0].destination",
            format!(
                "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://u:dest-{MARK}-2@h.example.com/{{event_type\""
            ),
        ),
        (
            "routes[0].failure_callback",
            format!(
                "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://h.example.com/\"\nfailure_callback = \"gopher://cb:cb-{MARK}-3@cb.example.com/?token=cb-{MARK}-4\""
            ),
        ),
    ] {
        let config = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(config.path(), &toml).unwrap();
        let out = without_config_env(&mut Command::new(BIN))
            .args(["check-config", "--config"])
            .arg(config.path())
            .env("DATABASE_URL", "postgres://postgres@127.0.0.1/x")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{toml}");
        assert!(stderr.contains(key), "{key}: {stderr}");
        assert!(!stderr.contains(MARK), "a secret is printed: {stderr}");
        assert!(stderr.contains("example.com"), "{stderr}");
    }
}
