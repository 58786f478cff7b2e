//! Many-queue subscriptions (`SubscribeMany`) against the real server process: per-mailbox
//! order, offline messages, acks that survive a new stream and a kill -9 of the server, positions
//! shared with single-queue subscriptions, positions across compactions of the consumer's
//! position log, removal, the stream-wide credit, and bad input.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use levee_client::{Client, ErrorCode, Mailboxes};
use levee_proto::v1::queues_client::QueuesClient;
use levee_proto::v1::subscribe_many_request::Kind;
use levee_proto::v1::{
    AddMailboxes, Credit, MailboxAck, MailboxAcks, SubscribeManyRequest, SubscribeManyResponse,
    SubscribeManyStart,
};
use support::{LeveeProcess, metric_value, runtime, wait_for};
use tokio::sync::mpsc;

const WAIT: Duration = Duration::from_secs(10);

/// Awaits `future`, failing the test (with the line) if it takes more than 10 s.
async fn within<T>(future: impl std::future::Future<Output = T>, line: u32) -> T {
    tokio::time::timeout(WAIT, future)
        .await
        .unwrap_or_else(|_| panic!("line {line}: no answer within {WAIT:?}"))
}

/// Takes `count` deliveries: (mailbox, offset, payload) in arrival order.
async fn take(mailboxes: &mut Mailboxes, count: usize) -> Vec<(u32, u64, String)> {
    take_raw(mailboxes, count)
        .await
        .into_iter()
        .map(|(mailbox, offset, payload)| (mailbox, offset, String::from_utf8(payload).unwrap()))
        .collect()
}

/// Takes `count` deliveries: (mailbox, offset, payload bytes) in arrival order.
async fn take_raw(mailboxes: &mut Mailboxes, count: usize) -> Vec<(u32, u64, Vec<u8>)> {
    let mut taken = Vec::new();
    while taken.len() < count {
        let delivery = within(mailboxes.next(), line!())
            .await
            .unwrap()
            .expect("the stream ended");
        taken.push((delivery.mailbox, delivery.offset, delivery.payload.to_vec()));
    }
    taken
}

/// Groups deliveries by mailbox, keeping each mailbox's arrival order.
fn by_mailbox(deliveries: &[(u32, u64, String)]) -> HashMap<u32, Vec<(u64, String)>> {
    let mut grouped: HashMap<u32, Vec<(u64, String)>> = HashMap::new();
    for (mailbox, offset, payload) in deliveries {
        grouped
            .entry(*mailbox)
            .or_default()
            .push((*offset, payload.clone()));
    }
    grouped
}

/// Asserts that nothing is delivered within 300 ms.
async fn assert_quiet(mailboxes: &mut Mailboxes, line: u32) {
    let more = tokio::time::timeout(Duration::from_millis(300), mailboxes.next()).await;
    assert!(more.is_err(), "line {line}: unexpected delivery {more:?}");
}

async fn append(client: &Client, queue: &str, from: u64, to: u64) {
    for index in from..to {
        client
            .append(queue.as_bytes(), format!("{queue}-{index}").as_bytes())
            .await
            .unwrap();
    }
}

/// Counts the deliveries that arrive until the stream is quiet for 300 ms.
async fn delivered(responses: &mut tonic::Streaming<SubscribeManyResponse>) -> usize {
    let mut count = 0;
    while let Ok(Some(response)) =
        tokio::time::timeout(Duration::from_millis(300), responses.message())
            .await
            .map(Result::unwrap)
    {
        count += response.deliveries.len();
    }
    count
}

