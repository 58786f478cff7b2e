//! Transport-neutral session streams. A session (`Subscribe`, `SubscribeMany`, `Consume`)
//! reads its client's messages from an [`Incoming`] and sends its responses through an
//! [`Outgoing`]; neither says which transport carries them. The gRPC services wrap tonic's
//! request stream and hand tonic the [`Responses`] (`grpc_stream`); another gateway (a
//! WebSocket one, say) wraps its socket the same way and runs the same sessions.
//!
//! Errors travel as [`WireError`]s, each transport mapping them to its own form (gRPC status
//! and trailers). Responses wait in a channel of [`RESPONSES_QUEUED_MAX`]: a client that stops
//! reading holds its session back instead of growing server memory.

use std::pin::Pin;
use std::time::Duration;

use levee_proto::WireError;
use levee_proto::v1::ErrorCode;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};

use crate::queue::credit::RESPONSES_QUEUED_MAX;

/// The client's messages to one session, from whichever transport carries them.
pub struct Incoming<T> {
    stream: Pin<Box<dyn Stream<Item = Result<T, WireError>> + Send + Sync>>,
}

impl<T> std::fmt::Debug for Incoming<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("Incoming")
    }
}

impl<T> Incoming<T> {
    /// The messages of `stream`, a transport's decoded frames.
    pub fn new(stream: impl Stream<Item = Result<T, WireError>> + Send + Sync + 'static) -> Self {
        Self {
            stream: Box::pin(stream),
        }
    }

    /// The client's next message: `Ok(None)` once it ended its side, `Err` if the transport
    /// failed (the session then ends).
    pub async fn message(&mut self) -> Result<Option<T>, WireError> {
        self.stream.next().await.transpose()
    }

    /// The stream's first message, which must be its start (`what`, picked out of the
    /// message by `start`), within `timeout`.
    pub async fn start<S>(
        &mut self,
        what: &str,
        timeout: Duration,
        start: impl FnOnce(T) -> Option<S>,
    ) -> Result<S, WireError> {
        let invalid = |message: String| WireError::new(ErrorCode::InvalidArgument, message);
        match tokio::time::timeout(timeout, self.message()).await {
            Ok(Ok(Some(message))) => {
                start(message).ok_or_else(|| invalid(format!("the first message must be a {what}")))
            }
            Ok(Ok(None)) => Err(invalid(format!("the stream ended before its {what}"))),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(invalid(format!(
                "no start message within {} s; send {what} first",
                timeout.as_secs()
            ))),
        }
    }
}

/// Where a session sends its responses. Cloned freely; the stream ends when every clone is
/// dropped.
#[derive(Debug)]
pub struct Outgoing<T> {
    sender: mpsc::Sender<Result<T, WireError>>,
}

impl<T> Clone for Outgoing<T> {
    fn clone(&self) -> Self {
        Self {
            sender: self.sender.clone(),
        }
    }
}

impl<T> Outgoing<T> {
    /// Sends `response`, waiting while the queue is full; false if the client is gone.
    pub async fn send(&self, response: T) -> bool {
        self.sender.send(Ok(response)).await.is_ok()
    }

    /// Sends `response` or, for an error, ends the stream with it; false if the client is
    /// gone.
    pub async fn send_result(&self, response: Result<T, WireError>) -> bool {
        self.sender.send(response).await.is_ok()
    }

    /// Ends the stream with `error` (the client sees it as the stream's status).
    pub async fn fail(&self, error: WireError) {
        let _ = self.sender.send(Err(error)).await;
    }
}

/// A session's responses as the transport reads them.
pub type Responses<T> = ReceiverStream<Result<T, WireError>>;

/// A session's outgoing side and the responses its transport sends, queued up to
/// [`RESPONSES_QUEUED_MAX`].
pub fn channel<T>() -> (Outgoing<T>, Responses<T>) {
    let (sender, receiver) = mpsc::channel(RESPONSES_QUEUED_MAX);
    (Outgoing { sender }, ReceiverStream::new(receiver))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use levee_proto::v1::subscribe_request::Kind;
    use levee_proto::v1::{Ack, Credit, SubscribeRequest, SubscribeStart};
    use levee_store::{Store, StoreOptions, SyncPolicy};
    use prometheus_client::metrics::counter::Counter;

    use super::*;
    use crate::queue::StoreCalls;
    use crate::queue::mailbox::position_log::PositionLogs;
    use crate::queue::mailbox::subscription::{Session, load_position};
    use crate::queue::waiters::Waiters;

    /// A transport that is not gRPC: the client's messages come from a channel, as a
    /// WebSocket gateway's decoded frames would.
    fn in_memory<T: Send + 'static>() -> (mpsc::Sender<Result<T, WireError>>, Incoming<T>) {
        let (sender, receiver) = mpsc::channel(4);
        (sender, Incoming::new(ReceiverStream::new(receiver)))
    }

    #[tokio::test]
    async fn given_a_session_over_a_non_grpc_transport_then_it_delivers_and_keeps_acks() {
        let directory = tempfile::tempdir().unwrap();
        let options = StoreOptions {
            sync: SyncPolicy::Always,
            ..StoreOptions::default()
        };
        let store = Arc::new(Store::open(directory.path(), options).unwrap().0);
        for payload in [b"one", b"two"] {
            store.append(b"inbox", payload).unwrap();
        }
        let calls = StoreCalls::new(Arc::clone(&store), SyncPolicy::Always).unwrap();
        let waiters = Arc::new(Waiters::default());
        let (_closing, closing) = tokio::sync::watch::channel(false);
        let (client, incoming) = in_memory();
        let (outgoing, mut responses) = channel();
        let session = Session {
            calls,
            notify: waiters.register(b"inbox").unwrap(),
            waiters: Arc::clone(&waiters),
            positions: Arc::new(PositionLogs::new(
                Arc::clone(&store),
                1_000,
                Counter::default(),
            )),
            replication: None,
            start: SubscribeStart {
                queue: b"inbox".to_vec(),
                consumer: "app".to_owned(),
                credit: Some(Credit {
                    messages: 10,
                    bytes: 0,
                }),
            },
            incoming,
            outgoing,
            delivered: Counter::default(),
            closing,
        };
        let running = tokio::spawn(session.run());

        let start = responses.next().await.unwrap().unwrap();
        assert_eq!(start.start_offset, Some(0));
        let delivered = responses.next().await.unwrap().unwrap();
        assert_eq!(
            delivered.start_offset, None,
            "only the first message says where"
        );
        let payloads: Vec<&[u8]> = delivered
            .deliveries
            .iter()
            .map(|delivery| &delivery.payload[..])
            .collect();
        assert_eq!(payloads, [&b"one"[..], b"two"]);
        let ack = SubscribeRequest {
            kind: Some(Kind::Ack(Ack { offset: 1 })),
        };
        client.send(Ok(ack)).await.unwrap();
        let answer = responses.next().await.unwrap().unwrap();
        assert_eq!(answer.acked_offset, 2, "answered once durable");

        // A second start is a protocol error: the stream ends with it, as a wire error.
        let again = SubscribeRequest {
            kind: Some(Kind::Start(SubscribeStart::default())),
        };
        client.send(Ok(again)).await.unwrap();
        let error = responses.next().await.unwrap().unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidArgument);
        running.await.unwrap();
        let store_for_load = Arc::clone(&store);
        let position = tokio::task::spawn_blocking(move || {
            load_position(&store_for_load, "app", b"inbox").unwrap()
        })
        .await
        .unwrap();
        assert_eq!(position, 2, "the ack is in the consumer's position queue");
    }
}
