//! Logs on stderr and, with `--otlp URL` (or `OTEL_EXPORTER_OTLP_ENDPOINT`)
//! in a build with the `otlp` feature, the spans of every session command,
//! turn, slice, agent start, sandbox exec, log append and checkpoint sent
//! over OTLP/HTTP. `docs/operations.md` lists the spans and their fields.

use anyhow::Result;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Flushes the exporter when dropped (after the async runtime has ended:
/// the exporter's batch thread sends with a blocking client).
#[must_use = "dropping the guard flushes and stops the exporter"]
pub struct Guard {
    #[cfg(feature = "otlp")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard").finish_non_exhaustive()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        #[cfg(feature = "otlp")]
        if let Some(provider) = self.provider.take() {
            if let Err(e) = provider.shutdown() {
                eprintln!("warning: the last spans may not have been exported: {e}");
            }
        }
    }
}

/// Set up logging (`verbose` 0: warnings, 1: info, 2+: debug; `RUST_LOG`
/// overrides) and, when `otlp` names an endpoint, span export.
pub fn init(verbose: u8, otlp: Option<&str>) -> Result<Guard> {
    let level = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| level.into()));
    let registry = tracing_subscriber::registry().with(logs);
    match otlp {
        None => {
            registry.init();
            Ok(Guard {
                #[cfg(feature = "otlp")]
                provider: None,
            })
        }
        #[cfg(feature = "otlp")]
        Some(endpoint) => {
            let provider = otlp::provider(endpoint)?;
            use opentelemetry::trace::TracerProvider as _;
            let tracer = provider.tracer("harness");
            // Spans at INFO and above, whatever the log level: the trace is
            // the turn's shape, not its debug chatter.
            let spans = tracing_opentelemetry::layer()
                .with_tracer(tracer)
                .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
            registry.with(spans).init();
            Ok(Guard {
                provider: Some(provider),
            })
        }
        #[cfg(not(feature = "otlp"))]
        Some(endpoint) => anyhow::bail!(
            "--otlp {endpoint}: this harness was built without OTLP export; rebuild it with `--features otlp` (cargo install --path crates/harness-cli --features otlp)"
        ),
    }
}

#[cfg(feature = "otlp")]
mod otlp {
    use anyhow::{Context, Result};
    use bytes::Bytes;
    use opentelemetry_http::{HttpClient, HttpError, Request, Response};
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
    use opentelemetry_sdk::trace::{BatchSpanProcessor, SdkTracerProvider};

    /// The OTLP exporter's HTTP client: the workspace's reqwest 0.12 in
    /// its blocking form. The SDK's batch processor exports from a thread
    /// of its own, outside any async runtime, which is what a blocking
    /// client needs.
    #[derive(Debug)]
    struct Blocking(reqwest::blocking::Client);

    #[async_trait::async_trait]
    impl HttpClient for Blocking {
        async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
            let request = reqwest::blocking::Request::try_from(request)?;
            let response = self.0.execute(request)?;
            let mut out = Response::builder().status(response.status());
            for (name, value) in response.headers() {
                out = out.header(name, value);
            }
            Ok(out.body(response.bytes()?)?)
        }
    }

    /// `endpoint` as the traces URL: an OTLP base (`http://host:4318`) gets
    /// `/v1/traces`, as `OTEL_EXPORTER_OTLP_ENDPOINT` means.
    pub(super) fn traces_url(endpoint: &str) -> String {
        let base = endpoint.trim_end_matches('/');
        if base.ends_with("/v1/traces") {
            base.to_string()
        } else {
            format!("{base}/v1/traces")
        }
    }

    pub(super) fn provider(endpoint: &str) -> Result<SdkTracerProvider> {
        let client = reqwest::blocking::Client::builder()
            .timeout(std::time::Duration::from_secs(10))
            .build()
            .context("building the OTLP HTTP client")?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(Blocking(client))
            .with_endpoint(traces_url(endpoint))
            .build()
            .with_context(|| format!("setting up OTLP export to {endpoint}"))?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name("harness")
            .build();
        Ok(SdkTracerProvider::builder()
            .with_span_processor(BatchSpanProcessor::builder(exporter).build())
            .with_resource(resource)
            .build())
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn a_base_endpoint_gets_the_traces_path_once() {
            assert_eq!(
                super::traces_url("http://h:4318"),
                "http://h:4318/v1/traces"
            );
            assert_eq!(
                super::traces_url("http://h:4318/"),
                "http://h:4318/v1/traces"
            );
            assert_eq!(
                super::traces_url("http://h:4318/v1/traces"),
                "http://h:4318/v1/traces"
            );
        }
    }
}
