//! The shards' calls to one peer over one long-lived stream (`Peer.ShardStream`, docs/CLUSTER.md,
//! "The shards' transport"): a [`Link`] per peer on the calling side, [`serve_frames`] on the
//! answering side.
//!
//! A unary call costs an HTTP/2 stream of its own (its headers, their compression, a trip
//! through the channel's buffer task) on both nodes, and every shard makes two to four of them
//! per entry. On a link a call is one frame each way: an id, the shard call, its answer.
//!
//! - Calls and answers are matched by id; answers come in the order they are ready, so a slow
//!   call (a forwarded write waiting for its commit) holds up no other.
//! - Every queue is bounded: the frames waiting to be written ([`LINK_FRAMES_QUEUED_MAX`], the
//!   caller waits for room), the calls a peer serves at once ([`LINK_CALLS_SERVED_MAX`], more
//!   wait to be read, and HTTP/2's flow control holds the caller back) and the answers waiting
//!   to be written ([`LINK_FRAMES_QUEUED_MAX`]). A call that times out or is dropped by its
//!   caller is forgotten at once, and its frame, if HTTP/2's flow control has not let it out
//!   yet, is never written.
//! - A stream that fails (the peer stopped, the connection broke) fails the calls it carries
//!   with its status and is closed; the next call opens a new one on the same channel, which
//!   tonic reconnects.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use levee_proto::peer_v1::peer_client::PeerClient;
use levee_proto::peer_v1::{ShardFrame, ShardMessage};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

/// Largest shard call (its body) sent on a link; a larger one (a snapshot's chunk, an
/// `AppendEntries` of large entries) is a call of its own.
pub const LINK_CALL_BYTES_MAX: usize = 64 << 10;
/// Frames that may wait to be written on one stream, each way.
pub const LINK_FRAMES_QUEUED_MAX: usize = 1_024;
/// Calls of one stream a node serves at once.
pub const LINK_CALLS_SERVED_MAX: usize = 1_024;

type Answer = Result<ShardMessage, Status>;

/// The calls of a link waiting for their answers.
#[derive(Default)]
struct Pending {
    answers: HashMap<u64, oneshot::Sender<Answer>>,
    /// The stream failed or ended: with what, for the calls made since.
    closed: Option<Status>,
}

fn lock(pending: &Mutex<Pending>) -> std::sync::MutexGuard<'_, Pending> {
    pending.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One stream of shard calls to a peer. Its frames are written by tonic from a bounded
/// queue; a task reads the answers and hands each to its call.
pub struct Link {
    frames: mpsc::Sender<ShardFrame>,
    pending: Arc<Mutex<Pending>>,
    next_id: AtomicU64,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Link")
            .field("closed", &self.closed())
            .finish_non_exhaustive()
    }
}

impl Link {
    /// Opens a stream on `client`'s channel (on a task of its own, which then reads the
    /// answers; calls may be made at once).
    pub fn open(mut client: PeerClient<Channel>) -> Arc<Self> {
        let (frames, outbound) = mpsc::channel(LINK_FRAMES_QUEUED_MAX);
        let pending = Arc::new(Mutex::new(Pending::default()));
        let reader = Arc::clone(&pending);
        // A frame whose call was given up on (timed out) before the frame is written is
        // dropped: the peer would serve a call nobody waits for (a forwarded write, perhaps).
        let waiting = Arc::clone(&pending);
        let frames_to_write = tokio_stream::StreamExt::filter(
            ReceiverStream::new(outbound),
            move |frame: &ShardFrame| lock(&waiting).answers.contains_key(&frame.id),
        );
        tokio::spawn(async move {
            let ending = match client.shard_stream(frames_to_write).await {
                Ok(response) => read_answers(response.into_inner(), &reader).await,
                Err(status) => status,
            };
            close(&reader, &ending);
        });
        Arc::new(Self {
            frames,
            pending,
            next_id: AtomicU64::new(1),
        })
    }

