//! QStash request signing: the `Upstash-Signature` JWT.
//!
//! HS256 over the literal signing-key string (including its `sig_` prefix),
//! claims `iss = "Upstash"`, `sub` = destination, `exp = iat + 300`, `nbf = 0`,
//! `iat`, a unique `jti`, and `body` = base64url(SHA-256(raw body)) with `=`
//! padding as in QStash's documented example (verifiers strip the padding).

use base64::engine::general_purpose::{URL_SAFE, URL_SAFE_NO_PAD};
use base64::Engine;
use hmac::{Hmac, Mac};
use serde::Serialize;
use sha2::{Digest, Sha256};

/// The `qstash dev` server's default token (base64 of the default user's credentials).
pub const DEV_TOKEN: &str =
    "eyJVc2VySUQiOiJkZWZhdWx0VXNlciIsIlBhc3N3b3JkIjoiZGVmYXVsdFBhc3N3b3JkIn0=";
/// The `qstash dev` server's current signing key.
pub const DEV_CURRENT_SIGNING_KEY: &str = "sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r";
/// The `qstash dev` server's next signing key.
pub const DEV_NEXT_SIGNING_KEY: &str = "sig_5ZB6DVzB1wjE8S6rZ7eenA8Pdnhs";

/// How long a signature is valid, as QStash signs it.
pub const SIGNATURE_LIFETIME_SECS: i64 = 300;

/// The claims of an `Upstash-Signature` JWT.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct SignatureClaims {
    pub iss: String,
    pub sub: String,
    pub exp: i64,
    pub nbf: i64,
    pub iat: i64,
    pub jti: String,
    pub body: String,
}

impl SignatureClaims {
    /// Claims for one delivery attempt of `body` to `destination` at `now` (unix seconds).
    pub fn new(destination: &str, body: &[u8], now: i64, jti: impl Into<String>) -> Self {
        SignatureClaims {
            iss: "Upstash".to_owned(),
            sub: destination.to_owned(),
            exp: now + SIGNATURE_LIFETIME_SECS,
            nbf: 0,
            iat: now,
            jti: jti.into(),
            body: body_hash(body),
        }
    }
}

/// base64url (padded) SHA-256 of a body, the `body` claim.
pub fn body_hash(body: &[u8]) -> String {
    URL_SAFE.encode(Sha256::digest(body))
}

/// An HS256 JWT of `claims`, keyed by the UTF-8 bytes of `signing_key`.
pub fn sign(signing_key: &str, claims: &SignatureClaims) -> String {
    const HEADER: &str = r#"{"alg":"HS256","typ":"JWT"}"#;
    let payload = serde_json::to_vec(claims).expect("claims serialize");
    let mut token = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(HEADER),
        URL_SAFE_NO_PAD.encode(payload)
    );
    let mut mac = Hmac::<Sha256>::new_from_slice(signing_key.as_bytes())
        .expect("HMAC takes keys of any length");
    mac.update(token.as_bytes());
    let sig = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
    token.push('.');
    token.push_str(&sig);
    token
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_test_vector() {
        // The test vector of docs/qstash-protocol.md: fixed claims signed with
        // the dev server's current key.
        let claims = SignatureClaims {
            iss: "Upstash".into(),
            sub: "https://example.com/api".into(),
            exp: 1700000300,
            nbf: 0,
            iat: 1700000000,
            jti: "jwt_fixed".into(),
            body: body_hash(br#"{"hello":"world"}"#),
        };
        assert_eq!(claims.body, "k6I5cakU5erL8KjSUVTNownDwccvu5kU1Hxg88toFYg=");
        assert_eq!(
            sign(DEV_CURRENT_SIGNING_KEY, &claims),
            "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJpc3MiOiJVcHN0YXNoIiwic3ViIjoiaHR0cHM6Ly9leGFtcGxlLmNvbS9hcGkiLCJleHAiOjE3MDAwMDAzMDAsIm5iZiI6MCwiaWF0IjoxNzAwMDAwMDAwLCJqdGkiOiJqd3RfZml4ZWQiLCJib2R5IjoiazZJNWNha1U1ZXJMOEtqU1VWVE5vd25Ed2NjdnU1a1UxSHhnODh0b0ZZZz0ifQ.1IpfJFb5w3fvlKJNdf9nIy4R4eZ13xEuxpq51AJ7J64"
        );
    }

    #[test]
    fn empty_body_hash() {
        assert_eq!(
            body_hash(b""),
            "47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU="
        );
    }
}
