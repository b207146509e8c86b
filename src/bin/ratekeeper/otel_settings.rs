//! The binary's tracing settings, under envoyproxy/ratelimit's names
//! (`TRACING_*`) and OpenTelemetry's standard exporter variables
//! (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`).

use clap::builder::BoolishValueParser;
use ratekeeper::otel::{Protocol, TraceSettings, Tracer};
use ratekeeper::{Error, Result};

/// OTLP transport, as `TRACING_EXPORTER_PROTOCOL` names it.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum ProtocolArg {
    Http,
    Grpc,
}

/// Tracing settings (flattened into the command line).
#[derive(Debug, clap::Args)]
pub struct TracingArgs {
    /// Export a span per sampled decision over OTLP.
    #[arg(long, env = "TRACING_ENABLED", value_parser = BoolishValueParser::new())]
    tracing_enabled: bool,
    /// `service.name` of the spans (envoyproxy/ratelimit's default).
    #[arg(long, env = "TRACING_SERVICE_NAME", default_value = "RateLimit")]
    tracing_service_name: String,
    /// `service.namespace` of the spans (none when empty).
    #[arg(long, env = "TRACING_SERVICE_NAMESPACE", default_value = "")]
    tracing_service_namespace: String,
    /// `service.instance.id` of the spans (random when empty).
    #[arg(long, env = "TRACING_SERVICE_INSTANCE_ID", default_value = "")]
    tracing_service_instance_id: String,
    /// Share of calls without a sampled parent that are traced, 0 to 1; a
    /// call whose `traceparent` says sampled is always traced.
    #[arg(long, env = "TRACING_SAMPLING_RATE", default_value_t = 1.0)]
    tracing_sampling_rate: f64,
    /// `http` (OTLP/HTTP protobuf) or `grpc` (OTLP/gRPC).
    #[arg(long, env = "TRACING_EXPORTER_PROTOCOL", value_enum, ignore_case = true, default_value_t = ProtocolArg::Http)]
    tracing_exporter_protocol: ProtocolArg,
    /// The receiver's base URL; `/v1/traces` is appended for HTTP.
    /// Default http://localhost:4318 (HTTP) or http://localhost:4317 (gRPC).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    otel_exporter_otlp_endpoint: Option<String>,
    /// The receiver's full URL for traces, used as given (wins over
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")]
    otel_exporter_otlp_traces_endpoint: Option<String>,
}

impl TracingArgs {
    /// The tracer these settings ask for (off unless `TRACING_ENABLED`).
    pub fn tracer(&self) -> Result<Tracer> {
        if !self.tracing_enabled {
            return Ok(Tracer::default());
        }
        let unread = unread_exporter_settings(|name| std::env::var_os(name).is_some());
        if !unread.is_empty() {
            tracing::warn!(
                set = %unread.join(","),
                "OTLP exporter settings not read here: spans go as plain OTLP to an http:// receiver (a Collector beside ratekeeper adds TLS, headers or compression)"
            );
        }
        Tracer::start(&self.settings()?)
    }

    fn settings(&self) -> Result<TraceSettings> {
        let rate = self.tracing_sampling_rate;
        if !(0.0..=1.0).contains(&rate) {
            return Err(Error::Startup(format!(
                "TRACING_SAMPLING_RATE {rate}: must be between 0 and 1"
            )));
        }
        let protocol = match self.tracing_exporter_protocol {
            ProtocolArg::Http => Protocol::Http,
            ProtocolArg::Grpc => Protocol::Grpc,
        };
        let base = |default: &str| {
            self.otel_exporter_otlp_endpoint
                .as_deref()
                .unwrap_or(default)
                .trim_end_matches('/')
                .to_owned()
        };
        let endpoint = match (&self.otel_exporter_otlp_traces_endpoint, protocol) {
            (Some(url), _) => url.clone(),
            (None, Protocol::Http) => format!("{}/v1/traces", base("http://localhost:4318")),
            (None, Protocol::Grpc) => base("http://localhost:4317"),
        };
        Ok(TraceSettings {
            service_name: self.tracing_service_name.clone(),
            service_namespace: self.tracing_service_namespace.clone(),
            service_instance_id: self.tracing_service_instance_id.clone(),
            sampling_rate: rate,
            endpoint,
            protocol,
        })
    }
}

/// The OpenTelemetry SDK's OTLP exporter variables (which their exporter
/// reads) that are set (`is_set`) and have no effect here.
fn unread_exporter_settings(is_set: impl Fn(&str) -> bool) -> Vec<String> {
    const UNREAD: [&str; 7] = [
        "HEADERS",
        "COMPRESSION",
        "INSECURE",
        "CERTIFICATE",
        "CLIENT_CERTIFICATE",
        "CLIENT_KEY",
        "TIMEOUT",
    ];
    UNREAD
        .iter()
        .flat_map(|name| {
            [
                format!("OTEL_EXPORTER_OTLP_{name}"),
                format!("OTEL_EXPORTER_OTLP_TRACES_{name}"),
            ]
        })
        .filter(|name| is_set(name))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::unread_exporter_settings;

    #[test]
    fn exporter_settings_set_but_unread_are_named() {
        let set = [
            "OTEL_EXPORTER_OTLP_HEADERS",
            "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
        ];
        let named = unread_exporter_settings(|name| set.contains(&name));
        assert_eq!(named, set);
        assert!(unread_exporter_settings(|name| name == "OTEL_EXPORTER_OTLP_ENDPOINT").is_empty());
    }
}
