//! `MERGE_DOMAIN_CONFIG`: several files of one domain make one domain, as
//! envoyproxy/ratelimit's loader patches a domain already loaded with the
//! next file's descriptors. Each file is compiled alone (so its errors keep
//! their file and line); their trees are then joined at the top level, where
//! a key/value defined twice is refused (theirs: "duplicate descriptor
//! composite key"). Nothing deeper merges, as there.

use super::DomainConfig;
use crate::rules::{Level, RuleTree};

/// Adds `from`'s descriptors to `into` (one domain, two files). `Err` says
/// what both define.
pub fn merge_domain(into: &mut DomainConfig, from: DomainConfig) -> Result<(), String> {
    if into.options != from.options {
        return Err(
            "its domain options (all_or_nothing, response_headers, failure_mode) differ".into(),
        );
    }
    merge_tree(&mut into.rules, from.rules)?;
    merge_tree(&mut into.concurrency, from.concurrency)
}

fn merge_tree<R>(into: &mut RuleTree<R>, from: RuleTree<R>) -> Result<(), String> {
    let mut root = from.root;
    shift(&mut root, into.rules.len());
    for (key, nodes) in std::mem::take(&mut root.keys) {
        let target = into.root.keys.entry(key.clone()).or_default();
        for (value, node) in nodes.exact {
            if target.exact.contains_key(&value) {
                return Err(format!("duplicate descriptor \"{key}_{value}\""));
            }
            target.exact.insert(value, node);
        }
        for (pattern, node) in nodes.wildcards {
            if target.wildcards.iter().any(|(p, _)| *p == pattern) {
                return Err(format!("duplicate descriptor \"{key}_{}\"", pattern.text()));
            }
            target.wildcards.push((pattern, node));
        }
        if let Some(node) = nodes.default {
            if target.default.is_some() {
                return Err(format!("duplicate descriptor \"{key}\""));
            }
            target.default = Some(node);
        }
    }
    into.rules.extend(from.rules);
    Ok(())
}

/// Moves every rule index of a tree by `offset` (its rules are appended).
fn shift(level: &mut Level, offset: usize) {
    for nodes in level.keys.values_mut() {
        let wildcards = nodes.wildcards.iter_mut().map(|(_, node)| node);
        for node in nodes
            .exact
            .values_mut()
            .chain(wildcards)
            .chain(&mut nodes.default)
        {
            if let Some(rule) = &mut node.rule {
                *rule += offset;
            }
            shift(&mut node.children, offset);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::{Config, LoadOptions};

    #[test]
    fn the_second_files_rules_keep_their_nodes_at_every_depth() {
        let one = "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        rate_limit: {unit: hour, requests_per_unit: 1}\n";
        let two = "domain: d\ndescriptors:\n  - key: c\n    rate_limit: {unit: hour, requests_per_unit: 3}\n    descriptors:\n      - key: e\n        value: 'x*'\n        rate_limit: {unit: hour, requests_per_unit: 2}\n";
        let files = [(Path::new("one.yaml"), one), (Path::new("two.yaml"), two)];
        let merging = LoadOptions {
            merge_domains: true,
        };
        let config = Config::from_files_with(files, merging).expect("merged");
        let rules = &config.domain("d").expect("domain").rules;
        let limit = |entries: &[(&str, &str)]| {
            rules
                .find(entries.iter().copied())
                .map(|r| (r.path.clone(), r.rates[0].requests_per_unit))
        };
        assert_eq!(limit(&[("a", "1"), ("b", "1")]), Some(("a.b".into(), 1)));
        assert_eq!(
            limit(&[("c", "1"), ("e", "xy")]),
            Some(("c.e_x*".into(), 2))
        );
        assert_eq!(limit(&[("c", "1")]), Some(("c".into(), 3)));
    }
}
