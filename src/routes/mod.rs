//! Routes: which sink an event goes to, chosen by its type. The first route
//! whose pattern matches wins; an event no route matches is dead-lettered.
//! The `[[routes]]` section of the configuration is in [`config`].

pub mod config;
pub mod retry;

use std::fmt;

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub use self::config::{
    BodyShape, EventPattern, HttpMethod, Ordering, RouteConfig, RouteError, SigningSecret, SinkKind,
};
pub use self::retry::{RetryPolicy, RetrySchedule};

/// What a value substituted into a URL may keep unescaped (RFC 3986 unreserved).
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Var {
    Id,
    EventType,
    AggregateType,
    AggregateId,
    TenantId,
    PartitionKey,
}

impl Var {
    fn parse(name: &str) -> Option<Var> {
        Some(match name {
            "id" => Var::Id,
            "event_type" => Var::EventType,
            "aggregate_type" => Var::AggregateType,
            "aggregate_id" => Var::AggregateId,
            "tenant_id" => Var::TenantId,
            "partition_key" => Var::PartitionKey,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Var(Var),
}

/// A destination URL with `{placeholders}`, parsed when the configuration
/// is read. It prints (`Debug`, `Serialize`, its errors) with the
/// credentials in it hidden.
#[derive(Clone, PartialEq, Eq)]
pub struct Template {
    source: String,
    parts: Vec<Part>,
}

/// The fields of an event a template can name.
pub(crate) struct TemplateValues<'a> {
    pub id: i64,
    pub event_type: &'a str,
    pub aggregate_type: &'a str,
    pub aggregate_id: &'a str,
    pub tenant_id: &'a str,
    pub partition_key: &'a str,
}

impl Template {
    pub fn parse(s: &str) -> Result<Template, String> {
        if s.is_empty() {
            return Err("must not be empty".to_owned());
        }
        let mut parts = Vec::new();
        let mut rest = s;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Literal(rest[..open].to_owned()));
            }
            let Some(close) = rest[open..].find('}') else {
                return Err(format!("unclosed `{{` in `{s}`"));
            };
            let name = &rest[open + 1..open + close];
            let var = Var::parse(name).ok_or_else(|| {
                format!("unknown placeholder `{{{name}}}` (known: id, event_type, aggregate_type, aggregate_id, tenant_id, partition_key)")
            })?;
            parts.push(Part::Var(var));
            rest = &rest[open + close + 1..];
        }
        if rest.contains('}') {
            return Err(format!("`}}` without `{{` in `{s}`"));
        }
        if !rest.is_empty() {
            parts.push(Part::Literal(rest.to_owned()));
        }
        match parts.first() {
            Some(Part::Literal(l)) if l.starts_with("http://") || l.starts_with("https://") => {}
            _ => return Err(format!("`{s}` must start with http:// or https://")),
        }
        Ok(Template {
            source: s.to_owned(),
            parts,
        })
    }

    /// The template as configured, credentials included.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    pub(crate) fn render(&self, v: &TemplateValues<'_>) -> String {
        let mut out = String::with_capacity(64);
        for part in &self.parts {
            match part {
                Part::Literal(l) => out.push_str(l),
                Part::Var(Var::Id) => out.push_str(&v.id.to_string()),
                Part::Var(var) => {
                    let value = match var {
                        Var::EventType => v.event_type,
                        Var::AggregateType => v.aggregate_type,
                        Var::AggregateId => v.aggregate_id,
                        Var::TenantId => v.tenant_id,
                        Var::PartitionKey => v.partition_key,
                        Var::Id => unreachable!(),
                    };
                    out.extend(utf8_percent_encode(value, SEGMENT));
                }
            }
        }
        out
    }
}

impl fmt::Debug for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&crate::redact::url(&self.source), f)
    }
}

impl Serialize for Template {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&crate::redact::url(&self.source))
    }
}

impl<'de> Deserialize<'de> for Template {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Template, D::Error> {
        let s = String::deserialize(d)?;
        Template::parse(&s).map_err(|e| serde::de::Error::custom(crate::redact::url_in(&e, &s)))
    }
}

/// A route, ready to use.
#[derive(Debug, Clone)]
pub struct Route {
    /// Position in the config (`routes[i]`), also its metric label.
    pub index: usize,
    pub name: String,
    pub config: RouteConfig,
}

