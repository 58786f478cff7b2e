//! `levee bench limits`: cluster-wide limits through the real client (docs/LIMITS.md).
//!
//! - **Local decisions**: one thread calls `Limiter::try_acquire` on a leased resource for a
//!   second: decisions per second; then `try_acquire_key` over 1,000 keys of a resource with
//!   a per-key limit.
//! - **Cap accuracy**: `--clients` limiters in this process, each its own lease session, offer
//!   `--offered` times the budget with Zipf-skewed demand (client i wants `1 / (i + 1)` of the
//!   largest share) against a rule of `--per-minute` permits; every `--window-s` the tool
//!   counts the permits admitted by all clients and compares with the window's budget. A cap is
//!   met when no window passes its budget and the shortfall is small.
//! - **Rule change**: then the cap is halved while the clients run, and the tool measures how
//!   long until the permits admitted over 100 ms follow the new cap.
//! - **Adaptive budget**: then `--adaptive-s` seconds of an adaptive rule against a simulated
//!   backend whose latency rises with its load (`limits_adaptive`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use levee_client::{Client, Limiter, LimiterOptions};
use levee_proto::v1::limits_client::LimitsClient;
use levee_proto::v1::{LimitRule, SetLimitRuleRequest};
use serde_json::{Value, json};

use super::server_process::ServerProcess;

const RESOURCE: &str = "bench";
const LOCAL_RESOURCE: &str = "bench-local";
const LOCAL_KEYS_RESOURCE: &str = "bench-local-keys";

#[derive(Debug, clap::Args)]
pub struct LimitsBenchArgs {
    /// Clients, each with its own lease session
    #[arg(long, default_value_t = 100)]
    clients: usize,
    /// The cap, in permits per minute over all clients
    #[arg(long, default_value_t = 21_000_000)]
    per_minute: u64,
    /// Demand offered, as a multiple of the cap
    #[arg(long, default_value_t = 1.5)]
    offered: f64,
    /// Length of the accuracy run, in seconds
    #[arg(long, default_value_t = 30)]
    duration_s: u64,
    /// The accuracy window, in seconds
    #[arg(long, default_value_t = 10)]
    window_s: u64,
    /// Length of the adaptive run, in seconds (0: skip it)
    #[arg(long, default_value_t = 30)]
    adaptive_s: u64,
    /// A running server's gRPC address; without it the tool starts one
    #[arg(long, value_name = "HOST:PORT")]
    server: Option<String>,
    /// Print one JSON object on standard output (the summary goes to standard error)
    #[arg(long)]
    json: bool,
}

