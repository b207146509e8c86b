//! Descriptor -> rule matching, compiled once per config load.
//!
//! Matching follows envoyproxy/ratelimit: the request's entries are walked
//! level by level; at each level an entry matches, in order, the node with the
//! exact `key`/`value`, then the first wildcard value (in file order) that
//! matches, then the value-less `key` node. The limit on the node matched by
//! the *last* entry applies; a parent's limit is never used as a fallback.
//! Matching allocates nothing.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use crate::limiter::{Algorithm, Unit};
use crate::stat_key::StatKey;
use crate::their_stats::TheirCounter;

/// One limit: a requests-per-unit rate counted by an algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rate {
    pub requests_per_unit: u32,
    pub unit: Unit,
    pub algorithm: Algorithm,
    /// Bucket size / queue depth of `token_bucket` / `leaky_bucket`;
    /// `None` means `requests_per_unit`.
    pub burst: Option<u32>,
    /// `rate_limit.name`, reported in `current_limit` and used by `replaces`.
    pub name: Option<String>,
    /// `charges:` of the limit, else of its domain: whether hits over the
    /// limit are recorded (`record`) or a refused request consumes nothing
    /// (`drop`); `None` leaves it to the server's default for the algorithm
    /// (`LimiterSettings::charges`).
    pub charges: Option<bool>,
}

impl Rate {
    /// Whether this limit is called `name`.
    pub fn is_named(&self, name: &str) -> bool {
        self.name.as_deref() == Some(name)
    }

    /// A fixed-window rate without a name (Envoy's override).
    pub fn fixed(requests_per_unit: u32, unit: Unit) -> Self {
        Rate {
            requests_per_unit,
            unit,
            algorithm: Algorithm::FixedWindow,
            burst: None,
            name: None,
            charges: None,
        }
    }

    /// The part of a counter key that identifies this rate's counter. Stable
    /// across reloads, so editing the number of requests keeps the counts.
    pub fn counter_id(&self) -> String {
        format!("{}.{}", self.algorithm.counter_tag(), self.unit.seconds())
    }

    /// The burst the store applies (0 for algorithms without one).
    pub fn effective_burst(&self) -> u64 {
        if self.algorithm.has_burst() {
            u64::from(self.burst.unwrap_or(self.requests_per_unit))
        } else {
            0
        }
    }

    /// The most hits this rate admits at once: what `RateLimit-Limit` reports.
    pub fn capacity(&self) -> u64 {
        if self.algorithm.has_burst() {
            self.effective_burst()
        } else {
            u64::from(self.requests_per_unit)
        }
    }
}

/// Per-rule counters, under ratekeeper's names (`ratekeeper_rate_limit_*`,
/// labels `domain` and `rule`) and under envoyproxy/ratelimit's stat names
/// ([`TheirCounter`]: statsd, and the Prometheus series their statsd
/// mapping makes, `ratelimit_service_rate_limit_*` with labels `domain`,
/// `key1`, `key2` by default). Names and labels are worked out once per rule;
/// each registers on its first increment, so compiling a config touches no
/// metrics and needs no recorder installed first.
#[derive(Debug, Clone)]
pub struct RuleMetrics {
    pub total_hits: RuleCounter,
    pub over_limit: RuleCounter,
    pub near_limit: RuleCounter,
    pub within_limit: RuleCounter,
    pub shadow_mode: RuleCounter,
    /// Over-limit hits the over-limit cache answered (also in `over_limit`).
    pub over_limit_with_local_cache: RuleCounter,
}

impl RuleMetrics {
    /// The counters of rule `rule` (its descriptor path) in `domain`
    /// (registered when first counted).
    pub fn register(domain: &str, rule: &str) -> Self {
        Self::with(domain, rule, Some(StatKey::new(domain, rule)))
    }

    /// Only ratekeeper's counters: for a rule whose envoyproxy/ratelimit
    /// stat key depends on the request (`detailed_metric`,
    /// `value_to_metric`), so theirs count it once, under that key.
    pub fn ours_only(domain: &str, rule: &str) -> Self {
        Self::with(domain, rule, None)
    }

    fn with(domain: &str, rule: &str, theirs: Option<StatKey>) -> Self {
        let labels = Arc::new(RuleLabels {
            domain: domain.to_owned(),
            rule: rule.to_owned(),
            theirs,
        });
        let counter = |suffix: &'static str| RuleCounter {
            suffix,
            labels: labels.clone(),
            ours: OnceLock::new(),
            theirs: OnceLock::new(),
        };
        RuleMetrics {
            total_hits: counter("total_hits"),
            over_limit: counter("over_limit"),
            near_limit: counter("near_limit"),
            within_limit: counter("within_limit"),
            shadow_mode: counter("shadow_mode"),
            over_limit_with_local_cache: counter("over_limit_with_local_cache"),
        }
    }
}

/// The names a rule's counters go by, shared by its six counters.
#[derive(Debug)]
struct RuleLabels {
    domain: String,
    rule: String,
    theirs: Option<StatKey>,
}