impl Route {
    pub fn ordered(&self) -> bool {
        self.config.ordering.per_key()
    }
}

/// All routes, in config order.
#[derive(Debug, Clone, Default)]
pub struct Router {
    routes: Vec<Route>,
}

impl Router {
    pub fn new(configs: &[RouteConfig]) -> Router {
        let routes = configs
            .iter()
            .enumerate()
            .map(|(index, c)| Route {
                index,
                name: format!("{}#{index}", c.event_type),
                config: c.clone(),
            })
            .collect();
        Router { routes }
    }

    /// The first route that takes `event_type`.
    pub fn route(&self, event_type: &str) -> Option<&Route> {
        self.routes.iter().find(|r| r.config.matches(event_type))
    }

    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// SQL `LIKE` patterns covering every event type that may be routed to an
    /// ordered route (`dlq replay` checks key order for them). It errs on the
    /// side of ordering: a type an earlier unordered route takes is included.
    pub fn ordered_like_patterns(&self) -> Vec<String> {
        self.routes
            .iter()
            .filter(|r| r.ordered())
            .map(|r| r.config.event_type.like())
            .collect()
    }
}

impl EventPattern {
    /// The event types this pattern matches, as an SQL `LIKE` pattern.
    pub(crate) fn like(&self) -> String {
        match self {
            EventPattern::All => "%".to_owned(),
            EventPattern::Prefix(prefix) => format!("{}%", escape_like(prefix)),
            EventPattern::Exact(exact) => escape_like(exact),
        }
    }

    /// Does this pattern match every type `other` matches? (A route behind
    /// one that covers it never gets an event.)
    pub(crate) fn covers(&self, other: &EventPattern) -> bool {
        match (self, other) {
            (EventPattern::All, _) => true,
            (_, EventPattern::All) => false,
            (EventPattern::Prefix(p), EventPattern::Prefix(o) | EventPattern::Exact(o)) => {
                o.starts_with(p.as_str())
            }
            (EventPattern::Exact(e), EventPattern::Exact(o)) => e == o,
            (EventPattern::Exact(_), EventPattern::Prefix(_)) => false,
        }
    }
}

