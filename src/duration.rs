//! Durations written as text: Go's syntax (`1h30m`, `1.5h`, `500ms`, `10us`,
//! as envoyproxy/ratelimit's settings take them), plus a bare number of
//! seconds. One reader for command-line flags, the environment and limits
//! files alike.

use std::time::Duration;

/// Parses a Go duration (`300ms`, `1.5h`, `2h45m`, `0`; units `ns`, `us`,
/// `µs`, `ms`, `s`, `m`, `h`) or a bare number of seconds (`30`, ratekeeper's
/// own shorthand). `None` for anything else: a negative duration, or one
/// longer than Go's longest (2⁶³ − 1 ns, about 292 years), which also keeps
/// every deadline made from a setting far from overflowing an `Instant`.
pub fn parse_duration(text: &str) -> Option<Duration> {
    const MAX_NANOS: u128 = i64::MAX as u128;
    let text = text.trim();
    let text = text.strip_prefix('+').unwrap_or(text);
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        let secs: u64 = text.parse().ok()?;
        return (u128::from(secs) * 1_000_000_000 <= MAX_NANOS).then(|| Duration::from_secs(secs));
    }
    let mut rest = text;
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let (nanos, after) = component(rest)?;
        total = total.checked_add(nanos)?;
        rest = after;
    }
    if text.is_empty() || total > MAX_NANOS {
        return None;
    }
    let secs = u64::try_from(total / 1_000_000_000).ok()?;
    Some(Duration::new(secs, (total % 1_000_000_000) as u32))
}

/// One `<number>[.<fraction>]<unit>` at the start of `text`: its length in
/// nanoseconds (a fraction below a nanosecond is dropped, as Go does) and
/// the text after it.
fn component(text: &str) -> Option<(u128, &str)> {
    let digits = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let whole_len = digits(text);
    let (whole, rest) = text.split_at(whole_len);
    let (fraction, rest) = match rest.strip_prefix('.') {
        Some(after) => after.split_at(digits(after)),
        None => ("", rest),
    };
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    let unit_len = rest
        .find(|c: char| c.is_ascii_digit() || c == '.')
        .unwrap_or(rest.len());
    let (unit, rest) = rest.split_at(unit_len);
    let scale: u128 = match unit {
        "ns" => 1,
        "us" | "µs" | "μs" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        _ => return None,
    };
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let mut nanos = whole.checked_mul(scale)?;
    // The fraction's digits, scaled one by one: no float rounding.
    let mut place = scale;
    for digit in fraction.bytes().take(20) {
        place /= 10;
        nanos = nanos.checked_add(u128::from(digit - b'0') * place)?;
    }
    Some((nanos, rest))
}

#[cfg(test)]
mod tests {
    use super::parse_duration;
    use std::time::Duration;

    #[test]
    fn reads_go_durations_and_bare_seconds() {
        let ms = Duration::from_millis;
        for (text, expected) in [
            ("500ms", ms(500)),
            ("30s", ms(30_000)),
            ("2m", ms(120_000)),
            ("1h", ms(3_600_000)),
            ("1h30m", ms(5_400_000)),
            ("1.5h", ms(5_400_000)),
            ("2h45m10.5s", ms(9_910_500)),
            (".5s", ms(500)),
            ("1.s", ms(1_000)),
            ("10us", Duration::from_micros(10)),
            ("10µs", Duration::from_micros(10)),
            ("7ns", Duration::from_nanos(7)),
            ("0", Duration::ZERO),
            ("+5s", ms(5_000)),
            ("30", ms(30_000)),
            (" 24h ", ms(86_400_000)),
        ] {
            assert_eq!(parse_duration(text), Some(expected), "{text}");
        }
        for bad in ["", "s", ".s", "1x", "-1s", "1h-5m", "h1", "1d", "1 h", "ms"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
        assert_eq!(parse_duration("1.5"), None, "a bare fraction has no unit");
        // Go's longest duration, and nothing longer (nor a panic on overflow).
        assert_eq!(
            parse_duration("9223372036854775807ns"),
            Some(Duration::from_nanos(i64::MAX as u64))
        );
        for long in [
            "9223372036854775808ns",
            "9223372037s",
            "18446744073709551615s",
            "18446744073709551615",
            "340282366920938463463374607431768211.9us",
        ] {
            assert_eq!(parse_duration(long), None, "{long}");
        }
    }
}
