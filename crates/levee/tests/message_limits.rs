//! Message size limits against the real server process, through raw gRPC as a client written
//! from proto/ would call it: the largest hot-key report the documented limits allow is
//! counted, one byte more ends the session with a Levee error (never a silent OK), and an
//! append over the gRPC message limit answers a Levee code in its trailers.

mod support;

use std::time::Duration;

use levee_proto::v1::hot_key_client_message::Kind;
use levee_proto::v1::hot_keys_client::HotKeysClient;
use levee_proto::v1::queues_client::QueuesClient;
use levee_proto::v1::{
    AppendMessage, AppendRequest, ErrorCode, Hello, HotKeyClientMessage, KeyReport, ReportBatch,
};
use levee_proto::{ERROR_CODE_METADATA_KEY, ERROR_REASON_METADATA_KEY, WireError};
use prost::Message;
use support::{LeveeProcess, metric_value, runtime, wait_for};

/// The largest report message the default limits allow: 10,000 keys of 1,024 bytes with 14
/// bytes of framing each, and 6 for the batch (proto/levee/v1/hotkey.proto).
const REPORT_MESSAGE_BYTES_MAX: usize = 10_000 * (1_024 + 14) + 6;

fn hello() -> HotKeyClientMessage {
    HotKeyClientMessage {
        kind: Some(Kind::Hello(Hello {
            app: "shop".to_owned(),
            client_id: "raw".to_owned(),
        })),
    }
}

fn report(keys: Vec<KeyReport>) -> HotKeyClientMessage {
    HotKeyClientMessage {
        kind: Some(Kind::Report(ReportBatch { keys })),
    }
}

/// 10,000 distinct keys of 1,024 bytes.
fn largest_batch() -> Vec<KeyReport> {
    (0..10_000_u32)
        .map(|index| {
            let mut key = vec![b'k'; 1_024];
            key[..4].copy_from_slice(&index.to_le_bytes());
            KeyReport { key, count: 1 }
        })
        .collect()
}

/// A report message of 10,000 keys and exactly `bytes` bytes: 9,999 keys of the largest batch,
/// then one key sized (and its count chosen) to land on `bytes`.
fn report_of_exactly(bytes: usize) -> HotKeyClientMessage {
    let mut first = largest_batch();
    first.pop();
    let base = report(first.clone()).encoded_len();
    for key_bytes in (bytes - base).saturating_sub(16)..bytes - base {
        for count in [1, 200, 20_000, 3_000_000, u32::MAX] {
            let mut keys = first.clone();
            keys.push(KeyReport {
                key: vec![b'x'; key_bytes],
                count,
            });
            let message = report(keys);
            if message.encoded_len() == bytes {
                return message;
            }
        }
    }
    panic!("no report of exactly {bytes} bytes");
}