    /// How the stream ended, once it has: a new link is then needed.
    pub fn closed(&self) -> Option<Status> {
        lock(&self.pending).closed.clone()
    }

    /// Sends `message` and waits up to `limit` for its answer.
    pub async fn call(&self, message: ShardMessage, limit: Duration) -> Answer {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (answer_to, answer) = oneshot::channel();
        {
            let mut pending = lock(&self.pending);
            if let Some(status) = &pending.closed {
                return Err(status.clone());
            }
            pending.answers.insert(id, answer_to);
        }
        // Forgets the call however it ends: answered, timed out, or dropped by its caller
        // (openraft bounds its calls by dropping them), so that no answer waits in vain.
        let _forget = Forget {
            pending: &self.pending,
            id,
        };
        let frame = ShardFrame {
            id,
            message: Some(message),
            code: 0,
            error: String::new(),
        };
        let sent_and_answered = async {
            if self.frames.send(frame).await.is_err() {
                return Err(self.closed().unwrap_or_else(ended));
            }
            answer
                .await
                .unwrap_or_else(|_| Err(self.closed().unwrap_or_else(ended)))
        };
        tokio::time::timeout(limit, sent_and_answered)
            .await
            .unwrap_or_else(|_| {
                Err(Status::deadline_exceeded(format!(
                    "no answer within {limit:?}"
                )))
            })
    }
}

/// Removes a call from those waiting for an answer when dropped.
struct Forget<'a> {
    pending: &'a Mutex<Pending>,
    id: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        lock(self.pending).answers.remove(&self.id);
    }
}

/// The status of a stream the peer ended.
fn ended() -> Status {
    Status::unavailable("the peer ended the stream of shard calls")
}

/// Hands each answer of `inbound` to its call, until the stream ends or fails; returns how.
async fn read_answers(mut inbound: Streaming<ShardFrame>, pending: &Mutex<Pending>) -> Status {
    loop {
        match inbound.message().await {
            Ok(Some(frame)) => {
                let answer = match (frame.code, frame.message) {
                    (0, Some(message)) => Ok(message),
                    (0, None) => Err(Status::internal(
                        "a peer answered a shard call with nothing",
                    )),
                    (code, _) => Err(Status::new(tonic::Code::from(code), frame.error)),
                };
                // A call that timed out or was dropped is no longer there: its answer goes nowhere.
                if let Some(answer_to) = lock(pending).answers.remove(&frame.id) {
                    let _ = answer_to.send(answer);
                }
            }
            Ok(None) => return ended(),
            Err(status) => return status,
        }
    }
}

/// Marks the link closed with `status` and fails every call still waiting with it.
fn close(pending: &Mutex<Pending>, status: &Status) {
    let answers = {
        let mut pending = lock(pending);
        pending.closed = Some(status.clone());
        std::mem::take(&mut pending.answers)
    };
    for answer_to in answers.into_values() {
        let _ = answer_to.send(Err(status.clone()));
    }
}

