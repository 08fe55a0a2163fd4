//! The circuit breaker's rules, state by state, and its witnesses.

use super::*;
use crate::sink::DeadReason;

fn retry(reason: RetryReason) -> Outcome {
    Outcome::Retry {
        after: None,
        reason,
        error: "e".into(),
    }
}

#[test]
fn outcomes_tell_the_sink_from_the_event() {
    assert_eq!(
        health(&[retry(RetryReason::ServerError), Outcome::Published]),
        Health::Up
    );
    assert_eq!(health(&[retry(RetryReason::BatchElement)]), Health::Up);
    assert!(matches!(
        health(&[
            retry(RetryReason::ServerError),
            retry(RetryReason::Unauthorized)
        ]),
        Health::Down {
            cause: "unauthorized",
            ..
        }
    ));
    assert!(matches!(
        health(&[retry(RetryReason::Timeout)]),
        Health::Failing { .. }
    ));
    let no_route = Outcome::Dead {
        reason: DeadReason::NoRoute,
        error: "x".into(),
    };
    assert_eq!(health(&[no_route]), Health::Unknown);
}

fn rejected(status: u16) -> Outcome {
    Outcome::Dead {
        reason: DeadReason::Rejected,
        error: format!("HTTP {status}"),
    }
}

#[test]
fn a_4xx_for_every_message_is_a_failing_request() {
    assert_eq!(
        health(&[rejected(404), rejected(404)]),
        Health::Failing {
            error: "HTTP 404".into()
        }
    );
    assert_eq!(health(&[rejected(400), Outcome::Published]), Health::Up);
}

#[test]
fn a_route_refusing_every_distinct_event_pauses() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
    let t0 = Instant::now();
    for id in 1..FAILING_REQUESTS as i64 {
        assert_eq!(b.record(&[rejected(404)], &[id], t0, t0), None);
    }
    let (until, error) = b
        .record(&[rejected(404)], &[99], t0, t0)
        .expect("paused on the fifth");
    assert_eq!(until, t0 + PAUSE_MIN);
    assert!(
        error.contains("failing") && error.contains("HTTP 404"),
        "{error}"
    );
}

#[test]
fn a_route_with_two_events_pauses_in_an_outage() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
    let t0 = Instant::now();
    let down = || retry(RetryReason::ServerError);
    for i in 1..FAILING_REQUESTS as i64 {
        assert_eq!(b.record(&[down()], &[i % 2], t0, t0), None);
    }
    assert!(b.record(&[down()], &[1], t0, t0).is_some());
}

#[test]
fn events_failing_while_the_route_accepts_others_do_not_pause_it() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
    let t0 = Instant::now();
    let fail = || retry(RetryReason::ServerError);
    b.record(&[fail(), fail(), Outcome::Published], &[1, 2, 3], t0, t0);
    // Events 1 and 2 failed while event 3 was accepted: poison, retried alone.
    let t1 = t0 + Duration::from_millis(50);
    for _ in 0..FAILING_REQUESTS * 3 {
        assert_eq!(b.record(&[fail(), fail()], &[1, 2], t1, t1), None);
    }
    assert_eq!(b.verdict(1, t1, t1), Verdict::Carry);
    // Events failing since the acceptance, with nothing accepted, do pause it.
    for id in 10..10 + FAILING_REQUESTS as i64 - 1 {
        assert_eq!(b.record(&[fail()], &[id], t1, t1), None);
    }
    assert!(b.record(&[fail()], &[99], t1, t1).is_some());
}

#[test]
fn stray_failures_on_a_busy_route_do_not_pause_it() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
    let t0 = Instant::now();
    let mut id = 0;
    for _ in 0..100 {
        // Four whole requests fail in a row, then one gets through.
        for _ in 1..FAILING_REQUESTS {
            id += 1;
            assert_eq!(
                b.record(&[retry(RetryReason::ServerError)], &[id], t0, t0),
                None
            );
        }
        id += 1;
        assert_eq!(
            b.record(
                &[retry(RetryReason::ServerError), Outcome::Published],
                &[id, id + 1],
                t0,
                t0
            ),
            None
        );
        id += 1;
    }
}

