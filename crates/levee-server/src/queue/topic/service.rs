//! The `levee.v1.Topics` gRPC service: topics, keyed publishing, consumer groups and their rate
//! limits. Publishing goes through the same store calls and idempotent-producer table as
//! `Queues.Append`; a member's stream is a [`ConsumeSession`].

use std::sync::Arc;

use levee_proto::v1::consume_request::Kind as ConsumeKind;
use levee_proto::v1::topics_client::TopicsClient;
use levee_proto::v1::topics_server::Topics as TopicsApi;
use levee_proto::v1::{
    AppendMessage, ConsumeRequest, ConsumeResponse, CreateTopicRequest, CreateTopicResponse,
    DescribeGroupRequest, DescribeGroupResponse, DescribeProducerRequest, DescribeProducerResponse,
    DescribeTopicRequest, DescribeTopicResponse, ErrorCode, GroupMember, GroupPartition,
    ListTopicsRequest, ListTopicsResponse, PartitionInfo, PublishMessage, PublishRequest,
    PublishResponse, SetGroupRateRequest, SetGroupRateResponse, SetProducerRateRequest,
    SetProducerRateResponse, TopicSummary,
};
use levee_proto::v1::{
    DescribeRetryPolicyRequest, DescribeRetryPolicyResponse, ListDeadLettersRequest,
    ListDeadLettersResponse, RedriveDeadLettersRequest, RedriveDeadLettersResponse,
    ResetGroupOffsetsRequest, ResetGroupOffsetsResponse, SetRetryPolicyRequest,
    SetRetryPolicyResponse,
};
use levee_proto::{WireError, topic_partition};
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status, Streaming};

use levee_broker::delay::DelayedEntry;
use levee_broker::names::{check_group_name, check_producer_name, retry_queue};
use levee_broker::retry::{DELAY_MS_MAX, RetryPolicy};

use crate::metrics::GroupLabels;
use crate::queue::credit::{STREAM_START_TIMEOUT, SUBSCRIPTIONS_MAX};
use crate::queue::grpc_stream::{self, GrpcResponses};
use crate::queue::producer::idempotent::{SequencedMessage, check_producer_id};
use crate::queue::replicated::{
    Coordinator, Lead, forward_failed, forward_stream, forwarded, outgoing,
};
use crate::queue::service::{APPEND_MESSAGES_MAX, QueueService};
use crate::queue::stream;
use crate::queue::topic::catalog::Topic;
use crate::queue::topic::consume::{ConsumeContext, ConsumeSession, now_ms, topic_wake_key};
use crate::queue::topic::retry;
use crate::queue::{lock, name_error};

/// Where a consumer group's call was served.
enum Served<Request, Answer> {
    /// Here (this node coordinates the topic's groups, as `Lead` in a replicated cluster).
    Here(Request, Option<Lead>),
    /// By the coordinator: its answer.
    There(Response<Answer>),
}

/// Implements `levee.v1.Topics`.
#[derive(Debug, Clone)]
pub struct TopicService {
    queues: QueueService,
    context: Arc<ConsumeContext>,
    streams: Arc<Semaphore>,
}

impl TopicService {
    /// A service sharing `queues`' store calls, producers and wake-ups.
    pub fn new(queues: QueueService, context: Arc<ConsumeContext>) -> Self {
        Self {
            queues,
            context,
            streams: Arc::new(Semaphore::new(SUBSCRIPTIONS_MAX)),
        }
    }

