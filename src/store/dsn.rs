//! Database URLs and keyword DSNs read the way libpq reads them.
//!
//! tokio-postgres parses most parameters, but refuses libpq's TLS ones
//! (`sslrootcert`, `sslcert`, `sslkey`, `sslmode=verify-ca|verify-full`)
//! with a bare "invalid connection string". They are taken out here and
//! interpreted ([`TlsSettings`], made into a connector by [`super::tls`]);
//! the rest goes on to tokio-postgres. A parameter neither knows is refused by
//! its name.

use std::path::PathBuf;

use percent_encoding::{percent_decode_str, utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
use tokio_postgres::config::SslMode;

use super::StoreError;

/// `sslmode`, as libpq has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    Disable,
    /// TLS when the server offers it, plain TCP otherwise; the certificate is
    /// checked only when `sslrootcert` is given (then as `verify-ca`).
    /// libpq's default, and ours.
    #[default]
    Prefer,
    /// TLS or nothing; the certificate is checked only when `sslrootcert`
    /// is given (then as `verify-ca`), as libpq does.
    Require,
    /// TLS; the server's certificate must chain to a trusted root.
    VerifyCa,
    /// TLS; the certificate must chain to a trusted root and name the host.
    VerifyFull,
}

impl TlsMode {
    fn parse(value: &str) -> Result<TlsMode, StoreError> {
        Ok(match value {
            "disable" => TlsMode::Disable,
            // libpq's `allow` tries plain first, then TLS: the nearest is prefer.
            "allow" | "prefer" => TlsMode::Prefer,
            "require" => TlsMode::Require,
            "verify-ca" => TlsMode::VerifyCa,
            "verify-full" => TlsMode::VerifyFull,
            other => {
                return Err(StoreError::BadUrl(format!(
                    "sslmode `{other}` is not one of disable, allow, prefer, require, verify-ca, verify-full"
                )))
            }
        })
    }

    /// What tokio-postgres is told: whether to ask for TLS and insist.
    fn ssl_mode(self) -> SslMode {
        match self {
            TlsMode::Disable => SslMode::Disable,
            TlsMode::Prefer => SslMode::Prefer,
            TlsMode::Require | TlsMode::VerifyCa | TlsMode::VerifyFull => SslMode::Require,
        }
    }
}

/// The roots a server certificate is checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCert {
    /// A PEM file of one or more CA certificates (`sslrootcert=/path`).
    File(PathBuf),
    /// The platform's trust store (`sslrootcert=system`).
    System,
}

/// What the URL says about TLS beyond what tokio-postgres reads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsSettings {
    pub mode: TlsMode,
    /// Unset: the Mozilla roots compiled in.
    pub root_cert: Option<RootCert>,
    /// A client certificate chain and its key (`sslcert`, `sslkey`).
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

/// The parameters interpreted here, which tokio-postgres would refuse.
pub const TLS_PARAMETERS: &[&str] = &["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// Parameters tokio-postgres reads itself.
const PASSED_ON: &[&str] = &[
    "user",
    "password",
    "dbname",
    "options",
    "application_name",
    "sslnegotiation",
    "host",
    "hostaddr",
    "port",
    "connect_timeout",
    "tcp_user_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_retries",
    "target_session_attrs",
    "channel_binding",
    "load_balance_hosts",
    "replication",
];

/// libpq parameters that mean something we do not do: refused rather than
/// silently ignored.
const UNSUPPORTED: &[&str] = &[
    "sslpassword",
    "sslcrl",
    "sslcrldir",
    "sslsni",
    "sslcertmode",
    "sslcompression",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "requirepeer",
    "require_auth",
    "gssencmode",
    "gsslib",
    "gssdelegation",
    "krbsrvname",
    "service",
    "passfile",
    "fallback_application_name",
];

/// A parsed connection string: tokio-postgres's config and our TLS settings.
#[derive(Debug, Clone)]
pub struct Dsn {
    pub config: tokio_postgres::Config,
    pub tls: TlsSettings,
}

/// One `key=value` of a connection string, where it stands in the text.
struct Param {
    key: String,
    value: String,
    span: std::ops::Range<usize>,
}

enum Form<'a> {
    /// `postgres://…?`, and the query after the `?`, if any.
    Url {
        base: &'a str,
        query: Option<&'a str>,
    },
    Keywords,
}

