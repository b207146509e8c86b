//! Answers that must be envoyproxy/ratelimit's, read against its source
//! (`src/config/config_impl.go`, `src/limiter/cache_key.go`,
//! `src/service/ratelimit.go`): the same file gives the same answers, on
//! the memory store and a real Redis.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{descriptor, request, Backend, TestServer};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use ratekeeper::clock::ManualClock;
use ratekeeper::config::Config;
use ratekeeper::service::rls::{GlobalModes, LimiterSettings};

const START_MS: u64 = 1_700_000_040_000;

async fn ask(server: &TestServer, descriptors: Vec<RateLimitDescriptor>) -> RateLimitResponse {
    let mut client = server.client().await;
    client
        .should_rate_limit(request("d", descriptors))
        .await
        .expect("answer")
        .into_inner()
}

fn overall(r: &RateLimitResponse) -> Code {
    Code::try_from(r.overall_code).expect("code")
}

async fn on_every_store<F, Fut>(limits: &str, body: F)
where
    F: Fn(TestServer, Arc<ManualClock>, &'static str) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    common::on_every_store(&[limits], START_MS, body).await;
}

fn codes(r: &RateLimitResponse) -> Vec<Code> {
    r.statuses
        .iter()
        .map(|s| Code::try_from(s.code).expect("code"))
        .collect()
}

/// As [`on_every_store`], with envoyproxy/ratelimit's global switches.
async fn on_every_store_with<F, Fut>(limits: &str, modes: GlobalModes, body: F)
where
    F: Fn(TestServer, &'static str) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for backend in Backend::all() {
        let clock = Arc::new(ManualClock::new(START_MS));
        let config = Config::from_files([(Path::new("d.yaml"), limits)]).expect("limits");
        let limiter = LimiterSettings {
            modes,
            ..TestServer::limiter_settings()
        };
        let store = backend.store(clock);
        let server = TestServer::start_with_limiter(config, None, store, limiter).await;
        body(server, backend.name()).await;
    }
}

/// Their cache key is prefix, domain, entries and window: no
/// `requests_per_unit`. So Envoy's `limit` override and the file's rule of
/// the same unit count on one counter.
#[tokio::test]
async fn a_limit_override_shares_the_configured_rules_counter() {
    let limits = "
domain: d
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
";
    on_every_store(limits, |server, _clock, store| async move {
        for _ in 0..3 {
            let r = ask(&server, vec![descriptor(&[("user", "a")])]).await;
            assert_eq!(overall(&r), Code::Ok, "{store}");
        }
        let mut overridden = descriptor(&[("user", "a")]);
        overridden.limit = Some(RateLimitOverride {
            requests_per_unit: 5,
            unit: 2, // MINUTE
        });
        let r = ask(&server, vec![overridden.clone()]).await;
        assert_eq!(overall(&r), Code::Ok, "{store}");
        assert_eq!(r.statuses[0].limit_remaining, 1, "{store}: 4 of 5 used");
        let r = ask(&server, vec![overridden.clone()]).await;
        assert_eq!(r.statuses[0].limit_remaining, 0, "{store}");
        let r = ask(&server, vec![overridden]).await;
        assert_eq!(overall(&r), Code::OverLimit, "{store}");
        let r = ask(&server, vec![descriptor(&[("user", "a")])]).await;
        assert_eq!(overall(&r), Code::OverLimit, "{store}: the rule sees 5 too");
    })
    .await;
}

