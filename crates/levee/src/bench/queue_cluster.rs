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
//! shard's leader, which also coordinates the group. The report's `shard_rounds` gives, per
//! node and over the run, the shard writes it committed as a leader, its log appends and its
//! applies, each with its average time (from each node's `/metrics`): where a write's time
//! goes.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use levee_client::Client;
use serde_json::{Value, json};

use super::failover::{shards_placed, shards_spread, start_replicated_cluster};
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
    let (single, single_used) = {
        let server = ServerProcess::start(&["--queue-sync", sync])?;
        let before = Used::of(server.pid(), None);
        let single = runtime.block_on(bench(args, &server.grpc_addr))?;
        (single, Used::of(server.pid(), None).since(&before))
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
    let admin: Vec<(u64, String)> = nodes
        .iter()
        .filter_map(|node| {
            let at = node.flags.iter().position(|flag| flag == "--admin-addr")?;
            Some((node.id, node.flags.get(at + 1)?.clone()))
        })
        .collect();
    let pids: Vec<(u64, u32, &str)> = nodes
        .iter()
        .zip(&admin)
        .filter_map(|(node, (_, admin))| Some((node.id, node.process.as_ref()?.pid(), &admin[..])))
        .collect();
    let report = runtime.block_on(async {
        let spread = wait_placed(&address, args.shards, replicas).await?;
        let before = round_timings(&admin);
        let node_1 = admin.first().map_or("", |(_, address)| address.as_str());
        let terms_before = shard_terms(node_1);
        let used_before = used_by(&pids);
        let mut report = bench(args, &address).await?;
        let used = used_by(&pids)
            .iter()
            .zip(&used_before)
            .map(|((id, after), (_, before))| (*id, after.since(before)))
            .collect::<Vec<_>>();
        report["leaders_spread"] = json!(spread);
        report["shard_elections"] = elections_report(&terms_before, &shard_terms(node_1));
        report["shard_rounds"] = rounds_report(&before, &round_timings(&admin));
        report["resources"] = resources_report(args, (&report, &used), (&single, &single_used));
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

/// The shard round histograms each node times: the metric, then the report's names for its
/// count and its average.
const ROUND_PARTS: [(&str, &str, &str); 3] = [
    ("levee_shard_commit_seconds", "commits", "commit_ms_avg"),
    (
        "levee_shard_log_append_seconds",
        "log_appends",
        "log_append_ms_avg",
    ),
    ("levee_shard_apply_seconds", "applies", "apply_ms_avg"),
];

/// Each node's (id, `_sum` and `_count` of every [`ROUND_PARTS`] histogram) from its
/// `/metrics`; a node that does not answer is left out.
fn round_timings(admin: &[(u64, String)]) -> Vec<(u64, Vec<(f64, f64)>)> {
    admin
        .iter()
        .filter_map(|(id, address)| {
            let text = scrape_metrics(address).ok()?;
            let value = |series: String| metric(&text, &series).unwrap_or_default();
            let parts = ROUND_PARTS
                .iter()
                .map(|(metric, _, _)| {
                    (
                        value(format!("{metric}_sum")),
                        value(format!("{metric}_count")),
                    )
                })
                .collect();
            Some((*id, parts))
        })
        .collect()
}

/// Per node, over the run: how many shard writes it committed as a leader, log appends and
/// applies it did, and each one's average in ms (where a write's time goes, docs/CLUSTER.md,
/// "Where the speed stands").
fn rounds_report(before: &[(u64, Vec<(f64, f64)>)], after: &[(u64, Vec<(f64, f64)>)]) -> Value {
    let nodes: Vec<Value> = after
        .iter()
        .filter_map(|(id, parts)| {
            let (_, earlier) = before.iter().find(|(other, _)| other == id)?;
            let mut node = json!({ "node": id });
            for (((_, counted, average), (sum, count)), (sum_before, count_before)) in
                ROUND_PARTS.iter().zip(parts).zip(earlier)
            {
                let count = count - count_before;
                node[*counted] = json!(count);
                node[*average] = if count > 0.0 {
                    json!((sum - sum_before) / count * 1e3)
                } else {
                    Value::Null
                };
            }
            Some(node)
        })
        .collect();
    for node in &nodes {
        eprintln!(
            "levee: node {}: {} commits as a leader averaging {:.2} ms; {} log appends {:.2} ms; \
             {} applies {:.2} ms",
            node["node"],
            node["commits"],
            node["commit_ms_avg"].as_f64().unwrap_or(f64::NAN),
            node["log_appends"],
            node["log_append_ms_avg"].as_f64().unwrap_or(f64::NAN),
            node["applies"],
            node["apply_ms_avg"].as_f64().unwrap_or(f64::NAN),
        );
    }
    Value::Array(nodes)
}

/// Each shard's Raft term as node 1 (admin port at `admin`) sees it, from `/v1/cluster`'s
/// `shard_groups`; empty if it does not answer.
fn shard_terms(admin: &str) -> Vec<(u64, u64)> {
    let Ok(text) = http_get(admin, "/v1/cluster") else {
        return Vec::new();
    };
    let cluster: Value = serde_json::from_str(&text).unwrap_or_default();
    cluster["shard_groups"]
        .as_array()
        .map(|groups| {
            groups
                .iter()
                .filter_map(|group| Some((group["shard"].as_u64()?, group["term"].as_u64()?)))
                .collect()
        })
        .unwrap_or_default()
}

/// The report's `shard_elections`: the terms the shards started over the run, as node 1 saw
/// them (each one an election, won or not: a leader lost under load, or a preferred replica
/// claiming its shard), and how many shards had any.
fn elections_report(before: &[(u64, u64)], after: &[(u64, u64)]) -> Value {
    let started: Vec<u64> = after
        .iter()
        .filter_map(|(shard, term)| {
            let (_, earlier) = before.iter().find(|(other, _)| other == shard)?;
            Some(term.saturating_sub(*earlier))
        })
        .collect();
    let total: u64 = started.iter().sum();
    let shards = started.iter().filter(|count| **count > 0).count();
    eprintln!("levee: {total} shard elections during the run, in {shards} shards");
    json!({ "terms_started": total, "shards": shards })
}

/// What a server process used over a run: bytes it sent to the disk, those its queue store
/// wrote (from `/metrics`; `None` where not scraped), and its CPU time.
#[derive(Debug, Clone, Copy, Default)]
struct Used {
    disk_bytes: u64,
    store_bytes: Option<f64>,
    cpu_s: f64,
}

impl Used {
    /// What process `pid` (admin port at `admin`, when given) has used so far.
    fn of(pid: u32, admin: Option<&str>) -> Self {
        let store_bytes = admin
            .and_then(|address| scrape_metrics(address).ok())
            .and_then(|text| metric(&text, "levee_store_bytes_written_total"));
        Self {
            disk_bytes: super::disk_bytes_written(&pid.to_string()),
            store_bytes,
            cpu_s: super::cpu_seconds(&pid.to_string()),
        }
    }

    /// What was used since `before`.
    fn since(&self, before: &Self) -> Self {
        Self {
            disk_bytes: self.disk_bytes.saturating_sub(before.disk_bytes),
            store_bytes: self
                .store_bytes
                .zip(before.store_bytes)
                .map(|(now, then)| now - then),
            cpu_s: self.cpu_s - before.cpu_s,
        }
    }
}

/// What each node (id, pid, admin address) has used so far.
fn used_by(pids: &[(u64, u32, &str)]) -> Vec<(u64, Used)> {
    pids.iter()
        .map(|(id, pid, admin)| (*id, Used::of(*pid, Some(admin))))
        .collect()
}

/// The report's `resources`: per node and over the cluster, the bytes sent to the disk per
/// byte of payload appended (the write amplification of a separate Raft log beside the
/// store, docs/CLUSTER.md, "Where the Raft log lives"), the store's share of them, and the
/// servers' CPU time per message; the single node's beside them.
fn resources_report(
    args: &QueueBenchArgs,
    (cluster, used): (&Value, &[(u64, Used)]),
    (single, single_used): (&Value, &Used),
) -> Value {
    let payload = |report: &Value| {
        report["appended"].as_f64().unwrap_or_default() * args.message_bytes as f64
    };
    let per = |amount: f64, of: f64| {
        if of > 0.0 {
            json!(amount / of)
        } else {
            Value::Null
        }
    };
    let (payload_bytes, single_payload) = (payload(cluster), payload(single));
    let messages = cluster["appended"].as_f64().unwrap_or_default();
    let disk: f64 = used.iter().map(|(_, used)| used.disk_bytes as f64).sum();
    let store: f64 = used.iter().filter_map(|(_, used)| used.store_bytes).sum();
    let cpu: f64 = used.iter().map(|(_, used)| used.cpu_s).sum();
    let report = json!({
        "payload_bytes": payload_bytes,
        "disk_bytes": disk,
        "disk_bytes_per_payload_byte": per(disk, payload_bytes),
        "store_bytes_per_payload_byte": per(store, payload_bytes),
        "server_cpu_s": cpu,
        "server_cpu_us_per_message": per(cpu * 1e6, messages),
        "nodes": used.iter().map(|(id, used)| json!({
            "node": id,
            "disk_bytes": used.disk_bytes,
            "store_bytes": used.store_bytes,
            "cpu_s": used.cpu_s,
        })).collect::<Vec<_>>(),
        "single_node": {
            "payload_bytes": single_payload,
            "disk_bytes": single_used.disk_bytes,
            "disk_bytes_per_payload_byte": per(single_used.disk_bytes as f64, single_payload),
            "server_cpu_s": single_used.cpu_s,
            "server_cpu_us_per_message":
                per(single_used.cpu_s * 1e6, single["appended"].as_f64().unwrap_or_default()),
        },
    });
    eprintln!(
        "levee: disk bytes per payload byte {:.1} over the nodes ({:.1} of it the stores'), \
         {:.1} on the single node; server CPU per message {:.1} us against {:.1} us",
        report["disk_bytes_per_payload_byte"]
            .as_f64()
            .unwrap_or(f64::NAN),
        report["store_bytes_per_payload_byte"]
            .as_f64()
            .unwrap_or(f64::NAN),
        report["single_node"]["disk_bytes_per_payload_byte"]
            .as_f64()
            .unwrap_or(f64::NAN),
        report["server_cpu_us_per_message"]
            .as_f64()
            .unwrap_or(f64::NAN),
        report["single_node"]["server_cpu_us_per_message"]
            .as_f64()
            .unwrap_or(f64::NAN),
    );
    report
}

/// The value of the first sample of `series` (a metric name with its labels, if any) in the
/// Prometheus text `text`.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.parse::<f64>().ok())
}

/// The text of `/metrics` on the admin port at `address`.
fn scrape_metrics(address: &str) -> anyhow::Result<String> {
    http_get(address, "/metrics")
}

/// The body of `path` on the admin port at `address`: a plain HTTP/1.0 GET over loopback, the
/// answer read until the server closes the connection.
fn http_get(address: &str, path: &str) -> anyhow::Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n").as_bytes())?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .context("an HTTP answer without a body")?;
    if head.split(' ').nth(1) != Some("200") {
        bail!(
            "{path} on {address}: {}",
            head.lines().next().unwrap_or_default()
        );
    }
    Ok(body.to_owned())
}

/// Waits until every shard's voters are `replicas` nodes and it has a leader, then (up to
/// [`SPREAD_TIMEOUT`]) until each is led by its preferred replica; whether they all were.
async fn wait_placed(address: &str, shards: u32, replicas: usize) -> anyhow::Result<bool> {
    let client = Client::connect(address).await?;
    let started = Instant::now();
    loop {
        let cluster = client.cluster().await?;
        let placed = shards_placed(&cluster, shards, replicas);
        let spread = placed && shards_spread(&cluster);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_terms_before_and_after_a_run_then_elections_count_the_new_terms_of_shards_seen_both_times()
     {
        let before = [(0, 3), (1, 5), (2, 7)];
        // Shard 1 elected twice, shard 2 not; shard 3 was not seen before and is left out.
        let after = [(0, 3), (1, 7), (2, 7), (3, 9)];
        let report = elections_report(&before, &after);
        assert_eq!(report["terms_started"], 2);
        assert_eq!(report["shards"], 1);
        assert_eq!(elections_report(&before, &[])["terms_started"], 0);
    }
}