/// A raw `SubscribeMany` stream (nothing gives credit back or acks by itself): sends the start
/// and the adds, returns the request sender and the responses.
async fn raw_stream(
    address: &str,
    consumer: &str,
    credit: u32,
    queues: &[&str],
) -> (
    mpsc::Sender<SubscribeManyRequest>,
    tonic::Streaming<SubscribeManyResponse>,
) {
    let channel = tonic::transport::Channel::from_shared(format!("http://{address}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (requests, receiver) = mpsc::channel(16);
    for kind in [
        Kind::Start(SubscribeManyStart {
            consumer: consumer.to_owned(),
            credit: Some(Credit {
                messages: credit,
                bytes: 0,
            }),
        }),
        Kind::Add(AddMailboxes {
            queues: queues
                .iter()
                .map(|queue| queue.as_bytes().to_vec())
                .collect(),
        }),
    ] {
        requests
            .send(SubscribeManyRequest { kind: Some(kind) })
            .await
            .unwrap();
    }
    let responses = QueuesClient::new(channel)
        .subscribe_many(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    (requests, responses)
}

/// The error that ends `responses`.
async fn stream_error(responses: &mut tonic::Streaming<SubscribeManyResponse>) -> tonic::Status {
    loop {
        if let Err(status) = responses.message().await {
            return status;
        }
    }
}

fn expected(queue: &str, from: u64, to: u64) -> Vec<(u64, String)> {
    (from..to)
        .map(|index| (index, format!("{queue}-{index}")))
        .collect()
}

#[test]
fn given_acks_across_position_log_compactions_then_a_kill_keeps_every_acked_position() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    let settings = [
        "--queue-sync",
        "always",
        "--queue-position-log-compact-entries",
        "30",
    ];
    let mut server = LeveeProcess::start_in(&data_dir, &settings);
    let runtime = runtime();
    let queues: Vec<String> = (0..20).map(|index| format!("user-{index}")).collect();
    let names: Vec<&[u8]> = queues.iter().map(String::as_bytes).collect();
    let rounds = 12;
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let mut mailboxes = client.subscribe_many("app", 1_000).await.unwrap();
        within(mailboxes.add(&names), line!()).await.unwrap();
        // Each round: one message per queue, delivered and acked (20 log entries a round).
        for round in 0..rounds {
            for queue in &queues {
                append(&client, queue, round, round + 1).await;
            }
            for (mailbox, offset, _) in take(&mut mailboxes, queues.len()).await {
                assert_eq!(offset, round, "mailbox {mailbox}");
                mailboxes.ack(mailbox, offset);
            }
            within(mailboxes.flush_acks(), line!()).await.unwrap();
        }
    });
    wait_for("two position log compactions", WAIT, || {
        metric_value(&server, "levee_queue_position_log_compactions_total") >= 2
    });
    server.signal("KILL");
    server.wait_exit(WAIT);
    let server = LeveeProcess::start_in(&data_dir, &settings);
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        for queue in &queues {
            append(&client, queue, rounds, rounds + 1).await;
        }
        let mut mailboxes = client.subscribe_many("app", 1_000).await.unwrap();
        let reversed: Vec<&[u8]> = names.iter().rev().copied().collect();
        within(mailboxes.add(&reversed), line!()).await.unwrap();
        // Only the message appended after the kill: every ack before it held.
        let grouped = by_mailbox(&take(&mut mailboxes, queues.len()).await);
        for (number, queue) in reversed.iter().enumerate() {
            let queue = std::str::from_utf8(queue).unwrap();
            let number = u32::try_from(number).unwrap();
            assert_eq!(grouped[&number], expected(queue, rounds, rounds + 1));
        }
        assert_quiet(&mut mailboxes, line!()).await;
    });
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_many_mailboxes_then_each_gets_its_messages_in_order_and_acks_survive_a_kill() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    let mut server = LeveeProcess::start_in(&data_dir, &["--queue-sync", "always"]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        // Offline messages: appended before anyone subscribed.
        append(&client, "user-b", 0, 2).await;
        let mut mailboxes = client.subscribe_many("app", 4).await.unwrap();
        let numbers = within(
            mailboxes.add(&[b"user-a".as_slice(), b"user-b", b"user-c"]),
            line!(),
        )
        .await
        .unwrap();
        assert_eq!(numbers, 0..3);
        append(&client, "user-a", 0, 5).await;
        append(&client, "user-c", 0, 3).await;
        let grouped = by_mailbox(&take(&mut mailboxes, 10).await);
        assert_eq!(grouped[&0], expected("user-a", 0, 5));
        assert_eq!(grouped[&1], expected("user-b", 0, 2));
        assert_eq!(grouped[&2], expected("user-c", 0, 3));
        assert_quiet(&mut mailboxes, line!()).await;

        // Acks: user-a through 2, user-c through 0; user-b not yet.
        mailboxes.ack(0, 1);
        mailboxes.ack(0, 2);
        mailboxes.ack(2, 0);
        within(mailboxes.flush_acks(), line!()).await.unwrap();

        // Removed: its queue's new messages are no longer delivered; the others' still are.
        // An ack recorded before the removal still counts (user-b through 0).
        mailboxes.ack(1, 0);
        within(mailboxes.remove(&[1]), line!()).await.unwrap();
        within(mailboxes.flush_acks(), line!()).await.unwrap();
        append(&client, "user-b", 2, 3).await;
        append(&client, "user-c", 3, 4).await;
        assert_eq!(
            take(&mut mailboxes, 1).await,
            vec![(2, 3, "user-c-3".to_owned())]
        );
        assert_quiet(&mut mailboxes, line!()).await;

        // Adding a queue twice to one stream is refused, naming it.
        let error = within(mailboxes.add(&[b"user-a".as_slice()]), line!())
            .await
            .unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::InvalidArgument));
        assert!(error.to_string().contains("already mailbox 0"), "{error}");
    });

    // kill -9: the acks were durable (sync always) when flush_acks returned.
    server.signal("KILL");
    server.wait_exit(WAIT);
    let server = LeveeProcess::start_in(&data_dir, &["--queue-sync", "always"]);
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let mut mailboxes = client.subscribe_many("app", 100).await.unwrap();
        // Another order, other numbers: positions belong to (consumer, queue).
        let numbers = within(
            mailboxes.add(&[b"user-c".as_slice(), b"user-a", b"user-b"]),
            line!(),
        )
        .await
        .unwrap();
        assert_eq!(numbers, 0..3);
        let grouped = by_mailbox(&take(&mut mailboxes, 3 + 2 + 2).await);
        assert_eq!(grouped[&0], expected("user-c", 1, 4));
        assert_eq!(grouped[&1], expected("user-a", 3, 5));
        assert_eq!(grouped[&2], expected("user-b", 1, 3));
        // A single-queue subscription of the same consumer shares the position.
        let single = client.subscribe(b"user-a", "app", 10).await.unwrap();
        assert_eq!(single.start_offset(), 3);
        // Another consumer starts from the beginning.
        let mut audit = client.subscribe_many("audit", 100).await.unwrap();
        within(audit.add(&[b"user-a".as_slice()]), line!())
            .await
            .unwrap();
        assert_eq!(take(&mut audit, 5).await[0].1, 0);
    });
}

