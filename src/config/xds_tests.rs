//! The xDS source against the file source: one compiler, same answers.

use std::path::Path;

use super::{xds, Config};
use crate::limiter::Unit;
use crate::pb::rls_conf::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitReplace, RateLimitUnit,
};

fn yaml(text: &str) -> Result<Config, crate::ConfigError> {
    Config::from_files([(Path::new("limits/test.yaml"), text)])
}

fn node(key: &str, value: &str) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: key.into(),
        value: value.into(),
        ..RateLimitDescriptor::default()
    }
}

fn policy(unit: RateLimitUnit, requests_per_unit: u32) -> RateLimitPolicy {
    RateLimitPolicy {
        unit: unit as i32,
        requests_per_unit,
        ..RateLimitPolicy::default()
    }
}

fn domain(descriptors: Vec<RateLimitDescriptor>) -> RateLimitConfig {
    RateLimitConfig {
        name: "d".into(),
        domain: "d".into(),
        descriptors,
    }
}

/// Each bad limit, written both ways, is refused for the same reason at the
/// same path; xDS names the domain where a file names the file and line.
#[test]
fn a_bad_limit_is_refused_for_the_same_reason_from_yaml_and_protobuf() {
    let with_limit = |p: RateLimitPolicy| {
        domain(vec![RateLimitDescriptor {
            rate_limit: Some(p),
            ..node("k", "")
        }])
    };
    let unlimited_with_unit = RateLimitPolicy {
        unlimited: true,
        ..policy(RateLimitUnit::Second, 0)
    };
    let replaces_itself = RateLimitPolicy {
        name: "a".into(),
        replaces: vec![RateLimitReplace { name: "a".into() }],
        ..policy(RateLimitUnit::Second, 1)
    };
    let empty_replace = RateLimitPolicy {
        replaces: vec![RateLimitReplace::default()],
        ..policy(RateLimitUnit::Second, 1)
    };
    let nested_empty_key = RateLimitDescriptor {
        descriptors: vec![node("", "x")],
        ..node("k", "v")
    };
    let rl =
        |body: &str| format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{{body}}}\n");
    let cases = [
        (rl("unlimited: true, unit: second"), with_limit(unlimited_with_unit)),
        (rl("requests_per_unit: 5"), with_limit(policy(RateLimitUnit::Unknown, 5))),
        (rl("unit: second, requests_per_unit: 1, name: a, replaces: [{name: a}]"), with_limit(replaces_itself)),
        (rl("unit: second, requests_per_unit: 1, replaces: [{name: ''}]"), with_limit(empty_replace)),
        (
            "domain: d\ndescriptors:\n  - key: k\n    value: v\n    descriptors: [{key: '', value: x}]\n".into(),
            domain(vec![nested_empty_key]),
        ),
        (
            "domain: d\ndescriptors:\n  - {key: k, value: v}\n  - {key: k, value: v}\n".into(),
            domain(vec![node("k", "v"), node("k", "v")]),
        ),
        ("domain: ''\n".into(), RateLimitConfig::default()),
    ];
    for (text, message) in cases {
        let from_yaml = yaml(&text).expect_err(&text);
        let domain = format!("domain {:?}", message.domain);
        let from_xds = xds::load(&[message]).expect_err(&text);
        // Named after its domain, but for the domain itself.
        let after_domain = match from_xds.reason.strip_prefix(&domain) {
            Some(rest) => rest.trim_start_matches([':', ' ']),
            None => &from_xds.reason,
        };
        assert_eq!(after_domain, from_yaml.reason, "{text}");
    }
}

