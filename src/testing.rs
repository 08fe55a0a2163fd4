//! For the engine's unit tests: the test kit's fresh database with the
//! relay's schema (`TestDb::new()`) and the relay's pool on it
//! (`db.pool(n)`), with [`RelayTestDb`] in scope; routes from TOML.

use std::time::Duration;

pub(crate) use outbox_testkit::TestDb;
use outbox_testkit::TestkitError;

use crate::routes::RouteConfig;
use crate::store::{self, Fence, Pool, ShardId, Store, StoreError};

pub(crate) trait RelayTestDb: Sized {
    /// A fresh database, migrated.
    async fn new() -> Result<Self, TestkitError>;
    /// A pool of `size` connections to it.
    fn pool(&self, size: u32) -> Result<Pool, StoreError>;
    /// A store on it with one shard over every bucket, held by the test.
    async fn one_shard(&self) -> (Store, Fence);
}

impl RelayTestDb for TestDb {
    async fn new() -> Result<TestDb, TestkitError> {
        TestDb::with_setup(store::migrate::run).await
    }

    fn pool(&self, size: u32) -> Result<Pool, StoreError> {
        store::pool(&self.url, size, Duration::from_secs(5))
    }

    async fn one_shard(&self) -> (Store, Fence) {
        let store = Store::open(&self.url, 2, Duration::from_secs(5)).unwrap();
        store.reshard(1).await.unwrap();
        let fence = store
            .seize_shard(ShardId::new(0), "test", Duration::from_secs(600))
            .await
            .unwrap();
        (store, fence)
    }
}

/// The `[[routes]]` of `toml`.
pub(crate) fn routes(toml: &str) -> Vec<RouteConfig> {
    figment::Figment::from(<figment::providers::Toml as figment::providers::Format>::string(toml))
        .extract_inner("routes")
        .unwrap()
}
