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
//!
//! [`AdaptiveBudget`] is the cluster form: a rate budget adapted by AIMD from the call
//! statistics of many clients, interval by interval.

use crate::breaker::CallCounts;

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

/// A rate budget adapted from call statistics reported by many clients (the cluster mode's
/// adaptive limit, as `PhxQueue` recomputes its flow control from call counts): every
/// evaluation interval the caller hands it that interval's [`CallCounts`] over all clients.
///
/// AIMD on the budget: an interval with at least `min_calls` calls whose error ratio passes
/// `error_ratio_max`, or whose mean latency (of successes) passes `latency_ns_max`, is an
/// overload and multiplies the budget by `backoff`; any other interval adds `max / 20`
/// (so a budget climbs from its floor to `max` in at most 20 intervals). The budget always
/// stays within `[min, max]`. Against a backend whose latency rises past a load L, the budget
/// saws between about `backoff x L` and `L + max / 20`.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveBudget {
    min: u64,
    max: u64,
    budget: f64,
    /// Intervals with fewer calls decide nothing (no evidence of overload).
    pub min_calls: u64,
    /// An error ratio above this is an overload, (0, 1]; 1 turns the error test off.
    pub error_ratio_max: f64,
    /// A mean success latency above this is an overload; 0 turns the latency test off.
    pub latency_ns_max: u64,
    /// The factor applied on an overload, (0, 1).
    pub backoff: f64,
}

impl AdaptiveBudget {
    /// A budget starting at `max` (the configured one) and never below `min` (at least 1).
    pub fn new(min: u64, max: u64) -> Self {
        let min = min.clamp(1, max.max(1));
        Self {
            min,
            max: max.max(min),
            #[allow(clippy::cast_precision_loss, reason = "budgets far below 2^52")]
            budget: max.max(min) as f64,
            min_calls: 10,
            error_ratio_max: 0.1,
            latency_ns_max: 0,
            backoff: 0.9,
        }
    }

    /// The budget now, rounded down, within `[min, max]`.
    pub fn budget(&self) -> u64 {
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "clamped to [min, max]"
        )]
        let budget = self.budget as u64;
        budget.clamp(self.min, self.max)
    }

    /// Changes the range (the rule changed); the budget is clamped into it.
    pub fn set_range(&mut self, min: u64, max: u64) {
        self.min = min.clamp(1, max.max(1));
        self.max = max.max(self.min);
        #[allow(clippy::cast_precision_loss, reason = "budgets far below 2^52")]
        let (low, high) = (self.min as f64, self.max as f64);
        self.budget = self.budget.clamp(low, high);
    }

    /// Whether `counts` shows an overload.
    pub fn is_overload(&self, counts: CallCounts) -> bool {
        if counts.calls < self.min_calls.max(1) {
            return false;
        }
        #[allow(clippy::cast_precision_loss, reason = "counts far below 2^52")]
        let error_ratio = counts.errors as f64 / counts.calls as f64;
        let successes = counts.calls.saturating_sub(counts.errors);
        let mean_latency = counts.latency_sum_ns.checked_div(successes).unwrap_or(0);
        error_ratio > self.error_ratio_max
            || (self.latency_ns_max > 0 && mean_latency > self.latency_ns_max)
    }

    /// Takes one evaluation interval's calls and returns the new budget.
    pub fn record(&mut self, counts: CallCounts) -> u64 {
        #[allow(clippy::cast_precision_loss, reason = "budgets far below 2^52")]
        let (low, high) = (self.min as f64, self.max as f64);
        self.budget = if self.is_overload(counts) {
            self.budget * self.backoff
        } else {
            self.budget + high / 20.0
        }
        .clamp(low, high);
        self.budget()
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
    fn given_a_backend_that_slows_past_a_load_then_the_budget_saws_around_that_load() {
        // The backend answers in 10 ms up to 500 calls an interval, slower beyond.
        let mut budget = AdaptiveBudget::new(50, 2_000);
        budget.latency_ns_max = 15_000_000;
        let mut seen = Vec::new();
        for _ in 0..200 {
            let calls = budget.budget();
            let latency = if calls <= 500 {
                10_000_000
            } else {
                10_000_000 * calls / 250
            };
            seen.push(budget.record(CallCounts {
                calls,
                latency_sum_ns: latency * calls,
                ..CallCounts::default()
            }));
        }
        let settled = &seen[100..];
        assert!(
            settled.iter().all(|b| (400..=900).contains(b)),
            "{settled:?}"
        );
    }

    #[test]
    fn given_errors_then_the_budget_falls_to_its_floor_and_climbs_back() {
        let mut budget = AdaptiveBudget::new(10, 1_000);
        let failing = CallCounts {
            calls: 100,
            errors: 50,
            ..CallCounts::default()
        };
        for _ in 0..100 {
            budget.record(failing);
        }
        assert_eq!(budget.budget(), 10);
        // Too few calls to judge: not an overload, so it climbs.
        assert_eq!(
            budget.record(CallCounts {
                calls: 5,
                errors: 5,
                ..failing
            }),
            60
        );
        for _ in 0..30 {
            budget.record(CallCounts::default());
        }
        assert_eq!(budget.budget(), 1_000);
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
