//! The Prometheus names envoyproxy/ratelimit's statsd stats go by: a
//! statsd_exporter mapping file (`PROMETHEUS_MAPPER_YAML`, else theirs,
//! `default_mapper.yaml`, embedded) turns a stat name such as
//! `ratelimit.service.rate_limit.web.user.total_hits` into a series,
//! `ratelimit_service_rate_limit_total_hits{domain="web",key1="user"}`.
//! Users who wrote their own mapping keep their dashboards' names.
//!
//! The part of statsd_exporter's format their mappers use: `match` as a
//! `glob` (`*` stands for any run of characters without a dot) or a
//! `regex` (unanchored), `name` and `labels` with `$1`…`$n`,
//! `match_metric_type`, `action: drop`, and for timers `scale` and
//! `buckets`. As in statsd_exporter, globs are tried before regexes (each in
//! file order), and a stat no mapping matches keeps its name with every
//! character Prometheus refuses turned into `_`. Anything else in the file
//! is refused at start-up with the file and line.

use std::sync::OnceLock;

use regex::Regex;
use serde::Deserialize;

use crate::{Error, Result};

/// Their default mapping, as their Prometheus sink embeds it.
const DEFAULT: &str = include_str!("default_mapper.yaml");

/// What kind of stat is being named (`match_metric_type` filters on it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StatKind {
    Counter,
    Gauge,
    #[serde(alias = "timer", alias = "histogram")]
    Observer,
}

/// The series a stat maps to.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub labels: Vec<(String, String)>,
    /// Timers: what a millisecond sample is multiplied by (`scale`).
    pub scale: f64,
    /// Timers: the histogram's buckets, when the mapping gives them.
    pub buckets: Option<Vec<f64>>,
}

/// A loaded mapping file.
#[derive(Debug)]
pub struct Mapper {
    /// Globs first, then regexes, each in file order: the order tried.
    mappings: Vec<Mapping>,
}

#[derive(Debug)]
struct Mapping {
    matcher: Regex,
    glob: bool,
    kind: Option<StatKind>,
    /// `None`: `action: drop`.
    name: Option<String>,
    labels: Vec<(String, String)>,
    scale: f64,
    buckets: Option<Vec<f64>>,
}

/// The file as written; `deny_unknown_fields` and the enums make serde_yaml
/// refuse what is not supported, with the line.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    mappings: Vec<RawMapping>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, try_from = "Fields")]
struct RawMapping(Mapping);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Fields {
    #[serde(rename = "match")]
    pattern: String,
    #[serde(default)]
    match_type: MatchType,
    match_metric_type: Option<StatKind>,
    name: Option<String>,
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    action: Action,
    /// Checked (histogram only); histograms are all the exporter makes.
    #[allow(dead_code)]
    #[serde(alias = "observer_type")]
    timer_type: Option<TimerType>,
    scale: Option<f64>,
    buckets: Option<Vec<f64>>,
    /// Accepted and unused: the series' help text.
    #[allow(dead_code)]
    help: Option<String>,
}

#[derive(Deserialize, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
enum MatchType {
    #[default]
    Glob,
    Regex,
}

#[derive(Deserialize, Default, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Action {
    #[default]
    Map,
    Drop,
}

/// Only histograms: the Prometheus exporter renders no statsd summaries.
#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum TimerType {
    Histogram,
}

impl TryFrom<Fields> for RawMapping {
    type Error = String;
    fn try_from(f: Fields) -> std::result::Result<Self, String> {
        let matcher = match f.match_type {
            MatchType::Glob => glob(&f.pattern),
            MatchType::Regex => Regex::new(&f.pattern).map_err(|e| e.to_string()),
        }
        .map_err(|e| format!("match {:?}: {e}", f.pattern))?;
        let name = match (f.action, f.name) {
            (Action::Drop, _) => None,
            (Action::Map, Some(name)) if is_name_template(&name) => Some(name),
            (Action::Map, Some(name)) => {
                return Err(format!("name {name:?} is not a Prometheus metric name"))
            }
            (Action::Map, None) => return Err(format!("match {:?}: no name", f.pattern)),
        };
        if let Some(bad) = f.labels.keys().find(|k| !is_prometheus_name(k)) {
            return Err(format!("label name {bad:?} is not a Prometheus label name"));
        }
        Ok(RawMapping(Mapping {
            matcher,
            glob: f.match_type == MatchType::Glob,
            kind: f.match_metric_type,
            name,
            labels: f.labels.into_iter().collect(),
            scale: f.scale.unwrap_or(1.0),
            buckets: f.buckets,
        }))
    }
}

