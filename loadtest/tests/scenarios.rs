//! The shipped scenario files load, validate and produce a relay config the relay accepts.

use std::path::PathBuf;

use loadtest::scenario::{relay_config_toml, Scenario, ScenarioKind};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/loadtest")
}

#[test]
fn every_shipped_scenario_loads_and_configures_the_relay() {
    for (file, kind) in [
        ("drain.toml", ScenarioKind::Drain),
        ("steady.toml", ScenarioKind::Steady),
        ("chaos.toml", ScenarioKind::Chaos),
        ("chaos-replicas.toml", ScenarioKind::Chaos),
        ("poison.toml", ScenarioKind::Poison),
        ("steady-5k.toml", ScenarioKind::Steady),
        ("drain-1m.toml", ScenarioKind::Drain),
        ("drain-ordered.toml", ScenarioKind::Drain),
        ("bloat.toml", ScenarioKind::Drain),
        ("bloat-held.toml", ScenarioKind::Drain),
        ("adversarial.toml", ScenarioKind::Adversarial),
        ("destination-order.toml", ScenarioKind::Steady),
    ] {
        let s = Scenario::load(&dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(s.kind, kind, "{file}");
        let text = relay_config_toml(&s, 40000, 40001).unwrap_or_else(|e| panic!("{file}: {e}"));
        // What `outbox-relay run --config` will parse (secrets come from the environment).
        let parsed: outbox_relay::Config = toml::from_str(&text).unwrap();
        let routes = 1 + usize::from(s.second_route.is_some());
        assert_eq!(parsed.routes.len(), routes, "{file}");
    }
    let capped = Scenario::load(&dir().join("drain-ordered-webhook-300k-c64.toml")).unwrap();
    let relay: outbox_relay::Config =
        toml::from_str(&relay_config_toml(&capped, 40000, 40001).unwrap()).unwrap();
    let host = &relay.http.hosts[..];
    assert_eq!(host.len(), 1, "{host:?}");
    assert_eq!(host[0].host, "127.0.0.1");
    assert_eq!(host[0].concurrency.map(|c| c.get()), Some(64));
    assert!(capped.ordered());
    for file in ["chaos.toml", "chaos-replicas.toml"] {
        let chaos = Scenario::load(&dir().join(file)).unwrap();
        let relay: outbox_relay::Config =
            toml::from_str(&relay_config_toml(&chaos, 40000, 40001).unwrap()).unwrap();
        assert!(
            chaos.sink.faults.hang_for > relay.http.request_timeout,
            "{file}: hangs outlive the relay's request timeout"
        );
        assert!(
            relay.relay.lease > relay.http.request_timeout,
            "{file}: a lease outlives a request"
        );
        assert!(chaos.ordered(), "{file}");
    }
    let s = Scenario::load(&dir().join("chaos-replicas.toml")).unwrap();
    assert_eq!(s.replicas, 3);
    let chaos = s.chaos.as_ref().unwrap();
    let (every_min, _) = chaos.pause_every().expect("pauses are on");
    let (_, pause_max) = chaos.pause_for_range();
    assert!(pause_max < every_min, "one pause at a time, mostly");
    let relay: outbox_relay::Config =
        toml::from_str(&relay_config_toml(&s, 40000, 40001).unwrap()).unwrap();
    assert!(
        pause_max < relay.relay.lease,
        "a pause alone does not outlive the row lease"
    );
    let ordered = Scenario::load(&dir().join("drain-ordered.toml")).unwrap();
    let unordered = Scenario::load(&dir().join("drain-1m.toml")).unwrap();
    assert!(ordered.ordered() && !unordered.ordered());
    assert_eq!(
        ordered.preload, unordered.preload,
        "twins: the same backlog"
    );
    let adv = Scenario::load(&dir().join("adversarial.toml")).unwrap();
    let relay: outbox_relay::Config =
        toml::from_str(&relay_config_toml(&adv, 40000, 40001).unwrap()).unwrap();
    let faults = &adv.sink.faults;
    let a = faults
        .adversarial
        .as_ref()
        .expect("the adversarial mode is on");
    assert!(faults.hang_for > relay.http.request_timeout);
    assert!(
        a.oversized_bytes > relay.http.max_response_bytes
            && a.oversized_bytes > relay.qstash.batch_size.get() * 1024,
        "oversized answers are more than the relay reads"
    );
    let load = adv.load.as_ref().unwrap();
    assert!(load.duration >= std::time::Duration::from_secs(60));
    let kinds: std::collections::BTreeSet<_> = a.outages.iter().map(|o| o.kind).collect();
    assert_eq!(kinds.len(), 8, "every outage kind: {kinds:?}");
    assert!(a.outages.iter().all(|o| o.at + o.duration < load.duration));
    // Sink-wide outages are shorter than a lease; one route is down for longer
    // (the other route must keep flowing meanwhile).
    let route = adv.second_route.as_ref().expect("a second route");
    assert!(a
        .outages
        .iter()
        .all(|o| o.route.is_some() || o.duration < relay.relay.lease));
    assert!(a.outages.iter().any(|o| {
        o.route.as_deref() == Some(route.path.as_str()) && o.duration > relay.relay.lease
    }));
    let held = Scenario::load(&dir().join("bloat-held.toml")).unwrap();
    let free = Scenario::load(&dir().join("bloat.toml")).unwrap();
    assert!(held.hold_snapshot && !free.hold_snapshot);
    assert_eq!(held.vacuum_watch, free.vacuum_watch);
    assert!(free.vacuum_watch.is_some());
    let dest = Scenario::load(&dir().join("destination-order.toml")).unwrap();
    let delivery = dest.sink.delivery.as_ref().expect("delivery mode is on");
    assert!(dest.ordered() && delivery.check_order);
    assert!(
        delivery.failure_rate > 0.0,
        "failed calls are what breaks order"
    );
}

#[test]
fn bad_delivery_settings_are_refused_naming_the_key() {
    let bad = |delivery: &str| {
        let text = format!(
            "name = \"d\"\nkind = \"steady\"\n[load]\nrate = 1.0\nduration = \"1s\"\n[sink.delivery]\n{delivery}\n"
        );
        Scenario::from_toml_str(&text)
            .expect_err(delivery)
            .to_string()
    };
    assert!(bad("failure_rate = 2.0").contains("sink.delivery.failure_rate"));
    assert!(bad("retry_delay = \"qstash\"\nretry_delay_max = \"3s\"")
        .contains("sink.delivery.retry_delay_max"));
    assert!(bad("retry_delay = \"whenever\"").contains("`whenever`"));
    assert!(bad("latency = 5").contains("latency"));
}
