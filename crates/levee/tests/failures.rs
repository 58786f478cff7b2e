//! When consumers fail, against the real server process: retries with the group's backoff,
//! dead letters with their history and redrive, retries that wait through a kill -9, delayed
//! publishes (also through a kill -9), offset resets (refused while members consume unless
//! forced, by offset, time, earliest and latest), and the bad inputs' errors.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use levee_client::{
    Client, ConsumerOptions, ConsumerStats, ErrorCode, GroupConsumer, Message, Outcome, ResetTo,
};
use levee_proto::v1::topics_client::TopicsClient;
use levee_proto::v1::{PublishMessage, PublishRequest, SetRetryPolicyRequest};
use support::{LeveeProcess, http_get, http_request, metric_value, runtime, wait_for};
use tokio::sync::oneshot;

const WAIT: Duration = Duration::from_secs(20);
/// How long a raw stream waits for a delivery that should come at once.
const DELIVERY_WAIT: Duration = Duration::from_secs(5);

/// A delivery as the handler saw it: (payload, partition, offset, attempt, retry, last error,
/// when).
type Seen = Arc<Mutex<Vec<(String, u32, u64, u32, bool, String, Instant)>>>;

type Handler = Arc<dyn Fn(&Message) -> Outcome + Send + Sync>;

fn unix_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// Runs a group member that records every delivery and answers with `decide`.
fn spawn_consumer(
    runtime: &tokio::runtime::Runtime,
    address: &str,
    (topic, group): (&str, &str),
    seen: &Seen,
    decide: Handler,
) -> (oneshot::Sender<()>, tokio::task::JoinHandle<ConsumerStats>) {
    let (stop, stopped) = oneshot::channel::<()>();
    let (address, topic, group) = (address.to_owned(), topic.to_owned(), group.to_owned());
    let seen = Arc::clone(seen);
    let task = runtime.spawn(async move {
        let client = Client::connect(&address).await.unwrap();
        let options = ConsumerOptions {
            member: Some("member".to_owned()),
            commit_interval: Duration::from_millis(20),
            backoff_max: Duration::from_millis(200),
            ..ConsumerOptions::default()
        };
        let consumer = GroupConsumer::new(client, &topic, &group, options).unwrap();
        consumer
            .run(
                move |message| {
                    let (seen, decide) = (Arc::clone(&seen), Arc::clone(&decide));
                    async move {
                        seen.lock().unwrap().push((
                            String::from_utf8_lossy(&message.payload).into_owned(),
                            message.partition,
                            message.offset,
                            message.attempt,
                            message.retry,
                            message.last_error.clone(),
                            Instant::now(),
                        ));
                        decide(&message)
                    }
                },
                async {
                    let _ = stopped.await;
                },
            )
            .await
            .unwrap()
    });
    (stop, task)
}