#[test]
fn a_verdict_is_carried_out_only_with_a_witness() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    // Every message refused (a deploy blip): nothing is witnessed.
    b.record(&[rejected(404), rejected(404)], &[3, 4], at(0), at(10));
    let first = Verdict::Defer { delay: PAUSE_MIN };
    assert_eq!(b.verdict(3, at(0), at(10)), first);
    // A poison event among accepted ones waits once: its request left
    // before the others were accepted. Refused again by a request sent
    // after that, it is its own fault.
    b.record(
        &[Outcome::Published, rejected(400)],
        &[1, 2],
        at(15),
        at(20),
    );
    assert_eq!(b.verdict(2, at(15), at(20)), first);
    b.record(&[rejected(400)], &[2], at(1020), at(1030));
    assert_eq!(b.verdict(2, at(1020), at(1030)), Verdict::Carry);
    // Event 3's 404 now has one window of acceptances behind it: the blip's
    // refusal and this one may be two outages. After another, its own.
    b.record(&[rejected(404)], &[3], at(1035), at(1040));
    assert_eq!(
        b.verdict(3, at(1035), at(1040)),
        Verdict::Defer {
            delay: 2 * PAUSE_MIN
        }
    );
    b.record(&[Outcome::Published], &[5], at(1050), at(1060));
    b.record(&[rejected(404)], &[3], at(3040), at(3050));
    assert_eq!(b.verdict(3, at(3040), at(3050)), Verdict::Carry);
}

/// Eighteen dead letters of a fresh-clone CI run: rows refused 404 in an
/// outage of every route at 31 s, not sent again until a consumer's 2 s
/// redeploy at 57.5 s refused them 404 once more; the thousands accepted
/// between the two were taken for their witness. Two outages of one kind
/// are not the rows' own failures.
#[test]
fn a_row_caught_by_two_outages_of_one_kind_is_not_dead_lettered() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    // The outage: every message refused.
    b.record(
        &[rejected(404), rejected(404)],
        &[7, 8],
        at(31_000),
        at(31_010),
    );
    assert_ne!(b.verdict(7, at(31_000), at(31_010)), Verdict::Carry);
    // Between the two, the route accepts everything else.
    for n in 0..1000 {
        let sent = at(32_000 + 25 * n);
        b.record(&[Outcome::Published], &[100 + n as i64], sent, sent);
    }
    // The redeploy: refused once more, with the same status, and so are
    // fresh rows sent in it.
    b.record(&[rejected(404)], &[7], at(57_600), at(57_610));
    assert_ne!(b.verdict(7, at(57_600), at(57_610)), Verdict::Carry);
    b.record(&[rejected(404)], &[2000], at(57_605), at(57_615));
    assert_ne!(b.verdict(2000, at(57_605), at(57_615)), Verdict::Carry);
    // Still in it: no acceptance since, and another row began failing
    // after the latest acceptance left.
    b.record(&[rejected(404)], &[7], at(58_700), at(58_710));
    assert_ne!(b.verdict(7, at(58_700), at(58_710)), Verdict::Carry);
    // The redeploy is over and the row is delivered: forgotten.
    b.record(&[Outcome::Published], &[7], at(60_000), at(60_010));
    b.record(&[rejected(404)], &[7], at(61_000), at(61_010));
    assert_ne!(
        b.verdict(7, at(61_000), at(61_010)),
        Verdict::Carry,
        "its next failure starts afresh"
    );
}

