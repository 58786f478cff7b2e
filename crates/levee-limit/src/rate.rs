//! [`RateLimiter`]: a rate limit as GCRA (the generic cell rate algorithm: one "theoretical
//! arrival time" per limiter, no buckets to refill), in exact integer arithmetic.
//!
//! A rule allows `permits` per `period_ns` with a `burst`: after a quiet spell up to `burst`
//! permits pass at once, then one every `period_ns / permits`. Over any interval of length D the
//! limiter admits at most `burst + D x permits / period` permits (so a per-minute budget of
//! 21,000,000 with a burst of 1,000 is exceeded by at most 1,000 in any window).
//!
//! - **Warm-up** (optional): a resource that was idle for the warm-up period restarts cold, at
//!   `rate / cold_factor`, and ramps linearly to the full rate over the period (Sentinel's
//!   warm-up, without its token-bucket slope). Warm-up only ever admits less, so the bound
//!   above still holds.
//! - **Queueing** (optional): with `max_wait_ns` above zero a call that does not fit now is
//!   admitted with the wait it must observe (pacing, as Sentinel's rate limiter does) when that
//!   wait is at most `max_wait_ns`; the permits are reserved, so later calls wait behind it.

use crate::{NANOS_PER_S, Nanos, RuleError};

/// The largest burst accepted.
pub const BURST_MAX: u64 = 1_000_000_000;
/// The longest period accepted: a day.
pub const PERIOD_NS_MAX: u64 = 86_400 * NANOS_PER_S;
/// The longest queueing wait accepted: a minute.
pub const MAX_WAIT_NS_MAX: u64 = 60 * NANOS_PER_S;

/// How a cold resource ramps up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Warmup {
    /// How long the ramp takes, and how long a resource must be idle to be cold again.
    pub period_ns: u64,
    /// A cold resource starts at `rate / cold_factor` (2 to 10; Sentinel uses 3).
    pub cold_factor: u32,
}

/// A rate rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateRule {
    /// Permits per period: at least 1.
    pub permits: u64,
    /// The period, in nanoseconds: 1 ms to a day.
    pub period_ns: u64,
    /// Permits that may pass at once after a quiet spell: 1 to the permits of a period (a larger
    /// burst would pass more than a period's budget at once).
    pub burst: u64,
    /// Ramp up after idleness; none: the full rate at once.
    pub warmup: Option<Warmup>,
    /// Longest a call may be paced instead of refused; 0: refuse at once.
    pub max_wait_ns: u64,
}

impl RateRule {
    /// `permits` per second, a burst of one tenth of a second's worth (at least 1).
    pub fn per_second(permits: u64) -> Self {
        Self {
            permits,
            period_ns: NANOS_PER_S,
            burst: (permits / 10).max(1),
            warmup: None,
            max_wait_ns: 0,
        }
    }

    /// `permits` per minute, a burst of one second's worth (at least 1).
    pub fn per_minute(permits: u64) -> Self {
        Self {
            permits,
            period_ns: 60 * NANOS_PER_S,
            burst: (permits / 60).max(1),
            warmup: None,
            max_wait_ns: 0,
        }
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), RuleError> {
        if self.permits == 0 {
            return Err(RuleError::NotPositive {
                field: "permits",
                got: 0,
            });
        }
        if !(1_000_000..=PERIOD_NS_MAX).contains(&self.period_ns) {
            return Err(RuleError::OutOfRange {
                field: "period_ns",
                got: self.period_ns,
                min: 1_000_000,
                max: PERIOD_NS_MAX,
                fix: "give a period from 1 ms to a day",
            });
        }
        let burst_max = self.permits.min(BURST_MAX);
        if !(1..=burst_max).contains(&self.burst) {
            return Err(RuleError::OutOfRange {
                field: "burst",
                got: self.burst,
                min: 1,
                max: burst_max,
                fix: "a burst may not pass more than one period's permits at once",
            });
        }
        if self.max_wait_ns > MAX_WAIT_NS_MAX {
            return Err(RuleError::OutOfRange {
                field: "max_wait_ns",
                got: self.max_wait_ns,
                min: 0,
                max: MAX_WAIT_NS_MAX,
                fix: "queue calls for at most a minute",
            });
        }
        if let Some(warmup) = self.warmup {
            if !(2..=10).contains(&warmup.cold_factor) {
                return Err(RuleError::OutOfRange {
                    field: "warmup.cold_factor",
                    got: u64::from(warmup.cold_factor),
                    min: 2,
                    max: 10,
                    fix: "a cold resource starts at rate / cold_factor",
                });
            }
            if !(1_000_000..=PERIOD_NS_MAX).contains(&warmup.period_ns) {
                return Err(RuleError::OutOfRange {
                    field: "warmup.period_ns",
                    got: warmup.period_ns,
                    min: 1_000_000,
                    max: PERIOD_NS_MAX,
                    fix: "give a warm-up period from 1 ms to a day",
                });
            }
        }
        Ok(())
    }
}

