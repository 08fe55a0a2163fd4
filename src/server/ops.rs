//! `/metrics` (Prometheus text), `/healthz` (the process answers) and
//! `/readyz` (the database answers and delivery is not stalled).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;

use metrics::gauge;

use crate::actors::Counters;
use crate::store::stats::Snapshot;
use crate::store::Store;

/// What `/readyz` last learned, refreshed by [`sample_forever`].
#[derive(Debug, Clone, Serialize)]
pub struct Readiness {
    pub ready: bool,
    pub reason: String,
    pub database: bool,
    pub oldest_pending_age_seconds: f64,
    pub delivered_since_last_check: u64,
    #[serde(skip)]
    pub checked_at: Option<Instant>,
}

impl Default for Readiness {
    fn default() -> Self {
        Readiness {
            ready: false,
            reason: "not checked yet".into(),
            database: false,
            oldest_pending_age_seconds: 0.0,
            delivered_since_last_check: 0,
            checked_at: None,
        }
    }
}

#[derive(Clone)]
pub struct OpsState {
    pub metrics: Option<PrometheusHandle>,
    pub readiness: Arc<Mutex<Readiness>>,
}

pub fn router(state: OpsState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { (StatusCode::OK, "ok\n") }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(State(state): State<OpsState>) -> Response {
    match &state.metrics {
        Some(handle) => (
            [("content-type", "text/plain; version=0.0.4")],
            handle.render(),
        )
            .into_response(),
        None => (StatusCode::NOT_FOUND, "metrics are not enabled\n").into_response(),
    }
}

async fn readyz(State(state): State<OpsState>) -> Response {
    let r = state.readiness.lock().expect("readiness lock").clone();
    let status = if r.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(r)).into_response()
}

/// Serves `router` on `addr` until `shutdown` resolves.
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((local, spawn_server(listener, router, shutdown)))
}

/// Serves `router` on `listener` in a task until `shutdown` resolves.
pub(crate) fn spawn_server<L>(
    listener: L,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> tokio::task::JoinHandle<()>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!(error = %e, "HTTP server failed");
        }
    })
}

/// How the sampler paces itself. The snapshot counts every pending row and
/// dead letter, so it costs more the larger the outbox (about 0.2 s at a
/// million pending rows): the next sample waits `interval`, or twenty times
/// as long as the last one took if that is longer, which keeps sampling under
/// 5% of one backend's time however large the backlog grows on the
/// production database. A sample may take three times as long as the last
/// (and at least two seconds, or `interval`) before the database is called
/// unresponsive, so a large backlog alone does not make the relay unready.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Pace {
    interval: Duration,
    last_took: Duration,
}

impl Pace {
    fn new(interval: Duration) -> Pace {
        Pace {
            interval,
            last_took: Duration::ZERO,
        }
    }

    /// From the end of one sample to the start of the next.
    fn wait(&self) -> Duration {
        self.interval.max(self.last_took * 20)
    }

    /// How long a sample may take before readiness says the database did
    /// not answer.
    fn limit(&self) -> Duration {
        self.interval
            .max(Duration::from_secs(2))
            .max(self.last_took * 3)
    }

    /// Is the sampler slower than `interval` asks?
    fn stretched(&self) -> bool {
        self.wait() > self.interval
    }
}

/// Samples the backlog gauges (one query) paced by [`Pace`], and decides
/// readiness: is the database reachable, and is delivery moving? Not ready
/// when the oldest pending row is older than `max_pending_age` and nothing
/// was delivered since the previous check.
pub(crate) async fn sample_forever(
    store: Store,
    counters: Arc<Counters>,
    readiness: Arc<Mutex<Readiness>>,
    interval: Duration,
    max_pending_age: Duration,
) {
    let mut last_delivered = delivered(&counters);
    let mut pace = Pace::new(interval);
    loop {
        let now_delivered = delivered(&counters);
        let progress = now_delivered - last_delivered;
        last_delivered = now_delivered;
        let started = Instant::now();
        let limit = pace.limit();
        let sampled = tokio::time::timeout(limit, store.snapshot()).await;
        let was_stretched = pace.stretched();
        pace.last_took = started.elapsed().min(limit);
        if pace.stretched() != was_stretched {
            if pace.stretched() {
                tracing::warn!(
                    took = ?pace.last_took,
                    every = ?pace.wait(),
                    "the backlog snapshot is slow on this outbox: sampling less often than server.stats_interval, to spare the database"
                );
            } else {
                tracing::info!(every = ?interval, "backlog sampling back to server.stats_interval");
            }
        }
        let next = match sampled {
            Ok(Ok(snapshot)) => {
                record_snapshot(&snapshot);
                let age = snapshot.oldest_pending_age_seconds;
                let stalled = age > max_pending_age.as_secs_f64() && progress == 0;
                Readiness {
                    ready: !stalled,
                    reason: if stalled {
                        format!(
                            "oldest pending event is {age:.0}s old (limit {}s) and nothing was delivered since the last check",
                            max_pending_age.as_secs()
                        )
                    } else {
                        "ok".into()
                    },
                    database: true,
                    oldest_pending_age_seconds: age,
                    delivered_since_last_check: progress,
                    checked_at: Some(Instant::now()),
                }
            }
            // The store's errors say "database: …" themselves.
            Ok(Err(e)) => unreachable_db(e.to_string(), progress),
            Err(_) => unreachable_db("database did not answer in time".into(), progress),
        };
        *readiness.lock().expect("readiness lock") = next;
        tokio::time::sleep(pace.wait()).await;
    }
}