/// One of a rule's counters (`suffix` says which) in every sink.
#[derive(Debug, Clone)]
pub struct RuleCounter {
    suffix: &'static str,
    labels: Arc<RuleLabels>,
    ours: OnceLock<metrics::Counter>,
    theirs: OnceLock<Option<TheirCounter>>,
}

impl RuleCounter {
    /// The rule label (its path) in ratekeeper's series.
    pub fn rule(&self) -> &str {
        &self.labels.rule
    }

    pub fn increment(&self, n: u64) {
        self.increment_ours(n);
        let theirs = self.theirs.get_or_init(|| {
            let key = self.labels.theirs.as_ref()?;
            Some(TheirCounter::new(&key.stat(self.suffix)))
        });
        if let Some(theirs) = theirs {
            theirs.add(n);
        }
    }

    /// Counts in ratekeeper's series only: for a stat theirs would not
    /// count in the same setup.
    pub fn increment_ours(&self, n: u64) {
        let ours = self.ours.get_or_init(|| {
            let RuleLabels { domain, rule, .. } = &*self.labels;
            let name = format!("ratekeeper_rate_limit_{}", self.suffix);
            metrics::counter!(name, "domain" => domain.clone(), "rule" => rule.clone())
        });
        ours.increment(n);
    }
}

/// One level of the stat path of a rule under a `value_to_metric` node, or
/// of a `detailed_metric` one under a `share_threshold` wildcard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricLevel {
    /// The level's label as configured (`key`, `key_value`, `key_pattern`).
    Config(String),
    /// The request entry's `key_value` (`key` when its value is empty).
    Request,
}

/// The limits attached to one node of a domain's descriptor tree.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Every limit of the node (`rate_limit`, or the stacked `rate_limits`),
    /// all checked; empty when the rule is `unlimited`.
    pub rates: Vec<Rate>,
    /// The `requests_per_unit` an `unlimited` rule was given: it limits
    /// nothing, and `/rlconfig` prints it, as theirs does.
    pub unlimited_requests_per_unit: u32,
    pub shadow_mode: bool,
    /// envoyproxy/ratelimit's `quota_mode`: over this rule's limit fails
    /// the request only when every quota descriptor of it is over.
    pub quota_mode: bool,
    /// `metadata:`, as `RESPONSE_DYNAMIC_METADATA` returns it.
    pub metadata: Option<envoy_types::pb::google::protobuf::Struct>,
    pub detailed_metric: bool,
    /// Names of rules this one replaces when both match one request.
    pub replaces: Vec<String>,
    /// The node's path, e.g. `plan_free.user_id`: the metrics label.
    pub path: String,
    pub metrics: RuleMetrics,
    /// Its stat path level by level, when that takes request values at
    /// some levels only: under a `value_to_metric` node, or, with
    /// `detailed_metric`, under a `share_threshold` wildcard (whose level
    /// keeps its pattern); see `config::value_metric`.
    pub metric_levels: Option<Arc<[MetricLevel]>>,
}

impl Rule {
    pub fn is_unlimited(&self) -> bool {
        self.rates.is_empty()
    }

    /// Whether any of the rule's limits is called `name`.
    pub fn is_named(&self, name: &str) -> bool {
        self.rates.iter().any(|r| r.is_named(name))
    }
}

/// A value pattern with `*` wildcards, each matching zero or more characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wildcard {
    parts: Vec<String>,
}

impl Wildcard {
    pub fn new(pattern: &str) -> Self {
        Wildcard {
            parts: pattern.split('*').map(str::to_owned).collect(),
        }
    }

    /// The pattern as written.
    pub fn text(&self) -> String {
        self.parts.join("*")
    }

    /// Whether `value` is the pattern as written (`*`s and all).
    pub fn is_written_as(&self, value: &str) -> bool {
        value.split('*').eq(self.parts.iter().map(String::as_str))
    }

    pub fn matches(&self, value: &str) -> bool {
        let (first, rest) = match self.parts.split_first() {
            Some(split) => split,
            None => return value.is_empty(),
        };
        let Some(mut tail) = value.strip_prefix(first.as_str()) else {
            return false;
        };
        let Some((last, middle)) = rest.split_last() else {
            return tail.is_empty();
        };
        for part in middle {
            match tail.find(part.as_str()) {
                Some(at) => tail = &tail[at + part.len()..],
                None => return false,
            }
        }
        tail.len() >= last.len() && tail.ends_with(last.as_str())
    }
}

/// The nodes sharing one descriptor key at one level.
#[derive(Debug, Default)]
pub struct KeyNodes {
    pub exact: HashMap<String, Node>,
    pub wildcards: Vec<(Wildcard, Node)>,
    pub default: Option<Node>,
}

