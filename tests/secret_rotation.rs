//! Rotating a webhook route's signing secret, against the real relay, a real
//! PostgreSQL and the test sink's webhook endpoint on a loopback port: a
//! route holding two secrets signs every request with both (two entries in
//! `webhook-signature`), so a receiver that knows either one accepts it,
//! checked with the `standardwebhooks` crate and with the consumer
//! toolkit's `WebhookVerifier`.

mod common;

use std::time::Duration;

use common::{config, webhook_route};
use outbox_client::consumer::webhooks::{WebhookError, WebhookVerifier};
use outbox_relay::config::Config;
use outbox_testkit::sink::Received;

const NEW: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const OLD: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const FOREIGN: &str = "whsec_dGhpcyBpcyBub3QgdGhlIHNlY3JldA==";

/// The route with `secrets` (TOML) in place of the test route's one secret.
fn rotating_route(sink_url: &str, secrets: &str) -> String {
    webhook_route(sink_url, "").replace(
        &format!("signing_secret = \"{NEW}\""),
        &format!("signing_secret = {secrets}"),
    )
}

fn headers(r: &Received) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    for name in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
        h.insert(name, r.headers[name].parse().unwrap());
    }
    h
}

/// Delivers 10 events through a route whose `signing_secret` is `secrets`
/// and returns what the sink received.
async fn deliver_with(secrets: &str) -> Vec<Received> {
    let db = common::test_db().await;
    let sink = common::start_sink().await;
    common::insert_events(&db, 10, 10).await;
    let routes = rotating_route(&sink.url(), secrets);
    assert!(routes.contains(OLD), "{routes}");
    common::run_until_drained(
        &db,
        config(&db, &sink.url(), &routes),
        Duration::from_secs(60),
    )
    .await;
    let received = sink.received();
    assert_eq!(received.len(), 10, "one request per event");
    received
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_with_two_secrets_signs_with_both_and_either_verifies() {
    let received = deliver_with(&format!("[\"{NEW}\", \"{OLD}\"]")).await;
    let official = |secret: &str| standardwebhooks::Webhook::new(secret).unwrap();
    let ours = |secret: &str| WebhookVerifier::new(&[secret]).unwrap();
    for r in &received {
        let signature = &r.headers["webhook-signature"];
        assert_eq!(
            signature
                .split(' ')
                .filter(|s| s.starts_with("v1,"))
                .count(),
            2,
            "{signature}"
        );
        let h = headers(r);
        // A receiver still on the old secret, and one already on the new.
        for secret in [NEW, OLD] {
            official(secret)
                .verify(r.body.as_bytes(), &h)
                .unwrap_or_else(|e| panic!("{secret}: {e}"));
            ours(secret).verify(&h, r.body.as_bytes()).unwrap();
        }
        // The toolkit configured with both (the receiver's side of a rotation).
        WebhookVerifier::new(&[OLD, NEW])
            .unwrap()
            .verify(&h, r.body.as_bytes())
            .unwrap();
        // A secret the route does not hold verifies nothing.
        assert!(official(FOREIGN).verify(r.body.as_bytes(), &h).is_err());
        assert_eq!(
            ours(FOREIGN).verify(&h, r.body.as_bytes()),
            Err(WebhookError::BadSignature)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_separated_by_spaces_are_a_rotation_too() {
    // One string holding both, as one value of a secret store can.
    let received = deliver_with(&format!("\"{NEW} {OLD}\"")).await;
    for r in &received {
        let h = headers(r);
        for secret in [NEW, OLD] {
            standardwebhooks::Webhook::new(secret)
                .unwrap()
                .verify(r.body.as_bytes(), &h)
                .unwrap_or_else(|e| panic!("{secret}: {e}"));
        }
    }
}

#[test]
fn a_bad_secret_of_a_rotation_is_refused_saying_which() {
    let route = |secrets: &str| {
        format!(
            "[[routes]]\nevent_type = \"*\"\nsink = \"webhook\"\ndestination = \"https://a.example.com/\"\nsigning_secret = {secrets}\n"
        )
    };
    for (secrets, want) in [
        (
            format!("[\"{NEW}\", \"whsec_***\"]"),
            "routes[0].signing_secret`: secret 2 of 2: the part after `whsec_` is not base64",
        ),
        (
            format!("\"MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw {OLD}\""),
            "routes[0].signing_secret`: secret 1 of 2: must start with `whsec_`",
        ),
        (
            "7".to_owned(),
            "routes[0].signing_secret`: must be a `whsec_…` secret, several separated by spaces, or a list of them",
        ),
        (
            "[]".to_owned(),
            "routes[0].signing_secret`: is required for webhook routes",
        ),
    ] {
        let e = Config::from_toml_str(&route(&secrets))
            .expect_err(&secrets)
            .to_string();
        assert!(e.contains(want), "{secrets}:\n{e}\nwanted: {want}");
        assert!(!e.contains("C2FVsBQ"), "the error shows a secret: {e}");
    }
}
