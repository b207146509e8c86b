//! The binary's reading of settings under envoyproxy/ratelimit's names, so
//! that ratekeeper runs in its place unchanged (Envoy Gateway's Deployment
//! sets only those): where the limits come from (`CONFIG_TYPE`, the xDS
//! client's `CONFIG_GRPC_XDS_*` / `XDS_CLIENT_*`), start-up without limits,
//! and the gRPC server's TLS (`GRPC_SERVER_*`, `GRPC_CLIENT_*`, aliases of
//! ratekeeper's own `GRPC_TLS_*`), where gRPC listens (`GRPC_HOST`,
//! `GRPC_PORT`), the limits directory's layout (`RUNTIME_*`), the backend
//! (`BACKEND_TYPE`) and `REDIS_TIMEOUT`. What is done with each of their
//! variables is listed in `settings_compat`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::ArgAction;
use ratekeeper::config::runtime::Runtime;
use ratekeeper::config::xds_client::{Backoff, ClientTls, XdsSettings};
use ratekeeper::config::{LimitsDir, LoadOptions};
use ratekeeper::service::rls::GlobalModes;
use ratekeeper::tls::TlsFiles;
use ratekeeper::vocab::Topology;
use ratekeeper::{Error, Result};
use rustls::pki_types::ServerName;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};

/// Where the limits come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigType {
    /// The limits directory (the default).
    File,
    /// An xDS server, state of the world.
    GrpcXdsSotw,
}