impl KeyNodes {
    /// The node whose value is `value` as written: an exact value, or a
    /// wildcard pattern sent literally (`foo*` is `foo*`'s node, not the
    /// first pattern matching it, as envoyproxy/ratelimit keeps patterns
    /// in its map of values).
    fn written(&self, value: &str) -> Option<&Node> {
        self.exact.get(value).or_else(|| {
            if !value.contains('*') {
                return None;
            }
            let (_, node) = self
                .wildcards
                .iter()
                .find(|(p, _)| p.is_written_as(value))?;
            Some(node)
        })
    }
}

/// One level of a descriptor tree.
#[derive(Debug, Default)]
pub struct Level {
    pub keys: HashMap<String, KeyNodes>,
}

impl Drop for Level {
    /// Frees the levels below one at a time: a tree from xDS may nest
    /// thousands deep ([`crate::config::xds_decode::MAX_DESCRIPTOR_DEPTH`]),
    /// and dropping it level by level through the calls would overflow the
    /// stack of whichever thread lets go of the config last.
    fn drop(&mut self) {
        let mut below: Vec<Level> = Vec::new();
        let take_children = |level: &mut Level, below: &mut Vec<Level>| {
            for (_, nodes) in level.keys.drain() {
                let KeyNodes {
                    exact,
                    wildcards,
                    default,
                } = nodes;
                let nodes = exact
                    .into_values()
                    .chain(wildcards.into_iter().map(|(_, n)| n));
                for mut node in nodes.chain(default) {
                    below.push(std::mem::take(&mut node.children));
                }
            }
        };
        take_children(self, &mut below);
        while let Some(mut level) = below.pop() {
            take_children(&mut level, &mut below);
        }
    }
}

/// A descriptor node: maybe a rule, maybe deeper levels.
#[derive(Debug, Default)]
pub struct Node {
    /// Index into [`RuleTree::rules`].
    pub rule: Option<usize>,
    /// envoyproxy/ratelimit's `share_threshold`: the node's wildcard value,
    /// which stands for every value it matches in the counter key.
    pub shared: Option<String>,
    pub children: Level,
}

/// A concurrent-connection limit attached to one node of a domain's
/// `concurrency:` tree.
#[derive(Debug, Clone)]
pub struct ConcurrencyRule {
    pub max_connections: u32,
    /// How long a lease lives without a heartbeat.
    pub lease_ttl: std::time::Duration,
    pub name: Option<String>,
    /// The node's path: the metrics label.
    pub path: String,
}

/// A domain's compiled descriptor tree of rules `R`.
#[derive(Debug)]
pub struct RuleTree<R = Rule> {
    pub root: Level,
    pub rules: Vec<R>,
}

impl<R> Default for RuleTree<R> {
    fn default() -> Self {
        RuleTree {
            root: Level::default(),
            rules: Vec::new(),
        }
    }
}

impl<R> RuleTree<R> {
    /// The rule for a request descriptor's `(key, value)` entries, if any.
    pub fn find<'a, 'e>(
        &'a self,
        entries: impl ExactSizeIterator<Item = (&'e str, &'e str)>,
    ) -> Option<&'a R> {
        self.find_sharing(entries, |_, _| {})
    }

    /// As [`RuleTree::find`], and calls `shared(i, pattern)` for each entry
    /// `i` matched by a `share_threshold` wildcard, even above the rule's
    /// node (envoyproxy/ratelimit tracks them all the way down).
    pub fn find_sharing<'a, 'e>(
        &'a self,
        entries: impl ExactSizeIterator<Item = (&'e str, &'e str)>,
        mut shared: impl FnMut(usize, &'a str),
    ) -> Option<&'a R> {
        let last = entries.len().checked_sub(1)?;
        let mut level = &self.root;
        for (i, (key, value)) in entries.enumerate() {
            let nodes = level.keys.get(key)?;
            let node = nodes
                .written(value)
                .or_else(|| {
                    let (_, node) = nodes
                        .wildcards
                        .iter()
                        .find(|(pattern, _)| pattern.matches(value))?;
                    if let Some(pattern) = &node.shared {
                        shared(i, pattern);
                    }
                    Some(node)
                })
                .or(nodes.default.as_ref())?;
            if i == last {
                return node.rule.map(|r| &self.rules[r]);
            }
            level = &node.children;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_match_anywhere() {
        let cases = [
            ("foo*", "foo", true),
            ("foo*", "foobar", true),
            ("foo*", "fo", false),
            ("*bar", "bar", true),
            ("*bar", "foobar", true),
            ("*bar", "barfoo", false),
            ("a*b*c", "abc", true),
            ("a*b*c", "a-b-b-c", true),
            ("a*b*c", "acb", false),
            ("a*a", "a", false),
            ("a*a", "aa", true),
            ("*", "", true),
            ("*", "anything", true),
            ("/api/*/users", "/api/v1/users", true),
            ("/api/*/users", "/api/v1/groups", false),
        ];
        for (pattern, value, expected) in cases {
            assert_eq!(
                Wildcard::new(pattern).matches(value),
                expected,
                "{pattern:?} vs {value:?}"
            );
        }
    }
}
