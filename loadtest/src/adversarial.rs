//! The invariants of the adversarial scenario (`kind = "adversarial"`), checked
//! from the outbox rows, the sink's answer log ([`AnswerEvent`]), its outage
//! windows and the harness's progress samples:
//!
//! 1. **Settled.** Every event is published or dead-lettered with a non-empty
//!    `last_error`; none is left pending.
//! 2. **Published means accepted.** A row marked published has at least one
//!    answer the sink logged as [`AnswerKind::Accepted`]: a readable answer
//!    that says *this* message was taken. A message the sink took but answered
//!    unreadably (lost, cut off, garbled, wrong length, not an object,
//!    oversized) does not count; its retry is answered as a duplicate, and
//!    that answer does.
//! 3. **Dead letters come from the message, never from an outage.** A
//!    rejection of a message itself is [`AnswerKind::Rejected`]: a 4xx other
//!    than 401/403/408/429 to a request carrying it alone, or an error element
//!    in its slot of a readable batch answer. The sink marks every answer an
//!    outage gave ([`AnswerEvent::outage`]). A row is dead-lettered justly
//!    when, before its `dead_lettered_at`, the sink's last answer about it was
//!    not an outage's (a sink-wide one, or a deploy blip's 404, 410 or 503
//!    across its route: such a dead letter is the outage's, however late it
//!    came), and either
//!    (a) that last answer was such a rejection, and either no `refused`
//!    outage (in which the sink sees no request) began since, or the row's
//!    `last_error` is that rejection's (the relay writes the error with the
//!    dead letter, so a dead letter caused by a refused connection names the
//!    connection; a mark can land seconds after the answer, when the rest of
//!    its request waits on a slow sink); or
//!    (b) the sink rejected it for itself at least once, and no `refused`
//!    outage began after its last answer (attempts used up by its own
//!    rejections mixed with random failures, the last of which may come as
//!    an outage begins).
//!    A row the sink never rejected for itself breaks the invariant too.
//! 4. **Progress** (`crate::progress`). Each route's count of settled rows
//!    (published + dead-lettered), sampled every [`SAMPLE_EVERY`], never
//!    stays flat for a lease or longer while that route has rows pending,
//!    the time of outages that hit the route excepted (sink-wide ones and
//!    its own): its clock restarts at such an outage's end, so after every
//!    outage the route must settle rows again within one lease. Another
//!    route's outage excuses nothing, and one route's progress does not
//!    hide another's stall.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::progress::{resumed_after, stalls};
pub use crate::progress::{ProgressSample, SAMPLE_EVERY};
use crate::verify::{sample_ids, OutboxRow};
use outbox_testkit::sink::{AnswerEvent, AnswerKind, OutageKind, OutageWindow};

/// When each dead-lettered row was dead-lettered, unix µs.
pub const DEAD_LETTERED_AT: &str =
    "SELECT id, (extract(epoch FROM dead_lettered_at) * 1000000)::bigint
FROM outbox WHERE dead_lettered_at IS NOT NULL";

/// A dead letter the sink's answers do not explain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnjustifiedDeadLetter {
    pub id: i64,
    pub last_error: Option<String>,
    /// Why it is not justified (the sink's last answer about it, or the outage).
    pub why: String,
}

/// Answers the sink logged, per kind (messages, not requests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnswerCounts {
    pub accepted: u64,
    pub accepted_unread: u64,
    pub rejected: u64,
    pub failed: u64,
}

/// A stall: no row (of `route`) settled from `from_secs` for `secs` while
/// rows (of that route) were pending.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Stall {
    /// Seconds since the run's origin.
    pub from_secs: f64,
    pub secs: f64,
    /// The route's destination path; `None` for all rows together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
}

/// One outage and how soon rows settled again after it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutageOutcome {
    pub kind: OutageKind,
    /// The destination path it was limited to; the whole sink when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    pub from_secs: f64,
    pub secs: f64,
    /// From the outage's end to the first progress after it; `None` when
    /// nothing was pending at its end, or nothing settled afterwards.
    pub resumed_after_secs: Option<f64>,
}

