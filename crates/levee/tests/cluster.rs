//! Several `levee server` processes forming one cluster over loopback (docs/CLUSTER.md): the
//! catalog written through any node is seen by every node, and survives the leader's kill -9.

mod support;

use std::time::Duration;

use levee_client::Client;
use support::{LeveeProcess, http_get, metric_value, run_to_exit, runtime, wait_for};

/// How long a cluster may take to see a write everywhere, or to elect a new leader.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(20);

/// Starts node 1 alone, then nodes 2 and 3 joining it.
fn three_nodes(directory: &std::path::Path) -> Vec<LeveeProcess> {
    let first = LeveeProcess::start_in(
        &directory.join("n1"),
        &[
            "--node-id",
            "1",
            "--peer-addr",
            "127.0.0.1:0",
            "--shards",
            "8",
        ],
    );
    let seed = first
        .peer_addr
        .expect("node 1 logs its peer address")
        .to_string();
    let mut nodes = vec![first];
    for node_id in ["2", "3"] {
        nodes.push(LeveeProcess::start_in(
            &directory.join(format!("n{node_id}")),
            &[
                "--node-id",
                node_id,
                "--peer-addr",
                "127.0.0.1:0",
                "--join",
                &seed,
                // The cluster's shards were fixed by node 1: this is ignored.
                "--shards",
                "4",
            ],
        ));
    }
    nodes
}

/// The cluster's shards are its first node's (8), and every node places them alike: three
/// replicas each over the three voters.
fn shards_are_fixed_by_the_first_node(nodes: &[LeveeProcess]) {
    wait_for("the shard map on every node", CONVERGE_TIMEOUT, || {
        let views: Vec<serde_json::Value> = nodes.iter().map(status).collect();
        views.iter().all(|view| {
            view["shards"] == 8
                && view["shard_map"] == views[0]["shard_map"]
                && view["shard_map"].as_array().is_some_and(|map| {
                    map.len() == 8
                        && map
                            .iter()
                            .all(|placement| placement["replicas"].as_array().unwrap().len() == 3)
                })
        })
    });
    let view = status(&nodes[1]);
    let first: Vec<u64> = view["shard_map"]
        .as_array()
        .unwrap()
        .iter()
        .map(|placement| placement["replicas"][0].as_u64().unwrap())
        .collect();
    // Each shard's preferred replica as the shared function places it.
    let expected: Vec<u64> = (0..8)
        .map(|shard| levee_proto::shards::replicas(shard, &[1, 2, 3])[0])
        .collect();
    assert_eq!(first, expected);
}

/// Runs `levee server` as node `node_id` on `data_dir` (ports picked freely, peers reach it at
/// `peer_addr`), joining through `join`, until it exits: its exit code and standard error.
fn server_to_exit(
    node_id: &str,
    data_dir: &std::path::Path,
    peer_addr: &str,
    join: Option<&str>,
) -> (Option<i32>, String) {
    let mut args = vec![
        "server",
        "--node-id",
        node_id,
        "--data-dir",
        data_dir.to_str().unwrap(),
        "--grpc-addr",
        "127.0.0.1:0",
        "--admin-addr",
        "127.0.0.1:0",
        "--peer-addr",
        peer_addr,
    ];
    if let Some(join) = join {
        args.extend(["--join", join]);
    }
    let (code, _, stderr) = run_to_exit(&args, &[]);
    (code, stderr)
}

/// The topics a node knows, by name.
fn topics(runtime: &tokio::runtime::Runtime, node: &LeveeProcess) -> Vec<String> {
    runtime.block_on(async {
        let Ok(client) = Client::connect(&node.grpc()).await else {
            return Vec::new();
        };
        client
            .list_topics()
            .await
            .map(|topics| topics.into_iter().map(|topic| topic.topic).collect())
            .unwrap_or_default()
    })
}