fn deliveries_of(seen: &Seen, payload: &str) -> usize {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|entry| entry.0 == payload)
        .count()
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn failed_messages_retry_with_backoff_then_dead_letter_and_redrive() {
    let server = LeveeProcess::start(&["--queue-sync", "always"]);
    let runtime = runtime();
    let client = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    runtime.block_on(async {
        client.create_topic("pay", 2).await.unwrap();
        let empty = client
            .set_retry_policy("cashback", &[], 3)
            .await
            .unwrap_err();
        assert_eq!(empty.code(), Some(ErrorCode::InvalidArgument));
        assert!(empty.to_string().contains("1 to 32 steps"), "{empty}");
        let absurd = client
            .set_retry_policy("cashback", &[Duration::from_secs(8 * 86_400)], 3)
            .await
            .unwrap_err();
        assert!(absurd.to_string().contains("7 days"), "{absurd}");
        let default = client.retry_policy("cashback").await.unwrap();
        assert!(default.is_default);
        assert_eq!(default.delays_ms, [1_000, 10_000, 60_000, 600_000]);
        client
            .set_retry_policy(
                "cashback",
                &[Duration::from_millis(300), Duration::from_millis(600)],
                3,
            )
            .await
            .unwrap();
        let set = client.retry_policy("cashback").await.unwrap();
        assert_eq!((set.delays_ms, set.max_attempts), (vec![300, 600], 3));
        let messages: Vec<(Vec<u8>, Vec<u8>)> = (0..10)
            .map(|index| {
                let payload = if index % 5 == 0 { "bad" } else { "good" };
                (
                    format!("key-{index}").into_bytes(),
                    format!("{payload}-{index}").into_bytes(),
                )
            })
            .collect();
        let batch: Vec<(&[u8], &[u8])> = messages
            .iter()
            .map(|(key, payload)| (key.as_slice(), payload.as_slice()))
            .collect();
        client.publish("pay", &batch).await.unwrap();
    });
    let healed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let decide: Handler = {
        let healed = Arc::clone(&healed);
        Arc::new(move |message: &Message| {
            let bad = message.payload.starts_with(b"bad");
            if bad && !healed.load(std::sync::atomic::Ordering::SeqCst) {
                Outcome::retry(format!("card service down (attempt {})", message.attempt))
            } else {
                Outcome::Success
            }
        })
    };
    let seen: Seen = Arc::default();
    let (stop, task) = spawn_consumer(&runtime, &server.grpc(), ("pay", "cashback"), &seen, decide);
    wait_for("both bad messages dead-lettered", WAIT, || {
        metric_value(
            &server,
            "levee_group_dead_lettered_total{group=\"cashback\"}",
        ) == 2
    });
    for bad in ["bad-0", "bad-5"] {
        let seen = seen.lock().unwrap();
        let attempts: Vec<_> = seen.iter().filter(|entry| entry.0 == bad).collect();
        assert_eq!(attempts.len(), 3, "{bad}: max_attempts deliveries");
        let numbers: Vec<u32> = attempts.iter().map(|entry| entry.3).collect();
        assert_eq!(numbers, [1, 2, 3], "{bad}: attempts counted");
        assert_eq!(
            (attempts[0].4, attempts[1].4, attempts[2].4),
            (false, true, true)
        );
        assert_eq!(attempts[2].5, "card service down (attempt 2)");
        assert_eq!(attempts[1].2, attempts[0].2, "the original offset is kept");
        assert_eq!(attempts[1].1, attempts[0].1, "and the partition");
        let waited = [attempts[1].6 - attempts[0].6, attempts[2].6 - attempts[1].6];
        assert!(
            waited[0] >= Duration::from_millis(300) && waited[1] >= Duration::from_millis(600),
            "{bad}: the schedule's delays, waited {waited:?}"
        );
    }
    for index in [1, 2, 3, 4, 6, 7, 8, 9] {
        assert_eq!(deliveries_of(&seen, &format!("good-{index}")), 1);
    }
    assert_eq!(
        metric_value(
            &server,
            "levee_group_retries_scheduled_total{group=\"cashback\"}"
        ),
        4
    );
    // Everything is committed: the failures did not hold the partitions up.
    wait_for("commits past every message", WAIT, || {
        let Ok(group) = runtime.block_on(client.describe_group("cashback", "pay")) else {
            return false;
        };
        group.partitions.iter().all(|partition| {
            partition.committed_offset == partition.next_offset
                && partition.retry_committed_offset == partition.retry_next_offset
        })
    });
    let group = runtime
        .block_on(client.describe_group("cashback", "pay"))
        .unwrap();
    assert_eq!((group.retries_scheduled, group.dead_lettered), (4, 2));

    let page = runtime
        .block_on(client.dead_letters("cashback", "pay", 0, 100))
        .unwrap();
    assert_eq!(page.dead_letters.len(), 2);
    assert_eq!(page.next_offset, 2);
    for letter in &page.dead_letters {
        assert!(letter.payload.starts_with(b"bad"));
        assert_eq!(letter.attempts, 3);
        let errors: Vec<&str> = letter.history.iter().map(|f| f.error.as_str()).collect();
        assert_eq!(
            errors,
            [
                "card service down (attempt 1)",
                "card service down (attempt 2)",
                "card service down (attempt 3)"
            ]
        );
    }
    let (code, json) = http_get(
        server.admin_addr,
        "/v1/groups/cashback/topics/pay/dead-letters",
    );
    assert_eq!(code, 200, "{json}");
    assert!(json.contains("card service down (attempt 3)"), "{json}");

    // The CLI lists them and shows the policy; a bad policy names the bound.
    let cli = |args: &[&str]| server.cli(args);
    let (code, listed, _) = cli(&[
        "group",
        "dead-letters",
        "--group",
        "cashback",
        "--topic",
        "pay",
    ]);
    assert_eq!(code, Some(0));
    assert!(listed.contains("\"attempts\":3"), "{listed}");
    let (code, policy, _) = cli(&["group", "retry-policy", "--group", "cashback"]);
    assert_eq!(code, Some(0));
    assert!(policy.contains("600"), "{policy}");
    let (code, _, refused) = cli(&[
        "group",
        "set-retry-policy",
        "--group",
        "other",
        "--delays-ms",
        "0",
        "--max-attempts",
        "3",
    ]);
    assert_ne!(code, Some(0));
    assert!(refused.contains("1 ms to"), "{refused}");

    // Redrive one, then the rest; the handler is healed.
    healed.store(true, std::sync::atomic::Ordering::SeqCst);
    runtime.block_on(async {
        let missing = client
            .redrive_dead_letters("cashback", "pay", Some(&[7]))
            .await
            .unwrap_err();
        assert_eq!(missing.code(), Some(ErrorCode::NotFound));
        assert!(missing.to_string().contains("dead letter 7"), "{missing}");
        let first = page.dead_letters[0].offset;
        assert_eq!(
            client
                .redrive_dead_letters("cashback", "pay", Some(&[first]))
                .await
                .unwrap(),
            1
        );
        let again = client
            .redrive_dead_letters("cashback", "pay", Some(&[first]))
            .await
            .unwrap_err();
        assert_eq!(again.code(), Some(ErrorCode::NotFound), "redriven already");
        let left = client
            .dead_letters("cashback", "pay", 0, 100)
            .await
            .unwrap();
        assert_eq!(left.dead_letters.len(), 1, "a redriven one is not listed");
        let left_offset = left.dead_letters[0].offset.to_string();
        let (code, redriven, _) = cli(&[
            "group",
            "redrive",
            "--group",
            "cashback",
            "--topic",
            "pay",
            "--offsets",
            &left_offset,
        ]);
        assert_eq!(code, Some(0));
        assert!(redriven.contains("\"redriven\":1"), "{redriven}");
        assert_eq!(
            client
                .redrive_dead_letters("cashback", "pay", None)
                .await
                .unwrap(),
            0,
            "nothing left: a redrive of all redrives none"
        );
        let none = client
            .dead_letters("cashback", "pay", 0, 100)
            .await
            .unwrap();
        assert!(none.dead_letters.is_empty());
    });
    wait_for("both redriven messages handled", WAIT, || {
        deliveries_of(&seen, "bad-0") == 4 && deliveries_of(&seen, "bad-5") == 4
    });
    assert_eq!(
        metric_value(&server, "levee_group_redriven_total{group=\"cashback\"}"),
        2
    );
    stop.send(()).unwrap();
    let stats = runtime.block_on(task).unwrap();
    assert_eq!((stats.retried, stats.dead_lettered), (4, 2));
    let last = seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.3, 1, "a redriven message starts its attempts again");
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn retries_waiting_and_delayed_publishes_survive_kill_9() {
    let server = LeveeProcess::start(&["--queue-sync", "always"]);
    let data_dir = server.data_dir.clone();
    let runtime = runtime();
    let client = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    runtime.block_on(async {
        client.create_topic("rides", 3).await.unwrap();
        client
            .set_retry_policy("billing", &[Duration::from_millis(1_500)], 5)
            .await
            .unwrap();
        let batch: Vec<(Vec<u8>, Vec<u8>)> = (0..6)
            .map(|index| {
                (
                    format!("k{index}").into_bytes(),
                    format!("ride-{index}").into_bytes(),
                )
            })
            .collect();
        let batch: Vec<(&[u8], &[u8])> = batch
            .iter()
            .map(|(key, payload)| (key.as_slice(), payload.as_slice()))
            .collect();
        client.publish("rides", &batch).await.unwrap();
    });
    // The first attempt fails; retries succeed.
    let decide: Handler = Arc::new(|message: &Message| {
        if message.attempt == 1 {
            Outcome::retry("first try fails")
        } else {
            Outcome::Success
        }
    });
    let seen: Seen = Arc::default();
    let (stop, task) = spawn_consumer(
        &runtime,
        &server.grpc(),
        ("rides", "billing"),
        &seen,
        Arc::clone(&decide),
    );
    wait_for("every first attempt committed past", WAIT, || {
        let Ok(group) = runtime.block_on(client.describe_group("billing", "rides")) else {
            return false; // Not joined yet.
        };
        metric_value(
            &server,
            "levee_group_retries_scheduled_total{group=\"billing\"}",
        ) == 6
            && group
                .partitions
                .iter()
                .all(|partition| partition.committed_offset == partition.next_offset)
    });
    let deliver_at = runtime.block_on(async {
        client
            .publish_delayed("rides", &[(b"k9", b"later")], Duration::from_millis(1_500))
            .await
            .unwrap()
    });
    assert!(deliver_at[0].1 >= unix_ms() + 1_000, "{deliver_at:?}");
    assert!(
        metric_value(&server, "levee_delayed_messages_waiting") >= 7,
        "6 retries and 1 delayed publish wait"
    );
    let mut server = server;
    server.signal("KILL");
    server.wait_exit(WAIT);
    stop.send(()).unwrap();
    let _ = runtime.block_on(task);
    let retried_before = seen.lock().unwrap().iter().filter(|entry| entry.4).count();
    assert_eq!(
        retried_before, 0,
        "the retries were still waiting at the kill"
    );

    let server = LeveeProcess::start_in(&data_dir, &["--queue-sync", "always"]);
    let seen_after: Seen = Arc::default();
    let (stop, task) = spawn_consumer(
        &runtime,
        &server.grpc(),
        ("rides", "billing"),
        &seen_after,
        decide,
    );
    wait_for(
        "every retry and the delayed message delivered",
        WAIT,
        || seen_after.lock().unwrap().len() >= 7,
    );
    std::thread::sleep(Duration::from_millis(300));
    stop.send(()).unwrap();
    runtime.block_on(task).unwrap();
    let seen_after = seen_after.lock().unwrap();
    let mut retried: Vec<&str> = seen_after
        .iter()
        .filter(|entry| entry.4)
        .map(|entry| entry.0.as_str())
        .collect();
    retried.sort_unstable();
    assert_eq!(
        retried,
        ["ride-0", "ride-1", "ride-2", "ride-3", "ride-4", "ride-5"],
        "every waiting retry delivered once, as a retry (attempt 2)"
    );
    assert!(
        seen_after
            .iter()
            .filter(|entry| entry.4)
            .all(|entry| entry.3 == 2)
    );
    let fresh: Vec<&str> = seen_after
        .iter()
        .filter(|entry| !entry.4)
        .map(|entry| entry.0.as_str())
        .collect();
    assert_eq!(
        fresh,
        ["later"],
        "the delayed publish, and no original again"
    );
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn delayed_publishes_wait_and_offset_resets_replay() {
    let server = LeveeProcess::start(&["--queue-sync", "always"]);
    let runtime = runtime();
    let client = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    runtime.block_on(async {
        client.create_topic("events", 1).await.unwrap();
        // Bad delays.
        let mut raw = TopicsClient::connect(format!("http://{}", server.grpc()))
            .await
            .unwrap();
        let publish = |message: PublishMessage, producer_id: &str| PublishRequest {
            topic: "events".to_owned(),
            messages: vec![message],
            producer_id: producer_id.to_owned(),
            producer_name: String::new(),
        };
        let too_far = raw
            .publish(publish(
                PublishMessage {
                    delay_ms: 8 * 86_400_000,
                    ..PublishMessage::default()
                },
                "",
            ))
            .await
            .unwrap_err();
        assert!(too_far.message().contains("7 days"), "{too_far:?}");
        let far_time = raw
            .publish(publish(
                PublishMessage {
                    deliver_at_ms: unix_ms() + 8 * 86_400_000,
                    ..PublishMessage::default()
                },
                "",
            ))
            .await
            .unwrap_err();
        assert!(far_time.message().contains("7 days"), "{far_time:?}");
        let idempotent = raw
            .publish(publish(
                PublishMessage {
                    delay_ms: 10,
                    sequence: 1,
                    ..PublishMessage::default()
                },
                "p1",
            ))
            .await
            .unwrap_err();
        assert!(
            idempotent.message().contains("producer_id"),
            "{idempotent:?}"
        );
        client
            .publish("events", &[(b"a", b"e0"), (b"a", b"e1")])
            .await
            .unwrap();
    });
    let published_at = Instant::now();
    let due = runtime
        .block_on(client.publish_delayed("events", &[(b"a", b"late")], Duration::from_millis(400)))
        .unwrap();
    let seen: Seen = Arc::default();
    let (stop, task) = spawn_consumer(
        &runtime,
        &server.grpc(),
        ("events", "audit"),
        &seen,
        Arc::new(|_: &Message| Outcome::Success),
    );
    wait_for("the delayed message", WAIT, || {
        deliveries_of(&seen, "late") == 1
    });
    let late = seen
        .lock()
        .unwrap()
        .iter()
        .find(|entry| entry.0 == "late")
        .cloned()
        .unwrap();
    assert!(
        late.6 - published_at >= Duration::from_millis(400),
        "not before its time (due {due:?})"
    );
    assert_eq!(late.2, 2, "it got its offset when delivered");
    wait_for("all committed", WAIT, || {
        runtime
            .block_on(client.describe_group("audit", "events"))
            .is_ok_and(|group| group.partitions[0].committed_offset == 3)
    });

    // Members consume: a reset is refused, unless forced.
    runtime.block_on(async {
        let refused = client
            .reset_group_offsets("audit", "events", &[], ResetTo::Earliest(true), false)
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Some(ErrorCode::FailedPrecondition));
        assert!(refused.to_string().contains("force"), "{refused}");
        let past = client
            .reset_group_offsets("audit", "events", &[], ResetTo::Offset(99), true)
            .await
            .unwrap_err();
        assert_eq!(past.code(), Some(ErrorCode::OffsetOutOfRange));
        let bad_partition = client
            .reset_group_offsets("audit", "events", &[3], ResetTo::Latest(true), true)
            .await
            .unwrap_err();
        assert_eq!(bad_partition.code(), Some(ErrorCode::InvalidArgument));
        let reset = client
            .reset_group_offsets("audit", "events", &[], ResetTo::Offset(1), true)
            .await
            .unwrap();
        assert_eq!(reset.members_fenced, 1);
        assert_eq!(reset.partitions[0].committed_offset, 1);
    });
    wait_for(
        "the member rejoined and replayed from offset 1",
        WAIT,
        || deliveries_of(&seen, "e1") == 2 && deliveries_of(&seen, "late") == 2,
    );
    assert_eq!(deliveries_of(&seen, "e0"), 1, "offset 0 is not replayed");
    stop.send(()).unwrap();
    runtime.block_on(task).unwrap();

    // Without members: by time and to the ends. A partition's messages are stamped per chunk
    // (4 KiB by default): a reset by time starts at most one chunk early, never late.
    let hundred_bytes = |index: u32| format!("{index:0100}").into_bytes();
    let publish_hundred = |from: u32| {
        let payloads: Vec<Vec<u8>> = (from..from + 100).map(hundred_bytes).collect();
        let batch: Vec<(&[u8], &[u8])> = payloads.iter().map(|p| (&b"a"[..], &p[..])).collect();
        runtime.block_on(client.publish("events", &batch)).unwrap();
    };
    publish_hundred(0);
    std::thread::sleep(Duration::from_millis(50));
    let between = unix_ms();
    std::thread::sleep(Duration::from_millis(50));
    publish_hundred(100);
    runtime.block_on(async {
        let by_time = client
            .reset_group_offsets(
                "audit",
                "events",
                &[0],
                ResetTo::TimestampMs(between),
                false,
            )
            .await
            .unwrap();
        let at = by_time.partitions[0].committed_offset;
        assert!(
            (103 - 41..=103).contains(&at),
            "the first message after the time is offset 103; got {at}"
        );
        let earliest = client
            .reset_group_offsets("audit", "events", &[], ResetTo::Earliest(true), false)
            .await
            .unwrap();
        assert_eq!(earliest.partitions[0].committed_offset, 0);
        assert!(!earliest.partitions[0].before_retention);
        let latest = client
            .reset_group_offsets("audit", "events", &[], ResetTo::Latest(true), false)
            .await
            .unwrap();
        assert_eq!(latest.partitions[0].committed_offset, 203);
        let group = client.describe_group("audit", "events").await.unwrap();
        assert_eq!(
            group.partitions[0].committed_offset, 203,
            "resets are committed"
        );
        // A bad request names the fix.
        let mut raw = TopicsClient::connect(format!("http://{}", server.grpc()))
            .await
            .unwrap();
        let nowhere = raw
            .reset_group_offsets(levee_proto::v1::ResetGroupOffsetsRequest {
                group: "audit".to_owned(),
                topic: "events".to_owned(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(
            nowhere.message().contains("earliest, latest"),
            "{nowhere:?}"
        );
        let _ = raw
            .set_retry_policy(SetRetryPolicyRequest {
                group: "audit".to_owned(),
                reset_to_default: true,
                ..Default::default()
            })
            .await
            .unwrap();
    });
}

/// The next response with deliveries on a raw stream (others skipped), within
/// [`DELIVERY_WAIT`].
async fn next_deliveries(
    responses: &mut tonic::Streaming<levee_proto::v1::ConsumeResponse>,
) -> Vec<levee_proto::v1::TopicDelivery> {
    loop {
        let response = tokio::time::timeout(DELIVERY_WAIT, responses.message())
            .await
            .expect("a delivery within the wait: the stream's credit must not leak")
            .unwrap()
            .unwrap();
        if !response.deliveries.is_empty() {
            return response.deliveries;
        }
    }
}

#[test]
fn given_a_byte_window_given_back_in_full_then_first_deliveries_and_retries_keep_flowing() {
    use levee_proto::v1::consume_request::Kind;
    use levee_proto::v1::{
        ConsumeRequest, ConsumeStart, Credit, MessageOutcome, OutcomeAction, OutcomeBatch,
    };
    let server = LeveeProcess::start(&["--queue-sync", "always"]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        client.create_topic("small", 1).await.unwrap();
        // A window of ten 100-byte payloads, given back in full after each round: a retry
        // record's history must not be charged, or the window shrinks with every retry until
        // nothing more is delivered.
        let (requests, receiver) = tokio::sync::mpsc::channel(16);
        let start = ConsumeStart {
            topic: "small".to_owned(),
            group: "tight".to_owned(),
            member: "m".to_owned(),
            credit: Some(Credit {
                messages: 10,
                bytes: 1_000,
            }),
            lease_ms: 0,
        };
        requests
            .send(ConsumeRequest {
                kind: Some(Kind::Start(start)),
            })
            .await
            .unwrap();
        let mut responses = TopicsClient::connect(format!("http://{}", server.grpc()))
            .await
            .unwrap()
            .consume(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await
            .unwrap()
            .into_inner();
        let give_back = |messages: u32, bytes: u32| ConsumeRequest {
            kind: Some(Kind::Credit(Credit { messages, bytes })),
        };
        for round in 0..16_u8 {
            let payload = vec![round; 100];
            client
                .publish("small", &[(b"k".as_slice(), payload.as_slice())])
                .await
                .unwrap();
            let first = next_deliveries(&mut responses).await.remove(0);
            assert_eq!((first.retry, first.payload.len()), (false, 100));
            let outcome = MessageOutcome {
                partition: first.partition,
                epoch: first.epoch,
                offset: first.offset,
                retry: false,
                action: OutcomeAction::Retry as i32,
                delay_ms: 1,
                error: "a long error text that makes the retry record bigger than its payload"
                    .to_owned(),
            };
            requests
                .send(ConsumeRequest {
                    kind: Some(Kind::Outcomes(OutcomeBatch {
                        outcomes: vec![outcome],
                    })),
                })
                .await
                .unwrap();
            let retried = next_deliveries(&mut responses).await.remove(0);
            assert!(retried.retry, "round {round}: the retry comes back");
            assert_eq!(retried.payload, first.payload);
            requests.send(give_back(2, 200)).await.unwrap();
        }
    });
}

#[test]
fn given_the_admin_port_then_policies_resets_and_redrives_are_json_with_clear_errors() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    let client = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    runtime.block_on(async {
        client.create_topic("audit", 2).await.unwrap();
        client
            .publish("audit", &[(b"a", b"1"), (b"b", b"2"), (b"c", b"3")])
            .await
            .unwrap();
    });
    let admin = server.admin_addr;
    let (code, body) = http_request(
        admin,
        "PUT",
        "/v1/groups/ops/retry-policy",
        r#"{"delays_ms": [500, 5000], "max_attempts": 3}"#,
    );
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""is_default":false"#), "{body}");
    let (code, body) = http_request(
        admin,
        "PUT",
        "/v1/groups/ops/retry-policy",
        r#"{"delays_ms": [], "max_attempts": 3}"#,
    );
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("1 to 32 steps"), "{body}");
    let (code, body) = http_request(admin, "DELETE", "/v1/groups/ops/retry-policy", "");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""is_default":true"#), "{body}");

    let reset = "/v1/groups/ops/topics/audit/offsets/reset";
    let (code, body) = http_request(admin, "POST", reset, r#"{"to": "latest"}"#);
    assert_eq!(code, 200, "{body}");
    let group = runtime
        .block_on(client.describe_group("ops", "audit"))
        .unwrap();
    let ends: Vec<u64> = group.partitions.iter().map(|p| p.next_offset).collect();
    let committed: Vec<u64> = group
        .partitions
        .iter()
        .map(|p| p.committed_offset)
        .collect();
    assert_eq!(committed, ends, "reset to the end of every partition");
    let (code, body) = http_request(admin, "POST", reset, r#"{"to": {"offset": 1000}}"#);
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("OFFSET_OUT_OF_RANGE"), "{body}");
    let (code, body) = http_request(admin, "POST", reset, r#"{"to": "somewhere"}"#);
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("earliest"), "{body}");

    let redrive = "/v1/groups/ops/topics/audit/dead-letters/redrive";
    let (code, body) = http_request(admin, "POST", redrive, r#"{"offsets": [0]}"#);
    assert_eq!(code, 404, "{body}");
    assert!(body.contains("dead letter 0 does not exist"), "{body}");
    let (code, body) = http_request(admin, "POST", redrive, r#"{"all": true}"#);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""redriven":0"#), "{body}");
    let (code, body) = http_request(admin, "POST", redrive, r#"{"all": true, "offsets": [1]}"#);
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("not both"), "{body}");
}