/// Poison events refused together, on a route that accepted the rest of its
/// rows and then went quiet: no second window of acceptances will come, and
/// no other event began failing since the route last accepted one, so the
/// route is not what fails.
#[test]
fn poison_events_on_a_route_gone_quiet_are_dead_lettered() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let poison = [1, 2, 3, 4, 5];
    let refused = |sent, now| {
        b.record(&poison.map(|_| rejected(400)), &poison, at(sent), at(now));
        poison.map(|id| b.verdict(id, at(sent), at(now)))
    };
    assert!(
        refused(0, 10).iter().all(|v| *v != Verdict::Carry),
        "together"
    );
    for id in 10..15 {
        b.record(&[Outcome::Published], &[id], at(20), at(30));
    }
    // One window: deferred once more.
    assert!(refused(2000, 2010).iter().all(|v| *v != Verdict::Carry));
    // Nothing else was sent since, and none began failing after the
    // acceptances: carried out.
    assert!(refused(5000, 5010).iter().all(|v| *v == Verdict::Carry));
}

/// The two dead letters of the full-fault adversarial run: rows refused 410
/// twice inside one deploy blip, dead-lettered on the second refusal because
/// a request sent before the blip began was answered 200 after the first.
#[test]
fn an_acceptance_sent_before_a_blip_witnesses_no_refusal_in_it() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let first = Verdict::Defer { delay: PAUSE_MIN };
    // Event 1's request leaves; the blip begins; event 2 is refused.
    assert_eq!(b.record(&[rejected(410)], &[2], at(5), at(10)), None);
    assert_eq!(b.verdict(2, at(5), at(10)), first);
    // Event 1's 200 comes back after that refusal.
    assert_eq!(b.record(&[Outcome::Published], &[1], at(0), at(40)), None);
    // Still in the blip, event 2 is refused again: nothing the destination
    // accepted was sent after its first refusal.
    b.record(&[rejected(410)], &[2], at(1030), at(1061));
    assert_ne!(b.verdict(2, at(1030), at(1061)), Verdict::Carry);
    // The blip is over: a message sent after it is accepted, and event 2's
    // next refusal has one window behind it; after another, its own.
    b.record(&[Outcome::Published], &[3], at(3000), at(3010));
    b.record(&[rejected(410)], &[2], at(4000), at(4010));
    assert_ne!(b.verdict(2, at(4000), at(4010)), Verdict::Carry);
    b.record(&[Outcome::Published], &[4], at(4100), at(4110));
    b.record(&[rejected(410)], &[2], at(6000), at(6010));
    assert_eq!(b.verdict(2, at(6000), at(6010)), Verdict::Carry);
}

/// Row 279 of a full-fault run: an answer it could not read at 2 s, nothing
/// about it for 56 s while the route accepted thousands, then a deploy
/// blip's 404 (its batch refused, then itself alone): dead-lettered on that
/// 404, the acceptances of long before counted as its witness. A witness
/// must come after the row began failing the way it fails now.
#[test]
fn a_witness_counts_from_when_the_row_began_failing_this_way() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    b.record(
        &[retry(RetryReason::UnreadableAnswer)],
        &[279],
        at(2000),
        at(2300),
    );
    b.record(&[Outcome::Published], &[1], at(3000), at(3010));
    // The blip.
    b.record(&[rejected(404)], &[279], at(58_000), at(58_023));
    assert_eq!(
        b.verdict(279, at(58_000), at(58_023)),
        Verdict::Defer { delay: PAUSE_MIN }
    );
    // Still in it: refused again, nothing accepted since the first 404.
    b.record(&[rejected(404)], &[279], at(59_100), at(59_110));
    assert_ne!(b.verdict(279, at(59_100), at(59_110)), Verdict::Carry);
    // After it, another message is accepted; refused once more: one window
    // (the blip and this may be two outages); after another, its own.
    b.record(&[Outcome::Published], &[2], at(60_000), at(60_010));
    b.record(&[rejected(404)], &[279], at(61_000), at(61_010));
    assert_ne!(b.verdict(279, at(61_000), at(61_010)), Verdict::Carry);
    b.record(&[Outcome::Published], &[3], at(61_100), at(61_110));
    b.record(&[rejected(404)], &[279], at(63_000), at(63_010));
    assert_eq!(b.verdict(279, at(63_000), at(63_010)), Verdict::Carry);
}

