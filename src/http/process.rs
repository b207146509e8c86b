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
    let mut out = String::new();
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = |field: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(field))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse::<f64>().ok())
            .map(|n| n * 1024.0)
    };
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
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
    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|text| {
        text.lines()
            .find_map(|line| line.strip_prefix("btime "))
            .and_then(|s| s.trim().parse::<f64>().ok())
    });
    let start = boot
        .zip(field(22))
        .map(|(boot, ticks)| boot + ticks / USER_HZ);
    let open = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|dir| dir.count() as f64);
    let max = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("Max open files"))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|soft| soft.parse::<f64>().ok())
        });
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
            max,
        ),
        (
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes.",
            kib("VmSize:"),
        ),
        (
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes.",
            kib("VmRSS:"),
        ),
        (
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since unix epoch in seconds.",
            start,
        ),
    ];
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
