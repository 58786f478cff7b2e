//! Three metadata-group nodes in one process, each with its own data directories and a real
//! gRPC peer server on a loopback port: the cluster forms (one voter, then two learners made
//! voters), a catalog command written on the leader is applied on every node, and when the
//! leader stops the two others elect a new one that commits the next command; writes made on
//! a follower are forwarded to the leader; with no quorum left a write fails fast.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use levee_broker::catalog::CatalogCommand;
use levee_cluster::{
    LogStore, Manager, MetaCommand, MetaStateMachine, MetaWriter, NodeId, NodeInfo, PeerNetwork,
    PeerService, Raft, WriteError,
};
use tokio::sync::oneshot;

/// How long the test waits for any one thing.
const WAIT: Duration = Duration::from_secs(10);

struct Node {
    id: NodeId,
    raft: Raft,
    machine: MetaStateMachine,
    info: NodeInfo,
    stop: Option<oneshot::Sender<()>>,
    _directory: tempfile::TempDir,
}

async fn start(id: NodeId) -> Node {
    let directory = tempfile::tempdir().unwrap();
    let log = LogStore::open(&directory.path().join("log")).unwrap();
    let machine = MetaStateMachine::open(&directory.path().join("state")).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let info = NodeInfo {
        peer_addr: listener.local_addr().unwrap().to_string(),
        ..NodeInfo::default()
    };
    let config = openraft::Config {
        cluster_name: "test".to_owned(),
        heartbeat_interval: 50,
        election_timeout_min: 150,
        election_timeout_max: 300,
        ..openraft::Config::default()
    };
    let raft = Raft::new(
        id,
        Arc::new(config.validate().unwrap()),
        PeerNetwork::default(),
        log,
        machine.clone(),
    )
    .await
    .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(PeerService::server(
                Manager::new(
                    raft.clone(),
                    tokio::sync::watch::channel("test".to_owned()).1,
                    tokio::sync::watch::channel(None).0,
                ),
                levee_cluster::shard::ShardSlot::default(),
            ))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                async {
                    let _ = stopped.await;
                },
            ),
    );
    Node {
        id,
        raft,
        machine,
        info,
        stop: Some(stop),
        _directory: directory,
    }
}

async fn wait_until(what: &str, mut done: impl AsyncFnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !done().await {
        assert!(started.elapsed() < WAIT, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    started.elapsed()
}

fn create(topic: &str, partitions: u32) -> MetaCommand {
    MetaCommand::Catalog(CatalogCommand::CreateTopic {
        topic: topic.to_owned(),
        partitions,
    })
}

fn has_topic(node: &Node, topic: &str) -> bool {
    node.machine
        .with_catalog(|catalog| catalog.topic(topic).is_some())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_three_nodes_then_a_write_reaches_all_and_survives_the_leader_stopping() {
    let mut nodes = vec![start(1).await, start(2).await, start(3).await];
    nodes[0]
        .raft
        .initialize(BTreeMap::from([(1, nodes[0].info.clone())]))
        .await
        .unwrap();
    wait_until("node 1 to lead", async || {
        nodes[0].raft.current_leader().await == Some(1)
    })
    .await;
    for node in &nodes[1..] {
        nodes[0]
            .raft
            .add_learner(node.id, node.info.clone(), true)
            .await
            .unwrap();
    }
    nodes[0]
        .raft
        .change_membership(BTreeSet::from([1, 2, 3]), false)
        .await
        .unwrap();

    let written = nodes[0]
        .raft
        .client_write(create("orders", 8))
        .await
        .unwrap();
    assert!(written.data.changed && written.data.refused.is_none());
    wait_until("orders on every node", async || {
        nodes.iter().all(|node| has_topic(node, "orders"))
    })
    .await;
    let repeat = nodes[0]
        .raft
        .client_write(create("orders", 4))
        .await
        .unwrap();
    assert!(
        repeat.data.refused.is_some(),
        "the engine's answer comes back"
    );
    // A follower takes a write too: it forwards it to the leader and answers once applied.
    let forwarded = MetaWriter::new(nodes[2].raft.clone())
        .write(create("refunds", 2))
        .await
        .unwrap();
    assert!(forwarded.changed && forwarded.refused.is_none());
    wait_until("refunds on every node", async || {
        nodes.iter().all(|node| has_topic(node, "refunds"))
    })
    .await;

    // The leader stops: the two others elect one of themselves and commit the next write.
    let mut old = nodes.remove(0);
    old.raft.shutdown().await.unwrap();
    let _ = old.stop.take().unwrap().send(());
    let mut leader = 0;
    let failover = wait_until("a new leader", async || {
        match nodes[0].raft.current_leader().await {
            Some(id) if id != 1 => {
                leader = id;
                true
            }
            _ => false,
        }
    })
    .await;
    assert!(failover < Duration::from_secs(5), "{failover:?}");
    // Written through the node that does not lead: forwarded to the new leader.
    let follower = nodes.iter().find(|node| node.id != leader).unwrap();
    let written = MetaWriter::new(follower.raft.clone())
        .write(create("payments", 4))
        .await
        .unwrap();
    assert!(written.changed);
    wait_until("payments on both", async || {
        nodes.iter().all(|node| has_topic(node, "payments"))
    })
    .await;
    // The new leader stops too: the last node has no quorum, and a write through it fails
    // fast with a clear error instead of hanging.
    let index = nodes.iter().position(|node| node.id == leader).unwrap();
    let mut stopped = nodes.remove(index);
    stopped.raft.shutdown().await.unwrap();
    let _ = stopped.stop.take().unwrap().send(());
    let started = Instant::now();
    let error = MetaWriter::new(nodes[0].raft.clone())
        .write(create("lost", 1))
        .await
        .unwrap_err();
    assert!(matches!(error, WriteError::NoLeader { .. }), "{error}");
    assert!(error.to_string().contains("no quorum"), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    for node in &nodes {
        node.raft.shutdown().await.unwrap();
    }
}
