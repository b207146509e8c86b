//! envoyproxy/ratelimit's stat names for a rule's counters:
//! `ratelimit.service.rate_limit.<key>.<total_hits|…>`, where the key is
//! the domain and the rule's descriptor path, each level `key` or
//! `key_value`, joined with `.`, then sanitized (`:`, `|` and control
//! characters become `_`, and so do the dots inside anything shaped like an
//! IPv4 address). The Prometheus series are made from these names by
//! [`crate::stat_mapper`]. Parts a caller chooses (a request's values, an
//! unknown domain) go in as [`one_segment`].

use std::borrow::Cow;

/// A rule's stat key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatKey {
    /// `<domain>.<path>`, sanitized.
    pub key: String,
}

impl StatKey {
    /// The stat key of the rule at `path` (levels joined with `.`) in `domain`.
    pub fn new(domain: &str, path: &str) -> Self {
        StatKey {
            key: sanitize(&format!("{domain}.{path}")),
        }
    }

    /// The name of the rule's stat `suffix` (`total_hits`, …).
    pub fn stat(&self, suffix: &str) -> String {
        format!("ratelimit.service.rate_limit.{}.{suffix}", self.key)
    }
}

/// envoyproxy/ratelimit's `SanitizeStatName`: `:` and `|` (statsd's field
/// separators) become `_`, and so do the dots of every match of
/// `\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}` (leftmost first, not overlapping).
/// Control characters become `_` too (theirs keeps them): a newline would
/// end the statsd line, and what follows it would be sent as a line of its
/// own.
pub fn sanitize(name: &str) -> String {
    let fields = |c: char| c == ':' || c == '|' || c.is_control();
    let mut bytes = name.replace(fields, "_").into_bytes();
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

/// Text a caller chose (a request's entry, an unknown domain) as one
/// segment of a stat name: its dots become `_`, or a domain such as
/// `web.route_r1.remote_address_10_0_0_1.total_hits` would be read by the
/// mapping (their default one too) as another rule's stat, and so do
/// control characters, which would end a statsd line. Theirs keeps both;
/// an IPv4 address comes out as theirs does (`10_0_0_1`).
pub fn one_segment(text: &str) -> Cow<'_, str> {
    let splits = |c: char| c == '.' || c.is_control();
    match text.contains(splits) {
        true => Cow::Owned(text.replace(splits, "_")),
        false => Cow::Borrowed(text),
    }
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
            ("d.a\nb\r\u{7f}\u{85}c", "d.a_b___c"),
        ];
        for (name, expected) in cases {
            assert_eq!(sanitize(name), expected, "{name:?}");
        }
    }

    #[test]
    fn a_callers_text_is_one_segment() {
        let cases = [
            (
                "web.route_r1.user.total_hits",
                "web_route_r1_user_total_hits",
            ),
            ("10.0.0.1", "10_0_0_1"),
            ("x\nratelimit.a:1|c", "x_ratelimit_a:1|c"),
            ("plain-ü", "plain-ü"),
        ];
        for (text, expected) in cases {
            assert_eq!(one_segment(text), expected, "{text:?}");
        }
        assert!(matches!(one_segment("plain"), Cow::Borrowed(_)));
    }

    #[test]
    fn stat_names_are_theirs() {
        let key = StatKey::new("default/eg/http", "route_r.remote_address_10.0.0.1");
        assert_eq!(
            key.stat("total_hits"),
            "ratelimit.service.rate_limit.default/eg/http.route_r.remote_address_10_0_0_1.total_hits"
        );
    }
}
