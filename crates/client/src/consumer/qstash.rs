//! Verifies the `Upstash-Signature` QStash puts on every delivery: an HS256
//! JWT keyed with the signing key's UTF-8 bytes (`sig_…` included) whose
//! `body` claim is the base64url SHA-256 of the raw request body.
//!
//! Stricter than the JS `Receiver` on purpose: only `HS256` is accepted (jose
//! takes any HMAC algorithm), `exp` is required (jose checks it only when
//! present), a `body` claim is required, and `crit` headers are refused.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use base64::engine::general_purpose::{URL_SAFE, URL_SAFE_NO_PAD};
use base64::Engine;
use hmac::{Hmac, Mac};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The request header carrying the JWT.
pub const SIGNATURE_HEADER: &str = "upstash-signature";

/// The only issuer QStash uses.
pub const ISSUER: &str = "Upstash";

/// Longer tokens are refused before any decoding (QStash's are ~400 bytes).
const MAX_TOKEN_LEN: usize = 8 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("no Upstash-Signature header")]
    Missing,
    #[error("Upstash-Signature is not a usable JWT: {0}")]
    Malformed(String),
    #[error("Upstash-Signature was not signed with the current or the next signing key")]
    BadSignature,
    #[error("Upstash-Signature expired at {exp} (now {now})")]
    Expired { exp: i64, now: i64 },
    #[error("Upstash-Signature is not valid before {nbf} (now {now})")]
    NotYetValid { nbf: i64, now: i64 },
    #[error("Upstash-Signature issuer is {found:?}, want \"Upstash\"")]
    WrongIssuer { found: Option<String> },
    #[error("Upstash-Signature subject is {found:?}, want {expected:?}")]
    WrongSubject {
        found: Option<String>,
        expected: String,
    },
    #[error(
        "body hash does not match the signature: claim {claim:?}, body hashes to {computed:?}"
    )]
    BodyMismatch { claim: String, computed: String },
}

impl SignatureError {
    fn malformed(reason: impl Into<String>) -> Self {
        SignatureError::Malformed(reason.into())
    }
}

/// The claims of a verified signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    pub subject: Option<String>,
    pub expires_at: i64,
    pub issued_at: Option<i64>,
    pub jwt_id: Option<String>,
    /// Whether the next signing key verified it (the sender already rotated).
    pub signed_with_next_key: bool,
}

/// Seconds since the Unix epoch; injectable so tests can pin time.
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> i64 + Send + Sync>);

impl Clock {
    pub fn system() -> Clock {
        Clock(Arc::new(|| chrono::Utc::now().timestamp()))
    }

    pub fn fixed(unix_seconds: i64) -> Clock {
        Clock(Arc::new(move || unix_seconds))
    }

    pub fn from_fn(f: impl Fn() -> i64 + Send + Sync + 'static) -> Clock {
        Clock(Arc::new(f))
    }

    pub fn now(&self) -> i64 {
        (self.0)()
    }
}

impl fmt::Debug for Clock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Clock")
    }
}

/// Holds the current and next signing keys; tries them in that order.
#[derive(Clone)]
pub struct Verifier {
    current: Vec<u8>,
    next: Option<Vec<u8>>,
    tolerance: i64,
    clock: Clock,
}

