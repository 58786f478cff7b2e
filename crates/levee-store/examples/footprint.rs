//! Measures the memory budget and recovery time at a chosen scale:
//! `cargo run -p levee-store --release --example footprint -- QUEUES PER_QUEUE INTERVAL_MS [DIR]`
//! (defaults 100000 20 100). Prints put throughput under `interval(INTERVAL_MS)`, memory per
//! queue and per message, disk bytes,
//! fsyncs, and the time to reopen (recover) the store.
#![allow(clippy::cast_precision_loss, reason = "ratios for a report")]

use std::time::Instant;

use levee_store::{Store, StoreOptions, SyncPolicy};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut arguments = std::env::args().skip(1);
    let queues: usize = arguments.next().map_or(Ok(100_000), |text| text.parse())?;
    let per_queue: usize = arguments.next().map_or(Ok(20), |text| text.parse())?;
    let interval_ms: u64 = arguments.next().map_or(Ok(100), |text| text.parse())?;
    let temporary = tempfile::tempdir()?;
    let directory = arguments
        .next()
        .map_or_else(|| temporary.path().to_path_buf(), Into::into);
    let options = StoreOptions {
        sync: SyncPolicy::Interval { interval_ms },
        ..StoreOptions::default()
    };
    let names: Vec<Vec<u8>> = (0..queues)
        .map(|index| format!("queue-{index:08}").into_bytes())
        .collect();
    let message = [b'm'; 58];
    let (store, _) = Store::open(&directory, options.clone())?;
    let started = Instant::now();
    for _ in 0..per_queue {
        for chunk in names.chunks(1000) {
            let batch: Vec<(&[u8], &[u8])> =
                chunk.iter().map(|name| (&name[..], &message[..])).collect();
            store.append_batch(&batch)?;
        }
    }
    store.sync()?;
    let put_seconds = started.elapsed().as_secs_f64();
    let messages = (queues * per_queue) as f64;
    let stats = store.stats();
    let usage = store.memory_usage();
    println!(
        "queues {queues}, messages {messages}, 58-byte messages, sync=interval({interval_ms})"
    );
    println!(
        "put: {:.0} messages/s ({put_seconds:.2} s)",
        messages / put_seconds
    );
    println!("stats: {stats:?}");
    println!("memory: {usage:?}");
    println!(
        "memory per queue {:.0} B (buffers included), index per message {:.3} B",
        usage.total_bytes as f64 / queues as f64,
        usage.index_bytes as f64 / messages
    );
    store.close()?;
    let started = Instant::now();
    let (store, report) = Store::open(&directory, options)?;
    let recovery_seconds = started.elapsed().as_secs_f64();
    println!(
        "recovery: {recovery_seconds:.3} s for {} bytes ({:.0} MB/s), {} records",
        report.bytes_scanned,
        report.bytes_scanned as f64 / recovery_seconds / 1e6,
        report.records
    );
    let usage = store.memory_usage();
    println!(
        "after recovery: memory per idle queue {:.0} B, index per message {:.3} B",
        usage.total_bytes as f64 / queues as f64,
        usage.index_bytes as f64 / messages
    );
    Ok(())
}
