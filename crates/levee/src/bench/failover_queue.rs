//! `levee bench failover --shape queue`: a cluster that replicates its queues (docs/CLUSTER.md,
//! "Part 2"), an idempotent producer appending to `--keys` queues from `--append-tasks` tasks,
//! each one message after another (each message's payload its number), and the leader of a shard killed with SIGKILL again and
//! again (the shard of queue `failover-k` at the k-th kill), each killed node restarted, the
//! shards placed again and the restarted node caught up (it answers a linearizable read of
//! every queue) before the next kill. Meanwhile a consumer reads every queue on one
//! many-queue stream, acking what it takes and confirming its acks after each batch; when its
//! node dies it opens the stream again through the next node. `acked_redelivered` counts the
//! deliveries of messages whose ack had been confirmed (a failover must never hand them out
//! again); `uncommitted_seen` the deliveries that are not, at the end, the stored message at
//! their offset. Failover time: from the kill to the first append
//! to the killed shard acknowledged after it. At the end, once every node holds every queue
//! alike, every node's queues are read whole: `acknowledged_lost` counts acknowledged appends
//! not found at their acknowledged offset on some node, `duplicates` the messages stored more
//! than once.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use hdrhistogram::Histogram;
use levee_client::{Client, ClientOptions, Producer, ProducerOptions};
use levee_proto::v1::ErrorCode;
use serde_json::{Value, json};
use tokio::sync::watch;

use super::failover::{
    FAILOVER_P99_TARGET_MS, FailoverBenchArgs, Node, print_report, shards_placed, start_node,
    start_replicated_cluster,
};
use super::failover_group;

/// Longest a failover, a placement or the nodes converging may take before the run gives up.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Appends acknowledged after a restart before the next kill.
const APPENDS_BETWEEN_KILLS: usize = 20;
/// Appends the run keeps a record of, at most (it stops appending beyond).
const APPENDS_MAX: usize = 1_000_000;

/// One append: its queue, number, when sent, and when acknowledged at which offset.
#[derive(Debug, Clone)]
struct Append {
    queue: String,
    number: u64,
    invoked: Instant,
    acked: Option<(Instant, u64)>,
}

type Appends = Arc<Mutex<Vec<Append>>>;

fn lock(appends: &Appends) -> std::sync::MutexGuard<'_, Vec<Append>> {
    appends.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs the queue shape of `levee bench failover`.
pub(super) fn run(args: &FailoverBenchArgs) -> anyhow::Result<()> {
    if !(1..=levee_proto::shards::SHARDS_MAX).contains(&args.shards) {
        bail!("--shards must be 1 to {}", levee_proto::shards::SHARDS_MAX);
    }
    let directory = tempfile::tempdir().context("creating a temporary directory")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let snapshot_entries = args
        .shard_snapshot_entries
        .map(|entries| entries.to_string());
    let extra: Vec<&str> = snapshot_entries
        .iter()
        .flat_map(|entries| ["--shard-snapshot-entries", entries.as_str()])
        .collect();
    let mut nodes = start_replicated_cluster(directory.path(), (args.nodes, args.shards), &extra)?;
    let report = runtime.block_on(bench(args, &mut nodes));
    for node in &mut nodes {
        drop(node.process.take());
    }
    let report = report?;
    print_report(
        args,
        &report,
        &format!(
            "a new leader named after p50 {} ms, max {} ms; {} appends acknowledged, {} lost, {} \
             duplicates; {} consumed, {} acked redelivered, {} uncommitted seen; group: {} \
             published, {} delivered, {} commit redelivered, {} not delivered, {} coordinator \
             kills, failover {}",
            report["election_ms"]["p50"],
            report["election_ms"]["max"],
            report["appends_acknowledged"],
            report["acknowledged_lost"],
            report["duplicates"],
            report["consumed"],
            report["acked_redelivered"],
            report["uncommitted_seen"],
            report["group"]["published"],
            report["group"]["delivered"],
            report["group"]["commit_redelivered"],
            report["group"]["not_delivered"],
            report["group"]["coordinator_kills"],
            report["group"]["group_failover_ms"]
        ),
    )?;
    if report["acknowledged_lost"] != 0 || report["duplicates"] != 0 {
        bail!("acknowledged appends were lost or messages stored twice");
    }
    if report["group_wrong"] == true {
        bail!(
            "the group's member was handed a message below an answered commit, a message never \
             published, or not every published message"
        );
    }
    if report["acked_redelivered"] != 0 || report["uncommitted_seen"] != 0 {
        bail!(
            "the consumer was handed a message again after its ack was confirmed, or one never stored"
        );
    }
    Ok(())
}