/// Rows 237 and 6545 of a full-fault run: two poison events, their batch
/// elements refused again and again on a route with nothing else left to
/// send, deferred for minutes as if the route were down. A readable batch
/// answer with an error in the message's slot is the sink judging that
/// message on its own: it witnesses the message's next verdict.
#[test]
fn an_error_element_witnesses_the_next_verdict_of_its_message() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let element = || retry(RetryReason::BatchElement);
    b.record(&[element(), element()], &[237, 6545], at(0), at(10));
    assert_eq!(
        b.verdict(237, at(0), at(10)),
        Verdict::Defer { delay: PAUSE_MIN }
    );
    b.record(&[element(), element()], &[237, 6545], at(1000), at(1010));
    assert_eq!(b.verdict(237, at(1000), at(1010)), Verdict::Carry);
    assert_eq!(b.verdict(6545, at(1000), at(1010)), Verdict::Carry);
}

#[test]
fn pauses_probes_and_backs_off() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
    let t0 = Instant::now();
    let ids: Vec<i64> = (0..FAILING_EVENTS as i64).collect();
    let fail = || Health::Failing {
        error: "500".into(),
    };
    // One event failing alone, again and again: maybe its own fault.
    for _ in 0..FAILING_REQUESTS * 3 {
        assert_eq!(b.record_health(fail(), &ids[..1], t0), None);
    }
    assert_eq!(b.record_health(Health::Up, &ids, t0), None);
    for _ in 1..FAILING_REQUESTS {
        assert_eq!(b.record_health(fail(), &ids, t0), None);
    }
    let (until, _) = b
        .record_health(fail(), &ids, t0)
        .expect("paused at the threshold");
    assert_eq!(until, t0 + PAUSE_MIN);
    assert!(matches!(b.admit(t0), Admit::Paused { .. }));
    // The pause ends: one probe goes, the others wait for it.
    assert_eq!(b.admit(until), Admit::Send);
    assert!(matches!(b.admit(until), Admit::Paused { .. }));
    // Every probe fails: paused twice as long.
    let mut now = until;
    for _ in 1..PROBE_TRIES {
        now = b.record_health(fail(), &ids[..1], now).unwrap().0;
        assert_eq!(b.admit(now), Admit::Send);
    }
    let (again, _) = b.record_health(fail(), &ids[..1], now).unwrap();
    assert_eq!(again, now + PAUSE_MIN * 2);
    // A probe that never reports is given up after the probe timeout.
    assert_eq!(b.admit(again), Admit::Send);
    assert!(matches!(b.admit(again), Admit::Paused { .. }));
    assert_eq!(b.admit(again + Duration::from_secs(2)), Admit::Send);
    assert_eq!(b.record_health(Health::Up, &ids, again), None);
    assert_eq!(b.admit(again), Admit::Send);
}

