//! The consuming side: QStash and Standard Webhooks signatures checked against
//! independent implementations, consume_once against a real PostgreSQL, and
//! the example consumer and failure callback over real HTTP.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use base64::engine::general_purpose::{STANDARD, URL_SAFE, URL_SAFE_NO_PAD};
use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
mod common;
/// The example consumer (`cargo run --example consumer`), its unit tests included.
#[path = "../examples/consumer.rs"]
#[allow(dead_code)] // its main() and serve() run only as the example binary
mod example;

use common::jwt;
use example::{ExampleConfig, ExampleConsumer, SubjectCheck};
use jsonwebtoken::Algorithm;
use outbox_client::consumer::idempotent::{consume_once, prune_processed, ConsumeError, Consumed};
use outbox_client::consumer::qstash::{Clock, SignatureError, Verifier};
use outbox_client::consumer::webhooks::{WebhookError, WebhookVerifier};
use outbox_client::{enqueue, NewEvent};
use outbox_relay::server::callback::{callback_router, CallbackOptions};
use outbox_testkit::TestDb;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use uuid::Uuid;

// The local dev server's keys (docs/qstash-protocol.md, "The local development server").
const CURRENT: &str = "sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r";
const NEXT: &str = "sig_5ZB6DVzB1wjE8S6rZ7eenA8Pdnhs";
const OTHER: &str = "sig_6jWGaWRxHsw4vMSPJprXadyvrybF";

const NOW: i64 = 1_700_000_000;
const URL: &str = "https://example.com/api";

fn body_hash(body: &[u8]) -> String {
    URL_SAFE.encode(Sha256::digest(body))
}

/// Claims the way QStash mints them, at `NOW`.
fn claims(body: &[u8]) -> Value {
    json!({
        "iss": "Upstash",
        "sub": URL,
        "exp": NOW + 300,
        "nbf": 0,
        "iat": NOW,
        "jti": "jwt_test",
        "body": body_hash(body),
    })
}

fn verifier() -> Verifier {
    Verifier::new(CURRENT, Some(NEXT)).with_clock(Clock::fixed(NOW))
}

const BODY: &[u8] = br#"{"type":"order.placed","orderId":"o-1"}"#;

// ───────────────────────────── QStash signatures ─────────────────────────────

#[test]
fn qstash_test_vector_verifies_at_its_time_and_expires_after() {
    let token = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJpc3MiOiJVcHN0YXNoIiwic3ViIjoiaHR0cHM6Ly9leGFtcGxlLmNvbS9hcGkiLCJleHAiOjE3MDAwMDAzMDAsIm5iZiI6MCwiaWF0IjoxNzAwMDAwMDAwLCJqdGkiOiJqd3RfZml4ZWQiLCJib2R5IjoiazZJNWNha1U1ZXJMOEtqU1VWVE5vd25Ed2NjdnU1a1UxSHhnODh0b0ZZZz0ifQ.1IpfJFb5w3fvlKJNdf9nIy4R4eZ13xEuxpq51AJ7J64";
    let body = br#"{"hello":"world"}"#;
    let claims = verifier()
        .verify(Some(token), body, Some("https://example.com/api"))
        .unwrap();
    assert_eq!(claims.subject.as_deref(), Some("https://example.com/api"));
    assert_eq!(claims.expires_at, 1_700_000_300);
    assert_eq!(claims.jwt_id.as_deref(), Some("jwt_fixed"));
    assert!(!claims.signed_with_next_key);
    let later = verifier().with_clock(Clock::fixed(1_700_000_300));
    assert_eq!(
        later.verify(Some(token), body, None),
        Err(SignatureError::Expired {
            exp: 1_700_000_300,
            now: 1_700_000_300
        })
    );
    assert!(matches!(
        verifier().verify(Some(token), br#"{"hello": "world"}"#, None),
        Err(SignatureError::BodyMismatch { .. })
    ));
}

#[test]
fn qstash_current_and_next_keys_verify() {
    let c = claims(BODY);
    let by_current = verifier()
        .verify(Some(&jwt(CURRENT, &c, Algorithm::HS256)), BODY, Some(URL))
        .unwrap();
    assert!(!by_current.signed_with_next_key);
    let by_next = verifier()
        .verify(Some(&jwt(NEXT, &c, Algorithm::HS256)), BODY, Some(URL))
        .unwrap();
    assert!(by_next.signed_with_next_key);
    // Without a next key configured, the next key's signature is foreign.
    let only_current = Verifier::new(CURRENT, None).with_clock(Clock::fixed(NOW));
    assert_eq!(
        only_current.verify(Some(&jwt(NEXT, &c, Algorithm::HS256)), BODY, None),
        Err(SignatureError::BadSignature)
    );
}

#[test]
fn qstash_wrong_key_is_a_bad_signature() {
    let token = jwt(OTHER, &claims(BODY), Algorithm::HS256);
    assert_eq!(
        verifier().verify(Some(&token), BODY, None),
        Err(SignatureError::BadSignature)
    );
    // The key is the literal `sig_…` string, not its base64 decoding or a part of it.
    let token = jwt(&CURRENT[4..], &claims(BODY), Algorithm::HS256);
    assert_eq!(
        verifier().verify(Some(&token), BODY, None),
        Err(SignatureError::BadSignature)
    );
}

#[test]
fn qstash_expiry_honours_the_clock_tolerance() {
    let mut c = claims(BODY);
    c["exp"] = json!(NOW - 10);
    let token = jwt(CURRENT, &c, Algorithm::HS256);
    assert_eq!(
        verifier().verify(Some(&token), BODY, None),
        Err(SignatureError::Expired {
            exp: NOW - 10,
            now: NOW
        })
    );
    let tolerant = verifier().with_tolerance(Duration::from_secs(30));
    assert!(tolerant.verify(Some(&token), BODY, None).is_ok());
    let not_enough = verifier().with_tolerance(Duration::from_secs(10));
    assert!(matches!(
        not_enough.verify(Some(&token), BODY, None),
        Err(SignatureError::Expired { .. })
    ));
}

#[test]
fn qstash_requires_exp() {
    let mut c = claims(BODY);
    c.as_object_mut().unwrap().remove("exp");
    let token = jwt(CURRENT, &c, Algorithm::HS256);
    assert!(matches!(
        verifier().verify(Some(&token), BODY, None),
        Err(SignatureError::Malformed(m)) if m.contains("exp")
    ));
}

#[test]
fn qstash_future_nbf_is_not_yet_valid() {
    let mut c = claims(BODY);
    c["nbf"] = json!(NOW + 60);
    let token = jwt(CURRENT, &c, Algorithm::HS256);
    assert_eq!(
        verifier().verify(Some(&token), BODY, None),
        Err(SignatureError::NotYetValid {
            nbf: NOW + 60,
            now: NOW
        })
    );
    let tolerant = verifier().with_tolerance(Duration::from_secs(60));
    assert!(tolerant.verify(Some(&token), BODY, None).is_ok());
}

#[test]
fn qstash_wrong_issuer_is_rejected() {
    let mut c = claims(BODY);
    c["iss"] = json!("Downstash");
    let token = jwt(CURRENT, &c, Algorithm::HS256);
    assert_eq!(
        verifier().verify(Some(&token), BODY, None),
        Err(SignatureError::WrongIssuer {
            found: Some("Downstash".into())
        })
    );
    c.as_object_mut().unwrap().remove("iss");
    let token = jwt(CURRENT, &c, Algorithm::HS256);
    assert_eq!(
        verifier().verify(Some(&token), BODY, None),
        Err(SignatureError::WrongIssuer { found: None })
    );
}

#[test]
fn qstash_subject_must_equal_the_expected_url_exactly() {
    let token = jwt(CURRENT, &claims(BODY), Algorithm::HS256);
    assert!(verifier().verify(Some(&token), BODY, Some(URL)).is_ok());
    assert_eq!(
        verifier().verify(Some(&token), BODY, Some("https://example.com/api/")),
        Err(SignatureError::WrongSubject {
            found: Some(URL.into()),
            expected: "https://example.com/api/".into()
        })
    );
    // No expected URL: `sub` is not checked.
    assert!(verifier().verify(Some(&token), BODY, None).is_ok());
}

#[test]
fn qstash_tampered_body_is_rejected() {
    let token = jwt(CURRENT, &claims(BODY), Algorithm::HS256);
    let mut tampered = BODY.to_vec();
    tampered[10] ^= 1;
    assert!(matches!(
        verifier().verify(Some(&token), &tampered, None),
        Err(SignatureError::BodyMismatch { .. })
    ));
    assert!(matches!(
        verifier().verify(Some(&token), b"", None),
        Err(SignatureError::BodyMismatch { .. })
    ));
}

#[test]
fn qstash_body_hash_padded_unpadded_and_standard_alphabet() {
    let body = br#"{"i":0}"#;
    let digest = Sha256::digest(body);
    let mut c = claims(body);
    for (claim, ok) in [
        (URL_SAFE.encode(digest), true),
        (URL_SAFE_NO_PAD.encode(digest), true),
        (STANDARD.encode(digest), false),
    ] {
        c["body"] = json!(claim);
        let token = jwt(CURRENT, &c, Algorithm::HS256);
        let result = verifier().verify(Some(&token), body, None);
        assert_eq!(result.is_ok(), ok, "{claim}: {result:?}");
        if !ok {
            assert!(matches!(result, Err(SignatureError::BodyMismatch { .. })));
        }
    }
    // The vectors of docs/qstash-protocol.md: this body's standard form has a '/',
    // its URL-safe one '_'.
    assert_eq!(
        STANDARD.encode(digest),
        "6fdOcVoYBqplFInc8XbncBOzyFHbwRTMnCTy/p1BHWU="
    );
}

#[test]
fn qstash_only_hs256_is_accepted() {
    for alg in [Algorithm::HS384, Algorithm::HS512] {
        let token = jwt(CURRENT, &claims(BODY), alg);
        assert!(
            matches!(
                verifier().verify(Some(&token), BODY, None),
                Err(SignatureError::Malformed(m)) if m.contains("HS256")
            ),
            "{alg:?}"
        );
    }
    // alg "none" with an empty signature.
    let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"none","typ":"JWT"}"#);
    let payload = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims(BODY)).unwrap());
    assert!(matches!(
        verifier().verify(Some(&format!("{header}.{payload}.")), BODY, None),
        Err(SignatureError::Malformed(_))
    ));
}

