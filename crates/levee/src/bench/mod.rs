//! `levee bench ...`: load tools that drive a real server through the real client over
//! loopback and report throughput and latency percentiles.

// Rates and ratios of counts far below 2^52, and float seconds turned back into counts: the
// casts lose nothing that matters to a benchmark figure.
#![allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]

pub mod delay;
pub mod failover;
mod failover_group;
pub mod failover_queue;
pub mod hotkey;
pub mod limits;
pub mod limits_adaptive;
pub mod queue;
pub mod queue_cluster;
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

/// Milliseconds since the Unix epoch (the server's clock too, on the same machine).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// CPU time a process has used so far, user and system, all threads, in seconds; `process` is
/// a pid or `self` (0 if unknown). From `/proc/PID/stat` (fields 14 and 15), in the kernel's
/// `USER_HZ` ticks, which Linux fixes at 100 per second for user space on every architecture we
/// build for: a resolution of 10 ms, fine for phases of seconds.
pub fn cpu_seconds(process: &str) -> f64 {
    const USER_HZ: f64 = 100.0;
    std::fs::read_to_string(format!("/proc/{process}/stat"))
        .ok()
        .and_then(|stat| {
            // The command name (field 2) is in parentheses and may hold spaces: count the
            // fields after its closing parenthesis, which is field 3.
            let rest = &stat[stat.rfind(')')? + 1..];
            let mut fields = rest.split_whitespace().skip(11);
            let user: u64 = fields.next()?.parse().ok()?;
            let system: u64 = fields.next()?.parse().ok()?;
            Some((user + system) as f64 / USER_HZ)
        })
        .unwrap_or(0.0)
}

/// Bytes a process has sent to storage so far (`write_bytes` in `/proc/PID/io`: counted when
/// it dirties a page of a file, so a page written again after an fsync counts again, as the
/// disk sees it; the file system's own journal is not counted); `process` is a pid or `self`
/// (0 if unknown).
pub fn disk_bytes_written(process: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{process}/io"))
        .ok()
        .and_then(|io| {
            let line = io.lines().find(|line| line.starts_with("write_bytes:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .unwrap_or(0)
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    /// Writing a file and syncing it raises the process's disk bytes as read from `/proc`
    /// (the file is written under the crate's folder: `/tmp` may be a memory file system).
    #[test]
    fn disk_bytes_written_counts_this_process() {
        use std::io::Write;
        let directory =
            tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).expect("a temporary directory");
        let before = super::disk_bytes_written("self");
        let mut file = std::fs::File::create(directory.path().join("written")).expect("a file");
        file.write_all(&vec![7_u8; 1 << 20]).expect("written");
        file.sync_all().expect("synced");
        let written = super::disk_bytes_written("self") - before;
        assert!(
            written >= 1 << 20,
            "{written} bytes counted for 1 MiB synced"
        );
        assert_eq!(super::disk_bytes_written("no-such-process"), 0);
    }

    /// Spinning on this thread raises the process's CPU time as read from `/proc`.
    #[test]
    fn cpu_seconds_counts_this_process() {
        let before = super::cpu_seconds("self");
        let started = Instant::now();
        let mut spins = 0_u64;
        while super::cpu_seconds("self") - before < 0.05
            && started.elapsed() < Duration::from_secs(20)
        {
            spins = std::hint::black_box(spins.wrapping_add(1));
        }
        let used = super::cpu_seconds("self") - before;
        assert!(used >= 0.05, "{used} s of CPU after {spins} spins");
        assert!(
            used < started.elapsed().as_secs_f64() * 64.0 + 1.0,
            "{used}"
        );
        assert!(super::cpu_seconds("no-such-process").abs() < f64::EPSILON);
    }
}
