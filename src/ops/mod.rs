//! Operations that only need the database: the health figures the relay
//! exports ([`stats`]), retention by batched deletes and the janitor
//! ([`prune`]), a partitioned outbox's upkeep ([`partitions`]), and the metric
//! names dashboards and alerts are written against ([`metric_names`]).

pub mod metric_names;
pub mod partitions;
pub mod prune;
pub mod shards;
pub mod stats;

pub use metric_names::METRIC_NAMES;
pub use prune::{prune, run_janitor, JanitorSummary, PruneOptions, PruneReport};
pub use stats::{snapshot, stats, Snapshot, Stats};
