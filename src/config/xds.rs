//! The xDS source: envoyproxy/ratelimit's `RateLimitConfig` messages (what
//! an ADS server such as Envoy Gateway sends) translated into
//! [`DomainDescription`]s and compiled by the same [`compile`] as the files.
//! One snapshot (every message of one response) becomes one [`Config`], whole
//! or not at all. Errors name the message and the node's path in it:
//! `domain "x" descriptors[2].rate_limit: the unit is missing`.

use std::path::PathBuf;

use super::compile::{compile, CompileError};
use super::description::{self as desc, DomainDescription};
use super::{Config, LoadOptions};
use crate::error::ConfigError;
use crate::limiter::Unit;
use crate::pb::rls_conf::{RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit};

/// Compiles one snapshot of `RateLimitConfig` messages.
pub fn load(snapshot: &[RateLimitConfig]) -> Result<Config, ConfigError> {
    load_with(snapshot, LoadOptions::default())
}

/// [`load`], merging the messages of one domain when `options` says so
/// (`MERGE_DOMAIN_CONFIG`, as their xDS provider does).
pub fn load_with(
    snapshot: &[RateLimitConfig],
    options: LoadOptions,
) -> Result<Config, ConfigError> {
    let (mut domains, mut warnings) = (Vec::with_capacity(snapshot.len()), Vec::new());
    for (i, message) in snapshot.iter().enumerate() {
        let source = source_name(i, message);
        // Where an error or a warning is, in this message.
        let located = |e: CompileError| {
            let at = match e.at.as_str() {
                "" => format!("domain {:?}", message.domain),
                // The domain itself: its name says nothing more.
                "domain" => "domain".into(),
                at => format!("domain {:?} {at}", message.domain),
            };
            ConfigError::new(&source, format!("{at}: {}", e.reason))
        };
        let (compiled, found) = describe(message).and_then(compile).map_err(located)?;
        warnings.extend(found.into_iter().map(located));
        domains.push((source, compiled));
    }
    let config = Config::from_domains_with(domains, options)?;
    // Said once the whole snapshot loads: one refused has only its error.
    for warning in warnings {
        tracing::warn!("{warning}");
    }
    Ok(config)
}

/// How errors name message `i`: by its `name`, else by its place.
fn source_name(i: usize, message: &RateLimitConfig) -> PathBuf {
    if message.name.is_empty() {
        PathBuf::from(format!("xDS RateLimitConfig #{i}"))
    } else {
        PathBuf::from(format!("xDS RateLimitConfig {:?}", message.name))
    }
}

/// Translates one message into the source-neutral description.
pub fn describe(message: &RateLimitConfig) -> Result<DomainDescription, CompileError> {
    Ok(DomainDescription {
        domain: message.domain.clone(),
        descriptors: descriptors(&message.descriptors, "descriptors")?,
        ..DomainDescription::default()
    })
}

fn descriptors(
    list: &[RateLimitDescriptor],
    at: &str,
) -> Result<Vec<desc::Descriptor>, CompileError> {
    list.iter()
        .enumerate()
        .map(|(i, d)| descriptor(d, format!("{at}[{i}]")))
        .collect()
}

fn descriptor(d: &RateLimitDescriptor, at: String) -> Result<desc::Descriptor, CompileError> {
    let limits = match &d.rate_limit {
        Some(policy) => vec![limit(policy, format!("{at}.rate_limit"))?],
        None => Vec::new(),
    };
    Ok(desc::Node {
        children: descriptors(&d.descriptors, &format!("{at}.descriptors"))?,
        key: d.key.clone(),
        value: Some(d.value.clone()).filter(|v| !v.is_empty()),
        payload: desc::Limits {
            limits,
            shadow_mode: d.shadow_mode,
            detailed_metric: d.detailed_metric,
            quota_mode: d.quota_mode,
            share_threshold: false,
            value_to_metric: false,
            metadata: d.metadata.clone().filter(|m| !m.fields.is_empty()),
        },
        at,
    })
}

fn limit(policy: &RateLimitPolicy, at: String) -> Result<desc::Limit, CompileError> {
    Ok(desc::Limit {
        // An unlimited policy ignores a unit that is not one (as a file's).
        unit: match unit(policy.unit) {
            Err(_) if policy.unlimited => None,
            unit => unit.map_err(|reason| CompileError::new(&format!("{at}.unit"), reason))?,
        },
        requests_per_unit: Some(policy.requests_per_unit),
        unlimited: policy.unlimited,
        name: Some(policy.name.clone()).filter(|n| !n.is_empty()),
        replaces: policy.replaces.iter().map(|r| r.name.clone()).collect(),
        algorithm: None,
        burst: None,
        charges: None,
        at,
    })
}

/// The unit of a `RateLimitUnit` number; `UNKNOWN` (the default) is none.
fn unit(number: i32) -> Result<Option<Unit>, String> {
    match RateLimitUnit::try_from(number) {
        Ok(RateLimitUnit::Unknown) => Ok(None),
        Ok(known) => Unit::parse(known.as_str_name())
            .map(Some)
            .ok_or_else(|| format!("unknown unit {}", known.as_str_name())),
        Err(_) => Err(format!(
            "unknown unit {number}: expected second, minute, hour, day, week, month or year"
        )),
    }
}
