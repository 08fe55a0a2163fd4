//! The listener's look at the outbox: the id sequence's position and the
//! cluster's transaction horizon, one cheap read on a connection of its own
//! (a one-page read that takes no lock a producer waits for).

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_postgres::{Client, Statement};

use super::{conn, StoreError};

/// The sequence behind `outbox.id` (an identity, also on the partitioned outbox).
const SEQUENCE: &str = "SELECT pg_get_serial_sequence('outbox', 'id')::regclass::oid";

/// The sequence's position and the cluster's transaction horizon, as text
/// (xid8 has no binary decoding in the client), in one round trip.
const PROBE: &str = "SELECT pg_sequence_last_value($1::oid::regclass),
       pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
       pg_snapshot_xmax(pg_current_snapshot())::text::bigint";

/// Without an id sequence: the highest visible id (a backward step on the key).
const PROBE_MAX_ID: &str = "SELECT (SELECT max(id) FROM outbox),
       pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
       pg_snapshot_xmax(pg_current_snapshot())::text::bigint";

/// One probe's reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reading {
    /// The sequence's last value (or the highest id).
    pub position: Option<i64>,
    /// The oldest transaction still running.
    pub xmin: i64,
    /// The next transaction id to be assigned.
    pub xmax: i64,
}

/// A dedicated connection with the probe prepared on it; the connection's
/// driver stops when this is dropped.
pub(crate) struct Probe {
    client: Client,
    statement: Statement,
    sequence: Option<u32>,
    driver: JoinHandle<()>,
}

impl Probe {
    pub(crate) async fn connect(
        url: &str,
        connect_timeout: Duration,
        liveness: &conn::Liveness,
    ) -> Result<Probe, StoreError> {
        let (mut config, tls) = conn::parse_with_tls(url)?;
        config.connect_timeout(connect_timeout);
        conn::apply_liveness(&mut config, liveness);
        config.application_name("outbox-relay listener");
        let (client, connection) = config.connect(tls).await?;
        let driver = tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "probe connection closed");
            }
        });
        let probe = async {
            let sequence: Option<u32> = client.query_one(SEQUENCE, &[]).await?.get(0);
            let statement = match sequence {
                Some(_) => client.prepare(PROBE).await?,
                None => {
                    tracing::warn!("outbox.id has no sequence; probing max(id) instead");
                    client.prepare(PROBE_MAX_ID).await?
                }
            };
            Ok::<_, StoreError>((sequence, statement))
        };
        match probe.await {
            Ok((sequence, statement)) => Ok(Probe {
                client,
                statement,
                sequence,
                driver,
            }),
            Err(e) => {
                driver.abort();
                Err(e)
            }
        }
    }

    pub(crate) async fn read(&self) -> Result<Reading, StoreError> {
        let row = match self.sequence {
            Some(oid) => self.client.query_one(&self.statement, &[&oid]).await?,
            None => self.client.query_one(&self.statement, &[]).await?,
        };
        Ok(Reading {
            position: row.get(0),
            xmin: row.get(1),
            xmax: row.get(2),
        })
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.driver.abort();
    }
}
