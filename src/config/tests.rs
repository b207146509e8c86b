//! Loading, validation and matching of limits files.

use std::path::Path;

use super::Config;
use crate::limiter::{Algorithm, Unit};

fn load(text: &str) -> Result<Config, crate::ConfigError> {
    Config::from_files([(Path::new("limits/test.yaml"), text)])
}

fn error(text: &str) -> crate::ConfigError {
    match load(text) {
        Ok(_) => panic!("config should have been refused:\n{text}"),
        Err(e) => e,
    }
}

fn assert_refused(text: &str, reason_contains: &str) {
    let e = error(text);
    assert_eq!(e.file, Path::new("limits/test.yaml"));
    assert!(
        e.reason.contains(reason_contains),
        "reason {:?} should mention {reason_contains:?}",
        e.reason
    );
}

/// The rule name (or path) matched by a request's entries in domain `d`.
fn matched(config: &Config, entries: &[(&str, &str)]) -> Option<String> {
    config
        .domain("d")
        .and_then(|d| d.rules.find(entries.iter().copied()))
        .map(|r| {
            r.rates
                .first()
                .and_then(|r| r.name.clone())
                .unwrap_or_else(|| r.path.clone())
        })
}

#[test]
fn loads_envoy_ratelimit_example() {
    let config = load(
        r#"
domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit:
      unit: second
      requests_per_unit: 500
  - key: database
    value: default
    rate_limit:
      unit: SECOND
      requests_per_unit: 500
    shadow_mode: true
    detailed_metric: true
"#,
    )
    .unwrap();
    let domain = config.domain("mongo_cps").unwrap();
    let rule = domain
        .rules
        .find([("database", "default")].into_iter())
        .unwrap();
    let rate = &rule.rates[0];
    assert_eq!((rate.requests_per_unit, rate.unit), (500, Unit::Second));
    assert!(rule.shadow_mode && rule.detailed_metric);
    assert_eq!(rule.path, "database_default");
}

#[test]
fn every_unit_parses_case_insensitively() {
    for (name, unit) in [
        ("second", Unit::Second),
        ("Minute", Unit::Minute),
        ("HOUR", Unit::Hour),
        ("day", Unit::Day),
        ("week", Unit::Week),
        ("month", Unit::Month),
        ("year", Unit::Year),
    ] {
        let config = load(&format!(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: {name}, requests_per_unit: 1}}\n"
        ))
        .unwrap();
        let rule = config
            .domain("d")
            .unwrap()
            .rules
            .find([("k", "v")].into_iter())
            .unwrap();
        assert_eq!(rule.rates[0].unit, unit);
    }
}

#[test]
fn scalar_values_are_text() {
    let config = load(
        "domain: d\ndescriptors:\n  - key: code\n    value: 429\n    rate_limit: {unit: second, requests_per_unit: 1, name: n}\n",
    )
    .unwrap();
    assert_eq!(matched(&config, &[("code", "429")]).as_deref(), Some("n"));
}

