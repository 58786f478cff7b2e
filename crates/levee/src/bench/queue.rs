//! `levee bench queue`: producers append through the real client over loopback while consumers
//! take the messages; reports acknowledged appends per second, consumed messages per second and
//! the latency from the append call to the delivery (HdrHistogram percentiles).
//!
//! - `--shape mailbox`: producer tasks send through one batching `Producer` to `--queues`
//!   queues (default 1,000,000); `--consumers` many-queue streams (`SubscribeMany`) hold the
//!   queues between them as mailboxes, consume and ack every message.
//! - `--shape topic`: one topic of `--partitions` partitions; producer tasks publish batches of
//!   `--batch` keyed messages; `--consumers` members of one consumer group consume with the
//!   `GroupConsumer` (ordered per partition) and commit in order. With `--fail-ratio` the
//!   handler fails that share of first deliveries (asking for a retry after
//!   `--retry-delay-ms`); the report adds the retries and their lateness after their due time.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use levee_client::{
    Bytes, Client, ConsumerOptions, GroupConsumer, Outcome, Producer, ProducerOptions,
};
use serde_json::{Value, json};

use super::failover::{shards_placed, shards_spread};
use super::percentiles_ms;
use super::server_process::ServerProcess;

/// Credit of each mailbox stream.
const CREDIT_MESSAGES: u32 = 8_192;
/// Longest a run against a node of a cluster (--server) waits for every shard to be ready.
const SHARDS_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest it waits, once the shards are ready, for each to be led by its preferred replica
/// (which calls an election within 5 s when another node leads).
const SHARDS_SPREAD_WAIT: Duration = Duration::from_secs(10);
/// How long the shards must stay ready and spread before the run starts (a node joining
/// moves them again).
const SHARDS_STEADY_FOR: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, clap::Args)]
pub struct QueueBenchArgs {
    /// `mailbox` (many queues, each a mailbox on a many-queue stream) or `topic` (one topic,
    /// one consumer group)
    #[arg(long, default_value = "mailbox")]
    pub shape: String,
    /// Mailbox shape: queues, shared out over the --consumers streams
    #[arg(long, default_value_t = 1_000_000)]
    pub queues: u64,
    /// Producer tasks, each waiting for its append (default: for mailbox 2048 against one node
    /// and 16384 against a cluster (--nodes 3 or 5, its single-node run too, or --server
    /// naming a node of a cluster that replicates its queues), each sending one
    /// message through a shared batching producer; 16 for topic, each publishing --batch)
    #[arg(long)]
    pub producers: Option<u64>,
    /// Mailbox shape: most messages per append request of the shared batching producer
    /// (its `batch_messages_max`), 1 to 10000
    #[arg(long, default_value_t = 1_000)]
    pub producer_batch_max: usize,
    /// Mailbox shape: append requests the shared batching producer keeps in flight (its
    /// `requests_in_flight_max`), 1 to 1024 (default: 8 against one node, 32 against a
    /// cluster, as for --producers). A cluster's appends take longer than a lone node's, so
    /// it needs more messages in flight (--producers, and this times --producer-batch-max) to
    /// be kept busy (docs/benchmarks.md, "Method notes")
    #[arg(long)]
    pub producer_requests: Option<usize>,
    /// Topic shape: partitions of the topic
    #[arg(long, default_value_t = 64)]
    pub partitions: u32,
    /// Topic shape: members of the consumer group; mailbox shape: many-queue streams (each
    /// holds every --consumers-th queue)
    #[arg(long, default_value_t = 4)]
    pub consumers: u64,
    /// Topic shape: messages per publish request
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// Offered load in messages per second over all producers (open loop: sends follow the
    /// schedule, so latency includes any queueing); without it producers send as fast as
    /// their appends are answered
    #[arg(long)]
    pub rate: Option<f64>,
    /// Topic shape: cap the consumer group at this many messages per second (flow control)
    /// and report the achieved rate over every 10 s window after a 2 s warm-up; producers
    /// should offer more. The backlog is not drained at the end
    #[arg(long)]
    pub group_rate: Option<f64>,
    /// Topic shape: name the producers (one producer name for all tasks), limit that name's
    /// appends to this many messages per second and report the achieved append rate over
    /// every 10 s window after a 2 s warm-up; producers should offer more
    #[arg(long)]
    pub producer_rate: Option<f64>,
    /// Topic shape: the handler fails this share (0 to 1) of first deliveries, asking for a
    /// retry after --retry-delay-ms; retries succeed. Reports the retries and how late each
    /// was delivered after its due time (the delay accuracy)
    #[arg(long)]
    pub fail_ratio: Option<f64>,
    /// With --fail-ratio: the retry delay the handler asks for, in ms
    #[arg(long, default_value_t = 1_000)]
    pub retry_delay_ms: u64,
    /// Bytes per message (at least 8: a message starts with its send time)
    #[arg(long, default_value_t = 58)]
    pub message_bytes: usize,
    /// Length of the append phase, in seconds
    #[arg(long, default_value_t = 10)]
    pub duration_s: u64,
    /// Latency is reported for messages sent after this many seconds of the append phase;
    /// the first ones (a fresh server and client fault in memory, open HTTP/2 windows, fill
    /// buffers) go to `warmup_latency_ms`. Throughput counts the whole phase. 0: all
    #[arg(long, default_value_t = 1)]
    pub warmup_s: u64,
    /// With `--sync interval`: the server's fsync interval in ms (`interval(N)`). 10 ms fsyncs
    /// a tenth of the data ten times as often as 100 ms: on the 2-core dev VM the same
    /// throughput and about half the p99 (docs/benchmarks.md, "Method notes")
    #[arg(long, default_value_t = 10)]
    pub interval_ms: u64,
    /// The server's queue sync policy: always or interval
    #[arg(long, default_value = "always")]
    pub sync: String,
    /// Worker threads of the load generator's runtime (default: half the cores, at least
    /// one, so the server has the other half). On the 2-core dev VM one thread offered more
    /// than two: its tasks wake each other on one thread instead of across two, so it spent
    /// less CPU per message, which the server shares (docs/benchmarks.md, "Method notes")
    #[arg(long)]
    pub client_threads: Option<usize>,
    /// A running server's gRPC address; without it the tool starts one with --sync
    #[arg(long, value_name = "HOST:PORT")]
    server: Option<String>,
    /// Servers to start: 1, or 3 or 5 forming a cluster that replicates its queues
    /// (docs/CLUSTER.md, "Part 2"); with 3 or 5 the tool runs the shape against a lone server
    /// first and reports its figures beside the cluster's
    #[arg(long, default_value_t = 1)]
    pub nodes: u64,
    /// With --nodes 3 or 5: the cluster's shards
    #[arg(long, default_value_t = levee_proto::shards::SHARDS_DEFAULT)]
    pub shards: u32,
    /// Run the same shape against Redis Streams too (needs redis-server installed, e.g. from
    /// apt, and the `baseline` feature): one stream per queue or partition, XADD,
    /// XREADGROUP and XACK, AOF fsync `always` or `everysec` to match --sync. In the mailbox
    /// shape Redis has no way to wait on a million streams at once, so its readers poll them
    /// and the figure measures that polling, not its appends: compare with --shape topic
    #[arg(long, value_name = "SYSTEM")]
    pub against: Option<String>,
    /// Print one JSON object on standard output (the summary goes to standard error)
    #[arg(long)]
    json: bool,
    /// Set when --server names a node of a cluster that replicates its queues: the mailbox
    /// shape then takes the defaults it takes against a cluster it starts.
    #[arg(skip)]
    server_in_cluster: bool,
}