/// What the adversarial checks found.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AdversarialReport {
    pub lease_secs: f64,
    pub outages: Vec<OutageOutcome>,
    pub answers: AnswerCounts,
    /// Neither published nor dead-lettered.
    pub unsettled: Vec<i64>,
    pub dead_without_reason: Vec<i64>,
    /// Published without an accepting answer from the sink.
    pub published_unaccepted: Vec<i64>,
    /// For the first ten of those: what the sink answered about it, in order.
    pub published_unaccepted_answers: Vec<String>,
    pub dead_letters: u64,
    /// Dead letters per reason (`last_error` up to its first `:`).
    pub dead_letter_reasons: BTreeMap<String, u64>,
    pub justified_dead_letters: Vec<i64>,
    pub unjustified_dead_letters: Vec<UnjustifiedDeadLetter>,
    /// Dead-lettered rows the sink had taken (a lost or unreadable answer,
    /// then a rejection): informative.
    pub dead_but_taken: u64,
    pub samples: u64,
    /// Longest time without progress while rows were pending, outages included.
    pub longest_stall: Stall,
    /// The longest any route went without progress while it had rows
    /// pending, the outages that hit it excepted (the invariant).
    pub longest_charged_stall: Stall,
}

impl AdversarialReport {
    /// Every broken invariant, one line each.
    pub fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if !self.unsettled.is_empty() {
            f.push(format!(
                "{} events neither published nor dead-lettered: ids {}",
                self.unsettled.len(),
                sample_ids(&self.unsettled)
            ));
        }
        if !self.dead_without_reason.is_empty() {
            f.push(format!(
                "{} events dead-lettered without a reason: ids {}",
                self.dead_without_reason.len(),
                sample_ids(&self.dead_without_reason)
            ));
        }
        if !self.published_unaccepted.is_empty() {
            f.push(format!(
                "{} events marked published that the sink never answered as accepted: ids {}",
                self.published_unaccepted.len(),
                sample_ids(&self.published_unaccepted)
            ));
            for a in &self.published_unaccepted_answers {
                f.push(format!("  {a}"));
            }
        }
        if !self.unjustified_dead_letters.is_empty() {
            f.push(format!(
                "{} dead letters not caused by a rejection of the message itself",
                self.unjustified_dead_letters.len()
            ));
            for d in self.unjustified_dead_letters.iter().take(10) {
                f.push(format!(
                    "  id {}: {}; last_error: {}",
                    d.id,
                    d.why,
                    d.last_error
                        .as_deref()
                        .map(|e| e.chars().take(160).collect::<String>())
                        .unwrap_or_default()
                ));
            }
        }
        if self.samples < 2 {
            f.push("progress was not sampled".into());
        }
        let s = &self.longest_charged_stall;
        if s.secs >= self.lease_secs {
            let of = s
                .route
                .as_deref()
                .map(|r| format!(" of route {r}"))
                .unwrap_or_default();
            f.push(format!(
                "no event{of} settled for {:.1} s from {:.1} s with events pending, outages excepted: longer than the lease ({:.1} s)",
                s.secs, s.from_secs, self.lease_secs
            ));
        }
        f
    }
}

/// What [`check`] needs.
pub struct CheckInput<'a> {
    pub rows: &'a [OutboxRow],
    /// `(id, dead_lettered_at unix µs)`.
    pub dead_lettered_at: &'a [(i64, i64)],
    pub answers: &'a [AnswerEvent],
    pub outages: &'a [OutageWindow],
    pub samples: &'a [ProgressSample],
    pub lease: Duration,
    /// unix µs the report's seconds count from.
    pub origin_us: i64,
}

