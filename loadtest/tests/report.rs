//! Report math on known samples.

use loadtest::report::{latency_after, LatencySummary, Report, ReportInput};
use loadtest::verify::{verify_rows, OutboxRow, VerifyOptions};
use outbox_testkit::sink::Record;

#[test]
fn percentiles_of_known_samples() {
    let s = LatencySummary::from_samples(1..=1000);
    assert_eq!(s.count, 1000);
    assert_eq!(s.p50_us, 500);
    assert_eq!(s.p90_us, 900);
    assert_eq!(s.p99_us, 990);
    assert_eq!(s.p999_us, 999);
    assert_eq!(s.max_us, 1000);
    assert!((s.mean_us - 500.5).abs() < 0.5);

    // 99 fast and one slow: p99 is still fast, p99.9 and max see the outlier (3 significant figures).
    let s = LatencySummary::from_samples((0..99).map(|_| 2_000).chain([5_000_000]));
    assert_eq!(s.p50_us, 2_000);
    assert_eq!(s.p99_us, 2_000);
    let within = |v: u64, want: u64| v.abs_diff(want) * 1000 <= want;
    assert!(within(s.p999_us, 5_000_000), "{}", s.p999_us);
    assert!(within(s.max_us, 5_000_000), "{}", s.max_us);

    assert_eq!(LatencySummary::from_samples([]), LatencySummary::default());
}

fn row(id: i64, created_at_us: i64) -> OutboxRow {
    OutboxRow {
        id,
        idempotency_key: format!("k{id}"),
        partition_key: "p".into(),
        created_at_us,
        published: true,
        dead_lettered: false,
        last_error: None,
        live_lease: false,
        poison_marker: false,
        attempt_count: if id == 3 { 3 } else { 1 },
    }
}

fn rec(seq: u64, id: i64, received_at_us: i64) -> Record {
    Record {
        seq,
        message_id: format!("msg_{id}"),
        dedup_id: Some(format!("k{id}")),
        outbox_id: Some(id),
        partition_key: Some("p".into()),
        destination: "http://127.0.0.1:1/hook".into(),
        received_at_us,
        deduplicated: false,
        created_at_us: None,
        via_batch: false,
    }
}

#[test]
fn throughput_series_and_latency_from_first_receipts() {
    let t0 = 1_700_000_000_000_000;
    let rows: Vec<OutboxRow> = (1..=4).map(|id| row(id, t0)).collect();
    let records = vec![
        rec(0, 1, t0 + 100_000),   // second 0, 100 ms
        rec(1, 2, t0 + 400_000),   // second 0, 400 ms
        rec(2, 3, t0 + 2_500_000), // second 2, 2.5 s
        rec(3, 1, t0 + 2_600_000), // duplicate: ignored for latency
        rec(4, 4, t0 + 4_000_000), // second 4, 4 s
    ];
    let verification = verify_rows(&rows, &records, &VerifyOptions::default());
    let report = Report::build(ReportInput {
        scenario: "unit",
        origin_us: t0,
        rows: &rows,
        records: &records,
        relay: Default::default(),
        outbox_dead_tuples: 7,
        produced: Default::default(),
        sink: Default::default(),
        verification,
    });
    assert!(report.passed, "{:?}", report.failures);
    assert_eq!(report.delivered, 4);
    assert_eq!(report.duration_secs, 4.0);
    assert_eq!(report.throughput_per_sec, 1.0);
    let per_second: Vec<u64> = report.series.iter().map(|p| p.delivered).collect();
    assert_eq!(per_second, vec![2, 0, 1, 0, 1]);
    assert_eq!(report.series[1].p99_us, None);
    assert_eq!(report.latency.count, 4);
    // HdrHistogram keeps 3 significant figures.
    let within = |v: u64, want: u64| v.abs_diff(want) * 1000 <= want;
    assert!(
        within(report.latency.max_us, 4_000_000),
        "{}",
        report.latency.max_us
    );
    assert!(
        within(report.latency.p50_us, 400_000),
        "{}",
        report.latency.p50_us
    );
    assert_eq!(report.db.retries, 2);
    assert_eq!(report.db.max_attempts, 3);
    assert_eq!(report.db.outbox_dead_tuples, 7);
    assert_eq!(report.verification.duplicates, 1);

    let table = report.table();
    let line = table
        .lines()
        .find(|l| l.starts_with("throughput "))
        .unwrap();
    assert!(line.ends_with("  1 events/s"), "{table}");
    // Aligned: every value starts in the same column.
    let col = |l: &str| {
        l.find("  ")
            .map(|i| i + l[i..].len() - l[i..].trim_start().len())
    };
    let cols: std::collections::HashSet<_> = table.lines().filter_map(col).collect();
    assert_eq!(cols.len(), 1, "{table}");
    assert!(table.contains("PASS"));

    let svg = report.svg().unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("polyline"),
        "{}",
        &svg[..200.min(svg.len())]
    );

    let dir = tempfile::tempdir().unwrap();
    report.write_json(&dir.path().join("r.json")).unwrap();
    let back: Report =
        serde_json::from_slice(&std::fs::read(dir.path().join("r.json")).unwrap()).unwrap();
    assert_eq!(back, report);
}

/// A load over a preload: the load's latency is that of the rows after the
/// preload's last id alone, each at its first receipt.
#[test]
fn the_load_latency_leaves_the_preload_out() {
    let t0 = 1_700_000_000_000_000;
    let rows: Vec<OutboxRow> = (1..=4).map(|id| row(id, t0)).collect();
    let records = vec![
        rec(0, 1, t0 + 90_000_000), // preloaded: 90 s
        rec(1, 3, t0 + 20_000),     // the load's: 20 ms
        rec(2, 2, t0 + 95_000_000), // preloaded
        rec(3, 4, t0 + 40_000),     // the load's: 40 ms
        rec(4, 3, t0 + 50_000_000), // a duplicate: its first receipt counts
    ];
    let load = latency_after(&rows, &records, 2);
    assert_eq!(load.count, 2);
    // 3 significant figures.
    let within = |v: u64, want: u64| v.abs_diff(want) * 1000 <= want;
    assert!(within(load.max_us, 40_000), "{}", load.max_us);
    assert!(within(load.p50_us, 20_000), "{}", load.p50_us);
    assert_eq!(latency_after(&rows, &records, 0).count, 4);
}