/// envoyproxy/ratelimit's settings (flattened into the command line).
#[derive(Debug, clap::Args)]
pub struct EnvoySettings {
    /// Where the limits come from: `FILE` (the limits directory) or
    /// `GRPC_XDS_SOTW` (an xDS server; see `CONFIG_GRPC_XDS_*`).
    #[arg(long, env = "CONFIG_TYPE", default_value = "FILE")]
    config_type: String,
    /// Start without limits when none can be loaded yet (a limits directory
    /// that is missing or bad, an xDS server not answering yet): until the
    /// first limits load, ShouldRateLimit answers UNAVAILABLE ("no rate
    /// limit configuration loaded"), as envoyproxy/ratelimit answers an
    /// error.
    #[arg(long, env = "FORCE_START_WITHOUT_INITIAL_CONFIG", value_parser = BoolishValueParser::new())]
    pub force_start_without_initial_config: bool,
    /// Health says NOT_SERVING while the limits in force have no domain.
    #[arg(long, env = "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", value_parser = BoolishValueParser::new())]
    pub healthy_with_at_least_one_config_loaded: bool,
    /// Health says NOT_SERVING while a store is unreachable, once it has
    /// answered (without it, as there, a replica stays ready through an
    /// outage and answers by the failure mode).
    #[arg(long, env = "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION", value_parser = BoolishValueParser::new())]
    pub redis_health_check_active_connection: bool,
    /// A refused request counts only on the fixed windows it takes over
    /// their limit and spares the ones it fitted, unless a limit or domain
    /// sets `charges:`.
    #[arg(long, env = "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", value_parser = BoolishValueParser::new())]
    pub stop_cache_key_increment_when_overlimit: bool,
    /// xDS server, `host:port`.
    #[arg(
        long,
        env = "CONFIG_GRPC_XDS_SERVER_URL",
        default_value = "localhost:18000"
    )]
    xds_server_url: String,
    /// xDS node id (the server's snapshots are keyed by it).
    #[arg(long, env = "CONFIG_GRPC_XDS_NODE_ID", default_value = "default")]
    xds_node_id: String,
    /// xDS node metadata, `k=v,k=v` (string fields).
    #[arg(long, env = "CONFIG_GRPC_XDS_NODE_METADATA", default_value = "")]
    xds_node_metadata: String,
    /// gRPC metadata sent to the xDS server, `k1:v1,k2:v2`.
    #[arg(
        long,
        env = "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
        default_value = ""
    )]
    xds_headers: String,
    /// TLS to the xDS server.
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_USE_TLS", value_parser = BoolishValueParser::new())]
    xds_use_tls: bool,
    /// PEM client certificate presented to the xDS server.
    #[arg(long, env = "CONFIG_GRPC_XDS_CLIENT_TLS_CERT")]
    xds_client_cert: Option<PathBuf>,
    /// PEM client key (PKCS#1, PKCS#8 or SEC1) for the xDS server.
    #[arg(long, env = "CONFIG_GRPC_XDS_CLIENT_TLS_KEY")]
    xds_client_key: Option<PathBuf>,
    /// PEM CA trusted for the xDS server's certificate (besides the
    /// system's roots).
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_TLS_CACERT")]
    xds_server_ca: Option<PathBuf>,
    /// The name the xDS server's certificate must be valid for (default:
    /// the host of CONFIG_GRPC_XDS_SERVER_URL).
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_TLS_SAN")]
    xds_server_san: Option<String>,
    /// First wait before dialling the xDS server again.
    #[arg(long, env = "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", value_parser = crate::parse::duration, default_value = "10s")]
    xds_backoff_initial: Duration,
    /// Longest wait before dialling the xDS server again.
    #[arg(long, env = "XDS_CLIENT_BACKOFF_MAX_INTERVAL", value_parser = crate::parse::duration, default_value = "60s")]
    xds_backoff_max: Duration,
    /// Multiplier of the wait at each failed dial (below 1: the wait stays
    /// the initial one, as in envoyproxy/ratelimit).
    #[arg(long, env = "XDS_CLIENT_BACKOFF_RANDOM_FACTOR", default_value_t = 0.5)]
    xds_backoff_factor: f64,
    /// Randomise each wait between the initial one and its full length.
    #[arg(long, env = "XDS_CLIENT_BACKOFF_JITTER", value_parser = BoolishValueParser::new(), action = ArgAction::Set, default_value = "true")]
    xds_backoff_jitter: bool,
    /// Largest xDS response accepted, in bytes (0: gRPC's 4 MiB). Also read
    /// from XDS_CLIENT_GRPC_OPTIONS_MAX_MSG_SIZE_IN_BYTES.
    #[arg(long, env = "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES")]
    xds_max_message_bytes: Option<usize>,
    /// Serve gRPC over TLS (GRPC_SERVER_TLS_CERT / _KEY). Unset: TLS when
    /// ratekeeper's GRPC_TLS_CERT is set.
    #[arg(long, env = "GRPC_SERVER_USE_TLS", value_parser = BoolishValueParser::new())]
    grpc_server_use_tls: Option<bool>,
    /// The client certificate must be valid for this DNS name or IP.
    #[arg(long, env = "GRPC_CLIENT_TLS_SAN")]
    grpc_client_tls_san: Option<String>,
    /// gRPC listen host (with GRPC_PORT), when GRPC_ADDR is not given.
    #[arg(long, env = "GRPC_HOST", default_value = "0.0.0.0")]
    grpc_host: String,
    /// gRPC listen port (with GRPC_HOST), when GRPC_ADDR is not given.
    #[arg(long, env = "GRPC_PORT", default_value_t = 8081)]
    grpc_port: u16,
    /// Serve gRPC on this Unix socket instead of TCP (GRPC_ADDR, GRPC_HOST
    /// and GRPC_PORT then unused). A socket file left by an earlier run is
    /// replaced.
    #[arg(long, env = "GRPC_UDS")]
    pub grpc_uds: Option<PathBuf>,
    /// The counters' store: `redis` (REDIS_URL; unset: in memory). The
    /// memcache backend is not supported.
    #[arg(long, env = "BACKEND_TYPE", default_value = "redis")]
    backend_type: String,
    /// Deadline of connecting to Redis and of each call (Go syntax, e.g.
    /// `10s`), unless REDIS_CONNECT_TIMEOUT_MS / REDIS_TIMEOUT_MS are given.
    #[arg(long, env = "REDIS_TIMEOUT", value_parser = crate::parse::redis_timeout)]
    pub redis_timeout: Option<Duration>,
    /// `tcp` or `unix`: with `unix` (a single Redis), REDIS_URL is the path
    /// of Redis's Unix socket. Unset: a REDIS_URL starting with `/` is one.
    #[arg(long, env = "REDIS_SOCKET_TYPE")]
    redis_socket_type: Option<String>,
    /// Password of the sentinels (REDIS_TYPE=sentinel); REDIS_AUTH is the
    /// master's. Never logged.
    #[arg(long, env = "REDIS_SENTINEL_AUTH", hide_env_values = true)]
    redis_sentinel_auth: Option<String>,
    /// Redis TLS: check the certificate chain but not that it names the
    /// host (single Redis and cluster).
    #[arg(long, env = "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", value_parser = BoolishValueParser::new())]
    pub redis_tls_skip_hostname_verification: bool,
    /// The most seconds added, at random, to the TTL of the Redis keys a
    /// call creates, so that the keys of one window do not all expire at
    /// once; decisions do not change. Default 0: none (theirs: 300); a
    /// negative value is none, as there.
    #[arg(
        long,
        env = "EXPIRATION_JITTER_MAX_SECONDS",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    expiration_jitter_max_seconds: i64,
    /// Size of the over-limit cache (keys known to be full until their
    /// window ends, answered without Redis), in bytes, each key counted
    /// by its length; 0 turns it off. Unset: 12800000 (some 100,000 keys).
    /// A negative size is their cache library's least, 512 KiB.
    #[arg(long, env = "LOCAL_CACHE_SIZE_IN_BYTES", allow_negative_numbers = true)]
    local_cache_size_in_bytes: Option<i64>,
    /// envoyproxy/ratelimit's runtime root. With any RUNTIME_* set (and no
    /// CONFIG_DIR), the limits are every file under
    /// `$RUNTIME_ROOT/$RUNTIME_SUBDIRECTORY/$RUNTIME_APPDIRECTORY`.
    #[arg(long, env = "RUNTIME_ROOT")]
    runtime_root: Option<PathBuf>,
    /// Subdirectory of the runtime root.
    #[arg(long, env = "RUNTIME_SUBDIRECTORY")]
    runtime_subdirectory: Option<String>,
    /// The runtime's app directory (under the subdirectory).
    #[arg(long, env = "RUNTIME_APPDIRECTORY")]
    runtime_appdirectory: Option<String>,
    /// Skip files and directories named `.*` under the app directory.
    #[arg(long, env = "RUNTIME_IGNOREDOTFILES", value_parser = BoolishValueParser::new())]
    runtime_ignoredotfiles: Option<bool>,
    /// true: read the files of the subdirectory whose path starts with
    /// `$RUNTIME_APPDIRECTORY.` (`/` read as `.`); false: every file under
    /// the app directory.
    #[arg(long, env = "RUNTIME_WATCH_ROOT", value_parser = BoolishValueParser::new())]
    runtime_watch_root: Option<bool>,
}

