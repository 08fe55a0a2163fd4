//! The claimers' poll while their claims find nothing: it backs off (an
//! ordered claim over keys held for their callbacks walks every key of its
//! shard each time), and it still claims a row the marker wrote as due again
//! when it comes due, not at the next poll.

mod common;

use std::time::Duration;

use common::{config, insert_events, pending, wait_until, QSTASH_ROUTE};
use outbox_relay::Relay;
use outbox_testkit::sink::Reply;

/// Rows pending but not due for an hour: every claim finds nothing. With the
/// poll at 0.5 s and no backoff the eight claimers claim about 16 times a
/// second; backed off to 4 s, about 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_claimers_poll_backs_off_while_its_claims_find_nothing() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    insert_events(&db, 50, 50).await;
    let admin = db.client().await.unwrap();
    admin
        .execute(
            "UPDATE outbox SET available_at = now() + interval '1 hour'",
            &[],
        )
        .await
        .unwrap();
    let mut cfg = config(&db, &sink.url(), QSTASH_ROUTE);
    cfg.relay.poll_interval = Duration::from_millis(500);
    cfg.relay.idle_poll_max = Duration::from_secs(4);
    let relay = Relay::start(cfg).await.unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || async {
            relay.shards_owned().len() == 8
        })
        .await
    );
    // At the ceiling after 0.5 + 0.5 + 1 + 2 s.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let before = relay.counters().claims;
    tokio::time::sleep(Duration::from_secs(8)).await;
    let claims = relay.counters().claims - before;
    eprintln!("{claims} claims in 8 s of claims finding nothing");
    // At most three polls per shard in 8 s at 4 s apart (two, and one more
    // for a claimer whose wait had not reached the ceiling); 128 without
    // the backoff.
    assert!(claims <= 24, "{claims} claims in 8 s");
    assert!(claims >= 8, "every shard's claimer still polls: {claims}");
    assert!(sink.received().is_empty());
    let report = relay.shutdown().await;
    assert_eq!(report.counters.claimed, 0);
}

/// A retry comes due 1 s after its failure (the sink's `Retry-After`); the
/// poll is 10 s. The marker tells the shard's claimer when it wrote the
/// retry due, so the second attempt goes about 1 s after the first, not at
/// the claimer's next poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_claimed_when_it_comes_due_not_at_the_next_poll() {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    sink.set_rule(|m| {
        if m.attempt == 0 {
            Reply::Status(503, Some("1".into()))
        } else {
            Reply::Accept
        }
    });
    insert_events(&db, 1, 1).await;
    let mut cfg = config(&db, &sink.url(), QSTASH_ROUTE);
    cfg.relay.backoff_base = Duration::from_secs(1);
    cfg.relay.backoff_cap = Duration::from_secs(1);
    cfg.relay.poll_interval = Duration::from_secs(10);
    cfg.relay.idle_poll_max = Duration::from_secs(30);
    let relay = Relay::start(cfg).await.unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || async {
            pending(&db).await == 0
        })
        .await,
        "the retry was not delivered within 30 s"
    );
    let received = sink.received();
    assert_eq!(received.len(), 2, "one failure, one success: {received:?}");
    let gap = received[1].at - received[0].at;
    eprintln!("second attempt {gap:?} after the first");
    assert!(
        gap < Duration::from_secs(6),
        "the retry, due 1 s after the first attempt, went {gap:?} after it (the poll is 10 s)"
    );
    let report = relay.shutdown().await;
    assert_eq!(report.counters.published, 1);
    assert_eq!(report.counters.retried, 1);
}