/// The payload of message `index` sent by producer task `task`: every 37th is larger than a
/// message an append hands over with its wake-up, so it is read back from the store.
fn racing_payload(task: usize, index: usize) -> Vec<u8> {
    let mut payload = format!("t{task}-{index}").into_bytes();
    if (task * 1_000 + index).is_multiple_of(37) {
        payload.resize(5 << 10, b'x');
    }
    payload
}

#[test]
fn given_appends_racing_on_shared_mailboxes_then_each_message_arrives_once_in_order() {
    const QUEUES: usize = 8;
    const TASKS: usize = 16;
    const PER_TASK: usize = 100;
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let names: Vec<String> = (0..QUEUES).map(|queue| format!("race-{queue}")).collect();
        let mut mailboxes = client.subscribe_many("app", 50).await.unwrap();
        let queues: Vec<&[u8]> = names.iter().map(String::as_bytes).collect();
        within(mailboxes.add(&queues), line!()).await.unwrap();
        // Many tasks through one batching producer with several requests in flight: appends
        // to one queue from different requests wake its stream in any order.
        let producer =
            levee_client::Producer::new(client.clone(), levee_client::ProducerOptions::default())
                .unwrap();
        let mut tasks = Vec::new();
        for task in 0..TASKS {
            let (producer, names) = (producer.clone(), names.clone());
            tasks.push(tokio::spawn(async move {
                for index in 0..PER_TASK {
                    let queue = &names[(task + index) % QUEUES];
                    producer
                        .send(queue.as_bytes(), &racing_payload(task, index))
                        .await
                        .unwrap();
                }
            }));
        }
        let deliveries = take_raw(&mut mailboxes, TASKS * PER_TASK).await;
        for task in tasks {
            task.await.unwrap();
        }
        assert_quiet(&mut mailboxes, line!()).await;
        // Each mailbox: every offset once, in order, with the payload the queue holds there.
        let mut grouped: HashMap<u32, Vec<(u64, Vec<u8>)>> = HashMap::new();
        for (mailbox, offset, payload) in deliveries {
            grouped.entry(mailbox).or_default().push((offset, payload));
        }
        assert_eq!(grouped.len(), QUEUES);
        for (mailbox, got) in &grouped {
            let queue = names[*mailbox as usize].as_bytes();
            let stored = client.read(queue, 0, 1_000, 4 << 20).await.unwrap();
            let offsets: Vec<u64> = got.iter().map(|(offset, _)| *offset).collect();
            let count = stored.payloads.len() as u64;
            assert_eq!(
                count,
                (TASKS * PER_TASK / QUEUES) as u64,
                "mailbox {mailbox}"
            );
            assert_eq!(offsets, (0..count).collect::<Vec<_>>(), "mailbox {mailbox}");
            for ((offset, payload), want) in got.iter().zip(&stored.payloads) {
                assert_eq!(payload, &want.to_vec(), "mailbox {mailbox} offset {offset}");
            }
        }
    });
    let large = (0..TASKS)
        .flat_map(|task| (0..PER_TASK).map(move |index| racing_payload(task, index).len()))
        .filter(|len| *len > 4 << 10)
        .count() as u64;
    let handed = metric_value(&server, "levee_queue_messages_handed_over_total");
    assert!(
        handed > 0 && handed <= (TASKS * PER_TASK) as u64 - large,
        "handed over {handed} of {} ({large} too large to hand over)",
        TASKS * PER_TASK
    );
}