/// Scalars as their loader (yaml.v2, YAML 1.1) reads them: a value is its
/// text as written, booleans take yes/no and on/off, counts Go's integer
/// forms and whole floats.
#[test]
fn scalars_read_as_their_yaml_reads_them() {
    let config = load(
        r#"
domain: d
descriptors:
  - key: hex
    value: 0x1F
    rate_limit: {unit: minute, requests_per_unit: 1_000, name: hex}
  - key: float
    value: 1.50
    shadow_mode: yes
    rate_limit: {unit: minute, requests_per_unit: 010, name: float}
  - key: word
    value: on
    detailed_metric: On
    rate_limit: {unit: minute, requests_per_unit: 1e3, unlimited: NO, name: word}
  - key: plus
    value: +5
    rate_limit: {unit: minute, requests_per_unit: 0x10, name: plus}
"#,
    )
    .unwrap();
    let rules = &config.domain("d").unwrap().rules;
    for (key, written, parsed, name, rpu) in [
        ("hex", "0x1F", "31", "hex", 1000),
        ("float", "1.50", "1.5", "float", 8),
        ("word", "on", "true", "word", 1000),
        ("plus", "+5", "5", "plus", 16),
    ] {
        let rule = rules.find([(key, written)].into_iter()).unwrap();
        assert_eq!(rule.rates[0].name.as_deref(), Some(name));
        assert_eq!(rule.rates[0].requests_per_unit, rpu, "{key}");
        assert!(rules.find([(key, parsed)].into_iter()).is_none(), "{key}");
    }
    let float = rules.find([("float", "1.50")].into_iter()).unwrap();
    assert!(float.shadow_mode && !float.detailed_metric);
    assert!(
        rules
            .find([("word", "on")].into_iter())
            .unwrap()
            .detailed_metric
    );

    // Each error names the scalar's own line and path.
    for (bad, reason) in [
        ("shadow_mode: maybe", "\"maybe\" is not a boolean"),
        ("shadow_mode: 1", "\"1\" is not a boolean"),
        (
            "rate_limit: {unit: second, requests_per_unit: 1.5}",
            "\"1.5\" is not a count",
        ),
        (
            "rate_limit: {unit: second, requests_per_unit: -1}",
            "\"-1\" is not a count",
        ),
        (
            "rate_limit: {unit: second, requests_per_unit: 4294967296}",
            "is not a count",
        ),
        (
            "rate_limit: {unit: second, requests_per_unit: 0x+1}",
            "is not a count",
        ),
        (
            "rate_limit: {unit: second, requests_per_unit: 09a}",
            "is not a count",
        ),
        (
            "rate_limit: {unit: second, requests_per_unit: _1}",
            "\"_1\" is not a count",
        ),
    ] {
        let e = error(&format!("domain: d\ndescriptors:\n  - key: k\n    {bad}\n"));
        assert!(e.reason.contains(reason), "{bad}: {e}");
        assert_eq!(e.line, Some(4), "{bad}: {e}");
    }
    let e = error("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      name: n\n      requests_per_unit: -1\n");
    assert_eq!(e.line, Some(7), "{e}");
    assert!(
        e.reason
            .starts_with("descriptors[0].rate_limit.requests_per_unit: "),
        "{e}"
    );
}

/// A file saved with a byte-order mark loads, as there.
#[test]
fn a_byte_order_mark_is_read_as_one() {
    let config = load("\u{feff}domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 3}\n").unwrap();
    assert!(config.domain("d").is_some());
}

/// YAML merge keys, which their loader applies, load too.
#[test]
fn merge_keys_apply_as_in_their_loader() {
    let config = load(
        r#"
domain: d
descriptors:
  - key: base
    rate_limit: &limit {unit: minute, requests_per_unit: 7, name: base}
  - key: merged
    shadow_mode: yes
    rate_limit:
      <<: *limit
      requests_per_unit: 9
      name: merged
    metadata: {<<: {tier: 2}, plan: gold}
"#,
    )
    .unwrap();
    let rules = &config.domain("d").unwrap().rules;
    let merged = rules.find([("merged", "x")].into_iter()).unwrap();
    let rate = &merged.rates[0];
    assert_eq!(
        (rate.unit, rate.requests_per_unit, rate.name.as_deref()),
        (Unit::Minute, 9, Some("merged"))
    );
    assert!(merged.shadow_mode);
    assert_eq!(
        rules.find([("base", "x")].into_iter()).unwrap().rates[0].requests_per_unit,
        7
    );

    let e = error("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {<<: {unit: second}, requests_per_unit: 1, bad: 1}\n");
    assert!(e.reason.contains("unknown field `bad`"), "{e}");
    assert_eq!(e.line, Some(4), "where the unknown key is written");
    // In a later document, and where an anchor's mapping merged elsewhere
    // holds it.
    let e = error("domain: a\n---\ndomain: d\ndescriptors:\n  - key: base\n    rate_limit: &l\n      unit: minute\n      bogus: 2\n  - key: m\n    rate_limit:\n      <<: *l\n      requests_per_unit: 9\n");
    assert!(e.reason.contains("unknown field `bogus`"), "{e}");
    assert_eq!(e.line, Some(8), "{e}");
    // A key written on two lines (a descriptor's `value`, and one where it
    // is unknown): no line rather than perhaps the wrong one.
    let e = error("domain: d\ndescriptors:\n  - key: k\n    value: v\n    rate_limit: {<<: {unit: minute}, requests_per_unit: 1, value: 3}\n");
    assert!(e.reason.contains("unknown field `value`"), "{e}");
    assert_eq!(e.line, None, "{e}");

    // Where a `<<` stands decides, as in yaml.v2: after a key, it wins.
    let config = load("domain: d\ndescriptors:\n  - key: base\n    rate_limit: &l {unit: minute, requests_per_unit: 7}\n  - key: m\n    rate_limit:\n      requests_per_unit: 9\n      <<: *l\n").unwrap();
    let m = config
        .domain("d")
        .unwrap()
        .rules
        .find([("m", "x")].into_iter())
        .unwrap();
    assert_eq!(m.rates[0].requests_per_unit, 7);

    // `<<` elsewhere (a comment, a value) is no merge key: scalars stay
    // their text, and errors keep their line.
    let text = "# generated << do not edit\ndomain: d\ndescriptors:\n  - key: hex\n    value: 0x1F\n    rate_limit: {unit: minute, requests_per_unit: 5, name: \"a<<b\"}\n";
    let config = load(text).unwrap();
    assert!(config
        .domain("d")
        .unwrap()
        .rules
        .find([("hex", "0x1F")].into_iter())
        .is_some());
    let e = error(&format!("{text}    bad: 1\n"));
    assert_eq!(e.line, Some(7), "{e}");
}

