//! The verifier catches what a broken relay would do, against real rows.

use loadtest::verify::{verify, VerifyOptions};
use outbox_client::{enqueue_many, NewEvent};
use outbox_relay::store::migrate;
use outbox_testkit::sink::Record;
use outbox_testkit::TestDb;
use serde_json::json;
use uuid::Uuid;

struct Fixture {
    db: TestDb,
    /// (id, idempotency_key, partition_key, poison)
    rows: Vec<(i64, String, String, bool)>,
}

/// Keys `k1` (3 events) and `k2` (2 events), then one poison event in `k2`.
async fn fixture() -> Fixture {
    let db = TestDb::with_setup(migrate::run).await.unwrap();
    let mut client = db.client().await.unwrap();
    let tenant = Uuid::new_v4();
    let spec = [
        ("k1", false),
        ("k1", false),
        ("k2", false),
        ("k1", false),
        ("k2", false),
        ("k2", true),
    ];
    let events: Vec<NewEvent> = spec
        .iter()
        .enumerate()
        .map(|(i, (key, poison))| {
            let payload = if *poison {
                json!({"n": i, "poison": true})
            } else {
                json!({"n": i})
            };
            NewEvent::new(
                tenant,
                "account",
                *key,
                "order.placed",
                payload,
                format!("idem-{i}"),
            )
            .with_partition_key(*key)
        })
        .collect();
    let tx = client.transaction().await.unwrap();
    let ids: Vec<i64> = enqueue_many(&tx, &events)
        .await
        .unwrap()
        .into_iter()
        .map(|e| match e {
            outbox_client::Enqueued::New { id } => id,
            other => panic!("{other:?}"),
        })
        .collect();
    tx.commit().await.unwrap();
    let rows = ids
        .iter()
        .zip(spec.iter())
        .enumerate()
        .map(|(i, (id, (key, poison)))| (*id, format!("idem-{i}"), key.to_string(), *poison))
        .collect();
    Fixture { db, rows }
}

impl Fixture {
    /// What a correct relay leaves: the good rows published, poison dead-lettered with a reason.
    async fn settle_correctly(&self) {
        let c = self.db.client().await.unwrap();
        c.batch_execute(
            "UPDATE outbox SET published_at = now(), attempt_count = 1 WHERE NOT payload @> '{\"poison\": true}';
             UPDATE outbox SET dead_lettered_at = now(), attempt_count = 1, last_error = 'HTTP 400: poison event rejected' WHERE payload @> '{\"poison\": true}';",
        )
        .await
        .unwrap();
    }

    /// One receipt per good row, in id order, with the right deduplication ids.
    fn good_records(&self) -> Vec<Record> {
        self.rows
            .iter()
            .filter(|r| !r.3)
            .map(|(id, key, pk, _)| record(*id, key, pk))
            .collect()
    }

    fn id(&self, i: usize) -> i64 {
        self.rows[i].0
    }

    async fn check(&self, records: &[Record]) -> loadtest::verify::Verification {
        let mut records = records.to_vec();
        for (seq, r) in records.iter_mut().enumerate() {
            r.seq = seq as u64;
        }
        let opts = VerifyOptions {
            ordered: true,
            poison_marker: true,
            ..VerifyOptions::default()
        };
        verify(&self.db.client().await.unwrap(), &records, &opts)
            .await
            .unwrap()
            .0
    }
}

fn record(id: i64, dedup: &str, key: &str) -> Record {
    Record {
        seq: 0,
        message_id: format!("msg_{id}"),
        dedup_id: Some(dedup.to_owned()),
        outbox_id: Some(id),
        partition_key: Some(key.to_owned()),
        destination: "http://127.0.0.1:1/hook".into(),
        received_at_us: chrono::Utc::now().timestamp_micros(),
        deduplicated: false,
        created_at_us: None,
        via_batch: true,
    }
}

#[tokio::test]
async fn a_correct_run_passes() {
    let f = fixture().await;
    f.settle_correctly().await;
    let v = f.check(&f.good_records()).await;
    assert!(v.passed(), "{:?}", v.failures());
    assert_eq!((v.rows, v.expected, v.received), (6, 5, 5));
    assert_eq!(v.poison.expected, 1);
    assert_eq!(v.poison.dead_lettered, 1);
    assert_eq!(v.pending, 0);
}

#[tokio::test]
async fn a_dropped_message_is_caught_by_id() {
    let f = fixture().await;
    f.settle_correctly().await;
    let dropped = f.id(2);
    let records: Vec<Record> = f
        .good_records()
        .into_iter()
        .filter(|r| r.outbox_id != Some(dropped))
        .collect();
    let v = f.check(&records).await;
    assert_eq!(v.missing, vec![dropped]);
    assert!(!v.passed());
    let failures = v.failures().join("\n");
    assert!(failures.contains(&format!("ids {dropped}")), "{failures}");
    // Marked published but never received: the lie is still caught.
    assert_eq!(v.received_not_marked, 0);
}

