//! Counter-key encoding (DESIGN.md section 5).
//!
//! `rk:{<domain>|<key>=<value>|...}:<rule id>`
//!
//! Descriptor values are user input and may contain any separator, so every
//! part is percent-escaped: `%`, `{`, `}`, `|`, `=`, `:` and control bytes
//! become `%XX`. Escaped parts never contain a raw separator, so the key can
//! be split back into exactly one (domain, entries, rule) — the encoding is
//! injective and two different descriptors never share a counter. The braces
//! are a Redis Cluster hash tag: every key of one descriptor lives in one slot.

/// The default prefix of every key ratekeeper writes.
pub const DEFAULT_PREFIX: &str = "rk:";

/// Appends `part` to `out`, escaping separators and control bytes.
fn push_escaped(out: &mut String, part: &str) {
    for ch in part.chars() {
        match ch {
            '%' | '{' | '}' | '|' | '=' | ':' | '\u{0}'..='\u{1f}' | '\u{7f}' => {
                let b = ch as u32;
                out.push('%');
                out.push(
                    char::from_digit(b >> 4, 16)
                        .unwrap_or('0')
                        .to_ascii_uppercase(),
                );
                out.push(
                    char::from_digit(b & 0xf, 16)
                        .unwrap_or('0')
                        .to_ascii_uppercase(),
                );
            }
            _ => out.push(ch),
        }
    }
}

/// Builds the counter key for one descriptor and one rule.
///
/// `rule_id` is chosen by ratekeeper (never user input) and must not contain
/// `{` or `}`.
pub fn counter_key<'a>(
    prefix: &str,
    domain: &str,
    entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    rule_id: &str,
) -> String {
    let mut key = String::with_capacity(prefix.len() + domain.len() + rule_id.len() + 48);
    key.push_str(prefix);
    key.push('{');
    push_escaped(&mut key, domain);
    for (k, v) in entries {
        key.push('|');
        push_escaped(&mut key, k);
        key.push('=');
        push_escaped(&mut key, v);
    }
    key.push_str("}:");
    key.push_str(rule_id);
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(domain: &str, entries: &[(&str, &str)]) -> String {
        counter_key(DEFAULT_PREFIX, domain, entries.iter().copied(), "fw.60")
    }

    #[test]
    fn separators_in_values_never_collide() {
        type Entries<'a> = &'a [(&'a str, &'a str)];
        let pairs: &[(&str, Entries<'_>, &str, Entries<'_>)] = &[
            ("d", &[("a_b", "c")], "d", &[("a", "b_c")]),
            (
                "d",
                &[("k", "a:b"), ("c", "")],
                "d",
                &[("k", "a"), ("b:c", "")],
            ),
            ("d", &[("a:b", "c")], "d", &[("a", "b:c")]),
            ("d", &[("k", "a|k=b")], "d", &[("k", "a"), ("k", "b")]),
            ("d|k", &[("v", "x")], "d", &[("k", "v"), ("x", "")]),
            ("d", &[("k", "v}x")], "d", &[("k", "v"), ("}x", "")]),
            ("a", &[("b", "c")], "a|b", &[("c", "")]),
            ("d", &[("k", "%7C")], "d", &[("k", "|")]),
            ("d", &[("k", "a\nb")], "d", &[("k", "a"), ("b", "")]),
        ];
        for (d1, e1, d2, e2) in pairs {
            assert_ne!(key(d1, e1), key(d2, e2), "{d1:?} {e1:?} vs {d2:?} {e2:?}");
        }
    }

    #[test]
    fn hash_tag_covers_the_whole_descriptor() {
        let k = key("api", &[("user", "{x}"), ("path", "/a:b")]);
        let open = k.find('{').unwrap();
        let close = k[open..].find('}').unwrap() + open;
        assert_eq!(&k[close..], "}:fw.60");
        assert_eq!(k, "rk:{api|user=%7Bx%7D|path=/a%3Ab}:fw.60");
    }

    #[test]
    fn unicode_passes_through() {
        assert_eq!(key("d", &[("k", "ü")]), "rk:{d|k=ü}:fw.60");
    }
}
