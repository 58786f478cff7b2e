//! A limiter resource's per-key shares ([`KeyShares`]) and its call reports ([`CallReports`],
//! [`LimitCall`]): what the lease answers carry beside the permits (docs/LIMITS.md).
//!
//! Per-key limits are decided in this process, without a call: the server tells every client
//! the rule's per-key limits and how many clients share them, and each enforces its share (a
//! limit of N per period among k clients: N per k periods, a burst of N / 10k, at least 1).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use levee_limit::{Decision, PerKeyLimiter, PerKeyRule, RateRule};
use levee_proto::v1::{CallStats, KeyLimits};

/// Keys one resource's per-key table holds at once (a full table refuses new keys rather than
/// admit them unlimited; fully recovered keys make room first).
pub const KEYS_TRACKED_MAX: usize = 100_000;
const DAY_NS: u128 = 86_400_000_000_000;

/// This client's share of a limit of `permits` per `period_ms` among `clients`; `None` when the
/// share rounds to nothing (the key is refused).
fn share(permits: u64, rule_period_ms: u64, clients: u64) -> Option<RateRule> {
    let clients = clients.max(1);
    let stretched = u128::from(rule_period_ms.max(1)) * 1_000_000 * u128::from(clients);
    let (permits_share, share_ns) = if stretched > DAY_NS {
        (u128::from(permits) * DAY_NS / stretched, DAY_NS)
    } else {
        (u128::from(permits), stretched)
    };
    let permits_share = u64::try_from(permits_share)
        .ok()
        .filter(|share| *share > 0)?;
    let burst = (permits / clients.saturating_mul(10))
        .max(1)
        .min(permits_share.min(levee_limit::rate::BURST_MAX));
    Some(RateRule {
        permits: permits_share,
        period_ns: u64::try_from(share_ns).ok()?,
        burst,
        warmup: None,
        max_wait_ns: 0,
    })
}

/// The per-key limits one resource's grants carried last.
#[derive(Debug)]
pub struct KeyShares {
    version: u64,
    /// Every key is limited (the rule has a default).
    limit_all: bool,
    /// Keys with their own share.
    listed: HashSet<Vec<u8>>,
    /// Keys (or, with `limit_all`, every other key) whose share rounds to nothing.
    blocked: HashSet<Vec<u8>>,
    default_blocked: bool,
    limiter: PerKeyLimiter,
}

impl KeyShares {
    /// The shares of `limits`; `None` for a rule without per-key limits.
    pub fn new(limits: &KeyLimits) -> Option<Self> {
        if limits.version == 0 {
            return None;
        }
        let default = share(limits.default_permits, limits.period_ms, limits.clients);
        let mut listed = HashSet::new();
        let mut blocked = HashSet::new();
        let mut exceptions = std::collections::BTreeMap::new();
        for limit in &limits.keys {
            listed.insert(limit.key.clone());
            match share(limit.permits, limits.period_ms, limits.clients) {
                Some(rule) => {
                    exceptions.insert(limit.key.clone(), rule);
                }
                None => {
                    blocked.insert(limit.key.clone());
                }
            }
        }
        let rule = PerKeyRule {
            default: default.unwrap_or_else(|| RateRule::per_second(1)),
            exceptions,
            keys_max: KEYS_TRACKED_MAX,
        };
        let limiter = PerKeyLimiter::new(rule).ok()?;
        Some(Self {
            version: limits.version,
            limit_all: limits.default_permits > 0,
            listed,
            blocked,
            default_blocked: limits.default_permits > 0 && default.is_none(),
            limiter,
        })
    }

    /// The version the server sent.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Whether `key` may take `permits` now (`now` in nanoseconds of the limiter's clock).
    pub fn try_acquire(&mut self, key: &[u8], permits: u64, now: u64) -> bool {
        let listed = self.listed.contains(key);
        if !listed && !self.limit_all {
            return true;
        }
        if self.blocked.contains(key) || (!listed && self.default_blocked) {
            return false;
        }
        matches!(
            self.limiter.try_acquire(key, permits, now),
            Decision::Admitted
        )
    }
}

/// Call outcomes counted since the last lease request.
#[derive(Debug, Default)]
pub struct CallReports {
    calls: AtomicU64,
    errors: AtomicU64,
    slow: AtomicU64,
    latency_sum_us: AtomicU64,
    /// A success slower than this is slow (the grant's `slow_call_ms`; 0: none is).
    pub slow_call_ns: AtomicU64,
}