#[tokio::test]
async fn duplicates_are_counted_and_must_carry_the_idempotency_key() {
    let f = fixture().await;
    f.settle_correctly().await;
    let mut records = f.good_records();
    let (id, key, pk, _) = f.rows[0].clone();
    let mut dup = record(id, &key, &pk);
    dup.deduplicated = true;
    records.push(dup);
    let v = f.check(&records).await;
    assert!(v.passed(), "{:?}", v.failures());
    assert_eq!((v.duplicates, v.duplicates_deduplicated), (1, 1));

    // A redelivery under a fresh deduplication id defeats QStash's dedup: caught.
    records.push(record(id, "some-other-key", &pk));
    let v = f.check(&records).await;
    assert_eq!(v.duplicates, 2);
    assert_eq!(v.wrong_dedup_id.len(), 1);
    assert_eq!(v.wrong_dedup_id[0].outbox_id, id);
    assert!(v.wrong_dedup_id[0].duplicate);
    assert!(!v.passed());
}

#[tokio::test]
async fn an_order_violation_is_caught() {
    let f = fixture().await;
    f.settle_correctly().await;
    let mut records = f.good_records();
    // Key k1 holds rows 0, 1 and 3: receive row 3 before row 1.
    let pos1 = records
        .iter()
        .position(|r| r.outbox_id == Some(f.id(1)))
        .unwrap();
    let pos3 = records
        .iter()
        .position(|r| r.outbox_id == Some(f.id(3)))
        .unwrap();
    records.swap(pos1, pos3);
    let v = f.check(&records).await;
    assert_eq!(v.order_violations.len(), 1, "{:?}", v.order_violations);
    let o = &v.order_violations[0];
    assert_eq!(
        (o.partition_key.as_str(), o.earlier_id, o.later_id),
        ("k1", f.id(1), f.id(3))
    );
    assert!(!v.passed());

    // A duplicate of an early id arriving late is not a violation: only first receipts count.
    let mut records = f.good_records();
    let (id, key, pk, _) = f.rows[0].clone();
    records.push(record(id, &key, &pk));
    assert!(f.check(&records).await.order_violations.is_empty());
}

#[tokio::test]
async fn poison_accounting_is_checked() {
    let f = fixture().await;
    let poison_id = f.id(5);
    let c = f.db.client().await.unwrap();

    // The relay never dead-lettered the poison event (still pending).
    c.batch_execute(
        "UPDATE outbox SET published_at = now() WHERE NOT payload @> '{\"poison\": true}'",
    )
    .await
    .unwrap();
    let v = f.check(&f.good_records()).await;
    assert_eq!(v.poison.not_dead_lettered, vec![poison_id]);
    assert!(!v.passed());

    // Dead-lettered, but without a reason.
    c.batch_execute(
        "UPDATE outbox SET dead_lettered_at = now() WHERE payload @> '{\"poison\": true}'",
    )
    .await
    .unwrap();
    let v = f.check(&f.good_records()).await;
    assert_eq!(v.poison.without_reason, vec![poison_id]);
    assert!(v.poison.not_dead_lettered.is_empty());

    // With a reason it passes ...
    f.settle_correctly().await;
    assert!(f.check(&f.good_records()).await.passed());

    // ... unless the sink recorded it as accepted.
    let mut records = f.good_records();
    let (id, key, pk, _) = f.rows[5].clone();
    records.push(record(id, &key, &pk));
    let v = f.check(&records).await;
    assert_eq!(v.poison.accepted, vec![poison_id]);
    assert!(!v.passed());

    // And a good event dead-lettered is a failure too.
    c.batch_execute(&format!(
        "UPDATE outbox SET dead_lettered_at = now(), last_error = 'x' WHERE id = {}",
        f.id(0)
    ))
    .await
    .unwrap();
    let v = f.check(&f.good_records()).await;
    assert_eq!(v.unexpected_dead_letters, vec![f.id(0)]);
}

#[tokio::test]
async fn a_live_lease_on_a_pending_row_is_caught() {
    let f = fixture().await;
    f.settle_correctly().await;
    let leased = f.id(4);
    let c = f.db.client().await.unwrap();
    c.batch_execute(&format!(
        "UPDATE outbox SET published_at = NULL, locked_until = now() + interval '1 hour' WHERE id = {leased};
         UPDATE outbox SET locked_until = now() - interval '1 hour' WHERE id = {};",
        f.id(0)
    ))
    .await
    .unwrap();
    let v = f.check(&f.good_records()).await;
    assert_eq!(v.live_leases, vec![leased]);
    assert_eq!(v.pending, 1);
    assert_eq!(v.received_not_marked, 1);
    assert!(v.failures().iter().any(|l| l.contains("live lease")));
}

#[tokio::test]
async fn receipts_for_unknown_rows_are_counted() {
    let f = fixture().await;
    f.settle_correctly().await;
    let mut records = f.good_records();
    records.push(record(999_999, "nope", "k9"));
    let mut no_id = record(1, "x", "k1");
    no_id.outbox_id = None;
    records.push(no_id);
    let v = f.check(&records).await;
    assert_eq!(v.unknown_records, 2);
    assert!(!v.passed());
}
