//! Connections to PostgreSQL: a pool for the relay's actors, dedicated
//! connections where a session matters (the listener, migrations), TLS when
//! the URL asks for it.

use std::time::Duration;

use bb8_postgres::PostgresConnectionManager;
use tokio_postgres::config::SslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::StoreError;

pub(crate) type Tls = MakeRustlsConnect;
pub(crate) type Manager = PostgresConnectionManager<Tls>;
pub type Pool = bb8::Pool<Manager>;
pub type PooledConn = bb8::PooledConnection<'static, Manager>;

/// A rustls connector with the Mozilla roots compiled in, so `sslmode=require`
/// works against managed PostgreSQL (Neon, Supabase, RDS) with nothing on the host.
pub fn tls() -> Tls {
    let roots = rustls::RootCertStore::from_iter(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    MakeRustlsConnect::new(config)
}

pub fn parse_url(url: &str) -> Result<tokio_postgres::Config, StoreError> {
    if url.is_empty() {
        return Err(StoreError::BadUrl(
            "it is empty (set DATABASE_URL or database.url)".into(),
        ));
    }
    let mut config = url
        .parse::<tokio_postgres::Config>()
        .map_err(|e| StoreError::BadUrl(e.to_string()))?;
    // libpq's default `prefer` tries TLS without checking the certificate; we
    // only speak verified TLS, so TLS is used when the URL asks for it
    // (`sslmode=require`) and plain TCP otherwise.
    if config.get_ssl_mode() == SslMode::Prefer {
        config.ssl_mode(SslMode::Disable);
    }
    Ok(config)
}

/// A pool that connects lazily; connections are checked by their closed flag,
/// not by an extra round trip on every checkout.
pub fn pool(url: &str, size: u32, connect_timeout: Duration) -> Result<Pool, StoreError> {
    let mut config = parse_url(url)?;
    config.connect_timeout(connect_timeout);
    if config.get_application_name().is_none() {
        config.application_name("outbox-relay");
    }
    let manager = PostgresConnectionManager::new(config, tls());
    Ok(bb8::Pool::builder()
        .max_size(size)
        .connection_timeout(connect_timeout)
        .test_on_check_out(false)
        .build_unchecked(manager))
}

/// A connection outside the pool, its driver task spawned; for sessions that
/// must not be shared (migrations' advisory lock, CLI commands).
pub async fn connect(url: &str) -> Result<tokio_postgres::Client, StoreError> {
    let config = parse_url(url)?;
    let (client, connection) = config.connect(tls()).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "database connection closed");
        }
    });
    Ok(client)
}