fn form(s: &str) -> Result<Form<'_>, StoreError> {
    if let Some(scheme) = url_scheme(s) {
        if scheme != "postgres" && scheme != "postgresql" {
            return Err(StoreError::BadUrl(format!(
                "the scheme `{scheme}://` is not postgres:// or postgresql://"
            )));
        }
        return Ok(match s.split_once('?') {
            Some((base, query)) => Form::Url {
                base,
                query: Some(query),
            },
            None => Form::Url {
                base: s,
                query: None,
            },
        });
    }
    Ok(Form::Keywords)
}

/// `scheme` of `scheme://…`, if the string starts like a URL.
fn url_scheme(s: &str) -> Option<&str> {
    let (scheme, _) = s.split_once("://")?;
    let mut chars = scheme.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
    .then_some(scheme)
}

fn url_params(query: &str, offset: usize) -> Result<Vec<Param>, StoreError> {
    let mut params = Vec::new();
    let mut at = offset;
    for part in query.split('&') {
        let span = at..at + part.len();
        at += part.len() + 1;
        if part.is_empty() {
            continue;
        }
        let (key, value) = part.split_once('=').ok_or_else(|| {
            StoreError::BadUrl(format!("parameter `{part}` has no value (`{part}=…`)"))
        })?;
        let decode = |s: &str| {
            percent_decode_str(s)
                .decode_utf8()
                .map(|c| c.into_owned())
                .map_err(|_| StoreError::BadUrl(format!("parameter `{key}` is not UTF-8")))
        };
        params.push(Param {
            key: decode(key)?,
            value: decode(value)?,
            span,
        });
    }
    Ok(params)
}