#[test]
fn given_the_largest_valid_report_then_counted_and_one_byte_more_ends_the_session_with_a_levee_error()
 {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    let largest = report(largest_batch());
    assert!(
        largest.encoded_len() > 4 << 20,
        "over the gRPC library's default limit"
    );
    assert!(largest.encoded_len() <= REPORT_MESSAGE_BYTES_MAX);
    let at_limit = report_of_exactly(REPORT_MESSAGE_BYTES_MAX);
    let over_limit = report_of_exactly(REPORT_MESSAGE_BYTES_MAX + 1);
    runtime.block_on(async {
        let (requests, receiver) = tokio::sync::mpsc::channel(4);
        let mut client = HotKeysClient::connect(format!("http://{}", server.grpc()))
            .await
            .unwrap();
        requests.send(hello()).await.unwrap();
        let mut responses = client
            .session(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await
            .unwrap()
            .into_inner();
        requests.send(largest).await.unwrap();
        wait_for("10,000 keys counted", Duration::from_secs(10), || {
            metric_value(&server, "levee_hotkey_keys_received_total{app=\"shop\"}") >= 10_000
        });
        // At the limit exactly: taken (its one over-long key is refused on its own).
        requests.send(at_limit).await.unwrap();
        wait_for(
            "the batch at the limit counted",
            Duration::from_secs(10),
            || metric_value(&server, "levee_hotkey_keys_received_total{app=\"shop\"}") >= 19_999,
        );
        requests.send(over_limit).await.unwrap();
        let status = loop {
            match tokio::time::timeout(Duration::from_secs(10), responses.message()).await {
                Ok(Ok(Some(_))) => {}
                Ok(Ok(None)) => panic!("the session ended with OK after an over-size report"),
                Ok(Err(status)) => break status,
                Err(elapsed) => panic!("the session went on after an over-size report: {elapsed}"),
            }
        };
        assert!(
            status.metadata().contains_key(ERROR_CODE_METADATA_KEY),
            "{status:?}"
        );
        let error = WireError::from_status(&status);
        assert_eq!(error.code, ErrorCode::InvalidArgument, "{error}");
        assert!(error.message.contains("size limit"), "{error}");
    });
}

#[test]
fn given_an_append_over_the_message_limit_then_the_error_carries_a_levee_code() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    runtime.block_on(async {
        let mut client = QueuesClient::connect(format!("http://{}", server.grpc()))
            .await
            .unwrap();
        let request = AppendRequest {
            messages: vec![AppendMessage {
                queue: levee_proto::Bytes::from_static(b"orders"),
                payload: vec![0; 17 << 20].into(),
                ..AppendMessage::default()
            }],
            ..AppendRequest::default()
        };
        let status = client.append(request).await.unwrap_err();
        let metadata = status.metadata();
        assert_eq!(
            metadata.get(ERROR_CODE_METADATA_KEY).unwrap(),
            &(ErrorCode::InvalidArgument as i32).to_string()
        );
        assert_eq!(
            metadata.get(ERROR_REASON_METADATA_KEY).unwrap(),
            ErrorCode::InvalidArgument.reason()
        );
        assert_eq!(
            status.code(),
            tonic::Code::InvalidArgument,
            "not OUT_OF_RANGE"
        );
    });
}

#[test]
fn given_an_over_size_message_on_a_stream_then_the_stream_ends_with_a_levee_error() {
    use levee_proto::v1::subscribe_many_request::Kind as ManyKind;
    use levee_proto::v1::{AddMailboxes, Credit, SubscribeManyRequest, SubscribeManyStart};

    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    runtime.block_on(async {
        let (requests, receiver) = tokio::sync::mpsc::channel(4);
        let start = SubscribeManyRequest {
            kind: Some(ManyKind::Start(SubscribeManyStart {
                consumer: "app".to_owned(),
                credit: Some(Credit {
                    messages: 10,
                    bytes: 0,
                }),
            })),
        };
        requests.send(start).await.unwrap();
        let mut responses = QueuesClient::connect(format!("http://{}", server.grpc()))
            .await
            .unwrap()
            .subscribe_many(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await
            .unwrap()
            .into_inner();
        // 70,000 names of 255 bytes: about 18 MB, over the 16 MiB a message may take.
        let add = SubscribeManyRequest {
            kind: Some(ManyKind::Add(AddMailboxes {
                queues: (0..70_000_u32)
                    .map(|index| {
                        let mut name = vec![b'q'; 255];
                        name[..4].copy_from_slice(&index.to_le_bytes());
                        name
                    })
                    .collect(),
            })),
        };
        assert!(add.encoded_len() > 16 << 20);
        requests.send(add).await.unwrap();
        let status = loop {
            match tokio::time::timeout(Duration::from_secs(10), responses.message()).await {
                Ok(Ok(Some(_))) => {}
                Ok(Ok(None)) => panic!("the stream ended with OK after an over-size message"),
                Ok(Err(status)) => break status,
                Err(elapsed) => panic!("the stream went on after an over-size message: {elapsed}"),
            }
        };
        let error = WireError::from_status(&status);
        assert!(
            status.metadata().contains_key(ERROR_CODE_METADATA_KEY),
            "{status:?}"
        );
        assert_eq!(error.code, ErrorCode::InvalidArgument, "{error}");
        assert!(error.message.contains("size limit"), "{error}");
    });
}
