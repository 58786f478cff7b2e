//! The `levee.v1.Queues` gRPC service. Store calls block (an append under `queue_sync = always`
//! waits for its group commit's fsync), so each runs through [`StoreCalls`] on tokio's blocking
//! pool. Appends with a producer id go through [`Producers`], which makes resends no-ops.

use std::sync::Arc;

use levee_proto::WireError;
use levee_proto::v1::queues_client::QueuesClient;
use levee_proto::v1::queues_server::Queues;
use levee_proto::v1::subscribe_many_request::Kind as SubscribeManyKind;
use levee_proto::v1::subscribe_request::Kind as SubscribeKind;
use levee_proto::v1::{
    AppendRequest, AppendResponse, DeleteQueueRequest, DeleteQueueResponse, ErrorCode,
    GetQueueInfoRequest, GetQueueInfoResponse, ListQueuesRequest, ListQueuesResponse, ReadRequest,
    ReadResponse, SetRetentionRequest, SetRetentionResponse, SubscribeManyRequest,
    SubscribeManyResponse, SubscribeRequest, SubscribeResponse,
};
use levee_store::{InputError, ReadError};
use tokio::sync::{Semaphore, watch};
use tonic::{Request, Response, Status, Streaming};

use levee_broker::names;

use crate::queue::credit::{STREAM_START_TIMEOUT, SUBSCRIPTIONS_MAX};
use crate::queue::grpc_stream::{self, GrpcResponses};
use crate::queue::mailbox::subscription::{Session, check_start};
use crate::queue::stream;
use crate::queue::waiters::{Appended, DeleteRefused, Waiters};

use crate::config::QUEUE_MESSAGE_BYTES_MAX_MAX;
use crate::metrics::Metrics;
use crate::queue::limits::producer_rate::{Admission, ProducerRates};
use crate::queue::mailbox::many::{self, ManyContext, ManySession};
use crate::queue::mailbox::position_log::PositionLogs;
use crate::queue::mailbox::spread::SpreadSession;
use crate::queue::producer::idempotent::{Producers, SequencedMessage, check_producer_id};
use crate::queue::replicated::{
    Replication, forward_failed, forward_stream, forwarded, was_forwarded,
};
use crate::queue::topic::catalog::{RetentionRule, Topics};
use crate::queue::{StoreCalls, invalid, name_error, write_error};
use crate::server::GRPC_MESSAGE_BYTES_MAX;
use levee_cluster::shard::ShardGroups;

/// Most messages in one append request.
pub const APPEND_MESSAGES_MAX: usize = 10_000;
/// Most messages one read returns.
pub const READ_MESSAGES_MAX: u32 = 10_000;
/// Messages a read returns when it does not say.
pub const READ_MESSAGES_DEFAULT: u32 = 100;
/// Most payload bytes one read returns (it always returns at least one message if there is one).
pub const READ_BYTES_MAX: u32 = 4 << 20;
/// Payload bytes a read returns when it does not say.
pub const READ_BYTES_DEFAULT: u32 = 1 << 20;
/// Most queue names one list returns.
pub const LIST_LIMIT_MAX: u32 = 10_000;
/// Queue names a list returns when it does not say.
pub const LIST_LIMIT_DEFAULT: u32 = 1_000;
const _: () = assert!(
    READ_MESSAGES_DEFAULT <= READ_MESSAGES_MAX
        && READ_BYTES_DEFAULT <= READ_BYTES_MAX
        && LIST_LIMIT_DEFAULT <= LIST_LIMIT_MAX,
    "every default is within its bound"
);
const _: () = assert!(
    READ_BYTES_MAX as usize + QUEUE_MESSAGE_BYTES_MAX_MAX as usize <= GRPC_MESSAGE_BYTES_MAX / 2,
    "a read's response (its bytes, passed by one message at most) fits a gRPC message twice"
);

/// Implements `levee.v1.Queues` over a [`Store`].
#[derive(Debug, Clone)]
pub struct QueueService {
    calls: StoreCalls,
    topics: Arc<Topics>,
    producers: Arc<Producers>,
    producer_rates: Arc<ProducerRates>,
    subscriptions: Arc<Semaphore>,
    waiters: Arc<Waiters>,
    positions: Arc<PositionLogs>,
    metrics: Metrics,
    closing: watch::Receiver<bool>,
    /// Set in a cluster: whether plain queues are replicated, and through what.
    replication: Option<Replication>,
}

