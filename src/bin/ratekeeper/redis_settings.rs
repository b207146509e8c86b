//! The binary's Redis stores: the main Redis (`REDIS_*`) and
//! envoyproxy/ratelimit's second Redis for per-second limits
//! (`REDIS_PERSECOND_*`, read here), each made into a store by the one
//! function [`store`], so both take every topology, Unix sockets, TLS and
//! sentinel passwords alike.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{Args, ValueEnum};
use ratekeeper::store::{RedisSettings, RedisStore, RedisTls, Role, Store};
use ratekeeper::vocab::Topology;
use ratekeeper::{Error, Result};

use crate::envoy_settings::redis_url;
use crate::parse::or_default;
use crate::read_file as read;

/// Connections to a Redis or serving threads, as clap reads them: at most
/// 1024, a bound far past any use that stops a typo from opening millions
/// of connections or threads before anything is served.
pub fn at_most_1024(text: &str) -> std::result::Result<usize, String> {
    const MAX: usize = 1024;
    match text.trim().parse::<usize>() {
        Ok(n) if n <= MAX => Ok(n),
        Ok(n) => Err(format!("{n} is more than {MAX}")),
        Err(_) => Err(format!("{text:?} is not a whole number")),
    }
}

/// `--redis-type`, `--redis-persecond-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TopologyArg {
    Single,
    Cluster,
    Sentinel,
}

impl From<TopologyArg> for Topology {
    fn from(arg: TopologyArg) -> Self {
        match arg {
            TopologyArg::Single => Topology::Single,
            TopologyArg::Cluster => Topology::Cluster,
            TopologyArg::Sentinel => Topology::Sentinel,
        }
    }
}

/// envoyproxy/ratelimit's second Redis: with `REDIS_PERSECOND=true`, the
/// counters of limits whose unit is the second live there, all others in
/// the main Redis. TLS certificates (`REDIS_TLS_CACERT`,
/// `REDIS_TLS_CLIENT_*`) are the main Redis's, as theirs.
#[derive(Debug, Args)]
pub struct PerSecondArgs {
    /// Keep the counters of per-second limits in a second Redis
    /// (REDIS_PERSECOND_URL).
    #[arg(long, env = "REDIS_PERSECOND", value_parser = BoolishValueParser::new())]
    redis_persecond: bool,
    /// The per-second Redis, written as REDIS_URL.
    #[arg(long, env = "REDIS_PERSECOND_URL")]
    redis_persecond_url: Option<String>,
    /// The per-second Redis's topology.
    #[arg(long, env = "REDIS_PERSECOND_TYPE", value_enum, ignore_case = true, default_value_t = TopologyArg::Single)]
    redis_persecond_type: TopologyArg,
    /// The per-second Redis's password, or `user:password`. Never logged.
    #[arg(long, env = "REDIS_PERSECOND_AUTH", hide_env_values = true)]
    redis_persecond_auth: Option<String>,
    /// TLS to the per-second Redis (also implied by a `rediss://` URL).
    #[arg(long, env = "REDIS_PERSECOND_TLS", value_parser = BoolishValueParser::new())]
    redis_persecond_tls: bool,
    /// Connections to the per-second Redis, in all. Default: REDIS_POOL_SIZE.
    #[arg(long, env = "REDIS_PERSECOND_POOL_SIZE", value_parser = at_most_1024)]
    redis_persecond_pool_size: Option<usize>,
    /// `tcp` or `unix`, as REDIS_SOCKET_TYPE.
    #[arg(long, env = "REDIS_PERSECOND_SOCKET_TYPE")]
    redis_persecond_socket_type: Option<String>,
    /// The per-second sentinels' password. Never logged.
    #[arg(long, env = "REDIS_PERSECOND_SENTINEL_AUTH", hide_env_values = true)]
    redis_persecond_sentinel_auth: Option<String>,
    /// Deadline of connecting to the per-second Redis and of each call (Go
    /// syntax). Default: the main Redis's deadlines.
    #[arg(long, env = "REDIS_PERSECOND_TIMEOUT", value_parser = crate::parse::redis_timeout)]
    redis_persecond_timeout: Option<Duration>,
}

