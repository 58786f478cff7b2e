//! A resource's rule beyond its budget (proto/levee/v1/limits.proto): per-key limits, a
//! circuit breaker over the calls clients report, and an adaptive budget. [`check`] refuses a
//! bad one naming the field; [`ResourceState`] is what the leader keeps per resource while it
//! grants leases: the allocator, the breaker, the adaptive budget and the per-key shares.

use std::hash::{Hash, Hasher};

use levee_limit::{
    AdaptiveBudget, BreakerRule, BreakerState, CallCounts, CircuitBreaker, LeaseAllocator,
    LeaseRule, Nanos, Trip,
};
use levee_proto::v1::{
    BreakerSpec, BreakerStatus, CallStats, KeyLimit, KeyLimits, LimitRule, PerKeyLimit,
};
use prost::Message;

use super::invalid;

/// Most per-key exceptions in a rule.
pub const EXCEPTIONS_MAX: usize = 100;
/// Longest key, in bytes.
pub const KEY_BYTES_MAX: usize = 1_024;
/// Most hot keys limited per resource.
pub const HOT_KEYS_MAX: usize = 1_000;
/// A client's counts in one request are taken up to this.
pub const REPORTED_CALLS_MAX: u64 = 10_000_000;
/// How often the adaptive budget is recomputed.
pub const ADAPTIVE_INTERVAL_NS: u64 = 1_000_000_000;
const HOUR_MS: u64 = 3_600_000;
/// The shortest a breaker stays open: leases granted before it opened (two lease periods at
/// most) run out before its probes are granted.
const OPEN_MS_MIN: u64 = 500;
const MS: u64 = 1_000_000;

type Checked = Result<(), tonic::Status>;

fn within(field: &str, got: u64, min: u64, max: u64, fix: &str) -> Checked {
    if (min..=max).contains(&got) {
        Ok(())
    } else {
        Err(invalid(format!(
            "{field}: {min} to {max}, got {got}; {fix}"
        )))
    }
}

/// Checks the per-key limits, breaker and adaptive budget of `rule`.
pub fn check(rule: &LimitRule) -> Checked {
    if let Some(per_key) = &rule.per_key {
        check_per_key(per_key)?;
    }
    if let Some(breaker) = &rule.breaker {
        breaker_rule(breaker)?;
    }
    if let Some(adaptive) = &rule.adaptive {
        within(
            "adaptive.min_permits",
            adaptive.min_permits,
            1,
            rule.permits.max(1),
            "give a floor from 1 to the rule's permits",
        )?;
        within(
            "adaptive.latency_ms",
            adaptive.latency_ms,
            0,
            HOUR_MS,
            "give 0 (off) to an hour",
        )?;
        within(
            "adaptive.error_ratio_percent",
            u64::from(adaptive.error_ratio_percent),
            0,
            100,
            "give 1 to 100, or 0 for 10",
        )?;
    }
    Ok(())
}

fn check_per_key(per_key: &PerKeyLimit) -> Checked {
    if per_key.exceptions.len() > EXCEPTIONS_MAX {
        return Err(invalid(format!(
            "per_key.exceptions: at most {EXCEPTIONS_MAX}, got {}; limit fewer keys by name",
            per_key.exceptions.len()
        )));
    }
    let mut seen = std::collections::BTreeSet::new();
    for exception in &per_key.exceptions {
        within(
            "per_key.exceptions.key (bytes)",
            exception.key.len() as u64,
            1,
            KEY_BYTES_MAX as u64,
            "give a key of 1 to 1024 bytes",
        )?;
        within(
            "per_key.exceptions.permits",
            exception.permits,
            1,
            u64::MAX,
            "give each exception at least 1 permit",
        )?;
        if !seen.insert(exception.key.as_slice()) {
            return Err(invalid(format!(
                "per_key.exceptions: key {:?} is given twice; give each key once",
                String::from_utf8_lossy(&exception.key)
            )));
        }
    }
    if !per_key.hot_key_app.is_empty() {
        within(
            "per_key.hot_key_permits",
            per_key.hot_key_permits,
            1,
            u64::MAX,
            "give hot keys at least 1 permit a period, or leave hot_key_app empty",
        )?;
        crate::hotkey::hub::check_app_name(&per_key.hot_key_app)
            .map_err(|error| invalid(format!("per_key.hot_key_app: {}", error.message)))?;
    }
    Ok(())
}