impl QueueService {
    /// A service over `calls`' store; subscriptions end when `closing` turns true (shutdown).
    /// `waiters` is shared with the topic service.
    pub fn new(
        calls: StoreCalls,
        waiters: Arc<Waiters>,
        topics: Arc<Topics>,
        producer_rates: Arc<ProducerRates>,
        positions: Arc<PositionLogs>,
        metrics: Metrics,
        closing: watch::Receiver<bool>,
    ) -> Self {
        Self {
            calls,
            positions,
            topics,
            producer_rates,
            producers: Arc::new(Producers::new(
                metrics.producer_messages_deduplicated.clone(),
            )),
            subscriptions: Arc::new(Semaphore::new(SUBSCRIPTIONS_MAX)),
            waiters,
            metrics,
            closing,
            replication: None,
        }
    }

    /// Waits, before a read of `queue` served here, until this node applied everything its
    /// shard committed (see [`Replication::read_barrier`]); at once without replication.
    pub(crate) async fn read_barrier(&self, queue: &[u8]) -> Result<(), WireError> {
        match &self.replication {
            Some(replication) => replication.read_barrier(queue).await,
            None => Ok(()),
        }
    }

    /// Where a read of `queue` goes when this node holds no replica of its shard (see
    /// [`Replication::read_elsewhere`]); `None`: served here.
    pub(crate) fn read_elsewhere(
        &self,
        queue: &[u8],
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<Option<(u64, tonic::transport::Channel)>, WireError> {
        match &self.replication {
            Some(replication) => {
                replication.read_elsewhere(queue, crate::queue::replicated::was_forwarded(metadata))
            }
            None => Ok(None),
        }
    }

    /// The service writing plain queues through the cluster's shards when `replication` says
    /// the cluster replicates them.
    #[must_use]
    pub fn with_replication(mut self, replication: Replication) -> Self {
        self.replication = Some(replication);
        self
    }

    /// The shard groups when the cluster replicates its queues (`None` when it does not),
    /// UNAVAILABLE while they open.
    pub(crate) fn replicated(&self) -> Result<Option<ShardGroups>, WireError> {
        Replication::groups_if_replicated(self.replication.as_ref())
    }

    /// The shard groups, when plain queues are replicated.
    fn shard_groups(&self) -> Option<Result<&ShardGroups, WireError>> {
        self.replication.as_ref().and_then(Replication::groups)
    }

    /// Runs `call` on the blocking pool once a slot is free.
    async fn blocking<T, F>(&self, call: F) -> Result<T, Status>
    where
        F: FnOnce(&levee_store::Store) -> Result<T, WireError> + Send + 'static,
        T: Send + 'static,
    {
        self.calls.run(call).await.map_err(Status::from)
    }

    /// Holds a request of `messages` messages until `producer_name`'s rate limit (if any)
    /// admits them.
    pub(crate) async fn admit_producer(
        &self,
        producer_name: &str,
        messages: u64,
    ) -> Result<Admission, WireError> {
        self.producer_rates.admit(producer_name, messages).await
    }
}

impl QueueService {
    /// A slot for one more subscription stream (single or many-queue).
    fn subscription_permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, WireError> {
        Arc::clone(&self.subscriptions)
            .try_acquire_owned()
            .map_err(|_| {
                WireError::new(
                    ErrorCode::ResourceExhausted,
                    format!(
                        "{SUBSCRIPTIONS_MAX} subscriptions are open on this server; retry later \
                         or subscribe on another server"
                    ),
                )
            })
    }

