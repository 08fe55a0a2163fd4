//! Standard Webhooks signing (<https://www.standardwebhooks.com>): the relay's
//! webhook sink signs each request with it, and
//! [`WebhookVerifier`](crate::consumer::webhooks::WebhookVerifier) checks it.
//!
//! `webhook-signature: v1,<base64 HMAC-SHA256(key, "{id}.{timestamp}.{body}")>`
//! where `key` is the base64-decoded part of a `whsec_…` secret.

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

pub const SECRET_PREFIX: &str = "whsec_";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    #[error("a webhook secret must start with `whsec_`")]
    MissingPrefix,
    #[error("the part after `whsec_` is not base64: {0}")]
    NotBase64(String),
    #[error("the secret's key is empty")]
    Empty,
}

/// The HMAC key inside a `whsec_…` secret.
pub fn decode_secret(secret: &str) -> Result<Vec<u8>, SecretError> {
    let b64 = secret
        .strip_prefix(SECRET_PREFIX)
        .ok_or(SecretError::MissingPrefix)?;
    let key = STANDARD
        .decode(b64)
        .map_err(|e| SecretError::NotBase64(e.to_string()))?;
    if key.is_empty() {
        return Err(SecretError::Empty);
    }
    Ok(key)
}

/// `v1,<base64 signature>` for one message.
pub fn sign(key: &[u8], msg_id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(msg_id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_errors_are_typed() {
        assert_eq!(decode_secret("abc"), Err(SecretError::MissingPrefix));
        assert!(matches!(
            decode_secret("whsec_***"),
            Err(SecretError::NotBase64(_))
        ));
        assert_eq!(decode_secret("whsec_"), Err(SecretError::Empty));
        assert_eq!(decode_secret("whsec_AQID").unwrap(), vec![1, 2, 3]);
    }
}
