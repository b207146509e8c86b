//! Which levels of a rule's stat path take the request's value instead of
//! the configured one, as envoyproxy/ratelimit builds the key:
//! - under a `value_to_metric` node, every rule at or under it puts the
//!   request's value at that node's level; the other levels keep their
//!   configured label (a wildcard its pattern, a value-less node its key);
//! - a `detailed_metric` rule puts every request value in its path, but
//!   when a `share_threshold` wildcard is on its path: then that level is
//!   the pattern, the others `key_value` (`key` for an empty value).
//!
//! A `share_threshold` wildcard's level is always its pattern, flag or not:
//! every value it matches counts as one there.

use std::collections::HashMap;
use std::sync::Arc;

use super::description::Descriptor;
use crate::rules::MetricLevel;

/// A node's label in metric paths: `key`, or `key_value`.
pub fn label(key: &str, value: Option<&str>) -> String {
    match value {
        Some(v) => format!("{key}_{v}"),
        None => key.to_owned(),
    }
}

/// The stat path levels of every rule whose path takes request values
/// level by level (see the module doc), by the rule node's `at`. Empty
/// (and allocation-free) without those flags.
pub fn levels(nodes: &[Descriptor]) -> HashMap<String, Arc<[MetricLevel]>> {
    let mut out = HashMap::new();
    walk(nodes, &mut Vec::new(), &mut out);
    out
}

fn walk<'a>(
    nodes: &'a [Descriptor],
    path: &mut Vec<&'a Descriptor>,
    out: &mut HashMap<String, Arc<[MetricLevel]>>,
) {
    for node in nodes {
        path.push(node);
        if !node.payload.limits.is_empty() {
            if let Some(levels) = rule_levels(path) {
                out.insert(node.at.clone(), levels);
            }
        }
        walk(&node.children, path, out);
        path.pop();
    }
}

/// The levels of the rule at the end of `path`; `None` when its stat path
/// is fixed (its configured one) or every value (plain `detailed_metric`).
fn rule_levels(path: &[&Descriptor]) -> Option<Arc<[MetricLevel]>> {
    let shares = |n: &Descriptor| n.payload.share_threshold;
    let detailed = path.last()?.payload.detailed_metric;
    let takes_value: fn(&Descriptor) -> bool = if detailed {
        if !path.iter().any(|n| shares(n)) {
            return None;
        }
        |n| !n.payload.share_threshold
    } else {
        if !path.iter().any(|n| n.payload.value_to_metric) {
            return None;
        }
        |n| n.payload.value_to_metric && !n.payload.share_threshold
    };
    let levels = path.iter().map(|n| match takes_value(n) {
        true => MetricLevel::Request,
        false => MetricLevel::Config(label(&n.key, n.value.as_deref())),
    });
    Some(levels.collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::description::{Limit, Limits};

    fn node(key: &str, value: Option<&str>, flag: bool, limited: bool) -> Descriptor {
        Descriptor {
            at: key.to_owned(),
            key: key.into(),
            value: value.map(str::to_owned),
            payload: Limits {
                limits: if limited {
                    vec![Limit::default()]
                } else {
                    Vec::new()
                },
                value_to_metric: flag,
                ..Limits::default()
            },
            children: Vec::new(),
        }
    }

    #[test]
    fn the_flag_reaches_the_rules_at_and_under_its_node() {
        let mut route = node("route", Some("r*"), false, false);
        let mut user = node("user", None, true, true);
        user.children = vec![node("device", Some("d1"), false, true)];
        route.children = vec![user, node("plain", None, false, true)];
        let levels = levels(&[route]);
        let config = |l: &str| MetricLevel::Config(l.into());
        assert_eq!(
            levels.get("user").map(|l| l.to_vec()),
            Some(vec![config("route_r*"), MetricLevel::Request])
        );
        assert_eq!(
            levels.get("device").map(|l| l.to_vec()),
            Some(vec![
                config("route_r*"),
                MetricLevel::Request,
                config("device_d1")
            ])
        );
        assert!(!levels.contains_key("plain"), "a sibling without the flag");
        assert!(!levels.contains_key("route"), "no limit, no rule");
    }

    #[test]
    fn a_shared_wildcard_keeps_its_pattern_also_in_detailed_rules() {
        let shared = |flag| {
            let mut n = node("route", Some("api/*"), flag, false);
            n.payload.share_threshold = true;
            n
        };
        let mut flagged = shared(true);
        flagged.children = vec![node("method", None, false, true)];
        let mut detailed = node("endpoint", None, false, true);
        detailed.at = "endpoint".into();
        detailed.payload.detailed_metric = true;
        let mut plain = shared(false);
        plain.children = vec![detailed];
        let config = |l: &str| MetricLevel::Config(l.into());
        let under_flag = levels(&[flagged]);
        assert_eq!(
            under_flag.get("method").map(|l| l.to_vec()),
            Some(vec![config("route_api/*"), config("method")])
        );
        let under_plain = levels(&[plain]);
        assert_eq!(
            under_plain.get("endpoint").map(|l| l.to_vec()),
            Some(vec![config("route_api/*"), MetricLevel::Request])
        );
    }
}
