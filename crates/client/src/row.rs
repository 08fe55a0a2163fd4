//! An outbox row as the relay delivers it, and the envelope consumers receive.

use chrono::{DateTime, SecondsFormat, Utc};
use uuid::Uuid;

/// An outbox row as the relay delivers it. `payload` stays the JSON text
/// PostgreSQL returned: it is passed through into the request body without
/// being parsed and re-encoded.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxRow {
    pub id: i64,
    pub tenant_id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub payload: String,
    /// `(name, value)` pairs from the `headers` object.
    pub headers: Vec<(String, String)>,
    pub idempotency_key: String,
    pub partition_key: String,
    pub created_at: DateTime<Utc>,
    /// The delivery attempt the relay claimed the row for (1 on the first);
    /// also the claim's fencing token.
    pub attempt: i32,
}

impl OutboxRow {
    /// The event as consumers receive it (the classic outbox event fields plus
    /// the partition key and creation time):
    /// `{"id","type","aggregateType","aggregateId","tenantId","partitionKey","payload","createdAt"}`,
    /// compact, with `payload` copied through byte for byte.
    pub fn envelope(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.payload.len() + 256);
        out.extend_from_slice(b"{\"id\":\"");
        out.extend_from_slice(itoa::Buffer::new().format(self.id).as_bytes());
        out.extend_from_slice(b"\",\"type\":");
        push_json_str(&mut out, &self.event_type);
        out.extend_from_slice(b",\"aggregateType\":");
        push_json_str(&mut out, &self.aggregate_type);
        out.extend_from_slice(b",\"aggregateId\":");
        push_json_str(&mut out, &self.aggregate_id);
        out.extend_from_slice(b",\"tenantId\":\"");
        let mut uuid = [0; uuid::fmt::Hyphenated::LENGTH];
        out.extend_from_slice(
            self.tenant_id
                .hyphenated()
                .encode_lower(&mut uuid)
                .as_bytes(),
        );
        out.extend_from_slice(b"\",\"partitionKey\":");
        push_json_str(&mut out, &self.partition_key);
        out.extend_from_slice(b",\"payload\":");
        out.extend_from_slice(self.payload.as_bytes());
        out.extend_from_slice(b",\"createdAt\":\"");
        out.extend_from_slice(
            self.created_at
                .to_rfc3339_opts(SecondsFormat::Micros, true)
                .as_bytes(),
        );
        out.extend_from_slice(b"\"}");
        out
    }
}

fn push_json_str(out: &mut Vec<u8>, s: &str) {
    // serde_json's escaping, without building a Value.
    serde_json::to_writer(&mut *out, s).expect("writing to a Vec cannot fail");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_is_compact_json_with_the_payload_passed_through() {
        let row = OutboxRow {
            id: 42,
            tenant_id: Uuid::nil(),
            aggregate_type: "order".into(),
            aggregate_id: "o\"1".into(),
            event_type: "order.placed".into(),
            payload: r#"{"orderId": "o1", "n": 1.50}"#.into(),
            headers: vec![],
            idempotency_key: "k".into(),
            partition_key: "order:o1".into(),
            created_at: DateTime::from_timestamp(1_700_000_000, 123_456_000).unwrap(),
            attempt: 1,
        };
        let text = String::from_utf8(row.envelope()).unwrap();
        assert_eq!(
            text,
            r#"{"id":"42","type":"order.placed","aggregateType":"order","aggregateId":"o\"1","tenantId":"00000000-0000-0000-0000-000000000000","partitionKey":"order:o1","payload":{"orderId": "o1", "n": 1.50},"createdAt":"2023-11-14T22:13:20.123456Z"}"#
        );
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["payload"]["orderId"], "o1");
    }
}
