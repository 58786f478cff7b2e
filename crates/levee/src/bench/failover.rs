//! `levee bench failover`: starts a cluster of `levee server` processes on loopback, writes
//! metadata through them without pause, and kills the leader with SIGKILL again and again
//! (restarting it each time). It reports how long each failover took, from the kill to the
//! first write sent after it that the cluster acknowledged, and checks at the end that no
//! acknowledged write was lost (docs/CLUSTER.md).
//!
//! The writes set producer rate limits: write number `n` sets the limit of producer name
//! `failover-{n mod keys}` to `n` messages/s, so each name's value only grows, and a name whose
//! final value (read on every node once they agree) is below a value the cluster acknowledged
//! for it lost that write.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use levee_client::{Client, ClientOptions, ClusterView, MemberRole};
use serde_json::{Value, json};
use tokio::sync::watch;

use super::server_process::ServerProcess;

/// The failover target (issue 35): p99 at most this.
pub(super) const FAILOVER_P99_TARGET_MS: f64 = 2_000.0;
/// Longest one failover, or the cluster settling after a restart, may take before the run
/// gives up.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);
/// A write's deadline.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Writes the run keeps a record of, at most (it stops writing beyond).
const WRITES_MAX: usize = 2_000_000;
/// Writes acknowledged after a restart before the next kill.
const WRITES_BETWEEN_KILLS: usize = 20;

#[derive(Debug, clap::Args)]
pub struct FailoverBenchArgs {
    /// What is written while leaders are killed: `metadata` (producer rate limits, through
    /// the metadata group) or `queue` (appends of an idempotent producer to replicated
    /// queues: kills the leader of a shard each time; docs/CLUSTER.md, "Part 2")
    #[arg(long, default_value = "metadata")]
    pub(super) shape: String,
    /// Nodes in the cluster (3 or 5: all voters)
    #[arg(long, default_value_t = 3)]
    pub(super) nodes: u64,
    /// Leader kills; each killed node is restarted before the next kill
    #[arg(long, default_value_t = 20)]
    pub(super) kills: u32,
    /// Queue shape: the cluster's shards
    #[arg(long, default_value_t = 4)]
    pub(super) shards: u32,
    /// Queue shape: every node's `--shard-snapshot-entries` (a snapshot mark that often, the
    /// shard logs purged behind it, so a restarted node far behind is sent a snapshot); the
    /// server's default when not given
    #[arg(long)]
    pub(super) shard_snapshot_entries: Option<u64>,
    /// Pause between two metadata writes, in milliseconds (the writes are sequential)
    #[arg(long, default_value_t = 5)]
    write_interval_ms: u64,
    /// Producer names (metadata shape) or queues (queue shape) the writes cycle over
    #[arg(long, default_value_t = 16)]
    pub(super) keys: u64,
    /// Queue shape: tasks appending at once through the idempotent producer, each waiting for
    /// its append (1 to 64): several make requests of several messages, which a shard's
    /// leader merges into shared entries while others are being committed
    #[arg(long, default_value_t = 4)]
    pub(super) append_tasks: u64,
    /// Print one JSON object on standard output (the summary goes to standard error)
    #[arg(long)]
    pub(super) json: bool,
}

/// One node: where it lives and how to start it again.
pub(super) struct Node {
    /// The node's id.
    pub(super) id: u64,
    /// Its data dir.
    pub(super) data_dir: PathBuf,
    /// Its flags, without `--join` (a restart needs none).
    pub(super) flags: Vec<String>,
    /// The node's gRPC address.
    pub(super) grpc_addr: String,
    /// The node's process, while running.
    pub(super) process: Option<ServerProcess>,
}

/// One write: its key and value, when it was sent, and when acknowledged (if it was).
#[derive(Debug, Clone, Copy)]
struct WriteRecord {
    key: u64,
    value: u64,
    invoked: Instant,
    acked: Option<Instant>,
}

