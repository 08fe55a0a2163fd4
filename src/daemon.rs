//! The long-lived process: start the actor tree, serve the HTTP endpoints,
//! stop on SIGTERM or SIGINT.

use crate::config::Config;
use crate::db;

/// Runs until SIGTERM or SIGINT.
pub async fn run_until_signal(config: Config) -> anyhow::Result<()> {
    let client = db::connect(&config.database.url).await?;
    client.simple_query("SELECT 1").await?;
    tracing::info!(config = %serde_json::to_string(&config.redacted())?, "outbox-relay started");
    wait_for_signal().await?;
    tracing::info!("stopping");
    Ok(())
}

/// Resolves on the first SIGTERM or SIGINT.
pub async fn wait_for_signal() -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}
