//! Every environment variable of envoyproxy/ratelimit's `settings.go`, with
//! what ratekeeper does with it: one table, so that none is silently
//! ignored. At start-up the ones set in the environment that are not read
//! under their own name are named in one warning, each with why; README's
//! settings table is this table (a test keeps them equal).

/// What ratekeeper does with one of envoyproxy/ratelimit's variables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Read under the same name, with the same meaning (the text adds any
    /// difference worth knowing; empty: none).
    Same(&'static str),
    /// Not read; ratekeeper's own setting does the job.
    Own(&'static str),
    /// Not read: it cannot apply here, for the reason given.
    NotApplicable(&'static str),
}

use Status::{NotApplicable, Own, Same};

const MEMCACHE: &str =
    "the memcache backend is not supported (`BACKEND_TYPE=memcache` stops the start-up)";
const PIPELINING: &str =
    "each Redis connection pipelines every call on it by itself; there is no window or limit to tune";
const MULTIPLEXED: &str = "connections are multiplexed: a call never waits for a free one";
const AT_START: &str = "read at start-up (theirs: again at each reload)";

/// envoyproxy/ratelimit's variables, in `settings.go`'s order.
pub const SETTINGS: &[(&str, Status)] = &[
    ("HOST", Same("")),
    ("PORT", Same("")),
    ("DEBUG_HOST", Same("the debug listener serves `/rlconfig` only")),
    ("DEBUG_PORT", Same("")),
    ("GRPC_UDS", Same("gRPC on this Unix socket instead of TCP")),
    ("GRPC_HOST", Same("with `GRPC_PORT`; `GRPC_ADDR` (own) wins")),
    ("GRPC_PORT", Same("with `GRPC_HOST`; `GRPC_ADDR` (own) wins")),
    ("GRPC_MAX_CONNECTION_AGE", Same("GOAWAY at the age (±10% jitter per serving thread, theirs per connection); Go duration syntax, default `24h`; `0` never, as grpc-go")),
    ("GRPC_MAX_CONNECTION_AGE_GRACE", Same("Go duration syntax, default `1h`; `0` never closes, as grpc-go")),
    ("GRPC_SERVER_USE_TLS", Same("")),
    ("GRPC_SERVER_TLS_CERT", Same("")),
    ("GRPC_SERVER_TLS_KEY", Same("")),
    ("GRPC_CLIENT_TLS_CACERT", Same("client certificates must chain to this CA alone (theirs adds it to the system roots, so a publicly trusted certificate passes too)")),
    ("GRPC_CLIENT_TLS_SAN", Same("but without `GRPC_CLIENT_TLS_CACERT` (no client certificate is checked) it stops the start, where theirs ignores it: a deployment that believes its clients are checked is told they are not")),
    ("LOG_LEVEL", Same("default `info` (theirs `WARN`); also a tracing filter directive")),
    ("LOG_FORMAT", Same("`json` in any case (their field names: `@timestamp`, `@message`, `level`), else their logfmt off a terminal")),
    ("CONFIG_TYPE", Same("")),
    ("FORCE_START_WITHOUT_INITIAL_CONFIG", Same("until the first limits load, `UNAVAILABLE` (\"no rate limit configuration loaded\"), as theirs answers an error")),
    ("CONFIG_GRPC_XDS_NODE_ID", Same("")),
    ("CONFIG_GRPC_XDS_NODE_METADATA", Same("")),
    ("CONFIG_GRPC_XDS_SERVER_URL", Same("")),
    (
        "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
        NotApplicable("it has no effect there either (their retry interceptor allows no retry); `XDS_CLIENT_BACKOFF_*` set the waits"),
    ),
    ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", Same("")),
    ("CONFIG_GRPC_XDS_SERVER_USE_TLS", Same("")),
    ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", Same("")),
    ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", Same("")),
    ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", Same("")),
    ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", Same("")),
    ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", Same("")),
    ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", Same("")),
    ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", Same("")),
    ("XDS_CLIENT_BACKOFF_JITTER", Same("")),
    ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", Same("")),
    ("USE_DOG_STATSD", Same("statsd with DogStatsD tags (`|#k:v`); refused with `USE_STATSD=true`, as theirs")),
    ("USE_DOG_STATSD_MOGRIFIERS", Same("each read from `DOG_STATSD_MOGRIFIER_<NAME>_PATTERN`, `_NAME`, `_TAGS`")),
    ("USE_STATSD", Same("default off unless `STATSD_HOST` is set (theirs: on); UDP, not TCP")),
    ("STATSD_HOST", Same("")),
    ("STATSD_PORT", Same("")),
    ("EXTRA_TAGS", Same("")),
    ("STATS_FLUSH_INTERVAL", Same("statsd only (Prometheus is scraped)")),
    ("DISABLE_STATS", Own("`METRICS_ADDR=off`")),
    ("USE_PROMETHEUS", Same("metrics are served without it too")),
    ("PROMETHEUS_ADDR", Same("")),
    ("PROMETHEUS_PATH", Same("")),
    (
        "PROMETHEUS_MAPPER_YAML",
        Same("names the `ratelimit_service_*`-style series made from their stat names (`ratekeeper_*` stay); `glob` and `regex` matches, other features refused with file and line"),
    ),
    (
        "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
        Same("with the default mapping; `ratekeeper_request_duration_seconds` stays in seconds"),
    ),
    ("RUNTIME_ROOT", Same("default `/srv/runtime_data/current`; with no `RUNTIME_*` and no `CONFIG_DIR` (own) set, the limits are `./config/*.yaml`")),
    ("RUNTIME_SUBDIRECTORY", Same("")),
    ("RUNTIME_APPDIRECTORY", Same("every file under it, recursively, is a limits file")),
    ("RUNTIME_IGNOREDOTFILES", Same("")),
    ("RUNTIME_WATCH_ROOT", Same("which files are read; changes are found by polling (`RELOAD_INTERVAL_MS`)")),
    ("EXPIRATION_JITTER_MAX_SECONDS", Same("in ms steps, 0 to the maximum included; default 0: none (theirs: 300); negative: none, as theirs; the in-memory store's keys get none")),
    ("LOCAL_CACHE_SIZE_IN_BYTES", Same("the over-limit cache's size, each key counted as its length and 72 bytes; 0 turns it off; negative, 512 KiB (theirs: freecache's least); unset, 12.8 MB, some 100,000 keys (theirs: off); set and not 0, their `ratelimit.localcache.*` stats are sent, as theirs")),
    ("NEAR_LIMIT_RATIO", Same("")),
    ("CACHE_KEY_PREFIX", Same("default `rk:`; the key format differs (see Differences)")),
    ("BACKEND_TYPE", Same("`redis` only: `memcache` stops the start-up")),
    ("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", Same("`charges: drop` per domain or limit consumes nothing at all when refused")),
    ("LIMIT_RESPONSE_HEADERS_ENABLED", Same("")),
    ("LIMIT_LIMIT_HEADER", Same("")),
    ("LIMIT_REMAINING_HEADER", Same("")),
    ("LIMIT_RESET_HEADER", Same("")),
    ("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", Same("")),
    ("REDIS_SOCKET_TYPE", Same("`unix`: `REDIS_URL` is the path of a single Redis's socket; unset, a `REDIS_URL` starting with `/` is one (theirs: `unix` by default); `tcp4` and `tcp6` read as `tcp` (the address picks the family)")),
    ("REDIS_TYPE", Same("")),
    ("REDIS_URL", Same("unset: counters in memory (one replica), with a warning when other `REDIS_*` settings are set (theirs defaults to `/var/run/nutcracker/ratelimit.sock`); a `redis://` URL's `username`, `password` and `db` query parameters are read, as their client reads them")),
    ("REDIS_POOL_SIZE", Same("connections in all, each multiplexed (default 4, at most 1024)")),
    ("REDIS_AUTH", Same("")),
    ("REDIS_TLS", Same("")),
    ("REDIS_TLS_CLIENT_CERT", Same("with `REDIS_TLS_CLIENT_KEY`: one alone is ignored, with a warning")),
    ("REDIS_TLS_CLIENT_KEY", Same("")),
    ("REDIS_TLS_CACERT", Same("")),
    ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", Same("")),
    ("REDIS_PIPELINE_WINDOW", NotApplicable(PIPELINING)),
    ("REDIS_PIPELINE_LIMIT", NotApplicable(PIPELINING)),
    ("REDIS_CLUSTER_PIPELINE_PARALLELISM", NotApplicable(PIPELINING)),
    ("REDIS_PERSECOND", Same("counters of limits whose unit is the second in a second Redis; a request with both kinds is all-or-nothing per Redis (see Redis: topologies and failures)")),
    ("REDIS_PERSECOND_SOCKET_TYPE", Same("as `REDIS_SOCKET_TYPE`")),
    ("REDIS_PERSECOND_TYPE", Same("")),
    ("REDIS_PERSECOND_URL", Same("required with `REDIS_PERSECOND=true` (theirs: a nutcracker socket by default)")),
    ("REDIS_PERSECOND_POOL_SIZE", Same("connections in all, each multiplexed (default `REDIS_POOL_SIZE`)")),
    ("REDIS_PERSECOND_AUTH", Same("")),
    ("REDIS_PERSECOND_TLS", Same("with the certificates of `REDIS_TLS_*`, as theirs")),
    ("REDIS_SENTINEL_AUTH", Same("a password, or `user:password` (split at the first `:`, as theirs)")),
    ("REDIS_PERSECOND_SENTINEL_AUTH", Same("")),
    ("REDIS_PERSECOND_PIPELINE_WINDOW", NotApplicable(PIPELINING)),
    ("REDIS_PERSECOND_PIPELINE_LIMIT", NotApplicable(PIPELINING)),
    ("REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM", NotApplicable(PIPELINING)),
    ("REDIS_HEALTH_CHECK_ACTIVE_CONNECTION", Same("`true`: not ready while a Redis is unreachable, once it has answered (a probe of the store, not a pool's count of connections); unset, a replica stays ready through an outage, as there")),
    ("REDIS_TIMEOUT", Same("the deadline of connecting and of each call, unless `REDIS_CONNECT_TIMEOUT_MS` / `REDIS_TIMEOUT_MS` (own) are set; 0 or negative (theirs: no dial deadline): the defaults")),
    ("REDIS_PERSECOND_TIMEOUT", Same("the deadline of connecting and of each call; default the main Redis's")),
    (
        "REDIS_POOL_ON_EMPTY_BEHAVIOR",
        NotApplicable(MULTIPLEXED),
    ),
    ("REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR", NotApplicable(MULTIPLEXED)),
    (
        "REDIS_STARTUP_INITIAL_INTERVAL",
        NotApplicable("the server starts without Redis and connects in the background (answers follow `FAILURE_MODE` meanwhile)"),
    ),
    (
        "REDIS_STARTUP_MAX_INTERVAL",
        NotApplicable("the server starts without Redis and connects in the background"),
    ),
    (
        "REDIS_STARTUP_MAX_ELAPSED_TIME",
        NotApplicable("the server starts without Redis and connects in the background"),
    ),
    ("MEMCACHE_HOST_PORT", NotApplicable(MEMCACHE)),
    ("MEMCACHE_MAX_IDLE_CONNS", NotApplicable(MEMCACHE)),
    ("MEMCACHE_SRV", NotApplicable(MEMCACHE)),
    ("MEMCACHE_SRV_REFRESH", NotApplicable(MEMCACHE)),
    ("MEMCACHE_TLS", NotApplicable(MEMCACHE)),
    ("MEMCACHE_TLS_CLIENT_CERT", NotApplicable(MEMCACHE)),
    ("MEMCACHE_TLS_CLIENT_KEY", NotApplicable(MEMCACHE)),
    ("MEMCACHE_TLS_CACERT", NotApplicable(MEMCACHE)),
    ("MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION", NotApplicable(MEMCACHE)),
    ("SHADOW_MODE", Same(AT_START)),
    ("QUOTA_MODE", Same(AT_START)),
    ("RESPONSE_DYNAMIC_METADATA", Same(AT_START)),
    ("MERGE_DOMAIN_CONFIG", Same(AT_START)),
    ("TRACING_ENABLED", Same("")),
    ("TRACING_SERVICE_NAME", Same("default `RateLimit`, as theirs")),
    ("TRACING_SERVICE_NAMESPACE", Same("")),
    ("TRACING_SERVICE_INSTANCE_ID", Same("random when empty")),
    ("TRACING_EXPORTER_PROTOCOL", Same("`http` (default) or `grpc`; no TLS to the receiver")),
    ("TRACING_SAMPLING_RATE", Same("")),
];

impl Status {
    /// Why a variable set with this status has no effect (`None`: it has).
    fn ignored_because(self) -> Option<String> {
        match self {
            Same(_) => None,
            Own(own) => Some(format!("use {own}")),
            NotApplicable(why) => Some(why.to_owned()),
        }
    }

    /// The README's "here" column.
    #[cfg(test)]
    fn describe(self) -> String {
        match self {
            Same("") => "same".to_owned(),
            Same(note) => format!("same; {note}"),
            Own(own) => format!("ratekeeper's own {own}"),
            NotApplicable(why) => format!("not applicable: {why}"),
        }
    }
}

/// Those of `set` (names of variables in the environment) that are
/// envoyproxy/ratelimit's and have no effect here, each with why.
pub fn ignored<'a>(set: impl IntoIterator<Item = &'a str>) -> Vec<(&'a str, String)> {
    let mut ignored: Vec<(&str, String)> = set
        .into_iter()
        .filter_map(|name| {
            let (_, status) = SETTINGS.iter().find(|(known, _)| *known == name)?;
            Some((name, status.ignored_because()?))
        })
        .collect();
    ignored.sort();
    ignored
}

/// The names of the variables in the environment (those that are text).
fn environment_names() -> Vec<String> {
    std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .collect()
}

/// Logs, in one warning, every envoyproxy/ratelimit variable set in the
/// environment that has no effect here.
pub fn warn_ignored() {
    let names = environment_names();
    let ignored = ignored(names.iter().map(String::as_str));
    if ignored.is_empty() {
        return;
    }
    let list: Vec<String> = ignored
        .iter()
        .map(|(name, why)| format!("{name} ({why})"))
        .collect();
    tracing::warn!(
        "envoyproxy/ratelimit settings set but ignored: {}",
        list.join("; ")
    );
}

/// Those of `set` (names of variables in the environment) that configure
/// the main Redis, when `REDIS_URL` is not set: the counters then stay in
/// this process, one replica's, where theirs would reach their default
/// `REDIS_URL` (a nutcracker socket); most likely a slip in a deployment
/// moved over.
pub fn redis_settings_without_url<'a>(set: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let set: Vec<&str> = set.into_iter().collect();
    if set.contains(&"REDIS_URL") {
        return Vec::new();
    }
    let mut redis: Vec<&str> = set
        .into_iter()
        .filter(|name| name.starts_with("REDIS_") && !name.starts_with("REDIS_PERSECOND"))
        .collect();
    redis.sort_unstable();
    redis
}

