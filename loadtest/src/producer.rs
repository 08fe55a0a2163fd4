//! Load producers: events written the way an application writes them
//! (`outbox_client::enqueue_many` in its own transactions, paced or flat out),
//! or a backlog preloaded with binary COPY.
//!
//! Events are spread over `tenants` tenants and `partition_keys` keys (each key
//! belongs to one tenant), picked uniformly or with a zipf-like skew, with
//! ~200-byte JSON payloads. A fraction can carry the sink's poison marker
//! (`"poison": true` in the payload). Latency is later measured from each
//! row's `created_at` (`now()` of its transaction), so nothing per event is
//! kept here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use outbox_client::{enqueue_many, NewEvent};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_postgres::binary_copy::BinaryCopyInWriter;
use tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};
use uuid::Uuid;

/// `application_name` of every harness connection; the chaos scenario spares them.
pub const APPLICATION_NAME: &str = "loadtest";

#[derive(Debug, thiserror::Error)]
pub enum ProduceError {
    #[error("database: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("enqueue: {0}")]
    Enqueue(#[from] outbox_client::EnqueueError),
    #[error("database URL: {0}")]
    Url(String),
    #[error("{0}")]
    Spec(String),
    #[error("producer task failed: {0}")]
    Join(String),
}

/// How keys are picked.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Skew {
    /// Every key equally likely.
    #[default]
    Uniform,
    /// Key `i` (from 0) has weight `1 / (i + 1)^s`: `{ zipf = 1.1 }`.
    Zipf(f64),
}

/// What the generated events look like.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EventMix {
    pub tenants: u32,
    pub partition_keys: u32,
    pub skew: Skew,
    /// Fraction of events carrying `"poison": true`.
    pub poison_fraction: f64,
    pub seed: u64,
}

impl Default for EventMix {
    fn default() -> Self {
        EventMix {
            tenants: 10,
            partition_keys: 1000,
            skew: Skew::Uniform,
            poison_fraction: 0.0,
            seed: 1,
        }
    }
}

impl EventMix {
    pub fn validate(&self) -> Result<(), String> {
        if self.tenants == 0 || self.partition_keys == 0 {
            return Err("tenants and partition_keys must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.poison_fraction) {
            return Err("poison_fraction must be between 0 and 1".into());
        }
        if let Skew::Zipf(s) = self.skew {
            if !(s.is_finite() && s > 0.0) {
                return Err("zipf exponent must be a positive number".into());
            }
        }
        Ok(())
    }
}

/// One generated event, before it becomes a row.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedEvent {
    pub tenant_id: Uuid,
    pub aggregate_id: String,
    pub event_type: &'static str,
    pub partition_key: String,
    /// Compact JSON object.
    pub payload: String,
    pub idempotency_key: String,
    pub poison: bool,
}

pub const AGGREGATE_TYPE: &str = "account";
const EVENT_TYPES: [&str; 4] = [
    "order.placed",
    "order.paid",
    "order.shipped",
    "invoice.issued",
];

impl GeneratedEvent {
    pub fn to_new_event(&self) -> NewEvent {
        NewEvent::new(
            self.tenant_id,
            AGGREGATE_TYPE,
            self.aggregate_id.clone(),
            self.event_type,
            serde_json::from_str(&self.payload).expect("generated payloads are JSON"),
            self.idempotency_key.clone(),
        )
        .with_partition_key(self.partition_key.clone())
    }
}

/// Deterministic event source: the same mix, stream name and seed give the same events.
pub struct EventGen {
    rng: StdRng,
    tenants: Vec<Uuid>,
    /// Cumulative weights for zipf; empty for uniform.
    cdf: Vec<f64>,
    keys: u32,
    poison_fraction: f64,
    key_prefix: String,
    seq: u64,
    /// `(r, m)`: only keys `k` with `k % m == r`.
    key_share: Option<(u32, u32)>,
}