    /// Describes `group` on `topic` (for the admin HTTP port too). A group not in memory is
    /// loaded from its commits on the blocking pool.
    pub async fn describe_group_now(
        context: &ConsumeContext,
        (group, topic): (&str, &str),
        lead: Option<Lead>,
    ) -> Result<DescribeGroupResponse, WireError> {
        check_group_name(group).map_err(|error| name_error(&error))?;
        let found = context.topics.require(topic)?;
        if let Some(lead) = &lead {
            lead.settle().await?;
        }
        let term = lead.as_ref().map_or(0, |lead| lead.term);
        let handle = {
            let (groups, group, found) = (
                Arc::clone(&context.groups),
                group.to_owned(),
                Arc::clone(&found),
            );
            context
                .calls
                .run(move |store| groups.find(store, &group, &found, term))
                .await?
        }
        .ok_or_else(|| {
            WireError::new(
                ErrorCode::NotFound,
                format!(
                    "group '{group}' has no member and no commit on topic '{topic}'; it \
                         exists once a member joins"
                ),
            )
        })?;
        let now = now_ms();
        let state = &lock(&handle).state;
        let mut members: Vec<GroupMember> = state
            .members()
            .map(|(member, expires_at_ms)| GroupMember {
                member: member.to_owned(),
                partitions: Vec::new(),
                lease_left_ms: expires_at_ms.saturating_sub(now),
            })
            .collect();
        let mut partitions = Vec::new();
        for (((partition, (owner, epoch)), committed), retry_committed) in (0_u32..)
            .zip(state.owners())
            .zip(state.committed())
            .zip(state.retry_committed())
        {
            if let Some(member) = members
                .iter_mut()
                .find(|member| Some(member.member.as_str()) == owner)
            {
                member.partitions.push(partition);
            }
            let next_offset = context
                .calls
                .store
                .queue_info(&found.queues[partition as usize])
                .ok()
                .flatten()
                .map_or(0, |info| info.next_offset);
            let retry_next_offset = context
                .calls
                .store
                .queue_info(&retry_queue(group, topic, partition))
                .ok()
                .flatten()
                .map_or(0, |info| info.next_offset);
            partitions.push(GroupPartition {
                partition,
                owner: owner.unwrap_or_default().to_owned(),
                epoch,
                committed_offset: *committed,
                next_offset,
                retry_committed_offset: *retry_committed,
                retry_next_offset,
            });
        }
        let labels = GroupLabels::new(group);
        let metrics = &context.metrics;
        let pacer = context.pacers.get(group, context.topics.rate(group));
        Ok(DescribeGroupResponse {
            group: group.to_owned(),
            topic: topic.to_owned(),
            generation: state.generation(),
            members,
            partitions,
            rate_limit_per_s: context.topics.rate(group),
            delivered: pacer.delivered(),
            throttled_s: pacer.throttled_s(),
            retries_scheduled: metrics.group_retries_scheduled.get_or_create(&labels).get(),
            dead_lettered: metrics.group_dead_lettered.get_or_create(&labels).get(),
            redriven: metrics.group_redriven.get_or_create(&labels).get(),
        })
    }

    /// Sets `group`'s rate durably and applies it at once.
    pub async fn set_rate(
        context: &ConsumeContext,
        group: String,
        messages_per_s: f64,
    ) -> Result<(), WireError> {
        let pacers = &context.pacers;
        context
            .topics
            .set_rate(&group, messages_per_s, || {
                pacers.set(&group, messages_per_s);
            })
            .await
    }

    /// Sets `producer_name`'s append rate durably and applies it at once.
    pub async fn set_producer_rate(
        context: &ConsumeContext,
        producer_name: String,
        messages_per_s: f64,
    ) -> Result<(), WireError> {
        let rates = &context.producer_rates;
        context
            .topics
            .set_producer_rate(&producer_name, messages_per_s, || {
                rates.set(&producer_name, messages_per_s);
            })
            .await
    }

    /// `group`'s retry policy.
    pub fn describe_retry_policy_now(
        context: &ConsumeContext,
        group: String,
    ) -> Result<DescribeRetryPolicyResponse, WireError> {
        check_group_name(&group).map_err(|error| name_error(&error))?;
        let (policy, is_default) = context.topics.retry_policy(&group);
        Ok(DescribeRetryPolicyResponse {
            group,
            delays_ms: policy.delays_ms,
            max_attempts: policy.max_attempts,
            is_default,
        })
    }

    /// `producer_name`'s limit and figures.
    pub fn describe_producer_now(
        context: &ConsumeContext,
        producer_name: &str,
    ) -> Result<DescribeProducerResponse, WireError> {
        check_producer_name(producer_name).map_err(|error| name_error(&error))?;
        let figures = context.producer_rates.figures(producer_name);
        Ok(DescribeProducerResponse {
            producer_name: producer_name.to_owned(),
            rate_limit_per_s: figures.rate_limit_per_s,
            admitted: figures.admitted,
            throttled_s: figures.throttled_s,
        })
    }
}

/// The partition `message` goes to: the one it names, else its key's.
fn partition_of(topic: &Topic, message: &PublishMessage) -> Result<u32, WireError> {
    match message.partition_plus_one {
        0 => Ok(topic_partition(&message.key, topic.partitions())),
        explicit if explicit <= topic.partitions() => Ok(explicit - 1),
        explicit => Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!(
                "partition {} does not exist; topic '{}' has {} partitions",
                explicit - 1,
                topic.name,
                topic.partitions()
            ),
        )),
    }
}