/// Logs a warning when [`redis_settings_without_url`] finds any and no
/// Redis URL was given at all (`url_given`: the flag's or the variable's).
pub fn warn_redis_without_url(url_given: bool) {
    if url_given {
        return;
    }
    warn_naming(
        |set| redis_settings_without_url(set),
        "Redis settings without REDIS_URL: the counters are kept in this process's memory, \
         not shared with other replicas (theirs defaults REDIS_URL to \
         /var/run/nutcracker/ratelimit.sock)",
    );
}

/// The statsd settings among `set` (names of variables in the environment)
/// when no statsd sink is on and `USE_STATSD` is not set (none when it
/// is: statsd was turned off on purpose): theirs sends to `localhost:8125`
/// by default, so a deployment that set only `STATSD_PORT` for a sidecar
/// exporter got its stats there and gets none here.
pub fn statsd_settings_while_off<'a>(set: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    const STATSD: [&str; 3] = ["STATSD_PORT", "STATS_FLUSH_INTERVAL", "EXTRA_TAGS"];
    let set: Vec<&str> = set.into_iter().collect();
    if set.contains(&"USE_STATSD") {
        return Vec::new();
    }
    let mut statsd: Vec<&str> = set
        .into_iter()
        .filter(|name| STATSD.contains(name))
        .collect();
    statsd.sort_unstable();
    statsd
}