impl fmt::Debug for Verifier {
    // Keys are secrets: never print them.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verifier")
            .field("has_next_key", &self.next.is_some())
            .field("tolerance_secs", &self.tolerance)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct JwtHeader {
    alg: String,
    #[serde(default)]
    crit: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct JwtClaims {
    iss: Option<serde_json::Value>,
    sub: Option<serde_json::Value>,
    exp: Option<serde_json::Value>,
    nbf: Option<serde_json::Value>,
    iat: Option<serde_json::Value>,
    jti: Option<serde_json::Value>,
    body: Option<serde_json::Value>,
}

impl Verifier {
    /// Keys as QStash shows them (`sig_…`); an empty `next` means none.
    /// No clock tolerance and the system clock.
    pub fn new(current: &str, next: Option<&str>) -> Verifier {
        Verifier {
            current: current.as_bytes().to_vec(),
            next: next
                .filter(|k| !k.is_empty())
                .map(|k| k.as_bytes().to_vec()),
            tolerance: 0,
            clock: Clock::system(),
        }
    }

    /// Leeway for `exp` and `nbf`, for clocks that disagree a little.
    pub fn with_tolerance(mut self, tolerance: Duration) -> Verifier {
        self.tolerance = i64::try_from(tolerance.as_secs()).unwrap_or(i64::MAX);
        self
    }

    pub fn with_clock(mut self, clock: Clock) -> Verifier {
        self.clock = clock;
        self
    }

    /// Verifies a request: `signature` is the `Upstash-Signature` value (or
    /// `None` when absent), `body` the raw bytes as received, `expected_url`
    /// the URL QStash delivered to, when the caller wants `sub` checked.
    pub fn verify(
        &self,
        signature: Option<&str>,
        body: &[u8],
        expected_url: Option<&str>,
    ) -> Result<Claims, SignatureError> {
        self.verify_token(signature, expected_url)?.check_body(body)
    }

    /// Everything [`Verifier::verify`] checks except the body hash, so a
    /// server can refuse a bad signature before it reads the body. The
    /// request is genuine only once [`VerifiedToken::check_body`] holds.
    pub fn verify_token(
        &self,
        signature: Option<&str>,
        expected_url: Option<&str>,
    ) -> Result<VerifiedToken, SignatureError> {
        let token = signature
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .ok_or(SignatureError::Missing)?;
        if token.len() > MAX_TOKEN_LEN {
            return Err(SignatureError::malformed("token is too long"));
        }
        let mut parts = token.split('.');
        let (Some(header_b64), Some(claims_b64), Some(sig_b64), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(SignatureError::malformed("not three dot-separated parts"));
        };
        let header: JwtHeader = decode_segment(header_b64, "header")?;
        if header.alg != "HS256" {
            return Err(SignatureError::malformed(format!(
                "algorithm {:?} is not accepted, only HS256",
                header.alg
            )));
        }
        if header.crit.is_some() {
            return Err(SignatureError::malformed("critical header extensions"));
        }
        let sig = URL_SAFE_NO_PAD
            .decode(sig_b64)
            .map_err(|_| SignatureError::malformed("signature is not base64url"))?;
        let signing_input = &token[..header_b64.len() + 1 + claims_b64.len()];

        let signed_with_next_key = if mac_matches(&self.current, signing_input, &sig) {
            false
        } else if self
            .next
            .as_deref()
            .is_some_and(|k| mac_matches(k, signing_input, &sig))
        {
            true
        } else {
            return Err(SignatureError::BadSignature);
        };

        // Claims are read only once a key vouched for them.
        let claims: JwtClaims = decode_segment(claims_b64, "claims")?;
        let issuer = optional_string(claims.iss, "iss")?;
        if issuer.as_deref() != Some(ISSUER) {
            return Err(SignatureError::WrongIssuer { found: issuer });
        }
        let now = self.clock.now();
        let exp = numeric_date(claims.exp, "exp")?
            .ok_or_else(|| SignatureError::malformed("no exp claim"))?;
        if now >= exp.saturating_add(self.tolerance) {
            return Err(SignatureError::Expired { exp, now });
        }
        if let Some(nbf) = numeric_date(claims.nbf, "nbf")? {
            if nbf > now.saturating_add(self.tolerance) {
                return Err(SignatureError::NotYetValid { nbf, now });
            }
        }
        let subject = optional_string(claims.sub, "sub")?;
        if let Some(expected) = expected_url {
            if subject.as_deref() != Some(expected) {
                return Err(SignatureError::WrongSubject {
                    found: subject,
                    expected: expected.to_owned(),
                });
            }
        }
        let body_claim = optional_string(claims.body, "body")?
            .ok_or_else(|| SignatureError::malformed("no body claim"))?;
        Ok(VerifiedToken {
            body_claim,
            claims: Claims {
                subject,
                expires_at: exp,
                issued_at: numeric_date(claims.iat, "iat")?,
                jwt_id: optional_string(claims.jti, "jti")?,
                signed_with_next_key,
            },
        })
    }

    /// [`Verifier::verify_token`] reading the signature from `headers`.
    pub fn verify_token_headers(
        &self,
        headers: &http::HeaderMap,
        expected_url: Option<&str>,
    ) -> Result<VerifiedToken, SignatureError> {
        let signature = match headers.get(SIGNATURE_HEADER) {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .map_err(|_| SignatureError::malformed("header is not ASCII"))?,
            ),
        };
        self.verify_token(signature, expected_url)
    }

    /// [`Verifier::verify`] reading the signature from `headers`.
    pub fn verify_headers(
        &self,
        headers: &http::HeaderMap,
        body: &[u8],
        expected_url: Option<&str>,
    ) -> Result<Claims, SignatureError> {
        self.verify_token_headers(headers, expected_url)?
            .check_body(body)
    }
}

/// A signature whose key, issuer, times and subject held; the body hash is
/// still to be checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedToken {
    body_claim: String,
    claims: Claims,
}

