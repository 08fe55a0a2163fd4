//! What QStash's reports say: the failure-callback and delivery-callback
//! bodies parsed into the outbox row, attempt and verdict they are about.
//! Pure functions of the body; the listener (`super`) verifies and applies
//! them.

use std::collections::HashMap;
use std::time::Duration;

use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
use base64::Engine;
use serde::Deserialize;

/// `last_error` keeps this many characters of the destination's answer.
const MAX_ERROR_BODY_CHARS: usize = 2000;

/// Header names (lowercase) that carry the outbox row id, in order of trust.
const ID_HEADERS: &[&str] = &["x-outbox-id", "x-event-id"];

/// Header names (lowercase) that carry the deduplication id of the attempt
/// the report is about: the relay forwards the first with every message.
const KEY_HEADERS: &[&str] = &["x-outbox-idempotency-key", "upstash-deduplication-id"];

/// A header value as QStash sends it (an array) or as its docs show it (a string).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum HeaderValues {
    Many(Vec<String>),
    One(String),
}

impl HeaderValues {
    fn first(&self) -> Option<&str> {
        match self {
            HeaderValues::Many(v) => v.first().map(String::as_str),
            HeaderValues::One(s) => Some(s),
        }
    }
}

/// The failure-callback report (docs/qstash-protocol.md, "Failure callbacks");
/// only what we use.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FailureReport {
    status: u16,
    #[serde(default)]
    body: Option<String>,
    #[serde(default)]
    retried: Option<u32>,
    #[serde(default)]
    max_retries: Option<u32>,
    #[serde(default)]
    dlq_id: Option<String>,
    #[serde(default)]
    source_message_id: Option<String>,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    source_header: HashMap<String, HeaderValues>,
    /// The destination's answer's headers (delivery callbacks).
    #[serde(default)]
    header: HashMap<String, HeaderValues>,
    #[serde(default)]
    source_body: Option<String>,
}

/// Why a report cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportError(pub String);

impl std::fmt::Display for ReportError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ReportError {}

/// What a failure report says, as the listener uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedReport {
    pub outbox_id: i64,
    /// The deduplication id of the attempt QStash gave up on.
    pub deduplication_id: String,
    /// The destination's last status (never 2xx).
    pub status: u16,
    /// What goes into the row's `last_error`.
    pub last_error: String,
    pub source_message_id: Option<String>,
    pub url: Option<String>,
}

/// Parses a failure report's body (the signature is checked elsewhere): a
/// report of a success, or one that does not name the outbox row and the
/// attempt, is an error naming what is wrong.
pub fn parse_failure_report(body: &[u8]) -> Result<ParsedReport, ReportError> {
    let report: FailureReport = serde_json::from_slice(body)
        .map_err(|e| ReportError(format!("not a QStash failure report: {e}")))?;
    if (200..300).contains(&report.status) {
        return Err(ReportError(format!(
            "status {} is a success, not a failure: only failure reports are taken",
            report.status
        )));
    }
    let outbox_id = outbox_id(&report)?;
    let deduplication_id = header_value(&report, KEY_HEADERS)
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| {
            ReportError("no X-Outbox-Idempotency-Key in sourceHeader: cannot tell which attempt the report is about".into())
        })?
        .to_owned();
    let last_error = describe(&report)?;
    Ok(ParsedReport {
        outbox_id,
        deduplication_id,
        status: report.status,
        last_error,
        source_message_id: report.source_message_id,
        url: report.url,
    })
}

/// What a delivery callback says of one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The destination answered 2xx.
    Delivered,
    /// It did not, and QStash will try again.
    Retrying,
    /// It did not, and that was the last attempt (retries used up, or the
    /// destination said not to retry: 489 with `Upstash-NonRetryable-Error`).
    Failed,
}

impl Verdict {
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::Delivered => "delivered",
            Verdict::Retrying => "retrying",
            Verdict::Failed => "failed",
        }
    }
}

/// What a delivery callback says, as the listener uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedOutcome {
    pub outbox_id: i64,
    /// The deduplication id of the attempt the callback is about.
    pub deduplication_id: String,
    pub status: u16,
    pub verdict: Verdict,
    /// Retries QStash made so far (`retried`), when the report says.
    pub retried: Option<u32>,
    /// What goes into the row's `last_error` when it was not delivered.
    pub last_error: String,
}

/// How long QStash waits after retry number `retried` before its next
/// attempt, by its default schedule (the relay sends no
/// `Upstash-Retry-Delay`): e^(2.5·n) seconds for retry n, at most a day
/// (12 s, 2 min 28 s, 30 min, 6 h, then a day). A report without `retried`
/// counts as the first failure.
pub(crate) fn qstash_next_attempt_in(retried: Option<u32>) -> Duration {
    let n = retried.unwrap_or(0).saturating_add(1).min(100);
    Duration::from_secs_f64((2.5 * f64::from(n)).exp().min(86_400.0))
}

