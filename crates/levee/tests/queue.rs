//! Queues against the real server process: append and read in order, info, list, delete, bad
//! input, and every acknowledged append surviving kill -9 of the server.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use levee_client::{Client, ErrorCode};
use support::{LeveeProcess, http_get, runtime, wait_for};

const WAIT: Duration = Duration::from_secs(10);

/// Awaits `future`, failing the test (with the line) if it takes more than 10 s.
async fn within<T>(future: impl std::future::Future<Output = T>, line: u32) -> T {
    tokio::time::timeout(WAIT, future)
        .await
        .unwrap_or_else(|_| panic!("line {line}: no answer within {WAIT:?}"))
}

/// Every page of `prefix`'s names at page size `limit`: each page but the last is full, and
/// the last one says it is the last.
async fn every_page(client: &Client, prefix: &[u8], limit: u32) -> Vec<Vec<u8>> {
    let (mut names, mut token) = (Vec::new(), Vec::new());
    for _ in 0..1_000 {
        let page = client.list_queue_page(prefix, &token, limit).await.unwrap();
        names.extend(page.queues.iter().cloned());
        if page.next_page_token.is_empty() {
            assert!(page.queues.len() <= limit as usize);
            return names;
        }
        assert_eq!(
            page.queues.len(),
            limit as usize,
            "a page before the last is full"
        );
        token = page.next_page_token;
    }
    panic!("paging never ended");
}

#[test]
fn given_internal_queues_then_paging_at_every_size_returns_every_queue_by_name_once() {
    let server = LeveeProcess::start(&[]);
    runtime().block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let mut expected: Vec<Vec<u8>> = Vec::new();
        for index in 0..40 {
            let name = format!("user-{:02}-{}", (index * 7) % 40, index % 3);
            client.append(name.as_bytes(), b"m").await.unwrap();
            expected.push(name.into_bytes());
        }
        // Internal queues beside them: a topic's partitions, a consumer's position, a deleted
        // queue's delete epoch.
        client.create_topic("payments", 8).await.unwrap();
        client
            .publish("payments", &[(&b"k"[..], &b"m"[..])])
            .await
            .unwrap();
        client.append(b"gone", b"m").await.unwrap();
        let mut mailbox = client.subscribe(b"user-00-0", "app", 10).await.unwrap();
        let delivery = mailbox.next().await.unwrap().unwrap();
        mailbox.ack(delivery.offset).await.unwrap();
        drop(mailbox);
        assert!(client.delete_queue(b"gone").await.unwrap());
        expected.sort();
        for limit in 1..=u32::try_from(expected.len()).unwrap() + 1 {
            assert_eq!(
                every_page(&client, b"", limit).await,
                expected,
                "limit {limit}"
            );
        }
        let with_prefix: Vec<Vec<u8>> = expected
            .iter()
            .filter(|name| name.starts_with(b"user-1"))
            .cloned()
            .collect();
        for limit in [1, 3, 100] {
            assert_eq!(every_page(&client, b"user-1", limit).await, with_prefix);
        }
        assert!(every_page(&client, b"nobody", 5).await.is_empty());
        let reserved = client
            .list_queue_page(b"\0topic", b"", 5)
            .await
            .unwrap_err();
        assert_eq!(reserved.code(), Some(ErrorCode::InvalidArgument));
    });
}

