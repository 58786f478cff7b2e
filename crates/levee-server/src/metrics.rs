//! The server's Prometheus metrics: one registry, the handles that code updates, and a
//! collector that reads the process's memory, CPU and file descriptors at each scrape.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels of a finished gRPC call.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The full method path, such as `/levee.v1.Admin/Echo`, or `unknown`.
    pub rpc: String,
    /// The gRPC status code's name, such as `OK` or `INVALID_ARGUMENT`.
    pub code: &'static str,
}

/// Labels of a latency observation.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    /// The full method path, or `unknown`.
    pub rpc: String,
}

type HistogramFamily = Family<RpcLabels, Histogram, fn() -> Histogram>;

/// Every metric the server exports. Cheap to clone; clones share the same values.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// gRPC connections open now.
    pub grpc_connections_open: Gauge,
    /// gRPC connections accepted since start.
    pub grpc_connections_accepted: Counter,
    /// Failed `accept` calls (for example: out of file descriptors).
    pub grpc_accept_errors: Counter,
    /// Finished gRPC calls by method and status code.
    pub grpc_requests: Family<RequestLabels, Counter>,
    /// gRPC call latency by method, from request headers to the end of the response.
    pub grpc_request_duration_seconds: HistogramFamily,
}

fn latency_histogram() -> Histogram {
    // 50 µs to about 105 s in 22 doubling buckets.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 22))
}

impl Metrics {
    /// A registry with every metric at zero, plus the process collector.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let grpc_connections_open = Gauge::default();
        registry.register(
            "levee_grpc_connections_open",
            "gRPC connections open now",
            grpc_connections_open.clone(),
        );
        let grpc_connections_accepted = Counter::default();
        registry.register(
            "levee_grpc_connections_accepted",
            "gRPC connections accepted since start",
            grpc_connections_accepted.clone(),
        );
        let grpc_accept_errors = Counter::default();
        registry.register(
            "levee_grpc_accept_errors",
            "failed accept calls on the gRPC listener",
            grpc_accept_errors.clone(),
        );
        let grpc_requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "levee_grpc_requests",
            "finished gRPC calls by method and status code",
            grpc_requests.clone(),
        );
        let grpc_request_duration_seconds =
            HistogramFamily::new_with_constructor(latency_histogram as fn() -> Histogram);
        registry.register(
            "levee_grpc_request_duration_seconds",
            "gRPC call latency by method, from request headers to the end of the response",
            grpc_request_duration_seconds.clone(),
        );
        registry.register_collector(Box::new(ProcessCollector {
            start: SystemTime::now(),
        }));
        Self {
            registry: Arc::new(registry),
            grpc_connections_open,
            grpc_connections_accepted,
            grpc_accept_errors,
            grpc_requests,
            grpc_request_duration_seconds,
        }
    }

    /// Everything in the `OpenMetrics` text format that Prometheus scrapes.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::error!(%error, "encoding metrics failed");
        }
        text
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Reads the process's resource use from the kernel at scrape time.
#[derive(Debug)]
struct ProcessCollector {
    start: SystemTime,
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let cpu = ConstCounter::new(process_cpu_seconds());
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "user and system CPU time of the process",
            None,
            cpu.metric_type(),
        )?)?;
        if let Some(resident) = process_resident_memory_bytes() {
            let gauge = ConstGauge::new(resident);
            gauge.encode(encoder.encode_descriptor(
                "process_resident_memory_bytes",
                "resident memory of the process",
                None,
                gauge.metric_type(),
            )?)?;
        }
        if let Ok(entries) = std::fs::read_dir("/proc/self/fd") {
            let gauge = ConstGauge::new(i64::try_from(entries.count()).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(
                "process_open_fds",
                "open file descriptors of the process",
                None,
                gauge.metric_type(),
            )?)?;
        }
        let start = self
            .start
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let gauge = ConstGauge::new(start);
        gauge.encode(encoder.encode_descriptor(
            "process_start_time_seconds",
            "start time of the process since the Unix epoch",
            None,
            gauge.metric_type(),
        )?)?;
        Ok(())
    }
}

/// User plus system CPU seconds of this process, from `getrusage`.
#[allow(unsafe_code)]
fn process_cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a valid, writable rusage; getrusage only writes into it, and we read it
    // only when the call succeeded.
    let status = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if status != 0 {
        return 0.0;
    }
    // SAFETY: getrusage returned 0, so it filled the struct (and it was zeroed before).
    let usage = unsafe { usage.assume_init() };
    let seconds = |time: libc::timeval| {
        #[allow(clippy::cast_precision_loss)]
        let value = time.tv_sec as f64 + time.tv_usec as f64 / 1_000_000.0;
        value
    };
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Resident set size from `/proc/self/status` (`VmRSS`, in KiB), or `None` off Linux.
fn process_resident_memory_bytes() -> Option<i64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let kibibytes: i64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kibibytes * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_recorded_call_then_text_has_counter_histogram_and_process_metrics() {
        let metrics = Metrics::new();
        let labels = RequestLabels {
            rpc: "/levee.v1.Admin/Echo".to_owned(),
            code: "OK",
        };
        metrics.grpc_requests.get_or_create(&labels).inc();
        metrics
            .grpc_request_duration_seconds
            .get_or_create(&RpcLabels {
                rpc: labels.rpc.clone(),
            })
            .observe(0.003);
        let text = metrics.encode();
        assert!(
            text.contains("levee_grpc_requests_total{rpc=\"/levee.v1.Admin/Echo\",code=\"OK\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("levee_grpc_request_duration_seconds_count"),
            "{text}"
        );
        assert!(text.contains("process_resident_memory_bytes "), "{text}");
        assert!(text.contains("process_cpu_seconds_total "), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
