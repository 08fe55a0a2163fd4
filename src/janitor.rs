//! The janitor: retention from inside the daemon. It prunes at start and then
//! every `janitor.interval` (`store::retention` does the batched deletes).

use std::future::Future;

use serde::Serialize;

use crate::config::JanitorConfig;
use crate::store::retention::{prune, PruneOptions, PruneReport};
use crate::store::{Store, StoreError};

impl From<&JanitorConfig> for PruneOptions {
    fn from(c: &JanitorConfig) -> Self {
        PruneOptions {
            published_older_than: c.retain_published,
            processed_older_than: Some(c.retain_processed),
            batch: c.batch,
        }
    }
}

/// What a janitor did over its life.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct JanitorSummary {
    /// Passes that completed.
    pub passes: u64,
    /// Passes that stopped on an error (logged; the next pass tries again).
    pub failed_passes: u64,
    pub outbox_deleted: u64,
    pub processed_deleted: u64,
}

/// Prunes at start and then every `config.interval` until `shutdown`
/// completes; returns at once when `config.enabled` is false. Errors are
/// logged and retried at the next interval, never fatal. A shutdown during a
/// pass stops it between or within batches: each batch is its own
/// transaction, so nothing is half done.
pub async fn run_janitor(
    store: Store,
    config: JanitorConfig,
    shutdown: impl Future<Output = ()>,
) -> JanitorSummary {
    run_janitor_observed(store, config, shutdown, |_| {}).await
}

/// [`run_janitor`], calling `on_pass` after each pass with its outcome
/// (tests, and a daemon that wants to count passes).
pub async fn run_janitor_observed(
    store: Store,
    config: JanitorConfig,
    shutdown: impl Future<Output = ()>,
    mut on_pass: impl FnMut(&Result<PruneReport, StoreError>),
) -> JanitorSummary {
    let mut summary = JanitorSummary::default();
    if !config.enabled {
        return summary;
    }
    let options = PruneOptions::from(&config);
    let mut ticker = tokio::time::interval(config.interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            _ = &mut shutdown => break,
            _ = ticker.tick() => {}
        }
        let outcome = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            outcome = janitor_pass(&store, &options) => outcome,
        };
        match &outcome {
            Ok(report) => {
                summary.passes += 1;
                summary.outbox_deleted += report.outbox.deleted;
                let processed = report.processed_messages.as_ref().map_or(0, |p| p.deleted);
                summary.processed_deleted += processed;
                if report.outbox.deleted > 0 || processed > 0 {
                    tracing::info!(
                        outbox_deleted = report.outbox.deleted,
                        processed_deleted = processed,
                        "janitor pruned old rows"
                    );
                }
            }
            Err(e) => {
                summary.failed_passes += 1;
                tracing::warn!(error = %e, "janitor pass failed; trying again next interval");
            }
        }
        on_pass(&outcome);
    }
    summary
}

async fn janitor_pass(store: &Store, options: &PruneOptions) -> Result<PruneReport, StoreError> {
    prune(&*store.conn().await?, options).await
}
