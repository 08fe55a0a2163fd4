//! CloudEvents 1.0 (<https://cloudevents.io>) for routes that ask for it:
//! `body = "cloudevents"` sends the structured JSON form
//! (`application/cloudevents+json`), through QStash or to a webhook;
//! `body = "cloudevents-binary"` sends the row's payload as the body and the
//! attributes as `ce-*` headers (the HTTP binding's binary mode, webhooks
//! only).
//!
//! The attributes: `id` = the outbox id, `source` = the route's
//! `cloudevents_source` (`/outbox-relay` unless set), `type` = the event
//! type, `subject` = the aggregate id, `time` = when the row was created,
//! `datacontenttype` = `application/json`, `data` = the payload, and two
//! extensions: `partitionkey` (the partitioning extension) and `tenantid`.

use chrono::SecondsFormat;
use outbox_client::row::OutboxRow;
use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};

/// The structured form's content type.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

/// `source` when the route sets none.
pub const DEFAULT_SOURCE: &str = "/outbox-relay";

/// What the HTTP binding percent-encodes in a `ce-*` header value: space,
/// `"`, `%` and everything outside printable ASCII (the non-ASCII bytes are
/// always encoded).
const HEADER_VALUE: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// The attributes of a row's event, in the order the structured form lists
/// them (`data` aside).
fn attributes<'a>(row: &'a OutboxRow, source: &'a str) -> [(&'static str, String); 8] {
    [
        ("specversion", "1.0".to_owned()),
        ("id", row.id.to_string()),
        ("source", source.to_owned()),
        ("type", row.event_type.clone()),
        ("subject", row.aggregate_id.clone()),
        (
            "time",
            row.created_at.to_rfc3339_opts(SecondsFormat::Micros, true),
        ),
        ("partitionkey", row.partition_key.clone()),
        ("tenantid", row.tenant_id.hyphenated().to_string()),
    ]
}

/// The structured form: one JSON object with the attributes and `data`,
/// the payload copied through byte for byte.
pub fn structured(row: &OutboxRow, source: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(row.payload.len() + 320);
    out.push(b'{');
    for (name, value) in attributes(row, source) {
        push_json_str(&mut out, name);
        out.push(b':');
        push_json_str(&mut out, &value);
        out.push(b',');
    }
    out.extend_from_slice(b"\"datacontenttype\":\"application/json\",\"data\":");
    out.extend_from_slice(row.payload.as_bytes());
    out.push(b'}');
    out
}

/// The binary form's headers (`ce-id`, `ce-source`, …), values
/// percent-encoded as the HTTP binding says; the body is the payload and its
/// `content-type` the data's (`application/json`).
pub fn binary_headers(row: &OutboxRow, source: &str) -> Vec<(String, String)> {
    attributes(row, source)
        .into_iter()
        .map(|(name, value)| {
            (
                format!("ce-{name}"),
                utf8_percent_encode(&value, HEADER_VALUE).to_string(),
            )
        })
        .collect()
}

fn push_json_str(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(&mut *out, s).expect("writing to a Vec cannot fail");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> OutboxRow {
        OutboxRow {
            id: 42,
            tenant_id: uuid::Uuid::nil(),
            aggregate_type: "order".into(),
            aggregate_id: "A 1/ü\"%".into(),
            event_type: "order.placed".into(),
            payload: r#"{"total": 3}"#.into(),
            headers: vec![],
            idempotency_key: "evt-42".into(),
            partition_key: "order:A 1".into(),
            created_at: chrono::DateTime::from_timestamp(1_700_000_000, 123_456_000).unwrap(),
            attempt: 1,
        }
    }

    #[test]
    fn the_structured_form_holds_every_attribute_and_the_payload() {
        let v: serde_json::Value = serde_json::from_slice(&structured(&row(), "/shop")).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "specversion": "1.0",
                "id": "42",
                "source": "/shop",
                "type": "order.placed",
                "subject": "A 1/ü\"%",
                "time": "2023-11-14T22:13:20.123456Z",
                "datacontenttype": "application/json",
                "data": {"total": 3},
                "partitionkey": "order:A 1",
                "tenantid": "00000000-0000-0000-0000-000000000000",
            })
        );
    }

    #[test]
    fn binary_header_values_are_percent_encoded() {
        let headers = binary_headers(&row(), DEFAULT_SOURCE);
        let get = |n: &str| headers.iter().find(|(k, _)| k == n).unwrap().1.clone();
        assert_eq!(get("ce-subject"), "A%201/%C3%BC%22%25");
        assert_eq!(get("ce-source"), "/outbox-relay");
        assert_eq!(get("ce-id"), "42");
        assert_eq!(headers.len(), 8);
    }
}