#[test]
fn refuses_unknown_keys_with_line() {
    let e = error("domain: d\ndescriptors:\n  - key: k\n    rate_limt: {unit: second, requests_per_unit: 1}\n");
    assert_eq!(e.line, Some(4), "{e}");
    assert!(e.reason.contains("unknown field `rate_limt`"), "{e}");
    assert!(e.to_string().starts_with("limits/test.yaml:4: "), "{e}");

    let e = error("domain: d\nfoo: 1\n");
    assert_eq!(e.line, Some(2), "{e}");
    assert!(e.reason.contains("unknown field `foo`"), "{e}");

    let e = error("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, algo: x}\n");
    assert!(e.reason.contains("unknown field `algo`"), "{e}");
}

#[test]
fn refuses_a_domain_no_request_could_name_with_line() {
    let long = "d".repeat(1025);
    let e = error(&format!("# limits\ndomain: {long}\ndescriptors: []\n"));
    assert_eq!(e.line, Some(2), "{e}");
    assert_eq!(
        e.reason,
        "domain: the domain is 1025 bytes, longer than the 1024 a request may name"
    );
    assert!(load(&format!("domain: {}\n", &long[1..])).is_ok());
}

/// Flow collections nested past serde_yaml's limit are refused before the
/// parse, whose time grows with the square of their depth.
#[test]
fn refuses_deep_flow_nesting_before_parsing_it() {
    let e = error(&format!(
        "domain: d\ndescriptors: {}\n",
        "[".repeat(200_000)
    ));
    assert_eq!(e.line, Some(2), "{e}");
    assert_eq!(
        e.reason,
        "flow collections ([...], {...}) nested more than 128 deep"
    );
}

#[test]
fn refuses_bad_unit_with_line() {
    let e = error("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n");
    assert!(e.reason.contains("unknown unit \"fortnight\""), "{e}");
    assert_eq!(e.line, Some(5), "{e}");
}

/// Their loader refuses a unit on an unlimited limit only when it is a
/// real unit: `unit: ""` (what a Go program marshalling their struct
/// writes) or an unknown name is ignored there, and here.
#[test]
fn an_unlimited_limit_ignores_a_unit_that_is_not_one() {
    for unit in ["\"\"", "unknown", "fortnight"] {
        let text = format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unlimited: true, unit: {unit}}}\n");
        let parsed = load(&text);
        assert!(parsed.is_ok(), "{unit}: {:?}", parsed.err());
    }
}

#[test]
fn refuses_syntax_errors_with_line() {
    let e = error("domain: d\ndescriptors:\n  - key: [unclosed\n");
    assert!(e.line.is_some(), "{e}");
    // The line is said once, in its own field: serde_yaml's locations in
    // the middle of the message are cut too.
    let e = error("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second\n\n");
    assert_eq!(e.line, Some(6), "{e}");
    assert_eq!(
        e.reason,
        "did not find expected ',' or '}', while parsing a flow mapping"
    );
}