/// What a limiter answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Go now.
    Admitted,
    /// Go after waiting this long (queueing): the permits are reserved.
    Wait(Nanos),
    /// Refused; the same request would fit after this long.
    Rejected {
        /// Nanoseconds until it would fit.
        retry_after_ns: Nanos,
    },
    /// Refused: more permits than the burst can ever pass at once.
    TooLarge,
}

impl Decision {
    /// Whether the call may go (now or after its wait).
    pub fn is_admitted(self) -> bool {
        matches!(self, Decision::Admitted | Decision::Wait(_))
    }
}

/// A GCRA rate limiter. Times are in "scaled" units: nanoseconds x permits, so that one
/// permit's interval, `period_ns`, is an exact integer.
#[derive(Debug, Clone)]
pub struct RateLimiter {
    rule: RateRule,
    /// The theoretical arrival time, scaled.
    tat: u128,
    /// When the current warm-up ramp started, and when a permit was last admitted.
    cold_since: Option<Nanos>,
    last_admitted: Option<Nanos>,
}

impl RateLimiter {
    /// A limiter of `rule`, which must be valid ([`RateRule::validate`]).
    pub fn new(rule: RateRule) -> Result<Self, RuleError> {
        rule.validate()?;
        Ok(Self {
            rule,
            tat: 0,
            cold_since: None,
            last_admitted: None,
        })
    }

    /// The rule.
    pub fn rule(&self) -> RateRule {
        self.rule
    }

    /// Replaces the rule; what was admitted so far still counts against it (the theoretical
    /// arrival time is kept, in the new rule's units).
    pub fn set_rule(&mut self, rule: RateRule) -> Result<(), RuleError> {
        rule.validate()?;
        let tat_ns = self.tat.div_ceil(u128::from(self.rule.permits));
        self.rule = rule;
        self.tat = tat_ns * u128::from(rule.permits);
        Ok(())
    }

    fn scaled(&self, nanos: Nanos) -> u128 {
        u128::from(nanos) * u128::from(self.rule.permits)
    }

    /// One permit's interval now, scaled: `period_ns`, or more while warming up.
    fn interval(&mut self, now: Nanos) -> u128 {
        let full = u128::from(self.rule.period_ns);
        let Some(warmup) = self.rule.warmup else {
            return full;
        };
        let idle = self
            .last_admitted
            .is_none_or(|last| now.saturating_sub(last) >= warmup.period_ns);
        if idle {
            self.cold_since = Some(now);
        }
        let since = now.saturating_sub(self.cold_since.unwrap_or(now));
        if since >= warmup.period_ns {
            return full;
        }
        // factor = cold - (cold - 1) x since / period, in thousandths.
        let cold = u128::from(warmup.cold_factor) * 1_000;
        let ramp = (cold - 1_000) * u128::from(since) / u128::from(warmup.period_ns);
        full * (cold - ramp) / 1_000
    }

    /// Whether the limiter has recovered fully by `now` (a full burst would pass): such a
    /// limiter answers as a fresh one would, so a table of limiters may drop it.
    pub fn is_idle(&self, now: Nanos) -> bool {
        self.tat <= self.scaled(now)
    }