/// A probe is one request, and any request can meet a stray 5xx, a timeout
/// or an unreadable answer: one such answer to the first request after a
/// deploy blip must not keep the route paused for twice as long. A probe
/// failing so is tried again shortly; only [`PROBE_TRIES`] of them failing in
/// a row, or a refusal of the sink's (credentials, a rate limit, no
/// connection), double the pause.
#[test]
fn a_probe_meeting_a_stray_failure_is_tried_again_soon() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(10));
    let t0 = Instant::now();
    let fail = || Health::Failing {
        error: "unreadable".into(),
    };
    let pause = Duration::from_secs(8);
    // The route has backed off to an 8 s pause in an outage.
    *b.state.lock().unwrap() = State::Open {
        until: t0,
        pause,
        error: "route paused (failing): HTTP 410".into(),
        misses: 0,
    };
    let mut now = t0;
    for _ in 1..PROBE_TRIES {
        assert_eq!(b.admit(now), Admit::Send, "the probe");
        let (until, error) = b.record_health(fail(), &[1], now).expect("still paused");
        assert_eq!(until, now + probe_gap(pause), "tried again soon");
        assert!(probe_gap(pause) <= Duration::from_secs(1));
        assert!(error.contains("HTTP 410"), "the pause's own error: {error}");
        assert!(matches!(b.admit(now), Admit::Paused { .. }));
        now = until;
    }
    // The next one is accepted: the route resumes, the backoff starts over.
    assert_eq!(b.admit(now), Admit::Send);
    assert_eq!(b.record_health(Health::Up, &[1], now), None);
    assert_eq!(b.admit(now), Admit::Send);
    // Every try failing: the pause doubles (up to the longest), as before.
    *b.state.lock().unwrap() = State::Open {
        until: now,
        pause,
        error: "e".into(),
        misses: 0,
    };
    for _ in 1..PROBE_TRIES {
        assert_eq!(b.admit(now), Admit::Send);
        now = b.record_health(fail(), &[1], now).unwrap().0;
    }
    assert_eq!(b.admit(now), Admit::Send);
    let (until, _) = b.record_health(fail(), &[1], now).unwrap();
    assert_eq!(until, now + Duration::from_secs(10));
    // A probe the sink refuses outright doubles it at once.
    assert_eq!(b.admit(until), Admit::Send);
    let down = Health::Down {
        after: None,
        cause: "unauthorized",
        error: "401".into(),
    };
    let (again, _) = b.record_health(down, &[1], until).unwrap();
    assert_eq!(again, until + Duration::from_secs(10));
}

#[test]
fn a_pause_never_outgrows_half_the_lease() {
    assert_eq!(
        longest_pause(Duration::from_secs(10)),
        Duration::from_secs(5)
    );
    assert_eq!(longest_pause(Duration::from_secs(600)), PAUSE_MAX);
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(5));
    let mut now = Instant::now();
    let down = || Health::Down {
        after: None,
        cause: "connect",
        error: "refused".into(),
    };
    let mut pauses = Vec::new();
    for _ in 0..6 {
        let (until, _) = b.record_health(down(), &[1], now).unwrap();
        pauses.push(until - now);
        now = until;
        assert_eq!(b.admit(now), Admit::Send, "the probe");
    }
    assert_eq!(pauses.iter().max(), Some(&Duration::from_secs(5)));
    // A 429 that says when it lifts is believed, even sooner than the backoff.
    let (until, _) = b
        .record_health(
            Health::Down {
                after: Some(Duration::from_millis(300)),
                cause: "rate_limited",
                error: "429".into(),
            },
            &[1],
            now,
        )
        .unwrap();
    assert_eq!(until, now + Duration::from_millis(300));
}

#[test]
fn a_sink_that_asks_for_longer_is_given_it() {
    let b = Breaker::new("r", Duration::from_secs(1), Duration::from_secs(30));
    let t0 = Instant::now();
    let (until, error) = b
        .record_health(
            Health::Down {
                after: Some(Duration::from_secs(30)),
                cause: "rate_limited",
                error: "HTTP 429".into(),
            },
            &[1],
            t0,
        )
        .unwrap();
    assert_eq!(until, t0 + Duration::from_secs(30));
    assert!(error.contains("rate_limited") && error.contains("429"));
    let all = Breakers {
        routes: vec![
            b,
            Breaker::new("s", Duration::from_secs(1), Duration::from_secs(30)),
        ],
    };
    assert_eq!(all.all_paused_until(t0), None, "one route still open");
}

#[test]
fn every_cause_of_a_pause_is_exported() {
    for reason in RetryReason::ALL {
        if let Health::Down { cause, .. } = health(&[retry(reason)]) {
            assert!(PAUSE_CAUSES.contains(&cause), "{cause}");
        }
    }
}