#[test]
fn given_a_queue_that_does_not_exist_or_is_reserved_then_read_and_info_refuse_it_alike() {
    let server = LeveeProcess::start(&[]);
    runtime().block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        for queue in [&b"never"[..], b"deleted"] {
            if queue == b"deleted" {
                client.append(queue, b"m").await.unwrap();
                assert!(client.delete_queue(queue).await.unwrap());
            }
            let read = client.read(queue, 0, 10, 0).await.unwrap_err();
            assert_eq!(read.code(), Some(ErrorCode::NotFound), "{read}");
            let info = client.queue_info(queue).await.unwrap_err();
            assert_eq!(info.code(), Some(ErrorCode::NotFound), "{info}");
        }
        // The server's own queues cannot be read or described.
        let read = client.read(b"\0meta", 0, 10, 0).await.unwrap_err();
        assert_eq!(read.code(), Some(ErrorCode::InvalidArgument), "{read}");
        let info = client.queue_info(b"\0meta").await.unwrap_err();
        assert_eq!(info.code(), Some(ErrorCode::InvalidArgument), "{info}");
        // An existing queue read past its end is empty, not an error.
        client.append(b"kept", b"m").await.unwrap();
        assert!(
            client
                .read(b"kept", 5, 10, 0)
                .await
                .unwrap()
                .payloads
                .is_empty()
        );
    });
}

#[test]
fn given_appends_then_reads_return_them_in_order_with_dense_offsets() {
    let server = LeveeProcess::start(&[]);
    runtime().block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        for index in 0..50_u64 {
            let offset = client
                .append(b"orders", format!("order-{index}").as_bytes())
                .await;
            assert_eq!(offset.unwrap(), index);
        }
        let offsets = client
            .append_batch(&[
                (b"orders", b"order-50"),
                (b"refunds", b"refund-0"),
                (b"orders", b"order-51"),
            ])
            .await
            .unwrap();
        assert_eq!(offsets, vec![50, 0, 51]);

        let mut read = Vec::new();
        let mut offset = 0;
        while offset < 52 {
            let batch = client.read(b"orders", offset, 7, 0).await.unwrap();
            assert!(!batch.payloads.is_empty());
            assert_eq!(batch.first_offset, offset);
            offset = batch.next_offset;
            read.extend(batch.payloads);
        }
        let expected: Vec<Vec<u8>> = (0..52)
            .map(|index| format!("order-{index}").into_bytes())
            .collect();
        assert_eq!(read, expected);
        let past_end = client.read(b"orders", 52, 10, 0).await.unwrap();
        assert!(
            past_end.payloads.is_empty(),
            "an offset past the end is an empty result"
        );
        assert_eq!(past_end.queue_next_offset, 52);

        let info = client.queue_info(b"orders").await.unwrap();
        assert_eq!((info.first_offset, info.next_offset), (0, 52));
        let mut names = client.list_queues(b"", 100).await.unwrap();
        names.sort();
        assert_eq!(names, vec![b"orders".to_vec(), b"refunds".to_vec()]);

        assert!(client.delete_queue(b"refunds").await.unwrap());
        assert!(!client.delete_queue(b"refunds").await.unwrap());
        let error = client.queue_info(b"refunds").await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::NotFound));
        assert_eq!(
            client.append(b"refunds", b"again").await.unwrap(),
            0,
            "re-created at 0"
        );
    });
    let (_, metrics) = http_get(server.admin_addr, "/metrics");
    assert!(
        metrics.contains("levee_queue_messages_appended_total 54"),
        "{metrics}"
    );
    // orders, refunds, and the server's own queue of delete epochs (the delete wrote it).
    assert!(metrics.contains("levee_store_queues 3"), "{metrics}");
    for counter in [
        "levee_store_budget_flushes_total",
        "levee_store_checkpoints_total",
        "levee_store_late_round_waits_total",
        "levee_store_segments_deleted_total",
        "levee_store_chunks_relocated_total",
    ] {
        assert!(
            metrics.contains(&format!("\n{counter} ")),
            "{counter}: {metrics}"
        );
    }
}

#[test]
fn given_bad_input_then_errors_name_the_problem() {
    let server = LeveeProcess::start(&["--queue-message-bytes-max", "1024"]);
    runtime().block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let error = client.append(b"", b"x").await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::InvalidArgument));
        assert!(
            error
                .to_string()
                .contains("queue name must be 1 to 255 bytes"),
            "{error}"
        );
        let error = client.append(&[b'q'; 256], b"x").await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::InvalidArgument));
        let error = client.append(b"q", &[0; 1025]).await.unwrap_err();
        assert!(error.to_string().contains("1024"), "{error}");
        let error = client.append_batch(&[]).await.unwrap_err();
        assert!(error.to_string().contains("1 to 10000 messages"), "{error}");
        let error = client.read(b"q", 0, 20_000, 0).await.unwrap_err();
        assert!(
            error
                .to_string()
                .contains("max_messages must be 1 to 10000"),
            "{error}"
        );
        // Nothing of the refused appends was stored.
        assert_eq!(
            client.queue_info(b"q").await.unwrap_err().code(),
            Some(ErrorCode::NotFound)
        );
    });
}

