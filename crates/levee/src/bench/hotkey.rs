//! `levee bench hotkey`: simulated app servers report a Zipf key stream plus planted hot keys
//! through the real client over loopback; the tool measures ingestion, server CPU, detection
//! latency, precision and recall on the planted keys, and push throughput.
//!
//! Planted keys: `--planted` keys each get `PLANTED_THRESHOLD` hits within `PLANTED_SPREAD`
//! (inside one window of their rule), so the moment of the last hit is when their true count
//! crosses the threshold; as many near-miss keys get half as many hits and must never turn hot.
//! The default rule's threshold is set at twice the expected window count of the hottest Zipf
//! key, so no Zipf key should turn hot either: every key reported hot that is not a planted hot
//! key counts against precision.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use levee_client::{Client, HotKeyRule, HotKeys, HotKeysOptions, MatchKind};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};
use serde_json::json;

use super::percentiles_ms;
use super::server_process::ServerProcess;

const APP: &str = "bench";
const PLANTED_PREFIX: &str = "planted-";
const NEAR_MISS_PREFIX: &str = "planted-near-";
const PUSH_PREFIX: &str = "push-";
const PLANTED_WINDOW_MS: u32 = 1_000;
const PLANTED_THRESHOLD: u64 = 100;
const PLANTED_SPREAD: Duration = Duration::from_millis(400);
const PLANTED_HOT_MS: u64 = 3_000;
/// Zipf samples generated up front and cycled through.
const SAMPLES: usize = 1 << 22;
/// Accesses recorded per step of a generator thread.
const CHUNK: usize = 256;

#[derive(Debug, clap::Args)]
pub struct HotKeyBenchArgs {
    /// Simulated app servers, each with its own client and connection
    #[arg(long, default_value_t = 100)]
    clients: usize,
    /// Distinct keys in the Zipf stream
    #[arg(long, default_value_t = 1_000_000)]
    keys: usize,
    /// Length of the ingestion phase, in seconds
    #[arg(long, default_value_t = 10)]
    duration_s: u64,
    /// The clients' report interval, in milliseconds (1 to 500)
    #[arg(long, default_value_t = 100)]
    interval_ms: u64,
    /// Accesses per second offered by all app servers together; 0 offers as many as possible
    #[arg(long, default_value_t = 2_000_000)]
    rate: u64,
    /// Exponent of the Zipf distribution of keys
    #[arg(long, default_value_t = 1.0)]
    zipf_exponent: f64,
    /// Planted hot keys (plus as many planted near-miss keys)
    #[arg(long, default_value_t = 40)]
    planted: usize,
    /// Hot keys set by hand in the push phase (0 skips the phase)
    #[arg(long, default_value_t = 1_000)]
    push_events: usize,
    /// Threads generating accesses
    #[arg(long, default_value_t = 1)]
    generators: usize,
    /// A running server's gRPC address; without it the tool starts one
    #[arg(long, value_name = "HOST:PORT")]
    server: Option<String>,
    /// Print one JSON object on standard output (the summary goes to standard error)
    #[arg(long)]
    json: bool,
}

/// What the callbacks of every simulated app server saw.
#[derive(Debug, Default)]
struct Observations {
    /// Key -> app server -> when it first saw the key hot (detected, not manual).
    detected: HashMap<Vec<u8>, HashMap<usize, Instant>>,
    /// Per app server: the push keys it saw hot.
    pushed: Vec<HashSet<Vec<u8>>>,
}

