//! Topics and consumer groups against the real server process: keyed publishing, in-order
//! delivery and commits that survive kill -9, rebalancing on join, leave, kill and lease
//! expiry, fencing of a stale owner, a slow consumer's bounded delivery, the rate limit, and
//! idempotent producers.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use levee_client::{Client, ConsumerOptions, ErrorCode, GroupConsumer, Producer, ProducerOptions};
use levee_proto::v1::consume_request::Kind;
use levee_proto::v1::topics_client::TopicsClient;
use levee_proto::v1::{Commit, CommitBatch, ConsumeRequest, ConsumeResponse, ConsumeStart, Credit};
use support::{LeveeProcess, http_get, http_request, runtime, wait_for};
use tokio::sync::{mpsc, oneshot};

const WAIT: Duration = Duration::from_secs(15);

/// Messages handled: (member, partition, offset, payload).
type Handled = Arc<Mutex<Vec<(String, u32, u64, String)>>>;

/// Runs a group consumer in the background; send on the returned channel to stop it.
fn spawn_consumer(
    runtime: &tokio::runtime::Runtime,
    address: &str,
    topic: &str,
    group: &str,
    member: &str,
    handled: &Handled,
    options: &ConsumerOptions,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<levee_client::ConsumerStats>,
) {
    let (stop, stopped) = oneshot::channel::<()>();
    let (address, topic, group, member) = (
        address.to_owned(),
        topic.to_owned(),
        group.to_owned(),
        member.to_owned(),
    );
    let handled = Arc::clone(handled);
    let options = options.clone();
    let task = runtime.spawn(async move {
        let client = Client::connect(&address).await.unwrap();
        let options = ConsumerOptions {
            member: Some(member.clone()),
            ..options
        };
        let consumer = GroupConsumer::new(client, &topic, &group, options).unwrap();
        consumer
            .run(
                move |message| {
                    let (handled, member) = (Arc::clone(&handled), member.clone());
                    async move {
                        handled.lock().unwrap().push((
                            member,
                            message.partition,
                            message.offset,
                            String::from_utf8(message.payload.to_vec()).unwrap(),
                        ));
                    }
                },
                async move {
                    let _ = stopped.await;
                },
            )
            .await
            .unwrap()
    });
    (stop, task)
}

fn owners(client: &Client, runtime: &tokio::runtime::Runtime, topic: &str) -> Vec<String> {
    runtime
        .block_on(client.describe_group("billing", topic))
        .map(|group| {
            group
                .partitions
                .iter()
                .map(|partition| partition.owner.clone())
                .collect()
        })
        .unwrap_or_default()
}

async fn raw_topics(address: &str) -> TopicsClient<tonic::transport::Channel> {
    let channel = tonic::transport::Channel::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    TopicsClient::new(channel)
}