/// When a message asks to be delivered (ms since the Unix epoch), `None` for at once; a time
/// too far ahead is refused.
fn delivery_time(message: &PublishMessage, now_ms: u64) -> Result<Option<u64>, WireError> {
    if message.delay_ms > DELAY_MS_MAX {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!(
                "delay_ms is at most {DELAY_MS_MAX} (7 days), got {}",
                message.delay_ms
            ),
        ));
    }
    if message.deliver_at_ms > now_ms.saturating_add(DELAY_MS_MAX) {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!(
                "deliver_at_ms {} is more than 7 days ({DELAY_MS_MAX} ms) after the server's \
                 clock ({now_ms}); deliver sooner",
                message.deliver_at_ms
            ),
        ));
    }
    let due = message
        .deliver_at_ms
        .max(now_ms.saturating_add(message.delay_ms));
    Ok((due > now_ms).then_some(due))
}

impl TopicService {
    /// Serves a consumer group's call on the topic `topic_of` names: here when this node
    /// coordinates the topic's groups, else by `call` on the coordinator
    /// (`Replication::coordinator`).
    async fn group_call<Message, Answer, Call, Calling>(
        &self,
        request: Request<Message>,
        topic_of: fn(&Message) -> &str,
        call: Call,
    ) -> Result<Served<Message, Answer>, Status>
    where
        Call: FnOnce(TopicsClient<tonic::transport::Channel>, Request<Message>) -> Calling,
        Calling: std::future::Future<Output = Result<Response<Answer>, Status>>,
    {
        let forwarded_here = crate::queue::replicated::was_forwarded(request.metadata());
        let coordinator = self
            .context
            .replication
            .coordinator(topic_of(request.get_ref()), forwarded_here)?;
        match coordinator {
            Coordinator::Here(lead) => Ok(Served::Here(request.into_inner(), lead)),
            Coordinator::Elsewhere {
                node,
                channel,
                mark,
            } => {
                let client = TopicsClient::new(channel).max_decoding_message_size(usize::MAX);
                call(client, outgoing(request.into_inner(), mark))
                    .await
                    .map(Served::There)
                    .map_err(|status| forward_failed(node, status))
            }
        }
    }

    /// Where a call or stream of `topic` goes when this node holds no replica of the topic's
    /// shard (see `Replication::read_elsewhere`; the shard is the topic name's, whether this
    /// node's catalog knows the topic yet or not); `None`: served here.
    fn topic_elsewhere(
        &self,
        topic: &str,
        metadata: &tonic::metadata::MetadataMap,
    ) -> Result<Option<(u64, tonic::transport::Channel)>, WireError> {
        self.queues
            .read_elsewhere(&levee_broker::names::partition_queue(topic, 0), metadata)
    }

    /// Publishes through the topic's shard: the partitions' messages are replicated like a
    /// plain queue's, an idempotent producer's judged in the shard's log. The offsets.
    async fn publish_replicated(
        groups: &levee_cluster::shard::ShardGroups,
        topic: &Topic,
        (partitions, messages): (&[u32], Vec<(levee_proto::Bytes, u64)>),
        producer_id: &str,
    ) -> Result<Vec<u64>, WireError> {
        let producer = if producer_id.is_empty() {
            None
        } else {
            check_producer_id(producer_id)?;
            Some(producer_id)
        };
        let messages = partitions
            .iter()
            .zip(messages)
            .map(|(&partition, (payload, sequence))| AppendMessage {
                queue: levee_proto::Bytes::copy_from_slice(&topic.queues[partition as usize]),
                payload,
                sequence,
            })
            .collect();
        crate::queue::replicated::Replication::append(groups, producer, messages).await
    }

    /// A request's messages as delayed entries (one not delayed is due `now`).
    fn delayed_entries(
        topic: &Topic,
        partitions: &[u32],
        messages: &[(levee_proto::Bytes, u64)],
        due: &[u64],
        now: u64,
    ) -> Vec<DelayedEntry> {
        partitions
            .iter()
            .zip(messages)
            .zip(due)
            .map(|((&partition, (payload, _)), &due_ms)| DelayedEntry {
                // A message not delayed is due now: it is appended at once.
                due_ms: due_ms.max(now),
                topic: topic.name.clone(),
                target: topic.queues[partition as usize].clone(),
                body: payload.to_vec(),
            })
            .collect()
    }

