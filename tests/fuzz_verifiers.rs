//! Property-based fuzzing of everything that decides whether a request is
//! genuine: the QStash JWT verifier, the Standard Webhooks verifier, and the
//! failure-report parser. Inputs are random bytes, valid tokens with random
//! mutations, forged claims and oversized headers. The properties: nothing
//! panics (proptest turns a panic into a failure), nothing forged is
//! accepted, and what an independent implementation signs (`jsonwebtoken`,
//! the official `standardwebhooks` crate) is accepted.
//!
//! `cargo test --test fuzz_verifiers` runs 2,000 cases per property (a few
//! seconds). A longer run: `PROPTEST_CASES=1000000 cargo test --release
//! --test fuzz_verifiers -- --nocapture`. Each property prints how many inputs
//! it tried.

use std::cell::Cell;

use base64::engine::general_purpose::{STANDARD, URL_SAFE};
use base64::Engine;
mod common;

use common::jwt;
use jsonwebtoken::Algorithm;
use outbox_client::consumer::qstash::{Clock, Verifier};
use outbox_client::consumer::webhooks::WebhookVerifier;
use outbox_relay::server::callback::{parse_delivery_report, parse_failure_report, Verdict};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const CURRENT: &str = "sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r";
const NEXT: &str = "sig_5ZB6DVzB1wjE8S6rZ7eenA8Pdnhs";
const NOW: i64 = 1_700_000_000;
const URL: &str = "https://consumer.example.com/hooks/orders";
const WH_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// Cases per property: `PROPTEST_CASES`, else enough for a few seconds.
fn runner() -> TestRunner {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000);
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

