//! [`Client`]: a connection to one Levee server and the calls it offers.

use std::sync::Arc;
use std::time::Duration;

use levee_proto::v1::admin_client::AdminClient;
use levee_proto::v1::cluster_client::ClusterClient;
use levee_proto::v1::hot_keys_client::HotKeysClient;
use levee_proto::v1::queues_client::QueuesClient;
use levee_proto::v1::topics_client::TopicsClient;
use levee_proto::v1::{
    AddNodeRequest, GetClusterRequest, GetClusterResponse, MemberRole, RemoveNodeRequest,
    WatchMembersRequest, WatchMembersResponse,
};
use levee_proto::v1::{
    AppendMessage, AppendRequest, DeleteQueueRequest, GetQueueInfoRequest, GetQueueInfoResponse,
    ListQueuesRequest, ListQueuesResponse, ReadRequest, ReadResponse, SetRetentionRequest,
};
use levee_proto::v1::{
    CreateTopicRequest, DescribeGroupRequest, DescribeGroupResponse, DescribeProducerRequest,
    DescribeProducerResponse, DescribeTopicRequest, DescribeTopicResponse, ListTopicsRequest,
    PublishMessage, PublishRequest, SetGroupRateRequest, SetProducerRateRequest, TopicSummary,
};
use levee_proto::v1::{
    EchoRequest, GetAppStatsRequest, GetAppStatsResponse, GetRulesRequest, GetServerInfoRequest,
    GetServerInfoResponse, HotKeyEvent, HotKeyRule, KeyCount, ListAppsRequest, ListHotKeysRequest,
    RemoveHotKeyRequest, SetHotKeyRequest, SetRulesRequest, TopKeysRequest,
};
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::error::ClientError;

/// Largest queue request or response the client sends or takes (the server's limit).
const QUEUE_MESSAGE_BYTES_MAX: usize = 16 << 20;

/// How a [`Client`] connects and how long calls may take.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Most time to establish the connection.
    pub connect_timeout: Duration,
    /// Default deadline of each call, sent to the server as `grpc-timeout`.
    pub request_timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// A server's health as the standard gRPC health service reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthStatus {
    /// Serving requests.
    Serving,
    /// Up but not serving (for example: shutting down).
    NotServing,
    /// The server does not know the service asked about.
    Unknown,
}

/// A connection to one Levee server. Cheap to clone; clones share the connection.
#[derive(Debug, Clone)]
pub struct Client {
    channel: Channel,
    /// Sent with every append and publish: the server paces them by this name's rate limit.
    producer_name: Option<Arc<str>>,
}

impl Client {
    /// Connects to `address` (`HOST:PORT`) with default options.
    pub async fn connect(address: &str) -> Result<Self, ClientError> {
        Self::connect_with(address, &ClientOptions::default()).await
    }

    /// The endpoint of `address` (`HOST:PORT` or a URI) with `options`.
    fn endpoint(address: &str, options: &ClientOptions) -> Result<Endpoint, ClientError> {
        let uri = if address.contains("://") {
            address.to_owned()
        } else {
            format!("http://{address}")
        };
        let endpoint = Endpoint::from_shared(uri).map_err(|error| ClientError::InvalidAddress {
            address: address.to_owned(),
            reason: error.to_string(),
        })?;
        Ok(endpoint
            .connect_timeout(options.connect_timeout)
            .timeout(options.request_timeout)
            .tcp_nodelay(true))
    }

    /// A client of `address` that connects on first use (and reconnects after a failure).
    pub(crate) fn connect_lazy(
        address: &str,
        options: &ClientOptions,
    ) -> Result<Self, ClientError> {
        Ok(Self {
            channel: Self::endpoint(address, options)?.connect_lazy(),
            producer_name: None,
        })
    }

    /// This connection, naming its appends as `other` does.
    pub(crate) fn with_producer_name_of(self, other: &Client) -> Self {
        Self {
            channel: self.channel,
            producer_name: other.producer_name.clone(),
        }
    }