/// One counter twice in a request (the same descriptor from two actions,
/// or a rule and an override of it): theirs reports each descriptor from
/// its own INCRBY, and so does ours, also when the request is refused (the
/// first status is what the first left, not what the whole request left).
#[tokio::test]
async fn a_counter_twice_in_a_request_reports_each_status_as_of_its_own_hits() {
    use envoy_types::pb::google::protobuf::UInt64Value;
    let limits = "
domain: d
descriptors:
  - key: b
    rate_limit: {unit: minute, requests_per_unit: 5}
";
    on_every_store(limits, |server, _clock, store| async move {
        let mut three = descriptor(&[("b", "t")]);
        three.hits_addend = Some(UInt64Value { value: 3 });
        let r = ask(&server, vec![three.clone(), three]).await;
        assert_eq!(codes(&r), [Code::Ok, Code::OverLimit], "{store}");
        let remaining: Vec<u32> = r.statuses.iter().map(|s| s.limit_remaining).collect();
        assert_eq!(remaining, [2, 0], "{store}");
        // Both counted (a fixed window of theirs counts past its limit).
        let r = ask(&server, vec![descriptor(&[("b", "t")])]).await;
        assert_eq!(overall(&r), Code::OverLimit, "{store}");
    })
    .await;
}

/// Their `requests_per_unit` is a `uint32` YAML field: missing reads as 0,
/// which refuses every request.
#[tokio::test]
async fn a_missing_requests_per_unit_refuses_everything() {
    let limits = "
domain: d
descriptors:
  - key: user
    rate_limit: {unit: minute}
";
    on_every_store(limits, |server, _clock, store| async move {
        let r = ask(&server, vec![descriptor(&[("user", "a")])]).await;
        assert_eq!(overall(&r), Code::OverLimit, "{store}");
        let limit = r.statuses[0].current_limit.as_ref().expect("limit");
        assert_eq!(limit.requests_per_unit, 0);
    })
    .await;
}

/// `value: ""` is the value-less node (their map key is then the key alone):
/// it matches any value, including an empty one.
#[tokio::test]
async fn an_empty_value_is_the_value_less_node() {
    let limits = r#"
domain: d
descriptors:
  - key: user
    value: ""
    rate_limit: {unit: minute, requests_per_unit: 1}
"#;
    on_every_store(limits, |server, _clock, store| async move {
        let r = ask(&server, vec![descriptor(&[("user", "a")])]).await;
        assert!(r.statuses[0].current_limit.is_some(), "{store}");
        let r = ask(&server, vec![descriptor(&[("user", "")])]).await;
        assert!(r.statuses[0].current_limit.is_some(), "{store}");
        let r = ask(&server, vec![descriptor(&[("user", "a")])]).await;
        assert_eq!(
            overall(&r),
            Code::OverLimit,
            "{store}: one counter per value"
        );
        let r = ask(&server, vec![descriptor(&[("user", "b")])]).await;
        assert_eq!(overall(&r), Code::Ok, "{store}");
    })
    .await;
}

/// Their matcher: the exact `key_value` first, then the wildcards of the
/// level in file order (each `*` zero or more characters, anywhere, several
/// allowed), then the value-less node. A pattern sent literally is an exact
/// value (theirs keeps patterns in its map of values): `/api/v*` is its own
/// node, though `/api/*` comes first and matches it.
#[tokio::test]
async fn wildcards_match_as_theirs_do() {
    let limits = r#"
domain: d
descriptors:
  - key: path
    value: "/api/*/users/*"
    rate_limit: {unit: minute, requests_per_unit: 1, name: two_stars}
  - key: path
    value: "/api/*"
    rate_limit: {unit: minute, requests_per_unit: 2, name: prefix}
  - key: path
    value: "/api/v*"
    rate_limit: {unit: minute, requests_per_unit: 7, name: versioned}
  - key: path
    value: "/api/v1/users/me"
    rate_limit: {unit: minute, requests_per_unit: 3, name: exact}
  - key: path
    rate_limit: {unit: minute, requests_per_unit: 4, name: any}
  - key: any
    value: "*"
    rate_limit: {unit: minute, requests_per_unit: 5, name: star}
  - key: mid
    value: "a*z"
    rate_limit: {unit: minute, requests_per_unit: 6, name: middle}
"#;
    on_every_store(limits, |server, _clock, store| async move {
        let cases = [
            (("path", "/api/v1/users/me"), Some("exact")),
            (("path", "/api/v1/users/42"), Some("two_stars")),
            (("path", "/api/v1/users/"), Some("two_stars")),
            (("path", "/api/v1/groups"), Some("prefix")),
            (("path", "/api/"), Some("prefix")),
            (("path", "/api/v2"), Some("prefix")),
            (("path", "/api/v*"), Some("versioned")),
            (("path", "/api/*"), Some("prefix")),
            (("path", "/other"), Some("any")),
            (("any", ""), Some("star")),
            (("any", "x"), Some("star")),
            (("mid", "az"), Some("middle")),
            (("mid", "a-z"), Some("middle")),
            (("mid", "za"), None),
            (("mid", "a"), None),
        ];
        for ((key, value), expected) in cases {
            let r = ask(&server, vec![descriptor(&[(key, value)])]).await;
            let name = r.statuses[0].current_limit.as_ref().map(|l| l.name.clone());
            assert_eq!(name.as_deref(), expected, "{store}: {key}={value:?}");
        }
    })
    .await;
}