impl VerifiedToken {
    /// The claims, once `body` (the raw bytes as received) matches the hash
    /// the signature carries.
    pub fn check_body(self, body: &[u8]) -> Result<Claims, SignatureError> {
        check_body(&self.body_claim, body)?;
        Ok(self.claims)
    }

    /// The signed claims; not yet bound to a body.
    pub fn claims(&self) -> &Claims {
        &self.claims
    }
}

fn decode_segment<T: for<'de> Deserialize<'de>>(
    segment: &str,
    what: &str,
) -> Result<T, SignatureError> {
    let bytes = URL_SAFE_NO_PAD
        .decode(segment)
        .map_err(|_| SignatureError::malformed(format!("{what} is not base64url")))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| SignatureError::malformed(format!("{what} is not a JSON object: {e}")))
}

fn mac_matches(key: &[u8], signing_input: &str, sig: &[u8]) -> bool {
    // An unset key must not turn into "anyone can sign with the empty key".
    if key.is_empty() {
        return false;
    }
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(key) else {
        return false;
    };
    mac.update(signing_input.as_bytes());
    // Constant-time comparison.
    mac.verify_slice(sig).is_ok()
}

fn optional_string(
    value: Option<serde_json::Value>,
    name: &str,
) -> Result<Option<String>, SignatureError> {
    match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(SignatureError::malformed(format!(
            "{name} claim is not a string"
        ))),
    }
}

/// A JWT NumericDate: seconds, possibly fractional (truncated here).
fn numeric_date(
    value: Option<serde_json::Value>,
    name: &str,
) -> Result<Option<i64>, SignatureError> {
    let bad = || SignatureError::malformed(format!("{name} claim is not a number of seconds"));
    match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Number(n)) => match n.as_i64() {
            Some(i) => Ok(Some(i)),
            None => n
                .as_f64()
                .filter(|f| f.is_finite() && f.abs() < 1e15)
                .map(|f| Some(f.trunc() as i64))
                .ok_or_else(bad),
        },
        Some(_) => Err(bad()),
    }
}

/// The `body` claim against the raw body: URL-safe alphabet, `=` padding
/// optional (QStash pads, the JS SDK compares unpadded). Standard base64
/// (`+`, `/`) never matches.
fn check_body(claim: &str, body: &[u8]) -> Result<(), SignatureError> {
    let digest = Sha256::digest(body);
    let computed = URL_SAFE.encode(digest);
    let unpadded = computed.trim_end_matches('=');
    if claim == computed || claim == unpadded {
        Ok(())
    } else {
        Err(SignatureError::BodyMismatch {
            claim: claim.chars().take(100).collect(),
            computed,
        })
    }
}

/// The URL a client used to reach this server, for the `sub` check behind a
/// reverse proxy: scheme from `X-Forwarded-Proto` (else `default_scheme`),
/// host from `X-Forwarded-Host`, else `Host`, else the request URI's authority,
/// then the path and query as received. Only trust these headers when a proxy
/// you run sets them; `None` when they are absent or implausible.
pub fn public_url(
    headers: &http::HeaderMap,
    uri: &http::Uri,
    default_scheme: &str,
) -> Option<String> {
    rebuild_url(headers, uri, default_scheme, true)
}

/// The URL of this request as this server received it: `scheme`, then `Host`
/// (else the request URI's authority), then the path and query. Unlike
/// [`public_url`], no `X-Forwarded-*` header is read, so a client cannot
/// choose the URL the `sub` check compares against.
pub fn request_url(headers: &http::HeaderMap, uri: &http::Uri, scheme: &str) -> Option<String> {
    rebuild_url(headers, uri, scheme, false)
}