#[test]
fn given_an_idempotent_resend_with_another_payload_then_the_mailbox_gets_the_stored_one() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let mut mailboxes = client.subscribe_many("app", 100).await.unwrap();
        within(mailboxes.add(&[b"idem".as_slice()]), line!())
            .await
            .unwrap();
        let channel = tonic::transport::Channel::from_shared(format!("http://{}", server.grpc()))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut raw = QueuesClient::new(channel);
        // Sequence 0, then a resend of sequence 0 with another payload (answered with the
        // first offset, storing nothing), then sequence 1.
        for (sequence, payload, offset) in [(0, "first", 0), (0, "changed", 0), (1, "next", 1)] {
            let request = levee_proto::v1::AppendRequest {
                messages: vec![levee_proto::v1::AppendMessage {
                    queue: levee_proto::Bytes::from_static(b"idem"),
                    payload: levee_proto::Bytes::from(payload),
                    sequence,
                }],
                producer_id: "producer-1".to_owned(),
                producer_name: String::new(),
            };
            let offsets = raw.append(request).await.unwrap().into_inner().offsets;
            assert_eq!(offsets, vec![offset], "{payload}");
        }
        assert_eq!(
            take(&mut mailboxes, 2).await,
            vec![(0, 0, "first".to_owned()), (0, 1, "next".to_owned())]
        );
        assert_quiet(&mut mailboxes, line!()).await;
    });
    let handed = metric_value(&server, "levee_queue_messages_handed_over_total");
    assert!((1..=2).contains(&handed), "handed over {handed}");
}

