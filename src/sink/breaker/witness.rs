//! A final verdict needs a witness. A destination that refuses a message for
//! itself (a 4xx), or fails every attempt the relay allows it, may be failing
//! for everyone at that moment: a consumer being redeployed answers 404 to
//! every request, a wrong path 404s every message, a small route's
//! destination is down. The failure is the message's own only when it was
//! failing the way it fails now on both sides of the route's acceptances:
//! the route accepted a message *sent* after this one began failing so,
//! answered before a later request of this one was sent, which failed the
//! same way. That first window only moves the row on: a later verdict is
//! carried out once the route accepted again since (a second window), or
//! when the route is not failing now (no other event began failing since
//! the latest acceptance left: poison events refused together on a route
//! that accepted the rest and went quiet). Until then the verdict
//! (dead-lettered) waits: the row is deferred without spending an attempt and
//! sent again later, after a delay that doubles up to the breaker's longest
//! pause. One window of acceptances is not enough: a row caught by one
//! outage (every route refusing 404) and, minutes later, by a consumer's
//! two-second redeploy has acceptances between its two refusals, thousands of
//! them, and neither refusal was its own; in the redeploy fresh rows fail
//! too, so it waits for the acceptances after it.
//!
//! Both ends of a witness are timed so that it surely happened between two
//! failures of the row: an acceptance is dated by when its request left (a
//! request sent before a deploy blip began can be answered 200 after the
//! blip's first refusal came back, and proves nothing about the destination
//! since), and it must have been answered before the verdict's request left.
//! "The way it fails now" is the kind of failure (a retry's reason, a
//! verdict's reason and status): a row whose answer was unreadable a minute
//! ago, while the route accepted thousands, proves nothing by that about a
//! 404 now, so a new kind of failure starts the row's window again. An
//! acceptance in an answer that failed the row (a batch answer that takes
//! some messages and refuses others), or an error in the row's own slot of a
//! readable batch answer, witnesses its later verdicts of that kind: the
//! sink judged the messages one by one at that moment. Such a judgment is
//! kept through answers of other kinds between (a poison event's batch
//! rejections with a 500 or an unreadable answer between them are still
//! judged), and witnesses nothing of another kind (a blip's 404 later).
//!
//! One case has no witness to wait for: an event failing alone, while the
//! route sends nothing else (the last event of a burst, the head of the only
//! key of an ordered route, a poison event left over when the others failing
//! with it were dead-lettered). It is carried out when nothing else on the
//! route failed or was accepted for the breaker's longest pause, and it has
//! kept failing for as long: failing the same way all that time, or with a
//! final verdict already deferred that long ago. (The second form is what
//! carries out a poison event whose answers vary: a destination that
//! rejects it, with now and then a 500 or an unreadable answer between the
//! rejections, restarts the same-way clock at every change. It never
//! dead-letters a row on a blip's first refusals: the row must already have
//! reached its final verdict, which its blip-free failures decided, a
//! longest pause before.) Rows waiting for a witness come back at most half
//! that pause apart, so events failing together show within it. Two events
//! failing together are a route failing: they wait for a witness however
//! long it takes. A lone event is so carried out within one and a half
//! longest pauses (three quarters of a lease) of its first deferred verdict
//! or of the others' last failure, whichever is later: a route whose last
//! pending row is a poison event stalls for less than a lease.
//!
//! The memory of failing events is per route, in this process, and bounded:
//! an event it forgot (or never saw fail, as after a restart) counts as
//! failing first now, which only ever makes it wait longer.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::PAUSE_MIN;

/// Failing events remembered per route; past this the memory starts over.
pub(crate) const REMEMBERED: usize = 100_000;
/// Acceptances remembered per route to find witnesses in; forgetting the
/// oldest only ever makes a verdict wait longer.
const ACCEPTANCES: usize = 256;

/// What to do with an event's final verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The route accepted other messages between this one's failures (see
    /// the module doc), or it has failed alone for long: carry the verdict
    /// out.
    Carry,
    /// No witness yet: the route may be what fails. Send it again after
    /// `delay`, without counting an attempt.
    Defer { delay: Duration },
}

/// The kind of a failure (see the module doc), as [`super::failure_kind`] tells it.
pub(crate) type Kind = u64;