fn escape_like(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '%' | '_' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values() -> TemplateValues<'static> {
        TemplateValues {
            id: 42,
            event_type: "order.placed",
            aggregate_type: "order",
            aggregate_id: "a b/c",
            tenant_id: "t1",
            partition_key: "order:1",
        }
    }

    #[test]
    fn renders_placeholders_percent_encoded() {
        let t = Template::parse("https://x.example/{event_type}/{aggregate_id}?id={id}").unwrap();
        assert_eq!(
            t.render(&values()),
            "https://x.example/order.placed/a%20b%2Fc?id=42"
        );
    }

    #[test]
    fn rejects_unknown_placeholder_and_bad_scheme() {
        assert!(Template::parse("https://x/{nope}")
            .unwrap_err()
            .contains("unknown placeholder"));
        assert!(Template::parse("ftp://x/").unwrap_err().contains("http://"));
        assert!(Template::parse("https://x/{event_type")
            .unwrap_err()
            .contains("unclosed"));
    }

    #[test]
    fn first_matching_route_wins_and_patterns_cover_one_another() {
        let toml = r#"
            [[routes]]
            event_type = "order.placed"
            destination = "https://a.example/placed"
            [[routes]]
            event_type = "order.*"
            destination = "https://a.example/orders"
            ordering = "partition_key_to_qstash"
            [[routes]]
            event_type = "*"
            destination = "https://a.example/all"
        "#;
        let router = Router::new(&crate::testing::routes(toml));
        assert_eq!(router.route("order.placed").unwrap().index, 0);
        assert_eq!(router.route("order.shipped").unwrap().index, 1);
        assert_eq!(router.route("user.created").unwrap().index, 2);
        let like: Vec<String> = router
            .routes()
            .iter()
            .map(|r| r.config.event_type.like())
            .collect();
        assert_eq!(like, ["order.placed", "order.%", "%"]);
        let p = |s: &str| EventPattern::parse(s).unwrap();
        assert!(p("order.*").covers(&p("order.placed")) && p("*").covers(&p("order.*")));
        assert!(p("order.*").covers(&p("order.x.*")) && !p("order.x.*").covers(&p("order.*")));
        assert!(!p("order.placed").covers(&p("order.*")) && !p("order.*").covers(&p("*")));
        assert!(!p("order.*").covers(&p("audit.*")) && p("a.b").covers(&p("a.b")));
    }

    #[test]
    fn event_patterns_are_exact_prefix_or_all() {
        let p = |s: &str| EventPattern::parse(s);
        assert_eq!(p("*"), Ok(EventPattern::All));
        assert_eq!(p("order.*"), Ok(EventPattern::Prefix("order.".into())));
        assert_eq!(
            p("order.placed"),
            Ok(EventPattern::Exact("order.placed".into()))
        );
        for bad in ["", "order*", "*.*", "a.*.*", "*.placed", "or*der.*"] {
            assert_eq!(
                p(bad),
                Err(format!("`{bad}` is not `exact.type`, `prefix.*` or `*`")),
                "{bad:?}"
            );
        }
        let prefix = p("order.*").unwrap();
        assert!(prefix.matches("order.placed") && !prefix.matches("orders.placed"));
        assert!(!prefix.matches("order"));
        assert!(p("a.b").unwrap().matches("a.b") && !p("a.b").unwrap().matches("a.bc"));
        for s in ["*", "order.*", "order.placed"] {
            assert_eq!(p(s).unwrap().to_string(), s);
        }
    }

    #[test]
    fn a_method_is_upper_cased_and_must_be_a_token() {
        assert_eq!(HttpMethod::parse("put").unwrap().as_str(), "PUT");
        assert_eq!(HttpMethod::default().method(), http::Method::POST);
        assert_eq!(
            HttpMethod::parse("GE T"),
            Err("`GE T` is not an HTTP method".to_owned())
        );
    }

    #[test]
    fn a_template_prints_without_its_credentials() {
        let t =
            Template::parse("https://u:s3cret@h.example.com/{event_type}?token=s3cret").unwrap();
        for shown in [format!("{t:?}"), serde_json::to_string(&t).unwrap()] {
            assert!(!shown.contains("s3cret"), "{shown}");
            assert!(shown.contains("h.example.com/{event_type}"), "{shown}");
        }
        assert_eq!(Template::parse(""), Err("must not be empty".to_owned()));
    }

    /// A route from `extra` keys on top of a QStash catch-all.
    fn route(extra: serde_json::Value) -> Result<RouteConfig, String> {
        let mut json =
            serde_json::json!({"event_type": "*", "destination": "https://a.example.com/"});
        for (k, v) in extra.as_object().unwrap() {
            json[k] = v.clone();
        }
        let r: RouteConfig = serde_json::from_value(json).map_err(|e| e.to_string())?;
        r.validate()
            .map_err(|e| format!("{}: {}", e.key, e.reason))?;
        Ok(r)
    }

    #[test]
    fn an_ordered_qstash_route_takes_callbacks_or_says_it_orders_only_to_qstash() {
        use serde_json::json;
        let cb = "https://relay.example.com/qstash/callback";
        let e = route(json!({"ordering": "partition_key"})).unwrap_err();
        assert!(
            e.starts_with("callback: is required for an ordered QStash route"),
            "{e}"
        );
        assert!(e.contains("partition_key_to_qstash"), "{e}");
        let r = route(json!({"ordering": "partition_key", "callback": cb})).unwrap();
        assert_eq!(
            r.callback_hold(),
            Some(std::time::Duration::from_secs(9 * 60))
        );
        let r = route(json!({"ordering": "partition_key_to_qstash"})).unwrap();
        assert!(r.ordering.per_key() && r.callback_hold().is_none());
        // A callback is for ordered QStash routes only.
        let e = route(json!({"callback": cb})).unwrap_err();
        assert!(
            e.starts_with("callback: is for ordered QStash routes"),
            "{e}"
        );
        // A webhook route waits for each answer: "to QStash" makes no sense there.
        let webhook = |ordering: &str| {
            route(json!({
                "sink": "webhook",
                "signing_secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                "ordering": ordering
            }))
        };
        assert!(webhook("partition_key_to_qstash")
            .unwrap_err()
            .starts_with("ordering:"));
        webhook("partition_key").unwrap();
        let e =
            route(json!({"ordering": "partition_key", "callback": cb, "callback_timeout": "0s"}))
                .unwrap_err();
        assert!(e.starts_with("callback_timeout:"), "{e}");
    }
}
