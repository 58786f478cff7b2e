//! [`ShardGroups`]: a node's Raft instance of every shard of the cluster (docs/CLUSTER.md,
//! "Part 2"), what a node does with them:
//!
//! - **Writes from any node**: [`ShardGroups::write`] proposes a command on the shard's leader
//!   (here, or forwarded over the peer port), and answers once it is committed (on a majority
//!   of the shard's replicas, fsynced) and applied. A shard without a quorum fails within
//!   [`WRITE_WAIT_MAX`] with [`ShardWriteError::Unavailable`], naming the shard; it never
//!   acknowledges what a majority does not hold.
//! - **Placement**: [`ShardGroups::place`], run by every node for the shards it leads, makes
//!   each shard's voters the replicas `levee_proto::shards::replicas` names over the
//!   metadata group's voters: a new replica is added as a learner, fed the log, then made a
//!   voter; a replica on a node removed from the cluster is removed.
//! - **The peer side**: [`ShardGroups::serve`] answers the `Shard` peer call.
//!
//! A node runs an instance of every shard; those it is not a replica of stay uninitialised and
//! idle (no timers of their own beyond openraft's).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use levee_proto::Bytes;
use levee_proto::peer_v1::{ShardCall, ShardMessage};
use levee_store::{Store, SyncPolicy};
use openraft::error::{ClientWriteError, RaftError};
use openraft::{ChangeMembers, ServerState, SnapshotPolicy};
use serde::{Deserialize, Serialize};
use tonic::Status;

use crate::log_store::{LogStore, open_keyspace_sized};
use crate::network::PeerDialer;
use crate::shard::appender::{self, AppendWrite};
use crate::shard::machine::{ShardObserver, ShardStateMachine};
use crate::shard::network::{PeerChannels, ShardNetwork, send};
use crate::shard::watch;
use crate::shard::{
    ConsumerPosition, QueueMessage, ShardCommand, ShardConfig, ShardId, ShardRaft, ShardResponse,
    to_postcard,
};
use crate::syncer::JournalSyncer;
use crate::{NodeId, NodeInfo};

/// Most entries one `AppendEntries` call carries to a shard's follower.
pub const APPEND_ENTRIES_MAX: u64 = 16;
/// Largest message on the peer port: [`APPEND_ENTRIES_MAX`] entries of a 16 MiB request each.
pub const PEER_MESSAGE_BYTES_MAX: usize = 16 * (16 << 20);

/// Longest a write waits for its shard to commit it (a leader elected, a quorum reached).
pub const WRITE_WAIT_MAX: Duration = Duration::from_secs(2);
/// How long a shard whose delivery of due delayed messages failed waits before the next try.
const DELIVER_RETRY: Duration = Duration::from_secs(1);
/// Pause between tries while a shard has no leader.
const LEADER_WAIT_STEP: Duration = Duration::from_millis(20);
/// Least time between two elections a node calls to lead a shard it is preferred for.
const CLAIM_INTERVAL: Duration = Duration::from_secs(5);
/// A node calls such elections only within this time of first following another leader of
/// the shard (after it joined, was placed on the shard, or restarted): the leaders spread
/// when nodes arrive, and a failover among the others is not undone again and again.
const CLAIM_WINDOW: Duration = Duration::from_secs(30);
/// Longest a shard's leader counts as one (for coordinating consumer groups) without a
/// quorum of its replicas acknowledging it. Another node may be elected 150 ms (the shortest
/// election timeout) after the last acknowledgement; a new coordinator waits
/// [`LEAD_HOLD`] more before it assigns partitions, so the old one has stopped by then
/// (docs/CLUSTER.md, "Consumer groups on the shards").
pub const LEAD_QUORUM_ACK_MAX: Duration = Duration::from_millis(500);
/// How long a node that has just taken the lead of a shard waits before it assigns the
/// partitions of its topics' groups (see [`LEAD_QUORUM_ACK_MAX`]).
pub const LEAD_HOLD: Duration = Duration::from_secs(1);
/// How long a removed node's replica of a shard may see no leader and still count as needed
/// by the shard ([`ShardGroups::held_needed`]): far longer than an election, even with
/// several replicas leaving at once on a busy machine.
pub const LEADERLESS_GRACE: Duration = Duration::from_secs(30);
/// How often [`ShardGroups::lost_lead`] looks at a shard's lead between changes.
const LEAD_CHECK_INTERVAL: Duration = Duration::from_millis(25);
/// Longest a new replica may take to catch up before it is made a voter (placement retries).
const CATCH_UP_MAX: Duration = Duration::from_secs(10);

/// Why a write to a shard failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardWriteError {
    /// No leader or no quorum within the wait: retry later. The write may still be applied
    /// if `maybe_stored` (it reached a leader that could not confirm it in time).
    #[error("shard {shard} is unavailable: {reason}")]
    Unavailable {
        /// The shard.
        shard: ShardId,
        /// Why, in words.
        reason: String,
        /// Whether the write may still be applied.
        maybe_stored: bool,
    },
    /// The node has no such shard.
    #[error("shard {shard} does not exist: the cluster has {shards} shards")]
    NoShard {
        /// The shard asked for.
        shard: ShardId,
        /// The cluster's shards.
        shards: u32,
    },
    /// The shard's Raft instance stopped (a storage failure): the node must be restarted.
    #[error("shard {shard} stopped on this node: {reason}")]
    Stopped {
        /// The shard.
        shard: ShardId,
        /// Why.
        reason: String,
    },
}

/// A forwarded command's answer, once the leader applied it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardForwarded {
    /// What applying it answered.
    pub response: ShardResponse,
    /// Where it sits in the shard's log.
    pub log_index: u64,
}

/// Why a forwarded command was not taken.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ForwardRefusal {
    /// The receiver does not lead the shard (nothing was proposed: try the leader).
    NotLeader,
    /// Proposed, but not committed within the wait (it may still be).
    NotCommitted(String),
    /// The receiver's instance stopped.
    Stopped(String),
    /// The receiver leads the shard but no quorum of its replicas confirmed that in time (a
    /// read index it cannot give).
    Unconfirmed(String),
}

/// One shard group as this node sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShardStatus {
    /// The shard.
    pub shard: ShardId,
    /// The leader this node knows.
    pub leader: Option<NodeId>,
    /// The shard's voters (its replicas).
    pub voters: Vec<NodeId>,
    /// The shard's learners: replicas being added (fed the log before they vote) or leaving
    /// (a placement that no longer names them; removed once they know it).
    pub learners: Vec<NodeId>,
    /// This node's last log index of the shard.
    pub last_log_index: Option<u64>,
    /// This node's last applied index of the shard.
    pub last_applied_index: Option<u64>,
    /// The voters are changing (a joint membership: the old and the new set both vote).
    pub changing: bool,
    /// This node's term of the shard.
    pub term: u64,
    /// This node's role in the shard (leader, follower, candidate, learner).
    pub role: String,
    /// Messages waiting in the shard's delay slots, as this node's replica holds them.
    pub delayed_waiting: u64,
    /// When the shard's next delay slot is due (ms since the Unix epoch), if one holds
    /// messages.
    pub delayed_next_due_ms: Option<u64>,
    /// The last log index this node's copy of the shard's log purged (after a snapshot's
    /// mark), if any.
    pub purged_index: Option<u64>,
    /// The last snapshot's index, as openraft knows it on this node (a mark built here, or a
    /// snapshot installed).
    pub snapshot_index: Option<u64>,
    /// Snapshots this node installed for the shard since it started.
    pub snapshots_installed: u64,
    /// Snapshot files this node wrote for the shard since it started (to send them).
    pub snapshots_written: u64,
}

/// What one try of a write did.
enum Attempt {
    Done(ShardResponse),
    /// Not proposed anywhere: try again after a pause.
    Again(String),
}

/// Where a node keeps its shard groups once it has opened them (the peer service answers
/// shard calls from then on).
pub type ShardSlot = Arc<std::sync::OnceLock<ShardGroups>>;

/// When a node first followed another leader of a shard it prefers to lead, and when it last
/// called an election of it.
type Claim = (Instant, Option<Instant>);