    /// Connects to `address` with `options`.
    pub async fn connect_with(address: &str, options: &ClientOptions) -> Result<Self, ClientError> {
        let channel = Self::endpoint(address, options)?
            .connect()
            .await
            .map_err(|source| ClientError::Connect {
                address: address.to_owned(),
                source,
            })?;
        Ok(Self {
            channel,
            producer_name: None,
        })
    }

    /// This connection, naming its appends and publishes (and those of every [`crate::Producer`]
    /// built on it) as coming from `producer_name` (1 to 64 bytes): an operator's rate limit for
    /// that name (`set_producer_rate`) then paces them on the server. Many processes may share
    /// a name.
    #[must_use]
    pub fn with_producer_name(&self, producer_name: &str) -> Self {
        Self {
            channel: self.channel.clone(),
            producer_name: Some(Arc::from(producer_name)),
        }
    }

    /// The connection, for the SDK's own streams.
    pub(crate) fn channel(&self) -> Channel {
        self.channel.clone()
    }

    pub(crate) fn producer_name(&self) -> String {
        self.producer_name.as_deref().unwrap_or_default().to_owned()
    }

    /// The server's version, addresses, data directory and uptime.
    pub async fn server_info(&self) -> Result<GetServerInfoResponse, ClientError> {
        let response = AdminClient::new(self.channel.clone())
            .get_server_info(GetServerInfoRequest {})
            .await?;
        Ok(response.into_inner())
    }

    /// Sends `payload` and gets it back after `delay` (at most 60 s) on the server.
    pub async fn echo(&self, payload: Vec<u8>, delay: Duration) -> Result<Vec<u8>, ClientError> {
        let delay_ms = u32::try_from(delay.as_millis()).unwrap_or(u32::MAX);
        let response = AdminClient::new(self.channel.clone())
            .echo(EchoRequest { payload, delay_ms })
            .await?;
        Ok(response.into_inner().payload)
    }

    /// The server's view of its cluster: the leader, the term, its log and apply positions,
    /// and every member with its role, addresses, health and (on the leader) lag.
    pub async fn cluster(&self) -> Result<GetClusterResponse, ClientError> {
        let response = ClusterClient::new(self.channel.clone())
            .get_cluster(GetClusterRequest {})
            .await?;
        Ok(response.into_inner())
    }

    /// The cluster's members now, then again at every change (each item is the whole list).
    pub async fn watch_members(
        &self,
    ) -> Result<tonic::Streaming<WatchMembersResponse>, ClientError> {
        let response = ClusterClient::new(self.channel.clone())
            .watch_members(WatchMembersRequest {})
            .await?;
        Ok(response.into_inner())
    }

    /// Adds the node `node` (a learner first, then a voter unless `learner`); answers its role.
    pub async fn add_node(&self, node: AddNodeRequest) -> Result<MemberRole, ClientError> {
        let response = ClusterClient::new(self.channel.clone())
            .add_node(node)
            .await?;
        Ok(response.into_inner().role())
    }

    /// Removes node `node_id` from the cluster; it stops serving.
    pub async fn remove_node(&self, node_id: u64) -> Result<(), ClientError> {
        ClusterClient::new(self.channel.clone())
            .remove_node(RemoveNodeRequest { node_id })
            .await?;
        Ok(())
    }

    /// Asks the standard gRPC health service about `service` (`""` for the whole server).
    pub async fn health(&self, service: &str) -> Result<HealthStatus, ClientError> {
        let response = HealthClient::new(self.channel.clone())
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await?;
        Ok(match response.into_inner().status() {
            ServingStatus::Serving => HealthStatus::Serving,
            ServingStatus::NotServing => HealthStatus::NotServing,
            ServingStatus::Unknown | ServingStatus::ServiceUnknown => HealthStatus::Unknown,
        })
    }

    fn hot_keys_client(&self) -> HotKeysClient<Channel> {
        HotKeysClient::new(self.channel.clone())
    }