fn unreachable_db(reason: String, progress: u64) -> Readiness {
    Readiness {
        ready: false,
        reason,
        database: false,
        delivered_since_last_check: progress,
        checked_at: Some(Instant::now()),
        ..Default::default()
    }
}

/// Events that moved on: published, dead-lettered, or taken by QStash for
/// an ordered route (held for its callback, which the callback listener
/// writes without passing through these counters).
fn delivered(c: &Counters) -> u64 {
    use std::sync::atomic::Ordering::Relaxed;
    c.published.load(Relaxed) + c.dead_lettered.load(Relaxed) + c.held.load(Relaxed)
}

/// Sets the gauges sampled from the database.
fn record_snapshot(s: &Snapshot) {
    use crate::metrics::names;
    gauge!(names::BACKLOG).set(s.backlog as f64);
    gauge!(names::OLDEST_PENDING_AGE_SECONDS).set(s.oldest_pending_age_seconds);
    gauge!(names::DEAD_LETTERS).set(s.dead_letters as f64);
    gauge!(names::FLAPPING).set(s.flapping as f64);
    gauge!(names::STUCK_LEASES).set(s.stuck_leases as f64);
    gauge!(names::OUTBOX_DEAD_TUPLES).set(s.outbox_dead_tuples as f64);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering::Relaxed;

    /// A database the pool cannot connect to: `/readyz` says why (the
    /// attempt's own error), not only that the pool timed out.
    #[tokio::test]
    async fn readiness_names_why_the_database_cannot_be_reached() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
        let store = Store::open(&url, 2, Duration::from_millis(300)).unwrap();
        let readiness = Arc::new(Mutex::new(Readiness::default()));
        let sampler = tokio::spawn(sample_forever(
            store,
            Arc::new(Counters::default()),
            Arc::clone(&readiness),
            Duration::from_millis(100),
            Duration::from_secs(300),
        ));
        let deadline = Instant::now() + Duration::from_secs(30);
        let r = loop {
            let r = readiness.lock().unwrap().clone();
            if r.checked_at.is_some() || Instant::now() > deadline {
                break r;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        sampler.abort();
        assert!(!r.ready && !r.database, "{r:?}");
        assert!(
            r.reason.to_lowercase().contains("connection refused")
                && !r.reason.starts_with("database: database"),
            "{r:?}"
        );
    }

    #[test]
    fn a_slow_snapshot_spaces_the_next_and_is_not_called_unresponsive() {
        let every = Duration::from_secs(5);
        let mut pace = Pace::new(every);
        assert_eq!(pace.wait(), every);
        assert_eq!(pace.limit(), every);
        assert!(!pace.stretched());
        // A small outbox: the interval rules.
        pace.last_took = Duration::from_millis(20);
        assert_eq!(pace.wait(), every);
        assert!(!pace.stretched());
        // 0.9 s (a few million pending rows): the next sample waits 18 s, so
        // sampling stays at 5% of a backend; 2.5 s is not "unresponsive"
        // after that.
        pace.last_took = Duration::from_millis(900);
        assert_eq!(pace.wait(), Duration::from_secs(18));
        assert!(pace.stretched());
        assert_eq!(pace.limit(), every);
        pace.last_took = Duration::from_millis(2_500);
        assert_eq!(pace.wait(), Duration::from_secs(50));
        assert_eq!(pace.limit(), Duration::from_millis(7_500));
        // A short interval still gives the database two seconds.
        assert_eq!(
            Pace::new(Duration::from_millis(200)).limit(),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn a_hold_for_a_callback_counts_as_progress() {
        let c = Counters::default();
        assert_eq!(delivered(&c), 0);
        c.held.fetch_add(2, Relaxed);
        c.published.fetch_add(1, Relaxed);
        assert_eq!(delivered(&c), 3);
    }
}
