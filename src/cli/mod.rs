pub mod dlq;
