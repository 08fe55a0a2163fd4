//! The consuming side: verify that a delivery came from QStash (or from the
//! relay's webhook sink), then handle each message once.

pub mod idempotent;
pub mod qstash;
pub mod webhooks;

pub use idempotent::{consume_once, prune_processed, ConsumeError, Consumed};
pub use qstash::{SignatureError, VerifiedToken, Verifier};
pub use webhooks::{WebhookError, WebhookVerifier};
