//! The adversarial scenario (`config/loadtest/adversarial.toml`) in short form
//! against the real relay: 45 s of load at 150 events/s with every outage of
//! the file, a longer lease for a debug build on a shared machine. It passes
//! when the harness's invariants hold (see `loadtest::adversarial`): every
//! event published or dead-lettered with a reason, nothing published without
//! an accepting answer, no dead letter from an outage, no stall longer than a
//! lease outside outages. The limits are only there so a broken relay fails
//! the test instead of hanging it; the asserts at the end check that the
//! faults really happened.
//!
//! The relay is chosen as in the chaos tests (`common::relay`).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{run_in_test, TestRun};
use loadtest::scenario::Scenario;

/// The shipped scenario, shortened for a debug build.
fn short_form() -> Scenario {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/loadtest/adversarial.toml");
    let mut s = Scenario::load(&path).unwrap();
    s.name = "adversarial-ci".into();
    let load = s.load.as_mut().unwrap();
    load.rate = Some(150.0);
    load.duration = Duration::from_secs(45);
    // A debug relay on a shared 2-core machine: a longer lease (the stall
    // limit is the lease), and a tighter drain bound.
    s.relay_config["relay"]
        .as_table_mut()
        .unwrap()
        .insert("lease".into(), "15s".into());
    s.drain_timeout = Duration::from_secs(150);
    s.validate().unwrap();
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adversarial_answers_lose_nothing_and_outages_dead_letter_nothing() {
    let scenario = short_form();
    let TestRun {
        report, context, ..
    } = run_in_test(&scenario, Duration::from_secs(480), 30).await;
    eprintln!("{}", report.table());

    let a = report.adversarial.as_ref().expect("adversarial checks ran");
    assert!(report.rows > 0, "{context}");
    assert!(report.passed, "{context}");
    assert!(
        a.unsettled.is_empty() && a.published_unaccepted.is_empty(),
        "{context}"
    );
    assert!(a.unjustified_dead_letters.is_empty(), "{context}");
    assert!(a.longest_charged_stall.secs < a.lease_secs, "{context}");
    assert!(report.verification.missing.is_empty(), "{context}");
    assert!(report.verification.wrong_dedup_id.is_empty(), "{context}");

    // The adversary really played: every outage ran, and each fault kind was drawn.
    let kinds: std::collections::BTreeSet<_> = a.outages.iter().map(|o| o.kind).collect();
    assert_eq!(kinds.len(), 6, "{context}");
    let faults = &report.sink.adversarial;
    for prefix in [
        "status_",
        "garbled_",
        "cut_off",
        "oversized",
        "nul_body",
        "outage_",
    ] {
        assert!(
            faults.iter().any(|(k, n)| k.starts_with(prefix) && *n > 0),
            "no {prefix} fault: {context}"
        );
    }
    assert!(
        a.answers.accepted_unread > 0 && a.answers.rejected > 0,
        "{context}"
    );
    assert!(
        report.verification.poison.expected > 0
            && report.verification.poison.dead_lettered == report.verification.poison.expected,
        "{context}"
    );
}