/// A node's instances of every shard. Clones share them.
#[derive(Clone)]
pub struct ShardGroups {
    node_id: NodeId,
    rafts: Arc<Vec<ShardRaft>>,
    channels: PeerChannels,
    syncer: JournalSyncer,
    /// Per shard this node prefers to lead: when it first found itself a voter following
    /// another leader, and when it last called an election.
    claimed: Arc<std::sync::Mutex<std::collections::HashMap<ShardId, Claim>>>,
    /// Per shard: the term this node last led it in, and when it first saw that lead.
    led: Arc<std::sync::Mutex<std::collections::HashMap<ShardId, (u64, Instant)>>>,
    /// Each shard's state machine here (its delay slots say when a delivery is due).
    machines: Arc<Vec<ShardStateMachine>>,
    /// Set when the groups shut down: the delivery task stops.
    stopping: Arc<tokio::sync::watch::Sender<bool>>,
    /// Per shard: the positions writes waiting for the shard's writer task
    /// ([`ShardGroups::write_positions`]).
    positions: Arc<Vec<tokio::sync::mpsc::Sender<PositionsWrite>>>,
    /// Per shard: the append requests waiting for the shard's appender
    /// ([`ShardGroups::append`]).
    appends: Arc<Vec<tokio::sync::mpsc::Sender<AppendWrite>>>,
    /// Told of each positions entry written.
    observer: Arc<dyn ShardObserver>,
    /// Set when this node was removed from the cluster and hands its shards over
    /// ([`ShardGroups::step_out`]): it places no replica any more (its view of the cluster,
    /// which it left, could name itself again).
    leaving: Arc<std::sync::atomic::AtomicBool>,
    /// Per shard: when [`ShardGroups::held_needed`] last saw the group with a leader (or
    /// first looked at it).
    leader_seen: Arc<std::sync::Mutex<std::collections::HashMap<ShardId, Instant>>>,
    /// When each shard last heard from its leader (`shard::watch`).
    heard: Arc<watch::Heard>,
}

/// One consumer's positions bound for a shard, and where its outcome goes.
struct PositionsWrite {
    consumer: String,
    positions: Vec<ConsumerPosition>,
    done: tokio::sync::oneshot::Sender<Result<(), ShardWriteError>>,
}

/// Positions writes that may wait for a shard's writer at once (more wait to be queued:
/// back-pressure on the acking streams).
const POSITIONS_QUEUED_MAX: usize = 1_024;
/// Positions after which no more writes join a shard entry of the positions writer (one
/// write of up to `ACKS_MAX`, 10,000, may take it past).
const POSITIONS_PER_WRITE_MAX: usize = 10_000;
/// Least time between the starts of two positions entries of one shard from one node: the
/// acks that arrive meanwhile wait and go in the next entry together. Acks come with nearly
/// every delivery, and as entries of their own they were three in four of a cluster's
/// entries at 1,000 appends/s; so spaced, an ack is confirmed up to this much later, and
/// the appends have the CPU (docs/CLUSTER.md, "Consumers' positions").
pub const POSITIONS_ENTRIES_APART: Duration = Duration::from_millis(50);

impl std::fmt::Debug for ShardGroups {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "ShardGroups({} shards)", self.rafts.len())
    }
}

/// Milliseconds since the Unix epoch, by this node's clock (the time delay slots are due by).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        })
}

/// Entries a shard's log keeps behind its built mark, at most (docs/CLUSTER.md, "Snapshots";
/// never more than the entries between two marks): a follower that far behind still catches
/// up from the log.
pub const SNAPSHOT_LOG_KEPT: u64 = 1_000;
/// How long a snapshot's last chunk may take to send and install, in ms (the others too).
const INSTALL_SNAPSHOT_MS: u64 = 120_000;
/// Bytes of one chunk of a snapshot sent to a replica.
const SNAPSHOT_CHUNK_BYTES: u64 = 1 << 20;

/// The settings of every shard group: the metadata group's timings; a snapshot's built mark
/// every `snapshot_entries` applied entries, the log purged up to it but the last
/// [`SNAPSHOT_LOG_KEPT`] entries or `snapshot_entries`, the fewer (docs/CLUSTER.md,
/// "Snapshots").
pub fn shard_raft_config(
    cluster_id: &str,
    snapshot_entries: u64,
) -> Result<openraft::Config, String> {
    openraft::Config {
        cluster_name: format!("{cluster_id}-shards"),
        heartbeat_interval: 50,
        election_timeout_min: 150,
        election_timeout_max: 300,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(snapshot_entries),
        max_in_snapshot_log_to_keep: SNAPSHOT_LOG_KEPT.min(snapshot_entries),
        install_snapshot_timeout: INSTALL_SNAPSHOT_MS,
        snapshot_max_chunk_size: SNAPSHOT_CHUNK_BYTES,
        max_payload_entries: APPEND_ENTRIES_MAX,
        ..openraft::Config::default()
    }
    .validate()
    .map_err(|error| error.to_string())
}

/// How many bytes the memtables of a node's shard logs hold together before the largest is
/// written to disk (fjall's default is 64 MiB), and how many one shard's entries may hold
/// (16 MiB by default). Entries purged behind a snapshot's mark while still in their memtable
/// never reach an SST file: fjall's flush drops what a tombstone covers. With the default
/// sizes an entry was written to the journal, then again by its flush and its compactions,
/// and under the topic shape at 64 publishers those flushes and compactions
/// stalled the disk for seconds: forwarded publishes timed out in 3 of 3 runs of `levee bench
/// queue --nodes 3 --shape topic --producers 64`; with these sizes and marks every 1,000
/// or 500 entries (`shard_snapshot_entries`) none did in 9 of 9 (docs/CLUSTER.md, "Snapshots").
/// The memory is a bound, used only as entries arrive.
pub const SHARD_LOG_WRITE_BUFFER_BYTES: u64 = 256 << 20;
/// See [`SHARD_LOG_WRITE_BUFFER_BYTES`].
pub const SHARD_LOG_ENTRIES_MEMTABLE_BYTES: u32 = 64 << 20;

/// The fsync interval of a store whose queues the shards hold, when it was opened under
/// `always` (see [`ShardGroups::open`]).
pub const SHARD_STORE_SYNC_MS: u64 = 10;