/// A glob as an anchored regex: each dot-separated part is `*` (any run
/// without a dot) or a name, as statsd_exporter's glob matcher requires.
fn glob(pattern: &str) -> std::result::Result<Regex, String> {
    let part = Regex::new(r"^(\*|[a-zA-Z_](-?[a-zA-Z0-9_])*)$").map_err(|e| e.to_string())?;
    if let Some(bad) = pattern.split('.').find(|p| !part.is_match(p)) {
        return Err(format!(
            "glob part {bad:?}: a part is `*` or a name (use match_type: regex)"
        ));
    }
    let parts: Vec<String> = pattern.split('*').map(regex::escape).collect();
    Regex::new(&format!("^{}$", parts.join("([^.]*)"))).map_err(|e| e.to_string())
}

/// statsd_exporter's check of a mapping's `name`: a metric name in which
/// `$n` / `${n}` may stand for characters.
fn is_name_template(name: &str) -> bool {
    let template = r"^([a-zA-Z_]|\$\{?\d+\}?)([a-zA-Z0-9_]|\$\{?\d+\}?)*$";
    Regex::new(template).is_ok_and(|re| re.is_match(name))
}

impl Mapper {
    /// The mapping in `text`, read from `file` (named in errors).
    pub fn parse(text: &str, file: &str) -> Result<Mapper> {
        let parsed: File = serde_yaml::from_str(text).map_err(|e| {
            let at = e
                .location()
                .map(|l| format!(":{}", l.line()))
                .unwrap_or_default();
            Error::Startup(format!("PROMETHEUS_MAPPER_YAML {file}{at}: {e}"))
        })?;
        let (mut globs, regexes): (Vec<_>, Vec<_>) = parsed
            .mappings
            .into_iter()
            .map(|RawMapping(m)| m)
            .partition(|m| m.glob);
        globs.extend(regexes);
        Ok(Mapper { mappings: globs })
    }

    /// Their default mapping; `response_time_ms` drops its timer's `scale`
    /// (`PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS`), as theirs does.
    pub fn default_mapping(response_time_ms: bool) -> Mapper {
        let text = match response_time_ms {
            true => DEFAULT.replacen("    scale: 0.001\n", "", 1),
            false => DEFAULT.to_owned(),
        };
        // Embedded and tested: it parses.
        Mapper::parse(&text, "default_mapper.yaml").unwrap_or(Mapper {
            mappings: Vec::new(),
        })
    }

    /// The series stat `name` (a `kind`) maps to; `None` when dropped.
    pub fn map(&self, name: &str, kind: StatKind) -> Option<Series> {
        let found = self.mappings.iter().find_map(|m| {
            let fits = m.kind.map_or(true, |k| k == kind);
            fits.then(|| m.matcher.captures(name))
                .flatten()
                .map(|c| (m, c))
        });
        let Some((mapping, captures)) = found else {
            return Some(Series {
                name: escape(name),
                labels: Vec::new(),
                scale: 1.0,
                buckets: None,
            });
        };
        let expand = |template: &str| {
            let mut out = String::new();
            captures.expand(template, &mut out);
            out
        };
        Some(Series {
            name: escape(&expand(mapping.name.as_deref()?)),
            labels: mapping
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), expand(v)))
                .collect(),
            scale: mapping.scale,
            buckets: mapping.buckets.clone(),
        })
    }
}

fn is_prometheus_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// statsd_exporter's `EscapeMetricName`: what Prometheus refuses becomes
/// `_`, and a leading digit gets a `_` before it.
fn escape(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|c| match c.is_ascii_alphanumeric() || c == '_' {
            true => c,
            false => '_',
        })
        .collect();
    if out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, '_');
    }
    out
}

/// The mapping in use (their default until [`install`]).
static MAPPER: OnceLock<Mapper> = OnceLock::new();

/// Makes `mapper` the one in use. Before any stat is counted: a series
/// keeps the name it was first registered under.
pub fn install(mapper: Mapper) -> Result<()> {
    MAPPER
        .set(mapper)
        .map_err(|_| Error::Startup("the Prometheus mapping is installed twice".into()))
}

