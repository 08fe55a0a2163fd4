//! `check-config`: it refuses what `run` would refuse about the database
//! without connecting, and with `--connect` checks the database itself (the
//! connection, the role's privileges, the schema, the shards).

mod common;

use std::process::Command;

use outbox_testkit::TestDb;

/// `outbox-relay check-config [extra…] --config <common::relay_config()>` with
/// `DATABASE_URL=url` and the environment `env`.
fn check_config(url: &str, extra: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let config = common::relay_config();
    let mut command = Command::new(common::BIN);
    command
        .arg("check-config")
        .args(extra)
        .arg("--config")
        .arg(config.path())
        .env("DATABASE_URL", url)
        .env_remove("OUTBOX_RELAY_LOG");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// What `run` refuses about the database URL, `check-config` refuses too,
/// without connecting, naming the key.
#[test]
fn check_config_refuses_what_run_would_without_connecting() {
    let missing = std::env::temp_dir().join("no-such-ca-h7.pem");
    let missing = missing.to_str().unwrap();
    for (url, env, key, why) in [
        ("", &[][..], "database.url", "empty"),
        ("postgress://nope", &[], "database.url", "`postgress://`"),
        (
            "postgres://db.example.com/app?foo=1",
            &[],
            "database.url",
            "`foo`",
        ),
        (
            "host=db.example.com sslpassword=x",
            &[],
            "database.url",
            "`sslpassword`",
        ),
        (
            "postgres://db.example.com/app?sslcert=/c.pem",
            &[],
            "database.url",
            "sslkey",
        ),
        (
            &*format!("postgres://db.example.com/app?sslmode=verify-full&sslrootcert={missing}"),
            &[],
            "database.url",
            "cannot be read",
        ),
        (
            "postgres://db.example.com/app",
            &[("OUTBOX_RELAY_DATABASE__SSLMODE", "verify_full")],
            "database.sslmode",
            "`verify_full`",
        ),
        (
            "postgres://db.example.com/app",
            &[("OUTBOX_RELAY_DATABASE__SSLROOTCERT", missing)],
            "database.sslrootcert",
            "cannot be read",
        ),
    ] {
        let (ok, stderr) = check_config(url, &[], env);
        assert!(!ok, "{url:?} {env:?} passed");
        assert!(
            stderr.contains(&format!("configuration key `{key}`")) && stderr.contains(why),
            "{url:?} {env:?} should name `{key}` and {why:?}: {stderr}"
        );
    }
}

/// `check-config --connect` connects as `run` would and checks what it
/// checks at start, and the role's privileges.
#[tokio::test]
async fn check_config_connect_checks_the_database_the_schema_the_shards_and_the_grants() {
    let db = common::test_db().await;
    let (ok, stderr) = check_config(&db.url, &["--connect"], &[]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("connected as `postgres`"), "{stderr}");

    let (ok, stderr) = check_config(
        &db.url,
        &["--connect"],
        &[("OUTBOX_RELAY_RELAY__SHARDS", "5")],
    );
    assert!(
        !ok && stderr.contains("configuration key `relay.shards`"),
        "{stderr}"
    );

    let empty = TestDb::empty().await.unwrap();
    let (ok, stderr) = check_config(&empty.url, &["--connect"], &[]);
    assert!(!ok && stderr.contains("outbox-relay migrate"), "{stderr}");

    let refused = format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        common::free_port()
    );
    let (ok, stderr) = check_config(&refused, &["--connect"], &[]);
    assert!(
        !ok && stderr.contains("configuration key `database.url`")
            && stderr.to_lowercase().contains("connection refused"),
        "{stderr}"
    );
    // Without --connect nothing connects.
    assert!(check_config(&refused, &[], &[]).0);

    // A role that may read the outbox and nothing else.
    let role = format!("h7_relay_{}", uuid::Uuid::new_v4().simple());
    let admin = db.client().await.unwrap();
    admin
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; GRANT SELECT ON outbox TO {role}"
        ))
        .await
        .unwrap();
    let as_role = db.url.replacen("postgres@", &format!("{role}@"), 1);
    let (ok, stderr) = check_config(&as_role, &["--connect"], &[]);
    admin
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .unwrap();
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("configuration key `database.url`")
            && stderr.contains(&format!("role `{role}` lacks"))
            && stderr.contains("UPDATE on outbox")
            && stderr.contains("USAGE on outbox_relay_shard_token_seq")
            && !stderr.contains("SELECT on outbox,")
            && stderr.contains("--print-grants"),
        "{stderr}"
    );
}
