//! A network partition between real `levee server` processes (docs/CLUSTER.md, failure
//! cases), made by fault-injecting TCP proxies: every node's peer port is reached through a
//! proxy (`--peer-advertise-addr`), and every node dials its peers from its own loopback
//! address (127.0.0.1N for node N), so a proxy knows which node each connection comes from.
//! Partitioning drops the connections that cross the cut and refuses new ones: real packets
//! stop, nothing inside the nodes is told. The shard groups of a cluster that replicates its
//! queues talk over the same peer port, so the same cut isolates a shard's leader.

mod support;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use levee_client::{Client, ErrorCode};
use support::{LeveeProcess, http_get, runtime, shard_groups, wait_for};

/// How long the cluster may take to elect, replicate or catch up.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(20);

/// The loopback address node `node` listens and dials from.
fn node_ip(node: u64) -> IpAddr {
    IpAddr::from([127, 0, 0, u8::try_from(10 + node).unwrap()])
}

/// Which node a connection comes from, by its source address.
fn node_of(ip: IpAddr) -> Option<u64> {
    match ip {
        IpAddr::V4(v4) if v4.octets()[..3] == [127, 0, 0] && v4.octets()[3] > 10 => {
            Some(u64::from(v4.octets()[3]) - 10)
        }
        _ => None,
    }
}

/// What the proxies share: the cut, and the open connections with their ends.
#[derive(Default)]
struct Cut {
    /// The nodes on the isolated side; empty: no partition.
    isolated: BTreeSet<u64>,
    /// (from node, to node, both sockets of the pair) of every proxied connection.
    open: Vec<(u64, u64, TcpStream, TcpStream)>,
}

impl Cut {
    fn crosses(&self, from: u64, to: u64) -> bool {
        self.isolated.contains(&from) != self.isolated.contains(&to)
    }
}

/// One proxy per node, in front of its peer port.
struct Proxies {
    cut: Arc<Mutex<Cut>>,
    addresses: Vec<SocketAddr>,
    targets: Vec<Arc<Mutex<Option<SocketAddr>>>>,
}

impl Proxies {
    fn new(nodes: u64) -> Self {
        let cut = Arc::new(Mutex::new(Cut::default()));
        let mut addresses = Vec::new();
        let mut targets = Vec::new();
        for node in 1..=nodes {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            addresses.push(listener.local_addr().unwrap());
            let target = Arc::new(Mutex::new(None));
            targets.push(Arc::clone(&target));
            let cut = Arc::clone(&cut);
            std::thread::spawn(move || {
                for incoming in listener.incoming() {
                    let Ok(client) = incoming else { continue };
                    proxy(&cut, &target, node, client);
                }
            });
        }
        Self {
            cut,
            addresses,
            targets,
        }
    }

    /// Where node `node`'s peers reach it.
    fn address(&self, node: u64) -> String {
        self.addresses[usize::try_from(node).unwrap() - 1].to_string()
    }

    /// Node `node`'s real peer port, once it listens.
    fn set_target(&self, node: u64, target: SocketAddr) {
        *lock(&self.targets[usize::try_from(node).unwrap() - 1]) = Some(target);
    }

    /// Cuts `isolated` off from the other nodes (both ways), dropping open connections.
    fn partition(&self, isolated: &[u64]) {
        let mut cut = lock(&self.cut);
        cut.isolated = isolated.iter().copied().collect();
        let crossing: Vec<usize> = (0..cut.open.len())
            .filter(|index| cut.crosses(cut.open[*index].0, cut.open[*index].1))
            .collect();
        for index in crossing.into_iter().rev() {
            let (_, _, client, server) = cut.open.swap_remove(index);
            let _ = client.shutdown(Shutdown::Both);
            let _ = server.shutdown(Shutdown::Both);
        }
    }