/// The same limits written both ways compile to the same rules.
#[test]
fn a_good_limit_gives_the_same_rules_from_yaml_and_protobuf() {
    let text = r#"
domain: d
descriptors:
  - key: plan
    value: free
    descriptors:
      - key: user
        rate_limit: {unit: minute, requests_per_unit: 100, name: free_user}
        shadow_mode: true
      - key: user
        value: vip
        rate_limit: {unit: week, requests_per_unit: 7, replaces: [{name: free_user}]}
        detailed_metric: true
  - key: path
    value: "/api/*"
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: open
    rate_limit: {unlimited: true}
"#;
    let message = domain(vec![
        RateLimitDescriptor {
            descriptors: vec![
                RateLimitDescriptor {
                    rate_limit: Some(RateLimitPolicy {
                        name: "free_user".into(),
                        ..policy(RateLimitUnit::Minute, 100)
                    }),
                    shadow_mode: true,
                    ..node("user", "")
                },
                RateLimitDescriptor {
                    rate_limit: Some(RateLimitPolicy {
                        replaces: vec![RateLimitReplace {
                            name: "free_user".into(),
                        }],
                        ..policy(RateLimitUnit::Week, 7)
                    }),
                    detailed_metric: true,
                    ..node("user", "vip")
                },
            ],
            ..node("plan", "free")
        },
        RateLimitDescriptor {
            rate_limit: Some(policy(RateLimitUnit::Second, 0)),
            ..node("path", "/api/*")
        },
        RateLimitDescriptor {
            rate_limit: Some(RateLimitPolicy {
                unlimited: true,
                ..RateLimitPolicy::default()
            }),
            ..node("open", "")
        },
    ]);
    let from_yaml = yaml(text).unwrap();
    let from_xds = xds::load(&[message]).unwrap();
    let probes: &[&[(&str, &str)]] = &[
        &[("plan", "free"), ("user", "alice")],
        &[("plan", "free"), ("user", "vip")],
        &[("plan", "free")],
        &[("plan", "gold"), ("user", "alice")],
        &[("path", "/api/v1")],
        &[("path", "/other")],
        &[("open", "x")],
    ];
    let mut matched = 0;
    for entries in probes {
        let rule = |c: &Config| {
            c.domain("d")
                .and_then(|d| d.rules.find(entries.iter().copied()))
                .map(|r| {
                    (
                        r.rates.clone(),
                        r.path.clone(),
                        r.shadow_mode,
                        r.detailed_metric,
                        r.replaces.clone(),
                    )
                })
        };
        assert_eq!(rule(&from_yaml), rule(&from_xds), "{entries:?}");
        matched += usize::from(rule(&from_xds).is_some());
    }
    assert_eq!(matched, 4, "the probes reach the rules");
    let vip = from_xds
        .domain("d")
        .unwrap()
        .rules
        .find([("plan", "free"), ("user", "vip")].into_iter())
        .unwrap();
    assert_eq!(vip.rates[0].unit, Unit::Week, "WEEK is 7 on the wire");
}

#[test]
fn a_snapshot_is_refused_whole() {
    let good = domain(vec![node("k", "")]);
    let e = xds::load(&[good.clone(), good.clone()]).unwrap_err();
    assert!(e.reason.contains("duplicate domain \"d\""), "{e}");
    let bad_unit = domain(vec![RateLimitDescriptor {
        rate_limit: Some(RateLimitPolicy {
            unit: 42,
            ..RateLimitPolicy::default()
        }),
        ..node("k", "")
    }]);
    let e = xds::load(&[good, bad_unit]).unwrap_err();
    assert_eq!(e.file, Path::new("xDS RateLimitConfig \"d\""));
    assert!(
        e.reason
            .starts_with("domain \"d\" descriptors[0].rate_limit.unit: unknown unit 42"),
        "{e}"
    );
    assert!(xds::load(&[]).unwrap().domain_names().is_empty());
}

/// MERGE_DOMAIN_CONFIG applies to a snapshot's messages as to files (their
/// xDS provider merges too); off, a second message of a domain is refused.
#[test]
fn messages_of_one_domain_merge_when_asked() {
    let limited = |key: &str, n| RateLimitDescriptor {
        rate_limit: Some(policy(RateLimitUnit::Minute, n)),
        ..node(key, "")
    };
    let two = [domain(vec![limited("a", 1)]), domain(vec![limited("b", 2)])];
    let merging = super::LoadOptions {
        merge_domains: true,
    };
    let config = xds::load_with(&two, merging).expect("merged");
    let rules = &config.domain("d").expect("domain").rules;
    let limit = |key| {
        rules
            .find([(key, "x")].into_iter())
            .map(|r| r.rates[0].requests_per_unit)
    };
    assert_eq!((limit("a"), limit("b")), (Some(1), Some(2)));
    let e = xds::load(&two).expect_err("a second message of d");
    assert!(e.reason.contains("duplicate domain"), "{e}");
    let clash = [domain(vec![limited("a", 1)]), domain(vec![limited("a", 2)])];
    let e = xds::load_with(&clash, merging).expect_err("a twice");
    assert!(e.reason.contains("duplicate descriptor \"a\""), "{e}");
}
