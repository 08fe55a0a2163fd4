//! Is there a transaction pooler (PgBouncer, Supavisor, RDS Proxy in
//! transaction mode) between the relay and PostgreSQL? The relay refuses to
//! run through one: its sessions keep state such a pooler does not keep for
//! them (statements prepared once per connection, migrations' session
//! advisory lock), so it would fail at random under load. A session pooler,
//! which gives each client connection one server connection for its whole
//! life, is fine.
//!
//! How it tells: two connections read their server process id a few times.
//! Connected directly (or through a session pooler), each connection always
//! reads its own id and the two differ. A transaction pooler hands each
//! statement whichever server connection is free: the second connection
//! reads the id the first one read (PgBouncer reuses the server connection
//! used last), or one connection reads two ids (pools that rotate them).

use std::time::Duration;

use tokio_postgres::Client;

use super::{conn, StoreError};

const BACKEND_PID: &str = "SELECT pg_backend_pid()";

/// Errs, naming the pooler and what to use instead, when `url` (the config's
/// `database.url`) leads to a transaction pooler. `relay run`, `drain` and
/// `migrate` check this before anything else.
pub async fn refuse_transaction_pooler(
    url: &str,
    connect_timeout: Duration,
) -> Result<(), StoreError> {
    let (mut config, tls) = conn::parse_with_tls(url)?;
    config.connect_timeout(connect_timeout);
    conn::apply_liveness(&mut config, &conn::Liveness::default());
    config.application_name("outbox-relay pooler check");
    let (a, a_driver) = open(&config, &tls).await?;
    let (b, b_driver) = open(&config, &tls).await?;
    let reads = async {
        Ok::<_, StoreError>([
            pid(&b).await?,
            pid(&b).await?,
            pid(&a).await?,
            pid(&a).await?,
            pid(&b).await?,
        ])
    };
    let result = reads.await;
    a_driver.abort();
    b_driver.abort();
    if each_served_alone(result?) {
        return Ok(());
    }
    let (host, port) = where_to(&config);
    Err(StoreError::Refused(format!(
        "configuration key `database.url` (DATABASE_URL): {host}:{port} is a connection pooler in transaction pooling mode \
         (two connections were served by the same PostgreSQL backend, or one connection by several: \
         PgBouncer, Supavisor or RDS Proxy with pool_mode = transaction). The relay keeps session \
         state such a pooler loses (prepared statements, migrations' advisory lock), so it must \
         connect directly: give it the direct URL (Supabase: the direct connection or the session \
         pooler on port 5432; Neon: the host without -pooler; your own PgBouncer: a database with \
         pool_mode = session). Applications can keep enqueueing through the pooler."
    )))
}

/// The reads of connection b, b, a, a, b: each connection kept its own
/// backend, and the two backends differ.
fn each_served_alone([b1, b2, a1, a2, b3]: [i32; 5]) -> bool {
    b1 == b2 && b2 == b3 && a1 == a2 && a1 != b1
}

/// The connection's server process id, by an unnamed statement (which works
/// through any pooler).
async fn pid(client: &Client) -> Result<i32, StoreError> {
    Ok(client.query_typed_one(BACKEND_PID, &[]).await?.get(0))
}

async fn open(
    config: &tokio_postgres::Config,
    tls: &conn::Tls,
) -> Result<(Client, tokio::task::JoinHandle<()>), StoreError> {
    let (client, connection) = config.connect(tls.clone()).await?;
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok((client, driver))
}

fn where_to(config: &tokio_postgres::Config) -> (String, u16) {
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        #[cfg(unix)]
        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    (host, config.get_ports().first().copied().unwrap_or(5432))
}

#[cfg(test)]
mod tests {
    use super::each_served_alone;

    #[test]
    fn a_pooler_that_reuses_or_rotates_backends_is_seen() {
        // Direct, or a session pooler: one backend per connection.
        assert!(each_served_alone([7, 7, 9, 9, 7]));
        // PgBouncer (last used first): a takes the backend b just released.
        assert!(!each_served_alone([7, 7, 7, 7, 7]));
        // Rotating over two backends: b reads both.
        assert!(!each_served_alone([7, 9, 7, 9, 7]));
        // Rotating so that a and b alternate: b's third read differs.
        assert!(!each_served_alone([7, 7, 9, 9, 9]));
    }
}