/// The mapping in use.
pub fn installed() -> &'static Mapper {
    MAPPER.get_or_init(|| Mapper::default_mapping(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(series: &Series) -> Vec<(&str, &str)> {
        let pairs = series.labels.iter();
        pairs.map(|(k, v)| (k.as_str(), v.as_str())).collect()
    }

    #[test]
    fn their_default_gives_domain_key1_key2() {
        let m = Mapper::default_mapping(false);
        let two = m
            .map(
                "ratelimit.service.rate_limit.web.user.total_hits",
                StatKind::Counter,
            )
            .unwrap();
        assert_eq!(two.name, "ratelimit_service_rate_limit_total_hits");
        assert_eq!(labels(&two), [("domain", "web"), ("key1", "user")]);
        let deep = "ratelimit.service.rate_limit.d.route_r.rule-0_x.third_y.near_limit";
        let three = m.map(deep, StatKind::Counter).unwrap();
        assert_eq!(three.name, "ratelimit_service_rate_limit_near_limit");
        assert_eq!(
            labels(&three),
            [("domain", "d"), ("key1", "route_r"), ("key2", "rule-0_x")]
        );
        let timer = m
            .map(
                "ratelimit_server.ShouldRateLimit.response_time",
                StatKind::Observer,
            )
            .unwrap();
        assert_eq!(timer.name, "ratelimit_service_response_time_seconds");
        assert_eq!(timer.scale, 0.001);
        let ms = Mapper::default_mapping(true);
        let timer = ms.map("ratelimit_server.X.response_time", StatKind::Observer);
        assert_eq!(timer.unwrap().scale, 1.0);
    }

    #[test]
    fn unmapped_stats_keep_their_name_escaped() {
        let m = Mapper::default_mapping(false);
        let shadow = m.map("ratelimit.service.global_shadow_mode", StatKind::Counter);
        assert_eq!(shadow.unwrap().name, "ratelimit_service_global_shadow_mode");
        let cache = "ratelimit.service.rate_limit.web.user.over_limit_with_local_cache";
        assert_eq!(
            m.map(cache, StatKind::Counter).unwrap().name,
            "ratelimit_service_rate_limit_web_user_over_limit_with_local_cache"
        );
        // `match_metric_type: counter` does not take a timer.
        let t = m.map("ratelimit_server.X.total_requests", StatKind::Observer);
        assert_eq!(t.unwrap().name, "ratelimit_server_X_total_requests");
    }

    #[test]
    fn globs_win_over_regexes_and_drop_drops() {
        let text = r#"mappings:
  - match: "a\\.(.*)"
    match_type: regex
    name: "from_regex"
  - match: "a.*.c"
    name: "glob_$1"
    labels: {part: "$1"}
  - match: "x.*"
    action: drop
"#;
        let m = Mapper::parse(text, "m.yaml").unwrap();
        let glob = m.map("a.b.c", StatKind::Counter).unwrap();
        assert_eq!(
            (glob.name.as_str(), labels(&glob)),
            ("glob_b", vec![("part", "b")])
        );
        assert_eq!(
            m.map("a.b.d", StatKind::Counter).unwrap().name,
            "from_regex"
        );
        assert_eq!(m.map("x.y", StatKind::Counter), None);
    }

    #[test]
    fn unsupported_parts_are_refused_with_file_and_line() {
        let cases = [
            (
                "mappings:\n  - match: a.*\n    name: n\n    match_type: fsm\n",
                ":4:",
            ),
            (
                "mappings:\n  - match: a.*\n    name: n\n    ttl: 10s\n",
                ":4:",
            ),
            ("defaults:\n  ttl: 10s\n", ":1:"),
            (
                "mappings:\n  - match: a.*\n    name: n\n    timer_type: summary\n",
                ":4:",
            ),
            ("mappings:\n  - match: a.*\n    labels: {x: $1}\n", ":2:"),
            (
                "mappings:\n  - match: '('\n    match_type: regex\n    name: n\n",
                ":2:",
            ),
            ("mappings:\n  - match: a.b*\n    name: n\n", ":2:"),
            ("mappings:\n  - match: a.*\n    name: my.name\n", ":2:"),
        ];
        for (text, line) in cases {
            let error = Mapper::parse(text, "/etc/m.yaml").unwrap_err().to_string();
            assert!(
                error.contains(&format!("/etc/m.yaml{line}")),
                "{text:?}: {error}"
            );
        }
    }
}