impl QueueBenchArgs {
    /// Producer tasks: --producers, else the shape's default, for a mailbox shape against a
    /// cluster ([`CLUSTER_MAILBOX_PRODUCERS`]) or one node ([`MAILBOX_PRODUCERS`]).
    pub(super) fn producer_tasks(&self) -> u64 {
        self.producers.unwrap_or(match &self.shape[..] {
            "topic" => 16,
            _ if self.against_cluster() => CLUSTER_MAILBOX_PRODUCERS,
            _ => MAILBOX_PRODUCERS,
        })
    }

    /// Mailbox shape: the shared producer's append requests in flight, --producer-requests
    /// or the default (more against a cluster).
    pub(super) fn producer_requests(&self) -> usize {
        self.producer_requests.unwrap_or(if self.against_cluster() {
            CLUSTER_PRODUCER_REQUESTS
        } else {
            MAILBOX_PRODUCER_REQUESTS
        })
    }

    /// Whether the run is against a cluster that replicates its queues: one the tool starts
    /// (--nodes 3 or 5, its single-node run too), or a node of one named by --server.
    fn against_cluster(&self) -> bool {
        self.nodes != 1 || self.server_in_cluster
    }

    /// These arguments, told whether the node named by --server is a member of a cluster of
    /// several nodes that replicates its queues (`GetCluster`; a server that does not answer
    /// it is taken as a lone one).
    async fn for_server(&self, client: &Client) -> Self {
        let mut args = self.clone();
        if args.server.is_some()
            && let Ok(cluster) = client.cluster().await
        {
            args.server_in_cluster = cluster.replicated_queues && cluster.members.len() > 1;
        }
        args
    }
}

/// Whether every shard of `cluster` is placed ([`shards_placed`]: a leader, its replicas as
/// voters, no change under way) on the replicas the cluster's voters name for it
/// ([`levee_proto::shards::replicas`]). A cluster just started or joined lacks that for a few
/// seconds, and an append meanwhile fails with `UNAVAILABLE` (no leader yet, or the lead moved
/// while it waited).
fn shards_ready(cluster: &levee_proto::v1::GetClusterResponse) -> bool {
    use levee_proto::v1::MemberRole;
    let voters: Vec<u64> = cluster
        .members
        .iter()
        .filter(|member| matches!(member.role(), MemberRole::Leader | MemberRole::Voter))
        .map(|member| member.node_id)
        .collect();
    let replicas = voters.len().min(levee_proto::shards::REPLICAS_MAX);
    shards_placed(cluster, cluster.shards, replicas)
        && cluster
            .shard_map
            .iter()
            .all(|shard| shard.replicas == levee_proto::shards::replicas(shard.shard, &voters))
}

