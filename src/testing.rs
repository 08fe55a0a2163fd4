//! For the engine's unit tests: the test kit's fresh database with the
//! relay's schema (`TestDb::new()`) and the relay's pool on it
//! (`db.pool(n)`), with [`RelayTestDb`] in scope.

use std::time::Duration;

pub(crate) use outbox_testkit::TestDb;
use outbox_testkit::TestkitError;

use crate::store::{self, Pool, StoreError};

pub(crate) trait RelayTestDb: Sized {
    /// A fresh database, migrated.
    async fn new() -> Result<Self, TestkitError>;
    /// A pool of `size` connections to it.
    fn pool(&self, size: u32) -> Result<Pool, StoreError>;
}

impl RelayTestDb for TestDb {
    async fn new() -> Result<TestDb, TestkitError> {
        TestDb::with_setup(store::migrate::run).await
    }

    fn pool(&self, size: u32) -> Result<Pool, StoreError> {
        store::pool(&self.url, size, Duration::from_secs(5))
    }
}