impl ShardGroups {
    /// Opens `shards` shard instances for node `node_id`: their logs in one keyspace in
    /// `directory`, their state machines over `store`.
    ///
    /// A `store` under `always` is switched to `interval(`[`SHARD_STORE_SYNC_MS`]`)`: the
    /// shards' logs make an acknowledged append durable (fsynced on a majority of replicas),
    /// and every state machine rebuilds what a crash took from the store out of its log and
    /// its apply record, so the store's own copy need not be fsynced before an apply
    /// answers (docs/CLUSTER.md, "The state machine").
    pub async fn open(
        (node_id, shards): (NodeId, u32),
        (directory, store): (&Path, &Arc<Store>),
        config: openraft::Config,
        dialer: PeerDialer,
        observer: Arc<dyn ShardObserver>,
    ) -> Result<Self, String> {
        if store.sync_policy() == SyncPolicy::Always {
            store
                .set_sync_policy(SyncPolicy::Interval {
                    interval_ms: SHARD_STORE_SYNC_MS,
                })
                .map_err(|error| format!("the store's sync policy: {error}"))?;
            tracing::info!(
                interval_ms = SHARD_STORE_SYNC_MS,
                "the queue store holds shard copies rebuilt from their logs: it fsyncs on an interval"
            );
        }
        let keyspace = open_keyspace_sized(directory, SHARD_LOG_WRITE_BUFFER_BYTES)
            .map_err(|error| error.to_string())?;
        let syncer = JournalSyncer::start(keyspace.clone(), directory)
            .map_err(|error| format!("the shard logs' sync thread: {error}"))?;
        // The apply records the machines only note are durable before the store writes a
        // message they name.
        store.set_write_barrier(syncer.write_barrier());
        let heard = Arc::new(watch::Heard::new(shards));
        let channels = PeerChannels::new(dialer)
            .with_observer(Arc::clone(&observer))
            .with_heard(Arc::clone(&heard));
        let config = Arc::new(config);
        let mut rafts = Vec::with_capacity(shards as usize);
        let mut machines = Vec::with_capacity(shards as usize);
        for shard in 0..shards {
            let log = LogStore::<ShardConfig>::open_in_sized(
                keyspace.clone(),
                &format!("-{shard}"),
                Some(SHARD_LOG_ENTRIES_MEMTABLE_BYTES),
            )
            .map_err(|error| format!("shard {shard}'s log: {error}"))?
            .with_syncer(syncer.clone())
            .with_flush_timer({
                let observer = Arc::clone(&observer);
                Arc::new(move |took| observer.log_flushed(shard, took))
            });
            let machine = ShardStateMachine::open(
                (shard, shards),
                (
                    Arc::clone(store),
                    log.clone(),
                    &directory.join("snapshots").join(shard.to_string()),
                ),
                Some(Arc::clone(&observer)),
            )
            .map_err(|error| format!("shard {shard}'s state: {error}"))?
            .with_records_fenced();
            machines.push(machine.clone());
            let raft = ShardRaft::new(
                node_id,
                Arc::clone(&config),
                ShardNetwork::new(shard, channels.clone()),
                log,
                machine,
            )
            .await
            .map_err(|error| format!("shard {shard}: {error}"))?;
            rafts.push(raft);
        }
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..shards)
            .map(|_| tokio::sync::mpsc::channel(POSITIONS_QUEUED_MAX))
            .unzip();
        let (append_senders, append_receivers): (Vec<_>, Vec<_>) = (0..shards)
            .map(|_| tokio::sync::mpsc::channel(appender::APPENDS_QUEUED_MAX))
            .unzip();
        let groups = Self {
            node_id,
            rafts: Arc::new(rafts),
            channels,
            syncer,
            claimed: Arc::default(),
            leaving: Arc::default(),
            leader_seen: Arc::default(),
            heard,
            led: Arc::default(),
            machines: Arc::new(machines),
            stopping: Arc::new(tokio::sync::watch::Sender::new(false)),
            positions: Arc::new(senders),
            appends: Arc::new(append_senders),
            observer,
        };
        for (shard, receiver) in (0..shards).zip(receivers) {
            tokio::spawn(groups.clone().note_leads(shard));
            tokio::spawn(groups.clone().write_positions_of(shard, receiver));
        }
        for (shard, receiver) in (0..shards).zip(append_receivers) {
            let stopping = groups.stopping.subscribe();
            tokio::spawn(appender::run(groups.clone(), shard, receiver, stopping));
        }
        tokio::spawn(groups.clone().deliver_due());
        tokio::spawn(watch::run(groups.clone(), groups.stopping.subscribe()));
        Ok(groups)
    }

    /// Every [`levee_broker::delay::FINE_MS`] until the groups shut down: for each shard this
    /// node leads whose next delay slot is due by this node's clock, proposes a
    /// `ShardCommand::Deliver` (in its term, never forwarded; every replica then delivers the
    /// same entries). A shard whose delivery failed (no quorum) is tried again after
    /// [`DELIVER_RETRY`].
    async fn deliver_due(self) {
        let mut stopping = self.stopping.subscribe();
        let mut tick = tokio::time::interval(Duration::from_millis(levee_broker::delay::FINE_MS));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failed: std::collections::HashMap<ShardId, Instant> =
            std::collections::HashMap::new();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stopping.wait_for(|stopping| *stopping) => return,
            }
            let now_ms = unix_ms();
            failed.retain(|_, at| at.elapsed() < DELIVER_RETRY);
            let mut writes = tokio::task::JoinSet::new();
            for (shard, machine) in (0..).zip(self.machines.iter()) {
                if failed.contains_key(&shard)
                    || machine.next_due_ms().is_none_or(|due| due > now_ms)
                {
                    continue;
                }
                let Some(term) = self
                    .raft(shard)
                    .and_then(|raft| Self::leads_in(self.node_id, &raft.metrics().borrow()))
                else {
                    continue;
                };
                let groups = self.clone();
                writes.spawn(async move {
                    let written = groups
                        .write_in_term(shard, term, ShardCommand::Deliver { now_ms })
                        .await;
                    (shard, written)
                });
            }
            while let Some(joined) = writes.join_next().await {
                if let Ok((shard, Err(error))) = joined {
                    tracing::warn!(shard, %error, "delivering the shard's due delayed messages failed; retrying in 1 s");
                    failed.insert(shard, Instant::now());
                }
            }
        }
    }

    /// Messages waiting in the delay slots of the shards this node leads.
    pub fn delayed_waiting(&self) -> u64 {
        (0..)
            .zip(self.machines.iter())
            .filter(|(shard, _)| {
                self.raft(*shard).is_some_and(|raft| {
                    Self::leads_in(self.node_id, &raft.metrics().borrow()).is_some()
                })
            })
            .map(|(_, machine)| machine.delayed_waiting())
            .sum()
    }

    /// Starts the hold of each new lead of `shard` by this node (see
    /// [`ShardGroups::lead_hold`]) the moment its metrics say so, until the shard stops.
    async fn note_leads(self, shard: ShardId) {
        let Some(mut metrics) = self.raft(shard).map(ShardRaft::metrics) else {
            return;
        };
        loop {
            let term = Self::leads_in(self.node_id, &metrics.borrow_and_update());
            if let Some(term) = term {
                self.lead_hold(shard, term);
            }
            if metrics.changed().await.is_err() {
                return;
            }
        }
    }

    /// The cluster's shards.
    pub fn shards(&self) -> u32 {
        u32::try_from(self.rafts.len()).unwrap_or(u32::MAX)
    }

    /// Shard `shard`'s instance here.
    pub fn raft(&self, shard: ShardId) -> Option<&ShardRaft> {
        self.rafts.get(shard as usize)
    }

    /// Makes this node the only replica of every shard not initialised yet (the node that
    /// created the cluster, or a lone server).
    pub async fn initialize_alone(&self, me: &NodeInfo) -> Result<(), String> {
        for (shard, raft) in self.rafts.iter().enumerate() {
            if raft
                .is_initialized()
                .await
                .map_err(|error| error.to_string())?
            {
                continue;
            }
            raft.initialize(BTreeMap::from([(self.node_id, me.clone())]))
                .await
                .map_err(|error| format!("shard {shard}: {error}"))?;
        }
        Ok(())
    }

    /// Whether this node is a voter of `shard`, so its store holds the shard's queues.
    pub fn replicates(&self, shard: ShardId) -> bool {
        self.raft(shard).is_some_and(|raft| {
            raft.metrics()
                .borrow()
                .membership_config
                .membership()
                .voter_ids()
                .any(|voter| voter == self.node_id)
        })
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    /// What `shard::watch` sees of `shard` here, and its known leader's peer address.
    pub(crate) fn watched(&self, shard: ShardId) -> Option<(watch::Seen, Option<String>)> {
        let raft = self.raft(shard)?;
        let metrics = raft.metrics();
        let metrics = metrics.borrow();
        let membership = metrics.membership_config.membership();
        let seen = watch::Seen {
            state: metrics.state,
            voter: membership.voter_ids().any(|voter| voter == self.node_id),
            leader: metrics.current_leader,
            silent_for: self.heard.silent_for(shard),
            since_granted: self.heard.since_granted(shard),
            since_outlogged: self.heard.since_outlogged(shard),
        };
        let peer_addr = metrics
            .current_leader
            .and_then(|leader| membership.get_node(&leader))
            .map(|node| node.peer_addr.clone());
        Some((seen, peer_addr))
    }

    /// The leader of `shard` this node knows, if any.
    pub fn leader_of(&self, shard: ShardId) -> Option<NodeId> {
        self.raft(shard)
            .and_then(|raft| raft.metrics().borrow().current_leader)
    }

    /// This node's term as `shard`'s leader, while it leads it and a quorum of the shard's
    /// replicas acknowledged it within [`LEAD_QUORUM_ACK_MAX`] as its last metrics say;
    /// `None` otherwise.
    pub fn lead(&self, shard: ShardId) -> Option<u64> {
        let metrics = self.raft(shard)?.metrics().borrow().clone();
        let acked = metrics
            .millis_since_quorum_ack
            .is_some_and(|millis| Duration::from_millis(millis) <= LEAD_QUORUM_ACK_MAX);
        (Self::leads_in(self.node_id, &metrics).is_some() && acked).then_some(metrics.current_term)
    }

    /// The term `node` leads in by `metrics`.
    fn leads_in(node: NodeId, metrics: &openraft::RaftMetrics<NodeId, NodeInfo>) -> Option<u64> {
        (metrics.state == ServerState::Leader && metrics.current_leader == Some(node))
            .then_some(metrics.current_term)
    }

    /// Returns, with the reason, once this node no longer leads `shard` in `term`: another
    /// term began, or no quorum of the shard's replicas acknowledged it for
    /// [`LEAD_QUORUM_ACK_MAX`]. openraft's metrics say when a quorum last acknowledged the
    /// leader as of their report; when no report newer than half the bound came (an idle
    /// shard reports nothing new; a leader cut off from the others reports a growing time),
    /// this node asks the quorum itself (a heartbeat round, within the other half).
    pub async fn lost_lead(&self, shard: ShardId, term: u64) -> String {
        let Some(raft) = self.raft(shard) else {
            return format!("shard {shard} does not exist here");
        };
        let lost = |why: &str| {
            format!(
                "node {} lost the lead of shard {shard}: {why}",
                self.node_id
            )
        };
        let half = LEAD_QUORUM_ACK_MAX / 2;
        let mut metrics = raft.metrics();
        let mut acked_at: Option<Instant> = None;
        // Whether `metrics` holds a report not read yet: only a new report's time since the
        // quorum's acknowledgement is as of now.
        let mut reported = true;
        loop {
            let now = metrics.borrow_and_update().clone();
            if Self::leads_in(self.node_id, &now) != Some(term) {
                return match now.current_leader {
                    Some(leader) if leader != self.node_id => {
                        lost(&format!("node {leader} leads it now"))
                    }
                    _ => lost("another term began"),
                };
            }
            if reported && let Some(millis) = now.millis_since_quorum_ack {
                acked_at = acked_at.max(Instant::now().checked_sub(Duration::from_millis(millis)));
            }
            if acked_at.is_none_or(|at| at.elapsed() > half) {
                let asked = Instant::now();
                match tokio::time::timeout(half, raft.get_read_log_id()).await {
                    Ok(Ok(_)) => acked_at = Some(asked),
                    Ok(Err(error)) => return lost(&error.to_string()),
                    Err(_) => {
                        return lost(&format!(
                            "no quorum of its replicas answered within {} ms",
                            LEAD_QUORUM_ACK_MAX.as_millis()
                        ));
                    }
                }
            }
            reported = tokio::select! {
                changed = metrics.changed() => {
                    if changed.is_err() {
                        return lost("the shard stopped on this node");
                    }
                    true
                }
                () = tokio::time::sleep(LEAD_CHECK_INTERVAL) => false,
            };
        }
    }

    /// How much longer this node, leading `shard` in `term`, waits before it assigns the
    /// partitions of the shard's topics' groups: what is left of [`LEAD_HOLD`] since it first
    /// saw itself lead in `term` (this call counts as seeing it; so does a task watching the
    /// shard's metrics, which sees it as the lead begins).
    pub fn lead_hold(&self, shard: ShardId, term: u64) -> Duration {
        let mut led = self
            .led
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let since = led.entry(shard).or_insert((term, Instant::now()));
        if since.0 != term {
            *since = (term, Instant::now());
        }
        LEAD_HOLD.saturating_sub(since.1.elapsed())
    }

    /// The leader of `shard` this node knows, with its addresses, if it is not this node.
    pub fn other_leader(&self, shard: ShardId) -> Option<(NodeId, NodeInfo)> {
        let (leader, node) = Self::leader(self.raft(shard)?)?;
        (leader != self.node_id).then_some((leader, node?))
    }

    /// The voters of `shard` as this node knows them.
    pub fn voters_of(&self, shard: ShardId) -> Vec<NodeId> {
        self.raft(shard)
            .map(|raft| {
                raft.metrics()
                    .borrow()
                    .membership_config
                    .membership()
                    .voter_ids()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Every shard this node is a member of, as it sees it.
    pub fn status(&self) -> Vec<ShardStatus> {
        self.rafts
            .iter()
            .enumerate()
            .filter_map(|(shard, raft)| {
                let metrics = raft.metrics().borrow().clone();
                let membership = metrics.membership_config.membership();
                membership.get_node(&self.node_id)?;
                Some(ShardStatus {
                    shard: u32::try_from(shard).unwrap_or(u32::MAX),
                    leader: metrics.current_leader,
                    voters: membership.voter_ids().collect(),
                    learners: membership.learner_ids().collect(),
                    last_log_index: metrics.last_log_index,
                    last_applied_index: metrics.last_applied.map(|log_id| log_id.index),
                    changing: membership.get_joint_config().len() > 1,
                    term: metrics.current_term,
                    role: format!("{:?}", metrics.state).to_lowercase(),
                    delayed_waiting: self.machines[shard].delayed_waiting(),
                    delayed_next_due_ms: self.machines[shard].next_due_ms(),
                    purged_index: metrics.purged.map(|log_id| log_id.index),
                    snapshot_index: metrics.snapshot.map(|log_id| log_id.index),
                    snapshots_installed: self.machines[shard].snapshot_counts().0,
                    snapshots_written: self.machines[shard].snapshot_counts().1,
                })
            })
            .collect()
    }

    /// Stops every instance.
    pub async fn shutdown(&self) {
        self.stopping.send_replace(true);
        for raft in self.rafts.iter() {
            if let Err(error) = raft.shutdown().await {
                tracing::warn!(%error, "stopping a shard");
            }
        }
        self.syncer.stop();
    }

    /// The leader of `shard` this node knows, with its addresses.
    fn leader(raft: &ShardRaft) -> Option<(NodeId, Option<NodeInfo>)> {
        let metrics = raft.metrics().borrow().clone();
        let leader = metrics.current_leader?;
        let node = metrics
            .membership_config
            .membership()
            .get_node(&leader)
            .cloned();
        Some((leader, node))
    }

    /// Shard `shard`'s instance here, to write to.
    fn raft_to_write(&self, shard: ShardId) -> Result<&ShardRaft, ShardWriteError> {
        self.raft(shard).ok_or(ShardWriteError::NoShard {
            shard,
            shards: self.shards(),
        })
    }

    /// Writes `command` to `shard` and answers what applying it did, once committed. A write
    /// that reached a leader but was not confirmed in time fails with `maybe_stored` set.
    pub async fn write(
        &self,
        shard: ShardId,
        command: ShardCommand,
    ) -> Result<ShardResponse, ShardWriteError> {
        let raft = self.raft_to_write(shard)?;
        let started = Instant::now();
        let mut reason = String::from("no leader is known yet");
        while let Some(left) = WRITE_WAIT_MAX.checked_sub(started.elapsed()) {
            let attempt = match Self::leader(raft) {
                Some((leader, _)) if leader == self.node_id => {
                    self.propose(shard, raft, &command, left).await?
                }
                Some((leader, Some(node))) => {
                    self.forward(shard, (leader, &node), &command, left).await?
                }
                Some((leader, None)) => {
                    Attempt::Again(format!("leader {leader} is not in the shard's membership"))
                }
                None => Attempt::Again("no leader is known yet".to_owned()),
            };
            match attempt {
                Attempt::Done(response) => return Ok(response),
                Attempt::Again(why) => reason = why,
            }
            tokio::time::sleep(LEADER_WAIT_STEP).await;
        }
        Err(ShardWriteError::Unavailable {
            shard,
            reason: format!(
                "no leader took the write within {} ms ({reason}); retry",
                WRITE_WAIT_MAX.as_millis()
            ),
            maybe_stored: false,
        })
    }

    /// Writes `command` to `shard` only as its leader in `term`: never forwarded, so a node
    /// that lost the lead cannot have the new leader commit a write it decided on before
    /// (a consumer group's commits, decided by the coordinator of that term).
    pub async fn write_in_term(
        &self,
        shard: ShardId,
        term: u64,
        command: ShardCommand,
    ) -> Result<ShardResponse, ShardWriteError> {
        let raft = self.raft_to_write(shard)?;
        let leads = Self::leads_in(self.node_id, &raft.metrics().borrow());
        if leads != Some(term) {
            return Err(ShardWriteError::Unavailable {
                shard,
                reason: format!("node {} no longer leads it in term {term}", self.node_id),
                maybe_stored: false,
            });
        }
        match self.propose(shard, raft, &command, WRITE_WAIT_MAX).await? {
            Attempt::Done(response) => Ok(response),
            Attempt::Again(why) => Err(ShardWriteError::Unavailable {
                shard,
                reason: why,
                maybe_stored: false,
            }),
        }
    }

    /// Waits until this node has applied everything `shard` committed before now (a write
    /// that changes nothing: proposed on the leader, or forwarded to it and awaited here).
    pub async fn barrier(&self, shard: ShardId) -> Result<(), ShardWriteError> {
        self.write(shard, ShardCommand::Barrier).await.map(|_| ())
    }

    /// Writes `consumer`'s `positions` on queues of `shard` (the largest wins, so a write may be
    /// applied twice: one that may be stored when the lead moves is written again, within
    /// about [`WRITE_WAIT_MAX`]) and returns once committed and applied here. A node writes one
    /// positions entry per shard at a time, and starts one at least
    /// [`POSITIONS_ENTRIES_APART`] after the one before: the writes that arrive meanwhile go
    /// in the next entry together, every consumer's (`ShardCommand::PositionsOf`), so however
    /// many streams ack on a node their acks cost at most one entry per shard per commit
    /// round and per 50 ms.
    pub async fn write_positions(
        &self,
        shard: ShardId,
        consumer: &str,
        positions: Vec<ConsumerPosition>,
    ) -> Result<(), ShardWriteError> {
        let (done, outcome) = tokio::sync::oneshot::channel();
        let write = PositionsWrite {
            consumer: consumer.to_owned(),
            positions,
            done,
        };
        self.through_writer(shard, &self.positions, write, outcome)
            .await
    }

    /// Hands `write` to `shard`'s writer task of `queues` (positions or appends) and waits for
    /// its `outcome`; fails when the shard does not exist or the writers are stopping.
    async fn through_writer<W, T>(
        &self,
        shard: ShardId,
        queues: &[tokio::sync::mpsc::Sender<W>],
        write: W,
        outcome: tokio::sync::oneshot::Receiver<Result<T, ShardWriteError>>,
    ) -> Result<T, ShardWriteError> {
        let stopped = |maybe_stored| ShardWriteError::Unavailable {
            shard,
            reason: "this node's shards are stopping".to_owned(),
            maybe_stored,
        };
        let queue = queues.get(shard as usize).ok_or(ShardWriteError::NoShard {
            shard,
            shards: self.shards(),
        })?;
        queue.send(write).await.map_err(|_| stopped(false))?;
        outcome.await.map_err(|_| stopped(true))?
    }

    /// Appends `producer`'s (if any) `messages` to queues of `shard`; on the shard's leader
    /// through the shard's appender (see [`appender`]): with the other requests that reach it
    /// while its previous entries are being committed, in one entry. A node that does not
    /// lead the shard forwards the request alone ([`Self::write`]): its round trip to the
    /// leader would hold back every request merged with it. Answers what applying the request
    /// did (`Appended`, or `Refused`), once committed and applied here, as [`Self::write`]
    /// does.
    pub async fn append(
        &self,
        shard: ShardId,
        producer: Option<String>,
        messages: Vec<QueueMessage>,
    ) -> Result<ShardResponse, ShardWriteError> {
        let leads_here = self
            .raft(shard)
            .is_some_and(|raft| raft.metrics().borrow().current_leader == Some(self.node_id));
        if !leads_here {
            return self
                .write(shard, ShardCommand::Append { producer, messages })
                .await;
        }
        let (write, outcome) = AppendWrite::new(producer, messages);
        self.through_writer(shard, &self.appends, write, outcome)
            .await
    }

    /// Told of what this node's shards do.
    pub(crate) fn observer(&self) -> &Arc<dyn ShardObserver> {
        &self.observer
    }

    /// `shard`'s positions writer: takes the first write waiting, waits until
    /// [`POSITIONS_ENTRIES_APART`] passed since the entry before began, takes every write
    /// queued by then (up to [`POSITIONS_PER_WRITE_MAX`] positions), writes them as one
    /// entry, answers each, and goes on; stops when the groups stop.
    async fn write_positions_of(
        self,
        shard: ShardId,
        mut queue: tokio::sync::mpsc::Receiver<PositionsWrite>,
    ) {
        let mut stopping = self.stopping.subscribe();
        let mut began: Option<Instant> = None;
        loop {
            let first = tokio::select! {
                first = queue.recv() => match first {
                    Some(first) => first,
                    None => return,
                },
                _ = stopping.wait_for(|stopping| *stopping) => return,
            };
            if let Some(began) = began {
                tokio::select! {
                    () = tokio::time::sleep_until((began + POSITIONS_ENTRIES_APART).into()) => {}
                    _ = stopping.wait_for(|stopping| *stopping) => return,
                }
            }
            began = Some(Instant::now());
            let mut count = first.positions.len();
            let mut batch = vec![first];
            while count < POSITIONS_PER_WRITE_MAX {
                match queue.try_recv() {
                    Ok(next) => {
                        count += next.positions.len();
                        batch.push(next);
                    }
                    Err(_) => break,
                }
            }
            let command = positions_command(&mut batch);
            let outcome = self.write_again_while_moving(shard, command).await;
            if outcome.is_ok() {
                self.observer.positions_written(shard, batch.len());
            }
            for write in batch {
                let _ = write.done.send(outcome.clone());
            }
        }
    }

    /// Writes a command that may be applied twice (positions: the largest wins; a barrier),
    /// writing it again while the shard's lead moves, within about [`WRITE_WAIT_MAX`].
    pub async fn write_again_while_moving(
        &self,
        shard: ShardId,
        command: ShardCommand,
    ) -> Result<(), ShardWriteError> {
        let started = Instant::now();
        loop {
            match self.write(shard, command.clone()).await {
                Err(ShardWriteError::Unavailable {
                    maybe_stored: true, ..
                }) if started.elapsed() < WRITE_WAIT_MAX => {
                    tokio::time::sleep(LEADER_WAIT_STEP).await;
                }
                other => return other.map(|_| ()),
            }
        }
    }

    /// Waits until this node has applied everything `shard` committed before the call, so a
    /// read of its store that follows is linearizable: it sees every write acknowledged
    /// before the call, through any node. The leader confirms it still leads with a quorum
    /// of the shard's replicas (openraft's read index: a heartbeat round; a new leader's
    /// index covers what earlier leaders committed); a follower asks the leader for that
    /// index. Then this node waits to apply that far. Fails `Unavailable` (nothing changed,
    /// retry) when no leader confirms within [`WRITE_WAIT_MAX`], or this node cannot apply
    /// that far in it.
    pub async fn read_barrier(&self, shard: ShardId) -> Result<(), ShardWriteError> {
        let raft = self.raft_to_write(shard)?;
        let started = Instant::now();
        let unavailable = |reason: String| ShardWriteError::Unavailable {
            shard,
            reason,
            maybe_stored: false,
        };
        let mut reason = String::from("no leader is known yet");
        while let Some(left) = WRITE_WAIT_MAX.checked_sub(started.elapsed()) {
            let index = match Self::leader(raft) {
                Some((leader, _)) if leader == self.node_id => {
                    Self::read_index_here(raft, left).await
                }
                Some((leader, Some(node))) => {
                    self.read_index_of(shard, (leader, &node), left).await
                }
                Some((leader, None)) => {
                    Err(format!("leader {leader} is not in the shard's membership"))
                }
                None => Err("no leader is known yet".to_owned()),
            };
            match index {
                Ok(index) => {
                    let left = WRITE_WAIT_MAX.saturating_sub(started.elapsed());
                    return raft
                        .wait(Some(left))
                        .applied_index_at_least(index, "a read index applied")
                        .await
                        .map(|_| ())
                        .map_err(|error| {
                            unavailable(format!(
                                "this node did not apply the shard's log up to its read index \
                                 {index:?} within {} ms ({error}); retry",
                                WRITE_WAIT_MAX.as_millis()
                            ))
                        });
                }
                Err(why) => reason = why,
            }
            tokio::time::sleep(LEADER_WAIT_STEP).await;
        }
        Err(unavailable(format!(
            "no leader confirmed a read index within {} ms ({reason}); retry",
            WRITE_WAIT_MAX.as_millis()
        )))
    }

    /// The read index of `shard` on this node, its leader: once a quorum confirmed the lead.
    async fn read_index_here(raft: &ShardRaft, left: Duration) -> Result<Option<u64>, String> {
        match tokio::time::timeout(left, raft.get_read_log_id()).await {
            Ok(Ok((read, _applied))) => Ok(read.map(|id| id.index)),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => {
                Err("no quorum of the shard's replicas confirmed the leader in time".to_owned())
            }
        }
    }

    /// The read index of `shard` as its leader `leader` gives it.
    async fn read_index_of(
        &self,
        shard: ShardId,
        (leader, node): (NodeId, &NodeInfo),
        left: Duration,
    ) -> Result<Option<u64>, String> {
        let answer = send(
            &self.channels,
            &node.peer_addr,
            (shard, ShardCall::ReadIndex),
            Vec::new(),
            left,
        )
        .await
        .map_err(|status| format!("leader {leader}: {}", status.message()))?;
        let answer: Result<Option<u64>, ForwardRefusal> = serde_json::from_slice(&answer)
            .map_err(|error| format!("leader {leader}'s answer is unreadable: {error}"))?;
        answer.map_err(|refusal| match refusal {
            ForwardRefusal::NotLeader => format!("node {leader} no longer leads"),
            ForwardRefusal::NotCommitted(why)
            | ForwardRefusal::Stopped(why)
            | ForwardRefusal::Unconfirmed(why) => format!("leader {leader}: {why}"),
        })
    }

    /// Proposes `command` on this node, which leads `shard`.
    async fn propose(
        &self,
        shard: ShardId,
        raft: &ShardRaft,
        command: &ShardCommand,
        left: Duration,
    ) -> Result<Attempt, ShardWriteError> {
        let started = Instant::now();
        let written = tokio::time::timeout(left, raft.client_write(command.clone()))
            .await
            .map_err(|_| ShardWriteError::Unavailable {
                shard,
                reason: "the leader could not reach a majority of the shard's replicas in time; \
                         the write may still be applied if it does"
                    .to_owned(),
                maybe_stored: true,
            })?;
        match written {
            Ok(written) => {
                self.observer.committed(shard, started.elapsed());
                Ok(Attempt::Done(written.data))
            }
            // The lead moved while the entry waited: it may still be committed by the next
            // leader (openraft answers this both before and after appending the entry).
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))) => {
                Err(ShardWriteError::Unavailable {
                    shard,
                    reason: "the shard's lead moved while the write waited; the next leader \
                             may still apply it"
                        .to_owned(),
                    maybe_stored: true,
                })
            }
            Err(RaftError::APIError(other)) => Ok(Attempt::Again(other.to_string())),
            // A normal stop (the node is stopping, or was removed from the cluster): the entry
            // may have reached the others, and another node goes on with the shard.
            Err(RaftError::Fatal(openraft::error::Fatal::Stopped)) => {
                Err(ShardWriteError::Unavailable {
                    shard,
                    reason: "the shard's instance on this node stopped while the write waited \
                             (the node is stopping or was removed); another node may still \
                             apply it"
                        .to_owned(),
                    maybe_stored: true,
                })
            }
            Err(RaftError::Fatal(fatal)) => Err(ShardWriteError::Stopped {
                shard,
                reason: fatal.to_string(),
            }),
        }
    }

    /// Sends `command` to `shard`'s leader and waits until this node applied it too (so a
    /// read through this node sees it), up to the time left.
    async fn forward(
        &self,
        shard: ShardId,
        (leader, node): (NodeId, &NodeInfo),
        command: &ShardCommand,
        left: Duration,
    ) -> Result<Attempt, ShardWriteError> {
        let maybe = |reason: String| ShardWriteError::Unavailable {
            shard,
            reason,
            maybe_stored: true,
        };
        let body = to_postcard(command).map_err(|error| ShardWriteError::Stopped {
            shard,
            reason: format!("cannot encode the command: {error}"),
        })?;
        let answer = match send(
            &self.channels,
            &node.peer_addr,
            (shard, ShardCall::Forward),
            body,
            left,
        )
        .await
        {
            Ok(answer) => answer,
            // Not connected: the leader never saw it.
            Err(status) if status.code() == tonic::Code::Unavailable => {
                return Ok(Attempt::Again(format!(
                    "leader {leader}: {}",
                    status.message()
                )));
            }
            Err(status) => {
                return Err(maybe(format!(
                    "forwarded to leader {leader}, no answer: {}",
                    status.message()
                )));
            }
        };
        let answer: Result<ShardForwarded, ForwardRefusal> = serde_json::from_slice(&answer)
            .map_err(|error| maybe(format!("leader {leader}'s answer is unreadable: {error}")))?;
        match answer {
            Ok(forwarded) => {
                if let Some(raft) = self.raft(shard) {
                    let applied = raft
                        .wait(Some(left))
                        .applied_index_at_least(Some(forwarded.log_index), "the write applied")
                        .await;
                    if let Err(error) = applied {
                        tracing::debug!(%error, shard, "a forwarded write is committed, not yet applied here");
                    }
                }
                Ok(Attempt::Done(forwarded.response))
            }
            Err(ForwardRefusal::NotLeader) => {
                Ok(Attempt::Again(format!("node {leader} no longer leads")))
            }
            Err(ForwardRefusal::NotCommitted(reason) | ForwardRefusal::Unconfirmed(reason)) => {
                Err(maybe(format!("leader {leader}: {reason}")))
            }
            // Proposed there, perhaps: it may reach the others.
            Err(ForwardRefusal::Stopped(reason)) => {
                Err(maybe(format!("leader {leader} stopped: {reason}")))
            }
        }
    }

    /// Answers one `Shard` peer call.
    pub async fn serve(&self, message: ShardMessage) -> Result<ShardMessage, Status> {
        let shard = message.shard;
        let raft = self
            .raft(shard)
            .ok_or_else(|| Status::unavailable(format!("no shard {shard} on this node")))?;
        let body = match ShardCall::try_from(message.call).unwrap_or(ShardCall::Unspecified) {
            ShardCall::AppendEntries => {
                self.heard.hear(shard);
                json(&raft.append_entries(decode_shared(&message.body)?).await)
            }
            ShardCall::Vote => {
                let answer = raft.vote(decode(&message.body)?).await;
                if answer.as_ref().is_ok_and(|vote| vote.vote_granted) {
                    self.heard.granted(shard);
                }
                json(&answer)
            }
            ShardCall::InstallSnapshot => {
                json(&raft.install_snapshot(decode(&message.body)?).await)
            }
            ShardCall::Forward => {
                let command: ShardCommand = decode_shared(&message.body)?;
                json(&self.serve_forward((shard, raft), command).await)
            }
            ShardCall::ReadIndex => json(&self.serve_read_index(raft).await),
            ShardCall::Probe => json(&()),
            ShardCall::Unspecified => {
                return Err(Status::invalid_argument("a shard call names no call"));
            }
        }?;
        Ok(ShardMessage {
            shard,
            call: message.call,
            body: body.into(),
        })
    }

    async fn serve_read_index(&self, raft: &ShardRaft) -> Result<Option<u64>, ForwardRefusal> {
        if raft.metrics().borrow().current_leader != Some(self.node_id) {
            return Err(ForwardRefusal::NotLeader);
        }
        Self::read_index_here(raft, WRITE_WAIT_MAX)
            .await
            .map_err(ForwardRefusal::Unconfirmed)
    }

    async fn serve_forward(
        &self,
        (shard, raft): (ShardId, &ShardRaft),
        command: ShardCommand,
    ) -> Result<ShardForwarded, ForwardRefusal> {
        if raft.metrics().borrow().current_leader != Some(self.node_id) {
            return Err(ForwardRefusal::NotLeader);
        }
        let started = Instant::now();
        let written = tokio::time::timeout(WRITE_WAIT_MAX, raft.client_write(command))
            .await
            .map_err(|_| {
                ForwardRefusal::NotCommitted(
                    "not committed in time: no majority of the shard's replicas confirmed it"
                        .to_owned(),
                )
            })?;
        match written {
            Ok(written) => {
                self.observer.committed(shard, started.elapsed());
                // The sender answers once it applied the write too: tell the followers the
                // commit now rather than at the next heartbeat (up to 50 ms later on a quiet
                // shard).
                if let Err(error) = raft.trigger().heartbeat().await {
                    tracing::debug!(%error, "pushing the commit to the followers");
                }
                Ok(ShardForwarded {
                    response: written.data,
                    log_index: written.log_id.index,
                })
            }
            // The lead moved while the entry waited: the next leader may still commit it.
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))) => {
                Err(ForwardRefusal::NotCommitted(
                    "the shard's lead moved while the write waited; the next leader may still \
                     apply it"
                        .to_owned(),
                ))
            }
            Err(RaftError::APIError(other)) => Err(ForwardRefusal::NotCommitted(other.to_string())),
            Err(RaftError::Fatal(fatal)) => Err(ForwardRefusal::Stopped(fatal.to_string())),
        }
    }

    /// Spreads the shards' leaders over the nodes: a node that is a shard's preferred replica
    /// (the first `levee_proto::shards::replicas` names), a voter of it, and not its leader
    /// while another node leads, calls an election, at most once per [`CLAIM_INTERVAL`] per
    /// shard and only within [`CLAIM_WINDOW`] of first following another leader. Its log is as long as the leader's when the shard is quiet and then it wins;
    /// otherwise the election fails and the leader stays. Writes waiting on the old leader at
    /// that moment fail as maybe stored (idempotent producers resend them safely).
    fn claim_lead(
        &self,
        shard: ShardId,
        raft: &ShardRaft,
        metrics: &openraft::RaftMetrics<NodeId, NodeInfo>,
        preferred: Option<NodeId>,
    ) {
        let leader = metrics.current_leader;
        let voter = metrics
            .membership_config
            .membership()
            .voter_ids()
            .any(|voter| voter == self.node_id);
        if preferred != Some(self.node_id)
            || !voter
            || leader.is_none()
            || leader == Some(self.node_id)
            || metrics.state != ServerState::Follower
        {
            return;
        }
        let mut claimed = self
            .claimed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        let (since, last) = claimed.entry(shard).or_insert((now, None));
        if now.duration_since(*since) > CLAIM_WINDOW
            || last.is_some_and(|at| now.duration_since(at) < CLAIM_INTERVAL)
        {
            return;
        }
        *last = Some(now);
        let raft = raft.clone();
        tokio::spawn(async move {
            if let Err(error) = raft.trigger().elect().await {
                tracing::debug!(%error, shard, "claiming the shard's lead");
            }
        });
    }

    /// For every shard this node leads, moves its voters towards the replicas `voters` (the
    /// metadata group's voters and their addresses) name for it, one change per shard per
    /// call: first a change a former leader left half done (a joint membership) is finished;
    /// then the named replicas it lacks are added (each a learner fed the log first, then all
    /// made voters at once); then, once it has every named replica and only when `shrink`
    /// (this node's view of the metadata group is current), the replicas it no longer names
    /// leave: those on nodes that are no longer `members` of the metadata group (removed from
    /// the cluster) as learners for one round, then removed (a removed node that still runs
    /// learns it left and stops), those on live members (a fourth voter took their place) as
    /// learners until they hold the membership that made them learners (they stop serving the
    /// shard then). With up to three voters every node is named for every
    /// shard, so every voter holds every shard and serves reads of every queue from its own
    /// store. Returns how many shards changed.
    pub async fn place(
        &self,
        voters: &BTreeMap<NodeId, NodeInfo>,
        members: &BTreeSet<NodeId>,
        shrink: bool,
    ) -> usize {
        if self.leaving.load(std::sync::atomic::Ordering::Acquire) {
            return 0;
        }
        let ids: Vec<NodeId> = voters.keys().copied().collect();
        let mut changed = 0;
        for (shard, raft) in self.rafts.iter().enumerate() {
            let metrics = raft.metrics().borrow().clone();
            let shard = u32::try_from(shard).unwrap_or(u32::MAX);
            let replicas = levee_proto::shards::replicas(shard, &ids);
            if metrics.state != ServerState::Leader {
                self.claim_lead(shard, raft, &metrics, replicas.first().copied());
                continue;
            }
            let membership = metrics.membership_config.membership().clone();
            if let Some(goal) = Self::unfinished_change(&membership) {
                // A leader that died between the two steps of a change leaves the joint
                // membership in the log; its successor ends it, or a node of the old set
                // going down would stall the shard.
                if self.change_voters(shard, raft, goal, true).await {
                    changed += 1;
                }
                continue;
            }
            let wanted: BTreeSet<NodeId> = replicas.into_iter().collect();
            let current: BTreeSet<NodeId> = membership.voter_ids().collect();
            let missing: BTreeSet<NodeId> = wanted.difference(&current).copied().collect();
            if missing.is_empty() {
                // Grown first, shrunk after: a majority of the named replicas holds the log
                // before a replica leaves. A node whose view of the metadata group may be
                // behind (restarted, replaying its log) does not shrink a shard on it.
                if !shrink {
                    continue;
                }
                let kept: BTreeSet<NodeId> = current.intersection(&wanted).copied().collect();
                if kept != current && !kept.is_empty() {
                    // A replica the placement no longer names stays a learner until it holds
                    // the membership that says so (it stops serving the shard then; a node
                    // removed from the cluster that is still running stops), then goes (one
                    // on a removed node goes at the next round whatever it holds).
                    if self.change_voters(shard, raft, kept, true).await {
                        changed += 1;
                    }
                    continue;
                }
                let stale = Self::stale_learners(&metrics, &wanted, members);
                if !stale.is_empty() && self.remove_learners(shard, raft, stale).await {
                    changed += 1;
                }
                continue;
            }
            if self
                .grow(shard, raft, (&membership, &missing), voters)
                .await
            {
                changed += 1;
            }
        }
        changed
    }

    /// Adds the `missing` replicas of `shard` (which this node leads, its membership
    /// `membership`) as learners fed the log, then, once every one caught up, makes them voters
    /// beside the current ones; whether the voters changed.
    async fn grow(
        &self,
        shard: ShardId,
        raft: &ShardRaft,
        (membership, missing): (&openraft::Membership<NodeId, NodeInfo>, &BTreeSet<NodeId>),
        voters: &BTreeMap<NodeId, NodeInfo>,
    ) -> bool {
        let grown: BTreeSet<NodeId> = membership
            .voter_ids()
            .chain(missing.iter().copied())
            .collect();
        let mut ready = true;
        for node in missing {
            if membership.get_node(node).is_some() {
                continue;
            }
            let Some(info) = voters.get(node) else {
                continue;
            };
            let added =
                tokio::time::timeout(CATCH_UP_MAX, raft.add_learner(*node, info.clone(), true))
                    .await;
            if !matches!(added, Ok(Ok(_))) {
                tracing::debug!(shard, node, "a new replica did not catch up yet; retrying");
                ready = false;
            }
        }
        ready && self.change_voters(shard, raft, grown, false).await
    }

    /// On a node removed from the cluster: hands over the shards it leads, each to its other
    /// voters (this node kept as a learner, which their next leader removes), since the
    /// cluster's own placement no longer runs here (a shard whose voters are this node and one
    /// other would otherwise be left without a quorum when it stops). A shard none of whose
    /// other voters is among the cluster's `remaining` voters (they were all removed too) is
    /// first grown onto the replicas the placement names among `remaining`, so that it is
    /// handed to them at a later call. Returns how many shards changed.
    pub async fn step_out(&self, remaining: &BTreeMap<NodeId, NodeInfo>) -> usize {
        self.leaving
            .store(true, std::sync::atomic::Ordering::Release);
        let ids: Vec<NodeId> = remaining.keys().copied().collect();
        let mut changed = 0;
        for (shard, raft) in self.rafts.iter().enumerate() {
            let metrics = raft.metrics().borrow().clone();
            if metrics.state != ServerState::Leader {
                continue;
            }
            let shard = u32::try_from(shard).unwrap_or(u32::MAX);
            let membership = metrics.membership_config.membership().clone();
            let unfinished = Self::unfinished_change(&membership);
            let goal = unfinished
                .clone()
                .unwrap_or_else(|| membership.voter_ids().collect());
            let others: BTreeSet<NodeId> = goal
                .iter()
                .copied()
                .filter(|node| *node != self.node_id)
                .collect();
            if !ids.is_empty() && !others.iter().any(|node| remaining.contains_key(node)) {
                if unfinished.is_some() {
                    // The change under way ended first (its joint membership), then the growth.
                    if self.change_voters(shard, raft, goal, true).await {
                        changed += 1;
                    }
                    continue;
                }
                let missing: BTreeSet<NodeId> = levee_proto::shards::replicas(shard, &ids)
                    .into_iter()
                    .filter(|node| !membership.voter_ids().any(|voter| voter == *node))
                    .collect();
                tracing::info!(
                    shard,
                    ?missing,
                    "every other replica of this shard left the cluster too: moving it to the \
                     nodes that stay before handing it over"
                );
                if self
                    .grow(shard, raft, (&membership, &missing), remaining)
                    .await
                {
                    changed += 1;
                }
                continue;
            }
            if !others.is_empty() && self.change_voters(shard, raft, others, true).await {
                changed += 1;
            }
        }
        changed
    }

    /// The shards whose move off this node may need its vote: it is a voter of one of the
    /// shard's voter sets (two while a change is under way) in which the nodes that stay
    /// (`remaining`) are no majority, and the group had a leader in view within
    /// [`LEADERLESS_GRACE`] (counted from the first call). The nodes that stay cannot change
    /// such a shard's voters without this node. A replica with no leader in view for longer
    /// (one the group dropped before it learned so, which then only stands for elections it
    /// cannot win) is not counted; one in an election is, however many the nodes that leave
    /// at once make it take: were it not, two of a shard's three replicas could both stop
    /// while it elects, and leave it without a majority for good.
    pub fn held_needed(&self, remaining: &BTreeSet<NodeId>) -> Vec<ShardId> {
        let now = Instant::now();
        let mut seen = self
            .leader_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (0..self.shards())
            .filter(|shard| {
                self.raft(*shard).is_some_and(|raft| {
                    let metrics = raft.metrics();
                    let metrics = metrics.borrow();
                    let last_seen = seen.entry(*shard).or_insert(now);
                    if metrics.current_leader.is_some() {
                        *last_seen = now;
                    }
                    now.duration_since(*last_seen) < LEADERLESS_GRACE
                        && metrics
                            .membership_config
                            .membership()
                            .get_joint_config()
                            .iter()
                            .any(|voters| {
                                let staying =
                                    voters.iter().filter(|id| remaining.contains(id)).count();
                                voters.contains(&self.node_id) && staying * 2 <= voters.len()
                            })
                })
            })
            .collect()
    }

    /// The voters a joint membership is changing to, when `membership` is one.
    fn unfinished_change(
        membership: &openraft::Membership<NodeId, NodeInfo>,
    ) -> Option<BTreeSet<NodeId>> {
        let configs = membership.get_joint_config();
        (configs.len() > 1).then(|| configs.last().cloned().unwrap_or_default())
    }

    /// The learners of a shard this node leads that are not among the `wanted` replicas and
    /// may go: those on nodes that are no longer `members` of the cluster, and those that hold
    /// the shard's membership (which made them learners, so they no longer serve the shard).
    fn stale_learners(
        metrics: &openraft::RaftMetrics<NodeId, NodeInfo>,
        wanted: &BTreeSet<NodeId>,
        members: &BTreeSet<NodeId>,
    ) -> BTreeSet<NodeId> {
        let since = metrics.membership_config.log_id();
        let holds = |node: &NodeId| {
            metrics
                .replication
                .as_ref()
                .and_then(|replication| replication.get(node))
                .is_some_and(|matched| matched >= since)
        };
        metrics
            .membership_config
            .membership()
            .learner_ids()
            .filter(|node| !wanted.contains(node) && (!members.contains(node) || holds(node)))
            .collect()
    }

    /// Removes the learners `learners` from `shard`, which this node leads: it no longer
    /// replicates to them; whether it did.
    async fn remove_learners(
        &self,
        shard: ShardId,
        raft: &ShardRaft,
        learners: BTreeSet<NodeId>,
    ) -> bool {
        let removing = ChangeMembers::RemoveNodes(learners);
        Self::change_membership(shard, raft, removing, false).await
    }

    /// Makes `voters` the voters of `shard`, which this node leads (openraft goes through the
    /// joint membership and on to the new one), the voters left out kept as learners when
    /// `retain`; whether it did.
    async fn change_voters(
        &self,
        shard: ShardId,
        raft: &ShardRaft,
        voters: BTreeSet<NodeId>,
        retain: bool,
    ) -> bool {
        let replacing = ChangeMembers::ReplaceAllVoters(voters);
        Self::change_membership(shard, raft, replacing, retain).await
    }

    /// Makes `change` to the membership of `shard`, which this node leads, within
    /// [`CATCH_UP_MAX`]; whether it did (a failure is logged and the next round tries again).
    async fn change_membership(
        shard: ShardId,
        raft: &ShardRaft,
        change: ChangeMembers<NodeId, NodeInfo>,
        retain: bool,
    ) -> bool {
        let described = format!("{change:?}");
        match tokio::time::timeout(CATCH_UP_MAX, raft.change_membership(change, retain)).await {
            Ok(Ok(_)) => {
                tracing::info!(shard, change = described, "placed the shard's replicas");
                true
            }
            Ok(Err(error)) => {
                tracing::debug!(%error, shard, change = described, "placing the shard's replicas");
                false
            }
            Err(_) => {
                tracing::debug!(
                    shard,
                    change = described,
                    "placing the shard's replicas timed out"
                );
                false
            }
        }
    }
}