#[test]
fn refuses_invalid_rules() {
    let cases = [
        ("descriptors: []\n", "domain must not be empty"),
        ("domain: ''\n", "domain must not be empty"),
        ("", "domain must not be empty"),
        ("domain: d\ndescriptors:\n  - value: v\n", "descriptors[0]: the descriptor key must not be empty"),
        ("domain: d\ndescriptors:\n  - key: ''\n", "key must not be empty"),
        (
            "domain: d\ndescriptors:\n  - key: k\n    descriptors:\n      - key: ''\n",
            "descriptors[0].descriptors[0]: the descriptor key must not be empty",
        ),
        ("domain: d\ndescriptors:\n  - key: k\n  - key: k\n", "duplicate descriptor \"k\""),
        (
            "domain: d\ndescriptors:\n  - {key: k, value: v}\n  - {key: k, value: v}\n",
            "descriptors[1]: duplicate descriptor \"k_v\"",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, unit: second}\n",
            "unlimited rate limit must not have a unit",
        ),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 5}\n", "unit is missing"),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: ''}]}\n",
            "every entry needs a name",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, name: a, replaces: [{name: a}]}\n",
            "replaces itself",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, name: a, replaces: [{name: a}]}\n",
            "replaces itself",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: -1}\n",
            "\"-1\" is not a count",
        ),
    ];
    for (text, reason) in cases {
        assert_refused(text, reason);
    }
}

#[test]
fn same_key_with_and_without_value_is_not_a_duplicate() {
    let config = load(
        "domain: d\ndescriptors:\n  - {key: k, rate_limit: {unit: second, requests_per_unit: 1, name: any}}\n  - {key: k, value: v, rate_limit: {unit: second, requests_per_unit: 1, name: exact}}\n",
    )
    .unwrap();
    assert_eq!(matched(&config, &[("k", "v")]).as_deref(), Some("exact"));
    assert_eq!(matched(&config, &[("k", "w")]).as_deref(), Some("any"));
}

#[test]
fn refuses_duplicate_domains_naming_both_files() {
    let text = "domain: d\n";
    let e =
        Config::from_files([(Path::new("a.yaml"), text), (Path::new("b.yaml"), text)]).unwrap_err();
    assert_eq!(e.file, Path::new("b.yaml"));
    assert!(
        e.reason.contains("duplicate domain \"d\"") && e.reason.contains("a.yaml"),
        "{e}"
    );
}

const MATCHING: &str = r#"
domain: d
descriptors:
  - key: plan
    value: free
    rate_limit: {unit: minute, requests_per_unit: 1, name: plan_free}
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 100, name: free_user}
      - key: user
        value: vip
        rate_limit: {unit: minute, requests_per_unit: 1000, name: free_vip}
  - key: plan
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 10, name: other_plan_user}
  - key: path
    value: "/api/*"
    rate_limit: {unit: second, requests_per_unit: 5, name: api_wild}
  - key: path
    value: "/api/v1*"
    rate_limit: {unit: second, requests_per_unit: 5, name: v1_wild}
  - key: path
    value: "/api/v1/exact"
    rate_limit: {unit: second, requests_per_unit: 5, name: exact}
  - key: path
    value: "*.png"
    rate_limit: {unit: second, requests_per_unit: 5, name: png}
  - key: parent_only
    rate_limit: {unit: second, requests_per_unit: 5, name: parent}
    descriptors:
      - key: child
        value: limited
        rate_limit: {unit: second, requests_per_unit: 5, name: child}
  - key: open
    rate_limit: {unlimited: true, name: open}
"#;