    /// Appends through the idempotent-producer table: resent runs are answered from memory.
    /// Returns each message's offset and whether this call stored it.
    pub async fn idempotent_append(
        &self,
        producer: &str,
        messages: &[SequencedMessage],
    ) -> Result<(Vec<u64>, Vec<bool>), Status> {
        let appended = self
            .producers
            .append(&self.calls.store, producer, messages)?;
        self.calls.durable(appended.ticket).await?;
        Ok((appended.offsets, appended.stored_now))
    }
}

fn input_error(error: &InputError) -> WireError {
    invalid(format!("{error}; fix the request"))
}

fn check_not_reserved(queue: &[u8]) -> Result<(), WireError> {
    names::check_not_reserved(queue).map_err(|error| name_error(&error))
}

/// The answer about a queue that does not exist.
fn queue_not_found(queue: &[u8]) -> WireError {
    WireError::new(
        ErrorCode::NotFound,
        format!(
            "queue '{}' does not exist; it is created by its first append",
            String::from_utf8_lossy(queue)
        ),
    )
}

fn read_error(error: ReadError) -> WireError {
    match error {
        ReadError::Input(input) => input_error(&input),
        other => WireError::new(ErrorCode::StorageFailed, other.to_string()),
    }
}

type SubscribeStream = GrpcResponses<SubscribeResponse>;
type SubscribeManyStream = GrpcResponses<SubscribeManyResponse>;

#[tonic::async_trait]
impl Queues for QueueService {
    type SubscribeStream = SubscribeStream;
    type SubscribeManyStream = SubscribeManyStream;

    async fn subscribe(
        &self,
        request: Request<Streaming<SubscribeRequest>>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let forwarded_here = was_forwarded(request.metadata());
        let mut incoming = grpc_stream::incoming(request.into_inner());
        let start = incoming
            .start(
                "SubscribeStart",
                STREAM_START_TIMEOUT,
                |message| match message.kind {
                    Some(SubscribeKind::Start(start)) => Some(start),
                    _ => None,
                },
            )
            .await?;
        check_start(&start)?;
        let permit = self.subscription_permit()?;
        if let Some((node, channel)) = match &self.replication {
            Some(replication) => replication.read_elsewhere(&start.queue, forwarded_here)?,
            None => None,
        } {
            // This node holds no replica of the queue's shard: the stream goes on through one.
            let first = SubscribeRequest {
                kind: Some(SubscribeKind::Start(start)),
            };
            return forward_stream(
                (node, true),
                (first, incoming, permit),
                |request| async move {
                    QueuesClient::new(channel)
                        .max_decoding_message_size(usize::MAX)
                        .subscribe(request)
                        .await
                },
            )
            .await;
        }
        let (outgoing, responses) = stream::channel();
        let session = Session {
            calls: self.calls.clone(),
            notify: self.waiters.register(&start.queue)?,
            waiters: Arc::clone(&self.waiters),
            positions: Arc::clone(&self.positions),
            replication: self.replication.clone(),
            start,
            incoming,
            outgoing,
            delivered: self.metrics.queue_messages_delivered.clone(),
            closing: self.closing.clone(),
        };
        tokio::spawn(async move {
            session.run().await;
            drop(permit);
        });
        Ok(Response::new(grpc_stream::responses(responses)))
    }

    async fn subscribe_many(
        &self,
        request: Request<Streaming<SubscribeManyRequest>>,
    ) -> Result<Response<Self::SubscribeManyStream>, Status> {
        let forwarded_here = was_forwarded(request.metadata());
        let mut incoming = grpc_stream::incoming(request.into_inner());
        let start = incoming
            .start(
                "SubscribeManyStart",
                STREAM_START_TIMEOUT,
                |message| match message.kind {
                    Some(SubscribeManyKind::Start(start)) => Some(start),
                    _ => None,
                },
            )
            .await?;
        many::check_start(&start)?;
        let permit = self.subscription_permit()?;
        let (outgoing, responses) = stream::channel();
        let context = ManyContext {
            calls: self.calls.clone(),
            waiters: Arc::clone(&self.waiters),
            positions: Arc::clone(&self.positions),
            replication: self.replication.clone(),
            delivered: self.metrics.queue_messages_delivered.clone(),
            handed_over: self.metrics.queue_messages_handed_over.clone(),
            mailboxes: self.metrics.queue_mailboxes_subscribed.clone(),
            closing: self.closing.clone(),
        };
        match &self.replication {
            Some(replication) if replication.spreads_many(forwarded_here)? => {
                // This node holds some shards only: the stream is served in parts.
                let parts_elsewhere = self.metrics.queue_mailbox_parts_elsewhere.clone();
                let session = SpreadSession::new(
                    (context, replication.clone(), parts_elsewhere),
                    start,
                    incoming,
                    outgoing,
                );
                tokio::spawn(async move {
                    session.run().await;
                    drop(permit);
                });
            }
            _ => {
                let session = ManySession::new(context, &start, incoming, outgoing);
                tokio::spawn(async move {
                    session.run().await;
                    drop(permit);
                });
            }
        }
        Ok(Response::new(grpc_stream::responses(responses)))
    }

