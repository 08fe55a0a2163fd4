//! Listener: finds new outbox rows without costing the producers anything.
//!
//! The outbox used to NOTIFY on insert, but PostgreSQL serialises the commits
//! of every transaction that notified (a database-wide lock held through the
//! commit's WAL flush), so each producer transaction waited for the previous
//! one. Instead, a dedicated connection probes the outbox's id sequence, a
//! one-page read that takes no lock a producer waits for, every millisecond
//! while rows are arriving and backing off, doubling, to `relay.idle_probe_max`
//! when they are not (an idle relay then costs the database about one probe
//! a second, and the first row after a quiet spell waits up to that long).
//!
//! The sequence moves when a producer inserts, before it commits. So a change
//! wakes the claimers at once (most inserts commit within that millisecond),
//! and again when every transaction that was running at the change has ended
//! (the snapshot's xmin passed them) or, with long-running transactions
//! elsewhere holding xmin back, at growing intervals for up to a second. The
//! claimers' own poll (`relay.poll_interval`) still guarantees liveness, e.g.
//! for rows inserted with explicit ids that do not move the sequence. On any
//! error, or a probe unanswered for as long as a claim may take, the listener
//! reconnects with backoff and wakes the claimers once to catch up.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::Wake;
use crate::store::probe::{Probe, Reading};
use crate::store::{reconnect_delay, Liveness, StoreError, Unanswered};

/// Probe interval while rows are arriving; the shortest `relay.idle_probe_max`.
pub(crate) const PROBE_BUSY: Duration = Duration::from_millis(1);
/// How long the listener waits for the transactions that were running when
/// the sequence moved, waking the claimers at growing intervals meanwhile.
const SETTLE_FOR: Duration = Duration::from_secs(1);
const FIRST_SETTLE_WAKE: Duration = Duration::from_millis(4);

#[derive(Clone)]
pub(crate) struct ListenerArgs {
    /// The database, for a connection of its own.
    pub url: String,
    pub connect_timeout: Duration,
    /// The longest probe interval while nothing moves (`relay.idle_probe_max`).
    pub idle_probe_max: Duration,
    pub liveness: Liveness,
    /// A probe unanswered for this long: the connection is given up.
    pub probe_timeout: Duration,
    /// Wakes the claimers.
    pub wake: Wake,
    /// Where an unanswered probe is noted: the actors' sessions then take
    /// fresh connections too (the same network lost theirs, most likely).
    pub unanswered: Unanswered,
}

pub(crate) struct Listener;

pub(crate) struct ListenerState {
    task: JoinHandle<()>,
}