    /// Publishes a request with delayed messages: those due later wait in the delayer, the
    /// others are appended at once. Returns the offsets (0 for the delayed ones) once durable.
    async fn publish_delayed(
        &self,
        topic: &Topic,
        partitions: &[u32],
        messages: &[(levee_proto::Bytes, u64)],
        due: &[u64],
        now: u64,
    ) -> Result<Vec<u64>, WireError> {
        let entries = Self::delayed_entries(topic, partitions, messages, due, now);
        let (delayed, immediate): (Vec<_>, Vec<_>) =
            (0..entries.len()).partition(|&index| due[index] > now);
        let mut offsets = vec![0; entries.len()];
        let batch: Vec<(&[u8], &[u8])> = immediate
            .iter()
            .map(|&index| {
                (
                    entries[index].target.as_slice(),
                    entries[index].body.as_slice(),
                )
            })
            .collect();
        let waiting: Vec<DelayedEntry> = delayed
            .iter()
            .map(|&index| entries[index].clone())
            .collect();
        let scheduled = self.context.delayer.schedule(&waiting, now)?;
        if !batch.is_empty() {
            let stored = self.context.calls.append_batch(&batch).await?;
            for (index, offset) in immediate.into_iter().zip(stored) {
                offsets[index] = offset;
            }
        }
        self.context.calls.durable(scheduled.ticket).await?;
        Ok(offsets)
    }
}

type ConsumeStream = GrpcResponses<ConsumeResponse>;

#[tonic::async_trait]
impl TopicsApi for TopicService {
    type ConsumeStream = ConsumeStream;

    async fn create_topic(
        &self,
        request: Request<CreateTopicRequest>,
    ) -> Result<Response<CreateTopicResponse>, Status> {
        let request = request.into_inner();
        let existed = self
            .context
            .topics
            .create(&request.topic, request.partitions)
            .await?;
        Ok(Response::new(CreateTopicResponse { existed }))
    }

    async fn describe_topic(
        &self,
        request: Request<DescribeTopicRequest>,
    ) -> Result<Response<DescribeTopicResponse>, Status> {
        let elsewhere = self.topic_elsewhere(&request.get_ref().topic, request.metadata())?;
        let name = request.into_inner().topic;
        if let Some((node, channel)) = elsewhere {
            return TopicsClient::new(channel)
                .describe_topic(forwarded(DescribeTopicRequest { topic: name }))
                .await
                .map_err(|status| forward_failed(node, status));
        }
        let topic = self.context.topics.require_current(&name).await?;
        let store = &self.context.calls.store;
        let partitions = (0_u32..)
            .zip(&topic.queues)
            .map(|(partition, queue)| {
                let info = store.queue_info(queue).ok().flatten();
                PartitionInfo {
                    partition,
                    first_offset: info.map_or(0, |info| info.first_offset),
                    next_offset: info.map_or(0, |info| info.next_offset),
                }
            })
            .collect();
        Ok(Response::new(DescribeTopicResponse {
            topic: name,
            partitions,
        }))
    }

    async fn list_topics(
        &self,
        _request: Request<ListTopicsRequest>,
    ) -> Result<Response<ListTopicsResponse>, Status> {
        self.context.topics.linearize().await?;
        let topics = self
            .context
            .topics
            .list()
            .iter()
            .map(|topic| TopicSummary {
                topic: topic.name.clone(),
                partitions: topic.partitions(),
            })
            .collect();
        Ok(Response::new(ListTopicsResponse { topics }))
    }

