//! The long-lived process: the HTTP endpoints, the actor tree, and signals.
//! SIGTERM or SIGINT stops it gracefully; a second signal exits at once.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_client::consumer::qstash::Verifier;

use crate::config::Config;
use crate::relay::{DrainReport, Relay};
use crate::server::callback::{self, CallbackOptions};
use crate::server::ops::{self, OpsState, Readiness};
use crate::store::Store;

/// Starts the relay; a database that cannot be reached (or drops the
/// connection) at start is tried again 0.5, 1, 2, … s later while that stays
/// within `database.connect_timeout` of the first attempt (three more tries at
/// the default 5 s); then the last attempt's error is returned. Configuration
/// and schema problems, and errors the server reported (authentication, a
/// missing database), stop it at once.
async fn start(config: &Config) -> Result<Relay, crate::relay::RelayError> {
    let started = Instant::now();
    let mut delay = Duration::from_millis(500);
    loop {
        match Relay::start(config.clone()).await {
            Err(e)
                if e.is_transient()
                    && started.elapsed() + delay <= config.database.connect_timeout =>
            {
                tracing::warn!(error = %e, retry_in = ?delay, "cannot reach the database (database.url) at start; retrying");
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            other => return other,
        }
    }
}

/// The failure-callback listener's guards: QStash signs the URL it calls, so
/// the routes' `failure_callback` URLs are the only `sub` accepted; a report
/// carries the message and the response in base64, so it may be about three
/// times `http.max_message_bytes`.
fn callback_options(config: &Config) -> CallbackOptions {
    let urls = |pick: fn(&crate::routes::RouteConfig) -> Option<&str>| {
        let mut urls: Vec<String> = config
            .routes
            .iter()
            .filter_map(|r| pick(r).map(str::to_owned))
            .collect();
        urls.sort_unstable();
        urls.dedup();
        urls
    };
    let failure = urls(|r| r.failure_callback.as_ref().map(|u| u.as_str()));
    let callback = urls(|r| r.callback.as_ref().map(|u| u.as_str()));
    if failure.is_empty() && callback.is_empty() {
        tracing::warn!("server.callback_bind is set but no route names a failure_callback or a callback: every report will be refused");
    }
    let mut options = CallbackOptions::new(failure);
    options.callback_urls = callback;
    if let Some(hold) = config.routes.iter().filter_map(|r| r.callback_hold()).max() {
        options.hold = hold;
    }
    options.max_body_bytes = options
        .max_body_bytes
        .max(config.http.max_message_bytes.saturating_mul(3));
    options
}

/// Serves QStash's failure and delivery callbacks on `server.callback_bind`,
/// when it is set, until `stop` changes. Counts the rows they dead-letter.
async fn serve_callbacks(
    config: &Config,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<Arc<AtomicU64>> {
    let Some(addr) = config.server.callback_bind else {
        return Ok(Arc::default());
    };
    let options = callback_options(config);
    let dead_lettered = Arc::clone(&options.dead_lettered);
    let verifier = Verifier::new(
        config.qstash.current_signing_key.expose(),
        Some(config.qstash.next_signing_key.expose()).filter(|k| !k.is_empty()),
    )
    .with_tolerance(config.server.signature_tolerance);
    // A pool of its own: the actors, the sampler or a janitor's long pass
    // never keep a callback waiting for a connection.
    let store = Store::open_with(&config.database.url, &config.database.callback_pool())?;
    let (local, _task) = callback::serve(addr, store, verifier, options, async move {
        let _ = stop.changed().await;
    })
    .await
    .map_err(|e| anyhow::anyhow!("server.callback_bind {addr}: {e}"))?;
    tracing::info!(%local, "serving POST /qstash/failure and /qstash/callback");
    Ok(dead_lettered)
}

/// The one-shot `drain`: runs the relay until nothing is due (or
/// `max_duration` passes), then stops it gracefully. An ordered QStash route
/// holds each event QStash took until its delivery callback, so the callback
/// listener runs meanwhile and `drain` ends once those callbacks are in.
pub async fn drain(config: Config, max_duration: Option<Duration>) -> anyhow::Result<DrainReport> {
    let started = Instant::now();
    let relay = start(&config).await?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let dead_by_callbacks = match serve_callbacks(&config, stop_rx).await {
        Ok(count) => count,
        Err(e) => {
            relay.shutdown().await;
            return Err(e);
        }
    };
    let report = relay
        .drain_started(max_duration, started, &dead_by_callbacks)
        .await;
    let _ = stop_tx.send(true);
    Ok(report?)
}

/// Registers every metric at 0 with the label sets this config can produce
/// (`metrics::export_at_zero`).
fn export_metrics_at_zero(config: &Config) {
    use crate::sink::{DeadReason, RetryReason};
    let routes: Vec<String> = crate::routes::Router::new(&config.routes)
        .routes()
        .iter()
        .map(|r| r.name.clone())
        .collect();
    crate::metrics::export_at_zero(&crate::metrics::KnownLabels {
        routes: &routes,
        retry_reasons: &RetryReason::ALL.map(|r| r.as_str()),
        dead_reasons: &DeadReason::ALL.map(|r| r.as_str()),
        pause_causes: &crate::sink::breaker::PAUSE_CAUSES,
        defer_causes: &crate::actors::marker::DeferCause::ALL.map(|c| c.as_str()),
        callback_outcomes: &callback::CALLBACK_OUTCOMES,
        handover_kinds: &crate::actors::coordinator::HANDOVER_KINDS,
        key_claim_kinds: &crate::actors::claim_plan::KEY_CLAIM_KINDS,
        actors: &crate::actors::supervisor::Child::LABELS,
        sinks: &crate::sink::http::SINK_LABELS,
    });
}

/// Runs until SIGTERM or SIGINT (exit 0), or until the actor tree gives up.
pub async fn run_until_signal(config: Config) -> anyhow::Result<()> {
    let metrics = match crate::metrics::install() {
        Ok(handle) => {
            export_metrics_at_zero(&config);
            Some(handle)
        }
        Err(e) => {
            tracing::warn!(error = %e, "metrics recorder not installed");
            None
        }
    };
    tracing::info!(config = %serde_json::to_string(&config.redacted())?, "outbox-relay starting");
    let mut relay = start(&config).await?;
    let readiness = Arc::new(Mutex::new(Readiness::default()));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // The sampler and the janitor have a connection each, apart from the actors'.
    let db = &config.database;
    let sampler = tokio::spawn(ops::sample_forever(
        Store::open_with(&db.url, &db.sampler_pool())?,
        relay.counters_handle(),
        Arc::clone(&readiness),
        config.server.stats_interval,
        config.server.ready_max_pending_age,
    ));
    if let Some(addr) = config.server.metrics_bind {
        let router = ops::router(OpsState {
            metrics,
            readiness: Arc::clone(&readiness),
        });
        let mut rx = stop_rx.clone();
        let (local, _task) = ops::serve(addr, router, async move {
            let _ = rx.changed().await;
        })
        .await
        .map_err(|e| anyhow::anyhow!("server.metrics_bind {addr}: {e}"))?;
        tracing::info!(%local, "serving /metrics, /healthz, /readyz");
    }
    serve_callbacks(&config, stop_rx.clone()).await?;
    let janitor = tokio::spawn({
        let mut rx = stop_rx.clone();
        let store = Store::open_with(&db.url, &db.janitor_pool())?;
        crate::janitor::run_janitor(store, config.janitor.clone(), async move {
            let _ = rx.changed().await;
        })
    });
    tracing::info!("outbox-relay running");

    let signals = Signals::new()?;
    tokio::pin!(signals);
    let failed = tokio::select! {
        _ = signals.next() => false,
        _ = relay.stopped() => true,
    };
    if failed {
        sampler.abort();
        anyhow::bail!("the relay stopped: an actor exhausted its restart budget (see the log)");
    }
    tracing::info!(grace = ?config.relay.shutdown_grace, "stopping: finishing in-flight work");
    let report = tokio::select! {
        report = relay.shutdown() => report,
        _ = signals.next() => {
            tracing::warn!("second signal: exiting now; leases will expire");
            std::process::exit(130);
        }
    };
    let _ = stop_tx.send(true);
    sampler.abort();
    let _ = janitor.await;
    tracing::info!(
        published = report.counters.published,
        retried = report.counters.retried,
        dead_lettered = report.counters.dead_lettered,
        released = report.released,
        "stopped"
    );
    Ok(())
}

/// SIGTERM and SIGINT as one stream.
struct Signals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Signals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    async fn next(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}