/// The engine's breaker rule of `spec`, with the documented defaults; the error names the
/// field.
pub fn breaker_rule(spec: &BreakerSpec) -> Result<BreakerRule, tonic::Status> {
    let percent = |field: &str, value: u32| {
        within(field, u64::from(value), 1, 100, "give 1 to 100").map(|()| f64::from(value) / 100.0)
    };
    let trip = match (
        spec.error_ratio_percent,
        spec.error_count,
        spec.slow_ratio_percent,
    ) {
        (ratio, 0, 0) if ratio > 0 => {
            Trip::ErrorRatio(percent("breaker.error_ratio_percent", ratio)?)
        }
        (0, count, 0) if count > 0 => Trip::ErrorCount(count),
        (0, 0, ratio) if ratio > 0 => {
            within(
                "breaker.slow_call_ms",
                spec.slow_call_ms,
                1,
                HOUR_MS,
                "give how slow a slow call is, 1 ms to an hour",
            )?;
            Trip::SlowRatio {
                slow_ns: spec.slow_call_ms * MS,
                ratio: percent("breaker.slow_ratio_percent", ratio)?,
            }
        }
        _ => {
            return Err(invalid(
                "breaker: give exactly one trip: error_ratio_percent, error_count, or \
                 slow_ratio_percent with slow_call_ms"
                    .to_owned(),
            ));
        }
    };
    let or = |value: u64, default: u64| if value == 0 { default } else { value };
    let window_ms = or(spec.window_ms, 10_000);
    within(
        "breaker.window_ms",
        window_ms,
        1_000,
        HOUR_MS,
        "give 1 s to an hour",
    )?;
    let open_ms = or(spec.open_ms, 5_000);
    within(
        "breaker.open_ms",
        open_ms,
        OPEN_MS_MIN,
        HOUR_MS,
        "give 500 ms (the leases granted before it opened run out first) to an hour",
    )?;
    let probes = or(u64::from(spec.probes), 5);
    within("breaker.probes", probes, 1, 1_000, "give 1 to 1000")?;
    let rule = BreakerRule {
        window_ns: window_ms * MS,
        buckets: 10,
        min_calls: or(spec.min_calls, 20),
        trip,
        open_ns: open_ms * MS,
        probes: u32::try_from(probes).unwrap_or(5),
    };
    rule.validate()
        .map_err(|error| invalid(format!("breaker: {error}")))?;
    Ok(rule)
}

/// The allocator rule of a budget: `permits` per `period_ms`, leases of 100 ms.
pub fn lease_rule(permits: u64, period_ms: u64) -> LeaseRule {
    LeaseRule {
        permits,
        period_ns: period_ms.saturating_mul(MS),
        ..LeaseRule::per_second(permits)
    }
}

/// What the leader keeps of one resource.
#[derive(Debug)]
pub struct ResourceState {
    pub allocator: LeaseAllocator,
    /// The rule's budget and its policy as replicated (to see a change).
    budget: (u64, u64),
    policy_bytes: Vec<u8>,
    policy: LimitRule,
    pub breaker: Option<CircuitBreaker>,
    adaptive: Option<AdaptiveBudget>,
    /// Calls reported in the current adaptive interval, and since it started.
    interval: CallCounts,
    interval_start: Nanos,
    pub total: CallCounts,
    /// The per-key limits last made.
    keys: Option<MadeKeys>,
}

/// The per-key limits made for a lease window.
#[derive(Debug)]
struct MadeKeys {
    window: u64,
    limits: KeyLimits,
    /// The hot keys among them.
    hot: Vec<Vec<u8>>,
}

/// A grant's extras: the breaker's state, the slow-call limit, the per-key shares.
#[derive(Debug, Default)]
pub struct Extras {
    pub permits: u64,
    pub breaker: BreakerStatus,
    pub slow_call_ms: u64,
    pub key_limits: Option<KeyLimits>,
}

