//! `levee bench ...`: load tools that drive a real server through the real client over
//! loopback and report throughput and latency percentiles.

// Rates and ratios of counts far below 2^52, and float seconds turned back into counts: the
// casts lose nothing that matters to a benchmark figure.
#![allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]

pub mod hotkey;
pub mod queue;
#[cfg(feature = "baseline")]
pub mod redis_baseline;
pub mod server_process;
pub mod store;

use hdrhistogram::Histogram;
use serde_json::{Value, json};

/// p50, p99, p999 and max of a histogram of microseconds, in milliseconds.
pub fn percentiles_ms(histogram: &Histogram<u64>) -> Value {
    let at = |quantile: f64| histogram.value_at_quantile(quantile) as f64 / 1000.0;
    json!({
        "p50": at(0.50),
        "p99": at(0.99),
        "p999": at(0.999),
        "max": histogram.max() as f64 / 1000.0,
        "count": histogram.len(),
    })
}

/// Without the `baseline` feature the Redis baseline is not built in.
#[cfg(not(feature = "baseline"))]
pub mod redis_baseline {
    /// Says how to build the tool with the baseline.
    #[allow(clippy::unused_async, reason = "the same signature as the real one")]
    pub async fn run(_args: &super::queue::QueueBenchArgs) -> anyhow::Result<serde_json::Value> {
        anyhow::bail!(
            "--against redis needs the tool built with the baseline feature: cargo build \
             --release -p levee --features baseline"
        )
    }
}

/// A process's peak resident memory (`VmHWM`) in bytes; `process` is a pid or `self` (0 if
/// unknown).
pub fn peak_rss_bytes(process: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{process}/status"))
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kibibytes| kibibytes * 1024)
}