/// Opens a raw consume stream; returns the request sender and the response stream.
async fn raw_member(
    address: &str,
    topic: &str,
    member: &str,
    credit: u32,
    lease_ms: u32,
) -> (
    mpsc::Sender<ConsumeRequest>,
    tonic::Streaming<ConsumeResponse>,
) {
    let (requests, receiver) = mpsc::channel(16);
    requests
        .send(ConsumeRequest {
            kind: Some(Kind::Start(ConsumeStart {
                topic: topic.to_owned(),
                group: "billing".to_owned(),
                member: member.to_owned(),
                credit: Some(Credit {
                    messages: credit,
                    bytes: 0,
                }),
                lease_ms,
            })),
        })
        .await
        .unwrap();
    let responses = raw_topics(address)
        .await
        .consume(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    (requests, responses)
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_keyed_publishes_then_group_gets_each_partition_in_order_and_commits_survive_kill_9() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    let mut server = LeveeProcess::start_in(&data_dir, &["--queue-sync", "always"]);
    let runtime = runtime();
    let client = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    runtime.block_on(async {
        assert!(!client.create_topic("orders", 4).await.unwrap());
        assert!(client.create_topic("orders", 4).await.unwrap());
        let error = client.create_topic("orders", 5).await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::AlreadyExists));
        let error = client.publish("none", &[(b"k", b"v")]).await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::NotFound));
    });
    let mut published: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    runtime.block_on(async {
        for round in 0..10 {
            let payloads: Vec<(String, String)> = (0..20)
                .map(|index| (format!("key-{index}"), format!("{round}/{index}")))
                .collect();
            let batch: Vec<(&[u8], &[u8])> = payloads
                .iter()
                .map(|(key, payload)| (key.as_bytes(), payload.as_bytes()))
                .collect();
            let placed = client.publish("orders", &batch).await.unwrap();
            for ((key, payload), (partition, offset)) in payloads.iter().zip(placed) {
                assert_eq!(partition, levee_client::topic_partition(key.as_bytes(), 4));
                let list = published.entry(partition).or_default();
                assert_eq!(offset, list.len() as u64, "dense offsets per partition");
                list.push(payload.clone());
            }
        }
    });

    let handled: Handled = Arc::default();
    let options = ConsumerOptions {
        parallelism: 3,
        ..ConsumerOptions::default()
    };
    let (stop, task) = spawn_consumer(
        &runtime,
        &server.grpc(),
        "orders",
        "billing",
        "a",
        &handled,
        &options,
    );
    wait_for("all 200 handled", WAIT, || {
        handled.lock().unwrap().len() >= 200
    });
    stop.send(()).unwrap();
    let stats = runtime.block_on(task).unwrap();
    assert_eq!(stats.handled, 200);
    assert!(stats.commits >= 1);
    let mut by_partition: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for (_, partition, offset, payload) in handled.lock().unwrap().iter() {
        let list = by_partition.entry(*partition).or_default();
        assert_eq!(
            *offset,
            list.len() as u64,
            "ordered: one at a time, in offset order"
        );
        list.push(payload.clone());
    }
    assert_eq!(by_partition, published);
    let group = runtime
        .block_on(client.describe_group("billing", "orders"))
        .unwrap();
    for partition in &group.partitions {
        assert_eq!(partition.committed_offset, partition.next_offset);
    }

    server.signal("KILL");
    server.wait_exit(WAIT);
    let server = LeveeProcess::start_in(&data_dir, &["--queue-sync", "always"]);
    let client = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    let group = runtime
        .block_on(client.describe_group("billing", "orders"))
        .unwrap();
    assert!(group.members.is_empty());
    for partition in &group.partitions {
        assert_eq!(
            partition.committed_offset, partition.next_offset,
            "commits survived kill -9"
        );
    }
    let never = runtime
        .block_on(client.describe_group("nobody", "orders"))
        .unwrap_err();
    assert_eq!(never.code(), Some(ErrorCode::NotFound));
    let again: Handled = Arc::default();
    let (stop, task) = spawn_consumer(
        &runtime,
        &server.grpc(),
        "orders",
        "billing",
        "b",
        &again,
        &options,
    );
    wait_for("the member owns every partition", WAIT, || {
        owners(&client, &runtime, "orders")
            .iter()
            .all(|owner| owner == "b")
    });
    runtime.block_on(async {
        client
            .publish("orders", &[(b"key-1", b"after restart")])
            .await
            .unwrap();
    });
    wait_for("the new message", WAIT, || {
        !again.lock().unwrap().is_empty()
    });
    std::thread::sleep(Duration::from_millis(300));
    stop.send(()).unwrap();
    runtime.block_on(task).unwrap();
    let again = again.lock().unwrap();
    assert_eq!(
        again
            .iter()
            .map(|entry| entry.3.as_str())
            .collect::<Vec<_>>(),
        vec!["after restart"],
        "nothing committed before the kill is delivered again"
    );
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_members_join_leave_die_and_go_silent_then_partitions_move_and_every_message_is_handled() {
    let server = LeveeProcess::start(&["--queue-sync", "interval(5)"]);
    let runtime = runtime();
    let client = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    runtime.block_on(client.create_topic("events", 6)).unwrap();
    let handled: Handled = Arc::default();
    let publish = |from: usize, to: usize| {
        runtime.block_on(async {
            let payloads: Vec<(String, String)> = (from..to)
                .map(|index| (format!("k{}", index % 50), format!("m{index}")))
                .collect();
            let batch: Vec<(&[u8], &[u8])> = payloads
                .iter()
                .map(|(key, payload)| (key.as_bytes(), payload.as_bytes()))
                .collect();
            client.publish("events", &batch).await.unwrap();
        });
    };
    let count_owned = |member: &str| {
        owners(&client, &runtime, "events")
            .iter()
            .filter(|owner| *owner == member)
            .count()
    };
    let options = ConsumerOptions::default();
    let address = server.grpc();
    let (stop_a, task_a) = spawn_consumer(
        &runtime, &address, "events", "billing", "a", &handled, &options,
    );
    wait_for("a owns all 6", WAIT, || count_owned("a") == 6);
    publish(0, 300);
    let (stop_b, task_b) = spawn_consumer(
        &runtime, &address, "events", "billing", "b", &handled, &options,
    );
    wait_for("a and b own 3 each", WAIT, || {
        count_owned("a") == 3 && count_owned("b") == 3
    });
    publish(300, 600);
    // c dies without leaving: its task is aborted, the connection drops.
    let (_stop_c, task_c) = spawn_consumer(
        &runtime, &address, "events", "billing", "c", &handled, &options,
    );
    wait_for("a, b and c own 2 each", WAIT, || {
        ["a", "b", "c"]
            .iter()
            .all(|member| count_owned(member) == 2)
    });
    task_c.abort();
    wait_for("c's partitions move back", WAIT, || {
        count_owned("a") == 3 && count_owned("b") == 3
    });
    publish(600, 900);
    // d goes silent: it joins on a raw stream and never talks again; its 1 s lease runs out.
    let silent = runtime.block_on(raw_member(&address, "events", "d", 10, 1_000));
    wait_for("d owns 2", WAIT, || count_owned("d") == 2);
    let silent_since = Instant::now();
    wait_for("d's lease runs out", WAIT, || count_owned("d") == 0);
    assert!(silent_since.elapsed() < Duration::from_secs(5));
    drop(silent);
    // a leaves cleanly.
    stop_a.send(()).unwrap();
    runtime.block_on(task_a).unwrap();
    wait_for("b owns all 6", WAIT, || count_owned("b") == 6);
    publish(900, 1_200);
    wait_for("everything committed", WAIT, || {
        runtime
            .block_on(client.describe_group("billing", "events"))
            .is_ok_and(|group| {
                group
                    .partitions
                    .iter()
                    .all(|partition| partition.committed_offset == partition.next_offset)
            })
    });
    stop_b.send(()).unwrap();
    runtime.block_on(task_b).unwrap();
    let handled = handled.lock().unwrap();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (_, _, _, payload) in handled.iter() {
        *seen.entry(payload.as_str()).or_default() += 1;
    }
    for index in 0..1_200 {
        assert!(
            seen.contains_key(format!("m{index}").as_str()),
            "m{index} was never handled"
        );
    }
    // Redelivery after a move is allowed (at-least-once), but only of uncommitted messages.
    assert!(handled.len() < 1_200 * 2, "{} handled", handled.len());
}