/// Runs `property` over `strategy` and prints how many inputs it tried. A
/// forgery accepted or a panic fails the run (with the smallest input found).
fn fuzz<S: Strategy>(
    name: &str,
    strategy: S,
    property: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let tried = Cell::new(0u64);
    let result = runner().run(&strategy, |input| {
        tried.set(tried.get() + 1);
        property(input)
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    eprintln!(
        "fuzz {name}: {} inputs, 0 forgeries accepted, 0 panics",
        tried.get()
    );
}

fn verifier() -> Verifier {
    Verifier::new(CURRENT, Some(NEXT)).with_clock(Clock::fixed(NOW))
}

fn claims(body: &[u8]) -> Value {
    json!({"iss": "Upstash", "sub": URL, "exp": NOW + 300, "nbf": 0, "iat": NOW,
           "jti": "jwt_fuzz", "body": URL_SAFE.encode(Sha256::digest(body))})
}

/// One edit to a string: replace, insert or delete a character, cut the
/// string, or swap two of its dot-separated parts.
#[derive(Debug, Clone)]
enum Mutation {
    Replace(usize, char),
    Insert(usize, char),
    Delete(usize),
    Truncate(usize),
    SwapParts(usize, usize),
    Append(String),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let c = prop_oneof![
        proptest::char::range('-', 'z'),
        Just('.'),
        Just('='),
        Just(' '),
        any::<char>()
    ];
    prop_oneof![
        (any::<usize>(), c.clone()).prop_map(|(i, c)| Mutation::Replace(i, c)),
        (any::<usize>(), c).prop_map(|(i, c)| Mutation::Insert(i, c)),
        any::<usize>().prop_map(Mutation::Delete),
        any::<usize>().prop_map(Mutation::Truncate),
        (0usize..4, 0usize..4).prop_map(|(a, b)| Mutation::SwapParts(a, b)),
        ".{0,40}".prop_map(Mutation::Append),
    ]
}

/// One byte of `body` changed (XOR with a non-zero `flip`), or one appended
/// to an empty body.
fn flip_byte(body: &[u8], (i, flip): (usize, u8)) -> Vec<u8> {
    let mut out = body.to_vec();
    match out.len() {
        0 => out.push(flip),
        n => out[i % n] ^= flip,
    }
    out
}

fn byte_flip() -> impl Strategy<Value = (usize, u8)> {
    (any::<usize>(), 1u8..=255)
}

fn mutate(s: &str, m: &Mutation) -> String {
    let mut chars: Vec<char> = s.chars().collect();
    let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
    match m {
        Mutation::Replace(i, c) if !chars.is_empty() => {
            let i = at(*i, chars.len());
            chars[i] = *c;
        }
        Mutation::Insert(i, c) => {
            let i = at(*i, chars.len() + 1);
            chars.insert(i, *c);
        }
        Mutation::Delete(i) if !chars.is_empty() => {
            let i = at(*i, chars.len());
            chars.remove(i);
        }
        Mutation::Truncate(i) => chars.truncate(at(*i, chars.len() + 1)),
        Mutation::SwapParts(a, b) => {
            let mut parts: Vec<&str> = s.split('.').collect();
            let (a, b) = (at(*a, parts.len()), at(*b, parts.len()));
            parts.swap(a, b);
            return parts.join(".");
        }
        Mutation::Append(tail) => chars.extend(tail.chars()),
        _ => {}
    }
    chars.into_iter().collect()
}

// ───────────────────────────── QStash JWT ─────────────────────────────

#[test]
fn qstash_random_bytes_are_never_accepted() {
    let v = verifier();
    fuzz(
        "qstash random bytes",
        (
            proptest::collection::vec(any::<u8>(), 0..600),
            proptest::collection::vec(any::<u8>(), 0..64),
        ),
        |(token, body)| {
            let token = String::from_utf8_lossy(&token);
            prop_assert!(v.verify(Some(&token), &body, None).is_err());
            let mut headers = http::HeaderMap::new();
            if let Ok(value) = http::HeaderValue::from_bytes(token.as_bytes()) {
                headers.insert("upstash-signature", value);
            }
            prop_assert!(v.verify_headers(&headers, &body, Some(URL)).is_err());
            Ok(())
        },
    );
}

#[test]
fn qstash_mutated_tokens_and_bodies_are_accepted_only_unchanged() {
    let v = verifier();
    fuzz(
        "qstash mutated tokens",
        (
            proptest::collection::vec(any::<u8>(), 0..64),
            prop_oneof![Just(CURRENT), Just(NEXT)],
            proptest::collection::vec(mutation(), 0..3),
            proptest::option::of(byte_flip()),
        ),
        |(body, key, token_edits, body_edit)| {
            let valid = jwt(key, &claims(&body), Algorithm::HS256);
            // An independent library's token for this body verifies.
            prop_assert!(v.verify(Some(&valid), &body, Some(URL)).is_ok());
            let token = token_edits.iter().fold(valid.clone(), |t, m| mutate(&t, m));
            let sent_body = match body_edit {
                Some(flip) => flip_byte(&body, flip),
                None => body.clone(),
            };
            if v.verify(Some(&token), &sent_body, Some(URL)).is_ok() {
                // Only surrounding whitespace may differ: the same token.
                prop_assert_eq!(token.trim(), valid.as_str());
                prop_assert_eq!(&sent_body, &body);
            }
            Ok(())
        },
    );
}

/// Claims as an attacker would write them: any issuer, subject, times and
/// body hash.
fn forged_claims() -> impl Strategy<Value = Value> {
    (
        proptest::option::of(prop_oneof![Just("Upstash".to_owned()), ".{0,12}"]),
        proptest::option::of(prop_oneof![Just(URL.to_owned()), ".{0,40}"]),
        proptest::option::of(any::<i64>()),
        proptest::option::of(any::<i64>()),
        proptest::option::of(".{0,50}"),
    )
        .prop_map(|(iss, sub, exp, nbf, body)| {
            json!({"iss": iss, "sub": sub, "exp": exp, "nbf": nbf, "body": body})
        })
}

#[test]
fn qstash_forged_signatures_are_never_accepted() {
    let v = verifier();
    fuzz(
        "qstash forged signatures",
        (
            forged_claims(),
            "sig_[A-Za-z0-9]{0,30}",
            prop_oneof![
                Just(Algorithm::HS256),
                Just(Algorithm::HS384),
                Just(Algorithm::HS512)
            ],
            proptest::collection::vec(any::<u8>(), 0..64),
        ),
        |(claims, key, alg, body)| {
            // Another key, or our key with an algorithm we do not accept.
            let token = if key != CURRENT && key != NEXT {
                jwt(&key, &claims, alg)
            } else {
                jwt(CURRENT, &claims, Algorithm::HS512)
            };
            prop_assert!(v.verify(Some(&token), &body, None).is_err());
            // Unsigned (`alg: none`) and empty-signature variants.
            let mut parts = token.split('.');
            let (_, payload) = (parts.next(), parts.next().unwrap());
            for header in [r#"{"alg":"none"}"#, r#"{"alg":"HS256"}"#] {
                let header = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(header);
                for unsigned in [
                    format!("{header}.{payload}."),
                    format!("{header}.{payload}"),
                ] {
                    prop_assert!(v.verify(Some(&unsigned), &body, None).is_err());
                }
            }
            Ok(())
        },
    );
}

#[test]
fn qstash_oversized_headers_are_refused_without_panics() {
    let v = verifier();
    fuzz(
        "qstash oversized headers",
        (8_000usize..20_000, any::<u8>(), any::<bool>()),
        |(len, fill, inside_claims)| {
            let body = b"{}";
            let token = if inside_claims {
                // A validly signed token whose claims are huge.
                let mut c = claims(body);
                c["pad"] = json!("x".repeat(len));
                jwt(CURRENT, &c, Algorithm::HS256)
            } else {
                let valid = jwt(CURRENT, &claims(body), Algorithm::HS256);
                let fill = char::from(b'A' + fill % 26);
                format!("{valid}{}", fill.to_string().repeat(len))
            };
            prop_assert!(v.verify(Some(&token), body, None).is_err());
            Ok(())
        },
    );
}

// ───────────────────────────── Standard Webhooks ─────────────────────────────

fn wh_headers(id: &str, ts: &str, sig: &str) -> Option<http::HeaderMap> {
    let mut h = http::HeaderMap::new();
    h.insert("webhook-id", id.parse().ok()?);
    h.insert("webhook-timestamp", ts.parse().ok()?);
    h.insert("webhook-signature", sig.parse().ok()?);
    Some(h)
}

#[test]
fn webhook_random_headers_are_never_accepted() {
    let ours = WebhookVerifier::new(&[WH_SECRET])
        .unwrap()
        .with_clock(Clock::fixed(NOW));
    fuzz(
        "webhook random headers",
        (
            ".{0,40}",
            prop_oneof![Just(NOW.to_string()), ".{0,20}"],
            prop_oneof![".{0,200}", "(v1,[A-Za-z0-9+/=]{0,60} ?){0,4}"],
            proptest::collection::vec(any::<u8>(), 0..64),
        ),
        |(id, ts, sig, body)| {
            prop_assert!(ours.verify_parts(&id, &ts, &sig, &body).is_err());
            if let Some(h) = wh_headers(&id, &ts, &sig) {
                prop_assert!(ours.verify(&h, &body).is_err());
            }
            Ok(())
        },
    );
}

#[test]
fn webhook_mutated_requests_are_accepted_only_unchanged() {
    let ours = WebhookVerifier::new(&[WH_SECRET])
        .unwrap()
        .with_clock(Clock::fixed(NOW));
    let theirs = standardwebhooks::Webhook::new(WH_SECRET).unwrap();
    let key = outbox_client::signing::decode_secret(WH_SECRET).unwrap();
    fuzz(
        "webhook mutated requests",
        (
            "msg_[A-Za-z0-9]{1,20}",
            -200i64..200,
            // The official crate signs only UTF-8 payloads.
            ".{0,40}".prop_map(String::into_bytes),
            0usize..4,
            mutation(),
            byte_flip(),
        ),
        |(id, skew, body, field, m, flip)| {
            let ts = NOW + skew;
            // The official crate's signature verifies with ours, and our
            // sink's with theirs (their clock is the real one: sign near now).
            let official = theirs.sign(&id, ts, &body).unwrap();
            prop_assert!(ours
                .verify_parts(&id, &ts.to_string(), &official, &body)
                .is_ok());
            let real_now = chrono::Utc::now().timestamp() + skew;
            let by_sink = outbox_client::signing::sign(&key, &id, real_now, &body);
            let headers = wh_headers(&id, &real_now.to_string(), &by_sink).unwrap();
            prop_assert!(theirs.verify(&body, &headers).is_ok());

            let (mut id2, mut ts2, mut sig2, mut body2) =
                (id.clone(), ts.to_string(), official.clone(), body.clone());
            match field {
                0 => id2 = mutate(&id, &m),
                1 => ts2 = mutate(&ts2, &m),
                2 => sig2 = mutate(&official, &m),
                _ => body2 = flip_byte(&body, flip),
            }
            if let Ok(verified) = ours.verify_parts(&id2, &ts2, &sig2, &body2) {
                prop_assert_eq!(&verified.id, &id);
                prop_assert_eq!(verified.timestamp, ts);
                prop_assert_eq!(&body2, &body);
                prop_assert!(sig2.split(' ').any(|s| s == official));
            }
            Ok(())
        },
    );
}

// ───────────────────────────── failure reports ─────────────────────────────

/// JSON shaped like a failure report, with any field any type.
fn report_like() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,20}".prop_map(Value::from),
        Just(json!("1")),
        Just(json!(["k-1"])),
    ];
    let field = leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::hash_map(
                prop_oneof![
                    Just("X-Outbox-Id".to_owned()),
                    Just("x-outbox-idempotency-key".to_owned()),
                    ".{0,8}"
                ],
                inner,
                0..4
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    proptest::collection::hash_map(
        prop_oneof![
            Just("status".to_owned()),
            Just("body".to_owned()),
            Just("retried".to_owned()),
            Just("sourceHeader".to_owned()),
            Just("sourceBody".to_owned()),
            Just("dlqId".to_owned()),
            ".{0,8}"
        ],
        field,
        0..7,
    )
    .prop_map(|m| Value::Object(m.into_iter().collect()))
}

