//! Replicated plain queues (docs/CLUSTER.md, "Part 2", step 2) with three `levee server`
//! processes over loopback: a cluster created with `--replicated-queues true` places every
//! shard on its three nodes; an append through any node is stored at the same offset on every
//! node; kill -9 the node that leads a shard while appends run through another node: after a
//! new leader is elected appends go on, and once the killed node is back every node holds
//! exactly the acknowledged messages, each once, at the offset it was acknowledged at, with
//! dense offsets. Kill -9 a follower under appends (none fails), restart it (it catches up),
//! then kill -9 every node at once and restart them all: every acknowledged append is there,
//! and offsets go on.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use levee_client::Client;
use levee_proto::v1::ErrorCode;
use support::{LeveeProcess, http_get, runtime, shard_groups, wait_for};

/// How long a cluster may take to form, place its shards, or elect a new leader.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(30);
/// Shards of the test's cluster.
const SHARDS: u32 = 4;

fn status(node: &LeveeProcess) -> serde_json::Value {
    let (code, body) = http_get(node.admin_addr, "/v1/cluster");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

fn three_nodes(directory: &std::path::Path) -> [Option<LeveeProcess>; 3] {
    support::three_replicated_nodes(directory, SHARDS)
}

fn wait_placed(nodes: &[&LeveeProcess], voters: &[u64]) -> BTreeMap<u64, u64> {
    support::wait_placed(nodes, voters, SHARDS)
}

fn wait_settled(nodes: &[&LeveeProcess]) -> BTreeMap<u64, u64> {
    support::wait_settled(nodes, SHARDS)
}

/// A queue named `{prefix}-{n}` in each shard, in shard order.
fn one_queue_per_shard(prefix: &str) -> Vec<Vec<u8>> {
    (0..SHARDS)
        .map(|shard| {
            (0..10_000)
                .map(|n| format!("{prefix}-{n}").into_bytes())
                .find(|queue| levee_proto::shards::shard_of_bytes(queue, SHARDS) == shard)
                .unwrap()
        })
        .collect()
}

/// Every message of `queue` on `node`, from offset 0 (the offsets must be dense).
async fn read_all(client: &Client, queue: &[u8]) -> Vec<Vec<u8>> {
    let mut messages = Vec::new();
    loop {
        let read = match client.read(queue, messages.len() as u64, 10_000, 0).await {
            Ok(read) => read,
            Err(error) if error.code() == Some(ErrorCode::NotFound) => return messages,
            // A node that restarted a moment ago is still opening its shards.
            Err(error) if error.code() == Some(ErrorCode::Unavailable) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(error) => panic!("reading {}: {error}", String::from_utf8_lossy(queue)),
        };
        if read.payloads.is_empty() {
            return messages;
        }
        assert_eq!(
            read.first_offset,
            messages.len() as u64,
            "offsets are dense"
        );
        messages.extend(read.payloads.into_iter().map(|payload| payload.to_vec()));
    }
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_a_replicated_cluster_when_a_shard_leader_is_killed_under_appends_then_nothing_acknowledged_is_lost_or_doubled()
 {
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let mut nodes = three_nodes(directory.path());
    let all: Vec<&LeveeProcess> = nodes.iter().flatten().collect();
    assert_eq!(status(all[1])["replicated_queues"], true);
    let leaders = wait_settled(&all);

    // Queues of every shard, appended through each node in turn.
    let queues: Vec<Vec<u8>> = (0..16)
        .map(|n| format!("orders-{n}").into_bytes())
        .collect();
    let clients: Vec<Client> = all
        .iter()
        .map(|node| runtime.block_on(Client::connect(&node.grpc())).unwrap())
        .collect();
    // What each append was acknowledged with: queue -> offset -> payload.
    let mut acknowledged: BTreeMap<Vec<u8>, BTreeMap<u64, Vec<u8>>> = BTreeMap::new();
    for (round, client) in clients.iter().enumerate() {
        let batch: Vec<(Vec<u8>, Vec<u8>)> = queues
            .iter()
            .map(|queue| (queue.clone(), format!("first-{round}").into_bytes()))
            .collect();
        let borrowed: Vec<(&[u8], &[u8])> = batch.iter().map(|(q, p)| (&q[..], &p[..])).collect();
        let offsets = runtime.block_on(client.append_batch(&borrowed)).unwrap();
        for ((queue, payload), offset) in batch.into_iter().zip(offsets) {
            assert_eq!(offset, round as u64, "appends of each round land in order");
            acknowledged
                .entry(queue)
                .or_default()
                .insert(offset, payload);
        }
    }
    // Read back through every node: the same messages at the same offsets (a node answers
    // a forwarded write once it applied it; the others may lag a heartbeat).
    for client in &clients {
        for queue in &queues {
            wait_for("the appends on every node", CONVERGE_TIMEOUT, || {
                runtime.block_on(read_all(client, queue)).len() == 3
            });
        }
    }

    // Kill the leader of shard 0 while a writer appends through another node.
    let victim = leaders[&0];
    let writer_index = usize::from(victim == 1);
    let writer = clients[writer_index].clone();
    let queues_for_writer = queues.clone();
    let appends = runtime.spawn(async move {
        let mut outcomes = Vec::new();
        let started = Instant::now();
        let mut sequence = 0_u64;
        while started.elapsed() < Duration::from_secs(6) {
            let queue = &queues_for_writer[(sequence % 16) as usize];
            let payload = format!("load-{sequence}").into_bytes();
            let answer = writer.append(queue, &payload).await;
            outcomes.push((
                queue.clone(),
                payload,
                answer.map_err(|error| error.to_string()),
            ));
            sequence += 1;
        }
        outcomes
    });
    // And an idempotent producer, through the same node, resending what fails.
    let producer = runtime
        .block_on(async {
            levee_client::Producer::new(
                clients[writer_index].clone(),
                levee_client::ProducerOptions {
                    idempotent: true,
                    retries_max: 50,
                    ..levee_client::ProducerOptions::default()
                },
            )
        })
        .unwrap();
    let idempotent = runtime.spawn(async move {
        let mut sends = Vec::new();
        let started = Instant::now();
        let mut sequence = 0_u64;
        while started.elapsed() < Duration::from_secs(6) {
            let queue = format!("events-{}", sequence % 8).into_bytes();
            let payload = format!("event-{sequence}").into_bytes();
            // Eight in flight at once, so resends overlap.
            let producer = producer.clone();
            sends.push(tokio::spawn(async move {
                let answer = producer.send(&queue, &payload).await;
                (queue, payload, answer.map_err(|error| error.to_string()))
            }));
            if sends.len() % 8 == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            sequence += 1;
        }
        let mut outcomes = Vec::new();
        for send in sends {
            outcomes.push(send.await.unwrap());
        }
        outcomes
    });
    std::thread::sleep(Duration::from_millis(1500));
    let killed = nodes[usize::try_from(victim).unwrap() - 1].take().unwrap();
    let killed_peer = killed.peer_addr.unwrap().to_string();
    killed.signal("KILL");
    drop(killed);
    let outcomes = runtime.block_on(appends).unwrap();
    let failed = outcomes.iter().filter(|outcome| outcome.2.is_err()).count();
    let succeeded_after_kill = outcomes
        .iter()
        .rev()
        .take_while(|outcome| outcome.2.is_ok())
        .count();
    let reasons: std::collections::BTreeSet<&str> = outcomes
        .iter()
        .filter_map(|outcome| outcome.2.as_ref().err().map(String::as_str))
        .collect();
    assert!(
        succeeded_after_kill > 10,
        "appends go on once a new leader is elected ({failed} failed of {}: {reasons:#?})",
        outcomes.len()
    );
    // The survivors found the leader's process gone (its peer port refused them) and called
    // the election at once, not after openraft's timeouts (docs/CLUSTER.md, "Failover").
    let survivors: Vec<&LeveeProcess> = nodes.iter().flatten().collect();
    let found_gone: f64 = survivors
        .iter()
        .map(|node| counted(node, "levee_shard_leaders_gone_total"))
        .sum();
    assert!(found_gone >= 1.0, "no survivor found the leader gone");
    // Failed appends: those said not stored must not be, those said maybe stored may be.
    let (mut not_stored, mut maybe_stored) = (Vec::new(), std::collections::BTreeSet::new());
    for (queue, payload, answer) in outcomes {
        match answer {
            Ok(offset) => {
                let previous = acknowledged
                    .entry(queue)
                    .or_default()
                    .insert(offset, payload);
                assert!(previous.is_none(), "an offset acknowledged twice");
            }
            Err(error) if error.contains("nothing was stored") => not_stored.push(payload),
            Err(error) if error.contains("may be stored") => {
                maybe_stored.insert(payload);
            }
            Err(error) => panic!("an append failed without saying whether it is stored: {error}"),
        }
    }

    // Every idempotent send was acknowledged (its resends rode out the failover).
    let mut events: BTreeMap<Vec<u8>, BTreeMap<u64, Vec<u8>>> = BTreeMap::new();
    for (queue, payload, answer) in runtime.block_on(idempotent).unwrap() {
        let offset = answer.unwrap_or_else(|error| panic!("an idempotent send failed: {error}"));
        let previous = events.entry(queue).or_default().insert(offset, payload);
        assert!(previous.is_none(), "an offset acknowledged twice");
    }

    // The killed node comes back from its data dir and catches up.
    let restarted = LeveeProcess::start_in(
        &directory.path().join(format!("n{victim}")),
        &[
            "--node-id",
            &victim.to_string(),
            "--peer-addr",
            &killed_peer,
        ],
    );
    nodes[usize::try_from(victim).unwrap() - 1] = Some(restarted);
    let all: Vec<&LeveeProcess> = nodes.iter().flatten().collect();
    wait_placed(&all, &[1, 2, 3]);
    let clients: Vec<Client> = all
        .iter()
        .map(|node| runtime.block_on(Client::connect(&node.grpc())).unwrap())
        .collect();
    for client in &clients {
        for queue in &queues {
            let expected = &acknowledged[queue];
            let highest = *expected.keys().next_back().unwrap();
            wait_for(
                "every acknowledged append on every node",
                CONVERGE_TIMEOUT,
                || runtime.block_on(read_all(client, queue)).len() as u64 > highest,
            );
            let stored = runtime.block_on(read_all(client, queue));
            for (offset, payload) in expected {
                assert_eq!(
                    &stored[usize::try_from(*offset).unwrap()],
                    payload,
                    "queue {} offset {offset}",
                    String::from_utf8_lossy(queue)
                );
            }
            // Nothing stored twice (the writer's payloads are unique), and nothing stored that
            // was not acknowledged unless its failure said it may be.
            let mut payloads_seen = std::collections::BTreeSet::new();
            for (offset, payload) in stored.iter().enumerate() {
                if payload.starts_with(b"load-") {
                    assert!(
                        payloads_seen.insert(payload.clone()),
                        "stored twice: {payload:?}"
                    );
                }
                assert!(
                    expected.contains_key(&(offset as u64)) || maybe_stored.contains(payload),
                    "{payload:?} stored at {offset}, never acknowledged nor said maybe stored"
                );
                assert!(!not_stored.contains(payload), "{payload:?} said not stored");
            }
        }
        // The idempotent producer's messages: exactly what was acknowledged, each once, at
        // its offset, and nothing else.
        assert_holds(&runtime, client, &events);
        for expected in events.values() {
            assert_eq!(
                expected.keys().copied().collect::<Vec<_>>(),
                (0..expected.len() as u64).collect::<Vec<_>>(),
                "dense offsets"
            );
        }
    }
}

/// Restarts node `id` from its data dir on its peer address `peer`.
/// The value of counter `name` on `node`'s `/metrics` (0 when absent).
fn counted(node: &LeveeProcess, name: &str) -> f64 {
    let (code, metrics) = http_get(node.admin_addr, "/metrics");
    assert_eq!(code, 200);
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{name} ")))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0.0)
}

fn restart(directory: &std::path::Path, id: u64, peer: &str) -> LeveeProcess {
    LeveeProcess::start_in(
        &directory.join(format!("n{id}")),
        &["--node-id", &id.to_string(), "--peer-addr", peer],
    )
}

/// Every queue of `acknowledged` on `client`'s node holds exactly its acknowledged messages at
/// their offsets (the writes never failed, so nothing else), once it caught up.
fn assert_holds(
    runtime: &tokio::runtime::Runtime,
    client: &Client,
    acknowledged: &BTreeMap<Vec<u8>, BTreeMap<u64, Vec<u8>>>,
) {
    for (queue, expected) in acknowledged {
        wait_for(
            "the acknowledged appends on the node",
            CONVERGE_TIMEOUT,
            || runtime.block_on(read_all(client, queue)).len() >= expected.len(),
        );
        let stored = runtime.block_on(read_all(client, queue));
        let expected: Vec<&Vec<u8>> = expected.values().collect();
        assert_eq!(
            stored.iter().collect::<Vec<_>>(),
            expected,
            "queue {}",
            String::from_utf8_lossy(queue)
        );
    }
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_a_replicated_cluster_when_a_follower_and_then_every_node_restart_then_appends_go_on_and_nothing_acknowledged_is_lost()
 {
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let mut nodes = three_nodes(directory.path());
    let peers: Vec<String> = nodes
        .iter()
        .map(|node| node.as_ref().unwrap().peer_addr.unwrap().to_string())
        .collect();
    let all: Vec<&LeveeProcess> = nodes.iter().flatten().collect();
    // Queues of one shard, appended through its leader while one of its followers dies: the
    // leader and the other follower are a majority, so no append may fail. The shard's
    // preferred replica claims its lead soon after the cluster forms; wait for that first, so
    // the lead stays put.
    let shard = 0;
    let leaders = wait_settled(&all);
    let queues: Vec<Vec<u8>> = (0..64)
        .map(|n| format!("ledger-{n}").into_bytes())
        .filter(|queue| levee_proto::shards::shard_of_bytes(queue, SHARDS) == shard)
        .take(4)
        .collect();
    assert_eq!(queues.len(), 4);
    let leader = leaders[&u64::from(shard)];
    let follower = if leader == 3 { 2 } else { 3 };
    let writer = runtime
        .block_on(Client::connect(
            &all[usize::try_from(leader).unwrap() - 1].grpc(),
        ))
        .unwrap();
    let writing = {
        let (writer, queues) = (writer.clone(), queues.clone());
        runtime.spawn(async move {
            let mut acknowledged: BTreeMap<Vec<u8>, BTreeMap<u64, Vec<u8>>> = BTreeMap::new();
            let started = Instant::now();
            let mut sequence = 0_u64;
            while started.elapsed() < Duration::from_secs(4) {
                let queue = &queues[(sequence % 4) as usize];
                let payload = format!("entry-{sequence}").into_bytes();
                let offset = writer
                    .append(queue, &payload)
                    .await
                    .unwrap_or_else(|error| panic!("an append failed with a majority up: {error}"));
                let previous = acknowledged
                    .entry(queue.clone())
                    .or_default()
                    .insert(offset, payload);
                assert!(previous.is_none(), "an offset acknowledged twice");
                sequence += 1;
            }
            acknowledged
        })
    };
    std::thread::sleep(Duration::from_secs(1));
    let killed = nodes[usize::try_from(follower).unwrap() - 1]
        .take()
        .unwrap();
    killed.signal("KILL");
    drop(killed);
    let mut acknowledged = runtime.block_on(writing).unwrap();
    for expected in acknowledged.values() {
        assert_eq!(
            expected.keys().copied().collect::<Vec<_>>(),
            (0..expected.len() as u64).collect::<Vec<_>>(),
            "dense offsets"
        );
    }

    // The follower comes back and catches up from the others.
    nodes[usize::try_from(follower).unwrap() - 1] = Some(restart(
        directory.path(),
        follower,
        &peers[usize::try_from(follower).unwrap() - 1],
    ));
    let restarted = runtime
        .block_on(Client::connect(
            &nodes[usize::try_from(follower).unwrap() - 1]
                .as_ref()
                .unwrap()
                .grpc(),
        ))
        .unwrap();
    assert_holds(&runtime, &restarted, &acknowledged);

    // The whole cluster dies at once (kill -9) and comes back from its disks: what was
    // acknowledged is there on every node, and appends go on after it.
    for node in &mut nodes {
        let node = node.take().unwrap();
        node.signal("KILL");
        drop(node);
    }
    for id in 1..=3_u64 {
        nodes[usize::try_from(id).unwrap() - 1] = Some(restart(
            directory.path(),
            id,
            &peers[usize::try_from(id).unwrap() - 1],
        ));
    }
    let all: Vec<&LeveeProcess> = nodes.iter().flatten().collect();
    wait_placed(&all, &[1, 2, 3]);
    let clients: Vec<Client> = all
        .iter()
        .map(|node| runtime.block_on(Client::connect(&node.grpc())).unwrap())
        .collect();
    for client in &clients {
        assert_holds(&runtime, client, &acknowledged);
    }
    for (queue, expected) in &mut acknowledged {
        let payload = b"after the restart".to_vec();
        let offset = runtime
            .block_on(clients[0].append(queue, &payload))
            .unwrap();
        assert_eq!(offset, expected.len() as u64, "offsets go on, never reused");
        expected.insert(offset, payload);
    }
    for client in &clients {
        assert_holds(&runtime, client, &acknowledged);
    }
}

#[test]
fn given_a_queue_deleted_while_its_following_streams_move_then_they_end_saying_so() {
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let mut nodes = three_nodes(directory.path());
    let all: Vec<&LeveeProcess> = nodes.iter().flatten().collect();
    wait_settled(&all);
    let clients: Vec<Client> = all
        .iter()
        .map(|node| runtime.block_on(Client::connect(&node.grpc())).unwrap())
        .collect();
    let (doomed, other) = (&b"vanishing"[..], &b"staying"[..]);
    runtime
        .block_on(clients[0].append(doomed, b"soon gone"))
        .unwrap();
    runtime.block_on(clients[0].append(other, b"here")).unwrap();
    // Through node 2: both kinds of following stream deliver from the queue.
    let (mut single, mut many) = runtime.block_on(async {
        let mut single = clients[1]
            .subscribe_following(doomed, "vanishing-reader", 10)
            .await
            .unwrap();
        let delivery = single.next().await.unwrap().unwrap();
        assert_eq!(&delivery.payload[..], b"soon gone");
        let mut many = clients[1]
            .subscribe_many_following("vanishing-many", 10)
            .await
            .unwrap();
        assert_eq!(many.add(&[doomed, other]).await.unwrap(), 0..2);
        let mut got = BTreeMap::new();
        while got.len() < 2 {
            let delivery = many.next().await.unwrap().unwrap();
            got.insert(delivery.mailbox, delivery.payload);
        }
        assert_eq!(&got[&0][..], b"soon gone");
        (single, many)
    });
    // Node 2 paused: the delete goes through nodes 1 and 3 (a majority of every shard) and
    // node 2's streams never hear of it; then node 2 dies and the streams move. Opened again
    // elsewhere they ask whether the queues they delivered from still exist, and end as a
    // server ends a stream whose queue it deletes (before, they waited on the deleted queue
    // as on one that does not exist).
    let paused = nodes[1].take().unwrap();
    paused.signal("STOP");
    let deleted = runtime.block_on(clients[0].delete_queue(doomed));
    paused.signal("KILL");
    drop(paused);
    assert!(deleted.unwrap());
    let ended = |error: levee_client::ClientError| {
        assert_eq!(error.code(), Some(ErrorCode::FailedPrecondition), "{error}");
        assert!(
            error
                .to_string()
                .contains("deleted while this stream moved"),
            "{error}"
        );
    };
    runtime.block_on(async {
        // What the new stream sent before it ended may come first (a node that had not
        // applied the delete yet may deliver the message again: at least once).
        let single_end = tokio::time::timeout(CONVERGE_TIMEOUT, async {
            loop {
                match single.next().await {
                    Ok(Some(delivery)) => assert_eq!(&delivery.payload[..], b"soon gone"),
                    Ok(None) => panic!("the single-queue stream ended cleanly"),
                    Err(error) => return error,
                }
            }
        })
        .await
        .expect("the single-queue stream ends");
        ended(single_end);
        let many_end = tokio::time::timeout(CONVERGE_TIMEOUT, async {
            loop {
                match many.next().await {
                    Ok(Some(_)) => {}
                    Ok(None) => panic!("the many-queue stream ended cleanly"),
                    Err(error) => return error,
                }
            }
        })
        .await
        .expect("the many-queue stream ends");
        ended(many_end);
    });
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_a_replicated_cluster_when_a_consumer_moves_to_another_node_then_it_resumes_where_it_acked()
{
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let mut nodes = three_nodes(directory.path());
    let all: Vec<&LeveeProcess> = nodes.iter().flatten().collect();
    wait_settled(&all);
    let clients: Vec<Client> = all
        .iter()
        .map(|node| runtime.block_on(Client::connect(&node.grpc())).unwrap())
        .collect();
    // Queues over every shard, ten messages each.
    let queues: Vec<Vec<u8>> = (0..8).map(|n| format!("inbox-{n}").into_bytes()).collect();
    for number in 0..10 {
        let payload = format!("m{number}").into_bytes();
        let batch: Vec<(&[u8], &[u8])> = queues
            .iter()
            .map(|queue| (&queue[..], &payload[..]))
            .collect();
        runtime.block_on(clients[0].append_batch(&batch)).unwrap();
    }
    let borrowed: Vec<&[u8]> = queues.iter().map(Vec::as_slice).collect();

    // Through node 2: a many-queue consumer acks offsets 0 to 5 of every queue, a single-queue
    // one offsets 0 to 3 of the first.
    runtime.block_on(async {
        let mut mailboxes = clients[1].subscribe_many("app", 1_000).await.unwrap();
        let added = mailboxes.add(&borrowed).await.unwrap();
        assert_eq!(added, 0..8);
        let mut delivered = 0;
        while delivered < 80 {
            let delivery = mailboxes.next().await.unwrap().unwrap();
            if delivery.offset == 5 {
                mailboxes.ack(delivery.mailbox, 5);
            }
            delivered += 1;
        }
        mailboxes.flush_acks().await.unwrap();
        let mut single = clients[1]
            .subscribe(&queues[0], "single", 100)
            .await
            .unwrap();
        assert_eq!(single.start_offset(), 0);
        for _ in 0..4 {
            single.next().await.unwrap().unwrap();
        }
        single.ack(3).await.unwrap();
    });
    // And a stream that follows the cluster by itself, acking offsets 0 to 4 of every queue.
    let mut following = runtime.block_on(async {
        let mut following = clients[1]
            .subscribe_many_following("follower", 1_000)
            .await
            .unwrap();
        assert_eq!(following.add(&borrowed).await.unwrap(), 0..8);
        for _ in 0..80 {
            let delivery = following.next().await.unwrap().unwrap();
            if delivery.offset == 4 {
                following.ack(delivery.mailbox, 4);
            }
        }
        following.flush_acks().await.unwrap();
        // Mailbox 7 removed: it stays removed after the stream moves.
        following.remove(&[7]).await.unwrap();
        following
    });
    // And a single-queue subscription that follows the cluster, acking offsets 0 to 5.
    let mut single_following = runtime.block_on(async {
        let mut single = clients[1]
            .subscribe_following(&queues[1], "single-follower", 100)
            .await
            .unwrap();
        for _ in 0..6 {
            single.next().await.unwrap().unwrap();
        }
        single.ack(5).await.unwrap();
        single
    });

    // Node 2 dies; on node 3 the consumers start after what they acked, nothing acked comes
    // again (node 3 may first wait out a failover of the shards node 2 led).
    let killed = nodes[1].take().unwrap();
    killed.signal("KILL");
    drop(killed);
    runtime.block_on(async {
        let started = Instant::now();
        let mut mailboxes = loop {
            let mut mailboxes = clients[2].subscribe_many("app", 1_000).await.unwrap();
            match mailboxes.add(&borrowed).await {
                Ok(added) => {
                    assert_eq!(added, 0..8);
                    break mailboxes;
                }
                Err(error) if started.elapsed() < CONVERGE_TIMEOUT => {
                    assert_eq!(error.code(), Some(ErrorCode::Unavailable), "{error}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(error) => panic!("the consumer could not move: {error}"),
            }
        };
        let mut next_by_mailbox = BTreeMap::new();
        for _ in 0..32 {
            let delivery = mailboxes.next().await.unwrap().unwrap();
            let expected = next_by_mailbox.entry(delivery.mailbox).or_insert(6_u64);
            assert_eq!(
                delivery.offset, *expected,
                "mailbox {} resumed after its ack",
                delivery.mailbox
            );
            *expected += 1;
        }
        assert_eq!(next_by_mailbox.len(), 8);
        let single = clients[2]
            .subscribe(&queues[0], "single", 100)
            .await
            .unwrap();
        assert_eq!(single.start_offset(), 4);
        // The following stream moved by itself and resumes after its acks.
        let mut next_by_mailbox = BTreeMap::new();
        for _ in 0..35 {
            let delivery = following.next().await.unwrap().unwrap();
            assert_ne!(delivery.mailbox, 7, "a removed mailbox delivers nothing");
            let expected = next_by_mailbox.entry(delivery.mailbox).or_insert(5_u64);
            assert_eq!(delivery.offset, *expected, "mailbox {}", delivery.mailbox);
            *expected += 1;
        }
        assert_eq!(next_by_mailbox.len(), 7);
        // Acks of messages taken before the move (offsets up to 9) stay within what the new
        // stream delivered: the stream goes on.
        for mailbox in 0..7 {
            following.ack(mailbox, 9);
        }
        following.flush_acks().await.unwrap();
        // The single one first hands out what it had received (offsets 6 to 9), then moves and
        // delivers again from its confirmed ack: 6 to 9 once more (taken, never acked).
        let mut offsets = Vec::new();
        for _ in 0..8 {
            offsets.push(single_following.next().await.unwrap().unwrap().offset);
        }
        assert_eq!(offsets, [6, 7, 8, 9, 6, 7, 8, 9]);
        assert_eq!(single_following.start_offset(), 6, "it moved");
    });
}

/// Waits until every shard is led and held by the replicas `levee_proto::shards::replicas`
/// names over `ids`, no change under way, as each of those replicas among `nodes` sees it.
/// A producer through `client` that resends failed batches (up to 100 times) and stores
/// nothing twice: it rides out leader moves.
fn idempotent_producer(
    runtime: &tokio::runtime::Runtime,
    client: &Client,
) -> levee_client::Producer {
    runtime
        .block_on(async {
            levee_client::Producer::new(
                client.clone(),
                levee_client::ProducerOptions {
                    idempotent: true,
                    retries_max: 100,
                    ..levee_client::ProducerOptions::default()
                },
            )
        })
        .unwrap()
}

/// Appends `round` to each of `queues` through `producer`, each append answered.
fn append_round(
    runtime: &tokio::runtime::Runtime,
    producer: &levee_client::Producer,
    queues: &[Vec<u8>],
    round: &str,
) {
    for queue in queues {
        runtime
            .block_on(producer.send(queue, round.as_bytes()))
            .unwrap_or_else(|error| panic!("an append ({round}): {error}"));
    }
}

fn wait_replicas(nodes: &[(u64, &LeveeProcess)], ids: &[u64]) {
    let deadline = Instant::now() + CONVERGE_TIMEOUT;
    loop {
        let views: BTreeMap<u64, _> = nodes
            .iter()
            .map(|(id, node)| (*id, shard_groups(node)))
            .collect();
        let placed = (0..SHARDS).all(|shard| {
            let mut expected = levee_proto::shards::replicas(shard, ids);
            expected.sort_unstable();
            expected.iter().all(|id| {
                views.get(id).is_none_or(|view| {
                    view.get(&u64::from(shard))
                        .is_some_and(|(leader, voters)| leader.is_some() && *voters == expected)
                })
            })
        });
        if placed {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the shards' replicas are not where the placement over {ids:?} names them: {views:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_a_replicated_cluster_when_a_node_is_removed_and_another_joins_then_the_replicas_move_and_appends_go_on()
 {
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    // Snapshot marks every 20 entries, so the logs are purged before node 4 joins.
    let start = |id: &str, join: Option<&str>| {
        support::start_replicated_with(
            directory.path(),
            id,
            ("127.0.0.1:0", join),
            SHARDS,
            &["--shard-snapshot-entries", "20"],
        )
    };
    let first = start("1", None);
    let seed = first.peer_addr.unwrap().to_string();
    let mut third = start("3", Some(&seed));
    let second = start("2", Some(&seed));
    wait_placed(&[&first, &second, &third], &[1, 2, 3]);
    let client = runtime.block_on(Client::connect(&first.grpc())).unwrap();

    // An idempotent producer appends through node 1 the whole time.
    let producer = idempotent_producer(&runtime, &client);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let appending = runtime.spawn({
        let producer = producer.clone();
        async move {
            let mut acknowledged: BTreeMap<Vec<u8>, BTreeMap<u64, Vec<u8>>> = BTreeMap::new();
            let mut sequence = 0_u64;
            while !*stopped.borrow() {
                let queue = format!("moving-{}", sequence % 8).into_bytes();
                let payload = format!("m{sequence}").into_bytes();
                let offset = producer
                    .send(&queue, &payload)
                    .await
                    .unwrap_or_else(|error| {
                        panic!("an append failed while replicas moved: {error}")
                    });
                let previous = acknowledged
                    .entry(queue)
                    .or_default()
                    .insert(offset, payload);
                assert!(previous.is_none(), "an offset acknowledged twice");
                sequence += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            acknowledged
        }
    });

    // Node 3 is removed: its replicas leave every shard, which goes on with nodes 1 and 2.
    runtime.block_on(client.remove_node(3)).unwrap();
    let exit = third.wait_exit(CONVERGE_TIMEOUT);
    assert!(!exit.success(), "a removed node stops with an error");
    assert!(third.logged("was removed from cluster"));
    wait_replicas(&[(1, &first), (2, &second)], &[1, 2]);

    // More entries than a log keeps past a mark go to every shard, so every shard's log is
    // purged past its start.
    let fillers: Vec<Vec<u8>> = one_queue_per_shard("filler");
    let mut filled = BTreeMap::new();
    for round in 0..1_100 {
        let payload = format!("f{round}").into_bytes();
        // Through the idempotent producer, every shard at once: leads may still move after
        // the removal, and a resend must not store a filler twice (offsets are checked).
        runtime.block_on(async {
            let mut sends = tokio::task::JoinSet::new();
            for queue in &fillers {
                let (producer, queue, payload) = (producer.clone(), queue.clone(), payload.clone());
                sends.spawn(async move { producer.send(&queue, &payload).await });
            }
            while let Some(sent) = sends.join_next().await {
                sent.unwrap()
                    .unwrap_or_else(|error| panic!("a filler append in round {round}: {error}"));
            }
        });
        for queue in &fillers {
            let messages: &mut BTreeMap<u64, Vec<u8>> = filled.entry(queue.clone()).or_default();
            messages.insert(round, payload.clone());
        }
    }
    // On both replicas: each node purges its own log, and a shard's leader may be either.
    wait_for("every shard's log purged", CONVERGE_TIMEOUT, || {
        [&first, &second].iter().all(|node| {
            let groups = status(node)["shard_groups"].clone();
            groups.as_array().is_some_and(|groups| {
                groups.len() == SHARDS as usize
                    && groups
                        .iter()
                        .all(|group| group["purged_index"].as_u64().is_some())
            })
        })
    });

    // Node 4 joins (a voter: the cluster has two): it takes a replica of every shard, each
    // from a snapshot, then the log.
    let fourth = start("4", Some(&seed));
    wait_replicas(&[(1, &first), (2, &second), (4, &fourth)], &[1, 2, 4]);
    let installed: Vec<u64> = status(&fourth)["shard_groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|group| group["snapshots_installed"].as_u64().unwrap())
        .collect();
    assert_eq!(installed.len(), SHARDS as usize);
    assert!(
        installed.iter().all(|count| *count >= 1),
        "every replica on node 4 began with a snapshot: {installed:?}"
    );
    let fourth_client = runtime.block_on(Client::connect(&fourth.grpc())).unwrap();
    assert_holds(&runtime, &fourth_client, &filled);

    // Node 5 joins as a learner (three voters already): it holds no replica, and forwards
    // reads to a replica rather than answer from its empty store.
    let fifth = start("5", Some(&seed));
    let fifth_client = runtime.block_on(Client::connect(&fifth.grpc())).unwrap();
    assert_forwards(&runtime, &client, &fifth_client);
    // A many-queue stream over a queue of every shard, through node 5 (which holds none):
    // served in parts by the replicas; its acks hold when the consumer moves to node 1.
    runtime.block_on(assert_many_in_parts(
        &fifth_client,
        "spread-1",
        &fillers,
        &filled,
        0,
    ));
    runtime.block_on(assert_many_in_parts(
        &client, "spread-1", &fillers, &filled, 5,
    ));

    // Node 5 made a voter: it takes a replica of the shards that name it, in place of one of
    // the others (three replicas each), and a stream through it is served in parts, here and
    // by the other replicas.
    let voters = [1, 2, 4, 5];
    let named: Vec<u32> = (0..SHARDS)
        .filter(|shard| levee_proto::shards::replicas(*shard, &voters).contains(&5))
        .collect();
    assert!(
        !named.is_empty() && named.len() < SHARDS as usize,
        "the test needs node 5 to hold some shards only: {named:?}"
    );
    // A consumer follows a queue of a shard through the node that will leave that shard (with
    // credit for every message it will read: it does not ack).
    let second_client = runtime.block_on(Client::connect(&second.grpc())).unwrap();
    let (leaving, moved) = [(1, &client), (2, &second_client), (4, &fourth_client)]
        .into_iter()
        .find_map(|(node, node_client)| {
            let shard = named
                .iter()
                .find(|shard| !levee_proto::shards::replicas(**shard, &voters).contains(&node))?;
            Some((node_client.clone(), *shard))
        })
        .expect("node 5 takes some other node's place");
    let moved_queue = fillers[moved as usize].clone();
    let mut following = runtime
        .block_on(leaving.subscribe_following(&moved_queue, "follows-the-move", 2_000))
        .unwrap();
    let followed = runtime.block_on(following.next()).unwrap().unwrap();
    assert_eq!(followed.offset, 0);
    runtime
        .block_on(support::make_voter(&client, 5, &fifth))
        .unwrap();
    wait_replicas(
        &[(1, &first), (2, &second), (4, &fourth), (5, &fifth)],
        &voters,
    );
    // Once the node that left the shard is no longer fed its log (no learner left), an
    // append reaches the consumer only if that node ended the stream and it opened again where
    // the shard is.
    let leads_without_learners = |node: &LeveeProcess| {
        let (_, body) = http_get(node.admin_addr, "/v1/cluster");
        let view: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        view["shard_groups"].as_array().is_some_and(|groups| {
            groups.iter().any(|group| {
                group["shard"] == moved
                    && group["role"] == "leader"
                    && group["learners"].as_array().is_some_and(Vec::is_empty)
            })
        })
    };
    wait_for(
        "the shard's former replica removed",
        CONVERGE_TIMEOUT,
        || {
            [&first, &second, &fourth, &fifth]
                .into_iter()
                .any(leads_without_learners)
        },
    );
    let after = runtime
        .block_on(client.append(&moved_queue, b"after-the-move"))
        .unwrap();
    runtime.block_on(async {
        loop {
            let delivery = tokio::time::timeout(CONVERGE_TIMEOUT, following.next())
                .await
                .expect("the followed queue's messages after the move")
                .unwrap()
                .unwrap();
            if delivery.offset == after {
                assert_eq!(&delivery.payload[..], b"after-the-move");
                break;
            }
        }
    });
    // Every node lists every queue, in pages, whatever shards it holds: a queue created
    // after the move in a shard one node left is listed through that node too.
    let created_after = (0..10_000)
        .map(|n| format!("after-move-{n}").into_bytes())
        .find(|queue| levee_proto::shards::shard_of_bytes(queue, SHARDS) == moved)
        .unwrap();
    runtime
        .block_on(client.append(&created_after, b"x"))
        .unwrap();
    let listed: Vec<Vec<Vec<u8>>> = [&client, &second_client, &fourth_client, &fifth_client]
        .into_iter()
        .map(|node_client| runtime.block_on(list_all(node_client)))
        .collect();
    for (queue, what) in [
        (&created_after, "a queue made after the move"),
        (&moved_queue, "a queue that moved"),
    ] {
        assert!(listed[0].contains(queue), "{what} is listed");
    }
    assert!(fillers.iter().all(|filler| listed[0].contains(filler)));
    for other in &listed[1..] {
        assert_eq!(other, &listed[0], "every node lists the same queues");
    }
    runtime.block_on(assert_many_in_parts(
        &fifth_client,
        "spread-2",
        &fillers,
        &filled,
        0,
    ));
    runtime.block_on(assert_many_in_parts(
        &client, "spread-2", &fillers, &filled, 5,
    ));
    assert!(
        support::metric_value(&fifth, "levee_queue_mailbox_parts_elsewhere_total") >= 2,
        "node 5 opened parts on other nodes"
    );
    // Its checks are a single node's: an ack past what was delivered ends the stream with
    // OFFSET_OUT_OF_RANGE.
    runtime.block_on(async {
        let mut many = fifth_client.subscribe_many("spread-3", 1).await.unwrap();
        let queues: Vec<&[u8]> = fillers.iter().map(Vec::as_slice).collect();
        many.add(&queues).await.unwrap();
        let taken = many.next().await.unwrap().unwrap();
        many.ack(taken.mailbox, taken.offset + 1_000);
        let refused = many
            .flush_acks()
            .await
            .expect_err("an ack past the delivered");
        assert_eq!(
            refused.code(),
            Some(ErrorCode::OffsetOutOfRange),
            "{refused}"
        );
    });

    let _ = stop.send(true);
    let acknowledged = runtime.block_on(appending).unwrap();
    assert!(acknowledged.values().map(BTreeMap::len).sum::<usize>() > 50);
    for node in [&first, &second, &fourth] {
        let client = runtime.block_on(Client::connect(&node.grpc())).unwrap();
        assert_holds(&runtime, &client, &acknowledged);
    }

    // The preferred replica of a shard node 5 does not hold is killed: node 5 forwards its
    // reads to another replica, one whose API answers its probes.
    let shard = (0..SHARDS).find(|shard| !named.contains(shard)).unwrap();
    let preferred = levee_proto::shards::replicas(shard, &voters)[0];
    let mut nodes = [(1, Some(first)), (2, Some(second)), (4, Some(fourth))];
    let killed = nodes
        .iter_mut()
        .find(|(id, _)| *id == preferred)
        .and_then(|(_, node)| node.take());
    drop(killed);
    let queue = &fillers[shard as usize];
    wait_for(
        "a read of the killed node's shard through node 5",
        CONVERGE_TIMEOUT,
        || {
            runtime
                .block_on(fifth_client.read(queue, 0, 10, 0))
                .is_ok_and(|read| read.payloads.len() == 10)
        },
    );
}

#[test]
fn given_three_replicated_nodes_when_two_are_removed_one_after_the_other_then_the_last_holds_every_shard_and_appends_go_on()
 {
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let [first, second, third] = three_nodes(directory.path());
    let (first, mut second, mut third) = (first.unwrap(), second.unwrap(), third.unwrap());
    wait_settled(&[&first, &second, &third]);
    let client = runtime.block_on(Client::connect(&first.grpc())).unwrap();
    // Leads move as nodes leave: an idempotent producer rides that out, storing nothing twice.
    let producer = idempotent_producer(&runtime, &client);
    let queues: Vec<Vec<u8>> = (0..8)
        .map(|n| format!("shrinking-{n}").into_bytes())
        .collect();
    let append_all = |round: &str| append_round(&runtime, &producer, &queues, round);
    append_all("three nodes");

    runtime.block_on(client.remove_node(3)).unwrap();
    assert!(!third.wait_exit(CONVERGE_TIMEOUT).success());
    // Settled: each shard led by its preferred replica, node 2 leading some.
    support::wait_placed_over(&[(1, &first), (2, &second)], &[1, 2], SHARDS);
    assert!(
        (0..SHARDS).any(|shard| levee_proto::shards::replicas(shard, &[1, 2])[0] == 2),
        "the test needs node 2 to lead a shard when it is removed"
    );
    append_all("two nodes");

    // Each shard's replicas are nodes 1 and 2 now: moving them to node 1 alone needs node 2's
    // vote, which it gives before it stops, and node 2 hands over the shards it leads (its
    // view of the cluster, which it left, no longer lets it place them).
    runtime.block_on(client.remove_node(2)).unwrap();
    assert!(!second.wait_exit(CONVERGE_TIMEOUT).success());
    assert!(second.logged("waiting for the shards' replicas here to move to the others"));
    wait_replicas(&[(1, &first)], &[1]);
    append_all("one node");
    for queue in &queues {
        let read = runtime.block_on(read_all(&client, queue));
        assert_eq!(
            read,
            [&b"three nodes"[..], b"two nodes", b"one node"],
            "{}",
            String::from_utf8_lossy(queue)
        );
    }
}

#[test]
fn given_four_voters_when_a_shards_three_replicas_are_removed_back_to_back_then_the_fourth_takes_the_shard_with_its_messages()
 {
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let [first, second, third] = three_nodes(directory.path());
    let (mut first, mut second, mut third) = (first.unwrap(), second.unwrap(), third.unwrap());
    wait_settled(&[&first, &second, &third]);
    let seed = first.peer_addr.unwrap().to_string();
    let fourth =
        support::start_replicated(directory.path(), "4", ("127.0.0.1:0", Some(&seed)), SHARDS);
    let client = runtime.block_on(Client::connect(&fourth.grpc())).unwrap();
    runtime
        .block_on(support::make_voter(&client, 4, &fourth))
        .unwrap();
    support::wait_placed_over(
        &[(1, &first), (2, &second), (3, &third), (4, &fourth)],
        &[1, 2, 3, 4],
        SHARDS,
    );
    assert!(
        (0..SHARDS).any(|shard| !levee_proto::shards::replicas(shard, &[1, 2, 3, 4]).contains(&4)),
        "the test needs a shard whose replicas are nodes 1 to 3"
    );
    let queues: Vec<Vec<u8>> = one_queue_per_shard("leaving");
    let producer = idempotent_producer(&runtime, &client);
    let append_all = |round: &str| append_round(&runtime, &producer, &queues, round);
    append_all("before");
    // Some megabytes in each shard, so that a new replica takes a while to catch up.
    let filler = vec![b'f'; 4_096];
    for queue in &queues {
        let batch: Vec<(&[u8], &[u8])> = (0..250).map(|_| (&queue[..], &filler[..])).collect();
        for _ in 0..4 {
            runtime.block_on(client.append_batch(&batch)).unwrap();
        }
    }

    // Nodes 1 to 3 removed at once, each retried while another change is under way, faster
    // than the placement moves anything: the shards on them alone must reach node 4 before
    // the last of them stops.
    let remove = |node_id: u64| {
        let client = client.clone();
        async move {
            let deadline = Instant::now() + CONVERGE_TIMEOUT;
            loop {
                match client.remove_node(node_id).await {
                    Ok(()) => return,
                    // A try whose answer was lost (the leader that removed it was itself
                    // removed as it answered, and the server's forwarding tried again, or this
                    // loop did) already removed it: the node stops all the same (checked below).
                    Err(error) if error.code() == Some(ErrorCode::NotFound) => return,
                    // The metadata group's lead moves as its leader leaves, and it makes one
                    // change at a time.
                    Err(error)
                        if matches!(
                            error.code(),
                            Some(ErrorCode::Unavailable | ErrorCode::FailedPrecondition)
                        ) && Instant::now() < deadline =>
                    {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Err(error) => panic!("removing node {node_id}: {error}"),
                }
            }
        }
    };
    runtime.block_on(async { tokio::join!(remove(1), remove(2), remove(3)) });
    for node in [&mut first, &mut second, &mut third] {
        assert!(!node.wait_exit(CONVERGE_TIMEOUT).success());
    }
    wait_replicas(&[(4, &fourth)], &[4]);
    append_all("after");
    for queue in &queues {
        let read = runtime.block_on(read_all(&client, queue));
        assert_eq!(
            read,
            [&b"before"[..]]
                .into_iter()
                .chain(std::iter::repeat_n(&filler[..], 1_000))
                .chain([&b"after"[..]])
                .collect::<Vec<_>>(),
            "{}",
            String::from_utf8_lossy(queue)
        );
    }
}

/// Consumer `consumer` reads `queues` (each `expected` to hold at least `from + 5` messages)
/// over one many-queue stream through `through`, with a credit smaller than the queues hold:
/// each mailbox's messages arrive from offset `from` (its consumer's last ack) in order, under
/// the number its add gave; it acks the first five of each and the acks are confirmed.
async fn assert_many_in_parts(
    through: &Client,
    consumer: &str,
    queues: &[Vec<u8>],
    expected: &BTreeMap<Vec<u8>, BTreeMap<u64, Vec<u8>>>,
    from: u64,
) {
    const TAKEN: u64 = 5;
    let mut many = through.subscribe_many(consumer, 7).await.unwrap();
    let names: Vec<&[u8]> = queues.iter().map(Vec::as_slice).collect();
    let count = u32::try_from(names.len()).unwrap();
    assert_eq!(many.add(&names).await.unwrap(), 0..count);
    let mut next: Vec<u64> = vec![from; names.len()];
    while next.iter().any(|offset| *offset < from + TAKEN) {
        let delivery = tokio::time::timeout(CONVERGE_TIMEOUT, many.next())
            .await
            .expect("deliveries of every mailbox")
            .unwrap()
            .unwrap();
        let mailbox = delivery.mailbox as usize;
        assert_eq!(delivery.offset, next[mailbox], "mailbox {mailbox} in order");
        let queue = &queues[mailbox];
        assert_eq!(
            Some(&delivery.payload[..]),
            expected[queue].get(&delivery.offset).map(Vec::as_slice),
            "mailbox {mailbox} is queue {}",
            String::from_utf8_lossy(queue)
        );
        next[mailbox] += 1;
    }
    for mailbox in 0..count {
        many.ack(mailbox, from + TAKEN - 1);
    }
    many.flush_acks().await.unwrap();
}

/// Every queue name `client`'s node lists, three to a page.
async fn list_all(client: &Client) -> Vec<Vec<u8>> {
    let mut all = Vec::new();
    let mut token = Vec::new();
    loop {
        let page = client.list_queue_page(b"", &token, 3).await.unwrap();
        all.extend(page.queues);
        if page.next_page_token.is_empty() {
            return all;
        }
        token = page.next_page_token;
    }
}

/// A node that holds no replica (`through`) forwards reads, queue info, a subscription, a
/// group member's stream and a topic's description to a replica: the same answers as `replica`
/// gives.
fn assert_forwards(runtime: &tokio::runtime::Runtime, replica: &Client, through: &Client) {
    let (client, fifth_client) = (replica, through);
    let mut forwarded = None;
    wait_for("node 5 forwarding a read", CONVERGE_TIMEOUT, || {
        forwarded = runtime
            .block_on(fifth_client.read(b"moving-0", 0, 10, 0))
            .ok();
        forwarded.is_some()
    });
    let direct = runtime
        .block_on(client.read(b"moving-0", 0, 10, 0))
        .unwrap();
    // Appends go on meanwhile, and either node may be a moment ahead: the common prefix.
    let forwarded = forwarded.unwrap().payloads;
    let common = forwarded.len().min(direct.payloads.len());
    assert!(common > 0);
    assert_eq!(forwarded[..common], direct.payloads[..common]);
    assert!(
        runtime
            .block_on(fifth_client.queue_info(b"moving-0"))
            .unwrap()
            .next_offset
            >= direct.payloads.len() as u64
    );
    let missing = runtime
        .block_on(fifth_client.queue_info(b"never-appended"))
        .expect_err("the replica's answer, forwarded");
    assert_eq!(missing.code(), Some(ErrorCode::NotFound), "{missing}");
    // Appends through it, forwarded, are stored on the replicas at the offsets answered.
    let batch: Vec<(&[u8], &[u8])> = (0..4)
        .map(|n| (&b"via-learner"[..], [&b"a"[..], b"b", b"c", b"d"][n]))
        .collect();
    let offsets = runtime.block_on(fifth_client.append_batch(&batch)).unwrap();
    assert_eq!(offsets, [0, 1, 2, 3]);
    // Node 1 (not the replica that answered, perhaps) applies them a moment later.
    let mut stored = Vec::new();
    wait_for("the forwarded appends on node 1", CONVERGE_TIMEOUT, || {
        stored = runtime
            .block_on(client.read(b"via-learner", 0, 10, 0))
            .map(|read| read.payloads)
            .unwrap_or_default();
        stored.len() == 4
    });
    assert_eq!(&stored[3][..], b"d");
    // A subscription through it goes on through the replica.
    runtime.block_on(async {
        let mut subscription = fifth_client
            .subscribe(b"moving-0", "via-learner", 10)
            .await
            .unwrap();
        assert_eq!(subscription.start_offset(), 0);
        for expected in direct.payloads.iter().take(3) {
            let delivery = subscription.next().await.unwrap().unwrap();
            assert_eq!(&delivery.payload, expected);
        }
        subscription.ack(2).await.unwrap();
        // And a many-queue stream (node 5 holds no shard at all: it goes to a voter).
        let mut many = fifth_client
            .subscribe_many("many-via-learner", 10)
            .await
            .unwrap();
        assert_eq!(many.add(&[&b"moving-0"[..]]).await.unwrap(), 0..1);
        let first = many.next().await.unwrap().unwrap();
        assert_eq!((first.offset, &first.payload), (0, &direct.payloads[0]));
        many.ack(0, 0);
        many.flush_acks().await.unwrap();
        // So do a group member's stream and a topic's description.
        client.create_topic("audit", 2).await.unwrap();
        let keys: Vec<(Vec<u8>, Vec<u8>)> = (0..10)
            .map(|n| (format!("k{n}").into_bytes(), format!("e{n}").into_bytes()))
            .collect();
        let borrowed: Vec<(&[u8], &[u8])> = keys
            .iter()
            .map(|(key, payload)| (&key[..], &payload[..]))
            .collect();
        // Published through node 5 (forwarded to a replica).
        fifth_client.publish("audit", &borrowed).await.unwrap();
        let handled = Handled::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let member = spawn_member(fifth_client, "audit", &handled, stopped);
        wait_handled(
            &handled,
            keys.len(),
            "the member through node 5 handles them",
        )
        .await;
        let _ = stop.send(());
        member.await.unwrap().unwrap();
        let described = fifth_client.describe_topic("audit").await.unwrap();
        let published: u64 = described.partitions.iter().map(|p| p.next_offset).sum();
        assert_eq!(published, keys.len() as u64);
    });
}

/// Nodes 1, 2 and 3 of a new cluster, settled ([`wait_settled`]): the nodes, each shard's
/// leader, and a client of each node.
fn settled_three(
    runtime: &tokio::runtime::Runtime,
    directory: &std::path::Path,
) -> ([Option<LeveeProcess>; 3], BTreeMap<u64, u64>, Vec<Client>) {
    let nodes = three_nodes(directory);
    let all: Vec<&LeveeProcess> = nodes.iter().flatten().collect();
    let leaders = wait_settled(&all);
    let clients = all
        .iter()
        .map(|node| runtime.block_on(Client::connect(&node.grpc())).unwrap())
        .collect();
    (nodes, leaders, clients)
}

/// Whether `client`'s node has no queue `queue` (deleted there), else its next offset.
async fn next_offset_on(client: &Client, queue: &[u8]) -> Option<u64> {
    match client.queue_info(queue).await {
        Ok(info) => Some(info.next_offset),
        Err(error) if error.code() == Some(ErrorCode::NotFound) => None,
        Err(error) => panic!("queue info: {error}"),
    }
}

#[test]
fn given_a_replicated_cluster_when_a_queue_is_deleted_through_any_node_then_every_node_deletes_it_and_forgets_its_positions()
 {
    let runtime = runtime();
    let directory = tempfile::tempdir().unwrap();
    let (mut nodes, _, clients) = settled_three(&runtime, directory.path());
    let queue: &[u8] = b"orders-to-delete";
    runtime.block_on(async {
        for payload in [&b"a0"[..], b"a1", b"a2"] {
            clients[0].append(queue, payload).await.unwrap();
        }
        // A consumer acks offsets 0 and 1 through node 2 (its position replicated).
        let mut single = clients[1].subscribe(queue, "app", 10).await.unwrap();
        for _ in 0..2 {
            single.next().await.unwrap().unwrap();
        }
        single.ack(1).await.unwrap();
        drop(single);
        // Another consumer reads the queue on a many-queue stream through node 3.
        let mut mailboxes = clients[2].subscribe_many("reader", 10).await.unwrap();
        mailboxes.add(&[queue]).await.unwrap();
        mailboxes.next().await.unwrap().unwrap();
        // A subscription on the node taking the delete refuses it there, as on a lone server.
        let held = clients[0].subscribe(queue, "holder", 10).await.unwrap();
        let refused = clients[0]
            .delete_queue(queue)
            .await
            .expect_err("held on this node");
        assert_eq!(
            refused.code(),
            Some(ErrorCode::FailedPrecondition),
            "{refused}"
        );
        drop(held);
        // Deleted through node 1 (the subscription there closes first).
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        let existed = loop {
            match clients[0].delete_queue(queue).await {
                Ok(existed) => break existed,
                Err(error)
                    if error.code() == Some(ErrorCode::FailedPrecondition)
                        && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(error) => panic!("delete: {error}"),
            }
        };
        assert!(existed);
        // The stream on node 3 ends, naming the queue.
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match mailboxes.next().await {
                    Ok(Some(_)) => {}
                    Ok(None) => panic!("the stream ended without saying why"),
                    Err(error) => return error,
                }
            }
        })
        .await
        .expect("the stream of a deleted queue ends");
        assert_eq!(ended.code(), Some(ErrorCode::FailedPrecondition), "{ended}");
        assert!(ended.to_string().contains("was deleted"), "{ended}");
        // Gone on every node.
        for client in &clients {
            let deadline = Instant::now() + CONVERGE_TIMEOUT;
            while next_offset_on(client, queue).await.is_some() {
                assert!(Instant::now() < deadline, "the queue is gone on every node");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        assert!(
            !clients[1].delete_queue(queue).await.unwrap(),
            "deleted already"
        );
        // Created again: offsets start at 0, and the consumer's position was forgotten on
        // every node.
        assert_eq!(clients[1].append(queue, b"b0").await.unwrap(), 0);
        for client in &clients {
            let mut again = client.subscribe(queue, "app", 10).await.unwrap();
            assert_eq!(again.start_offset(), 0);
            let first = again.next().await.unwrap().unwrap();
            assert_eq!((first.offset, &first.payload[..]), (0, &b"b0"[..]));
        }
    });
    drop(nodes.iter_mut().map(Option::take).collect::<Vec<_>>());
}

/// Publishes `keys` (payload = key) to `topic` through `client` as idempotent producer `id`,
/// numbering each partition's messages from `sequences`; resends while the topic's shard
/// moves (the shard judges resends, so nothing is stored twice). Each message's partition
/// and offset.
async fn publish_idempotent(
    client: &Client,
    topic: &str,
    keys: &[String],
    (id, sequences): (&str, &mut BTreeMap<u32, u64>),
) -> Vec<(u32, u64)> {
    let messages: Vec<levee_proto::v1::PublishMessage> = keys
        .iter()
        .map(|key| {
            let partition = levee_proto::topic_partition(key.as_bytes(), 4);
            let sequence = sequences.entry(partition).or_default();
            *sequence += 1;
            levee_proto::v1::PublishMessage {
                key: key.clone().into_bytes().into(),
                payload: key.clone().into_bytes().into(),
                sequence: *sequence - 1,
                ..Default::default()
            }
        })
        .collect();
    let request = levee_proto::v1::PublishRequest {
        topic: topic.to_owned(),
        messages,
        producer_id: id.to_owned(),
        ..Default::default()
    };
    let started = Instant::now();
    loop {
        match client.publish_request(request.clone()).await {
            Ok(stored) => return stored,
            Err(error)
                if error.code() == Some(ErrorCode::Unavailable)
                    && started.elapsed() < CONVERGE_TIMEOUT =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(error) => panic!("publish: {error}"),
        }
    }
}

/// What a group's members handled: each partition's (offset, payload)s.
type Handled = std::sync::Arc<std::sync::Mutex<BTreeMap<u32, Vec<(u64, Vec<u8>)>>>>;

/// Waits until the members recording in `handled` handled `count` messages (`what` names
/// the wait if it times out).
async fn wait_handled(handled: &Handled, count: usize, what: &str) {
    let deadline = Instant::now() + CONVERGE_TIMEOUT;
    while handled
        .lock()
        .unwrap()
        .values()
        .map(Vec::len)
        .sum::<usize>()
        < count
    {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the members recording in `handled` handled every message at `places`
/// (partition, offset), some perhaps more than once (`what` names the wait if it times out).
async fn wait_seen(handled: &Handled, places: &[(u32, u64)], what: &str) {
    let deadline = Instant::now() + CONVERGE_TIMEOUT;
    loop {
        let seen: std::collections::BTreeSet<(u32, u64)> = handled
            .lock()
            .unwrap()
            .iter()
            .flat_map(|(partition, messages)| {
                messages
                    .iter()
                    .map(move |(offset, _)| (*partition, *offset))
            })
            .collect();
        if places.iter().all(|place| seen.contains(place)) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A member of group "billing" on `topic` through `client`, recording what it handles in
/// `handled`, until `stopped`.
fn spawn_member(
    client: &Client,
    topic: &str,
    handled: &Handled,
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<Result<levee_client::ConsumerStats, levee_client::ClientError>> {
    spawn_member_with(client, topic, (handled, false), stopped)
}

/// [`spawn_member`], following the cluster when `following`.
fn spawn_member_with(
    client: &Client,
    topic: &str,
    (handled, following): (&Handled, bool),
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<Result<levee_client::ConsumerStats, levee_client::ClientError>> {
    let handled = std::sync::Arc::clone(handled);
    spawn_billing(
        client,
        (topic, following),
        move |message: levee_client::Message| {
            let handled = std::sync::Arc::clone(&handled);
            async move {
                handled
                    .lock()
                    .unwrap()
                    .entry(message.partition)
                    .or_default()
                    .push((message.offset, message.payload.to_vec()));
            }
        },
        stopped,
    )
}

/// A member of group "billing" on `topic` through `client` (following the cluster when
/// `following`), running `handler` on every message until `stopped`.
fn spawn_billing<H, F, O>(
    client: &Client,
    (topic, following): (&str, bool),
    handler: H,
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<Result<levee_client::ConsumerStats, levee_client::ClientError>>
where
    H: Fn(levee_client::Message) -> F + Send + Sync + 'static,
    F: std::future::Future<Output = O> + Send + 'static,
    O: Into<levee_client::Outcome> + Send + 'static,
{
    let member = levee_client::GroupConsumer::new(
        client.clone(),
        topic,
        "billing",
        levee_client::ConsumerOptions::default(),
    )
    .unwrap();
    tokio::spawn(async move {
        let member = if following {
            member.following().await
        } else {
            member
        };
        member
            .run(handler, async move {
                let _ = stopped.await;
            })
            .await
    })
}

#[test]
fn given_a_replicated_cluster_when_a_topic_is_published_through_any_node_then_every_node_holds_it_and_a_leader_kill_loses_nothing()
 {
    let runtime = runtime();
    let directory = tempfile::tempdir().unwrap();
    let (mut nodes, leaders, clients) = settled_three(&runtime, directory.path());
    let topic = "payments";
    let leader = leaders[&u64::from(levee_proto::shards::shard_of_bytes(
        topic.as_bytes(),
        SHARDS,
    ))];
    // Published through a node that does not lead the topic's shard, consumed through the
    // other one.
    let others: Vec<&Client> = (0..3)
        .filter(|index| *index as u64 + 1 != leader)
        .map(|index| &clients[index])
        .collect();
    let keys: Vec<String> = (0..60).map(|n| format!("user-{n}")).collect();
    let mut sequences = BTreeMap::new();
    let handled = Handled::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stored = runtime.block_on(async {
        assert!(!clients[0].create_topic(topic, 4).await.unwrap());
        let mut stored =
            publish_idempotent(others[0], topic, &keys[..30], ("p", &mut sequences)).await;
        // A group member on the other node is woken by the messages its node applies.
        let running = spawn_member(others[1], topic, &handled, stopped);
        // The shard's leader is killed; publishing goes on through the new one.
        nodes[usize::try_from(leader - 1).unwrap()].take();
        stored
            .extend(publish_idempotent(others[0], topic, &keys[30..], ("p", &mut sequences)).await);
        wait_handled(
            &handled,
            keys.len(),
            "every message handled on the other node",
        )
        .await;
        let _ = stop.send(());
        running.await.unwrap().unwrap();
        stored
    });
    // Every acknowledged message once, at its acknowledged partition and offset, dense.
    let mut expected: BTreeMap<u32, Vec<(u64, Vec<u8>)>> = BTreeMap::new();
    for (key, (partition, offset)) in keys.iter().zip(&stored) {
        let messages = expected.entry(*partition).or_default();
        messages.push((*offset, key.clone().into_bytes()));
    }
    for messages in expected.values_mut() {
        messages.sort();
        let offsets: Vec<u64> = messages.iter().map(|(offset, _)| *offset).collect();
        assert_eq!(offsets, (0..offsets.len() as u64).collect::<Vec<_>>());
    }
    // The group's coordinator (the shard's leader) was killed: what the member handled but
    // had not committed by then comes again (at least once; the coordinator test below checks
    // that nothing committed does).
    let mut handled = handled.lock().unwrap().clone();
    for messages in handled.values_mut() {
        messages.sort();
        messages.dedup();
    }
    assert_eq!(handled, expected);
    for client in others {
        let described = runtime.block_on(client.describe_topic(topic)).unwrap();
        let next: Vec<u64> = described.partitions.iter().map(|p| p.next_offset).collect();
        let counts: Vec<u64> = (0..4)
            .map(|partition| expected.get(&partition).map_or(0, |m| m.len() as u64))
            .collect();
        assert_eq!(next, counts);
    }
}

#[test]
fn given_a_following_group_member_when_its_node_dies_then_it_rejoins_through_another_and_handles_every_message()
 {
    let runtime = runtime();
    let directory = tempfile::tempdir().unwrap();
    let (mut nodes, _, clients) = settled_three(&runtime, directory.path());
    let topic = "shipments";
    let keys: Vec<String> = (0..40).map(|n| format!("parcel-{n}")).collect();
    let mut sequences = BTreeMap::new();
    let handled = Handled::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stored = runtime.block_on(async {
        assert!(!clients[0].create_topic(topic, 4).await.unwrap());
        let mut stored =
            publish_idempotent(&clients[0], topic, &keys[..20], ("p", &mut sequences)).await;
        let running = spawn_member_with(&clients[1], topic, (&handled, true), stopped);
        wait_handled(&handled, 20, "the first half handled through node 2").await;
        // Node 2 dies: the member rejoins through another node and goes on (from that node's
        // commits: messages may come again, none is missed).
        nodes[1].take();
        stored.extend(
            publish_idempotent(&clients[0], topic, &keys[20..], ("p", &mut sequences)).await,
        );
        wait_seen(&handled, &stored, "every message handled after the move").await;
        let _ = stop.send(());
        running.await.unwrap().unwrap();
        stored
    });
    assert_eq!(stored.len(), keys.len());
}

/// The leader of `topic`'s shard (its groups' coordinator) among `leaders`, and the clients
/// of the other nodes.
fn leader_of_topic<'a>(
    leaders: &BTreeMap<u64, u64>,
    clients: &'a [Client],
    topic: &str,
) -> (u64, Vec<&'a Client>) {
    let shard = levee_proto::shards::shard_of_bytes(topic.as_bytes(), SHARDS);
    let leader = leaders[&u64::from(shard)];
    let others = (0..3)
        .filter(|index| *index as u64 + 1 != leader)
        .map(|index| &clients[index])
        .collect();
    (leader, others)
}

/// Each partition's committed offset of group "billing" on `topic`, as `client`'s node
/// answers (the group's coordinator answers, wherever the call goes in).
async fn committed(client: &Client, topic: &str) -> Vec<u64> {
    let described = client.describe_group("billing", topic).await.unwrap();
    described
        .partitions
        .iter()
        .map(|partition| partition.committed_offset)
        .collect()
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_a_group_whose_coordinator_is_killed_then_its_members_go_on_and_no_committed_message_comes_again()
 {
    let runtime = runtime();
    let directory = tempfile::tempdir().unwrap();
    let (mut nodes, leaders, clients) = settled_three(&runtime, directory.path());
    let topic = "invoices";
    // The group's coordinator: the leader of the topic's shard.
    let (leader, others) = leader_of_topic(&leaders, &clients, topic);
    let keys: Vec<String> = (0..80).map(|n| format!("invoice-{n}")).collect();
    let mut sequences = BTreeMap::new();
    let handled = Handled::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    runtime.block_on(async {
        assert!(!clients[0].create_topic(topic, 4).await.unwrap());
        let first = publish_idempotent(others[0], topic, &keys[..40], ("p", &mut sequences)).await;
        // The member joins through a node that does not coordinate the group: its stream is
        // forwarded to the coordinator.
        let running = spawn_member(others[1], topic, &handled, stopped);
        wait_handled(&handled, 40, "the first half handled").await;
        let mut ends = vec![0_u64; 4];
        for (partition, offset) in &first {
            ends[*partition as usize] = ends[*partition as usize].max(offset + 1);
        }
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        while committed(others[0], topic).await != ends {
            assert!(Instant::now() < deadline, "every handled message committed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Every node answers the coordinator's view: the member and its commits.
        for client in &clients {
            assert_eq!(committed(client, topic).await, ends);
            let described = client.describe_group("billing", topic).await.unwrap();
            assert_eq!(described.members.len(), 1, "{described:?}");
        }
        // The coordinator dies; the member's stream ends, it joins again through its node and
        // the new leader of the shard coordinates the group from the commits in the log.
        nodes[usize::try_from(leader - 1).unwrap()].take();
        let second = publish_idempotent(others[0], topic, &keys[40..], ("p", &mut sequences)).await;
        wait_seen(
            &handled,
            &second,
            "every message published after the kill handled",
        )
        .await;
        for (partition, offset) in &second {
            ends[*partition as usize] = ends[*partition as usize].max(offset + 1);
        }
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        while committed(others[1], topic).await != ends {
            assert!(Instant::now() < deadline, "the new coordinator commits");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = stop.send(());
        running.await.unwrap().unwrap();
        // No message committed before the kill was handled again.
        let handled = handled.lock().unwrap().clone();
        for (partition, offset) in &first {
            let times = handled[partition]
                .iter()
                .filter(|(handled_offset, _)| handled_offset == offset)
                .count();
            assert_eq!(
                times, 1,
                "partition {partition} offset {offset} handled once"
            );
        }
        assert_eq!(committed(others[0], topic).await, ends);
    });
}

/// What a member of group "billing" handled: (payload, whether it came as a retry).
type Attempts = std::sync::Arc<std::sync::Mutex<Vec<(String, bool)>>>;

/// A member of group "billing" on `topic` through `client` that rejects every first delivery
/// of a `dead-` message (dead-lettered at once), asks for a retry of every first delivery of a
/// `retry-` message, and handles everything else, recording each delivery in `attempts`.
fn spawn_failing_member(
    client: &Client,
    topic: &str,
    attempts: &Attempts,
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> tokio::task::JoinHandle<Result<levee_client::ConsumerStats, levee_client::ClientError>> {
    let attempts = std::sync::Arc::clone(attempts);
    spawn_billing(
        client,
        (topic, false),
        move |message: levee_client::Message| {
            let attempts = std::sync::Arc::clone(&attempts);
            async move {
                let payload = String::from_utf8(message.payload.to_vec()).unwrap();
                attempts
                    .lock()
                    .unwrap()
                    .push((payload.clone(), message.retry));
                match (payload.split('-').next(), message.retry) {
                    (Some("dead"), false) => levee_client::Outcome::reject("refused"),
                    (Some("retry"), false) => levee_client::Outcome::retry("busy"),
                    _ => levee_client::Outcome::Success,
                }
            }
        },
        stopped,
    )
}

/// How many times `attempts` holds `payload` (as a retry when `retry`).
fn times(attempts: &Attempts, payload: &str, retry: bool) -> usize {
    attempts
        .lock()
        .unwrap()
        .iter()
        .filter(|(seen, as_retry)| seen == payload && *as_retry == retry)
        .count()
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_a_group_whose_coordinator_is_killed_then_its_retries_and_dead_letters_are_on_the_new_one()
{
    let runtime = runtime();
    let directory = tempfile::tempdir().unwrap();
    let (mut nodes, leaders, clients) = settled_three(&runtime, directory.path());
    let topic = "refunds";
    let (leader, others) = leader_of_topic(&leaders, &clients, topic);
    let payloads = ["dead-1", "dead-2", "retry-1", "retry-2", "fine-1"];
    let attempts = Attempts::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    runtime.block_on(async {
        assert!(!clients[0].create_topic(topic, 2).await.unwrap());
        others[0]
            .set_retry_policy("billing", &[Duration::from_millis(200)], 5)
            .await
            .unwrap();
        for payload in payloads {
            others[0]
                .publish(topic, &[(payload.as_bytes(), payload.as_bytes())])
                .await
                .unwrap();
        }
        // Through a node that does not coordinate the group: the coordinator (the shard's
        // leader) dead-letters and retries through the shard.
        let running = spawn_failing_member(others[1], topic, &attempts, stopped);
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        loop {
            let dead = others[0]
                .dead_letters("billing", topic, 0, 100)
                .await
                .unwrap();
            let retried = ["retry-1", "retry-2"]
                .iter()
                .all(|payload| times(&attempts, payload, true) == 1);
            if dead.dead_letters.len() == 2 && retried {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "two dead letters and two retries handled"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Once the member committed everything it handled (its partitions and its retry
        // queues), the coordinator is killed.
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        loop {
            let described = others[0].describe_group("billing", topic).await.unwrap();
            if described.partitions.iter().all(|partition| {
                partition.committed_offset == partition.next_offset
                    && partition.retry_committed_offset == partition.retry_next_offset
            }) {
                break;
            }
            assert!(Instant::now() < deadline, "everything handled committed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // A commit shows in the description once the coordinator accepted it, and is durable
        // (and answered to the member) a shard round later: a kill before that may take it
        // back (seen once under CI's load). The member's commits get that round.
        tokio::time::sleep(Duration::from_millis(500)).await;
        nodes[usize::try_from(leader - 1).unwrap()].take();
        // The new coordinator holds the dead letters (the shard replicated them) ...
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        let dead = loop {
            match others[0].dead_letters("billing", topic, 0, 100).await {
                Ok(dead) => break dead,
                Err(error) if error.code() == Some(ErrorCode::Unavailable) => {
                    assert!(Instant::now() < deadline, "a new coordinator: {error}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => panic!("listing dead letters: {error}"),
            }
        };
        let mut dead: Vec<String> = dead
            .dead_letters
            .iter()
            .map(|letter| String::from_utf8(letter.payload.clone()).unwrap())
            .collect();
        dead.sort();
        assert_eq!(dead, ["dead-1", "dead-2"]);
        // ... and redrives them through the shard: the member handles them as retries.
        assert_eq!(
            others[1]
                .redrive_dead_letters("billing", topic, None)
                .await
                .unwrap(),
            2
        );
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        while ["dead-1", "dead-2"]
            .iter()
            .any(|payload| times(&attempts, payload, true) == 0)
        {
            assert!(Instant::now() < deadline, "the redriven letters handled");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            others[0]
                .dead_letters("billing", topic, 0, 100)
                .await
                .unwrap()
                .dead_letters
                .is_empty()
        );
        let _ = stop.send(());
        running.await.unwrap().unwrap();
    });
    // The retries handled before the kill, and committed, did not come again.
    for payload in ["retry-1", "retry-2"] {
        assert_eq!(times(&attempts, payload, true), 1, "{payload}");
    }
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_a_retry_and_a_delayed_message_waiting_when_the_coordinator_is_killed_then_the_new_one_delivers_them_when_due()
 {
    let runtime = runtime();
    let directory = tempfile::tempdir().unwrap();
    let (mut nodes, leaders, clients) = settled_three(&runtime, directory.path());
    let topic = "reminders";
    let (leader, others) = leader_of_topic(&leaders, &clients, topic);
    let leader_node = nodes[usize::try_from(leader - 1).unwrap()]
        .as_ref()
        .unwrap();
    let waiting =
        |node: &LeveeProcess| support::metric_value(node, "levee_delayed_messages_waiting");
    let attempts = Attempts::default();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let delay = Duration::from_secs(3);
    let (published, kill_at) = runtime.block_on(async {
        assert!(!clients[0].create_topic(topic, 2).await.unwrap());
        others[0]
            .set_retry_policy("billing", &[delay], 5)
            .await
            .unwrap();
        others[0]
            .publish(topic, &[(b"retry-1", b"retry-1")])
            .await
            .unwrap();
        // Published through a node that does not lead the topic's shard: the message waits in
        // the shard's slots, on every replica.
        let published = Instant::now();
        let due = others[0]
            .publish_delayed(topic, &[(b"later-1", b"later-1")], delay)
            .await
            .unwrap();
        assert!(due[0].1 > 0, "a due time is answered: {due:?}");
        let running = spawn_failing_member(others[1], topic, &attempts, stopped);
        (published, running)
    });
    let running = kill_at;
    // The retry (judged by the coordinator) and the delayed message wait in the leader's
    // shard slots.
    wait_for(
        "two messages waiting on the leader",
        CONVERGE_TIMEOUT,
        || waiting(leader_node) == 2,
    );
    // The admin port says where they wait: the topic's shard, and when its next slot is due.
    let shard = levee_proto::shards::shard_of_bytes(topic.as_bytes(), SHARDS);
    let cluster = status(leader_node);
    let group = cluster["shard_groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|group| group["shard"] == shard)
        .unwrap()
        .clone();
    assert_eq!(group["delayed_waiting"], 2, "{group}");
    assert!(group["delayed_next_due_ms"].as_u64().is_some(), "{group}");
    // Once the member committed what it handled (else the new coordinator hands retry-1 out
    // again, at least once, and it is retried again).
    runtime.block_on(async {
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        loop {
            let described = others[0].describe_group("billing", topic).await.unwrap();
            if described
                .partitions
                .iter()
                .all(|partition| partition.committed_offset == partition.next_offset)
            {
                break;
            }
            assert!(Instant::now() < deadline, "everything handled committed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // A commit shows in the description once the coordinator accepted it, and is durable
        // a shard round later (a kill before that may take it back: seen under CI's load).
        tokio::time::sleep(Duration::from_millis(300)).await;
    });
    assert!(
        published.elapsed() < delay,
        "the kill comes before the messages are due"
    );
    assert_eq!(times(&attempts, "later-1", false), 0, "not delivered early");
    nodes[usize::try_from(leader - 1).unwrap()].take();
    runtime.block_on(async {
        let deadline = Instant::now() + CONVERGE_TIMEOUT;
        while times(&attempts, "retry-1", true) == 0 || times(&attempts, "later-1", false) == 0 {
            assert!(
                Instant::now() < deadline,
                "the new coordinator delivers the retry and the delayed message: {:?}",
                attempts.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            published.elapsed() >= delay,
            "delivered no earlier than due"
        );
        // Handled once each, and nothing waits any more.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _ = stop.send(());
        running.await.unwrap().unwrap();
    });
    assert_eq!(times(&attempts, "retry-1", false), 1);
    assert_eq!(times(&attempts, "retry-1", true), 1);
    assert_eq!(times(&attempts, "later-1", false), 1);
    for node in nodes.iter().flatten() {
        assert_eq!(waiting(node), 0, "nothing waits on node {}", node.grpc());
    }
}

/// Shard `shard`'s group as `node` reports it in `/v1/cluster`.
fn shard_group(node: &LeveeProcess, shard: u32) -> serde_json::Value {
    status(node)["shard_groups"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|group| group["shard"].as_u64() == Some(u64::from(shard)))
        .cloned()
        .unwrap_or(serde_json::Value::Null)
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_a_shard_log_purged_while_a_follower_was_down_when_it_comes_back_then_a_snapshot_brings_it_every_message_and_position()
 {
    const SNAPSHOT_FLAGS: [&str; 2] = ["--shard-snapshot-entries", "20"];
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let mut nodes = support::three_replicated_nodes_with(directory.path(), SHARDS, &SNAPSHOT_FLAGS);
    let peers: Vec<String> = nodes
        .iter()
        .map(|node| node.as_ref().unwrap().peer_addr.unwrap().to_string())
        .collect();
    let all: Vec<&LeveeProcess> = nodes.iter().flatten().collect();
    let shard = 0;
    let leader = wait_settled(&all)[&u64::from(shard)];
    let follower = if leader == 3 { 2 } else { 3 };
    let index = |id: u64| usize::try_from(id).unwrap() - 1;
    let queues: Vec<Vec<u8>> = (0..64)
        .map(|n| format!("kept-{n}").into_bytes())
        .filter(|queue| levee_proto::shards::shard_of_bytes(queue, SHARDS) == shard)
        .take(2)
        .collect();
    let borrowed: Vec<&[u8]> = queues.iter().map(Vec::as_slice).collect();
    let writer = runtime
        .block_on(Client::connect(&all[index(leader)].grpc()))
        .unwrap();
    let mut acknowledged: BTreeMap<Vec<u8>, BTreeMap<u64, Vec<u8>>> = BTreeMap::new();
    let mut append = |sequence: u64| {
        let queue = &queues[usize::try_from(sequence % 2).unwrap()];
        let payload = format!("entry-{sequence}").into_bytes();
        let offset = runtime.block_on(writer.append(queue, &payload)).unwrap();
        acknowledged
            .entry(queue.clone())
            .or_default()
            .insert(offset, payload);
    };
    for sequence in 0..20 {
        append(sequence);
    }

    // The follower dies; meanwhile a consumer acks offsets 0 to 5 of both queues through the
    // leader, and far more entries than the log keeps past a snapshot's mark are appended.
    let killed = nodes[index(follower)].take().unwrap();
    killed.signal("KILL");
    drop(killed);
    let leader_node = nodes[index(leader)].as_ref().unwrap();
    let behind = shard_group(leader_node, shard)["last_log_index"]
        .as_u64()
        .unwrap();
    runtime.block_on(async {
        let mut mailboxes = writer.subscribe_many("app", 1_000).await.unwrap();
        assert_eq!(mailboxes.add(&borrowed).await.unwrap(), 0..2);
        for _ in 0..20 {
            let delivery = mailboxes.next().await.unwrap().unwrap();
            if delivery.offset == 5 {
                mailboxes.ack(delivery.mailbox, 5);
            }
        }
        mailboxes.flush_acks().await.unwrap();
    });
    for sequence in 20..1_400 {
        append(sequence);
    }
    wait_for(
        "the leader's copy of the shard's log purged past the follower",
        CONVERGE_TIMEOUT,
        || {
            shard_group(leader_node, shard)["purged_index"]
                .as_u64()
                .is_some_and(|purged| purged > behind)
        },
    );
    // openraft now wants a snapshot for the dead follower, and asks for one again after each
    // failed try: the leader captures it, but writes no file while no replica answers.
    std::thread::sleep(Duration::from_secs(2));
    let group = shard_group(leader_node, shard);
    assert_eq!(
        group["snapshots_written"].as_u64(),
        Some(0),
        "no snapshot file for a replica that is down: {group}"
    );

    // It comes back: the log it needs is gone, so it is sent a snapshot, and holds every
    // acknowledged message at its offset and the consumer's acks.
    nodes[index(follower)] = Some(LeveeProcess::start_in(
        &directory.path().join(format!("n{follower}")),
        &[
            "--node-id",
            &follower.to_string(),
            "--peer-addr",
            &peers[index(follower)],
            SNAPSHOT_FLAGS[0],
            SNAPSHOT_FLAGS[1],
        ],
    ));
    let back = nodes[index(follower)].as_ref().unwrap();
    let leader_node = nodes[index(leader)].as_ref().unwrap();
    wait_for("the follower caught up", CONVERGE_TIMEOUT, || {
        let target = shard_group(leader_node, shard)["last_log_index"].as_u64();
        shard_group(back, shard)["last_applied_index"].as_u64() >= target
    });
    let group = shard_group(back, shard);
    assert!(
        group["snapshots_installed"].as_u64() >= Some(1),
        "the follower was sent a snapshot: {group}"
    );
    assert!(
        shard_group(leader_node, shard)["snapshots_written"].as_u64() >= Some(1),
        "the leader wrote one"
    );
    assert!(counted(back, "levee_shard_snapshots_installed_total") >= 1.0);
    assert!(counted(leader_node, "levee_shard_snapshots_written_total") >= 1.0);
    let restarted = runtime.block_on(Client::connect(&back.grpc())).unwrap();
    assert_holds(&runtime, &restarted, &acknowledged);
    runtime.block_on(async {
        let mut mailboxes = restarted.subscribe_many("app", 1_000).await.unwrap();
        assert_eq!(mailboxes.add(&borrowed).await.unwrap(), 0..2);
        let mut next_by_mailbox = BTreeMap::new();
        for _ in 0..10 {
            let delivery = mailboxes.next().await.unwrap().unwrap();
            let expected = next_by_mailbox.entry(delivery.mailbox).or_insert(6_u64);
            assert_eq!(
                delivery.offset, *expected,
                "mailbox {} resumed after its ack on the restarted node",
                delivery.mailbox
            );
            *expected += 1;
        }
    });

    // Appends go on through it, at the next offsets on every node.
    for (queue, expected) in &mut acknowledged {
        let payload = b"after the snapshot".to_vec();
        let offset = runtime.block_on(restarted.append(queue, &payload)).unwrap();
        assert_eq!(offset, expected.len() as u64, "offsets go on, never reused");
        expected.insert(offset, payload);
    }
    for node in nodes.iter().flatten() {
        let client = runtime.block_on(Client::connect(&node.grpc())).unwrap();
        assert_holds(&runtime, &client, &acknowledged);
    }
}

/// Reads are linearizable on every replica: an append acknowledged by a shard's leader is in
/// the very next `Read` and `GetQueueInfo` through either follower (each first learns the
/// leader's read index and applies that far), round after round.
#[test]
fn given_a_replicated_cluster_when_the_leader_acknowledges_an_append_then_a_read_through_any_follower_at_once_sees_it()
 {
    const ROUNDS: u64 = 40;
    let runtime = runtime();
    let directory = tempfile::tempdir().unwrap();
    let (mut nodes, leaders, clients) = settled_three(&runtime, directory.path());
    runtime.block_on(async {
        for round in 0..ROUNDS {
            let queue = format!("read-your-writes-{}", round % 8).into_bytes();
            let shard = u64::from(levee_proto::shards::shard_of_bytes(&queue, SHARDS));
            let leader = usize::try_from(leaders[&shard]).unwrap() - 1;
            let payload = format!("m{round}").into_bytes();
            let offset = clients[leader].append(&queue, &payload).await.unwrap();
            for (index, follower) in clients.iter().enumerate() {
                if index == leader {
                    continue;
                }
                let read = follower.read(&queue, offset, 1, 0).await.unwrap();
                assert_eq!(
                    read.payloads.first().map(|payload| payload.to_vec()),
                    Some(payload.clone()),
                    "round {round}: node {} missed offset {offset} acknowledged by node {}",
                    index + 1,
                    leader + 1
                );
                let info = follower.queue_info(&queue).await.unwrap();
                assert_eq!(info.next_offset, offset + 1, "round {round}");
            }
        }
    });
    drop(nodes.iter_mut().map(Option::take).collect::<Vec<_>>());
}

/// Many appends at once through each node, to the queues of one shard: the shard leader's
/// appender merges those that wait into shared entries (counted; the other nodes forward
/// theirs one by one), and every append is stored once, at the offset it was answered with (one
/// refused as "may be stored", when the shard's lead moves under the load, at most once).
#[test]
fn given_many_appends_at_once_to_one_shard_then_they_share_entries_and_each_is_stored_once_at_its_offset()
 {
    const PER_NODE: usize = 300;
    let runtime = runtime();
    let directory = tempfile::tempdir().unwrap();
    let (mut nodes, _, clients) = settled_three(&runtime, directory.path());
    let shard_queues = one_queue_per_shard("burst");
    let queues = [shard_queues[0].clone(), {
        // A second queue of the same shard.
        (0..10_000)
            .map(|n| format!("burst-b-{n}").into_bytes())
            .find(|queue| levee_proto::shards::shard_of_bytes(queue, SHARDS) == 0)
            .unwrap()
    }];
    // Each append answered with its offset, or `None`: refused as "may be stored" (a shard
    // whose lead moves under this load, as a busy machine may see, fails the writes that
    // waited; they are stored once or not at all).
    let answered = runtime.block_on(async {
        let mut appends = tokio::task::JoinSet::new();
        for (node, client) in clients.iter().enumerate() {
            for n in 0..PER_NODE {
                let (client, queue) = (client.clone(), queues[n % 2].clone());
                let payload = format!("n{node}-{n}").into_bytes();
                appends.spawn(async move {
                    let offset = match client.append(&queue, &payload).await {
                        Ok(offset) => Some(offset),
                        Err(error) if error.code() == Some(ErrorCode::Unavailable) => None,
                        Err(error) => panic!("an append: {error}"),
                    };
                    (queue, offset, payload)
                });
            }
        }
        let mut answered = Vec::new();
        while let Some(append) = appends.join_next().await {
            answered.push(append.unwrap());
        }
        answered
    });
    let acknowledged = answered
        .iter()
        .filter(|(_, offset, _)| offset.is_some())
        .count();
    // How many fail depends on when the lead moves, if it does: what is checked is that
    // some are answered and that every answer holds.
    assert!(acknowledged > 0, "no append of {} answered", 3 * PER_NODE);
    runtime.block_on(async {
        let stored = [
            read_all(&clients[1], &queues[0]).await,
            read_all(&clients[1], &queues[1]).await,
        ];
        let mut sent: std::collections::HashSet<&[u8]> = answered
            .iter()
            .map(|(_, _, payload)| &payload[..])
            .collect();
        for payload in stored.iter().flatten() {
            assert!(
                sent.remove(&payload[..]),
                "{} stored twice, or never sent",
                String::from_utf8_lossy(payload)
            );
        }
        for (queue, offset, payload) in &answered {
            let Some(offset) = offset else { continue };
            let index = usize::from(queue != &queues[0]);
            assert_eq!(
                stored[index].get(usize::try_from(*offset).unwrap()),
                Some(payload),
                "the append answered with offset {offset}"
            );
        }
    });
    let (requests, entries): (u64, u64) = nodes.iter().flatten().fold((0, 0), |sum, node| {
        (
            sum.0 + support::metric_value(node, "levee_shard_append_requests_total"),
            sum.1 + support::metric_value(node, "levee_shard_append_entries_total"),
        )
    });
    // The leader's own 300 (more if the lead moved meanwhile). When the lead moved (some
    // appends refused), the leaders may have proposed the requests as they came, forwarded:
    // the merge is checked on a burst the same leader took whole.
    if acknowledged == 3 * PER_NODE {
        assert!(
            (1..=3 * PER_NODE as u64).contains(&requests) && (1..requests).contains(&entries),
            "{requests} append requests written in {entries} entries"
        );
    } else {
        eprintln!(
            "the lead moved during the burst ({acknowledged} of {} answered): {requests} \
             append requests written in {entries} entries",
            3 * PER_NODE
        );
    }
    drop(nodes.iter_mut().map(Option::take).collect::<Vec<_>>());
}

/// The least time between two positions entries of one shard from one node
/// (`levee_cluster::shard::groups::POSITIONS_ENTRIES_APART`; queue.proto, Subscribe).
const POSITIONS_ENTRIES_APART: Duration = Duration::from_millis(50);

#[test]
fn given_acks_flushed_one_after_another_on_one_shard_then_their_entries_start_50_ms_apart() {
    const FLUSHES: u32 = 4;
    let runtime = runtime();
    let directory = tempfile::tempdir().unwrap();
    let (mut nodes, _, clients) = settled_three(&runtime, directory.path());
    let node = nodes[0].as_ref().unwrap();
    let entries_before = support::metric_value(node, "levee_shard_positions_entries_total");
    let took = runtime.block_on(async {
        for message in 0..FLUSHES {
            let payload = format!("m{message}").into_bytes();
            clients[0]
                .append(b"spaced".as_slice(), &payload)
                .await
                .unwrap();
        }
        let queue: &[u8] = b"spaced";
        let mut mailboxes = clients[0]
            .subscribe_many("spaced-app", 1_000)
            .await
            .unwrap();
        assert_eq!(mailboxes.add(&[queue]).await.unwrap(), 0..1);
        let mut deliveries = Vec::new();
        while deliveries.len() < FLUSHES as usize {
            deliveries.push(mailboxes.next().await.unwrap().unwrap());
        }
        let started = Instant::now();
        for delivery in deliveries {
            mailboxes.ack(delivery.mailbox, delivery.offset);
            mailboxes.flush_acks().await.unwrap();
        }
        started.elapsed()
    });
    // Each flush waits for its entry, and each entry after the first starts at least 50 ms
    // after the one before.
    assert!(
        took >= POSITIONS_ENTRIES_APART * (FLUSHES - 1),
        "{FLUSHES} acks flushed one after another in {took:?}"
    );
    let entries = support::metric_value(node, "levee_shard_positions_entries_total");
    assert_eq!(
        entries - entries_before,
        u64::from(FLUSHES),
        "one positions entry per flush"
    );
    drop(nodes.iter_mut().map(Option::take).collect::<Vec<_>>());
}

/// Many consumers acking at once through one node: their acks go through the shards in
/// shared entries (the node counts its positions writes and the entries they took), and each
/// consumer then resumes on another node right after its own acks.
#[test]
fn given_many_consumers_acking_at_once_through_one_node_then_their_acks_share_entries_and_each_resumes_elsewhere_after_its_own()
 {
    const CONSUMERS: u64 = 6;
    let runtime = runtime();
    let directory = tempfile::tempdir().unwrap();
    let (mut nodes, _, clients) = settled_three(&runtime, directory.path());
    let queues: Vec<Vec<u8>> = (0..8).map(|n| format!("inbox-{n}").into_bytes()).collect();
    let borrowed: Vec<&[u8]> = queues.iter().map(Vec::as_slice).collect();
    let mailboxes_count = u32::try_from(queues.len()).unwrap();
    // Consumer `c` acks offset `c % 4` of every queue (each queue holds offsets 0 to 4).
    let acked = |consumer: u64| consumer % 4;
    runtime.block_on(async {
        for queue in &queues {
            for message in 0..5 {
                let payload = format!("m{message}").into_bytes();
                clients[0].append(queue, &payload).await.unwrap();
            }
        }
        let mut streams = Vec::new();
        for consumer in 0..CONSUMERS {
            let mut mailboxes = clients[0]
                .subscribe_many(&format!("app-{consumer}"), 1_000)
                .await
                .unwrap();
            assert_eq!(mailboxes.add(&borrowed).await.unwrap(), 0..mailboxes_count);
            for _ in 0..queues.len() * 5 {
                let delivery = mailboxes.next().await.unwrap().unwrap();
                if delivery.offset == acked(consumer) {
                    mailboxes.ack(delivery.mailbox, delivery.offset);
                }
            }
            streams.push(mailboxes);
        }
        // Every consumer flushes at once: the node merges what waits per shard.
        let mut flushes = tokio::task::JoinSet::new();
        for mut stream in streams {
            flushes.spawn(async move { stream.flush_acks().await });
        }
        while let Some(flushed) = flushes.join_next().await {
            flushed.unwrap().unwrap();
        }
        for consumer in 0..CONSUMERS {
            let mut mailboxes = clients[1]
                .subscribe_many(&format!("app-{consumer}"), 1_000)
                .await
                .unwrap();
            assert_eq!(mailboxes.add(&borrowed).await.unwrap(), 0..mailboxes_count);
            let mut first = BTreeMap::new();
            while first.len() < queues.len() {
                let delivery = mailboxes.next().await.unwrap().unwrap();
                first.entry(delivery.mailbox).or_insert(delivery.offset);
            }
            assert!(
                first.values().all(|offset| *offset == acked(consumer) + 1),
                "consumer {consumer} resumed on node 2 at {first:?}"
            );
        }
    });
    let node = nodes[0].as_ref().unwrap();
    let writes = support::metric_value(node, "levee_shard_positions_writes_total");
    let entries = support::metric_value(node, "levee_shard_positions_entries_total");
    assert!(
        writes >= CONSUMERS && (1..=writes).contains(&entries),
        "{writes} positions writes in {entries} entries"
    );
    // The shards' calls to peers go on streams (docs/CLUSTER.md, "The shards' transport").
    assert!(
        support::metric_value(node, "levee_shard_peer_streams_opened_total") >= 1,
        "no stream of shard calls opened"
    );
    // The shards' rounds are timed: every entry was appended to the log and applied, and
    // each leader's writes timed from proposal to commit.
    for series in [
        "levee_shard_log_append_seconds_count",
        "levee_shard_apply_wait_seconds_count",
        "levee_shard_apply_seconds_count",
    ] {
        assert!(support::metric_value(node, series) > 0, "{series}");
    }
    let commits: u64 = nodes
        .iter()
        .flatten()
        .map(|node| support::metric_value(node, "levee_shard_commit_seconds_count"))
        .sum();
    // The 40 appends, one write each, and the positions entries.
    assert!(
        commits >= 40 + entries,
        "{commits} writes committed by leaders, for 40 appends and {entries} positions entries"
    );
    drop(nodes.iter_mut().map(Option::take).collect::<Vec<_>>());
}
