//! Criterion micro-benchmarks of the hot-key engine: single reports and batches over a Zipf(1.0)
//! stream of 1M keys (mostly tracked keys), and a uniform cold stream over 10M keys (the
//! prefilter path: almost every report misses the tracked keys and goes to the sketch).
//!
//! Run: `cargo bench -p levee-hotkey --bench engine -- --measurement-time 3 --warm-up-time 1`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use levee_hotkey::{EngineConfig, HotKeyEngine};

const APP: &str = "bench";
const ZIPF_KEYS: usize = 1_000_000;
const STREAM_LENGTH: usize = 1 << 20;
const COLD_KEYS: u64 = 10_000_000;
const REPORTS_PER_ITERATION: usize = 100_000;
const BATCH_ITEMS: usize = 1_000;
/// Virtual time: one millisecond per this many reports (10 M reports/s). The engine is ticked
/// once per virtual millisecond, as the server does every few milliseconds.
const REPORTS_PER_MS: u64 = 10_000;

/// xorshift64*: a deterministic, dependency-free random stream.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        #[allow(
            clippy::cast_precision_loss,
            reason = "53 random bits fit an f64 exactly"
        )]
        let value = (self.next() >> 11) as f64;
        value / 9_007_199_254_740_992.0 // 2^53
    }
}

/// Key indices drawn from Zipf(1.0) over `keys` keys, by inverting the cumulative weights.
fn zipf_stream(keys: usize, length: usize, random: &mut Random) -> Vec<u32> {
    let mut cumulative = Vec::with_capacity(keys);
    let mut total = 0.0;
    for rank in 1..=keys {
        #[allow(
            clippy::cast_precision_loss,
            reason = "ranks up to 1M are exact in f64"
        )]
        let weight = 1.0 / rank as f64;
        total += weight;
        cumulative.push(total);
    }
    (0..length)
        .map(|_| {
            let target = random.unit() * total;
            let index = cumulative
                .partition_point(|&value| value < target)
                .min(keys - 1);
            u32::try_from(index).expect("fewer than 2^32 keys")
        })
        .collect()
}

fn engine() -> HotKeyEngine {
    // The defaults: 256 MiB budget, 32 MiB sketch, the `*` rule of 1000 hits in 5 s.
    HotKeyEngine::new(EngineConfig::default())
}

fn bench_zipf(criterion: &mut Criterion) {
    let mut random = Random(0x9E37_79B9_7F4A_7C15);
    let keys: Vec<Vec<u8>> = (0..ZIPF_KEYS)
        .map(|index| format!("user:{index}").into_bytes())
        .collect();
    // The stream's keys lie one after another in one buffer, as they do in a decoded report
    // frame, rather than in a million scattered allocations.
    let indices = zipf_stream(ZIPF_KEYS, STREAM_LENGTH, &mut random);
    let mut arena = Vec::new();
    let mut ranges = Vec::with_capacity(STREAM_LENGTH);
    for &index in &indices {
        let start = arena.len();
        arena.extend_from_slice(&keys[index as usize]);
        ranges.push(start..arena.len());
    }
    let stream: Vec<&[u8]> = ranges.into_iter().map(|range| &arena[range]).collect();
    let mut group = criterion.benchmark_group("zipf_1m_keys");
    group.throughput(Throughput::Elements(REPORTS_PER_ITERATION as u64));

    let mut single = engine();
    let mut events = Vec::new();
    let mut position = 0_usize;
    let mut reports = 0_u64;
    group.bench_function("report", |bencher| {
        bencher.iter(|| {
            for _ in 0..REPORTS_PER_ITERATION {
                let key = stream[position];
                position = (position + 1) % STREAM_LENGTH;
                reports += 1;
                if reports.is_multiple_of(REPORTS_PER_MS) {
                    single.tick(reports / REPORTS_PER_MS, &mut events);
                }
                single
                    .report(APP, key, 1, reports / REPORTS_PER_MS, &mut events)
                    .expect("valid report");
            }
            events.clear();
        });
    });
    let memory = single.memory();
    println!(
        "zipf report: {reports} reports, {} keys tracked, {} bytes used",
        memory.keys_tracked, memory.used_bytes
    );

    let mut batched = engine();
    let mut position = 0_usize;
    let mut reports = 0_u64;
    let mut batch: Vec<(&[u8], u32)> = Vec::with_capacity(BATCH_ITEMS);
    group.bench_function("report_batch_1000", |bencher| {
        bencher.iter(|| {
            for _ in 0..REPORTS_PER_ITERATION / BATCH_ITEMS {
                batch.clear();
                for _ in 0..BATCH_ITEMS {
                    batch.push((stream[position], 1));
                    position = (position + 1) % STREAM_LENGTH;
                }
                reports += BATCH_ITEMS as u64;
                if reports.is_multiple_of(REPORTS_PER_MS) {
                    batched.tick(reports / REPORTS_PER_MS, &mut events);
                }
                let outcome = batched
                    .report_batch(APP, &batch, reports / REPORTS_PER_MS, &mut events)
                    .expect("valid batch");
                black_box(outcome);
            }
            events.clear();
        });
    });
    let memory = batched.memory();
    println!(
        "zipf report_batch: {reports} reports, {} keys tracked, {} bytes used",
        memory.keys_tracked, memory.used_bytes
    );
    group.finish();
}

fn bench_cold(criterion: &mut Criterion) {
    let mut group = criterion.benchmark_group("uniform_10m_keys");
    group.throughput(Throughput::Elements(REPORTS_PER_ITERATION as u64));
    let mut cold = engine();
    let mut random = Random(0x2545_F491_4F6C_DD1D);
    let mut events = Vec::new();
    let mut reports = 0_u64;
    group.bench_function("report_cold", |bencher| {
        bencher.iter(|| {
            for _ in 0..REPORTS_PER_ITERATION {
                let key = (random.next() % COLD_KEYS).to_le_bytes();
                reports += 1;
                if reports.is_multiple_of(REPORTS_PER_MS) {
                    cold.tick(reports / REPORTS_PER_MS, &mut events);
                }
                cold.report(APP, &key, 1, reports / REPORTS_PER_MS, &mut events)
                    .expect("valid report");
            }
            events.clear();
        });
    });
    let memory = cold.memory();
    println!(
        "cold report: {reports} reports, {} keys tracked, {} bytes used",
        memory.keys_tracked, memory.used_bytes
    );

    let mut cold_batched = engine();
    let mut reports = 0_u64;
    let mut keys = vec![[0_u8; 8]; BATCH_ITEMS];
    group.bench_function("report_batch_1000_cold", |bencher| {
        bencher.iter(|| {
            for _ in 0..REPORTS_PER_ITERATION / BATCH_ITEMS {
                for key in &mut keys {
                    *key = (random.next() % COLD_KEYS).to_le_bytes();
                }
                let batch: Vec<(&[u8], u32)> = keys.iter().map(|key| (&key[..], 1)).collect();
                reports += BATCH_ITEMS as u64;
                if reports.is_multiple_of(REPORTS_PER_MS) {
                    cold_batched.tick(reports / REPORTS_PER_MS, &mut events);
                }
                let outcome = cold_batched
                    .report_batch(APP, &batch, reports / REPORTS_PER_MS, &mut events)
                    .expect("valid batch");
                black_box(outcome);
            }
            events.clear();
        });
    });
    let memory = cold_batched.memory();
    println!(
        "cold report_batch: {reports} reports, {} keys tracked, {} bytes used",
        memory.keys_tracked, memory.used_bytes
    );
    group.finish();
}

criterion_group!(benches, bench_zipf, bench_cold);
criterion_main!(benches);
