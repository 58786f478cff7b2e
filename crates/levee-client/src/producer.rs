//! [`Producer`]: batches appends from many callers into few requests. A message waits at most
//! `linger` for others to join its batch; a batch closes at `batch_messages_max` messages or
//! `batch_bytes_max` bytes, and (with `send_when_idle`, the default) as soon as no request is
//! in flight, so a lightly loaded producer adds no linger while a busy one batches what arrives
//! during each round trip. Each caller gets its own message's offset once the batch is durable.
//! At most `queued_messages_max` messages wait at once: further sends wait (back-pressure).
//!
//! With `idempotent`, the producer takes a fresh producer id and numbers each queue's messages;
//! a batch whose request failed in a way that may not have reached the disk (unavailable, a
//! timeout, a sequence gap left by a batch still in flight) is resent with the same numbers up
//! to `retries_max` times, and the server stores nothing twice. A batch that finally fails
//! (its resends spent, or an error no resend mends) may never be stored, so the batches after
//! it take a fresh producer id, every queue numbered from 0 again (else each would meet a
//! `SEQUENCE_GAP` for good; a failed batch stored later after all never collides with them).
//! While a batch is being resent
//! the producer sends no new batch: the server answers a resend with its original offsets only
//! while it is among the last 8 requests that touched its queues (`RUNS_KEPT`), so newer
//! batches must not pile up behind it. Without it nothing is resent,
//! since a resend could duplicate. The producer keeps one counter per queue it has sent to.
//!
//! A producer built on a named client ([`Client::with_producer_name`]) sends that name with
//! every batch, so an operator's rate limit for the name paces it: the server holds a batch
//! until the limit admits it, which the producer feels as back-pressure.

use std::time::Duration;

use levee_proto::WireError;
use levee_proto::v1::{AppendMessage, ErrorCode};
use std::sync::Arc;

use tokio::sync::{Notify, Semaphore, mpsc, oneshot};

use crate::client::Client;
use crate::error::ClientError;
use crate::routing::{REFRESH_INTERVAL, ShardRoutes};

/// The longest pause between two resends of an idempotent batch.
const RESEND_PAUSE_MAX: Duration = Duration::from_millis(100);

/// How a [`Producer`] batches.
#[derive(Debug, Clone)]
pub struct ProducerOptions {
    /// Longest a message waits for others to join its batch (default 1 ms).
    pub linger: Duration,
    /// Send a batch before its linger is up when no request is in flight (default true): what
    /// is queued goes at once, and messages arriving during a request's round trip make the
    /// next batch. False waits out the linger always (fewer, larger requests; more latency).
    pub send_when_idle: bool,
    /// Most messages per append request, 1 to 10000 (default 1000).
    pub batch_messages_max: usize,
    /// Most payload bytes per append request (default 4 MiB; a larger single message goes alone).
    pub batch_bytes_max: usize,
    /// Most messages waiting to be sent (default 100000).
    pub queued_messages_max: usize,
    /// Append requests in flight at once (default 8). Batches in flight together may be
    /// stored in any order: a caller that needs its messages in order awaits each send.
    pub requests_in_flight_max: usize,
    /// Resend failed batches without ever storing a message twice (default false).
    pub idempotent: bool,
    /// With `idempotent`: resends of one batch before its callers get the error (default 10,
    /// 10 ms apart, doubling up to 100 ms: about 0.75 s in all, enough to ride out a shard
    /// leader's failover in a cluster).
    pub retries_max: u32,
    /// In a cluster that replicates its queues: send each batch's messages straight to their
    /// shards' leaders (learned from `GetCluster` every second and after a failure), saving the
    /// hop a node takes forwarding them (default true). Elsewhere it changes nothing.
    pub route_to_shard_leaders: bool,
}

impl Default for ProducerOptions {
    fn default() -> Self {
        Self {
            linger: Duration::from_millis(1),
            send_when_idle: true,
            batch_messages_max: 1_000,
            batch_bytes_max: 4 << 20,
            queued_messages_max: 100_000,
            requests_in_flight_max: 8,
            idempotent: false,
            retries_max: 10,
            route_to_shard_leaders: true,
        }
    }
}

struct Pending {
    /// The message as the request carries it (copied once, at `send`).
    message: AppendMessage,
    answer: oneshot::Sender<Result<u64, ClientError>>,
}

/// Batches appends. Cheap to clone; clones share the batching task, which stops when the last
/// clone is dropped (after sending what it holds).
#[derive(Clone)]
pub struct Producer {
    sender: mpsc::Sender<Pending>,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Producer").finish_non_exhaustive()
    }
}

