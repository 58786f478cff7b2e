//! The server's Prometheus metrics: one registry, the handles that code updates, and a
//! collector that reads the process's memory, CPU and file descriptors at each scrape.

use std::sync::{Arc, OnceLock, Weak};
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels of a finished gRPC call.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The full method path, such as `/levee.v1.Admin/Echo`, or `unknown`.
    pub rpc: String,
    /// The gRPC status code's name, such as `OK` or `INVALID_ARGUMENT`.
    pub code: &'static str,
}

/// Labels of a latency observation.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    /// The full method path, or `unknown`.
    pub rpc: String,
}

/// Labels of a per-app hot-key metric.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AppLabels {
    /// The app.
    pub app: String,
}

impl AppLabels {
    /// Labels for `app`.
    pub fn new(app: &str) -> Self {
        Self {
            app: app.to_owned(),
        }
    }
}

/// Labels of a per-resource limits metric.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    /// The limits resource.
    pub resource: String,
}

/// Labels of a per-consumer-group metric.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GroupLabels {
    /// The consumer group.
    pub group: String,
}

impl GroupLabels {
    /// Labels for `group`.
    pub fn new(group: &str) -> Self {
        Self {
            group: group.to_owned(),
        }
    }
}

/// The label of per-producer-name metrics (only names with a rate limit have them).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProducerLabels {
    /// The producer name requests carry.
    pub producer_name: String,
}

impl ProducerLabels {
    /// Labels for `producer_name`.
    pub fn new(producer_name: &str) -> Self {
        Self {
            producer_name: producer_name.to_owned(),
        }
    }
}

/// A counter of seconds.
pub type SecondsCounter = Counter<f64, std::sync::atomic::AtomicU64>;
/// A gauge of a fractional value.
pub type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// Labels that say why or what kind.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// The reason or kind, from a fixed set.
    pub reason: &'static str,
}

type HistogramFamily = Family<RpcLabels, Histogram, fn() -> Histogram>;

