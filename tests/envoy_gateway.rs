//! Envoy Gateway's translator outputs (`tests/fixtures/envoy-gateway/`, the
//! `RateLimitConfig`s it sends over xDS, rendered as YAML) load as limits
//! files and as xDS snapshots, to the same rules, and answer the descriptors
//! their routes make Envoy send.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{descriptor, request, Backend, TestServer};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use ratekeeper::clock::ManualClock;
use ratekeeper::config::{xds, Config};
use ratekeeper::pb::rls_conf::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitReplace, RateLimitUnit,
};
use ratekeeper::rules::{Level, Node, Rule};
use serde::Deserialize;
use serde_yaml::Value;

const FIXTURES: &str = "tests/fixtures/envoy-gateway";

fn fixture(name: &str) -> (PathBuf, String) {
    let path = Path::new(FIXTURES).join(name);
    let text = std::fs::read_to_string(&path).expect("fixture");
    (path, text)
}

fn load(name: &str) -> Config {
    let (path, text) = fixture(name);
    Config::from_files([(path.as_path(), text.as_str())])
        .unwrap_or_else(|e| panic!("{name} should load: {e}"))
}

fn fixture_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(FIXTURES)
        .expect("fixtures")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    names.sort();
    names
}

#[test]
fn every_translator_output_loads() {
    let names = fixture_names();
    assert_eq!(names.len(), 25, "{names:?}");
    let mut domains = 0;
    for name in &names {
        domains += load(name).domain_names().len();
    }
    // Six files hold two or three snapshots' configs (YAML documents).
    assert_eq!(domains, 32);
    let multi = load("multiple-domains.yaml");
    assert_eq!(
        multi.domain_names(),
        vec!["first-listener", "test-namespace/test-policy-1"]
    );
}

/// Sends `entries` in `domain` `times` times; the codes answered.
async fn codes(
    server: &TestServer,
    domain: &str,
    entries: &[(&str, &str)],
    times: usize,
) -> Vec<Code> {
    let mut client = server.client().await;
    let mut codes = Vec::new();
    for _ in 0..times {
        let answer = client
            .should_rate_limit(request(domain, vec![descriptor(entries)]))
            .await
            .expect("answer")
            .into_inner();
        codes.push(answer.overall_code());
    }
    codes
}

async fn serve(name: &str) -> TestServer {
    let store = Backend::Memory.store(Arc::new(ManualClock::new(1_700_000_000_000)));
    TestServer::start_with(load(name), None, store).await
}

#[tokio::test]
async fn translator_outputs_answer_as_on_envoy_ratelimit() {
    use Code::{Ok, OverLimit};
    let five_then_over = [vec![Ok; 5], vec![OverLimit]].concat();

    // A distinct match on a header: `value: ""` is the per-user node.
    let server = serve("distinct-match.yaml").await;
    let alice = [("first-route", "first-route"), ("rule-0-match-0", "alice")];
    assert_eq!(
        codes(&server, "first-listener", &alice, 6).await,
        five_then_over
    );
    let bob = [("first-route", "first-route"), ("rule-0-match-0", "bob")];
    assert_eq!(codes(&server, "first-listener", &bob, 1).await, vec![Ok]);
    // The route node has `rate_limit: null`: no limit of its own.
    let route = [("first-route", "first-route")];
    assert_eq!(
        codes(&server, "first-listener", &route, 7).await,
        vec![Ok; 7]
    );
    server.stop().await;

    // An inverted CIDR match, its value as Envoy sends it.
    let server = serve("ratelimit-sourceip-invert.yaml").await;
    let outside = [
        ("first-route", "first-route"),
        ("masked_remote_address", "invert:192.168.0.0/24"),
    ];
    assert_eq!(
        codes(&server, "first-listener", &outside, 6).await,
        five_then_over
    );
    server.stop().await;

    // Shadow mode answers OK past the limit.
    let server = serve("global-shadow-mode.yaml").await;
    let shadowed = [
        ("first-route", "first-route"),
        ("rule-0-match-0", "rule-0-match-0"),
        ("rule-0-match-1", "rule-0-match-1"),
        ("rule-0-match-2", "rule-0-match-2"),
        ("masked_remote_address", "0.0.0.0/0"),
    ];
    assert_eq!(
        codes(&server, "first-listener", &shadowed, 7).await,
        vec![Ok; 7]
    );
    server.stop().await;

    // A shared policy's domain holds a `/`; the file's second document.
    let server = serve("multiple-domains.yaml").await;
    let shared = [
        (
            "test-namespace/test-policy-1/rule/0",
            "test-namespace/test-policy-1/rule/0",
        ),
        ("rule-0-match-0", "rule-0-match-0"),
    ];
    assert_eq!(
        codes(&server, "test-namespace/test-policy-1", &shared, 6).await,
        five_then_over
    );
    server.stop().await;
}

