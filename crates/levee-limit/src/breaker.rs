//! [`CircuitBreaker`]: stops calls to a failing dependency, then probes it.
//!
//! - **Closed**: every call passes; outcomes are counted in a sliding window of `buckets`
//!   buckets spanning `window_ns`. After each recorded call, once the window holds at least
//!   `min_calls` calls, the breaker opens when its trip condition holds: an error ratio, an
//!   error count, or a slow-call ratio (calls slower than `slow_ns`). So it opens on the very
//!   call that crosses the threshold, within one window of the ratio crossing it.
//! - **Open**: no call passes for `open_ns`.
//! - **Half-open**: `probes` calls pass; if all succeed (and none is slow, for a slow-call
//!   trip) the breaker closes with an empty window, else it opens again.

use crate::{Nanos, RuleError};

/// What makes the breaker open.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Trip {
    /// Errors / calls at least this (0 to 1].
    ErrorRatio(f64),
    /// At least this many errors in the window.
    ErrorCount(u64),
    /// Calls slower than `slow_ns` / calls at least `ratio`.
    SlowRatio {
        /// A call slower than this is slow.
        slow_ns: u64,
        /// (0 to 1].
        ratio: f64,
    },
}

/// A breaker's rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerRule {
    /// The evaluation window: 1 ms to an hour.
    pub window_ns: u64,
    /// Buckets the window slides by: 1 to 60.
    pub buckets: u32,
    /// Calls the window must hold before the breaker may open: at least 1.
    pub min_calls: u64,
    /// When it opens.
    pub trip: Trip,
    /// How long it stays open before probing: 1 ms to an hour.
    pub open_ns: u64,
    /// Calls let through while half-open: 1 to 1000.
    pub probes: u32,
}

const HOUR_NS: u64 = 3_600_000_000_000;

impl BreakerRule {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), RuleError> {
        let range = |field, got: u64, min, max, fix| {
            if (min..=max).contains(&got) {
                Ok(())
            } else {
                Err(RuleError::OutOfRange {
                    field,
                    got,
                    min,
                    max,
                    fix,
                })
            }
        };
        range(
            "window_ns",
            self.window_ns,
            1_000_000,
            HOUR_NS,
            "give 1 ms to an hour",
        )?;
        range(
            "buckets",
            u64::from(self.buckets),
            1,
            60,
            "give 1 to 60 buckets",
        )?;
        range(
            "open_ns",
            self.open_ns,
            1_000_000,
            HOUR_NS,
            "give 1 ms to an hour",
        )?;
        range(
            "probes",
            u64::from(self.probes),
            1,
            1_000,
            "give 1 to 1000 probes",
        )?;
        if self.min_calls == 0 {
            return Err(RuleError::NotPositive {
                field: "min_calls",
                got: 0,
            });
        }
        let ratio = |field, got: f64| {
            if got > 0.0 && got <= 1.0 {
                Ok(())
            } else {
                Err(RuleError::BadRatio { field, got })
            }
        };
        match self.trip {
            Trip::ErrorRatio(value) => ratio("trip.error_ratio", value),
            Trip::ErrorCount(0) => Err(RuleError::NotPositive {
                field: "trip.error_count",
                got: 0,
            }),
            Trip::ErrorCount(_) => Ok(()),
            Trip::SlowRatio { ratio: value, .. } => ratio("trip.slow_ratio", value),
        }
    }
}

/// How a call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// It succeeded, taking this long.
    Success {
        /// Its latency.
        latency_ns: u64,
    },
    /// It failed.
    Error,
}

/// Calls counted together, for [`CircuitBreaker::record_counts`] and
/// [`crate::AdaptiveBudget::record`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallCounts {
    /// Calls that ended.
    pub calls: u64,
    /// Of them, failed.
    pub errors: u64,
    /// Of them, succeeded slower than the slow-call limit.
    pub slow: u64,
    /// Their latencies added up, in nanoseconds (successes only).
    pub latency_sum_ns: u64,
}