    async fn append(
        &self,
        request: Request<AppendRequest>,
    ) -> Result<Response<AppendResponse>, Status> {
        let forwarded_here = was_forwarded(request.metadata());
        let request = request.into_inner();
        let (messages, producer) = (request.messages, request.producer_id);
        if messages.is_empty() || messages.len() > APPEND_MESSAGES_MAX {
            return Err(invalid(format!(
                "messages: send 1 to {APPEND_MESSAGES_MAX} messages per append, got {}",
                messages.len()
            ))
            .into());
        }
        for message in &messages {
            check_not_reserved(&message.queue)?;
        }
        let count = messages.len() as u64;
        let admission = self.admit_producer(&request.producer_name, count).await?;
        let offsets = if let Some(groups) = self.shard_groups() {
            let groups = groups?;
            let producer = if producer.is_empty() {
                None
            } else {
                check_producer_id(&producer)?;
                Some(producer.as_str())
            };
            let replication = self.replication.as_ref().ok_or_else(|| {
                WireError::new(ErrorCode::Internal, "shard groups without replication")
            })?;
            replication
                .append_anywhere(groups, (producer, forwarded_here), messages)
                .await?
        } else if producer.is_empty() {
            let batch: Vec<(&[u8], &[u8])> = messages
                .iter()
                .map(|message| (&message.queue[..], &message.payload[..]))
                .collect();
            let offsets = self.calls.append_batch(&batch).await?;
            // Visible to readers now (durable under `always`): caught-up mailboxes get the
            // messages with their wake-ups instead of reading them back.
            let appended: Vec<Appended<'_>> = batch
                .iter()
                .zip(&offsets)
                .map(|(&(queue, payload), &offset)| Appended {
                    queue,
                    offset,
                    payload,
                })
                .collect();
            self.waiters.wake_appended(&appended);
            offsets
        } else {
            let sequenced: Vec<SequencedMessage> = messages
                .into_iter()
                .map(|message| SequencedMessage {
                    queue: message.queue,
                    payload: message.payload,
                    sequence: message.sequence,
                })
                .collect();
            let (offsets, stored_now) = self.idempotent_append(&producer, &sequenced).await?;
            // The messages this call stored are handed over as above. A resend's are not (its
            // payload may differ from the one stored first): its queues are only woken.
            let mut appended = Vec::with_capacity(sequenced.len());
            let mut resent = Vec::new();
            for ((message, &offset), &stored) in sequenced.iter().zip(&offsets).zip(&stored_now) {
                if stored {
                    appended.push(Appended {
                        queue: &message.queue,
                        offset,
                        payload: &message.payload,
                    });
                } else {
                    resent.push(&message.queue[..]);
                }
            }
            self.waiters.wake_appended(&appended);
            if !resent.is_empty() {
                self.waiters.wake_all(&resent);
            }
            offsets
        };
        admission.stored();
        self.metrics.queue_messages_appended.inc_by(count);
        Ok(Response::new(AppendResponse { offsets }))
    }

