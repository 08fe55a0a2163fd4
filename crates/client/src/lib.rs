//! outbox-client: what an application links to use outbox-relay, without the
//! relay itself (no HTTP client, actor runtime, web framework or metrics).
//!
//! ```text
//! producer side   app transaction ── enqueue ──▶ outbox table ──▶ relay (outbox-relay)
//! consumer side   relay / QStash ──▶ your endpoint: verify the signature, consume_once
//! ```
//!
//! - [`producer`]: [`enqueue`] and [`enqueue_many`] write events inside the
//!   caller's `tokio_postgres::Transaction`, so they commit with the business rows.
//! - [`row`]: an outbox row and the envelope consumers receive.
//! - [`consumer`]: verify QStash ([`consumer::qstash`]) and Standard Webhooks
//!   ([`consumer::webhooks`]) deliveries, and handle each event once
//!   ([`consumer::consume_once`]) on any `tokio_postgres` connection.
//! - [`signing`]: Standard Webhooks signing, shared by the relay's webhook sink
//!   and the verifier.

#![warn(unreachable_pub)]

pub mod consumer;
pub mod producer;
pub mod row;
pub mod signing;

pub use producer::{enqueue, enqueue_many, EnqueueError, Enqueued, NewEvent};