impl CallCounts {
    /// Adds `other`'s counts.
    pub fn add(&mut self, other: Self) {
        self.calls = self.calls.saturating_add(other.calls);
        self.errors = self.errors.saturating_add(other.errors);
        self.slow = self.slow.saturating_add(other.slow);
        self.latency_sum_ns = self.latency_sum_ns.saturating_add(other.latency_sum_ns);
    }
}

/// The breaker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls pass.
    Closed,
    /// No call passes until then.
    Open {
        /// When it turns half-open.
        until: Nanos,
    },
    /// Probes pass.
    HalfOpen {
        /// Probes let through so far.
        let_through: u32,
        /// Probes that succeeded so far.
        succeeded: u32,
    },
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    /// Which bucket of time this is (now / bucket length); counts of another one are stale.
    slot: u64,
    calls: u64,
    errors: u64,
    slow: u64,
}

/// A circuit breaker.
#[derive(Debug, Clone)]
pub struct CircuitBreaker {
    rule: BreakerRule,
    state: BreakerState,
    buckets: Vec<Bucket>,
    /// Times it opened.
    opened: u64,
    /// Half-open: when the last probe was let through. Probes not reported within `open_ns` of
    /// it are presumed lost (a caller that never reported) and let through again, so the
    /// breaker never stays half-open for want of reports.
    probed_at: Nanos,
}

impl CircuitBreaker {
    /// A closed breaker of `rule`.
    pub fn new(rule: BreakerRule) -> Result<Self, RuleError> {
        rule.validate()?;
        Ok(Self {
            rule,
            state: BreakerState::Closed,
            buckets: vec![Bucket::default(); rule.buckets as usize],
            opened: 0,
            probed_at: 0,
        })
    }

    /// The state at `now` (an open breaker whose time is up is half-open).
    pub fn state(&mut self, now: Nanos) -> BreakerState {
        if let BreakerState::Open { until } = self.state
            && now >= until
        {
            self.state = BreakerState::HalfOpen {
                let_through: 0,
                succeeded: 0,
            };
        }
        self.state
    }

    /// Times it opened so far.
    pub fn times_opened(&self) -> u64 {
        self.opened
    }

    /// Whether a call may go now.
    pub fn allow(&mut self, now: Nanos) -> bool {
        self.allow_many(1, now) == 1
    }

    fn bucket_ns(&self) -> u64 {
        (self.rule.window_ns / u64::from(self.rule.buckets)).max(1)
    }

    fn is_slow(&self, outcome: CallOutcome) -> bool {
        match (self.rule.trip, outcome) {
            (Trip::SlowRatio { slow_ns, .. }, CallOutcome::Success { latency_ns }) => {
                latency_ns > slow_ns
            }
            _ => false,
        }
    }

    /// Records how a call that was allowed ended.
    pub fn record(&mut self, outcome: CallOutcome, now: Nanos) {
        let failed = outcome == CallOutcome::Error || self.is_slow(outcome);
        match self.state(now) {
            BreakerState::Open { .. } => {}
            BreakerState::HalfOpen {
                let_through,
                succeeded,
            } => {
                if failed {
                    self.open(now);
                } else if succeeded + 1 >= self.rule.probes {
                    self.state = BreakerState::Closed;
                    self.buckets.fill(Bucket::default());
                } else {
                    self.state = BreakerState::HalfOpen {
                        let_through,
                        succeeded: succeeded + 1,
                    };
                }
            }
            BreakerState::Closed => {
                let counts = CallCounts {
                    calls: 1,
                    errors: u64::from(outcome == CallOutcome::Error),
                    slow: u64::from(self.is_slow(outcome)),
                    latency_sum_ns: 0,
                };
                self.count_closed(counts, now);
            }
        }
    }

