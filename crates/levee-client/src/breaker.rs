//! [`Breaker`]: a circuit breaker in this process, around calls to a dependency. The engine's
//! [`CircuitBreaker`] (docs/LIMITS.md) decides on this process's monotonic clock; a
//! [`CallGuard`] reports each call's outcome and latency to it. As Sentinel's breakers, each
//! process judges its own calls: no network on the call's path.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

pub use levee_limit::breaker::Trip;
pub use levee_limit::{BreakerRule, BreakerState};
use levee_limit::{CallOutcome, CircuitBreaker};

use crate::error::ClientError;

/// A circuit breaker shared by clones; see the module docs.
#[derive(Debug, Clone)]
pub struct Breaker {
    engine: Arc<Mutex<CircuitBreaker>>,
    started: Instant,
}

/// One call let through: say how it ended with [`CallGuard::success`] or
/// [`CallGuard::failure`]; a guard dropped without either counts as a failure (the call was
/// cancelled or panicked).
#[derive(Debug)]
pub struct CallGuard {
    breaker: Breaker,
    called: Instant,
    reported: bool,
}

impl Breaker {
    /// A closed breaker under `rule` (checked: a bad field is [`ClientError::InvalidOptions`]
    /// naming it).
    pub fn new(rule: BreakerRule) -> Result<Self, ClientError> {
        let engine = CircuitBreaker::new(rule)
            .map_err(|error| ClientError::InvalidOptions(error.to_string()))?;
        Ok(Self {
            engine: Arc::new(Mutex::new(engine)),
            started: Instant::now(),
        })
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn engine(&self) -> std::sync::MutexGuard<'_, CircuitBreaker> {
        self.engine.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A guard for one call when the breaker lets it through (closed, or a half-open probe);
    /// `None` while it is open: fail fast, or serve a fallback.
    pub fn try_call(&self) -> Option<CallGuard> {
        let now = self.now_ns();
        self.engine().allow(now).then(|| CallGuard {
            breaker: self.clone(),
            called: Instant::now(),
            reported: false,
        })
    }

    /// The breaker's state now.
    pub fn state(&self) -> BreakerState {
        let now = self.now_ns();
        self.engine().state(now)
    }

    /// Times it opened so far.
    pub fn times_opened(&self) -> u64 {
        self.engine().times_opened()
    }

    fn record(&self, outcome: CallOutcome) {
        let now = self.now_ns();
        self.engine().record(outcome, now);
    }
}

impl CallGuard {
    /// The call succeeded; its latency (since [`Breaker::try_call`]) counts for slow-call trips.
    pub fn success(mut self) {
        self.reported = true;
        let latency_ns = u64::try_from(self.called.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.breaker.record(CallOutcome::Success { latency_ns });
    }

    /// The call failed.
    pub fn failure(mut self) {
        self.reported = true;
        self.breaker.record(CallOutcome::Error);
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if !self.reported {
            self.breaker.record(CallOutcome::Error);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn rule() -> BreakerRule {
        BreakerRule {
            window_ns: 10_000_000_000,
            buckets: 10,
            min_calls: 4,
            trip: Trip::ErrorRatio(0.5),
            open_ns: 50_000_000,
            probes: 1,
        }
    }

    #[test]
    fn given_failures_then_it_opens_fails_fast_probes_and_closes_on_success() {
        let breaker = Breaker::new(rule()).unwrap();
        breaker.try_call().unwrap().success();
        breaker.try_call().unwrap().failure();
        breaker.try_call().unwrap().failure();
        assert_eq!(
            breaker.state(),
            BreakerState::Closed,
            "3 calls: under min_calls"
        );
        drop(breaker.try_call().unwrap()); // A dropped guard is a failure.
        assert!(matches!(breaker.state(), BreakerState::Open { .. }));
        assert!(breaker.try_call().is_none(), "open: fail fast");
        assert_eq!(breaker.times_opened(), 1);
        std::thread::sleep(Duration::from_millis(60));
        let probe = breaker.try_call().expect("half-open: one probe passes");
        assert!(breaker.try_call().is_none(), "one probe at a time");
        probe.success();
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert!(breaker.try_call().is_some());
    }

    #[test]
    fn given_a_bad_rule_then_refused_naming_the_field() {
        let error = Breaker::new(BreakerRule {
            probes: 0,
            ..rule()
        })
        .unwrap_err();
        assert!(error.to_string().contains("probes"), "{error}");
    }
}