pub fn run(args: &LimitsBenchArgs) -> anyhow::Result<()> {
    if args.clients == 0
        || args.per_minute == 0
        || args.window_s == 0
        || args.duration_s < args.window_s
        || !(args.offered.is_finite() && args.offered > 0.0)
    {
        bail!(
            "need --clients, --per-minute and --window-s >= 1, --duration-s >= --window-s, --offered above 0"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let (address, started_server) = ServerProcess::given_or_started(args.server.as_ref(), &[])?;
    let report = runtime.block_on(bench(args, &address))?;
    drop(started_server);
    let worst = &report["windows_worst"];
    eprintln!(
        "levee: {} local decisions/s on one thread ({} per key); {} windows of {} s: admitted {} to {} of the \
         budget, over it by at most {} permits; a halved cap in force within {} ms",
        report["local_decisions_per_s"],
        report["local_key_decisions_per_s"],
        report["windows"].as_array().map_or(0, Vec::len),
        args.window_s,
        worst["lowest_ratio"],
        worst["highest_ratio"],
        worst["most_over"],
        report["rule_change_ms"],
    );
    let adaptive = &report["adaptive"];
    if !adaptive.is_null() {
        eprintln!(
            "levee: adaptive budget from {}/s settled at {}/s (median of the last half; admitted \
             {}/s, latency {} ms) against a backend whose latency crosses {} ms at {}/s",
            adaptive["rule_per_s"],
            adaptive["settled_median_budget_per_s"],
            adaptive["settled_median_admitted_per_s"],
            adaptive["settled_median_latency_ms"],
            adaptive["target_latency_ms"],
            adaptive["latency_crosses_target_at_per_s"],
        );
    }
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

async fn set_rule(address: &str, resource: &str, per_minute: u64) -> anyhow::Result<()> {
    let client = Client::connect(address).await?;
    let mut limits = LimitsClient::connect(format!("http://{address}")).await?;
    let rule = LimitRule {
        resource: resource.to_owned(),
        permits: per_minute,
        period_ms: 60_000,
        ..LimitRule::default()
    };
    limits
        .set_rule(SetLimitRuleRequest { rule: Some(rule) })
        .await
        .context("setting the rule")?;
    drop(client);
    Ok(())
}

async fn bench(args: &LimitsBenchArgs, address: &str) -> anyhow::Result<Value> {
    set_rule(address, RESOURCE, args.per_minute).await?;
    set_rule(address, LOCAL_RESOURCE, u64::MAX / 4).await?;
    let local = local_decisions(address).await?;
    let local_keys = local_key_decisions(address).await?;
    let admitted = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut limiters = Vec::new();
    let weights: Vec<f64> = (0..args.clients).map(|i| 1.0 / (i as f64 + 1.0)).collect();
    let total_weight: f64 = weights.iter().sum();
    let offered_per_s = args.per_minute as f64 / 60.0 * args.offered;
    let mut drivers = Vec::new();
    for weight in &weights {
        let limiter = Limiter::start(LimiterOptions::new(vec![address.to_owned()]))?;
        limiters.push(limiter.clone());
        let per_ms = offered_per_s * weight / total_weight / 1000.0;
        drivers.push(tokio::spawn(drive(
            limiter,
            per_ms,
            Arc::clone(&admitted),
            Arc::clone(&stop),
        )));
    }
    // One lease period to warm up, then the windows.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let budget = u128::from(args.per_minute) * u128::from(args.window_s) / 60;
    let mut windows = Vec::new();
    let mut last = admitted.load(Ordering::Relaxed);
    for _ in 0..args.duration_s / args.window_s {
        tokio::time::sleep(Duration::from_secs(args.window_s)).await;
        let now = admitted.load(Ordering::Relaxed);
        let in_window = now - last;
        last = now;
        windows.push(json!({
            "admitted": in_window,
            "budget": u64::try_from(budget).unwrap_or(u64::MAX),
            "ratio": in_window as f64 / budget as f64,
        }));
    }
    let rule_change_ms = rule_change(address, args.per_minute, &admitted).await?;
    stop.store(true, Ordering::Relaxed);
    for driver in drivers {
        driver.await?;
    }
    let adaptive = if args.adaptive_s == 0 {
        Value::Null
    } else {
        super::limits_adaptive::run(address, args.adaptive_s).await?
    };
    let ratios: Vec<f64> = windows.iter().filter_map(|w| w["ratio"].as_f64()).collect();
    let most_over = windows
        .iter()
        .map(|w| {
            w["admitted"]
                .as_u64()
                .unwrap_or(0)
                .saturating_sub(w["budget"].as_u64().unwrap_or(0))
        })
        .max()
        .unwrap_or(0);
    let connected = limiters
        .iter()
        .filter(|limiter| limiter.stats().connected)
        .count();
    let attempts: u64 = limiters
        .iter()
        .map(|limiter| limiter.stats().admitted + limiter.stats().refused)
        .sum();
    let run_s = (args.duration_s / args.window_s * args.window_s) as f64 + 0.3;
    let expired_unspent: u64 = limiters
        .iter()
        .map(|limiter| limiter.stats().expired_unspent)
        .sum();
    let granted: u64 = limiters.iter().map(|limiter| limiter.stats().granted).sum();
    let returned: u64 = limiters
        .iter()
        .map(|limiter| limiter.stats().returned)
        .sum();
    Ok(json!({
        "clients": args.clients,
        "clients_connected": connected,
        "per_minute": args.per_minute,
        "offered": args.offered,
        "window_s": args.window_s,
        "local_decisions_per_s": local,
        "local_key_decisions_per_s": local_keys,
        "offered_per_s": (args.per_minute as f64 / 60.0 * args.offered).round(),
        "attempted_per_s": (attempts as f64 / run_s).round(),
        "granted_per_s": (granted as f64 / (run_s + rule_change_ms / 1_000.0)).round(),
        "expired_unspent_per_s": (expired_unspent as f64 / (run_s + rule_change_ms / 1_000.0)).round(),
        "returned_per_s": (returned as f64 / (run_s + rule_change_ms / 1_000.0)).round(),
        "windows": windows,
        "rule_change_ms": rule_change_ms,
        "adaptive": adaptive,
        "windows_worst": {
            "lowest_ratio": ratios.iter().copied().fold(f64::INFINITY, f64::min),
            "highest_ratio": ratios.iter().copied().fold(0.0, f64::max),
            "most_over": most_over,
        },
    }))
}

/// Halves the cap while the clients run and measures how long until their admissions follow:
/// the milliseconds from the rule's acknowledgement until the permits admitted over the last
/// 100 ms are within 10% of the new cap's 100 ms (a sliding count sampled every 10 ms).
async fn rule_change(address: &str, per_minute: u64, admitted: &AtomicU64) -> anyhow::Result<f64> {
    let halved = (per_minute / 2).max(1);
    let per_100ms = halved as f64 / 600.0;
    set_rule(address, RESOURCE, halved).await?;
    let changed = Instant::now();
    let mut samples = std::collections::VecDeque::from([admitted.load(Ordering::Relaxed)]);
    while changed.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
        samples.push_back(admitted.load(Ordering::Relaxed));
        if samples.len() > 11 {
            samples.pop_front();
        }
        let (Some(first), Some(last)) = (samples.front(), samples.back()) else {
            continue;
        };
        if samples.len() == 11 && ((last - first) as f64) <= per_100ms * 1.1 {
            // The sliding 100 ms ended at the sample: the change was in force 100 ms before.
            let elapsed = changed.elapsed().saturating_sub(Duration::from_millis(100));
            return Ok((elapsed.as_secs_f64() * 1_000.0).round());
        }
    }
    bail!("the clients did not follow a halved cap within 5 s")
}

/// Calls `try_acquire` `per_ms` times a millisecond (fractions carried over) until stopped.
async fn drive(limiter: Limiter, per_ms: f64, admitted: Arc<AtomicU64>, stop: Arc<AtomicBool>) {
    let Some(resource) = limiter.resource(RESOURCE) else {
        return;
    };
    let mut ticker = tokio::time::interval(Duration::from_millis(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut owed = 0.0_f64;
    while !stop.load(Ordering::Relaxed) {
        ticker.tick().await;
        owed += per_ms;
        let calls = owed.floor();
        owed -= calls;
        let calls = calls as u64;
        let taken = (0..calls).filter(|_| resource.try_acquire(1)).count() as u64;
        admitted.fetch_add(taken, Ordering::Relaxed);
    }
}

/// Decisions per second of one thread calling `try_acquire_key` over 1,000 keys on a leased
/// resource whose rule limits every key (to more than the thread can ask: every call admitted).
async fn local_key_decisions(address: &str) -> anyhow::Result<f64> {
    let mut limits = LimitsClient::connect(format!("http://{address}")).await?;
    let rule = LimitRule {
        resource: LOCAL_KEYS_RESOURCE.to_owned(),
        permits: u64::MAX / 4,
        period_ms: 1_000,
        per_key: Some(levee_proto::v1::PerKeyLimit {
            permits: u64::MAX / 4,
            ..levee_proto::v1::PerKeyLimit::default()
        }),
        ..LimitRule::default()
    };
    limits
        .set_rule(SetLimitRuleRequest { rule: Some(rule) })
        .await
        .context("setting the per-key rule")?;
    let limiter = Limiter::start(LimiterOptions::new(vec![address.to_owned()]))?;
    let resource = limiter
        .resource(LOCAL_KEYS_RESOURCE)
        .context("following the resource")?;
    resource.try_acquire(1);
    let deadline = Instant::now() + Duration::from_secs(5);
    while limiter.stats().leases_received < 3 {
        if Instant::now() > deadline {
            bail!("no lease within 5 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let keys: Vec<Vec<u8>> = (0..1_000)
        .map(|key| format!("user-{key}").into_bytes())
        .collect();
    let measured = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let mut calls = 0_u64;
        while started.elapsed() < Duration::from_secs(1) {
            for key in &keys {
                std::hint::black_box(resource.try_acquire_key(key, 1));
            }
            calls += keys.len() as u64;
        }
        calls as f64 / started.elapsed().as_secs_f64()
    })
    .await?;
    Ok(measured.round())
}

/// Decisions per second of one thread calling `try_acquire` on a leased resource's handle.
async fn local_decisions(address: &str) -> anyhow::Result<f64> {
    let limiter = Limiter::start(LimiterOptions::new(vec![address.to_owned()]))?;
    // Ask once so the next periods lease the resource.
    limiter.try_acquire(LOCAL_RESOURCE, 1);
    let deadline = Instant::now() + Duration::from_secs(5);
    while limiter.stats().leases_received < 3 {
        if Instant::now() > deadline {
            bail!("no lease within 5 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let resource = limiter
        .resource(LOCAL_RESOURCE)
        .context("following the resource")?;
    let measured = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let mut calls = 0_u64;
        while started.elapsed() < Duration::from_secs(1) {
            for _ in 0..10_000 {
                std::hint::black_box(resource.try_acquire(1));
            }
            calls += 10_000;
        }
        calls as f64 / started.elapsed().as_secs_f64()
    })
    .await?;
    Ok(measured.round())
}