#[test]
fn given_appends_after_a_raw_stream_subscribed_then_delivery_stops_at_its_credit() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let (requests, mut responses) =
            raw_stream(&server.grpc(), "slow", 5, &["h-0", "h-1"]).await;
        // Nothing yet; the adds are registered once the stream answers nothing for a while.
        assert_eq!(within(delivered(&mut responses), line!()).await, 0);
        for queue in ["h-0", "h-1"] {
            append(&client, queue, 0, 6).await;
        }
        assert_eq!(within(delivered(&mut responses), line!()).await, 5);
        for (messages, expected) in [(3, 3), (100, 4)] {
            requests
                .send(SubscribeManyRequest {
                    kind: Some(Kind::Credit(Credit { messages, bytes: 0 })),
                })
                .await
                .unwrap();
            assert_eq!(within(delivered(&mut responses), line!()).await, expected);
        }
    });
}

#[test]
fn given_stream_credit_then_delivery_stops_at_it_and_bad_input_is_refused() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        for queue in ["q-0", "q-1", "q-2"] {
            append(&client, queue, 0, 4).await;
        }
        // A raw stream, so that nothing gives credit back: 5 messages of credit over 12.
        let (requests, mut responses) =
            raw_stream(&server.grpc(), "slow", 5, &["q-0", "q-1", "q-2"]).await;
        let send = |kind: Kind| {
            let requests = requests.clone();
            async move {
                requests
                    .send(SubscribeManyRequest { kind: Some(kind) })
                    .await
                    .unwrap();
            }
        };
        assert_eq!(within(delivered(&mut responses), line!()).await, 5);
        send(Kind::Credit(Credit {
            messages: 2,
            bytes: 0,
        }))
        .await;
        assert_eq!(within(delivered(&mut responses), line!()).await, 2);

        // Bad input: a reserved name ends the stream with an error naming it.
        send(Kind::Add(AddMailboxes {
            queues: vec![b"ok".to_vec(), b"\0position".to_vec()],
        }))
        .await;
        let error = within(stream_error(&mut responses), line!()).await;
        assert_eq!(error.code(), tonic::Code::InvalidArgument);
        assert!(
            error.message().contains("queues[1]") && error.message().contains("reserved"),
            "{error:?}"
        );

        // A bad start: refused at once.
        let error = within(client.subscribe_many("", 10), line!())
            .await
            .unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::InvalidArgument));
        assert!(error.to_string().contains("consumer must be"), "{error}");
        // An ack of a mailbox never added.
        let mut mailboxes = client.subscribe_many("app", 10).await.unwrap();
        within(mailboxes.add(&[b"q-0".as_slice()]), line!())
            .await
            .unwrap();
        mailboxes.ack(7, 0);
        let error = within(mailboxes.flush_acks(), line!()).await.unwrap_err();
        assert!(error.to_string().contains("never added"), "{error}");
    });
}

#[test]
fn given_an_ack_batch_with_an_invalid_ack_then_the_acks_before_it_are_kept() {
    let server = LeveeProcess::start(&["--queue-sync", "always"]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        append(&client, "solo", 0, 3).await;
        let (requests, mut responses) = raw_stream(&server.grpc(), "c", 10, &["solo"]).await;
        assert_eq!(within(delivered(&mut responses), line!()).await, 3);
        // Offsets 0 and 1 of mailbox 0 acked, then an ack of a mailbox never added.
        let acks = MailboxAcks {
            acks: vec![
                MailboxAck {
                    mailbox: 0,
                    offset: 1,
                },
                MailboxAck {
                    mailbox: 5,
                    offset: 0,
                },
            ],
            sequence: 1,
        };
        requests
            .send(SubscribeManyRequest {
                kind: Some(Kind::Ack(acks)),
            })
            .await
            .unwrap();
        let error = within(stream_error(&mut responses), line!()).await;
        assert!(error.message().contains("never added"), "{error:?}");
        // A new stream of the same consumer starts after the valid ack.
        let mut mailboxes = client.subscribe_many("c", 10).await.unwrap();
        within(mailboxes.add(&[b"solo".as_slice()]), line!())
            .await
            .unwrap();
        assert_eq!(
            take(&mut mailboxes, 1).await,
            vec![(0, 2, "solo-2".to_owned())]
        );
    });
}