/// The leader `node` knows and the members it sees in each role, from `/v1/cluster`.
fn cluster_view(node: &LeveeProcess) -> (Option<u64>, Vec<u64>, Vec<u64>) {
    let (status, body) = http_get(node.admin_addr, "/v1/cluster");
    assert_eq!(status, 200, "{body}");
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    let with_role = |role: &str| {
        view["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|member| member["role"] == role)
            .map(|member| member["node_id"].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    (
        view["leader_id"].as_u64(),
        with_role("leader"),
        with_role("voter"),
    )
}

/// Creates `topic` through `node`, retrying while the cluster has no leader.
fn create_topic(runtime: &tokio::runtime::Runtime, node: &LeveeProcess, topic: &str) {
    wait_for(&format!("{topic} created"), CONVERGE_TIMEOUT, || {
        runtime.block_on(async {
            let client = Client::connect(&node.grpc()).await.unwrap();
            client.create_topic(topic, 2).await.is_ok()
        })
    });
}

#[test]
fn given_three_nodes_when_the_leader_is_killed_then_the_catalog_is_kept_and_still_writable() {
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let mut nodes = three_nodes(directory.path());

    // Every node knows the same leader, and sees it and two other voters.
    wait_for("one leader and three voters", CONVERGE_TIMEOUT, || {
        let views: Vec<_> = nodes.iter().map(cluster_view).collect();
        views.iter().all(|(leader, leaders, voters)| {
            *leader == views[0].0
                && leader.is_some()
                && *leaders == [leader.unwrap()]
                && voters.len() == 2
        })
    });
    let leader_id = cluster_view(&nodes[0]).0.unwrap();
    let leading: Vec<u64> = nodes
        .iter()
        .map(|node| metric_value(node, "levee_cluster_is_leader"))
        .collect();
    assert_eq!(leading.iter().sum::<u64>(), 1, "{leading:?}");
    for node in &nodes {
        assert_eq!(metric_value(node, "levee_cluster_voters"), 3);
        assert_eq!(metric_value(node, "levee_cluster_has_leader"), 1);
    }
    // The leader reports each member's lag (none here: nothing is being written).
    let (_, exposed) = http_get(
        nodes[usize::try_from(leader_id).unwrap() - 1].admin_addr,
        "/metrics",
    );
    let lags = exposed
        .lines()
        .filter(|line| line.starts_with("levee_cluster_replication_lag_entries{"))
        .count();
    assert_eq!(lags, 3, "{exposed}");
    // The nodes that joined took the first node's cluster id.
    let cluster_ids: Vec<String> = nodes
        .iter()
        .map(|node| {
            let (_, body) = http_get(node.admin_addr, "/v1/server");
            let facts: serde_json::Value = serde_json::from_str(&body).unwrap();
            facts["cluster_id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert!(
        cluster_ids.iter().all(|id| *id == cluster_ids[0]),
        "{cluster_ids:?}"
    );
    let follower = usize::from(leader_id == 1);

    // Written through a follower: forwarded to the leader, then seen by every node.
    create_topic(&runtime, &nodes[follower], "orders");
    // Whoever wrote through a node reads it back there at once.
    assert_eq!(topics(&runtime, &nodes[follower]), ["orders"]);
    for node in &nodes {
        wait_for("orders on every node", CONVERGE_TIMEOUT, || {
            topics(&runtime, node) == ["orders"]
        });
    }

    // Losing the leader leaves two of three, a majority, which elects another.
    let leader = nodes.remove(usize::try_from(leader_id).unwrap() - 1);
    let leader_peer = leader.peer_addr.unwrap().to_string();
    leader.signal("KILL");
    drop(leader);
    create_topic(&runtime, &nodes[1], "after-failover");
    wait_for("a new leader", CONVERGE_TIMEOUT, || {
        let (leader, _, _) = cluster_view(&nodes[0]);
        leader.is_some() && leader != Some(leader_id)
    });
    for node in &nodes {
        assert!(metric_value(node, "levee_cluster_leader_changes_total") >= 1);
    }
    for node in &nodes {
        wait_for("both topics on the survivors", CONVERGE_TIMEOUT, || {
            topics(&runtime, node) == ["after-failover", "orders"]
        });
    }

    // The killed node comes back from its data dir, without --join, on the peer address the
    // members know it by, and catches up.
    let restarted = LeveeProcess::start_in(
        &directory.path().join(format!("n{leader_id}")),
        &[
            "--node-id",
            &leader_id.to_string(),
            "--peer-addr",
            &leader_peer,
        ],
    );
    wait_for("the restarted node caught up", CONVERGE_TIMEOUT, || {
        topics(&runtime, &restarted) == ["after-failover", "orders"]
    });
}

#[test]
fn given_a_node_id_in_use_when_another_node_joins_with_it_then_it_is_refused_with_the_fix() {
    let directory = tempfile::tempdir().unwrap();
    let nodes = three_nodes(directory.path());
    let seed = nodes[0].peer_addr.unwrap().to_string();
    let data_dir = directory.path().join("taken");
    let (code, stderr) = server_to_exit("2", &data_dir, "127.0.0.1:0", Some(&seed));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("node id 2 is taken"), "{stderr}");
    assert!(stderr.contains("--node-id"), "{stderr}");
}

#[test]
fn given_join_without_a_peer_address_then_the_server_refuses_to_start() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    let (code, _, stderr) = run_to_exit(
        &[
            "server",
            "--data-dir",
            data_dir.to_str().unwrap(),
            "--join",
            "127.0.0.1:7072",
        ],
        &[],
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("peer_addr"), "{stderr}");
}

/// A topic created through one node is listed at once by another (linearizable reads), and a
/// rate set through one node is in force on every node.
fn reads_and_rates_agree(runtime: &tokio::runtime::Runtime, nodes: &[LeveeProcess]) {
    // Linearizable reads: a topic created through one node is listed at once by another.
    create_topic(runtime, &nodes[1], "first");
    assert_eq!(topics(runtime, &nodes[2]), ["first"]);
    // A rate set through one node is in force on every node.
    runtime.block_on(async {
        let client = Client::connect(&nodes[2].grpc()).await.unwrap();
        client.set_producer_rate("billing", 250.0).await.unwrap();
    });
    for node in nodes {
        wait_for("the rate on every node", CONVERGE_TIMEOUT, || {
            runtime.block_on(async {
                let client = Client::connect(&node.grpc()).await.unwrap();
                let described = client.describe_producer("billing").await.unwrap();
                (described.rate_limit_per_s - 250.0).abs() < f64::EPSILON
            })
        });
    }
}

/// Hot-key rules set through one node, and a key set hot by hand through another, are in force
/// on every node.
fn hot_key_settings_reach_every_node(runtime: &tokio::runtime::Runtime, nodes: &[LeveeProcess]) {
    let rule = levee_client::HotKeyRule {
        match_kind: levee_client::MatchKind::Prefix as i32,
        key: b"sku-".to_vec(),
        window_ms: 1_000,
        threshold: 50,
        hot_duration_ms: 5_000,
        description: "cluster".to_owned(),
    };
    runtime.block_on(async {
        let first = Client::connect(&nodes[0].grpc()).await.unwrap();
        first
            .set_hot_key_rules("shop", vec![rule.clone()])
            .await
            .unwrap();
        let second = Client::connect(&nodes[1].grpc()).await.unwrap();
        second
            .set_hot_key("shop", b"sku-42", Duration::from_secs(60))
            .await
            .unwrap();
    });
    for node in nodes {
        // Rules are read linearizably: at once, on every node.
        let rules = runtime.block_on(async {
            let client = Client::connect(&node.grpc()).await.unwrap();
            client.hot_key_rules("shop").await.unwrap()
        });
        assert_eq!(rules, std::slice::from_ref(&rule));
        wait_for("the manual hot key on every node", CONVERGE_TIMEOUT, || {
            runtime.block_on(async {
                let client = Client::connect(&node.grpc()).await.unwrap();
                let hot = client.hot_keys("shop").await.unwrap();
                hot.iter().any(|event| event.key == b"sku-42")
            })
        });
    }
}

/// Keys made hot through one app server: eight, so that they fall on more than one node (all
/// eight on one of three nodes: one run in 6,561).
const SPREAD_KEYS: [&str; 8] = [
    "sku-1", "sku-2", "sku-3", "sku-4", "sku-5", "sku-6", "sku-7", "sku-8",
];

/// Two app servers, each given a different node as its only seed, follow the cluster: each
/// holds a session with every node, and a key detected hot by whichever node owns it reaches
/// both.
fn hot_keys_reach_app_servers_through_any_node(
    runtime: &tokio::runtime::Runtime,
    nodes: &[LeveeProcess],
) {
    let _entered = runtime.enter();
    let start = |node: &LeveeProcess| {
        let mut options = levee_client::HotKeysOptions::new("shop", vec![node.grpc()]);
        options.report_interval = Duration::from_millis(10);
        options.reconnect_backoff_min = Duration::from_millis(20);
        options.reconnect_backoff_max = Duration::from_millis(200);
        levee_client::HotKeys::<Vec<u8>>::start(options).unwrap()
    };
    let reporter = start(&nodes[0]);
    let watcher = start(&nodes[2]);
    wait_for("sessions with all three nodes", CONVERGE_TIMEOUT, || {
        reporter.stats().servers_connected == 3 && watcher.stats().servers_connected == 3
    });
    // The rule set above: 50 hits of sku-... within 1 s make a key hot.
    for key in SPREAD_KEYS {
        reporter.record(key.as_bytes(), 60);
    }
    wait_for("keys hot at the other app server", CONVERGE_TIMEOUT, || {
        SPREAD_KEYS
            .iter()
            .all(|key| watcher.is_hot_now(key.as_bytes()))
    });
    hot_keys_of_every_node_are_limited(runtime, nodes, &reporter);
    reporter.close();
    watcher.close();
}

/// A limits rule that limits the hot keys of "shop": the leader's grants name the keys every
/// node detected (`SPREAD_KEYS`, spread over the nodes that own them, kept hot by `reporter`),
/// not only its own.
fn hot_keys_of_every_node_are_limited(
    runtime: &tokio::runtime::Runtime,
    nodes: &[LeveeProcess],
    reporter: &levee_client::HotKeys<Vec<u8>>,
) {
    use levee_proto::v1::hot_keys_client::HotKeysClient;
    use levee_proto::v1::limits_client::LimitsClient;
    use levee_proto::v1::{
        LeaseDemand, LeaseRequest, LimitRule, ListHotKeysRequest, PerKeyLimit, SetLimitRuleRequest,
    };
    let leader_id = status(&nodes[0])["leader_id"].as_u64().unwrap();
    let leader = &nodes[usize::try_from(leader_id).unwrap() - 1];
    let hot: std::collections::BTreeSet<Vec<u8>> = SPREAD_KEYS
        .iter()
        .map(|key| key.as_bytes().to_vec())
        .collect();
    runtime.block_on(async {
        let rule = LimitRule {
            resource: "shop-calls".to_owned(),
            permits: 1_000_000,
            period_ms: 1_000,
            per_key: Some(PerKeyLimit {
                hot_key_app: "shop".to_owned(),
                hot_key_permits: 10,
                ..PerKeyLimit::default()
            }),
            ..LimitRule::default()
        };
        LimitsClient::connect(format!("http://{}", nodes[2].grpc()))
            .await
            .unwrap()
            .set_rule(SetLimitRuleRequest { rule: Some(rule) })
            .await
            .unwrap();
        let own: std::collections::BTreeSet<Vec<u8>> =
            HotKeysClient::connect(format!("http://{}", leader.grpc()))
                .await
                .unwrap()
                .list_hot_keys(ListHotKeysRequest {
                    app: "shop".to_owned(),
                })
                .await
                .unwrap()
                .into_inner()
                .hot
                .into_iter()
                .map(|event| event.key)
                .collect();
        let mut limits = LimitsClient::connect(format!("http://{}", leader.grpc()))
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let limited = loop {
            // Kept hot (a key stays hot 5 s after its last window over the threshold).
            for key in SPREAD_KEYS {
                reporter.record(key.as_bytes(), 60);
            }
            let request = LeaseRequest {
                client_id: 9,
                demands: vec![LeaseDemand {
                    resource: "shop-calls".to_owned(),
                    demand: 10,
                    ..LeaseDemand::default()
                }],
            };
            let answer = limits
                .leases(tokio_stream::iter([request]))
                .await
                .unwrap()
                .into_inner()
                .message()
                .await
                .unwrap()
                .unwrap();
            let limited: std::collections::BTreeSet<Vec<u8>> = answer.grants[0]
                .key_limits
                .iter()
                .flat_map(|limits| limits.keys.iter().map(|limit| limit.key.clone()))
                .collect();
            if hot.is_subset(&limited) || started.elapsed() > CONVERGE_TIMEOUT {
                break limited;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        // Every detected key (and the manual one set earlier, sku-42) is limited.
        assert!(
            hot.is_subset(&limited),
            "limited {limited:?}; the leader counted {own:?} itself"
        );
        assert!(!hot.is_subset(&own), "the peers counted some: {own:?}");
    });
}

/// A limits rule set through a follower is the cluster's; leases come from the leader, and a
/// follower's refusal names it.
fn leases_come_from_the_leader(runtime: &tokio::runtime::Runtime, nodes: &[LeveeProcess]) {
    use levee_proto::v1::limits_client::LimitsClient;
    use levee_proto::v1::{LeaseDemand, LeaseRequest, LimitRule, SetLimitRuleRequest};
    let leader_id = status(&nodes[0])["leader_id"].as_u64().unwrap();
    let leader = &nodes[usize::try_from(leader_id).unwrap() - 1];
    let follower = nodes
        .iter()
        .find(|node| node.grpc() != leader.grpc())
        .unwrap();
    runtime.block_on(async {
        let connect =
            |node: &LeveeProcess| LimitsClient::connect(format!("http://{}", node.grpc()));
        let mut through_follower = connect(follower).await.unwrap();
        let rule = LimitRule {
            resource: "search".to_owned(),
            permits: 600,
            period_ms: 60_000,
            ..LimitRule::default()
        };
        through_follower
            .set_rule(SetLimitRuleRequest { rule: Some(rule) })
            .await
            .unwrap();
        let request = || {
            tokio_stream::iter([LeaseRequest {
                client_id: 7,
                demands: vec![LeaseDemand {
                    resource: "search".to_owned(),
                    demand: 100,
                    ..LeaseDemand::default()
                }],
            }])
        };
        let refused = through_follower.leases(request()).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
        assert!(refused.message().contains(&leader.grpc()), "{refused:?}");
        let mut granted = connect(leader)
            .await
            .unwrap()
            .leases(request())
            .await
            .unwrap()
            .into_inner();
        let answer = granted.message().await.unwrap().unwrap();
        // 600 a minute: 1 a lease period of 100 ms.
        assert_eq!(answer.grants[0].permits, 1, "{answer:?}");
    });
}

/// Removing a node that is not a member, or adding node 0, is refused naming the problem.
fn bad_requests_say_why(node: &LeveeProcess) {
    // Bad requests say what is wrong.
    let (code, _, stderr) = run_to_exit(
        &[
            "cluster",
            "remove-node",
            "--server",
            &node.grpc(),
            "--node-id",
            "9",
        ],
        &[],
    );
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("node 9 is not a member"), "{stderr}");
    let (code, _, stderr) = run_to_exit(
        &[
            "cluster",
            "add-node",
            "--server",
            &node.grpc(),
            "--node-id",
            "0",
            "--peer-addr",
            "127.0.0.1:1",
            "--grpc-addr",
            "127.0.0.1:2",
            "--admin-addr",
            "127.0.0.1:3",
        ],
        &[],
    );
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("node_id: 0 is not a node id"), "{stderr}");
}

/// `levee cluster status --json` through `node`.
fn status(node: &LeveeProcess) -> serde_json::Value {
    let (code, stdout, stderr) = run_to_exit(
        &["cluster", "status", "--server", &node.grpc(), "--json"],
        &[],
    );
    assert_eq!(code, Some(0), "{stderr}");
    serde_json::from_str(&stdout).unwrap()
}

/// The members' ids in a status, by role.
fn members_with(view: &serde_json::Value, role: &str) -> Vec<u64> {
    view["members"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|member| member["role"] == role)
        .map(|member| member["node_id"].as_u64().unwrap())
        .collect()
}

#[test]
fn given_three_nodes_when_a_node_is_removed_then_it_stops_and_can_be_added_back() {
    let directory = tempfile::tempdir().unwrap();
    let runtime = runtime();
    let mut nodes = three_nodes(directory.path());
    wait_for(
        "a leader, two voters, all healthy",
        CONVERGE_TIMEOUT,
        || {
            let view = status(&nodes[0]);
            members_with(&view, "leader").len() == 1
                && members_with(&view, "voter").len() == 2
                && view["members"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|member| member["healthy"] == true)
        },
    );
    let leader_id = status(&nodes[0])["leader_id"].as_u64().unwrap();

    shards_are_fixed_by_the_first_node(&nodes);
    reads_and_rates_agree(&runtime, &nodes);
    hot_key_settings_reach_every_node(&runtime, &nodes);
    hot_keys_reach_app_servers_through_any_node(&runtime, &nodes);
    leases_come_from_the_leader(&runtime, &nodes);
    bad_requests_say_why(&nodes[0]);

    // A follower removed through another node stops, and says why.
    let victim_id = (1..=3).find(|id| *id != leader_id).unwrap();
    let victim_index = usize::try_from(victim_id).unwrap() - 1;
    let through = (victim_index + 1) % 3;
    let (code, _, stderr) = run_to_exit(
        &[
            "cluster",
            "remove-node",
            "--server",
            &nodes[through].grpc(),
            "--node-id",
            &victim_id.to_string(),
        ],
        &[],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let victim_peer = nodes[victim_index].peer_addr.unwrap().to_string();
    let exit = nodes[victim_index].wait_exit(CONVERGE_TIMEOUT);
    assert!(!exit.success());
    assert!(nodes[victim_index].logged("was removed from cluster"));
    let view = status(&nodes[through]);
    assert_eq!(view["members"].as_array().unwrap().len(), 2, "{view}");

    // Started again on its data dir it refuses to serve, unless added back with --join.
    let victim_dir = directory.path().join(format!("n{victim_id}"));
    let (code, stderr) = server_to_exit(&victim_id.to_string(), &victim_dir, &victim_peer, None);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("was removed from cluster"), "{stderr}");
    assert!(stderr.contains("--join"), "{stderr}");
    create_topic(&runtime, &nodes[through], "while-away");
    let seed = nodes[through].peer_addr.unwrap().to_string();
    let back = LeveeProcess::start_in(
        &victim_dir,
        &[
            "--node-id",
            &victim_id.to_string(),
            "--peer-addr",
            &victim_peer,
            "--join",
            &seed,
        ],
    );
    wait_for("the node back with every topic", CONVERGE_TIMEOUT, || {
        topics(&runtime, &back) == ["first", "while-away"]
    });
    wait_for("three members again", CONVERGE_TIMEOUT, || {
        let view = status(&back);
        view["members"].as_array().unwrap().len() == 3 && view["leader_id"].is_u64()
    });
}

#[test]
fn given_three_voters_when_a_fourth_node_joins_then_it_is_a_learner_until_promoted_by_hand() {
    let directory = tempfile::tempdir().unwrap();
    let nodes = three_nodes(directory.path());
    let seed = nodes[0].peer_addr.unwrap().to_string();
    let fourth = LeveeProcess::start_in(
        &directory.path().join("n4"),
        &[
            "--node-id",
            "4",
            "--peer-addr",
            "127.0.0.1:0",
            "--join",
            &seed,
        ],
    );
    let role_of_4 = |view: &serde_json::Value| {
        view["members"]
            .as_array()
            .unwrap()
            .iter()
            .find(|member| member["node_id"] == 4)
            .map(|member| member["role"].as_str().unwrap().to_owned())
    };
    wait_for("node 4 a learner", CONVERGE_TIMEOUT, || {
        role_of_4(&status(&nodes[0])).as_deref() == Some("learner")
    });
    assert_eq!(members_with(&status(&nodes[0]), "voter").len(), 2);
    // Promoted by hand through another node.
    let (code, stdout, stderr) = run_to_exit(
        &[
            "cluster",
            "add-node",
            "--server",
            &nodes[1].grpc(),
            "--node-id",
            "4",
            "--peer-addr",
            &fourth.peer_addr.unwrap().to_string(),
            "--grpc-addr",
            &fourth.grpc(),
            "--admin-addr",
            &fourth.admin_addr.to_string(),
            "--json",
        ],
        &[],
    );
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("\"voter\""), "{stdout}");
    wait_for("four voters", CONVERGE_TIMEOUT, || {
        let view = status(&fourth);
        role_of_4(&view).is_some_and(|role| role != "learner")
            && members_with(&view, "voter").len() + members_with(&view, "leader").len() == 4
    });
}

#[test]
fn given_a_node_of_another_cluster_when_it_joins_then_it_is_refused_with_the_fix() {
    let directory = tempfile::tempdir().unwrap();
    let other_dir = directory.path().join("other");
    let other = LeveeProcess::start_in(
        &other_dir,
        &["--node-id", "5", "--peer-addr", "127.0.0.1:0"],
    );
    drop(other);
    let member = LeveeProcess::start_in(
        &directory.path().join("member"),
        &["--node-id", "1", "--peer-addr", "127.0.0.1:0"],
    );
    let (code, stderr) = server_to_exit(
        "5",
        &other_dir,
        "127.0.0.1:0",
        Some(&member.peer_addr.unwrap().to_string()),
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("belongs to cluster"), "{stderr}");
    assert!(stderr.contains("empty data dir"), "{stderr}");
}