#[test]
fn qstash_missing_header_is_missing() {
    assert_eq!(
        verifier().verify(None, BODY, None),
        Err(SignatureError::Missing)
    );
    assert_eq!(
        verifier().verify(Some("  "), BODY, None),
        Err(SignatureError::Missing)
    );
    assert_eq!(
        verifier().verify_headers(&http::HeaderMap::new(), BODY, None),
        Err(SignatureError::Missing)
    );
}

#[test]
fn qstash_garbage_and_mutated_tokens_are_rejected_without_panics() {
    let v = verifier();
    let valid = jwt(CURRENT, &claims(BODY), Algorithm::HS256);
    assert!(v.verify(Some(&valid), BODY, None).is_ok());
    let fixed = [
        "garbage",
        "a.b.c",
        "..",
        "....",
        "e30.e30.",
        "e30.e30.e30",
        "eyJhbGciOiJIUzI1NiJ9.bnVsbA.AAAA",
        "eyJhbGciOiJIUzI1NiJ9.W10.AAAA",
        "eyJhbGciOiJIUzI1NiJ9.eyJleHAiOiJ4In0.AAAA",
        "\u{0}\u{1}.\u{ff}.é",
    ];
    for t in fixed {
        assert!(v.verify(Some(t), BODY, None).is_err(), "{t:?}");
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let alphabet: Vec<char> =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_+/=.é\u{0} "
            .chars()
            .collect();
    for _ in 0..3000 {
        // Random strings.
        let len = rng.random_range(0..200);
        let s: String = (0..len)
            .map(|_| alphabet[rng.random_range(0..alphabet.len())])
            .collect();
        assert!(v.verify(Some(&s), BODY, None).is_err());
        // One character of a valid token replaced by a different one.
        let mut chars: Vec<char> = valid.chars().collect();
        let i = rng.random_range(0..chars.len());
        let replacement = loop {
            let c = alphabet[rng.random_range(0..alphabet.len())];
            if c != chars[i] {
                break c;
            }
        };
        chars[i] = replacement;
        let mutated: String = chars.iter().collect();
        assert!(v.verify(Some(&mutated), BODY, None).is_err(), "{mutated}");
        // A valid token cut short.
        let cut = rng.random_range(0..valid.len());
        assert!(v.verify(Some(&valid[..cut]), BODY, None).is_err());
        // Random JSON in correctly signed tokens.
        let junk = json!({"iss": rng.random::<u32>(), "exp": [1], "body": {"x": 1}, "nbf": "soon"});
        let token = jwt(CURRENT, &junk, Algorithm::HS256);
        assert!(v.verify(Some(&token), BODY, None).is_err());
    }
    // Huge numbers and NaN-like values in claims.
    for exp in [
        json!(1e300),
        json!(-1e300),
        json!(u64::MAX),
        json!(i64::MIN),
    ] {
        let mut c = claims(BODY);
        c["exp"] = exp;
        let token = jwt(CURRENT, &c, Algorithm::HS256);
        assert!(v.verify(Some(&token), BODY, None).is_err());
    }
    let mut c = claims(BODY);
    c["exp"] = json!(i64::MAX);
    let token = jwt(CURRENT, &c, Algorithm::HS256);
    assert!(v
        .clone()
        .with_tolerance(Duration::from_secs(u64::MAX))
        .verify(Some(&token), BODY, None)
        .is_ok());
}

// ───────────────────────────── Standard Webhooks ─────────────────────────────

const WH_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const WH_OLD_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const WH_FOREIGN_SECRET: &str = "whsec_dGhpcyBpcyBub3QgdGhlIHNlY3JldA==";

fn wh_headers(id: &str, timestamp: i64, signature: &str) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    h.insert("webhook-id", id.parse().unwrap());
    h.insert("webhook-timestamp", timestamp.to_string().parse().unwrap());
    h.insert("webhook-signature", signature.parse().unwrap());
    h
}

fn now() -> i64 {
    chrono::Utc::now().timestamp()
}

#[test]
fn webhook_signed_by_the_official_crate_verifies_with_ours() {
    let theirs = standardwebhooks::Webhook::new(WH_SECRET).unwrap();
    let ts = now();
    let signature = theirs.sign("msg_1", ts, BODY).unwrap();
    let ours = WebhookVerifier::new(&[WH_SECRET]).unwrap();
    let verified = ours
        .verify(&wh_headers("msg_1", ts, &signature), BODY)
        .unwrap();
    assert_eq!(verified.id, "msg_1");
    assert_eq!(verified.timestamp, ts);
}

#[test]
fn webhook_signed_by_our_sink_verifies_with_the_official_crate() {
    let key = outbox_client::signing::decode_secret(WH_SECRET).unwrap();
    let ts = now();
    let signature = outbox_client::signing::sign(&key, "msg_2", ts, BODY);
    let theirs = standardwebhooks::Webhook::new(WH_SECRET).unwrap();
    theirs
        .verify(BODY, &wh_headers("msg_2", ts, &signature))
        .unwrap();
    let wrong = standardwebhooks::Webhook::new(WH_OLD_SECRET).unwrap();
    assert!(wrong
        .verify(BODY, &wh_headers("msg_2", ts, &signature))
        .is_err());
}