/// Logs a warning when statsd is off (`statsd_on`: a sink was configured)
/// and [`statsd_settings_while_off`] finds any.
pub fn warn_statsd_while_off(statsd_on: bool) {
    if statsd_on {
        return;
    }
    warn_naming(
        |set| statsd_settings_while_off(set),
        "statsd settings without STATSD_HOST or USE_STATSD=true: no stats are sent over \
         statsd (theirs sends to localhost:8125 by default)",
    );
}

/// Logs `why`, naming the variables of the environment that `found` picks,
/// when it picks any.
fn warn_naming(found: impl for<'a> Fn(Vec<&'a str>) -> Vec<&'a str>, why: &str) {
    let names = environment_names();
    let set = found(names.iter().map(String::as_str).collect());
    if !set.is_empty() {
        tracing::warn!(set = %set.join(","), "{why}");
    }
}

/// README's table of envoyproxy/ratelimit's settings, as Markdown.
#[cfg(test)]
fn readme_table() -> String {
    let mut table = String::from("| theirs | here |\n|---|---|\n");
    for (name, status) in SETTINGS {
        table.push_str(&format!("| `{name}` | {} |\n", status.describe()));
    }
    table
}

#[cfg(test)]
mod tests {
    use super::{
        ignored, readme_table, redis_settings_without_url, statsd_settings_while_off, Same,
        SETTINGS,
    };