    async fn read(&self, request: Request<ReadRequest>) -> Result<Response<ReadResponse>, Status> {
        check_not_reserved(&request.get_ref().queue)?;
        let elsewhere = self.read_elsewhere(&request.get_ref().queue, request.metadata())?;
        let request = request.into_inner();
        if let Some((node, channel)) = elsewhere {
            return QueuesClient::new(channel)
                .max_decoding_message_size(usize::MAX)
                .read(forwarded(request))
                .await
                .map_err(|status| forward_failed(node, status));
        }
        let max_messages = match request.max_messages {
            0 => READ_MESSAGES_DEFAULT,
            count if count <= READ_MESSAGES_MAX => count,
            count => {
                return Err(invalid(format!(
                    "max_messages must be 1 to {READ_MESSAGES_MAX} (or 0 for \
                     {READ_MESSAGES_DEFAULT}), got {count}"
                ))
                .into());
            }
        };
        let max_bytes = match request.max_bytes {
            0 => READ_BYTES_DEFAULT,
            bytes if bytes <= READ_BYTES_MAX => bytes,
            bytes => {
                return Err(invalid(format!(
                    "max_bytes must be at most {READ_BYTES_MAX} (or 0 for {READ_BYTES_DEFAULT}), \
                     got {bytes}"
                ))
                .into());
            }
        };
        self.read_barrier(&request.queue).await?;
        let batch = self
            .calls
            .store
            .read(
                &request.queue,
                request.offset,
                max_messages as usize,
                max_bytes as usize,
            )
            .map_err(read_error)?;
        // An empty answer from offset 0 may be a queue that does not exist: that is NOT_FOUND,
        // as GetQueueInfo says (one lookup, only for such answers).
        if batch.is_empty()
            && batch.visible_end_offset == 0
            && self
                .calls
                .store
                .queue_info(&request.queue)
                .map_err(|error| input_error(&error))?
                .is_none()
        {
            return Err(queue_not_found(&request.queue).into());
        }
        self.metrics.queue_messages_read.inc_by(batch.len() as u64);
        Ok(Response::new(ReadResponse {
            first_offset: batch.first_offset,
            next_offset: batch.next_offset(),
            skipped_to_first_retained: batch.skipped_to_first_retained,
            queue_next_offset: batch.visible_end_offset,
            payloads: crate::queue::payloads(batch).collect(),
        }))
    }

    async fn get_queue_info(
        &self,
        request: Request<GetQueueInfoRequest>,
    ) -> Result<Response<GetQueueInfoResponse>, Status> {
        check_not_reserved(&request.get_ref().queue)?;
        let elsewhere = self.read_elsewhere(&request.get_ref().queue, request.metadata())?;
        let queue = request.into_inner().queue;
        if let Some((node, channel)) = elsewhere {
            return QueuesClient::new(channel)
                .get_queue_info(forwarded(GetQueueInfoRequest { queue }))
                .await
                .map_err(|status| forward_failed(node, status));
        }
        self.read_barrier(&queue).await?;
        let info = self
            .calls
            .store
            .queue_info(&queue)
            .map_err(|error| input_error(&error))?;
        let info = info.ok_or_else(|| queue_not_found(&queue))?;
        let rule = self.topics.retention_for(&queue);
        Ok(Response::new(GetQueueInfoResponse {
            first_offset: info.first_offset,
            next_offset: info.next_offset,
            retention_max_age_ms: rule.max_age_ms,
            retention_max_bytes: rule.max_bytes,
        }))
    }

    async fn list_queues(
        &self,
        request: Request<ListQueuesRequest>,
    ) -> Result<Response<ListQueuesResponse>, Status> {
        let forwarded_here = was_forwarded(request.metadata());
        if forwarded_here && let Some(groups) = self.shard_groups() {
            crate::queue::replicated::check_listing_shards(groups?, request.metadata())?;
        }
        let request = request.into_inner();
        let limit = match request.limit {
            0 => LIST_LIMIT_DEFAULT,
            limit if limit <= LIST_LIMIT_MAX => limit,
            limit => {
                return Err(
                    invalid(format!("limit must be 1 to {LIST_LIMIT_MAX}, got {limit}")).into(),
                );
            }
        };
        names::check_name_prefix(&request.prefix).map_err(|error| name_error(&error))?;
        let start = if request.page_token.is_empty() {
            request.after
        } else {
            request.page_token
        };
        // The server's own queues sort first: a listing starts after them.
        let start = start.max(names::reserved_names_end());
        let prefix = request.prefix;
        let listing = match &self.replication {
            Some(replication) => replication.listing(forwarded_here)?,
            None => None,
        };
        let page = {
            let (start, prefix) = (start.clone(), prefix.clone());
            let limit = limit as usize;
            self.blocking(move |store| {
                Ok(store.list_queues_with_prefix(Some(&start), &prefix, limit + 1))
            })
            .await?
        };
        let mut page = ListPage::of(page, limit as usize);
        if let Some((groups, elsewhere)) = listing {
            // This node holds some shards only: its own queues of those, and each other
            // node's of the shards it holds, merged.
            page.queues.retain(|queue| {
                groups.replicates(crate::queue::replicated::shard_of_queue(
                    queue,
                    groups.shards(),
                ))
            });
            for (node, channel, shards) in elsewhere {
                let asked = ListQueuesRequest {
                    after: start.clone(),
                    limit,
                    prefix: prefix.clone(),
                    page_token: Vec::new(),
                };
                let mut asked = forwarded(asked);
                let shards: Vec<String> = shards.iter().map(ToString::to_string).collect();
                if let Ok(value) = shards.join(",").parse() {
                    asked
                        .metadata_mut()
                        .insert(crate::queue::replicated::LIST_SHARDS_HEADER, value);
                }
                let answer = QueuesClient::new(channel)
                    .list_queues(asked)
                    .await
                    .map_err(|status| forward_failed(node, status))?
                    .into_inner();
                page.merge(answer);
            }
        }
        Ok(Response::new(page.answer(limit as usize)))
    }

