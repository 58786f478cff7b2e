//! The JSON forms of the limits rules and descriptions (docs/LIMITS.md): the admin port's
//! `/v1/limits` answers and bodies, and the CLI's output.

use serde_json::json;

use crate::v1::{
    AdaptiveSpec, BreakerSpec, BreakerStatus, DescribeResourceResponse, KeyLimit, LimitRule,
    PerKeyLimit,
};

/// `per_key` of a rule's body: exceptions as `{"key": permits}` (UTF-8 keys).
#[derive(Debug, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PerKeyBody {
    /// Every key's limit per period (0: none).
    pub permits: u64,
    /// Keys with their own limit.
    pub exceptions: std::collections::BTreeMap<String, u64>,
    /// The hot-key app whose hot keys are limited.
    pub hot_key_app: String,
    /// A hot key's limit per period.
    pub hot_key_permits: u64,
}

/// `breaker` of a rule's body: the fields of `BreakerSpec`.
#[derive(Debug, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
#[allow(missing_docs, reason = "the fields of BreakerSpec, documented there")]
pub struct BreakerBody {
    pub error_ratio_percent: u32,
    pub error_count: u64,
    pub slow_ratio_percent: u32,
    pub slow_call_ms: u64,
    pub window_ms: u64,
    pub min_calls: u64,
    pub open_ms: u64,
    pub probes: u32,
}

/// `adaptive` of a rule's body: the fields of `AdaptiveSpec`.
#[derive(Debug, Default, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
#[allow(missing_docs, reason = "the fields of AdaptiveSpec, documented there")]
pub struct AdaptiveBody {
    pub min_permits: u64,
    pub latency_ms: u64,
    pub error_ratio_percent: u32,
}

impl AdaptiveBody {
    /// The proto form.
    pub fn spec(&self) -> AdaptiveSpec {
        AdaptiveSpec {
            min_permits: self.min_permits,
            latency_ms: self.latency_ms,
            error_ratio_percent: self.error_ratio_percent,
        }
    }
}

impl PerKeyBody {
    /// The proto form.
    pub fn spec(self) -> PerKeyLimit {
        PerKeyLimit {
            permits: self.permits,
            exceptions: self
                .exceptions
                .into_iter()
                .map(|(key, permits)| KeyLimit {
                    key: key.into_bytes(),
                    permits,
                })
                .collect(),
            hot_key_app: self.hot_key_app,
            hot_key_permits: self.hot_key_permits,
        }
    }

    /// The JSON form.
    pub fn of(spec: &PerKeyLimit) -> Self {
        Self {
            permits: spec.permits,
            exceptions: spec
                .exceptions
                .iter()
                .map(|limit| {
                    (
                        String::from_utf8_lossy(&limit.key).into_owned(),
                        limit.permits,
                    )
                })
                .collect(),
            hot_key_app: spec.hot_key_app.clone(),
            hot_key_permits: spec.hot_key_permits,
        }
    }
}

impl BreakerBody {
    /// The proto form.
    pub fn spec(&self) -> BreakerSpec {
        BreakerSpec {
            error_ratio_percent: self.error_ratio_percent,
            error_count: self.error_count,
            slow_ratio_percent: self.slow_ratio_percent,
            slow_call_ms: self.slow_call_ms,
            window_ms: self.window_ms,
            min_calls: self.min_calls,
            open_ms: self.open_ms,
            probes: self.probes,
        }
    }

    /// The JSON form.
    pub fn of(spec: &BreakerSpec) -> Self {
        Self {
            error_ratio_percent: spec.error_ratio_percent,
            error_count: spec.error_count,
            slow_ratio_percent: spec.slow_ratio_percent,
            slow_call_ms: spec.slow_call_ms,
            window_ms: spec.window_ms,
            min_calls: spec.min_calls,
            open_ms: spec.open_ms,
            probes: spec.probes,
        }
    }
}

/// A limits rule as JSON.
pub fn rule_json(rule: &LimitRule) -> serde_json::Value {
    let mut json = json!({
        "resource": rule.resource,
        "permits": rule.permits,
        "period_ms": rule.period_ms,
    });
    if let Some(per_key) = &rule.per_key {
        json["per_key"] = json!(PerKeyBody::of(per_key));
    }
    if let Some(breaker) = &rule.breaker {
        json["breaker"] = json!(BreakerBody::of(breaker));
    }
    if let Some(adaptive) = &rule.adaptive {
        json["adaptive"] = json!(AdaptiveBody {
            min_permits: adaptive.min_permits,
            latency_ms: adaptive.latency_ms,
            error_ratio_percent: adaptive.error_ratio_percent,
        });
    }
    json
}

/// A breaker state's name in JSON (`None`: no breaker).
pub fn breaker_name(status: BreakerStatus) -> Option<&'static str> {
    match status {
        BreakerStatus::Unspecified => None,
        BreakerStatus::Closed => Some("closed"),
        BreakerStatus::Open => Some("open"),
        BreakerStatus::HalfOpen => Some("half_open"),
    }
}

/// A resource's description as JSON.
pub fn describe_json(described: &DescribeResourceResponse) -> serde_json::Value {
    json!({
        "rule": described.rule.as_ref().map(rule_json),
        "granted": described.granted,
        "budget": described.budget,
        "clients": described.clients,
        "lease_period_ms": described.lease_period_ms,
        "permits_now": described.permits_now,
        "breaker": breaker_name(described.breaker()),
        "breaker_opened": described.breaker_opened,
        "calls": described.calls.map(|calls| json!({
            "calls": calls.calls,
            "errors": calls.errors,
            "slow": calls.slow,
            "latency_sum_us": calls.latency_sum_us,
        })),
        "hot_keys_limited": described
            .hot_keys_limited
            .iter()
            .map(|key| String::from_utf8_lossy(key).into_owned())
            .collect::<Vec<_>>(),
    })
}