#[test]
fn matching_follows_envoy_ratelimit() {
    let config = load(MATCHING).unwrap();
    type Entries<'a> = &'a [(&'a str, &'a str)];
    let cases: &[(Entries<'_>, Option<&str>)] = &[
        // Exact value.
        (&[("plan", "free")], Some("plan_free")),
        // Nested: value-less default key under an exact value.
        (&[("plan", "free"), ("user", "alice")], Some("free_user")),
        // Nested exact beats the default.
        (&[("plan", "free"), ("user", "vip")], Some("free_vip")),
        // Value-less parent for an unknown plan.
        (
            &[("plan", "gold"), ("user", "alice")],
            Some("other_plan_user"),
        ),
        // The value-less parent has no limit of its own.
        (&[("plan", "gold")], None),
        // Wildcards in file order; exact first.
        (&[("path", "/api/v1/users")], Some("api_wild")),
        (&[("path", "/api/v1/exact")], Some("exact")),
        (&[("path", "/img/logo.png")], Some("png")),
        (&[("path", "/other")], None),
        // No fallback to the parent's limit when the child does not match.
        (&[("parent_only", "x"), ("child", "unlimited")], None),
        (&[("parent_only", "x"), ("child", "limited")], Some("child")),
        // Deeper than the tree.
        (&[("plan", "free"), ("user", "a"), ("extra", "b")], None),
        // Unknown key, empty entries.
        (&[("nope", "x")], None),
        (&[], None),
        (&[("open", "x")], Some("open")),
    ];
    for (entries, expected) in cases {
        assert_eq!(
            matched(&config, entries).as_deref(),
            *expected,
            "entries {entries:?}"
        );
    }
    let open = config
        .domain("d")
        .unwrap()
        .rules
        .find([("open", "x")].into_iter())
        .unwrap();
    assert!(open.is_unlimited(), "unlimited rules carry no rate");
}

#[test]
fn load_dir_skips_hidden_and_non_yaml_and_follows_symlinks() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("..data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("a.yaml"), "domain: a\n").unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink("..data/a.yaml", dir.path().join("a.yaml")).unwrap();
    std::fs::write(dir.path().join("b.yml"), "domain: b\n").unwrap();
    std::fs::write(dir.path().join("README.md"), "not yaml").unwrap();
    std::fs::write(dir.path().join(".hidden.yaml"), "domain: hidden\n").unwrap();
    let config = Config::load_dir(dir.path()).unwrap();
    assert_eq!(config.domain_names(), vec!["a", "b"]);
}

#[test]
fn a_file_that_is_not_utf8_is_refused_at_the_line_of_its_first_bad_byte() {
    let dir = tempfile::tempdir().unwrap();
    let text = b"domain: d\ndescriptors:\n  - key: k\xff\n";
    std::fs::write(dir.path().join("l.yaml"), text).unwrap();
    let errors = Config::check_dir(dir.path()).unwrap_err();
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].line, Some(3), "{}", errors[0]);
    assert_eq!(errors[0].reason, "the text is not UTF-8 from column 11");
}

/// A limits file's name on what cannot be read as one is an error naming
/// it: skipped, a reload would drop its domain unseen.
#[cfg(unix)]
#[test]
fn a_yaml_name_on_what_is_not_a_readable_file_is_an_error() {
    use std::os::unix::fs::symlink;
    type Make = fn(&Path);
    let cases: [(&str, Make, &str); 3] = [
        (
            "dangling.yaml",
            |p| symlink("gone.yaml", p).unwrap(),
            "cannot read the limits file",
        ),
        (
            "loop.yaml",
            |p| symlink(p, p).unwrap(),
            "cannot read the limits file",
        ),
        (
            "dir.yaml",
            |p| std::fs::create_dir(p).unwrap(),
            "not a file",
        ),
    ];
    for (name, make, reason) in cases {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("good.yaml"), "domain: a\n").unwrap();
        make(&dir.path().join(name));
        let e = Config::load_dir(dir.path()).unwrap_err();
        assert!(e.file.ends_with(name), "{name}: {e}");
        assert!(e.to_string().contains(reason), "{name}: {e}");
    }
}

#[test]
fn load_dir_reports_the_broken_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("good.yaml"), "domain: a\n").unwrap();
    std::fs::write(dir.path().join("bad.yaml"), "domain: b\nextra: 1\n").unwrap();
    let e = Config::load_dir(dir.path()).unwrap_err();
    assert!(e.file.ends_with("bad.yaml"), "{e}");
    assert_eq!(e.line, Some(2));
    assert!(Config::load_dir(&dir.path().join("missing")).is_err());
}

#[test]
fn check_dir_reports_every_broken_file_and_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), "domain: a\nextra: 1\n").unwrap();
    std::fs::write(dir.path().join("b.yaml"), "domain: b\n").unwrap();
    std::fs::write(dir.path().join("c.yaml"), "domain: b\n").unwrap();
    let unit = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n";
    std::fs::write(dir.path().join("d.yaml"), unit).unwrap();
    let errors = Config::check_dir(dir.path()).unwrap_err();
    let found: Vec<(String, Option<usize>)> = errors
        .iter()
        .map(|e| {
            (
                e.file.file_name().unwrap().to_string_lossy().into_owned(),
                e.line,
            )
        })
        .collect();
    // Parse errors in file order, then the duplicate among the files that parsed.
    let expected = [("a.yaml", Some(2)), ("d.yaml", Some(4)), ("c.yaml", None)];
    let expected: Vec<(String, Option<usize>)> =
        expected.iter().map(|(f, l)| (f.to_string(), *l)).collect();
    assert_eq!(found, expected, "{errors:?}");
    assert!(
        errors[2].reason.contains("duplicate domain \"b\""),
        "{errors:?}"
    );
    // The server stops at the first of them.
    assert_eq!(Config::load_dir(dir.path()).unwrap_err(), errors[0]);
}