    async fn delete_queue(
        &self,
        request: Request<DeleteQueueRequest>,
    ) -> Result<Response<DeleteQueueResponse>, Status> {
        let forwarded_here = was_forwarded(request.metadata());
        let queue = request.into_inner().queue;
        check_not_reserved(&queue)?;
        let deleting = self.waiters.begin_delete(&queue).map_err(|refused| {
            let name = String::from_utf8_lossy(&queue);
            match refused {
                DeleteRefused::Subscribed => WireError::new(
                    ErrorCode::FailedPrecondition,
                    format!(
                        "queue '{name}' is held by an open subscription or a mailbox of a \
                         many-queue stream; remove the mailbox (or close the subscription) \
                         first, or its consumer could ack messages of the deleted queue"
                    ),
                ),
                DeleteRefused::InProgress => WireError::new(
                    ErrorCode::Unavailable,
                    format!("queue '{name}' is being deleted by another call; retry"),
                ),
            }
        })?;
        if let Some(groups) = self.shard_groups() {
            if let Some(replication) = &self.replication
                && let Some((node, channel)) =
                    replication.delete_elsewhere(&queue, forwarded_here)?
            {
                // This node can reach neither a replica of the queue's shard nor its leader
                // over the peer port: a replica's client port takes the delete.
                let answer = QueuesClient::new(channel)
                    .delete_queue(forwarded(DeleteQueueRequest { queue }))
                    .await
                    .map_err(|status| forward_failed(node, status));
                drop(deleting);
                return answer;
            }
            // Through the queue's shard: every replica deletes it and forgets the consumers'
            // positions on it, in log order. Held until then: no subscription of the queue
            // on this node meanwhile.
            let existed = Replication::delete(groups?, &queue).await;
            drop(deleting);
            return Ok(Response::new(DeleteQueueResponse { existed: existed? }));
        }
        let positions = Arc::clone(&self.positions);
        let existed = self
            .blocking(move |store| {
                // Held until the delete is done: no subscription of the queue meanwhile.
                let _deleting = deleting;
                if store
                    .queue_info(&queue)
                    .map_err(|error| input_error(&error))?
                    .is_none()
                {
                    return Ok(false);
                }
                // Consumers forget their positions first, so a queue created again under the
                // name is delivered from its start; a crash in between only redelivers.
                // Counted however it ends, failed part way (forgets written, or the queue gone
                // for readers) included: a stream that read positions meanwhile reads them
                // again.
                let _count = positions.counting_delete();
                positions.forget(&queue)?;
                store.delete_queue(&queue).map_err(write_error)
            })
            .await?;
        Ok(Response::new(DeleteQueueResponse { existed }))
    }