    async fn publish(
        &self,
        request: Request<PublishRequest>,
    ) -> Result<Response<PublishResponse>, Status> {
        let elsewhere = self.topic_elsewhere(&request.get_ref().topic, request.metadata())?;
        let request = request.into_inner();
        if let Some((node, channel)) = elsewhere {
            // This node holds no replica of the topic's shard: published through one.
            return TopicsClient::new(channel)
                .publish(forwarded(request))
                .await
                .map_err(|status| forward_failed(node, status));
        }
        let topic = self.context.topics.require_current(&request.topic).await?;
        let count = request.messages.len();
        if count == 0 || count > APPEND_MESSAGES_MAX {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "messages: send 1 to {APPEND_MESSAGES_MAX} messages per publish, got {count}"
                ),
            )
            .into());
        }
        let now = crate::queue::delay::unix_ms();
        let mut partitions = Vec::with_capacity(count);
        let mut messages = Vec::with_capacity(count);
        let mut due = Vec::new();
        for (index, message) in request.messages.iter().enumerate() {
            if let Some(due_ms) = delivery_time(message, now)? {
                if !request.producer_id.is_empty() {
                    return Err(WireError::new(
                        ErrorCode::InvalidArgument,
                        "a delayed message cannot have a producer_id (delayed messages are not \
                         deduplicated); publish it without one",
                    )
                    .into());
                }
                due.resize(index, 0);
                due.push(due_ms);
            }
        }
        if !due.is_empty() {
            due.resize(count, 0);
        }
        let replicated = self.queues.replicated()?;
        for message in request.messages {
            let partition = partition_of(&topic, &message)?;
            partitions.push(partition);
            messages.push((message.payload, message.sequence));
        }
        let admission = self
            .queues
            .admit_producer(&request.producer_name, count as u64)
            .await?;
        let queue_of = |partition: u32| &topic.queues[partition as usize];
        let offsets = if replicated.is_some() && !due.is_empty() {
            // Through the topic's shard, which keeps the delayed ones in its slots.
            let entries = Self::delayed_entries(&topic, &partitions, &messages, &due, now);
            self.context.delayer.append_through_shards(entries).await?
        } else if let Some(groups) = &replicated {
            Self::publish_replicated(
                groups,
                &topic,
                (&partitions, messages),
                &request.producer_id,
            )
            .await?
        } else if !due.is_empty() {
            self.publish_delayed(&topic, &partitions, &messages, &due, now)
                .await?
        } else if request.producer_id.is_empty() {
            // The partitions' queue names are borrowed, not copied per message.
            let batch: Vec<(&[u8], &[u8])> = partitions
                .iter()
                .zip(&messages)
                .map(|(&partition, (payload, _))| (queue_of(partition).as_slice(), &payload[..]))
                .collect();
            self.context.calls.append_batch(&batch).await?
        } else {
            let sequenced: Vec<SequencedMessage> = partitions
                .iter()
                .zip(messages)
                .map(|(&partition, (payload, sequence))| SequencedMessage {
                    queue: levee_proto::Bytes::copy_from_slice(queue_of(partition)),
                    payload,
                    sequence,
                })
                .collect();
            self.queues
                .idempotent_append(&request.producer_id, &sequenced)
                .await?
                .0
        };
        admission.stored();
        self.context
            .metrics
            .topic_messages_published
            .inc_by(count as u64);
        self.context.waiters.wake(&topic_wake_key(&topic.name));
        Ok(Response::new(PublishResponse {
            partitions,
            offsets,
            deliver_at_ms: due,
        }))
    }

    async fn consume(
        &self,
        request: Request<Streaming<ConsumeRequest>>,
    ) -> Result<Response<Self::ConsumeStream>, Status> {
        let metadata = request.metadata().clone();
        let mut incoming = grpc_stream::incoming(request.into_inner());
        let start = incoming
            .start(
                "ConsumeStart",
                STREAM_START_TIMEOUT,
                |message| match message.kind {
                    Some(ConsumeKind::Start(start)) => Some(start),
                    _ => None,
                },
            )
            .await?;
        let permit = Arc::clone(&self.streams).try_acquire_owned().map_err(|_| {
            WireError::new(
                ErrorCode::ResourceExhausted,
                format!("{SUBSCRIPTIONS_MAX} consume streams are open on this server; retry later"),
            )
        })?;
        let forwarded_here = crate::queue::replicated::was_forwarded(&metadata);
        let lead = match self
            .context
            .replication
            .coordinator(&start.topic, forwarded_here)?
        {
            Coordinator::Here(lead) => lead,
            Coordinator::Elsewhere {
                node,
                channel,
                mark,
            } => {
                // The member's stream goes on through the coordinator: the leader of the
                // topic's shard.
                let first = ConsumeRequest {
                    kind: Some(ConsumeKind::Start(start)),
                };
                return forward_stream(
                    (node, mark),
                    (first, incoming, permit),
                    |request| async move {
                        TopicsClient::new(channel)
                            .max_decoding_message_size(usize::MAX)
                            .consume(request)
                            .await
                    },
                )
                .await;
            }
        };
        let (outgoing, responses) = stream::channel();
        let session =
            ConsumeSession::join(Arc::clone(&self.context), (start, lead), incoming, outgoing)
                .await?;
        tokio::spawn(async move {
            session.run().await;
            drop(permit);
        });
        Ok(Response::new(grpc_stream::responses(responses)))
    }

    async fn describe_group(
        &self,
        request: Request<DescribeGroupRequest>,
    ) -> Result<Response<DescribeGroupResponse>, Status> {
        let served = self
            .group_call(
                request,
                |request| &request.topic,
                |mut client, request| async move { client.describe_group(request).await },
            )
            .await?;
        let (request, lead) = match served {
            Served::Here(request, lead) => (request, lead),
            Served::There(answer) => return Ok(answer),
        };
        Ok(Response::new(
            Self::describe_group_now(&self.context, (&request.group, &request.topic), lead).await?,
        ))
    }

    async fn set_group_rate(
        &self,
        request: Request<SetGroupRateRequest>,
    ) -> Result<Response<SetGroupRateResponse>, Status> {
        let request = request.into_inner();
        Self::set_rate(&self.context, request.group, request.messages_per_s).await?;
        Ok(Response::new(SetGroupRateResponse {}))
    }

    async fn set_producer_rate(
        &self,
        request: Request<SetProducerRateRequest>,
    ) -> Result<Response<SetProducerRateResponse>, Status> {
        let request = request.into_inner();
        Self::set_producer_rate(&self.context, request.producer_name, request.messages_per_s)
            .await?;
        Ok(Response::new(SetProducerRateResponse {}))
    }

    async fn describe_producer(
        &self,
        request: Request<DescribeProducerRequest>,
    ) -> Result<Response<DescribeProducerResponse>, Status> {
        let request = request.into_inner();
        Ok(Response::new(Self::describe_producer_now(
            &self.context,
            &request.producer_name,
        )?))
    }

    async fn set_retry_policy(
        &self,
        request: Request<SetRetryPolicyRequest>,
    ) -> Result<Response<SetRetryPolicyResponse>, Status> {
        let request = request.into_inner();
        let policy = (!request.reset_to_default).then_some(RetryPolicy {
            delays_ms: request.delays_ms,
            max_attempts: request.max_attempts,
        });
        retry::set_policy(&self.context, &request.group, policy).await?;
        Ok(Response::new(SetRetryPolicyResponse {}))
    }

    async fn describe_retry_policy(
        &self,
        request: Request<DescribeRetryPolicyRequest>,
    ) -> Result<Response<DescribeRetryPolicyResponse>, Status> {
        let group = request.into_inner().group;
        Ok(Response::new(Self::describe_retry_policy_now(
            &self.context,
            group,
        )?))
    }

    async fn list_dead_letters(
        &self,
        request: Request<ListDeadLettersRequest>,
    ) -> Result<Response<ListDeadLettersResponse>, Status> {
        // A group's dead letters are its coordinator's own (docs/CLUSTER.md).
        let served = self
            .group_call(
                request,
                |request| &request.topic,
                |mut client, request| async move { client.list_dead_letters(request).await },
            )
            .await?;
        let (request, lead) = match served {
            Served::Here(request, lead) => (request, lead),
            Served::There(answer) => return Ok(answer),
        };
        if let Some(lead) = &lead {
            // A new coordinator first applies every dead letter the shard holds.
            lead.settle().await?;
        }
        Ok(Response::new(
            retry::list_dead_letters(&self.context, request).await?,
        ))
    }

    async fn redrive_dead_letters(
        &self,
        request: Request<RedriveDeadLettersRequest>,
    ) -> Result<Response<RedriveDeadLettersResponse>, Status> {
        let served = self
            .group_call(
                request,
                |request| &request.topic,
                |mut client, request| async move { client.redrive_dead_letters(request).await },
            )
            .await?;
        let (request, lead) = match served {
            Served::Here(request, lead) => (request, lead),
            Served::There(answer) => return Ok(answer),
        };
        let redriven = retry::redrive(
            &self.context,
            (request.group, request.topic),
            (request.offsets, request.all),
            lead,
        )
        .await?;
        Ok(Response::new(RedriveDeadLettersResponse { redriven }))
    }

    async fn reset_group_offsets(
        &self,
        request: Request<ResetGroupOffsetsRequest>,
    ) -> Result<Response<ResetGroupOffsetsResponse>, Status> {
        let served = self
            .group_call(
                request,
                |request| &request.topic,
                |mut client, request| async move { client.reset_group_offsets(request).await },
            )
            .await?;
        let (request, lead) = match served {
            Served::Here(request, lead) => (request, lead),
            Served::There(answer) => return Ok(answer),
        };
        Ok(Response::new(
            retry::reset_offsets(&self.context, request, lead).await?,
        ))
    }
}
