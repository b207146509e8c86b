//! The `process_*` series of Prometheus' process collector, which
//! envoyproxy/ratelimit serves through client_golang and Envoy Gateway's
//! rate limit dashboard charts (resident and virtual memory): read from
//! `/proc/self` at each scrape and written after the recorder's text, so
//! they cost nothing between scrapes and go nowhere else (statsd has none
//! there either). Empty where there is no `/proc` (not Linux).

use std::fmt::Write;

/// Linux reports process times in USER_HZ, 100 on every architecture this
/// builds for (the kernel converts from its own tick rate).
const USER_HZ: f64 = 100.0;

/// The series as Prometheus text, each with its `HELP` and `TYPE`; a value
/// `/proc` does not give is left out.
pub fn render() -> String {
    let status = read("/proc/self/status");
    let bytes = |field| number_after(&status, field).map(|kib| kib * 1024.0);
    let (cpu, start) = times();
    let limits = read("/proc/self/limits");
    let open = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|dir| dir.count() as f64);
    let series = [
        (
            "process_cpu_seconds_total",
            "counter",
            "Total user and system CPU time spent in seconds.",
            cpu,
        ),
        (
            "process_open_fds",
            "gauge",
            "Number of open file descriptors.",
            open,
        ),
        (
            "process_max_fds",
            "gauge",
            "Maximum number of open file descriptors.",
            number_after(&limits, "Max open files"),
        ),
        (
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            bytes("VmSize:"),
        ),
        (
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            bytes("VmRSS:"),
        ),
        (
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            start,
        ),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in series {
        if let Some(value) = value {
            // Writing to a String cannot fail.
            let _ = write!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
            );
        }
    }
    out
}

/// CPU seconds used (user and system) and the start time (Unix seconds),
/// from `/proc/self/stat` and the boot time in `/proc/stat`.
fn times() -> (Option<f64>, Option<f64>) {
    let stat = read("/proc/self/stat");
    // The fields after the command name, which may hold spaces and ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // proc(5) numbers the fields from 1, the state (3) first after the name.
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    let cpu = field(14)
        .zip(field(15))
        .map(|(user, system)| (user + system) / USER_HZ);
    let boot = number_after(&read("/proc/stat"), "btime");
    let start = boot
        .zip(field(22))
        .map(|(boot, ticks)| boot + ticks / USER_HZ);
    (cpu, start)
}

/// The first word after `prefix` on the line of `text` that starts with
/// it, as a number.
fn number_after(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(prefix))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|word| word.parse().ok())
}

/// A `/proc` file's text; empty when it cannot be read.
fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        if !std::path::Path::new("/proc/self/status").exists() {
            return;
        }
        let text = render();
        let value = |name: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(&format!("{name} ")))
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("no {name} in {text}"))
        };
        assert!(value("process_resident_memory_bytes") > 1e5);
        assert!(value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes"));
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_max_fds") >= value("process_open_fds"));
        // Started after 2020, before now.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let start = value("process_start_time_seconds");
        assert!(start > 1.577e9 && start <= now + 1.0, "{start}");
        assert!(value("process_cpu_seconds_total") >= 0.0);
        assert!(text.contains("# TYPE process_cpu_seconds_total counter\n"));
    }
}