/// `key = value` pairs, values bare or in single quotes with `\'` and `\\`.
fn keyword_params(s: &str) -> Result<Vec<Param>, StoreError> {
    let bytes = s.as_bytes();
    let mut params = Vec::new();
    let mut i = 0;
    let skip_space = |mut i: usize| {
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    loop {
        i = skip_space(i);
        if i == bytes.len() {
            return Ok(params);
        }
        let start = i;
        while i < bytes.len() && bytes[i] != b'=' && !bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = s[start..i].to_owned();
        i = skip_space(i);
        if i == bytes.len() || bytes[i] != b'=' {
            return Err(StoreError::BadUrl(format!(
                "`{key}` has no value (`{key}=…`)"
            )));
        }
        i = skip_space(i + 1);
        let mut value = String::new();
        if i < bytes.len() && bytes[i] == b'\'' {
            i += 1;
            loop {
                match bytes.get(i) {
                    None => {
                        return Err(StoreError::BadUrl(format!(
                            "the quoted value of `{key}` has no closing quote"
                        )))
                    }
                    Some(b'\'') => {
                        i += 1;
                        break;
                    }
                    Some(b'\\') if i + 1 < bytes.len() => {
                        value.push(s[i + 1..].chars().next().expect("a character"));
                        i += 1 + s[i + 1..].chars().next().map_or(1, char::len_utf8);
                    }
                    Some(_) => {
                        let c = s[i..].chars().next().expect("a character");
                        value.push(c);
                        i += c.len_utf8();
                    }
                }
            }
        } else {
            let v = i;
            while i < bytes.len() && !bytes[i].is_ascii_whitespace() {
                i += 1;
            }
            value.push_str(&s[v..i]);
        }
        params.push(Param {
            key,
            value,
            span: start..i,
        });
    }
}

fn params(form: &Form<'_>, s: &str) -> Result<Vec<Param>, StoreError> {
    match form {
        Form::Url { base, query } => match query {
            Some(q) => url_params(q, base.len() + 1),
            None => Ok(Vec::new()),
        },
        Form::Keywords => keyword_params(s),
    }
}

/// `s` without the parameters at `spans`.
fn without(form: &Form<'_>, s: &str, spans: &[std::ops::Range<usize>]) -> String {
    let kept = |from: usize, parts: &mut Vec<String>, sep: char| {
        let mut pieces = Vec::new();
        let mut at = from;
        for span in spans {
            pieces.push(&s[at..span.start]);
            at = span.end;
        }
        pieces.push(&s[at..]);
        let joined: String = pieces.concat();
        parts.extend(
            joined
                .split(sep)
                .filter(|p| !p.trim().is_empty())
                .map(str::to_owned),
        );
    };
    match form {
        Form::Url { base, query: None } => (*base).to_owned(),
        Form::Url {
            base,
            query: Some(_),
        } => {
            let mut parts = Vec::new();
            kept(base.len() + 1, &mut parts, '&');
            if parts.is_empty() {
                (*base).to_owned()
            } else {
                format!("{base}?{}", parts.join("&"))
            }
        }
        Form::Keywords => {
            let mut parts = Vec::new();
            kept(0, &mut parts, '\u{0}');
            parts.join(" ")
        }
    }
}

/// Reads a database URL (`postgres://…`) or a keyword DSN
/// (`host=… dbname=…`), libpq's TLS parameters included.
pub fn parse(s: &str) -> Result<Dsn, StoreError> {
    if s.trim().is_empty() {
        return Err(StoreError::BadUrl(
            "it is empty (set DATABASE_URL or database.url)".into(),
        ));
    }
    let form = form(s)?;
    let params = params(&form, s)?;
    let mut tls = TlsSettings::default();
    let (mut cert, mut key) = (None, None);
    let mut ours = Vec::new();
    for p in &params {
        match p.key.as_str() {
            "sslmode" => tls.mode = TlsMode::parse(&p.value)?,
            "sslrootcert" if p.value == "system" => tls.root_cert = Some(RootCert::System),
            "sslrootcert" => tls.root_cert = Some(RootCert::File(path(&p.key, &p.value)?)),
            "sslcert" => cert = Some(path(&p.key, &p.value)?),
            "sslkey" => key = Some(path(&p.key, &p.value)?),
            k if PASSED_ON.contains(&k) => continue,
            k if UNSUPPORTED.contains(&k) => {
                return Err(StoreError::BadUrl(format!(
                    "parameter `{k}` is not supported by outbox-relay"
                )))
            }
            k => return Err(StoreError::BadUrl(format!("unknown parameter `{k}`"))),
        }
        ours.push(p.span.clone());
    }
    tls.client_cert = match (cert, key) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        (Some(_), None) => {
            return Err(StoreError::BadUrl(
                "sslcert is given without sslkey: a client certificate needs its key".into(),
            ))
        }
        (None, Some(_)) => {
            return Err(StoreError::BadUrl(
                "sslkey is given without sslcert: a client key needs its certificate".into(),
            ))
        }
    };
    let rest = without(&form, s, &ours);
    let mut config = rest.parse::<tokio_postgres::Config>().map_err(|e| {
        StoreError::BadUrl(match std::error::Error::source(&e) {
            Some(cause) => format!("{e}: {cause}"),
            None => e.to_string(),
        })
    })?;
    config.ssl_mode(tls.mode.ssl_mode());
    Ok(Dsn { config, tls })
}

fn path(key: &str, value: &str) -> Result<PathBuf, StoreError> {
    if value.is_empty() {
        return Err(StoreError::BadUrl(format!("{key} is empty")));
    }
    Ok(PathBuf::from(shellexpand::tilde(value).into_owned()))
}

/// What a value in a URL's query keeps as it is.
const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'/');