/// Waits until every shard of the cluster `client` talks to is ready ([`shards_ready`]), for
/// up to [`SHARDS_READY_TIMEOUT`], then for up to [`SHARDS_SPREAD_WAIT`] until each is led by
/// its preferred replica, so that a run started right after the cluster does not fail on the
/// shards' first elections.
async fn wait_shards_ready(client: &Client, address: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    let (mut ready_at, mut steady_since) = (None, None);
    let mut told = false;
    loop {
        let cluster = client.cluster().await?;
        let ready = shards_ready(&cluster);
        if ready && shards_spread(&cluster) {
            let steady_since = *steady_since.get_or_insert_with(Instant::now);
            if steady_since.elapsed() >= SHARDS_STEADY_FOR {
                return Ok(());
            }
        } else {
            steady_since = None;
        }
        if ready {
            let ready_at = *ready_at.get_or_insert_with(Instant::now);
            if ready_at.elapsed() > SHARDS_SPREAD_WAIT {
                eprintln!(
                    "levee: some shards are not led by their preferred replica after {} s (is \
                     it down?); it may take the lead during the run",
                    SHARDS_SPREAD_WAIT.as_secs()
                );
                return Ok(());
            }
        } else if started.elapsed() > SHARDS_READY_TIMEOUT {
            bail!(
                "the cluster of {address} still has shards without a leader or with a replica \
                 change under way after {} s (levee cluster status --server {address} lists \
                 them); run again once every shard has a leader",
                SHARDS_READY_TIMEOUT.as_secs()
            );
        }
        if !told && steady_since.is_none() {
            eprintln!("levee: waiting for every shard of the cluster to have its leader");
            told = true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn run(args: &QueueBenchArgs) -> anyhow::Result<()> {
    if args.shape != "mailbox" && args.shape != "topic" {
        bail!("--shape must be mailbox or topic, got '{}'", args.shape);
    }
    if args.warmup_s >= args.duration_s {
        bail!(
            "--warmup-s ({}) must be below --duration-s ({}): latency is measured after it",
            args.warmup_s,
            args.duration_s
        );
    }
    if args.queues == 0
        || args.producers == Some(0)
        || args.message_bytes < 8
        || args.partitions == 0
        || args.consumers == 0
        || args.client_threads == Some(0)
        || !(1..=10_000).contains(&args.batch)
        || !(1..=10_000).contains(&args.producer_batch_max)
        || args
            .producer_requests
            .is_some_and(|requests| !(1..=1_024).contains(&requests))
        || [args.rate, args.group_rate, args.producer_rate]
            .iter()
            .flatten()
            .any(|rate| !(rate.is_finite() && *rate > 0.0))
    {
        bail!(
            "need --queues, --producers, --partitions, --consumers and --client-threads >= 1, \
             --batch and --producer-batch-max 1 to 10000, --producer-requests 1 to 1024, \
             --message-bytes >= 8, and --rate, --group-rate and --producer-rate above 0"
        );
    }
    if args.shape == "mailbox"
        && (args.group_rate.is_some() || args.producer_rate.is_some() || args.fail_ratio.is_some())
    {
        bail!("--group-rate, --producer-rate and --fail-ratio apply to --shape topic");
    }
    if let Some(ratio) = args.fail_ratio
        && !(0.0..=1.0).contains(&ratio)
    {
        bail!("--fail-ratio must be 0 to 1, got {ratio}");
    }
    if !(1..=600_000).contains(&args.retry_delay_ms) {
        bail!(
            "--retry-delay-ms must be 1 to 600000, got {}",
            args.retry_delay_ms
        );
    }
    let sync = match args.sync.as_str() {
        "always" => "always".to_owned(),
        "interval" => format!("interval({})", args.interval_ms),
        other => bail!("--sync must be always or interval, got '{other}'"),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(client_threads(args))
        .enable_all()
        .build()?;
    if args.nodes != 1 {
        if args.server.is_some() || args.against.is_some() {
            bail!("--nodes starts its own servers: drop --server and --against");
        }
        let report = super::queue_cluster::run(args, &runtime, &sync)?;
        return print_report(args, &report);
    }
    let (address, started_server) =
        ServerProcess::given_or_started(args.server.as_ref(), &["--queue-sync", &sync])?;
    let mut report = runtime.block_on(bench(args, &address))?;
    if let Some(server) = &started_server {
        report["server_peak_rss_bytes"] = json!(server.peak_rss_bytes());
        eprintln!(
            "levee: server peak RSS {} MiB",
            server.peak_rss_bytes() >> 20
        );
    }
    drop(started_server);
    if let Some(against) = &args.against {
        if against != "redis" {
            bail!("--against takes redis, got '{against}'");
        }
        let mut baseline = runtime.block_on(super::redis_baseline::run(args))?;
        print_summary("redis", &baseline);
        if args.shape == "mailbox" {
            eprintln!("redis: {MAILBOX_REDIS_CAVEAT}");
            baseline["caveat"] = json!(MAILBOX_REDIS_CAVEAT);
        }
        let ratio = |field: &str| {
            report[field].as_f64().unwrap_or(0.0) / baseline[field].as_f64().unwrap_or(f64::NAN)
        };
        report["ratios"] = json!({
            "appends_per_s": ratio("appends_per_s"),
            "consumed_per_s": ratio("consumed_per_s"),
        });
        report["baseline"] = baseline;
    }
    print_report(args, &report)
}

/// Prints the report: one JSON line with `--json`, else indented.
fn print_report(args: &QueueBenchArgs, report: &Value) -> anyhow::Result<()> {
    if args.json {
        println!("{report}");
    } else {
        println!(
            "{}",
            serde_json::to_string_pretty(report).context("printing the report")?
        );
    }
    Ok(())
}

/// What the mailbox shape's Redis figure measures, said with every such run.
const MAILBOX_REDIS_CAVEAT: &str = "in the mailbox shape Redis Streams cannot wait on many \
    streams at once, so its readers poll them in windows: this figure measures that polling, \
    not Redis's append path; for the fair comparison of appends run --shape topic";

/// The load generator's worker threads: `--client-threads`, else half the cores (at least 1).
pub(super) fn client_threads(args: &QueueBenchArgs) -> usize {
    args.client_threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, |cores| (cores.get() / 2).max(1))
    })
}

/// The pacing of producer task `task` of `tasks`, each sending `unit` messages at a time: with
/// `--rate`, one send every `unit x tasks / rate` seconds, the tasks' schedules staggered
/// evenly over the period so that together they offer a smooth load, not bursts.
pub(super) fn pacing(
    args: &QueueBenchArgs,
    task: u64,
    tasks: u64,
    unit: usize,
) -> Option<tokio::time::Interval> {
    let rate = args.rate?;
    #[allow(clippy::cast_precision_loss, reason = "small counts")]
    let period = Duration::from_secs_f64(unit as f64 * tasks as f64 / rate);
    #[allow(clippy::cast_precision_loss, reason = "small counts")]
    let offset = period.mul_f64(task as f64 / tasks as f64);
    Some(tokio::time::interval_at(
        tokio::time::Instant::now() + offset,
        period,
    ))
}

/// Waits for the next send of a paced producer (at once without pacing); returns how late
/// the send is against its schedule (`None` without pacing).
pub(super) async fn next_send(pace: &mut Option<tokio::time::Interval>) -> Option<Duration> {
    match pace {
        Some(interval) => Some(interval.tick().await.elapsed()),
        None => None,
    }
}

/// A payload that starts with its send time in microseconds since `epoch`.
pub(super) fn stamped_payload(epoch: Instant, bytes: usize) -> anyhow::Result<Vec<u8>> {
    let stamp = u64::try_from(epoch.elapsed().as_micros())?.to_le_bytes();
    let mut payload = Vec::with_capacity(bytes);
    payload.extend_from_slice(&stamp);
    payload.resize(bytes, 0x5a);
    Ok(payload)
}

/// Append-to-delivery latencies, split by send time: messages sent in the first `--warmup-s`
/// seconds of the append phase, and the rest (`latency_ms`); and the append calls' own
/// latencies (send to acknowledgement) after the warm-up (`append_latency_ms`).
pub(super) struct Latencies {
    /// Microseconds after the epoch from which a send counts as measured.
    measured_from_us: AtomicU64,
    warmup: std::sync::Mutex<Histogram<u64>>,
    measured: std::sync::Mutex<Histogram<u64>>,
    appends: std::sync::Mutex<Histogram<u64>>,
    /// With `--rate`: how late each paced send left against its schedule.
    send_lags: std::sync::Mutex<Histogram<u64>>,
}

impl Latencies {
    pub(super) fn new() -> anyhow::Result<Arc<Self>> {
        Ok(Arc::new(Self {
            measured_from_us: AtomicU64::new(0),
            warmup: std::sync::Mutex::new(Histogram::new(3)?),
            measured: std::sync::Mutex::new(Histogram::new(3)?),
            appends: std::sync::Mutex::new(Histogram::new(3)?),
            send_lags: std::sync::Mutex::new(Histogram::new(3)?),
        }))
    }

    /// The append phase starts now: sends in its first `warmup_s` seconds are warm-up.
    pub(super) fn start(&self, epoch: Instant, warmup_s: u64) -> anyhow::Result<()> {
        let from = epoch.elapsed() + Duration::from_secs(warmup_s);
        self.measured_from_us
            .store(u64::try_from(from.as_micros())?, Ordering::Relaxed);
        Ok(())
    }

    /// Records one delivery's append-to-delivery latency.
    pub(super) fn record(&self, epoch: Instant, payload: &[u8]) -> anyhow::Result<()> {
        let sent = send_time(payload)?;
        let histogram = if sent < self.measured_from_us.load(Ordering::Relaxed) {
            &self.warmup
        } else {
            &self.measured
        };
        record_since(histogram, epoch, sent)
    }

    /// Records the append-to-delivery latency of every payload of a batch delivered now: one
    /// clock read and one lock per histogram for the batch.
    pub(super) fn record_batch<'a>(
        &self,
        epoch: Instant,
        payloads: impl Iterator<Item = &'a [u8]>,
    ) -> anyhow::Result<()> {
        let now = u64::try_from(epoch.elapsed().as_micros())?;
        let measured_from = self.measured_from_us.load(Ordering::Relaxed);
        let mut warmup = self
            .warmup
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut measured = self
            .measured
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for payload in payloads {
            let sent = send_time(payload)?;
            let histogram = if sent < measured_from {
                &mut warmup
            } else {
                &mut measured
            };
            histogram.record(now.saturating_sub(sent).max(1))?;
        }
        Ok(())
    }

    /// Records the latency of one append call that sent `payload` (the first of its batch)
    /// and was just acknowledged; calls that started in the warm-up are not counted.
    pub(super) fn record_append(&self, epoch: Instant, payload: &[u8]) -> anyhow::Result<()> {
        let sent = send_time(payload)?;
        if sent < self.measured_from_us.load(Ordering::Relaxed) {
            return Ok(());
        }
        record_since(&self.appends, epoch, sent)
    }

    /// Records how late a paced send left (`next_send`'s answer), after the warm-up only.
    pub(super) fn record_send_lag(
        &self,
        epoch: Instant,
        lag: Option<Duration>,
    ) -> anyhow::Result<()> {
        let Some(lag) = lag else {
            return Ok(());
        };
        let now = u64::try_from(epoch.elapsed().as_micros())?;
        if now < self.measured_from_us.load(Ordering::Relaxed) {
            return Ok(());
        }
        let lag = u64::try_from(lag.as_micros())?;
        self.send_lags
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .record(lag.max(1))?;
        Ok(())
    }

    /// `latency_ms`, `latency_samples`, `warmup_latency_ms`, `append_latency_ms` and (paced
    /// runs) `send_lag_ms` of a report.
    pub(super) fn report(&self, report: &mut Value) {
        let read = |histogram: &std::sync::Mutex<Histogram<u64>>| {
            histogram
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
        };
        let measured = read(&self.measured);
        report["latency_ms"] = percentiles_ms(&measured);
        report["latency_samples"] = json!(measured.len());
        report["warmup_latency_ms"] = percentiles_ms(&read(&self.warmup));
        report["append_latency_ms"] = percentiles_ms(&read(&self.appends));
        let lags = read(&self.send_lags);
        if !lags.is_empty() {
            report["send_lag_ms"] = percentiles_ms(&lags);
        }
    }
}