/// Every metric the server exports. Cheap to clone; clones share the same values.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// gRPC connections open now.
    pub grpc_connections_open: Gauge,
    /// Times the leader this node knows changed to another node (docs/CLUSTER.md).
    pub cluster_leader_changes: Counter,
    /// gRPC connections accepted since start.
    pub grpc_connections_accepted: Counter,
    /// Failed `accept` calls (for example: out of file descriptors).
    pub grpc_accept_errors: Counter,
    /// Finished gRPC calls by method and status code.
    pub grpc_requests: Family<RequestLabels, Counter>,
    /// gRPC call latency by method, from request headers to the end of the response.
    pub grpc_request_duration_seconds: HistogramFamily,
    /// Hot-key reports (key, count pairs) counted, by app.
    pub hotkey_keys_received: Family<AppLabels, Counter>,
    /// Hits counted (the sum of report counts), by app.
    pub hotkey_hits_received: Family<AppLabels, Counter>,
    /// Keys that turned hot by detection, by app.
    pub hotkey_hot_detected: Family<AppLabels, Counter>,
    /// Events published to apps' channels, by kind (`hot`, `cool`).
    pub hotkey_events_published: Family<ReasonLabels, Counter>,
    /// Events delivered to app servers (one event to one app server counts once).
    pub hotkey_events_delivered: Counter,
    /// App servers sent a fresh snapshot because they fell behind.
    pub hotkey_resyncs: Counter,
    /// Reports refused, by reason.
    pub hotkey_reports_rejected: Family<ReasonLabels, Counter>,
    /// App servers connected, by app.
    pub hotkey_clients_connected: Family<AppLabels, Gauge>,
    /// Permits granted in leases, by limits resource (docs/LIMITS.md).
    pub limits_permits_granted: Family<ResourceLabels, Counter>,
    /// Permits clients asked for in their lease requests (their demand), by limits resource:
    /// beside the granted, what the rule held back.
    pub limits_permits_demanded: Family<ResourceLabels, Counter>,
    /// Each resource's budget in permits per second now (the adaptive budget where the rule
    /// has one), as the lease requests found it.
    pub limits_budget_per_second: Family<ResourceLabels, FloatGauge>,
    /// Calls clients reported in their lease requests, by limits resource.
    pub limits_calls_reported: Family<ResourceLabels, Counter>,
    /// Of them, failed.
    pub limits_call_errors_reported: Family<ResourceLabels, Counter>,
    /// Each resource's breaker: 0 closed, 1 half-open, 2 open (resources with a breaker).
    pub limits_breaker_state: Family<ResourceLabels, Gauge>,
    /// Times each resource's breaker opened since this node became the leader.
    pub limits_breaker_opens: Family<ResourceLabels, Gauge>,
    /// Lease sessions open on this node.
    pub limits_lease_sessions: Gauge,
    /// Bytes the hot-key engines use.
    pub hotkey_memory_bytes: Gauge,
    /// The hot-key engines' memory budget.
    pub hotkey_memory_budget_bytes: Gauge,
    /// Keys with an exact window.
    pub hotkey_keys_tracked: Gauge,
    /// Keys the memory budget kept out of (or evicted from) the exact windows.
    pub hotkey_budget_evictions: Counter,
    /// Messages appended to queues (acknowledged).
    pub queue_messages_appended: Counter,
    /// Messages returned by queue reads.
    pub queue_messages_read: Counter,
    /// Messages pushed to subscriptions (redeliveries included).
    pub queue_messages_delivered: Counter,
    /// Of those, mailbox messages handed to their stream by the append (not read back).
    pub queue_messages_handed_over: Counter,
    /// Queues subscribed on `SubscribeMany` streams (mailboxes), over all streams.
    pub queue_mailboxes_subscribed: Gauge,
    /// Parts of `SubscribeMany` streams opened on other nodes (this node holds some shards
    /// only).
    pub queue_mailbox_parts_elsewhere: Counter,
    /// Compactions of consumers' position logs (`SubscribeMany` acks).
    pub queue_position_log_compactions: Counter,
    /// Consumers' positions forgotten because their queue was deleted.
    pub queue_position_forgets: Counter,
    /// Messages published to topics (acknowledged).
    pub topic_messages_published: Counter,
    /// Messages of idempotent appends answered from memory instead of stored again.
    pub producer_messages_deduplicated: Counter,
    /// Messages delivered to consumer-group members, by group.
    pub group_messages_delivered: Family<GroupLabels, Counter>,
    /// Each group's configured rate limit in messages per second (0: none).
    pub group_rate_limit_per_second: Family<GroupLabels, FloatGauge>,
    /// Seconds group deliveries waited for the rate limit, by group.
    pub group_throttled_seconds: Family<GroupLabels, SecondsCounter>,
    /// Each rate-limited producer name's limit in messages per second (0: cleared).
    pub producer_rate_limit_per_second: Family<ProducerLabels, FloatGauge>,
    /// Messages admitted under a producer rate limit, by producer name.
    pub producer_messages_admitted: Family<ProducerLabels, Counter>,
    /// Seconds appends waited for their producer's rate limit, by producer name.
    pub producer_throttled_seconds: Family<ProducerLabels, SecondsCounter>,
    /// Failed messages scheduled for a retry, by group.
    pub group_retries_scheduled: Family<GroupLabels, Counter>,
    /// Failed messages moved to the dead letters, by group.
    pub group_dead_lettered: Family<GroupLabels, Counter>,
    /// Dead letters redriven into the retry path, by group.
    pub group_redriven: Family<GroupLabels, Counter>,
    /// Shard snapshots this node installed (a replica behind its leader's purged log).
    pub shard_snapshots_installed: Counter,
    /// Time from a shard log append to its fsync (the shards' group commit).
    pub shard_log_append_seconds: Histogram,
    /// Time a shard's run of committed entries waited, while applied, for the store's fsync
    /// of earlier batches or for a blocking thread.
    pub shard_apply_wait_seconds: Histogram,
    /// Time a shard took to apply a run of committed entries (the wait included).
    pub shard_apply_seconds: Histogram,
    /// Time a write proposed on this node (a shard's leader) took until committed and applied.
    pub shard_commit_seconds: Histogram,
    /// Positions writes (a stream's ack batch, per shard) through the shards.
    pub shard_positions_writes: Counter,
    /// Shard entries this node merged its positions writes into.
    pub shard_positions_entries: Counter,
    /// Append requests through this node's shard appenders, committed.
    pub shard_append_requests: Counter,
    /// Shard entries this node merged its append requests into.
    pub shard_append_entries: Counter,
    /// Streams of shard calls this node opened to its peers.
    pub shard_peer_streams_opened: Counter,
    /// Shards whose leader's process this node found gone and called an election of at once.
    pub shard_leaders_gone: Counter,
    /// Shard snapshot files this node wrote to send to a replica.
    pub shard_snapshots_written: Counter,
    /// Messages that wait for their time (retries and delayed publishes) on this server.
    pub delayed_messages_waiting: Gauge,
    /// Messages placed to wait (retries and delayed publishes).
    pub delayed_messages_scheduled: Counter,
    /// Waiting messages delivered to their queue once due.
    pub delayed_messages_delivered: Counter,
    /// How long after its time each waiting message was appended to its queue.
    pub delayed_delivery_lateness_seconds: Histogram,
    /// Consumer-group members connected, by group.
    pub group_members: Family<GroupLabels, Gauge>,
    /// Rebalances, by group.
    pub group_rebalances: Family<GroupLabels, Counter>,
    /// Consume streams this node ended because it stopped coordinating their group (it lost
    /// the lead of the topic's shard), by group.
    pub group_coordinator_lost: Family<GroupLabels, Counter>,
    /// The queue store whose figures `/metrics` reports, once it is open.
    store: Arc<OnceLock<Weak<levee_store::Store>>>,
    /// This node's Raft instance of the metadata group, once it is open.
    raft: Arc<OnceLock<MetadataRaft>>,
}