const QUOTAS: &str = "
domain: d
descriptors:
  - key: q1
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: q2
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: plain
    rate_limit: {unit: minute, requests_per_unit: 10}
";

/// Their `shouldRateLimitWorker`: a quota descriptor over its limit says
/// OVER_LIMIT in its status, but fails the request only when every quota
/// descriptor of it is over; the request's other descriptors still count.
#[tokio::test]
async fn quota_descriptors_fail_the_request_only_all_together() {
    on_every_store(QUOTAS, |server, _clock, store| async move {
        let all = || {
            vec![
                descriptor(&[("q1", "a")]),
                descriptor(&[("q2", "a")]),
                descriptor(&[("plain", "a")]),
            ]
        };
        let r = ask(&server, all()).await;
        assert_eq!(overall(&r), Code::Ok, "{store}");
        let r = ask(&server, all()).await;
        assert_eq!(codes(&r), [Code::OverLimit, Code::Ok, Code::Ok], "{store}");
        assert_eq!(overall(&r), Code::Ok, "{store}: q2 is not over");
        assert_eq!(r.statuses[2].limit_remaining, 8, "{store}: plain counted");
        let r = ask(&server, all()).await;
        assert_eq!(
            codes(&r)[..2],
            [Code::OverLimit, Code::OverLimit],
            "{store}"
        );
        assert_eq!(overall(&r), Code::OverLimit, "{store}: every quota is over");
        // A descriptor that is not a quota one fails the request alone.
        for _ in 0..7 {
            ask(&server, vec![descriptor(&[("plain", "a")])]).await;
        }
        let r = ask(
            &server,
            vec![descriptor(&[("q2", "b")]), descriptor(&[("plain", "a")])],
        )
        .await;
        assert_eq!(codes(&r), [Code::Ok, Code::OverLimit], "{store}");
        assert_eq!(overall(&r), Code::OverLimit, "{store}");
    })
    .await;
}

/// `QUOTA_MODE=true`: every descriptor but an unlimited one is a quota
/// descriptor, one that matches no rule included (and it is never over).
#[tokio::test]
async fn global_quota_mode_makes_every_descriptor_a_quota() {
    let limits = "
domain: d
descriptors:
  - key: plain
    rate_limit: {unit: minute, requests_per_unit: 1}
";
    let modes = GlobalModes {
        quota: true,
        ..GlobalModes::default()
    };
    on_every_store_with(limits, modes, |server, store| async move {
        let one = || vec![descriptor(&[("plain", "a")])];
        let two = || {
            vec![
                descriptor(&[("plain", "a")]),
                descriptor(&[("nothing", "x")]),
            ]
        };
        assert_eq!(overall(&ask(&server, one()).await), Code::Ok, "{store}");
        let r = ask(&server, two()).await;
        assert_eq!(codes(&r), [Code::OverLimit, Code::Ok], "{store}");
        assert_eq!(overall(&r), Code::Ok, "{store}: the unmatched one passed");
        let r = ask(&server, one()).await;
        assert_eq!(
            overall(&r),
            Code::OverLimit,
            "{store}: its only quota is over"
        );
    })
    .await;
}

