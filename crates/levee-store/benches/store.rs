//! Criterion micro-benchmarks of the hot paths: append (both sync policies, one and many
//! threads), `append_batch` across many queues, read from a random offset, and recovery.
//! Run: `cargo bench -p levee-store -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use levee_store::{Store, StoreOptions, SyncPolicy};

#[allow(
    clippy::cast_possible_truncation,
    reason = "benchmark indices are small"
)]
const fn index(value: u64) -> usize {
    value as usize
}

const MESSAGE: [u8; 58] = [b'm'; 58];
const QUEUES: usize = 10_000;

fn names(count: usize) -> Vec<Vec<u8>> {
    (0..count)
        .map(|index| format!("queue-{index:07}").into_bytes())
        .collect()
}

fn interval() -> StoreOptions {
    StoreOptions {
        sync: SyncPolicy::Interval { interval_ms: 100 },
        ..StoreOptions::default()
    }
}

fn append(criterion: &mut Criterion) {
    let names = names(QUEUES);
    let mut group = criterion.benchmark_group("append");
    group.throughput(Throughput::Elements(1));
    for (label, options) in [
        ("interval", interval()),
        ("always", StoreOptions::default()),
    ] {
        let directory = tempfile::tempdir().unwrap();
        let (store, _) = Store::open(directory.path(), options).unwrap();
        let mut next = 0;
        group.bench_function(format!("{label}/1_thread/58B"), |bencher| {
            bencher.iter(|| {
                next = (next + 1) % QUEUES;
                black_box(store.append(&names[next], &MESSAGE).unwrap())
            });
        });
    }
    // Pipelining: one thread keeps up to 4096 deferred appends in flight under `always`.
    {
        let directory = tempfile::tempdir().unwrap();
        let (store, _) = Store::open(directory.path(), StoreOptions::default()).unwrap();
        let mut next = 0;
        group.bench_function("always/1_thread_pipelined_4096/58B", |bencher| {
            bencher.iter_custom(|iterations| {
                let started = Instant::now();
                // The highest ticket covers every append before it (a later append may hold
                // an earlier one).
                let mut ticket = None;
                for message in 0..iterations {
                    next = (next + 1) % QUEUES;
                    let (_, appended) = store.append_deferred(&names[next], &MESSAGE).unwrap();
                    ticket = ticket.max(Some(appended));
                    if message % 4096 == 4095
                        && let Some(highest) = ticket
                    {
                        store.wait_durable(highest).unwrap();
                    }
                }
                if let Some(ticket) = ticket {
                    store.wait_durable(ticket).unwrap();
                }
                started.elapsed()
            });
        });
    }
    // Group commit: 16 threads appending under `always` share fsyncs.
    let directory = tempfile::tempdir().unwrap();
    let store = Arc::new(
        Store::open(directory.path(), StoreOptions::default())
            .unwrap()
            .0,
    );
    let names = Arc::new(names);
    group.bench_function("always/16_threads/58B", |bencher| {
        bencher.iter_custom(|iterations| {
            let per_thread = iterations.div_ceil(16);
            let started = Instant::now();
            let handles: Vec<_> = (0..16_u64)
                .map(|thread| {
                    let store = store.clone();
                    let names = names.clone();
                    std::thread::spawn(move || {
                        for message in 0..per_thread {
                            let queue = index(thread * per_thread + message) % QUEUES;
                            store.append(&names[queue], &MESSAGE).unwrap();
                        }
                    })
                })
                .collect();
            for handle in handles {
                handle.join().unwrap();
            }
            started.elapsed()
        });
    });
    group.finish();
}

fn append_batch(criterion: &mut Criterion) {
    const BATCH: usize = 1000;
    let names = names(QUEUES);
    let mut group = criterion.benchmark_group("append_batch");
    group.throughput(Throughput::Elements(BATCH as u64));
    for (label, options) in [
        ("interval", interval()),
        ("always", StoreOptions::default()),
    ] {
        let directory = tempfile::tempdir().unwrap();
        let (store, _) = Store::open(directory.path(), options).unwrap();
        let mut start = 0;
        group.bench_function(format!("{label}/1000_queues/58B"), |bencher| {
            bencher.iter_batched(
                || {
                    start = (start + BATCH) % QUEUES;
                    (start..start + BATCH)
                        .map(|index| (&names[index % QUEUES][..], &MESSAGE[..]))
                        .collect::<Vec<_>>()
                },
                |batch| black_box(store.append_batch(&batch).unwrap()),
                BatchSize::SmallInput,
            );
        });
    }
    group.finish();
}

/// A store with `QUEUES` queues of 100 messages each, fully written.
fn filled_store(directory: &std::path::Path) -> Store {
    let names = names(QUEUES);
    let (store, _) = Store::open(directory, interval()).unwrap();
    for _ in 0..100 {
        let batch: Vec<(&[u8], &[u8])> =
            names.iter().map(|name| (&name[..], &MESSAGE[..])).collect();
        store.append_batch(&batch).unwrap();
    }
    store.sync().unwrap();
    store
}

fn read(criterion: &mut Criterion) {
    let names = names(QUEUES);
    let directory = tempfile::tempdir().unwrap();
    let store = filled_store(directory.path());
    let mut group = criterion.benchmark_group("read");
    group.throughput(Throughput::Elements(1));
    let mut state: u64 = 0x2545_F491_4F6C_DD1D;
    group.bench_function("random_offset/10_messages", |bencher| {
        bencher.iter(|| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let queue = &names[index(state % QUEUES as u64)];
            let batch = store.read(queue, (state >> 32) % 90, 10, 1 << 20).unwrap();
            assert_eq!(batch.len(), 10);
            black_box(batch)
        });
    });
    group.finish();
}

fn recovery(criterion: &mut Criterion) {
    let directory = tempfile::tempdir().unwrap();
    let store = filled_store(directory.path());
    let disk_bytes = store.stats().disk_bytes;
    store.close().unwrap();
    let mut group = criterion.benchmark_group("recovery");
    group.throughput(Throughput::Bytes(disk_bytes));
    group.sample_size(10);
    group.bench_function("open/10k_queues/1M_messages", |bencher| {
        bencher.iter(|| {
            let (store, report) = Store::open(directory.path(), interval()).unwrap();
            assert_eq!(report.messages, 100 * QUEUES as u64);
            store
        });
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = append, append_batch, read, recovery
}
criterion_main!(benches);