#[derive(Debug, Clone, Copy)]
struct Seen {
    /// When this process first saw the event fail.
    first: Instant,
    /// Verdicts deferred so far.
    deferrals: u32,
    /// The kind of its latest failure, and since when it fails so.
    kind: Kind,
    since: Instant,
    /// When an answer that failed it some way accepted another message of
    /// the same request, or judged it alone (the first such answer of that
    /// kind; a judgment of another kind since replaces it, an answer of
    /// another kind without one does not).
    beside: Option<(Kind, Instant)>,
    /// When its final verdict was first deferred (whatever the kind).
    deferred: Option<Instant>,
    /// When a verdict of the way it fails now first had an acceptance for a
    /// witness (and was deferred once more: those acceptances may lie
    /// between two outages rather than around this failure).
    witnessed: Option<Instant>,
}

impl Seen {
    /// When an answer first judged the event the way it fails now.
    fn judged(&self) -> Option<Instant> {
        self.beside
            .and_then(|(kind, at)| (kind == self.kind).then_some(at))
    }
}

/// One route's witnesses: its recent acceptances, since when each failing
/// event has been failing, the last two events that failed and the last two
/// that began failing.
#[derive(Debug, Default)]
pub(crate) struct Witnesses {
    /// When the latest acceptance was answered.
    last_answer: Option<Instant>,
    /// Acceptances as `(sent, answered)`, none both sent earlier and
    /// answered later than another: sorted by `sent`, and so by `answered`.
    /// The first one sent at or after a time is the earliest answered of
    /// all those sent since.
    acceptances: VecDeque<(Instant, Instant)>,
    failing: HashMap<i64, Seen>,
    /// The latest failure, and the latest of another event than that one.
    latest: Option<(i64, Instant)>,
    latest_other: Option<Instant>,
    /// The two events that most recently began failing, newest first, and
    /// when.
    began: [Option<(i64, Instant)>; 2],
}

impl Witnesses {
    /// The route accepted event `id`, in the answer at `answered` to a
    /// request sent at `sent`.
    pub(crate) fn accepted(&mut self, id: i64, sent: Instant, answered: Instant) {
        if self.last_answer.is_none_or(|last| last < answered) {
            self.last_answer = Some(answered);
        }
        self.failing.remove(&id);
        let known = &mut self.acceptances;
        if known.iter().any(|&(s, a)| s >= sent && a <= answered) {
            return; // one known already says more
        }
        known.retain(|&(s, a)| !(s <= sent && a >= answered));
        let at = known.partition_point(|&(s, _)| s < sent);
        known.insert(at, (sent, answered));
        if known.len() > ACCEPTANCES {
            known.pop_front();
        }
    }

    /// Event `id` failed at `now` (any failure that reached the sink, or
    /// that may be the sink's), the `kind` way; `beside` when the same
    /// answer accepted another message.
    pub(crate) fn failed(&mut self, id: i64, now: Instant, kind: Kind, beside: bool) {
        if !self.failing.contains_key(&id) {
            if self.began[0].is_some_and(|(last, _)| last != id) {
                self.began[1] = self.began[0];
            }
            self.began[0] = Some((id, now));
        }
        let seen = self.seen(id, now);
        if seen.kind != kind {
            seen.kind = kind;
            seen.since = now;
            seen.witnessed = None;
        }
        if beside && seen.beside.is_none_or(|(k, _)| k != kind) {
            seen.beside = Some((kind, now));
        }
        match self.latest {
            Some((last, _)) if last == id => {}
            Some((_, at)) => self.latest_other = Some(at),
            None => {}
        }
        self.latest = Some((id, now));
    }

    /// Event `id` reached a final verdict at `now`, in the answer to a
    /// request sent at `sent`.
    pub(crate) fn verdict(
        &mut self,
        id: i64,
        sent: Instant,
        now: Instant,
        longest: Duration,
    ) -> Verdict {
        let seen = *self.seen(id, now);
        // Acceptances since the row began failing this way, or since its
        // first witnessed verdict of this kind: the first such window only
        // moves the row on. After it, a second window carries the verdict,
        // and so does a route that is not failing now: no other event began
        // failing since the latest acceptance left (poison events refused
        // together on a route that went quiet after accepting the rest).
        let window = self.accepted_between(seen.witnessed.unwrap_or(seen.since), sent);
        let witnessed = seen.judged().is_some_and(|at| at <= sent)
            || (seen.witnessed.is_some() && (window || !self.another_began_failing(id)));
        // Alone: nothing else failed or was accepted on the route for the
        // longest pause (events failing together come back within half a
        // longest pause of each other, the most a deferral waits; the
        // failures of events dead-lettered or delivered since age out), and
        // this one kept failing as long: the same way, or since its final
        // verdict was first deferred.
        let failing_long =
            now >= seen.since + longest || seen.deferred.is_some_and(|at| now >= at + longest);
        let alone =
            failing_long && self.alone_since(id, now.checked_sub(longest).unwrap_or(seen.first));
        if witnessed || alone {
            self.failing.remove(&id);
            return Verdict::Carry;
        }
        let delay = PAUSE_MIN
            .saturating_mul(1 << seen.deferrals.min(16))
            .min((longest / 2).max(PAUSE_MIN));
        if let Some(seen) = self.failing.get_mut(&id) {
            seen.deferrals = seen.deferrals.saturating_add(1);
            seen.deferred.get_or_insert(now);
            if window {
                seen.witnessed = Some(now);
            }
        }
        Verdict::Defer { delay }
    }

