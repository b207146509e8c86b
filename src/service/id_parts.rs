//! The parts self-describing ids share (lease ids, reservation ids): a
//! nonce nobody can guess, keys in hex (so an id stays one token of
//! `[0-9a-z.:]`, whatever bytes a key holds), and the short quote of a bad
//! id an error message gives.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use tonic::Status;

/// 128 bits no caller can predict, as 32 hex digits: two process-random
/// SipHash keys over a counter and the time.
pub fn random_nonce() -> String {
    static KEYS: OnceLock<(RandomState, RandomState)> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let (a, b) = KEYS.get_or_init(|| (RandomState::new(), RandomState::new()));
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{:016x}{:016x}", a.hash_one((n, t)), b.hash_one((t, n)))
}

/// Whether `s` has the shape of a [`random_nonce`].
pub fn is_nonce(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Appends `s`'s bytes to `out` as lowercase hex.
pub fn push_hex(out: &mut String, s: &str) {
    push_hex_bytes(out, s.as_bytes());
}

/// Appends `bytes` to `out` as lowercase hex.
pub fn push_hex_bytes(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.extend(bytes.iter().flat_map(|&b| {
        [
            char::from(DIGITS[usize::from(b >> 4)]),
            char::from(DIGITS[usize::from(b & 0xf)]),
        ]
    }));
}

/// The UTF-8 text `hex` encodes; `None` for odd lengths, non-hex digits or
/// bytes that are not UTF-8.
pub fn from_hex(hex: &str) -> Option<String> {
    String::from_utf8(hex_bytes(hex)?).ok()
}

/// The bytes `hex` encodes; `None` for odd lengths or non-hex digits.
pub fn hex_bytes(hex: &str) -> Option<Vec<u8>> {
    hex.as_bytes().chunks(2).map(hex_byte).collect()
}

/// The byte two hex digits spell; `None` for anything else (a sign
/// included, which `u8::from_str_radix` would take).
pub fn hex_byte(pair: &[u8]) -> Option<u8> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    match pair {
        [hi, lo] => Some(digit(*hi)? << 4 | digit(*lo)?),
        _ => None,
    }
}

/// `id`, minted for a caller, unless it is longer than `max`, the longest
/// id taken back: then `INVALID_ARGUMENT` before anything is taken, since
/// the caller could never hand it back. `made_of` names what its length
/// comes from.
pub fn returnable(id: String, max: usize, what: &str, made_of: &str) -> Result<String, Status> {
    if id.len() > max {
        return Err(Status::invalid_argument(format!(
            "the descriptors' {made_of} make a {what} of {} bytes, over {max}: send fewer or \
             shorter descriptors",
            id.len()
        )));
    }
    Ok(id)
}

/// `s` quoted, its first 40 characters only and `…` after the quote when
/// there were more: enough to recognise a bad id in an error message,
/// never a megabyte echoed back, and never a cut part read as a whole one
/// (a TTL of 300000 as 3000).
pub fn quote_start(s: &str) -> String {
    match s.char_indices().nth(40) {
        Some((end, _)) => format!("{:?}…", &s[..end]),
        None => format!("{s:?}"),
    }
}

/// A decimal count: ASCII digits only (no sign, no space, as ids are
/// minted), and within `u64`.
pub fn count(s: &str) -> Option<u64> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonces_differ_and_hex_round_trips() {
        let (a, b) = (random_nonce(), random_nonce());
        assert!(is_nonce(&a) && is_nonce(&b) && a != b);
        assert!(!is_nonce("short") && !is_nonce(&"g".repeat(32)));
        let mut hex = String::new();
        push_hex(&mut hex, "rk:{d|ü}");
        assert_eq!(from_hex(&hex).as_deref(), Some("rk:{d|ü}"));
        for bad in ["a", "zz", "ff", "+1", "é"] {
            assert_eq!(from_hex(bad), None, "{bad}");
        }
        assert_eq!(
            quote_start(&"é".repeat(50)),
            format!("\"{}\"…", "é".repeat(40))
        );
        assert_eq!(quote_start("r1.x"), "\"r1.x\"");
        assert_eq!(count("300000"), Some(300_000));
        for bad in ["", "+3", " 3", "-3", "3x", "18446744073709551616"] {
            assert_eq!(count(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn an_id_too_long_to_come_back_is_refused_with_its_length() {
        assert_eq!(
            returnable("abc".into(), 3, "lease id", "lease sets").ok(),
            Some("abc".into())
        );
        let e = returnable("abcd".into(), 3, "reservation id", "counter keys").unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(
            e.message(),
            "the descriptors' counter keys make a reservation id of 4 bytes, over 3: send \
             fewer or shorter descriptors"
        );
    }
}