#[test]
fn webhook_rotation_and_multiple_signatures() {
    let ts = 1_700_000_000;
    let clock = Clock::fixed(ts);
    let sign_with = |secret: &str| {
        standardwebhooks::Webhook::new(secret)
            .unwrap()
            .sign("msg_3", ts, BODY)
            .unwrap()
    };
    let (new_sig, old_sig, foreign_sig) = (
        sign_with(WH_SECRET),
        sign_with(WH_OLD_SECRET),
        sign_with(WH_FOREIGN_SECRET),
    );
    // The receiver already knows the new secret and still accepts the old one.
    let rotating = WebhookVerifier::new(&[WH_SECRET, WH_OLD_SECRET])
        .unwrap()
        .with_clock(clock.clone());
    for sig in [&new_sig, &old_sig] {
        assert!(rotating.verify(&wh_headers("msg_3", ts, sig), BODY).is_ok());
    }
    // A sender mid-rotation sends both; any matching entry is enough.
    let only_new = WebhookVerifier::new(&[WH_SECRET])
        .unwrap()
        .with_clock(clock.clone());
    let both = format!("{foreign_sig} v2,abc {new_sig}");
    assert!(only_new
        .verify(&wh_headers("msg_3", ts, &both), BODY)
        .is_ok());
    assert_eq!(
        only_new.verify(
            &wh_headers("msg_3", ts, &format!("{foreign_sig} {old_sig}")),
            BODY
        ),
        Err(WebhookError::BadSignature)
    );
    // Only non-v1 entries: nothing to check.
    let v2_only = new_sig.replacen("v1,", "v2,", 1);
    assert!(matches!(
        only_new.verify(&wh_headers("msg_3", ts, &v2_only), BODY),
        Err(WebhookError::Malformed { .. })
    ));
    // The id is signed too.
    assert_eq!(
        only_new.verify(&wh_headers("msg_4", ts, &new_sig), BODY),
        Err(WebhookError::BadSignature)
    );
}

#[test]
fn webhook_timestamps_outside_the_tolerance_are_rejected_both_ways() {
    let now = 1_700_000_000;
    let verifier = WebhookVerifier::new(&[WH_SECRET])
        .unwrap()
        .with_clock(Clock::fixed(now));
    let theirs = standardwebhooks::Webhook::new(WH_SECRET).unwrap();
    let at = |ts: i64| {
        let sig = theirs.sign("msg_5", ts, BODY).unwrap();
        verifier.verify(&wh_headers("msg_5", ts, &sig), BODY)
    };
    assert!(at(now - 300).is_ok());
    assert!(at(now + 300).is_ok());
    assert_eq!(
        at(now - 301),
        Err(WebhookError::Expired {
            timestamp: now - 301,
            now
        })
    );
    assert_eq!(
        at(now + 301),
        Err(WebhookError::NotYetValid {
            timestamp: now + 301,
            now
        })
    );
    let strict = verifier.clone().with_tolerance(Duration::from_secs(10));
    let sig = theirs.sign("msg_5", now - 11, BODY).unwrap();
    assert!(matches!(
        strict.verify(&wh_headers("msg_5", now - 11, &sig), BODY),
        Err(WebhookError::Expired { .. })
    ));
}

#[test]
fn webhook_tampered_body_missing_and_garbage_headers() {
    let ts = now();
    let verifier = WebhookVerifier::new(&[WH_SECRET]).unwrap();
    let sig = standardwebhooks::Webhook::new(WH_SECRET)
        .unwrap()
        .sign("msg_6", ts, BODY)
        .unwrap();
    let mut tampered = BODY.to_vec();
    tampered.push(b' ');
    assert_eq!(
        verifier.verify(&wh_headers("msg_6", ts, &sig), &tampered),
        Err(WebhookError::BadSignature)
    );
    let mut h = wh_headers("msg_6", ts, &sig);
    h.remove("webhook-id");
    assert_eq!(
        verifier.verify(&h, BODY),
        Err(WebhookError::Missing("webhook-id"))
    );
    let mut h = wh_headers("msg_6", ts, &sig);
    h.insert("webhook-timestamp", "soon".parse().unwrap());
    assert!(matches!(
        verifier.verify(&h, BODY),
        Err(WebhookError::Malformed {
            header: "webhook-timestamp",
            ..
        })
    ));
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for _ in 0..2000 {
        let junk: String = (0..rng.random_range(0..120))
            .map(|_| char::from(rng.random_range(0x20u8..0x7f)))
            .collect();
        assert!(verifier
            .verify_parts("msg_6", &ts.to_string(), &junk, BODY)
            .is_err());
        assert!(
            verifier.verify_parts("msg_6", &junk, &sig, BODY).is_err()
                || junk.trim() == ts.to_string()
        );
    }
    assert!(WebhookVerifier::new::<&str>(&[]).is_err());
    assert!(WebhookVerifier::new(&["not-a-secret"]).is_err());
}

// ───────────────────────────── consume_once ─────────────────────────────

async fn setup_db() -> (TestDb, outbox_relay::store::Pool) {
    let db = common::test_db().await;
    let pool = common::pool(&db, 12);
    let conn = pool.get().await.unwrap();
    conn.batch_execute("CREATE TABLE side_effects (message_id text NOT NULL, note text)")
        .await
        .unwrap();
    drop(conn);
    (db, pool)
}

async fn scalar(pool: &outbox_relay::store::Pool, sql: &str) -> i64 {
    common::count_on(&pool.get().await.unwrap(), sql).await
}

#[derive(Debug, PartialEq)]
struct Boom;

#[tokio::test]
async fn consume_once_runs_the_work_once_for_concurrent_duplicates() {
    let (_db, pool) = setup_db().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(tokio::sync::Barrier::new(8));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (pool, runs, start) = (pool.clone(), runs.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = pool.get().await.unwrap();
            start.wait().await;
            consume_once(&mut *conn, "billing", "msg-1", move |tx| {
                Box::pin(async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tx.execute(
                        "INSERT INTO side_effects (message_id) VALUES ('msg-1')",
                        &[],
                    )
                    .await
                })
            })
            .await
        }));
    }
    let mut processed = 0;
    let mut duplicates = 0;
    for t in tasks {
        match t.await.unwrap().unwrap() {
            Consumed::Processed(1) => processed += 1,
            Consumed::Processed(n) => panic!("inserted {n} rows"),
            Consumed::Duplicate => duplicates += 1,
        }
    }
    assert_eq!((processed, duplicates), (1, 7));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(scalar(&pool, "SELECT count(*) FROM side_effects").await, 1);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_messages").await,
        1
    );
    // Another consumer has its own namespace.
    let mut conn = pool.get().await.unwrap();
    let other = consume_once(&mut *conn, "shipping", "msg-1", |_tx| {
        Box::pin(async { Ok::<_, Boom>("shipped") })
    })
    .await
    .unwrap();
    assert_eq!(other, Consumed::Processed("shipped"));
}