    async fn set_retention(
        &self,
        request: Request<SetRetentionRequest>,
    ) -> Result<Response<SetRetentionResponse>, Status> {
        let request = request.into_inner();
        let rule = RetentionRule {
            max_age_ms: request.max_age_ms,
            max_bytes: request.max_bytes,
        };
        self.topics.set_retention(&request.prefix, rule).await?;
        let topics = Arc::clone(&self.topics);
        let messages_removed = self
            .blocking(move |store| {
                let now_ms = crate::queue::delay::unix_ms();
                // Retry queues are trimmed by the minute's pass (it knows the groups).
                crate::queue::retention::enforce_retention(
                    store,
                    now_ms,
                    |name| topics.retention_for(name).to_store(),
                    |_| None,
                )
                .map_err(write_error)
            })
            .await?;
        Ok(Response::new(SetRetentionResponse { messages_removed }))
    }
}

/// A page of queue names from one or more sources (this node's store, other nodes), each
/// complete up to its `covered` name (all of its names up to it are in `queues`; `None`: all
/// of them, the source is exhausted).
#[derive(Debug)]
struct ListPage {
    queues: Vec<Vec<u8>>,
    covered: Option<Vec<u8>>,
}

impl ListPage {
    /// The store's answer to a scan for `limit + 1` names.
    fn of(mut scanned: Vec<Vec<u8>>, limit: usize) -> Self {
        let covered = (scanned.len() > limit).then(|| {
            scanned.truncate(limit);
            scanned.last().cloned().unwrap_or_default()
        });
        Self {
            queues: scanned,
            covered,
        }
    }

    /// Adds another node's page: covered up to the lesser of the two.
    fn merge(&mut self, other: ListQueuesResponse) {
        self.queues.extend(other.queues);
        if !other.next_page_token.is_empty() {
            let other = other.next_page_token;
            self.covered = Some(match self.covered.take() {
                Some(mine) => mine.min(other),
                None => other,
            });
        }
    }

    /// The names up to what every source covered, sorted, each once, at most `limit`; the
    /// next page starts after the last one when names may follow.
    fn answer(mut self, limit: usize) -> ListQueuesResponse {
        if let Some(covered) = &self.covered {
            self.queues.retain(|queue| queue <= covered);
        }
        self.queues.sort_unstable();
        self.queues.dedup();
        let next_page_token = if self.queues.len() > limit {
            self.queues.truncate(limit);
            self.queues.last().cloned().unwrap_or_default()
        } else {
            self.covered.unwrap_or_default()
        };
        ListQueuesResponse {
            queues: self.queues,
            next_page_token,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(names: &[&str]) -> Vec<Vec<u8>> {
        names.iter().map(|name| name.as_bytes().to_vec()).collect()
    }

    #[test]
    fn given_pages_of_several_nodes_then_the_merge_holds_what_all_covered_in_order_once() {
        // This node's store: more than the limit of 3, so covered up to "d".
        let mut page = ListPage::of(names(&["a", "c", "d", "f"]), 3);
        // Another node: covered up to "e" (its page was full), one name shared.
        page.merge(ListQueuesResponse {
            queues: names(&["b", "c", "e"]),
            next_page_token: b"e".to_vec(),
        });
        // A third node, exhausted: "g" lies past what the others covered.
        page.merge(ListQueuesResponse {
            queues: names(&["bb", "g"]),
            next_page_token: Vec::new(),
        });
        let answer = page.answer(3);
        assert_eq!(answer.queues, names(&["a", "b", "bb"]));
        assert_eq!(answer.next_page_token, b"bb");

        // Every source exhausted: the last page.
        let mut last = ListPage::of(names(&["x"]), 3);
        last.merge(ListQueuesResponse {
            queues: names(&["w", "x"]),
            next_page_token: Vec::new(),
        });
        let answer = last.answer(3);
        assert_eq!(answer.queues, names(&["w", "x"]));
        assert!(answer.next_page_token.is_empty());

        // Fewer names than the limit (filtered, or the others covered less): not the last page.
        let mut short = ListPage::of(names(&["a", "b", "c", "d"]), 3);
        short.merge(ListQueuesResponse {
            queues: names(&["a0"]),
            next_page_token: b"a5".to_vec(),
        });
        let answer = short.answer(3);
        assert_eq!(answer.queues, names(&["a", "a0"]));
        assert_eq!(answer.next_page_token, b"a5");
    }
}