impl ResourceState {
    /// The state of a replicated rule (checked when it was set).
    pub fn new(budget: (u64, u64), policy_bytes: &[u8], now: Nanos) -> Result<Self, tonic::Status> {
        let allocator = LeaseAllocator::new(lease_rule(budget.0, budget.1))
            .map_err(|error| invalid(error.to_string()))?;
        let mut state = Self {
            allocator,
            budget: (0, 0),
            policy_bytes: vec![u8::MAX],
            policy: LimitRule::default(),
            breaker: None,
            adaptive: None,
            interval: CallCounts::default(),
            interval_start: now,
            total: CallCounts::default(),
            keys: None,
        };
        state.sync(budget, policy_bytes)?;
        Ok(state)
    }

    /// Follows the replicated rule: a changed budget or policy takes effect from now.
    pub fn sync(&mut self, budget: (u64, u64), policy_bytes: &[u8]) -> Checked {
        if self.budget == budget && self.policy_bytes == policy_bytes {
            return Ok(());
        }
        let policy = LimitRule::decode(policy_bytes)
            .map_err(|error| invalid(format!("the replicated rule does not decode: {error}")))?;
        if self.policy.breaker != policy.breaker {
            self.breaker = match &policy.breaker {
                Some(spec) => Some(
                    CircuitBreaker::new(breaker_rule(spec)?)
                        .map_err(|error| invalid(error.to_string()))?,
                ),
                None => None,
            };
        }
        self.adaptive = policy.adaptive.map(|spec| {
            let mut adaptive = self
                .adaptive
                .take()
                .unwrap_or_else(|| AdaptiveBudget::new(spec.min_permits, budget.0));
            adaptive.set_range(spec.min_permits, budget.0);
            adaptive.latency_ns_max = spec.latency_ms * MS;
            adaptive.error_ratio_max = if spec.error_ratio_percent == 0 {
                0.1
            } else {
                f64::from(spec.error_ratio_percent) / 100.0
            };
            adaptive
        });
        self.budget = budget;
        self.policy_bytes = policy_bytes.to_vec();
        self.policy = policy;
        self.keys = None;
        self.apply_budget()
    }

    /// The budget per period now: the rule's, or the adaptive one.
    pub fn permits_now(&self) -> u64 {
        self.adaptive
            .as_ref()
            .map_or(self.budget.0, AdaptiveBudget::budget)
    }

    fn apply_budget(&mut self) -> Checked {
        let rule = lease_rule(self.permits_now(), self.budget.1);
        if self.allocator.rule() != rule {
            self.allocator
                .set_rule(rule)
                .map_err(|error| invalid(error.to_string()))?;
        }
        Ok(())
    }

    /// Takes a client's reported calls: the breaker sees them at once, the adaptive budget at
    /// the end of its interval.
    pub fn record(&mut self, stats: Option<&CallStats>, now: Nanos) -> Checked {
        let counts = stats.map_or_else(CallCounts::default, |stats| {
            let calls = stats.calls.min(REPORTED_CALLS_MAX);
            CallCounts {
                calls,
                errors: stats.errors.min(calls),
                slow: stats.slow.min(calls),
                latency_sum_ns: stats.latency_sum_us.saturating_mul(1_000),
            }
        });
        self.total.add(counts);
        if let Some(breaker) = &mut self.breaker {
            breaker.record_counts(counts, now);
        }
        self.interval.add(counts);
        if now.saturating_sub(self.interval_start) >= ADAPTIVE_INTERVAL_NS {
            let interval = std::mem::take(&mut self.interval);
            self.interval_start = now;
            if let Some(adaptive) = &mut self.adaptive {
                adaptive.record(interval);
                self.apply_budget()?;
            }
        }
        Ok(())
    }

    /// The breaker's state at `now`.
    pub fn breaker_status(&mut self, now: Nanos) -> BreakerStatus {
        match self.breaker.as_mut().map(|breaker| breaker.state(now)) {
            None => BreakerStatus::Unspecified,
            Some(BreakerState::Closed) => BreakerStatus::Closed,
            Some(BreakerState::Open { .. }) => BreakerStatus::Open,
            Some(BreakerState::HalfOpen { .. }) => BreakerStatus::HalfOpen,
        }
    }

