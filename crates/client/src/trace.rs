//! W3C trace context carried with an event, from the producer's transaction
//! to the consumer's handler.
//!
//! The producer records `traceparent` (and `tracestate`, if any) in the
//! event's headers when it enqueues; the relay forwards an event's headers
//! with it (to QStash as `Upstash-Forward-…`, which QStash delivers without
//! the prefix; to a webhook as they are), replacing `traceparent` with its
//! own delivery span's when it exports spans; the consumer reads them from
//! the request and continues the trace.
//!
//! Without the `opentelemetry` feature this is the header format alone:
//! [`TraceContext::parse`], [`TraceContext::from_headers`] and
//! [`crate::NewEvent::with_trace_context`]. With it,
//! [`TraceContext::current`] reads the current `tracing` span's context
//! (through `tracing-opentelemetry`) and [`TraceContext::set_parent_of`]
//! makes a handler's span continue the producer's trace.

use std::fmt;

/// The header that names the trace and the caller's span.
pub const TRACEPARENT: &str = "traceparent";
/// Vendor-specific trace state that travels with it.
pub const TRACESTATE: &str = "tracestate";

/// A `traceparent` (version 00) and its optional `tracestate`.
#[derive(Clone, PartialEq, Eq)]
pub struct TraceContext {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    flags: u8,
    tracestate: Option<String>,
}

/// Why a `traceparent` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("traceparent `{value}` is not W3C trace context: {reason}")]
pub struct TraceContextError {
    pub value: String,
    pub reason: &'static str,
}

impl TraceContext {
    /// A context from its parts; `None` when either id is all zeros (which
    /// W3C trace context calls invalid).
    pub fn new(trace_id: [u8; 16], span_id: [u8; 8], sampled: bool) -> Option<TraceContext> {
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceContext {
            trace_id,
            span_id,
            flags: u8::from(sampled),
            tracestate: None,
        })
    }

    /// `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`.
    pub fn parse(traceparent: &str) -> Result<TraceContext, TraceContextError> {
        let refuse = |reason| TraceContextError {
            value: traceparent.chars().take(80).collect(),
            reason,
        };
        let parts: Vec<&str> = traceparent.trim().split('-').collect();
        let [version, trace, span, flags] = parts[..] else {
            return Err(refuse("it needs four fields separated by `-`"));
        };
        if version != "00" {
            return Err(refuse("only version 00 is known"));
        }
        let trace_id: [u8; 16] = hex(trace)
            .and_then(|v| v.try_into().ok())
            .ok_or_else(|| refuse("the trace id must be 32 lower-case hex digits"))?;
        let span_id: [u8; 8] = hex(span)
            .and_then(|v| v.try_into().ok())
            .ok_or_else(|| refuse("the parent id must be 16 lower-case hex digits"))?;
        let [flags]: [u8; 1] = hex(flags)
            .and_then(|v| v.try_into().ok())
            .ok_or_else(|| refuse("the flags must be 2 lower-case hex digits"))?;
        let mut context = TraceContext::new(trace_id, span_id, false)
            .ok_or_else(|| refuse("an all-zero trace or parent id is invalid"))?;
        context.flags = flags;
        Ok(context)
    }

    /// The context a request carries, if its `traceparent` is valid (an
    /// invalid one is ignored, as W3C trace context says to).
    pub fn from_headers(headers: &http::HeaderMap) -> Option<TraceContext> {
        let traceparent = headers.get(TRACEPARENT)?.to_str().ok()?;
        let mut context = TraceContext::parse(traceparent).ok()?;
        context.tracestate = headers
            .get(TRACESTATE)
            .and_then(|v| v.to_str().ok())
            .filter(|s| !s.trim().is_empty())
            .map(str::to_owned);
        Some(context)
    }

    /// The same context with `tracestate` set.
    pub fn with_tracestate(mut self, tracestate: impl Into<String>) -> TraceContext {
        let s = tracestate.into();
        self.tracestate = (!s.trim().is_empty()).then_some(s);
        self
    }

    pub fn trace_id(&self) -> [u8; 16] {
        self.trace_id
    }

    /// The span that sent it: the parent of the receiver's span.
    pub fn span_id(&self) -> [u8; 8] {
        self.span_id
    }

    /// The trace id as 32 hex digits, as trace back ends show it.
    pub fn trace_id_hex(&self) -> String {
        to_hex(&self.trace_id)
    }

    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// The `traceparent` header's value.
    pub fn traceparent(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            to_hex(&self.trace_id),
            to_hex(&self.span_id),
            self.flags
        )
    }

    /// The headers to send: `traceparent`, and `tracestate` when set.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut headers = vec![(TRACEPARENT, self.traceparent())];
        if let Some(state) = &self.tracestate {
            headers.push((TRACESTATE, state.clone()));
        }
        headers
    }
}