impl CallReports {
    /// Counts one call.
    pub fn record(&self, succeeded: bool, latency: Duration) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if !succeeded {
            self.errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let latency_ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        let slow_ns = self.slow_call_ns.load(Ordering::Relaxed);
        if slow_ns > 0 && latency_ns > slow_ns {
            self.slow.fetch_add(1, Ordering::Relaxed);
        }
        self.latency_sum_us
            .fetch_add(latency_ns / 1_000, Ordering::Relaxed);
    }

    /// The counts since the last call, for a lease request (`None` when no call ended).
    pub fn take(&self) -> Option<CallStats> {
        let calls = self.calls.swap(0, Ordering::AcqRel);
        let stats = CallStats {
            calls,
            errors: self.errors.swap(0, Ordering::AcqRel),
            slow: self.slow.swap(0, Ordering::AcqRel),
            latency_sum_us: self.latency_sum_us.swap(0, Ordering::AcqRel),
        };
        (calls > 0).then_some(stats)
    }
}

/// A call admitted by [`crate::LimitedResource::try_call`]: report how it ended with
/// [`LimitCall::success`] or [`LimitCall::failure`] (its latency is measured from the
/// admission); dropped unreported (cancelled, panicked), it counts as a failure. The outcomes
/// reach the server with the next lease request, for the rule's breaker and adaptive budget.
#[derive(Debug)]
#[must_use = "report the call's outcome, or it counts as a failure when dropped"]
pub struct LimitCall {
    pub(crate) resource: crate::LimitedResource,
    pub(crate) started: Instant,
    pub(crate) reported: bool,
}

impl LimitCall {
    /// The call succeeded.
    pub fn success(mut self) {
        self.report(true);
    }

    /// The call failed.
    pub fn failure(mut self) {
        self.report(false);
    }

    fn report(&mut self, succeeded: bool) {
        if !self.reported {
            self.reported = true;
            self.resource.record(succeeded, self.started.elapsed());
        }
    }
}

impl Drop for LimitCall {
    fn drop(&mut self) {
        self.report(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use levee_proto::v1::KeyLimit;

    fn limits(default_permits: u64, keys: &[(&[u8], u64)], clients: u64) -> KeyLimits {
        KeyLimits {
            version: 7,
            default_permits,
            period_ms: 1_000,
            keys: keys
                .iter()
                .map(|(key, permits)| KeyLimit {
                    key: key.to_vec(),
                    permits: *permits,
                })
                .collect(),
            clients,
        }
    }

    fn admitted(shares: &mut KeyShares, key: &[u8]) -> usize {
        (0..1_000).filter(|_| shares.try_acquire(key, 1, 0)).count()
    }

    #[test]
    fn given_four_clients_then_each_gets_a_quarter_of_a_keys_burst_and_rate() {
        // 400 a second per key among 4 clients: 100 a second each, a burst of 10.
        let mut shares = KeyShares::new(&limits(400, &[(b"vip", 4_000)], 4)).unwrap();
        assert_eq!(admitted(&mut shares, b"anyone"), 10);
        assert_eq!(admitted(&mut shares, b"vip"), 100);
        // A second later (10 ms a permit) another 100 of anyone's.
        let later = (0..1_000)
            .filter(|_| shares.try_acquire(b"anyone", 1, 1_000_000_000))
            .count();
        assert_eq!(later, 10, "still capped by the burst");
    }

    #[test]
    fn given_no_default_then_only_listed_keys_are_limited_and_a_zero_share_refuses() {
        let mut shares = KeyShares::new(&limits(0, &[(b"hot", 20)], 4)).unwrap();
        assert_eq!(admitted(&mut shares, b"cold"), 1_000);
        assert_eq!(admitted(&mut shares, b"hot"), 1);
        // 1 a day among a million clients rounds to nothing: refused, never admitted unlimited.
        let mut rare = limits(0, &[(b"hot", 1)], 1_000_000);
        rare.period_ms = 86_400_000;
        let mut shares = KeyShares::new(&rare).unwrap();
        assert_eq!(admitted(&mut shares, b"hot"), 0);
        assert!(KeyShares::new(&KeyLimits::default()).is_none());
    }
}
