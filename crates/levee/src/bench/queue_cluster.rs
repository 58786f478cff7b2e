//! `levee bench queue --nodes 3`: the same load against a cluster of `--nodes` `levee server`
//! processes on this machine that replicate their queues (docs/CLUSTER.md, "Part 2"), with the
//! single-node figure of the same run beside it. The tool starts a lone server and runs the
//! shape against it first, then starts the cluster (node 1, the others joining it, every one
//! with `--replicated-queues true --shards S` and the same `--sync`), waits until every shard
//! has its replicas as voters and a leader (and, up to 30 s, until each shard is led by its
//! preferred replica, so the leaders are spread), and runs the shape against node 1. Mailbox
//! shape: the producer sends each batch's messages straight to their shard leaders, and the
//! mailbox streams read node 1's replica. Topic shape: the topic's partitions are all in the
//! shard of its name, so publishes and the group members' streams go through node 1 to that
//! shard's leader, which also coordinates the group.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use levee_client::Client;
use serde_json::{Value, json};

use super::failover::{shards_placed, start_replicated_cluster};
use super::queue::{QueueBenchArgs, bench};
use super::server_process::ServerProcess;

/// Longest the cluster may take to place every shard.
const PLACED_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest the tool waits for the leaders to spread over the nodes.
const SPREAD_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs the single node, then the cluster; the cluster's report with the single node's
/// figures in `single_node` and the ratio of their append rates.
pub(super) fn run(
    args: &QueueBenchArgs,
    runtime: &tokio::runtime::Runtime,
    sync: &str,
) -> anyhow::Result<Value> {
    if !matches!(args.nodes, 3 | 5) {
        bail!("--nodes takes 1, 3 or 5, got {}", args.nodes);
    }
    if !(1..=levee_proto::shards::SHARDS_MAX).contains(&args.shards) {
        bail!(
            "--shards must be 1 to {}, got {}",
            levee_proto::shards::SHARDS_MAX,
            args.shards
        );
    }
    eprintln!("levee: the single node first");
    let single = {
        let server = ServerProcess::start(&["--queue-sync", sync])?;
        runtime.block_on(bench(args, &server.grpc_addr))?
    };
    eprintln!(
        "levee: now {} nodes replicating their queues over {} shards",
        args.nodes, args.shards
    );
    let directory = tempfile::tempdir().context("creating a temporary directory")?;
    let mut nodes = start_replicated_cluster(
        directory.path(),
        (args.nodes, args.shards),
        &["--queue-sync", sync],
    )?;
    let address = nodes[0].grpc_addr.clone();
    let replicas = usize::try_from(args.nodes)?.min(levee_proto::shards::REPLICAS_MAX);
    let report = runtime.block_on(async {
        let spread = wait_placed(&address, args.shards, replicas).await?;
        let mut report = bench(args, &address).await?;
        report["leaders_spread"] = json!(spread);
        anyhow::Ok(report)
    });
    for node in &mut nodes {
        drop(node.process.take());
    }
    let mut report = report?;
    let ratio = report["appends_per_s"].as_f64().unwrap_or_default()
        / single["appends_per_s"].as_f64().unwrap_or(f64::NAN);
    report["nodes"] = json!(args.nodes);
    report["shards"] = json!(args.shards);
    report["ratio_to_single_node"] = json!(ratio);
    report["single_node"] = json!({
        "appends_per_s": single["appends_per_s"],
        "consumed_per_s": single["consumed_per_s"],
        "latency_ms": single["latency_ms"],
        "append_latency_ms": single["append_latency_ms"],
    });
    eprintln!(
        "levee: {} nodes append {:.0}/s, {:.0}% of the single node's {:.0}/s",
        args.nodes,
        report["appends_per_s"].as_f64().unwrap_or_default(),
        ratio * 100.0,
        single["appends_per_s"].as_f64().unwrap_or_default()
    );
    Ok(report)
}

/// Waits until every shard's voters are `replicas` nodes and it has a leader, then (up to
/// [`SPREAD_TIMEOUT`]) until each is led by its preferred replica; whether they all were.
async fn wait_placed(address: &str, shards: u32, replicas: usize) -> anyhow::Result<bool> {
    let client = Client::connect(address).await?;
    let started = Instant::now();
    loop {
        let cluster = client.cluster().await?;
        let placed = shards_placed(&cluster, shards, replicas);
        let spread = placed
            && cluster
                .shard_map
                .iter()
                .all(|shard| shard.replicas.first() == Some(&shard.leader_id));
        if spread || (placed && started.elapsed() > SPREAD_TIMEOUT) {
            return Ok(spread);
        }
        if started.elapsed() > PLACED_TIMEOUT {
            bail!(
                "the cluster did not place its {shards} shards within {} s",
                PLACED_TIMEOUT.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