/// A postcard request body.
fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Status> {
    postcard::from_bytes(body).map_err(|error| unreadable(&error))
}

/// A postcard request body carrying messages, decoded as slices of `body`
/// ([`crate::shard::from_postcard_shared`]).
fn decode_shared<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, Status> {
    crate::shard::from_postcard_shared(body).map_err(|error| unreadable(&error))
}

/// A shard request that does not decode.
fn unreadable(error: &postcard::Error) -> Status {
    Status::invalid_argument(format!(
        "a shard request this node cannot read ({error}); do the cluster's nodes run one \
         version?"
    ))
}

/// One shard command for a batch of positions writes: `Positions` for one write, else
/// `PositionsOf` with each consumer once (its writes' positions in order). Takes the
/// positions out of `batch`.
fn positions_command(batch: &mut [PositionsWrite]) -> ShardCommand {
    if let [only] = batch {
        return ShardCommand::Positions {
            consumer: only.consumer.clone(),
            positions: std::mem::take(&mut only.positions),
        };
    }
    let mut consumers: Vec<(String, Vec<ConsumerPosition>)> = Vec::new();
    let mut places: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for write in batch {
        let place = *places.entry(write.consumer.clone()).or_insert_with(|| {
            consumers.push((write.consumer.clone(), Vec::new()));
            consumers.len() - 1
        });
        consumers[place].1.append(&mut write.positions);
    }
    ShardCommand::PositionsOf { consumers }
}

