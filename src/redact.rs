//! Hides credentials in what the relay prints: passwords in URLs
//! (`user:secret@`), secret-looking query parameters (`?password=`,
//! `?token=`, `?qstash_token=`, `?sig=` …) and the `password` of a libpq
//! keyword connection string (`host=… password=…`). [`Secret`] and
//! [`HttpUrl`] are configuration values that print themselves that way.

use std::fmt;
use std::str::FromStr;

use percent_encoding::percent_decode_str;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub(crate) const REDACTED: &str = "<redacted>";

/// Parameter and keyword names (lower-case substrings) whose values are hidden.
const SECRET_NAMES: &[&str] = &[
    "password",
    "passwd",
    "pwd",
    "pass",
    "secret",
    "token",
    "key",
    "sig",
    "auth",
    "credential",
    "session",
];

fn is_secret_name(name: &str) -> bool {
    let name = percent_decode_str(name).decode_utf8_lossy().to_lowercase();
    SECRET_NAMES.iter().any(|s| name.contains(s))
}

/// A database URL or libpq keyword string, fit to print: the user name is
/// kept, every password is hidden.
pub(crate) fn database_url(dsn: &str) -> String {
    if dsn.contains("://") {
        redact_url(dsn, false)
    } else {
        keyword_dsn(dsn)
    }
}

/// An HTTP URL fit to print: a password in it is hidden, and so is a bare
/// user name (`https://TOKEN@host` carries a token that way); so are the
/// values of secret-looking query parameters.
pub(crate) fn url(url: &str) -> String {
    redact_url(url, true)
}

/// `message` with every occurrence of `url` replaced by [`url`]'s redacted form.
pub(crate) fn url_in(message: &str, raw: &str) -> String {
    if raw.is_empty() {
        return message.to_owned();
    }
    message.replace(raw, &url(raw))
}

fn redact_url(url: &str, hide_bare_user: bool) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let mut out = String::with_capacity(url.len() + REDACTED.len());
    out.push_str(&url[..scheme_end]);
    match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            match userinfo.find(':') {
                Some(colon) => {
                    out.push_str(&userinfo[..=colon]);
                    out.push_str(REDACTED);
                }
                None if hide_bare_user => out.push_str(REDACTED),
                None => out.push_str(userinfo),
            }
            out.push_str(&authority[at..]);
        }
        None => out.push_str(authority),
    }
    out.push_str(&redact_query(&rest[authority_end..]));
    out
}

/// `path?a=1&token=x#f` → `path?a=1&token=<redacted>#f`.
fn redact_query(tail: &str) -> String {
    let (before_fragment, fragment) = match tail.find('#') {
        Some(i) => tail.split_at(i),
        None => (tail, ""),
    };
    let Some((path, query)) = before_fragment.split_once('?') else {
        return tail.to_owned();
    };
    let query: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if is_secret_name(name) => format!("{name}={REDACTED}"),
            _ => pair.to_owned(),
        })
        .collect();
    format!("{path}?{}{fragment}", query.join("&"))
}

/// libpq's `key = value` list: values unquoted (backslash escapes) or in
/// single quotes (`\'` and `\\` inside). Something that does not parse is
/// hidden from there on rather than printed.
fn keyword_dsn(dsn: &str) -> String {
    let chars: Vec<char> = dsn.chars().collect();
    let n = chars.len();
    let text = |from: usize, to: usize| chars[from..to].iter().collect::<String>();
    let mut out = String::with_capacity(dsn.len());
    let mut i = 0;
    loop {
        let start = i;
        while i < n && chars[i].is_whitespace() {
            i += 1;
        }
        out.push_str(&text(start, i));
        if i >= n {
            return out;
        }
        let key_start = i;
        while i < n && chars[i] != '=' && !chars[i].is_whitespace() {
            i += 1;
        }
        let key = text(key_start, i);
        let separator_start = i;
        while i < n && chars[i].is_whitespace() {
            i += 1;
        }
        if i >= n || chars[i] != '=' {
            out.push_str(REDACTED);
            return out;
        }
        i += 1;
        while i < n && chars[i].is_whitespace() {
            i += 1;
        }
        out.push_str(&key);
        out.push_str(&text(separator_start, i));
        let value_start = i;
        if i < n && chars[i] == '\'' {
            i += 1;
            while i < n && chars[i] != '\'' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else {
            while i < n && !chars[i].is_whitespace() {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
        }
        let i_end = i.min(n);
        if is_secret_name(&key) {
            out.push_str(REDACTED);
        } else {
            out.push_str(&text(value_start, i_end));
        }
        i = i_end;
    }
}

/// A credential from the configuration (a token, a signing key). It is
/// trimmed of the white space a file or a Kubernetes secret leaves around it
/// (a token ending in a newline would be sent as a bare `Bearer`), refused
/// when what is left could not be sent in a header, and never printed:
/// `Debug` and `Serialize` show `<redacted>`. Empty means not set.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Not set.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The secret itself, for the request that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    fn shown(&self) -> &'static str {
        if self.is_empty() {
            ""
        } else {
            REDACTED
        }
    }
}

