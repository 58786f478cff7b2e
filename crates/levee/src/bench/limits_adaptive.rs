//! `levee bench limits`' adaptive run (docs/LIMITS.md): a rule with an adaptive budget against
//! a simulated backend whose latency rises with its load. Ten clients offer more than the rule's
//! budget; each admitted call is answered by the backend model at once with the latency it
//! would have at the load of the last 100 ms (`base` up to `capacity` calls a second, growing
//! with the square of the overload beyond), and reported with `LimitedResource::record`. Every
//! second the tool reads the budget the server computed (`DescribeResource.permits_now`) and
//! the calls admitted, so the series shows the budget converging to the load where the
//! backend's latency crosses the rule's target.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use levee_client::{LimitedResource, Limiter, LimiterOptions};
use levee_proto::v1::limits_client::LimitsClient;
use levee_proto::v1::{AdaptiveSpec, DescribeResourceRequest, LimitRule, SetLimitRuleRequest};
use serde_json::{Value, json};

const RESOURCE: &str = "bench-adaptive";
const CLIENTS: u32 = 10;
/// The backend's capacity, in calls a second, and its latency up to it.
const CAPACITY_PER_S: f64 = 2_000.0;
const BASE_LATENCY_MS: f64 = 10.0;
/// The rule: three times the capacity, a floor, and the latency target.
const RULE_PER_S: u64 = 6_000;
const FLOOR_PER_S: u64 = 100;
const TARGET_LATENCY_MS: u64 = 20;

/// The backend's latency at `load` calls a second.
fn latency_ms(load_per_s: f64) -> f64 {
    let over = (load_per_s / CAPACITY_PER_S).max(1.0);
    BASE_LATENCY_MS * over * over
}

/// Runs the adaptive scenario for `seconds` against the server at `address`.
pub async fn run(address: &str, seconds: u64) -> anyhow::Result<Value> {
    let mut limits = LimitsClient::connect(format!("http://{address}")).await?;
    let rule = LimitRule {
        resource: RESOURCE.to_owned(),
        permits: RULE_PER_S,
        period_ms: 1_000,
        adaptive: Some(AdaptiveSpec {
            min_permits: FLOOR_PER_S,
            latency_ms: TARGET_LATENCY_MS,
            error_ratio_percent: 0,
        }),
        ..LimitRule::default()
    };
    limits
        .set_rule(SetLimitRuleRequest { rule: Some(rule) })
        .await?;
    let admitted = Arc::new(AtomicU64::new(0));
    // The backend's current latency in microseconds, from the load of the last 100 ms.
    let latency_us = Arc::new(AtomicU64::new((BASE_LATENCY_MS * 1_000.0) as u64));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    let mut limiters = Vec::new();
    for _ in 0..CLIENTS {
        let limiter = Limiter::start(LimiterOptions::new(vec![address.to_owned()]))?;
        let Some(resource) = limiter.resource(RESOURCE) else {
            anyhow::bail!("the limiter follows too many resources");
        };
        limiters.push(limiter);
        tasks.push(tokio::spawn(offer(
            resource,
            Arc::clone(&admitted),
            Arc::clone(&latency_us),
            Arc::clone(&stop),
        )));
    }
    tasks.push(tokio::spawn(backend(
        Arc::clone(&admitted),
        Arc::clone(&latency_us),
        Arc::clone(&stop),
    )));
    let mut series = Vec::new();
    let mut last = admitted.load(Ordering::Relaxed);
    for second in 1..=seconds {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = admitted.load(Ordering::Relaxed);
        let described = limits
            .describe_resource(DescribeResourceRequest {
                resource: RESOURCE.to_owned(),
            })
            .await?
            .into_inner();
        series.push(json!({
            "second": second,
            "budget_per_s": described.permits_now,
            "admitted_per_s": now - last,
            "latency_ms": latency_us.load(Ordering::Relaxed) as f64 / 1_000.0,
        }));
        last = now;
    }
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await?;
    }
    drop(limiters);
    Ok(summary(&series))
}

/// The series and its last half's medians.
fn summary(series: &[Value]) -> Value {
    let settled = &series[series.len() / 2..];
    let median = |field: &str| {
        let mut values: Vec<f64> = settled.iter().filter_map(|s| s[field].as_f64()).collect();
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied().unwrap_or(0.0)
    };
    // The load where the model's latency crosses the target.
    let knee = CAPACITY_PER_S * (TARGET_LATENCY_MS as f64 / BASE_LATENCY_MS).sqrt();
    json!({
        "clients": CLIENTS,
        "rule_per_s": RULE_PER_S,
        "floor_per_s": FLOOR_PER_S,
        "target_latency_ms": TARGET_LATENCY_MS,
        "backend_capacity_per_s": CAPACITY_PER_S,
        "latency_crosses_target_at_per_s": knee.round(),
        "settled_median_budget_per_s": median("budget_per_s"),
        "settled_median_admitted_per_s": median("admitted_per_s"),
        "settled_median_latency_ms": median("latency_ms"),
        "series": series,
    })
}

/// One client: offers a call every 0.5 ms (2,000 a second, more than its share), reports each
/// admitted one at the backend's current latency.
async fn offer(
    resource: LimitedResource,
    admitted: Arc<AtomicU64>,
    latency_us: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
) {
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    while !stop.load(Ordering::Relaxed) {
        ticker.tick().await;
        for _ in 0..2 {
            if resource.try_acquire(1) {
                admitted.fetch_add(1, Ordering::Relaxed);
                let latency = Duration::from_micros(latency_us.load(Ordering::Relaxed));
                resource.record(true, latency);
            }
        }
    }
}

/// The backend model: every 100 ms, its latency from the calls admitted in them.
async fn backend(admitted: Arc<AtomicU64>, latency_us: Arc<AtomicU64>, stop: Arc<AtomicBool>) {
    let mut last = admitted.load(Ordering::Relaxed);
    let mut at = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = admitted.load(Ordering::Relaxed);
        let load = (now - last) as f64 / at.elapsed().as_secs_f64();
        (last, at) = (now, Instant::now());
        latency_us.store((latency_ms(load) * 1_000.0) as u64, Ordering::Relaxed);
    }
}
