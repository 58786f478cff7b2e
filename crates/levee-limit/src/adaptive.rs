//! [`AdaptiveLimit`]: a concurrency limit computed from the calls themselves, for a dependency
//! whose capacity nobody configured (Netflix's `concurrency-limits`, the flow control of `PhxQueue`).
//! Feed it every call's outcome and latency; read [`AdaptiveLimit::limit`] and set it on a
//! [`crate::ConcurrencyLimiter`].
//!
//! - **AIMD**: a success no slower than `latency_ns_max` raises the limit by one; an error, or
//!   a call slower than that, multiplies it by `backoff` (0.9 by default). Simple, and it saws
//!   around the capacity.
//! - **Gradient** (Netflix's first gradient limit): the limit follows the ratio of the no-load
//!   latency (the lowest seen) to the recent one (an exponential average over about 10
//!   calls): `new = limit x clamp(tolerance x no_load / recent, 0.5, 1) + sqrt(limit)` (the
//!   square root is the queue it may build), smoothed by 0.2 per call. While latency stays
//!   within `tolerance` of its no-load level the limit grows by about its square root; beyond,
//!   it shrinks. It settles where `limit = tolerance x capacity + sqrt(limit)` for a backend
//!   whose latency grows with the queue past its capacity. An error counts as a call at twice
//!   the recent latency. The no-load latency is the lowest ever seen: call
//!   [`AdaptiveLimit::reset_baseline`] when the dependency changes (a deploy, a new host).
//!
//! The limit always stays within `[min, max]`.

/// The algorithm.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AdaptiveAlgorithm {
    /// Additive increase, multiplicative decrease.
    Aimd {
        /// A success slower than this counts as an overload.
        latency_ns_max: u64,
        /// The factor applied on an overload, (0, 1).
        backoff: f64,
    },
    /// A gradient of latencies (Netflix's first gradient limit).
    Gradient {
        /// Latency rises up to this factor over its no-load level are tolerated (1.5 is
        /// usual).
        tolerance: f64,
    },
}

/// A limit that adapts to the calls' latencies and errors.
#[derive(Debug, Clone)]
pub struct AdaptiveLimit {
    algorithm: AdaptiveAlgorithm,
    min: f64,
    max: f64,
    limit: f64,
    no_load_ns: Option<f64>,
    recent_ns: Option<f64>,
}

impl AdaptiveLimit {
    /// A limit starting at `initial`, kept within `[min, max]` (min at least 1).
    pub fn new(algorithm: AdaptiveAlgorithm, initial: u32, min: u32, max: u32) -> Self {
        let min = f64::from(min.max(1));
        let max = f64::from(max).max(min);
        Self {
            algorithm,
            min,
            max,
            limit: f64::from(initial).clamp(min, max),
            no_load_ns: None,
            recent_ns: None,
        }
    }

    /// The limit now, rounded down.
    pub fn limit(&self) -> u32 {
        // Clamped to [1, u32::MAX] on every update.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let limit = self.limit as u32;
        limit
    }

    /// Forgets the no-load latency (gradient): the next calls measure it again.
    pub fn reset_baseline(&mut self) {
        self.no_load_ns = None;
    }

    /// Takes one call's outcome: its latency, and whether it failed (an error or a timeout).
    pub fn record(&mut self, latency_ns: u64, failed: bool) {
        // Latencies far below 2^52 ns (52 days).
        #[allow(clippy::cast_precision_loss)]
        let latency = latency_ns as f64;
        match self.algorithm {
            AdaptiveAlgorithm::Aimd {
                latency_ns_max,
                backoff,
            } => {
                if failed || latency_ns > latency_ns_max {
                    self.limit *= backoff;
                } else {
                    self.limit += 1.0;
                }
            }
            AdaptiveAlgorithm::Gradient { tolerance } => {
                let recent = self.recent_ns.unwrap_or(latency);
                let sample = if failed { recent * 2.0 } else { latency };
                let recent = recent + (sample - recent) / 10.0;
                let no_load = self
                    .no_load_ns
                    .map_or(sample, |no_load| no_load.min(sample));
                self.recent_ns = Some(recent);
                self.no_load_ns = Some(no_load);
                let gradient = (tolerance * no_load / recent.max(1.0)).clamp(0.5, 1.0);
                let target = self.limit * gradient + self.limit.sqrt();
                self.limit = self.limit * 0.8 + target * 0.2;
            }
        }
        self.limit = self.limit.clamp(self.min, self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend whose latency is 10 ms up to 50 calls in flight and grows with the queue
    /// beyond: the limit must settle near 50.
    fn backend_latency_ns(in_flight: u32) -> u64 {
        let base = 10_000_000_u64;
        if in_flight <= 50 {
            base
        } else {
            base * u64::from(in_flight) / 50
        }
    }

    fn settle(mut limit: AdaptiveLimit) -> u32 {
        for _ in 0..20_000 {
            let in_flight = limit.limit();
            limit.record(backend_latency_ns(in_flight), false);
        }
        limit.limit()
    }

    #[test]
    fn given_aimd_against_a_backend_that_slows_when_overloaded_then_it_saws_around_capacity() {
        let aimd = AdaptiveAlgorithm::Aimd {
            latency_ns_max: 12_000_000,
            backoff: 0.9,
        };
        let settled = settle(AdaptiveLimit::new(aimd, 10, 1, 1_000));
        assert!((45..=61).contains(&settled), "{settled}");
    }

    #[test]
    fn given_gradient_against_a_backend_that_slows_when_overloaded_then_it_converges_near_capacity()
    {
        let gradient = AdaptiveAlgorithm::Gradient { tolerance: 1.5 };
        let settled = settle(AdaptiveLimit::new(gradient, 10, 1, 1_000));
        assert!((40..=110).contains(&settled), "{settled}");
    }

    #[test]
    fn given_errors_then_the_limit_falls_but_never_below_min() {
        let aimd = AdaptiveAlgorithm::Aimd {
            latency_ns_max: 1,
            backoff: 0.5,
        };
        let mut limit = AdaptiveLimit::new(aimd, 100, 4, 1_000);
        for _ in 0..100 {
            limit.record(0, true);
        }
        assert_eq!(limit.limit(), 4);
    }
}