/// A client of each node.
async fn connect(nodes: &[Node]) -> anyhow::Result<Vec<Client>> {
    let options = ClientOptions {
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(5),
    };
    let mut clients = Vec::new();
    for node in nodes {
        clients.push(Client::connect_with(&node.grpc_addr, &options).await?);
    }
    Ok(clients)
}

/// Deliveries in `seen` that are not, at the end, the stored message at their offset.
fn uncommitted_seen(
    seen: &[(String, u64, Vec<u8>)],
    stored: &BTreeMap<String, Vec<Vec<u8>>>,
) -> usize {
    seen.iter()
        .filter(|(queue, offset, payload)| {
            usize::try_from(*offset)
                .ok()
                .and_then(|offset| stored.get(queue)?.get(offset))
                != Some(payload)
        })
        .count()
}

async fn bench(args: &FailoverBenchArgs, nodes: &mut [Node]) -> anyhow::Result<Value> {
    let clients = connect(nodes).await?;
    let replicas = nodes.len().min(levee_proto::shards::REPLICAS_MAX);
    let alive = vec![true; nodes.len()];
    wait_placed(&clients, &alive, (args.shards, replicas)).await?;
    let producer = Producer::new(
        clients[0].clone(),
        ProducerOptions {
            idempotent: true,
            // About 5 s of resends (100 ms apart at most) before a send fails.
            retries_max: 55,
            ..ProducerOptions::default()
        },
    )?;
    let appends: Appends = Arc::default();
    let (stop, stopped) = watch::channel(false);
    // The consumer group: a topic in a shard the kills hit, its publisher and one member.
    let addresses = nodes.iter().map(|node| node.grpc_addr.clone()).collect();
    let mut group =
        failover_group::Group::start(&clients, addresses, args.shards, stopped.clone()).await?;
    let consumed: Arc<Mutex<Consumed>> = Arc::default();
    let consuming = tokio::spawn(consume_continuously(
        clients.clone(),
        args.keys,
        stopped.clone(),
        Arc::clone(&consumed),
    ));
    let writing = start_appending(args, &producer, &appends, &stopped);
    let started = Instant::now();
    let mut failovers = Histogram::<u64>::new(3)?;
    let mut elections = Histogram::<u64>::new(3)?;
    let mut group_failovers = Histogram::<u64>::new(3)?;
    let mut leaders_killed = Vec::new();
    for kill in 0..args.kills {
        let queue = format!("failover-{}", u64::from(kill) % args.keys);
        let shard = levee_proto::shards::shard_of(&queue, args.shards);
        let before_kill = Instant::now();
        let (index, failover, election) =
            kill_leader(&clients, nodes, &appends, (shard, args.shards)).await?;
        failovers.record(failover.as_micros().try_into().unwrap_or(u64::MAX))?;
        if let Some(election) = election {
            elections.record(election.as_micros().try_into().unwrap_or(u64::MAX))?;
        }
        if shard == levee_proto::shards::shard_of(&group.topic, args.shards) {
            // The group's coordinator was killed: the member's next answered commit.
            let failover = failover_group::wait_commit_after(&group.run, before_kill).await?;
            group_failovers.record(failover.as_micros().try_into().unwrap_or(u64::MAX))?;
        }
        leaders_killed.push(nodes[index].id);
        let (data_dir, flags) = (nodes[index].data_dir.clone(), nodes[index].flags.clone());
        let process = tokio::task::spawn_blocking(move || start_node(&data_dir, &flags))
            .await?
            .with_context(|| format!("restarting node {}", nodes[index].id))?;
        nodes[index].process = Some(process);
        wait_placed(&clients, &alive, (args.shards, replicas)).await?;
        wait_caught_up(&clients[index], args.keys).await?;
        wait_appends_resume(&appends).await?;
    }
    group.drain().await?;
    let _ = stop.send(true);
    for task in writing {
        task.await.context("an appending task")?;
    }
    consuming.await.context("the consuming task")?;
    let (group, group_wrong) = group.finish(&group_failovers).await?;
    let duration_s = started.elapsed().as_secs_f64();
    let appends = lock(&appends).clone();
    let (lost, duplicates, stored) = check(&clients, &appends, args.keys).await?;
    let consumed = std::mem::take(&mut *lock_consumed(&consumed));
    let failover_ms = super::percentiles_ms(&failovers);
    let target_met = failover_ms["p99"].as_f64().unwrap_or(f64::MAX) <= FAILOVER_P99_TARGET_MS;
    let acknowledged = appends
        .iter()
        .filter(|append| append.acked.is_some())
        .count();
    let uncommitted_seen = uncommitted_seen(&consumed.seen, &stored);
    Ok(json!({
        "shape": "queue",
        "nodes": args.nodes,
        "shards": args.shards,
        "append_tasks": args.append_tasks,
        "kills": args.kills,
        "leaders_killed": leaders_killed,
        "failover_ms": failover_ms,
        "election_ms": super::percentiles_ms(&elections),
        "target_p99_ms": FAILOVER_P99_TARGET_MS,
        "target_met": target_met,
        "appends_attempted": appends.len(),
        "appends_acknowledged": acknowledged,
        "appends_failed": appends.len() - acknowledged,
        "acknowledged_lost": lost,
        "duplicates": duplicates,
        "consumed": consumed.delivered,
        "consumer_reopened": consumed.reopened,
        "acked_redelivered": consumed.acked_redelivered,
        "unconfirmed_redelivered": consumed.unconfirmed_redelivered,
        "uncommitted_seen": uncommitted_seen,
        "append_latency_ms": append_latency_ms(&appends)?,
        "group": group,
        "group_wrong": group_wrong,
        "duration_s": duration_s,
    }))
}

