//! Winding a tenure down, one shard's (a handover) or every shard's (the
//! shutdown): stop claiming, let no new request start, wait until no request
//! of the shard can still reach the destination, and write what was
//! answered. Rows never sent need nothing: a claim wrote nothing on them, so
//! the next owner reads them again. Only then may the shard's lease be given
//! back: for an ordered key, a request of the old owner still open while the
//! new owner sends the key's next event could reach the destination out of
//! order.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::claimer::Claimers;
use super::inflight::InFlight;
use super::marker::MarkerPort;
use super::ownership::Ownership;
use crate::store::Fence;

#[derive(Clone)]
pub(crate) struct Winddown {
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
pub(crate) struct Wound {
    /// Rows still out when the wait ended (their outcome unwritten: the next
    /// owner reads them again).
    pub in_flight_at_deadline: usize,
}

impl Winddown {
    /// Hands one tenure over: afterwards nothing of it is in the air and the
    /// shard is no longer this replica's.
    pub(crate) async fn shard(&self, fence: Fence) -> Wound {
        self.claimers.stop(fence).await;
        self.ownership.stop_sending(Some(fence));
        let deadline = Instant::now() + self.requests_end_within;
        while self.in_flight.holds_any(fence) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // From here no publisher starts a row of this tenure. (If the shard
        // was lost meanwhile and taken again, the new tenure stays.)
        self.ownership.remove_if(fence);
        self.flush().await;
        Wound {
            in_flight_at_deadline: self.in_flight.count_of(fence),
        }
    }

    /// Winds every shard down for the shutdown, waiting `grace` or at least
    /// until every request has ended. The shards stay in [`Ownership`] for
    /// the coordinator to give back.
    pub(crate) async fn all(&self, grace: Duration) -> Wound {
        self.claimers.stop_all().await;
        self.ownership.stop_sending(None);
        let deadline = Instant::now() + grace.max(self.requests_end_within);
        while self.in_flight.count() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.flush().await;
        Wound {
            in_flight_at_deadline: self.in_flight.len(),
        }
    }

    /// Writes what was answered.
    async fn flush(&self) {
        if !self.marker.flush().await {
            tracing::warn!("the marker did not confirm its flush; rows whose outcome it held are read again by the next claim");
        }
    }
}
