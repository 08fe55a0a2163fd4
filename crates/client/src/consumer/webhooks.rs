//! Verifies Standard Webhooks requests, the counterpart of the relay's webhook
//! sink (both use [`crate::signing`]): `webhook-id`, `webhook-timestamp` within a
//! tolerance in both directions, and at least one `v1,` entry of the
//! space-separated `webhook-signature` made by one of the secrets (several
//! secrets let a sender rotate without downtime).

use std::time::Duration;

use subtle::ConstantTimeEq;

use super::qstash::Clock;
use crate::signing::{decode_secret, sign, SecretError};

pub const ID_HEADER: &str = "webhook-id";
pub const TIMESTAMP_HEADER: &str = "webhook-timestamp";
pub const SIGNATURE_HEADER: &str = "webhook-signature";

/// The Standard Webhooks default: five minutes either way.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WebhookError {
    #[error("no {0} header")]
    Missing(&'static str),
    #[error("{header} header is malformed: {reason}")]
    Malformed {
        header: &'static str,
        reason: &'static str,
    },
    #[error("no v1 signature matches any of the secrets")]
    BadSignature,
    #[error("webhook-timestamp {timestamp} is too old (now {now})")]
    Expired { timestamp: i64, now: i64 },
    #[error("webhook-timestamp {timestamp} is in the future (now {now})")]
    NotYetValid { timestamp: i64, now: i64 },
}

/// What a verified request carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedWebhook {
    pub id: String,
    pub timestamp: i64,
}

#[derive(Clone)]
pub struct WebhookVerifier {
    keys: Vec<Vec<u8>>,
    tolerance: i64,
    clock: Clock,
}

impl std::fmt::Debug for WebhookVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookVerifier")
            .field("secrets", &self.keys.len())
            .field("tolerance_secs", &self.tolerance)
            .finish_non_exhaustive()
    }
}

impl WebhookVerifier {
    /// `whsec_…` secrets, newest first; at least one.
    pub fn new<S: AsRef<str>>(secrets: &[S]) -> Result<WebhookVerifier, SecretError> {
        let keys = secrets
            .iter()
            .map(|s| decode_secret(s.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err(SecretError::Empty);
        }
        Ok(WebhookVerifier {
            keys,
            tolerance: DEFAULT_TOLERANCE.as_secs() as i64,
            clock: Clock::system(),
        })
    }

    pub fn with_tolerance(mut self, tolerance: Duration) -> WebhookVerifier {
        self.tolerance = i64::try_from(tolerance.as_secs()).unwrap_or(i64::MAX);
        self
    }

    pub fn with_clock(mut self, clock: Clock) -> WebhookVerifier {
        self.clock = clock;
        self
    }

    pub fn verify(
        &self,
        headers: &http::HeaderMap,
        body: &[u8],
    ) -> Result<VerifiedWebhook, WebhookError> {
        let get = |name: &'static str| -> Result<&str, WebhookError> {
            let v = headers.get(name).ok_or(WebhookError::Missing(name))?;
            v.to_str().map_err(|_| WebhookError::Malformed {
                header: name,
                reason: "not ASCII",
            })
        };
        self.verify_parts(
            get(ID_HEADER)?,
            get(TIMESTAMP_HEADER)?,
            get(SIGNATURE_HEADER)?,
            body,
        )
    }

    /// The same check from the three header values.
    pub fn verify_parts(
        &self,
        id: &str,
        timestamp: &str,
        signatures: &str,
        body: &[u8],
    ) -> Result<VerifiedWebhook, WebhookError> {
        if id.is_empty() {
            return Err(WebhookError::Missing(ID_HEADER));
        }
        let timestamp: i64 = timestamp
            .trim()
            .parse()
            .map_err(|_| WebhookError::Malformed {
                header: TIMESTAMP_HEADER,
                reason: "not an integer number of seconds",
            })?;
        let now = self.clock.now();
        if now.saturating_sub(timestamp) > self.tolerance {
            return Err(WebhookError::Expired { timestamp, now });
        }
        if timestamp.saturating_sub(now) > self.tolerance {
            return Err(WebhookError::NotYetValid { timestamp, now });
        }
        let offered: Vec<&[u8]> = signatures
            .split(' ')
            .filter_map(|entry| entry.strip_prefix("v1,"))
            .map(str::as_bytes)
            .collect();
        if offered.is_empty() {
            return Err(WebhookError::Malformed {
                header: SIGNATURE_HEADER,
                reason: "no v1 signature",
            });
        }
        for key in &self.keys {
            let expected = sign(key, id, timestamp, body);
            let expected = &expected.as_bytes()["v1,".len()..];
            // Every entry is compared in full, in constant time.
            let mut matched = subtle::Choice::from(0);
            for candidate in &offered {
                matched |= candidate.ct_eq(expected);
            }
            if bool::from(matched) {
                return Ok(VerifiedWebhook {
                    id: id.to_owned(),
                    timestamp,
                });
            }
        }
        Err(WebhookError::BadSignature)
    }
}
