//! The `# HELP` lines of ratekeeper's own series on `/metrics`: what each
//! counts, said once when the Prometheus recorder is installed (a series
//! without one is flagged by `promtool check metrics`, and a dashboard's
//! author has nothing to read). envoyproxy/ratelimit's series keep what
//! their statsd_exporter mapping gives them. README's "Metrics" says more.

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};

/// (name, help) of ratekeeper's counters.
const COUNTERS: &[(&str, &str)] = &[
    (
        "ratekeeper_rate_limit_total_hits",
        "Hits asked of a rule (hits_addend summed).",
    ),
    (
        "ratekeeper_rate_limit_over_limit",
        "Hits a rule refused: the part of a request past its limit.",
    ),
    (
        "ratekeeper_rate_limit_near_limit",
        "Hits past floor(limit x NEAR_LIMIT_RATIO) and within the limit.",
    ),
    (
        "ratekeeper_rate_limit_within_limit",
        "Hits a rule admitted.",
    ),
    (
        "ratekeeper_rate_limit_shadow_mode",
        "Hits over a shadow-mode rule's limit, let through.",
    ),
    (
        "ratekeeper_rate_limit_over_limit_with_local_cache",
        "Hits refused by the over-limit cache, without a store call.",
    ),
    (
        "ratekeeper_domain_not_found",
        "Requests for a domain no limits file or xDS config defines.",
    ),
    (
        "ratekeeper_global_shadow_mode",
        "Requests SHADOW_MODE let through that were over a limit.",
    ),
    (
        "ratekeeper_over_limit_cache_hits",
        "Requests answered by the over-limit cache.",
    ),
    (
        "ratekeeper_store_errors",
        "Requests whose store call failed.",
    ),
    (
        "ratekeeper_store_error_fail_open",
        "Requests whose store call failed, allowed (failure mode open).",
    ),
    (
        "ratekeeper_store_error_fail_closed",
        "Requests whose store call failed, refused (failure mode closed).",
    ),
    (
        "ratekeeper_store_error_fail_unavailable",
        "Requests whose store call failed, answered UNAVAILABLE.",
    ),
    (
        "ratekeeper_store_error_fail_local",
        "Requests whose store call failed, decided by this replica alone (failure mode local).",
    ),
    (
        "ratekeeper_local_fallback_untracked",
        "Counters failure mode local did not write for a new key: it held LOCAL_FALLBACK_MAX_KEYS.",
    ),
    (
        "ratekeeper_store_give_backs_dropped",
        "Give-backs of failed lease acquires not started: too many waiting.",
    ),
    (
        "ratekeeper_config_load_success",
        "Limits configurations loaded.",
    ),
    (
        "ratekeeper_config_load_error",
        "Limits configurations refused (the running one stays).",
    ),
    (
        "ratekeeper_budget_reserves",
        "BudgetService Reserve calls, by result.",
    ),
    (
        "ratekeeper_budget_settles",
        "BudgetService Settle calls, by result.",
    ),
    (
        "ratekeeper_concurrency_acquires",
        "Concurrency lease acquires, by result.",
    ),
    (
        "ratekeeper_concurrency_leases_expired",
        "Leases an acquire found expired and removed (their holder stopped heartbeating).",
    ),
    (
        "ratekeeper_concurrency_leases_lost",
        "Leases a heartbeat or Hold found gone from the store (a heartbeat's ids are the caller's word: one released, or never granted, counts too).",
    ),
    (
        "ratekeeper_admin_operations",
        "Admin API operations that changed state, by operation.",
    ),
    (
        "ratekeeper_admin_unauthorized",
        "Admin API calls refused: a missing or wrong bearer token.",
    ),
    (
        "ratekeeper_tls_reload_success",
        "TLS certificates re-read after a change.",
    ),
    (
        "ratekeeper_tls_reload_error",
        "TLS certificate changes refused (the previous ones stay).",
    ),
    (
        "ratekeeper_trace_decisions_exported",
        "Decision spans sent to the OTLP receiver.",
    ),
    (
        "ratekeeper_trace_decisions_dropped",
        "Decision spans dropped: the export queue was full.",
    ),
    (
        "ratekeeper_trace_export_failures",
        "OTLP exports that failed (their spans dropped).",
    ),
];

/// (name, help) of ratekeeper's gauges.
const GAUGES: &[(&str, &str)] = &[
    (
        "ratekeeper_store_up",
        "1 while the store's health probe succeeds, 0 while it fails.",
    ),
    (
        "ratekeeper_config_load_failing",
        "1 from a refused limits configuration until one loads.",
    ),
    (
        "ratekeeper_concurrency_active",
        "Leases the caller of the latest acquire on a concurrency rule held (that caller's, not the rule's over all callers; a sample, kept until the next acquire).",
    ),
    (
        "ratekeeper_concurrency_held_leases",
        "Leases held by Hold streams on this replica.",
    ),
    (
        "ratekeeper_build_info",
        "Always 1, labelled with the version and commit.",
    ),
];

/// (name, help) of ratekeeper's histograms, in seconds.
const HISTOGRAMS: &[(&str, &str)] = &[
    (
        "ratekeeper_request_duration_seconds",
        "Time to decide a request (gRPC or /json).",
    ),
    (
        "ratekeeper_store_call_duration_seconds",
        "Time of one store call (a batched call deciding many requests is one).",
    ),
];

/// Describes every series above to the installed recorder.
pub fn describe() {
    for &(name, help) in COUNTERS {
        describe_counter!(name, help);
    }
    for &(name, help) in GAUGES {
        describe_gauge!(name, help);
    }
    for &(name, help) in HISTOGRAMS {
        describe_histogram!(name, Unit::Seconds, help);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every series the source names literally (`counter!("ratekeeper_…"`,
    /// `gauge!`, `histogram!`) has its help, under its kind.
    #[test]
    fn every_series_of_ours_has_its_help() {
        let mut sources = vec![std::path::PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/src"
        ))];
        let mut named = Vec::new();
        while let Some(path) = sources.pop() {
            if path.is_dir() {
                sources.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") || path.ends_with("metric_help.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for (kind, table) in [
                ("counter", COUNTERS),
                ("gauge", GAUGES),
                ("histogram", HISTOGRAMS),
            ] {
                let opening = format!("{kind}!(");
                for (at, _) in text.match_indices(&opening) {
                    let rest = text[at + opening.len()..].trim_start();
                    let Some(name) = rest
                        .strip_prefix("\"ratekeeper_")
                        .and_then(|r| r.split('"').next())
                    else {
                        continue;
                    };
                    let name = format!("ratekeeper_{name}");
                    named.push(name.clone());
                    assert!(
                        table.iter().any(|(n, _)| *n == name),
                        "{name} ({kind}, {}) has no help",
                        path.display()
                    );
                }
            }
        }
        assert!(named.len() >= 20, "found only {named:?}");
    }
}