impl FromStr for Secret {
    type Err = String;

    /// Only visible ASCII (no inner white space, no control characters) can
    /// be sent in a header. The error says what is wrong and where, never
    /// what the secret is.
    fn from_str(value: &str) -> Result<Secret, String> {
        let value = value.trim();
        match value.char_indices().find(|(_, c)| !c.is_ascii_graphic()) {
            None => Ok(Secret(value.to_owned())),
            Some((byte, c)) => Err(format!(
                "has {} at character {}; a secret must be printable ASCII without spaces \
                 (was it read from a file with more than one line?)",
                if c.is_control() {
                    format!("a control character ({c:?})")
                } else if c.is_whitespace() {
                    "white space".to_owned()
                } else {
                    "a non-ASCII character".to_owned()
                },
                value[..byte].chars().count()
            )),
        }
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.shown(), f)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.shown())
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Secret, D::Error> {
        /// A string, or anything else refused without echoing it (serde's
        /// own "invalid type" error would print a number or a boolean).
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Other(serde::de::IgnoredAny),
        }
        match Raw::deserialize(d)? {
            Raw::Text(s) => s.parse().map_err(serde::de::Error::custom),
            Raw::Other(_) => Err(serde::de::Error::custom("must be a string")),
        }
    }
}

/// An `http://` or `https://` URL from the configuration, checked when it
/// is read. It prints (`Debug`, `Serialize`, its errors) with its
/// credentials hidden, as [`url`] does.
#[derive(Clone, PartialEq, Eq)]
pub struct HttpUrl(String);

impl HttpUrl {
    /// The URL as configured, credentials included: for requests only.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for HttpUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<HttpUrl, String> {
        let uri: http::Uri = s
            .parse()
            .map_err(|e| format!("`{}` is not a URL: {e}", url(s)))?;
        match uri.scheme_str() {
            Some("http") | Some("https") => Ok(HttpUrl(s.to_owned())),
            _ => Err(format!("`{}` must start with http:// or https://", url(s))),
        }
    }
}

impl fmt::Debug for HttpUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&url(&self.0), f)
    }
}

impl Serialize for HttpUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&url(&self.0))
    }
}