/// Polls until `sql` counts at least one row; the condition, not a delay,
/// is what the test waits for.
async fn until_some(pool: &outbox_relay::store::Pool, what: &str, sql: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while scalar(pool, sql).await == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never saw: {what}");
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn a_second_delivery_waits_for_the_first_and_runs_only_if_it_failed() {
    let (_db, pool) = setup_db().await;
    for first_fails in [false, true] {
        let id = format!("msg-{first_fails}");
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let first = {
            let (pool, id) = (pool.clone(), id.clone());
            tokio::spawn(async move {
                let mut conn = pool.get().await.unwrap();
                consume_once(&mut *conn, "billing", &id, move |_tx| {
                    Box::pin(async move {
                        released.await.unwrap();
                        if first_fails {
                            Err(Boom)
                        } else {
                            Ok("first")
                        }
                    })
                })
                .await
            })
        };
        // The first holds its dedupe row uncommitted until released.
        until_some(
            &pool,
            "the first delivery's open transaction",
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
             WHERE a.datname = current_database() AND l.locktype = 'transactionid'
               AND l.mode = 'ExclusiveLock' AND a.state = 'idle in transaction'",
        )
        .await;
        let second = {
            let (pool, id) = (pool.clone(), id.clone());
            tokio::spawn(async move {
                let mut conn = pool.get().await.unwrap();
                consume_once(&mut *conn, "billing", &id, |_tx| {
                    Box::pin(async { Ok::<_, Boom>("second") })
                })
                .await
            })
        };
        until_some(
            &pool,
            "the second delivery blocked on the first",
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .await;
        release.send(()).unwrap();
        let first = first.await.unwrap();
        let second = second.await.unwrap().unwrap();
        if first_fails {
            assert!(matches!(first, Err(ConsumeError::Work(Boom))));
            assert_eq!(second, Consumed::Processed("second"));
        } else {
            assert_eq!(first.unwrap(), Consumed::Processed("first"));
            assert_eq!(second, Consumed::Duplicate);
        }
    }
}

#[tokio::test]
async fn failing_work_leaves_no_dedupe_row_and_the_retry_runs() {
    let (_db, pool) = setup_db().await;
    let mut conn = pool.get().await.unwrap();
    let failed = consume_once(&mut *conn, "billing", "msg-9", |tx| {
        Box::pin(async move {
            tx.execute(
                "INSERT INTO side_effects VALUES ('msg-9', 'half done')",
                &[],
            )
            .await
            .unwrap();
            Err::<(), _>(Boom)
        })
    })
    .await;
    assert!(matches!(failed, Err(ConsumeError::Work(Boom))));
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM side_effects").await, 0);
    let retried = consume_once(&mut *conn, "billing", "msg-9", |tx| {
        Box::pin(async move {
            tx.execute("INSERT INTO side_effects VALUES ('msg-9', 'done')", &[])
                .await
        })
    })
    .await
    .unwrap();
    assert_eq!(retried, Consumed::Processed(1));
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_messages WHERE consumer = 'billing' AND message_id = 'msg-9'").await,
        1
    );
    // A failing SQL statement inside the work is a work error too.
    let bad_sql = consume_once(&mut *conn, "billing", "msg-10", |tx| {
        Box::pin(async move {
            tx.execute("INSERT INTO no_such_table VALUES (1)", &[])
                .await
        })
    })
    .await;
    assert!(matches!(bad_sql, Err(ConsumeError::Work(_))));
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM processed_messages WHERE message_id = 'msg-10'"
        )
        .await,
        0
    );
}

/// Given the caller's open transaction, the dedupe row and the work go into a
/// savepoint: they commit or roll back with the caller's transaction, and a
/// failed work leaves that transaction usable.
#[tokio::test]
async fn consume_once_in_the_callers_transaction_commits_and_rolls_back_with_it() {
    async fn record(
        tx: &tokio_postgres::Transaction<'_>,
        note: &str,
    ) -> Result<u64, tokio_postgres::Error> {
        tx.execute("INSERT INTO side_effects VALUES ('msg-tx', $1)", &[&note])
            .await
    }
    let (_db, pool) = setup_db().await;
    let mut conn = pool.get().await.unwrap();
    let mut tx = conn.transaction().await.unwrap();
    record(&tx, "the caller's own write").await.unwrap();
    let done = consume_once(&mut tx, "billing", "msg-tx", |tx| {
        Box::pin(record(tx, "work"))
    })
    .await
    .unwrap();
    assert_eq!(done, Consumed::Processed(1));
    let again = consume_once(&mut tx, "billing", "msg-tx", |_tx| {
        Box::pin(async { Ok::<_, Boom>(()) })
    })
    .await
    .unwrap();
    assert_eq!(again, Consumed::Duplicate);
    let failed = consume_once(&mut tx, "billing", "msg-tx-2", |tx| {
        Box::pin(async move {
            record(tx, "half done").await.unwrap();
            Err::<(), _>(Boom)
        })
    })
    .await;
    assert!(matches!(failed, Err(ConsumeError::Work(Boom))));
    let inside: (i64, i64) = {
        let row = tx
            .query_one(
                "SELECT (SELECT count(*) FROM side_effects), (SELECT count(*) FROM processed_messages)",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(
        inside,
        (2, 1),
        "the failed work's savepoint is gone, the rest is there"
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_messages").await,
        0,
        "nothing is visible before the caller commits"
    );
    tx.rollback().await.unwrap();
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM side_effects").await, 0);

    // The caller's rollback took the dedupe row with it: the redelivery runs.
    let mut tx = conn.transaction().await.unwrap();
    let redelivered = consume_once(&mut tx, "billing", "msg-tx", |tx| {
        Box::pin(record(tx, "work"))
    })
    .await
    .unwrap();
    assert_eq!(redelivered, Consumed::Processed(1));
    tx.commit().await.unwrap();
    assert_eq!(scalar(&pool, "SELECT count(*) FROM side_effects").await, 1);
    let later = consume_once(&mut *conn, "billing", "msg-tx", |_tx| {
        Box::pin(async { Ok::<_, Boom>(()) })
    })
    .await
    .unwrap();
    assert_eq!(later, Consumed::Duplicate);
}

#[tokio::test]
async fn prune_deletes_only_rows_past_the_ttl_in_batches() {
    let (_db, pool) = setup_db().await;
    pool.get()
        .await
        .unwrap()
        .batch_execute(
            "INSERT INTO processed_messages (consumer, message_id, processed_at)
             SELECT 'c', 'old-' || i, now() - interval '2 days' FROM generate_series(1, 25) i;
             INSERT INTO processed_messages (consumer, message_id, processed_at)
             SELECT 'c', 'new-' || i, now() - interval '1 hour' FROM generate_series(1, 5) i;",
        )
        .await
        .unwrap();
    let conn = pool.get().await.unwrap();
    let deleted = prune_processed(&conn, Duration::from_secs(24 * 3600), 10)
        .await
        .unwrap();
    assert_eq!(deleted, 25);
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM processed_messages WHERE message_id LIKE 'new-%'"
        )
        .await,
        5
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_messages").await,
        5
    );
    assert_eq!(
        prune_processed(&conn, Duration::from_secs(24 * 3600), 10)
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        prune_processed(&conn, Duration::from_secs(60), 2)
            .await
            .unwrap(),
        5
    );
}

// ───────────────────────────── over HTTP ─────────────────────────────