    /// Replaces an app's hot-key rules (creating the app).
    pub async fn set_hot_key_rules(
        &self,
        app: &str,
        rules: Vec<HotKeyRule>,
    ) -> Result<(), ClientError> {
        self.hot_keys_client()
            .set_rules(SetRulesRequest {
                app: app.to_owned(),
                rules,
            })
            .await?;
        Ok(())
    }

    /// An app's hot-key rules.
    pub async fn hot_key_rules(&self, app: &str) -> Result<Vec<HotKeyRule>, ClientError> {
        let response = self
            .hot_keys_client()
            .get_rules(GetRulesRequest {
                app: app.to_owned(),
            })
            .await?;
        Ok(response.into_inner().rules)
    }

    /// The apps the server knows.
    pub async fn hot_key_apps(&self) -> Result<Vec<String>, ClientError> {
        Ok(self
            .hot_keys_client()
            .list_apps(ListAppsRequest {})
            .await?
            .into_inner()
            .apps)
    }

    /// Sets `key` hot by hand for `duration`; it is pushed like a detected hot key.
    pub async fn set_hot_key(
        &self,
        app: &str,
        key: &[u8],
        duration: Duration,
    ) -> Result<(), ClientError> {
        let duration_ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
        self.hot_keys_client()
            .set_hot_key(SetHotKeyRequest {
                app: app.to_owned(),
                key: key.to_vec(),
                duration_ms,
            })
            .await?;
        Ok(())
    }

    /// Cools `key` by hand. Returns whether it was hot.
    pub async fn remove_hot_key(&self, app: &str, key: &[u8]) -> Result<bool, ClientError> {
        let response = self
            .hot_keys_client()
            .remove_hot_key(RemoveHotKeyRequest {
                app: app.to_owned(),
                key: key.to_vec(),
            })
            .await?;
        Ok(response.into_inner().was_hot)
    }

    /// The app's hot keys now.
    pub async fn hot_keys(&self, app: &str) -> Result<Vec<HotKeyEvent>, ClientError> {
        let response = self
            .hot_keys_client()
            .list_hot_keys(ListHotKeysRequest {
                app: app.to_owned(),
            })
            .await?;
        Ok(response.into_inner().hot)
    }

    /// The app's `limit` keys with the highest window counts now.
    pub async fn top_keys(&self, app: &str, limit: u32) -> Result<Vec<KeyCount>, ClientError> {
        let response = self
            .hot_keys_client()
            .top_keys(TopKeysRequest {
                app: app.to_owned(),
                limit,
            })
            .await?;
        Ok(response.into_inner().keys)
    }

    /// The app's hot-key counters on this server.
    pub async fn hot_key_stats(&self, app: &str) -> Result<GetAppStatsResponse, ClientError> {
        let response = self
            .hot_keys_client()
            .get_app_stats(GetAppStatsRequest {
                app: app.to_owned(),
            })
            .await?;
        Ok(response.into_inner())
    }

