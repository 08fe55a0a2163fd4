//! The shards this replica holds: shard → its tenure (fencing token) and when
//! its lease ends as this process sees it (measured before the statement that
//! took or renewed it, so never later than the database's). Publishers check
//! it before sending: a replica paused past its lease drops what it held.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::store::{Fence, ShardId};

#[derive(Debug, Default)]
pub(crate) struct Ownership {
    shards: Mutex<HashMap<ShardId, Tenure>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tenure {
    pub token: i64,
    pub until: Instant,
    /// False once the shard is on its way out (handover, shutdown): the lease
    /// is still renewed, but no publisher starts a request for its rows.
    pub sending: bool,
}

impl Tenure {
    pub(crate) fn new(token: i64, until: Instant) -> Tenure {
        Tenure {
            token,
            until,
            sending: true,
        }
    }
}

impl Ownership {
    /// May a request for a row claimed under `fence` start now: is it still
    /// this replica's tenure, not over, and not on its way out?
    pub(crate) fn holds(&self, fence: Fence) -> bool {
        self.lock()
            .get(&fence.shard)
            .is_some_and(|t| t.token == fence.token && t.sending && t.until > Instant::now())
    }

    pub(crate) fn set(&self, shard: ShardId, tenure: Tenure) {
        self.lock().insert(shard, tenure);
    }

    /// Extends the tenure under `fence` (keeping whether it still sends).
    pub(crate) fn renew(&self, fence: Fence, until: Instant) {
        if let Some(t) = self
            .lock()
            .get_mut(&fence.shard)
            .filter(|t| t.token == fence.token)
        {
            t.until = until;
        }
    }

    /// No request starts for the tenure's rows from now on (it is being
    /// handed over); `None` stops every shard (shutdown).
    pub(crate) fn stop_sending(&self, fence: Option<Fence>) {
        for (s, t) in self.lock().iter_mut() {
            if fence.is_none_or(|f| f.shard == *s && f.token == t.token) {
                t.sending = false;
            }
        }
    }

    /// Removes the tenure if it is still the one under `fence`.
    pub(crate) fn remove_if(&self, fence: Fence) {
        let mut shards = self.lock();
        if shards
            .get(&fence.shard)
            .is_some_and(|t| t.token == fence.token)
        {
            shards.remove(&fence.shard);
        }
    }

    pub(crate) fn get(&self, shard: ShardId) -> Option<Tenure> {
        self.lock().get(&shard).copied()
    }

    /// Tenures held, by shard.
    pub(crate) fn fences(&self) -> Vec<Fence> {
        let mut v: Vec<Fence> = self
            .lock()
            .iter()
            .map(|(s, t)| Fence {
                shard: *s,
                token: t.token,
            })
            .collect();
        v.sort_unstable_by_key(|f| f.shard);
        v
    }

    /// Shards held, in order.
    pub(crate) fn shards(&self) -> Vec<ShardId> {
        self.fences().into_iter().map(|f| f.shard).collect()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }

    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ShardId, Tenure>> {
        self.shards.lock().expect("ownership lock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn fence(shard: u32, token: i64) -> Fence {
        Fence {
            shard: ShardId::new(shard),
            token,
        }
    }

    #[test]
    fn a_tenure_is_held_under_its_token_until_it_ends() {
        let ownership = Ownership::default();
        let later = Instant::now() + Duration::from_secs(60);
        let s3 = ShardId::new(3);
        ownership.set(s3, Tenure::new(7, later));
        assert!(ownership.holds(fence(3, 7)));
        assert!(!ownership.holds(fence(3, 6)), "an older token");
        assert!(!ownership.holds(fence(4, 7)), "another shard");
        ownership.set(
            s3,
            Tenure::new(7, Instant::now() - Duration::from_millis(1)),
        );
        assert!(!ownership.holds(fence(3, 7)), "the lease ended");
        ownership.set(s3, Tenure::new(7, later));
        ownership.stop_sending(Some(fence(3, 7)));
        assert!(!ownership.holds(fence(3, 7)), "on its way out");
        ownership.renew(fence(3, 7), later + Duration::from_secs(1));
        assert!(!ownership.holds(fence(3, 7)), "a renewal does not undo it");
        assert_eq!(
            ownership.get(s3).unwrap().until,
            later + Duration::from_secs(1)
        );
    }

    #[test]
    fn removing_an_old_tenure_leaves_a_newer_one() {
        let ownership = Ownership::default();
        let later = Instant::now() + Duration::from_secs(60);
        ownership.set(ShardId::new(3), Tenure::new(9, later));
        ownership.remove_if(fence(3, 7));
        assert!(ownership.holds(fence(3, 9)));
        ownership.remove_if(fence(3, 9));
        assert!(ownership.is_empty());
    }
}