#[test]
fn failure_reports_never_panic_and_never_pass_a_success() {
    let valid = |status: u16| {
        json!({"status": status, "retried": 3, "body": STANDARD.encode("down"),
               "sourceHeader": {"X-Outbox-Id": ["41"], "X-Outbox-Idempotency-Key": ["k-41"]},
               "sourceBody": STANDARD.encode(r#"{"id":"41"}"#)})
    };
    fuzz(
        "failure reports",
        (
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..300),
                report_like().prop_map(|v| serde_json::to_vec(&v).unwrap()),
                (100u16..600, mutation())
                    .prop_map(move |(s, m)| mutate(&valid(s).to_string(), &m).into_bytes()),
            ],
            100u16..600,
        ),
        |(bytes, status)| {
            if let Ok(report) = parse_failure_report(&bytes) {
                prop_assert!(!(200..300).contains(&report.status));
                prop_assert!(!report.deduplication_id.trim().is_empty());
            }
            // The unmutated report: taken exactly when it reports a failure.
            let parsed = parse_failure_report(&serde_json::to_vec(&valid(status)).unwrap());
            prop_assert_eq!(parsed.is_ok(), !(200..300).contains(&status));
            if let Ok(report) = parsed {
                prop_assert_eq!(report.outbox_id, 41);
                prop_assert_eq!(report.deduplication_id.as_str(), "k-41");
            }
            Ok(())
        },
    );
}

#[test]
fn delivery_callbacks_never_panic_and_read_the_status_right() {
    let valid = |status: u16, retried: u32| {
        json!({"status": status, "retried": retried, "maxRetries": 3, "body": STANDARD.encode("answer"),
               "sourceHeader": {"X-Outbox-Id": ["41"], "X-Outbox-Idempotency-Key": ["k-41"]}})
    };
    fuzz(
        "delivery callbacks",
        (
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..300),
                report_like().prop_map(|v| serde_json::to_vec(&v).unwrap()),
                (100u16..600, mutation()).prop_map(move |(s, m)| mutate(
                    &valid(s, 0).to_string(),
                    &m
                )
                .into_bytes()),
            ],
            0u16..600,
            0u32..5,
        ),
        |(bytes, status, retried)| {
            if let Ok(report) = parse_delivery_report(&bytes) {
                prop_assert!(!report.deduplication_id.trim().is_empty());
                prop_assert_eq!(
                    report.verdict == Verdict::Delivered,
                    (200..300).contains(&report.status)
                );
            }
            // The unmutated callback: delivered exactly on a 2xx, failed for
            // good once the retries are used up, retried before that.
            let parsed =
                parse_delivery_report(&serde_json::to_vec(&valid(status, retried)).unwrap())
                    .unwrap();
            let expected = if (200..300).contains(&status) {
                Verdict::Delivered
            } else if retried >= 3 {
                Verdict::Failed
            } else {
                Verdict::Retrying
            };
            prop_assert_eq!(parsed.verdict, expected);
            prop_assert_eq!(parsed.outbox_id, 41);
            Ok(())
        },
    );
}
