//! Levee's flow-control engine (issue 37): the decisions of Sentinel-style limits as plain
//! data structures with no networking and no clock of their own. Every call takes the time as
//! [`Nanos`] (nanoseconds on any monotonic clock the caller chooses), so the engine is tested
//! with virtual time and property tests, and a server or a client library wires it to a real
//! clock.
//!
//! - [`rate`]: [`RateLimiter`], GCRA with a burst, an optional warm-up (a cold resource starts
//!   at a fraction of its rate and ramps up) and optional queueing (pace a call instead of
//!   refusing it, up to a longest wait). Over any interval of length D it admits at most
//!   `burst + D x rate` permits (the property tests check it).
//! - [`concurrency`]: [`ConcurrencyLimiter`], calls in flight.
//! - [`breaker`]: [`CircuitBreaker`], open on an error ratio, an error count or a slow-call
//!   ratio over a sliding window with a minimum of calls; half-open probes; close.
//! - [`per_key`]: [`PerKeyLimiter`], "no key of the resource above N/s", with exceptions for
//!   named keys and a bounded table of keys; a hot key can be given its own limit at once.
//! - [`adaptive`]: [`AdaptiveLimit`], a concurrency limit computed from the calls' outcomes and
//!   latencies (AIMD or gradient).
//! - [`lease`]: [`LeaseAllocator`], the cluster mode's budget: clients hold leases of tokens
//!   sized from their demand; the grants of each window never exceed the window's budget.
//! - [`RuleError`]: why a rule is refused, naming the field and the fix.

#![deny(missing_docs)]

pub mod adaptive;
pub mod breaker;
pub mod concurrency;
pub mod lease;
pub mod per_key;
pub mod rate;

pub use adaptive::{AdaptiveAlgorithm, AdaptiveBudget, AdaptiveLimit};
pub use breaker::{BreakerRule, BreakerState, CallCounts, CallOutcome, CircuitBreaker, Trip};
pub use concurrency::ConcurrencyLimiter;
pub use lease::{Grant, LeaseAllocator, LeaseRule};
pub use per_key::{PerKeyLimiter, PerKeyRule};
pub use rate::{Decision, RateLimiter, RateRule, Warmup};

/// A point in time, in nanoseconds on the caller's monotonic clock.
pub type Nanos = u64;

/// Nanoseconds in a second.
pub const NANOS_PER_S: u64 = 1_000_000_000;

/// Why a rule is refused. Each message names the field, the value and the fix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RuleError {
    /// A count or budget that must be above zero is not.
    #[error("{field}: must be at least 1, got {got}; give a positive {field}")]
    NotPositive {
        /// The field.
        field: &'static str,
        /// What was given.
        got: u64,
    },
    /// A value outside its range.
    #[error("{field}: must be {min} to {max}, got {got}; {fix}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// What was given.
        got: u64,
        /// The smallest accepted.
        min: u64,
        /// The largest accepted.
        max: u64,
        /// What to do.
        fix: &'static str,
    },
    /// A ratio outside (0, 1].
    #[error("{field}: must be above 0 and at most 1, got {got}; give a ratio such as 0.5")]
    BadRatio {
        /// The field.
        field: &'static str,
        /// What was given.
        got: f64,
    },
}