impl EventGen {
    /// Restricts this generator to keys `k` with `k % of == share` (their
    /// relative weights unchanged), so concurrent producers own disjoint keys.
    /// Ignored when there are fewer keys than shares.
    pub fn own_keys(mut self, share: u32, of: u32) -> Self {
        if of > 1 && self.keys >= of {
            self.key_share = Some((share % of, of));
        }
        self
    }

    /// `stream` names this generator in idempotency keys (`{stream}-{seq}`): give
    /// each concurrent generator of a run its own.
    pub fn new(mix: &EventMix, stream: &str, stream_index: u64) -> Self {
        // Tenants depend on the mix seed only, so all streams share them.
        let mut tenant_rng = StdRng::seed_from_u64(mix.seed);
        let tenants = (0..mix.tenants)
            .map(|_| Uuid::from_u128(tenant_rng.random()))
            .collect();
        let cdf = match mix.skew {
            Skew::Uniform => Vec::new(),
            Skew::Zipf(s) => {
                let mut acc = 0.0;
                let mut cdf: Vec<f64> = (0..mix.partition_keys)
                    .map(|i| {
                        acc += 1.0 / ((i + 1) as f64).powf(s);
                        acc
                    })
                    .collect();
                let total = acc;
                cdf.iter_mut().for_each(|c| *c /= total);
                cdf
            }
        };
        EventGen {
            rng: StdRng::seed_from_u64(mix.seed ^ stream_index.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            tenants,
            cdf,
            keys: mix.partition_keys,
            poison_fraction: mix.poison_fraction,
            key_prefix: stream.to_owned(),
            seq: 0,
            key_share: None,
        }
    }

    pub fn pick_key(&mut self) -> u32 {
        loop {
            let k = self.draw_key();
            if self.key_share.is_none_or(|(r, m)| k % m == r) {
                return k;
            }
        }
    }

    fn draw_key(&mut self) -> u32 {
        if self.cdf.is_empty() {
            return self.rng.random_range(0..self.keys);
        }
        let u: f64 = self.rng.random();
        (self.cdf.partition_point(|c| *c < u) as u32).min(self.keys - 1)
    }

    pub fn next_event(&mut self) -> GeneratedEvent {
        let key = self.pick_key();
        let tenant_id = self.tenants[key as usize % self.tenants.len()];
        let seq = self.seq;
        self.seq += 1;
        let poison = self.poison_fraction > 0.0 && self.rng.random::<f64>() < self.poison_fraction;
        let event_type = EVENT_TYPES[self.rng.random_range(0..EVENT_TYPES.len())];
        let account = format!("acct-{key:06}");
        let amount: u32 = self.rng.random_range(100..1_000_000);
        let qty: u8 = self.rng.random_range(1..9);
        let sku: u16 = self.rng.random_range(1000..9999);
        let poison_field = if poison { r#","poison":true"# } else { "" };
        let payload = format!(
            r#"{{"accountId":"{account}","orderId":"ord-{}-{seq}","amountCents":{amount},"currency":"EUR","items":[{{"sku":"SKU-{sku}","qty":{qty}}}],"channel":"web","shipTo":{{"country":"DE","city":"Berlin"}},"note":"load test event, padded to a realistic size"{poison_field}}}"#,
            self.key_prefix
        );
        GeneratedEvent {
            tenant_id,
            aggregate_id: account.clone(),
            event_type,
            partition_key: format!("{AGGREGATE_TYPE}:{account}"),
            payload,
            idempotency_key: format!("{}-{seq}", self.key_prefix),
            poison,
        }
    }
}

/// A paced or flat-out load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadSpec {
    /// Events per second over all connections; flat out when absent.
    pub rate: Option<f64>,
    /// Stop after this long ...
    #[serde(with = "humantime_serde")]
    pub duration: Duration,
    /// ... or after this many events, whichever comes first.
    pub max_events: Option<u64>,
    pub connections: u32,
    /// Events per transaction (one `enqueue_many` each).
    pub events_per_tx: u32,
    /// `synchronous_commit` of the producer sessions (off lets one box produce faster).
    pub synchronous_commit: bool,
    #[serde(flatten)]
    pub mix: EventMix,
}

impl Default for LoadSpec {
    fn default() -> Self {
        LoadSpec {
            rate: Some(1000.0),
            duration: Duration::from_secs(10),
            max_events: None,
            connections: 4,
            events_per_tx: 10,
            synchronous_commit: false,
            mix: EventMix::default(),
        }
    }
}

impl LoadSpec {
    pub fn validate(&self) -> Result<(), String> {
        if self.connections == 0 || self.events_per_tx == 0 {
            return Err("connections and events_per_tx must be at least 1".into());
        }
        if let Some(r) = self.rate {
            if !(r.is_finite() && r > 0.0) {
                return Err("rate must be a positive number of events per second".into());
            }
        }
        self.mix.validate()
    }
}

/// What a producer run did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProduceStats {
    /// Rows committed (duplicates of an idempotency key excluded).
    pub events: u64,
    pub transactions: u64,
    pub poison: u64,
    pub elapsed_secs: f64,
}

