//! Listener: a dedicated connection (pooled connections drop notifications)
//! running `LISTEN outbox_relay`; every NOTIFY wakes the claimers. On any error
//! it reconnects with backoff and re-LISTENs, waking the claimers once to catch
//! up. NOTIFY is only a latency hint: the claimers' poll keeps the relay live
//! while the listener is down.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;
use tokio_postgres::AsyncMessage;

use super::{reconnect_delay, Shared};
use crate::db;

/// The channel the insert trigger notifies (migrations/0001_outbox.sql).
pub const CHANNEL: &str = "outbox_relay";

pub struct Listener;

pub struct ListenerState {
    task: JoinHandle<()>,
}

impl Actor for Listener {
    type Msg = ();
    type State = ListenerState;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        shared: Arc<Shared>,
    ) -> Result<ListenerState, ActorProcessingErr> {
        Ok(ListenerState {
            task: tokio::spawn(listen_forever(shared)),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<()>,
        state: &mut ListenerState,
    ) -> Result<(), ActorProcessingErr> {
        state.task.abort();
        Ok(())
    }
}

async fn listen_forever(shared: Arc<Shared>) {
    let mut failures = 0u32;
    loop {
        match listen_once(&shared, &mut failures).await {
            Ok(()) => tracing::warn!("notification connection closed; reconnecting"),
            Err(e) => tracing::warn!(error = %e, "notification connection failed; reconnecting"),
        }
        failures += 1;
        tokio::time::sleep(reconnect_delay(failures)).await;
    }
}

async fn listen_once(shared: &Shared, failures: &mut u32) -> Result<(), db::DbError> {
    let mut config = db::parse_url(&shared.config.database.url)?;
    config.connect_timeout(shared.config.database.connect_timeout);
    config.application_name("outbox-relay listener");
    // A silently dead peer is noticed by TCP keepalives (the connection only reads).
    config.keepalives(true);
    config.keepalives_idle(Duration::from_secs(30));
    config.keepalives_interval(Duration::from_secs(10));
    config.keepalives_retries(3);
    let (client, mut connection) = config.connect(db::tls()).await?;
    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    {
        let statement = format!("LISTEN {CHANNEL}");
        let listen = client.batch_execute(&statement);
        // The connection must be polled for LISTEN to complete.
        tokio::pin!(listen);
        loop {
            tokio::select! {
                result = &mut listen => { result?; break; }
                message = messages.next() => match message {
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(e.into()),
                    None => return Ok(()),
                }
            }
        }
    }
    *failures = 0;
    tracing::debug!("listening for new outbox rows");
    // Rows may have arrived while we were away.
    shared.directory.wake_claimers();
    // Keep the client alive: dropping it would close the connection.
    let _client = client;
    loop {
        match messages.next().await {
            Some(Ok(AsyncMessage::Notification(_))) => shared.directory.wake_claimers(),
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e.into()),
            None => return Ok(()),
        }
    }
}
