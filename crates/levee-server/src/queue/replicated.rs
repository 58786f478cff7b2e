//! Plain queues replicated over the cluster's shards (docs/CLUSTER.md, "Part 2", step 2), in
//! a cluster created with `replicated_queues`: an append is split by shard
//! (`levee_proto::shards::shard_of_bytes` of each queue's name), each part written through its
//! shard's Raft group (proposed on the shard's leader, forwarded there from any other node)
//! and answered once a majority of the shard's replicas hold it fsynced and it is applied.
//! Every replica applies the log to its own store, so reads, queue info and subscriptions are
//! served by any node from committed data; each node's subscriptions are woken as its replica
//! applies ([`ApplyHere`]).
//!
//! Consumers' acked positions (`Subscribe` and `SubscribeMany` acks) go through the shards of
//! their queues too ([`Replication::record_positions`]): every replica records them in its
//! position logs, so a consumer that moves to another node resumes where it acked. A stream
//! reads its positions after a barrier on their shards ([`Replication::barrier`]): the node
//! has then applied every ack committed before.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use levee_cluster::shard::groups::shard_raft_config;
use levee_cluster::shard::{
    ConsumerPosition, QueueMessage, RefusedCode, ShardCommand, ShardGroups, ShardId, ShardObserver,
    ShardResponse, ShardSlot, ShardWriteError,
};
use levee_cluster::{MetaStateMachine, NodeId, NodeInfo, Raft};
use levee_proto::WireError;
use levee_proto::v1::{AppendMessage, ErrorCode};
use levee_store::Store;
use tokio::sync::watch;

use crate::queue::mailbox::position_log::PositionLogs;
use crate::queue::waiters::{Appended, Waiters};

/// How often a node moves the replicas of the shards it leads towards their placement.
const PLACE_INTERVAL: Duration = Duration::from_millis(500);
/// The shard logs' directory in the data dir.
pub const SHARDS_DIR_NAME: &str = "shards";

/// Whether, and through what, this node's plain queues are replicated.
#[derive(Debug, Clone)]
pub struct Replication {
    machine: MetaStateMachine,
    slot: ShardSlot,
    /// The metadata group: its voters place the shards, its members' addresses are where reads
    /// of shards this node holds no replica of go.
    meta: watch::Receiver<levee_cluster::network::RaftMetrics>,
    /// Whether each member's API answered this node's last probe: a forwarded call goes to a
    /// shard's first replica that did.
    health: crate::cluster_service::MemberHealth,
    /// A channel per member address reads were forwarded to (at most [`FORWARD_CHANNELS_MAX`]).
    channels: Arc<std::sync::Mutex<BTreeMap<String, tonic::transport::Channel>>>,
}

/// A node and a channel to its client port.
pub type NodeChannel = (NodeId, tonic::transport::Channel);

/// A node asked for the queues of some shards in a listing, a channel to it, and the shards.
pub type ListingPart = (NodeId, tonic::transport::Channel, Vec<ShardId>);

/// Request metadata of a `ListQueues` forwarded by a node that holds some shards only: the
/// shards (comma-separated numbers) the node asked must hold, else it answers UNAVAILABLE
/// (the shards are moving) rather than a page that lacks their queues.
pub const LIST_SHARDS_HEADER: &str = "levee-list-shards";

/// Refuses a forwarded listing whose `asked` shards (the [`LIST_SHARDS_HEADER`]) this node
/// does not all hold.
pub fn check_listing_shards(
    groups: &ShardGroups,
    metadata: &tonic::metadata::MetadataMap,
) -> Result<(), WireError> {
    let Some(asked) = metadata
        .get(LIST_SHARDS_HEADER)
        .and_then(|value| value.to_str().ok())
    else {
        return Ok(());
    };
    for shard in asked
        .split(',')
        .filter_map(|shard| shard.parse::<ShardId>().ok())
    {
        if !groups.replicates(shard) {
            return Err(WireError::new(
                ErrorCode::Unavailable,
                format!(
                    "node asked to list the queues of shard {shard} holds no replica of it yet \
                     (its replicas are moving); list again in a moment"
                ),
            ));
        }
    }
    Ok(())
}

/// Request metadata marking a read forwarded by a node without a replica: it is never
/// forwarded again.
pub const FORWARDED_HEADER: &str = "levee-forwarded";
/// Messages of a forwarded stream waiting to go on to the replica.
const FORWARD_QUEUED_MAX: usize = 64;

