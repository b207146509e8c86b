//! envoyproxy/ratelimit's own config fixtures (`tests/fixtures/envoy-ratelimit/`):
//! the files their loader takes load here, the files it refuses are refused,
//! and their basic config matches the same rules. The exceptions are the
//! descriptor options ratekeeper does not act on yet, refused by name.

use std::path::Path;

use ratekeeper::config::{Config, LoadOptions};
use ratekeeper::limiter::Unit;

const FIXTURES: &str = "tests/fixtures/envoy-ratelimit";

fn load(names: &[&str]) -> Result<Config, ratekeeper::ConfigError> {
    let files: Vec<(std::path::PathBuf, String)> = names
        .iter()
        .map(|name| {
            let path = Path::new(FIXTURES).join(name);
            let text = std::fs::read_to_string(&path).expect("fixture");
            (path, text)
        })
        .collect();
    Config::from_files(files.iter().map(|(p, t)| (p.as_path(), t.as_str())))
}

#[test]
fn the_files_their_loader_takes_load_and_the_ones_it_refuses_are_refused() {
    for loads in [
        &["basic_config.yaml"][..],
        &["shadowmode_config.yaml"],
        &["wildcard.yaml"],
        &["metadata.yaml"],
        &["share_threshold.yaml"],
    ] {
        if let Err(e) = load(loads) {
            panic!("{loads:?} should load: {e}");
        }
    }
    // Their test name, the files, what our reason says.
    let refused: &[(&[&str], &str)] = &[
        (&["empty_domain.yaml"], "the domain must not be empty"),
        (
            &["basic_config.yaml", "duplicate_domain.yaml"],
            "duplicate domain \"test-domain\"",
        ),
        // MERGE_DOMAIN_CONFIG is off by default there too.
        (
            &["merge_domain_key1.yaml", "merge_domain_key2.yaml"],
            "duplicate domain",
        ),
        (&["empty_key.yaml"], "the descriptor key must not be empty"),
        (
            &["duplicate_key.yaml"],
            "duplicate descriptor \"key1_value1\"",
        ),
        (&["bad_limit_unit.yaml"], "unknown unit \"foo\""),
        (&["replaces_self.yaml"], "replaces itself"),
        (&["replaces_empty.yaml"], "every entry needs a name"),
        (&["bad_yaml.yaml"], ""),
        (&["misspelled_key.yaml"], "unknown field `ratelimit`"),
        (&["misspelled_key2.yaml"], "unknown field `requestsperunit`"),
        (&["non_string_key.yaml"], "0.25"),
        (&["non_map_list.yaml"], "expected a descriptor: a mapping"),
        (
            &["unlimited_with_unit.yaml"],
            "an unlimited rate limit must not have a unit",
        ),
    ];
    for (files, reason) in refused {
        match load(files) {
            Ok(_) => panic!("{files:?} should be refused"),
            Err(e) => assert!(e.reason.contains(reason), "{files:?}: {e}"),
        }
    }
}

/// The lookups of their `TestBasicConfig`.
#[test]
fn their_basic_config_matches_the_same_rules() {
    let config = load(&["basic_config.yaml"]).unwrap();
    let domain = config.domain("test-domain").unwrap();
    let limit = |entries: &[(&str, &str)]| {
        domain
            .rules
            .find(entries.iter().copied())
            .map(|r| (r.rates[0].requests_per_unit, r.rates[0].unit))
    };
    assert_eq!(limit(&[("key1", "something")]), None);
    assert_eq!(limit(&[("key1", "value1")]), None);
    assert_eq!(limit(&[("key2", "value2"), ("subkey", "subvalue")]), None);
    assert_eq!(limit(&[("key5", "value5"), ("subkey5", "subvalue")]), None);
    assert_eq!(
        limit(&[("key1", "value1"), ("subkey1", "something")]),
        Some((5, Unit::Second))
    );
    assert_eq!(
        limit(&[("key1", "value1"), ("subkey1", "subvalue1")]),
        Some((10, Unit::Second))
    );
    assert_eq!(limit(&[("key2", "something")]), Some((20, Unit::Minute)));
    assert_eq!(limit(&[("key2", "value2")]), Some((30, Unit::Minute)));
    assert_eq!(limit(&[("key3", "foo")]), Some((1, Unit::Hour)));
    assert_eq!(limit(&[("key4", "foo")]), Some((1, Unit::Day)));
    assert_eq!(
        limit(&[("key5", "value5"), ("subkey5", "subvalue5")]),
        Some((25, Unit::Day))
    );
    // `key2: value3` has no limit: the value is let through.
    assert!(domain
        .rules
        .find([("key2", "value3")].into_iter())
        .is_none());
}

/// Their `TestMergeDomainConfig` and its duplicate case: with
/// MERGE_DOMAIN_CONFIG the two files of `test-domain` make one domain; a
/// key/value defined by both is refused, with both files named.
#[test]
fn merge_domain_config_merges_the_files_of_a_domain() {
    let merging = LoadOptions {
        merge_domains: true,
    };
    let read = |name: &str| {
        let path = Path::new(FIXTURES).join(name);
        let text = std::fs::read_to_string(&path).expect("fixture");
        (path, text)
    };
    let (one, two) = (
        read("merge_domain_key1.yaml"),
        read("merge_domain_key2.yaml"),
    );
    let files = [
        (one.0.as_path(), one.1.as_str()),
        (two.0.as_path(), two.1.as_str()),
    ];
    let config = Config::from_files_with(files, merging).expect("merged");
    let domain = config.domain("test-domain").expect("domain");
    let limit = |entries: &[(&str, &str)]| {
        domain
            .rules
            .find(entries.iter().copied())
            .map(|r| r.rates[0].requests_per_unit)
    };
    assert_eq!(limit(&[("key1", "value1")]), Some(10));
    assert_eq!(limit(&[("key2", "value2")]), Some(20));

    let copy = Path::new("limits/copy.yaml");
    let twice = [(one.0.as_path(), one.1.as_str()), (copy, one.1.as_str())];
    let e = Config::from_files_with(twice, merging).expect_err("duplicate");
    let text = e.to_string();
    assert!(text.contains("limits/copy.yaml"), "{text}");
    assert!(text.contains("merge_domain_key1.yaml"), "{text}");
    assert!(
        text.contains("duplicate descriptor \"key1_value1\""),
        "{text}"
    );
}