/// Review 2: while streams of a consumer ack steadily (under `always`), another stream of the
/// same consumer adds mailboxes: every add should succeed.
#[test]
fn given_a_consumer_acking_on_other_streams_then_adds_do_not_fail() {
    let server = LeveeProcess::start(&["--queue-sync", "always"]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut ackers = Vec::new();
        for acker in 0..4 {
            let queue = format!("busy-{acker}");
            let payloads: Vec<Vec<u8>> = (0..3_000)
                .map(|index: u32| index.to_le_bytes().to_vec())
                .collect();
            let batch: Vec<(&[u8], &[u8])> = payloads
                .iter()
                .map(|payload| (queue.as_bytes(), &payload[..]))
                .collect();
            client.append_batch(&batch).await.unwrap();
            let (client, stop) = (client.clone(), std::sync::Arc::clone(&stop));
            ackers.push(tokio::spawn(async move {
                let mut mailboxes = client.subscribe_many("app", 1_000).await.unwrap();
                mailboxes.add(&[queue.as_bytes()]).await.unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // Bounded: an acker that ran out of messages still sees `stop`.
                    let next = Duration::from_millis(100);
                    let Ok(delivery) = tokio::time::timeout(next, mailboxes.next()).await else {
                        continue;
                    };
                    let delivery = delivery.unwrap().unwrap();
                    mailboxes.ack(delivery.mailbox, delivery.offset);
                    mailboxes.flush_acks().await.unwrap();
                }
            }));
        }
        let mut failures = Vec::new();
        let mut adder = client.subscribe_many("app", 1_000).await.unwrap();
        for index in 0..300 {
            let queue = format!("new-{index}");
            if let Err(error) = within(adder.add(&[queue.as_bytes()]), line!()).await {
                failures.push(error.to_string());
                adder = client.subscribe_many("app", 1_000).await.unwrap();
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for acker in ackers {
            acker.await.unwrap();
        }
        assert!(
            failures.is_empty(),
            "{} of 300 adds failed, first: {:?}",
            failures.len(),
            failures.first()
        );
    });
}

/// Deletes `queue` once no subscription holds it any more (a stream's remove, or a dropped
/// subscription, reaches the server a moment after the client returns).
async fn delete_when_free(client: &Client, queue: &[u8]) {
    loop {
        match client.delete_queue(queue).await {
            Ok(existed) => {
                assert!(existed);
                return;
            }
            Err(error) if error.code() == Some(ErrorCode::FailedPrecondition) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(error) => panic!("delete: {error}"),
        }
    }
}