    fn heal(&self) {
        lock(&self.cut).isolated.clear();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Proxies one connection to node `to`, unless it crosses the cut.
fn proxy(
    cut: &Arc<Mutex<Cut>>,
    target: &Arc<Mutex<Option<SocketAddr>>>,
    to: u64,
    client: TcpStream,
) {
    let Some(from) = client.peer_addr().ok().and_then(|peer| node_of(peer.ip())) else {
        return;
    };
    let Some(target) = *lock(target) else { return };
    let mut state = lock(cut);
    if state.crosses(from, to) {
        return;
    }
    let Ok(server) = TcpStream::connect(target) else {
        return;
    };
    let (Ok(client_copy), Ok(server_copy)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    state.open.push((from, to, client_copy, server_copy));
    drop(state);
    let (Ok(client_reader), Ok(server_reader)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    std::thread::spawn(move || pipe(client_reader, server));
    std::thread::spawn(move || pipe(server_reader, client));
}

/// Copies `from` to `to` until either side closes.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    let mut buffer = [0_u8; 16 << 10];
    loop {
        match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(read) => {
                if to.write_all(&buffer[..read]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// The leader `node` knows, from `/v1/cluster`.
fn leader_seen_by(node: &LeveeProcess) -> Option<u64> {
    let (status, body) = http_get(node.admin_addr, "/v1/cluster");
    assert_eq!(status, 200, "{body}");
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    view["leader_id"].as_u64()
}

fn topics(
    runtime: &tokio::runtime::Runtime,
    node: &LeveeProcess,
) -> Result<Vec<String>, ErrorCode> {
    runtime.block_on(async {
        let client = Client::connect(&node.grpc()).await.unwrap();
        client
            .list_topics()
            .await
            .map(|topics| topics.into_iter().map(|topic| topic.topic).collect())
            .map_err(|error| error.code().unwrap_or(ErrorCode::Unspecified))
    })
}

fn create_topic(
    runtime: &tokio::runtime::Runtime,
    node: &LeveeProcess,
    topic: &str,
) -> Result<bool, ErrorCode> {
    runtime.block_on(async {
        let client = Client::connect(&node.grpc()).await.unwrap();
        client
            .create_topic(topic, 1)
            .await
            .map_err(|error| error.code().unwrap_or(ErrorCode::Unspecified))
    })
}

/// Starts three nodes behind the proxies: node 1 alone, then 2 and 3 joining through node 1's
/// proxy.
fn three_nodes(directory: &std::path::Path, proxies: &Proxies) -> Vec<LeveeProcess> {
    three_nodes_with(directory, proxies, &[])
}

/// [`three_nodes`], node 1 (which creates the cluster) with `creation` flags too.
fn three_nodes_with(
    directory: &std::path::Path,
    proxies: &Proxies,
    creation: &[&str],
) -> Vec<LeveeProcess> {
    let mut nodes: Vec<LeveeProcess> = Vec::new();
    for node in 1..=3_u64 {
        // A fixed port, known before the node starts: it joins through the proxies, which
        // must reach it while it is being added.
        let listen = TcpListener::bind((node_ip(node), 0))
            .unwrap()
            .local_addr()
            .unwrap();
        proxies.set_target(node, listen);
        let listen = listen.to_string();
        let advertised = proxies.address(node);
        let seed = proxies.address(1);
        let node_id = node.to_string();
        let mut flags = vec![
            "--node-id",
            &node_id,
            "--peer-addr",
            &listen,
            "--peer-advertise-addr",
            &advertised,
        ];
        if node > 1 {
            flags.extend(["--join", &seed]);
        } else {
            flags.extend(creation);
        }
        nodes.push(LeveeProcess::start_in(
            &directory.join(format!("n{node}")),
            &flags,
        ));
    }
    nodes
}

#[test]
fn given_a_partitioned_leader_then_it_cannot_commit_and_the_majority_elects_another() {
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let proxies = Proxies::new(3);
    let nodes = three_nodes(directory.path(), &proxies);
    wait_for("one leader known to all", CONVERGE_TIMEOUT, || {
        let leaders: Vec<Option<u64>> = nodes.iter().map(leader_seen_by).collect();
        leaders[0].is_some() && leaders.iter().all(|leader| *leader == leaders[0])
    });
    let leader_id = leader_seen_by(&nodes[0]).unwrap();
    let leader = &nodes[usize::try_from(leader_id).unwrap() - 1];
    let majority: Vec<&LeveeProcess> = (1..=3)
        .filter(|id| *id != leader_id)
        .map(|id| &nodes[usize::try_from(id).unwrap() - 1])
        .collect();
    assert_eq!(create_topic(&runtime, leader, "before"), Ok(false));

    proxies.partition(&[leader_id]);

    // The isolated leader cannot commit: its write fails fast with a retryable error, and a
    // linearizable read there says it cannot be served rather than answer stale.
    let started = Instant::now();
    assert_eq!(
        create_topic(&runtime, leader, "isolated"),
        Err(ErrorCode::Unavailable)
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(topics(&runtime, leader), Err(ErrorCode::Unavailable));

    // The majority elects a leader among itself and commits.
    wait_for("a leader on the majority side", CONVERGE_TIMEOUT, || {
        let seen = leader_seen_by(majority[0]);
        seen.is_some() && seen != Some(leader_id) && seen == leader_seen_by(majority[1])
    });
    wait_for("a write on the majority side", CONVERGE_TIMEOUT, || {
        create_topic(&runtime, majority[0], "majority").is_ok()
    });
    assert_eq!(
        topics(&runtime, majority[1]),
        Ok(vec!["before".to_owned(), "majority".to_owned()])
    );

    // Healed, the old leader follows the new one: it has what the majority committed, and
    // the write it could not commit is gone (it was never acknowledged).
    proxies.heal();
    wait_for("the old leader caught up", CONVERGE_TIMEOUT, || {
        topics(&runtime, leader) == Ok(vec!["before".to_owned(), "majority".to_owned()])
    });
    assert_ne!(leader_seen_by(leader), Some(leader_id));
}

/// Every message of `queue` on `node`, from offset 0.
fn read_all(runtime: &tokio::runtime::Runtime, node: &LeveeProcess, queue: &[u8]) -> Vec<Vec<u8>> {
    runtime.block_on(async {
        let client = Client::connect(&node.grpc()).await.unwrap();
        match client.read(queue, 0, 10_000, 0).await {
            Ok(read) => read
                .payloads
                .into_iter()
                .map(|payload| payload.to_vec())
                .collect(),
            Err(error) if error.code() == Some(ErrorCode::NotFound) => Vec::new(),
            Err(error) => panic!("reading {}: {error}", String::from_utf8_lossy(queue)),
        }
    })
}

fn append(
    runtime: &tokio::runtime::Runtime,
    node: &LeveeProcess,
    queue: &[u8],
    payload: &[u8],
) -> Result<u64, String> {
    runtime.block_on(async {
        let client = Client::connect(&node.grpc()).await.unwrap();
        client
            .append(queue, payload)
            .await
            .map_err(|error| format!("{:?}: {error}", error.code()))
    })
}

#[test]
fn given_a_partitioned_shard_leader_then_it_acknowledges_nothing_and_the_majority_takes_the_shard()
{
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let proxies = Proxies::new(3);
    let nodes = three_nodes_with(
        directory.path(),
        &proxies,
        &["--replicated-queues", "true", "--shards", "2"],
    );
    let queue = b"payments";
    let shard = u64::from(levee_proto::shards::shard_of_bytes(queue, 2));
    wait_for("the shard placed on all three", CONVERGE_TIMEOUT, || {
        let views: Vec<_> = nodes.iter().map(shard_groups).collect();
        views.iter().all(|view| {
            view.get(&shard).is_some_and(|(leader, voters)| {
                *voters == [1, 2, 3] && leader.is_some() && *leader == views[0][&shard].0
            })
        })
    });
    let leader_id = shard_groups(&nodes[0])[&shard].0.unwrap();
    let leader = &nodes[usize::try_from(leader_id).unwrap() - 1];
    let majority: Vec<&LeveeProcess> = (1..=3)
        .filter(|id| *id != leader_id)
        .map(|id| &nodes[usize::try_from(id).unwrap() - 1])
        .collect();
    assert_eq!(append(&runtime, leader, queue, b"before"), Ok(0));
    let led_in = shard_term(leader, shard);

    proxies.partition(&[leader_id]);

    // The isolated leader cannot reach a majority: the append fails fast, retryable, naming
    // the shard, and is not acknowledged.
    let started = Instant::now();
    let isolated = append(&runtime, leader, queue, b"isolated");
    let error = isolated.expect_err("an isolated shard leader acknowledged an append");
    assert!(
        error.starts_with("Some(Unavailable)") && error.contains(&format!("shard {shard}")),
        "{error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );

    // The majority elects a leader of the shard among itself and appends go on there.
    wait_for(
        "a shard leader on the majority side",
        CONVERGE_TIMEOUT,
        || {
            let seen = shard_groups(majority[0])[&shard].0;
            seen.is_some() && seen != Some(leader_id) && seen == shard_groups(majority[1])[&shard].0
        },
    );
    let mut offset = None;
    wait_for("an append on the majority side", CONVERGE_TIMEOUT, || {
        offset = append(&runtime, majority[0], queue, b"majority").ok();
        offset.is_some()
    });
    assert_eq!(offset, Some(1), "the isolated append took no offset");

    // Healed, the old leader follows: every node holds exactly what was acknowledged, and the
    // append the isolated leader could not commit is nowhere (no split brain).
    proxies.heal();
    let expected = vec![b"before".to_vec(), b"majority".to_vec()];
    for node in &nodes {
        wait_for(
            "every node holds the acknowledged appends",
            CONVERGE_TIMEOUT,
            || read_all(&runtime, node, queue) == expected,
        );
    }
    // The old leader no longer leads in the term it led in (it may lead again in a later one:
    // as the shard's preferred replica it claims the lead back soon after it follows).
    assert!(shard_term(leader, shard) > led_in);
    // Appends through the old leader go on at the next offset. (An idempotent producer
    // resends a write caught in a move of the lead, and it is stored once.)
    let offset = runtime.block_on(async {
        let client = Client::connect(&leader.grpc()).await.unwrap();
        let producer = levee_client::Producer::new(
            client,
            levee_client::ProducerOptions {
                idempotent: true,
                ..levee_client::ProducerOptions::default()
            },
        )
        .unwrap();
        producer.send(queue, b"after").await
    });
    assert_eq!(offset.map_err(|error| error.to_string()), Ok(2));
    let mut expected = expected;
    expected.push(b"after".to_vec());
    assert_eq!(read_all(&runtime, leader, queue), expected);
}

/// `node`'s term of shard `shard`, as its `/v1/cluster` says.
fn shard_term(node: &LeveeProcess, shard: u64) -> u64 {
    let (_, body) = http_get(node.admin_addr, "/v1/cluster");
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    view["shard_groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|group| group["shard"] == shard)
        .and_then(|group| group["term"].as_u64())
        .unwrap()
}

/// A raw member stream of group "ledger-readers" on `topic` through `node`: the request
/// sender (its start already sent) and the answers.
async fn raw_member(
    node: &LeveeProcess,
    topic: &str,
    member: &str,
) -> Result<
    (
        tokio::sync::mpsc::Sender<levee_proto::v1::ConsumeRequest>,
        tonic::Streaming<levee_proto::v1::ConsumeResponse>,
    ),
    tonic::Status,
> {
    use levee_proto::v1::consume_request::Kind;
    let (sender, receiver) = tokio::sync::mpsc::channel(16);
    let start = levee_proto::v1::ConsumeStart {
        topic: topic.to_owned(),
        group: "ledger-readers".to_owned(),
        member: member.to_owned(),
        credit: Some(levee_proto::v1::Credit {
            messages: 1_000,
            bytes: 0,
        }),
        lease_ms: 0,
    };
    sender
        .send(levee_proto::v1::ConsumeRequest {
            kind: Some(Kind::Start(start)),
        })
        .await
        .unwrap();
    let mut client =
        levee_proto::v1::topics_client::TopicsClient::connect(format!("http://{}", node.grpc()))
            .await
            .unwrap();
    let answers = client
        .consume(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await?
        .into_inner();
    Ok((sender, answers))
}

/// The next answer of a member's stream that `wanted` picks, within `CONVERGE_TIMEOUT`.
async fn next_answer<T>(
    answers: &mut tonic::Streaming<levee_proto::v1::ConsumeResponse>,
    mut wanted: impl FnMut(&levee_proto::v1::ConsumeResponse) -> Option<T>,
) -> Result<T, tonic::Status> {
    let deadline = tokio::time::Instant::now() + CONVERGE_TIMEOUT;
    loop {
        let answer = tokio::time::timeout_at(deadline, answers.message())
            .await
            .expect("the stream answers in time")?
            .expect("the stream goes on");
        if let Some(found) = wanted(&answer) {
            return Ok(found);
        }
    }
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_a_partitioned_group_coordinator_then_its_streams_end_before_another_member_owns_its_partition()
 {
    use levee_proto::v1::consume_request::Kind;
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let proxies = Proxies::new(3);
    let nodes = three_nodes_with(
        directory.path(),
        &proxies,
        &["--replicated-queues", "true", "--shards", "2"],
    );
    let topic = "ledger";
    let shard = u64::from(levee_proto::shards::shard_of_bytes(topic.as_bytes(), 2));
    // Settled: the shard led by its preferred replica (which claims the lead otherwise).
    let all: Vec<&LeveeProcess> = nodes.iter().collect();
    support::wait_settled(&all, 2);
    let leader_id = shard_groups(&nodes[0])[&shard].0.unwrap();
    let leader = &nodes[usize::try_from(leader_id).unwrap() - 1];
    let majority: Vec<&LeveeProcess> = (1..=3)
        .filter(|id| *id != leader_id)
        .map(|id| &nodes[usize::try_from(id).unwrap() - 1])
        .collect();
    runtime.block_on(async {
        let client = Client::connect(&leader.grpc()).await.unwrap();
        client.create_topic(topic, 1).await.unwrap();
        for offset in 0..3_u8 {
            client
                .publish(
                    topic,
                    &[(b"k".as_slice(), [b'm', b'0' + offset].as_slice())],
                )
                .await
                .unwrap();
        }
        // Member A, on the coordinator (the shard's leader), owns the one partition, takes the
        // three messages and commits the first two.
        let (a_requests, mut a_answers) = raw_member(leader, topic, "a").await.unwrap();
        let epoch = next_answer(&mut a_answers, |answer| {
            answer
                .assignment
                .as_ref()
                .and_then(|assignment| assignment.partitions.first())
                .map(|owned| owned.epoch)
        })
        .await
        .unwrap();
        let mut delivered = 0;
        while delivered < 3 {
            delivered += next_answer(&mut a_answers, |answer| {
                (!answer.deliveries.is_empty()).then_some(answer.deliveries.len())
            })
            .await
            .unwrap();
        }
        let commit = levee_proto::v1::CommitBatch {
            commits: vec![levee_proto::v1::Commit {
                partition: 0,
                epoch,
                next_offset: 2,
                retry: false,
            }],
        };
        if a_requests
            .send(levee_proto::v1::ConsumeRequest {
                kind: Some(Kind::Commit(commit)),
            })
            .await
            .is_err()
        {
            let ended = next_answer(&mut a_answers, |_| None::<()>).await;
            panic!("A's stream ended before the cut: {ended:?}");
        }
        let committed = next_answer(&mut a_answers, |answer| {
            answer.commit_results.first().cloned()
        })
        .await
        .unwrap();
        assert_eq!(
            (committed.code, committed.next_offset),
            (0, 2),
            "{committed:?}"
        );

        // The coordinator is cut off from the other two (its clients still reach it).
        proxies.partition(&[leader_id]);
        let cut_at = tokio::time::Instant::now();
        // Member B joins through the majority side while A's stream is still open.
        let b = async {
            loop {
                let joined = raw_member(majority[0], topic, "b").await;
                let (b_requests, mut b_answers) = match joined {
                    Ok(joined) => joined,
                    Err(status) => {
                        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let owned = next_answer(&mut b_answers, |answer| {
                    answer
                        .assignment
                        .as_ref()
                        .map(|assignment| !assignment.partitions.is_empty())
                })
                .await;
                match owned {
                    Ok(true) => {
                        return (tokio::time::Instant::now(), b_requests, b_answers);
                    }
                    Ok(false) => {
                        // Not owned yet: the owner is A, until its coordinator stops.
                        let owned = next_answer(&mut b_answers, |answer| {
                            answer
                                .assignment
                                .as_ref()
                                .filter(|assignment| !assignment.partitions.is_empty())
                                .map(|_| ())
                        })
                        .await;
                        if owned.is_ok() {
                            return (tokio::time::Instant::now(), b_requests, b_answers);
                        }
                    }
                    Err(status) => {
                        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let a = async {
            // A's stream ends: its coordinator lost the lead.
            let ended = next_answer(&mut a_answers, |_| None::<()>)
                .await
                .unwrap_err();
            (tokio::time::Instant::now(), ended)
        };
        let ((a_ended_at, ended), (b_owns_at, _b_requests, mut b_answers)) = tokio::join!(a, b);
        assert_eq!(ended.code(), tonic::Code::Unavailable, "{ended:?}");
        assert!(ended.message().contains("lost the lead"), "{ended:?}");
        assert!(
            a_ended_at - cut_at < Duration::from_secs(5),
            "the cut-off coordinator stopped within {:?}",
            a_ended_at - cut_at
        );
        // Never two owners: B owned the partition only after A's stream had ended.
        assert!(
            b_owns_at > a_ended_at,
            "B owned the partition {:?} after the cut, A's stream ended {:?} after it",
            b_owns_at - cut_at,
            a_ended_at - cut_at
        );
        // The cut-off node counts the streams it ended.
        let (code, metrics) = http_get(leader.admin_addr, "/metrics");
        assert_eq!(code, 200);
        // (B's first joins may have reached it too, before it stopped.)
        let ended: u64 = metrics
            .lines()
            .find_map(|line| {
                line.strip_prefix("levee_group_coordinator_lost_total{group=\"ledger-readers\"} ")
            })
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(0);
        assert!(ended >= 1, "{metrics}");
        // B starts after A's answered commit: only the uncommitted message comes again.
        let first = next_answer(&mut b_answers, |answer| {
            answer.deliveries.first().map(|delivery| delivery.offset)
        })
        .await
        .unwrap();
        assert_eq!(first, 2);
    });
    proxies.heal();
}
