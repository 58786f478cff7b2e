//! The put and random-check phases of `levee bench store`, on the engine alone, so the engine
//! can be measured and profiled without building the server binary:
//! `cargo run -p levee-store --release --example put -- QUEUES MESSAGES THREADS SYNC [DIR]`
//! (SYNC is `always` or `interval`; defaults 100000 10000000 16 interval). Each thread appends
//! to its share of the queues, offset by offset, in `append_batch` calls of 256 messages of 58
//! bytes; then each thread reads 10 messages from a random offset of each of its queues.
#![allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::too_many_lines,
    reason = "a measurement driver: ratios for a report, the phases in order"
)]

use std::io::Write;
use std::time::Instant;

use levee_store::{Store, StoreOptions, SyncPolicy};

/// Messages per `append_batch`, as in `levee bench store`.
const BATCH_MESSAGES: usize = 256;
/// Bytes per message.
const MESSAGE_BYTES: usize = 58;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut arguments = std::env::args().skip(1);
    let queues: u64 = arguments.next().map_or(Ok(100_000), |text| text.parse())?;
    let messages: u64 = arguments
        .next()
        .map_or(Ok(10_000_000), |text| text.parse())?;
    let threads: u64 = arguments.next().map_or(Ok(16), |text| text.parse())?;
    let sync = match arguments.next().as_deref() {
        None | Some("interval") => SyncPolicy::Interval { interval_ms: 100 },
        Some("always") => SyncPolicy::Always,
        Some(other) => return Err(format!("SYNC must be always or interval, got {other}").into()),
    };
    let temporary = tempfile::tempdir()?;
    let directory = arguments
        .next()
        .map_or_else(|| temporary.path().to_path_buf(), Into::into);
    let options = StoreOptions {
        sync,
        ..StoreOptions::default()
    };
    let per_queue = messages / queues;
    let (store, _) = Store::open(&directory, options.clone())?;
    let started = Instant::now();
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let store = &store;
            scope.spawn(move || {
                let mut names = Vec::new();
                let mut ends = Vec::new();
                let message = [b'm'; MESSAGE_BYTES];
                for _offset in 0..per_queue {
                    for queue in (thread..queues).step_by(threads as usize) {
                        let _ = write!(names, "q{queue:08}");
                        ends.push(names.len());
                        if ends.len() == BATCH_MESSAGES {
                            put(store, &names, &ends, &message);
                            names.clear();
                            ends.clear();
                        }
                    }
                }
                put(store, &names, &ends, &message);
            });
        }
    });
    let put_seconds = started.elapsed().as_secs_f64();
    let stored = (per_queue * queues) as f64;
    let stats = store.stats();
    let usage = store.memory_usage();
    let started = Instant::now();
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let store = &store;
            scope.spawn(move || {
                let mut random = thread.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                for queue in (thread..queues).step_by(threads as usize) {
                    random ^= random << 13;
                    random ^= random >> 7;
                    random ^= random << 17;
                    let count = per_queue.min(10);
                    let offset = random % (per_queue - count + 1);
                    let name = format!("q{queue:08}");
                    let mut read = 0;
                    while read < count {
                        let batch = store
                            .read(
                                name.as_bytes(),
                                offset + read,
                                (count - read) as usize,
                                1 << 20,
                            )
                            .expect("read");
                        assert!(!batch.is_empty(), "queue {name} offset {}", offset + read);
                        read += batch.len() as u64;
                    }
                }
            });
        }
    });
    let random_seconds = started.elapsed().as_secs_f64();
    println!(
        "put {:.0} msg/s ({put_seconds:.2} s), {} fsyncs, {} rounds; random check {:.0} gets/s",
        stored / put_seconds,
        stats.file_syncs + stats.dir_syncs,
        stats.commit_rounds,
        queues as f64 / random_seconds
    );
    println!(
        "index {:.2} B/message ({} entries), memory {:.0} B/queue (buffers {} B, spare {} B)",
        usage.index_bytes as f64 / stored,
        usage.index_entries,
        usage.total_bytes as f64 / queues as f64,
        usage.buffer_bytes,
        usage.spare_buffer_bytes
    );
    drop(store);
    let started = Instant::now();
    let (store, report) = Store::open(&directory, options)?;
    println!(
        "recovery {:.3} s, {} records ({} log records before the floor), {} bytes, {} messages",
        started.elapsed().as_secs_f64(),
        report.records,
        report.log_records_skipped,
        report.bytes_scanned,
        report.messages
    );
    drop(store);
    Ok(())
}

fn put(store: &Store, names: &[u8], ends: &[usize], message: &[u8]) {
    let mut batch: Vec<(&[u8], &[u8])> = Vec::with_capacity(ends.len());
    let mut start = 0;
    for &end in ends {
        batch.push((&names[start..end], message));
        start = end;
    }
    if !batch.is_empty() {
        store.append_batch(&batch).expect("append_batch");
    }
}
