//! Counter-key encoding: one Redis key per (descriptor, limit).
//!
//! `rk:{<domain>|<key>=<value>|...}:<rule id>`
//!
//! Descriptor values are user input and may contain any separator, so every
//! part is percent-escaped: `%`, `{`, `}`, `|`, `=`, `:` and control bytes
//! become `%XX`. Escaped parts never contain a raw separator, so the key can
//! be split back into exactly one (domain, entries, rule) — the encoding is
//! injective and two different descriptors never share a counter. The braces
//! are a Redis Cluster hash tag: every key of one descriptor lives in one slot.
//!
//! A value longer than [`MAX_RAW_VALUE_BYTES`] (a token in a header, say)
//! goes in as its digest, `%h<hex>`, which no escaped value can spell: keys
//! stay small whatever a caller sends, and such a request is counted, not
//! refused (a refused request passes Envoy's filter unlimited).

use std::borrow::Cow;

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
    values: Values,
    rule_id: &str,
) -> String {
    let mut key = String::with_capacity(prefix.len() + domain.len() + rule_id.len() + 48);
    key.push_str(prefix);
    key.push('{');
    push_escaped(&mut key, domain);
    let entries_start = key.len();
    for (k, v) in entries {
        key.push('|');
        push_escaped(&mut key, k);
        key.push('=');
        match values {
            Values::Raw if v.len() > MAX_RAW_VALUE_BYTES => {
                key.push_str("%h");
                key.push_str(&digest_hex(v));
            }
            _ => push_escaped(&mut key, &values.encode(v)),
        }
    }
    if key.len() - entries_start > MAX_KEY_ENTRIES_BYTES {
        // A descriptor of many long entries (a `limit` override takes them
        // all) as one digest: the key stays small, and stays its own (an
        // escaped entry never holds `%H`).
        let digest = digest_hex(&key[entries_start..]);
        key.truncate(entries_start);
        key.push_str("|%H");
        key.push_str(&digest);
    }
    key.push_str("}:");
    key.push_str(rule_id);
    key
}

/// Longest descriptor value that goes into keys and labels as sent.
pub const MAX_RAW_VALUE_BYTES: usize = 1024;

/// Longest run of a key's escaped entries kept as sent; a longer one (up to
/// 256 entries of a kilobyte each) goes in as its digest.
pub const MAX_KEY_ENTRIES_BYTES: usize = 4096;

/// A stat path or label of a caller's text, kept to
/// [`MAX_KEY_ENTRIES_BYTES`]: a longer one as its digest (`h:<hex>`).
pub fn bounded_label(label: String) -> String {
    if label.len() <= MAX_KEY_ENTRIES_BYTES {
        return label;
    }
    format!("h:{}", digest_hex(&label))
}

/// The first 128 bits of `value`'s SHA-256, in hex.
fn digest_hex(value: &str) -> String {
    use sha2::{Digest, Sha256};
    use std::fmt::Write;
    let digest = Sha256::digest(value.as_bytes());
    let mut hex = String::with_capacity(32);
    for b in &digest[..16] {
        // Writing to a String cannot fail.
        let _ = write!(hex, "{b:02x}");
    }
    hex
}

/// How descriptor values appear in keys and metrics labels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Values {
    /// As sent (escaped), up to [`MAX_RAW_VALUE_BYTES`]; a longer one as
    /// its digest (`h:<hex>` in labels).
    #[default]
    Raw,
    /// The first 128 bits of their SHA-256, in hex: raw tokens, emails or IPs
    /// never reach Redis or `/metrics`. Stable across releases and replicas
    /// (no secret), so counters survive restarts and upgrades.
    Sha256,
}