pub fn run(args: &HotKeyBenchArgs) -> anyhow::Result<()> {
    if args.clients == 0 || args.keys == 0 || args.generators == 0 {
        bail!("--clients, --keys and --generators must be at least 1");
    }
    if !(1..=500).contains(&args.interval_ms) {
        bail!("--interval-ms must be 1 to 500, got {}", args.interval_ms);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    // A server the tool starts lives until the end of this function.
    let started_server;
    let address = if let Some(address) = &args.server {
        address.clone()
    } else {
        started_server = ServerProcess::start(&[])?;
        started_server.grpc_addr.clone()
    };
    runtime.block_on(bench(args, &address))
}

#[allow(clippy::too_many_lines)]
async fn bench(args: &HotKeyBenchArgs, address: &str) -> anyhow::Result<()> {
    let admin = Client::connect(address).await?;
    let default_threshold = default_threshold(args);
    admin
        .set_hot_key_rules(
            APP,
            vec![
                rule(MatchKind::Default, "", 1_000, default_threshold, 1_000),
                rule(
                    MatchKind::Prefix,
                    PLANTED_PREFIX,
                    PLANTED_WINDOW_MS,
                    PLANTED_THRESHOLD,
                    PLANTED_HOT_MS,
                ),
                rule(MatchKind::Prefix, PUSH_PREFIX, 1_000, 1_000_000_000, 60_000),
            ],
        )
        .await?;
    eprintln!(
        "levee bench hotkey: {} app servers, {} keys (zipf {}), rate {}/s, interval {} ms, \
         {} s, server {address}",
        args.clients, args.keys, args.zipf_exponent, args.rate, args.interval_ms, args.duration_s
    );

    let observations = Arc::new(Mutex::new(Observations {
        pushed: vec![HashSet::new(); args.clients],
        ..Observations::default()
    }));
    let mut clients = Vec::with_capacity(args.clients);
    for index in 0..args.clients {
        let mut options = HotKeysOptions::new(APP, vec![address.to_owned()]);
        options.client_id = format!("bench-{index}");
        options.report_interval = Duration::from_millis(args.interval_ms);
        let client: HotKeys = HotKeys::start(options)?;
        let seen = Arc::clone(&observations);
        client.on_change(move |change| {
            if !change.hot {
                return;
            }
            let mut seen = seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if change.key.starts_with(PUSH_PREFIX.as_bytes()) {
                seen.pushed[index].insert(change.key.clone());
            } else if !change.manual {
                seen.detected
                    .entry(change.key.clone())
                    .or_default()
                    .entry(index)
                    .or_insert_with(Instant::now);
            }
        });
        clients.push(client);
    }
    wait_until(Duration::from_secs(30), || {
        clients
            .iter()
            .all(|client| client.stats().servers_connected == 1)
    })
    .await
    .context("the simulated app servers did not all connect within 30 s")?;

    let keys: Arc<Vec<Vec<u8>>> = Arc::new(
        (0..args.keys)
            .map(|rank| format!("k{rank}").into_bytes())
            .collect(),
    );
    let samples = Arc::new(zipf_samples(args.keys, args.zipf_exponent)?);
    let before_stats = admin.hot_key_stats(APP).await?;
    let before_info = admin.server_info().await?;
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let recorded = Arc::new(AtomicU64::new(0));
    let clients = Arc::new(clients);

    let mut generators = Vec::new();
    for generator in 0..args.generators {
        let (clients, keys, samples) = (
            Arc::clone(&clients),
            Arc::clone(&keys),
            Arc::clone(&samples),
        );
        let (stop, recorded) = (Arc::clone(&stop), Arc::clone(&recorded));
        let rate = args.rate / args.generators as u64;
        let count = args.generators;
        generators.push(std::thread::spawn(move || {
            generate(
                generator, count, &clients, &keys, &samples, rate, &stop, &recorded,
            );
        }));
    }
    let planted = {
        let clients = Arc::clone(&clients);
        let (count, duration) = (args.planted, Duration::from_secs(args.duration_s));
        let interval = Duration::from_millis(args.interval_ms);
        std::thread::spawn(move || plant(&clients, count, duration, interval))
    };

    tokio::time::sleep(Duration::from_secs(args.duration_s)).await;
    stop.store(true, Ordering::Relaxed);
    for generator in generators {
        let _ = generator.join();
    }
    let elapsed = started.elapsed();
    let crossings = planted
        .join()
        .map_err(|_| anyhow::anyhow!("the planting thread panicked"))?;
    // Let the last reports and pushes land.
    tokio::time::sleep(Duration::from_millis(args.interval_ms * 2 + 500)).await;
    let after_stats = admin.hot_key_stats(APP).await?;
    let after_info = admin.server_info().await?;

    let server_keys = after_stats.reports_received - before_stats.reports_received;
    let server_hits = after_stats.hits_received - before_stats.hits_received;
    let server_cpu_s = after_info.process_cpu_seconds - before_info.process_cpu_seconds;
    let seconds = elapsed.as_secs_f64();
    let mut latency = Histogram::<u64>::new(3)?;
    let (precision, recall, unseen) = {
        let seen = observations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut detected_planted = 0_usize;
        let mut unseen = 0_usize;
        for (key, crossed) in &crossings {
            match seen.detected.get(key) {
                Some(times) if times.len() == args.clients => {
                    detected_planted += 1;
                    let last = times.values().max().copied().unwrap_or(*crossed);
                    let micros = last.saturating_duration_since(*crossed).as_micros();
                    latency.record(u64::try_from(micros).unwrap_or(u64::MAX))?;
                }
                Some(_) => {
                    detected_planted += 1;
                    unseen += 1;
                }
                None => {}
            }
        }
        let reported = seen.detected.len();
        let precision = if reported == 0 {
            0.0
        } else {
            detected_planted as f64 / reported as f64
        };
        let recall = if crossings.is_empty() {
            1.0
        } else {
            detected_planted as f64 / crossings.len() as f64
        };
        (precision, recall, unseen)
    };

    let deliveries_per_s = if args.push_events > 0 {
        push_phase(&admin, &observations, args.push_events, args.clients).await?
    } else {
        0.0
    };
    let client_stats: Vec<_> = clients.iter().map(HotKeys::stats).collect();
    let sum = |field: fn(&levee_client::HotKeysStats) -> u64| -> u64 {
        client_stats.iter().map(field).sum()
    };
    let report = json!({
        "bench": "hotkey",
        "clients": args.clients,
        "keys": args.keys,
        "zipf_exponent": args.zipf_exponent,
        "rate_offered_per_s": args.rate,
        "interval_ms": args.interval_ms,
        "duration_s": seconds,
        "accesses_recorded_per_s": recorded.load(Ordering::Relaxed) as f64 / seconds,
        "keys_per_s": server_keys as f64 / seconds,
        "hits_per_s": server_hits as f64 / seconds,
        "server_cpu_s": server_cpu_s,
        "server_cpu_s_per_million_keys": if server_keys == 0 { 0.0 } else { server_cpu_s / (server_keys as f64 / 1e6) },
        "server_resident_memory_bytes": after_info.resident_memory_bytes,
        "detection_latency_ms": percentiles_ms(&latency),
        "planted_hot": crossings.len(),
        "planted_seen_by_some_not_all": unseen,
        "precision": precision,
        "recall": recall,
        "deliveries_per_s": deliveries_per_s,
        "push_events": args.push_events,
        "default_rule_threshold": default_threshold,
        "client_accesses_dropped": sum(|stats| stats.accesses_dropped),
        "client_keys_unsent": sum(|stats| stats.keys_unsent),
        "client_sessions_opened": sum(|stats| stats.sessions_opened),
    });
    for client in clients.iter() {
        client.close();
    }
    eprintln!(
        "keys/s {:.0} (hits/s {:.0}), server CPU {:.3} s per million keys, detection latency \
         p50 {} ms p99 {} ms max {} ms, precision {:.3}, recall {:.3}, deliveries/s {:.0}",
        report["keys_per_s"].as_f64().unwrap_or_default(),
        report["hits_per_s"].as_f64().unwrap_or_default(),
        report["server_cpu_s_per_million_keys"]
            .as_f64()
            .unwrap_or_default(),
        report["detection_latency_ms"]["p50"],
        report["detection_latency_ms"]["p99"],
        report["detection_latency_ms"]["max"],
        precision,
        recall,
        deliveries_per_s,
    );
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

fn rule(kind: MatchKind, key: &str, window_ms: u32, threshold: u64, hot_ms: u64) -> HotKeyRule {
    HotKeyRule {
        match_kind: kind as i32,
        key: key.as_bytes().to_vec(),
        window_ms,
        threshold,
        hot_duration_ms: hot_ms,
        description: "levee bench hotkey".to_owned(),
    }
}

/// Twice the expected one-second count of the hottest Zipf key, so that none turns hot.
fn default_threshold(args: &HotKeyBenchArgs) -> u64 {
    if args.rate == 0 {
        return 1_000_000_000_000;
    }
    let harmonic: f64 = (1..=args.keys)
        .map(|rank| 1.0 / (rank as f64).powf(args.zipf_exponent))
        .sum();
    let top_per_second = args.rate as f64 / harmonic;
    (top_per_second * 2.0).max(1_000.0) as u64
}

fn zipf_samples(keys: usize, exponent: f64) -> anyhow::Result<Vec<u32>> {
    let zipf = Zipf::new(keys as f64, exponent).context("invalid --zipf-exponent")?;
    let mut random = rand::rngs::StdRng::seed_from_u64(0x5eed);
    Ok((0..SAMPLES)
        .map(|_| (zipf.sample(&mut random) as u32).saturating_sub(1))
        .collect())
}

/// Records accesses from the sample stream into this generator's share of the clients.
#[allow(clippy::too_many_arguments)]
fn generate(
    generator: usize,
    generators: usize,
    clients: &[HotKeys],
    keys: &[Vec<u8>],
    samples: &[u32],
    rate: u64,
    stop: &AtomicBool,
    recorded: &AtomicU64,
) {
    let mine: Vec<&HotKeys> = clients.iter().skip(generator).step_by(generators).collect();
    if mine.is_empty() {
        return;
    }
    let started = Instant::now();
    let mut offset = (generator * SAMPLES / generators) % SAMPLES;
    let mut done = 0_u64;
    let mut turn = 0;
    while !stop.load(Ordering::Relaxed) {
        if rate > 0 {
            let due = (started.elapsed().as_secs_f64() * rate as f64) as u64;
            if done >= due {
                std::thread::sleep(Duration::from_micros(200));
                continue;
            }
        }
        let client = mine[turn % mine.len()];
        turn += 1;
        for _ in 0..CHUNK {
            client.record(&keys[samples[offset] as usize], 1);
            offset = (offset + 1) % samples.len();
        }
        done += CHUNK as u64;
    }
    recorded.fetch_add(done, Ordering::Relaxed);
}

/// Plants hot and near-miss keys at even times through the run, each shifted by a random part
/// of the report interval so that crossings fall at every phase of the clients' report timers;
/// returns each hot key with the moment its true count reached the threshold.
fn plant(
    clients: &[HotKeys],
    count: usize,
    duration: Duration,
    interval: Duration,
) -> Vec<(Vec<u8>, Instant)> {
    let started = Instant::now();
    let mut random = rand::rngs::StdRng::seed_from_u64(0x91a7);
    let mut crossings = Vec::with_capacity(count);
    let step = PLANTED_SPREAD / u32::try_from(PLANTED_THRESHOLD).unwrap_or(1);
    for index in 0..count {
        let start_at = duration.mul_f64((index as f64 + 0.5) / count as f64)
            + interval.mul_f64(random.random::<f64>());
        if let Some(wait) = start_at.checked_sub(started.elapsed()) {
            std::thread::sleep(wait);
        }
        if started.elapsed() + PLANTED_SPREAD > duration {
            break;
        }
        let hot = format!("{PLANTED_PREFIX}{index}").into_bytes();
        let near = format!("{NEAR_MISS_PREFIX}{index}").into_bytes();
        let client = &clients[index % clients.len()];
        for hit in 0..PLANTED_THRESHOLD {
            client.record(&hot, 1);
            if hit % 2 == 0 {
                client.record(&near, 1);
            }
            if hit + 1 == PLANTED_THRESHOLD {
                crossings.push((hot.clone(), Instant::now()));
            } else {
                std::thread::sleep(step);
            }
        }
    }
    crossings
}

/// Sets `events` keys hot by hand and measures until every app server has seen them all.
async fn push_phase(
    admin: &Client,
    observations: &Arc<Mutex<Observations>>,
    events: usize,
    clients: usize,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut pending = Vec::new();
    for index in 0..events {
        let admin = admin.clone();
        pending.push(tokio::spawn(async move {
            let key = format!("{PUSH_PREFIX}{index}");
            admin
                .set_hot_key(APP, key.as_bytes(), Duration::from_secs(60))
                .await
        }));
    }
    for call in pending {
        call.await??;
    }
    let all_seen = || {
        let seen = observations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        seen.pushed.iter().all(|keys| keys.len() >= events)
    };
    wait_until(Duration::from_secs(60), all_seen)
        .await
        .context("not every app server saw every pushed key within 60 s")?;
    let deliveries = (events * clients) as f64;
    Ok(deliveries / started.elapsed().as_secs_f64())
}

async fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !done() {
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}
