//! What a refused configuration says: the key, the reason, where the value
//! came from.

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read or parsed.
    #[error("configuration: {0}")]
    Load(String),
    #[error("configuration key `{key}`: {reason}")]
    Invalid { key: String, reason: String },
    /// More than one source is wrong (a file and an environment variable).
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Several(Vec<ConfigError>),
}

impl ConfigError {
    pub(super) fn invalid(key: impl Into<String>, reason: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// What figment reports (a value a section's type refused, a wrong
    /// type, an unknown key), named the way the checks below name keys.
    pub(super) fn from_figment(errors: figment::Error) -> Self {
        let mut all: Vec<ConfigError> = errors.into_iter().map(Self::from_one).collect();
        if all.len() == 1 {
            all.remove(0)
        } else {
            ConfigError::Several(all)
        }
    }

    fn from_one(e: figment::Error) -> Self {
        if e.path.is_empty() {
            return ConfigError::Load(e.to_string());
        }
        let mut path = e.path.clone();
        let mut reason = e.kind.to_string();
        if let figment::error::Kind::MissingField(field) = &e.kind {
            path.push(field.to_string());
            reason = "must be set".to_owned();
        }
        if let Some(origin) = origin(&e) {
            reason = format!("{reason} (in {origin})");
        }
        ConfigError::invalid(key_of(&path), reason)
    }
}

/// `["routes", "0", "destination"]` → `routes[0].destination`.
fn key_of(path: &[String]) -> String {
    let mut key = String::new();
    for part in path {
        if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            key.push_str(&format!("[{part}]"));
        } else {
            if !key.is_empty() {
                key.push('.');
            }
            key.push_str(part);
        }
    }
    key
}

/// Where a refused value came from: the file or the `OUTBOX_RELAY_…`
/// variables. The defaults and the well-known variables are merged here in
/// code, so figment knows only a line of this file for them: not worth saying.
fn origin(e: &figment::Error) -> Option<String> {
    let md = e.metadata.as_ref()?;
    match &md.source {
        Some(figment::Source::Code(_)) => None,
        Some(source) => Some(format!("{} {source}", md.name)),
        None => Some(md.name.to_string()),
    }
}