#[test]
fn given_acknowledged_appends_when_server_is_killed_then_all_survive_in_order() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    let mut server = LeveeProcess::start_in(&data_dir, &["--queue-sync", "always"]);
    let runtime = runtime();
    let acknowledged: Arc<Mutex<HashMap<String, Vec<u64>>>> = Arc::default();
    let address = server.grpc();
    for writer in 0..8 {
        let (acknowledged, address) = (Arc::clone(&acknowledged), address.clone());
        runtime.spawn(async move {
            let client = Client::connect(&address).await.unwrap();
            let queue = format!("queue-{writer}");
            for index in 0_u64.. {
                let payload = format!("{queue}/{index}");
                let Ok(offset) = client.append(queue.as_bytes(), payload.as_bytes()).await else {
                    return;
                };
                assert_eq!(offset, index, "offsets are dense and in order");
                acknowledged
                    .lock()
                    .unwrap()
                    .entry(queue.clone())
                    .or_default()
                    .push(offset);
            }
        });
    }
    wait_for("some acknowledged appends", WAIT, || {
        acknowledged
            .lock()
            .unwrap()
            .values()
            .map(Vec::len)
            .sum::<usize>()
            >= 400
    });
    server.signal("KILL");
    server.wait_exit(WAIT);
    let acknowledged = acknowledged.lock().unwrap().clone();

    let server = LeveeProcess::start_in(&data_dir, &["--queue-sync", "always"]);
    assert!(
        server
            .logs
            .iter()
            .any(|line| line.contains("queue store opened"))
    );
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        for (queue, offsets) in &acknowledged {
            let last = *offsets.last().unwrap();
            let mut offset = 0;
            while offset <= last {
                let batch = client
                    .read(queue.as_bytes(), offset, 1_000, 0)
                    .await
                    .unwrap();
                assert!(
                    !batch.payloads.is_empty(),
                    "{queue}: acknowledged offset {offset} lost"
                );
                for (index, payload) in batch.payloads.iter().enumerate() {
                    let expected = format!("{queue}/{}", offset + index as u64);
                    assert_eq!(payload, expected.as_bytes(), "{queue}: wrong message");
                }
                offset = batch.next_offset;
            }
        }
    });
}