#[test]
#[allow(clippy::too_many_lines, reason = "one scenario, step by step")]
fn given_a_queue_deleted_and_created_again_then_its_consumers_get_the_new_one_from_its_start() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    let settings = ["--queue-sync", "always"];
    let mut server = LeveeProcess::start_in(&data_dir, &settings);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        append(&client, "driver-1", 0, 5).await;
        append(&client, "driver-2", 0, 3).await;
        // "app" takes and acks everything on a many-queue stream, "solo" on a single one.
        let mut mailboxes = client.subscribe_many("app", 100).await.unwrap();
        within(mailboxes.add(&[b"driver-1", b"driver-2"]), line!())
            .await
            .unwrap();
        for (mailbox, offset, _) in take(&mut mailboxes, 8).await {
            mailboxes.ack(mailbox, offset);
        }
        within(mailboxes.flush_acks(), line!()).await.unwrap();
        let mut solo = client.subscribe(b"driver-1", "solo", 100).await.unwrap();
        for offset in 0..5 {
            let delivery = within(solo.next(), line!()).await.unwrap().unwrap();
            assert_eq!(delivery.offset, offset);
        }
        within(solo.ack(4), line!()).await.unwrap();
        // Both hold the queue: the delete is refused and deletes nothing.
        let refused = client.delete_queue(b"driver-1").await.unwrap_err();
        assert_eq!(refused.code(), Some(ErrorCode::FailedPrecondition));
        assert!(
            refused.to_string().contains("held by an open subscription"),
            "{refused}"
        );
        assert_eq!(client.queue_info(b"driver-1").await.unwrap().next_offset, 5);
        drop(solo);
        within(mailboxes.remove(&[0]), line!()).await.unwrap();
        within(delete_when_free(&client, b"driver-1"), line!()).await;
        // "app"'s log got a forget, "solo"'s position queue went.
        assert_eq!(
            metric_value(&server, "levee_queue_position_forgets_total"),
            2
        );
        for index in 0..2 {
            let payload = format!("new-{index}");
            assert_eq!(
                client
                    .append(b"driver-1", payload.as_bytes())
                    .await
                    .unwrap(),
                index
            );
        }
        // Both consumers get the new queue from its start, not from their old positions.
        let added = within(mailboxes.add(&[b"driver-1"]), line!())
            .await
            .unwrap();
        assert_eq!(added, 2..3);
        assert_eq!(
            take(&mut mailboxes, 2).await,
            vec![(2, 0, "new-0".to_owned()), (2, 1, "new-1".to_owned())]
        );
        mailboxes.ack(2, 0);
        within(mailboxes.flush_acks(), line!()).await.unwrap();
        let solo = client.subscribe(b"driver-1", "solo", 100).await.unwrap();
        assert_eq!(solo.start_offset(), 0);
        assert_quiet(&mut mailboxes, line!()).await;
    });
    // A kill -9: the ack on the new queue holds, and so does the other queue's.
    server.signal("KILL");
    server.wait_exit(WAIT);
    let server = LeveeProcess::start_in(&data_dir, &settings);
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        append(&client, "driver-2", 3, 4).await;
        let mut mailboxes = client.subscribe_many("app", 100).await.unwrap();
        within(mailboxes.add(&[b"driver-1", b"driver-2"]), line!())
            .await
            .unwrap();
        let grouped = by_mailbox(&take(&mut mailboxes, 2).await);
        assert_eq!(grouped[&0], vec![(1, "new-1".to_owned())]);
        assert_eq!(grouped[&1], expected("driver-2", 3, 4));
        assert_quiet(&mut mailboxes, line!()).await;
        drop(server);
    });
}

