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

/// Every `interval`: samples the backlog gauges (one query), and decides
/// readiness: is the database reachable, and is delivery moving? Not ready when the oldest pending row is older than `max_pending_age` and
/// nothing was delivered since the previous check.
pub(crate) async fn sample_forever(
    store: Store,
    counters: Arc<Counters>,
    readiness: Arc<Mutex<Readiness>>,
    interval: Duration,
    max_pending_age: Duration,
) {
    let mut last_delivered = delivered(&counters);
    let mut ticker = tokio::time::interval(interval);
    loop {
        ticker.tick().await;
        let now_delivered = delivered(&counters);
        let progress = now_delivered - last_delivered;
        last_delivered = now_delivered;
        let sampled =
            tokio::time::timeout(interval.max(Duration::from_secs(2)), store.snapshot()).await;
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
            Ok(Err(e)) => unreachable_db(format!("database: {e}"), progress),
            Err(_) => unreachable_db("database did not answer in time".into(), progress),
        };
        *readiness.lock().expect("readiness lock") = next;
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

    #[test]
    fn a_hold_for_a_callback_counts_as_progress() {
        let c = Counters::default();
        assert_eq!(delivered(&c), 0);
        c.held.fetch_add(2, Relaxed);
        c.published.fetch_add(1, Relaxed);
        assert_eq!(delivered(&c), 3);
    }
}