impl Producer {
    /// A producer sending through `client`; must run inside a tokio runtime.
    pub fn new(client: Client, options: ProducerOptions) -> Result<Self, ClientError> {
        if !(1..=10_000).contains(&options.batch_messages_max)
            || options.batch_bytes_max == 0
            || options.queued_messages_max == 0
            || options.requests_in_flight_max == 0
        {
            return Err(ClientError::InvalidOptions(
                "batch_messages_max must be 1 to 10000; batch_bytes_max, queued_messages_max and \
                 requests_in_flight_max at least 1"
                    .to_owned(),
            ));
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            ClientError::InvalidOptions("Producer::new must run inside a tokio runtime".to_owned())
        })?;
        let (sender, receiver) = mpsc::channel(options.queued_messages_max);
        runtime.spawn(run(client, options, receiver));
        Ok(Self { sender })
    }

    /// Appends `payload` to `queue`; returns its offset once its batch is durable.
    pub async fn send(&self, queue: &[u8], payload: &[u8]) -> Result<u64, ClientError> {
        self.send_bytes(
            levee_proto::Bytes::copy_from_slice(queue),
            levee_proto::Bytes::copy_from_slice(payload),
        )
        .await
    }

    /// As [`Producer::send`], taking the name and payload as shared bytes, so nothing is
    /// copied: a caller that sends to the same queues again keeps their names as `Bytes`
    /// (cloning one is a reference count).
    pub async fn send_bytes(
        &self,
        queue: levee_proto::Bytes,
        payload: levee_proto::Bytes,
    ) -> Result<u64, ClientError> {
        let (answer, answered) = oneshot::channel();
        let pending = Pending {
            message: AppendMessage {
                queue,
                payload,
                sequence: 0,
            },
            answer,
        };
        let stopped = || WireError::new(ErrorCode::Unavailable, "the producer has stopped");
        self.sender.send(pending).await.map_err(|_| stopped())?;
        answered.await.map_err(|_| stopped())?
    }
}

/// A fresh idempotent producer id: the time and process id, hashed.
fn fresh_producer_id() -> String {
    use std::hash::BuildHasher;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos());
    let hash = foldhash::fast::RandomState::default().hash_one((nanos, std::process::id()));
    format!("producer-{hash:016x}")
}

/// Routes for `client`'s cluster, refreshed every [`REFRESH_INTERVAL`] while they are used.
fn follow_routes(client: &Client) -> Arc<ShardRoutes> {
    let routes = Arc::new(ShardRoutes::new(client.clone()));
    let weak = Arc::downgrade(&routes);
    tokio::spawn(async move {
        while let Some(routes) = weak.upgrade() {
            if let Err(error) = routes.refresh().await {
                tracing::debug!(%error, "refreshing the shard routes");
            }
            drop(routes);
            tokio::time::sleep(REFRESH_INTERVAL).await;
        }
    });
    routes
}

async fn run(client: Client, options: ProducerOptions, mut receiver: mpsc::Receiver<Pending>) {
    let routes = options
        .route_to_shard_leaders
        .then(|| follow_routes(&client));
    let in_flight = Arc::new(Semaphore::new(options.requests_in_flight_max));
    // Signalled when a request completes, so a batch waiting for an idle line re-checks.
    let completed = Arc::new(Notify::new());
    let mut producer_id = options.idempotent.then(fresh_producer_id);
    // Set when an idempotent group finally failed: its sequences may never be stored, so the
    // batches after it take a fresh id (else each would meet a SEQUENCE_GAP for good).
    let renumber = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // How many groups are being resent now.
    let (resends, mut resending) = tokio::sync::watch::channel(0_usize);
    let resends = Arc::new(resends);
    let mut sequences: std::collections::HashMap<levee_proto::Bytes, u64> =
        std::collections::HashMap::new();
    // A message that would have taken its batch past batch_bytes_max starts the next one.
    let mut carried = None;
    loop {
        let first = match carried.take() {
            Some(first) => first,
            None => match receiver.recv().await {
                Some(first) => first,
                None => break,
            },
        };
        let mut bytes = first.message.payload.len();
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + options.linger;
        while batch.len() < options.batch_messages_max && bytes < options.batch_bytes_max {
            // What is queued already joins without waiting.
            let next = match receiver.try_recv() {
                Ok(next) => Some(next),
                Err(mpsc::error::TryRecvError::Disconnected) => None,
                Err(mpsc::error::TryRecvError::Empty) => {
                    let idle = in_flight.available_permits() == options.requests_in_flight_max;
                    if options.send_when_idle && idle {
                        break;
                    }
                    tokio::select! {
                        next = receiver.recv() => next,
                        () = completed.notified(), if options.send_when_idle => continue,
                        () = tokio::time::sleep_until(deadline) => None,
                    }
                }
            };
            let Some(next) = next else { break };
            if bytes + next.message.payload.len() > options.batch_bytes_max {
                carried = Some(next);
                break;
            }
            bytes += next.message.payload.len();
            batch.push(next);
        }
        // No new batch while one is being resent (it must stay among the server's remembered
        // requests of its queues); numbered after, so a resend that finally failed is known.
        if resending.wait_for(|count| *count == 0).await.is_err() {
            return;
        }
        if producer_id.is_some() {
            if renumber.swap(false, std::sync::atomic::Ordering::AcqRel) {
                producer_id = Some(fresh_producer_id());
                sequences.clear();
            }
            for pending in &mut batch {
                let next = sequences.entry(pending.message.queue.clone()).or_default();
                pending.message.sequence = *next;
                *next += 1;
            }
        }
        // Waits while requests_in_flight_max requests are out: back-pressure on the queue.
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else {
            return;
        };
        let client = client.clone();
        let routes = routes.clone();
        let producer_id = producer_id.clone();
        let retries_max = options.retries_max;
        let completed = Arc::clone(&completed);
        let resends = Arc::clone(&resends);
        let renumber = Arc::clone(&renumber);
        tokio::spawn(async move {
            let sending = Sending {
                client,
                routes,
                producer_id,
                retries_max,
                resends,
                renumber,
            };
            sending.batch(batch).await;
            drop(permit);
            completed.notify_one();
        });
    }
}

