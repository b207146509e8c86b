//! The binary's stats settings under envoyproxy/ratelimit's names: the
//! statsd sink (`USE_STATSD`, `STATSD_HOST`, `STATSD_PORT`, `EXTRA_TAGS`,
//! `STATS_FLUSH_INTERVAL`), DogStatsD (`USE_DOG_STATSD`,
//! `USE_DOG_STATSD_MOGRIFIERS`), the mapping of their stat names to
//! Prometheus series (`PROMETHEUS_MAPPER_YAML`,
//! `PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS`) and where `near_limit`
//! starts (`NEAR_LIMIT_RATIO`).

use std::time::Duration;

use clap::builder::BoolishValueParser;
use ratekeeper::dogstatsd::Mogrifiers;
use ratekeeper::service::rls::NearLimitRatio;
use ratekeeper::stat_mapper::Mapper;
use ratekeeper::statsd::StatsdSettings;
use ratekeeper::{Error, Result};

/// Stats settings (flattened into the command line).
#[derive(Debug, clap::Args)]
pub struct StatsSettings {
    /// Send counters to a statsd server under envoyproxy/ratelimit's stat
    /// names. Off unless set to true, or STATSD_HOST is given (theirs
    /// defaults to on: see the README's differences).
    #[arg(long, env = "USE_STATSD", value_parser = BoolishValueParser::new())]
    use_statsd: Option<bool>,
    /// The statsd server's host (default `localhost`).
    #[arg(long, env = "STATSD_HOST")]
    statsd_host: Option<String>,
    /// The statsd server's UDP port.
    #[arg(long, env = "STATSD_PORT", default_value_t = 8125)]
    statsd_port: u16,
    /// Tags added to every statsd stat, `key:value,key:value`.
    #[arg(long, env = "EXTRA_TAGS", default_value = "")]
    extra_tags: String,
    /// How often statsd counters are sent.
    #[arg(long, env = "STATS_FLUSH_INTERVAL", value_parser = crate::parse::duration, default_value = "10s")]
    stats_flush_interval: Duration,
    /// Send statsd stats DogStatsD's way: tags as `|#key:value`, names
    /// through the mogrifiers. Not with USE_STATSD=true (as theirs).
    #[arg(long, env = "USE_DOG_STATSD", value_parser = BoolishValueParser::new(), default_value_t = false)]
    use_dog_statsd: bool,
    /// DogStatsD mogrifiers to apply, comma-separated names, each defined by
    /// DOG_STATSD_MOGRIFIER_<NAME>_PATTERN, _NAME and _TAGS.
    #[arg(long, env = "USE_DOG_STATSD_MOGRIFIERS", default_value = "")]
    use_dog_statsd_mogrifiers: String,
    /// A statsd_exporter mapping file that names the `ratelimit_service_*`
    /// series (empty: envoyproxy/ratelimit's own mapping, as theirs).
    #[arg(long, env = "PROMETHEUS_MAPPER_YAML", default_value = "")]
    prometheus_mapper_yaml: String,
    /// With the default mapping, `ratelimit_service_response_time_seconds`
    /// in milliseconds (as theirs, the name stays).
    #[arg(long, env = "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", value_parser = BoolishValueParser::new(), default_value_t = false)]
    prometheus_response_time_as_milliseconds: bool,
    /// The share of a limit past which hits count as `near_limit` too.
    #[arg(long, env = "NEAR_LIMIT_RATIO", default_value_t = 0.8)]
    near_limit_ratio: f32,
}

impl StatsSettings {
    /// The statsd sink's settings, when it is on.
    pub fn statsd(&self) -> Result<Option<StatsdSettings>> {
        if self.use_dog_statsd && self.use_statsd == Some(true) {
            return Err(Error::Startup(
                "unable to use more than one stats sink at the same time: set one of USE_DOG_STATSD, USE_STATSD".into(),
            ));
        }
        let on = self.use_statsd.unwrap_or(self.statsd_host.is_some());
        if !on && !self.use_dog_statsd {
            return Ok(None);
        }
        if self.stats_flush_interval.is_zero() {
            return Err(Error::Startup(
                "STATS_FLUSH_INTERVAL must be positive".into(),
            ));
        }
        let host = self.statsd_host.as_deref().unwrap_or("localhost");
        // An IPv6 literal (`::1`) is bracketed, as Go's JoinHostPort does.
        let addr = match host.contains(':') && !host.starts_with('[') {
            true => format!("[{host}]:{}", self.statsd_port),
            false => format!("{host}:{}", self.statsd_port),
        };
        Ok(Some(StatsdSettings {
            addr,
            flush_interval: self.stats_flush_interval,
            extra_tags: self.extra_tags.clone(),
            dog: self.mogrifiers()?,
        }))
    }

    /// With USE_DOG_STATSD, the mogrifiers (read from the environment).
    fn mogrifiers(&self) -> Result<Option<Mogrifiers>> {
        if !self.use_dog_statsd {
            return Ok(None);
        }
        let env = |key: &str| std::env::var(key).ok();
        Mogrifiers::from_env(&self.use_dog_statsd_mogrifiers, env).map(Some)
    }

    /// The mapping of their stat names to Prometheus series: the file
    /// PROMETHEUS_MAPPER_YAML names, else their default.
    pub fn prometheus_mapper(&self) -> Result<Mapper> {
        let file = &self.prometheus_mapper_yaml;
        if file.is_empty() {
            let ms = self.prometheus_response_time_as_milliseconds;
            return Ok(Mapper::default_mapping(ms));
        }
        let text = std::fs::read_to_string(file).map_err(|e| {
            Error::Startup(format!("PROMETHEUS_MAPPER_YAML {file}: cannot read: {e}"))
        })?;
        Mapper::parse(&text, file)
    }

    pub fn near_limit_ratio(&self) -> Result<NearLimitRatio> {
        let ratio = self.near_limit_ratio;
        if !(0.0..=1.0).contains(&ratio) {
            return Err(Error::Startup(format!(
                "NEAR_LIMIT_RATIO {ratio}: must be between 0 and 1"
            )));
        }
        Ok(NearLimitRatio(ratio))
    }
}