/// What the writer and the killer share.
#[derive(Default)]
struct Shared {
    /// Whether each node is up (by index).
    alive: Vec<bool>,
    writes: Vec<WriteRecord>,
}

type SharedState = Arc<Mutex<Shared>>;

fn lock(shared: &SharedState) -> std::sync::MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Ports a node may be given, below Linux's default ephemeral range (32768-60999): a node's
/// port stays free while it is down (killed, then restarted on the same addresses), where a
/// port the system hands out for any outgoing connection may meanwhile be taken by one.
const NODE_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A port free now on loopback, from [`NODE_PORTS`] (tried at random, 1,000 times at most;
/// then any the system gives).
fn free_port() -> anyhow::Result<u16> {
    use rand::Rng;
    let mut random = rand::rng();
    for _ in 0..1_000 {
        let port = random.random_range(NODE_PORTS);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

pub fn run(args: &FailoverBenchArgs) -> anyhow::Result<()> {
    if !(args.nodes == 3 || args.nodes == 5)
        || args.kills == 0
        || args.keys == 0
        || !(1..=64).contains(&args.append_tasks)
    {
        bail!("need --nodes 3 or 5, --kills >= 1, --keys >= 1 and --append-tasks 1 to 64");
    }
    match args.shape.as_str() {
        "metadata" => {}
        "queue" => return super::failover_queue::run(args),
        other => bail!("--shape takes metadata or queue, got '{other}'"),
    }
    let directory = tempfile::tempdir().context("creating a temporary directory")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut nodes = start_cluster(directory.path(), args.nodes, &[])?;
    let report = runtime.block_on(bench(args, &mut nodes));
    for node in &mut nodes {
        drop(node.process.take());
    }
    let report = report?;
    print_report(
        args,
        &report,
        &format!(
            "{} writes acknowledged, {} lost",
            report["writes_acknowledged"], report["writes_lost"]
        ),
    )?;
    if report["writes_lost"] != 0 {
        bail!("acknowledged writes were lost");
    }
    Ok(())
}

/// Prints `report`: a summary of its failovers and `outcome` on standard error, the report
/// itself on standard output (one JSON line with `--json`).
pub(super) fn print_report(
    args: &FailoverBenchArgs,
    report: &Value,
    outcome: &str,
) -> anyhow::Result<()> {
    let failover = &report["failover_ms"];
    eprintln!(
        "levee: {} kills, failover p50 {} ms, p99 {} ms, max {} ms (target p99 <= {} ms: {}); \
         {outcome}",
        args.kills,
        failover["p50"],
        failover["p99"],
        failover["max"],
        FAILOVER_P99_TARGET_MS,
        if report["target_met"] == true {
            "met"
        } else {
            "NOT met"
        },
    );
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(report)?);
    }
    Ok(())
}

/// Starts a cluster of `count` nodes that replicates its queues over `shards` shards, every
/// node with `extra` flags too.
pub(super) fn start_replicated_cluster(
    directory: &Path,
    (count, shards): (u64, u32),
    extra: &[&str],
) -> anyhow::Result<Vec<Node>> {
    let mut flags = vec![
        "--replicated-queues".to_owned(),
        "true".to_owned(),
        "--shards".to_owned(),
        shards.to_string(),
    ];
    flags.extend(extra.iter().map(|flag| (*flag).to_owned()));
    start_cluster(directory, count, &flags)
}

/// Whether every one of `shards` shards has a leader and `replicas` voters, no change of them
/// under way, as `cluster` says.
pub(super) fn shards_placed(
    cluster: &levee_proto::v1::GetClusterResponse,
    shards: u32,
    replicas: usize,
) -> bool {
    cluster.replicated_queues
        && cluster.shard_map.len() == shards as usize
        && cluster
            .shard_map
            .iter()
            .all(|shard| shard.leader_id != 0 && shard.voters.len() == replicas && !shard.changing)
}

/// Whether every shard of `cluster` is led by its preferred replica (the first named).
pub(super) fn shards_spread(cluster: &levee_proto::v1::GetClusterResponse) -> bool {
    cluster
        .shard_map
        .iter()
        .all(|shard| shard.replicas.first() == Some(&shard.leader_id))
}

/// Starts node 1, then the others joining it, each on fixed free loopback ports (a node
/// restarts on the same addresses, which the cluster knows it by), every one with `extra`
/// flags too.
pub(super) fn start_cluster(
    directory: &Path,
    count: u64,
    extra: &[String],
) -> anyhow::Result<Vec<Node>> {
    let mut nodes: Vec<Node> = Vec::new();
    let mut seed: Option<String> = None;
    for id in 1..=count {
        let grpc_addr = format!("127.0.0.1:{}", free_port()?);
        let peer_addr = format!("127.0.0.1:{}", free_port()?);
        let mut flags = vec![
            "--node-id".to_owned(),
            id.to_string(),
            "--grpc-addr".to_owned(),
            grpc_addr.clone(),
            "--admin-addr".to_owned(),
            format!("127.0.0.1:{}", free_port()?),
            "--peer-addr".to_owned(),
            peer_addr.clone(),
        ];
        flags.extend_from_slice(extra);
        let data_dir = directory.join(format!("n{id}"));
        let mut first_start = flags.clone();
        if let Some(seed) = &seed {
            first_start.extend(["--join".to_owned(), seed.clone()]);
        }
        let process =
            start_node(&data_dir, &first_start).with_context(|| format!("starting node {id}"))?;
        seed.get_or_insert(peer_addr);
        flags.shrink_to_fit();
        nodes.push(Node {
            id,
            data_dir,
            flags,
            grpc_addr,
            process: Some(process),
        });
    }
    Ok(nodes)
}

pub(super) fn start_node(data_dir: &Path, flags: &[String]) -> anyhow::Result<ServerProcess> {
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    ServerProcess::start_in(data_dir, &flags)
}

async fn bench(args: &FailoverBenchArgs, nodes: &mut [Node]) -> anyhow::Result<Value> {
    let options = ClientOptions {
        connect_timeout: Duration::from_secs(1),
        request_timeout: WRITE_TIMEOUT,
    };
    let mut clients = Vec::new();
    for node in nodes.iter() {
        clients.push(Client::connect_with(&node.grpc_addr, &options).await?);
    }
    let clients = Arc::new(clients);
    wait_settled(&clients, &vec![true; nodes.len()]).await?;
    let shared: SharedState = Arc::new(Mutex::new(Shared {
        alive: vec![true; nodes.len()],
        writes: Vec::new(),
    }));
    let (stop, stopped) = watch::channel(false);
    let writing = tokio::spawn(write_continuously(
        Arc::clone(&clients),
        Arc::clone(&shared),
        stopped,
        (args.keys, Duration::from_millis(args.write_interval_ms)),
    ));
    let started = Instant::now();
    let mut failovers = Histogram::<u64>::new(3)?;
    let mut leaders_killed = Vec::new();
    for _ in 0..args.kills {
        let killed = kill_leader(&clients, nodes, &shared).await?;
        failovers.record(killed.failover.as_micros().try_into().unwrap_or(u64::MAX))?;
        leaders_killed.push(killed.node_id);
        restart(&clients, nodes, &shared, killed.index).await?;
    }
    let _ = stop.send(true);
    writing.await.context("the writer task")?;
    let duration_s = started.elapsed().as_secs_f64();
    let alive = vec![true; nodes.len()];
    wait_settled(&clients, &alive).await?;
    let writes = lock(&shared).writes.clone();
    let (lost, finals_agree) = count_lost(&clients, &writes, args.keys).await?;
    let mut latency = Histogram::<u64>::new(3)?;
    for write in &writes {
        if let Some(acked) = write.acked {
            let micros = (acked - write.invoked).as_micros();
            latency.record(micros.try_into().unwrap_or(u64::MAX))?;
        }
    }
    let failover_ms = super::percentiles_ms(&failovers);
    let target_met = failover_ms["p99"].as_f64().unwrap_or(f64::MAX) <= FAILOVER_P99_TARGET_MS;
    Ok(json!({
        "nodes": args.nodes,
        "kills": args.kills,
        "leaders_killed": leaders_killed,
        "failover_ms": failover_ms,
        "target_p99_ms": FAILOVER_P99_TARGET_MS,
        "target_met": target_met,
        "writes_attempted": writes.len(),
        "writes_acknowledged": writes.iter().filter(|write| write.acked.is_some()).count(),
        "writes_failed": writes.iter().filter(|write| write.acked.is_none()).count(),
        "writes_lost": lost,
        "nodes_agree": finals_agree,
        "write_latency_ms": super::percentiles_ms(&latency),
        "duration_s": duration_s,
    }))
}

/// Writes one metadata change after another, each through the next node that is up, until
/// told to stop.
async fn write_continuously(
    clients: Arc<Vec<Client>>,
    shared: SharedState,
    stop: watch::Receiver<bool>,
    (keys, interval): (u64, Duration),
) {
    let mut turn = 0;
    for value in 1_u64.. {
        if *stop.borrow() {
            return;
        }
        let target = {
            let shared = lock(&shared);
            if shared.writes.len() >= WRITES_MAX {
                return;
            }
            let count = shared.alive.len();
            (1..=count)
                .map(|step| (turn + step) % count)
                .find(|index| shared.alive[*index])
        };
        let Some(target) = target else {
            tokio::time::sleep(interval).await;
            continue;
        };
        turn = target;
        let key = value % keys;
        let invoked = Instant::now();
        // A value below 2^53 is exact as f64.
        #[allow(clippy::cast_precision_loss)]
        let rate = value as f64;
        let written = tokio::time::timeout(
            WRITE_TIMEOUT,
            clients[target].set_producer_rate(&format!("failover-{key}"), rate),
        )
        .await;
        let acked = matches!(written, Ok(Ok(()))).then(Instant::now);
        lock(&shared).writes.push(WriteRecord {
            key,
            value,
            invoked,
            acked,
        });
        tokio::time::sleep(interval).await;
    }
}

/// A leader killed: which, and how long until a write sent after the kill was acknowledged.
struct Killed {
    index: usize,
    node_id: u64,
    failover: Duration,
}

/// Finds the leader, kills it with SIGKILL, and waits for the first acknowledged write sent
/// after the kill.
async fn kill_leader(
    clients: &[Client],
    nodes: &mut [Node],
    shared: &SharedState,
) -> anyhow::Result<Killed> {
    let view = clients[0].cluster().await?;
    let index = nodes
        .iter()
        .position(|node| node.id == view.leader_id)
        .with_context(|| format!("no node is the leader {}", view.leader_id))?;
    let process = nodes[index]
        .process
        .take()
        .context("the leader is not running")?;
    lock(shared).alive[index] = false;
    let killed_at = Instant::now();
    tokio::task::spawn_blocking(move || process.kill()).await?;
    let deadline = killed_at + SETTLE_TIMEOUT;
    loop {
        let acked = lock(shared)
            .writes
            .iter()
            .rev()
            .take_while(|write| write.invoked >= killed_at)
            .filter_map(|write| write.acked)
            .min();
        if let Some(acked) = acked {
            return Ok(Killed {
                index,
                node_id: nodes[index].id,
                failover: acked - killed_at,
            });
        }
        if Instant::now() >= deadline {
            bail!(
                "no write succeeded within {SETTLE_TIMEOUT:?} of killing leader {}",
                nodes[index].id
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Restarts node `index` on its data dir and addresses and waits for the cluster to settle:
/// every node up and caught up, and a few more writes acknowledged.
async fn restart(
    clients: &[Client],
    nodes: &mut [Node],
    shared: &SharedState,
    index: usize,
) -> anyhow::Result<()> {
    let (data_dir, flags) = (nodes[index].data_dir.clone(), nodes[index].flags.clone());
    let process = tokio::task::spawn_blocking(move || start_node(&data_dir, &flags))
        .await?
        .with_context(|| format!("restarting node {}", nodes[index].id))?;
    nodes[index].process = Some(process);
    let alive = vec![true; nodes.len()];
    wait_settled(clients, &alive).await?;
    let acked_before = acked_count(shared);
    lock(shared).alive[index] = true;
    wait_acked(
        || acked_count(shared),
        acked_before + WRITES_BETWEEN_KILLS,
        "writes",
    )
    .await
}

/// Waits up to [`SETTLE_TIMEOUT`] until `acked()` reaches `target` (`what` resumed after a
/// restart).
pub(super) async fn wait_acked(
    acked: impl Fn() -> usize,
    target: usize,
    what: &str,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    while acked() < target {
        if Instant::now() >= deadline {
            bail!("{what} did not resume within {SETTLE_TIMEOUT:?} of a restart");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

fn acked_count(shared: &SharedState) -> usize {
    lock(shared)
        .writes
        .iter()
        .filter(|write| write.acked.is_some())
        .count()
}

/// Waits until every node that is up knows one leader, which sees every member healthy and at
/// most a few entries behind.
async fn wait_settled(clients: &[Client], alive: &[bool]) -> anyhow::Result<()> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    loop {
        if settled(clients, alive).await {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("the cluster did not settle within {SETTLE_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn settled(clients: &[Client], alive: &[bool]) -> bool {
    let mut views: Vec<ClusterView> = Vec::new();
    for (client, _) in clients.iter().zip(alive).filter(|(_, alive)| **alive) {
        match client.cluster().await {
            Ok(view) => views.push(view),
            Err(_) => return false,
        }
    }
    let Some(leader_id) = views.first().map(|view| view.leader_id) else {
        return false;
    };
    let Some(leader_view) = views.iter().find(|view| view.node_id == leader_id) else {
        return false;
    };
    views.iter().all(|view| view.leader_id == leader_id)
        && leader_view.members.len() == alive.len()
        && leader_view.members.iter().all(|member| {
            member.healthy
                && (member.role() == MemberRole::Leader || member.lag_entries.unwrap_or(0) <= 2)
        })
}

/// Reads every key's final value on every node (once every node has applied the whole log)
/// and counts the acknowledged writes above it; also whether the nodes agree.
async fn count_lost(
    clients: &[Client],
    writes: &[WriteRecord],
    keys: u64,
) -> anyhow::Result<(usize, bool)> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    loop {
        let mut indexes = Vec::new();
        for client in clients {
            let view = client.cluster().await?;
            indexes.push((view.last_log_index, view.applied_index));
        }
        let last = indexes.iter().map(|(last, _)| *last).max().unwrap_or(0);
        if indexes.iter().all(|(_, applied)| *applied == last) {
            break;
        }
        if Instant::now() >= deadline {
            bail!("the nodes did not all apply the log within {SETTLE_TIMEOUT:?}: {indexes:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut finals: Vec<BTreeMap<u64, u64>> = Vec::new();
    for client in clients {
        let mut values = BTreeMap::new();
        for key in 0..keys {
            let described = client.describe_producer(&format!("failover-{key}")).await?;
            // Values are whole numbers below 2^53.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            values.insert(key, described.rate_limit_per_s as u64);
        }
        finals.push(values);
    }
    let lowest = |key: u64| {
        finals
            .iter()
            .map(|values| values.get(&key).copied().unwrap_or(0))
            .min()
            .unwrap_or(0)
    };
    let lost = writes
        .iter()
        .filter(|write| write.acked.is_some() && write.value > lowest(write.key))
        .count();
    let agree = finals.iter().all(|values| *values == finals[0]);
    Ok((lost, agree))
}
