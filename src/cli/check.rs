//! `check-config --connect`: what `run` checks at start, on the database
//! itself, without starting anything.

use crate::config::{Config, ConfigError};
use crate::store::Store;

fn on_url(reason: impl std::fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        key: "database.url".into(),
        reason: reason.to_string(),
    }
}

/// Connects as `run` would, checks the schema and the shard layout as it
/// does at start, and that the role has every privilege the relay needs.
/// Says what it found.
pub async fn connect(config: &Config) -> anyhow::Result<String> {
    let db = &config.database;
    let store = Store::open(&db.url, 2, db.connect_timeout).map_err(on_url)?;
    store.connect_now().await.map_err(on_url)?;
    let (role, missing) = store.missing_relay_privileges().await.map_err(on_url)?;
    if !missing.is_empty() {
        return Err(on_url(format!(
            "role `{role}` lacks what the relay needs: {}; `outbox-relay migrate --print-grants --app-role APP --relay-role {role}` prints the GRANTs (docs/roles.md)",
            missing.join(", ")
        ))
        .into());
    }
    crate::relay::check_schema(&store, config).await?;
    let shards = store.shard_count().await.map_err(on_url)?;
    Ok(format!(
        "database: connected as `{role}`; the schema is this relay's, the outbox has {shards} shards, and the role has every privilege the relay needs"
    ))
}