#[test]
fn given_subscription_then_appends_are_pushed_in_order_within_credit_and_unacked_redelivered() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    let mut server = LeveeProcess::start_in(&data_dir, &[]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let mut subscription = client.subscribe(b"driver-7", "app", 3).await.unwrap();
        assert_eq!(subscription.start_offset(), 0);
        // Appended after subscribing: pushed, no polling.
        for index in 0..10 {
            client
                .append(b"driver-7", format!("order-{index}").as_bytes())
                .await
                .unwrap();
        }
        for index in 0..3_u64 {
            let delivery = within(subscription.next(), line!()).await.unwrap().unwrap();
            assert_eq!(delivery.offset, index);
            assert_eq!(delivery.payload, format!("order-{index}").into_bytes());
        }
        // The credit of 3 is used up: nothing more comes until an ack grants some back.
        let more = tokio::time::timeout(Duration::from_millis(300), subscription.next()).await;
        assert!(more.is_err(), "delivered beyond the credit: {more:?}");
        within(subscription.ack(1), line!()).await.unwrap();
        for index in 3..5_u64 {
            let delivery = within(subscription.next(), line!()).await.unwrap().unwrap();
            assert_eq!(delivery.offset, index);
        }
        drop(subscription);

        // Offsets 0 and 1 were acked; 2 to 4 were delivered but not: they come again.
        let mut again = client.subscribe(b"driver-7", "app", 100).await.unwrap();
        assert_eq!(again.start_offset(), 2);
        assert_eq!(
            within(again.next(), line!()).await.unwrap().unwrap().offset,
            2
        );
        within(again.ack(4), line!()).await.unwrap();
        // Another consumer has its own position.
        let other = client.subscribe(b"driver-7", "audit", 100).await.unwrap();
        assert_eq!(other.start_offset(), 0);
        // Acking what was not delivered breaks the protocol: the stream ends with the error.
        let mut bad = client.subscribe(b"driver-7", "bad", 1).await.unwrap();
        within(bad.next(), line!()).await.unwrap();
        let error = within(bad.ack(5), line!()).await.unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::OffsetOutOfRange));
        assert!(
            error
                .to_string()
                .contains("beyond the last delivered offset"),
            "{error}"
        );
        drop(again);
    });
    // A subscription open during shutdown does not hold the drain up.
    let _open = runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        client.subscribe(b"driver-7", "idle", 1).await.unwrap()
    });
    let stopping = std::time::Instant::now();
    server.signal("TERM");
    assert_eq!(server.wait_exit(WAIT).code(), Some(0));
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "took {:?}",
        stopping.elapsed()
    );

    // The acked position survives the restart.
    let server = LeveeProcess::start_in(&data_dir, &[]);
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let mut subscription = client.subscribe(b"driver-7", "app", 10).await.unwrap();
        assert_eq!(subscription.start_offset(), 5);
        assert_eq!(
            within(subscription.next(), line!())
                .await
                .unwrap()
                .unwrap()
                .offset,
            5
        );
        let names = client.list_queues(b"", 100).await.unwrap();
        assert_eq!(
            names,
            vec![b"driver-7".to_vec()],
            "position queues are not listed"
        );
        let error = client.append(b"\0position", b"x").await.unwrap_err();
        assert!(error.to_string().contains("reserved"), "{error}");
    });
}

#[test]
fn given_producer_then_concurrent_sends_share_requests_and_get_their_own_offsets() {
    let server = LeveeProcess::start(&["--queue-sync", "always"]);
    let runtime = runtime();
    let offsets = runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let options = levee_client::ProducerOptions {
            linger: Duration::from_millis(5),
            ..levee_client::ProducerOptions::default()
        };
        let producer = levee_client::Producer::new(client, options).unwrap();
        let sends: Vec<_> = (0..500_u32)
            .map(|index| {
                let producer = producer.clone();
                tokio::spawn(async move {
                    let queue = format!("queue-{}", index % 5);
                    // Half through `send_bytes` (shared bytes, no copy): the same batches.
                    let offset = if index % 2 == 0 {
                        producer.send(queue.as_bytes(), &index.to_le_bytes()).await
                    } else {
                        let payload = levee_client::Bytes::copy_from_slice(&index.to_le_bytes());
                        producer
                            .send_bytes(levee_client::Bytes::from(queue.clone()), payload)
                            .await
                    }
                    .unwrap();
                    (queue, offset, index)
                })
            })
            .collect();
        let mut offsets = Vec::new();
        for send in sends {
            offsets.push(send.await.unwrap());
        }
        let client = Client::connect(&server.grpc()).await.unwrap();
        for (queue, offset, index) in &offsets {
            let read = client.read(queue.as_bytes(), *offset, 1, 0).await.unwrap();
            assert_eq!(
                &read.payloads[0][..],
                index.to_le_bytes(),
                "offset answered to the right caller"
            );
        }
        offsets
    });
    for queue in 0..5 {
        let mut mine: Vec<u64> = offsets
            .iter()
            .filter(|(name, _, _)| *name == format!("queue-{queue}"))
            .map(|(_, offset, _)| *offset)
            .collect();
        mine.sort_unstable();
        assert_eq!(
            mine,
            (0..100).collect::<Vec<u64>>(),
            "dense offsets per queue"
        );
    }
    let appends = append_requests(&server);
    assert!(
        appends < 100,
        "500 sends should share far fewer requests, got {appends}"
    );
}

