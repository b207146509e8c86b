//! Envoy Gateway's translator outputs (`tests/fixtures/envoy-gateway/`, the
//! `RateLimitConfig`s it sends over xDS, rendered as YAML) load as limits
//! files, and answer the descriptors their routes make Envoy send.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{descriptor, request, Backend, TestServer};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use ratekeeper::clock::ManualClock;
use ratekeeper::config::Config;

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

#[test]
fn every_translator_output_loads() {
    let mut names: Vec<String> = std::fs::read_dir(FIXTURES)
        .expect("fixtures")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".yaml"))
        .collect();
    names.sort();
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
