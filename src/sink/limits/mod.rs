//! Limits per destination for webhook routes: a route's `rate` (requests per
//! `period`, one second unless set) and `concurrency` (requests in flight),
//! and the same per destination host shared by every route that sends there
//! (`[[http.hosts]]`, [`hosts`]). A `429` from a destination (with or without
//! `Retry-After`) makes its host wait, entry or not (a host without one: that
//! host and port): every route sending there waits, no other host does.
//! (QStash routes send `rate`/`period`/`parallelism` to QStash as flow
//! control instead; the relay does not pace them.)
//!
//! A publisher serves every route, so it must never sit behind one route's
//! limiter. Before a delivery each row is admitted or not, at once:
//! - a row whose rate slot comes within [`MAX_WAIT`] takes that slot and is
//!   sent when it comes (the publisher waits at most that long: a short,
//!   bounded wait keeps a steady stream flowing without a database round
//!   trip per row);
//! - a row that finds every request slot taken queues for one in its
//!   request's own task (the publisher's other rows go on), as long as the
//!   queue is short enough to be served within about [`MAX_WAIT`] at the
//!   requests' recent pace (and never less than one slot's worth): a full
//!   limiter is then a queue, not a database round trip per row. A queued
//!   row whose slot has not freed by the time its lease would no longer
//!   outlast the request is not sent: it comes back as a timed-out attempt
//!   (its destination held every slot for a whole request's time);
//! - a row that cannot go by then (its slot is later, the slot queue is
//!   full, or its host asked us to wait) is deferred without spending an
//!   attempt, like a paused route's rows. Its delay is the next slot
//!   promised to a deferred row of that limiter, and each deferral moves the
//!   promise one interval on, so a backlog comes back spread over its future
//!   slots rather than all at the next claim (which would only defer it again
//!   and churn the database).
//!
//! Sends are paced strictly (one per `period / rate`, no burst), so any
//! window of one period holds at most `rate + 1` of them (a process held up
//! past several slots sends those rows when it runs again: the `k`-th
//! request never goes before its slot, but a few may go together then). An ordered route
//! claims one row per key at a time, so deferring a key's head defers the
//! key: its order holds.

mod hosts;

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{Outcome, RetryReason};
use crate::routes::{Route, SinkKind};
pub(crate) use hosts::validate_hosts;
pub use hosts::HostLimit;
use hosts::HostPort;
use outbox_client::row::OutboxRow;

/// The longest a publisher waits for a row's rate slot; a later slot defers the row.
pub(crate) const MAX_WAIT: Duration = Duration::from_millis(250);
/// How long a host that answered `429` without `Retry-After` is left alone.
pub(crate) const RATE_LIMITED_WAIT: Duration = Duration::from_secs(1);
/// The period of a webhook route or host with `rate` and no `period`.
pub const DEFAULT_PERIOD: Duration = Duration::from_secs(1);

/// A row's leave to go: when, the request slots it holds until its answer
/// is in (dropping the ticket frees them), and those it still queues for.
#[derive(Debug)]
pub(crate) struct Ticket {
    pub at: Instant,
    permits: Vec<(OwnedSemaphorePermit, Arc<Slots>)>,
    queued: Vec<Queued>,
    /// The last moment a queued row may still be sent (its lease outlasts
    /// the request); set by the publisher.
    pub by: Option<Instant>,
    /// When its request went, once it has all its slots.
    sent: Option<Instant>,
}

impl Ticket {
    pub(crate) fn now() -> Ticket {
        Ticket::at(Instant::now())
    }

    /// Leave to go at `at`, holding and queuing for no request slot.
    fn at(at: Instant) -> Ticket {
        Ticket {
            at,
            permits: Vec::new(),
            queued: Vec::new(),
            by: None,
            sent: None,
        }
    }

    /// Whether it still waits for a request slot.
    #[cfg(test)]
    pub(crate) fn queued(&self) -> bool {
        !self.queued.is_empty()
    }

    /// Takes the slots it queues for, in the limiters' order; the error
    /// names the limiter whose slot did not free by [`Ticket::by`].
    pub(crate) async fn ready(&mut self) -> Result<(), String> {
        for q in std::mem::take(&mut self.queued) {
            let acquire = Arc::clone(&q.slots.semaphore).acquire_owned();
            let permit = match self.by {
                Some(by) => tokio::time::timeout_at(by.into(), acquire)
                    .await
                    .map_err(|_| {
                        format!(
                            "{} had all {} request slots taken (concurrency) until this row's lease no longer outlasted a request: not sent",
                            q.name, q.slots.max
                        )
                    })?,
                None => acquire.await,
            }
            .expect("limiter semaphores are never closed");
            self.permits.push((permit, Arc::clone(&q.slots)));
        }
        if !self.permits.is_empty() {
            self.sent = Some(Instant::now());
        }
        Ok(())
    }
}