impl Values {
    /// `value` as it goes into a key or label.
    pub fn encode(self, value: &str) -> Cow<'_, str> {
        match self {
            Values::Raw if value.len() <= MAX_RAW_VALUE_BYTES => Cow::Borrowed(value),
            _ => Cow::Owned(format!("h:{}", digest_hex(value))),
        }
    }
}

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag (the
/// part between the first `{` and the next `}`, if non-empty) mod 16384.
pub fn cluster_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &bytes[open + 1..];
        rest.iter()
            .position(|&b| b == b'}')
            .filter(|&close| close > 0)
            .map(|close| &rest[..close])
    });
    crc16(tagged.unwrap_or(bytes)) % 16_384
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(domain: &str, entries: &[(&str, &str)]) -> String {
        counter_key(
            DEFAULT_PREFIX,
            domain,
            entries.iter().copied(),
            Values::Raw,
            "fw.60",
        )
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
    fn cluster_slots_match_redis() {
        // Values from `redis-cli CLUSTER KEYSLOT`.
        assert_eq!(cluster_slot("foo"), 12_182);
        assert_eq!(cluster_slot("123456789"), 12_739);
        assert_eq!(
            cluster_slot("{user1000}.following"),
            cluster_slot("user1000")
        );
        // An empty first tag: the whole key is hashed.
        assert_eq!(cluster_slot("foo{}{bar}"), 8_363);
        assert_eq!(cluster_slot("foo{{bar}}zap"), cluster_slot("{bar"));
        let k = key("api", &[("user", "a")]);
        assert_eq!(
            cluster_slot(&k),
            cluster_slot(&k.replace(":fw.60", ":sw.1"))
        );
    }

    #[test]
    fn hashed_values_hide_the_value_and_stay_stable() {
        let hashed = Values::Sha256.encode("alice@example.com");
        assert_eq!(hashed, "h:ff8d9819fc0e12bf0d24892e45987e24");
        assert_ne!(hashed, Values::Sha256.encode("bob@example.com"));
        assert_eq!(Values::Raw.encode("alice@example.com"), "alice@example.com");
    }

    #[test]
    fn long_values_go_in_as_a_digest_no_value_can_spell() {
        let long = "t".repeat(MAX_RAW_VALUE_BYTES + 1);
        let k = key("d", &[("k", &long)]);
        assert_eq!(k.len(), "rk:{d|k=%h}:fw.60".len() + 32, "{k}");
        assert!(k.starts_with("rk:{d|k=%h"), "{k}");
        // The digest's text as a value is escaped, so it names another counter.
        let spelled = &k["rk:{d|k=".len()..k.len() - "}:fw.60".len()];
        assert_ne!(key("d", &[("k", spelled)]), k);
        assert_ne!(key("d", &[("k", &long[1..])]), k);
        let at_cap = "t".repeat(MAX_RAW_VALUE_BYTES);
        assert_eq!(
            key("d", &[("k", &at_cap)]),
            format!("rk:{{d|k={at_cap}}}:fw.60")
        );
        assert_eq!(Values::Raw.encode(&long), Values::Sha256.encode(&long));
    }

    fn refs(entries: &[(String, String)]) -> Vec<(&str, &str)> {
        entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    #[test]
    fn many_long_entries_go_in_as_one_digest() {
        let long = "v".repeat(1000);
        let entries: Vec<(String, String)> =
            (0..256).map(|i| (format!("k{i}"), long.clone())).collect();
        let big = key("d", &refs(&entries));
        assert!(big.len() < 100, "{} bytes", big.len());
        assert!(big.starts_with("rk:{d|%H"), "{big}");
        let mut other = entries.clone();
        other[255].1.push('w');
        assert_ne!(key("d", &refs(&other)), big);
        // Short descriptors keep their entries as sent.
        assert_eq!(key("d", &[("user", "alice")]), "rk:{d|user=alice}:fw.60");
        assert_eq!(bounded_label("user_alice".into()), "user_alice");
        assert!(bounded_label("x".repeat(5000)).starts_with("h:"));
    }

    #[test]
    fn unicode_passes_through() {
        assert_eq!(key("d", &[("k", "ü")]), "rk:{d|k=ü}:fw.60");
    }
}
