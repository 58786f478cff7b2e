//! Criterion micro-benchmarks of local limit decisions on one thread: a GCRA rate limiter that
//! admits every call (a generous limit), one that refuses most (a tight one), a per-key limiter
//! over 10,000 keys, and a circuit breaker's allow-and-record.
//!
//! Run: `cargo bench -p levee-limit --bench decisions -- --measurement-time 3 --warm-up-time 1`

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use levee_limit::breaker::Trip;
use levee_limit::{
    BreakerRule, CallOutcome, CircuitBreaker, PerKeyLimiter, PerKeyRule, RateLimiter, RateRule,
};

const CALLS: u64 = 100_000;

fn decisions(criterion: &mut Criterion) {
    let mut group = criterion.benchmark_group("decisions");
    group.throughput(Throughput::Elements(CALLS));
    group.bench_function("rate_admitting", |bench| {
        let mut limiter = RateLimiter::new(RateRule::per_second(1_000_000_000)).unwrap();
        let mut now = 0_u64;
        bench.iter(|| {
            for _ in 0..CALLS {
                now += 10;
                black_box(limiter.try_acquire(1, now));
            }
        });
    });
    group.bench_function("rate_refusing", |bench| {
        let mut limiter = RateLimiter::new(RateRule::per_second(1_000)).unwrap();
        let mut now = 0_u64;
        bench.iter(|| {
            for _ in 0..CALLS {
                now += 10;
                black_box(limiter.try_acquire(1, now));
            }
        });
    });
    group.bench_function("per_key_10000_keys", |bench| {
        let rule = PerKeyRule {
            default: RateRule::per_second(100),
            exceptions: std::collections::BTreeMap::new(),
            keys_max: 10_000,
        };
        let mut limiter = PerKeyLimiter::new(rule).unwrap();
        let keys: Vec<Vec<u8>> = (0..10_000_u32)
            .map(|key| key.to_le_bytes().to_vec())
            .collect();
        let mut now = 0_u64;
        bench.iter(|| {
            for call in 0..CALLS {
                now += 10;
                let key = &keys[usize::try_from(call % 10_000).unwrap()];
                black_box(limiter.try_acquire(key, 1, now));
            }
        });
    });
    group.bench_function("breaker_allow_and_record", |bench| {
        let rule = BreakerRule {
            window_ns: 1_000_000_000,
            buckets: 10,
            min_calls: 100,
            trip: Trip::ErrorRatio(0.5),
            open_ns: 1_000_000_000,
            probes: 5,
        };
        let mut breaker = CircuitBreaker::new(rule).unwrap();
        let mut now = 0_u64;
        bench.iter(|| {
            for _ in 0..CALLS {
                now += 10;
                if breaker.allow(now) {
                    breaker.record(CallOutcome::Success { latency_ns: 1_000 }, now);
                }
            }
        });
    });
    group.finish();
}

criterion_group!(benches, decisions);
criterion_main!(benches);
