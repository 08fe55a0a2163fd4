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
    // Copies the runs between whitespace outside strings (a string is
    // skipped to its closing quote in one search), not byte by byte: this
    // runs on every claimed row's payload.
    let mut out = Vec::with_capacity(bytes.len());
    let (mut i, mut run) = (0, 0);
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                loop {
                    match memchr::memchr2(b'"', b'\\', &bytes[i..]) {
                        None => {
                            i = bytes.len();
                            break;
                        }
                        Some(at) if bytes[i + at] == b'"' => {
                            i += at + 1;
                            break;
                        }
                        // An escape: the byte after the backslash is part of it.
                        Some(at) => i = (i + at + 2).min(bytes.len()),
                    }
                }
            }
            b' ' | b'\n' | b'\r' | b'\t' => {
                out.extend_from_slice(&bytes[run..i]);
                i += 1;
                run = i;
            }
            _ => i += 1,
        }
    }
    out.extend_from_slice(&bytes[run..]);
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
        // An escaped backslash ends right before the closing quote; an
        // escaped quote does not close the string.
        assert_eq!(
            compact_json(r#"{"p\\": "a b\\", "q": "c \" d", "r": [ ]}"#),
            r#"{"p\\":"a b\\","q":"c \" d","r":[]}"#
        );
        assert_eq!(compact_json("{\"a\": \"x y"), "{\"a\":\"x y");
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