#[test]
fn algorithms_stacked_limits_and_domain_options_load() {
    let config = load(
        r#"
domain: d
all_or_nothing: false
response_headers: true
descriptors:
  - key: user
    rate_limits:
      - {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 20, name: burst}
      - {unit: day, requests_per_unit: 10000, name: daily}
  - key: ip
    rate_limit: {unit: minute, requests_per_unit: 60, algorithm: sliding_window}
  - key: log
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: sliding_log}
  - key: queue
    rate_limit: {unit: second, requests_per_unit: 2, algorithm: leaky_bucket}
"#,
    )
    .unwrap();
    let domain = config.domain("d").unwrap();
    assert!(!domain.options.all_or_nothing);
    assert_eq!(domain.options.response_headers, Some(true));
    let user = domain.rules.find([("user", "u")].into_iter()).unwrap();
    assert_eq!(user.rates.len(), 2);
    assert_eq!(user.rates[0].algorithm, Algorithm::TokenBucket);
    assert_eq!(
        (user.rates[0].effective_burst(), user.rates[0].capacity()),
        (20, 20)
    );
    assert_eq!(user.rates[1].algorithm, Algorithm::FixedWindow);
    assert_eq!(
        (user.rates[1].effective_burst(), user.rates[1].capacity()),
        (0, 10_000)
    );
    assert!(user.is_named("daily"));
    let queue = domain.rules.find([("queue", "q")].into_iter()).unwrap();
    assert_eq!(
        queue.rates[0].effective_burst(),
        2,
        "burst defaults to the rate"
    );
    // Defaults: all-or-nothing, headers follow the flag.
    let plain = load("domain: d\n").unwrap();
    let options = &plain.domain("d").unwrap().options;
    assert!(options.all_or_nothing);
    assert_eq!(options.response_headers, None);
}

#[test]
fn refuses_bad_algorithms_and_rates() {
    let e = error("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      requests_per_unit: 1\n      algorithm: gcra\n");
    assert!(e.reason.contains("unknown algorithm \"gcra\""), "{e}");
    // The scalar's own line.
    assert_eq!(e.line, Some(7), "{e}");
    let rl =
        |body: &str| format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{{body}}}\n");
    let cases = [
        (rl("unit: second, requests_per_unit: 5, burst: 3"), "burst applies only to token_bucket and leaky_bucket, not fixed_window"),
        (
            rl("unit: second, requests_per_unit: 5, burst: 3, algorithm: sliding_log"),
            "burst applies only to token_bucket and leaky_bucket, not sliding_log",
        ),
        (rl("unit: second, requests_per_unit: 0, algorithm: token_bucket"), "requests_per_unit must be positive for token_bucket"),
        (rl("unit: second, requests_per_unit: 0, algorithm: sliding_window"), "requests_per_unit must be positive"),
        (rl("unit: second, requests_per_unit: 5, algorithm: leaky_bucket, burst: 0"), "burst must be positive"),
        (rl("unit: year, requests_per_unit: 1, algorithm: token_bucket, burst: 4000000000"), "spans more than 2^52"),
        (rl("unit: second, requests_per_unit: -5, algorithm: token_bucket"), "\"-5\" is not a count"),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n    rate_limits: [{unit: day, requests_per_unit: 9}]\n".into(),
            "use rate_limit or rate_limits, not both",
        ),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limits: []\n".into(), "rate_limits: the list must not be empty"),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limits: [{unit: second, requests_per_unit: 1}, {unlimited: true}]\n".into(),
            "rate_limits[1]: an unlimited rate limit cannot be stacked",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limits: [{unit: second, requests_per_unit: 1}, {unit: second, requests_per_unit: 5}]\n".into(),
            "a second fixed_window limit per second",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limits: [{unit: second, requests_per_unit: 1, name: a}, {unit: day, requests_per_unit: 5, replaces: [{name: a}]}]\n".into(),
            "replaces itself",
        ),
    ];
    for (text, reason) in cases {
        assert_refused(&text, reason);
    }
    // The same unit with another algorithm is a valid stack.
    load("domain: d\ndescriptors:\n  - key: k\n    rate_limits: [{unit: second, requests_per_unit: 1}, {unit: second, requests_per_unit: 5, algorithm: sliding_log}]\n").unwrap();
    // A zero fixed window (refuse everything) loads, as in envoyproxy/ratelimit.
    load(&rl("unit: second, requests_per_unit: 0")).unwrap();
}