/// The client's messages of a stream forwarded to a replica: `first` (its start), then the
/// rest of `incoming`, through a bounded channel (the client waits while the replica does).
/// `held` (the stream's permit) is kept until the client's side ends.
fn forward_requests<T: Send + 'static>(
    first: T,
    mut incoming: crate::queue::stream::Incoming<T>,
    held: impl Send + 'static,
) -> tokio_stream::wrappers::ReceiverStream<T> {
    let (sender, receiver) = tokio::sync::mpsc::channel(FORWARD_QUEUED_MAX);
    tokio::spawn(async move {
        let _held = held;
        if sender.send(first).await.is_err() {
            return;
        }
        // The client's end (or a broken request stream) ends the forwarded one.
        while let Ok(Some(message)) = incoming.message().await {
            if sender.send(message).await.is_err() {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(receiver)
}

/// Forwards a stream to node `node` (a replica, or a group's coordinator): its client's
/// `first` message, then the rest of `incoming` (with `held`, the stream's permit, until the
/// client's side ends), through `call` (the stub's method on a channel to the node), marked
/// forwarded (never forwarded again) with `mark`; the node's answers as this node's.
pub async fn forward_stream<Request, Answer, Call, Calling>(
    (node, mark): (NodeId, bool),
    (first, incoming, held): (
        Request,
        crate::queue::stream::Incoming<Request>,
        impl Send + 'static,
    ),
    call: Call,
) -> Result<tonic::Response<crate::queue::grpc_stream::GrpcResponses<Answer>>, tonic::Status>
where
    Request: Send + 'static,
    Answer: Send + 'static,
    Call: FnOnce(tonic::Request<tokio_stream::wrappers::ReceiverStream<Request>>) -> Calling,
    Calling: std::future::Future<
            Output = Result<tonic::Response<tonic::Streaming<Answer>>, tonic::Status>,
        >,
{
    let requests = forward_requests(first, incoming, held);
    let answers = call(outgoing(requests, mark))
        .await
        .map_err(|status| forward_failed(node, status))?
        .into_inner();
    Ok(tonic::Response::new(forward_responses(node, answers)))
}

/// The replica's answers to a forwarded stream, as this node's.
fn forward_responses<T: Send + 'static>(
    node: NodeId,
    responses: tonic::Streaming<T>,
) -> crate::queue::grpc_stream::GrpcResponses<T> {
    use tokio_stream::StreamExt;
    Box::pin(responses.map(move |answer| answer.map_err(|status| forward_failed(node, status))))
}

/// `message` as a request forwarded to a replica (never forwarded again).
pub fn forwarded<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(
        FORWARDED_HEADER,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    request
}

/// `message` as a request to another node, marked forwarded with `mark`.
pub fn outgoing<T>(message: T, mark: bool) -> tonic::Request<T> {
    if mark {
        forwarded(message)
    } else {
        tonic::Request::new(message)
    }
}

/// Whether `metadata` marks a request forwarded by another node.
pub fn was_forwarded(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata.contains_key(FORWARDED_HEADER)
}

/// A forwarded call's failure: the replica's answer as it gave it, a connection that failed
/// as UNAVAILABLE naming the node.
pub fn forward_failed(node: NodeId, status: tonic::Status) -> tonic::Status {
    // A status the replica made carries Levee's error code; one the transport made does not.
    let reached = status
        .metadata()
        .contains_key(levee_proto::ERROR_CODE_METADATA_KEY);
    if !reached
        && matches!(
            status.code(),
            tonic::Code::Unavailable | tonic::Code::Unknown
        )
    {
        return WireError::new(
            ErrorCode::Unavailable,
            format!(
                "this node could not reach node {node}, which holds the shard's data (or leads \
                 it, for a consumer group): {}; retry, or call that node",
                status.message()
            ),
        )
        .into();
    }
    status
}

/// This node as the coordinator of the consumer groups of the topics of `shard` (see
/// [`Replication::coordinator`]): it leads the shard in `term`.
#[derive(Debug, Clone)]
pub struct Lead {
    /// The shard groups.
    pub groups: ShardGroups,
    /// The topic's shard.
    pub shard: ShardId,
    /// The term this node leads it in.
    pub term: u64,
}

impl Lead {
    /// Waits out a new lead's hold (`levee_cluster::shard::groups::LEAD_HOLD`), then until
    /// this node applied everything the shard committed before (every commit of its groups).
    pub async fn settle(&self) -> Result<(), WireError> {
        tokio::time::sleep(self.groups.lead_hold(self.shard, self.term)).await;
        self.groups
            .write_again_while_moving(self.shard, ShardCommand::Barrier)
            .await
            .map_err(|error| shard_error(&error))
    }

    /// Returns, with the reason as an error, once this node no longer leads the shard in its
    /// term: its group streams end and their members join again.
    pub async fn lost(&self) -> WireError {
        let why = self.groups.lost_lead(self.shard, self.term).await;
        WireError::new(
            ErrorCode::Unavailable,
            format!("{why}, which coordinates this topic's consumer groups; join again"),
        )
    }

    /// Writes a group's commit snapshot `record` to its commit queue through the shard, as
    /// its leader in this term only; returns once a majority of the shard's replicas hold it
    /// and this node applied it.
    pub async fn write_commit(&self, queue: Vec<u8>, record: Vec<u8>) -> Result<(), WireError> {
        let command = ShardCommand::Append {
            producer: None,
            messages: vec![QueueMessage {
                queue: levee_proto::Bytes::from(queue),
                payload: levee_proto::Bytes::from(record),
                sequence: 0,
            }],
        };
        match self
            .groups
            .write_in_term(self.shard, self.term, command)
            .await
        {
            Ok(ShardResponse::Appended { .. }) => Ok(()),
            Ok(ShardResponse::Refused { code, reason }) => Err(refused(code, &reason)),
            Ok(other) => Err(WireError::new(
                ErrorCode::Internal,
                format!("shard {} answered a commit with {other:?}", self.shard),
            )),
            Err(error) => {
                let mut wire = shard_error(&error);
                wire.message = format!(
                    "{error}; the commit may not be kept: the member's stream ends, and its \
                     messages since its last confirmed commit may come again"
                );
                Err(wire)
            }
        }
    }
}

/// Where a topic's consumer groups are coordinated.
#[derive(Debug)]
pub enum Coordinator {
    /// On this node: as the shard's leader (`Some`), or on a server whose queues are not
    /// replicated (`None`).
    Here(Option<Lead>),
    /// On another node, through `channel` to its client port; `mark`: marked forwarded (never
    /// forwarded again).
    Elsewhere {
        /// The node.
        node: NodeId,
        /// A channel to its client port.
        channel: tonic::transport::Channel,
        /// Whether the call is marked forwarded.
        mark: bool,
    },
}

/// Records one shard append of [`Replication::append_records`] (or one write of
/// [`Replication::delay_records`]) carries, at most ...
const RECORDS_PER_APPEND_MAX: usize = 1_000;
/// ... and bytes, past its first record (a log entry stays well within a peer message).
const RECORD_BYTES_PER_APPEND_MAX: usize = 8 << 20;

/// Splits `items` into runs of at most [`RECORDS_PER_APPEND_MAX`] items and, past each run's
/// first, [`RECORD_BYTES_PER_APPEND_MAX`] bytes as `bytes` counts them.
fn bounded_runs<T>(items: Vec<T>, bytes: impl Fn(&T) -> usize) -> Vec<Vec<T>> {
    let mut runs: Vec<Vec<T>> = Vec::new();
    let mut run_bytes = 0;
    for item in items {
        let size = bytes(&item);
        match runs.last_mut() {
            Some(run)
                if run.len() < RECORDS_PER_APPEND_MAX
                    && run_bytes + size <= RECORD_BYTES_PER_APPEND_MAX =>
            {
                run_bytes += size;
                run.push(item);
            }
            _ => {
                run_bytes = size;
                runs.push(vec![item]);
            }
        }
    }
    runs
}
/// Channels [`Replication`] keeps for forwarded reads; past it they are opened again.
const FORWARD_CHANNELS_MAX: usize = 64;

/// What a node's replica of a shard does beyond its store: wakes the node's subscriptions as
/// it applies appends, and records consumers' positions in the node's position logs.
#[derive(Debug)]
pub struct ApplyHere {
    /// The node's subscriptions, by queue.
    waiters: Arc<Waiters>,
    /// The node's consumers' position logs.
    positions: Arc<PositionLogs>,
    /// The last [`RECENT_DELETES_MAX`] queues deleted through each shard since this process
    /// started, with their delete epoch: a position of one taken before its delete (an ack
    /// written on another node before it applied the delete) is dropped, even after a
    /// compaction of the consumer's log dropped the delete's forget.
    recent_deletes: std::sync::Mutex<BTreeMap<ShardId, RecentDeletes>>,
    /// The node's delayer, if any: told when a shard appended retries.
    delayer: Option<Arc<crate::queue::delay::Delayer>>,
    /// Counters of the shard snapshots installed and written here, if kept.
    snapshots: Option<(
        prometheus_client::metrics::counter::Counter,
        prometheus_client::metrics::counter::Counter,
    )>,
    /// Histograms of the shards' log appends, apply waits and applies, if kept.
    timings: Option<ShardTimings>,
    /// Counters of the positions writes (acks through shards) and of the entries they were
    /// merged into, if kept.
    positions_written: Option<(
        prometheus_client::metrics::counter::Counter,
        prometheus_client::metrics::counter::Counter,
    )>,
    /// Counters of the append requests through the shards' appenders here and of the
    /// entries they were merged into, if kept.
    appends_written: Option<(
        prometheus_client::metrics::counter::Counter,
        prometheus_client::metrics::counter::Counter,
    )>,
    /// Counter of the streams of shard calls this node opened to its peers, if kept.
    peer_streams_opened: Option<prometheus_client::metrics::counter::Counter>,
    /// Counter of the shard leaders this node found gone and replaced at once, if kept.
    leaders_gone: Option<prometheus_client::metrics::counter::Counter>,
}

/// A shard's recent deletes: each queue's latest delete epoch, and the queues oldest first.
#[derive(Debug, Default)]
struct RecentDeletes {
    epochs: std::collections::HashMap<Box<[u8]>, u64>,
    order: std::collections::VecDeque<Box<[u8]>>,
}

/// Deletes per shard [`ApplyHere`] remembers.
const RECENT_DELETES_MAX: usize = 1_024;

impl ApplyHere {
    /// This node stopped holding a replica of `shards` (the placement moved them): the
    /// streams of their queues here end, and their consumers subscribe again elsewhere.
    pub fn shards_left(&self, shards: &[ShardId]) {
        tracing::info!(
            ?shards,
            "this node no longer holds a replica of these shards; their streams here end"
        );
        self.waiters.note_shards_moved();
    }

    /// What this node's replicas do beyond their store, on `waiters`, `positions` and
    /// `delayer` (told when retries became readable, and counting deliveries).
    pub fn new(
        waiters: Arc<Waiters>,
        positions: Arc<PositionLogs>,
        delayer: Option<Arc<crate::queue::delay::Delayer>>,
    ) -> Self {
        Self {
            waiters,
            positions,
            delayer,
            recent_deletes: std::sync::Mutex::default(),
            snapshots: None,
            positions_written: None,
            appends_written: None,
            peer_streams_opened: None,
            leaders_gone: None,
            timings: None,
        }
    }

    /// Counts the shard snapshots installed and written here in `installed` and `written`.
    #[must_use]
    pub fn count_snapshots(
        self,
        installed: prometheus_client::metrics::counter::Counter,
        written: prometheus_client::metrics::counter::Counter,
    ) -> Self {
        Self {
            snapshots: Some((installed, written)),
            ..self
        }
    }

    /// Counts the positions writes (acks through the shards) in `writes` and the shard entries
    /// this node merged them into in `entries`.
    #[must_use]
    pub fn count_positions(
        self,
        writes: prometheus_client::metrics::counter::Counter,
        entries: prometheus_client::metrics::counter::Counter,
    ) -> Self {
        Self {
            positions_written: Some((writes, entries)),
            ..self
        }
    }

    /// Counts the append requests through this node's shard appenders in `requests` and the
    /// shard entries they were merged into in `entries`.
    #[must_use]
    pub fn count_appends(
        self,
        requests: prometheus_client::metrics::counter::Counter,
        entries: prometheus_client::metrics::counter::Counter,
    ) -> Self {
        Self {
            appends_written: Some((requests, entries)),
            ..self
        }
    }

    /// Counts the streams of shard calls this node opens to its peers in `opened`.
    #[must_use]
    pub fn count_peer_streams(self, opened: prometheus_client::metrics::counter::Counter) -> Self {
        Self {
            peer_streams_opened: Some(opened),
            ..self
        }
    }

    /// Counts in `gone` the shards whose leader's process this node found gone and called an
    /// election of at once (`levee_cluster::shard::watch`).
    #[must_use]
    pub fn count_leaders_gone(self, gone: prometheus_client::metrics::counter::Counter) -> Self {
        Self {
            leaders_gone: Some(gone),
            ..self
        }
    }

    /// Times the shards' log appends and applies in `timings`.
    #[must_use]
    pub fn time_shards(self, timings: ShardTimings) -> Self {
        Self {
            timings: Some(timings),
            ..self
        }
    }

    /// `positions` less those taken before a delete of their queue this process applied.
    fn after_deletes<'a>(
        &self,
        shard: ShardId,
        positions: &'a [ConsumerPosition],
    ) -> Vec<&'a ConsumerPosition> {
        let recent = crate::queue::lock(&self.recent_deletes);
        let Some(recent) = recent.get(&shard) else {
            return positions.iter().collect();
        };
        positions
            .iter()
            .filter(|position| {
                recent
                    .epochs
                    .get(&position.queue[..])
                    .is_none_or(|deleted| *deleted <= position.epoch)
            })
            .collect()
    }
}

impl ShardObserver for ApplyHere {
    fn positions(
        &self,
        shard: ShardId,
        consumer: &str,
        positions: &[ConsumerPosition],
    ) -> Result<Option<levee_store::CommitTicket>, String> {
        let log = self.positions.open(consumer);
        let current = self.after_deletes(shard, positions);
        if current.is_empty() {
            return Ok(None);
        }
        let (ticket, compact) = log
            .append(
                current
                    .iter()
                    .map(|position| (&position.queue[..], position.epoch, position.next)),
            )
            .map_err(|error| error.to_string())?;
        if compact && let Ok(runtime) = tokio::runtime::Handle::try_current() {
            // Off the applying thread: the shard goes on meanwhile.
            runtime.spawn_blocking(move || {
                if let Err(error) = log.compact() {
                    tracing::warn!(%error, consumer = log.consumer(), "compacting a position log failed; retried once it has grown as much again");
                }
            });
        }
        Ok(ticket)
    }

    fn deleting(&self, shard: ShardId, queue: &[u8], epoch: u64) -> Result<(), String> {
        {
            let mut recent = crate::queue::lock(&self.recent_deletes);
            let recent = recent.entry(shard).or_default();
            if recent.epochs.insert(queue.into(), epoch).is_none() {
                recent.order.push_back(queue.into());
                if recent.order.len() > RECENT_DELETES_MAX
                    && let Some(oldest) = recent.order.pop_front()
                {
                    recent.epochs.remove(&oldest);
                }
            }
        }
        self.positions
            .forget_replicated(queue, epoch)
            .map_err(|error| error.to_string())
    }

    fn deleted(&self, _shard: ShardId, queue: &[u8]) {
        self.positions.delete_done();
        // Streams of it on this node end (their positions were forgotten).
        self.waiters.note_deleted(queue);
    }

    fn shard_positions(
        &self,
        _shard: ShardId,
        of_shard: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Vec<(String, Vec<ConsumerPosition>)>, String> {
        let held = self
            .positions
            .positions_where(of_shard)
            .map_err(|error| error.to_string())?;
        Ok(held
            .into_iter()
            .map(|(consumer, positions)| {
                let positions = positions
                    .into_iter()
                    .map(|(queue, position)| ConsumerPosition {
                        queue: levee_proto::Bytes::from(queue.into_vec()),
                        epoch: position.epoch,
                        next: position.next,
                    })
                    .collect();
                (consumer, positions)
            })
            .collect())
    }

    fn snapshot_written(&self, _shard: ShardId) {
        if let Some((_, written)) = &self.snapshots {
            written.inc();
        }
    }

    fn applied(&self, _shard: ShardId, _entries: usize, (waited, took): (Duration, Duration)) {
        if let Some(timings) = &self.timings {
            timings.apply_wait.observe(waited.as_secs_f64());
            timings.apply.observe(took.as_secs_f64());
        }
    }

    fn log_flushed(&self, _shard: ShardId, took: Duration) {
        if let Some(timings) = &self.timings {
            timings.log_append.observe(took.as_secs_f64());
        }
    }

    fn committed(&self, _shard: ShardId, took: Duration) {
        if let Some(timings) = &self.timings {
            timings.commit.observe(took.as_secs_f64());
        }
    }

    fn positions_written(&self, _shard: ShardId, writes: usize) {
        if let Some((counted, entries)) = &self.positions_written {
            counted.inc_by(writes as u64);
            entries.inc();
        }
    }

    fn appends_written(&self, _shard: ShardId, requests: usize) {
        if let Some((counted, entries)) = &self.appends_written {
            counted.inc_by(requests as u64);
            entries.inc();
        }
    }

    fn peer_stream_opened(&self) {
        if let Some(opened) = &self.peer_streams_opened {
            opened.inc();
        }
    }

    fn leader_gone(&self, _shard: ShardId) {
        if let Some(gone) = &self.leaders_gone {
            gone.inc();
        }
    }

    fn installed(&self, _shard: ShardId) {
        if let Some((installed, _)) = &self.snapshots {
            installed.inc();
        }
        // Streams look at their queues again (their contents jumped ahead).
        self.waiters.wake_every();
        if let Some(delayer) = &self.delayer {
            delayer.retries_visible();
        }
    }

    fn delivered(&self, _shard: ShardId, now_ms: u64, due_ms: &[u64]) {
        if let Some(delayer) = &self.delayer {
            delayer.count_delivered(now_ms, due_ms);
        }
    }

    fn appended(&self, _shard: ShardId, appended: &[(&[u8], u64, &[u8])]) {
        type Stored<'a> = &'a (&'a [u8], u64, &'a [u8]);
        let (partitions, plain): (Vec<Stored<'_>>, Vec<Stored<'_>>) = appended
            .iter()
            .partition(|(queue, _, _)| levee_broker::names::is_reserved(queue));
        if let Some(delayer) = &self.delayer
            && partitions
                .iter()
                .any(|appended| appended.0.starts_with(levee_broker::names::RETRY_PREFIX))
        {
            // Before the topic is woken: its streams look at their retry queues again.
            delayer.retries_visible();
        }
        let plain: Vec<Appended<'_>> = plain
            .into_iter()
            .map(|&(queue, offset, payload)| Appended {
                queue,
                offset,
                payload,
            })
            .collect();
        self.waiters.wake_appended(&plain);
        // A topic's consumers wait on the topic: woken once per topic.
        let mut topics: Vec<&[u8]> = partitions
            .iter()
            .map(|(queue, _, _)| levee_broker::names::routing_name(queue))
            .collect();
        topics.sort_unstable();
        topics.dedup();
        for topic in topics {
            self.waiters
                .wake(&crate::queue::topic::consume::topic_wake_key_bytes(topic));
        }
    }
}

/// The shard of `queue` among `shards`: by its name, or a topic partition's by its topic's
/// (`levee_broker::names::routing_name`).
pub fn shard_of_queue(queue: &[u8], shards: u32) -> ShardId {
    levee_proto::shards::shard_of_bytes(levee_broker::names::routing_name(queue), shards)
}

/// The histograms of the shards' rounds on this node (`/metrics`).
#[derive(Debug, Clone)]
pub struct ShardTimings {
    /// From an append to a shard's log until fsynced.
    pub log_append: prometheus_client::metrics::histogram::Histogram,
    /// A run of committed entries waiting for a blocking thread.
    pub apply_wait: prometheus_client::metrics::histogram::Histogram,
    /// A run of committed entries applied, the wait included.
    pub apply: prometheus_client::metrics::histogram::Histogram,
    /// A write proposed on this node, a shard's leader, until committed and applied here.
    pub commit: prometheus_client::metrics::histogram::Histogram,
}

/// A shard write's failure as the API says it.
pub fn shard_error(error: &ShardWriteError) -> WireError {
    match error {
        ShardWriteError::Unavailable {
            maybe_stored: true, ..
        } => WireError::new(
            ErrorCode::Unavailable,
            format!("{error}; the messages may be stored: read the queue before resending"),
        ),
        ShardWriteError::Unavailable { .. } => WireError::new(
            ErrorCode::Unavailable,
            format!("{error}; nothing was stored"),
        ),
        ShardWriteError::NoShard { .. } => WireError::new(ErrorCode::Internal, error.to_string()),
        ShardWriteError::Stopped { .. } => {
            WireError::new(ErrorCode::StorageFailed, error.to_string())
        }
    }
}

/// Where `shard`'s replicas are, as far as this node knows, for an error message.
fn replicas_hint(groups: &ShardGroups, shard: ShardId) -> String {
    let voters = groups.voters_of(shard);
    if voters.is_empty() {
        "the nodes GetCluster's shard_map names".to_owned()
    } else {
        format!("nodes {voters:?}, as GetCluster's shard_map says")
    }
}

/// A failed write of acks or of a barrier as the API says it.
fn consumer_error(error: &ShardWriteError, what: &str) -> WireError {
    let mut wire = shard_error(error);
    wire.message = format!(
        "{what}: {error}; acks not confirmed are delivered again to the consumer's next \
         subscription"
    );
    wire
}

impl Replication {
    /// Replication as `machine` says the cluster was created, through the groups `slot` holds
    /// once opened.
    pub fn new(
        machine: MetaStateMachine,
        slot: ShardSlot,
        (meta, health): (
            watch::Receiver<levee_cluster::network::RaftMetrics>,
            crate::cluster_service::MemberHealth,
        ),
    ) -> Self {
        Self {
            machine,
            slot,
            meta,
            health,
            channels: Arc::default(),
        }
    }

    /// Where a read of `queue` goes when this node holds no replica of its shard: the shard's
    /// preferred replica (its usual leader) as the metadata group's voters place it, and a
    /// client of its gRPC port. `None` when this node holds a replica (or the cluster does not
    /// replicate its queues), or when the request was forwarded already (`forwarded`: then
    /// the refusal naming the replicas).
    pub fn read_elsewhere(
        &self,
        queue: &[u8],
        forwarded: bool,
    ) -> Result<Option<(NodeId, tonic::transport::Channel)>, WireError> {
        let Some(groups) = self.groups() else {
            return Ok(None);
        };
        let groups = groups?;
        let shard = shard_of_queue(queue, groups.shards());
        if groups.replicates(shard) {
            return Ok(None);
        }
        if forwarded {
            Self::check_replicated_here(groups, &[queue])?;
        }
        let target = self.channel_to_replica(shard)?;
        if target.is_none() {
            // No replica known: say so.
            Self::check_replicated_here(groups, &[queue])?;
        }
        Ok(target)
    }

    /// Makes a read of `queue` served here linearizable: returns once this node applied
    /// everything the queue's shard committed before the call (`ShardGroups::read_barrier`),
    /// so the read sees every append acknowledged before it, through any node. Nothing to
    /// wait for when the cluster does not replicate its queues or this node holds no replica
    /// of the shard (the read is forwarded, or refused, before it gets here).
    pub async fn read_barrier(&self, queue: &[u8]) -> Result<(), WireError> {
        let Some(groups) = self.groups() else {
            return Ok(());
        };
        let groups = groups?;
        let shard = shard_of_queue(queue, groups.shards());
        if !groups.replicates(shard) {
            return Ok(());
        }
        groups
            .read_barrier(shard)
            .await
            .map_err(|error| match error {
                ShardWriteError::Unavailable { .. } => {
                    WireError::new(ErrorCode::Unavailable, format!("{error}; nothing was read"))
                }
                other => shard_error(&other),
            })
    }

    /// Whether a many-queue stream opened on this node is served in parts
    /// (`crate::queue::mailbox::spread`): the cluster replicates its queues, this node holds
    /// the replicas of some shards only (a voter beyond three, a learner), and the stream was
    /// not forwarded here (a forwarded one is served here, its adds of queues of shards this
    /// node does not hold refused).
    pub fn spreads_many(&self, forwarded: bool) -> Result<bool, WireError> {
        let Some(groups) = self.groups() else {
            return Ok(false);
        };
        let groups = groups?;
        Ok(!forwarded && !(0..groups.shards()).all(|shard| groups.replicates(shard)))
    }

    /// How `ListQueues` lists on this node: `None` when its store holds every queue of the
    /// cluster (queues not replicated, or this node holds every shard); else the shard groups,
    /// to keep only the queues of the shards this node holds (a copy of a shard it left is
    /// not listed), and unless the call was `forwarded` here, the nodes to ask for the others
    /// (the preferred replica of each shard it does not hold, each once).
    pub fn listing(
        &self,
        forwarded: bool,
    ) -> Result<Option<(ShardGroups, Vec<ListingPart>)>, WireError> {
        let Some(groups) = self.groups() else {
            return Ok(None);
        };
        let groups = groups?;
        let missing: Vec<ShardId> = (0..groups.shards())
            .filter(|shard| !groups.replicates(*shard))
            .collect();
        if missing.is_empty() {
            return Ok(None);
        }
        let mut elsewhere: Vec<ListingPart> = Vec::new();
        if !forwarded {
            for shard in missing {
                let Some((node, channel)) = self.channel_to_replica(shard)? else {
                    return Err(WireError::new(
                        ErrorCode::Unavailable,
                        format!(
                            "this node holds no replica of shard {shard} and knows no node that \
                             does, so it cannot list every queue; retry, or list through \
                             another node"
                        ),
                    ));
                };
                match elsewhere.iter_mut().find(|(known, ..)| *known == node) {
                    Some((_, _, shards)) => shards.push(shard),
                    None => elsewhere.push((node, channel, vec![shard])),
                }
            }
        }
        Ok(Some((groups.clone(), elsewhere)))
    }

    /// A replica of `shard` as the metadata voters place it, other than this node: the first
    /// one named (the preferred) whose API answered this node's last probe, else the
    /// preferred one; and a channel to its client port (kept for the next call). `None` when
    /// no replica's address is known.
    fn channel_to_replica(
        &self,
        shard: ShardId,
    ) -> Result<Option<(NodeId, tonic::transport::Channel)>, WireError> {
        let metrics = self.meta.borrow().clone();
        let membership = metrics.membership_config.membership();
        let voters: Vec<NodeId> = membership.voter_ids().collect();
        let replicas: Vec<(NodeId, String)> = levee_proto::shards::replicas(shard, &voters)
            .into_iter()
            .filter(|node| *node != metrics.id)
            .filter_map(|node| Some((node, membership.get_node(&node)?.grpc_addr.clone())))
            .filter(|(_, address)| !address.is_empty())
            .collect();
        let healthy = {
            let health = self.health.borrow();
            replicas
                .iter()
                .position(|(node, _)| health.get(node).copied().unwrap_or(false))
        };
        let Some((node, address)) = replicas.get(healthy.unwrap_or(0)) else {
            return Ok(None);
        };
        Ok(Some((*node, self.channel_to(*node, address)?)))
    }

    /// A channel to node `node`'s client port at `address` (kept for the next call).
    fn channel_to(
        &self,
        node: NodeId,
        address: &str,
    ) -> Result<tonic::transport::Channel, WireError> {
        let mut channels = crate::queue::lock(&self.channels);
        if let Some(channel) = channels.get(address) {
            return Ok(channel.clone());
        }
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .map_err(|error| {
                WireError::new(
                    ErrorCode::Unavailable,
                    format!("node {node}'s address '{address}': {error}"),
                )
            })?
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy();
        if channels.len() >= FORWARD_CHANNELS_MAX {
            channels.clear();
        }
        channels.insert(address.to_owned(), channel.clone());
        Ok(channel)
    }

    /// Where `topic`'s consumer groups are coordinated (docs/CLUSTER.md, "Consumer groups on
    /// the shards"): here on a server whose queues are not replicated; else by the leader of
    /// the topic's shard: here when this node leads it, else that leader (a call `forwarded`
    /// already is refused with UNAVAILABLE, the lead having moved). A node holding no replica
    /// of the shard that knows no leader sends the call to the shard's preferred replica
    /// unmarked, which sends it on to the leader.
    pub fn coordinator(&self, topic: &str, forwarded: bool) -> Result<Coordinator, WireError> {
        let Some(groups) = self.groups() else {
            return Ok(Coordinator::Here(None));
        };
        let groups = groups?;
        let shard = shard_of_queue(
            &levee_broker::names::partition_queue(topic, 0),
            groups.shards(),
        );
        if let Some(term) = groups.lead(shard) {
            return Ok(Coordinator::Here(Some(Lead {
                groups: groups.clone(),
                shard,
                term,
            })));
        }
        let moved = |why: &str| {
            WireError::new(
                ErrorCode::Unavailable,
                format!(
                    "topic '{topic}''s consumer groups are coordinated by the leader of shard \
                     {shard}, and {why}; join again in a moment"
                ),
            )
        };
        if forwarded {
            return Err(moved("this node does not lead it (the lead moved)"));
        }
        if let Some((node, info)) = groups.other_leader(shard)
            && !info.grpc_addr.is_empty()
        {
            let channel = self.channel_to(node, &info.grpc_addr)?;
            return Ok(Coordinator::Elsewhere {
                node,
                channel,
                mark: true,
            });
        }
        if !groups.replicates(shard)
            && let Some((node, channel)) = self.channel_to_replica(shard)?
        {
            return Ok(Coordinator::Elsewhere {
                node,
                channel,
                mark: false,
            });
        }
        Err(moved("this node knows no leader of it yet"))
    }

    /// The shard groups when the cluster replicates its queues (`None` when it does not),
    /// UNAVAILABLE while they open.
    pub fn groups_if_replicated(
        replication: Option<&Self>,
    ) -> Result<Option<ShardGroups>, WireError> {
        match replication.and_then(Self::groups) {
            Some(Ok(groups)) => Ok(Some(groups.clone())),
            Some(Err(error)) => Err(error),
            None => Ok(None),
        }
    }

    /// Records `consumer`'s `positions` through their queues' shards; returns once a majority
    /// of every shard's replicas hold them and this node applied them.
    pub async fn record_positions(
        groups: &ShardGroups,
        consumer: &str,
        positions: Vec<ConsumerPosition>,
    ) -> Result<(), WireError> {
        let mut parts: BTreeMap<ShardId, Vec<ConsumerPosition>> = BTreeMap::new();
        for position in positions {
            let shard = shard_of_queue(&position.queue, groups.shards());
            parts.entry(shard).or_default().push(position);
        }
        let writes = parts
            .into_iter()
            .map(|(shard, positions)| groups.write_positions(shard, consumer, positions));
        for written in futures_util::future::join_all(writes).await {
            written.map_err(|error| consumer_error(&error, "recording acks"))?;
        }
        Ok(())
    }

    /// Refuses to serve `queues` from this node's store when it holds no replica of one of
    /// their shards (a node beyond the shards' three replicas: a metadata learner, or a fourth
    /// or fifth voter): its store does not have their messages or positions.
    pub fn check_replicated_here(
        groups: &ShardGroups,
        queues: &[impl AsRef<[u8]>],
    ) -> Result<(), WireError> {
        for queue in queues {
            let shard = shard_of_queue(queue.as_ref(), groups.shards());
            if !groups.replicates(shard) {
                return Err(WireError::new(
                    ErrorCode::FailedPrecondition,
                    format!(
                        "this node holds no replica of shard {shard} (queue '{}'); read or \
                         subscribe through one of its replicas ({})",
                        String::from_utf8_lossy(queue.as_ref()),
                        replicas_hint(groups, shard)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Ends a stream served here once the shard of one of its `queues` moved off this node:
    /// when `waiters` saw shards move since `seen` (the count the stream last checked at),
    /// UNAVAILABLE naming the shard if this node no longer holds one of theirs; else the count
    /// now, to pass next time.
    pub fn check_still_held<'a>(
        groups: &ShardGroups,
        waiters: &Waiters,
        seen: u64,
        mut queues: impl Iterator<Item = &'a [u8]>,
    ) -> Result<u64, WireError> {
        let now = waiters.shards_moved();
        if now == seen {
            return Ok(now);
        }
        let moved = queues.find_map(|queue| {
            let shard = shard_of_queue(queue, groups.shards());
            (!groups.replicates(shard)).then_some((shard, queue))
        });
        match moved {
            None => Ok(now),
            Some((shard, queue)) => Err(WireError::new(
                ErrorCode::Unavailable,
                format!(
                    "this node no longer holds a replica of shard {shard} (queue '{}'): the \
                     shard's replicas moved ({}); subscribe again, through any node: the \
                     consumer resumes after its last confirmed ack",
                    String::from_utf8_lossy(queue),
                    replicas_hint(groups, shard)
                ),
            )),
        }
    }

    /// Returns once this node applied everything the shards of `queues` committed before the
    /// call (so positions read next include every ack confirmed anywhere before).
    pub async fn barrier(groups: &ShardGroups, queues: &[Box<[u8]>]) -> Result<(), WireError> {
        Self::check_replicated_here(groups, queues)?;
        let shards: std::collections::BTreeSet<ShardId> = queues
            .iter()
            .map(|queue| shard_of_queue(queue, groups.shards()))
            .collect();
        let barriers = shards
            .into_iter()
            .map(|shard| groups.write_again_while_moving(shard, ShardCommand::Barrier));
        for done in futures_util::future::join_all(barriers).await {
            done.map_err(|error| consumer_error(&error, "reading the consumer's positions"))?;
        }
        Ok(())
    }

    /// The shard groups, when the cluster replicates its queues (`None` when it does not;
    /// UNAVAILABLE while they open).
    pub fn groups(&self) -> Option<Result<&ShardGroups, WireError>> {
        if !self.machine.replicated_queues() {
            return None;
        }
        Some(self.slot.get().ok_or_else(|| {
            WireError::new(
                ErrorCode::Unavailable,
                "this node is still opening its shards; retry in a moment",
            )
        }))
    }

    /// Where a delete of `queue` goes when this node neither holds a replica of its shard nor
    /// knows the shard's leader (a learner, or a voter beyond the shard's three replicas): a
    /// replica of the shard, over its client port (`None`: written through the shard here, or
    /// refused when `forwarded` here already).
    pub fn delete_elsewhere(
        &self,
        queue: &[u8],
        forwarded: bool,
    ) -> Result<Option<NodeChannel>, WireError> {
        let Some(groups) = self.groups() else {
            return Ok(None);
        };
        let groups = groups?;
        let shard = shard_of_queue(queue, groups.shards());
        if forwarded || groups.replicates(shard) || groups.leader_of(shard).is_some() {
            return Ok(None);
        }
        self.channel_to_replica(shard)
    }

    /// Deletes `queue` through its shard (see `ShardCommand::Delete`); whether it existed.
    /// Deleting again is harmless, so a delete whose answer was lost may simply be sent again.
    pub async fn delete(groups: &ShardGroups, queue: &[u8]) -> Result<bool, WireError> {
        let shard = shard_of_queue(queue, groups.shards());
        if !groups.replicates(shard) && groups.leader_of(shard).is_none() {
            return Err(WireError::new(
                ErrorCode::FailedPrecondition,
                format!(
                    "this node holds no replica of shard {shard} and knows no leader of it; \
                     delete through one of its replicas ({})",
                    replicas_hint(groups, shard)
                ),
            ));
        }
        let command = ShardCommand::Delete {
            queue: levee_proto::Bytes::copy_from_slice(queue),
        };
        match groups.write(shard, command).await {
            Ok(ShardResponse::Deleted { existed }) => Ok(existed),
            Ok(ShardResponse::Refused { code, reason }) => Err(refused(code, &reason)),
            Ok(other) => Err(WireError::new(
                ErrorCode::Internal,
                format!("shard {shard} answered a delete with {other:?}"),
            )),
            Err(error) => {
                let mut wire = shard_error(&error);
                if let ShardWriteError::Unavailable { maybe_stored, .. } = error {
                    wire.message = format!(
                        "{error}; {}",
                        if maybe_stored {
                            "the delete may have been done: deleting again is safe"
                        } else {
                            "nothing was deleted"
                        }
                    );
                }
                Err(wire)
            }
        }
    }

    /// [`Replication::append`] from any node: the messages of shards this node neither
    /// replicates nor knows a leader of (a node beyond the shards' replicas) are forwarded,
    /// one request per node, to each shard's preferred replica over its client port (which
    /// forwards them to the leader); the rest are written here. Not when the request was
    /// forwarded already (`forwarded`): then such messages are refused, naming the replicas.
    pub async fn append_anywhere(
        &self,
        groups: &ShardGroups,
        (producer, was_forwarded): (Option<&str>, bool),
        messages: Vec<AppendMessage>,
    ) -> Result<Vec<u64>, WireError> {
        let shards = groups.shards();
        let unreachable = |queue: &[u8]| {
            let shard = shard_of_queue(queue, shards);
            !groups.replicates(shard) && groups.leader_of(shard).is_none()
        };
        if was_forwarded || !messages.iter().any(|message| unreachable(&message.queue)) {
            return Self::append(groups, producer, messages).await;
        }
        let count = messages.len();
        let (mut here, mut here_places) = (Vec::new(), Vec::new());
        let mut away: BTreeMap<
            NodeId,
            (tonic::transport::Channel, Vec<usize>, Vec<AppendMessage>),
        > = BTreeMap::new();
        for (place, message) in messages.into_iter().enumerate() {
            let target = if unreachable(&message.queue) {
                self.read_elsewhere(&message.queue, false)?
            } else {
                None
            };
            if let Some((node, channel)) = target {
                let part = away
                    .entry(node)
                    .or_insert_with(|| (channel, Vec::new(), Vec::new()));
                part.1.push(place);
                part.2.push(message);
            } else {
                here_places.push(place);
                here.push(message);
            }
        }
        let producer_id = producer.unwrap_or_default().to_owned();
        let forwards = away.into_iter().map(|(node, (channel, places, messages))| {
            let producer_id = producer_id.clone();
            async move {
                let request = levee_proto::v1::AppendRequest {
                    messages,
                    producer_id,
                    ..Default::default()
                };
                let answer = levee_proto::v1::queues_client::QueuesClient::new(channel)
                    .append(forwarded(request))
                    .await
                    .map_err(|status| WireError::from_status(&forward_failed(node, status)))?;
                Ok::<_, WireError>((places, answer.into_inner().offsets))
            }
        });
        let (written_here, forwarded_answers) = futures_util::future::join(
            async {
                if here.is_empty() {
                    Ok(Vec::new())
                } else {
                    Self::append(groups, producer, here).await
                }
            },
            futures_util::future::join_all(forwards),
        )
        .await;
        let mut offsets = vec![0; count];
        for (place, offset) in here_places.into_iter().zip(written_here?) {
            offsets[place] = offset;
        }
        for answer in forwarded_answers {
            let (places, written) = answer?;
            for (place, offset) in places.into_iter().zip(written) {
                offsets[place] = offset;
            }
        }
        Ok(offsets)
    }

    /// Appends the server's own `records` (queue, payload) through their queues' shards, a
    /// bounded batch at a time; returns once a majority of each shard's replicas hold them
    /// and this node applied them (a failure may leave some appended). INTERNAL when the
    /// cluster does not replicate its queues (`replication` says).
    pub async fn append_records(
        replication: Option<&Self>,
        records: Vec<(Vec<u8>, Vec<u8>)>,
    ) -> Result<(), WireError> {
        let Some(groups) = Self::groups_if_replicated(replication)? else {
            return Err(WireError::new(
                ErrorCode::Internal,
                "records for the shards on a node whose queues are not replicated",
            ));
        };
        for run in bounded_runs(records, |(queue, payload)| queue.len() + payload.len()) {
            let messages = run
                .into_iter()
                .map(|(queue, payload)| AppendMessage {
                    queue: levee_proto::Bytes::from(queue),
                    payload: levee_proto::Bytes::from(payload),
                    sequence: 0,
                })
                .collect();
            Self::append(&groups, None, messages).await?;
        }
        Ok(())
    }

    /// Writes delayed `entries` through their targets' shards as of `now_ms`
    /// (`ShardCommand::Delay`, at most [`RECORDS_PER_APPEND_MAX`] per write): each shard
    /// places them in its own delay slots, or appends those due at once to their targets, on
    /// every replica alike, and its leader delivers them when due (docs/CLUSTER.md, "Retries
    /// and delayed messages through the shards"). Each entry's offset in its target when it
    /// was appended at once, 0 when it waits; answered once a majority of each shard holds
    /// them.
    pub async fn delay_records(
        replication: Option<&Self>,
        entries: &[levee_broker::delay::DelayedEntry],
        now_ms: u64,
    ) -> Result<Vec<u64>, WireError> {
        let Some(groups) = Self::groups_if_replicated(replication)? else {
            return Err(WireError::new(
                ErrorCode::Internal,
                "delayed messages for the shards on a node whose queues are not replicated",
            ));
        };
        let shards = groups.shards();
        let mut parts: BTreeMap<ShardId, (Vec<usize>, Vec<levee_proto::Bytes>)> = BTreeMap::new();
        for (index, entry) in entries.iter().enumerate() {
            let part = parts
                .entry(shard_of_queue(&entry.target, shards))
                .or_default();
            part.0.push(index);
            part.1.push(levee_proto::Bytes::from(entry.encode()));
        }
        let mut offsets = vec![0; entries.len()];
        for (shard, (places, encoded)) in parts {
            let runs = bounded_runs(places.into_iter().zip(encoded).collect(), |(_, entry)| {
                entry.len()
            });
            for run in runs {
                let (places, encoded): (Vec<usize>, Vec<levee_proto::Bytes>) =
                    run.into_iter().unzip();
                let command = ShardCommand::Delay {
                    now_ms,
                    entries: encoded,
                };
                let response = groups
                    .write(shard, command)
                    .await
                    .map_err(|error| shard_error(&error))?;
                match response {
                    ShardResponse::Appended { offsets: written }
                        if written.len() == places.len() =>
                    {
                        for (&place, offset) in places.iter().zip(written) {
                            offsets[place] = offset;
                        }
                    }
                    ShardResponse::Refused { code, reason } => return Err(refused(code, &reason)),
                    other => {
                        return Err(WireError::new(
                            ErrorCode::Internal,
                            format!("shard {shard} answered delayed messages with {other:?}"),
                        ));
                    }
                }
            }
        }
        Ok(offsets)
    }

    /// Appends `messages` through their shards (as idempotent `producer`'s, if given); their
    /// offsets in request order.
    pub async fn append(
        groups: &ShardGroups,
        producer: Option<&str>,
        messages: Vec<AppendMessage>,
    ) -> Result<Vec<u64>, WireError> {
        let shards = groups.shards();
        // Each shard's messages and their places in the request.
        let mut parts: BTreeMap<ShardId, (Vec<usize>, Vec<QueueMessage>)> = BTreeMap::new();
        for (index, message) in messages.into_iter().enumerate() {
            let shard = shard_of_queue(&message.queue, shards);
            let part = parts.entry(shard).or_default();
            part.0.push(index);
            part.1.push(QueueMessage {
                queue: message.queue,
                payload: message.payload,
                sequence: message.sequence,
            });
        }
        // A node that neither replicates a shard nor knows its leader (a learner node, never a
        // replica) cannot forward: say where to go rather than wait out the write.
        if let Some(shard) = parts
            .keys()
            .copied()
            .find(|shard| !groups.replicates(*shard) && groups.leader_of(*shard).is_none())
        {
            return Err(WireError::new(
                ErrorCode::FailedPrecondition,
                format!(
                    "this node holds no replica of shard {shard} and knows no leader of it; \
                     append through one of its replicas ({}); nothing was stored",
                    replicas_hint(groups, shard)
                ),
            ));
        }
        let count = parts.values().map(|part| part.0.len()).sum();
        let writes = parts
            .into_iter()
            .map(|(shard, (places, messages))| async move {
                let response = groups
                    .append(shard, producer.map(str::to_owned), messages)
                    .await
                    .map_err(|error| shard_error(&error))?;
                match response {
                    ShardResponse::Appended { offsets } if offsets.len() == places.len() => {
                        Ok((places, offsets))
                    }
                    ShardResponse::Refused { code, reason } => Err(refused(code, &reason)),
                    other => Err(WireError::new(
                        ErrorCode::Internal,
                        format!("shard {shard} answered an append with {other:?}"),
                    )),
                }
            });
        let mut offsets = vec![0; count];
        for written in futures_util::future::join_all(writes).await {
            let (places, written) = written?;
            for (place, offset) in places.into_iter().zip(written) {
                offsets[place] = offset;
            }
        }
        Ok(offsets)
    }
}

/// A shard's refusal as the API says it.
fn refused(code: RefusedCode, reason: &str) -> WireError {
    match code {
        RefusedCode::Invalid => WireError::new(
            ErrorCode::InvalidArgument,
            format!("{reason}; fix the request"),
        ),
        RefusedCode::SequenceGap => WireError::new(ErrorCode::SequenceGap, reason),
        RefusedCode::SequenceTooOld => WireError::new(ErrorCode::SequenceTooOld, reason),
    }
}

/// How often a node looks whether it stopped holding a shard.
const HELD_CHECK_INTERVAL: Duration = Duration::from_millis(250);

/// Every [`HELD_CHECK_INTERVAL`] until `stop`: tells `observer` of the shards this node
/// stopped holding since the last look (their streams here end).
async fn watch_shards_left(
    groups: ShardGroups,
    observer: Arc<ApplyHere>,
    mut stop: watch::Receiver<bool>,
) {
    let mut held: Vec<bool> = (0..groups.shards())
        .map(|shard| groups.replicates(shard))
        .collect();
    loop {
        tokio::select! {
            () = tokio::time::sleep(HELD_CHECK_INTERVAL) => {}
            _ = stop.wait_for(|stop| *stop) => return,
        }
        let now: Vec<bool> = (0..groups.shards())
            .map(|shard| groups.replicates(shard))
            .collect();
        let left: Vec<ShardId> = (0..groups.shards())
            .filter(|shard| held[*shard as usize] && !now[*shard as usize])
            .collect();
        if !left.is_empty() {
            observer.shards_left(&left);
        }
        held = now;
    }
}

/// Once the cluster's shards are fixed, and if it replicates its queues: opens this node's
/// shard groups (making itself every shard's only replica when it created the cluster or is
/// its only voter), hands them to `slot`, then, every [`PLACE_INTERVAL`] until `stop`, places
/// the replicas of the shards it leads over the metadata group's voters.
pub async fn run_shards(
    (raft, machine, slot): (Raft, MetaStateMachine, ShardSlot),
    (node_id, me, created, snapshot_entries): (NodeId, NodeInfo, bool, u64),
    (directory, store, observer): (std::path::PathBuf, Arc<Store>, Arc<ApplyHere>),
    dialer: levee_cluster::network::PeerDialer,
    mut stop: watch::Receiver<bool>,
) {
    let shards = loop {
        if let Some(shards) = machine.shards() {
            break shards;
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
            _ = stop.wait_for(|stop| *stop) => return,
        }
    };
    if !machine.replicated_queues() {
        return;
    }
    let config = match shard_raft_config(&format!("node-{node_id}"), snapshot_entries) {
        Ok(config) => config,
        Err(error) => {
            tracing::error!(%error, "the shards' settings");
            return;
        }
    };
    let groups = match ShardGroups::open(
        (node_id, shards),
        (&directory, &store),
        config,
        dialer,
        observer.clone(),
    )
    .await
    {
        Ok(groups) => groups,
        Err(error) => {
            tracing::error!(%error, "cannot open this node's shards; replicated queues are unavailable here");
            return;
        }
    };
    let voters = |raft: &Raft| -> BTreeMap<NodeId, NodeInfo> {
        let metrics = raft.metrics().borrow().clone();
        let membership = metrics.membership_config.membership();
        membership
            .voter_ids()
            .filter_map(|id| membership.get_node(&id).map(|node| (id, node.clone())))
            .collect()
    };
    // Every member, voter or learner of the metadata group: a replica on a node that is none
    // (removed from the cluster) is moved to the others.
    let members = |raft: &Raft| -> std::collections::BTreeSet<NodeId> {
        let metrics = raft.metrics().borrow().clone();
        metrics
            .membership_config
            .membership()
            .nodes()
            .map(|(id, _)| *id)
            .collect()
    };
    let alone = voters(&raft).keys().eq([node_id].iter());
    if (created || alone)
        && let Err(error) = groups.initialize_alone(&me).await
    {
        tracing::error!(%error, "cannot initialise this node's shards");
    }
    let _ = slot.set(groups.clone());
    tracing::info!(shards, "replicated queues: this node's shards are open");
    // Whether this node still holds each shard, looked at on its own timer (a placement
    // round may wait seconds for a slow replica): streams of a shard it left end soon.
    tokio::spawn(watch_shards_left(
        groups.clone(),
        Arc::clone(&observer),
        stop.clone(),
    ));
    loop {
        tokio::select! {
            () = tokio::time::sleep(PLACE_INTERVAL) => {}
            _ = stop.wait_for(|stop| *stop) => break,
        }
        // The metadata view is current enough to remove replicas on once this node knows the
        // metadata leader and applied its whole log.
        let current = {
            let metrics = raft.metrics().borrow().clone();
            metrics.current_leader.is_some()
                && metrics.last_applied.map(|log_id| log_id.index) >= metrics.last_log_index
        };
        groups.place(&voters(&raft), &members(&raft), current).await;
    }
    groups.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use levee_store::StoreOptions;
    use prometheus_client::metrics::counter::Counter;

    fn position(queue: &[u8], epoch: u64, next: u64) -> ConsumerPosition {
        ConsumerPosition {
            queue: levee_proto::Bytes::copy_from_slice(queue),
            epoch,
            next,
        }
    }

    #[test]
    fn given_records_then_runs_are_bounded_by_count_and_bytes_and_keep_their_order() {
        let small: Vec<usize> = (0..2_500).collect();
        let runs = bounded_runs(small, |_| 10);
        assert_eq!(
            runs.iter().map(Vec::len).collect::<Vec<_>>(),
            [1_000, 1_000, 500]
        );
        assert_eq!(runs.concat(), (0..2_500).collect::<Vec<_>>());
        let large = vec![5 << 20, 5 << 20, 1, RECORD_BYTES_PER_APPEND_MAX * 2, 1];
        let runs = bounded_runs(large.clone(), |size| *size);
        assert_eq!(
            runs.iter().map(Vec::len).collect::<Vec<_>>(),
            [1, 2, 1, 1],
            "a run passes the bound only with its first record"
        );
        assert_eq!(runs.concat(), large);
    }

    #[test]
    fn given_a_replicated_delete_then_acks_taken_before_it_are_dropped_and_later_ones_kept() {
        let directory = tempfile::tempdir().unwrap();
        let store = Arc::new(
            Store::open(directory.path(), StoreOptions::default())
                .unwrap()
                .0,
        );
        let positions = Arc::new(PositionLogs::new(
            Arc::clone(&store),
            1_000,
            Counter::default(),
        ));
        let here = ApplyHere::new(Arc::new(Waiters::default()), Arc::clone(&positions), None);
        let queues = [b"q".to_vec().into_boxed_slice()];
        let read = || positions.open("app").positions(&queues).unwrap()[0];
        here.positions(0, "app", &[position(b"q", 0, 5)]).unwrap();
        assert_eq!(read().next, 5);
        // The shard's first delete: epoch 1.
        here.deleting(0, b"q", 1).unwrap();
        here.deleted(0, b"q");
        assert_eq!((read().epoch, read().next), (1, 0), "forgotten");
        // An ack written on another node before it applied the delete, applied after it.
        here.positions(0, "app", &[position(b"q", 0, 7)]).unwrap();
        assert_eq!(read().next, 0, "an ack of the deleted queue is dropped");
        // An ack of the queue created again, in the new epoch.
        here.positions(0, "app", &[position(b"q", 1, 2)]).unwrap();
        assert_eq!(read().next, 2);
        // Deletes of other queues (in its shard or another) do not touch it.
        here.deleting(0, b"other", 2).unwrap();
        here.deleting(1, b"elsewhere", 4).unwrap();
        here.positions(0, "app", &[position(b"q", 1, 3)]).unwrap();
        assert_eq!(read().next, 3);
        assert_eq!(positions.deletes(), 1);
    }
}
