//! Durations written as text (`500ms`, `30s`, `2m`, `1h`, or plain seconds):
//! one reader for command-line flags and limits files alike.

use std::time::Duration;

/// Parses `500ms`, `30s`, `2m`, `1h`, or plain seconds.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().ok()?;
    let ms = match unit.trim() {
        "ms" => n,
        "" | "s" => n.checked_mul(1_000)?,
        "m" => n.checked_mul(60_000)?,
        "h" => n.checked_mul(3_600_000)?,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}
