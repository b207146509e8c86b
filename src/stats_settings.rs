//! The binary's stats settings under envoyproxy/ratelimit's names: the
//! statsd sink (`USE_STATSD`, `STATSD_HOST`, `STATSD_PORT`, `EXTRA_TAGS`,
//! `STATS_FLUSH_INTERVAL`) and where `near_limit` starts
//! (`NEAR_LIMIT_RATIO`).

use std::time::Duration;

use clap::builder::BoolishValueParser;
use ratekeeper::service::rls::NearLimitRatio;
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
    #[arg(long, env = "STATS_FLUSH_INTERVAL", value_parser = crate::duration, default_value = "10s")]
    stats_flush_interval: Duration,
    /// The share of a limit past which hits count as `near_limit` too.
    #[arg(long, env = "NEAR_LIMIT_RATIO", default_value_t = 0.8)]
    near_limit_ratio: f32,
}

impl StatsSettings {
    /// The statsd sink's settings, when it is on.
    pub fn statsd(&self) -> Result<Option<StatsdSettings>> {
        if !self.use_statsd.unwrap_or(self.statsd_host.is_some()) {
            return Ok(None);
        }
        if self.stats_flush_interval.is_zero() {
            return Err(Error::Startup(
                "STATS_FLUSH_INTERVAL must be positive".into(),
            ));
        }
        let host = self.statsd_host.as_deref().unwrap_or("localhost");
        Ok(Some(StatsdSettings {
            addr: format!("{host}:{}", self.statsd_port),
            flush_interval: self.stats_flush_interval,
            extra_tags: self.extra_tags.clone(),
        }))
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