fn latency_histogram() -> Histogram {
    // 50 µs to about 105 s in 22 doubling buckets.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 22))
}

/// Registers `metric` under `name` and returns a handle to it.
fn registered<M>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M
where
    M: prometheus_client::registry::Metric + Clone,
{
    registry.register(name, help, metric.clone());
    metric
}

impl Metrics {
    /// A registry with every metric at zero, plus the process collector.
    // One registration per metric: long, but flat and easy to scan.
    #[allow(clippy::too_many_lines)]
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let registry_ref = &mut registry;
        let metrics = Self {
            cluster_leader_changes: registered(
                registry_ref,
                "levee_cluster_leader_changes",
                "times the metadata group's leader, as this node knows it, became another node",
                Counter::default(),
            ),
            grpc_connections_open: registered(
                registry_ref,
                "levee_grpc_connections_open",
                "gRPC connections open now",
                Gauge::default(),
            ),
            grpc_connections_accepted: registered(
                registry_ref,
                "levee_grpc_connections_accepted",
                "gRPC connections accepted since start",
                Counter::default(),
            ),
            grpc_accept_errors: registered(
                registry_ref,
                "levee_grpc_accept_errors",
                "failed accept calls on the gRPC listener",
                Counter::default(),
            ),
            grpc_requests: registered(
                registry_ref,
                "levee_grpc_requests",
                "finished gRPC calls by method and status code",
                Family::default(),
            ),
            grpc_request_duration_seconds: registered(
                registry_ref,
                "levee_grpc_request_duration_seconds",
                "gRPC call latency by method, from request headers to the end of the response",
                HistogramFamily::new_with_constructor(latency_histogram as fn() -> Histogram),
            ),
            hotkey_keys_received: registered(
                registry_ref,
                "levee_hotkey_keys_received",
                "hot-key reports (key, count pairs) counted, by app",
                Family::default(),
            ),
            hotkey_hits_received: registered(
                registry_ref,
                "levee_hotkey_hits_received",
                "hits counted (the sum of report counts), by app",
                Family::default(),
            ),
            hotkey_hot_detected: registered(
                registry_ref,
                "levee_hotkey_hot_detected",
                "keys that turned hot by detection, by app",
                Family::default(),
            ),
            hotkey_events_published: registered(
                registry_ref,
                "levee_hotkey_events_published",
                "hot and cool events published, by kind (the reason label)",
                Family::default(),
            ),
            hotkey_events_delivered: registered(
                registry_ref,
                "levee_hotkey_events_delivered",
                "events delivered to app servers, one per event and app server",
                Counter::default(),
            ),
            hotkey_resyncs: registered(
                registry_ref,
                "levee_hotkey_resyncs",
                "app servers sent a fresh snapshot because they fell behind",
                Counter::default(),
            ),
            hotkey_reports_rejected: registered(
                registry_ref,
                "levee_hotkey_reports_rejected",
                "hot-key reports refused, by reason",
                Family::default(),
            ),
            hotkey_clients_connected: registered(
                registry_ref,
                "levee_hotkey_clients_connected",
                "app servers connected, by app",
                Family::default(),
            ),
            limits_permits_granted: registered(
                registry_ref,
                "levee_limits_permits_granted",
                "permits granted in leases, by limits resource",
                Family::default(),
            ),
            limits_permits_demanded: registered(
                registry_ref,
                "levee_limits_permits_demanded",
                "permits clients asked for in lease requests (their demand), by limits resource",
                Family::default(),
            ),
            limits_budget_per_second: registered(
                registry_ref,
                "levee_limits_budget_per_second",
                "each limits resource's budget in permits per second now (adaptive where set)",
                Family::default(),
            ),
            limits_calls_reported: registered(
                registry_ref,
                "levee_limits_calls_reported",
                "calls clients reported in lease requests, by limits resource",
                Family::default(),
            ),
            limits_call_errors_reported: registered(
                registry_ref,
                "levee_limits_call_errors_reported",
                "failed calls clients reported in lease requests, by limits resource",
                Family::default(),
            ),
            limits_breaker_state: registered(
                registry_ref,
                "levee_limits_breaker_state",
                "each limits resource's breaker: 0 closed, 1 half-open, 2 open",
                Family::default(),
            ),
            limits_breaker_opens: registered(
                registry_ref,
                "levee_limits_breaker_opens",
                "times each limits resource's breaker opened since this node became leader",
                Family::default(),
            ),
            limits_lease_sessions: registered(
                registry_ref,
                "levee_limits_lease_sessions",
                "limits lease sessions open on this node",
                Gauge::default(),
            ),
            hotkey_memory_bytes: registered(
                registry_ref,
                "levee_hotkey_memory_bytes",
                "bytes the hot-key engines use",
                Gauge::default(),
            ),
            hotkey_memory_budget_bytes: registered(
                registry_ref,
                "levee_hotkey_memory_budget_bytes",
                "the hot-key engines' memory budget",
                Gauge::default(),
            ),
            hotkey_keys_tracked: registered(
                registry_ref,
                "levee_hotkey_keys_tracked",
                "keys with an exact sliding window",
                Gauge::default(),
            ),
            hotkey_budget_evictions: registered(
                registry_ref,
                "levee_hotkey_budget_evictions",
                "keys the memory budget kept out of or evicted from the exact windows",
                Counter::default(),
            ),
            queue_messages_appended: registered(
                registry_ref,
                "levee_queue_messages_appended",
                "messages appended to queues and acknowledged",
                Counter::default(),
            ),
            queue_messages_read: registered(
                registry_ref,
                "levee_queue_messages_read",
                "messages returned by queue reads",
                Counter::default(),
            ),
            queue_messages_delivered: registered(
                registry_ref,
                "levee_queue_messages_delivered",
                "messages pushed to subscriptions, redeliveries included",
                Counter::default(),
            ),
            queue_messages_handed_over: registered(
                registry_ref,
                "levee_queue_messages_handed_over",
                "mailbox messages delivered as their append handed them over, without a store read",
                Counter::default(),
            ),
            queue_mailbox_parts_elsewhere: registered(
                registry_ref,
                "levee_queue_mailbox_parts_elsewhere",
                "parts of SubscribeMany streams served by other nodes, opened because this node \
                 holds the replicas of some shards only",
                Counter::default(),
            ),
            queue_position_log_compactions: registered(
                registry_ref,
                "levee_queue_position_log_compactions",
                "compactions of consumers' position logs (acks of SubscribeMany streams)",
                Counter::default(),
            ),
            queue_position_forgets: registered(
                registry_ref,
                "levee_queue_position_forgets",
                "consumers' positions forgotten because their queue was deleted (forgets written \
                 to position logs, Subscribe position queues deleted)",
                Counter::default(),
            ),
            queue_mailboxes_subscribed: registered(
                registry_ref,
                "levee_queue_mailboxes_subscribed",
                "queues subscribed on SubscribeMany streams (mailboxes), over all streams",
                Gauge::default(),
            ),
            topic_messages_published: registered(
                registry_ref,
                "levee_topic_messages_published",
                "messages published to topics and acknowledged",
                Counter::default(),
            ),
            producer_messages_deduplicated: registered(
                registry_ref,
                "levee_producer_messages_deduplicated",
                "messages of resent idempotent appends answered with their original offsets",
                Counter::default(),
            ),
            group_messages_delivered: registered(
                registry_ref,
                "levee_group_messages_delivered",
                "messages delivered to consumer-group members, redeliveries included, by group",
                Family::default(),
            ),
            group_rate_limit_per_second: registered(
                registry_ref,
                "levee_group_rate_limit_per_second",
                "each group's configured delivery rate limit in messages per second (0: none)",
                Family::default(),
            ),
            group_throttled_seconds: registered(
                registry_ref,
                "levee_group_throttled_seconds",
                "seconds group deliveries waited for the group's rate limit",
                Family::default(),
            ),
            producer_rate_limit_per_second: registered(
                registry_ref,
                "levee_producer_rate_limit_per_second",
                "each rate-limited producer name's append limit in messages per second (0: cleared)",
                Family::default(),
            ),
            producer_messages_admitted: registered(
                registry_ref,
                "levee_producer_messages_admitted",
                "messages admitted under a producer rate limit, by producer name",
                Family::default(),
            ),
            producer_throttled_seconds: registered(
                registry_ref,
                "levee_producer_throttled_seconds",
                "seconds appends waited for their producer name's rate limit",
                Family::default(),
            ),
            group_retries_scheduled: registered(
                registry_ref,
                "levee_group_retries_scheduled",
                "failed messages scheduled for a retry, by group",
                Family::default(),
            ),
            group_dead_lettered: registered(
                registry_ref,
                "levee_group_dead_lettered",
                "failed messages moved to the group's dead letters, by group",
                Family::default(),
            ),
            group_redriven: registered(
                registry_ref,
                "levee_group_redriven",
                "dead letters redriven into the retry path, by group",
                Family::default(),
            ),
            shard_log_append_seconds: registered(
                registry_ref,
                "levee_shard_log_append_seconds",
                "time from an append to a shard's log until it is fsynced (the shards' group commit)",
                latency_histogram(),
            ),
            shard_apply_wait_seconds: registered(
                registry_ref,
                "levee_shard_apply_wait_seconds",
                "time a shard's run of committed entries waited, while applied, for the store to make earlier batches durable or for a blocking thread (deletes, deliveries)",
                latency_histogram(),
            ),
            shard_apply_seconds: registered(
                registry_ref,
                "levee_shard_apply_seconds",
                "time a shard took to apply a run of committed entries, the wait included",
                latency_histogram(),
            ),
            shard_commit_seconds: registered(
                registry_ref,
                "levee_shard_commit_seconds",
                "time from a write proposed on this node as a shard's leader (its own or one \
                 forwarded to it) until a majority of the shard's replicas held it and this node \
                 applied it",
                latency_histogram(),
            ),
            shard_positions_writes: registered(
                registry_ref,
                "levee_shard_positions_writes",
                "consumers' positions writes (acks of streams on this node, per shard) committed",
                Counter::default(),
            ),
            shard_positions_entries: registered(
                registry_ref,
                "levee_shard_positions_entries",
                "shard entries this node's positions writes were merged into",
                Counter::default(),
            ),
            shard_append_requests: registered(
                registry_ref,
                "levee_shard_append_requests",
                "append requests (a call's messages of one shard) this node wrote through the \
                 shards' appenders, committed",
                Counter::default(),
            ),
            shard_append_entries: registered(
                registry_ref,
                "levee_shard_append_entries",
                "shard entries this node's append requests were merged into (requests / entries: \
                 requests per entry)",
                Counter::default(),
            ),
            shard_peer_streams_opened: registered(
                registry_ref,
                "levee_shard_peer_streams_opened",
                "streams of shard calls this node opened to its peers: one per peer while they \
                 stay up, more when a stream failed (a peer restarted, a connection broke) and \
                 was opened again",
                Counter::default(),
            ),
            shard_leaders_gone: registered(
                registry_ref,
                "levee_shard_leaders_gone",
                "times this node found a shard's leader's process gone (silent for 150 ms, its \
                 peer port refusing connections) and called an election of the shard at once \
                 rather than after the election timeout",
                Counter::default(),
            ),
            shard_snapshots_installed: registered(
                registry_ref,
                "levee_shard_snapshots_installed",
                "shard snapshots this node installed (a replica behind its leader's purged log)",
                Counter::default(),
            ),
            shard_snapshots_written: registered(
                registry_ref,
                "levee_shard_snapshots_written",
                "shard snapshot files this node wrote to send to a replica",
                Counter::default(),
            ),
            delayed_messages_waiting: registered(
                registry_ref,
                "levee_delayed_messages_waiting",
                "messages waiting for their time (retries and delayed publishes)",
                Gauge::default(),
            ),
            delayed_messages_scheduled: registered(
                registry_ref,
                "levee_delayed_messages_scheduled",
                "messages placed to wait for their time (retries and delayed publishes)",
                Counter::default(),
            ),
            delayed_messages_delivered: registered(
                registry_ref,
                "levee_delayed_messages_delivered",
                "waiting messages appended to their queue once due",
                Counter::default(),
            ),
            delayed_delivery_lateness_seconds: registered(
                registry_ref,
                "levee_delayed_delivery_lateness_seconds",
                "how long after its time each waiting message was appended to its queue",
                // 1 ms to about 65 s.
                Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            ),
            group_members: registered(
                registry_ref,
                "levee_group_members",
                "consumer-group members connected, by group",
                Family::default(),
            ),
            group_rebalances: registered(
                registry_ref,
                "levee_group_rebalances",
                "consumer-group rebalances (joins, leaves, lease expiries), by group",
                Family::default(),
            ),
            group_coordinator_lost: registered(
                registry_ref,
                "levee_group_coordinator_lost",
                "consume streams ended because this node stopped coordinating their group (it \
                 lost the lead of the topic's shard), by group",
                Family::default(),
            ),
            store: Arc::new(OnceLock::new()),
            raft: Arc::new(OnceLock::new()),
            registry: Arc::new(Registry::default()),
        };
        registry.register_collector(Box::new(StoreCollector {
            store: Arc::clone(&metrics.store),
        }));
        registry.register_collector(Box::new(RaftCollector {
            raft: Arc::clone(&metrics.raft),
        }));
        registry.register_collector(Box::new(ProcessCollector {
            start: SystemTime::now(),
        }));
        Self {
            registry: Arc::new(registry),
            ..metrics
        }
    }

    /// Reports `store`'s figures from now on (without keeping it alive).
    pub fn attach_store(&self, store: &Arc<levee_store::Store>) {
        let _ = self.store.set(Arc::downgrade(store));
    }

    /// Reports the metadata group's figures, as `raft` sees them, from now on.
    pub fn attach_raft(&self, raft: &levee_cluster::Raft) {
        let _ = self.raft.set(MetadataRaft(raft.clone()));
    }

    /// Everything in the `OpenMetrics` text format that Prometheus scrapes.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        if let Err(error) = prometheus_client::encoding::text::encode(&mut text, &self.registry) {
            tracing::error!(%error, "encoding metrics failed");
        }
        text
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// This node's Raft instance of the metadata group.
struct MetadataRaft(levee_cluster::Raft);