/// Each output, sent as the protobuf messages it renders, compiles to the
/// same rules as the file.
#[test]
fn every_translator_output_compiles_the_same_as_an_xds_snapshot() {
    for name in fixture_names() {
        let (_, text) = fixture(&name);
        let snapshot: Vec<RateLimitConfig> = serde_yaml::Deserializer::from_str(&text)
            .map(|doc| config_message(&Value::deserialize(doc).expect("yaml")))
            .collect();
        let from_xds = xds::load(&snapshot).unwrap_or_else(|e| panic!("{name}: {e}"));
        let from_file = load(&name);
        assert_eq!(from_xds.domain_names(), from_file.domain_names(), "{name}");
        for domain in from_file.domain_names() {
            let (a, b) = (
                from_file.domain(domain).unwrap(),
                from_xds.domain(domain).unwrap(),
            );
            same_level(
                &a.rules.root,
                &a.rules.rules,
                &b.rules.root,
                &b.rules.rules,
                &name,
            );
        }
    }
}

fn text(v: &Value, field: &str) -> String {
    v.get(field)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

fn flag(v: &Value, field: &str) -> bool {
    v.get(field).and_then(Value::as_bool).unwrap_or(false)
}

fn list<T>(v: &Value, field: &str, item: fn(&Value) -> T) -> Vec<T> {
    v.get(field)
        .and_then(Value::as_sequence)
        .map(|items| items.iter().map(item).collect())
        .unwrap_or_default()
}

fn config_message(doc: &Value) -> RateLimitConfig {
    RateLimitConfig {
        name: text(doc, "name"),
        domain: text(doc, "domain"),
        descriptors: list(doc, "descriptors", descriptor_message),
    }
}

fn descriptor_message(v: &Value) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: text(v, "key"),
        value: text(v, "value"),
        rate_limit: v
            .get("rate_limit")
            .filter(|p| !p.is_null())
            .map(|p| RateLimitPolicy {
                unit: RateLimitUnit::from_str_name(&text(p, "unit"))
                    .unwrap_or(RateLimitUnit::Unknown) as i32,
                requests_per_unit: p
                    .get("requests_per_unit")
                    .and_then(Value::as_u64)
                    .and_then(|n| u32::try_from(n).ok())
                    .unwrap_or(0),
                unlimited: flag(p, "unlimited"),
                name: text(p, "name"),
                replaces: list(p, "replaces", |r| RateLimitReplace {
                    name: text(r, "name"),
                }),
            }),
        descriptors: list(v, "descriptors", descriptor_message),
        shadow_mode: flag(v, "shadow_mode"),
        detailed_metric: flag(v, "detailed_metric"),
        quota_mode: flag(v, "quota_mode"),
        metadata: None,
    }
}

/// Asserts two compiled levels hold the same nodes and rules.
fn same_level(a: &Level, ar: &[Rule], b: &Level, br: &[Rule], name: &str) {
    let mut keys: Vec<&String> = a.keys.keys().collect();
    keys.sort();
    let mut other: Vec<&String> = b.keys.keys().collect();
    other.sort();
    assert_eq!(keys, other, "{name}");
    for key in keys {
        let (x, y) = (&a.keys[key], &b.keys[key]);
        let mut values: Vec<&String> = x.exact.keys().collect();
        values.sort();
        let mut other: Vec<&String> = y.exact.keys().collect();
        other.sort();
        assert_eq!(values, other, "{name}: {key}");
        for value in values {
            same_node(&x.exact[value], ar, &y.exact[value], br, name);
        }
        assert_eq!(x.wildcards.len(), y.wildcards.len(), "{name}: {key}");
        for ((p, m), (q, n)) in x.wildcards.iter().zip(&y.wildcards) {
            assert_eq!(p, q, "{name}: {key}");
            same_node(m, ar, n, br, name);
        }
        match (&x.default, &y.default) {
            (Some(m), Some(n)) => same_node(m, ar, n, br, name),
            (None, None) => {}
            _ => panic!("{name}: {key}: a default node on one side only"),
        }
    }
}

fn same_node(a: &Node, ar: &[Rule], b: &Node, br: &[Rule], name: &str) {
    let rule = |r: Option<usize>, rules: &[Rule]| {
        r.map(|i| {
            let r = &rules[i];
            (
                r.rates.clone(),
                r.path.clone(),
                r.shadow_mode,
                r.detailed_metric,
                r.replaces.clone(),
            )
        })
    };
    assert_eq!(rule(a.rule, ar), rule(b.rule, br), "{name}");
    same_level(&a.children, ar, &b.children, br, name);
}
