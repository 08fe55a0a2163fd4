//! Progress of the adversarial scenario, per route: the count of settled rows
//! (published + dead-lettered) of each route, sampled every [`SAMPLE_EVERY`],
//! and the longest stretch each route stayed flat while it had rows pending.
//!
//! A route's stall clock is excused only by outages that hit it: one of the
//! whole sink, or one of its own destination path. So while one route is
//! down the other is measured on its own (a count summed over routes would
//! hide it stalling behind the other's progress), and the route that was down
//! must settle rows again within a lease of its outage's end.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::scenario::SecondRoute;
use outbox_testkit::sink::OutageWindow;

/// How often the harness samples progress.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// The main route's destination path on the sink.
pub const MAIN_PATH: &str = "/hook";

/// Settled and pending rows of one route.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteProgress {
    pub settled: i64,
    pub pending: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgressSample {
    pub at_us: i64,
    pub settled: i64,
    pub pending: i64,
    /// Per route, by its destination path on the sink (`/hook`,
    /// `/hook/invoices`). Empty: only the totals were sampled.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub routes: BTreeMap<String, RouteProgress>,
}

/// Settled and pending rows per route (`path`, settled, pending): the second
/// route's rows are those of its event type, the main route has the rest.
pub fn progress_query(second: Option<&SecondRoute>) -> String {
    let route = match second {
        Some(r) => {
            let cond = match r.event_type.strip_suffix('*') {
                Some(prefix) => format!("starts_with(event_type, {})", quote(prefix)),
                None => format!("event_type = {}", quote(&r.event_type)),
            };
            format!(
                "CASE WHEN {cond} THEN {} ELSE {} END",
                quote(&r.path),
                quote(MAIN_PATH)
            )
        }
        None => quote(MAIN_PATH),
    };
    format!(
        "SELECT {route},
  count(*) FILTER (WHERE published_at IS NOT NULL OR dead_lettered_at IS NOT NULL),
  count(*) FILTER (WHERE published_at IS NULL AND dead_lettered_at IS NULL)
FROM outbox GROUP BY 1"
    )
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// A sample from the rows of [`progress_query`].
pub fn sample(at_us: i64, rows: impl IntoIterator<Item = (String, i64, i64)>) -> ProgressSample {
    let routes: BTreeMap<String, RouteProgress> = rows
        .into_iter()
        .map(|(path, settled, pending)| (path, RouteProgress { settled, pending }))
        .collect();
    ProgressSample {
        at_us,
        settled: routes.values().map(|r| r.settled).sum(),
        pending: routes.values().map(|r| r.pending).sum(),
        routes,
    }
}

/// A stretch without progress: from `start` (unix µs), `len` µs long, on
/// `route` (`None`: the totals).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Flat {
    pub route: Option<String>,
    pub start: i64,
    pub len: i64,
}

/// The longest stretch the totals stayed flat with rows pending, outages
/// included; and the longest any route stayed flat with rows of its own
/// pending, the outages that hit that route excepted (the totals, with
/// sink-wide outages excepted, when the samples have no routes).
pub fn stalls(samples: &[ProgressSample], outages: &[OutageWindow]) -> (Flat, Flat) {
    let totals: Vec<(i64, RouteProgress)> = samples
        .iter()
        .map(|s| {
            let p = RouteProgress {
                settled: s.settled,
                pending: s.pending,
            };
            (s.at_us, p)
        })
        .collect();
    let raw = flat(&totals, &[]);
    let mut paths: Vec<&String> = samples.iter().flat_map(|s| s.routes.keys()).collect();
    paths.sort();
    paths.dedup();
    if paths.is_empty() {
        let wide: Vec<&OutageWindow> = outages.iter().filter(|o| o.route.is_none()).collect();
        return (raw.clone(), flat(&totals, &wide));
    }
    let mut charged = Flat::default();
    for path in paths {
        let series: Vec<(i64, RouteProgress)> = samples
            .iter()
            .map(|s| (s.at_us, s.routes.get(path).copied().unwrap_or_default()))
            .collect();
        let hit: Vec<&OutageWindow> = outages
            .iter()
            .filter(|o| o.route.as_ref().is_none_or(|r| r == path))
            .collect();
        let f = flat(&series, &hit);
        if f.len > charged.len || charged.route.is_none() {
            charged = Flat {
                route: Some(path.clone()),
                ..f
            };
        }
    }
    (raw, charged)
}

