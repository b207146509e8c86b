//! Log lines as envoyproxy/ratelimit writes them (logrus), so a log
//! pipeline keyed on theirs keeps working:
//! - `LOG_FORMAT=json` ([`Their::Json`]): logrus' JSON formatter with their
//!   field map, `{"@message": ..., "@timestamp": RFC 3339 with nanoseconds,
//!   UTC, "level": "info", <the event's fields>}`, one object a line, keys
//!   in order as Go's encoder writes a map;
//! - text ([`Their::Text`]): logrus' text formatter off a terminal, logfmt:
//!   `time="2026-11-27T19:45:49Z" level=info msg="limits loaded" <the
//!   event's fields, by name>`, a value quoted as Go's `%q` when it holds
//!   anything but letters, digits and `-._/@^+`.
//!
//! A field named like one of the line's own is kept as `fields.<name>`, as
//! logrus does.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The event formatter: logrus' JSON or text (see the module doc).
#[derive(Debug, Clone, Copy)]
pub enum Their {
    Json,
    Text,
}

impl<S, N> FormatEvent<S, N> for Their
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let (now, level) = (SystemTime::now(), level_name(event.metadata().level()));
        match self {
            Their::Json => writeln!(writer, "{}", json_line(now, level, fields)),
            Their::Text => writeln!(writer, "{}", text_line(now, level, fields)),
        }
    }
}

/// One logfmt line, as logrus' text formatter writes it: the time (RFC
/// 3339, whole seconds), the level, the message (left out when empty), then
/// the other fields sorted by name.
fn text_line(now: SystemTime, level: &str, fields: Fields) -> String {
    let mut others: Vec<(String, String)> = fields
        .others
        .into_iter()
        .map(|(name, value)| {
            let name = match name.as_str() {
                "time" | "level" | "msg" => format!("fields.{name}"),
                _ => name,
            };
            let value = match value {
                Value::String(text) => text,
                other => other.to_string(),
            };
            (name, value)
        })
        .collect();
    others.sort_by(|a, b| a.0.cmp(&b.0));
    let mut line = format!("time={} level={level}", logfmt_value(&rfc3339(now, false)));
    if let Some(message) = fields.message.filter(|m| !m.is_empty()) {
        line.push_str(" msg=");
        line.push_str(&logfmt_value(&message));
    }
    for (name, value) in others {
        line.push(' ');
        line.push_str(&name);
        line.push('=');
        line.push_str(&logfmt_value(&value));
    }
    line
}

/// A value as logrus' text formatter writes it: as it is when it holds only
/// letters, digits and `-._/@^+` (and is not empty), else quoted as Go's
/// `%q` quotes it.
fn logfmt_value(text: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-._/@^+".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        return text.to_owned();
    }
    let mut quoted = String::with_capacity(text.len() + 2);
    quoted.push('"');
    for c in text.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            '\n' => quoted.push_str("\\n"),
            '\r' => quoted.push_str("\\r"),
            '\t' => quoted.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                quoted.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

/// The logfmt line a start-up error ends the process with, at logrus'
/// `fatal` level, as their `logger.Fatalf` writes it (tracing has no such
/// level).
pub fn fatal_text(message: &str) -> String {
    text_line(SystemTime::now(), "fatal", Fields::of(message))
}

/// [`fatal_text`] as a JSON line.
pub fn fatal_json(message: &str) -> String {
    json_line(SystemTime::now(), "fatal", Fields::of(message)).to_string()
}

/// A JSON line at `info` of `message` and `fields`, for what is written
/// outside the logger (the readiness line, on stdout).
pub fn json_info(message: &str, fields: &[(&str, &str)]) -> String {
    let mut line = Fields::of(message);
    let fields = fields.iter().map(|(k, v)| ((*k).to_owned(), (*v).into()));
    line.others.extend(fields);
    json_line(SystemTime::now(), "info", line).to_string()
}

/// One JSON line's object: the time, the level, the message and the other
/// fields.
fn json_line(now: SystemTime, level: &str, fields: Fields) -> Value {
    let mut object = Map::new();
    object.insert("@timestamp".into(), rfc3339(now, true).into());
    object.insert("level".into(), level.into());
    object.insert("@message".into(), fields.message.unwrap_or_default().into());
    for (name, value) in fields.others {
        let name = if object.contains_key(&name) {
            format!("fields.{name}")
        } else {
            name
        };
        object.insert(name, value);
    }
    Value::Object(object)
}