/// Parses a delivery callback's body (the signature is checked elsewhere):
/// the same report as a failure callback's, about any attempt. A failure
/// without `retried` and `maxRetries` is taken as one QStash retries (the row
/// stays held; if nothing else comes, its hold runs out and it is sent again).
pub fn parse_delivery_report(body: &[u8]) -> Result<ParsedOutcome, ReportError> {
    let report: FailureReport = serde_json::from_slice(body)
        .map_err(|e| ReportError(format!("not a QStash callback report: {e}")))?;
    let outbox_id = outbox_id(&report)?;
    let deduplication_id = header_value(&report, KEY_HEADERS)
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| {
            ReportError("no X-Outbox-Idempotency-Key in sourceHeader: cannot tell which attempt the callback is about".into())
        })?
        .to_owned();
    let non_retryable = report.status == 489
        && report.header.iter().any(|(name, values)| {
            name.eq_ignore_ascii_case("upstash-nonretryable-error")
                && values
                    .first()
                    .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
        });
    let verdict = if (200..300).contains(&report.status) {
        Verdict::Delivered
    } else if non_retryable
        || matches!((report.retried, report.max_retries), (Some(r), Some(max)) if r >= max)
    {
        Verdict::Failed
    } else {
        Verdict::Retrying
    };
    let last_error = if verdict == Verdict::Delivered {
        String::new()
    } else {
        describe(&report)?
    };
    Ok(ParsedOutcome {
        outbox_id,
        deduplication_id,
        status: report.status,
        verdict,
        retried: report.retried,
        last_error,
    })
}

/// The first of `names` (lowercase, in order) found in `sourceHeader`, any case.
fn header_value<'a>(report: &'a FailureReport, names: &[&str]) -> Option<&'a str> {
    names.iter().find_map(|wanted| {
        report
            .source_header
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(wanted))
            .and_then(|(_, v)| v.first())
    })
}

/// The outbox id the relay forwarded: a header first, else the `id` of the
/// JSON envelope in the original body.
fn outbox_id(report: &FailureReport) -> Result<i64, ReportError> {
    if let Some(value) = header_value(report, ID_HEADERS) {
        return value
            .trim()
            .parse()
            .map_err(|_| ReportError(format!("outbox id header {value:?} is not an outbox id")));
    }
    let Some(encoded) = &report.source_body else {
        return Err(ReportError(
            "no X-Outbox-Id in sourceHeader and no sourceBody".into(),
        ));
    };
    let source =
        decode_base64(encoded).ok_or_else(|| ReportError("sourceBody is not base64".into()))?;
    let envelope: serde_json::Value = serde_json::from_slice(&source).map_err(|_| {
        ReportError("no X-Outbox-Id in sourceHeader and sourceBody is not JSON".into())
    })?;
    match envelope.get("id") {
        Some(serde_json::Value::Number(n)) => n.as_i64(),
        Some(serde_json::Value::String(s)) => s.trim().parse().ok(),
        _ => None,
    }
    .ok_or_else(|| {
        ReportError("no X-Outbox-Id in sourceHeader and no numeric `id` in sourceBody".into())
    })
}

/// `qstash: status 500 after 3 retries: <response body> (dlqId …)`.
fn describe(report: &FailureReport) -> Result<String, ReportError> {
    let response = match &report.body {
        None => String::new(),
        Some(encoded) => {
            let bytes =
                decode_base64(encoded).ok_or_else(|| ReportError("body is not base64".into()))?;
            crate::sink::body_text(&bytes, MAX_ERROR_BODY_CHARS)
        }
    };
    let mut text = format!(
        "qstash: status {} after {} retries: {}",
        report.status,
        report
            .retried
            .or(report.max_retries)
            .map_or_else(|| "?".to_owned(), |n| n.to_string()),
        response
    );
    if let Some(dlq_id) = &report.dlq_id {
        text.push_str(&format!(" (dlqId {dlq_id})"));
    }
    // Storable and readable whatever the destination answered: no control
    // characters (PostgreSQL refuses NUL in text), bounded.
    Ok(crate::sink::truncate(text, MAX_ERROR_BODY_CHARS + 200))
}