/// The send time (microseconds after the epoch) a payload starts with.
fn send_time(payload: &[u8]) -> anyhow::Result<u64> {
    let stamp = payload
        .get(..8)
        .context("a bench payload starts with its 8-byte send time")?;
    Ok(u64::from_le_bytes(stamp.try_into()?))
}

/// Records in `histogram` the microseconds from `sent` (after the epoch) to now.
fn record_since(
    histogram: &std::sync::Mutex<Histogram<u64>>,
    epoch: Instant,
    sent: u64,
) -> anyhow::Result<()> {
    let now = u64::try_from(epoch.elapsed().as_micros())?;
    histogram
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .record(now.saturating_sub(sent).max(1))?;
    Ok(())
}

pub(super) async fn bench(args: &QueueBenchArgs, address: &str) -> anyhow::Result<Value> {
    let client = Client::connect(address).await?;
    let args = &args.for_server(&client).await;
    if args.server_in_cluster {
        wait_shards_ready(&client, address).await?;
    }
    if args.server_in_cluster && args.shape == "mailbox" {
        eprintln!(
            "levee: {address} is a node of a cluster that replicates its queues: {} producer \
             tasks and {} requests in flight unless set (--producers, --producer-requests)",
            args.producer_tasks(),
            args.producer_requests()
        );
    }
    let epoch = Instant::now();
    let consumed = Arc::new(AtomicU64::new(0));
    let latency = Latencies::new()?;
    let run_id = format!("{:x}", std::process::id());
    if args.shape == "topic" {
        return bench_topic(args, &client, epoch, &consumed, &latency, &run_id).await;
    }
    // Named once, as the Redis baseline does: formatting a name per message is load-generator
    // work that would be charged to the server.
    let names: Arc<[Bytes]> = (0..args.queues)
        .map(|queue| Bytes::from(format!("bench-{run_id}-{queue}")))
        .collect();
    let subscribing = Instant::now();
    let consumers = start_consumers(args, &client, &names, epoch, &consumed, &latency).await?;
    let subscribe_s = subscribing.elapsed().as_secs_f64();
    eprintln!(
        "levee: {} queues subscribed on {} streams in {subscribe_s:.1} s",
        names.len(),
        args.consumers
    );
    let options = ProducerOptions {
        batch_messages_max: args.producer_batch_max,
        requests_in_flight_max: args.producer_requests(),
        ..ProducerOptions::default()
    };
    let producer = Producer::new(client.clone(), options)?;
    let producer_tasks = args.producer_tasks();
    let stop = Arc::new(AtomicBool::new(false));
    let appended = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    latency.start(epoch, args.warmup_s)?;
    let mut producers = Vec::new();
    for task in 0..producer_tasks {
        let (producer, stop, appended, latency) = (
            producer.clone(),
            Arc::clone(&stop),
            Arc::clone(&appended),
            Arc::clone(&latency),
        );
        let (bytes, names) = (args.message_bytes, Arc::clone(&names));
        let mut pace = pacing(args, task, producer_tasks, 1);
        producers.push(tokio::spawn(async move {
            let mut index = usize::try_from(task)?;
            while !stop.load(Ordering::Relaxed) {
                let lag = next_send(&mut pace).await;
                latency.record_send_lag(epoch, lag)?;
                let payload = stamped_payload(epoch, bytes)?;
                // The send time, kept: the payload goes to the producer without a copy.
                let stamp: [u8; 8] = payload[..8].try_into()?;
                producer
                    .send_bytes(names[index % names.len()].clone(), Bytes::from(payload))
                    .await?;
                latency.record_append(epoch, &stamp)?;
                appended.fetch_add(1, Ordering::Relaxed);
                index += 1;
            }
            anyhow::Ok(())
        }));
    }
    let append_s = produce_for(args, started, &stop, producers).await?;
    let total = appended.load(Ordering::Relaxed);
    wait_consumed(&consumed, total).await?;
    let drained_s = started.elapsed().as_secs_f64();
    for consumer in &consumers {
        consumer.abort();
    }
    let handled = consumed.load(Ordering::Relaxed);
    let mut result = report(args, total, handled, append_s, drained_s, &latency);
    result["subscribe_s"] = json!(subscribe_s);
    Ok(result)
}