/// One Redis as its flags describe it.
pub struct Redis<'a> {
    /// The prefix of its variables (`REDIS`, `REDIS_PERSECOND`), for errors.
    pub var: &'static str,
    /// The store it holds, named in its log lines.
    pub role: Role,
    pub url: &'a str,
    pub topology: Topology,
    pub auth: Option<String>,
    /// TLS asked for (a `rediss://` URL asks too).
    pub tls: bool,
    pub connections: usize,
    pub socket_type: Option<&'a str>,
    pub sentinel_auth: Option<&'a str>,
    pub connect_timeout: Duration,
    pub call_timeout: Duration,
}

/// What both Redis stores share.
pub struct Shared<'a> {
    /// `REDIS_TLS_CACERT`, `REDIS_TLS_CLIENT_CERT` and `_KEY`: read only
    /// for a Redis with TLS.
    pub tls_ca: Option<&'a Path>,
    pub tls_client: Option<(&'a Path, &'a Path)>,
    pub skip_hostname_verification: bool,
    pub lanes: usize,
    pub functions: bool,
    pub expiry_jitter: Duration,
}

/// The store of `redis`; errors name its variables.
pub fn store(redis: Redis<'_>, shared: &Shared<'_>) -> Result<Store> {
    let var = redis.var;
    let settings = settings(redis, shared)?;
    let store =
        RedisStore::new(&settings, None).map_err(|e| Error::Startup(format!("{var}_URL: {e}")))?;
    Ok(Store::Redis(Arc::new(store)))
}

fn settings(redis: Redis<'_>, shared: &Shared<'_>) -> Result<RedisSettings> {
    let tls = if redis.tls || redis.url.starts_with("rediss://") {
        ratekeeper::tls::check_client_files(shared.tls_ca, shared.tls_client)?;
        let client = match shared.tls_client {
            Some((cert, key)) => Some((read(cert)?, read(key)?)),
            None => None,
        };
        Some(RedisTls {
            ca: match shared.tls_ca {
                Some(ca) => Some(ratekeeper::tls::pem_with_system_roots(&read(ca)?)),
                None => None,
            },
            client,
            skip_hostname_verification: shared.skip_hostname_verification,
        })
    } else {
        None
    };
    Ok(RedisSettings {
        tls,
        topology: redis.topology,
        url: redis_url(
            redis.var,
            redis.url,
            redis.topology,
            redis.socket_type,
            redis.sentinel_auth,
        )?,
        store: redis.role.name(),
        auth: redis.auth,
        connections: redis.connections,
        lanes: shared.lanes,
        connect_timeout: redis.connect_timeout,
        call_timeout: redis.call_timeout,
        functions: shared.functions,
        expiry_jitter: shared.expiry_jitter,
    })
}

impl PerSecondArgs {
    /// The per-second Redis, when REDIS_PERSECOND is on; `main` is the main
    /// Redis (its pool size and deadlines are the defaults here), `None`
    /// when counters are in memory, which leaves no second Redis to add.
    pub fn redis<'a>(&'a self, main: Option<&Redis<'_>>) -> Result<Option<Redis<'a>>> {
        if !self.redis_persecond {
            return Ok(None);
        }
        let Some(main) = main else {
            return Err(Error::Startup(
                "REDIS_PERSECOND=true needs REDIS_URL too: without it counters are kept in memory"
                    .into(),
            ));
        };
        let Some(url) = self
            .redis_persecond_url
            .as_deref()
            .filter(|u| !u.is_empty())
        else {
            return Err(Error::Startup(
                "REDIS_PERSECOND=true needs REDIS_PERSECOND_URL".into(),
            ));
        };
        Ok(Some(Redis {
            var: "REDIS_PERSECOND",
            role: Role::PerSecond,
            url,
            topology: self.redis_persecond_type.into(),
            auth: self.redis_persecond_auth.clone(),
            tls: self.redis_persecond_tls,
            connections: self.redis_persecond_pool_size.unwrap_or(main.connections),
            socket_type: self.redis_persecond_socket_type.as_deref(),
            sentinel_auth: self.redis_persecond_sentinel_auth.as_deref(),
            connect_timeout: or_default(self.redis_persecond_timeout)
                .unwrap_or(main.connect_timeout),
            call_timeout: or_default(self.redis_persecond_timeout).unwrap_or(main.call_timeout),
        }))
    }
}
