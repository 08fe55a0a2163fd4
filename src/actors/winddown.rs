//! Winding a tenure down, one shard's (a handover) or every shard's (the
//! shutdown): stop claiming, let no new request start, wait until no request
//! of the shard can still reach the destination, write what was answered, and
//! give back the leases of what was never sent. Only then may the shard's
//! lease be given back: for an ordered key, a request of the old owner still
//! open while the new owner sends the key's next event could reach the
//! destination out of order.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::claimer::Claimers;
use super::inflight::InFlight;
use super::marker::MarkerPort;
use super::ownership::Ownership;
use crate::store::Fence;

#[derive(Clone)]
pub struct Winddown {
    pub claimers: Claimers,
    pub ownership: Arc<Ownership>,
    pub in_flight: Arc<InFlight>,
    pub marker: MarkerPort,
    /// How long after publishers stop starting requests every request has
    /// ended (answered or cut off by `http.request_timeout`) and its outcome
    /// is marked.
    pub requests_end_within: Duration,
}

/// What a wind-down left.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Wound {
    /// Rows still in flight when the wait ended.
    pub in_flight_at_deadline: usize,
    /// Of those, rows whose lease was given back for another claim to take now.
    pub released: u64,
}

impl Winddown {
    /// Hands one tenure over: afterwards nothing of it is in the air and the
    /// shard is no longer this replica's.
    pub async fn shard(&self, fence: Fence) -> Wound {
        self.claimers.stop(fence).await;
        self.ownership.stop_sending(Some(fence));
        let deadline = Instant::now() + self.requests_end_within;
        while self.in_flight.holds_any(fence) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let in_flight_at_deadline = self.in_flight.of(fence).len();
        // From here no publisher starts a row of this tenure. (If the shard
        // was lost meanwhile and taken again, the new tenure stays.)
        self.ownership.remove_if(fence);
        let released = self.flush_and_release(Some(fence)).await;
        Wound {
            in_flight_at_deadline,
            released,
        }
    }

    /// Winds every shard down for the shutdown, waiting `grace` or at least
    /// until every request has ended. The shards stay in [`Ownership`] for
    /// the coordinator to give back.
    pub async fn all(&self, grace: Duration) -> Wound {
        self.claimers.stop_all().await;
        self.ownership.stop_sending(None);
        let deadline = Instant::now() + grace.max(self.requests_end_within);
        while self.in_flight.count() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let in_flight_at_deadline = self.in_flight.len();
        let released = self.flush_and_release(None).await;
        Wound {
            in_flight_at_deadline,
            released,
        }
    }

    /// Writes what was answered, then gives back the leases of the rows of
    /// `fence` (every row: `None`) still unmarked, so another claim takes
    /// them at once.
    async fn flush_and_release(&self, fence: Option<Fence>) -> u64 {
        if !self.marker.flush().await {
            tracing::warn!("the marker did not confirm its flush; unmarked rows will be claimed again when their leases expire");
        }
        let rest = match fence {
            Some(fence) => self.in_flight.of(fence),
            None => self.in_flight.snapshot(),
        };
        if rest.is_empty() {
            return 0;
        }
        let n = rest.len();
        match self.marker.release(rest).await {
            Some(released) => released,
            None => {
                tracing::warn!(rows = n, "could not release the leases of undelivered rows; they are claimed again when the leases expire");
                0
            }
        }
    }
}