/// The server's count of successful `Append` requests.
fn append_requests(server: &LeveeProcess) -> u64 {
    support::metric_value(
        server,
        "levee_grpc_requests_total{rpc=\"/levee.v1.Queues/Append\",code=\"OK\"}",
    )
}

#[test]
fn given_batch_bytes_max_then_no_request_carries_more_unless_one_message_does() {
    let server = LeveeProcess::start(&["--queue-sync", "interval(5)"]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let producer = levee_client::Producer::new(
            client.clone(),
            levee_client::ProducerOptions {
                linger: Duration::from_millis(200),
                batch_bytes_max: 100,
                requests_in_flight_max: 1,
                ..levee_client::ProducerOptions::default()
            },
        )
        .unwrap();
        // Ten 60-byte messages: two would be 120 bytes, so each goes alone.
        let sends: Vec<_> = (0..10_u8)
            .map(|index| {
                let producer = producer.clone();
                tokio::spawn(async move { producer.send(b"sized", &[index; 60]).await })
            })
            .collect();
        for send in sends {
            send.await.unwrap().unwrap();
        }
        // A single message over the bound still goes (alone).
        producer.send(b"sized", &[7; 150]).await.unwrap();
        let read = client.read(b"sized", 0, 20, 0).await.unwrap();
        assert_eq!(read.payloads.len(), 11);
    });
    assert_eq!(append_requests(&server), 11, "one message per request");
}

#[test]
fn given_an_idle_producer_then_a_lone_send_does_not_wait_out_the_linger() {
    let server = LeveeProcess::start(&["--queue-sync", "always"]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let linger = Duration::from_secs(60);
        let eager = levee_client::Producer::new(
            client.clone(),
            levee_client::ProducerOptions {
                linger,
                ..levee_client::ProducerOptions::default()
            },
        )
        .unwrap();
        // Nothing in flight: the message goes at once, not after the minute of linger.
        let offset = tokio::time::timeout(Duration::from_secs(20), eager.send(b"idle", b"first"))
            .await
            .expect("a lone send on an idle producer answered before its linger")
            .unwrap();
        assert_eq!(offset, 0);

        let patient = levee_client::Producer::new(
            client.clone(),
            levee_client::ProducerOptions {
                linger: Duration::from_millis(300),
                send_when_idle: false,
                ..levee_client::ProducerOptions::default()
            },
        )
        .unwrap();
        let started = std::time::Instant::now();
        let offset = patient.send(b"idle", b"second").await.unwrap();
        assert_eq!(offset, 1);
        assert!(
            started.elapsed() >= Duration::from_millis(300),
            "send_when_idle off waits out the linger, answered after {:?}",
            started.elapsed()
        );
        let read = client.read(b"idle", 0, 10, 0).await.unwrap();
        assert_eq!(read.payloads, vec![b"first".to_vec(), b"second".to_vec()]);
    });
}

#[test]
fn given_retention_rule_then_oldest_messages_go_and_the_rule_survives_restart() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    let runtime = runtime();
    let payload = vec![b'x'; 1_000];
    {
        let server = LeveeProcess::start_in(&data_dir, &[]);
        runtime.block_on(async {
            let client = Client::connect(&server.grpc()).await.unwrap();
            for _ in 0..50 {
                let batch: Vec<(&[u8], &[u8])> = (0..10)
                    .flat_map(|_| [(&b"tmp-a"[..], &payload[..]), (&b"keep"[..], &payload[..])])
                    .collect();
                client.append_batch(&batch).await.unwrap();
            }
            let error = client.set_retention(b"\0position", 0, 1).await.unwrap_err();
            assert_eq!(error.code(), Some(ErrorCode::InvalidArgument));
            let removed = client.set_retention(b"tmp-", 0, 20_000).await.unwrap();
            assert!(removed > 0, "the pass runs at once");
            let info = client.queue_info(b"tmp-a").await.unwrap();
            assert!(info.first_offset > 0 && info.next_offset == 500, "{info:?}");
            assert!(info.next_offset - info.first_offset < 100, "{info:?}");
            assert_eq!(info.retention_max_bytes, 20_000);
            let read = client.read(b"tmp-a", 0, 1, 0).await.unwrap();
            assert!(read.skipped_to_first_retained);
            let kept = client.queue_info(b"keep").await.unwrap();
            assert_eq!((kept.first_offset, kept.retention_max_bytes), (0, 0));
        });
    }
    let server = LeveeProcess::start_in(&data_dir, &[]);
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let info = client.queue_info(b"tmp-a").await.unwrap();
        assert_eq!(info.retention_max_bytes, 20_000, "kept across restarts");
    });
}