impl Drop for Ticket {
    /// A request that went tells its limiters how long requests take.
    fn drop(&mut self) {
        if let Some(sent) = self.sent {
            let took = sent.elapsed();
            for (_, slots) in &self.permits {
                slots.took(took);
            }
        }
    }
}

/// A limiter's request slots (`concurrency`).
#[derive(Debug)]
struct Slots {
    max: u32,
    semaphore: Arc<Semaphore>,
    /// Rows queued for a slot now.
    waiting: AtomicUsize,
    /// How long one request took lately, µs (a moving average).
    request_us: AtomicU64,
}

impl Slots {
    fn new(max: u32) -> Slots {
        Slots {
            max,
            semaphore: Arc::new(Semaphore::new(max as usize)),
            waiting: AtomicUsize::new(0),
            // A guess until the first answers are in.
            request_us: AtomicU64::new(10_000),
        }
    }

    /// How many rows may queue: as many as the slots serve within
    /// [`MAX_WAIT`] at the recent pace, and never fewer than the slots.
    fn queue_room(&self) -> usize {
        let per_request = self.request_us.load(Ordering::Relaxed).max(1);
        let rounds = (MAX_WAIT.as_micros() as u64 / per_request).max(1);
        (self.max as u64).saturating_mul(rounds) as usize
    }

    /// How long one request took lately.
    fn request_time(&self) -> Duration {
        Duration::from_micros(self.request_us.load(Ordering::Relaxed))
    }

    /// About how long the rows queued now take to get their slots, and one
    /// request more.
    fn drain_time(&self) -> Duration {
        let rounds = self.waiting.load(Ordering::Relaxed) as u32 / self.max + 1;
        self.request_time() * rounds
    }

    fn took(&self, took: Duration) {
        let us = took.as_micros().min(u64::MAX as u128) as u64;
        // Racing updates may lose one sample; the estimate stays close.
        let old = self.request_us.load(Ordering::Relaxed);
        self.request_us.store((old * 3 + us) / 4, Ordering::Relaxed);
    }
}

/// A row's place in a limiter's slot queue (it leaves the queue when it is
/// dropped, with its slot or without).
#[derive(Debug)]
struct Queued {
    name: String,
    slots: Arc<Slots>,
}