/// `s` with each `(key, value)` set: a parameter of the same name in `s` is
/// replaced. How the `database.ssl…` keys reach the connection string.
pub fn with_parameters(s: &str, set: &[(&str, &str)]) -> Result<String, StoreError> {
    let form = form(s)?;
    let params = params(&form, s)?;
    let replaced: Vec<_> = params
        .iter()
        .filter(|p| set.iter().any(|(k, _)| *k == p.key))
        .map(|p| p.span.clone())
        .collect();
    let mut out = without(&form, s, &replaced);
    for (key, value) in set {
        match form {
            Form::Url { .. } => {
                out.push(if out.contains('?') { '&' } else { '?' });
                out.push_str(key);
                out.push('=');
                out.extend(utf8_percent_encode(value, QUERY_VALUE));
            }
            Form::Keywords => {
                let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
                out.push_str(&format!(" {key}='{quoted}'"));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(s: &str) -> String {
        parse(s).expect_err(s).to_string()
    }

    #[test]
    fn libpq_tls_parameters_are_read_from_urls_and_keywords() {
        for s in [
            "postgres://u@db.example.com:5433/app?sslmode=verify-full&sslrootcert=/etc/ca.pem&application_name=x",
            "host=db.example.com port=5433 user=u dbname=app sslmode=verify-full sslrootcert='/etc/ca.pem' application_name=x",
        ] {
            let dsn = parse(s).unwrap();
            assert_eq!(dsn.tls.mode, TlsMode::VerifyFull, "{s}");
            assert_eq!(
                dsn.tls.root_cert,
                Some(RootCert::File("/etc/ca.pem".into())),
                "{s}"
            );
            assert_eq!(dsn.config.get_ssl_mode(), SslMode::Require);
            assert_eq!(dsn.config.get_dbname(), Some("app"));
            assert_eq!(dsn.config.get_ports(), [5433]);
            assert_eq!(dsn.config.get_application_name(), Some("x"));
        }
        let dsn = parse("postgres://h/db?sslrootcert=system&sslcert=/c.pem&sslkey=/k.pem").unwrap();
        assert_eq!(dsn.tls.mode, TlsMode::Prefer);
        assert_eq!(dsn.tls.root_cert, Some(RootCert::System));
        assert_eq!(
            dsn.tls.client_cert,
            Some(("/c.pem".into(), "/k.pem".into()))
        );
        let dsn = parse("host=h sslrootcert='/a dir/it\\'s.pem'").unwrap();
        assert_eq!(
            dsn.tls.root_cert,
            Some(RootCert::File("/a dir/it's.pem".into()))
        );
        assert_eq!(
            parse("postgres://h/db").unwrap().config.get_ssl_mode(),
            SslMode::Prefer
        );
        assert_eq!(
            parse("postgres://h/db?sslmode=disable")
                .unwrap()
                .config
                .get_ssl_mode(),
            SslMode::Disable
        );
    }

    #[test]
    fn what_cannot_be_used_is_refused_by_name() {
        for (s, named) in [
            ("", "empty"),
            ("postgress://nope", "`postgress://`"),
            ("mysql://u@h/db", "`mysql://`"),
            ("postgres://h/db?foo=1", "`foo`"),
            ("host=h foo=1", "`foo`"),
            ("postgres://h/db?sslpassword=x", "`sslpassword`"),
            (
                "postgres://h/db?sslmode=verify_full",
                "sslmode `verify_full`",
            ),
            ("postgres://h/db?sslcert=/c.pem", "sslkey"),
            ("postgres://h/db?sslkey=/k.pem", "sslcert"),
            ("postgres://h/db?port=x", "`port`"),
            ("host=h dbname='open", "closing quote"),
            ("host", "`host` has no value"),
        ] {
            let e = refusal(s);
            assert!(e.contains(named), "{s:?}: {e}");
        }
    }

    #[test]
    fn parameters_are_set_over_the_url_or_the_keywords() {
        let url = with_parameters(
            "postgres://u@h/db?sslmode=disable&application_name=a",
            &[
                ("sslmode", "verify-full"),
                ("sslrootcert", "/etc/my ca.pem"),
            ],
        )
        .unwrap();
        assert_eq!(
            url,
            "postgres://u@h/db?application_name=a&sslmode=verify-full&sslrootcert=/etc/my%20ca.pem"
        );
        let dsn = parse(&url).unwrap();
        assert_eq!(dsn.tls.mode, TlsMode::VerifyFull);
        assert_eq!(
            dsn.tls.root_cert,
            Some(RootCert::File("/etc/my ca.pem".into()))
        );
        let kw = with_parameters("host=h sslmode=disable", &[("sslkey", "/k'.pem")]).unwrap();
        assert_eq!(kw, "host=h sslmode=disable sslkey='/k\\'.pem'");
        assert_eq!(
            with_parameters("postgres://h/db", &[("sslmode", "require")]).unwrap(),
            "postgres://h/db?sslmode=require"
        );
    }
}