struct Server {
    addr: SocketAddr,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn serve(router: axum::Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    Server { addr, _stop: stop }
}

struct Reply {
    status: u16,
    headers: http::HeaderMap,
    body: String,
}

async fn post(addr: SocketAddr, path: &str, headers: &[(&str, String)], body: &[u8]) -> Reply {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let mut req = http::Request::post(format!("http://{addr}{path}"));
    for (name, value) in headers {
        req = req.header(*name, value);
    }
    let resp = client
        .request(req.body(Full::new(Bytes::copy_from_slice(body))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

/// The URL QStash delivers the example consumer's events to.
const CONSUMER_URL: &str = "https://consumer.example.com/hooks/orders";
/// The URL QStash sends failure reports to.
const CALLBACK_URL: &str = "https://relay.example.com/qstash/failure";

/// An `Upstash-Signature` for `body` sent to the example consumer, minted now with `key`.
fn sign_now(key: &str, body: &[u8]) -> String {
    sign_for(key, CONSUMER_URL, body)
}

/// An `Upstash-Signature` for `body` sent to `url`, minted now with `key`.
fn sign_for(key: &str, url: &str, body: &[u8]) -> String {
    let now = chrono::Utc::now().timestamp();
    jwt(
        key,
        &json!({"iss": "Upstash", "sub": url, "exp": now + 300, "nbf": 0,
                "iat": now, "jti": format!("jwt_{}", Uuid::new_v4().simple()), "body": body_hash(body)}),
        Algorithm::HS256,
    )
}

async fn example_server() -> (TestDb, outbox_relay::store::Pool, Server) {
    let (db, pool) = setup_db().await;
    example::prepare(&pool).await.unwrap();
    let consumer = ExampleConsumer {
        pool: pool.clone(),
        verifier: Verifier::new(CURRENT, Some(NEXT)).with_tolerance(Duration::from_secs(5)),
        consumer: "example".into(),
        subject: SubjectCheck::Exact(CONSUMER_URL.into()),
    };
    let server = serve(example::router(consumer)).await;
    (db, pool, server)
}

fn delivery(key: &str, outbox_id: &str, body: &[u8]) -> Vec<(&'static str, String)> {
    vec![
        ("upstash-signature", sign_now(key, body)),
        ("x-outbox-id", outbox_id.to_owned()),
        ("content-type", "application/json".to_owned()),
    ]
}

#[tokio::test]
async fn example_consumer_processes_once_and_acknowledges_the_duplicate() {
    let (_db, pool, server) = example_server().await;
    let body = envelope(41);
    let first = post(server.addr, "/", &delivery(CURRENT, "41", &body), &body).await;
    assert_eq!((first.status, first.body.as_str()), (200, "processed"));
    // QStash redelivers (a fresh JWT, signed by the next key after a rotation).
    let again = post(server.addr, "/", &delivery(NEXT, "41", &body), &body).await;
    assert_eq!((again.status, again.body.as_str()), (200, "duplicate"));
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM example_received_events WHERE message_id = '41' AND event_type = 'order.placed'").await,
        1
    );
}

/// A body as the relay sends it with `body = "envelope"`, for outbox row `id`.
fn envelope(id: i64) -> Vec<u8> {
    format!(
        r#"{{"id":"{id}","type":"order.placed","aggregateType":"order","aggregateId":"o-{id}","tenantId":"00000000-0000-0000-0000-000000000007","partitionKey":"order:o-{id}","payload":{{"orderId":"o-{id}"}},"createdAt":"2026-12-01T03:00:00.000000Z"}}"#
    )
    .into_bytes()
}

#[tokio::test]
async fn example_consumer_replay_under_a_future_id_does_not_swallow_that_event() {
    let (_db, pool, server) = example_server().await;
    let body_41 = envelope(41);
    let genuine = delivery(CURRENT, "41", &body_41);
    let first = post(server.addr, "/", &genuine, &body_41).await;
    assert_eq!((first.status, first.body.as_str()), (200, "processed"));
    // Someone holding that signed delivery sends it again within `exp`, with
    // the unsigned X-Outbox-Id of an event that does not exist yet.
    let mut replay = genuine.clone();
    replay.retain(|(n, _)| *n != "x-outbox-id");
    replay.push(("x-outbox-id", "99".into()));
    let replayed = post(server.addr, "/", &replay, &body_41).await;
    assert_eq!(replayed.status, 401, "{}", replayed.body);
    // Event 99 really arrives later: it must be processed, not taken for a duplicate.
    let body_99 = envelope(99);
    let real = post(
        server.addr,
        "/",
        &delivery(CURRENT, "99", &body_99),
        &body_99,
    )
    .await;
    assert_eq!((real.status, real.body.as_str()), (200, "processed"));
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM example_received_events WHERE message_id = '99' AND body->>'id' = '99'"
        )
        .await,
        1
    );
    // The plain replay of the genuine delivery is a duplicate.
    let again = post(server.addr, "/", &genuine, &body_41).await;
    assert_eq!((again.status, again.body.as_str()), (200, "duplicate"));
}

#[tokio::test]
async fn example_config_checks_the_url_by_default() {
    let (_db, pool) = setup_db().await;
    example::prepare(&pool).await.unwrap();
    let config = ExampleConfig::from_lookup(|name| match name {
        "DATABASE_URL" => Some("postgres://postgres@127.0.0.1:5432/app".into()),
        "QSTASH_CURRENT_SIGNING_KEY" => Some(CURRENT.into()),
        _ => None,
    })
    .unwrap();
    let server = serve(example::router(ExampleConsumer {
        pool: pool.clone(),
        verifier: Verifier::new(CURRENT, None),
        consumer: "example".into(),
        subject: config.subject,
    }))
    .await;
    let own_url = format!("http://{}/hooks/orders", server.addr);
    let body = envelope(51);
    let signed = |url: &str| vec![("upstash-signature", sign_for(CURRENT, url, &body))];
    // A delivery QStash made for another endpoint of the same account.
    let elsewhere = post(server.addr, "/hooks/orders", &signed(CONSUMER_URL), &body).await;
    assert_eq!(elsewhere.status, 401, "{}", elsewhere.body);
    assert!(elsewhere.body.contains("subject"), "{}", elsewhere.body);
    // Forwarded headers are not trusted unless configured.
    let mut spoofed = signed(CONSUMER_URL);
    spoofed.push(("x-forwarded-proto", "https".into()));
    spoofed.push(("x-forwarded-host", "consumer.example.com".into()));
    let spoofed = post(server.addr, "/hooks/orders", &spoofed, &body).await;
    assert_eq!(spoofed.status, 401, "{}", spoofed.body);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    let own = post(server.addr, "/hooks/orders", &signed(&own_url), &body).await;
    assert_eq!((own.status, own.body.as_str()), (200, "processed"));
}

#[tokio::test]
async fn example_consumer_rejects_bad_and_missing_signatures() {
    let (_db, pool, server) = example_server().await;
    let body = envelope(42);
    let mut headers = delivery(OTHER, "42", &body);
    let wrong_key = post(server.addr, "/", &headers, &body).await;
    assert_eq!(wrong_key.status, 401);
    headers.retain(|(n, _)| *n != "upstash-signature");
    let missing = post(server.addr, "/", &headers, &body).await;
    assert_eq!(missing.status, 401);
    // Signed for another body.
    let mut other_body = delivery(CURRENT, "42", b"{}");
    other_body.push(("x-extra", "1".into()));
    let tampered = post(server.addr, "/", &other_body, &body).await;
    assert_eq!(tampered.status, 401);
    assert!(tampered.body.contains("body hash"), "{}", tampered.body);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM example_received_events").await,
        0
    );
}

#[tokio::test]
async fn example_consumer_tells_qstash_not_to_retry_a_poison_message() {
    let (_db, pool, server) = example_server().await;
    // Not JSON; no event type; no `id` (a route that sends only the payload).
    for body in [
        &b"not json at all"[..],
        br#"{"id":"43","orderId":"o-1"}"#,
        BODY,
    ] {
        let headers = delivery(CURRENT, "43", body);
        let reply = post(server.addr, "/", &headers, body).await;
        assert_eq!(reply.status, 489, "{}", reply.body);
        assert_eq!(
            reply
                .headers
                .get("upstash-nonretryable-error")
                .map(|v| v.to_str().unwrap()),
            Some("true")
        );
    }
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
}

#[tokio::test]
async fn example_consumer_answers_5xx_when_the_work_fails_and_processes_the_retry() {
    let (_db, pool, server) = example_server().await;
    pool.get()
        .await
        .unwrap()
        .batch_execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN RAISE EXCEPTION 'ledger is closed'; END $$;
             CREATE TRIGGER refuse BEFORE INSERT ON example_received_events
               FOR EACH ROW EXECUTE FUNCTION refuse();",
        )
        .await
        .unwrap();
    let body = envelope(44);
    let failed = post(server.addr, "/", &delivery(CURRENT, "44", &body), &body).await;
    assert_eq!(failed.status, 500);
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    pool.get()
        .await
        .unwrap()
        .batch_execute("DROP TRIGGER refuse ON example_received_events")
        .await
        .unwrap();
    let retried = post(server.addr, "/", &delivery(CURRENT, "44", &body), &body).await;
    assert_eq!((retried.status, retried.body.as_str()), (200, "processed"));
}

// ───────────────────────────── failure callback ─────────────────────────────

async fn published_row(pool: &outbox_relay::store::Pool, key: &str) -> i64 {
    let mut conn = pool.get().await.unwrap();
    let tx = conn.transaction().await.unwrap();
    let event = NewEvent::new(
        Uuid::new_v4(),
        "order",
        "o-1",
        "order.placed",
        json!({"orderId": "o-1"}),
        key,
    );
    let id = match enqueue(&tx, &event).await.unwrap() {
        outbox_client::Enqueued::New { id } => id,
        other => panic!("{other:?}"),
    };
    tx.commit().await.unwrap();
    conn.execute(
        "UPDATE outbox SET published_at = now(), attempt_count = 1, locked_until = now() + interval '1 minute' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    id
}

fn failure_report(source_headers: Value, source_body: &[u8]) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "status": 503,
        "header": {"content-type": ["text/plain"]},
        "body": STANDARD.encode("upstream is down\nfor maintenance"),
        "retried": 3,
        "maxRetries": 3,
        "dlqId": "1725323658779-0",
        "sourceMessageId": "msg_abc",
        "url": "https://consumer.example.com/hook",
        "method": "POST",
        "sourceHeader": source_headers,
        "sourceBody": STANDARD.encode(source_body),
        "notBefore": 1701198458025u64,
        "createdAt": 1701198447054u64,
    }))
    .unwrap()
}