/// QStash uses standard base64; accept the URL-safe and unpadded forms too.
fn decode_base64(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(s).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(json: serde_json::Value) -> FailureReport {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn finds_the_outbox_id_in_headers_then_the_body() {
        let r = report(serde_json::json!({"status": 500, "sourceHeader": {"X-OUTBOX-ID": ["41"]}}));
        assert_eq!(outbox_id(&r).unwrap(), 41);
        let r = report(serde_json::json!({"status": 500, "sourceHeader": {"x-event-id": "42"}}));
        assert_eq!(outbox_id(&r).unwrap(), 42);
        let body = STANDARD.encode(br#"{"id": 43, "type": "t"}"#);
        let r = report(serde_json::json!({"status": 500, "sourceBody": body}));
        assert_eq!(outbox_id(&r).unwrap(), 43);
        let r = report(serde_json::json!({"status": 500, "sourceHeader": {"X-Outbox-Id": ["x"]}}));
        assert!(outbox_id(&r).is_err());
        let r = report(serde_json::json!({"status": 500}));
        assert!(outbox_id(&r).is_err());
    }

    #[test]
    fn last_error_is_truncated_and_names_the_dlq_entry() {
        let long = "é".repeat(3000);
        let r = report(serde_json::json!({
            "status": 502, "retried": 3, "body": STANDARD.encode(&long), "dlqId": "17-0"
        }));
        let text = describe(&r).unwrap();
        assert!(text.starts_with("qstash: status 502 after 3 retries: éé"));
        assert!(text.ends_with("é… (dlqId 17-0)"), "{text}");
        assert_eq!(text.matches('é').count(), MAX_ERROR_BODY_CHARS);
    }

    #[test]
    fn last_error_from_a_binary_answer_is_storable_text() {
        let r = report(serde_json::json!({
            "status": 500, "retried": 3,
            "body": STANDARD.encode(b"oops\x00 \x1b[31m\xff\xfe"), "dlqId": "1\u{0}7"
        }));
        let text = describe(&r).unwrap();
        // PostgreSQL refuses NUL in text: the dead letter would not be recorded.
        assert!(!text.chars().any(char::is_control), "{text:?}");
        assert!(
            text.starts_with("qstash: status 500 after 3 retries: (binary body of 13 bytes"),
            "{text:?}"
        );
    }

    fn delivery(json: serde_json::Value) -> Result<ParsedOutcome, ReportError> {
        parse_delivery_report(&serde_json::to_vec(&json).unwrap())
    }

    fn about(status: u16, retried: u32) -> serde_json::Value {
        serde_json::json!({
            "status": status, "retried": retried, "maxRetries": 3,
            "body": STANDARD.encode(b"answer"),
            "sourceHeader": {"X-Outbox-Id": ["7"], "X-Outbox-Idempotency-Key": ["k-7"]}
        })
    }

    /// A "retrying" callback holds the row past QStash's next attempt, so a
    /// short `callback_timeout` does not run out while QStash waits 30
    /// minutes before its third retry (and re-send a second copy).
    #[test]
    fn a_retrying_callback_holds_until_after_qstashs_next_attempt() {
        let secs = |retried| qstash_next_attempt_in(retried).as_secs();
        assert_eq!(secs(None), 12);
        assert_eq!(secs(Some(0)), 12);
        assert_eq!(secs(Some(1)), 148);
        assert_eq!(secs(Some(2)), 1808);
        assert_eq!(secs(Some(3)), 22026);
        assert_eq!(secs(Some(4)), 86_400);
        assert_eq!(secs(Some(u32::MAX)), 86_400);
        assert_eq!(delivery(about(503, 2)).unwrap().retried, Some(2));
    }

    #[test]
    fn a_delivery_callback_says_delivered_retrying_or_failed() {
        let ok = delivery(about(204, 1)).unwrap();
        assert_eq!(
            (ok.outbox_id, ok.deduplication_id.as_str(), ok.verdict),
            (7, "k-7", Verdict::Delivered)
        );
        assert!(ok.last_error.is_empty());
        let again = delivery(about(503, 1)).unwrap();
        assert_eq!(again.verdict, Verdict::Retrying);
        assert!(again
            .last_error
            .starts_with("qstash: status 503 after 1 retries: answer"));
        assert_eq!(delivery(about(503, 3)).unwrap().verdict, Verdict::Failed);
        // No answer at all (QStash reports status 0): a failure like any other.
        assert_eq!(delivery(about(0, 2)).unwrap().verdict, Verdict::Retrying);
        // 489 with Upstash-NonRetryable-Error: QStash stops at once.
        let mut stop = about(489, 0);
        stop["header"] = serde_json::json!({"Upstash-NonRetryable-Error": ["true"]});
        assert_eq!(delivery(stop).unwrap().verdict, Verdict::Failed);
        assert_eq!(delivery(about(489, 0)).unwrap().verdict, Verdict::Retrying);
        // Without the counts, a failure is taken as one QStash retries.
        let mut unknown = about(500, 3);
        unknown.as_object_mut().unwrap().remove("maxRetries");
        assert_eq!(delivery(unknown).unwrap().verdict, Verdict::Retrying);
    }

    #[test]
    fn a_delivery_callback_must_say_which_attempt_it_is_about() {
        let mut no_key = about(200, 0);
        no_key["sourceHeader"] = serde_json::json!({"X-Outbox-Id": ["7"]});
        let e = delivery(no_key).unwrap_err();
        assert!(e.0.contains("X-Outbox-Idempotency-Key"), "{e}");
        assert!(parse_delivery_report(b"not json").is_err());
    }
}
