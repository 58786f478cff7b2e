//! `levee bench delay`: delayed delivery at scale. Publishes `--messages` delayed messages
//! (default a million) with delays spread evenly over `--delay-min-s` to `--delay-max-s`
//! (past the server's 120 s fine horizon, so coarse slots are spread too), while a consumer
//! group takes them as they come due. Reports the publish rate, the server's resident memory
//! before and with every message waiting (payloads stay on disk: memory must not grow with the
//! messages), and how late each message reached its handler after its time.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use levee_client::{Client, ConsumerOptions, GroupConsumer};
use levee_proto::v1::{PublishMessage, PublishRequest};
use serde_json::{Value, json};

use super::server_process::ServerProcess;
use super::unix_ms;

const GROUP: &str = "bench-delay";

#[derive(Debug, clap::Args)]
pub struct DelayBenchArgs {
    /// Delayed messages to publish
    #[arg(long, default_value_t = 1_000_000)]
    messages: u64,
    /// Shortest delay, in seconds
    #[arg(long, default_value_t = 10)]
    delay_min_s: u64,
    /// Longest delay, in seconds (the run lasts about this long)
    #[arg(long, default_value_t = 150)]
    delay_max_s: u64,
    /// Messages per publish request
    #[arg(long, default_value_t = 1_000)]
    batch: usize,
    /// Bytes per message (at least 8: a message starts with its due time)
    #[arg(long, default_value_t = 64)]
    message_bytes: usize,
    /// Partitions of the topic
    #[arg(long, default_value_t = 16)]
    partitions: u32,
    /// The server's queue sync policy when the tool starts it: always or interval(MS)
    #[arg(long, default_value = "always")]
    sync: String,
    /// A running server's gRPC address; without it the tool starts one (and can report its
    /// memory)
    #[arg(long, value_name = "HOST:PORT")]
    server: Option<String>,
    /// Print one JSON object on standard output (the summary goes to standard error)
    #[arg(long)]
    json: bool,
}

