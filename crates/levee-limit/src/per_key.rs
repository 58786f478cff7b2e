//! [`PerKeyLimiter`]: "no key of this resource above N/s": one GCRA limiter per key, made on
//! the key's first call, with exceptions for named keys and limits set on the fly (a key that
//! turns hot can be given its own, lower limit at once).
//!
//! The table holds at most `keys_max` keys. A key whose limiter has fully recovered answers
//! exactly as a fresh one would, so such keys are dropped first when room is needed (among a
//! sample of [`EVICTION_SAMPLES`]): no decision changes. When every sampled key is still
//! limiting, a new key is refused (`Decision::Rejected` with a retry of one millisecond) rather
//! than admitted unlimited: the limits are never exceeded, and memory stays bounded however many
//! keys callers send.

use std::collections::{BTreeMap, HashMap};

use crate::rate::{Decision, RateLimiter, RateRule};
use crate::{Nanos, RuleError};

/// Keys looked at for one that can be dropped when the table is full.
pub const EVICTION_SAMPLES: usize = 32;
/// The largest table accepted.
pub const KEYS_MAX_MAX: usize = 10_000_000;

/// A per-key rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerKeyRule {
    /// Every key's limit, unless it has an exception.
    pub default: RateRule,
    /// Keys with their own limits.
    pub exceptions: BTreeMap<Vec<u8>, RateRule>,
    /// Keys tracked at once: 1 to 10,000,000.
    pub keys_max: usize,
}

impl PerKeyRule {
    /// Checks the default, every exception and the bound.
    pub fn validate(&self) -> Result<(), RuleError> {
        self.default.validate()?;
        for rule in self.exceptions.values() {
            rule.validate()?;
        }
        if !(1..=KEYS_MAX_MAX).contains(&self.keys_max) {
            return Err(RuleError::OutOfRange {
                field: "keys_max",
                got: self.keys_max as u64,
                min: 1,
                max: KEYS_MAX_MAX as u64,
                fix: "track 1 to 10,000,000 keys",
            });
        }
        Ok(())
    }
}

/// Per-key rate limits.
#[derive(Debug, Clone)]
pub struct PerKeyLimiter {
    rule: PerKeyRule,
    /// Limits set on the fly (hot keys), ahead of the rule's exceptions.
    overrides: HashMap<Vec<u8>, RateRule>,
    limiters: HashMap<Vec<u8>, RateLimiter>,
    refused_for_room: u64,
}

impl PerKeyLimiter {
    /// A limiter of `rule`.
    pub fn new(rule: PerKeyRule) -> Result<Self, RuleError> {
        rule.validate()?;
        Ok(Self {
            rule,
            overrides: HashMap::new(),
            limiters: HashMap::new(),
            refused_for_room: 0,
        })
    }

    fn rule_of(&self, key: &[u8]) -> RateRule {
        self.overrides
            .get(key)
            .or_else(|| self.rule.exceptions.get(key))
            .copied()
            .unwrap_or(self.rule.default)
    }

    /// Gives `key` its own limit from now on (a key that turned hot), ahead of the rule.
    pub fn limit_key(&mut self, key: &[u8], rule: RateRule) -> Result<(), RuleError> {
        rule.validate()?;
        if let Some(limiter) = self.limiters.get_mut(key) {
            limiter.set_rule(rule)?;
        }
        self.overrides.insert(key.to_vec(), rule);
        Ok(())
    }

    /// Takes back a limit set with [`Self::limit_key`] (the key cooled).
    pub fn unlimit_key(&mut self, key: &[u8]) {
        if self.overrides.remove(key).is_some() {
            let rule = self.rule_of(key);
            if let Some(limiter) = self.limiters.get_mut(key) {
                // The rule was valid when it was set.
                let _ = limiter.set_rule(rule);
            }
        }
    }

    /// Keys tracked now.
    pub fn keys(&self) -> usize {
        self.limiters.len()
    }

    /// New keys refused because the table was full of limiting keys.
    pub fn refused_for_room(&self) -> u64 {
        self.refused_for_room
    }

    /// Asks for `permits` of `key` at `now`.
    pub fn try_acquire(&mut self, key: &[u8], permits: u64, now: Nanos) -> Decision {
        if let Some(limiter) = self.limiters.get_mut(key) {
            return limiter.try_acquire(permits, now);
        }
        if self.limiters.len() >= self.rule.keys_max {
            let idle = self
                .limiters
                .iter()
                .take(EVICTION_SAMPLES)
                .find(|(_, limiter)| limiter.is_idle(now))
                .map(|(key, _)| key.clone());
            let Some(idle) = idle else {
                self.refused_for_room += 1;
                return Decision::Rejected {
                    retry_after_ns: 1_000_000,
                };
            };
            self.limiters.remove(&idle);
        }
        let rule = self.rule_of(key);
        // Every rule in the table was validated when it was set.
        let Ok(mut limiter) = RateLimiter::new(rule) else {
            return Decision::TooLarge;
        };
        let decision = limiter.try_acquire(permits, now);
        self.limiters.insert(key.to_vec(), limiter);
        decision
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn rule(permits: u64) -> RateRule {
        let mut rule = RateRule::per_second(permits);
        rule.burst = 1;
        rule
    }

    fn limiter(keys_max: usize) -> PerKeyLimiter {
        PerKeyLimiter::new(PerKeyRule {
            default: rule(10),
            exceptions: BTreeMap::from([(b"vip".to_vec(), rule(1_000))]),
            keys_max,
        })
        .unwrap()
    }

    fn admitted(limiter: &mut PerKeyLimiter, key: &[u8], calls: u64) -> usize {
        (0..calls)
            .filter(|call| limiter.try_acquire(key, 1, call * MS).is_admitted())
            .count()
    }

    #[test]
    fn given_keys_then_each_has_its_own_limit_and_exceptions_theirs() {
        let mut keys = limiter(100);
        // 100 calls over 100 ms: 10/s lets 1 (the burst) and 1 more at 100 ms... just the first.
        assert_eq!(admitted(&mut keys, b"a", 100), 1);
        assert_eq!(admitted(&mut keys, b"b", 100), 1);
        assert_eq!(admitted(&mut keys, b"vip", 100), 100);
    }

    #[test]
    fn given_a_hot_key_then_its_own_limit_applies_at_once_and_goes_when_it_cools() {
        let mut keys = limiter(100);
        keys.limit_key(b"vip", rule(10)).unwrap();
        assert_eq!(admitted(&mut keys, b"vip", 100), 1);
        keys.unlimit_key(b"vip");
        let later = (0..100)
            .filter(|call| {
                keys.try_acquire(b"vip", 1, 1_000 * MS + call * MS)
                    .is_admitted()
            })
            .count();
        assert_eq!(later, 100);
    }

    #[test]
    fn given_a_full_table_then_recovered_keys_make_room_and_limiting_ones_do_not() {
        let mut keys = limiter(2);
        assert!(keys.try_acquire(b"a", 1, 0).is_admitted());
        assert!(keys.try_acquire(b"b", 1, 0).is_admitted());
        // Both still limiting: a third key is refused, not admitted unlimited.
        assert!(!keys.try_acquire(b"c", 1, MS).is_admitted());
        assert_eq!(keys.refused_for_room(), 1);
        // A second later both recovered: room for c.
        assert!(keys.try_acquire(b"c", 1, 1_000 * MS).is_admitted());
        assert_eq!(keys.keys(), 2);
    }
}
