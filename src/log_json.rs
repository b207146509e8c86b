//! `LOG_FORMAT=json` lines as envoyproxy/ratelimit writes them (logrus'
//! JSON formatter with their field map), so a log pipeline keyed on their
//! names keeps working: `{"@message": ..., "@timestamp": RFC 3339 with
//! nanoseconds, UTC, "level": "info", <the event's fields>}`, one object a
//! line, keys in order as Go's encoder writes a map. A field named like one
//! of those three is kept as `fields.<name>`, as logrus does.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The event formatter (see the module doc).
pub struct TheirJson;

impl<S, N> FormatEvent<S, N> for TheirJson
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
        let level = level_name(event.metadata().level());
        let line = line(SystemTime::now(), level, |fields| event.record(fields));
        writeln!(writer, "{line}")
    }
}

/// The line a start-up error ends the process with, at logrus' `fatal`
/// level, as their `logger.Fatalf` writes it (tracing has no such level).
pub fn fatal(message: &str) -> String {
    line(SystemTime::now(), "fatal", |fields| {
        fields.message = Some(message.to_owned())
    })
    .to_string()
}

/// One log line's object: the time, the level and what `record` visits.
fn line(now: SystemTime, level: &'static str, record: impl FnOnce(&mut Fields)) -> Value {
    let mut fields = Fields::default();
    record(&mut fields);
    let mut object = Map::new();
    object.insert("@timestamp".into(), rfc3339_nano(now).into());
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
/// fraction's trailing zeros dropped (and the fraction with them when 0).
fn rfc3339_nano(now: SystemTime) -> String {
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
    let nanos = since.subsec_nanos();
    if nanos > 0 {
        let fraction = format!("{nanos:09}");
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
    }

    #[test]
    fn a_line_has_their_names_and_keeps_a_clashing_field() {
        let line = line(UNIX_EPOCH, level_name(&Level::WARN), |fields| {
            fields.message = Some("store down".into());
            fields.others.push(("store".into(), "main".into()));
            fields.others.push(("level".into(), 3.into()));
        });
        assert_eq!(
            line.to_string(),
            r#"{"@message":"store down","@timestamp":"1970-01-01T00:00:00Z","fields.level":3,"level":"warning","store":"main"}"#
        );
        let fatal: Value = serde_json::from_str(&fatal("cannot listen")).expect("JSON");
        assert_eq!(fatal["level"], "fatal");
        assert_eq!(fatal["@message"], "cannot listen");
    }
}
