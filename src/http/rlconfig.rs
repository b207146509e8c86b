//! `GET /rlconfig` on the debug listener: the rules in force as text, one
//! limit a line, in envoyproxy/ratelimit's `Dump()` format:
//!
//! ```text
//! web.user_id: unit=MINUTE requests_per_unit=10, shadow_mode: false, quota_mode: false
//! ```
//!
//! Theirs prints in Go map order; here domains are sorted and a domain's
//! rules come in file order. A rule with several (stacked) limits prints a
//! line for each, and a limit counted by another algorithm than the fixed
//! window says which at the end of its line, as does a limit that sets
//! `charges:` (itself or through its domain).

use std::fmt::Write;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;

use crate::config::Config;
use crate::limiter::Algorithm;
use crate::rules::Rule;

/// The text of `/rlconfig` for `config`.
pub fn dump(config: &Config) -> String {
    let mut text = String::new();
    for name in config.domain_names() {
        let Some(domain) = config.domain(name) else {
            continue;
        };
        for rule in &domain.rules.rules {
            dump_rule(&mut text, name, rule);
        }
    }
    text
}

fn dump_rule(text: &mut String, domain: &str, rule: &Rule) {
    // An unlimited rule has no unit, and the number it was given, as theirs
    // prints it.
    if rule.is_unlimited() {
        let requests_per_unit = rule.unlimited_requests_per_unit;
        line(
            text,
            domain,
            rule,
            Unit::Unknown.as_str_name(),
            requests_per_unit,
        );
        text.push('\n');
    }
    for rate in &rule.rates {
        let unit = Unit::try_from(rate.unit.to_envoy()).unwrap_or(Unit::Unknown);
        line(
            text,
            domain,
            rule,
            unit.as_str_name(),
            rate.requests_per_unit,
        );
        if rate.algorithm != Algorithm::FixedWindow {
            let _ = write!(text, ", algorithm: {}", rate.algorithm.name());
        }
        if let Some(record) = rate.charges {
            let _ = write!(
                text,
                ", charges: {}",
                if record { "record" } else { "drop" }
            );
        }
        text.push('\n');
    }
}

fn line(text: &mut String, domain: &str, rule: &Rule, unit: &str, requests_per_unit: u32) {
    let _ = write!(
        text,
        "{domain}.{}: unit={unit} requests_per_unit={requests_per_unit}, shadow_mode: {}, quota_mode: {}",
        rule.path, rule.shadow_mode, rule.quota_mode
    );
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::dump;
    use crate::config::Config;

    #[test]
    fn one_line_per_limit_in_their_format() {
        let web = "domain: web\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\n    descriptors:\n      - key: path\n        value: /login\n        shadow_mode: true\n        rate_limit: {unit: second, requests_per_unit: 1}\n  - key: admin\n    rate_limit: {unlimited: true}\n";
        let api = "domain: api\ndescriptors:\n  - key: token\n    rate_limit: {unit: hour, requests_per_unit: 100, algorithm: token_bucket, charges: record}\n";
        let config =
            Config::from_files([(Path::new("web.yaml"), web), (Path::new("api.yaml"), api)])
                .unwrap();
        assert_eq!(
            dump(&config),
            "api.token: unit=HOUR requests_per_unit=100, shadow_mode: false, quota_mode: false, algorithm: token_bucket, charges: record\n\
             web.user: unit=MINUTE requests_per_unit=10, shadow_mode: false, quota_mode: false\n\
             web.user.path_/login: unit=SECOND requests_per_unit=1, shadow_mode: true, quota_mode: false\n\
             web.admin: unit=UNKNOWN requests_per_unit=0, shadow_mode: false, quota_mode: false\n"
        );
    }
}
