//! The claim's `jsonb` columns as PostgreSQL prints them, turned into an
//! [`OutboxRow`](outbox_client::row::OutboxRow)'s fields without a parse and
//! re-encode of the payload.

/// Removes the whitespace PostgreSQL's `jsonb` output puts after `:` and `,`,
/// so the body is compact JSON without a parse and re-encode of the payload.
pub(crate) fn compact_json(text: &str) -> String {
    let bytes = text.as_bytes();
    if !bytes.contains(&b' ') && !bytes.contains(&b'\n') {
        return text.to_owned();
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut in_string = false;
    let mut escaped = false;
    for &b in bytes {
        if in_string {
            out.push(b);
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
        } else if b == b'"' {
            in_string = true;
            out.push(b);
        } else if !matches!(b, b' ' | b'\n' | b'\r' | b'\t') {
            out.push(b);
        }
    }
    // Only ASCII whitespace outside strings was removed: still valid UTF-8.
    String::from_utf8(out).expect("removing ASCII bytes keeps UTF-8 valid")
}

/// Parses the `headers` column (a JSON object of strings; validated on enqueue,
/// but an application may have written anything: non-strings are skipped).
pub(crate) fn parse_headers(text: &str) -> Vec<(String, String)> {
    if text == "{}" {
        return Vec::new();
    }
    match serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(text) {
        Ok(map) => map
            .into_iter()
            .filter_map(|(k, v)| match v {
                serde_json::Value::String(s) => Some((k, s)),
                _ => None,
            })
            .collect(),
        Err(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compacts_jsonb_text_but_not_strings() {
        assert_eq!(
            compact_json(r#"{"a": [1, 2], "b": "x, y: \" z", "c": {"d": null}}"#),
            r#"{"a":[1,2],"b":"x, y: \" z","c":{"d":null}}"#
        );
        assert_eq!(compact_json(r#"{"a":1}"#), r#"{"a":1}"#);
    }

    #[test]
    fn headers_skip_non_strings() {
        assert_eq!(parse_headers("{}"), vec![]);
        assert_eq!(
            parse_headers(r#"{"a":"1","b":2}"#),
            vec![("a".to_owned(), "1".to_owned())]
        );
        assert_eq!(parse_headers("not json"), vec![]);
    }
}
