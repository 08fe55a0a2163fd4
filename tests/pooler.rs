//! The relay and the producer behind a real PgBouncer: the producer
//! (`outbox-client`) enqueues, and a consumer handles messages once,
//! through a transaction pooler, the relay runs
//! through a session pooler and refuses a transaction pooler, naming it.
//! Each test skips, saying why, when there is no `pgbouncer` binary.

mod common;

use std::time::Duration;

use common::{config_toml_with, event, pending, wait_until, QSTASH_ROUTE};
use outbox_client::consumer::consume_once;
use outbox_client::{enqueue, enqueue_many, NewEvent};
use outbox_testkit::pgbouncer::{PgBouncer, PoolMode};
use outbox_testkit::relay::Output;
use outbox_testkit::TestDb;

/// PgBouncer in `mode` in front of `db`, or `None` (the reason printed) when
/// the binary is absent.
fn bouncer(db: &TestDb, mode: PoolMode, pool_size: u32) -> Option<PgBouncer> {
    if let Err(why) = PgBouncer::binary() {
        eprintln!("skipped: {why}");
        return None;
    }
    Some(PgBouncer::start(&db.url, mode, pool_size).expect("pgbouncer starts"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_producer_enqueues_through_a_transaction_pooler() {
    let db = common::test_db().await;
    let Some(bouncer) = bouncer(&db, PoolMode::Transaction, 2) else {
        return;
    };
    let url = bouncer.url_for(&db.url);
    // The pooler really hands a client's statements to other server
    // connections: a statement prepared (named) on one is gone on the next.
    let a = outbox_testkit::postgres::connect(&url).await.unwrap();
    let mut b = outbox_testkit::postgres::connect(&url).await.unwrap();
    let named = a.prepare("SELECT 1").await.unwrap();
    let hold = b.transaction().await.unwrap();
    hold.batch_execute("SELECT 1").await.unwrap();
    let err = a
        .query(&named, &[])
        .await
        .expect_err("a named statement does not survive a transaction pooler");
    let message = err.as_db_error().map(|e| e.message().to_owned());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("does not exist")),
        "{err:?}"
    );
    hold.rollback().await.unwrap();

    // Eight producers over two server connections, each committing
    // transactions of one event and of a batch, interleaved.
    let producers = (0..8).map(|p| {
        let url = url.clone();
        tokio::spawn(async move {
            let mut client = outbox_testkit::postgres::connect(&url).await.unwrap();
            for t in 0..10 {
                let n = p * 1000 + t * 10;
                let tx = client.transaction().await.unwrap();
                enqueue(&tx, &event(n, &format!("order:p{p}")))
                    .await
                    .unwrap();
                let batch: Vec<NewEvent> = (1..5)
                    .map(|i| event(n + i, &format!("order:p{p}")))
                    .collect();
                enqueue_many(&tx, &batch).await.unwrap();
                // A retried request enqueues nothing twice.
                assert!(matches!(
                    enqueue(&tx, &batch[0]).await.unwrap(),
                    outbox_client::Enqueued::Duplicate
                ));
                tx.commit().await.unwrap();
                // And a consumer's once-only handling, on the same pooler.
                let handled = consume_once(&mut client, "billing", &format!("m{n}"), |tx| {
                    Box::pin(async move { tx.query_typed("SELECT 1", &[]).await.map(|_| ()) })
                })
                .await
                .unwrap();
                assert!(!handled.is_duplicate());
            }
        })
    });
    for p in futures_util::future::join_all(producers).await {
        p.expect("a producer enqueued through the pooler");
    }
    assert_eq!(pending(&db).await, 8 * 10 * 5);
    assert_eq!(
        common::count(&db, "SELECT count(*) FROM processed_messages").await,
        8 * 10
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_refuses_a_transaction_pooler_naming_it() {
    let db = common::test_db().await;
    let Some(bouncer) = bouncer(&db, PoolMode::Transaction, 4) else {
        return;
    };
    let pooled = bouncer.url_for(&db.url);
    let config = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        config.path(),
        config_toml_with(
            &db,
            "http://127.0.0.1:9",
            &format!("[database]\nurl = \"{pooled}\"\n"),
            QSTASH_ROUTE,
        ),
    )
    .unwrap();
    for args in [&["migrate"][..], &["drain"], &["run"]] {
        let out = std::process::Command::new(common::BIN)
            .args(args)
            .arg("--config")
            .arg(config.path())
            .env("DATABASE_URL", &pooled)
            .output()
            .expect("the relay binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} ran: {stderr}");
        for words in ["transaction pooling", "database.url", "direct"] {
            assert!(
                stderr.contains(words),
                "{args:?} should say {words:?}: {stderr}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_delivers_through_a_session_pooler() {
    let db = common::test_db().await;
    let Some(bouncer) = bouncer(&db, PoolMode::Session, 20) else {
        return;
    };
    let sink = common::start_sink().await;
    common::insert_events(&db, 500, 20).await;
    let toml = config_toml_with(
        &db,
        &sink.url(),
        &format!("[database]\nurl = \"{}\"\n", bouncer.url_for(&db.url)),
        QSTASH_ROUTE,
    );
    let relay = common::spawn_relay(&["run"], &toml, Output::Null);
    assert!(
        wait_until(Duration::from_secs(60), || async {
            pending(&db).await == 0
        })
        .await,
        "the relay did not deliver through the session pooler: {} pending",
        pending(&db).await
    );
    assert!(sink.accepted().len() >= 500);
    relay
        .terminate(Duration::from_secs(20))
        .await
        .expect("exits 0 on SIGTERM");
}
