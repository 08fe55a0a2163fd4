//! The dashboard and the alert rules in `config/` name only metrics the relay
//! exports (`metrics::names`), and every alert is complete.

mod common;

use common::{is_known_series, our_series};
use outbox_relay::metrics::names::{HISTOGRAMS, METRIC_NAMES};
use serde_json::Value;

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{}/{path}", env!("CARGO_MANIFEST_DIR")))
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Strings under the keys Grafana keeps PromQL in, anywhere in the document.
fn dashboard_queries(v: &Value, key: Option<&str>, out: &mut Vec<String>) {
    match v {
        Value::String(s) if matches!(key, Some("expr" | "query" | "definition")) => {
            out.push(s.clone())
        }
        Value::Array(items) => items.iter().for_each(|i| dashboard_queries(i, key, out)),
        Value::Object(map) => map
            .iter()
            .for_each(|(k, v)| dashboard_queries(v, Some(k), out)),
        _ => {}
    }
}

fn balanced(expr: &str) -> bool {
    let mut stack = Vec::new();
    let mut in_string = false;
    for c in expr.chars() {
        match c {
            '"' => in_string = !in_string,
            _ if in_string => {}
            '(' | '[' | '{' => stack.push(c),
            ')' | ']' | '}' => {
                let open = stack.pop();
                let want = match c {
                    ')' => '(',
                    ']' => '[',
                    _ => '{',
                };
                if open != Some(want) {
                    return false;
                }
            }
            _ => {}
        }
    }
    stack.is_empty() && !in_string
}

#[test]
fn the_scanner_finds_our_identifiers_only() {
    assert_eq!(
        our_series(
            r#"sum(rate(outbox_relay_events_published_total{job="outbox-relay"}[5m])) / x_outbox_relay_y"#
        ),
        ["outbox_relay_events_published_total"]
    );
    assert!(is_known_series("outbox_relay_commit_to_ack_seconds_bucket"));
    assert!(!is_known_series("outbox_relay_backlog_bucket"));
    assert!(!is_known_series("outbox_relay_events_published"));
}

#[test]
fn metric_names_follow_prometheus_conventions() {
    for name in METRIC_NAMES {
        assert!(name.starts_with("outbox_relay_"), "{name}");
        assert!(
            name.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
            "{name}"
        );
    }
    let counters: Vec<_> = METRIC_NAMES
        .iter()
        .filter(|n| n.ends_with("_total"))
        .collect();
    assert_eq!(counters.len(), 13);
    for h in HISTOGRAMS {
        assert!(METRIC_NAMES.contains(h));
        assert!(!h.ends_with("_total"));
    }
    let mut sorted = METRIC_NAMES.to_vec();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), METRIC_NAMES.len(), "duplicate names");
}

#[test]
fn the_dashboard_uses_only_exported_metrics_and_shows_them_all() {
    let dashboard: Value = serde_json::from_str(&read("config/grafana/outbox-relay.json")).unwrap();
    let mut queries = Vec::new();
    dashboard_queries(&dashboard, None, &mut queries);
    assert!(queries.len() > 20, "{queries:?}");
    let mut used = Vec::new();
    for q in &queries {
        assert!(balanced(q), "unbalanced brackets in {q}");
        for series in our_series(q) {
            assert!(is_known_series(&series), "unknown metric `{series}` in {q}");
            used.push(series);
        }
    }
    for name in METRIC_NAMES {
        assert!(
            used.iter().any(|u| u.starts_with(name)),
            "the dashboard has no panel for {name}"
        );
    }
    for h in HISTOGRAMS {
        assert!(
            queries
                .iter()
                .any(|q| q.contains("histogram_quantile(") && q.contains(&format!("{h}_bucket"))),
            "no quantile panel for {h}"
        );
    }
    // Every panel has a unique id and a title; every target a refId.
    let panels = dashboard["panels"].as_array().unwrap();
    let mut ids: Vec<i64> = panels.iter().map(|p| p["id"].as_i64().unwrap()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), panels.len());
    for p in panels {
        assert!(p["title"].as_str().is_some_and(|t| !t.is_empty()), "{p}");
        for t in p["targets"].as_array().into_iter().flatten() {
            assert!(t["refId"].is_string(), "{t}");
        }
    }
}