impl ProduceStats {
    pub fn events_per_sec(&self) -> f64 {
        if self.elapsed_secs > 0.0 {
            self.events as f64 / self.elapsed_secs
        } else {
            0.0
        }
    }
}

/// Live counters a progress display can read while producers run.
#[derive(Debug, Default)]
pub struct ProduceProgress {
    pub events: AtomicU64,
}

/// Opens a harness connection (named [`APPLICATION_NAME`]).
pub async fn connect(url: &str) -> Result<tokio_postgres::Client, ProduceError> {
    let (mut config, tls) =
        outbox_relay::store::parse_with_tls(url).map_err(|e| ProduceError::Url(e.to_string()))?;
    config.application_name(APPLICATION_NAME);
    let (client, connection) = config.connect(tls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "loadtest connection closed");
        }
    });
    Ok(client)
}

/// Runs `spec` against `url` until its duration or event count is reached,
/// or `stop` turns true. `run_tag` keeps idempotency keys unique across runs.
pub async fn produce(
    url: &str,
    spec: &LoadSpec,
    run_tag: &str,
    progress: Option<Arc<ProduceProgress>>,
    stop: Option<watch::Receiver<bool>>,
) -> Result<ProduceStats, ProduceError> {
    spec.validate().map_err(ProduceError::Spec)?;
    let started = Instant::now();
    let deadline = started + spec.duration;
    let next_tx = Arc::new(AtomicU64::new(0));
    let k = spec.events_per_tx as u64;
    let max_tx = spec.max_events.map(|m| m.div_ceil(k));
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..spec.connections {
        let client = connect(url).await?;
        if !spec.synchronous_commit {
            client.batch_execute("SET synchronous_commit = off").await?;
        }
        let spec = spec.clone();
        let next_tx = Arc::clone(&next_tx);
        let progress = progress.clone();
        let mut stop = stop.clone();
        let stream = format!("{run_tag}-w{worker}");
        tasks.spawn(async move {
            let mut client = client;
            // Each key has one producer, committing its events one transaction
            // after the other, as an application serializes an aggregate's
            // writers: per key, id order is then commit order, which is what
            // per-key ordering can promise (two open transactions of one key
            // have no order a relay could see).
            let mut gen = EventGen::new(&spec.mix, &stream, worker as u64 + 1)
                .own_keys(worker, spec.connections);
            let mut stats = ProduceStats::default();
            loop {
                if stop.as_ref().is_some_and(|s| *s.borrow()) {
                    break;
                }
                let tx_index = next_tx.fetch_add(1, Ordering::Relaxed);
                if max_tx.is_some_and(|m| tx_index >= m) {
                    break;
                }
                if let Some(rate) = spec.rate {
                    // Interval pacing from one shared clock: transaction i is due
                    // at i·K/rate; a late worker catches up without sleeping.
                    let due = started + Duration::from_secs_f64(tx_index as f64 * k as f64 / rate);
                    if due >= deadline {
                        break;
                    }
                    if let Some(stop) = stop.as_mut() {
                        tokio::select! {
                            _ = tokio::time::sleep_until(due.into()) => {}
                            _ = stop.wait_for(|s| *s) => break,
                        }
                    } else {
                        tokio::time::sleep_until(due.into()).await;
                    }
                } else if Instant::now() >= deadline {
                    break;
                }
                let n = match (spec.max_events, max_tx) {
                    // The last transaction may be short so the count is exact.
                    (Some(m), Some(mt)) if tx_index + 1 == mt => m - tx_index * k,
                    _ => k,
                };
                let generated: Vec<GeneratedEvent> = (0..n).map(|_| gen.next_event()).collect();
                let events: Vec<NewEvent> =
                    generated.iter().map(GeneratedEvent::to_new_event).collect();
                let tx = client.transaction().await?;
                let results = enqueue_many(&tx, &events).await?;
                tx.commit().await?;
                let new = results.iter().filter(|r| r.is_new()).count() as u64;
                stats.events += new;
                stats.poison += generated.iter().filter(|g| g.poison).count() as u64;
                stats.transactions += 1;
                if let Some(p) = &progress {
                    p.events.fetch_add(new, Ordering::Relaxed);
                }
            }
            Ok::<_, ProduceError>(stats)
        });
    }
    let mut total = ProduceStats::default();
    while let Some(joined) = tasks.join_next().await {
        let stats = joined.map_err(|e| ProduceError::Join(e.to_string()))??;
        total.events += stats.events;
        total.transactions += stats.transactions;
        total.poison += stats.poison;
    }
    total.elapsed_secs = started.elapsed().as_secs_f64();
    Ok(total)
}