pub fn run(args: &DelayBenchArgs) -> anyhow::Result<()> {
    if args.messages == 0
        || args.delay_min_s == 0
        || args.delay_max_s < args.delay_min_s
        || args.delay_max_s > 7 * 86_400
        || !(1..=10_000).contains(&args.batch)
        || args.message_bytes < 8
        || args.partitions == 0
    {
        bail!(
            "need --messages >= 1, 1 <= --delay-min-s <= --delay-max-s <= 604800, --batch 1 to \
             10000, --message-bytes >= 8 and --partitions >= 1"
        );
    }
    let (address, server) = ServerProcess::given_or_started(
        args.server.as_ref(),
        &["--queue-sync", args.sync.as_str()],
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let report = runtime.block_on(bench(args, &address, server.as_ref()))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// A process's resident memory now (`VmRSS`), in bytes (0 if unknown).
fn rss_bytes(pid: Option<u32>) -> u64 {
    let Some(pid) = pid else { return 0 };
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kibibytes| kibibytes * 1024)
}

/// The delay of message `index`: spread evenly over the range, in a shuffled order.
fn delay_ms(args: &DelayBenchArgs, index: u64) -> u64 {
    let span = (args.delay_max_s - args.delay_min_s) * 1_000;
    let spread = index.wrapping_mul(0x9E37_79B9_7F4A_7C15) % (span + 1);
    args.delay_min_s * 1_000 + spread
}

async fn bench(
    args: &DelayBenchArgs,
    address: &str,
    server: Option<&ServerProcess>,
) -> anyhow::Result<Value> {
    let client = Client::connect(address).await?;
    let topic = format!("bench-delay-{:x}", std::process::id());
    client.create_topic(&topic, args.partitions).await?;
    let pid = server.map(ServerProcess::pid);
    let lateness = Arc::new(std::sync::Mutex::new(Histogram::<u64>::new_with_bounds(
        1, 3_600_000, 3,
    )?));
    let delivered = Arc::new(AtomicU64::new(0));
    let (stop, member) = consume(&client, &topic, &lateness, &delivered);
    let rss_before = rss_bytes(pid);
    let started = Instant::now();
    let mut index = 0;
    while index < args.messages {
        let count = (args.messages - index).min(args.batch as u64);
        let now = unix_ms();
        let messages = (index..index + count)
            .map(|at| {
                let delay = delay_ms(args, at);
                let mut payload = (now + delay).to_le_bytes().to_vec();
                payload.resize(args.message_bytes, 0);
                PublishMessage {
                    key: at.to_le_bytes().to_vec().into(),
                    payload: payload.into(),
                    delay_ms: delay,
                    ..PublishMessage::default()
                }
            })
            .collect();
        client
            .publish_request(PublishRequest {
                topic: topic.clone(),
                messages,
                ..PublishRequest::default()
            })
            .await
            .context("publishing delayed messages")?;
        index += count;
    }
    let publish_s = started.elapsed().as_secs_f64();
    let rss_waiting = rss_bytes(pid);
    eprintln!(
        "levee: {} delayed messages published in {publish_s:.1} s; server RSS {} MiB before, {} \
         MiB with them waiting",
        args.messages,
        rss_before >> 20,
        rss_waiting >> 20
    );
    let deadline = Duration::from_secs(args.delay_max_s + 60);
    while delivered.load(Ordering::Relaxed) < args.messages {
        if started.elapsed() > deadline {
            bail!(
                "{} of {} delayed messages delivered within {} s",
                delivered.load(Ordering::Relaxed),
                args.messages,
                deadline.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::Relaxed);
    member.await??;
    let histogram = match lateness.lock() {
        Ok(histogram) => histogram.clone(),
        Err(poisoned) => poisoned.into_inner().clone(),
    };
    let within_100 = histogram.count_between(1, 100);
    let report = json!({
        "bench": "delay",
        "messages": args.messages,
        "delay_s": [args.delay_min_s, args.delay_max_s],
        "sync": args.sync,
        "publish_s": publish_s,
        "published_per_s": args.messages as f64 / publish_s,
        "server_rss_bytes_before": rss_before,
        "server_rss_bytes_waiting": rss_waiting,
        "server_peak_rss_bytes": server.map(ServerProcess::peak_rss_bytes),
        "delivered": delivered.load(Ordering::Relaxed),
        "lateness_ms": {
            "p50": histogram.value_at_quantile(0.5),
            "p99": histogram.value_at_quantile(0.99),
            "p999": histogram.value_at_quantile(0.999),
            "max": histogram.max(),
        },
        "within_100ms_share": within_100 as f64 / histogram.len().max(1) as f64,
    });
    eprintln!(
        "levee: lateness after the due time {}",
        report["lateness_ms"]
    );
    Ok(report)
}

/// One group member that records each message's lateness (its receive time after the due
/// time it carries) until `stop` turns true.
fn consume(
    client: &Client,
    topic: &str,
    lateness: &Arc<std::sync::Mutex<Histogram<u64>>>,
    delivered: &Arc<AtomicU64>,
) -> (Arc<AtomicBool>, tokio::task::JoinHandle<anyhow::Result<()>>) {
    let stop = Arc::new(AtomicBool::new(false));
    let (client, topic) = (client.clone(), topic.to_owned());
    let (lateness, delivered, stopping) = (
        Arc::clone(lateness),
        Arc::clone(delivered),
        Arc::clone(&stop),
    );
    let member = tokio::spawn(async move {
        let options = ConsumerOptions {
            parallelism: 64,
            ordered: false,
            credit_messages: 8_192,
            ..ConsumerOptions::default()
        };
        let consumer = GroupConsumer::new(client, &topic, GROUP, options)?;
        consumer
            .run(
                move |message| {
                    let (lateness, delivered) = (Arc::clone(&lateness), Arc::clone(&delivered));
                    async move {
                        let mut due = [0; 8];
                        due.copy_from_slice(&message.payload[..8]);
                        let late = unix_ms().saturating_sub(u64::from_le_bytes(due)).max(1);
                        if let Ok(mut histogram) = lateness.lock() {
                            let _ = histogram.record(late.min(3_600_000));
                        }
                        delivered.fetch_add(1, Ordering::Relaxed);
                    }
                },
                async move {
                    while !stopping.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            )
            .await?;
        anyhow::Ok(())
    });
    (stop, member)
}
