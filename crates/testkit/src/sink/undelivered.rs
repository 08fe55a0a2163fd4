//! Delivery mode's completeness check: every message the sink accepted (and
//! did not answer as a duplicate) must reach the destination with a 2xx. The
//! order check ([`super::check_order`]) says nothing about an event that
//! never arrived; this names each one and what its delivery did.

use std::collections::{BTreeMap, BTreeSet};

use super::delivery::DeliveryOutcome;
use super::destination::Call;
use super::Record;

/// How many undelivered events a report spells out.
pub const MAX_UNDELIVERED_EXAMPLES: usize = 10;

/// Accepted events without a successful call at the destination.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Undelivered {
    /// Outbox ids accepted fresh by the sink.
    pub accepted: u64,
    /// Of them, how many no successful call carried.
    pub missing: u64,
    /// Up to [`MAX_UNDELIVERED_EXAMPLES`], each with what its delivery did.
    pub examples: Vec<String>,
}

/// Compares the fresh `records` (with an outbox id) with the successful
/// `calls`, explaining each gap from `outcomes` and the calls it got.
pub fn undelivered(
    records: &[Record],
    outcomes: &[DeliveryOutcome],
    calls: &[Call],
) -> Undelivered {
    let accepted: BTreeMap<i64, &Record> = records
        .iter()
        .filter(|r| !r.deduplicated)
        .filter_map(|r| r.outbox_id.map(|id| (id, r)))
        .collect();
    let delivered: BTreeSet<i64> = calls
        .iter()
        .filter(|c| c.succeeded())
        .filter_map(|c| c.outbox_id)
        .collect();
    let missing: Vec<(&i64, &&Record)> = accepted
        .iter()
        .filter(|(id, _)| !delivered.contains(id))
        .collect();
    let examples = missing
        .iter()
        .take(MAX_UNDELIVERED_EXAMPLES)
        .map(|(id, record)| {
            let outcome = outcomes.iter().find(|o| o.message_id == record.message_id);
            let statuses: Vec<String> = calls
                .iter()
                .filter(|c| c.outbox_id == Some(**id))
                .map(|c| c.status.to_string())
                .collect();
            let state = match outcome {
                None => "its delivery never finished".to_owned(),
                Some(o) if o.delivered => format!(
                    "its delivery says delivered after {} attempts, the destination recorded no success",
                    o.attempts
                ),
                Some(o) => format!(
                    "given up after {} attempts: {}",
                    o.attempts,
                    o.error.as_deref().unwrap_or("no error recorded")
                ),
            };
            format!(
                "event {id} (key {}, message {}): {state}; destination calls answered [{}]",
                record.partition_key.as_deref().unwrap_or("-"),
                record.message_id,
                statuses.join(", ")
            )
        })
        .collect();
    Undelivered {
        accepted: accepted.len() as u64,
        missing: missing.len() as u64,
        examples,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: i64, message: &str, deduplicated: bool) -> Record {
        Record {
            seq: id as u64,
            message_id: message.to_owned(),
            dedup_id: Some(id.to_string()),
            outbox_id: Some(id),
            partition_key: Some("k".to_owned()),
            destination: "http://127.0.0.1:1/".to_owned(),
            received_at_us: 0,
            deduplicated,
            created_at_us: None,
            via_batch: false,
        }
    }

    fn call(id: i64, status: u16) -> Call {
        Call {
            outbox_id: Some(id),
            partition_key: Some("k".to_owned()),
            message_id: None,
            retried: None,
            traceparent: None,
            method: "POST".to_owned(),
            target: "/".to_owned(),
            status,
            in_us: 0,
            out_us: 0,
        }
    }

    fn outcome(message: &str, delivered: bool, attempts: u32) -> DeliveryOutcome {
        DeliveryOutcome {
            message_id: message.to_owned(),
            destination: "http://127.0.0.1:1/".to_owned(),
            outbox_id: None,
            flow_control_key: Some("k".to_owned()),
            attempts,
            last_status: Some(if delivered { 200 } else { 500 }),
            delivered,
            error: (!delivered).then(|| "destination answered 500".to_owned()),
        }
    }

    #[test]
    fn each_accepted_event_without_a_successful_call_is_named_with_what_its_delivery_did() {
        let records = [
            record(1, "m1", false),
            record(2, "m2", false),
            record(3, "m3", false),
            record(1, "m1", true),
        ];
        let calls = [call(1, 500), call(1, 200), call(2, 500), call(2, 500)];
        let outcomes = [outcome("m1", true, 2), outcome("m2", false, 2)];
        let u = undelivered(&records, &outcomes, &calls);
        assert_eq!((u.accepted, u.missing), (3, 2));
        assert_eq!(u.examples.len(), 2);
        assert!(
            u.examples[0].contains("event 2")
                && u.examples[0].contains("given up after 2 attempts: destination answered 500")
                && u.examples[0].contains("[500, 500]"),
            "{:?}",
            u.examples
        );
        assert!(
            u.examples[1].contains("event 3") && u.examples[1].contains("never finished"),
            "{:?}",
            u.examples
        );
    }

    #[test]
    fn everything_delivered_leaves_nothing_missing() {
        let records = [record(1, "m1", false), record(2, "m2", false)];
        let calls = [call(2, 200), call(1, 200)];
        let u = undelivered(&records, &[], &calls);
        assert_eq!((u.accepted, u.missing), (2, 0));
        assert!(u.examples.is_empty());
    }
}