/// Whether a failed idempotent append may be resent: the server may not have stored it, or an
/// earlier batch is still on its way.
fn is_retryable(error: &ClientError) -> bool {
    match error.code() {
        Some(code) => matches!(
            code,
            ErrorCode::Unavailable
                | ErrorCode::DeadlineExceeded
                | ErrorCode::SequenceGap
                | ErrorCode::ResourceExhausted
        ),
        None => true,
    }
}

/// What sending a batch needs: where to, and how.
#[derive(Clone)]
struct Sending {
    client: Client,
    routes: Option<Arc<ShardRoutes>>,
    producer_id: Option<String>,
    retries_max: u32,
    /// Counts the groups being resent (the producer sends no new batch meanwhile).
    resends: Arc<tokio::sync::watch::Sender<usize>>,
    /// Set when an idempotent group finally fails: the next batch takes a fresh id.
    renumber: Arc<std::sync::atomic::AtomicBool>,
}

/// Counts one group as being resent while it lives.
struct Resending(Arc<tokio::sync::watch::Sender<usize>>);

impl Resending {
    fn start(resends: &Arc<tokio::sync::watch::Sender<usize>>) -> Self {
        resends.send_modify(|count| *count += 1);
        Self(Arc::clone(resends))
    }
}

impl Drop for Resending {
    fn drop(&mut self) {
        self.0.send_modify(|count| *count -= 1);
    }
}

impl Sending {
    /// Sends `batch`: split by the node each message's shard is led by, when routing.
    async fn batch(&self, batch: Vec<Pending>) {
        let Some(routes) = self.routes.as_ref().filter(|routes| routes.routing()) else {
            return self.group(batch).await;
        };
        let mut groups: std::collections::HashMap<u64, Vec<Pending>> =
            std::collections::HashMap::new();
        for pending in batch {
            let (node, _) = routes.route(&pending.message.queue);
            groups.entry(node).or_default().push(pending);
        }
        let mut sends = tokio::task::JoinSet::new();
        for (_, group) in groups {
            let sending = self.clone();
            sends.spawn(async move { sending.group(group).await });
        }
        while sends.join_next().await.is_some() {}
    }

    /// The client a group goes to: its first message's shard leader's (the node forwards any
    /// message it does not lead), or the seed.
    fn target(&self, messages: &[AppendMessage]) -> Client {
        match (&self.routes, messages.first()) {
            (Some(routes), Some(first)) => routes.route(&first.queue).1,
            _ => self.client.clone(),
        }
    }

    /// Sends one group (resending it when idempotent) and answers its callers.
    async fn group(&self, batch: Vec<Pending>) {
        let (messages, answers): (Vec<AppendMessage>, Vec<_>) = batch
            .into_iter()
            .map(|pending| (pending.message, pending.answer))
            .unzip();
        let result = match self.producer_id.as_deref() {
            None => {
                let result = self
                    .target(&messages)
                    .append_messages(messages, String::new())
                    .await;
                if result.is_err()
                    && let Some(routes) = &self.routes
                {
                    routes.refresh_after_failure().await;
                }
                result
            }
            Some(producer_id) => {
                let mut backoff = Duration::from_millis(10);
                let mut attempt = 0;
                let mut resending = None;
                let result = loop {
                    // A resend carries the same messages (payloads shared, not copied).
                    let result = self
                        .target(&messages)
                        .append_messages(messages.clone(), producer_id.to_owned())
                        .await;
                    match result {
                        Err(error) if attempt < self.retries_max && is_retryable(&error) => {
                            attempt += 1;
                            resending.get_or_insert_with(|| Resending::start(&self.resends));
                            if let Some(routes) = &self.routes {
                                routes.refresh_after_failure().await;
                            }
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(RESEND_PAUSE_MAX);
                        }
                        other => break other,
                    }
                };
                if result.is_err() {
                    // Set before the resend's guard goes, so the next batch sees it.
                    self.renumber
                        .store(true, std::sync::atomic::Ordering::Release);
                }
                result
            }
        };
        match result {
            Ok(offsets) => {
                for (answer, offset) in answers.into_iter().zip(offsets) {
                    let _ = answer.send(Ok(offset));
                }
            }
            Err(error) => {
                // Every message of the group fails with the same code and message.
                let failed = match error {
                    ClientError::Server(wire) => wire,
                    other => WireError::new(ErrorCode::Unavailable, other.to_string()),
                };
                for answer in answers {
                    let _ = answer.send(Err(ClientError::Server(failed.clone())));
                }
            }
        }
    }
}