impl Queued {
    fn join(name: &str, slots: &Arc<Slots>) -> Queued {
        slots.waiting.fetch_add(1, Ordering::Relaxed);
        Queued {
            name: name.to_owned(),
            slots: Arc::clone(slots),
        }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.slots.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Whether a row may be sent now.
#[derive(Debug)]
pub(crate) enum Admission {
    /// Send it at the ticket's time (now, or within [`MAX_WAIT`]).
    Go(Ticket),
    /// Not now: defer it this long, without spending an attempt.
    Wait { delay: Duration, error: String },
}

#[derive(Debug)]
struct Pace {
    /// The earliest time the next request may go.
    next: Instant,
    /// The next time promised to a deferred row.
    promised: Instant,
    /// The destination asked us to wait until then (a `429`).
    blocked: Option<Instant>,
}

#[derive(Debug)]
struct Limiter {
    /// `route "x"` or `host "h"`, for the deferred rows' `last_error`.
    name: String,
    interval: Option<Duration>,
    slots: Option<Arc<Slots>>,
    pace: Mutex<Pace>,
}

impl Limiter {
    fn new(
        name: String,
        rate: Option<NonZeroU32>,
        period: Option<Duration>,
        concurrency: Option<NonZeroU32>,
    ) -> Limiter {
        let now = Instant::now();
        Limiter {
            name,
            interval: rate.map(|r| period.unwrap_or(DEFAULT_PERIOD) / r.get()),
            slots: concurrency.map(|c| Arc::new(Slots::new(c.get()))),
            pace: Mutex::new(Pace {
                next: now,
                promised: now,
                blocked: None,
            }),
        }
    }

    /// A deferred row's delay: the next promised time (at least `earliest`),
    /// moving the promise on by `step`.
    fn promise(
        &self,
        pace: &mut Pace,
        now: Instant,
        earliest: Instant,
        step: Duration,
    ) -> Duration {
        let at = pace.promised.max(earliest).max(now);
        pace.promised = at + step;
        at - now
    }

    fn pace(&self) -> std::sync::MutexGuard<'_, Pace> {
        self.pace.lock().expect("pace lock")
    }

    /// Whether the destination asked to wait past `now`.
    fn blocked_after(&self, now: Instant) -> bool {
        self.pace().blocked.is_some_and(|b| b > now)
    }

    /// Nothing goes before `until` (a `429`); a longer wait asked before
    /// stands. Whether the wait grew.
    fn block(&self, until: Instant) -> bool {
        let mut pace = self.pace();
        let longer = pace.blocked.is_none_or(|b| b < until);
        if longer {
            pace.blocked = Some(until);
        }
        longer
    }
}

/// The limiters of every webhook route and destination host.
#[derive(Debug, Default)]
pub(crate) struct Limits {
    /// By route index; `None` for a route without limits (and QStash routes).
    routes: Vec<Option<Limiter>>,
    /// `[[http.hosts]]`.
    configured: Vec<(HostPort, Arc<Limiter>)>,
    /// Destinations without an entry that answered `429`, while they are
    /// waited for.
    blocked: Mutex<HashMap<HostPort, Arc<Limiter>>>,
}

impl Limits {
    pub(crate) fn new(routes: &[Route], hosts: &[HostLimit]) -> Limits {
        Limits {
            routes: routes
                .iter()
                .map(|r| {
                    let c = &r.config;
                    (c.sink == SinkKind::Webhook && (c.rate.is_some() || c.concurrency.is_some()))
                        .then(|| {
                            let rate = c.rate.and_then(NonZeroU32::new);
                            Limiter::new(
                                format!("route `{}`", r.name),
                                rate,
                                c.period,
                                c.concurrency,
                            )
                        })
                })
                .collect(),
            configured: hosts
                .iter()
                .filter_map(|h| {
                    // Validated; an entry that does not parse limits nothing.
                    let at = HostPort::parse(&h.host)?;
                    let name = format!("host `{at}`");
                    let limiter = Limiter::new(name, h.rate, h.period, h.concurrency);
                    Some((at, Arc::new(limiter)))
                })
                .collect(),
            blocked: Mutex::default(),
        }
    }

    /// The destination's `[[http.hosts]]` entry (one naming its port before
    /// one naming none), else the limiter a `429` of its own left.
    fn host(&self, to: &HostPort) -> Option<Arc<Limiter>> {
        let covering = |with_port: bool| {
            self.configured
                .iter()
                .find(|(at, _)| at.port.is_some() == with_port && at.covers(to))
        };
        if let Some((_, l)) = covering(true).or_else(|| covering(false)) {
            return Some(Arc::clone(l));
        }
        let mut blocked = self.blocked.lock().expect("limits lock");
        let now = Instant::now();
        blocked.retain(|_, l| l.blocked_after(now));
        blocked.get(to).cloned()
    }

    /// Whether no destination is waited for after a `429` of its own (and
    /// forgets those whose wait is over).
    fn nothing_blocked(&self, now: Instant) -> bool {
        let mut blocked = self.blocked.lock().expect("limits lock");
        blocked.retain(|_, l| l.blocked_after(now));
        blocked.is_empty()
    }

    /// Makes every request to `to` wait until `until` (it answered `429`);
    /// whether the wait grew.
    fn block(&self, to: &HostPort, until: Instant) -> bool {
        if let Some(l) = self.host(to) {
            return l.block(until);
        }
        // Created and blocked under the map's lock, so that no clean-up
        // drops it before it holds the block.
        let mut blocked = self.blocked.lock().expect("limits lock");
        blocked
            .entry(to.clone())
            .or_insert_with(|| Arc::new(Limiter::new(format!("host `{to}`"), None, None, None)))
            .block(until)
    }

    /// Whether each of `route`'s rows may go now (see the module doc).
    /// A row whose destination is not a URL goes (the sink dead-letters it).
    pub(crate) fn admit(&self, route: &Route, rows: &[OutboxRow], now: Instant) -> Vec<Admission> {
        if route.config.sink != SinkKind::Webhook {
            return rows.iter().map(|_| Admission::Go(Ticket::now())).collect();
        }
        let own = self.routes.get(route.index).and_then(Option::as_ref);
        if own.is_none() && self.configured.is_empty() && self.nothing_blocked(now) {
            // Nothing can limit these rows: no destination needs parsing.
            return rows.iter().map(|_| admit_one(&[], now)).collect();
        }
        rows.iter()
            .map(|row| {
                let host = HostPort::of(route, row).and_then(|to| self.host(&to));
                let limiters: Vec<&Limiter> = own.into_iter().chain(host.as_deref()).collect();
                admit_one(&limiters, now)
            })
            .collect()
    }