impl<'de> Deserialize<'de> for HttpUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<HttpUrl, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_urls_keep_the_user_and_hide_every_password() {
        for (input, want) in [
            (
                "postgres://app:s3cret@db:5432/app",
                "postgres://app:<redacted>@db:5432/app",
            ),
            ("postgres://app@db/app", "postgres://app@db/app"),
            (
                "postgresql://app@db/app?sslmode=require&password=s3cret",
                "postgresql://app@db/app?sslmode=require&password=<redacted>",
            ),
            (
                "postgres://db/app?user=app&sslpassword=s3cret",
                "postgres://db/app?user=app&sslpassword=<redacted>",
            ),
            (
                "postgres://app:p@ss@db?PASS%77ORD=s3cret",
                "postgres://app:<redacted>@db?PASS%77ORD=<redacted>",
            ),
            (
                "host=db user=app password=s3cret dbname=app",
                "host=db user=app password=<redacted> dbname=app",
            ),
            (
                "host=db password = 'with \\' quote and spaces' dbname=app",
                "host=db password = <redacted> dbname=app",
            ),
            ("password=s3\\ cret host=db", "password=<redacted> host=db"),
            (
                "host=db sslpassword=s3cret",
                "host=db sslpassword=<redacted>",
            ),
            ("host=db s3cret-without-equals", "host=db <redacted>"),
            (
                "host=db password='unterminated s3cret",
                "host=db password=<redacted>",
            ),
            ("", ""),
        ] {
            let got = database_url(input);
            assert_eq!(got, want, "{input}");
            if input.contains("s3cret") && !want.contains("s3cret") {
                assert!(!got.contains("s3cret"), "{got}");
            }
        }
    }

    #[test]
    fn http_urls_hide_user_info_and_secret_query_values() {
        for (input, want) in [
            (
                "https://u:s3cret@hooks.example.com/x?a=1",
                "https://u:<redacted>@hooks.example.com/x?a=1",
            ),
            (
                "https://s3cret@hooks.example.com/x",
                "https://<redacted>@hooks.example.com/x",
            ),
            (
                "https://qstash.example.com/?qstash_token=s3cret",
                "https://qstash.example.com/?qstash_token=<redacted>",
            ),
            (
                "https://h.example.com/in/{event_type}?Signature=s3cret&api_key=s3cret&b=2#frag",
                "https://h.example.com/in/{event_type}?Signature=<redacted>&api_key=<redacted>&b=2#frag",
            ),
            (
                "https://h.example.com?access_token=s3cret",
                "https://h.example.com?access_token=<redacted>",
            ),
            ("https://h.example.com/a@b", "https://h.example.com/a@b"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(url(input), want, "{input}");
        }
    }

    #[test]
    fn a_secret_is_trimmed_refused_when_it_cannot_be_sent_and_never_printed() {
        let s = Secret::from_str("  tok-s3cret\n").unwrap();
        assert_eq!(s.expose(), "tok-s3cret");
        assert_eq!(format!("{s:?}"), "\"<redacted>\"");
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"<redacted>\"");
        let unset = Secret::from_str(" \n").unwrap();
        assert!(unset.is_empty());
        assert_eq!(serde_json::to_string(&unset).unwrap(), "\"\"");
        for (bad, what) in [
            ("s3c\nret", "a control character ('\\n') at character 3"),
            ("s3c ret", "white space at character 3"),
            ("s3crét", "a non-ASCII character at character 4"),
        ] {
            let e = Secret::from_str(bad).unwrap_err();
            assert!(e.contains(what), "{bad:?}: {e}");
            assert!(!e.contains("s3c"), "{e}");
        }
        // Read as a value: a number (the environment's `…_TOKEN=12345`) is
        // refused without being echoed.
        use serde::de::IntoDeserializer;
        let number: serde::de::value::U64Deserializer<serde::de::value::Error> =
            12345u64.into_deserializer();
        let e = Secret::deserialize(number).unwrap_err().to_string();
        assert!(
            e.contains("must be a string") && !e.contains("12345"),
            "{e}"
        );
        let read: Secret = serde_json::from_str("\" tok\\n\"").unwrap();
        assert_eq!(read.expose(), "tok");
    }

    #[test]
    fn an_http_url_is_http_or_https_and_prints_without_its_credentials() {
        let u = HttpUrl::from_str("https://u:s3cret@qstash.example.com/?token=s3cret").unwrap();
        assert_eq!(
            u.as_str(),
            "https://u:s3cret@qstash.example.com/?token=s3cret"
        );
        for shown in [format!("{u:?}"), serde_json::to_string(&u).unwrap()] {
            assert!(!shown.contains("s3cret"), "{shown}");
            assert!(shown.contains("qstash.example.com"), "{shown}");
        }
        assert!(HttpUrl::from_str("http://127.0.0.1:8080").is_ok());
        let e = HttpUrl::from_str("ftp://u:s3cret@files.example.com/").unwrap_err();
        assert_eq!(
            e,
            "`ftp://u:<redacted>@files.example.com/` must start with http:// or https://"
        );
        let e = HttpUrl::from_str("https://u:s3cret@bad host/").unwrap_err();
        assert!(e.contains("is not a URL") && !e.contains("s3cret"), "{e}");
    }
}