impl fmt::Debug for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TraceContext")
            .field("traceparent", &self.traceparent())
            .field("tracestate", &self.tracestate)
            .finish()
    }
}

fn hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::TraceContext;

    impl TraceContext {
        /// The current `tracing` span's context, when a
        /// `tracing-opentelemetry` layer gives it one.
        pub fn current() -> Option<TraceContext> {
            TraceContext::of_span(&tracing::Span::current())
        }

        /// `span`'s context, when a `tracing-opentelemetry` layer gives it one.
        pub fn of_span(span: &tracing::Span) -> Option<TraceContext> {
            let context = span.context();
            let span_ref = context.span();
            let sc = span_ref.span_context();
            TraceContext::from_span_context(sc)
        }

        /// The context of an OpenTelemetry span.
        pub fn from_span_context(sc: &SpanContext) -> Option<TraceContext> {
            if !sc.is_valid() {
                return None;
            }
            let mut context = TraceContext::new(
                sc.trace_id().to_bytes(),
                sc.span_id().to_bytes(),
                sc.is_sampled(),
            )?;
            let state = sc.trace_state().header();
            if !state.is_empty() {
                context.tracestate = Some(state);
            }
            Some(context)
        }

        /// As an OpenTelemetry remote span context.
        pub fn span_context(&self) -> SpanContext {
            let state = self
                .tracestate
                .as_deref()
                .and_then(|s| s.parse::<TraceState>().ok())
                .unwrap_or_default();
            SpanContext::new(
                TraceId::from_bytes(self.trace_id),
                SpanId::from_bytes(self.span_id),
                TraceFlags::new(self.flags),
                true,
                state,
            )
        }

        /// Makes `span` a child of this context: the consumer's handler span
        /// continues the producer's trace. (A span already entered keeps the
        /// parent it had; call this before entering it.)
        pub fn set_parent_of(&self, span: &tracing::Span) {
            let parent =
                opentelemetry::Context::new().with_remote_span_context(self.span_context());
            // Fails only without a tracing-opentelemetry layer, where there
            // is no trace to continue.
            let _ = span.set_parent(parent);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_round_trips() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let c = TraceContext::parse(tp).unwrap();
        assert_eq!(c.traceparent(), tp);
        assert_eq!(c.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert!(c.sampled());
    }

    #[test]
    fn malformed_traceparents_are_refused_saying_why() {
        for (tp, why) in [
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
                "four fields",
            ),
            (
                "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "version",
            ),
            (
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                "trace id",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
                "trace id",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902-01",
                "parent id",
            ),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "all-zero",
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
                "flags",
            ),
        ] {
            let e = TraceContext::parse(tp).unwrap_err();
            assert!(e.to_string().contains(why), "{tp}: {e}");
        }
    }

    #[test]
    fn headers_carry_tracestate_and_an_invalid_traceparent_is_ignored() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            TRACEPARENT,
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
                .parse()
                .unwrap(),
        );
        headers.insert(TRACESTATE, "congo=t61rcWkgMzE".parse().unwrap());
        let c = TraceContext::from_headers(&headers).unwrap();
        assert_eq!(c.tracestate(), Some("congo=t61rcWkgMzE"));
        assert!(!c.sampled());
        assert_eq!(c.headers().len(), 2);
        headers.insert(TRACEPARENT, "garbage".parse().unwrap());
        assert_eq!(TraceContext::from_headers(&headers), None);
    }
}