    /// A message sent at or after `from` was accepted in an answer that came
    /// no later than `until`.
    fn accepted_between(&self, from: Instant, until: Instant) -> bool {
        let first_sent_since = self.acceptances.partition_point(|&(s, _)| s < from);
        self.acceptances
            .get(first_sent_since)
            .is_some_and(|&(_, answered)| answered <= until)
    }

    /// When the latest acceptance's request was sent.
    fn last_sent(&self) -> Option<Instant> {
        self.acceptances.back().map(|&(sent, _)| sent)
    }

    /// Another event than `id` began failing after the latest acceptance's
    /// request left (or none was accepted): the route may be failing now.
    fn another_began_failing(&self, id: i64) -> bool {
        self.began
            .iter()
            .flatten()
            .find(|&&(other, _)| other != id)
            .is_some_and(|&(_, at)| self.last_sent().is_none_or(|sent| at > sent))
    }

    /// Of the failing events `ids`, those whose failure no acceptance
    /// explains yet: they may be failing because the route does. (The
    /// others kept failing while the route accepted other messages: their
    /// failures are their own, and do not count against the route.)
    pub(crate) fn unexplained(&self, ids: &[i64]) -> Vec<i64> {
        ids.iter()
            .copied()
            .filter(|id| {
                self.failing.get(id).is_some_and(|seen| {
                    seen.judged().is_none() && self.last_sent().is_none_or(|sent| sent < seen.first)
                })
            })
            .collect()
    }

    /// Nothing else was accepted or failed on the route since `since`.
    fn alone_since(&self, id: i64, since: Instant) -> bool {
        let other_failed = match self.latest {
            Some((last, at)) if last != id => at >= since,
            _ => self.latest_other.is_some_and(|at| at >= since),
        };
        !other_failed && self.last_answer.is_none_or(|a| a < since)
    }

    fn seen(&mut self, id: i64, now: Instant) -> &mut Seen {
        if self.failing.len() >= REMEMBERED && !self.failing.contains_key(&id) {
            self.forget();
        }
        self.failing.entry(id).or_insert(Seen {
            first: now,
            deferrals: 0,
            kind: 0,
            since: now,
            beside: None,
            deferred: None,
            witnessed: None,
        })
    }

    /// Makes room: first the events a witness has seen already (their next
    /// verdict only waits for another acceptance), then all of them.
    fn forget(&mut self) {
        if let Some(last) = self.last_sent() {
            self.failing.retain(|_, seen| seen.first > last);
        }
        if self.failing.len() >= REMEMBERED {
            self.failing.clear();
        }
    }