    /// Asks for `permits` at `now` (calls must not go back in time; an earlier `now` counts as
    /// the latest seen).
    pub fn try_acquire(&mut self, permits: u64, now: Nanos) -> Decision {
        if permits == 0 {
            return Decision::Admitted;
        }
        if permits > self.rule.burst {
            return Decision::TooLarge;
        }
        let interval = self.interval(now);
        let now_scaled = self.scaled(now);
        let start = self.tat.max(now_scaled);
        // Room is checked at the full rate; warming up spaces the permits wider (the arrival
        // time moves by the warm-up interval), so it only ever admits less.
        let full = u128::from(self.rule.period_ns);
        let new_tat = start + interval * u128::from(permits);
        let tolerance = full * u128::from(self.rule.burst);
        let ahead = start - now_scaled + full * u128::from(permits);
        let permits_scale = u128::from(self.rule.permits);
        if ahead <= tolerance {
            self.tat = new_tat;
            self.last_admitted = Some(now);
            return Decision::Admitted;
        }
        let wait_ns = (ahead - tolerance).div_ceil(permits_scale);
        let wait_ns = u64::try_from(wait_ns).unwrap_or(u64::MAX);
        if self.rule.max_wait_ns > 0 && wait_ns <= self.rule.max_wait_ns {
            self.tat = new_tat;
            self.last_admitted = Some(now.saturating_add(wait_ns));
            return Decision::Wait(wait_ns);
        }
        Decision::Rejected {
            retry_after_ns: wait_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn given_a_burst_then_it_passes_at_once_and_the_rest_at_the_rate() {
        let mut rule = RateRule::per_second(100);
        rule.burst = 5;
        let mut limiter = RateLimiter::new(rule).unwrap();
        let admitted = (0..10)
            .filter(|_| limiter.try_acquire(1, 0).is_admitted())
            .count();
        assert_eq!(admitted, 5);
        // One permit every 10 ms from then on.
        assert!(matches!(
            limiter.try_acquire(1, 5 * MS),
            Decision::Rejected { retry_after_ns } if retry_after_ns == 5 * MS
        ));
        assert_eq!(limiter.try_acquire(1, 10 * MS), Decision::Admitted);
        assert_eq!(limiter.try_acquire(6, 10 * MS), Decision::TooLarge);
    }

    #[test]
    fn given_queueing_then_a_call_that_does_not_fit_waits_its_turn() {
        let mut rule = RateRule::per_second(100);
        rule.burst = 1;
        rule.max_wait_ns = 25 * MS;
        let mut limiter = RateLimiter::new(rule).unwrap();
        assert_eq!(limiter.try_acquire(1, 0), Decision::Admitted);
        assert_eq!(limiter.try_acquire(1, 0), Decision::Wait(10 * MS));
        assert_eq!(limiter.try_acquire(1, 0), Decision::Wait(20 * MS));
        assert!(matches!(
            limiter.try_acquire(1, 0),
            Decision::Rejected { .. }
        ));
    }

    #[test]
    fn given_warm_up_then_a_cold_resource_starts_slow_and_reaches_the_full_rate() {
        let mut rule = RateRule::per_second(1_000);
        rule.burst = 1;
        rule.warmup = Some(Warmup {
            period_ns: 1_000 * MS,
            cold_factor: 4,
        });
        let mut limiter = RateLimiter::new(rule).unwrap();
        let count = |limiter: &mut RateLimiter, from: u64, to: u64| {
            (from..to)
                .step_by(100_000)
                .filter(|now| limiter.try_acquire(1, *now).is_admitted())
                .count()
        };
        // The first 100 ms run at a quarter of the rate or a little more (factor 4 to 3.7);
        // the last 100 ms of the ramp at 1/1.3 of it to all of it; after the ramp, all of it.
        let cold = count(&mut limiter, 0, 100 * MS);
        let warm = count(&mut limiter, 900 * MS, 1_000 * MS);
        let full = count(&mut limiter, 1_000 * MS, 1_100 * MS);
        assert!((25..=35).contains(&cold), "{cold}");
        assert!((76..=100).contains(&warm), "{warm}");
        assert!((99..=101).contains(&full), "{full}");
    }

    #[test]
    fn given_bad_rules_then_each_error_names_its_field() {
        let mut rule = RateRule::per_second(0);
        assert!(
            RateLimiter::new(rule)
                .unwrap_err()
                .to_string()
                .contains("permits")
        );
        rule = RateRule::per_second(10);
        rule.burst = 11;
        let error = rule.validate().unwrap_err().to_string();
        assert!(error.contains("burst") && error.contains("11"), "{error}");
        rule.burst = 1;
        rule.warmup = Some(Warmup {
            period_ns: MS,
            cold_factor: 1,
        });
        assert!(
            rule.validate()
                .unwrap_err()
                .to_string()
                .contains("cold_factor")
        );
    }
}