/// Percentiles of the acknowledged appends' latency.
fn append_latency_ms(appends: &[Append]) -> anyhow::Result<Value> {
    let mut latency = Histogram::<u64>::new(3)?;
    for append in appends {
        if let Some((acked, _)) = append.acked {
            latency.record(
                (acked - append.invoked)
                    .as_micros()
                    .try_into()
                    .unwrap_or(u64::MAX),
            )?;
        }
    }
    Ok(super::percentiles_ms(&latency))
}

/// Waits until `restarted`'s node answers a read of each of the `keys` queues. A read is
/// linearizable: the node first applies what its shard had committed when it asked, so the
/// next kill finds every replica caught up (one failure at a time), not a node still
/// replaying what it missed while it was down.
async fn wait_caught_up(restarted: &Client, keys: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    for key in 0..keys {
        let queue = format!("failover-{key}");
        loop {
            match restarted.read(queue.as_bytes(), 0, 1, 0).await {
                Ok(_) => break,
                Err(error) if error.code() == Some(ErrorCode::NotFound) => break,
                Err(error) if Instant::now() >= deadline => {
                    bail!(
                        "the restarted node did not catch up on {queue} within \
                         {SETTLE_TIMEOUT:?}: {error}"
                    );
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    Ok(())
}

/// Waits for [`APPENDS_BETWEEN_KILLS`] more acknowledged appends.
async fn wait_appends_resume(appends: &Appends) -> anyhow::Result<()> {
    let target = acked_count(appends) + APPENDS_BETWEEN_KILLS;
    super::failover::wait_acked(|| acked_count(appends), target, "appends").await
}

fn acked_count(appends: &Appends) -> usize {
    lock(appends)
        .iter()
        .filter(|append| append.acked.is_some())
        .count()
}

/// Starts `--append-tasks` tasks appending through `producer` into `appends` until `stopped`.
fn start_appending(
    args: &FailoverBenchArgs,
    producer: &Producer,
    appends: &Appends,
    stopped: &watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..args.append_tasks)
        .map(|task| {
            tokio::spawn(append_continuously(
                producer.clone(),
                Arc::clone(appends),
                stopped.clone(),
                (args.keys, task, args.append_tasks),
            ))
        })
        .collect()
}

/// Appends message `task`, then `task + tasks`, and so on, each to queue `number % keys`
/// once the one before was answered (resent by the producer as needed), until stopped.
async fn append_continuously(
    producer: Producer,
    appends: Appends,
    stop: watch::Receiver<bool>,
    (keys, task, tasks): (u64, u64, u64),
) {
    for number in (task..).step_by(usize::try_from(tasks).unwrap_or(1)) {
        if *stop.borrow() || lock(&appends).len() >= APPENDS_MAX {
            return;
        }
        let queue = format!("failover-{}", number % keys);
        let invoked = Instant::now();
        let sent = producer
            .send(queue.as_bytes(), number.to_string().as_bytes())
            .await;
        let acked = sent.ok().map(|offset| (Instant::now(), offset));
        lock(&appends).push(Append {
            queue,
            number,
            invoked,
            acked,
        });
    }
}

/// When, after `killed_at`, one of `survivors` first names a leader of `shard` other than
/// the killed `leader` (asked every 10 ms, for at most [`SETTLE_TIMEOUT`]).
async fn elected_after(
    survivors: Vec<Client>,
    shard: u32,
    leader: u64,
    killed_at: Instant,
) -> Option<Duration> {
    while killed_at.elapsed() < SETTLE_TIMEOUT {
        for client in &survivors {
            let named = client.cluster().await.ok().and_then(|cluster| {
                cluster
                    .shard_map
                    .get(shard as usize)
                    .map(|placement| placement.leader_id)
            });
            if named.is_some_and(|named| named != 0 && named != leader) {
                return Some(killed_at.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// Kills the leader of `shard` and waits for the first append to one of its queues
/// acknowledged after the kill; the killed node's index, the failover time and when a
/// surviving node first named a new leader of the shard.
async fn kill_leader(
    clients: &[Client],
    nodes: &mut [Node],
    appends: &Appends,
    (shard, shards): (u32, u32),
) -> anyhow::Result<(usize, Duration, Option<Duration>)> {
    // A preferred replica may be taking the lead back just now: its election is waited out.
    let looking = Instant::now();
    let leader = loop {
        let known = clients[0]
            .cluster()
            .await?
            .shard_map
            .get(shard as usize)
            .map(|placement| placement.leader_id)
            .filter(|leader| *leader != 0);
        match known {
            Some(leader) => break leader,
            None if looking.elapsed() < SETTLE_TIMEOUT => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            None => bail!("shard {shard} has no leader after {SETTLE_TIMEOUT:?}"),
        }
    };
    let index = nodes
        .iter()
        .position(|node| node.id == leader)
        .with_context(|| format!("no node is shard {shard}'s leader {leader}"))?;
    let process = nodes[index]
        .process
        .take()
        .context("the leader is not running")?;
    let survivors: Vec<Client> = clients
        .iter()
        .zip(nodes.iter())
        .filter(|(_, node)| node.process.is_some())
        .map(|(client, _)| client.clone())
        .collect();
    let killed_at = Instant::now();
    tokio::task::spawn_blocking(move || process.kill()).await?;
    let electing = tokio::spawn(elected_after(survivors, shard, leader, killed_at));
    let deadline = killed_at + SETTLE_TIMEOUT;
    loop {
        let acked = lock(appends)
            .iter()
            .filter_map(|append| append.acked.map(|(at, _)| (append, at)))
            .filter(|(append, at)| {
                *at > killed_at && levee_proto::shards::shard_of(&append.queue, shards) == shard
            })
            .map(|(_, at)| at)
            .min();
        if let Some(acked) = acked {
            let election = electing.await.context("watching the election")?;
            return Ok((index, acked - killed_at, election));
        }
        if Instant::now() >= deadline {
            let mut views = Vec::new();
            for (client, node) in clients.iter().zip(nodes.iter()) {
                if node.process.is_some()
                    && let Ok(cluster) = client.cluster().await
                    && let Some(placement) = cluster.shard_map.get(shard as usize)
                {
                    views.push(format!(
                        "node {} sees leader {} voters {:?}{}",
                        node.id,
                        placement.leader_id,
                        placement.voters,
                        if placement.changing {
                            " (changing)"
                        } else {
                            ""
                        }
                    ));
                }
            }
            let last = lock(appends)
                .last()
                .map(|append| format!("{} {:?} ago", append.queue, append.invoked.elapsed()));
            bail!(
                "no append to shard {shard} succeeded within {SETTLE_TIMEOUT:?} of killing its \
                 leader {leader} ({}; the last append recorded: {last:?})",
                views.join(", ")
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until every shard has `replicas` voters, a leader and no change under way, as every
/// node that is up sees it.
async fn wait_placed(
    clients: &[Client],
    alive: &[bool],
    (shards, replicas): (u32, usize),
) -> anyhow::Result<()> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    loop {
        let mut placed = true;
        for (client, _) in clients.iter().zip(alive).filter(|(_, alive)| **alive) {
            placed &= client
                .cluster()
                .await
                .is_ok_and(|cluster| shards_placed(&cluster, shards, replicas));
        }
        if placed {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("the shards were not placed within {SETTLE_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every message of `queue` on `client`'s node, from offset 0.
async fn read_all(client: &Client, queue: &str) -> anyhow::Result<Vec<Vec<u8>>> {
    let opened_by = Instant::now() + SETTLE_TIMEOUT;
    let mut messages = Vec::new();
    loop {
        let read = match client
            .read(queue.as_bytes(), messages.len() as u64, 10_000, 0)
            .await
        {
            Ok(read) => read,
            Err(error) if error.code() == Some(ErrorCode::NotFound) => return Ok(messages),
            // A node that restarted a moment ago is still opening its shards.
            Err(error)
                if error.code() == Some(ErrorCode::Unavailable) && Instant::now() < opened_by =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(error) => return Err(error.into()),
        };
        if read.payloads.is_empty() {
            return Ok(messages);
        }
        messages.extend(read.payloads.into_iter().map(|payload| payload.to_vec()));
    }
}

/// Once every node holds each queue alike, counts the acknowledged appends not at their
/// offset on some node, and the messages stored more than once.
async fn check(
    clients: &[Client],
    appends: &[Append],
    keys: u64,
) -> anyhow::Result<(usize, usize, BTreeMap<String, Vec<Vec<u8>>>)> {
    let mut stored: BTreeMap<String, Vec<Vec<Vec<u8>>>> = BTreeMap::new();
    for key in 0..keys {
        let queue = format!("failover-{key}");
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        let copies = loop {
            let mut copies = Vec::new();
            for client in clients {
                copies.push(read_all(client, &queue).await?);
            }
            if copies.iter().all(|copy| *copy == copies[0]) {
                break copies;
            }
            if Instant::now() >= deadline {
                bail!("the nodes' copies of {queue} still differ after {SETTLE_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        stored.insert(queue, copies);
    }
    let lost = appends
        .iter()
        .filter_map(|append| append.acked.map(|(_, offset)| (append, offset)))
        .filter(|(append, offset)| {
            stored[&append.queue].iter().any(|copy| {
                usize::try_from(*offset)
                    .ok()
                    .and_then(|offset| copy.get(offset))
                    != Some(&append.number.to_string().into_bytes())
            })
        })
        .count();
    let mut duplicates = 0;
    for copies in stored.values() {
        let mut seen = std::collections::HashSet::new();
        duplicates += copies[0]
            .iter()
            .filter(|message| !seen.insert(*message))
            .count();
    }
    let first_copies = stored
        .into_iter()
        .map(|(queue, mut copies)| (queue, copies.swap_remove(0)))
        .collect();
    Ok((lost, duplicates, first_copies))
}

/// What the consumer saw.
#[derive(Debug, Default)]
struct Consumed {
    delivered: u64,
    /// Streams opened again after the first.
    reopened: u64,
    /// Deliveries below the confirmed position of their queue.
    acked_redelivered: u64,
    /// Deliveries acked but not confirmed before the stream broke (delivered again, at least
    /// once: allowed).
    unconfirmed_redelivered: u64,
    /// Every delivery (queue, offset, payload), up to [`APPENDS_MAX`].
    seen: Vec<(String, u64, Vec<u8>)>,
}

/// The consumer of the queue shape: one many-queue stream over every queue, acking each batch
/// and confirming the acks before the next; opened again through the next node when it breaks.
async fn consume_continuously(
    clients: Vec<Client>,
    keys: u64,
    mut stop: watch::Receiver<bool>,
    consumed: Arc<Mutex<Consumed>>,
) {
    let queues: Vec<Vec<u8>> = (0..keys)
        .map(|key| format!("failover-{key}").into_bytes())
        .collect();
    let borrowed: Vec<&[u8]> = queues.iter().map(Vec::as_slice).collect();
    // Per mailbox: the position its confirmed acks reached, and what was acked since.
    let mut confirmed = vec![0_u64; queues.len()];
    let mut acked = vec![0_u64; queues.len()];
    for node in 0_usize.. {
        if *stop.borrow() {
            return;
        }
        let client = &clients[node % clients.len()];
        let opened = async {
            let mut stream = client.subscribe_many("failover-consumer", 1_000).await?;
            stream.add(&borrowed).await?;
            Ok::<_, levee_client::ClientError>(stream)
        };
        let Ok(mut stream) = opened.await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        if node > 0 {
            lock_consumed(&consumed).reopened += 1;
        }
        loop {
            let batch = tokio::select! {
                batch = stream.next_batch(256) => batch,
                _ = stop.changed() => return,
            };
            let Ok(batch) = batch else { break };
            if batch.is_empty() {
                break;
            }
            {
                let mut consumed = lock_consumed(&consumed);
                for delivery in &batch {
                    let mailbox = delivery.mailbox as usize;
                    consumed.delivered += 1;
                    if delivery.offset < confirmed[mailbox] {
                        consumed.acked_redelivered += 1;
                    } else if delivery.offset < acked[mailbox] {
                        consumed.unconfirmed_redelivered += 1;
                    }
                    if consumed.seen.len() < APPENDS_MAX {
                        let queue = format!("failover-{mailbox}");
                        consumed
                            .seen
                            .push((queue, delivery.offset, delivery.payload.to_vec()));
                    }
                    acked[mailbox] = acked[mailbox].max(delivery.offset + 1);
                    stream.ack(delivery.mailbox, delivery.offset);
                }
            }
            if stream.flush_acks().await.is_err() {
                break;
            }
            confirmed.clone_from(&acked);
        }
    }
}

fn lock_consumed(consumed: &Mutex<Consumed>) -> std::sync::MutexGuard<'_, Consumed> {
    consumed.lock().unwrap_or_else(PoisonError::into_inner)
}
