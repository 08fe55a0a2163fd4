//! One scrape of a relay's `/metrics` (Prometheus text format) at the end of a
//! run, and the few series the report shows per replica. A series the relay
//! does not export (yet) is simply absent from the report.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};

/// Gauge: shards this replica owns (shard ownership across replicas).
pub const SHARDS_OWNED: &str = "outbox_relay_shards_owned";
/// Counter, label `kind` = `acquired` | `released` | `lost`.
pub const SHARD_HANDOVERS_TOTAL: &str = "outbox_relay_shard_handovers_total";
/// Counter, labels `route`: summed over routes.
pub const EVENTS_PUBLISHED_TOTAL: &str = "outbox_relay_events_published_total";
/// Counter: marks refused because the lease had moved on.
pub const MARKS_FENCED_TOTAL: &str = "outbox_relay_marks_fenced_total";

/// One sample line: `name{labels} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// The samples of a Prometheus text exposition; comments and lines that do
/// not parse are skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(after) = rest.strip_prefix('{') {
        let mut chars = after.char_indices().peekable();
        let end;
        loop {
            // label name
            while chars
                .next_if(|(_, c)| *c == ',' || c.is_whitespace())
                .is_some()
            {}
            let (start, c) = chars.next()?;
            if c == '}' {
                end = start + 1;
                break;
            }
            let mut key_end = start + c.len_utf8();
            while let Some((i, c)) = chars.next_if(|(_, c)| *c != '=') {
                key_end = i + c.len_utf8();
            }
            let key = after[start..key_end].trim().to_owned();
            chars.next().filter(|(_, c)| *c == '=')?;
            chars.next().filter(|(_, c)| *c == '"')?;
            let mut value = String::new();
            loop {
                match chars.next()? {
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    (_, '"') => break,
                    (_, c) => value.push(c),
                }
            }
            labels.insert(key, value);
        }
        rest = &after[end..];
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// `GET http://127.0.0.1:<port>/metrics`; `None` when it does not answer 200
/// within `timeout`.
pub async fn scrape(port: u16, timeout: Duration) -> Option<String> {
    let client: Client<_, Empty<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let uri: http::Uri = format!("http://127.0.0.1:{port}/metrics").parse().ok()?;
    let fetch = async {
        let resp = client.get(uri).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        String::from_utf8(body.to_vec()).ok()
    };
    tokio::time::timeout(timeout, fetch).await.ok().flatten()
}

/// What the report shows of one replica's `/metrics`, scraped once at the end
/// of the run (counters count since that process started).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReplicaMetrics {
    /// 0-based, as in `relay-<replica>.log`.
    pub replica: u32,
    pub metrics_port: u16,
    /// `/metrics` answered.
    pub scraped: bool,
    /// `outbox_relay_shards_owned`, when the relay exports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards_owned: Option<f64>,
    /// `outbox_relay_shard_handovers_total` by `kind`, when exported.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub shard_handovers: BTreeMap<String, f64>,
    /// `outbox_relay_events_published_total`, summed over routes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events_published: Option<f64>,
    /// `outbox_relay_marks_fenced_total`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub marks_fenced: Option<f64>,
}

impl ReplicaMetrics {
    /// From the scraped text, or `None` when the scrape failed.
    pub fn from_scrape(replica: u32, metrics_port: u16, text: Option<&str>) -> Self {
        let mut m = ReplicaMetrics {
            replica,
            metrics_port,
            scraped: text.is_some(),
            ..Default::default()
        };
        let sum = |samples: &[Sample], name: &str| {
            let mut it = samples.iter().filter(|s| s.name == name).peekable();
            it.peek()
                .is_some()
                .then(|| it.map(|s| s.value).sum::<f64>())
        };
        if let Some(text) = text {
            let samples = parse(text);
            m.shards_owned = sum(&samples, SHARDS_OWNED);
            m.events_published = sum(&samples, EVENTS_PUBLISHED_TOTAL);
            m.marks_fenced = sum(&samples, MARKS_FENCED_TOTAL);
            for s in samples.iter().filter(|s| s.name == SHARD_HANDOVERS_TOTAL) {
                let kind = s.labels.get("kind").cloned().unwrap_or_default();
                *m.shard_handovers.entry(kind).or_default() += s.value;
            }
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP outbox_relay_shards_owned Shards this replica owns.
# TYPE outbox_relay_shards_owned gauge
outbox_relay_shards_owned 3
# TYPE outbox_relay_shard_handovers_total counter
outbox_relay_shard_handovers_total{kind="acquired"} 5
outbox_relay_shard_handovers_total{kind="released"} 1
outbox_relay_shard_handovers_total{kind="lost"} 2
outbox_relay_events_published_total{route="0",sink="qstash"} 100
outbox_relay_events_published_total{route="1",sink="we\"ird, {x}"} 20.5
outbox_relay_publish_duration_seconds_bucket{le="+Inf"} 7
outbox_relay_marks_fenced_total 0 1700000000000
not a metric line
"#;

    #[test]
    fn parses_names_labels_and_values() {
        let s = parse(TEXT);
        assert_eq!(s.len(), 8, "{s:?}");
        assert_eq!(s[0].name, SHARDS_OWNED);
        assert!(s[0].labels.is_empty());
        assert_eq!(s[0].value, 3.0);
        assert_eq!(s[5].labels["sink"], "we\"ird, {x}");
        assert_eq!(s[5].labels["route"], "1");
        assert_eq!((s[6].labels["le"].as_str(), s[6].value), ("+Inf", 7.0));
        assert_eq!(s[7].value, 0.0);
    }

    #[test]
    fn replica_metrics_pick_their_series_and_tolerate_absence() {
        let m = ReplicaMetrics::from_scrape(2, 9000, Some(TEXT));
        assert!(m.scraped);
        assert_eq!(m.shards_owned, Some(3.0));
        assert_eq!(m.shard_handovers["acquired"], 5.0);
        assert_eq!(m.shard_handovers["lost"], 2.0);
        assert_eq!(m.events_published, Some(120.5));
        assert_eq!(m.marks_fenced, Some(0.0));

        let today = "outbox_relay_events_published_total{route=\"0\"} 7\n";
        let m = ReplicaMetrics::from_scrape(0, 9000, Some(today));
        assert!(m.scraped && m.shards_owned.is_none() && m.shard_handovers.is_empty());
        let m = ReplicaMetrics::from_scrape(1, 9001, None);
        assert!(!m.scraped && m.events_published.is_none());
    }
}