impl std::fmt::Debug for MetadataRaft {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("MetadataRaft")
    }
}

/// Reads the metadata group's figures (docs/CLUSTER.md) at scrape time.
#[derive(Debug)]
struct RaftCollector {
    raft: Arc<OnceLock<MetadataRaft>>,
}

impl Collector for RaftCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(MetadataRaft(raft)) = self.raft.get() else {
            return Ok(());
        };
        let metrics = raft.metrics().borrow().clone();
        let membership = metrics.membership_config.membership();
        let index = |index: Option<u64>| i64::try_from(index.unwrap_or(0)).unwrap_or(i64::MAX);
        let count = |count: usize| i64::try_from(count).unwrap_or(i64::MAX);
        let gauges = [
            (
                "levee_cluster_term",
                "the metadata group's current Raft term",
                index(Some(metrics.current_term)),
            ),
            (
                "levee_cluster_is_leader",
                "1 when this node leads the metadata group",
                i64::from(metrics.current_leader == Some(metrics.id)),
            ),
            (
                "levee_cluster_has_leader",
                "1 when this node knows a leader of the metadata group",
                i64::from(metrics.current_leader.is_some()),
            ),
            (
                "levee_cluster_last_log_index",
                "the index of the last entry in this node's metadata log",
                index(metrics.last_log_index),
            ),
            (
                "levee_cluster_last_applied_index",
                "the index of the last entry this node applied",
                index(metrics.last_applied.map(|log_id| log_id.index)),
            ),
            (
                "levee_cluster_members",
                "nodes in the metadata group, voters and learners",
                count(membership.nodes().count()),
            ),
            (
                "levee_cluster_voters",
                "voters of the metadata group",
                count(membership.voter_ids().count()),
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        // On the leader: how many entries each member's log is behind.
        if let Some(replication) = &metrics.replication {
            let mut family = encoder.encode_descriptor(
                "levee_cluster_replication_lag_entries",
                "on the leader: entries each member's metadata log is behind the leader's",
                None,
                prometheus_client::metrics::MetricType::Gauge,
            )?;
            let last = metrics.last_log_index.unwrap_or(0);
            for (node_id, matched) in replication {
                let lag = last.saturating_sub(matched.map_or(0, |log_id| log_id.index));
                let labels = [("node_id", node_id.to_string())];
                ConstGauge::new(index(Some(lag))).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

/// Reads the queue store's counters at scrape time.
#[derive(Debug)]
struct StoreCollector {
    store: Arc<OnceLock<Weak<levee_store::Store>>>,
}

impl Collector for StoreCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(store) = self.store.get().and_then(Weak::upgrade) else {
            return Ok(());
        };
        let stats = store.stats();
        let gauges = [
            ("levee_store_queues", "queues in the store", stats.queues),
            ("levee_store_segments", "segment files", stats.segments),
            (
                "levee_store_disk_bytes",
                "bytes of all segment files",
                stats.disk_bytes,
            ),
            (
                "levee_store_buffered_bytes",
                "bytes buffered, not yet written",
                stats.buffered_bytes,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let counters = [
            (
                "levee_store_bytes_written",
                "bytes written since start",
                stats.bytes_written,
            ),
            (
                "levee_store_file_fsyncs",
                "fsyncs of segment files since start",
                stats.file_syncs,
            ),
            (
                "levee_store_dir_fsyncs",
                "fsyncs of the store directory since start",
                stats.dir_syncs,
            ),
            (
                "levee_store_commit_rounds",
                "group-commit rounds since start",
                stats.commit_rounds,
            ),
            (
                "levee_store_budget_flushes",
                "rounds that answered a full buffer budget since start",
                stats.budget_flushes,
            ),
            (
                "levee_store_checkpoints",
                "rounds that sealed every write buffer since start",
                stats.checkpoints,
            ),
            (
                "levee_store_late_round_waits",
                "store append calls under interval held back because the last round started over two intervals ago",
                stats.late_round_waits,
            ),
            (
                "levee_store_segments_deleted",
                "segment files deleted since start",
                stats.segments_deleted,
            ),
            (
                "levee_store_chunks_relocated",
                "live chunks copied out of old segments since start",
                stats.chunks_relocated,
            ),
        ];
        for (name, help, value) in counters {
            let counter = ConstCounter::new(value);
            counter.encode(encoder.encode_descriptor(
                name,
                help,
                None,
                counter.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

/// Reads the process's resource use from the kernel at scrape time.
#[derive(Debug)]
struct ProcessCollector {
    start: SystemTime,
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let cpu = ConstCounter::new(process_cpu_seconds());
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "user and system CPU time of the process",
            None,
            cpu.metric_type(),
        )?)?;
        if let Some(resident) = process_resident_memory_bytes() {
            let gauge = ConstGauge::new(resident);
            gauge.encode(encoder.encode_descriptor(
                "process_resident_memory_bytes",
                "resident memory of the process",
                None,
                gauge.metric_type(),
            )?)?;
        }
        if let Ok(entries) = std::fs::read_dir("/proc/self/fd") {
            let gauge = ConstGauge::new(i64::try_from(entries.count()).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(
                "process_open_fds",
                "open file descriptors of the process",
                None,
                gauge.metric_type(),
            )?)?;
        }
        let start = self
            .start
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let gauge = ConstGauge::new(start);
        gauge.encode(encoder.encode_descriptor(
            "process_start_time_seconds",
            "start time of the process since the Unix epoch",
            None,
            gauge.metric_type(),
        )?)?;
        Ok(())
    }
}

/// User plus system CPU seconds of this process, from `getrusage`.
#[allow(unsafe_code)]
pub fn process_cpu_seconds() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a valid, writable rusage; getrusage only writes into it, and we read it
    // only when the call succeeded.
    let status = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) };
    if status != 0 {
        return 0.0;
    }
    // SAFETY: getrusage returned 0, so it filled the struct (and it was zeroed before).
    let usage = unsafe { usage.assume_init() };
    let seconds = |time: libc::timeval| {
        #[allow(clippy::cast_precision_loss)]
        let value = time.tv_sec as f64 + time.tv_usec as f64 / 1_000_000.0;
        value
    };
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Resident set size from `/proc/self/status` (`VmRSS`, in KiB), or `None` off Linux.
pub fn process_resident_memory_bytes() -> Option<i64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let kibibytes: i64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kibibytes * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_recorded_call_then_text_has_counter_histogram_and_process_metrics() {
        let metrics = Metrics::new();
        let labels = RequestLabels {
            rpc: "/levee.v1.Admin/Echo".to_owned(),
            code: "OK",
        };
        metrics.grpc_requests.get_or_create(&labels).inc();
        metrics
            .grpc_request_duration_seconds
            .get_or_create(&RpcLabels {
                rpc: labels.rpc.clone(),
            })
            .observe(0.003);
        let text = metrics.encode();
        assert!(
            text.contains("levee_grpc_requests_total{rpc=\"/levee.v1.Admin/Echo\",code=\"OK\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("levee_grpc_request_duration_seconds_count"),
            "{text}"
        );
        assert!(text.contains("process_resident_memory_bytes "), "{text}");
        assert!(text.contains("process_cpu_seconds_total "), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