#[test]
fn concurrency_rules_load_and_match() {
    use std::time::Duration;
    let config = load(
        r#"
domain: d
concurrency:
  - key: user_id
    max_connections: 5
    lease_ttl: 30s
  - key: plan
    value: free
    descriptors:
      - key: user_id
        max_connections: 1
        lease_ttl: 1500ms
        name: free_sessions
"#,
    )
    .unwrap();
    let tree = &config.domain("d").unwrap().concurrency;
    let user = tree.find([("user_id", "u")].into_iter()).unwrap();
    assert_eq!(
        (user.max_connections, user.lease_ttl),
        (5, Duration::from_secs(30))
    );
    let free = tree
        .find([("plan", "free"), ("user_id", "u")].into_iter())
        .unwrap();
    assert_eq!(
        (free.max_connections, free.lease_ttl),
        (1, Duration::from_millis(1500))
    );
    assert_eq!(free.name.as_deref(), Some("free_sessions"));
    assert!(tree.find([("plan", "free")].into_iter()).is_none());
    // Rate limits and concurrency limits are separate trees.
    assert!(config
        .domain("d")
        .unwrap()
        .rules
        .find([("user_id", "u")].into_iter())
        .is_none());
}

#[test]
fn refuses_bad_concurrency_rules() {
    let c = |body: &str| format!("domain: d\nconcurrency:\n  - key: k\n{body}");
    let cases = [
        (c("    max_connections: 0\n"), "max_connections must be positive"),
        (c("    max_connections: 2\n    lease_ttl: 10x\n"), "bad duration \"10x\""),
        (c("    max_connections: 2\n    lease_ttl: 100ms\n"), "lease_ttl must be between"),
        (c("    max_connections: 2\n    lease_ttl: 2h\n"), "lease_ttl must be between"),
        (c("    lease_ttl: 30s\n"), "lease_ttl and name need max_connections"),
        (c("    max_connections: 2\n    rate_limit: {unit: second, requests_per_unit: 1}\n"), "unknown field `rate_limit`"),
        ("domain: d\nconcurrency:\n  - max_connections: 2\n".into(), "concurrency[0]: the descriptor key must not be empty"),
        ("domain: d\nconcurrency:\n  - {key: k, max_connections: 1}\n  - {key: k, max_connections: 2}\n".into(), "duplicate descriptor"),
    ];
    for (text, reason) in cases {
        assert_refused(&text, reason);
    }
}

#[test]
fn compile_errors_carry_the_line_of_the_node() {
    let cases = [
        ("domain: d\ndescriptors:\n  - key: k\n  - key: k\n", 4, "descriptors[1]: duplicate descriptor"),
        (
            "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        rate_limit:\n          requests_per_unit: 5\n",
            7,
            "descriptors[0].descriptors[0].rate_limit: the unit is missing",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, unit: second}\n",
            4,
            "descriptors[0].rate_limit: an unlimited rate limit must not have a unit",
        ),
        ("domain: d\nconcurrency:\n  - key: k\n  - key: j\n    max_connections: 0\n", 4, "concurrency[1]: max_connections must be positive"),
    ];
    for (text, line, reason) in cases {
        let e = error(text);
        assert_eq!(e.line, Some(line), "{e}");
        assert!(e.reason.starts_with(reason), "{e}");
        assert!(
            e.to_string()
                .starts_with(&format!("limits/test.yaml:{line}: {reason}")),
            "{e}"
        );
    }
}

