#![doc = include_str!("../README.md")]
#![warn(unreachable_pub)]

pub mod consumer;
pub mod producer;
pub mod row;
pub mod signing;
pub mod trace;

pub use producer::{enqueue, enqueue_many, EnqueueError, Enqueued, NewEvent};