    #[cfg(test)]
    pub(crate) fn remembered(&self) -> usize {
        self.failing.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONGEST: Duration = Duration::from_secs(5);
    /// One kind of failure.
    const K: Kind = 7;

    fn defer(secs: u64) -> Verdict {
        Verdict::Defer {
            delay: Duration::from_secs(secs),
        }
    }

    fn ms(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn a_verdict_waits_for_an_acceptance_after_the_first_failure() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        // The route accepted something before events 1 and 2 first failed:
        // no witness for them.
        w.accepted(9, t0, t0);
        w.failed(1, ms(t0, 10), K, false);
        w.failed(2, ms(t0, 10), K, false);
        assert_eq!(w.verdict(1, ms(t0, 5), ms(t0, 10), LONGEST), defer(1));
        // Deferred again and again: the delay doubles up to half the longest
        // pause.
        let delays: Vec<Duration> = (0..5)
            .map(|_| match w.verdict(1, ms(t0, 5), ms(t0, 20), LONGEST) {
                Verdict::Defer { delay } => delay,
                Verdict::Carry => panic!("carried without a witness"),
            })
            .collect();
        assert_eq!(
            delays,
            [2000, 2500, 2500, 2500, 2500].map(Duration::from_millis)
        );
        // Another message is accepted: the next request's verdict has one
        // window of acceptances behind it, and waits for a second.
        w.accepted(3, ms(t0, 25), ms(t0, 30));
        assert_eq!(
            w.verdict(1, ms(t0, 40), ms(t0, 50), LONGEST),
            Verdict::Defer {
                delay: Duration::from_millis(2500)
            }
        );
        // Accepted again since that verdict: the next one is carried out.
        w.accepted(4, ms(t0, 55), ms(t0, 60));
        assert_eq!(
            w.verdict(1, ms(t0, 70), ms(t0, 80), LONGEST),
            Verdict::Carry
        );
        assert_eq!(w.remembered(), 1);
    }

    #[test]
    fn an_acceptance_answered_after_the_request_left_is_no_witness() {
        // The end of a redeploy: the request refused was sent before the
        // destination came back, and others of the same moment were accepted.
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        w.failed(1, t0, K, false);
        w.failed(2, t0, K, false);
        w.accepted(3, ms(t0, 995), ms(t0, 1000));
        w.failed(1, ms(t0, 1000), K, false);
        assert_eq!(w.verdict(1, ms(t0, 990), ms(t0, 1000), LONGEST), defer(1));
        // Its next request, sent after the acceptance, is witnessed once;
        // after another acceptance, twice.
        assert_eq!(w.verdict(1, ms(t0, 2000), ms(t0, 2010), LONGEST), defer(2));
        w.accepted(4, ms(t0, 2100), ms(t0, 2110));
        assert_eq!(
            w.verdict(1, ms(t0, 3000), ms(t0, 3010), LONGEST),
            Verdict::Carry
        );
    }

    #[test]
    fn an_acceptance_sent_before_the_first_failure_is_no_witness() {
        // A deploy blip: event 3's request left just before the destination
        // began refusing, and its 200 came back after event 1's first 410.
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        w.failed(1, ms(t0, 10), K, false);
        w.failed(2, ms(t0, 10), K, false);
        w.accepted(3, t0, ms(t0, 20));
        w.failed(1, ms(t0, 1040), K, false);
        assert_eq!(w.verdict(1, ms(t0, 1030), ms(t0, 1040), LONGEST), defer(1));
        assert_eq!(
            w.unexplained(&[1, 2]),
            [1, 2],
            "they count against the route"
        );
        // The destination is back: a request sent after the first refusal is
        // accepted, and answered before the verdict's request left.
        w.accepted(4, ms(t0, 2000), ms(t0, 2010));
        assert_eq!(w.unexplained(&[1, 2]), Vec::<i64>::new());
        assert_eq!(
            w.verdict(1, ms(t0, 2005), ms(t0, 2030), LONGEST),
            defer(2),
            "answered after the verdict's request left"
        );
        assert_eq!(
            w.verdict(1, ms(t0, 3000), ms(t0, 3010), LONGEST),
            Verdict::Defer {
                delay: Duration::from_millis(2500)
            },
            "one window of acceptances"
        );
        w.accepted(5, ms(t0, 3100), ms(t0, 3110));
        assert_eq!(
            w.verdict(1, ms(t0, 4000), ms(t0, 4010), LONGEST),
            Verdict::Carry
        );
    }

    #[test]
    fn the_earliest_answered_acceptance_sent_since_is_found() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        w.failed(1, ms(t0, 10), K, false);
        assert_eq!(w.verdict(1, ms(t0, 5), ms(t0, 10), LONGEST), defer(1));
        // Sent after the failure: one slow (answered at 500), one quick
        // (answered at 60), one sent later still.
        w.accepted(2, ms(t0, 20), ms(t0, 500));
        w.accepted(3, ms(t0, 30), ms(t0, 60));
        w.accepted(4, ms(t0, 40), ms(t0, 700));
        assert_eq!(w.acceptances.len(), 2, "the slow one says nothing more");
        w.failed(2, ms(t0, 90), K, false);
        assert!(w.accepted_between(ms(t0, 10), ms(t0, 100)), "the quick one");
        assert!(!w.accepted_between(ms(t0, 10), ms(t0, 59)));
        assert!(!w.accepted_between(ms(t0, 35), ms(t0, 600)), "sent at 40");
        assert!(w.accepted_between(ms(t0, 35), ms(t0, 700)));
    }