/// Checks the invariants (see the module doc).
pub fn check(input: &CheckInput<'_>) -> AdversarialReport {
    let secs = |us: i64| (us - input.origin_us) as f64 / 1e6;
    let mut r = AdversarialReport {
        lease_secs: input.lease.as_secs_f64(),
        samples: input.samples.len() as u64,
        ..AdversarialReport::default()
    };
    let mut by_id: HashMap<i64, Vec<&AnswerEvent>> = HashMap::new();
    for a in input.answers {
        match a.kind {
            AnswerKind::Accepted => r.answers.accepted += 1,
            AnswerKind::AcceptedUnread => r.answers.accepted_unread += 1,
            AnswerKind::Rejected { .. } => r.answers.rejected += 1,
            AnswerKind::Failed { .. } => r.answers.failed += 1,
        }
        by_id.entry(a.outbox_id).or_default().push(a);
    }
    for answers in by_id.values_mut() {
        answers.sort_by_key(|a| a.at_us);
    }
    let dead_at: HashMap<i64, i64> = input.dead_lettered_at.iter().copied().collect();
    let none = Vec::new();
    for row in input.rows {
        let answers = by_id.get(&row.id).unwrap_or(&none);
        if row.published {
            if !answers.iter().any(|a| a.kind == AnswerKind::Accepted) {
                if r.published_unaccepted.len() < 10 {
                    r.published_unaccepted_answers.push(format!(
                        "id {}: {}",
                        row.id,
                        history(answers, &secs)
                    ));
                }
                r.published_unaccepted.push(row.id);
            }
            continue;
        }
        if !row.dead_lettered {
            r.unsettled.push(row.id);
            continue;
        }
        r.dead_letters += 1;
        *r.dead_letter_reasons
            .entry(reason(row.last_error.as_deref()))
            .or_insert(0) += 1;
        if row
            .last_error
            .as_deref()
            .is_none_or(|e| e.trim().is_empty())
        {
            r.dead_without_reason.push(row.id);
        }
        if answers
            .iter()
            .any(|a| matches!(a.kind, AnswerKind::Accepted | AnswerKind::AcceptedUnread))
        {
            r.dead_but_taken += 1;
        }
        match justify(
            dead_at.get(&row.id).copied(),
            row.last_error.as_deref(),
            answers,
            input.outages,
            &secs,
        ) {
            Ok(()) => r.justified_dead_letters.push(row.id),
            Err(why) => r.unjustified_dead_letters.push(UnjustifiedDeadLetter {
                id: row.id,
                last_error: row.last_error.clone(),
                why,
            }),
        }
    }
    let (raw, charged) = stalls(input.samples, input.outages);
    r.longest_stall = Stall {
        from_secs: secs(raw.start),
        secs: raw.len as f64 / 1e6,
        route: None,
    };
    r.longest_charged_stall = Stall {
        from_secs: secs(charged.start),
        secs: charged.len as f64 / 1e6,
        route: charged.route,
    };
    r.outages = input
        .outages
        .iter()
        .map(|o| OutageOutcome {
            kind: o.kind,
            route: o.route.clone(),
            from_secs: secs(o.start_us),
            secs: (o.end_us - o.start_us) as f64 / 1e6,
            resumed_after_secs: resumed_after(input.samples, o.end_us),
        })
        .collect();
    r
}

/// `last_error` up to its first `:`, at most 60 characters.
fn reason(last_error: Option<&str>) -> String {
    let e = last_error.unwrap_or("(none)");
    let head = e.split(':').next().unwrap_or(e).trim();
    head.chars().take(60).collect()
}

