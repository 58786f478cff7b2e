//! The `levee.v1.Topics` gRPC service: topics, keyed publishing, consumer groups and their rate
//! limits. Publishing goes through the same store calls and idempotent-producer table as
//! `Queues.Append`; a member's stream is a [`ConsumeSession`].

use std::sync::Arc;

use levee_proto::v1::consume_request::Kind as ConsumeKind;
use levee_proto::v1::topics_server::Topics as TopicsApi;
use levee_proto::v1::{
    ConsumeRequest, ConsumeResponse, CreateTopicRequest, CreateTopicResponse, DescribeGroupRequest,
    DescribeGroupResponse, DescribeProducerRequest, DescribeProducerResponse, DescribeTopicRequest,
    DescribeTopicResponse, ErrorCode, GroupMember, GroupPartition, ListTopicsRequest,
    ListTopicsResponse, PartitionInfo, PublishRequest, PublishResponse, SetGroupRateRequest,
    SetGroupRateResponse, SetProducerRateRequest, SetProducerRateResponse, TopicSummary,
};
use levee_proto::{WireError, topic_partition};
use tokio::sync::Semaphore;
use tonic::{Request, Response, Status, Streaming};

use levee_broker::names::{check_group_name, check_producer_name};

use crate::queue::credit::{STREAM_START_TIMEOUT, SUBSCRIPTIONS_MAX};
use crate::queue::grpc_stream::{self, GrpcResponses};
use crate::queue::producer::idempotent::SequencedMessage;
use crate::queue::service::{APPEND_MESSAGES_MAX, QueueService};
use crate::queue::stream;
use crate::queue::topic::consume::{ConsumeContext, ConsumeSession, now_ms, topic_wake_key};
use crate::queue::{lock, name_error};

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
        group: &str,
        topic: &str,
    ) -> Result<DescribeGroupResponse, WireError> {
        check_group_name(group).map_err(|error| name_error(&error))?;
        let found = context.topics.require(topic)?;
        let handle = {
            let (groups, group, found) = (
                Arc::clone(&context.groups),
                group.to_owned(),
                Arc::clone(&found),
            );
            context
                .calls
                .run(move |store| groups.find(store, &group, &found))
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
        for ((partition, (owner, epoch)), committed) in
            (0_u32..).zip(state.owners()).zip(state.committed())
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
            partitions.push(GroupPartition {
                partition,
                owner: owner.unwrap_or_default().to_owned(),
                epoch,
                committed_offset: *committed,
                next_offset,
            });
        }
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
        let name = request.into_inner().topic;
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
        let request = request.into_inner();
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
        let mut partitions = Vec::with_capacity(count);
        let mut messages = Vec::with_capacity(count);
        for message in request.messages {
            let partition = match message.partition_plus_one {
                0 => topic_partition(&message.key, topic.partitions()),
                explicit if explicit <= topic.partitions() => explicit - 1,
                explicit => {
                    return Err(WireError::new(
                        ErrorCode::InvalidArgument,
                        format!(
                            "partition {} does not exist; topic '{}' has {} partitions",
                            explicit - 1,
                            topic.name,
                            topic.partitions()
                        ),
                    )
                    .into());
                }
            };
            partitions.push(partition);
            messages.push((message.payload, message.sequence));
        }
        let admission = self
            .queues
            .admit_producer(&request.producer_name, count as u64)
            .await?;
        let queue_of = |partition: u32| &topic.queues[partition as usize];
        let offsets = if request.producer_id.is_empty() {
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
        }))
    }

    async fn consume(
        &self,
        request: Request<Streaming<ConsumeRequest>>,
    ) -> Result<Response<Self::ConsumeStream>, Status> {
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
        let (outgoing, responses) = stream::channel();
        let session =
            ConsumeSession::join(Arc::clone(&self.context), start, incoming, outgoing).await?;
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
        let request = request.into_inner();
        Ok(Response::new(
            Self::describe_group_now(&self.context, &request.group, &request.topic).await?,
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
}