/// Serves the calls of `inbound` with `serve`, up to [`LINK_CALLS_SERVED_MAX`] at once, and
/// returns the stream of their answers, each sent as soon as it is ready.
pub fn serve_frames<S, F>(
    mut inbound: Streaming<ShardFrame>,
    serve: S,
) -> ReceiverStream<Result<ShardFrame, Status>>
where
    S: Fn(ShardMessage) -> F + Send + 'static,
    F: Future<Output = Answer> + Send + 'static,
{
    let (answers, outbound) = mpsc::channel(LINK_FRAMES_QUEUED_MAX);
    tokio::spawn(async move {
        let serving = Arc::new(Semaphore::new(LINK_CALLS_SERVED_MAX));
        loop {
            let Ok(permit) = Arc::clone(&serving).acquire_owned().await else {
                return;
            };
            let Ok(Some(frame)) = inbound.message().await else {
                // Ended or failed: the calls under way still answer, into a stream that ends
                // with the last of them.
                return;
            };
            let served = frame.message.map(&serve);
            let answers = answers.clone();
            tokio::spawn(async move {
                let answer = match served {
                    Some(served) => served.await,
                    None => Err(Status::invalid_argument("a shard frame carries no call")),
                };
                let frame = match answer {
                    Ok(message) => ShardFrame {
                        id: frame.id,
                        message: Some(message),
                        code: 0,
                        error: String::new(),
                    },
                    Err(status) => ShardFrame {
                        id: frame.id,
                        message: None,
                        code: status.code() as i32,
                        error: status.message().to_owned(),
                    },
                };
                let _ = answers.send(Ok(frame)).await;
                drop(permit);
            });
        }
    });
    ReceiverStream::new(outbound)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use levee_proto::peer_v1::PeerMessage;
    use levee_proto::peer_v1::peer_server::{Peer, PeerServer};
    use tonic::{Request, Response};

    use super::*;
    use crate::network::PeerDialer;
    use crate::shard::network::{PeerChannels, send};
    use levee_proto::peer_v1::ShardCall;

    /// A peer that answers each shard call after `shard` milliseconds with its body, fails
    /// the calls whose body is `fail`, and ends its first `streams_ended` streams at once;
    /// with `streams` false it has no `ShardStream` and answers `Shard` alike.
    #[derive(Clone)]
    struct Echo {
        streams: Arc<std::sync::atomic::AtomicBool>,
        streams_ended: usize,
        opened: Arc<AtomicUsize>,
        /// When set, a stream's calls are read only once this is notified.
        hold: Option<Arc<tokio::sync::Notify>>,
        /// The calls served over streams.
        served: Arc<AtomicUsize>,
    }

    async fn echo(message: ShardMessage) -> Answer {
        tokio::time::sleep(Duration::from_millis(u64::from(message.shard))).await;
        if message.body.as_ref() == b"fail" {
            return Err(Status::failed_precondition("asked to fail"));
        }
        Ok(message)
    }

    fn no(_: &str) -> Status {
        Status::unimplemented("not in this test")
    }

    #[tonic::async_trait]
    impl Peer for Echo {
        async fn append_entries(
            &self,
            _: Request<PeerMessage>,
        ) -> Result<Response<PeerMessage>, Status> {
            Err(no("append_entries"))
        }
        async fn vote(&self, _: Request<PeerMessage>) -> Result<Response<PeerMessage>, Status> {
            Err(no("vote"))
        }
        async fn install_snapshot(
            &self,
            _: Request<PeerMessage>,
        ) -> Result<Response<PeerMessage>, Status> {
            Err(no("install_snapshot"))
        }
        async fn forward(&self, _: Request<PeerMessage>) -> Result<Response<PeerMessage>, Status> {
            Err(no("forward"))
        }
        async fn join(&self, _: Request<PeerMessage>) -> Result<Response<PeerMessage>, Status> {
            Err(no("join"))
        }
        async fn manage(&self, _: Request<PeerMessage>) -> Result<Response<PeerMessage>, Status> {
            Err(no("manage"))
        }
        async fn leave(&self, _: Request<PeerMessage>) -> Result<Response<PeerMessage>, Status> {
            Err(no("leave"))
        }
        async fn shard(
            &self,
            request: Request<ShardMessage>,
        ) -> Result<Response<ShardMessage>, Status> {
            echo(request.into_inner()).await.map(Response::new)
        }

        type ShardStreamStream = ReceiverStream<Result<ShardFrame, Status>>;

        async fn shard_stream(
            &self,
            request: Request<Streaming<ShardFrame>>,
        ) -> Result<Response<Self::ShardStreamStream>, Status> {
            if !self.streams.load(Ordering::SeqCst) {
                return Err(no("shard_stream"));
            }
            if self.opened.fetch_add(1, Ordering::SeqCst) < self.streams_ended {
                let (_, ended) = mpsc::channel(1);
                return Ok(Response::new(ReceiverStream::new(ended)));
            }
            let served = Arc::clone(&self.served);
            let serve = move |message| {
                served.fetch_add(1, Ordering::SeqCst);
                echo(message)
            };
            let Some(hold) = self.hold.clone() else {
                return Ok(Response::new(serve_frames(request.into_inner(), serve)));
            };
            let (answers, outbound) = mpsc::channel(LINK_FRAMES_QUEUED_MAX);
            tokio::spawn(async move {
                hold.notified().await;
                let mut answered = serve_frames(request.into_inner(), serve);
                while let Some(answer) = tokio_stream::StreamExt::next(&mut answered).await {
                    if answers.send(answer).await.is_err() {
                        return;
                    }
                }
            });
            Ok(Response::new(ReceiverStream::new(outbound)))
        }
    }

    async fn start(peer: Echo) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PeerServer::new(peer))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        address
    }

    fn message(delay_ms: u32, body: &'static [u8]) -> ShardMessage {
        ShardMessage {
            shard: delay_ms,
            call: ShardCall::AppendEntries.into(),
            body: levee_proto::Bytes::from_static(body),
        }
    }

    fn peer(streams: bool, streams_ended: usize) -> Echo {
        Echo {
            streams: Arc::new(std::sync::atomic::AtomicBool::new(streams)),
            streams_ended,
            opened: Arc::default(),
            hold: None,
            served: Arc::default(),
        }
    }

    #[tokio::test]
    async fn given_calls_on_one_link_then_each_gets_its_own_answer_as_soon_as_it_is_ready() {
        let address = start(peer(true, 0)).await;
        let channels = PeerChannels::new(PeerDialer::default());
        let link = Link::open(channels.client(&address).unwrap());
        let limit = Duration::from_secs(5);
        let slow = link.call(message(300, b"slow"), limit);
        let fast = async {
            let answer = link.call(message(0, b"fast"), limit).await;
            (answer, std::time::Instant::now())
        };
        let slow = async {
            let answer = slow.await;
            (answer, std::time::Instant::now())
        };
        let ((slow, slow_at), (fast, fast_at)) = tokio::join!(slow, fast);
        assert_eq!(slow.unwrap().body.as_ref(), b"slow");
        assert_eq!(fast.unwrap().body.as_ref(), b"fast");
        assert!(
            fast_at < slow_at,
            "the fast answer is not held behind the slow one"
        );
        let failed = link.call(message(0, b"fail"), limit).await.unwrap_err();
        assert_eq!(failed.code(), tonic::Code::FailedPrecondition);
        assert_eq!(failed.message(), "asked to fail");
        assert!(link.closed().is_none());
    }

    #[tokio::test]
    async fn given_a_call_that_times_out_or_is_dropped_then_it_is_forgotten_at_once() {
        let address = start(peer(true, 0)).await;
        let channels = PeerChannels::new(PeerDialer::default());
        let link = Link::open(channels.client(&address).unwrap());
        let late = link
            .call(message(500, b"late"), Duration::from_millis(50))
            .await
            .unwrap_err();
        assert_eq!(late.code(), tonic::Code::DeadlineExceeded);
        assert!(lock(&link.pending).answers.is_empty());
        let dropped = tokio::time::timeout(
            Duration::from_millis(50),
            link.call(message(500, b"dropped"), Duration::from_secs(5)),
        )
        .await;
        assert!(dropped.is_err(), "the caller gave up first");
        assert!(
            lock(&link.pending).answers.is_empty(),
            "a call its caller dropped is forgotten too"
        );
        tokio::time::sleep(Duration::from_millis(600)).await;
        let next = link.call(message(0, b"next"), Duration::from_secs(5)).await;
        assert_eq!(
            next.unwrap().body.as_ref(),
            b"next",
            "the late answer went nowhere"
        );
        assert!(lock(&link.pending).answers.is_empty());
    }

    #[tokio::test]
    async fn given_a_stream_the_peer_ends_then_its_calls_fail_unavailable_and_the_next_opens_another()
     {
        let echo = peer(true, 1);
        let opened = Arc::clone(&echo.opened);
        let address = start(echo).await;
        let channels = PeerChannels::new(PeerDialer::default());
        let call = (0, ShardCall::AppendEntries);
        let limit = Duration::from_secs(5);
        let failed = send(&channels, &address, call, b"first".to_vec(), limit)
            .await
            .unwrap_err();
        assert_eq!(failed.code(), tonic::Code::Unavailable, "{failed:?}");
        let answer = send(&channels, &address, call, b"second".to_vec(), limit).await;
        assert_eq!(answer.unwrap().as_ref(), b"second");
        assert_eq!(opened.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn given_calls_that_time_out_while_the_peer_reads_nothing_then_those_still_queued_are_never_sent()
     {
        let hold = Arc::new(tokio::sync::Notify::new());
        let echo = Echo {
            hold: Some(Arc::clone(&hold)),
            ..peer(true, 0)
        };
        let served = Arc::clone(&echo.served);
        let address = start(echo).await;
        let channels = PeerChannels::new(PeerDialer::default());
        let link = Link::open(channels.client(&address).unwrap());
        // Far more than HTTP/2's windows (1 MiB at the peer) let through unread.
        let calls = 64;
        let body = levee_proto::Bytes::from(vec![1_u8; 60 << 10]);
        let timed_out = futures_util::future::join_all((0..calls).map(|_| {
            let message = ShardMessage {
                body: body.clone(),
                ..message(0, b"")
            };
            link.call(message, Duration::from_millis(300))
        }))
        .await;
        assert!(timed_out.iter().all(|answer| {
            answer
                .as_ref()
                .is_err_and(|status| status.code() == tonic::Code::DeadlineExceeded)
        }));
        hold.notify_one();
        let after = link
            .call(message(0, b"after"), Duration::from_secs(5))
            .await;
        assert_eq!(after.unwrap().body.as_ref(), b"after");
        let served = served.load(Ordering::SeqCst);
        assert!(
            served < calls / 2,
            "{served} calls served: the frames of calls given up on before they were written \
             are dropped, not sent"
        );
    }

    #[tokio::test]
    async fn given_a_call_over_the_link_bound_then_it_goes_alone_and_opens_no_stream() {
        let echo = peer(true, 0);
        let opened = Arc::clone(&echo.opened);
        let address = start(echo).await;
        let channels = PeerChannels::new(PeerDialer::default());
        let large = vec![7_u8; LINK_CALL_BYTES_MAX + 1];
        let answer = send(
            &channels,
            &address,
            (0, ShardCall::AppendEntries),
            large.clone(),
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(answer.unwrap().as_ref(), large.as_slice());
        assert_eq!(opened.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn given_a_peer_without_streams_then_calls_go_one_by_one_until_it_is_tried_again() {
        let echo = peer(false, 0);
        let (streams, opened) = (Arc::clone(&echo.streams), Arc::clone(&echo.opened));
        let address = start(echo).await;
        let channels = PeerChannels::new(PeerDialer::default())
            .with_link_retry_after(Duration::from_millis(200));
        for body in [b"one", b"two"] {
            let answer = send(
                &channels,
                &address,
                (0, ShardCall::Vote),
                body.to_vec(),
                Duration::from_secs(5),
            )
            .await;
            assert_eq!(answer.unwrap().as_ref(), body);
        }
        assert!(channels.link(&address).unwrap().is_none());
        // Upgraded since: once the retry time has passed, the next call opens a stream.
        streams.store(true, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let call = (0, ShardCall::Vote);
        let answer = send(
            &channels,
            &address,
            call,
            b"three".to_vec(),
            Duration::from_secs(5),
        );
        assert_eq!(answer.await.unwrap().as_ref(), b"three");
        assert_eq!(opened.load(Ordering::SeqCst), 1, "a stream was opened");
        assert!(channels.link(&address).unwrap().is_some());
    }
}
