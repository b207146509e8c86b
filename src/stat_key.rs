//! envoyproxy/ratelimit's stat names for a rule's counters, and the
//! Prometheus labels their statsd_exporter mapping (`default_mapper.yaml`,
//! which Envoy Gateway ships too) turns them into: dashboards and alerts
//! built on their names keep working against ratekeeper.
//!
//! Their stat key is the domain and the rule's descriptor path, each level
//! `key` or `key_value`, joined with `.`, then sanitized (`:` and `|` become
//! `_`, and so do the dots inside anything shaped like an IPv4 address).
//! The mapping splits the key at its dots: the first part is `domain`, the
//! second `key1`, the third (if any) `key2`; deeper levels are dropped. A
//! dot inside a value therefore shifts the levels, as it does for them.

/// A rule's stat key and the labels the mapping gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatKey {
    /// `<domain>.<path>`, sanitized: the statsd name is
    /// `ratelimit.service.rate_limit.<key>.<total_hits|…>`.
    pub key: String,
    pub domain: String,
    pub key1: String,
    /// Only for keys of three or more parts (nested rules).
    pub key2: Option<String>,
}

impl StatKey {
    /// The stat key of the rule at `path` (levels joined with `.`) in `domain`.
    pub fn new(domain: &str, path: &str) -> Self {
        let key = sanitize(&format!("{domain}.{path}"));
        let mut parts = key.split('.');
        let domain = parts.next().unwrap_or_default().to_owned();
        let key1 = parts.next().unwrap_or_default().to_owned();
        let key2 = parts.next().map(str::to_owned);
        StatKey {
            key,
            domain,
            key1,
            key2,
        }
    }
}

/// envoyproxy/ratelimit's `SanitizeStatName`: `:` and `|` (statsd's field
/// separators) become `_`, and so do the dots of every match of
/// `\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}` (leftmost first, not overlapping).
pub fn sanitize(name: &str) -> String {
    let mut bytes = name.replace([':', '|'], "_").into_bytes();
    let mut at = 0;
    while at < bytes.len() {
        match ipv4_at(&bytes, at) {
            Some(end) => {
                for b in &mut bytes[at..end] {
                    if *b == b'.' {
                        *b = b'_';
                    }
                }
                at = end;
            }
            None => at += 1,
        }
    }
    // Only ASCII dots became ASCII underscores: still UTF-8.
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// The end of the IPv4-shaped match starting at `start`, if one does.
fn ipv4_at(bytes: &[u8], start: usize) -> Option<usize> {
    let digits = |from: usize| {
        bytes[from..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count()
    };
    let mut at = start;
    for _ in 0..3 {
        // `\d{1,3}\.`: a longer run of digits cannot be followed by the dot.
        let n = digits(at);
        if !(1..=3).contains(&n) || bytes.get(at + n) != Some(&b'.') {
            return None;
        }
        at += n + 1;
    }
    match digits(at) {
        0 => None,
        n => Some(at + n.min(3)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sanitizes_as_envoyproxy_ratelimit_does() {
        let cases = [
            ("d.remote_address_10.0.0.1", "d.remote_address_10_0_0_1"),
            ("d.a:b|c", "d.a_b_c"),
            (
                "d.masked_remote_address_0.0.0.0/0",
                "d.masked_remote_address_0_0_0_0/0",
            ),
            ("d.x_1234.5.6.7", "d.x_1234_5_6_7"),
            ("d.x_1.2.3", "d.x_1.2.3"),
            ("d.x_1.2.3.4567", "d.x_1_2_3_4567"),
            ("d.host_example.com", "d.host_example.com"),
            ("d.ü_1.2.3.4", "d.ü_1_2_3_4"),
        ];
        for (name, expected) in cases {
            assert_eq!(sanitize(name), expected, "{name:?}");
        }
    }

    #[test]
    fn labels_follow_the_mapper() {
        let one = StatKey::new("web", "user");
        assert_eq!((one.domain.as_str(), one.key1.as_str()), ("web", "user"));
        assert_eq!(one.key2, None);
        let three = StatKey::new("default/eg/http", "route_r.rule-0-match-0_x.third_y");
        assert_eq!(
            three.key,
            "default/eg/http.route_r.rule-0-match-0_x.third_y"
        );
        assert_eq!(three.key1, "route_r");
        assert_eq!(three.key2.as_deref(), Some("rule-0-match-0_x"));
        let dotted = StatKey::new("web", "host_example.com");
        assert_eq!(dotted.key1, "host_example");
        assert_eq!(dotted.key2.as_deref(), Some("com"));
    }
}