/// A JSON answer body.
fn json<T: Serialize>(answer: &T) -> Result<Vec<u8>, Status> {
    serde_json::to_vec(answer)
        .map_err(|error| Status::internal(format!("cannot encode a shard answer: {error}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_of(consumer: &str, queue: &str, next: u64) -> PositionsWrite {
        PositionsWrite {
            consumer: consumer.to_owned(),
            positions: vec![ConsumerPosition {
                queue: levee_proto::Bytes::copy_from_slice(queue.as_bytes()),
                epoch: 0,
                next,
            }],
            done: tokio::sync::oneshot::channel().0,
        }
    }

    #[test]
    fn given_waiting_positions_writes_then_one_command_holds_each_consumer_once_in_order() {
        let at = |queue: &str, next| ConsumerPosition {
            queue: levee_proto::Bytes::copy_from_slice(queue.as_bytes()),
            epoch: 0,
            next,
        };
        let mut one = [write_of("app", "q1", 4)];
        assert_eq!(
            positions_command(&mut one),
            ShardCommand::Positions {
                consumer: "app".to_owned(),
                positions: vec![at("q1", 4)],
            }
        );
        let mut several = [
            write_of("app", "q1", 4),
            write_of("audit", "q2", 1),
            write_of("app", "q1", 6),
        ];
        assert_eq!(
            positions_command(&mut several),
            ShardCommand::PositionsOf {
                consumers: vec![
                    ("app".to_owned(), vec![at("q1", 4), at("q1", 6)]),
                    ("audit".to_owned(), vec![at("q2", 1)]),
                ],
            }
        );
    }

    fn node() -> NodeInfo {
        NodeInfo::default()
    }

    #[test]
    fn given_a_joint_membership_when_asked_then_the_change_left_to_finish_is_the_new_set() {
        let nodes: BTreeMap<NodeId, NodeInfo> = (1..=3).map(|id| (id, node())).collect();
        let joint = openraft::Membership::new(
            vec![BTreeSet::from([1]), BTreeSet::from([1, 2, 3])],
            nodes.clone(),
        );
        assert_eq!(
            ShardGroups::unfinished_change(&joint),
            Some(BTreeSet::from([1, 2, 3]))
        );
        let uniform = openraft::Membership::new(vec![BTreeSet::from([1, 2, 3])], nodes);
        assert_eq!(ShardGroups::unfinished_change(&uniform), None);
    }
}