#[test]
fn every_alert_is_complete_and_uses_only_exported_metrics() {
    let rules: serde_norway::Value =
        serde_norway::from_str(&read("config/prometheus/alerts.yml")).unwrap();
    let groups = rules["groups"].as_sequence().expect("groups");
    let mut alerts = Vec::new();
    for group in groups {
        assert!(group["name"].as_str().is_some());
        for rule in group["rules"].as_sequence().expect("rules") {
            alerts.push(rule);
        }
    }
    assert!(alerts.len() >= 6);
    let mut names = Vec::new();
    let mut used = Vec::new();
    for rule in &alerts {
        let name = rule["alert"].as_str().expect("every rule is an alert");
        names.push(name);
        let expr = rule["expr"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: expr"));
        assert!(balanced(expr), "{name}: unbalanced brackets in {expr}");
        for series in our_series(expr) {
            assert!(
                is_known_series(&series),
                "{name}: unknown metric `{series}`"
            );
            used.push(series);
        }
        let r#for = rule["for"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: for"));
        humantime::parse_duration(r#for).unwrap_or_else(|e| panic!("{name}: for {for}: {e}"));
        let severity = rule["labels"]["severity"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: labels.severity"));
        assert!(
            ["critical", "warning", "info"].contains(&severity),
            "{name}: severity {severity}"
        );
        assert!(
            rule["annotations"]["summary"]
                .as_str()
                .is_some_and(|s| !s.is_empty()),
            "{name}: annotations.summary"
        );
    }
    let mut unique = names.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), names.len(), "duplicate alert names");

    // The alerts the runbook promises.
    let by_name = |n: &str| {
        alerts
            .iter()
            .find(|r| r["alert"].as_str() == Some(n))
            .unwrap_or_else(|| panic!("missing alert {n}"))
    };
    let lag = by_name("OutboxRelayLagCritical");
    assert!(lag["expr"]
        .as_str()
        .unwrap()
        .contains("outbox_relay_oldest_pending_age_seconds"));
    assert_ne!(lag["for"].as_str(), Some("0m"), "lag needs a for: window");
    assert!(by_name("OutboxRelayDeadLetter")["expr"]
        .as_str()
        .unwrap()
        .contains("outbox_relay_events_dead_lettered_total"));
    assert!(by_name("OutboxRelayDown")["expr"]
        .as_str()
        .unwrap()
        .contains("up{"));
    assert!(by_name("OutboxRelayAbsent")["expr"]
        .as_str()
        .unwrap()
        .contains("absent("));
    assert!(by_name("OutboxRelayRestartLoop")["expr"]
        .as_str()
        .unwrap()
        .contains("outbox_relay_actor_restarts_total"));
    assert!(by_name("OutboxRelayDeadTuplesGrowing")["expr"]
        .as_str()
        .unwrap()
        .contains("outbox_relay_outbox_dead_tuples"));
    // Alert on age, never on depth alone.
    assert!(
        !used.iter().any(|u| u == "outbox_relay_backlog")
            || alerts.iter().all(|r| {
                let e = r["expr"].as_str().unwrap();
                !e.contains("outbox_relay_backlog") || e.contains("absent(")
            })
    );
}

fn alert_rules() -> Vec<serde_norway::Value> {
    let rules: serde_norway::Value =
        serde_norway::from_str(&read("config/prometheus/alerts.yml")).unwrap();
    rules["groups"]
        .as_sequence()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_sequence().expect("rules").clone())
        .collect()
}

/// The alerts' texts agree with the code: every metric they name is
/// exported, and the paused-route alert explains every cause a pause can
/// have (`outbox_relay_route_pauses_total{cause}`).
#[test]
fn the_alert_texts_name_what_the_code_exports() {
    for rule in alert_rules() {
        let name = rule["alert"].as_str().unwrap();
        for key in ["summary", "description"] {
            let text = rule["annotations"][key].as_str().unwrap_or_default();
            for series in our_series(text) {
                assert!(
                    is_known_series(&series),
                    "{name}: {key} names `{series}`, which the relay does not export"
                );
            }
        }
        if name == "OutboxRelayRoutePaused" {
            let text = rule["annotations"]["description"].as_str().unwrap();
            for cause in [
                "unauthorized",
                "rate_limited",
                "redirect",
                "connect",
                "failing",
            ] {
                assert!(
                    text.contains(cause),
                    "{name}: the description does not explain cause `{cause}`"
                );
            }
        }
    }
}

/// Every alert has a case in the rules' unit tests
/// (`config/prometheus/alerts.test.yml`), whose input series are ones the
/// relay (or Prometheus: `up`) exports.
#[test]
fn every_alert_has_a_unit_test_on_exported_series() {
    let tests = read("config/prometheus/alerts.test.yml");
    for rule in alert_rules() {
        let name = rule["alert"].as_str().unwrap();
        assert!(
            tests.contains(&format!("alertname=\"{name}\""))
                || tests.contains(&format!("alertname: {name}")),
            "{name} has no case in alerts.test.yml"
        );
    }
    let doc: serde_norway::Value = serde_norway::from_str(&tests).unwrap();
    let mut inputs = 0;
    for case in doc["tests"].as_sequence().expect("tests") {
        for input in case["input_series"].as_sequence().expect("input_series") {
            let series = input["series"].as_str().unwrap();
            let name = &series[..series.find('{').unwrap_or(series.len())];
            assert!(
                name == "up" || is_known_series(name),
                "alerts.test.yml feeds `{name}`, which the relay does not export"
            );
            inputs += 1;
        }
    }
    assert!(inputs >= 10, "{inputs} input series");
}

/// `promtool check rules` and `promtool test rules` (Debian's `prometheus`
/// package; CI installs it): the rules load, and each fires when and with
/// the labels its unit test expects. Skipped, saying so, without promtool.
#[test]
fn the_alert_rules_pass_promtool() {
    let dir = format!("{}/config/prometheus", env!("CARGO_MANIFEST_DIR"));
    let promtool = |args: &[&str]| {
        std::process::Command::new("promtool")
            .args(args)
            .current_dir(&dir)
            .output()
    };
    if promtool(&["--version"]).is_err() {
        eprintln!("SKIPPED the_alert_rules_pass_promtool: promtool is not installed (apt-get install prometheus)");
        return;
    }
    for args in [
        &["check", "rules", "alerts.yml"][..],
        &["test", "rules", "alerts.test.yml"],
    ] {
        let out = promtool(args).unwrap();
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