    /// Takes what a delivery found out: a `429` makes its destination wait
    /// (as long as it asked, else [`RATE_LIMITED_WAIT`]). How long requests
    /// take, which tells when request slots free, each ticket reports itself.
    pub(crate) fn record(&self, route: &Route, rows: &[OutboxRow], outcomes: &[Outcome]) {
        if route.config.sink != SinkKind::Webhook {
            return;
        }
        let now = Instant::now();
        let rate_limited = outcomes.iter().any(|o| {
            matches!(
                o,
                Outcome::Retry {
                    reason: RetryReason::RateLimited,
                    ..
                }
            )
        });
        if !rate_limited {
            return;
        }
        for (row, outcome) in rows.iter().zip(outcomes) {
            let Some(to) = HostPort::of(route, row) else {
                continue;
            };
            if let Outcome::Retry {
                reason: RetryReason::RateLimited,
                after,
                ..
            } = outcome
            {
                let wait = after.unwrap_or(RATE_LIMITED_WAIT);
                if self.block(&to, now + wait) {
                    tracing::info!(destination = %to, ?wait, "the destination answered 429: every route's requests to it wait");
                }
            }
        }
    }
}

/// Admits one row under every limiter it falls under (its route's, its host's).
fn admit_one(limiters: &[&Limiter], now: Instant) -> Admission {
    if limiters.is_empty() {
        return Admission::Go(Ticket::at(now));
    }
    // Always the route's before the host's: one lock order.
    let mut paces: Vec<_> = limiters
        .iter()
        .map(|l| l.pace.lock().expect("pace lock"))
        .collect();
    let step = |l: &Limiter| l.interval.unwrap_or(Duration::from_millis(10));
    for (l, pace) in limiters.iter().zip(paces.iter_mut()) {
        if let Some(until) = pace.blocked.filter(|b| *b > now) {
            let delay = l.promise(pace, now, until, step(l));
            return Admission::Wait {
                delay,
                error: format!(
                    "{} answered 429: waiting {} before sending (not an attempt)",
                    l.name,
                    humantime::format_duration(until - now)
                ),
            };
        }
    }
    let mut permits = Vec::new();
    let mut queued = Vec::new();
    for (l, pace) in limiters.iter().zip(paces.iter_mut()) {
        let Some(slots) = &l.slots else { continue };
        // Once a row queues, it queues for each later limiter's slot too:
        // every row takes its slots in one order.
        if queued.is_empty() {
            if let Ok(p) = Arc::clone(&slots.semaphore).try_acquire_owned() {
                permits.push((p, Arc::clone(slots)));
                continue;
            }
        }
        if slots.waiting.load(Ordering::Relaxed) < slots.queue_room() {
            queued.push(Queued::join(&l.name, slots));
            continue;
        }
        // Come back about when the queue has drained; each row deferred so
        // far waits one slot's share more.
        let max = slots.max;
        let step = (slots.request_time() / max).max(Duration::from_millis(5));
        let freed = now + slots.drain_time();
        let delay = l.promise(pace, now, freed, step);
        return Admission::Wait {
            delay,
            error: format!(
                "{} has {max} requests in flight and its queue for them is full (concurrency): deferred (not an attempt)",
                l.name
            ),
        };
    }
    let slot = paces.iter().map(|p| p.next.max(now)).max().unwrap_or(now);
    if slot > now + MAX_WAIT {
        // The limiter whose slot is furthest decides when to come back.
        let i = (0..limiters.len())
            .max_by_key(|&i| paces[i].next)
            .unwrap_or(0);
        let l = limiters[i];
        let delay = l.promise(&mut paces[i], now, slot, step(l));
        return Admission::Wait {
            delay,
            error: format!("{} is at its rate limit: deferred (not an attempt)", l.name),
        };
    }
    for (l, pace) in limiters.iter().zip(paces.iter_mut()) {
        if let Some(interval) = l.interval {
            pace.next = slot + interval;
        }
    }
    Admission::Go(Ticket {
        at: slot,
        permits,
        queued,
        by: None,
        sent: None,
    })
}

#[cfg(test)]
mod tests;
