//! `[[http.hosts]]`: limits per destination host, and how a destination is
//! matched to its entry (host and port; a port the entry does not name is
//! any port, a destination without one has its scheme's).

use std::num::NonZeroU32;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::routes::Route;
use outbox_client::row::OutboxRow;

/// One `[[http.hosts]]` entry: limits shared by every webhook route whose
/// destination is on `host` (`api.example.com`, any port, or
/// `api.example.com:8443`, that port only).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HostLimit {
    pub host: String,
    /// Requests per `period`.
    #[serde(default)]
    pub rate: Option<NonZeroU32>,
    #[serde(default, with = "humantime_serde")]
    pub period: Option<Duration>,
    /// Requests in flight at once.
    #[serde(default)]
    pub concurrency: Option<NonZeroU32>,
}

/// Checks `[[http.hosts]]`: `(index, key, reason)` of the first entry that is wrong.
pub(crate) fn validate_hosts(hosts: &[HostLimit]) -> Result<(), (usize, &'static str, String)> {
    for (i, h) in hosts.iter().enumerate() {
        let bad = |key, reason: &str| Err((i, key, reason.to_owned()));
        let Some(at) = HostPort::parse(&h.host) else {
            return bad(
                "host",
                "must be a host name, optionally with a port (\"api.example.com\", \"api.example.com:8443\"), without a scheme, path or user",
            );
        };
        if h.rate.is_none() && h.concurrency.is_none() {
            return bad(
                "rate",
                "or `concurrency` must be set (a host entry limits something)",
            );
        }
        if h.period.is_some() && h.rate.is_none() {
            return bad("period", "needs `rate`");
        }
        if h.period.is_some_and(|p| p.is_zero()) {
            return bad("period", "must be more than zero");
        }
        if let Some(j) = hosts[..i]
            .iter()
            .position(|o| HostPort::parse(&o.host).as_ref() == Some(&at))
        {
            return Err((
                i,
                "host",
                format!("`{}` is already limited by http.hosts[{j}]", h.host),
            ));
        }
    }
    Ok(())
}

/// A host (lower case) and its port: in an `[[http.hosts]]` entry, the port
/// if it names one; of a destination, its port or its scheme's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct HostPort {
    pub(super) host: String,
    pub(super) port: Option<u16>,
}

impl HostPort {
    /// An entry's `host`: a host name or address, optionally `:port`.
    pub(super) fn parse(entry: &str) -> Option<HostPort> {
        let a: ::http::uri::Authority = entry.parse().ok()?;
        if a.as_str().contains('@') || a.host().is_empty() {
            return None;
        }
        let port = match a.port() {
            Some(p) => Some(p.as_u16()),
            None if entry.ends_with(':') => return None,
            None => None,
        };
        Some(HostPort {
            host: a.host().to_ascii_lowercase(),
            port,
        })
    }

    /// Where the row goes; `None` when its destination is not a URL (the
    /// sink dead-letters it).
    pub(super) fn of(route: &Route, row: &OutboxRow) -> Option<HostPort> {
        let url = crate::sink::destination(route, row).ok()?;
        let uri: ::http::Uri = url.parse().ok()?;
        let port = uri.port_u16().or(match uri.scheme_str() {
            Some(s) if s.eq_ignore_ascii_case("http") => Some(80),
            Some(s) if s.eq_ignore_ascii_case("https") => Some(443),
            _ => None,
        });
        Some(HostPort {
            host: uri.host()?.to_ascii_lowercase(),
            port,
        })
    }

    /// Whether this entry covers the destination `d`: same host, and the
    /// same port unless the entry names none.
    pub(super) fn covers(&self, d: &HostPort) -> bool {
        self.host == d.host && (self.port.is_none() || self.port == d.port)
    }
}

impl std::fmt::Display for HostPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.port {
            Some(p) => write!(f, "{}:{p}", self.host),
            None => f.write_str(&self.host),
        }
    }
}
