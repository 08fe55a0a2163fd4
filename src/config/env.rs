//! Values from the environment: the well-known variables other tools use,
//! and `${NAME}` in a route's URLs.

use figment::providers::Serialized;
use figment::value::Value;
use figment::Figment;

use super::ConfigError;

/// Well-known variables that other tools already use, mapped onto our keys.
pub(super) const WELL_KNOWN_ENV: &[(&str, &str)] = &[
    ("DATABASE_URL", "database.url"),
    ("QSTASH_URL", "qstash.url"),
    ("QSTASH_TOKEN", "qstash.token"),
    ("QSTASH_CURRENT_SIGNING_KEY", "qstash.current_signing_key"),
    ("QSTASH_NEXT_SIGNING_KEY", "qstash.next_signing_key"),
];

/// The keys of a route in which `${NAME}` is an environment variable.
const ROUTE_KEYS_WITH_ENV: &[&str] = &["destination", "failure_callback", "callback"];

/// `${NAME}` (or `$NAME`) in a route's URLs replaced by the environment
/// variable's value, in the layered values before the routes are parsed (so
/// the URL types check what will be used); `$$` is a literal `$`.
pub(super) fn expand_route_env(figment: Figment) -> Result<Figment, ConfigError> {
    let Ok(Value::Array(tag, mut routes)) = figment.find_value("routes") else {
        // None, or not a list: extracting says what is wrong.
        return Ok(figment);
    };
    let mut expanded = false;
    for (i, route) in routes.iter_mut().enumerate() {
        let Value::Dict(_, keys) = route else {
            continue;
        };
        for key in ROUTE_KEYS_WITH_ENV {
            if let Some(Value::String(_, s)) = keys.get_mut(*key) {
                if s.contains('$') {
                    *s = expand_env(s, &format!("routes[{i}].{key}"))?;
                    expanded = true;
                }
            }
        }
    }
    Ok(if expanded {
        figment.merge(Serialized::default("routes", Value::Array(tag, routes)))
    } else {
        figment
    })
}

fn expand_env(s: &str, key: &str) -> Result<String, ConfigError> {
    shellexpand::env(s).map(|c| c.into_owned()).map_err(|e| {
        ConfigError::invalid(
            key,
            format!(
                "environment variable `{}` is not set ({})",
                e.var_name, e.cause
            ),
        )
    })
}