/// Rule 3 of the module doc.
fn justify(
    dead_at: Option<i64>,
    last_error: Option<&str>,
    answers: &[&AnswerEvent],
    outages: &[OutageWindow],
    secs: &dyn Fn(i64) -> f64,
) -> Result<(), String> {
    let Some(dead_at) = dead_at else {
        return Err("no dead_lettered_at".into());
    };
    let before: Vec<&AnswerEvent> = answers
        .iter()
        .copied()
        .filter(|a| a.at_us <= dead_at)
        .collect();
    let Some(last) = before.last() else {
        return Err("the sink never answered about it before it was dead-lettered".into());
    };
    let history = || history(&before, secs);
    if let Some(kind) = last.outage {
        let o = outages
            .iter()
            .filter(|o| o.kind == kind && o.start_us <= last.at_us)
            .max_by_key(|o| o.start_us);
        return Err(format!(
            "its last answer before the dead letter at {:.3} s was the {} outage's{}{}; {}",
            secs(dead_at),
            kind.as_str(),
            o.and_then(|o| o.route.as_deref())
                .map(|r| format!(" on {r}"))
                .unwrap_or_default(),
            o.map(|o| format!(" ({:.1}-{:.1} s)", secs(o.start_us), secs(o.end_us)))
                .unwrap_or_default(),
            history()
        ));
    }
    if last.kind.is_rejection() && names_rejection(last_error, last.kind) {
        return Ok(());
    }
    if let Some(o) = outages
        .iter()
        .find(|o| o.kind == OutageKind::Refused && o.start_us > last.at_us && o.start_us <= dead_at)
    {
        return Err(format!(
            "connections were refused from {:.3} s, after the sink's last answer about it; {}",
            secs(o.start_us),
            history()
        ));
    }
    if !before.iter().any(|a| a.kind.is_rejection()) {
        return Err(format!(
            "the sink never rejected the message itself; {}",
            history()
        ));
    }
    Ok(())
}

/// Does the relay's `last_error` record `rejection` itself (its HTTP status
/// on a request that carried the message alone, or an element error of a
/// batch answer, possibly as the last of its attempts), rather than a
/// connection that failed?
fn names_rejection(last_error: Option<&str>, rejection: AnswerKind) -> bool {
    let AnswerKind::Rejected { status } = rejection else {
        return false;
    };
    let Some(error) = last_error else {
        return false;
    };
    // "attempt 8 of 8 failed: <the last attempt's error>"
    let error = match error.strip_prefix("attempt ") {
        Some(rest) => rest.split_once(" failed: ").map_or(error, |(_, e)| e),
        None => error,
    };
    error.starts_with(&format!("HTTP {status}:")) || error.starts_with("qstash: ")
}

/// The last few answers, for a failure message.
fn history(answers: &[&AnswerEvent], secs: &dyn Fn(i64) -> f64) -> String {
    let shown: Vec<String> = answers
        .iter()
        .rev()
        .take(10)
        .rev()
        .map(|a| format!("{:?} at {:.3} s", a.kind, secs(a.at_us)))
        .collect();
    format!(
        "the sink's answers about it ({} in all, the last {}): {}",
        answers.len(),
        shown.len(),
        shown.join(", ")
    )
}