    #[test]
    fn statsd_settings_while_statsd_is_off_are_named() {
        let set = ["STATSD_PORT", "PATH", "EXTRA_TAGS", "USE_PROMETHEUS"];
        assert_eq!(
            statsd_settings_while_off(set),
            ["EXTRA_TAGS", "STATSD_PORT"]
        );
        assert!(statsd_settings_while_off(["PATH", "STATSD_HOST"]).is_empty());
        assert!(statsd_settings_while_off(["STATSD_PORT", "USE_STATSD"]).is_empty());
    }

    #[test]
    fn redis_settings_without_redis_url_are_named() {
        let set = ["REDIS_AUTH", "PATH", "REDIS_TYPE", "REDIS_PERSECOND_URL"];
        assert_eq!(
            redis_settings_without_url(set),
            ["REDIS_AUTH", "REDIS_TYPE"]
        );
        assert!(redis_settings_without_url(["REDIS_URL", "REDIS_AUTH"]).is_empty());
        assert!(redis_settings_without_url(["PATH"]).is_empty());
    }

    const BEGIN: &str = "<!-- settings table: from src/bin/ratekeeper/settings_compat.rs -->\n";
    const END: &str = "<!-- end of settings table -->";

    /// README's table is this module's; `UPDATE_README=1` rewrites it.
    #[test]
    fn readme_table_is_this_table() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
        let readme = std::fs::read_to_string(path).expect("README.md");
        let start = readme
            .find(BEGIN)
            .expect("README has the table's start marker")
            + BEGIN.len();
        let end = start
            + readme[start..]
                .find(END)
                .expect("README has the end marker");
        let table = readme_table();
        if readme[start..end] != table && std::env::var_os("UPDATE_README").is_some() {
            let updated = format!("{}{table}{}", &readme[..start], &readme[end..]);
            std::fs::write(path, updated).expect("write README.md");
            return;
        }
        assert_eq!(
            readme[start..end],
            table,
            "README's settings table is out of date: UPDATE_README=1 cargo test --bin ratekeeper readme_table"
        );
    }

    /// Their names read with `std::env` (listen.rs, envoy_settings.rs) rather
    /// than as a flag's `env`.
    const READ_DIRECTLY: &[&str] = &[
        "HOST",
        "PORT",
        "DEBUG_HOST",
        "DEBUG_PORT",
        "GRPC_SERVER_TLS_CERT",
        "GRPC_SERVER_TLS_KEY",
        "GRPC_CLIENT_TLS_CACERT",
    ];

    /// A "same" row is read, and a variable read is a "same" row: the
    /// table cannot claim what the flags do not do (nor miss what they do).
    #[test]
    fn same_means_read() {
        use clap::CommandFactory;
        let mut read: Vec<String> = crate::cli::Cli::command()
            .get_arguments()
            .filter_map(|arg| arg.get_env())
            .map(|env| env.to_string_lossy().into_owned())
            .collect();
        read.extend(READ_DIRECTLY.iter().map(|name| (*name).to_owned()));
        for (name, status) in SETTINGS {
            let is_read = read.iter().any(|r| r == name);
            assert_eq!(
                is_read,
                matches!(status, Same(_)),
                "{name}: read {is_read}, but the table says {status:?}"
            );
        }
    }

    #[test]
    fn every_setting_is_listed_once() {
        let mut names: Vec<&str> = SETTINGS.iter().map(|(name, _)| *name).collect();
        assert_eq!(names.len(), 114, "settings.go has 114 variables");
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), 114, "a variable is listed twice");
    }

    #[test]
    fn only_theirs_that_do_nothing_are_named() {
        let found = ignored(["MEMCACHE_SRV", "REDIS_URL", "PATH", "DISABLE_STATS"]);
        let names: Vec<&str> = found.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, ["DISABLE_STATS", "MEMCACHE_SRV"]);
        assert!(found[0].1.contains("METRICS_ADDR=off"), "{found:?}");
    }
}
