//! `value_to_metric`: which levels of a rule's stat path take the request's
//! value instead of the configured one. As in envoyproxy/ratelimit, a node
//! with the flag puts the request's value in the stats of every rule at or
//! under it; the other levels keep their configured label (a wildcard its
//! pattern, a value-less node its key).

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

/// The stat path levels of every rule under a `value_to_metric` node, by
/// the rule node's `at`. Empty (and allocation-free) without the flag.
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
        let flagged = path.iter().any(|n| n.payload.value_to_metric);
        if flagged && !node.payload.limits.is_empty() {
            let levels = path
                .iter()
                .map(|n| match n.payload.value_to_metric {
                    true => MetricLevel::Request,
                    false => MetricLevel::Config(label(&n.key, n.value.as_deref())),
                })
                .collect();
            out.insert(node.at.clone(), levels);
        }
        walk(&node.children, path, out);
        path.pop();
    }
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
}