/// Skips assignments and deliveries until the answer to a commit batch; returns its first.
async fn next_commit_result(
    responses: &mut tonic::Streaming<ConsumeResponse>,
) -> levee_proto::v1::CommitResult {
    loop {
        let response = responses.message().await.unwrap().unwrap();
        if let Some(result) = response.commit_results.first() {
            return result.clone();
        }
    }
}

#[test]
fn given_partition_moved_when_old_owner_commits_then_fenced() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        client.create_topic("pay", 2).await.unwrap();
        client
            .publish("pay", &[(b"x", b"1"), (b"y", b"2"), (b"z", b"3")])
            .await
            .unwrap();
        let (requests_a, mut responses_a) = raw_member(&server.grpc(), "pay", "a", 100, 0).await;
        let first = responses_a.message().await.unwrap().unwrap();
        let old = first.assignment.unwrap().partitions;
        assert_eq!(old.len(), 2);
        let (_requests_b, mut responses_b) = raw_member(&server.grpc(), "pay", "b", 100, 0).await;
        let taken = responses_b
            .message()
            .await
            .unwrap()
            .unwrap()
            .assignment
            .unwrap()
            .partitions;
        assert_eq!(taken.len(), 1);
        let moved = taken[0].partition;
        let stale_epoch = old
            .iter()
            .find(|assigned| assigned.partition == moved)
            .unwrap()
            .epoch;
        assert!(taken[0].epoch > stale_epoch);
        requests_a
            .send(ConsumeRequest {
                kind: Some(Kind::Commit(CommitBatch {
                    commits: vec![Commit {
                        partition: moved,
                        epoch: stale_epoch,
                        next_offset: 0,
                        retry: false,
                    }],
                })),
            })
            .await
            .unwrap();
        let result = next_commit_result(&mut responses_a).await;
        assert_eq!(result.code, ErrorCode::Fenced as i32);
        assert!(
            result.message.contains("no longer owns"),
            "{}",
            result.message
        );
        // A commit past the end of a partition it owns is refused too.
        // The partition a kept did not move, so its epoch did not change.
        let kept = 1 - moved;
        let epoch = old
            .iter()
            .find(|assigned| assigned.partition == kept)
            .unwrap()
            .epoch;
        requests_a
            .send(ConsumeRequest {
                kind: Some(Kind::Commit(CommitBatch {
                    commits: vec![Commit {
                        partition: kept,
                        epoch,
                        next_offset: 1_000,
                        retry: false,
                    }],
                })),
            })
            .await
            .unwrap();
        let result = next_commit_result(&mut responses_a).await;
        assert_eq!(result.code, ErrorCode::OffsetOutOfRange as i32);
    });
}

