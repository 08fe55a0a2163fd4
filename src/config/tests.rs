use std::time::Duration;

use super::*;

fn with_token(token: &str) -> Result<Config, ConfigError> {
    Config::from_toml_str(&format!(
        "[qstash]\ntoken = {}\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\n",
        toml_string(token)
    ))
}

fn toml_string(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

#[test]
fn a_token_read_from_a_file_is_trimmed() {
    let c = with_token("  secret-token\n").unwrap();
    assert_eq!(c.qstash.token.expose(), "secret-token");
    // And it is sent whole, not as a bare `Bearer`.
    let sink = crate::sink::qstash::QstashSink::new(&c.qstash, &c.http);
    let request = sink.batch_request(&[]);
    assert_eq!(
        request.headers()["authorization"].to_str().unwrap(),
        "Bearer secret-token"
    );
}

#[test]
fn a_token_with_an_inner_control_character_stops_the_relay_naming_the_key() {
    for bad in ["first\nsecond", "tab\there", "nul\0", "späce", "two words"] {
        let e = with_token(bad).unwrap_err().to_string();
        assert!(
            e.contains("configuration key `qstash.token`"),
            "{bad:?}: {e}"
        );
        assert!(!e.contains(bad), "the error must not print the secret: {e}");
    }
}

#[test]
fn a_relay_without_routes_is_refused_with_how_to_add_one() {
    let c = Config::from_toml_str("[qstash]\ntoken = \"t\"\n").unwrap();
    let e = c.validate_for_relay().unwrap_err().to_string();
    assert!(e.contains("`routes`"), "{e}");
    assert!(e.contains("[[routes]]"), "{e}");
}

#[test]
fn route_urls_take_environment_variables() {
    std::env::set_var("OUTBOXTEST_DEST_Q7", "https://hooks.example.com/in");
    std::env::set_var("OUTBOXTEST_CB_Q7", "https://relay.example.com");
    let c = Config::from_toml_str(
        "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"${OUTBOXTEST_DEST_Q7}/{event_type}\"\nfailure_callback = \"$OUTBOXTEST_CB_Q7/qstash/failure\"\n",
    )
    .unwrap();
    assert_eq!(
        c.routes[0].destination.as_str(),
        "https://hooks.example.com/in/{event_type}"
    );
    assert_eq!(
        c.routes[0].failure_callback.as_ref().unwrap().as_str(),
        "https://relay.example.com/qstash/failure"
    );
    let c = Config::from_toml_str(
        "[qstash]\ntoken = \"t\"\ncurrent_signing_key = \"k\"\n[server]\ncallback_bind = \"127.0.0.1:0\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\nordering = \"partition_key\"\ncallback = \"${OUTBOXTEST_CB_Q7}/qstash/callback\"\n",
    )
    .unwrap();
    assert_eq!(
        c.routes[0].callback.as_ref().unwrap().as_str(),
        "https://relay.example.com/qstash/callback"
    );
    let e = Config::from_toml_str(
        "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"${OUTBOXTEST_UNSET_Q7}\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("routes[0].destination"), "{e}");
    assert!(e.contains("OUTBOXTEST_UNSET_Q7"), "{e}");
    // What the variable holds is checked like a value written in the file.
    std::env::set_var("OUTBOXTEST_FTP_Q7", "ftp://files.example.com");
    let e = Config::from_toml_str(
        "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\nfailure_callback = \"${OUTBOXTEST_FTP_Q7}/x\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("configuration key `routes[0].failure_callback`: `ftp://files.example.com/x` must start with http:// or https://"),
        "{e}"
    );
}

#[test]
fn values_refused_as_they_are_read_name_their_key_like_the_checks_do() {
    let route = "[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\n";
    for (toml, want) in [
        (
            "[qstash]\nbatch_size = 0\n".to_owned(),
            "configuration key `qstash.batch_size`: must be between 1 and 1000",
        ),
        (
            "[qstash]\nurl = \"qstash.example.com\"\n".to_owned(),
            "configuration key `qstash.url`: `qstash.example.com` must start with http:// or https://",
        ),
        (
            "[http]\nrequest_timeout = \"0s\"\n".to_owned(),
            "configuration key `http.request_timeout`: must be more than zero",
        ),
        (
            format!("[qstash]\ntoken = \"t\"\n{route}{route}parallelism = 0\n"),
            "configuration key `routes[1].parallelism`: must be at least 1",
        ),
        (
            format!("{route}method = \"GET POST\"\n"),
            "configuration key `routes[0].method`: `GET POST` is not an HTTP method",
        ),
        (
            format!("{route}sink = \"webhook\"\nsigning_secret = \"whsec_***\"\n"),
            "configuration key `routes[0].signing_secret`: the part after `whsec_` is not base64",
        ),
        (
            format!("{route}sink = \"webhook\"\nsigning_secret = \"MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\n"),
            "configuration key `routes[0].signing_secret`: must start with `whsec_`",
        ),
        (
            "[[routes]]\nevent_type = \"*\"\n".to_owned(),
            "configuration key `routes[0].destination`: must be set",
        ),
        (
            "[[routes]]\nevent_type = \"*\"\ndestination = \"\"\n".to_owned(),
            "configuration key `routes[0].destination`: must not be empty",
        ),
        (
            format!("[qstash]\ntoken = \"t\"\n{route}period = \"1s\"\n"),
            "configuration key `routes[0].period`: needs `rate`",
        ),
    ] {
        let e = Config::from_toml_str(&toml).expect_err(&toml).to_string();
        assert!(e.contains(want), "{toml:?}:\n{e}\nwanted: {want}");
    }
    // A wrong type says where the value was written.
    let e = Config::from_toml_str("[relay]\nshards = \"two\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("configuration key `relay.shards`: invalid type")
            && e.contains("TOML source string"),
        "{e}"
    );
}

#[test]
fn the_idle_cost_keys_are_read_and_checked_naming_the_key() {
    let c = Config::default();
    assert_eq!(c.relay.idle_probe_max, Duration::from_secs(1));
    assert_eq!(c.database.idle_timeout, Duration::from_secs(600));
    let c = Config::from_toml_str(
        "[relay]\nidle_probe_max = \"30s\"\n[database]\nidle_timeout = \"2m\"\n",
    )
    .unwrap();
    assert_eq!(c.relay.idle_probe_max, Duration::from_secs(30));
    assert_eq!(c.database.idle_timeout, Duration::from_secs(120));
    for (toml, want) in [
        (
            "[relay]\nidle_probe_max = \"0s\"\n",
            "configuration key `relay.idle_probe_max`: must be at least 1ms",
        ),
        (
            "[relay]\nidle_probe_max = \"500us\"\n",
            "configuration key `relay.idle_probe_max`: must be at least 1ms",
        ),
        (
            "[database]\nidle_timeout = \"0s\"\n",
            "configuration key `database.idle_timeout`: must be at least 1s",
        ),
        (
            "[relay]\nidle_probe_max = \"soon\"\n",
            "configuration key `relay.idle_probe_max`",
        ),
    ] {
        let e = Config::from_toml_str(toml).expect_err(toml).to_string();
        assert!(e.contains(want), "{toml:?}:\n{e}\nwanted: {want}");
    }
}

#[test]
fn a_webhook_route_signs_with_the_key_of_its_secret() {
    let c = Config::from_toml_str(
        "[[routes]]\nevent_type = \"*\"\nsink = \"webhook\"\ndestination = \"https://a.example.com/\"\nsigning_secret = \" whsec_AQID\\n\"\n",
    )
    .unwrap();
    let secret = c.routes[0].signing_secret.as_ref().unwrap();
    assert_eq!(secret.key(), [1, 2, 3]);
    // An empty secret is none, as it was before it was set.
    let c = Config::from_toml_str(
        "[qstash]\ntoken = \"t\"\n[[routes]]\nevent_type = \"*\"\ndestination = \"https://a.example.com/\"\nsigning_secret = \"\"\n",
    )
    .unwrap();
    assert!(c.routes[0].signing_secret.is_none());
}

#[test]
fn neither_debug_nor_serialize_prints_a_secret() {
    const MARK: &str = "Leak";
    let c = Config::from_toml_str(&format!(
        "[database]\nurl = \"postgres://app:db-{MARK}@db.example.com/app\"\n\
         [qstash]\nurl = \"https://u:qs-{MARK}@qstash.example.com/\"\ntoken = \"tok-{MARK}\"\n\
         current_signing_key = \"cur-{MARK}\"\nnext_signing_key = \"next-{MARK}\"\n\
         [[routes]]\nevent_type = \"*\"\nsink = \"webhook\"\n\
         destination = \"https://u:dest-{MARK}@hooks.example.com/{{event_type}}?token=t-{MARK}\"\n\
         failure_callback = \"https://cb-{MARK}@cb.example.com/\"\n\
         signing_secret = \"whsec_TGVha0xlYWtMZWFr\"\n"
    ))
    .unwrap();
    let debug = format!("{c:?}");
    let json = serde_json::to_string(&c.redacted()).unwrap();
    for shown in [&debug, &json] {
        assert!(!shown.contains(MARK), "{shown}");
        assert!(!shown.contains("TGVha0xlYWtMZWFr"), "{shown}");
        assert!(shown.contains("<redacted>"), "{shown}");
        assert!(shown.contains("hooks.example.com"), "{shown}");
    }
    // Unset secrets print as unset.
    let json = serde_json::to_value(Config::default()).unwrap();
    assert_eq!(json["qstash"]["token"], "");
}