impl Actor for Listener {
    type Msg = ();
    type State = ListenerState;
    type Arguments = ListenerArgs;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        args: ListenerArgs,
    ) -> Result<ListenerState, ActorProcessingErr> {
        Ok(ListenerState {
            task: tokio::spawn(listen_forever(args)),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<()>,
        state: &mut ListenerState,
    ) -> Result<(), ActorProcessingErr> {
        state.task.abort();
        Ok(())
    }
}

async fn listen_forever(args: ListenerArgs) {
    let mut failures = 0u32;
    loop {
        if let Err(e) = listen_once(&args, &mut failures).await {
            tracing::warn!(error = %e, "outbox probe connection failed; reconnecting");
        }
        failures += 1;
        tokio::time::sleep(reconnect_delay(failures)).await;
    }
}

/// When to wake the claimers and how long to sleep, from successive readings.
#[derive(Debug)]
pub(crate) struct Schedule {
    last: Option<Option<i64>>,
    /// The sequence moved at the previous probe: take the horizon now (the
    /// inserting transaction surely has its id by then).
    arm: bool,
    /// Wait for transactions below this id to end.
    settle: Option<Settle>,
    interval: Duration,
    /// The ceiling of the idle backoff.
    idle_max: Duration,
}

#[derive(Debug)]
struct Settle {
    horizon: i64,
    since: Instant,
    next_wake: Instant,
    step: Duration,
}

impl Schedule {
    /// Probing every millisecond at first, backing off to `idle_max` while
    /// nothing moves.
    pub(crate) fn new(idle_max: Duration) -> Schedule {
        Schedule {
            last: None,
            arm: false,
            settle: None,
            interval: PROBE_BUSY,
            idle_max: idle_max.max(PROBE_BUSY),
        }
    }

    /// Takes a reading; returns whether to wake the claimers and when to probe next.
    pub(crate) fn observe(&mut self, r: Reading, now: Instant) -> (bool, Duration) {
        let moved = self.last.is_some_and(|last| last != r.position);
        self.last = Some(r.position);
        let mut wake = moved;
        if self.arm {
            self.arm = false;
            self.settle = Some(Settle {
                horizon: r.xmax,
                since: now,
                next_wake: now + FIRST_SETTLE_WAKE,
                step: FIRST_SETTLE_WAKE,
            });
        }
        if moved {
            self.arm = true;
        }
        if let Some(s) = &mut self.settle {
            if r.xmin >= s.horizon {
                // Every transaction that was running at the change has ended.
                wake = true;
                self.settle = None;
            } else if now >= s.next_wake {
                wake = true;
                s.step *= 4;
                s.next_wake = now + s.step;
                if now.duration_since(s.since) >= SETTLE_FOR {
                    self.settle = None;
                }
            }
        }
        self.interval = if moved || self.arm || self.settle.is_some() {
            PROBE_BUSY
        } else {
            (self.interval * 2).min(self.idle_max)
        };
        (wake, self.interval)
    }
}

async fn listen_once(args: &ListenerArgs, failures: &mut u32) -> Result<(), StoreError> {
    let probe = Probe::connect(&args.url, args.connect_timeout, &args.liveness).await?;
    *failures = 0;
    tracing::debug!("probing for new outbox rows");
    // Rows may have arrived while we were away.
    (args.wake)();
    let mut schedule = Schedule::new(args.idle_probe_max);
    loop {
        let reading = tokio::time::timeout(args.probe_timeout, probe.read())
            .await
            .map_err(|_| {
                args.unanswered.note();
                StoreError::Unanswered(args.probe_timeout)
            })??;
        let (wake, next) = schedule.observe(reading, Instant::now());
        if wake {
            (args.wake)();
        }
        tokio::time::sleep(next).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(position: i64, xmin: i64, xmax: i64) -> Reading {
        Reading {
            position: Some(position),
            xmin,
            xmax,
        }
    }

    #[test]
    fn a_moving_sequence_wakes_at_once_and_again_when_its_writers_end() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut s = Schedule::new(ms(10));
        assert!(!s.observe(at(10, 100, 100), t0).0);
        // Idle: the interval grows to the ceiling.
        let mut interval = PROBE_BUSY;
        for i in 1..10 {
            interval = s.observe(at(10, 100, 100), t0 + ms(i)).1;
        }
        assert_eq!(interval, ms(10));
        // An insert moves the sequence: wake, probe fast.
        assert_eq!(s.observe(at(11, 100, 101), t0 + ms(20)), (true, PROBE_BUSY));
        // Its transaction (100) still runs: the horizon is taken (102), no wake yet.
        assert_eq!(
            s.observe(at(11, 100, 102), t0 + ms(21)),
            (false, PROBE_BUSY)
        );
        // It committed (xmin passed 102): wake once more.
        assert!(s.observe(at(11, 102, 102), t0 + ms(22)).0);
        // Then quiet again.
        let (wake, next) = s.observe(at(11, 102, 102), t0 + ms(23));
        assert!(!wake);
        assert!(next > PROBE_BUSY);
    }

    #[test]
    fn a_long_transaction_elsewhere_gets_growing_wakes_for_a_second() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut s = Schedule::new(ms(10));
        s.observe(at(1, 5, 50), t0);
        assert!(s.observe(at(2, 5, 50), t0).0);
        s.observe(at(2, 5, 51), t0 + ms(1)); // horizon 51; xmin stays at 5
        let wakes: Vec<u64> = (2..2000)
            .filter(|&i| s.observe(at(2, 5, 51), t0 + ms(i)).0)
            .collect();
        assert_eq!(wakes, vec![5, 21, 85, 341, 1365]);
        // Given up: back to idle probing, no more wakes.
        assert_eq!(s.observe(at(2, 5, 51), t0 + ms(2001)), (false, ms(10)));
    }

    /// Nothing moving, the interval doubles from 1 ms to the ceiling and
    /// stays there; the first probe that sees the sequence move wakes the
    /// claimers and goes back to 1 ms, and the backoff starts again from there.
    #[test]
    fn an_idle_probe_backs_off_to_its_ceiling_and_returns_to_one_millisecond_when_rows_flow() {
        let ms = Duration::from_millis;
        let mut t = Instant::now();
        let mut s = Schedule::new(Duration::from_secs(1));
        let idle = |s: &mut Schedule, t: &mut Instant, position| {
            let (wake, next) = s.observe(at(position, 7, 7), *t);
            *t += next;
            (wake, next)
        };
        idle(&mut s, &mut t, 1);
        let backoff: Vec<u64> = (0..12)
            .map(|_| idle(&mut s, &mut t, 1).1.as_millis() as u64)
            .collect();
        assert_eq!(
            backoff,
            [4, 8, 16, 32, 64, 128, 256, 512, 1000, 1000, 1000, 1000]
        );
        // A row: wake at once, probe every millisecond while it settles.
        assert_eq!(idle(&mut s, &mut t, 2), (true, PROBE_BUSY));
        // Its transaction had ended by the next probe (xmin at the horizon):
        // a second wake, and the backoff begins afresh.
        assert_eq!(idle(&mut s, &mut t, 2), (true, ms(2)));
        assert_eq!(idle(&mut s, &mut t, 2), (false, ms(4)));
        // Rows keep arriving: every probe that sees one is 1 ms after it.
        for position in 3..6 {
            assert_eq!(idle(&mut s, &mut t, position), (true, PROBE_BUSY));
        }
        // A ceiling below the busy interval is the busy interval.
        let mut s = Schedule::new(Duration::ZERO);
        s.observe(at(1, 7, 7), t);
        assert_eq!(s.observe(at(1, 7, 7), t).1, PROBE_BUSY);
    }
}