#[test]
fn given_consumer_that_grants_no_more_credit_then_server_sends_no_more_than_the_credit() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        client.create_topic("slow", 1).await.unwrap();
        let (_requests, mut responses) = raw_member(&server.grpc(), "slow", "s", 10, 0).await;
        let payloads: Vec<Vec<u8>> = (0..100_u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let batch: Vec<(&[u8], &[u8])> =
            payloads.iter().map(|p| (&b"k"[..], p.as_slice())).collect();
        client.publish("slow", &batch).await.unwrap();
        let mut delivered = 0;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while let Ok(Ok(Some(response))) =
            tokio::time::timeout_at(deadline, responses.message()).await
        {
            delivered += response.deliveries.len();
        }
        assert_eq!(
            delivered, 10,
            "exactly the credit, then nothing until more is granted"
        );
    });
}

#[test]
fn given_group_rate_then_deliveries_are_paced_and_metrics_show_it() {
    let server = LeveeProcess::start(&["--queue-sync", "interval(5)"]);
    let runtime = runtime();
    let client = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    runtime.block_on(async {
        client.create_topic("paced", 2).await.unwrap();
        let payloads: Vec<String> = (0..3_000).map(|index| format!("p{index}")).collect();
        let batch: Vec<(&[u8], &[u8])> = payloads
            .iter()
            .map(|payload| (payload.as_bytes(), payload.as_bytes()))
            .collect();
        client.publish("paced", &batch).await.unwrap();
    });
    // Set through the admin HTTP port, as an operator would, per minute.
    let (status, body) = http_request(
        server.admin_addr,
        "PUT",
        "/v1/groups/billing/rate",
        r#"{"messages_per_minute": 24000}"#,
    );
    assert_eq!(status, 200, "{body}");
    let (status, body) = http_request(
        server.admin_addr,
        "PUT",
        "/v1/groups/billing/rate",
        r#"{"messages_per_hour": 1}"#,
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("messages_per_minute"),
        "the error shows the form: {body}"
    );
    let handled: Handled = Arc::default();
    let (stop, task) = spawn_consumer(
        &runtime,
        &server.grpc(),
        "paced",
        "billing",
        "a",
        &handled,
        &ConsumerOptions::default(),
    );
    wait_for("the first message", WAIT, || {
        !handled.lock().unwrap().is_empty()
    });
    let started = Instant::now();
    let at_start = handled.lock().unwrap().len();
    std::thread::sleep(Duration::from_secs(3));
    let in_window = handled.lock().unwrap().len() - at_start;
    let elapsed = started.elapsed().as_secs_f64();
    stop.send(()).unwrap();
    runtime.block_on(task).unwrap();
    // 400/s: never more than the rate allows (plus one 10 ms burst and a delivery round in
    // flight), and not far below it.
    let allowed = 400.0 * elapsed;
    #[allow(clippy::cast_precision_loss)]
    let in_window = in_window as f64;
    assert!(in_window <= allowed + 50.0, "{in_window} in {elapsed:.2} s");
    assert!(in_window >= allowed * 0.8, "{in_window} in {elapsed:.2} s");
    let group = runtime
        .block_on(client.describe_group("billing", "paced"))
        .unwrap();
    assert!((group.rate_limit_per_s - 400.0).abs() < 1e-9);
    assert!(group.throttled_s > 0.0);
    let (_, metrics) = http_get(server.admin_addr, "/metrics");
    assert!(
        metrics.contains(r#"levee_group_rate_limit_per_second{group="billing"} 400"#),
        "{metrics}"
    );
    assert!(metrics.contains(r#"levee_group_throttled_seconds_total{group="billing"}"#));
    // Cleared at runtime.
    runtime
        .block_on(client.set_group_rate("billing", 0.0))
        .unwrap();
    let (_, body) = http_get(server.admin_addr, "/v1/groups/billing/rate");
    assert!(body.contains(r#""messages_per_s":0.0"#), "{body}");
}

/// Appends batches of 50 (to a queue, or published to a topic) through `client` until
/// `until`; returns the messages acknowledged.
async fn append_until(client: Client, task: usize, until: Instant) -> u64 {
    let payloads: Vec<String> = (0..50).map(|index| format!("m{task}-{index}")).collect();
    let queue = format!("limited-{task}");
    let mut acknowledged = 0;
    while Instant::now() < until {
        let batch: Vec<(&[u8], &[u8])> = payloads
            .iter()
            .map(|payload| (queue.as_bytes(), payload.as_bytes()))
            .collect();
        if task.is_multiple_of(2) {
            client.append_batch(&batch).await.unwrap();
        } else {
            client.publish("limited", &batch).await.unwrap();
        }
        acknowledged += 50;
    }
    acknowledged
}

/// Unnamed appends are not paced; a named request that would wait over 10 s is refused.
fn assert_unnamed_free_and_long_wait_refused(
    runtime: &tokio::runtime::Runtime,
    client: &Client,
    named: &Client,
) {
    // Unnamed appends are not paced: 10,000 messages go in one request at once.
    let payloads: Vec<String> = (0..10_000).map(|index| format!("u{index}")).collect();
    let batch: Vec<(&[u8], &[u8])> = payloads
        .iter()
        .map(|payload| (&b"free"[..], payload.as_bytes()))
        .collect();
    let unnamed_started = Instant::now();
    runtime.block_on(client.append_batch(&batch)).unwrap();
    assert!(unnamed_started.elapsed() < Duration::from_secs(5));
    // A request that would wait over 10 s is refused at once, and stores nothing.
    runtime
        .block_on(client.set_producer_rate("checkout", 100.0))
        .unwrap();
    let error = runtime
        .block_on(named.append_batch(&batch[..2_000]))
        .unwrap_err();
    assert_eq!(error.code(), Some(ErrorCode::ResourceExhausted), "{error}");
    assert!(error.to_string().contains("limited to 100"), "{error}");
    let info = runtime.block_on(client.queue_info(b"free")).unwrap();
    assert_eq!(
        info.next_offset, 10_000,
        "the refused request stored nothing"
    );
}

#[test]
fn given_producer_rate_then_its_appends_and_publishes_are_paced_and_others_are_not() {
    let directory = tempfile::tempdir().unwrap();
    let server = LeveeProcess::start_in(directory.path(), &["--queue-sync", "interval(5)"]);
    let runtime = runtime();
    let client = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    runtime.block_on(client.create_topic("limited", 4)).unwrap();
    // Set through the admin HTTP port, as an operator would.
    let (status, body) = http_request(
        server.admin_addr,
        "PUT",
        "/v1/producers/checkout/rate",
        r#"{"messages_per_s": 1000}"#,
    );
    assert_eq!(status, 200, "{body}");
    let named = client.with_producer_name("checkout");
    let started = Instant::now();
    let until = started + Duration::from_secs(2);
    let tasks: Vec<_> = (0..4)
        .map(|task| runtime.spawn(append_until(named.clone(), task, until)))
        .collect();
    let acknowledged: u64 = tasks
        .into_iter()
        .map(|task| runtime.block_on(task).unwrap())
        .sum();
    let elapsed = started.elapsed().as_secs_f64();
    // 1,000/s over appends and publishes together: never more than the rate allows (plus the
    // bucket's 10 ms), and not far below it.
    #[allow(clippy::cast_precision_loss)]
    let acknowledged = acknowledged as f64;
    let allowed = 1_000.0 * elapsed + 10.0;
    assert!(acknowledged <= allowed, "{acknowledged} in {elapsed:.2} s");
    assert!(
        acknowledged >= 0.8 * 1_000.0 * elapsed,
        "{acknowledged} in {elapsed:.2} s"
    );
    assert_unnamed_free_and_long_wait_refused(&runtime, &client, &named);
    // Figures: on the admin port, through the CLI, and in /metrics.
    let (_, body) = http_get(server.admin_addr, "/v1/producers/checkout/rate");
    assert!(body.contains(r#""messages_per_s":100.0"#), "{body}");
    let (code, stdout, stderr) = support::run_to_exit(
        &[
            "producer",
            "describe",
            "--producer",
            "checkout",
            "--json",
            "--server",
            &server.grpc(),
        ],
        &[],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let described: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert!(
        described["admitted"].as_u64().unwrap() >= 1_000,
        "{described}"
    );
    assert!(
        described["throttled_s"].as_f64().unwrap() > 0.0,
        "{described}"
    );
    let (_, metrics) = http_get(server.admin_addr, "/metrics");
    assert!(
        metrics.contains(r#"levee_producer_rate_limit_per_second{producer_name="checkout"} 100"#),
        "{metrics}"
    );
    assert!(
        metrics.contains(r#"levee_producer_throttled_seconds_total{producer_name="checkout"}"#)
    );
    assert!(
        metrics.contains(r#"levee_producer_messages_admitted_total{producer_name="checkout"}"#)
    );
    // Kept across a restart, cleared through the CLI.
    drop(server);
    let server = LeveeProcess::start_in(directory.path(), &[]);
    let (_, body) = http_get(server.admin_addr, "/v1/producers/checkout/rate");
    assert!(body.contains(r#""messages_per_s":100.0"#), "{body}");
    let (code, _, stderr) = support::run_to_exit(
        &[
            "producer",
            "set-rate",
            "--producer",
            "checkout",
            "--per-second",
            "0",
            "--server",
            &server.grpc(),
        ],
        &[],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let (_, body) = http_get(server.admin_addr, "/v1/producers/checkout/rate");
    assert!(body.contains(r#""messages_per_s":0.0"#), "{body}");
}

#[test]
fn given_idempotent_producer_when_batches_are_resent_then_nothing_is_stored_twice() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let batch: Vec<(&[u8], &[u8], u64)> = vec![
            (b"orders", b"a", 0),
            (b"refunds", b"x", 0),
            (b"orders", b"b", 1),
        ];
        let first = client.append_idempotent("p-1", &batch).await.unwrap();
        assert_eq!(first, vec![0, 0, 1]);
        client.append(b"orders", b"other producer").await.unwrap();
        let resent = client.append_idempotent("p-1", &batch).await.unwrap();
        assert_eq!(resent, first, "a resend gets the original offsets");
        assert_eq!(client.queue_info(b"orders").await.unwrap().next_offset, 3);
        let gap = client
            .append_idempotent("p-1", &[(b"orders", b"d", 5)])
            .await
            .unwrap_err();
        assert_eq!(gap.code(), Some(ErrorCode::SequenceGap));
        assert!(gap.to_string().contains("next expected is 2"), "{gap}");

        // The batching producer numbers messages itself; 500 sends store 500 messages.
        let producer = Producer::new(
            client.clone(),
            ProducerOptions {
                idempotent: true,
                ..ProducerOptions::default()
            },
        )
        .unwrap();
        let mut sends = Vec::new();
        for index in 0..500_u32 {
            let producer = producer.clone();
            sends.push(tokio::spawn(async move {
                let queue = format!("q{}", index % 7);
                producer
                    .send(queue.as_bytes(), &index.to_le_bytes())
                    .await
                    .unwrap()
            }));
        }
        for send in sends {
            send.await.unwrap();
        }
        let mut stored = 0;
        for queue in 0..7 {
            stored += client
                .queue_info(format!("q{queue}").as_bytes())
                .await
                .unwrap()
                .next_offset;
        }
        assert_eq!(stored, 500);
    });
    let (_, metrics) = http_get(server.admin_addr, "/metrics");
    assert!(
        metrics.contains("levee_producer_messages_deduplicated_total 3"),
        "{metrics}"
    );
}

#[test]
fn given_a_commit_below_the_committed_offset_then_the_answer_says_the_offset_that_stands() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        client.create_topic("ledger", 1).await.unwrap();
        let messages: Vec<(&[u8], &[u8])> = vec![(b"k", b"m"); 5];
        client.publish("ledger", &messages).await.unwrap();
        let (requests_a, mut responses_a) = raw_member(&server.grpc(), "ledger", "a", 100, 0).await;
        let assigned = responses_a.message().await.unwrap().unwrap();
        let epoch_a = assigned.assignment.unwrap().partitions[0].epoch;
        let commit = |next_offset| ConsumeRequest {
            kind: Some(Kind::Commit(CommitBatch {
                commits: vec![Commit {
                    partition: 0,
                    epoch: epoch_a,
                    next_offset,
                    retry: false,
                }],
            })),
        };
        requests_a.send(commit(4)).await.unwrap();
        let result = next_commit_result(&mut responses_a).await;
        assert_eq!((result.code, result.next_offset), (0, 4));
        requests_a.send(commit(2)).await.unwrap();
        let result = next_commit_result(&mut responses_a).await;
        assert_eq!(
            (result.code, result.next_offset),
            (0, 4),
            "a commit below the committed offset answers the offset that stands"
        );

        // A handoff raises the epoch by one.
        let (_requests_b, mut responses_b) =
            raw_member(&server.grpc(), "ledger", "b", 100, 0).await;
        drop(requests_a);
        let taken = loop {
            let response = responses_b.message().await.unwrap().unwrap();
            if let Some(assignment) = response.assignment
                && !assignment.partitions.is_empty()
            {
                break assignment.partitions[0];
            }
        };
        assert_eq!(taken.epoch, epoch_a + 1);
        assert_eq!(taken.start_offset, 4);
    });
}

#[test]
fn given_a_member_stuck_sending_to_a_client_that_stopped_reading_then_its_lease_runs_out() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        client.create_topic("stuck", 2).await.unwrap();
        // More deliveries than the stream's response queue (16 rounds of up to 1,000) and the
        // transport's window hold.
        let payload = vec![b'x'; 100];
        for batch in 0..60_u32 {
            let messages: Vec<Vec<u8>> = (0..1_000_u32)
                .map(|index| (batch * 1_000 + index).to_le_bytes().to_vec())
                .collect();
            let pairs: Vec<(&[u8], &[u8])> = messages
                .iter()
                .map(|key| (key.as_slice(), payload.as_slice()))
                .collect();
            client.publish("stuck", &pairs).await.unwrap();
        }
        // Member a takes both partitions, then never reads nor sends again: its stream
        // fills the transport's window and its response queue, and stays stuck sending.
        let (_requests_a, _unread_a) =
            raw_member(&server.grpc(), "stuck", "a", 100_000, 1_000).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (_requests_b, mut responses_b) =
            raw_member(&server.grpc(), "stuck", "b", 100, 60_000).await;
        let started = Instant::now();
        loop {
            let response = tokio::time::timeout(Duration::from_secs(10), responses_b.message())
                .await
                .expect("b hears of every change")
                .unwrap()
                .unwrap();
            if response
                .assignment
                .is_some_and(|assignment| assignment.partitions.len() == 2)
            {
                break;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "a's partitions moved {:?} after b joined",
            started.elapsed()
        );
    });
}

#[test]
fn given_a_data_dir_of_an_older_version_then_its_catalog_is_imported_into_the_metadata_group() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    // The catalog as versions before the cluster kept it: records of the store's \0meta queue.
    {
        let (store, _) = levee_store::Store::open(
            data_dir.join("queues"),
            levee_store::StoreOptions::default(),
        )
        .unwrap();
        for record in [
            &br#"{"kind":"topic","topic":"legacy","partitions":3}"#[..],
            br#"{"kind":"group_rate","group":"billing","messages_per_s":5.0}"#,
            br#"{"kind":"producer_rate","producer_name":"checkout","messages_per_s":7.0}"#,
        ] {
            store.append(b"\0meta", record).unwrap();
        }
        store.close().unwrap();
    }
    let runtime = runtime();
    let check = |server: &LeveeProcess| {
        runtime.block_on(async {
            let client = Client::connect(&server.grpc()).await.unwrap();
            let topic = client.describe_topic("legacy").await.unwrap();
            assert_eq!(topic.partitions.len(), 3);
        });
        let (_, rate) = http_get(server.admin_addr, "/v1/groups/billing/rate");
        assert!(rate.contains("\"messages_per_s\":5.0"), "{rate}");
        let (_, producer) = http_get(server.admin_addr, "/v1/producers/checkout/rate");
        assert!(producer.contains("\"messages_per_s\":7.0"), "{producer}");
    };
    for _ in 0..2 {
        // Imported on the first start, kept by the group's own log on the second.
        let mut server = LeveeProcess::start_in(&data_dir, &[]);
        check(&server);
        server.signal("TERM");
        assert_eq!(server.wait_exit(Duration::from_secs(10)).code(), Some(0));
    }
    let (store, _) = levee_store::Store::open(
        data_dir.join("queues"),
        levee_store::StoreOptions::default(),
    )
    .unwrap();
    assert!(
        store.queue_info(b"\0meta").unwrap().is_none(),
        "the old queue is read no more, and deleted"
    );
}