/// The longest flat stretch of `series` with rows pending; the time of
/// `excused` outages does not count (a stretch's clock restarts when one
/// ends, and stands still while one lasts).
fn flat(series: &[(i64, RouteProgress)], excused: &[&OutageWindow]) -> Flat {
    let Some(&(first, _)) = series.first() else {
        return Flat::default();
    };
    let mut since = first;
    let mut longest = Flat {
        route: None,
        start: first,
        len: 0,
    };
    for w in series.windows(2) {
        let ((_, prev), (at, cur)) = (w[0], w[1]);
        if cur.settled > prev.settled || prev.pending == 0 {
            since = at;
            continue;
        }
        for o in excused {
            if o.start_us <= at {
                since = since.max(o.end_us.min(at));
            }
        }
        if at - since > longest.len {
            longest = Flat {
                route: None,
                start: since,
                len: at - since,
            };
        }
    }
    longest
}

/// From `at_us` (an outage's end, a fault) to the first sample after it
/// with more rows settled; `None` when nothing was pending then, or nothing
/// settled afterwards.
pub fn resumed_after(samples: &[ProgressSample], at_us: i64) -> Option<f64> {
    let then = samples.iter().rev().find(|s| s.at_us <= at_us)?;
    if then.pending == 0 {
        return None;
    }
    samples
        .iter()
        .find(|s| s.at_us > at_us && s.settled > then.settled)
        .map(|s| (s.at_us - at_us) as f64 / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_testkit::sink::OutageKind;

    const S: i64 = 1_000_000;

    /// `(path, settled, pending)`.
    type Route<'a> = (&'a str, i64, i64);

    /// `(second, routes)`.
    fn samples(points: &[(i64, &[Route<'_>])]) -> Vec<ProgressSample> {
        points
            .iter()
            .map(|&(t, routes)| sample(t * S, routes.iter().map(|&(p, s, n)| (p.to_owned(), s, n))))
            .collect()
    }

    fn outage(from: i64, to: i64, route: Option<&str>) -> OutageWindow {
        OutageWindow {
            kind: OutageKind::ServerError,
            start_us: from * S,
            end_us: to * S,
            route: route.map(str::to_owned),
        }
    }

    #[test]
    fn a_route_stalled_behind_the_others_progress_is_a_stall() {
        // /hook settles nothing from 10 s to 24 s while /hook/invoices keeps
        // settling: the totals move all along.
        let s = samples(&[
            (0, &[("/hook", 0, 50), ("/hook/invoices", 0, 50)]),
            (10, &[("/hook", 20, 30), ("/hook/invoices", 10, 40)]),
            (17, &[("/hook", 20, 30), ("/hook/invoices", 20, 30)]),
            (24, &[("/hook", 20, 30), ("/hook/invoices", 30, 20)]),
            (25, &[("/hook", 50, 0), ("/hook/invoices", 50, 0)]),
        ]);
        let (raw, charged) = stalls(&s, &[]);
        assert_eq!(raw.len, 0, "the totals never stood still");
        assert_eq!(charged.route.as_deref(), Some("/hook"));
        assert_eq!((charged.start, charged.len), (10 * S, 14 * S));
        // An outage of the other route excuses nothing on this one; one of
        // its own does.
        let (_, charged) = stalls(&s, &[outage(10, 24, Some("/hook/invoices"))]);
        assert_eq!(charged.len, 14 * S);
        let (_, charged) = stalls(&s, &[outage(10, 20, Some("/hook"))]);
        assert_eq!((charged.start, charged.len), (20 * S, 4 * S));
    }

    #[test]
    fn a_route_down_is_excused_only_while_it_is_down() {
        // /hook/invoices down from 5 s to 17 s, flat until 30 s: 13 s after
        // its outage's end. /hook flows.
        let s = samples(&[
            (0, &[("/hook", 0, 50), ("/hook/invoices", 0, 20)]),
            (5, &[("/hook", 10, 40), ("/hook/invoices", 5, 15)]),
            (17, &[("/hook", 30, 20), ("/hook/invoices", 5, 15)]),
            (30, &[("/hook", 50, 0), ("/hook/invoices", 5, 15)]),
            (31, &[("/hook", 50, 0), ("/hook/invoices", 20, 0)]),
        ]);
        let (_, charged) = stalls(&s, &[outage(5, 17, Some("/hook/invoices"))]);
        assert_eq!(charged.route.as_deref(), Some("/hook/invoices"));
        assert_eq!((charged.start, charged.len), (17 * S, 13 * S));
        // A route with nothing pending is no stall.
        let idle = samples(&[(0, &[("/hook", 5, 0)]), (30, &[("/hook", 5, 0)])]);
        assert_eq!(stalls(&idle, &[]).1.len, 0);
    }

    #[test]
    fn the_route_of_a_row_is_its_event_type() {
        let second = SecondRoute {
            event_type: "invoice.*".into(),
            path: "/hook/invoices".into(),
            ordering: Default::default(),
        };
        let q = progress_query(Some(&second));
        assert!(
            q.contains("CASE WHEN starts_with(event_type, 'invoice.') THEN '/hook/invoices' ELSE '/hook' END"),
            "{q}"
        );
        assert!(progress_query(None).starts_with("SELECT '/hook',"));
    }
}