    /// The breaker's say on `granted` permits, and what the client must be told beside them.
    pub fn extras(
        &mut self,
        granted: u64,
        keys_version: u64,
        hot_keys: impl FnOnce(&str) -> Vec<Vec<u8>>,
        now: Nanos,
    ) -> Extras {
        let permits = match &mut self.breaker {
            Some(breaker) => breaker.allow_many(granted, now),
            None => granted,
        };
        let breaker = self.breaker_status(now);
        let slow_call_ms = self
            .breaker
            .as_ref()
            .and_then(CircuitBreaker::slow_ns)
            .map_or(0, |slow_ns| slow_ns / MS);
        let limits = self.key_limits(hot_keys, now);
        Extras {
            permits,
            breaker,
            slow_call_ms,
            key_limits: (limits.version != keys_version).then_some(limits),
        }
    }

    /// The per-key limits of the current lease window (made again when the window or the
    /// number of clients changes).
    fn key_limits(&mut self, hot_keys: impl FnOnce(&str) -> Vec<Vec<u8>>, now: Nanos) -> KeyLimits {
        let window = now / self.allocator.rule().window_ns;
        let clients = self.allocator.active_clients(now).max(1) as u64;
        if let Some(made) = &self.keys
            && made.window == window
            && made.limits.clients == clients
        {
            return made.limits.clone();
        }
        let Some(per_key) = &self.policy.per_key else {
            return KeyLimits::default();
        };
        let mut keys: std::collections::BTreeMap<Vec<u8>, u64> = per_key
            .exceptions
            .iter()
            .map(|exception| (exception.key.clone(), exception.permits))
            .collect();
        let mut hot = Vec::new();
        if !per_key.hot_key_app.is_empty() {
            for key in hot_keys(&per_key.hot_key_app)
                .into_iter()
                .take(HOT_KEYS_MAX)
            {
                // A hot key's limit only ever tightens the one it had.
                let before = keys.get(&key).copied().or(match per_key.permits {
                    0 => None,
                    permits => Some(permits),
                });
                let limit = before.map_or(per_key.hot_key_permits, |before| {
                    before.min(per_key.hot_key_permits)
                });
                keys.insert(key.clone(), limit);
                hot.push(key);
            }
        }
        let mut limits = KeyLimits {
            version: 0,
            default_permits: per_key.permits,
            period_ms: self.budget.1,
            keys: keys
                .into_iter()
                .map(|(key, permits)| KeyLimit { key, permits })
                .collect(),
            clients,
        };
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        limits.encode_to_vec().hash(&mut hasher);
        limits.version = hasher.finish().max(1);
        self.keys = Some(MadeKeys {
            window,
            limits: limits.clone(),
            hot,
        });
        limits
    }

    /// The hot keys limited now (as last made).
    pub fn hot_keys_limited(&self) -> Vec<Vec<u8>> {
        self.keys
            .as_ref()
            .map_or_else(Vec::new, |made| made.hot.clone())
    }

    /// The policy part of a rule as replicated: empty for a plain budget.
    pub fn policy_bytes(rule: &LimitRule) -> Vec<u8> {
        if rule.per_key.is_none() && rule.breaker.is_none() && rule.adaptive.is_none() {
            return Vec::new();
        }
        LimitRule {
            resource: String::new(),
            permits: 0,
            period_ms: 0,
            per_key: rule.per_key.clone(),
            breaker: rule.breaker,
            adaptive: rule.adaptive,
        }
        .encode_to_vec()
    }
}

/// `rule` with the policy replicated for it.
pub fn with_policy(mut rule: LimitRule, policy_bytes: Option<&Vec<u8>>) -> LimitRule {
    if let Some(policy) = policy_bytes.and_then(|bytes| LimitRule::decode(bytes.as_slice()).ok()) {
        rule.per_key = policy.per_key;
        rule.breaker = policy.breaker;
        rule.adaptive = policy.adaptive;
    }
    rule
}
