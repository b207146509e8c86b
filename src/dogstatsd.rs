//! DogStatsD's mogrifiers (`USE_DOG_STATSD_MOGRIFIERS`), as
//! envoyproxy/ratelimit's godogstats sink applies them: each named
//! mogrifier is a regex (`DOG_STATSD_MOGRIFIER_<NAME>_PATTERN`) that, when
//! it matches a stat name, renames it (`…_NAME`) and tags it (`…_TAGS`,
//! `key:value,…`), both with `$0`, `$1`, … standing for the match's
//! groups. The first mogrifier that matches wins; tagging per request value
//! instead of per name is what makes the stats aggregable in Datadog.

use regex::Regex;

use crate::{Error, Result};

/// The mogrifiers in the order `USE_DOG_STATSD_MOGRIFIERS` lists them.
#[derive(Debug, Clone, Default)]
pub struct Mogrifiers(Vec<Mogrifier>);

#[derive(Debug, Clone)]
struct Mogrifier {
    matcher: Regex,
    name: String,
    /// `(key, value template)`, in the order given.
    tags: Vec<(String, String)>,
}

impl Mogrifiers {
    /// The mogrifiers `list` (comma-separated names) names, each read from
    /// `env` (an environment lookup) under `DOG_STATSD_MOGRIFIER_<NAME>_*`.
    pub fn from_env(list: &str, env: impl Fn(&str) -> Option<String>) -> Result<Mogrifiers> {
        let names = list.split(',').map(str::trim).filter(|n| !n.is_empty());
        names
            .map(|name| Mogrifier::from_env(name, &env))
            .collect::<Result<Vec<_>>>()
            .map(Mogrifiers)
    }

    /// The stat's name and tags (`key:value`) as the first matching
    /// mogrifier makes them; the name unchanged and no tags if none does.
    pub fn mogrify(&self, name: &str) -> (String, Vec<String>) {
        for mogrifier in &self.0 {
            let Some(found) = mogrifier.matcher.captures(name) else {
                continue;
            };
            let groups: Vec<&str> = found.iter().map(|g| g.map_or("", |m| m.as_str())).collect();
            let tags = mogrifier.tags.iter();
            let tags = tags.map(|(k, v)| format!("{k}:{}", expand(v, &groups)));
            return (expand(&mogrifier.name, &groups), tags.collect());
        }
        (name.to_owned(), Vec::new())
    }
}

impl Mogrifier {
    fn from_env(name: &str, env: &impl Fn(&str) -> Option<String>) -> Result<Mogrifier> {
        // envconfig, which theirs reads these with, upper-cases the names.
        let var = |part: &str| {
            let key = format!("DOG_STATSD_MOGRIFIER_{name}_{part}").to_uppercase();
            env(&key).filter(|v| !v.is_empty())
        };
        let fail = |why: String| Error::Startup(format!("mogrifier {name}: {why}"));
        let pattern = var("PATTERN").ok_or_else(|| fail("no PATTERN specified".into()))?;
        let matcher =
            Regex::new(&pattern).map_err(|e| fail(format!("bad PATTERN {pattern:?}: {e}")))?;
        let new_name = var("NAME").ok_or_else(|| fail("no NAME specified".into()))?;
        let mut tags = Vec::new();
        for pair in var("TAGS").iter().flat_map(|t| t.split(',')) {
            match pair.split_once(':') {
                Some((k, v)) if !k.is_empty() && !v.is_empty() => {
                    tags.push((k.to_owned(), v.to_owned()))
                }
                _ => return Err(fail(format!("TAGS: {pair:?} is not key:value"))),
            }
        }
        Ok(Mogrifier {
            matcher,
            name: new_name,
            tags,
        })
    }
}

/// `template` with each `$<digits>` replaced by that group (kept as
/// written when there is no such group, as theirs does).
fn expand(template: &str, groups: &[&str]) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits = rest[at + 1..]
            .bytes()
            .take_while(u8::is_ascii_digit)
            .count();
        let number = &rest[at + 1..at + 1 + digits];
        match number.parse::<usize>().ok().and_then(|i| groups.get(i)) {
            Some(group) => out.push_str(group),
            None => out.push_str(&rest[at..at + 1 + digits]),
        }
        rest = &rest[at + 1 + digits..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| vars.get(k).cloned()
    }

    #[test]
    fn their_readme_example_mogrifies() {
        let vars = env(&[
            (
                "DOG_STATSD_MOGRIFIER_DOMAIN_PATTERN",
                r"^some\.original\.metric\.(.*)$",
            ),
            ("DOG_STATSD_MOGRIFIER_DOMAIN_NAME", "some.original.metric"),
            ("DOG_STATSD_MOGRIFIER_DOMAIN_TAGS", "domain:$1"),
            (
                "DOG_STATSD_MOGRIFIER_HITS_PATTERN",
                r"^ratelimit\.service\.rate_limit\.([^.]+)\.(.*)\.([^.]+)$",
            ),
            (
                "DOG_STATSD_MOGRIFIER_HITS_NAME",
                "ratelimit.service.rate_limit.$3",
            ),
            ("DOG_STATSD_MOGRIFIER_HITS_TAGS", "domain:$1,descriptor:$2"),
        ]);
        let m = Mogrifiers::from_env("DOMAIN, hits", vars).unwrap();
        assert_eq!(
            m.mogrify("ratelimit.service.rate_limit.web.user.total_hits"),
            (
                "ratelimit.service.rate_limit.total_hits".to_owned(),
                vec!["domain:web".to_owned(), "descriptor:user".to_owned()]
            )
        );
        assert_eq!(
            m.mogrify("some.original.metric.x"),
            (
                "some.original.metric".to_owned(),
                vec!["domain:x".to_owned()]
            )
        );
        assert_eq!(m.mogrify("other"), ("other".to_owned(), vec![]));
    }

    #[test]
    fn placeholders_without_a_group_stay() {
        assert_eq!(expand("a.$1.$9.$x$", &["all", "one"]), "a.one.$9.$x$");
    }

    #[test]
    fn incomplete_mogrifiers_are_refused() {
        let refused = |vars: &[(&str, &str)]| {
            Mogrifiers::from_env("m", env(vars))
                .unwrap_err()
                .to_string()
        };
        assert!(refused(&[]).contains("mogrifier m: no PATTERN"));
        let bad = refused(&[("DOG_STATSD_MOGRIFIER_M_PATTERN", "(")]);
        assert!(bad.contains("bad PATTERN"), "{bad}");
        let no_name = refused(&[("DOG_STATSD_MOGRIFIER_M_PATTERN", "a")]);
        assert!(no_name.contains("no NAME"), "{no_name}");
        let tags = refused(&[
            ("DOG_STATSD_MOGRIFIER_M_PATTERN", "a"),
            ("DOG_STATSD_MOGRIFIER_M_NAME", "b"),
            ("DOG_STATSD_MOGRIFIER_M_TAGS", "novalue"),
        ]);
        assert!(tags.contains("not key:value"), "{tags}");
    }
}