    pub(crate) fn queues_client(&self) -> QueuesClient<Channel> {
        QueuesClient::new(self.channel.clone())
            .max_decoding_message_size(QUEUE_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(QUEUE_MESSAGE_BYTES_MAX)
    }

    /// Appends `payload` to `queue` and returns its offset once the server says it is durable.
    pub async fn append(&self, queue: &[u8], payload: &[u8]) -> Result<u64, ClientError> {
        let offsets = self.append_batch(&[(queue, payload)]).await?;
        offsets.first().copied().ok_or_else(|| {
            ClientError::Server(levee_proto::WireError::new(
                levee_proto::v1::ErrorCode::Internal,
                "the server answered an append without an offset",
            ))
        })
    }

    /// Appends messages to any queues in one request; returns their offsets in order.
    pub async fn append_batch(&self, messages: &[(&[u8], &[u8])]) -> Result<Vec<u64>, ClientError> {
        let request = AppendRequest {
            messages: messages
                .iter()
                .map(|(queue, payload)| AppendMessage {
                    queue: levee_proto::Bytes::copy_from_slice(queue),
                    payload: levee_proto::Bytes::copy_from_slice(payload),
                    sequence: 0,
                })
                .collect(),
            producer_id: String::new(),
            producer_name: self.producer_name(),
        };
        self.send_append(request).await
    }

    /// Appends as idempotent producer `producer_id`: each message is `(queue, payload,
    /// sequence)`, sequences consecutive per queue. Resending the same request (after a timeout,
    /// say) stores nothing twice and answers with the original offsets.
    pub async fn append_idempotent(
        &self,
        producer_id: &str,
        messages: &[(&[u8], &[u8], u64)],
    ) -> Result<Vec<u64>, ClientError> {
        let request = AppendRequest {
            messages: messages
                .iter()
                .map(|(queue, payload, sequence)| AppendMessage {
                    queue: levee_proto::Bytes::copy_from_slice(queue),
                    payload: levee_proto::Bytes::copy_from_slice(payload),
                    sequence: *sequence,
                })
                .collect(),
            producer_id: producer_id.to_owned(),
            producer_name: self.producer_name(),
        };
        self.send_append(request).await
    }

    /// Appends messages already in their request form (the producer's batches), as
    /// idempotent producer `producer_id` unless it is empty.
    pub(crate) async fn append_messages(
        &self,
        messages: Vec<AppendMessage>,
        producer_id: String,
    ) -> Result<Vec<u64>, ClientError> {
        let request = AppendRequest {
            messages,
            producer_id,
            producer_name: self.producer_name(),
        };
        self.send_append(request).await
    }

    async fn send_append(&self, request: AppendRequest) -> Result<Vec<u64>, ClientError> {
        Ok(self
            .queues_client()
            .append(request)
            .await?
            .into_inner()
            .offsets)
    }

    /// Reads up to `max_messages` messages of `queue` from `offset` (0 for the server's
    /// defaults); fewer than asked is normal: read again from `next_offset`.
    pub async fn read(
        &self,
        queue: &[u8],
        offset: u64,
        max_messages: u32,
        max_bytes: u32,
    ) -> Result<ReadResponse, ClientError> {
        let request = ReadRequest {
            queue: queue.to_vec(),
            offset,
            max_messages,
            max_bytes,
        };
        Ok(self.queues_client().read(request).await?.into_inner())
    }

    /// A queue's first retained offset and next offset.
    pub async fn queue_info(&self, queue: &[u8]) -> Result<GetQueueInfoResponse, ClientError> {
        let request = GetQueueInfoRequest {
            queue: queue.to_vec(),
        };
        Ok(self
            .queues_client()
            .get_queue_info(request)
            .await?
            .into_inner())
    }

    /// Up to `limit` queue names after `after` (empty: from the start).
    pub async fn list_queues(&self, after: &[u8], limit: u32) -> Result<Vec<Vec<u8>>, ClientError> {
        let request = ListQueuesRequest {
            after: after.to_vec(),
            limit,
            ..ListQueuesRequest::default()
        };
        Ok(self
            .queues_client()
            .list_queues(request)
            .await?
            .into_inner()
            .queues)
    }

    /// One page of the queue names that start with `prefix` (empty: all), in byte order:
    /// the first page for an empty `page_token`, else the page after the one whose
    /// `next_page_token` it is. The page's `next_page_token` is empty on the last page (a short
    /// page is not the last one by itself).
    pub async fn list_queue_page(
        &self,
        prefix: &[u8],
        page_token: &[u8],
        limit: u32,
    ) -> Result<ListQueuesResponse, ClientError> {
        let request = ListQueuesRequest {
            limit,
            prefix: prefix.to_vec(),
            page_token: page_token.to_vec(),
            ..ListQueuesRequest::default()
        };
        Ok(self
            .queues_client()
            .list_queues(request)
            .await?
            .into_inner())
    }

    /// Deletes `queue`; returns whether it existed.
    pub async fn delete_queue(&self, queue: &[u8]) -> Result<bool, ClientError> {
        let request = DeleteQueueRequest {
            queue: queue.to_vec(),
        };
        Ok(self
            .queues_client()
            .delete_queue(request)
            .await?
            .into_inner()
            .existed)
    }

    /// Sets the retention of queues whose names start with `prefix` (the longest matching
    /// prefix wins; empty: every queue): oldest messages go once older than `max_age_ms` or
    /// while the queue holds more than `max_bytes` (0: no bound; both 0 removes the rule).
    /// Returns the messages the pass run at once removed.
    pub async fn set_retention(
        &self,
        prefix: &[u8],
        max_age_ms: u64,
        max_bytes: u64,
    ) -> Result<u64, ClientError> {
        let request = SetRetentionRequest {
            prefix: prefix.to_vec(),
            max_age_ms,
            max_bytes,
        };
        Ok(self
            .queues_client()
            .set_retention(request)
            .await?
            .into_inner()
            .messages_removed)
    }

    /// Subscribes `consumer` to `queue`: messages after its last ack, then new ones as they are
    /// appended, at most `credit_messages` (1 to 100000) unacked at a time.
    pub async fn subscribe(
        &self,
        queue: &[u8],
        consumer: &str,
        credit_messages: u32,
    ) -> Result<crate::Subscription, ClientError> {
        crate::Subscription::open(self.queues_client(), queue, consumer, credit_messages).await
    }

    /// [`Client::subscribe`] that moves by itself, as [`Client::subscribe_many_following`]
    /// says: when its node goes away it opens itself again through another member and goes on
    /// from the consumer's last confirmed ack ([`crate::Subscription::start_offset`] then says
    /// where); an ack cut short says so once the subscription is open again.
    pub async fn subscribe_following(
        &self,
        queue: &[u8],
        consumer: &str,
        credit_messages: u32,
    ) -> Result<crate::Subscription, ClientError> {
        let subscription = self.subscribe(queue, consumer, credit_messages).await?;
        Ok(subscription
            .following(self.clone(), (queue, consumer, credit_messages))
            .await)
    }

    /// Opens `consumer`'s stream over many queues (mailboxes), with `credit_messages` (1 to
    /// 100000) in flight over all of them; add queues with [`crate::Mailboxes::add`].
    pub async fn subscribe_many(
        &self,
        consumer: &str,
        credit_messages: u32,
    ) -> Result<crate::Mailboxes, ClientError> {
        crate::Mailboxes::open(self.queues_client(), consumer, credit_messages).await
    }

    /// [`Client::subscribe_many`] that moves by itself: when its node goes away (the stream
    /// fails with `UNAVAILABLE` or a broken connection) it opens the stream again through
    /// another member of the cluster (asked of this node, or of the members it knew), adds
    /// every queue again under the same mailbox numbers (removed ones removed again) and goes
    /// on, for up to 30 s per move. Delivery resumes after the consumer's last confirmed ack:
    /// messages taken or acked but not confirmed are delivered again (at least once); in a
    /// cluster that replicates its queues, no message whose ack was confirmed is delivered
    /// again (docs/CLUSTER.md, "Consumers' positions"). A queue deleted while the stream moved
    /// (its node went away before it applied the delete, so neither stream hears of it) ends
    /// the stream with `FAILED_PRECONDITION`, as a server ends one whose queue it deletes:
    /// after each move the stream asks the new node (`GetQueueInfo`, 64 at a time) whether
    /// each queue it delivered from still exists, at least as far as it delivered (a queue
    /// created again with more messages than were delivered is not told apart). The same
    /// holds for [`Client::subscribe_following`].
    pub async fn subscribe_many_following(
        &self,
        consumer: &str,
        credit_messages: u32,
    ) -> Result<crate::Mailboxes, ClientError> {
        let mailboxes = self.subscribe_many(consumer, credit_messages).await?;
        Ok(mailboxes.following(self.clone(), consumer).await)
    }

    pub(crate) fn topics_client(&self) -> TopicsClient<Channel> {
        TopicsClient::new(self.channel.clone())
            .max_decoding_message_size(QUEUE_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(QUEUE_MESSAGE_BYTES_MAX)
    }

    /// Creates `topic` with `partitions` partitions; `Ok(true)` if it existed with that count.
    pub async fn create_topic(&self, topic: &str, partitions: u32) -> Result<bool, ClientError> {
        let request = CreateTopicRequest {
            topic: topic.to_owned(),
            partitions,
        };
        Ok(self
            .topics_client()
            .create_topic(request)
            .await?
            .into_inner()
            .existed)
    }

    /// A topic's partitions with their first and next offsets.
    pub async fn describe_topic(&self, topic: &str) -> Result<DescribeTopicResponse, ClientError> {
        let request = DescribeTopicRequest {
            topic: topic.to_owned(),
        };
        Ok(self
            .topics_client()
            .describe_topic(request)
            .await?
            .into_inner())
    }

    /// Every topic with its partition count.
    pub async fn list_topics(&self) -> Result<Vec<TopicSummary>, ClientError> {
        Ok(self
            .topics_client()
            .list_topics(ListTopicsRequest {})
            .await?
            .into_inner()
            .topics)
    }

    /// Publishes `(key, payload)` messages to `topic` (partition = XXH3-64(key) mod P); returns
    /// each message's `(partition, offset)` once durable.
    pub async fn publish(
        &self,
        topic: &str,
        messages: &[(&[u8], &[u8])],
    ) -> Result<Vec<(u32, u64)>, ClientError> {
        let request = PublishRequest {
            topic: topic.to_owned(),
            messages: messages
                .iter()
                .map(|(key, payload)| PublishMessage {
                    key: levee_proto::Bytes::copy_from_slice(key),
                    payload: levee_proto::Bytes::copy_from_slice(payload),
                    ..PublishMessage::default()
                })
                .collect(),
            producer_id: String::new(),
            producer_name: self.producer_name(),
        };
        self.publish_request(request).await
    }

    /// Sends a prepared publish request (explicit partitions, an idempotent producer).
    pub async fn publish_request(
        &self,
        request: PublishRequest,
    ) -> Result<Vec<(u32, u64)>, ClientError> {
        let response = self.topics_client().publish(request).await?.into_inner();
        Ok(response
            .partitions
            .into_iter()
            .zip(response.offsets)
            .collect())
    }

    /// A consumer group's members, owners, epochs, committed offsets and rate on `topic`.
    pub async fn describe_group(
        &self,
        group: &str,
        topic: &str,
    ) -> Result<DescribeGroupResponse, ClientError> {
        let request = DescribeGroupRequest {
            group: group.to_owned(),
            topic: topic.to_owned(),
        };
        Ok(self
            .topics_client()
            .describe_group(request)
            .await?
            .into_inner())
    }

    /// Sets `group`'s delivery rate limit in messages per second (0 clears it).
    pub async fn set_group_rate(
        &self,
        group: &str,
        messages_per_s: f64,
    ) -> Result<(), ClientError> {
        let request = SetGroupRateRequest {
            group: group.to_owned(),
            messages_per_s,
        };
        self.topics_client().set_group_rate(request).await?;
        Ok(())
    }

    /// Sets the append rate limit of every request naming `producer_name` (see
    /// [`Client::with_producer_name`]) in messages per second (0 clears it).
    pub async fn set_producer_rate(
        &self,
        producer_name: &str,
        messages_per_s: f64,
    ) -> Result<(), ClientError> {
        let request = SetProducerRateRequest {
            producer_name: producer_name.to_owned(),
            messages_per_s,
        };
        self.topics_client().set_producer_rate(request).await?;
        Ok(())
    }

    /// A producer name's rate limit, the messages admitted under it and the seconds waited.
    pub async fn describe_producer(
        &self,
        producer_name: &str,
    ) -> Result<DescribeProducerResponse, ClientError> {
        let request = DescribeProducerRequest {
            producer_name: producer_name.to_owned(),
        };
        Ok(self
            .topics_client()
            .describe_producer(request)
            .await?
            .into_inner())
    }

    /// The raw `Topics` gRPC client on this connection (for the consumer).
    pub(crate) fn raw_topics_client(&self) -> TopicsClient<Channel> {
        self.topics_client()
    }
}