/// Sends arriving while a request is in flight (staggered over many round trips,
/// several producer clones at once, `requests_in_flight_max` > 1) each answer long before a
/// minute of linger, and every batch respects `batch_messages_max`.
#[test]
fn given_staggered_sends_on_a_busy_producer_then_none_waits_out_the_linger() {
    let server = LeveeProcess::start(&["--queue-sync", "always"]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        for in_flight in [1, 3, 8] {
            let producer = levee_client::Producer::new(
                client.clone(),
                levee_client::ProducerOptions {
                    linger: Duration::from_secs(60),
                    batch_messages_max: 3,
                    requests_in_flight_max: in_flight,
                    ..levee_client::ProducerOptions::default()
                },
            )
            .unwrap();
            let queue = format!("stagger-{in_flight}");
            let mut tasks = Vec::new();
            for index in 0..200_u64 {
                let (producer, queue) = (producer.clone(), queue.clone());
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_micros(300 * (index % 50))).await;
                    tokio::time::timeout(
                        Duration::from_secs(20),
                        producer.send(queue.as_bytes(), &index.to_le_bytes()),
                    )
                    .await
                    .expect("answered well before the minute of linger")
                    .unwrap()
                }));
            }
            drop(producer);
            let mut offsets: Vec<u64> = Vec::new();
            for task in tasks {
                offsets.push(task.await.unwrap());
            }
            offsets.sort_unstable();
            assert_eq!(offsets, (0..200).collect::<Vec<_>>());
        }
    });
    // At most 3 messages a request: at least 67 requests for each producer's 200 sends.
    let requests = append_requests(&server);
    assert!(requests >= 3 * 67, "{requests} requests for 600 sends");
}

#[test]
fn given_an_idempotent_batch_that_finally_failed_then_later_sends_to_its_queue_still_succeed() {
    let server = LeveeProcess::start(&["--queue-message-bytes-max", "1024"]);
    let runtime = runtime();
    runtime.block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        let producer = levee_client::Producer::new(
            client.clone(),
            levee_client::ProducerOptions {
                idempotent: true,
                ..levee_client::ProducerOptions::default()
            },
        )
        .unwrap();
        assert_eq!(
            within(producer.send(b"ledger", b"first"), line!())
                .await
                .unwrap(),
            0
        );
        // Refused whole (over the server's message limit): its sequence is never stored.
        let refused = within(producer.send(b"ledger", &[7_u8; 2_048]), line!())
            .await
            .unwrap_err();
        assert_eq!(
            refused.code(),
            Some(ErrorCode::InvalidArgument),
            "{refused}"
        );
        // The next sends do not meet a sequence gap: the producer took a fresh id.
        for (payload, offset) in [(&b"second"[..], 1), (b"third", 2)] {
            assert_eq!(
                within(producer.send(b"ledger", payload), line!())
                    .await
                    .unwrap(),
                offset
            );
        }
        let read = client.read(b"ledger", 0, 10, 0).await.unwrap();
        assert_eq!(
            read.payloads,
            vec![b"first".to_vec(), b"second".to_vec(), b"third".to_vec()]
        );
    });
}