    #[test]
    fn an_acceptance_in_the_refusing_answer_witnesses_the_next_verdict() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        w.accepted(1, t0, ms(t0, 10));
        w.failed(2, ms(t0, 10), K, true);
        w.failed(3, ms(t0, 10), K, false);
        assert_eq!(w.unexplained(&[2, 3]), [3]);
        assert_eq!(w.verdict(2, t0, ms(t0, 10), LONGEST), defer(1));
        assert_eq!(
            w.verdict(2, ms(t0, 20), ms(t0, 30), LONGEST),
            Verdict::Carry
        );
    }

    #[test]
    fn a_new_kind_of_failure_opens_the_window_again() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        // An unreadable answer, then others accepted: nothing about a 404 later.
        w.failed(1, t0, 1, false);
        w.failed(2, t0, 1, false);
        w.accepted(3, ms(t0, 10), ms(t0, 20));
        w.failed(1, ms(t0, 5000), 2, false);
        assert_eq!(w.verdict(1, ms(t0, 4990), ms(t0, 5000), LONGEST), defer(1));
        // The same kind again after another acceptance: one window of the
        // new kind; after another, its own.
        w.accepted(4, ms(t0, 5100), ms(t0, 5110));
        w.failed(1, ms(t0, 6010), 2, false);
        assert_eq!(w.verdict(1, ms(t0, 6000), ms(t0, 6010), LONGEST), defer(2));
        w.accepted(5, ms(t0, 6100), ms(t0, 6110));
        w.failed(1, ms(t0, 7010), 2, false);
        assert_eq!(
            w.verdict(1, ms(t0, 7000), ms(t0, 7010), LONGEST),
            Verdict::Carry
        );
    }

    #[test]
    fn an_event_failing_alone_for_long_is_carried_out() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        w.accepted(9, t0, t0);
        w.failed(1, ms(t0, 10), K, false);
        assert_eq!(w.verdict(1, ms(t0, 5), ms(t0, 10), LONGEST), defer(1));
        w.failed(1, ms(t0, 3000), K, false);
        assert_eq!(w.verdict(1, ms(t0, 2990), ms(t0, 3000), LONGEST), defer(2));
        w.failed(1, ms(t0, 5010), K, false);
        assert_eq!(
            w.verdict(1, ms(t0, 5000), ms(t0, 5010), LONGEST),
            Verdict::Carry
        );
    }

    /// Row 6525 of a full-fault run: poison events failing together, the
    /// others dead-lettered (their witnesses came in time), this one left
    /// failing alone on an idle route, deferred every 8 s for minutes: the
    /// others' old failures kept it from ever being alone.
    #[test]
    fn an_event_left_failing_alone_is_carried_out_once_the_others_are_gone() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        w.failed(1, t0, K, false);
        w.failed(2, ms(t0, 1), K, false);
        let carried_at = (1..=6).find(|s| {
            let at = t0 + Duration::from_secs(5 * s);
            w.failed(1, at, K, false);
            w.verdict(1, at, at, LONGEST) == Verdict::Carry
        });
        assert_eq!(carried_at, Some(2), "once event 2's failure is a pause old");
    }

    /// Row 6385 of a short-form adversarial run: the last poison event of
    /// its route, the other two dead-lettered at 0 s; its deferred verdicts
    /// came back rejected, 500, rejected, 409, rejected, each change of kind
    /// restarting its same-way clock: carried out only 20.8 s later, longer
    /// than the 20 s lease.
    #[test]
    fn a_lone_event_whose_answers_vary_is_carried_out_within_a_pause_and_a_half() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        const POISON: Kind = 1;
        w.failed(2, t0, POISON, false);
        w.failed(1, ms(t0, 500), POISON, false);
        assert_ne!(
            w.verdict(1, ms(t0, 490), ms(t0, 500), LONGEST),
            Verdict::Carry
        );
        // Every other answer something else: a 500, a 409, an unreadable one.
        let carried_at = (1..=8).find_map(|n| {
            let at = ms(t0, 500 + 2500 * n);
            let kind = if n % 2 == 0 { POISON } else { 10 + n };
            w.failed(1, at, kind, false);
            (w.verdict(1, at, at, LONGEST) == Verdict::Carry).then_some(at - t0)
        });
        assert_eq!(
            carried_at,
            Some(Duration::from_millis(5500)),
            "a longest pause after event 2's last failure and the first deferral"
        );
    }

    /// The end of a short-form adversarial run: four poison events left on
    /// an idle route, each batch answer judging them one by one, with a 500
    /// or an unreadable answer now and then between; each of those reset
    /// the judgment, so a route with nothing else pending stalled 17.5 s.
    #[test]
    fn a_judgment_outlives_answers_of_another_kind_between() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        const ELEMENT: Kind = 1;
        const SERVER_ERROR: Kind = 2;
        const NOT_FOUND: Kind = 3;
        for id in [1, 2] {
            w.failed(id, t0, ELEMENT, true);
        }
        for id in [1, 2] {
            w.failed(id, ms(t0, 1000), SERVER_ERROR, false);
        }
        for id in [1, 2] {
            w.failed(id, ms(t0, 2000), ELEMENT, true);
            assert_eq!(
                w.verdict(id, ms(t0, 1990), ms(t0, 2000), LONGEST),
                Verdict::Carry
            );
        }
        // A judgment witnesses nothing of another kind: a blip's 404.
        w.failed(3, ms(t0, 3000), ELEMENT, true);
        w.failed(4, ms(t0, 3000), ELEMENT, true);
        w.failed(3, ms(t0, 4000), NOT_FOUND, false);
        assert_ne!(
            w.verdict(3, ms(t0, 3990), ms(t0, 4000), LONGEST),
            Verdict::Carry
        );
        assert_eq!(w.unexplained(&[3, 4]), [3]);
    }

    /// The case the same-way clock is for: a lone event retried for long
    /// (timeouts, no final verdict) meets a deploy blip's 404s. The blip
    /// decides nothing: the row had no deferred verdict before it.
    #[test]
    fn a_lone_event_retried_for_long_is_not_dead_lettered_by_a_blip() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        const TIMEOUT: Kind = 1;
        const NOT_FOUND: Kind = 2;
        for s in 0..6 {
            w.failed(1, t0 + Duration::from_secs(3 * s), TIMEOUT, false);
        }
        for at in [ms(t0, 16_000), ms(t0, 17_000), ms(t0, 18_500)] {
            w.failed(1, at, NOT_FOUND, false);
            assert_ne!(w.verdict(1, at, at, LONGEST), Verdict::Carry, "{at:?}");
        }
        // The blip is over: delivered, and forgotten.
        w.accepted(1, ms(t0, 19_000), ms(t0, 19_010));
        assert_eq!(w.remembered(), 0);
    }

    #[test]
    fn two_events_failing_together_wait_however_long() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        for s in 0..100 {
            let at = t0 + Duration::from_secs(s);
            w.failed(1, at, K, false);
            w.failed(2, at, K, false);
            assert_ne!(w.verdict(1, at, at, LONGEST), Verdict::Carry);
            assert_ne!(w.verdict(2, at, at, LONGEST), Verdict::Carry);
        }
    }

    #[test]
    fn only_failures_no_acceptance_explains_count_against_the_route() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        w.failed(1, t0, K, false);
        w.accepted(2, ms(t0, 1), ms(t0, 1));
        w.failed(3, ms(t0, 2), K, false);
        // Event 1 kept failing while the route accepted event 2; event 3
        // failed since, with nothing accepted.
        assert_eq!(w.unexplained(&[1, 3]), [3]);
    }

    #[test]
    fn an_event_that_succeeds_is_forgotten() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        w.failed(1, t0, K, false);
        w.failed(2, t0, K, false);
        w.accepted(1, ms(t0, 4), ms(t0, 5));
        assert_eq!(w.remembered(), 1);
        // Its own acceptance is no witness for a later failure of it.
        w.failed(1, ms(t0, 10), K, false);
        w.failed(2, ms(t0, 10), K, false);
        assert_eq!(w.verdict(1, ms(t0, 8), ms(t0, 10), LONGEST), defer(1));
    }

    #[test]
    fn a_forgotten_event_waits_for_a_new_witness() {
        let mut w = Witnesses::default();
        let t0 = Instant::now();
        for id in 0..REMEMBERED as i64 {
            w.failed(id, t0, K, false);
        }
        w.accepted(-1, ms(t0, 1), ms(t0, 1));
        // Full: the witnessed ones make room for a new one.
        w.failed(REMEMBERED as i64, ms(t0, 2), K, false);
        assert_eq!(w.remembered(), 1);
        // Event 0 was witnessed but forgotten: it fails first "now" again.
        assert_eq!(w.verdict(0, ms(t0, 3), ms(t0, 3), LONGEST), defer(1));
    }
}