async fn row_state(pool: &outbox_relay::store::Pool, id: i64) -> (bool, Option<String>, bool) {
    let row = pool
        .get()
        .await
        .unwrap()
        .query_one(
            "SELECT dead_lettered_at IS NOT NULL, last_error, locked_until IS NULL FROM outbox WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// Posts a failure report signed with `key`.
async fn report_to(server: &Server, key: &str, report: &[u8]) -> Reply {
    post(
        server.addr,
        "/qstash/failure",
        &[("upstash-signature", sign_for(key, CALLBACK_URL, report))],
        report,
    )
    .await
}

async fn callback_server() -> (TestDb, outbox_relay::store::Pool, Server) {
    callback_server_with(CallbackOptions::new([CALLBACK_URL])).await
}

#[tokio::test]
async fn failure_callback_dead_letters_the_published_row_with_the_reason() {
    let (_db, pool, server) = callback_server().await;
    let id = published_row(&pool, "k-cb-1").await;
    let other = published_row(&pool, "k-cb-2").await;
    let report = failure_report(
        json!({"Content-Type": ["application/json"], "x-OUTBOX-id": [id.to_string()],
               "x-outbox-idempotency-key": ["k-cb-1"]}),
        BODY,
    );
    let reply = report_to(&server, CURRENT, &report).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert_eq!(
        row_state(&pool, id).await,
        (
            true,
            Some(
                // The answer's newline becomes a space: last_error is one readable line.
                "qstash: status 503 after 3 retries: upstream is down for maintenance (dlqId 1725323658779-0)"
                    .to_owned()
            ),
            true
        )
    );
    assert_eq!(row_state(&pool, other).await, (false, None, false));

    // Headers as plain strings, and only the envelope's id: both are found.
    let report = failure_report(
        json!({"X-Event-Id": other.to_string(), "X-Outbox-Idempotency-Key": "k-cb-2"}),
        format!(r#"{{"id": {other}}}"#).as_bytes(),
    );
    let reply = report_to(&server, NEXT, &report).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(row_state(&pool, other).await.0);
    let third = published_row(&pool, "k-cb-3").await;
    let report = failure_report(
        json!({"Upstash-Deduplication-Id": ["k-cb-3"]}),
        format!(r#"{{"id":"{third}","type":"t"}}"#).as_bytes(),
    );
    let reply = report_to(&server, CURRENT, &report).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(row_state(&pool, third).await.0);
}

#[tokio::test]
async fn failure_callback_with_a_bad_signature_changes_nothing() {
    let (_db, pool, server) = callback_server().await;
    let id = published_row(&pool, "k-cb-4").await;
    let report = failure_report(json!({"X-Outbox-Id": [id.to_string()]}), BODY);
    for headers in [
        vec![("upstash-signature", sign_for(OTHER, CALLBACK_URL, &report))],
        vec![(
            "upstash-signature",
            sign_for(CURRENT, CALLBACK_URL, b"another body"),
        )],
        vec![],
    ] {
        let reply = post(server.addr, "/qstash/failure", &headers, &report).await;
        assert_eq!(reply.status, 401, "{}", reply.body);
    }
    assert_eq!(row_state(&pool, id).await, (false, None, false));
}

#[tokio::test]
async fn failure_callback_unknown_id_is_404_and_garbage_is_400() {
    let (_db, pool, server) = callback_server().await;
    let id = published_row(&pool, "k-cb-5").await;
    let report = failure_report(
        json!({"X-Outbox-Id": ["987654"], "X-Outbox-Idempotency-Key": ["k-cb-5"]}),
        BODY,
    );
    let reply = report_to(&server, CURRENT, &report).await;
    assert_eq!(reply.status, 404, "{}", reply.body);
    let mut bad_reports: Vec<Vec<u8>> = vec![
        b"not json".to_vec(),
        b"{}".to_vec(),
        br#"{"status": "five hundred"}"#.to_vec(),
        br#"{"status": 500, "sourceHeader": {"X-Outbox-Id": ["abc"]}}"#.to_vec(),
        br#"{"status": 500, "sourceBody": "%%%not base64%%%"}"#.to_vec(),
        br#"{"status": 500, "sourceHeader": {"X-Outbox-Id": [1]}}"#.to_vec(),
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for _ in 0..20 {
        bad_reports.push((0..rng.random_range(0..64)).map(|_| rng.random()).collect());
    }
    for report in bad_reports {
        let reply = report_to(&server, CURRENT, &report).await;
        assert_eq!(
            reply.status,
            400,
            "{:?}: {}",
            String::from_utf8_lossy(&report),
            reply.body
        );
    }
    assert_eq!(row_state(&pool, id).await, (false, None, false));
    // Nothing else answers.
    let reply = post(server.addr, "/qstash/other", &[], b"{}").await;
    assert_eq!(reply.status, 404);
}

/// The report QStash sends when the attempt with deduplication id `key` of
/// outbox row `id` failed with `status`.
fn report_on(id: i64, key: &str, status: u16) -> Vec<u8> {
    let mut report: Value = serde_json::from_slice(&failure_report(
        json!({"X-Outbox-Id": [id.to_string()], "X-Outbox-Idempotency-Key": [key]}),
        &envelope(id),
    ))
    .unwrap();
    report["status"] = json!(status);
    serde_json::to_vec(&report).unwrap()
}

#[tokio::test]
async fn failure_callback_refuses_a_success_report() {
    let (_db, pool, server) = callback_server().await;
    let id = published_row(&pool, "k-cb-ok").await;
    // A signed success callback (the same signing key signs both kinds).
    for status in [200, 201, 204] {
        let reply = report_to(&server, CURRENT, &report_on(id, "k-cb-ok", status)).await;
        assert_eq!(reply.status, 400, "{}", reply.body);
        assert!(reply.body.contains("not a failure"), "{}", reply.body);
    }
    assert_eq!(row_state(&pool, id).await, (false, None, false));
}

#[tokio::test]
async fn failure_callback_ignores_a_late_report_on_a_replayed_row() {
    let (_db, pool, server) = callback_server().await;
    let id = published_row(&pool, "k-cb-late").await;
    let first_failure = report_on(id, "k-cb-late", 503);
    let reply = report_to(&server, CURRENT, &first_failure).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(row_state(&pool, id).await.0);
    // The operator replays the row (a new deduplication id) and the relay
    // publishes it again.
    let selector = outbox_relay::cli::dlq::Selector {
        ids: vec![id],
        ..Default::default()
    };
    let replayed = outbox_relay::store::Store::with_pool(pool.clone())
        .replay_dead(&selector.selection())
        .await
        .unwrap();
    assert_eq!(replayed.len(), 1);
    pool.get()
        .await
        .unwrap()
        .execute(
            "UPDATE outbox SET published_at = now(), attempt_count = 1 WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    // QStash retries the first report's callback (or it is replayed): it is
    // about the old attempt and must not touch the new one.
    let reply = report_to(&server, CURRENT, &first_failure).await;
    assert_eq!(reply.status, 409, "{}", reply.body);
    assert!(reply.body.contains("k-cb-late"), "{}", reply.body);
    assert!(!row_state(&pool, id).await.0);
    // A report without the deduplication id cannot say which attempt it is about.
    let unkeyed = failure_report(json!({"X-Outbox-Id": [id.to_string()]}), &envelope(id));
    let reply = report_to(&server, CURRENT, &unkeyed).await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert!(!row_state(&pool, id).await.0);
}

async fn callback_server_with(
    options: CallbackOptions,
) -> (TestDb, outbox_relay::store::Pool, Server) {
    let (db, pool) = setup_db().await;
    let server = serve(callback_router(
        outbox_relay::store::Store::with_pool(pool.clone()),
        Verifier::new(CURRENT, Some(NEXT)),
        options,
    ))
    .await;
    (db, pool, server)
}

/// A report's head and the first `sent` bytes of its body over a raw socket;
/// the rest is left unsent. `length` is the Content-Length, or chunked when `None`.
async fn start_report(
    addr: SocketAddr,
    signature: Option<&str>,
    length: Option<usize>,
    sent: &[u8],
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut head = format!(
        "POST /qstash/failure HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n"
    );
    if let Some(signature) = signature {
        head.push_str(&format!("upstash-signature: {signature}\r\n"));
    }
    match length {
        Some(n) => head.push_str(&format!("content-length: {n}\r\n\r\n")),
        None => head.push_str("transfer-encoding: chunked\r\n\r\n"),
    }
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    if length.is_some() {
        stream.write_all(sent).await.unwrap();
    } else if !sent.is_empty() {
        stream
            .write_all(format!("{:x}\r\n", sent.len()).as_bytes())
            .await
            .unwrap();
        stream.write_all(sent).await.unwrap();
        stream.write_all(b"\r\n").await.unwrap();
    }
    stream
}

/// The status of the response on `stream`; the test's own limit only keeps
/// a broken server from hanging it.
async fn response_status(stream: &mut tokio::net::TcpStream) -> u16 {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    tokio::time::timeout(Duration::from_secs(20), async {
        while !got.windows(2).any(|w| w == b"\r\n") {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed without an answer");
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("no answer");
    let line = String::from_utf8_lossy(&got);
    line.split(' ').nth(1).unwrap().parse().unwrap()
}

#[tokio::test]
async fn failure_callback_bounds_size_and_time_before_verifying_the_body() {
    let mut options = CallbackOptions::new([CALLBACK_URL]);
    options.max_body_bytes = 4096;
    options.read_timeout = Duration::from_millis(300);
    let (_db, pool, server) = callback_server_with(options).await;
    let id = published_row(&pool, "k-cb-big").await;
    let big = report_on(id, "k-cb-big", 503)
        .into_iter()
        .chain(std::iter::repeat_n(b' ', 8000))
        .collect::<Vec<u8>>();
    let signed_big = sign_for(CURRENT, CALLBACK_URL, &big);
    // Declared too long: refused without reading a byte of it.
    let mut s = start_report(server.addr, Some(&signed_big), Some(big.len()), b"").await;
    assert_eq!(response_status(&mut s).await, 413);
    // Chunked, so the length shows only while reading: refused at the limit.
    let mut s = start_report(server.addr, Some(&signed_big), None, &big[..5000]).await;
    assert_eq!(response_status(&mut s).await, 413);
    // A bad signature is refused before the body is awaited (else: 408).
    let mut s = start_report(server.addr, Some("not.a.jwt"), Some(1000), b"").await;
    assert_eq!(response_status(&mut s).await, 401);
    let mut s = start_report(server.addr, None, Some(1000), b"").await;
    assert_eq!(response_status(&mut s).await, 401);
    // A body that stops coming is given up on.
    let report = report_on(id, "k-cb-big", 503);
    let signed = sign_for(CURRENT, CALLBACK_URL, &report);
    let mut s = start_report(
        server.addr,
        Some(&signed),
        Some(report.len()),
        &report[..10],
    )
    .await;
    assert_eq!(response_status(&mut s).await, 408);
    assert_eq!(row_state(&pool, id).await, (false, None, false));
    // The same report sent whole is taken.
    let reply = report_to(&server, CURRENT, &report).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
}

#[tokio::test]
async fn failure_callback_limits_the_reports_in_flight() {
    let mut options = CallbackOptions::new([CALLBACK_URL]);
    options.max_concurrent = 2;
    // A report waits this long for a slot before it is refused.
    options.slot_wait = Duration::from_millis(100);
    let (_db, pool, server) = callback_server_with(options).await;
    let mut held = Vec::new();
    for key in ["k-cb-c1", "k-cb-c2"] {
        let id = published_row(&pool, key).await;
        let report = report_on(id, key, 503);
        let signed = sign_for(CURRENT, CALLBACK_URL, &report);
        let stream = start_report(
            server.addr,
            Some(&signed),
            Some(report.len()),
            &report[..20],
        )
        .await;
        held.push((stream, report, id));
    }
    // Wait until both slow reports hold their slots: an unsigned request is
    // then refused for lack of a slot (503), not for its signature (401).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let probe = post(server.addr, "/qstash/failure", &[], b"{}").await;
        if probe.status == 503 {
            assert_eq!(
                probe
                    .headers
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap()),
                Some("1")
            );
            break;
        }
        assert_eq!(probe.status, 401, "{}", probe.body);
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slots never filled"
        );
        tokio::task::yield_now().await;
    }
    let third = published_row(&pool, "k-cb-c3").await;
    let report = report_on(third, "k-cb-c3", 503);
    let refused = report_to(&server, CURRENT, &report).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert!(!row_state(&pool, third).await.0);
    // The slow ones finish and free their slots.
    for (mut stream, report, id) in held {
        use tokio::io::AsyncWriteExt;
        stream.write_all(&report[20..]).await.unwrap();
        assert_eq!(response_status(&mut stream).await, 200);
        assert!(row_state(&pool, id).await.0);
    }
    let reply = report_to(&server, CURRENT, &report).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(row_state(&pool, third).await.0);
}

/// A burst of reports larger than the slots queues for a slot instead of
/// being turned away: a report that comes while every slot is taken is
/// answered 200 once one frees (within `slot_wait`), not 503.
#[tokio::test]
async fn a_report_that_finds_every_slot_taken_waits_for_one() {
    let mut options = CallbackOptions::new([CALLBACK_URL]);
    options.max_concurrent = 1;
    let (_db, pool, server) = callback_server_with(options).await;
    let slow_id = published_row(&pool, "k-cb-w1").await;
    let slow = report_on(slow_id, "k-cb-w1", 503);
    let signed = sign_for(CURRENT, CALLBACK_URL, &slow);
    let mut stream = start_report(server.addr, Some(&signed), Some(slow.len()), &slow[..20]).await;
    // Wait until the slow report holds the one slot: an unsigned request
    // then waits for it too, rather than being refused at once for its
    // signature (401).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let probe = tokio::time::timeout(
            Duration::from_millis(300),
            post(server.addr, "/qstash/failure", &[], b"{}"),
        )
        .await;
        match probe {
            Err(_) => break,
            Ok(p) => assert_eq!(p.status, 401, "{}", p.body),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slot never filled"
        );
    }
    let waiting_id = published_row(&pool, "k-cb-w2").await;
    let waiting = report_on(waiting_id, "k-cb-w2", 503);
    let addr = server.addr;
    let reply = tokio::spawn(async move {
        let signed = sign_for(CURRENT, CALLBACK_URL, &waiting);
        post(
            addr,
            "/qstash/failure",
            &[("upstash-signature", signed)],
            &waiting,
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !reply.is_finished(),
        "the report was answered while every slot was taken"
    );
    use tokio::io::AsyncWriteExt;
    stream.write_all(&slow[20..]).await.unwrap();
    assert_eq!(response_status(&mut stream).await, 200);
    let reply = reply.await.unwrap();
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(row_state(&pool, waiting_id).await.0);
}

#[tokio::test]
async fn failure_callback_checks_the_url_it_was_called_at() {
    let (_db, pool, server) = callback_server().await;
    let id = published_row(&pool, "k-cb-url").await;
    let report = report_on(id, "k-cb-url", 500);
    for url in [
        "https://other-service.example.com/qstash/failure",
        "https://relay.example.com/qstash/failure/",
        CONSUMER_URL,
    ] {
        let reply = post(
            server.addr,
            "/qstash/failure",
            &[("upstash-signature", sign_for(CURRENT, url, &report))],
            &report,
        )
        .await;
        assert_eq!(reply.status, 401, "{url}: {}", reply.body);
        assert!(reply.body.contains("subject"), "{}", reply.body);
    }
    assert_eq!(row_state(&pool, id).await, (false, None, false));
    let reply = report_to(&server, CURRENT, &report).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
}

/// The failure callback served the way the daemon serves it, with the
/// connection limits of `options`.
async fn guarded_callback_server(
    options: CallbackOptions,
) -> (TestDb, SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let (db, pool) = setup_db().await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (addr, _task) = outbox_relay::server::callback::serve(
        "127.0.0.1:0".parse().unwrap(),
        outbox_relay::store::Store::with_pool(pool),
        Verifier::new(CURRENT, Some(NEXT)),
        options,
        async {
            let _ = stopped.await;
        },
    )
    .await
    .unwrap();
    (db, addr, stop)
}

/// Reads until the server closes the connection; the test's own limit only
/// keeps a server that never closes it from hanging the test.
async fn closed_by_server(stream: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

#[tokio::test]
async fn failure_callback_closes_connections_that_go_quiet() {
    use tokio::io::AsyncWriteExt;
    let mut options = CallbackOptions::new([CALLBACK_URL]);
    options.idle_timeout = Duration::from_millis(300);
    let (_db, addr, _stop) = guarded_callback_server(options).await;
    // Nothing at all, and headers that never end.
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"POST /qstash/failure HTTP/1.1\r\nhost: relay\r\nx-a: ")
        .await
        .unwrap();
    assert!(
        closed_by_server(&mut silent).await,
        "a silent client was kept"
    );
    assert!(
        closed_by_server(&mut slow).await,
        "unfinished headers were waited on"
    );
    // A client that keeps talking is served.
    let reply = post(addr, "/qstash/failure", &[], b"{}").await;
    assert_eq!(reply.status, 401, "{}", reply.body);
}

#[tokio::test]
async fn failure_callback_caps_open_connections() {
    use tokio::io::AsyncWriteExt;
    let mut options = CallbackOptions::new([CALLBACK_URL]);
    options.max_connections = 2;
    let (_db, addr, _stop) = guarded_callback_server(options).await;
    let first = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _second = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The third is accepted only when one of the two goes away.
    let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
    third
        .write_all(b"POST /qstash/failure HTTP/1.1\r\nhost: relay\r\ncontent-length: 2\r\n\r\n{}")
        .await
        .unwrap();
    let mut byte = [0u8; 1];
    use tokio::io::AsyncReadExt;
    let early = tokio::time::timeout(Duration::from_millis(300), third.read(&mut byte)).await;
    assert!(early.is_err(), "served over the connection limit");
    drop(first);
    assert_eq!(response_status(&mut third).await, 401);
}

const DELIVERY_CALLBACK_URL: &str = "https://relay.example.com/qstash/callback";

/// A row QStash took for an ordered route: held until its callback comes.
async fn held_row(pool: &outbox_relay::store::Pool, key: &str) -> i64 {
    let id = published_row(pool, key).await;
    pool.get()
        .await
        .unwrap()
        .execute(
            "UPDATE outbox SET published_at = NULL, accepted_at = now(),
                    locked_until = now() + interval '1 hour' WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    id
}

/// `(published, dead-lettered, held for more than 30 minutes, last_error)`.
async fn delivery_state(
    pool: &outbox_relay::store::Pool,
    id: i64,
) -> (bool, bool, bool, Option<String>) {
    let row = pool
        .get()
        .await
        .unwrap()
        .query_one(
            "SELECT published_at IS NOT NULL, dead_lettered_at IS NOT NULL,
                    coalesce(locked_until > now() + interval '30 minutes', false), last_error
             FROM outbox WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

async fn callback_report(server: &Server, key: &str, url: &str, report: &[u8]) -> Reply {
    post(
        server.addr,
        "/qstash/callback",
        &[("upstash-signature", sign_for(key, url, report))],
        report,
    )
    .await
}

#[tokio::test]
async fn delivery_callback_is_verified_and_tied_to_the_held_attempt() {
    let mut options = CallbackOptions::new([CALLBACK_URL]);
    options.callback_urls = vec![DELIVERY_CALLBACK_URL.to_owned()];
    options.hold = Duration::from_secs(3600);
    let (_db, pool, server) = callback_server_with(options).await;
    let delivered = held_row(&pool, "k-dc-1").await;
    let ok = report_on(delivered, "k-dc-1", 200);

    // Unsigned, signed by someone else, or signed for the failure callback's
    // URL (a replayed report meant for the other endpoint): refused, untouched.
    let unsigned = post(server.addr, "/qstash/callback", &[], &ok).await;
    assert_eq!(unsigned.status, 401, "{}", unsigned.body);
    let forged = callback_report(&server, "sig_not_ours", DELIVERY_CALLBACK_URL, &ok).await;
    assert_eq!(forged.status, 401, "{}", forged.body);
    let other_url = callback_report(&server, CURRENT, CALLBACK_URL, &ok).await;
    assert_eq!(other_url.status, 401, "{}", other_url.body);
    assert_eq!(
        delivery_state(&pool, delivered).await,
        (false, false, true, None)
    );
    // Not a report, or one that cannot say which attempt it is about: 400.
    let junk = callback_report(&server, CURRENT, DELIVERY_CALLBACK_URL, b"{\"status\":").await;
    assert_eq!(junk.status, 400, "{}", junk.body);
    let unkeyed = serde_json::to_vec(&json!({
        "status": 200, "sourceHeader": {"X-Outbox-Id": [delivered.to_string()]}
    }))
    .unwrap();
    let reply = callback_report(&server, CURRENT, DELIVERY_CALLBACK_URL, &unkeyed).await;
    assert_eq!(reply.status, 400, "{}", reply.body);
    // A report about another deduplication id (an attempt since replaced) is stale.
    let other_attempt = report_on(delivered, "k-dc-old", 200);
    let reply = callback_report(&server, CURRENT, DELIVERY_CALLBACK_URL, &other_attempt).await;
    assert_eq!(reply.status, 409, "{}", reply.body);
    assert_eq!(
        delivery_state(&pool, delivered).await,
        (false, false, true, None)
    );

    // The genuine success callback publishes the row and ends its hold.
    let reply = callback_report(&server, CURRENT, DELIVERY_CALLBACK_URL, &ok).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let (published, dead, held, _) = delivery_state(&pool, delivered).await;
    assert!(published && !dead && !held);
    // A failure report arriving after it (late, or replayed) changes nothing;
    // it is acknowledged, so QStash does not call again.
    let late = report_on(delivered, "k-dc-1", 503);
    let reply = callback_report(&server, CURRENT, DELIVERY_CALLBACK_URL, &late).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    assert!(reply.body.contains("already final"), "{}", reply.body);
    assert_eq!(
        delivery_state(&pool, delivered).await,
        (true, false, false, None)
    );

    // QStash still retrying: the row stays held, with the destination's answer.
    let retrying = held_row(&pool, "k-dc-2").await;
    pool.get()
        .await
        .unwrap()
        .execute(
            "UPDATE outbox SET locked_until = now() + interval '1 minute' WHERE id = $1",
            &[&retrying],
        )
        .await
        .unwrap();
    let mut report: Value = serde_json::from_slice(&report_on(retrying, "k-dc-2", 503)).unwrap();
    report["retried"] = json!(1);
    let report = serde_json::to_vec(&report).unwrap();
    let reply = callback_report(&server, CURRENT, DELIVERY_CALLBACK_URL, &report).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let (published, dead, held, error) = delivery_state(&pool, retrying).await;
    assert!(!published && !dead && held, "the hold was not extended");
    assert!(error.unwrap().contains("503"));

    // QStash gave up (retried == maxRetries): dead-lettered with the reason.
    let failed = held_row(&pool, "k-dc-3").await;
    let reply = callback_report(
        &server,
        CURRENT,
        DELIVERY_CALLBACK_URL,
        &report_on(failed, "k-dc-3", 503),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let (published, dead, _, error) = delivery_state(&pool, failed).await;
    assert!(!published && dead);
    assert!(error.unwrap().contains("upstream is down"));
}
