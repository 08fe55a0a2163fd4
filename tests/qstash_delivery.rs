//! The relay against the QStash stand-in in delivery mode: what QStash does
//! after it accepted an event (delivering it, retrying, calling the failure
//! callback) reaches the relay the way the real one would, so the relay's
//! failure-callback endpoint reads the stand-in's reports.

mod common;

use std::time::Duration;

use common::{config, count, insert_events, wait_until};
use outbox_client::consumer::qstash::Verifier;
use outbox_relay::server::callback::{self, CallbackOptions};
use outbox_relay::Relay;
use outbox_testkit::sink::{
    DeliveryConfig, Destination, DestinationConfig, RetryDelay, Sink, SinkConfig,
    DEV_CURRENT_SIGNING_KEY, DEV_NEXT_SIGNING_KEY,
};

const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_that_fails_every_retry_comes_back_as_a_dead_letter() {
    let db = common::test_db().await;
    let dest = Destination::start(DestinationConfig {
        failure_rate: 1.0,
        ..DestinationConfig::default()
    })
    .await
    .unwrap();
    let sink = Sink::start(SinkConfig {
        delivery: Some(DeliveryConfig {
            retry_delay: RetryDelay::Fixed(Duration::from_millis(100)),
            ..DeliveryConfig::default()
        }),
        ..SinkConfig::for_tests(common::TOKEN)
    })
    .await
    .unwrap();
    // The failure callback, served as the daemon serves it.
    let callback_addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let callback_url = format!("http://{callback_addr}{}", callback::FAILURE_PATH);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let _server = callback::serve(
        callback_addr,
        outbox_relay::store::Store::with_pool(common::pool(&db, 2)),
        Verifier::new(DEV_CURRENT_SIGNING_KEY, Some(DEV_NEXT_SIGNING_KEY)),
        CallbackOptions::new([callback_url.clone()]),
        async {
            let _ = stopped.await;
        },
    )
    .await
    .unwrap();
    let routes = format!(
        r#"
        [[routes]]
        event_type = "*"
        destination = "{}/events"
        retries = 1
        failure_callback = "{callback_url}"
        ordering = "partition_key"
        "#,
        dest.url()
    );
    insert_events(&db, 5, 5).await;
    let relay = Relay::start(config(&db, &sink.url(), &routes))
        .await
        .unwrap();
    let dead = || async {
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE dead_lettered_at IS NOT NULL",
        )
        .await
    };
    let all_dead = wait_until(LIMIT, || async { dead().await == 5 }).await;
    relay.shutdown().await;
    let _ = stop.send(());
    assert!(all_dead, "{} of 5 dead-lettered", dead().await);

    let client = db.client().await.unwrap();
    for row in client
        .query("SELECT last_error FROM outbox ORDER BY id", &[])
        .await
        .unwrap()
    {
        let error: String = row.get(0);
        assert!(
            error.starts_with("qstash: status 503 after 1 retries")
                && error.contains("the destination answered 503")
                && error.contains("dlqId"),
            "{error}"
        );
    }
    // Two attempts each at the destination, then one report each, taken.
    let calls = dest.calls();
    assert_eq!(calls.len(), 10);
    assert!(calls.iter().all(|c| !c.succeeded()));
    let reports = sink.callbacks();
    assert_eq!(reports.len(), 5);
    assert!(reports
        .iter()
        .all(|r| r.delivered && r.last_status == Some(200) && r.retried == 1));
}