fn rebuild_url(
    headers: &http::HeaderMap,
    uri: &http::Uri,
    default_scheme: &str,
    trust_forwarded: bool,
) -> Option<String> {
    let first = |name: &str| -> Option<String> {
        if !trust_forwarded && name.starts_with("x-forwarded-") {
            return None;
        }
        let v = headers.get(name)?.to_str().ok()?;
        // Proxies chain values: the first is the client-facing one.
        let v = v.split(',').next()?.trim();
        (!v.is_empty()).then(|| v.to_owned())
    };
    let scheme = first("x-forwarded-proto")
        .map(|s| s.to_ascii_lowercase())
        .unwrap_or_else(|| default_scheme.to_owned());
    if scheme != "http" && scheme != "https" {
        return None;
    }
    let host = first("x-forwarded-host")
        .or_else(|| first("host"))
        .or_else(|| uri.authority().map(|a| a.as_str().to_owned()))?;
    if host.parse::<http::uri::Authority>().is_err() || host.contains('@') {
        return None;
    }
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    Some(format!("{scheme}://{host}{path}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_hash_accepts_padded_and_unpadded_url_safe_only() {
        let body = br#"{"i":0}"#;
        assert!(check_body("6fdOcVoYBqplFInc8XbncBOzyFHbwRTMnCTy_p1BHWU", body).is_ok());
        assert!(check_body("6fdOcVoYBqplFInc8XbncBOzyFHbwRTMnCTy_p1BHWU=", body).is_ok());
        assert!(matches!(
            check_body("6fdOcVoYBqplFInc8XbncBOzyFHbwRTMnCTy/p1BHWU=", body),
            Err(SignatureError::BodyMismatch { .. })
        ));
        assert!(check_body("47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU=", b"").is_ok());
    }

    #[test]
    fn an_empty_key_verifies_nothing() {
        let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"HS256"}"#);
        let claims = URL_SAFE_NO_PAD.encode(
            format!(
                r#"{{"iss":"Upstash","exp":{},"body":"{}"}}"#,
                i64::MAX,
                URL_SAFE.encode(Sha256::digest(b""))
            )
            .as_bytes(),
        );
        let input = format!("{header}.{claims}");
        let mut mac = Hmac::<Sha256>::new_from_slice(b"").unwrap();
        mac.update(input.as_bytes());
        let token = format!(
            "{input}.{}",
            URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
        );
        assert_eq!(
            Verifier::new("", Some("")).verify(Some(&token), b"", None),
            Err(SignatureError::BadSignature)
        );
    }

    #[test]
    fn public_url_prefers_forwarded_headers() {
        let uri: http::Uri = "/hooks/qstash?x=1".parse().unwrap();
        let mut h = http::HeaderMap::new();
        h.insert("host", "127.0.0.1:3000".parse().unwrap());
        assert_eq!(
            public_url(&h, &uri, "http").as_deref(),
            Some("http://127.0.0.1:3000/hooks/qstash?x=1")
        );
        h.insert("x-forwarded-proto", "https, http".parse().unwrap());
        h.insert("x-forwarded-host", "api.example.com".parse().unwrap());
        assert_eq!(
            public_url(&h, &uri, "http").as_deref(),
            Some("https://api.example.com/hooks/qstash?x=1")
        );
        h.insert("x-forwarded-proto", "gopher".parse().unwrap());
        assert_eq!(public_url(&h, &uri, "http"), None);
        h.insert("x-forwarded-proto", "https".parse().unwrap());
        h.insert("x-forwarded-host", "a b/c".parse().unwrap());
        assert_eq!(public_url(&h, &uri, "http"), None);
        assert_eq!(public_url(&http::HeaderMap::new(), &uri, "http"), None);
    }

    #[test]
    fn request_url_ignores_forwarded_headers() {
        let uri: http::Uri = "/hooks/qstash?x=1".parse().unwrap();
        let mut h = http::HeaderMap::new();
        h.insert("host", "127.0.0.1:3000".parse().unwrap());
        h.insert("x-forwarded-proto", "https".parse().unwrap());
        h.insert("x-forwarded-host", "api.example.com".parse().unwrap());
        assert_eq!(
            request_url(&h, &uri, "http").as_deref(),
            Some("http://127.0.0.1:3000/hooks/qstash?x=1")
        );
    }
}