    /// Of `wanted` calls, how many may go now: the batch form of [`Self::allow`] for leases
    /// (all while closed, none while open, what is left of the probes while half-open; probes
    /// let through more than `open_ns` ago and never reported are let through again).
    pub fn allow_many(&mut self, wanted: u64, now: Nanos) -> u64 {
        match self.state(now) {
            BreakerState::Closed => wanted,
            BreakerState::Open { .. } => 0,
            BreakerState::HalfOpen {
                mut let_through,
                succeeded,
            } => {
                if let_through >= self.rule.probes
                    && now >= self.probed_at.saturating_add(self.rule.open_ns)
                {
                    let_through = succeeded;
                }
                let left = u64::from(self.rule.probes.saturating_sub(let_through));
                let allowed = wanted.min(left);
                if allowed > 0 {
                    self.probed_at = now;
                }
                self.state = BreakerState::HalfOpen {
                    let_through: let_through + u32::try_from(allowed).unwrap_or(0),
                    succeeded,
                };
                allowed
            }
        }
    }

    /// Records calls reported together (a lease period's calls of many clients, counted by
    /// each client): `counts.calls` calls, of which `errors` failed and `slow` succeeded slower
    /// than the slow-call limit. As [`Self::record`] for each, with one trip check at the end.
    /// Half-open, a failure opens it again, and successes count as probes only up to the probes
    /// let through and not yet reported (calls admitted before it opened do not close it).
    pub fn record_counts(&mut self, counts: CallCounts, now: Nanos) {
        if counts.calls == 0 {
            return;
        }
        let slow_trips = matches!(self.rule.trip, Trip::SlowRatio { .. });
        let failed = counts.errors + if slow_trips { counts.slow } else { 0 };
        match self.state(now) {
            BreakerState::Open { .. } => {}
            BreakerState::HalfOpen {
                let_through,
                succeeded,
            } => {
                let outstanding = u64::from(let_through.saturating_sub(succeeded));
                let succeeded = u64::from(succeeded).saturating_add(counts.calls.min(outstanding));
                if failed > 0 {
                    self.open(now);
                } else if succeeded >= u64::from(self.rule.probes) {
                    self.state = BreakerState::Closed;
                    self.buckets.fill(Bucket::default());
                } else {
                    self.state = BreakerState::HalfOpen {
                        let_through,
                        succeeded: u32::try_from(succeeded).unwrap_or(u32::MAX),
                    };
                }
            }
            BreakerState::Closed => {
                let counted = CallCounts {
                    errors: counts.errors.min(counts.calls),
                    slow: if slow_trips { counts.slow } else { 0 },
                    ..counts
                };
                self.count_closed(counted, now);
            }
        }
    }

    /// Counts calls in the current bucket of a closed breaker and opens it if they trip it.
    fn count_closed(&mut self, counts: CallCounts, now: Nanos) {
        let current = now / self.bucket_ns();
        let index = usize::try_from(current % u64::from(self.rule.buckets)).unwrap_or(0);
        let bucket = &mut self.buckets[index];
        if bucket.slot != current {
            *bucket = Bucket {
                slot: current,
                ..Bucket::default()
            };
        }
        bucket.calls += counts.calls;
        bucket.errors += counts.errors;
        bucket.slow += counts.slow;
        if self.trips(current) {
            self.open(now);
        }
    }

    /// The slow-call limit of a slow-ratio trip (`None` for the other trips).
    pub fn slow_ns(&self) -> Option<u64> {
        match self.rule.trip {
            Trip::SlowRatio { slow_ns, .. } => Some(slow_ns),
            _ => None,
        }
    }