/// The topic shape: one topic, producer tasks publishing batches, one consumer group.
async fn bench_topic(
    args: &QueueBenchArgs,
    client: &Client,
    epoch: Instant,
    consumed: &Arc<AtomicU64>,
    latency: &Arc<Latencies>,
    run_id: &str,
) -> anyhow::Result<Value> {
    let topic = format!("bench-{run_id}");
    client.create_topic(&topic, args.partitions).await?;
    if let Some(rate) = args.group_rate {
        client.set_group_rate(GROUP, rate).await?;
    }
    let producer_name = format!("bench-{run_id}");
    let producer_client = match args.producer_rate {
        Some(rate) => {
            client.set_producer_rate(&producer_name, rate).await?;
            client.with_producer_name(&producer_name)
        }
        None => client.clone(),
    };
    let failures = Arc::new(Failures::new()?);
    let (stops, members) = start_group(args, client, &topic, (epoch, consumed, latency), &failures);
    wait_for_stable_group(args, client, &topic).await?;
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = tokio::spawn(sample_every_second(Arc::clone(consumed), {
        let sampling = Arc::clone(&sampling);
        move || sampling.load(Ordering::Relaxed)
    }));
    let appended = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let append_sampler = tokio::spawn(sample_every_second(Arc::clone(&appended), {
        let stop = Arc::clone(&stop);
        move || !stop.load(Ordering::Relaxed)
    }));
    let producers = args.producer_tasks();
    let started = Instant::now();
    latency.start(epoch, args.warmup_s)?;
    let mut tasks = Vec::new();
    for task in 0..producers {
        let (client, topic, stop, appended, latency) = (
            producer_client.clone(),
            topic.clone(),
            Arc::clone(&stop),
            Arc::clone(&appended),
            Arc::clone(latency),
        );
        let (batch, bytes) = (args.batch, args.message_bytes);
        let mut pace = pacing(args, task, producers, batch);
        tasks.push(tokio::spawn(async move {
            let mut key = task * 1_000_000_007;
            while !stop.load(Ordering::Relaxed) {
                let lag = next_send(&mut pace).await;
                latency.record_send_lag(epoch, lag)?;
                let mut messages = Vec::with_capacity(batch);
                for _ in 0..batch {
                    key += 1;
                    messages.push((key.to_le_bytes(), stamped_payload(epoch, bytes)?));
                }
                let refs: Vec<(&[u8], &[u8])> = messages
                    .iter()
                    .map(|(key, payload)| (&key[..], payload.as_slice()))
                    .collect();
                client.publish(&topic, &refs).await?;
                latency.record_append(epoch, &messages[0].1)?;
                appended.fetch_add(batch as u64, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    let append_s = produce_for(args, started, &stop, tasks).await?;
    if args.producer_rate.is_some() {
        // The limit is kept across restarts: a long-running --server must not collect them.
        client.set_producer_rate(&producer_name, 0.0).await?;
    }
    let total = appended.load(Ordering::Relaxed);
    if args.group_rate.is_some() {
        // Paced consumers: the windows cover the append phase only, the backlog is left.
        sampling.store(false, Ordering::Relaxed);
    } else {
        wait_consumed(consumed, total).await?;
    }
    // Before awaiting the samplers, which notice the end at their next tick (up to a second).
    let drained_s = started.elapsed().as_secs_f64();
    sampling.store(false, Ordering::Relaxed);
    let consumed_each_second = sampler.await?;
    let appended_each_second = append_sampler.await?;
    for stop in stops {
        let _ = stop.send(());
    }
    for member in members {
        member.await??;
    }
    let handled = consumed.load(Ordering::Relaxed);
    let mut result = report(args, total, handled, append_s, drained_s, latency);
    report_topic_options(
        args,
        &mut result,
        (&consumed_each_second, &appended_each_second),
        &failures,
    );
    Ok(result)
}

/// Adds what the topic shape's options measured: the group's and the producer's rate windows,
/// the failures.
fn report_topic_options(
    args: &QueueBenchArgs,
    result: &mut Value,
    (consumed_each_second, appended_each_second): (&[u64], &[u64]),
    failures: &Failures,
) {
    if let Some(rate) = args.group_rate {
        result["group_rate"] = rate_windows(rate, consumed_each_second);
        eprintln!("group rate: {}", result["group_rate"]);
    }
    if let Some(rate) = args.producer_rate {
        result["producer_rate"] = rate_windows(rate, appended_each_second);
        eprintln!("producer rate: {}", result["producer_rate"]);
    }
    if let Some(ratio) = args.fail_ratio {
        result["failures"] = failures.report(ratio, args.retry_delay_ms);
        eprintln!("failures: {}", result["failures"]);
    }
}

/// With --fail-ratio: first deliveries failed, and how late each retry came after its due
/// time.
struct Failures {
    failed: AtomicU64,
    retried: AtomicU64,
    lateness_ms: std::sync::Mutex<Histogram<u64>>,
}

impl Failures {
    fn new() -> anyhow::Result<Self> {
        Ok(Self {
            failed: AtomicU64::new(0),
            retried: AtomicU64::new(0),
            lateness_ms: std::sync::Mutex::new(Histogram::new_with_bounds(1, 3_600_000, 3)?),
        })
    }

    /// Whether the message at (partition, offset) fails its first delivery: a fixed hash of
    /// its place, so the share is `ratio` and a redelivery decides the same.
    fn fails(ratio: f64, partition: u32, offset: u64) -> bool {
        let mixed = (u64::from(partition) << 40 ^ offset).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        // The top 24 bits as a fraction of 1.
        #[allow(clippy::cast_precision_loss, reason = "24 bits are exact in an f64")]
        let fraction = (mixed >> 40) as f64 / f64::from(1_u32 << 24);
        fraction < ratio
    }

    /// A retried message delivered: how late after its due time.
    fn record_retry(&self, due_ms: u64) {
        let now_ms = super::unix_ms();
        self.retried.fetch_add(1, Ordering::Relaxed);
        let late = now_ms.saturating_sub(due_ms).max(1);
        if let Ok(mut histogram) = self.lateness_ms.lock() {
            let _ = histogram.record(late.min(3_600_000));
        }
    }

    fn report(&self, ratio: f64, delay_ms: u64) -> Value {
        let histogram = match self.lateness_ms.lock() {
            Ok(histogram) => histogram.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        let within_100 = histogram.count_between(1, 100);
        json!({
            "fail_ratio": ratio,
            "retry_delay_ms": delay_ms,
            "failed_first_deliveries": self.failed.load(Ordering::Relaxed),
            "retries_delivered": self.retried.load(Ordering::Relaxed),
            "retry_lateness_ms": {
                "p50": histogram.value_at_quantile(0.5),
                "p99": histogram.value_at_quantile(0.99),
                "max": histogram.max(),
            },
            "retries_within_100ms_share": if histogram.is_empty() {
                1.0
            } else {
                #[allow(clippy::cast_precision_loss, reason = "a share")]
                let share = within_100 as f64 / histogram.len() as f64;
                share
            },
        })
    }
}

/// Waits (at most 10 s) until every member has joined and every partition has an owner, so
/// the measurement does not include the rebalances of the start (their redeliveries would
/// count as latency).
async fn wait_for_stable_group(
    args: &QueueBenchArgs,
    client: &Client,
    topic: &str,
) -> anyhow::Result<()> {
    let members = usize::try_from(args.consumers.min(u64::from(args.partitions)))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(group) = client.describe_group(GROUP, topic).await
            && group.members.len() == members
            && group
                .partitions
                .iter()
                .all(|partition| !partition.owner.is_empty())
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the consumer group did not settle within 10 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The consumer group of the topic shape.
const GROUP: &str = "bench";
/// Seconds of a flow-control window, and of the warm-up before the first.
const RATE_WINDOW_S: usize = 10;
const RATE_WARM_UP_S: usize = 2;

/// Samples `counter` once a second (the first sample at once) until `running` turns false.
async fn sample_every_second(counter: Arc<AtomicU64>, running: impl Fn() -> bool) -> Vec<u64> {
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        // A sample taken once the phase ended would cover part of a second after it.
        if !running() {
            return samples;
        }
        samples.push(counter.load(Ordering::Relaxed));
    }
}

/// The achieved rate over every 10 s window after the warm-up, against the configured one.
fn rate_windows(configured: f64, samples: &[u64]) -> Value {
    let rates: Vec<f64> = (RATE_WARM_UP_S..samples.len())
        .filter(|start| start + RATE_WINDOW_S < samples.len())
        .map(|start| {
            (samples[start + RATE_WINDOW_S] - samples[start]) as f64 / RATE_WINDOW_S as f64
        })
        .collect();
    let deviation = |rate: &f64| (rate - configured).abs() / configured * 100.0;
    json!({
        "configured_per_s": configured,
        "windows_10s": rates.len(),
        "achieved_min_per_s": rates.iter().copied().reduce(f64::min),
        "achieved_max_per_s": rates.iter().copied().reduce(f64::max),
        "max_deviation_percent": rates.iter().map(deviation).reduce(f64::max),
    })
}

/// Lets the producer `tasks` run for `--duration-s`, then stops and joins them; returns the
/// seconds since `started`.
pub(super) async fn produce_for(
    args: &QueueBenchArgs,
    started: Instant,
    stop: &AtomicBool,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
) -> anyhow::Result<f64> {
    tokio::time::sleep(Duration::from_secs(args.duration_s)).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await??;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Waits (at most 60 s) until `total` messages were consumed.
pub(super) async fn wait_consumed(consumed: &AtomicU64, total: u64) -> anyhow::Result<()> {
    if !drain(consumed, total).await {
        bail!(
            "consumed {} of {total} messages within {} s",
            consumed.load(Ordering::Relaxed),
            DRAIN_LIMIT.as_secs()
        );
    }
    Ok(())
}

/// Producer tasks of the mailbox shape without `--producers`. 4,096 (before the ninth
/// session) reached no more appends per second than 1,024 on the 2-core machine, and the
/// messages they kept in flight only queued (p50 10-17 ms against 2.5 ms closed loop). Since
/// the store and server got cheaper per message, 1,024 in flight no longer kept the two cores
/// busy: 2,048 appended 10-25% more in the seventeenth session, with p99 3-5 ms (4,096: no
/// more appends, p99 6 ms; docs/benchmarks.md, "Method notes").
pub(super) const MAILBOX_PRODUCERS: u64 = 2_048;
/// Producer tasks of the mailbox shape against a cluster (and its single-node run): each
/// waits for its append, so appends/s is at most the tasks over the append latency, and a
/// cluster's appends take about ten times a lone node's (a commit round on three replicas).
/// With 2,048 the bench measured its own limit (48 k/s at 40 ms); with 16,384 the cluster's
/// CPU (docs/benchmarks.md, "Method notes").
pub(super) const CLUSTER_MAILBOX_PRODUCERS: u64 = 16_384;
/// Append requests the mailbox shape's shared producer keeps in flight against one node ...
const MAILBOX_PRODUCER_REQUESTS: usize = 8;
/// ... and against a cluster: measured against three processes started by hand through
/// --server, 8 in flight left appends waiting in the producer (p99 43-46 ms at 20,000/s
/// with 3 shards, 20-22 ms with 32).
const CLUSTER_PRODUCER_REQUESTS: usize = 32;

/// How long the consumers may take to catch up once the producers stop.
pub(super) const DRAIN_LIMIT: Duration = Duration::from_secs(60);

/// Waits until `total` messages were consumed (true) or [`DRAIN_LIMIT`] passed (false).
pub(super) async fn drain(consumed: &AtomicU64, total: u64) -> bool {
    let deadline = Instant::now() + DRAIN_LIMIT;
    while consumed.load(Ordering::Relaxed) < total {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

type Member = tokio::task::JoinHandle<anyhow::Result<()>>;

/// `--consumers` members of one group on `topic`, each recording latency.
fn start_group(
    args: &QueueBenchArgs,
    client: &Client,
    topic: &str,
    (epoch, consumed, latency): (Instant, &Arc<AtomicU64>, &Arc<Latencies>),
    failures: &Arc<Failures>,
) -> (Vec<tokio::sync::oneshot::Sender<()>>, Vec<Member>) {
    let mut stops = Vec::new();
    let mut members = Vec::new();
    for member in 0..args.consumers {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        stops.push(stop);
        let options = ConsumerOptions {
            member: Some(format!("member-{member}")),
            parallelism: 64,
            credit_messages: 8_192,
            ..ConsumerOptions::default()
        };
        let (client, topic) = (client.clone(), topic.to_owned());
        let (consumed, latency) = (Arc::clone(consumed), Arc::clone(latency));
        let (failures, fail_ratio) = (Arc::clone(failures), args.fail_ratio.unwrap_or(0.0));
        let retry_delay = Duration::from_millis(args.retry_delay_ms);
        members.push(tokio::spawn(async move {
            let member = GroupConsumer::new(client, &topic, GROUP, options)?;
            member
                .run(
                    move |message| {
                        let (consumed, latency) = (Arc::clone(&consumed), Arc::clone(&latency));
                        let failures = Arc::clone(&failures);
                        async move {
                            if message.retry {
                                // Its latency includes the delay: only its lateness counts.
                                failures.record_retry(message.due_ms);
                            } else if fail_ratio > 0.0
                                && Failures::fails(fail_ratio, message.partition, message.offset)
                            {
                                failures.failed.fetch_add(1, Ordering::Relaxed);
                                return Outcome::retry_after(
                                    retry_delay,
                                    "bench: failed on purpose",
                                );
                            } else {
                                let _ = latency.record(epoch, &message.payload);
                            }
                            consumed.fetch_add(1, Ordering::Relaxed);
                            Outcome::Success
                        }
                    },
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await?;
            anyhow::Ok(())
        }));
    }
    (stops, members)
}

fn report(
    args: &QueueBenchArgs,
    total: u64,
    consumed: u64,
    append_s: f64,
    drained_s: f64,
    latency: &Latencies,
) -> Value {
    let mut report = json!({
        "bench": "queue",
        "shape": args.shape,
        "queues": if args.shape == "topic" { u64::from(args.partitions) } else { args.queues },
        "consumers": args.consumers,
        "producers": args.producer_tasks(),
        "producer_requests": (args.shape == "mailbox").then(|| args.producer_requests()),
        "producer_batch_max": (args.shape == "mailbox").then_some(args.producer_batch_max),
        "message_bytes": args.message_bytes,
        "client_threads": client_threads(args),
        "sync": args.sync,
        "interval_ms": (args.sync == "interval").then_some(args.interval_ms),
        "offered_rate": args.rate,
        "duration_s": append_s,
        "warmup_s": args.warmup_s,
        "appended": total,
        "appends_per_s": total as f64 / append_s,
        "consumed": consumed,
        "consumed_per_s": consumed as f64 / drained_s,
    });
    latency.report(&mut report);
    print_summary("levee", &report);
    report
}

/// One line on standard error: throughput and latency percentiles.
pub fn print_summary(system: &str, report: &Value) {
    eprintln!(
        "{system}: appends/s {:.0}, consumed/s {:.0}, append-to-delivery p50 {} ms p99 {} ms \
         p999 {} ms max {} ms",
        report["appends_per_s"].as_f64().unwrap_or_default(),
        report["consumed_per_s"].as_f64().unwrap_or_default(),
        report["latency_ms"]["p50"],
        report["latency_ms"]["p99"],
        report["latency_ms"]["p999"],
        report["latency_ms"]["max"],
    );
}

/// `--consumers` many-queue streams, stream `k` holding queues `k`, `k + consumers`, ...; each
/// records append-to-delivery latency and acks every message (acks go out in batches).
async fn start_consumers(
    args: &QueueBenchArgs,
    client: &Client,
    names: &[Bytes],
    epoch: Instant,
    consumed: &Arc<AtomicU64>,
    latency: &Arc<Latencies>,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<anyhow::Result<()>>>> {
    let streams = usize::try_from(args.consumers)?;
    let mut subscribing = Vec::new();
    for stream in 0..streams {
        let client = client.clone();
        let share: Vec<Bytes> = names
            .iter()
            .skip(stream)
            .step_by(streams)
            .cloned()
            .collect();
        subscribing.push(tokio::spawn(async move {
            let mut mailboxes = client.subscribe_many("bench", CREDIT_MESSAGES).await?;
            let queues: Vec<&[u8]> = share.iter().map(AsRef::as_ref).collect();
            mailboxes.add(&queues).await?;
            anyhow::Ok(mailboxes)
        }));
    }
    let mut consumers = Vec::new();
    for subscribed in subscribing {
        let mut mailboxes = subscribed.await??;
        let (consumed, latency) = (Arc::clone(consumed), Arc::clone(latency));
        consumers.push(tokio::spawn(async move {
            loop {
                // A response's messages at once: they were delivered together.
                let batch = mailboxes.next_batch(usize::MAX).await?;
                if batch.is_empty() {
                    break;
                }
                latency.record_batch(epoch, batch.iter().map(|delivery| &delivery.payload[..]))?;
                consumed.fetch_add(batch.len() as u64, Ordering::Relaxed);
                for delivery in &batch {
                    mailboxes.ack(delivery.mailbox, delivery.offset);
                }
            }
            anyhow::Ok(())
        }));
    }
    Ok(consumers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Command {
        #[command(flatten)]
        args: QueueBenchArgs,
    }

    fn parsed(flags: &[&str]) -> QueueBenchArgs {
        use clap::Parser;
        let line = std::iter::once("bench-queue").chain(flags.iter().copied());
        Command::try_parse_from(line)
            .expect("flags the tool takes")
            .args
    }

    #[test]
    fn given_no_producer_flags_then_a_cluster_run_keeps_more_appends_in_flight_than_a_lone_node() {
        let lone = parsed(&[]);
        assert_eq!(
            (lone.producer_tasks(), lone.producer_requests()),
            (2_048, 8)
        );
        let cluster = parsed(&["--nodes", "3"]);
        assert_eq!(
            (cluster.producer_tasks(), cluster.producer_requests()),
            (16_384, 32)
        );
        let topic = parsed(&["--nodes", "3", "--shape", "topic"]);
        assert_eq!(topic.producer_tasks(), 16);
        // A node of a cluster named by --server, as `for_server` finds it.
        let mut node = parsed(&["--server", "127.0.0.1:7070"]);
        assert_eq!(
            (node.producer_tasks(), node.producer_requests()),
            (2_048, 8)
        );
        node.server_in_cluster = true;
        assert_eq!(
            (node.producer_tasks(), node.producer_requests()),
            (16_384, 32)
        );
        let chosen = parsed(&[
            "--nodes",
            "3",
            "--producers",
            "100",
            "--producer-requests",
            "2",
        ]);
        assert_eq!(
            (chosen.producer_tasks(), chosen.producer_requests()),
            (100, 2)
        );
    }

    #[test]
    fn given_producer_flags_out_of_range_then_the_run_is_refused_naming_them() {
        for flags in [
            ["--producer-requests", "0"],
            ["--producer-requests", "1025"],
            ["--producer-batch-max", "10001"],
        ] {
            let error = run(&parsed(&flags)).expect_err("refused").to_string();
            assert!(error.contains(flags[0]), "{flags:?}: {error}");
        }
    }

    fn sent_at(micros: u64) -> Vec<u8> {
        let mut payload = micros.to_le_bytes().to_vec();
        payload.extend_from_slice(&[0; 50]);
        payload
    }

    #[test]
    fn given_a_warm_up_then_only_later_sends_count_as_measured() {
        let epoch = Instant::now().checked_sub(Duration::from_secs(5)).unwrap();
        let latencies = Latencies::new().unwrap();
        // The phase starts about 5 s after the epoch: sends before about 6 s are warm-up.
        latencies.start(epoch, 1).unwrap();
        latencies.record(epoch, &sent_at(5_500_000)).unwrap();
        latencies.record(epoch, &sent_at(4_000_000)).unwrap();
        latencies.record(epoch, &sent_at(6_500_000)).unwrap();
        let mut report = json!({});
        latencies.report(&mut report);
        assert_eq!(report["warmup_latency_ms"]["count"], 2);
        assert_eq!(report["latency_ms"]["count"], 1);
        assert_eq!(report["latency_samples"], 1);
        // The send at 4 s waited about 1 s.
        let warm_max = report["warmup_latency_ms"]["max"].as_f64().unwrap();
        assert!((1_000.0..1_100.0).contains(&warm_max), "{warm_max}");
    }

    #[test]
    fn given_a_batch_delivered_at_once_then_its_sends_split_by_the_warm_up_like_single_ones() {
        let epoch = Instant::now().checked_sub(Duration::from_secs(5)).unwrap();
        let latencies = Latencies::new().unwrap();
        latencies.start(epoch, 1).unwrap();
        let payloads = [sent_at(5_500_000), sent_at(4_000_000), sent_at(6_500_000)];
        latencies
            .record_batch(epoch, payloads.iter().map(Vec::as_slice))
            .unwrap();
        let mut report = json!({});
        latencies.report(&mut report);
        assert_eq!(report["warmup_latency_ms"]["count"], 2);
        assert_eq!(report["latency_ms"]["count"], 1);
        let warm_max = report["warmup_latency_ms"]["max"].as_f64().unwrap();
        assert!((1_000.0..1_100.0).contains(&warm_max), "{warm_max}");
        // A payload without its send time is an error, not a silent zero.
        assert!(
            latencies
                .record_batch(epoch, [&[1_u8][..]].into_iter())
                .is_err()
        );
    }

    #[test]
    fn given_appends_and_paced_sends_then_only_those_after_the_warm_up_count() {
        let epoch = Instant::now().checked_sub(Duration::from_secs(5)).unwrap();
        let latencies = Latencies::new().unwrap();
        latencies.start(epoch, 0).unwrap();
        latencies.record_append(epoch, &sent_at(5_500_000)).unwrap();
        latencies.record_append(epoch, &sent_at(1_000)).unwrap();
        // Unpaced sends have no schedule to be late against.
        latencies.record_send_lag(epoch, None).unwrap();
        let mut report = json!({});
        latencies.report(&mut report);
        assert_eq!(report["append_latency_ms"]["count"], 1);
        assert!(report.get("send_lag_ms").is_none(), "{report}");

        latencies
            .record_send_lag(epoch, Some(Duration::from_millis(3)))
            .unwrap();
        latencies.report(&mut report);
        assert_eq!(report["send_lag_ms"]["count"], 1);
        let lag = report["send_lag_ms"]["max"].as_f64().unwrap();
        assert!((2.9..3.1).contains(&lag), "{lag}");
    }

    #[test]
    fn given_a_shard_without_a_leader_mid_change_or_led_elsewhere_then_the_cluster_is_not_ready_or_spread()
     {
        use levee_proto::shards::replicas;
        use levee_proto::v1::{GetClusterResponse, Member, MemberRole, ShardPlacement};
        let named = |shard| replicas(shard, &[1, 2, 3]);
        // A shard led by its preferred replica, its named replicas all voters.
        let placed = |shard| ShardPlacement {
            shard,
            replicas: named(shard),
            leader_id: named(shard)[0],
            voters: named(shard),
            changing: false,
        };
        let cluster = |voters: &[u64], shard_map| GetClusterResponse {
            shards: 2,
            replicated_queues: true,
            members: voters
                .iter()
                .map(|&node_id| Member {
                    node_id,
                    role: MemberRole::Voter.into(),
                    ..Member::default()
                })
                .collect(),
            shard_map,
            ..GetClusterResponse::default()
        };
        let settled = cluster(&[1, 2, 3], vec![placed(0), placed(1)]);
        assert!(shards_ready(&settled) && shards_spread(&settled));
        let no_leader = ShardPlacement {
            leader_id: 0,
            ..placed(1)
        };
        let changing = ShardPlacement {
            changing: true,
            ..placed(1)
        };
        let short = ShardPlacement {
            voters: vec![named(1)[0]],
            ..placed(1)
        };
        for not_ready in [no_leader, changing, short] {
            assert!(!shards_ready(&cluster(
                &[1, 2, 3],
                vec![placed(0), not_ready]
            )));
        }
        assert!(
            !shards_ready(&cluster(&[1, 2, 3], vec![placed(0)])),
            "a shard missing from the map"
        );
        assert!(
            !shards_ready(&cluster(&[1, 2, 3, 4], vec![placed(0), placed(1)])),
            "a voter joined since the shards were named"
        );
        let led_elsewhere = ShardPlacement {
            leader_id: named(1)[1],
            ..placed(1)
        };
        let elsewhere = cluster(&[1, 2, 3], vec![placed(0), led_elsewhere]);
        assert!(shards_ready(&elsewhere) && !shards_spread(&elsewhere));
    }
}