#[test]
fn given_deletes_racing_adds_of_their_queues_then_the_stream_stays_and_positions_match_each_outcome()
 {
    let directory = tempfile::tempdir().unwrap();
    let server = LeveeProcess::start_in(directory.path(), &["--queue-sync", "always"]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let names: Vec<String> = (0..20).map(|index| format!("racer-{index}")).collect();
        for name in &names {
            append(&client, name, 0, 3).await;
        }
        // "app" takes and acks all three messages of every queue, then lets the queues go.
        let mut mailboxes = client.subscribe_many("app", 100).await.unwrap();
        let queues: Vec<&[u8]> = names.iter().map(String::as_bytes).collect();
        within(mailboxes.add(&queues), line!()).await.unwrap();
        for (mailbox, offset, _) in take(&mut mailboxes, 60).await {
            mailboxes.ack(mailbox, offset);
        }
        within(mailboxes.flush_acks(), line!()).await.unwrap();
        let numbers: Vec<u32> = (0..20).collect();
        within(mailboxes.remove(&numbers), line!()).await.unwrap();
        // Each queue is deleted while the stream adds it again, both at once. Whichever comes
        // first, the stream stays open: an add that meets the delete waits for it.
        let mut deleted = HashMap::new();
        for name in &names {
            let queue = [name.as_bytes()];
            let (deletion, added) = tokio::join!(
                client.delete_queue(name.as_bytes()),
                within(mailboxes.add(&queue), line!())
            );
            let mailbox = added.unwrap().start;
            let gone = match deletion {
                Ok(existed) => existed,
                // The stream's removal or its new add reached the server first.
                Err(error) if error.code() == Some(ErrorCode::FailedPrecondition) => false,
                Err(error) => panic!("delete of {name}: {error}"),
            };
            deleted.insert(mailbox, gone);
        }
        for name in &names {
            client.append(name.as_bytes(), b"new").await.unwrap();
        }
        // A deleted queue starts again at offset 0 and is delivered from there; a kept one
        // goes on after the three acked messages.
        let deliveries = take(&mut mailboxes, 20).await;
        for (mailbox, offset, payload) in &deliveries {
            let expected_offset = if deleted[mailbox] { 0 } else { 3 };
            assert_eq!(
                (*offset, payload.as_str()),
                (expected_offset, "new"),
                "mailbox {mailbox}"
            );
        }
        assert_eq!(by_mailbox(&deliveries).len(), 20);
        assert_quiet(&mut mailboxes, line!()).await;
    });
}

#[test]
fn given_batches_taken_then_each_stays_within_the_credit_and_acked_messages_are_not_delivered_again()
 {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let queues = ["b-0", "b-1", "b-2"];
        for queue in queues {
            append(&client, queue, 0, 4).await;
        }
        let names: Vec<&[u8]> = queues.iter().map(|queue| queue.as_bytes()).collect();
        let mut mailboxes = client.subscribe_many("batcher", 4).await.unwrap();
        within(mailboxes.add(&names), line!()).await.unwrap();
        let mut taken = Vec::new();
        let first = within(mailboxes.next_batch(1), line!()).await.unwrap();
        assert_eq!(first.len(), 1, "at most the number asked for");
        taken.extend(first);
        while taken.len() < 12 {
            let batch = within(mailboxes.next_batch(usize::MAX), line!())
                .await
                .unwrap();
            assert!(
                (1..=4).contains(&batch.len()),
                "a batch holds 1 to the credit's 4 messages, got {}",
                batch.len()
            );
            taken.extend(batch);
        }
        let deliveries: Vec<(u32, u64, String)> = taken
            .iter()
            .map(|delivery| {
                let payload = String::from_utf8(delivery.payload.to_vec()).unwrap();
                (delivery.mailbox, delivery.offset, payload)
            })
            .collect();
        let grouped = by_mailbox(&deliveries);
        for (mailbox, queue) in queues.iter().enumerate() {
            assert_eq!(
                grouped[&u32::try_from(mailbox).unwrap()],
                expected(queue, 0, 4)
            );
        }
        for delivery in &taken {
            mailboxes.ack(delivery.mailbox, delivery.offset);
        }
        within(mailboxes.flush_acks(), line!()).await.unwrap();
        drop(mailboxes);

        // The same consumer again: everything was acked, so only new messages come.
        let mut again = client.subscribe_many("batcher", 4).await.unwrap();
        within(again.add(&names), line!()).await.unwrap();
        append(&client, "b-1", 4, 5).await;
        let batch = within(again.next_batch(usize::MAX), line!()).await.unwrap();
        let got: Vec<(u32, u64)> = batch
            .iter()
            .map(|delivery| (delivery.mailbox, delivery.offset))
            .collect();
        assert_eq!(got, vec![(1, 4)]);
    });
}