    /// Whether the window ending in bucket `newest` meets the trip condition.
    fn trips(&self, newest: u64) -> bool {
        let oldest = newest.saturating_sub(u64::from(self.rule.buckets) - 1);
        let (calls, errors, slow) = self
            .buckets
            .iter()
            .filter(|bucket| bucket.slot >= oldest && bucket.slot <= newest && bucket.calls > 0)
            .fold((0, 0, 0), |(calls, errors, slow), bucket| {
                (
                    calls + bucket.calls,
                    errors + bucket.errors,
                    slow + bucket.slow,
                )
            });
        if calls < self.rule.min_calls {
            return false;
        }
        // Counts far below 2^52: the ratios are exact enough.
        #[allow(clippy::cast_precision_loss)]
        let ratio = |count: u64| count as f64 / calls as f64;
        match self.rule.trip {
            Trip::ErrorRatio(threshold) => ratio(errors) >= threshold,
            Trip::ErrorCount(threshold) => errors >= threshold,
            Trip::SlowRatio {
                ratio: threshold, ..
            } => ratio(slow) >= threshold,
        }
    }

    fn open(&mut self, now: Nanos) {
        self.state = BreakerState::Open {
            until: now.saturating_add(self.rule.open_ns),
        };
        self.opened += 1;
        self.buckets.fill(Bucket::default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn rule(trip: Trip) -> BreakerRule {
        BreakerRule {
            window_ns: 1_000 * MS,
            buckets: 10,
            min_calls: 10,
            trip,
            open_ns: 500 * MS,
            probes: 2,
        }
    }

    #[test]
    fn given_errors_over_the_ratio_then_it_opens_probes_and_closes() {
        let mut breaker = CircuitBreaker::new(rule(Trip::ErrorRatio(0.5))).unwrap();
        let ok = CallOutcome::Success { latency_ns: MS };
        for now in 0..5 {
            breaker.record(ok, now * MS);
        }
        for now in 5..9 {
            breaker.record(CallOutcome::Error, now * MS);
        }
        assert_eq!(
            breaker.state(9 * MS),
            BreakerState::Closed,
            "9 calls: under min_calls"
        );
        breaker.record(CallOutcome::Error, 9 * MS);
        // 5 errors in 10 calls: 0.5 reached, open at once.
        assert!(!breaker.allow(10 * MS));
        assert!(!breaker.allow(508 * MS));
        // Half-open: two probes, the third waits.
        assert!(breaker.allow(510 * MS) && breaker.allow(510 * MS));
        assert!(!breaker.allow(510 * MS));
        breaker.record(ok, 511 * MS);
        breaker.record(ok, 512 * MS);
        assert_eq!(breaker.state(512 * MS), BreakerState::Closed);
        assert_eq!(breaker.times_opened(), 1);
    }

    #[test]
    fn given_a_failed_probe_then_it_opens_again() {
        let mut breaker = CircuitBreaker::new(rule(Trip::ErrorCount(3))).unwrap();
        for now in 0..10 {
            breaker.record(CallOutcome::Error, now);
        }
        assert!(matches!(breaker.state(10), BreakerState::Open { .. }));
        assert!(breaker.allow(600 * MS));
        breaker.record(CallOutcome::Error, 600 * MS);
        assert_eq!(
            breaker.state(600 * MS),
            BreakerState::Open { until: 1_100 * MS }
        );
    }

    #[test]
    fn given_counts_reported_in_batches_then_it_trips_probes_and_closes_as_for_single_calls() {
        let mut breaker = CircuitBreaker::new(rule(Trip::ErrorRatio(0.5))).unwrap();
        let batch = |calls, errors| CallCounts {
            calls,
            errors,
            ..CallCounts::default()
        };
        breaker.record_counts(batch(6, 2), 0);
        assert_eq!(breaker.allow_many(100, MS), 100, "6 calls: under min_calls");
        breaker.record_counts(batch(6, 4), 100 * MS);
        // 6 errors in 12 calls: open.
        assert_eq!(breaker.allow_many(100, 101 * MS), 0);
        // Half-open after 500 ms: two probes in all, however they are asked for.
        assert_eq!(breaker.allow_many(1, 700 * MS), 1);
        assert_eq!(breaker.allow_many(5, 700 * MS), 1);
        assert_eq!(breaker.allow_many(5, 700 * MS), 0);
        breaker.record_counts(batch(2, 0), 800 * MS);
        assert_eq!(breaker.state(800 * MS), BreakerState::Closed);
        breaker.record_counts(batch(10, 10), 900 * MS);
        assert_eq!(breaker.times_opened(), 2);
    }

    #[test]
    fn given_half_open_then_only_reported_probes_close_it_and_lost_probes_are_let_through_again() {
        let mut breaker = CircuitBreaker::new(rule(Trip::ErrorCount(3))).unwrap();
        let counts = |calls, errors| CallCounts {
            calls,
            errors,
            ..CallCounts::default()
        };
        breaker.record_counts(counts(10, 10), 0);
        // Half-open at 500 ms: successes of calls admitted before (no probe out) close nothing.
        breaker.record_counts(counts(50, 0), 600 * MS);
        assert!(matches!(
            breaker.state(600 * MS),
            BreakerState::HalfOpen { .. }
        ));
        // Two probes go and are never reported: within open_ns (500 ms) nothing more goes...
        assert_eq!(breaker.allow_many(10, 600 * MS), 2);
        assert_eq!(breaker.allow_many(10, 1_000 * MS), 0);
        // ... then they are presumed lost and let through again.
        assert_eq!(breaker.allow_many(10, 1_100 * MS), 2);
        breaker.record_counts(counts(5, 0), 1_200 * MS);
        assert_eq!(breaker.state(1_200 * MS), BreakerState::Closed);
    }

    #[test]
    fn given_slow_calls_in_a_batch_then_a_slow_ratio_trip_counts_them() {
        let mut breaker = CircuitBreaker::new(rule(Trip::SlowRatio {
            slow_ns: 5 * MS,
            ratio: 0.3,
        }))
        .unwrap();
        assert_eq!(breaker.slow_ns(), Some(5 * MS));
        let counts = CallCounts {
            calls: 10,
            slow: 2,
            ..CallCounts::default()
        };
        breaker.record_counts(counts, 0);
        assert_eq!(breaker.state(0), BreakerState::Closed);
        breaker.record_counts(CallCounts { slow: 5, ..counts }, MS);
        assert!(matches!(breaker.state(MS), BreakerState::Open { .. }));
    }

    #[test]
    fn given_old_errors_then_they_slide_out_of_the_window() {
        let mut breaker = CircuitBreaker::new(rule(Trip::ErrorRatio(0.5))).unwrap();
        for now in 0..6 {
            breaker.record(CallOutcome::Error, now * MS);
        }
        // Two seconds later the errors are out of the window: 10 fresh successes keep it shut.
        for now in 0..10 {
            breaker.record(
                CallOutcome::Success { latency_ns: 1 },
                2_000 * MS + now * MS,
            );
        }
        assert_eq!(breaker.state(2_010 * MS), BreakerState::Closed);
    }

    #[test]
    fn given_slow_calls_over_the_ratio_then_it_opens() {
        let trip = Trip::SlowRatio {
            slow_ns: 100 * MS,
            ratio: 0.3,
        };
        let mut breaker = CircuitBreaker::new(rule(trip)).unwrap();
        for now in 0..7 {
            breaker.record(CallOutcome::Success { latency_ns: MS }, now * MS);
        }
        for now in 7..10 {
            breaker.record(
                CallOutcome::Success {
                    latency_ns: 200 * MS,
                },
                now * MS,
            );
        }
        assert!(matches!(breaker.state(10 * MS), BreakerState::Open { .. }));
    }

    #[test]
    fn given_bad_rules_then_the_error_names_the_field() {
        let mut bad = rule(Trip::ErrorRatio(1.5));
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("trip.error_ratio")
        );
        bad.trip = Trip::ErrorCount(0);
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("error_count")
        );
        bad = rule(Trip::ErrorCount(1));
        bad.buckets = 0;
        assert!(bad.validate().unwrap_err().to_string().contains("buckets"));
    }
}