/// A backlog written with binary COPY before the relay starts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PreloadSpec {
    pub events: u64,
    /// Parallel COPY streams.
    pub connections: u32,
    #[serde(flatten)]
    pub mix: EventMix,
}

impl Default for PreloadSpec {
    fn default() -> Self {
        PreloadSpec {
            events: 100_000,
            connections: 2,
            mix: EventMix::default(),
        }
    }
}

/// A JSON text sent as `jsonb` without building a `serde_json::Value`.
#[derive(Debug)]
struct JsonbText<'a>(&'a str);

impl ToSql for JsonbText<'_> {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        if *ty == Type::JSONB {
            out.extend_from_slice(&[1]); // jsonb binary format version
        }
        out.extend_from_slice(self.0.as_bytes());
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSONB || *ty == Type::JSON
    }

    to_sql_checked!();
}

const COPY_OUTBOX: &str = "COPY outbox (tenant_id, aggregate_type, aggregate_id, event_type, payload, headers, idempotency_key, partition_key) FROM STDIN (FORMAT binary)";
const COPY_TYPES: &[Type] = &[
    Type::UUID,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::JSONB,
    Type::JSONB,
    Type::TEXT,
    Type::TEXT,
];

/// Writes `spec.events` rows with binary COPY over `spec.connections`
/// streams; returns the rows copied (exactly `spec.events`).
pub async fn preload(
    url: &str,
    spec: &PreloadSpec,
    run_tag: &str,
    progress: Option<Arc<ProduceProgress>>,
) -> Result<ProduceStats, ProduceError> {
    spec.mix.validate().map_err(ProduceError::Spec)?;
    let started = Instant::now();
    let streams = spec.connections.max(1) as u64;
    let mut tasks = tokio::task::JoinSet::new();
    for s in 0..streams {
        let share = spec.events / streams + u64::from(s < spec.events % streams);
        if share == 0 {
            continue;
        }
        let client = connect(url).await?;
        let mix = spec.mix.clone();
        let stream = format!("{run_tag}-p{s}");
        let progress = progress.clone();
        tasks.spawn(async move {
            client.batch_execute("SET synchronous_commit = off").await?;
            let sink = client.copy_in(COPY_OUTBOX).await?;
            let writer = BinaryCopyInWriter::new(sink, COPY_TYPES);
            futures_util::pin_mut!(writer);
            let mut gen = EventGen::new(&mix, &stream, 1000 + s);
            let headers = JsonbText("{}");
            let mut poison = 0u64;
            for i in 0..share {
                let e = gen.next_event();
                poison += u64::from(e.poison);
                writer
                    .as_mut()
                    .write(&[
                        &e.tenant_id,
                        &AGGREGATE_TYPE,
                        &e.aggregate_id,
                        &e.event_type,
                        &JsonbText(&e.payload),
                        &headers,
                        &e.idempotency_key,
                        &e.partition_key,
                    ])
                    .await?;
                if let Some(p) = &progress {
                    if i % 1024 == 1023 {
                        p.events.fetch_add(1024, Ordering::Relaxed);
                    }
                }
            }
            let rows = writer.finish().await?;
            if let Some(p) = &progress {
                p.events.fetch_add(share % 1024, Ordering::Relaxed);
            }
            Ok::<_, ProduceError>((rows, poison))
        });
    }
    let mut total = ProduceStats::default();
    while let Some(joined) = tasks.join_next().await {
        let (rows, poison) = joined.map_err(|e| ProduceError::Join(e.to_string()))??;
        total.events += rows;
        total.poison += poison;
        total.transactions += 1;
    }
    total.elapsed_secs = started.elapsed().as_secs_f64();
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_about_200_bytes_and_valid_json() {
        let mut g = EventGen::new(&EventMix::default(), "run-w0", 1);
        for _ in 0..100 {
            let e = g.next_event();
            let v: serde_json::Value = serde_json::from_str(&e.payload).unwrap();
            assert!(v.is_object());
            assert!(
                (180..=300).contains(&e.payload.len()),
                "{}",
                e.payload.len()
            );
        }
    }

    #[test]
    fn generation_is_deterministic_and_keys_unique() {
        let mix = EventMix {
            poison_fraction: 0.1,
            ..EventMix::default()
        };
        let a: Vec<_> = {
            let mut g = EventGen::new(&mix, "s", 1);
            (0..50).map(|_| g.next_event()).collect()
        };
        let b: Vec<_> = {
            let mut g = EventGen::new(&mix, "s", 1);
            (0..50).map(|_| g.next_event()).collect()
        };
        assert_eq!(a, b);
        let keys: std::collections::HashSet<_> = a.iter().map(|e| &e.idempotency_key).collect();
        assert_eq!(keys.len(), 50);
        for e in &a {
            assert_eq!(e.payload.contains("\"poison\":true"), e.poison);
        }
    }

    #[test]
    fn zipf_skews_towards_the_first_keys() {
        let count_first = |skew| {
            let mut g = EventGen::new(
                &EventMix {
                    partition_keys: 100,
                    skew,
                    ..EventMix::default()
                },
                "s",
                1,
            );
            (0..10_000).filter(|_| g.pick_key() == 0).count()
        };
        let uniform = count_first(Skew::Uniform);
        let zipf = count_first(Skew::Zipf(1.2));
        assert!((50..200).contains(&uniform), "{uniform}");
        assert!(zipf > 1500, "{zipf}");
    }

    #[test]
    fn owned_keys_are_disjoint() {
        let mix = EventMix {
            partition_keys: 50,
            skew: Skew::Zipf(1.1),
            ..EventMix::default()
        };
        let mut a = EventGen::new(&mix, "a", 1).own_keys(0, 3);
        let mut b = EventGen::new(&mix, "b", 2).own_keys(1, 3);
        for _ in 0..500 {
            assert_eq!(a.pick_key() % 3, 0);
            assert_eq!(b.pick_key() % 3, 1);
        }
    }

    #[test]
    fn skew_reads_from_toml() {
        #[derive(Deserialize)]
        struct W {
            skew: Skew,
        }
        let w: W = toml::from_str("skew = { zipf = 1.1 }").unwrap();
        assert_eq!(w.skew, Skew::Zipf(1.1));
        let w: W = toml::from_str("skew = \"uniform\"").unwrap();
        assert_eq!(w.skew, Skew::Uniform);
    }
}
