//! The application side: write an event in the same transaction as the
//! business rows. Either both commit or neither does.

use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio_postgres::types::Type;
use tokio_postgres::Transaction;
use uuid::Uuid;

/// An event to put in the outbox.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub tenant_id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    /// Must be a JSON object.
    pub payload: Value,
    /// Must be a JSON object of string values (forwarded as HTTP headers).
    pub headers: Value,
    /// Unique per event; becomes the QStash deduplication id. Re-enqueueing the
    /// same key is a no-op, so a retried request cannot emit the event twice.
    pub idempotency_key: String,
    /// Ordering and sharding key; `aggregate_type:aggregate_id` when `None`.
    pub partition_key: Option<String>,
    /// Deliver no earlier than this; now when `None`.
    pub available_at: Option<DateTime<Utc>>,
}

impl NewEvent {
    /// An event with no headers, keyed by its aggregate, deliverable now.
    pub fn new(
        tenant_id: Uuid,
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: Value,
        idempotency_key: impl Into<String>,
    ) -> Self {
        NewEvent {
            tenant_id,
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload,
            headers: Value::Object(Default::default()),
            idempotency_key: idempotency_key.into(),
            partition_key: None,
            available_at: None,
        }
    }

    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        if let Value::Object(map) = &mut self.headers {
            map.insert(name.into(), Value::String(value.into()));
        }
        self
    }

    /// Records a W3C trace context in the event's headers (`traceparent`,
    /// and `tracestate` when set), so the consumer's handler continues the
    /// producer's trace. [`crate::trace::TraceContext::current`] (feature
    /// `opentelemetry`) gives the current span's.
    pub fn with_trace_context(mut self, context: &crate::trace::TraceContext) -> Self {
        for (name, value) in context.headers() {
            self = self.with_header(name, value);
        }
        self
    }

    /// Records the current `tracing` span's trace context, when a
    /// `tracing-opentelemetry` layer gives it one; otherwise the event is
    /// unchanged.
    #[cfg(feature = "opentelemetry")]
    pub fn with_current_trace(self) -> Self {
        match crate::trace::TraceContext::current() {
            Some(context) => self.with_trace_context(&context),
            None => self,
        }
    }

    pub fn with_partition_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// Checks what the database would reject late or not at all.
    pub fn validate(&self) -> Result<(), EnqueueError> {
        if !self.payload.is_object() {
            return Err(EnqueueError::PayloadNotObject {
                found: json_kind(&self.payload),
            });
        }
        let Value::Object(headers) = &self.headers else {
            return Err(EnqueueError::HeadersNotObject {
                found: json_kind(&self.headers),
            });
        };
        for (name, value) in headers {
            if !value.is_string() {
                return Err(EnqueueError::HeaderNotString {
                    name: name.clone(),
                    found: json_kind(value),
                });
            }
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(EnqueueError::BadHeaderName { name: name.clone() });
            }
        }
        if self.idempotency_key.trim().is_empty() {
            return Err(EnqueueError::EmptyIdempotencyKey);
        }
        for (field, value) in [
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("event_type", &self.event_type),
        ] {
            if value.is_empty() {
                return Err(EnqueueError::EmptyField { field });
            }
        }
        if matches!(&self.partition_key, Some(k) if k.is_empty()) {
            return Err(EnqueueError::EmptyField {
                field: "partition_key",
            });
        }
        Ok(())
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error("payload must be a JSON object, found {found}")]
    PayloadNotObject { found: &'static str },
    #[error("headers must be a JSON object of strings, found {found}")]
    HeadersNotObject { found: &'static str },
    #[error("header `{name}` must be a string, found {found}")]
    HeaderNotString { name: String, found: &'static str },
    #[error("header name `{name}` is not a valid HTTP header name")]
    BadHeaderName { name: String },
    #[error("idempotency_key must not be empty")]
    EmptyIdempotencyKey,
    #[error("{field} must not be empty")]
    EmptyField { field: &'static str },
    #[error("event {index} of the batch: {source}")]
    InBatch {
        index: usize,
        #[source]
        source: Box<EnqueueError>,
    },
    #[error("database: {0}")]
    Postgres(#[from] tokio_postgres::Error),
}

/// Whether the row was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// A new outbox row with this id.
    New { id: i64 },
    /// A row with this idempotency key already exists; nothing was written.
    Duplicate,
}

impl Enqueued {
    pub fn is_new(&self) -> bool {
        matches!(self, Enqueued::New { .. })
    }
}

const INSERT_ONE: &str = "INSERT INTO outbox
    (tenant_id, aggregate_type, aggregate_id, event_type, payload, headers,
     idempotency_key, partition_key, available_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, coalesce($9, now()))
ON CONFLICT DO NOTHING
RETURNING id";

const INSERT_ONE_TYPES: &[Type] = &[
    Type::UUID,
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::JSONB,
    Type::JSONB,
    Type::TEXT,
    Type::TEXT,
    Type::TIMESTAMPTZ,
];

/// Writes one event inside the caller's transaction: it commits with the
/// business rows, or neither does.
///
/// ```no_run
/// # async fn f(client: &mut tokio_postgres::Client, order_id: &str, tenant_id: uuid::Uuid)
/// # -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_client::{enqueue, Enqueued, NewEvent};
///
/// let tx = client.transaction().await?;
/// tx.execute("INSERT INTO orders (id) VALUES ($1)", &[&order_id]).await?;
/// let event = NewEvent::new(
///     tenant_id,
///     "order",
///     order_id,
///     "order.placed",
///     serde_json::json!({"orderId": order_id}),
///     format!("order.placed:{order_id}"),
/// );
/// match enqueue(&tx, &event).await? {
///     Enqueued::New { id } => println!("event {id} enqueued"),
///     Enqueued::Duplicate => {} // this idempotency key was enqueued before
/// }
/// tx.commit().await?;
/// # Ok(())
/// # }
/// ```
pub async fn enqueue(tx: &Transaction<'_>, event: &NewEvent) -> Result<Enqueued, EnqueueError> {
    event.validate()?;
    // Typed: parse, bind and execute in one round trip, no prepared statement.
    let row = tx
        .query_typed_opt(
            INSERT_ONE,
            &[
                (&event.tenant_id, INSERT_ONE_TYPES[0].clone()),
                (&event.aggregate_type, INSERT_ONE_TYPES[1].clone()),
                (&event.aggregate_id, INSERT_ONE_TYPES[2].clone()),
                (&event.event_type, INSERT_ONE_TYPES[3].clone()),
                (&event.payload, INSERT_ONE_TYPES[4].clone()),
                (&event.headers, INSERT_ONE_TYPES[5].clone()),
                (&event.idempotency_key, INSERT_ONE_TYPES[6].clone()),
                (&event.partition_key, INSERT_ONE_TYPES[7].clone()),
                (&event.available_at, INSERT_ONE_TYPES[8].clone()),
            ],
        )
        .await?;
    Ok(match row {
        Some(row) => Enqueued::New { id: row.get(0) },
        None => Enqueued::Duplicate,
    })
}

// `ON CONFLICT DO NOTHING` without a target: the same as naming
// `(idempotency_key)` on the plain outbox (the identity id never conflicts),
// and it also works on the partitioned outbox (docs/partitioning.md), whose
// key uniqueness is kept by a trigger.
// Results map back to inputs by idempotency key, so duplicates are reported
// in place.
const INSERT_MANY: &str = "INSERT INTO outbox
    (tenant_id, aggregate_type, aggregate_id, event_type, payload, headers,
     idempotency_key, partition_key, available_at)
SELECT t, at, ai, et, p, h, k, pk, coalesce(av, now())
FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::jsonb[],
            $7::text[], $8::text[], $9::timestamptz[]) AS u(t, at, ai, et, p, h, k, pk, av)
ON CONFLICT DO NOTHING
RETURNING id, idempotency_key";

/// Writes many events in one round trip inside the caller's transaction.
/// The result lines up with `events`.
pub async fn enqueue_many(
    tx: &Transaction<'_>,
    events: &[NewEvent],
) -> Result<Vec<Enqueued>, EnqueueError> {
    for (index, e) in events.iter().enumerate() {
        e.validate().map_err(|source| EnqueueError::InBatch {
            index,
            source: Box::new(source),
        })?;
    }
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let tenants: Vec<Uuid> = events.iter().map(|e| e.tenant_id).collect();
    let agg_types: Vec<&str> = events.iter().map(|e| e.aggregate_type.as_str()).collect();
    let agg_ids: Vec<&str> = events.iter().map(|e| e.aggregate_id.as_str()).collect();
    let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
    let payloads: Vec<&Value> = events.iter().map(|e| &e.payload).collect();
    let headers: Vec<&Value> = events.iter().map(|e| &e.headers).collect();
    let keys: Vec<&str> = events.iter().map(|e| e.idempotency_key.as_str()).collect();
    let pkeys: Vec<Option<&str>> = events.iter().map(|e| e.partition_key.as_deref()).collect();
    let avail: Vec<Option<DateTime<Utc>>> = events.iter().map(|e| e.available_at).collect();
    let rows = tx
        .query_typed(
            INSERT_MANY,
            &[
                (&tenants, Type::UUID_ARRAY),
                (&agg_types, Type::TEXT_ARRAY),
                (&agg_ids, Type::TEXT_ARRAY),
                (&types, Type::TEXT_ARRAY),
                (&payloads, Type::JSONB_ARRAY),
                (&headers, Type::JSONB_ARRAY),
                (&keys, Type::TEXT_ARRAY),
                (&pkeys, Type::TEXT_ARRAY),
                (&avail, Type::TIMESTAMPTZ_ARRAY),
            ],
        )
        .await?;
    let mut inserted: std::collections::HashMap<String, i64> = rows
        .iter()
        .map(|r| (r.get::<_, String>(1), r.get::<_, i64>(0)))
        .collect();
    // A key repeated inside the batch is new once, then a duplicate.
    Ok(events
        .iter()
        .map(|e| match inserted.remove(&e.idempotency_key) {
            Some(id) => Enqueued::New { id },
            None => Enqueued::Duplicate,
        })
        .collect())
}