/// `SHADOW_MODE=true`: the request is never OVER_LIMIT, the descriptor
/// statuses still say which limit is over, and everything is counted.
#[tokio::test]
async fn global_shadow_mode_never_refuses() {
    let limits = "
domain: d
descriptors:
  - key: plain
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: wide
    rate_limit: {unit: minute, requests_per_unit: 10}
";
    let modes = GlobalModes {
        shadow: true,
        ..GlobalModes::default()
    };
    on_every_store_with(limits, modes, |server, store| async move {
        let both = || vec![descriptor(&[("plain", "a")]), descriptor(&[("wide", "a")])];
        ask(&server, both()).await;
        let r = ask(&server, both()).await;
        assert_eq!(codes(&r), [Code::OverLimit, Code::Ok], "{store}");
        assert_eq!(overall(&r), Code::Ok, "{store}");
        assert_eq!(r.statuses[1].limit_remaining, 8, "{store}: wide counted");
    })
    .await;
}

const SHARED: &str = r#"
domain: d
descriptors:
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: apart
    value: apart/*
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: path
    value: path/*
    share_threshold: true
    descriptors:
      - key: file
        value: file/*
        descriptors:
          - key: type
            rate_limit: {unit: minute, requests_per_unit: 1}
  - key: file
    value: test1
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: file
    value: test*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: mid
    value: a*z
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 1}
"#;

/// `share_threshold` on a wildcard: every value it matches counts on one
/// counter (their cache key puts the pattern in place of the value, by entry
/// position, also for a wildcard above the rule's node); without it each
/// value counts apart; an exact value still wins over the wildcard.
#[tokio::test]
async fn share_threshold_wildcards_share_one_counter() {
    on_every_store(SHARED, |server, _clock, store| async move {
        let one = |k: &str, v: &str| vec![descriptor(&[(k, v)])];
        let code = |r: RateLimitResponse| overall(&r);
        assert_eq!(code(ask(&server, one("files", "files/a")).await), Code::Ok);
        assert_eq!(code(ask(&server, one("files", "files/b")).await), Code::Ok);
        let r = ask(&server, one("files", "files/c")).await;
        assert_eq!(overall(&r), Code::OverLimit, "{store}: 2 for all files/*");
        assert_eq!(code(ask(&server, one("apart", "apart/a")).await), Code::Ok);
        let r = ask(&server, one("apart", "apart/b")).await;
        assert_eq!(overall(&r), Code::Ok, "{store}: no share_threshold");

        let nested =
            |p: &str, f: &str| vec![descriptor(&[("path", p), ("file", f), ("type", "t")])];
        assert_eq!(
            code(ask(&server, nested("path/1", "file/x")).await),
            Code::Ok
        );
        let r = ask(&server, nested("path/2", "file/x")).await;
        assert_eq!(overall(&r), Code::OverLimit, "{store}: the parent shares");
        let r = ask(&server, nested("path/3", "file/y")).await;
        assert_eq!(overall(&r), Code::Ok, "{store}: the child does not");

        assert_eq!(code(ask(&server, one("file", "test2")).await), Code::Ok);
        let r = ask(&server, one("file", "test3")).await;
        assert_eq!(overall(&r), Code::OverLimit, "{store}");
        let r = ask(&server, one("file", "test1")).await;
        assert_eq!(
            overall(&r),
            Code::Ok,
            "{store}: the exact value has its own"
        );

        assert_eq!(code(ask(&server, one("mid", "abz")).await), Code::Ok);
        let r = ask(&server, one("mid", "a-z")).await;
        assert_eq!(overall(&r), Code::OverLimit, "{store}: * in the middle");
    })
    .await;
}

/// As theirs, `share_threshold` needs a wildcard value (or a '*' in the key).
#[test]
fn share_threshold_without_a_wildcard_is_refused() {
    let text = "domain: d\ndescriptors:\n  - key: k\n    value: v\n    share_threshold: true\n";
    let e = Config::from_files([(Path::new("d.yaml"), text)]).expect_err("refused");
    assert!(
        e.to_string()
            .contains("share_threshold can only be used with wildcard values"),
        "{e}"
    );
    // Their fixture loads whole (its stat keys: tests/stats.rs).
    let fixture = std::fs::read_to_string("tests/fixtures/envoy-ratelimit/share_threshold.yaml")
        .expect("fixture");
    if let Err(e) = Config::from_files([(Path::new("share_threshold.yaml"), fixture.as_str())]) {
        panic!("{e}");
    }
    // Theirs looks for the '*' in `key_value`: one in the key will do.
    let in_key = "domain: d\ndescriptors:\n  - key: a*\n    share_threshold: true\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    if let Err(e) = Config::from_files([(Path::new("d.yaml"), in_key)]) {
        panic!("{e}");
    }
}

const WITH_METADATA: &str = "
domain: d
descriptors:
  - key: regular
    rate_limit: {unit: minute, requests_per_unit: 10}
    metadata: {name: service_1, team: {a: 1}}
  - key: quota
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata: {name: service_2, team: {b: [x, true]}}
";

/// `RESPONSE_DYNAMIC_METADATA=true`: their `ratelimitToMetadata`, field by
/// field: the domain, each descriptor (entries as `key=value`, the override
/// as protobuf text, its own `hitsAddend`), the request's `hitsAddend` when
/// not 0, and the merged `metadata` of the rules not over their limit
/// (first value wins, structs merge).
#[tokio::test]
async fn response_dynamic_metadata_is_theirs() {
    use envoy_types::pb::google::protobuf::UInt64Value;
    use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
    let v = |kind| Value { kind: Some(kind) };
    let s = |pairs: Vec<(&str, Value)>| {
        v(Kind::StructValue(Struct {
            fields: pairs.into_iter().map(|(k, x)| (k.to_owned(), x)).collect(),
        }))
    };
    let text = |t: &str| v(Kind::StringValue(t.into()));
    let list = |values: Vec<Value>| v(Kind::ListValue(ListValue { values }));
    let number = |n: f64| v(Kind::NumberValue(n));
    let modes = GlobalModes {
        dynamic_metadata: true,
        ..GlobalModes::default()
    };
    on_every_store_with(WITH_METADATA, modes, |server, store| async move {
        let mut overridden = descriptor(&[("other", "o")]);
        overridden.limit = Some(RateLimitOverride {
            requests_per_unit: 42,
            unit: 3,
        });
        overridden.hits_addend = Some(UInt64Value { value: 0 });
        let descriptors = vec![
            descriptor(&[("regular", "r")]),
            descriptor(&[("quota", "q"), ("x", "")]),
            descriptor(&[("quota", "q")]),
            overridden,
        ];
        let mut client = server.client().await;
        let mut req = request("d", descriptors);
        req.hits_addend = 1;
        let r = client
            .should_rate_limit(req.clone())
            .await
            .expect("answer")
            .into_inner();
        let entries = |e: &[&str]| s(vec![("entries", list(e.iter().map(|e| text(e)).collect()))]);
        let expected = |metadata: Value| {
            s(vec![
                ("domain", text("d")),
                (
                    "descriptors",
                    list(vec![
                        entries(&["regular=r"]),
                        entries(&["quota=q", "x="]),
                        entries(&["quota=q"]),
                        s(vec![
                            ("entries", list(vec![text("other=o")])),
                            ("limit", text("requests_per_unit:42 unit:HOUR")),
                            ("hitsAddend", number(0.0)),
                        ]),
                    ]),
                ),
                ("hitsAddend", number(1.0)),
                ("metadata", metadata),
            ])
        };
        let both = s(vec![
            ("name", text("service_1")),
            (
                "team",
                s(vec![
                    ("a", number(1.0)),
                    ("b", list(vec![text("x"), v(Kind::BoolValue(true))])),
                ]),
            ),
        ]);
        let got = r.dynamic_metadata.map(|m| v(Kind::StructValue(m)));
        assert_eq!(got, Some(expected(both)), "{store}");
        // The quota is over now: only the regular rule's metadata is left.
        let r = client
            .should_rate_limit(req)
            .await
            .expect("answer")
            .into_inner();
        assert_eq!(overall(&r), Code::OverLimit, "{store}: its only quota");
        let regular = s(vec![
            ("name", text("service_1")),
            ("team", s(vec![("a", number(1.0))])),
        ]);
        let got = r.dynamic_metadata.map(|m| v(Kind::StructValue(m)));
        assert_eq!(got, Some(expected(regular)), "{store}");
        // An unknown domain is described too (every descriptor passed).
        let unknown = request("nowhere", vec![descriptor(&[("k", "v")])]);
        let r = client
            .should_rate_limit(unknown)
            .await
            .expect("answer")
            .into_inner();
        let got = r.dynamic_metadata.map(|m| v(Kind::StructValue(m)));
        let nowhere = s(vec![
            ("domain", text("nowhere")),
            ("descriptors", list(vec![entries(&["k=v"])])),
        ]);
        assert_eq!(got, Some(nowhere), "{store}");
    })
    .await;
}

/// Off (the default), no dynamic metadata, whatever the file says.
#[tokio::test]
async fn no_dynamic_metadata_unless_asked() {
    on_every_store(WITH_METADATA, |server, _clock, store| async move {
        let r = ask(&server, vec![descriptor(&[("regular", "r")])]).await;
        assert_eq!(r.dynamic_metadata, None, "{store}");
    })
    .await;
}

/// The binary reads their switches under their names.
#[tokio::test]
async fn the_binary_reads_their_switches() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 1}\n    metadata: {m: 1}\n";
    let b = "domain: d\ndescriptors:\n  - key: b\n    rate_limit: {unit: minute, requests_per_unit: 1}\n";
    std::fs::write(dir.path().join("a.yaml"), a).expect("write");
    std::fs::write(dir.path().join("b.yaml"), b).expect("write");
    let env = [
        ("MERGE_DOMAIN_CONFIG", "true"),
        ("SHADOW_MODE", "true"),
        ("RESPONSE_DYNAMIC_METADATA", "true"),
    ];
    let server = common::Ratekeeper::spawn_with_env(dir.path(), &[], &env);
    let client = server.client().await;
    let ask = |entries: &'static [(&'static str, &'static str)]| {
        let req = request("d", vec![descriptor(entries)]);
        let mut client = client.clone();
        async move {
            client
                .should_rate_limit(req)
                .await
                .expect("answer")
                .into_inner()
        }
    };
    ask(&[("a", "x")]).await;
    let r = ask(&[("a", "x")]).await;
    assert_eq!(codes(&r), [Code::OverLimit]);
    assert_eq!(overall(&r), Code::Ok, "SHADOW_MODE");
    let metrics = server.metrics();
    assert!(
        metrics.contains("ratekeeper_global_shadow_mode 1"),
        "{metrics}"
    );
    assert!(r.dynamic_metadata.is_some(), "RESPONSE_DYNAMIC_METADATA");
    let r = ask(&[("b", "x")]).await;
    assert!(r.statuses[0].current_limit.is_some(), "MERGE_DOMAIN_CONFIG");
}

/// `ratekeeper validate` reads MERGE_DOMAIN_CONFIG as the server does.
#[test]
fn validate_merges_when_asked() {
    let a =
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let b =
        "domain: d\ndescriptors:\n  - key: b\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let validate = |files: &[(&str, &str)]| {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).expect("write");
        }
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ratekeeper"))
            .args(["validate", "--config-dir"])
            .arg(dir.path())
            .env_remove("CONFIG_DIR")
            .env_remove("RUNTIME_ROOT")
            .env("MERGE_DOMAIN_CONFIG", "true")
            .output()
            .expect("run");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stderr) = validate(&[("a.yaml", a), ("b.yaml", b)]);
    assert_eq!(code, Some(0), "{stderr}");
    let (code, stderr) = validate(&[("a.yaml", a), ("b.yaml", a)]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("b.yaml: domain \"d\" merged with"),
        "{stderr}"
    );
    assert!(
        stderr.contains("a.yaml: duplicate descriptor \"a\""),
        "{stderr}"
    );
}