/// What envoyproxy/ratelimit's loader takes (Envoy Gateway writes all of
/// it): a top-level `name`, `null` blocks, `value: ""` as the value-less
/// node, empty `replaces` and `name`, their options set to false.
#[test]
fn loads_what_envoy_ratelimit_accepts() {
    let config = load(
        r#"
name: d
domain: d
descriptors:
  - key: route
    value: r
    rate_limit: null
    descriptors:
      - key: user
        value: ""
        rate_limit:
          requests_per_unit: 5
          unit: SECOND
          unlimited: false
          name: ""
          replaces: []
        descriptors: []
        shadow_mode: false
        quota_mode: false
        detailed_metric: false
        value_to_metric: false
        share_threshold: false
        metadata: {}
  - key: empty
    descriptors: null
    rate_limit: {unit: minute, requests_per_unit: 1, replaces: null}
"#,
    )
    .unwrap();
    let rules = &config.domain("d").unwrap().rules;
    let user = rules
        .find([("route", "r"), ("user", "alice")].into_iter())
        .unwrap();
    assert_eq!(
        user.path, "route_r.user",
        "value \"\" is the value-less node"
    );
    assert_eq!(user.rates[0].requests_per_unit, 5);
    assert_eq!(user.rates[0].name, None, "name \"\" is no name");
    assert!(user.replaces.is_empty());
    assert!(
        rules.find([("route", "r")].into_iter()).is_none(),
        "rate_limit: null is no limit"
    );
    assert!(rules.find([("empty", "x")].into_iter()).is_some());
}

#[test]
fn a_file_holds_one_domain_per_document() {
    let config = load("domain: a\n---\ndomain: b\ndescriptors:\n  - key: k\n").unwrap();
    assert_eq!(config.domain_names(), vec!["a", "b"]);
    // Lines count from the start of the file, whichever document.
    let e = error("domain: a\n---\ndomain: b\ndescriptors:\n  - key: k\n  - key: k\n");
    assert_eq!(e.line, Some(6), "{e}");
    let e = error("domain: a\n---\ndomain: b\nbad: 1\n");
    assert_eq!(e.line, Some(4), "{e}");
    let e = error("domain: a\n---\ndomain: a\n");
    assert!(e.reason.contains("duplicate domain \"a\""), "{e}");
    // Empty documents (a leading or trailing `---`) are no domains.
    let config = load("---\ndomain: a\n---\n").unwrap();
    assert_eq!(config.domain_names(), vec!["a"]);
    let e = error("# only a comment\n---\n");
    assert!(e.reason.contains("domain must not be empty"), "{e}");
}

#[test]
fn an_empty_domain_and_a_rule_replacing_itself_name_their_line() {
    let e = error("descriptors: []\ndomain: ''\n");
    assert_eq!(e.line, Some(2), "{e}");
    assert!(e.reason.starts_with("domain: "), "{e}");
    let e = error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: second\n      \
         requests_per_unit: 1\n      name: a\n      replaces: [{name: a}]\n",
    );
    assert_eq!(e.line, Some(8), "{e}");
    assert!(
        e.reason
            .starts_with("descriptors[0].rate_limit.replaces: rule \"k\" (\"a\") replaces itself"),
        "{e}"
    );
}

#[test]
fn descriptors_nested_past_the_yaml_readers_limit_are_refused_saying_so() {
    let mut text = String::from("domain: d\ndescriptors:\n");
    let mut indent = String::new();
    for level in 0..100 {
        text += &format!("{indent}  - key: k{level}\n{indent}    descriptors:\n");
        indent += "    ";
    }
    text += &format!(
        "{indent}  - key: last\n{indent}    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("deep.yaml"), text).unwrap();
    let e = Config::load_dir(dir.path()).unwrap_err();
    assert!(e.reason.contains("nested too deeply"), "{e}");
    assert!(e.line.is_some(), "{e}");
}

/// A node of the wrong shape is named in the file's words, not the
/// reader's (their `non_map_list.yaml`, a scalar where a mapping goes).
#[test]
fn a_node_of_the_wrong_shape_is_named_in_the_files_words() {
    for (text, expected) in [
        ("domain: d\ndescriptors:\n  - a\n", "expected a descriptor: a mapping with key"),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: ''\n",
            "expected a rate limit: a mapping with unit and requests_per_unit",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [m]}\n",
            "expected a replaces entry: a mapping with name",
        ),
        ("- domain: d\n", "expected a limits file: a mapping with domain"),
    ] {
        let e = error(text);
        assert!(e.reason.contains(expected), "{text}: {e}");
        assert!(!e.reason.contains("Raw"), "{text}: {e}");
    }
}
