//! `levee bench queue`: producers append through the real client (a batching `Producer`) over
//! loopback while one subscription per queue consumes and acks; reports acknowledged appends per
//! second, consumed messages per second and the latency from the append call to the delivery.
//! Shape `mailbox` only for now (topics and consumer groups are not built yet).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use levee_client::{Client, Producer, ProducerOptions};
use serde_json::json;

use super::percentiles_ms;
use super::server_process::ServerProcess;

/// Acks are sent after this many deliveries (and at the end).
const ACK_EVERY: u64 = 256;
/// Credit of each subscription.
const CREDIT_MESSAGES: u32 = 4_096;

#[derive(Debug, clap::Args)]
pub struct QueueBenchArgs {
    /// Only `mailbox` (one subscription per queue) for now
    #[arg(long, default_value = "mailbox")]
    shape: String,
    /// Queues, each with one subscription
    #[arg(long, default_value_t = 1_000)]
    queues: u64,
    /// Tasks appending through one shared batching producer (each waits for its append)
    #[arg(long, default_value_t = 4_096)]
    producers: u64,
    /// Bytes per message (at least 8: a message starts with its send time)
    #[arg(long, default_value_t = 58)]
    message_bytes: usize,
    /// Length of the append phase, in seconds
    #[arg(long, default_value_t = 10)]
    duration_s: u64,
    /// The server's queue sync policy: always or interval
    #[arg(long, default_value = "always")]
    sync: String,
    /// A running server's gRPC address; without it the tool starts one with --sync
    #[arg(long, value_name = "HOST:PORT")]
    server: Option<String>,
    /// Print one JSON object on standard output (the summary goes to standard error)
    #[arg(long)]
    json: bool,
}

pub fn run(args: &QueueBenchArgs) -> anyhow::Result<()> {
    if args.shape != "mailbox" {
        bail!(
            "--shape {} is not built yet; use --shape mailbox",
            args.shape
        );
    }
    if args.queues == 0 || args.producers == 0 || args.message_bytes < 8 {
        bail!("need --queues >= 1, --producers >= 1 and --message-bytes >= 8");
    }
    let sync = match args.sync.as_str() {
        "always" => "always",
        "interval" => "interval(100)",
        other => bail!("--sync must be always or interval, got '{other}'"),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let started_server;
    let address = if let Some(address) = &args.server {
        address.clone()
    } else {
        started_server = ServerProcess::start(&["--queue-sync", sync])?;
        started_server.grpc_addr.clone()
    };
    runtime.block_on(bench(args, &address))
}

async fn bench(args: &QueueBenchArgs, address: &str) -> anyhow::Result<()> {
    let client = Client::connect(address).await?;
    let epoch = Instant::now();
    let consumed = Arc::new(AtomicU64::new(0));
    let latency = Arc::new(std::sync::Mutex::new(Histogram::<u64>::new(3)?));
    let run_id = format!("{:x}", std::process::id());
    let queue_name = move |queue: u64| format!("bench-{run_id}-{queue}").into_bytes();
    let consumers = start_consumers(
        &client,
        args.queues,
        &queue_name,
        epoch,
        &consumed,
        &latency,
    )
    .await?;
    let producer = Producer::new(client.clone(), ProducerOptions::default())?;
    let stop = Arc::new(AtomicBool::new(false));
    let appended = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut producers = Vec::new();
    for task in 0..args.producers {
        let (producer, stop, appended) =
            (producer.clone(), Arc::clone(&stop), Arc::clone(&appended));
        let (queues, bytes, queue_name) = (args.queues, args.message_bytes, queue_name.clone());
        producers.push(tokio::spawn(async move {
            let mut index = task;
            while !stop.load(Ordering::Relaxed) {
                let mut payload = u64::try_from(epoch.elapsed().as_micros())?
                    .to_le_bytes()
                    .to_vec();
                payload.resize(bytes, 0x5a);
                producer.send(&queue_name(index % queues), &payload).await?;
                appended.fetch_add(1, Ordering::Relaxed);
                index += 1;
            }
            anyhow::Ok(())
        }));
    }
    tokio::time::sleep(Duration::from_secs(args.duration_s)).await;
    stop.store(true, Ordering::Relaxed);
    for task in producers {
        task.await??;
    }
    let append_s = started.elapsed().as_secs_f64();
    let total = appended.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(60);
    while consumed.load(Ordering::Relaxed) < total {
        if Instant::now() > deadline {
            bail!(
                "consumed {} of {total} messages within 60 s",
                consumed.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let drained_s = started.elapsed().as_secs_f64();
    for consumer in &consumers {
        consumer.abort();
    }
    let histogram = latency
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let report = json!({
        "bench": "queue",
        "shape": args.shape,
        "queues": args.queues,
        "producers": args.producers,
        "message_bytes": args.message_bytes,
        "sync": args.sync,
        "duration_s": append_s,
        "appended": total,
        "appends_per_s": total as f64 / append_s,
        "consumed_per_s": total as f64 / drained_s,
        "latency_ms": percentiles_ms(&histogram),
        "latency_samples": histogram.len(),
    });
    eprintln!(
        "appends/s {:.0}, consumed/s {:.0}, append-to-delivery p50 {} ms p99 {} ms p999 {} ms max {} ms",
        report["appends_per_s"].as_f64().unwrap_or_default(),
        report["consumed_per_s"].as_f64().unwrap_or_default(),
        report["latency_ms"]["p50"],
        report["latency_ms"]["p99"],
        report["latency_ms"]["p999"],
        report["latency_ms"]["max"],
    );
    if args.json {
        println!("{report}");
    } else {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).context("printing the report")?
        );
    }
    Ok(())
}

/// One subscription per queue, each recording append-to-delivery latency and acking.
async fn start_consumers(
    client: &Client,
    queues: u64,
    queue_name: &(impl Fn(u64) -> Vec<u8> + Sync),
    epoch: Instant,
    consumed: &Arc<AtomicU64>,
    latency: &Arc<std::sync::Mutex<Histogram<u64>>>,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<anyhow::Result<()>>>> {
    let mut consumers = Vec::new();
    for queue in 0..queues {
        let mut subscription = client
            .subscribe(&queue_name(queue), "bench", CREDIT_MESSAGES)
            .await?;
        let (consumed, latency) = (Arc::clone(consumed), Arc::clone(latency));
        consumers.push(tokio::spawn(async move {
            let mut since_ack = 0;
            while let Some(delivery) = subscription.next().await? {
                let sent = u64::from_le_bytes(delivery.payload[..8].try_into()?);
                let now = u64::try_from(epoch.elapsed().as_micros())?;
                latency
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .record(now.saturating_sub(sent).max(1))?;
                consumed.fetch_add(1, Ordering::Relaxed);
                since_ack += 1;
                if since_ack >= ACK_EVERY {
                    subscription.ack(delivery.offset).await?;
                    since_ack = 0;
                }
            }
            anyhow::Ok(())
        }));
    }
    Ok(consumers)
}
