//! When an idle claimer claims again: its poll, backing off while claims
//! find nothing, and never later than a row the marker wrote comes due.
//!
//! A claim that finds nothing is not free: with 20,000 keys held for their
//! delivery callbacks, an ordered claim walks every key of its shard to find
//! that none can go, so with thousands of keys held eight claimers polling
//! every second cost the database CPU for nothing. What can
//! make such a claim find something is known to the relay: new rows (the
//! listener wakes the claimers), a key moving on (the marker's flush and the
//! delivery callbacks, whichever replica takes them, wake them too: the
//! callbacks through the id sequence the listeners watch), and rows coming
//! due by time — retries, deferrals of a paused route, holds that run out —
//! whose times the marker writes and tells the shard's claimer
//! ([`PollSchedule::due_at`]). So after each claim that finds nothing the
//! poll waits twice as long, from `relay.poll_interval` up to
//! `relay.idle_poll_max`, and a claim that finds rows, a wake-up, or a due
//! time brings it back. What only the poll finds (rows due by a time an
//! earlier process wrote, rows inserted with explicit ids that do not move
//! the sequence) waits at most `relay.idle_poll_max`.

use std::time::{Duration, Instant};

/// One claimer's poll.
#[derive(Debug, Clone)]
pub(crate) struct PollSchedule {
    interval: Duration,
    max: Duration,
    /// Claims in a row that found nothing without a wake-up before them.
    empty: u32,
    /// The earliest time a row of the shard comes due, as the marker wrote
    /// it, if that is still ahead of the last claim.
    due: Option<Instant>,
}

impl PollSchedule {
    /// `interval`: `relay.poll_interval`; `max`: `relay.idle_poll_max` (not
    /// below `interval`).
    pub(crate) fn new(interval: Duration, max: Duration) -> PollSchedule {
        PollSchedule {
            interval,
            max: max.max(interval),
            empty: 0,
            due: None,
        }
    }

    /// A claim started at `at` and took `got` rows; `woken`: something
    /// said rows may be ready (the claim was not the poll's).
    pub(crate) fn claimed(&mut self, at: Instant, got: usize, woken: bool) {
        if got > 0 || woken {
            self.empty = 0;
        } else {
            self.empty = self.empty.saturating_add(1);
        }
        // What came due by then, this claim read.
        if self.due.is_some_and(|due| due <= at) {
            self.due = None;
        }
    }

    /// A row of the shard comes due at `at`. True when that is sooner than
    /// anything known before (the caller then polls no later than `at`).
    pub(crate) fn due_at(&mut self, at: Instant) -> bool {
        if self.due.is_some_and(|due| due <= at) {
            return false;
        }
        self.due = Some(at);
        true
    }

    /// How long after `now` the next poll is: the interval doubled for each
    /// empty claim but the first, up to the ceiling, and no later than the
    /// next due time.
    pub(crate) fn wait(&self, now: Instant) -> Duration {
        let doublings = self.empty.saturating_sub(1).min(16);
        let backed_off = self
            .interval
            .checked_mul(1 << doublings)
            .map_or(self.max, |d| d.min(self.max));
        match self.due {
            Some(due) => backed_off.min(due.saturating_duration_since(now)),
            None => backed_off,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn empty_claims_double_the_poll_up_to_the_ceiling_and_rows_bring_it_back() {
        let t0 = Instant::now();
        let mut p = PollSchedule::new(S, 8 * S);
        assert_eq!(p.wait(t0), S);
        let mut waits = Vec::new();
        for _ in 0..6 {
            p.claimed(t0, 0, false);
            waits.push(p.wait(t0).as_secs());
        }
        assert_eq!(waits, [1, 2, 4, 8, 8, 8]);
        p.claimed(t0, 3, false);
        assert_eq!(p.wait(t0), S);
        p.claimed(t0, 0, false);
        p.claimed(t0, 0, false);
        assert_eq!(p.wait(t0), 2 * S);
        // A wake-up's claim that finds nothing starts the backoff over.
        p.claimed(t0, 0, true);
        assert_eq!(p.wait(t0), S);
    }

    #[test]
    fn a_due_time_comes_before_the_backed_off_poll_until_a_claim_reads_it() {
        let t0 = Instant::now();
        let mut p = PollSchedule::new(S, 60 * S);
        for _ in 0..8 {
            p.claimed(t0, 0, false);
        }
        assert_eq!(p.wait(t0), 60 * S);
        assert!(p.due_at(t0 + 3 * S));
        assert!(!p.due_at(t0 + 5 * S), "a later due time changes nothing");
        assert_eq!(p.wait(t0), 3 * S);
        assert!(p.due_at(t0 + 2 * S));
        assert_eq!(p.wait(t0 + S), S);
        // Past due: poll at once.
        assert_eq!(p.wait(t0 + 4 * S), Duration::ZERO);
        // A claim before the due time leaves it; one at or after it clears it.
        p.claimed(t0 + S, 0, false);
        assert_eq!(p.wait(t0 + S), S);
        p.claimed(t0 + 2 * S, 0, false);
        assert_eq!(p.wait(t0 + 2 * S), 60 * S);
    }

    #[test]
    fn a_ceiling_below_the_interval_is_the_interval() {
        let t0 = Instant::now();
        let mut p = PollSchedule::new(2 * S, S);
        for _ in 0..4 {
            p.claimed(t0, 0, false);
        }
        assert_eq!(p.wait(t0), 2 * S);
    }
}