/// The row ids [`check`] found justly dead-lettered, for [`crate::verify`].
pub fn justified(report: &AdversarialReport) -> BTreeSet<i64> {
    report.justified_dead_letters.iter().copied().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use AnswerKind::{Accepted, AcceptedUnread, Failed, Rejected};

    const S: i64 = 1_000_000;

    fn row(id: i64, published: bool, dead: bool, err: Option<&str>) -> OutboxRow {
        OutboxRow {
            id,
            idempotency_key: format!("k{id}"),
            partition_key: "p".into(),
            created_at_us: 0,
            published,
            dead_lettered: dead,
            last_error: err.map(str::to_owned),
            live_lease: false,
            poison_marker: false,
            attempt_count: 1,
        }
    }

    fn ans(at_s: i64, id: i64, kind: AnswerKind) -> AnswerEvent {
        AnswerEvent {
            at_us: at_s * S,
            outbox_id: id,
            kind,
            outage: None,
        }
    }

    /// Marks row `id`'s answer at `at_s` as the `kind` outage's.
    fn flag(answers: &mut [AnswerEvent], id: i64, at_s: i64, kind: OutageKind) {
        let a = answers
            .iter_mut()
            .find(|a| a.outbox_id == id && a.at_us == at_s * S)
            .expect("an answer to flag");
        a.outage = Some(kind);
    }

    /// The answer events of each `(outbox id, [(second, kind)])`.
    fn answers_by_row(rows: &[(i64, &[(i64, AnswerKind)])]) -> Vec<AnswerEvent> {
        rows.iter()
            .flat_map(|&(id, answers)| answers.iter().map(move |&(at_s, kind)| ans(at_s, id, kind)))
            .collect()
    }

    fn progress(points: &[(i64, i64, i64)]) -> Vec<ProgressSample> {
        points
            .iter()
            .map(|&(t, settled, pending)| ProgressSample {
                at_us: t * S,
                settled,
                pending,
                routes: Default::default(),
            })
            .collect()
    }

    fn input<'a>(
        rows: &'a [OutboxRow],
        dead: &'a [(i64, i64)],
        answers: &'a [AnswerEvent],
        outages: &'a [OutageWindow],
        samples: &'a [ProgressSample],
    ) -> CheckInput<'a> {
        CheckInput {
            rows,
            dead_lettered_at: dead,
            answers,
            outages,
            samples,
            lease: Duration::from_secs(10),
            origin_us: 0,
        }
    }

    #[test]
    fn published_needs_an_accepting_answer_and_dead_letters_a_rejection() {
        let rows = [
            row(1, true, false, None),
            row(2, true, false, None),
            row(3, false, true, Some("HTTP 422: nope")),
            row(4, false, true, Some("HTTP 503: outage")),
            row(5, false, true, Some("connect: refused")),
            row(6, false, false, None),
            row(7, false, true, Some(" ")),
            row(8, false, true, Some("attempt 8 of 8 failed: HTTP 503")),
            row(9, false, true, Some("attempt 8 of 8 failed: HTTP 503")),
            // Marked after the refused outage began, for the rejection itself.
            row(10, false, true, Some("HTTP 400: bad")),
            row(
                11,
                false,
                true,
                Some("attempt 8 of 8 failed: qstash: poison"),
            ),
            // Marked after it began, for a refused connection.
            row(
                12,
                false,
                true,
                Some("attempt 8 of 8 failed: connect: refused"),
            ),
            row(
                13,
                false,
                true,
                Some("HTTP 404: not the 400 it was answered"),
            ),
        ];
        // Each row's answers, (second, kind) in order.
        let answers = answers_by_row(&[
            (1, &[(1, AcceptedUnread), (2, Accepted)]),
            (2, &[(1, AcceptedUnread)]),
            (
                3,
                &[(1, Failed { status: 503 }), (2, Rejected { status: 422 })],
            ),
            (
                4,
                &[(1, Rejected { status: 400 }), (2, Failed { status: 503 })],
            ),
            (5, &[(1, Rejected { status: 400 })]),
            (7, &[(1, Rejected { status: 400 })]),
            (
                8,
                &[(1, Rejected { status: 400 }), (11, Failed { status: 503 })],
            ),
            (9, &[(11, Failed { status: 503 })]),
            (10, &[(1, Rejected { status: 400 })]),
            (11, &[(1, Rejected { status: 200 })]),
            (12, &[(1, Rejected { status: 200 })]),
            (13, &[(1, Rejected { status: 400 })]),
        ]);
        let mut answers = answers;
        flag(&mut answers, 4, 2, OutageKind::ServerError);
        let dead = [
            (3, 3 * S),
            (4, 3 * S),
            (5, 9 * S),
            (7, 2 * S),
            (8, 12 * S),
            (9, 12 * S),
            (10, 6 * S),
            (11, 6 * S),
            (12, 6 * S),
            (13, 6 * S),
        ];
        let outages = [
            OutageWindow {
                kind: OutageKind::ServerError,
                start_us: 2 * S,
                end_us: 5 * S / 2,
                route: None,
            },
            OutageWindow {
                kind: OutageKind::Refused,
                start_us: 5 * S,
                end_us: 8 * S,
                route: None,
            },
        ];
        let samples = progress(&[(0, 0, 7), (1, 1, 6), (2, 6, 1)]);
        let r = check(&input(&rows, &dead, &answers, &outages, &samples));
        assert_eq!(r.published_unaccepted, vec![2]);
        assert_eq!(r.unsettled, vec![6]);
        assert_eq!(r.dead_without_reason, vec![7]);
        // 8: its own rejections and random failures used its attempts up.
        // 10, 11: their last_error is the rejection, not the refused connection.
        assert_eq!(r.justified_dead_letters, vec![3, 7, 8, 10, 11]);
        let unjust: Vec<i64> = r.unjustified_dead_letters.iter().map(|d| d.id).collect();
        assert_eq!(unjust, vec![4, 5, 9, 12, 13]);
        let why: Vec<&str> = r
            .unjustified_dead_letters
            .iter()
            .map(|d| d.why.as_str())
            .collect();
        assert!(
            why[0].starts_with(
                "its last answer before the dead letter at 3.000 s was the server_error outage's (2.0-2.5 s)"
            ),
            "{}",
            why[0]
        );
        assert!(why[1].starts_with("connections were refused from 5.000 s"));
        assert!(why[2].starts_with("the sink never rejected the message itself"));
        assert!(why[2].contains("Failed { status: 503 } at 11.000 s"));
        assert_eq!(r.dead_letter_reasons["HTTP 422"], 1);
        assert_eq!(r.answers.rejected, 9);
        let f = r.failures().join("\n");
        assert!(f.contains("never answered as accepted: ids 2"), "{f}");
        assert!(f.contains("id 2: the sink's answers about it (1 in all, the last 1): AcceptedUnread at 1.000 s"), "{f}");
        assert!(
            f.contains("neither published nor dead-lettered: ids 6"),
            "{f}"
        );
        assert!(
            f.contains("id 4: its last answer before the dead letter"),
            "{f}"
        );
    }

    #[test]
    fn stalls_count_outside_outages_only() {
        let rows = [row(1, true, false, None)];
        let answers = [ans(1, 1, AnswerKind::Accepted)];
        // Flat from 10 s to 40 s; an outage from 12 s to 30 s.
        let samples = progress(&[
            (0, 0, 100),
            (10, 50, 50),
            (20, 50, 50),
            (30, 50, 50),
            (38, 50, 50),
            (40, 60, 40),
            (41, 100, 0),
            (70, 100, 0),
        ]);
        let outages = [OutageWindow {
            kind: OutageKind::ServerError,
            start_us: 12 * S,
            end_us: 30 * S,
            route: None,
        }];
        let r = check(&input(&rows, &[], &answers, &outages, &samples));
        assert_eq!(r.longest_stall.secs, 28.0);
        assert_eq!(r.longest_stall.from_secs, 10.0);
        assert_eq!(r.longest_charged_stall.secs, 8.0);
        assert_eq!(r.longest_charged_stall.from_secs, 30.0);
        assert_eq!(r.outages[0].resumed_after_secs, Some(10.0));
        assert!(r.failures().is_empty(), "{:?}", r.failures());
        // Nothing pending is no stall; without the outage the flat stretch fails.
        let r = check(&input(&rows, &[], &answers, &[], &samples));
        assert_eq!(r.longest_charged_stall.secs, 28.0);
        assert!(
            r.failures()[0].contains("longer than the lease"),
            "{:?}",
            r.failures()
        );
        let r = check(&input(&rows, &[], &answers, &[], &[]));
        assert_eq!(r.failures(), vec!["progress was not sampled".to_string()]);
    }

    #[test]
    fn a_dead_letter_after_a_blip_answer_is_caused_by_the_blip() {
        let rows = [
            // 404 from the route's deploy blip, dead-lettered at once.
            row(
                1,
                false,
                true,
                Some("HTTP 404: not found (deploy in progress)"),
            ),
            // Rejected for itself once, then the blip's 410; dead-lettered
            // well after the blip: still the blip's doing.
            row(
                2,
                false,
                true,
                Some("attempt 8 of 8 failed: HTTP 410: gone"),
            ),
            // A random 404 of its own during the blip: its own rejection.
            row(3, false, true, Some("HTTP 404: injected 404")),
            // Dead-lettered during another route's outage, for itself.
            row(4, false, true, Some("HTTP 422: nope")),
        ];
        let answers = answers_by_row(&[
            (1, &[(11, Failed { status: 404 })]),
            (
                2,
                &[(1, Rejected { status: 400 }), (21, Failed { status: 410 })],
            ),
            (3, &[(11, Rejected { status: 404 })]),
            (4, &[(31, Rejected { status: 422 })]),
        ]);
        let mut answers = answers;
        flag(&mut answers, 1, 11, OutageKind::NotFound);
        flag(&mut answers, 2, 21, OutageKind::Gone);
        let dead = [(1, 11 * S), (2, 25 * S), (3, 11 * S), (4, 31 * S)];
        let blip = |kind, from: i64, route: Option<&str>| OutageWindow {
            kind,
            start_us: from * S,
            end_us: (from + 2) * S,
            route: route.map(str::to_owned),
        };
        let outages = [
            blip(OutageKind::NotFound, 10, Some("/hook")),
            blip(OutageKind::Gone, 20, None),
            blip(OutageKind::ServerError, 30, Some("/hook/invoices")),
        ];
        let samples = progress(&[(0, 0, 4), (40, 4, 0)]);
        let r = check(&input(&rows, &dead, &answers, &outages, &samples));
        assert_eq!(r.justified_dead_letters, vec![3, 4]);
        let unjust: Vec<i64> = r.unjustified_dead_letters.iter().map(|d| d.id).collect();
        assert_eq!(unjust, vec![1, 2]);
        let why = &r.unjustified_dead_letters[0].why;
        assert!(
            why.contains("last answer before the dead letter at 11.000 s was the not_found outage's on /hook"),
            "{why}"
        );
        assert!(r.unjustified_dead_letters[1]
            .why
            .contains("the gone outage's ("));
    }

    /// Two dead letters two runs called unjust: a poison event whose last
    /// attempt got a random 503 on its own route while another route was
    /// down, and one whose last attempt got an unreadable 200 just as a
    /// sink-wide outage began. Both were used up by their own rejections;
    /// neither answer was an outage's.
    #[test]
    fn a_dead_letter_near_an_outage_is_judged_by_the_answer_that_caused_it() {
        let rows = [
            row(1, false, true, Some("attempt 8 of 8 failed: HTTP 503: x")),
            row(2, false, true, Some("attempt 8 of 8 failed: unreadable")),
        ];
        let answers = answers_by_row(&[
            (
                1,
                &[(46, Rejected { status: 400 }), (50, Failed { status: 503 })],
            ),
            (
                2,
                &[(3, Rejected { status: 400 }), (5, Failed { status: 200 })],
            ),
        ]);
        let dead = [(1, 50 * S), (2, 5 * S)];
        let outages = [
            OutageWindow {
                kind: OutageKind::ServerError,
                start_us: 45 * S,
                end_us: 57 * S,
                route: Some("/hook/invoices".into()),
            },
            OutageWindow {
                kind: OutageKind::ServerError,
                start_us: 5 * S,
                end_us: 9 * S,
                route: None,
            },
        ];
        let samples = progress(&[(0, 0, 2), (60, 2, 0)]);
        let r = check(&input(&rows, &dead, &answers, &outages, &samples));
        assert_eq!(r.justified_dead_letters, vec![1, 2], "{:?}", r.failures());
    }

    #[test]
    fn one_route_down_excuses_no_stall() {
        let rows = [row(1, true, false, None)];
        let answers = [ans(1, 1, AnswerKind::Accepted)];
        // Flat from 10 s to 40 s while only /hook/invoices is down.
        let samples = progress(&[(0, 0, 100), (10, 50, 50), (40, 50, 50), (41, 100, 0)]);
        let outages = [OutageWindow {
            kind: OutageKind::ServerError,
            start_us: 10 * S,
            end_us: 35 * S,
            route: Some("/hook/invoices".into()),
        }];
        let r = check(&input(&rows, &[], &answers, &outages, &samples));
        assert_eq!(r.longest_charged_stall.secs, 30.0);
        assert_eq!(r.outages[0].route.as_deref(), Some("/hook/invoices"));
        assert!(
            r.failures()[0].contains("longer than the lease"),
            "{:?}",
            r.failures()
        );
    }
}
