//! A QStash consumer that handles each outbox event once.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1/app \
//! QSTASH_CURRENT_SIGNING_KEY=sig_… QSTASH_NEXT_SIGNING_KEY=sig_… \
//! cargo run --example consumer -- [CONSUMER_NAME]
//! ```
//!
//! The handler lives in `outbox_relay::consumer::example` so tests can run it.

use outbox_relay::consumer::example::{self, ExampleConfig, ExampleConsumer};
use outbox_relay::consumer::Verifier;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let mut config = ExampleConfig::from_env().map_err(anyhow::Error::msg)?;
    if let Some(name) = std::env::args().nth(1) {
        config.consumer = name;
    }
    let pool =
        outbox_relay::store::pool(&config.database_url, 8, std::time::Duration::from_secs(5))?;
    example::prepare(&pool).await?;
    let verifier = Verifier::new(
        &config.current_signing_key,
        config.next_signing_key.as_deref(),
    )
    .with_tolerance(config.clock_tolerance);
    let listener = tokio::net::TcpListener::bind(config.bind).await?;
    tracing::info!(addr = %listener.local_addr()?, consumer = %config.consumer, "consumer listening");
    let consumer = ExampleConsumer {
        pool,
        verifier,
        consumer: config.consumer,
        subject: config.subject,
    };
    example::serve(listener, consumer, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