/// The value of the first of `names` set (and not empty) in the
/// environment: a setting known under several names.
pub fn first_env(names: &[&str]) -> Option<String> {
    names
        .iter()
        .find_map(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
}

impl EnvoySettings {
    /// The limits' directory and layout: `given` (CONFIG_DIR) as a flat
    /// directory; else envoyproxy/ratelimit's runtime layout when any
    /// RUNTIME_* is set (their defaults for the others); else `config`.
    pub fn limits_dir(&self, given: Option<PathBuf>) -> LimitsDir {
        if let Some(dir) = given {
            return LimitsDir::Flat(dir);
        }
        let runtime_set = self.runtime_root.is_some()
            || self.runtime_subdirectory.is_some()
            || self.runtime_appdirectory.is_some()
            || self.runtime_ignoredotfiles.is_some()
            || self.runtime_watch_root.is_some();
        if !runtime_set {
            return LimitsDir::Flat(PathBuf::from("config"));
        }
        let runtime = Runtime {
            root: self
                .runtime_root
                .clone()
                .unwrap_or_else(|| PathBuf::from("/srv/runtime_data/current")),
            subdirectory: self.runtime_subdirectory.clone().unwrap_or_default(),
            app_directory: self
                .runtime_appdirectory
                .clone()
                .unwrap_or_else(|| "config".into()),
            ignore_dotfiles: self.runtime_ignoredotfiles.unwrap_or(false),
            watch_root: self.runtime_watch_root.unwrap_or(true),
        };
        if runtime.watch_root && runtime.subdirectory.is_empty() {
            tracing::warn!("RUNTIME_SUBDIRECTORY is empty with RUNTIME_WATCH_ROOT=true: no limits files are read (as envoyproxy/ratelimit)");
        }
        LimitsDir::Runtime(runtime)
    }

    /// The gRPC listen address: `own` (GRPC_ADDR), else
    /// `$GRPC_HOST:$GRPC_PORT`.
    pub fn grpc_addr(&self, own: Option<std::net::SocketAddr>) -> String {
        match own {
            Some(addr) => addr.to_string(),
            None => join_host_port(&self.grpc_host, self.grpc_port),
        }
    }

    /// The main Redis's REDIS_SOCKET_TYPE and REDIS_SENTINEL_AUTH (see
    /// [`redis_url`]).
    pub fn redis_extras(&self) -> (Option<&str>, Option<&str>) {
        (
            self.redis_socket_type.as_deref(),
            self.redis_sentinel_auth.as_deref(),
        )
    }

    /// EXPIRATION_JITTER_MAX_SECONDS as a duration: at most a year (a TTL
    /// Redis and the limiter's arithmetic both take).
    pub fn expiry_jitter(&self) -> Result<Duration> {
        const MOST: u64 = 365 * 24 * 3600;
        match u64::try_from(self.expiration_jitter_max_seconds).unwrap_or(0) {
            seconds if seconds <= MOST => Ok(Duration::from_secs(seconds)),
            seconds => Err(startup(format!(
                "EXPIRATION_JITTER_MAX_SECONDS {seconds} is more than a year ({MOST})"
            ))),
        }
    }

    /// The over-limit cache's size in bytes, LOCAL_CACHE_SIZE_IN_BYTES
    /// (`None`: the default). Below 0 it is freecache's least, 512 KiB:
    /// theirs turns the cache on for any size but 0, and freecache raises
    /// a smaller one to that.
    pub fn over_cache_bytes(&self) -> Option<usize> {
        const FREECACHE_LEAST: usize = 512 * 1024;
        self.local_cache_size_in_bytes
            .map(|bytes| usize::try_from(bytes).unwrap_or(FREECACHE_LEAST))
    }

    /// Refuses a backend other than Redis (or memory, without REDIS_URL).
    pub fn check_backend(&self) -> Result<()> {
        match self.backend_type.to_ascii_lowercase().as_str() {
            "redis" | "" => Ok(()),
            "memcache" => Err(startup(
                "BACKEND_TYPE=memcache is not supported: ratekeeper keeps counters in Redis (REDIS_URL) or, without it, in memory",
            )),
            other => Err(startup(format!(
                "BACKEND_TYPE {other:?} is not supported: redis (the default)"
            ))),
        }
    }

    pub fn config_type(&self) -> Result<ConfigType> {
        match self.config_type.to_ascii_uppercase().as_str() {
            "FILE" => Ok(ConfigType::File),
            "GRPC_XDS_SOTW" => Ok(ConfigType::GrpcXdsSotw),
            _ => Err(Error::Startup(format!(
                "CONFIG_TYPE {:?} is not supported: FILE (limits files) or GRPC_XDS_SOTW (xDS, state of the world)",
                self.config_type
            ))),
        }
    }

    /// The xDS client's settings.
    pub fn xds(&self) -> Result<XdsSettings> {
        let max_message_bytes = match self.xds_max_message_bytes {
            Some(bytes) => Some(bytes),
            None => first_env(&["XDS_CLIENT_GRPC_OPTIONS_MAX_MSG_SIZE_IN_BYTES"])
                .map(|v| {
                    v.trim().parse::<usize>().map_err(|_| {
                        startup(format!("XDS_CLIENT_GRPC_OPTIONS_MAX_MSG_SIZE_IN_BYTES {v:?}: not a number of bytes"))
                    })
                })
                .transpose()?,
        };
        Ok(XdsSettings {
            server: self.xds_server_url.clone(),
            node_id: self.xds_node_id.clone(),
            node_metadata: node_metadata(&self.xds_node_metadata),
            headers: headers(&self.xds_headers)?,
            max_message_bytes: max_message_bytes.filter(|&b| b > 0),
            backoff: Backoff {
                initial: self.xds_backoff_initial,
                max: self.xds_backoff_max,
                factor: self.xds_backoff_factor,
                jitter: self.xds_backoff_jitter,
            },
            tls: self.xds_tls()?,
            // Set from EnvoyModes by the caller.
            load_options: LoadOptions::default(),
        })
    }

    fn xds_tls(&self) -> Result<Option<ClientTls>> {
        if !self.xds_use_tls {
            return Ok(None);
        }
        let identity = match (&self.xds_client_cert, &self.xds_client_key) {
            (Some(cert), Some(key)) => Some((cert.as_path(), key.as_path())),
            (None, None) => None,
            _ => return Err(startup(
                "CONFIG_GRPC_XDS_CLIENT_TLS_CERT and CONFIG_GRPC_XDS_CLIENT_TLS_KEY go together",
            )),
        };
        let config = ratekeeper::tls::client_config(self.xds_server_ca.as_deref(), identity)?;
        let name = match &self.xds_server_san {
            Some(san) => san.clone(),
            None => host(&self.xds_server_url).to_owned(),
        };
        let server_name = ServerName::try_from(name.clone()).map_err(|e| {
            startup(format!(
                "xDS server name {name:?} (CONFIG_GRPC_XDS_SERVER_TLS_SAN): {e}"
            ))
        })?;
        Ok(Some(ClientTls {
            config: Arc::new(config),
            server_name,
        }))
    }

    /// The gRPC server's TLS files: envoyproxy/ratelimit's names, or
    /// ratekeeper's own (`own_*`, given first). `GRPC_CLIENT_TLS_CACERT`
    /// requires client certificates; Envoy Gateway's
    /// `GRPC_SERVER_TLS_CA_CERT` (a name envoyproxy/ratelimit does not read)
    /// checks the certificates clients present without requiring one.
    pub fn grpc_tls(
        &self,
        own_cert: Option<&Path>,
        own_key: Option<&Path>,
        own_client_ca: Option<&Path>,
    ) -> Result<Option<TlsFiles>> {
        let path = |own: Option<&Path>, name: &str| {
            own.map(Path::to_path_buf)
                .or_else(|| first_env(&[name]).map(PathBuf::from))
        };
        // Their certificate alone serves plaintext, as theirs does
        // (GRPC_SERVER_USE_TLS defaults to false); ratekeeper's own turns
        // TLS on.
        if !self.grpc_server_use_tls.unwrap_or(own_cert.is_some()) {
            return Ok(None);
        }
        let cert = path(own_cert, "GRPC_SERVER_TLS_CERT");
        let key = path(own_key, "GRPC_SERVER_TLS_KEY");
        let (Some(cert), Some(key)) = (cert, key) else {
            return Err(startup(
                "gRPC TLS needs a certificate and a key: GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY (or GRPC_TLS_CERT and GRPC_TLS_KEY)",
            ));
        };
        let required = path(own_client_ca, "GRPC_CLIENT_TLS_CACERT");
        let client_ca = required
            .clone()
            .or_else(|| first_env(&["GRPC_SERVER_TLS_CA_CERT"]).map(PathBuf::from));
        if self.grpc_client_tls_san.is_some() && client_ca.is_none() {
            return Err(startup(
                "GRPC_CLIENT_TLS_SAN needs a CA to check client certificates: GRPC_CLIENT_TLS_CACERT",
            ));
        }
        Ok(Some(TlsFiles {
            cert,
            key,
            client_ca,
            client_cert_required: required.is_some(),
            client_san: self.grpc_client_tls_san.clone(),
        }))
    }
}

fn startup(message: impl Into<String>) -> Error {
    Error::Startup(message.into())
}

/// A Redis URL with envoyproxy/ratelimit's `<var>_SOCKET_TYPE`
/// (`socket_type`) and `<var>_SENTINEL_AUTH` (`sentinel_auth`) applied: a
/// socket path as a `unix://` URL, the sentinels' credentials in each
/// sentinel's address; and each `redis://` address's `username`,
/// `password` and `db` query parameters, which their client reads, where
/// redis-rs reads them ([`with_query_credentials`]). `var` (`REDIS`,
/// `REDIS_PERSECOND`) names the variables in errors.
pub fn redis_url(
    var: &str,
    url: &str,
    topology: Topology,
    socket_type: Option<&str>,
    sentinel_auth: Option<&str>,
) -> Result<String> {
    let unix = match socket_type.map(str::to_ascii_lowercase) {
        None => url.starts_with('/'),
        Some(kind) if kind == "unix" => true,
        // Go's networks: tcp4 and tcp6 pick the address family there; here
        // the address does.
        Some(kind) if matches!(kind.as_str(), "tcp" | "tcp4" | "tcp6" | "") => false,
        Some(other) => {
            return Err(startup(format!(
                "{var}_SOCKET_TYPE {other:?} is not supported: tcp or unix"
            )))
        }
    };
    // A single Redis's URL is one (a ',' in its password stays); cluster
    // and sentinel list addresses.
    let url = &match topology {
        Topology::Single => with_query_credentials(url),
        _ => url
            .split(',')
            .map(with_query_credentials)
            .collect::<Vec<_>>()
            .join(","),
    };
    match topology {
        Topology::Single if unix && !url.contains("://") => {
            let path = std::path::absolute(url)
                .map_err(|e| startup(format!("{var}_URL: the socket path: {e}")))?;
            Ok(format!("unix://{}", path.display()))
        }
        Topology::Sentinel => Ok(match sentinel_auth {
            Some(auth) if !auth.is_empty() => with_sentinel_password(url, auth),
            _ => url.to_owned(),
        }),
        _ => Ok(url.to_owned()),
    }
}

/// `mastername,host:port,...` with `auth` in each sentinel's address:
/// `user:password` (split at the first `:`, as theirs) as
/// `redis://user:password@host:port`, a lone password as
/// `redis://:password@host:port`; an address given as a URL is kept.
fn with_sentinel_password(url: &str, auth: &str) -> String {
    let userinfo = match auth.split_once(':') {
        Some((user, password)) => {
            format!("{}:{}", percent_encoded(user), percent_encoded(password))
        }
        None => format!(":{}", percent_encoded(auth)),
    };
    url.split(',')
        .enumerate()
        .map(|(i, part)| {
            let part = part.trim();
            if i == 0 || part.is_empty() || part.contains("://") {
                part.to_owned()
            } else {
                format!("redis://{userinfo}@{part}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// A `redis://` address whose query names `username`, `password` or `db`
/// (radix, their client, reads them) with those moved into its user info
/// and path, where redis-rs reads them; what the address already says
/// there wins, as in radix. Other query parameters stay; any other address
/// is kept as it is.
fn with_query_credentials(address: &str) -> String {
    let Some((base, query)) = address
        .strip_prefix("redis://")
        .and_then(|rest| rest.split_once('?'))
    else {
        return address.to_owned();
    };
    let (mut user, mut password, mut db, mut others) = (None, None, None, Vec::new());
    // The first of a name counts, as Go's `url.Values.Get` takes it.
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("username", v)) => user = user.or_else(|| Some(query_text(v))),
            Some(("password", v)) => password = password.or_else(|| Some(query_text(v))),
            Some(("db", v)) => db = db.or(Some(v)),
            _ => others.push(pair),
        }
    }
    let (authority, path) = base.split_at(base.find('/').unwrap_or(base.len()));
    let (userinfo, host) = match authority.rsplit_once('@') {
        Some((userinfo, host)) => (Some(userinfo.to_owned()), host),
        None => (None, authority),
    };
    let userinfo = userinfo.or_else(|| match (&user, &password) {
        (None, None) => None,
        _ => Some(format!(
            "{}:{}",
            percent_encoded(user.as_deref().unwrap_or("")),
            percent_encoded(password.as_deref().unwrap_or(""))
        )),
    });
    let path = match (path, db) {
        ("" | "/", Some(db)) if !db.is_empty() => format!("/{db}"),
        _ => path.to_owned(),
    };
    let mut url = String::from("redis://");
    if let Some(userinfo) = userinfo {
        url.push_str(&userinfo);
        url.push('@');
    }
    url.push_str(host);
    url.push_str(&path);
    if !others.is_empty() {
        url.push('?');
        url.push_str(&others.join("&"));
    }
    url
}

/// A query value decoded ([`ratekeeper::query::decode`]); as written when it
/// does not decode to UTF-8.
fn query_text(value: &str) -> String {
    ratekeeper::query::decode(value).unwrap_or_else(|_| value.to_owned())
}

/// `text` percent-encoded for a URL's user info (unreserved bytes kept).
fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The host of `host:port` (`[v6]:port` too).
fn host(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// `k=v,k=v` pairs; entries without `=` are skipped, as envoyproxy/ratelimit
/// does.
fn node_metadata(text: &str) -> Vec<(String, String)> {
    text.split(',')
        .filter_map(|entry| entry.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// `k1:v1,k2:v2` as gRPC metadata (keys lower-cased, as Go's gRPC does).
fn headers(text: &str) -> Result<MetadataMap> {
    let mut map = MetadataMap::new();
    for entry in text.split(',').filter(|e| !e.trim().is_empty()) {
        let bad = || {
            startup(format!(
                "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS: {entry:?} is not name:value (a header name and an ASCII value)"
            ))
        };
        let (name, value) = entry.split_once(':').ok_or_else(bad)?;
        let name = MetadataKey::from_bytes(name.trim().to_ascii_lowercase().as_bytes())
            .map_err(|_| bad())?;
        let value = MetadataValue::try_from(value.trim()).map_err(|_| bad())?;
        map.append(name, value);
    }
    Ok(map)
}

/// envoyproxy/ratelimit's global switches of the answer (`SetConfig` in
/// their `src/service/ratelimit.go`), all off by default.
#[derive(Debug, clap::Args)]
pub struct EnvoyModes {
    /// Never answer OVER_LIMIT; what would have been is counted
    /// (`ratekeeper_global_shadow_mode`). Descriptor statuses still say it.
    #[arg(long = "global-shadow-mode", env = "SHADOW_MODE", value_parser = BoolishValueParser::new())]
    shadow_mode: bool,
    /// Every descriptor is a quota descriptor: the request is OVER_LIMIT only
    /// when all of them are.
    #[arg(long = "global-quota-mode", env = "QUOTA_MODE", value_parser = BoolishValueParser::new())]
    quota_mode: bool,
    /// Describe the request in the response's `dynamic_metadata` (domain,
    /// descriptors, hits, and the `metadata` of the rules it passed).
    #[arg(long, env = "RESPONSE_DYNAMIC_METADATA", value_parser = BoolishValueParser::new())]
    response_dynamic_metadata: bool,
    /// Files of one domain merge into it (a key/value both define is
    /// refused, both files named); off, a second file of a domain is refused.
    #[arg(long, env = "MERGE_DOMAIN_CONFIG", value_parser = BoolishValueParser::new())]
    merge_domain_config: bool,
}

impl EnvoyModes {
    pub fn modes(&self) -> GlobalModes {
        GlobalModes {
            shadow: self.shadow_mode,
            quota: self.quota_mode,
            dynamic_metadata: self.response_dynamic_metadata,
        }
    }

    pub fn load_options(&self) -> LoadOptions {
        LoadOptions {
            merge_domains: self.merge_domain_config,
        }
    }
}

/// A listen address from their `*_HOST` and `*_PORT`, as Go's
/// `net.JoinHostPort` makes it: an IPv6 host in brackets, and an empty
/// host (the variable set to nothing) every interface, as their `:PORT`
/// listens.
pub fn join_host_port(host: &str, port: impl std::fmt::Display) -> String {
    match host {
        "" => format!("0.0.0.0:{port}"),
        host if host.contains(':') => format!("[{host}]:{port}"),
        host => format!("{host}:{port}"),
    }
}

#[cfg(test)]
mod tests {
    use super::{
        headers, host, node_metadata, redis_url, with_query_credentials, with_sentinel_password,
    };
    use ratekeeper::vocab::Topology;

    #[test]
    fn their_list_formats_are_read_as_theirs() {
        let map = headers("X-Team:rate, authorization:Bearer abc").expect("headers");
        assert_eq!(
            map.get("x-team").and_then(|v| v.to_str().ok()),
            Some("rate")
        );
        assert_eq!(
            map.get("authorization").and_then(|v| v.to_str().ok()),
            Some("Bearer abc")
        );
        assert!(headers("").expect("empty").is_empty());
        assert!(headers("no-colon").is_err());
        assert_eq!(
            node_metadata("a=1,b,c=x=y"),
            [("a".into(), "1".into()), ("c".into(), "x=y".into())]
        );
        assert_eq!(host("envoy-gateway:18001"), "envoy-gateway");
        assert_eq!(host("[::1]:18001"), "::1");
        // user:password split at the first ':', as theirs (strings.Cut).
        assert_eq!(
            with_sentinel_password("mymaster, s1:26379,redis://s2:26379", "p@ss:w:x"),
            "mymaster,redis://p%40ss:w%3Ax@s1:26379,redis://s2:26379"
        );
        assert_eq!(
            with_sentinel_password("mymaster,s1:26379", "s3cret"),
            "mymaster,redis://:s3cret@s1:26379"
        );
    }

    /// radix's query parameters, moved where redis-rs reads them; what the
    /// address says itself wins, as in radix's parseRedisURL.
    #[test]
    fn a_urls_query_credentials_and_db_are_read_as_radix_reads_them() {
        for (given, read) in [
            (
                "redis://h:6379?password=s%40cret",
                "redis://:s%40cret@h:6379",
            ),
            (
                "redis://h:6379?username=u&password=p&db=3",
                "redis://u:p@h:6379/3",
            ),
            ("redis://h:6379/2?db=3", "redis://h:6379/2"),
            ("redis://x:y@h:6379?password=p", "redis://x:y@h:6379"),
            (
                "redis://h:6379?db=1&protocol=resp2",
                "redis://h:6379/1?protocol=resp2",
            ),
            ("redis://h:6379?password=a+b%3A", "redis://:a%20b%3A@h:6379"),
            ("redis://h:6379?db=1&db=2", "redis://h:6379/1"),
            ("redis://h:6379", "redis://h:6379"),
            ("rediss://h:6379?password=p", "rediss://h:6379?password=p"),
            ("h:6379", "h:6379"),
        ] {
            assert_eq!(with_query_credentials(given), read, "{given}");
        }
        // A single Redis's URL is not a list: a ',' in its password stays.
        let single = redis_url(
            "REDIS",
            "redis://h:6379?password=a,b",
            Topology::Single,
            None,
            None,
        );
        assert_eq!(single.ok().as_deref(), Some("redis://:a%2Cb@h:6379"));
    }
}