/// logrus' names of the levels.
fn level_name(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "error",
        Level::WARN => "warning",
        Level::INFO => "info",
        Level::DEBUG => "debug",
        Level::TRACE => "trace",
    }
}

/// An event's message and its other fields, in order.
#[derive(Default)]
struct Fields {
    message: Option<String>,
    others: Vec<(String, Value)>,
}

impl Fields {
    /// A line's fields of `message` alone.
    fn of(message: &str) -> Self {
        Fields {
            message: Some(message.to_owned()),
            others: Vec::new(),
        }
    }

    fn put(&mut self, field: &Field, value: Value) {
        if field.name() == "message" {
            self.message = Some(match value {
                Value::String(text) => text,
                other => other.to_string(),
            });
        } else {
            self.others.push((field.name().to_owned(), value));
        }
    }
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, format!("{value:?}").into());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(field, value.into());
    }
}

/// Go's `time.RFC3339Nano` in UTC: `2026-11-26T17:40:56.1234Z`, the
/// fraction's trailing zeros dropped (and the fraction with them when 0);
/// without `nanos`, `time.RFC3339`: whole seconds.
fn rfc3339(now: SystemTime, nanos: bool) -> String {
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, of_day) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    let mut text = format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}",
        of_day / 3_600,
        of_day % 3_600 / 60,
        of_day % 60
    );
    let fraction = since.subsec_nanos();
    if nanos && fraction > 0 {
        let fraction = format!("{fraction:09}");
        text.push('.');
        text.push_str(fraction.trim_end_matches('0'));
    }
    text.push('Z');
    text
}

/// The (year, month, day) of a count of days since 1970-01-01 (Howard
/// Hinnant's `civil_from_days`, for days on or after the epoch).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn times_are_gos_rfc3339_nano_in_utc() {
        let at = |secs, nanos| UNIX_EPOCH + Duration::new(secs, nanos);
        let rfc3339_nano = |now| rfc3339(now, true);
        assert_eq!(rfc3339_nano(at(0, 0)), "1970-01-01T00:00:00Z");
        assert_eq!(
            rfc3339_nano(at(1_795_714_856, 123_400_000)),
            "2026-11-26T17:40:56.1234Z"
        );
        // A leap day, and the last second of a year.
        assert_eq!(
            rfc3339_nano(at(951_782_400, 1)),
            "2000-02-29T00:00:00.000000001Z"
        );
        assert_eq!(rfc3339_nano(at(1_767_225_599, 0)), "2025-12-31T23:59:59Z");
        assert_eq!(
            rfc3339(at(1_795_714_856, 123_400_000), false),
            "2026-11-26T17:40:56Z"
        );
    }

    /// As logrus' text formatter writes an entry (its `needsQuoting` and
    /// Go's `%q`), the fields sorted and a clashing one renamed.
    #[test]
    fn a_text_line_is_logrus_logfmt() {
        let mut fields = Fields::of("limits reload failed");
        fields.others.push(("store".into(), "main".into()));
        fields
            .others
            .push(("error".into(), "a.yaml:3: \"x\" bad\tline\u{1}".into()));
        fields.others.push(("left_out".into(), 3.into()));
        fields.others.push(("level".into(), "x".into()));
        fields.others.push(("empty".into(), "".into()));
        fields
            .others
            .push(("path".into(), "/srv/a-b_c.d@e^f+g".into()));
        assert_eq!(
            text_line(UNIX_EPOCH, "warning", fields),
            r#"time="1970-01-01T00:00:00Z" level=warning msg="limits reload failed" empty="" error="a.yaml:3: \"x\" bad\tline\x01" fields.level=x left_out=3 path=/srv/a-b_c.d@e^f+g store=main"#
        );
        let unnamed = text_line(UNIX_EPOCH, "info", Fields::default());
        assert_eq!(unnamed, r#"time="1970-01-01T00:00:00Z" level=info"#);
    }

    #[test]
    fn a_line_has_their_names_and_keeps_a_clashing_field() {
        let mut fields = Fields::of("store down");
        fields.others.push(("store".into(), "main".into()));
        fields.others.push(("level".into(), 3.into()));
        let line = json_line(UNIX_EPOCH, level_name(&Level::WARN), fields);
        assert_eq!(
            line.to_string(),
            r#"{"@message":"store down","@timestamp":"1970-01-01T00:00:00Z","fields.level":3,"level":"warning","store":"main"}"#
        );
        let fatal: Value = serde_json::from_str(&fatal_json("cannot listen")).expect("JSON");
        assert_eq!(fatal["level"], "fatal");
        assert_eq!(fatal["@message"], "cannot listen");
    }
}
