//! [`ShardStateMachine`]: a shard's queues, applied from its log to the node's queue store.
//!
//! The Raft log already holds the messages durably; the store's copy is what readers and
//! subscriptions are served from. The store a node's shards open over runs under `interval`
//! ([`crate::shard::groups::ShardGroups::open`] switches one opened under `always`): a batch
//! is applied once buffered there (readable at once), and the store fsyncs on its interval.
//! Over a store under `always` (tests that open one directly) a batch is applied once the
//! store has fsynced it, since reads there see fsynced messages only and an answered append
//! must be readable. What makes a restart exact is
//! the **apply record**, kept in the shard's log partition and durable before the store
//! holds on disk any message of the batch it names: the batch's log range, the
//! membership after it, and where each of its queues stood before it (the queue's next
//! offset) and how many messages it adds. Under `interval`, while the batches applied before
//! are not yet durable in the store, the record names them too, as one range from the first
//! one's first entry with each queue's offset before the first of them (at most
//! [`UNSYNCED_BATCHES_MAX`] batches and [`UNSYNCED_QUEUES_MAX`] queues; past that, and before
//! a delete, a delivery, a snapshot's mark or an install, the apply waits for the store, and
//! so does one whose positions alone are not durable yet). So at a restart every batch before
//! the recorded range is whole in the store, and the range is partly there: for each of its
//! queues, the messages past the recorded start are counted (a queue's messages are recovered
//! as a prefix), and only those missing are appended again, from the log, the range planned
//! again as one batch. No message is stored twice, none is lost,
//! and every replica holds the same offsets.
//!
//! How the record is made durable first: under `interval`, over a store that runs the shard
//! logs' write barrier before each of its writes ([`ShardStateMachine::with_records_fenced`],
//! as a node's shards open), the record is written and only noted with the group commit, and
//! the batch goes to the store at once: the store's next round fsyncs the log (when no round
//! of the group commit did meanwhile) before it writes the messages. Otherwise (`always`, or a
//! store without the barrier) the record is fsynced before the batch touches the store.
//!
//! A batch is applied on the state machine's own task: the record's fsync (and, when the
//! record cannot name the batches before, the store's) is awaited without holding a thread,
//! so an apply costs no hand-off to a blocking thread and back. Deletes and deliveries, which
//! wait for the store step by step, heavy batches and batches while the store holds appends
//! back run on a blocking thread.
//!
//! **Snapshots** (docs/CLUSTER.md, "Snapshots") are lazy. Building one (openraft asks every
//! `snapshot_entries` applied entries) makes the store durable up to the last applied entry
//! and records that point (the *built mark*): the log up to it may then be purged, since the
//! store holds everything it says. The bytes are written only when a replica needs them (a
//! follower behind the purged log, a new replica): [`snapshot::write_shard`] streams the
//! shard's queues and its consumers' positions at the last applied entry into a file, while
//! applies wait, and that file is sent. An install replaces the shard's queues with the
//! file's, crash-safely: the file is kept under its final name and recorded as being installed
//! before the first queue is touched, so a restart installs it again from the start.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use levee_proto::Bytes;
use levee_store::{CommitTicket, Store, SyncPolicy};
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    Entry, EntryPayload, LogId, OptionalSend, RaftSnapshotBuilder, SnapshotMeta, StorageIOError,
    StoredMembership,
};
use serde::{Deserialize, Serialize};

use crate::log_store::LogStore;
use levee_broker::delay::DelayWheel;

use crate::shard::plan::{Plan, ShardProducers, deletes_queue, next_offset, shard_wheel};
use crate::shard::snapshot::{self, ShardTail, SnapshotFile, StreamOf};
use crate::shard::{
    ConsumerPosition, RefusedCode, ShardCommand, ShardConfig, ShardId, ShardResponse,
};
use crate::{NodeId, NodeInfo, StorageError};

/// The apply record's key in the shard's log meta partition.
const APPLYING_KEY: &str = "applying";
/// The built mark's key (a `SnapshotMeta`): the store holds everything up to it.
const BUILT_KEY: &str = "snapshot-built";
/// The key of the snapshot file on disk (a [`SnapshotRecord`]).
const DATA_KEY: &str = "snapshot-data";
/// The key of a snapshot being installed (a [`SnapshotRecord`]), until it is whole.
const INSTALLING_KEY: &str = "snapshot-installing";

/// A snapshot file: what openraft knows it by, and its name in the shard's snapshot folder.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SnapshotRecord {
    meta: SnapshotMeta<NodeId, NodeInfo>,
    file: String,
}

/// Told of every message a shard stores, once it is readable (on every replica), and keeper of
/// the consumers' positions the shard's log carries.
pub trait ShardObserver: Send + Sync {
    /// `appended` holds each stored message's queue (plain queues and topic partitions; not
    /// the shard's own records), offset and payload.
    fn appended(&self, shard: ShardId, appended: &[(&[u8], u64, &[u8])]);

    /// Records `consumer`'s `positions` in the node's store (the largest position of a queue
    /// wins); what makes them durable. Called on the applying thread.
    ///
    /// # Errors
    /// A store failure, in words: the shard's instance stops.
    fn positions(
        &self,
        _shard: ShardId,
        _consumer: &str,
        _positions: &[ConsumerPosition],
    ) -> Result<Option<levee_store::CommitTicket>, String> {
        Ok(None)
    }

    /// `queue` is about to be deleted (applying a `ShardCommand::Delete`, or finishing one a
    /// crash cut short): makes every consumer forget its position on it in delete `epoch`
    /// (the shard's delete epoch after this delete), durably, before it returns. Called on the
    /// applying thread; may be called twice for one delete.
    ///
    /// # Errors
    /// A store failure, in words: the shard's instance stops.
    fn deleting(&self, _shard: ShardId, _queue: &[u8], _epoch: u64) -> Result<(), String> {
        Ok(())
    }

    /// `queue` was deleted: wakes whoever waits on it.
    fn deleted(&self, _shard: ShardId, _queue: &[u8]) {}

    /// A `ShardCommand::Deliver` applied at `now_ms` delivered entries due at `due_ms` (each
    /// one's due time) to their targets (told after [`ShardObserver::appended`]).
    fn delivered(&self, _shard: ShardId, _now_ms: u64, _due_ms: &[u64]) {}

    /// Every consumer's positions on the queues `of_shard` says are the shard's, as
    /// [`ShardObserver::positions`] recorded them (for a snapshot of the shard). Called on
    /// the applying thread, no apply under way.
    ///
    /// # Errors
    /// A store failure, in words: the snapshot is not written.
    fn shard_positions(
        &self,
        _shard: ShardId,
        _of_shard: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Vec<(String, Vec<ConsumerPosition>)>, String> {
        Ok(Vec::new())
    }

    /// A snapshot replaced the shard's queues: wakes whoever waits on them.
    fn installed(&self, _shard: ShardId) {}

    /// A snapshot file of the shard was written, to send to a replica.
    fn snapshot_written(&self, _shard: ShardId) {}

    /// This node's positions writer committed one entry of `shard` holding `writes` positions
    /// writes (acks of its streams merged: `ShardGroups::write_positions`).
    fn positions_written(&self, _shard: ShardId, _writes: usize) {}

    /// This node's appender committed one entry of `shard` holding `requests` append requests
    /// (`ShardGroups::append`).
    fn appends_written(&self, _shard: ShardId, _requests: usize) {}

    /// This node found the process of `shard`'s leader gone (its peer port refused a
    /// connection after the leader was silent for three heartbeats) and called an election
    /// at once (`shard::watch`).
    fn leader_gone(&self, _shard: ShardId) {}

    /// This node opened a stream of shard calls to a peer (`shard::link`): one per peer while
    /// the peers stay up, more when a stream failed and was opened again.
    fn peer_stream_opened(&self) {}

    /// Shard `shard` applied a run of `entries` entries: `waited` of it for the store to make
    /// earlier batches durable or for a blocking thread (deletes, deliveries), `took` from
    /// openraft's call until done.
    fn applied(
        &self,
        _shard: ShardId,
        _entries: usize,
        (_waited, _took): (std::time::Duration, std::time::Duration),
    ) {
    }

    /// An append to shard `shard`'s log took `took` from the call until fsynced.
    fn log_flushed(&self, _shard: ShardId, _took: std::time::Duration) {}

    /// A write this node proposed as shard `shard`'s leader (its own, or one another node
    /// forwarded to it) took `took` from the proposal until a majority held it and this node
    /// applied it (the log appends, the followers' answers over the peer port and the apply).
    fn committed(&self, _shard: ShardId, _took: std::time::Duration) {}
}

/// One queue's part of a batch: where it stood before, and how many messages the batch adds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct QueueStart {
    queue: Bytes,
    start: u64,
    count: u64,
}

/// The apply record (see the module's text).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Applying {
    /// The batch's first index.
    from: u64,
    /// The batch's last log id: applied once the batch is in the store.
    last: LogId<NodeId>,
    /// The membership after the batch.
    membership: StoredMembership<NodeId, NodeInfo>,
    /// The batch's queues.
    queues: Vec<QueueStart>,
    /// The queue the batch deletes, when it is one `ShardCommand::Delete` (its `queues` then
    /// hold the shard's delete counter only).
    #[serde(default)]
    deleted: Option<Vec<u8>>,
    /// The shard's delay wheel's marks after the batch (`DelayWheel::taken_below`): every
    /// replica places delayed entries alike only with the same marks, so they are recorded
    /// with every batch.
    #[serde(default)]
    delay_marks: (u64, u64),
    /// The delay slot a delivery cut short after the batch, if one was: its queue and the
    /// first offset not delivered (kept with every batch, like the marks).
    #[serde(default)]
    delay_partial: Option<(Vec<u8>, u64)>,
    /// When the batch is one `ShardCommand::Deliver`: what it did.
    #[serde(default)]
    delivered: Option<Delivered>,
}

/// What a `ShardCommand::Deliver` did, as its apply record keeps it: planned again from the
/// marks before it and its time when a crash cut its appends short, its slots deleted (again)
/// once they are whole.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Delivered {
    now_ms: u64,
    marks_before: (u64, u64),
    #[serde(default)]
    partial_before: Option<(Vec<u8>, u64)>,
    slots: Vec<Vec<u8>>,
}

#[derive(Debug, Default)]
struct Applied {
    last: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, NodeInfo>,
    /// The store round that makes the last batch durable (under `interval`).
    ticket: Option<CommitTicket>,
    /// The store round that makes the positions applied since then durable (under
    /// `interval`): waited for too before the next apply record replaces the last one, since
    /// a recovery hands over again only the recorded batch's positions.
    positions_ticket: Option<CommitTicket>,
    producers: ShardProducers,
    /// The shard's delay slots (docs/CLUSTER.md, "Retries and delayed messages through the
    /// shards").
    wheel: DelayWheel,
    /// The slot a delivery cut short, and where the next one goes on.
    partial: Option<(Bytes, u64)>,
    /// The batches applied since the store was last known to hold them durably (under
    /// `interval`), which the next apply record names too.
    unsynced: Option<Unsynced>,
}

impl Applied {
    /// Forgets the batches not yet durable in the store and returns the store rounds that
    /// make them and their positions durable: to wait for before the next apply record
    /// replaces the last one on its own.
    fn take_pending(&mut self) -> impl Iterator<Item = CommitTicket> + use<> {
        self.unsynced = None;
        [self.ticket.take(), self.positions_ticket.take()]
            .into_iter()
            .flatten()
    }
}

/// Most batches one apply record names (see [`ShardStateMachine::apply_batch`]): at more,
/// the apply waits for the store.
const UNSYNCED_BATCHES_MAX: usize = 32;
/// Most queues one apply record names when it names several batches.
const UNSYNCED_QUEUES_MAX: usize = 4_096;

/// Most messages and consumers' positions a run of entries may carry to be applied on the
/// state machine's task (a few milliseconds of work at most); a heavier one is applied on a
/// blocking thread (`ShardStateMachine::apply_entries`). Measured with the topic shape at 64
/// publishers (runs of up to some 16,000 messages): with no bound, followers missed their
/// leaders' 50 ms deadlines and publishes timed out; with 2,048 and 4,096 they did not, and
/// 4,096 kept most of the gain with 3 shards (runs of thousands of messages), which 2,048 lost.
const APPLY_INLINE_WEIGHT_MAX: usize = 4_096;

/// What an entry weighs when its run is applied (`ShardStateMachine::apply_entries`): the
/// messages and consumers' positions it carries.
fn apply_weight(entry: &Entry<ShardConfig>) -> usize {
    match &entry.payload {
        EntryPayload::Normal(ShardCommand::Append { messages, .. }) => messages.len(),
        EntryPayload::Normal(ShardCommand::Appends { requests }) => {
            requests.iter().map(|request| request.messages.len()).sum()
        }
        EntryPayload::Normal(ShardCommand::Delay { entries, .. }) => entries.len(),
        EntryPayload::Normal(ShardCommand::Positions { positions, .. }) => positions.len(),
        EntryPayload::Normal(ShardCommand::PositionsOf { consumers }) => {
            consumers.iter().map(|(_, positions)| positions.len()).sum()
        }
        _ => 1,
    }
}

/// A run of entries planned by [`ShardStateMachine::plan_batch`].
struct PlannedBatch<'a> {
    responses: Vec<ShardResponse>,
    /// The membership after the run.
    membership: StoredMembership<NodeId, NodeInfo>,
    positions: PlannedPositions<'a>,
    /// `None` when the run carries consumers' positions only.
    stored: Option<ToStore>,
}

/// What a planned run stores, and how.
struct ToStore {
    /// The messages, with the offset each must get.
    batch: Vec<(Bytes, Bytes, u64)>,
    /// The batches the apply record names, this one included.
    unsynced: Unsynced,
    /// The store rounds to wait for before the record replaces the last one.
    before: Vec<CommitTicket>,
    record: Applying,
}

/// Consecutive batches applied under `interval` that the store may not hold durably yet.
#[derive(Debug)]
struct Unsynced {
    /// The first entry of the first of them.
    from: u64,
    /// Each queue they touch: its offset before the first of them, and its next offset after
    /// the last.
    queues: HashMap<Bytes, (u64, u64)>,
    /// How many.
    batches: usize,
}

/// A shard's state machine over the node's queue store. Clones share it.
#[derive(Clone)]
pub struct ShardStateMachine {
    shard: ShardId,
    /// The cluster's shards.
    shards: u32,
    /// The shard's snapshot files.
    snapshots: Arc<SnapshotFolder>,
    store: Arc<Store>,
    log: LogStore<ShardConfig>,
    applied: Arc<Mutex<Applied>>,
    /// Held through an apply, a snapshot's mark, a capture to write and an install: an apply
    /// lets go of `applied`'s lock while it waits for fsyncs, its batch planned but not yet
    /// stored, and none of those may see the shard so.
    gate: Arc<tokio::sync::Mutex<()>>,
    observer: Option<Arc<dyn ShardObserver>>,
    /// The delay wheel's next due time (`u64::MAX`: none) and count, as the last apply left
    /// them.
    delays: Arc<DelaySummary>,
    /// The store fsyncs the log's noted writes before each of its writes
    /// ([`ShardStateMachine::with_records_fenced`]): under `interval`, an apply record is
    /// written without waiting for its fsync.
    records_fenced: bool,
}

/// A shard's snapshot folder.
#[derive(Debug)]
struct SnapshotFolder {
    path: PathBuf,
    /// Until openraft's first `get_current_snapshot`, made while the instance starts and
    /// reading only the snapshot's meta: answered from the built mark, writing no file.
    starting: AtomicBool,
    /// Snapshots this replica installed since it started.
    installed: AtomicU64,
    /// Snapshot files this replica wrote since it started (to send them).
    written: AtomicU64,
    /// The file being written, if one is.
    writing: Mutex<Option<Arc<WritingSnapshot>>>,
    /// Held by a writer while it writes, and by an install (which stops the writer first).
    streaming: Mutex<()>,
    /// Installs begun since the start: a writer whose capture came before the latest one
    /// stops.
    installs: AtomicU64,
}

/// A snapshot captured to be written off the state machine's worker: its writer waits until
/// the file is first read (a replica answered and is being sent it), so a replica that is
/// down costs no file however often openraft asks for one.
#[derive(Debug)]
struct WritingSnapshot {
    meta: SnapshotMeta<NodeId, NodeInfo>,
    /// Its path once whole, or why the write failed.
    written: tokio::sync::watch::Receiver<snapshot::Written>,
    /// Taken by the first read: the writer goes on. Dropped unused (this capture replaced
    /// and no handle of it left), the writer gives up.
    go: Mutex<Option<std::sync::mpsc::SyncSender<()>>>,
}

impl WritingSnapshot {
    /// Lets the writer write the file (once; later calls do nothing).
    fn start(&self) {
        if let Some(go) = locked(&self.go).take() {
            // A writer that stopped already has said why through `written`.
            let _ = go.send(());
        }
    }
}

/// See [`ShardStateMachine::publish_delays`].
#[derive(Debug, Default)]
struct DelaySummary {
    next_due_ms: AtomicU64,
    pending: AtomicU64,
}

impl std::fmt::Debug for ShardStateMachine {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "ShardStateMachine({})", self.shard)
    }
}

fn io_error(error: &(impl std::error::Error + 'static)) -> StorageError {
    StorageIOError::write_state_machine(error).into()
}

/// Consumers' positions of a run of entries, in log order.
type PlannedPositions<'a> = Vec<(&'a str, &'a [ConsumerPosition])>;

/// Plans `entries` (see [`Plan`]): each one's answer, the membership after them, and the
/// consumers' positions they carry.
fn plan_entries<'a>(
    plan: &mut Plan<'_>,
    (producers, wheel): (&mut ShardProducers, &mut DelayWheel),
    entries: &'a [Entry<ShardConfig>],
    mut membership: StoredMembership<NodeId, NodeInfo>,
) -> (
    Vec<ShardResponse>,
    StoredMembership<NodeId, NodeInfo>,
    PlannedPositions<'a>,
) {
    let mut positions = Vec::new();
    let responses = entries
        .iter()
        .map(|entry| match &entry.payload {
            // A delete or a delivery is applied on its own (`ShardStateMachine::apply_delete`,
            // `ShardStateMachine::apply_deliver`): planned, it appends nothing.
            EntryPayload::Blank
            | EntryPayload::Normal(
                ShardCommand::Barrier | ShardCommand::Delete { .. } | ShardCommand::Deliver { .. },
            ) => ShardResponse::Done,
            EntryPayload::Membership(changed) => {
                membership = StoredMembership::new(Some(entry.log_id), changed.clone());
                ShardResponse::Done
            }
            EntryPayload::Normal(ShardCommand::Append { producer, messages }) => {
                plan.append(producers, producer.as_deref(), messages)
            }
            EntryPayload::Normal(ShardCommand::Appends { requests }) => ShardResponse::Each {
                responses: requests
                    .iter()
                    .map(|request| {
                        plan.append(producers, request.producer.as_deref(), &request.messages)
                    })
                    .collect(),
            },
            EntryPayload::Normal(ShardCommand::Delay { now_ms, entries }) => {
                plan.delay(wheel, *now_ms, entries)
            }
            EntryPayload::Normal(ShardCommand::Positions {
                consumer,
                positions: entry_positions,
            }) => {
                positions.push((consumer.as_str(), entry_positions.as_slice()));
                ShardResponse::Done
            }
            EntryPayload::Normal(ShardCommand::PositionsOf { consumers }) => {
                positions.extend(
                    consumers
                        .iter()
                        .map(|(consumer, of)| (consumer.as_str(), of.as_slice())),
                );
                ShardResponse::Done
            }
        })
        .collect();
    (responses, membership, positions)
}

/// Why a delete of `queue` is refused, if it is (the same on every replica).
fn delete_refusal(queue: &[u8]) -> Option<String> {
    if queue.is_empty() || queue.len() > 255 {
        return Some(levee_store::InputError::QueueName(queue.len()).to_string());
    }
    levee_broker::names::is_reserved(queue).then(|| {
        "queue names starting with a zero byte are the server's own; choose another name".to_owned()
    })
}

/// A cut-short slot as the apply record keeps it.
fn partial_record(partial: Option<&(Bytes, u64)>) -> Option<(Vec<u8>, u64)> {
    partial.map(|(queue, offset)| (queue.to_vec(), *offset))
}

/// Where each of `queues` (a plan's, or a range of batches': offset before, next offset
/// after) stood before, and how many messages it adds.
fn queue_starts(queues: &HashMap<Bytes, (u64, u64)>) -> Vec<QueueStart> {
    queues
        .iter()
        .map(|(queue, (start, next))| QueueStart {
            queue: queue.clone(),
            start: *start,
            count: next - start,
        })
        .collect()
}

/// The planned messages as the store takes them.
fn store_batch(batch: &[(Bytes, Bytes, u64)]) -> Vec<(&[u8], &[u8])> {
    batch
        .iter()
        .map(|(queue, payload, _)| (&queue[..], &payload[..]))
        .collect()
}

impl ShardStateMachine {
    /// Shard `shard`'s (of `shards`) state machine over `store`, its apply record in `log`,
    /// its snapshot files in the folder `snapshots` (made if missing), telling `observer` of
    /// what it applies. Finishes the install or the batch a crash interrupted, if any (see the
    /// module's text).
    pub fn open(
        (shard, shards): (ShardId, u32),
        (store, log, snapshots): (Arc<Store>, LogStore<ShardConfig>, &Path),
        observer: Option<Arc<dyn ShardObserver>>,
    ) -> Result<Self, StorageError> {
        std::fs::create_dir_all(snapshots).map_err(|error| io_error(&error))?;
        // Snapshots a stop cut short while they were received (sent again) or written.
        for entry in std::fs::read_dir(snapshots)
            .map_err(|error| io_error(&error))?
            .flatten()
        {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with("receiving-")
            {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        let machine = Self {
            shard,
            shards,
            snapshots: Arc::new(SnapshotFolder {
                path: snapshots.to_owned(),
                starting: AtomicBool::new(true),
                installed: AtomicU64::new(0),
                written: AtomicU64::new(0),
                writing: Mutex::new(None),
                streaming: Mutex::new(()),
                installs: AtomicU64::new(0),
            }),
            store,
            log,
            applied: Arc::new(Mutex::new(Applied::default())),
            gate: Arc::default(),
            delays: Arc::default(),
            observer,
            records_fenced: false,
        };
        if let Some(record) = machine.log.read_meta::<SnapshotRecord>(INSTALLING_KEY)? {
            tracing::info!(shard, snapshot = %record.meta.snapshot_id, "installing again the snapshot a stop cut short");
            machine.finish_install(&mut machine.lock(), &record)?;
        }
        let applying = machine.log.read_meta::<Applying>(APPLYING_KEY)?;
        if let Some(applying) = &applying {
            machine.recover(applying)?;
        }
        let marks = applying
            .as_ref()
            .map_or((0, 0), |applying| applying.delay_marks);
        let wheel = shard_wheel(&machine.store, shard, marks);
        let partial = applying
            .as_ref()
            .and_then(|applying| applying.delay_partial.clone())
            .map(|(queue, offset)| (Bytes::from(queue), offset));
        // The membership in force at the last applied entry, as the log itself records it
        // (openraft takes it from here and reads only the memberships after that entry).
        let mut applied = machine.lock();
        machine.publish_delays(&wheel);
        applied.wheel = wheel;
        applied.partial = partial;
        if let Some(last) = applied.last
            && let Some(logged) = machine.log.membership_at(last.index)?
            && logged.log_id() > applied.membership.log_id()
        {
            applied.membership = logged;
        }
        drop(applied);
        Ok(machine)
    }

    /// This state machine, told that its store runs the write barrier of its log's group
    /// commit before each write (`Store::set_write_barrier` with
    /// [`crate::syncer::JournalSyncer::write_barrier`], as [`crate::shard::ShardGroups::open`]
    /// sets it): under `interval` an apply record is then only noted with the group commit,
    /// not waited for, since the store writes none of the messages it names before it is
    /// durable (see the module's text). Without a group commit it changes nothing.
    #[must_use]
    pub fn with_records_fenced(mut self) -> Self {
        self.records_fenced = self.log.has_syncer();
        self
    }

    /// The last applied log id.
    pub fn last_applied(&self) -> Option<LogId<NodeId>> {
        self.lock().last
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Applied> {
        locked(&self.applied)
    }

    /// When the shard's next delay slot is due (ms since the Unix epoch), if one holds
    /// messages: its leader proposes a `ShardCommand::Deliver` from then on.
    /// Never waits on an apply under way (read from what the last one published).
    pub fn next_due_ms(&self) -> Option<u64> {
        let due = self.delays.next_due_ms.load(Ordering::Acquire);
        (due != u64::MAX).then_some(due)
    }

    /// Messages waiting in the shard's delay slots (as of the last apply; never waits).
    pub fn delayed_waiting(&self) -> u64 {
        self.delays.pending.load(Ordering::Acquire)
    }

    /// Publishes `wheel`'s next due time and count for [`ShardStateMachine::next_due_ms`] and
    /// [`ShardStateMachine::delayed_waiting`], read without the apply lock (an apply holds it
    /// across fsyncs).
    fn publish_delays(&self, wheel: &DelayWheel) {
        self.delays
            .next_due_ms
            .store(wheel.next_due_ms().unwrap_or(u64::MAX), Ordering::Release);
        self.delays
            .pending
            .store(wheel.pending(), Ordering::Release);
    }

    /// Plans the recorded batch again from the state before it (the record's starts) and
    /// appends what of it the store does not hold.
    fn recover(&self, applying: &Applying) -> Result<(), StorageError> {
        let starts: HashMap<&[u8], (u64, u64)> = applying
            .queues
            .iter()
            .map(|queue| (&queue.queue[..], (queue.start, queue.count)))
            .collect();
        let start_of = |queue: &[u8]| {
            starts
                .get(queue)
                .map_or_else(|| next_offset(&self.store, queue), |(start, _)| *start)
        };
        let producer_limit = |queue: &[u8]| starts.get(queue).map(|(start, _)| *start);
        let entries = self.log.entries(&(applying.from..=applying.last.index))?;
        let mut producers = ShardProducers::default();
        let mut plan = Plan::new((&self.store, self.shard), &start_of, &producer_limit);
        let mut positions = Vec::new();
        if let Some(delivered) = &applying.delivered {
            // Planned again only when its appends were cut short: its slots are all still
            // there then (they go once the appends are durable).
            let whole = applying
                .queues
                .iter()
                .all(|queue| next_offset(&self.store, &queue.queue) >= queue.start + queue.count);
            if !whole {
                let mut wheel = shard_wheel(&self.store, self.shard, delivered.marks_before);
                let mut partial = delivered
                    .partial_before
                    .clone()
                    .map(|(queue, offset)| (Bytes::from(queue), offset));
                plan.deliver(&mut wheel, delivered.now_ms, &mut partial);
            }
        } else {
            let mut wheel = DelayWheel::taken(applying.delay_marks.0, applying.delay_marks.1);
            positions = plan_entries(
                &mut plan,
                (&mut producers, &mut wheel),
                &entries,
                StoredMembership::default(),
            )
            .2;
        }
        // The messages of each queue past those the store holds (a queue's messages are
        // recovered as a prefix).
        let missing: Vec<(Bytes, Bytes, u64)> = plan
            .batch
            .iter()
            .filter(|(queue, _, offset)| *offset >= next_offset(&self.store, queue))
            .cloned()
            .collect();
        let (_, ticket) = self
            .store
            .append_batch_deferred(&store_batch(&missing))
            .map_err(|error| io_error(&error))?;
        self.store
            .wait_durable(ticket)
            .map_err(|error| io_error(&error))?;
        // The batch's positions may not have reached the store before the crash.
        if let Some(ticket) = self.record_positions(&positions)? {
            self.store
                .wait_durable(ticket)
                .map_err(|error| io_error(&error))?;
        }
        if let Some(queue) = &applying.deleted {
            let epoch = starts
                .get(&deletes_queue(self.shard)[..])
                .map_or(0, |(start, _)| *start);
            self.finish_delete(queue, epoch)?;
        }
        for slot in applying
            .delivered
            .iter()
            .flat_map(|delivered| &delivered.slots)
        {
            self.store
                .delete_queue(slot)
                .map_err(|error| io_error(&error))?;
        }
        tracing::info!(
            shard = self.shard,
            restored = missing.len(),
            last = applying.last.index,
            "finished the shard's last applied batch"
        );
        let mut applied = self.lock();
        applied.last = Some(applying.last);
        applied.membership = applying.membership.clone();
        applied.producers = producers;
        Ok(())
    }

    /// Hands the consumers' `positions` to the observer; the store round that makes them
    /// durable, if they wrote any.
    fn record_positions(
        &self,
        positions: &PlannedPositions<'_>,
    ) -> Result<Option<CommitTicket>, StorageError> {
        let Some(observer) = &self.observer else {
            return Ok(None);
        };
        let mut last = None;
        for (consumer, positions) in positions {
            let ticket = observer
                .positions(self.shard, consumer, positions)
                .map_err(|error| io_error(&std::io::Error::other(error)))?;
            last = ticket.or(last);
        }
        Ok(last)
    }

    /// Ends once the store holds `ticket`'s appends durably, waiting on a blocking thread
    /// when it does not yet (the store's waits block).
    async fn store_durable(&self, ticket: CommitTicket) -> Result<(), StorageError> {
        if self
            .store
            .is_durable(ticket)
            .map_err(|error| io_error(&error))?
        {
            return Ok(());
        }
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || store.wait_durable(ticket))
            .await
            .map_err(|error| io_error(&error))?
            .map_err(|error| io_error(&error))
    }

    /// Waits until the batches and positions applied so far are durable in the store (under
    /// `interval` they were not waited for), before an apply record replaces the last one.
    fn wait_applied(&self, applied: &mut Applied) -> Result<(), StorageError> {
        for ticket in applied.take_pending() {
            self.store
                .wait_durable(ticket)
                .map_err(|error| io_error(&error))?;
        }
        Ok(())
    }

    /// Applies `entries`: each delete and delivery on its own, on a blocking thread (they
    /// wait for the store), the runs of entries between them as one batch each
    /// ([`ShardStateMachine::apply_batch`]): on the caller's task when the run is light (at
    /// most [`APPLY_INLINE_WEIGHT_MAX`] messages and positions) and the store is not holding
    /// appends back ([`Store::is_late`]), else on a blocking thread too, so that neither a
    /// large batch's planning and store append nor the store's back-pressure hold a runtime
    /// thread (the peer calls of every shard wait on those: a follower busy so misses its
    /// leader's 50 ms deadline; without the store check, publishes timed out under load).
    /// Returns the answers and how long the applies waited for blocking threads and for the
    /// store.
    async fn apply_entries(
        &self,
        mut entries: Vec<Entry<ShardConfig>>,
    ) -> Result<(Vec<ShardResponse>, std::time::Duration), StorageError> {
        let alone = |entry: &Entry<ShardConfig>| {
            matches!(
                entry.payload,
                EntryPayload::Normal(ShardCommand::Delete { .. } | ShardCommand::Deliver { .. })
            )
        };
        let mut responses = Vec::with_capacity(entries.len());
        let mut waited = std::time::Duration::ZERO;
        while !entries.is_empty() {
            let run = entries
                .iter()
                .position(alone)
                .unwrap_or(entries.len())
                .max(1);
            let mut rest = entries.split_off(run);
            std::mem::swap(&mut entries, &mut rest);
            // `rest` now holds the run (or the entry applied alone), `entries` what follows.
            let light = rest.iter().map(apply_weight).sum::<usize>() <= APPLY_INLINE_WEIGHT_MAX
                && !self.store.is_late();
            let (applied, run_waited) = if !alone(&rest[0]) && light {
                self.apply_batch(&rest).await?
            } else {
                let queued = std::time::Instant::now();
                let runtime = tokio::runtime::Handle::current();
                let (applied, run_waited, started) = self
                    .blocking(move |machine| {
                        let started = std::time::Instant::now();
                        let (applied, run_waited) = if alone(&rest[0]) {
                            let entry = &rest[0];
                            let response =
                                if let EntryPayload::Normal(ShardCommand::Deliver { now_ms }) =
                                    entry.payload
                                {
                                    machine.apply_deliver(entry.log_id, now_ms)?
                                } else {
                                    machine.apply_delete(entry)?
                                };
                            (vec![response], std::time::Duration::ZERO)
                        } else {
                            runtime.block_on(machine.apply_batch(&rest))?
                        };
                        Ok((applied, run_waited, started))
                    })
                    .await?;
                (applied, run_waited + started.duration_since(queued))
            };
            waited += run_waited;
            responses.extend(applied);
        }
        Ok((responses, waited))
    }

    /// Applies one `ShardCommand::Delete` entry: the previous batch made durable, an apply
    /// record naming the delete and the shard's delete counter's place, then
    /// [`ShardStateMachine::finish_delete`].
    fn apply_delete(&self, entry: &Entry<ShardConfig>) -> Result<ShardResponse, StorageError> {
        let EntryPayload::Normal(ShardCommand::Delete { queue }) = &entry.payload else {
            unreachable!("called with deletes only");
        };
        let mut guard = self.lock();
        let applied = &mut *guard;
        let response = if let Some(reason) = delete_refusal(queue) {
            ShardResponse::Refused {
                code: RefusedCode::Invalid,
                reason,
            }
        } else {
            self.wait_applied(applied)?;
            let counter = deletes_queue(self.shard);
            let epoch = next_offset(&self.store, &counter);
            let existed = self
                .store
                .queue_info(queue)
                .map_err(|error| io_error(&error))?
                .is_some();
            self.log.write_meta_binary_grouped(
                APPLYING_KEY,
                &Applying {
                    from: entry.log_id.index,
                    last: entry.log_id,
                    membership: applied.membership.clone(),
                    queues: vec![QueueStart {
                        queue: counter.clone(),
                        start: epoch,
                        count: 1,
                    }],
                    deleted: Some(queue.to_vec()),
                    delay_marks: applied.wheel.taken_below(),
                    delay_partial: partial_record(applied.partial.as_ref()),
                    delivered: None,
                },
            )?;
            self.finish_delete(queue, epoch)?;
            ShardResponse::Deleted { existed }
        };
        applied.last = Some(entry.log_id);
        drop(guard);
        if matches!(response, ShardResponse::Deleted { .. })
            && let Some(observer) = &self.observer
        {
            observer.deleted(self.shard, queue);
        }
        Ok(response)
    }

    /// Does a recorded delete of `queue`, the shard's delete counter at `epoch` before it, or
    /// what of it a crash left undone: counts it (once), has the consumers forget their
    /// positions on the queue in the new epoch, then deletes the queue (each step durable
    /// before the next; doing them again changes nothing).
    fn finish_delete(&self, queue: &[u8], epoch: u64) -> Result<(), StorageError> {
        let counter = deletes_queue(self.shard);
        if next_offset(&self.store, &counter) == epoch {
            let (_, ticket) = self
                .store
                .append_deferred(&counter, &[])
                .map_err(|error| io_error(&error))?;
            self.store
                .wait_durable(ticket)
                .map_err(|error| io_error(&error))?;
        }
        if let Some(observer) = &self.observer {
            observer
                .deleting(self.shard, queue, epoch + 1)
                .map_err(|error| io_error(&std::io::Error::other(error)))?;
        }
        self.store
            .delete_queue(queue)
            .map_err(|error| io_error(&error))?;
        Ok(())
    }

    /// Plans a run of entries without deletes or deliveries (see
    /// [`ShardStateMachine::apply_batch`]), under the lock on the applied state: each one's
    /// answer, the membership and positions after them and, unless they carry positions only,
    /// what to store.
    fn plan_batch<'a>(
        &self,
        entries: &'a [Entry<ShardConfig>],
        last: LogId<NodeId>,
        always: bool,
    ) -> Result<PlannedBatch<'a>, StorageError> {
        let mut guard = self.lock();
        let applied = &mut *guard;
        let start_of = |queue: &[u8]| next_offset(&self.store, queue);
        let producer_limit = |_: &[u8]| None;
        let mut plan = Plan::new((&self.store, self.shard), &start_of, &producer_limit);
        let (responses, membership, positions) = plan_entries(
            &mut plan,
            (&mut applied.producers, &mut applied.wheel),
            entries,
            applied.membership.clone(),
        );
        self.publish_delays(&applied.wheel);
        // Positions only: applied again after a crash (the largest wins), nothing to record.
        if plan.batch.is_empty() {
            return Ok(PlannedBatch {
                responses,
                membership,
                positions,
                stored: None,
            });
        }
        // The batches before whole in the store before this one's record replaces theirs, or,
        // under `interval` while they are not yet, named by this record too.
        let mut before = Vec::new();
        let unsynced = if let Some(unsynced) = self.unsynced_with(applied, &plan, always)? {
            unsynced
        } else {
            before.extend(applied.take_pending());
            Unsynced {
                from: entries[0].log_id.index,
                queues: std::mem::take(&mut plan.queues),
                batches: 0,
            }
        };
        let record = Applying {
            from: unsynced.from,
            last,
            membership: membership.clone(),
            queues: queue_starts(&unsynced.queues),
            deleted: None,
            delay_marks: applied.wheel.taken_below(),
            delay_partial: partial_record(applied.partial.as_ref()),
            delivered: None,
        };
        Ok(PlannedBatch {
            responses,
            membership,
            positions,
            stored: Some(ToStore {
                batch: std::mem::take(&mut plan.batch),
                unsynced,
                before,
                record,
            }),
        })
    }

    /// Applies a run of entries without deletes or deliveries as one batch, on the caller's
    /// task: planned ([`ShardStateMachine::plan_batch`]); the batches before made durable in
    /// the store first unless this one's record can name them too
    /// ([`ShardStateMachine::unsynced_with`]); its apply record written and its fsync awaited
    /// (the shard logs' group commit, holding no thread); then the messages buffered in the
    /// store. The lock on the applied state is let go across the waits:
    /// [`ShardStateMachine::gate`] keeps out every other apply, snapshot mark, capture and
    /// install meanwhile. Returns the answers and how long the batch waited for the store.
    async fn apply_batch(
        &self,
        entries: &[Entry<ShardConfig>],
    ) -> Result<(Vec<ShardResponse>, std::time::Duration), StorageError> {
        let Some(last_entry) = entries.last() else {
            return Ok((Vec::new(), std::time::Duration::ZERO));
        };
        let always = self.store.sync_policy() == SyncPolicy::Always;
        let PlannedBatch {
            responses,
            membership,
            positions,
            stored,
        } = self.plan_batch(entries, last_entry.log_id, always)?;
        let mut waited = std::time::Duration::ZERO;
        let Some(ToStore {
            batch,
            unsynced,
            before,
            record,
        }) = stored
        else {
            let ticket = self.record_positions(&positions)?;
            let mut applied = self.lock();
            if let Some(ticket) = ticket {
                if always {
                    drop(applied);
                    let started = std::time::Instant::now();
                    self.store_durable(ticket).await?;
                    waited = started.elapsed();
                    applied = self.lock();
                } else {
                    applied.positions_ticket = applied.positions_ticket.max(Some(ticket));
                }
            }
            applied.last = Some(last_entry.log_id);
            applied.membership = membership;
            return Ok((responses, waited));
        };
        let started = std::time::Instant::now();
        for ticket in before {
            self.store_durable(ticket).await?;
        }
        waited = started.elapsed();
        if always || !self.records_fenced {
            self.log
                .write_meta_binary_then_sync(APPLYING_KEY, &record)?
                .await?;
        } else {
            self.log.write_meta_binary_noted(APPLYING_KEY, &record)?;
        }
        let (offsets, ticket) = self
            .store
            .append_batch_deferred(&store_batch(&batch))
            .map_err(|error| io_error(&error))?;
        if let Some(((queue, _, planned), stored)) = batch
            .iter()
            .zip(&offsets)
            .find(|((_, _, planned), stored)| planned != *stored)
        {
            return Err(io_error(&std::io::Error::other(format!(
                "queue '{}': the store gave offset {stored} where the shard's log planned \
                 {planned}; this replica's queues differ from the log (was the queue written \
                 outside the shard?)",
                String::from_utf8_lossy(queue)
            ))));
        }
        // Under `always`, readable (a read sees fsynced messages only) before answered.
        if always {
            self.store_durable(ticket).await?;
        }
        // After the messages they may point past, recorded again by the recovery of this
        // batch if a crash comes first.
        let positions_ticket = self.record_positions(&positions)?;
        if always && let Some(positions_ticket) = positions_ticket {
            self.store_durable(positions_ticket).await?;
        }
        let mut applied = self.lock();
        if !always {
            applied.ticket = Some(ticket);
            applied.positions_ticket = applied.positions_ticket.max(positions_ticket);
            applied.unsynced = Some(Unsynced {
                batches: unsynced.batches + 1,
                ..unsynced
            });
        }
        applied.last = Some(last_entry.log_id);
        applied.membership = membership;
        drop(applied);
        self.tell_appended(&batch);
        Ok((responses, waited))
    }

    /// Under `interval`, while the store does not yet hold the batches applied before
    /// durably: those batches and `plan`'s as one range for the next apply record (each
    /// queue from where the first of them found it), so the apply need not wait for the
    /// store's fsync (a restart plans the whole range again, [`ShardStateMachine::recover`]).
    /// `None` when they are durable (forgotten then), under `always`, or when the range
    /// would name more than [`UNSYNCED_BATCHES_MAX`] batches or [`UNSYNCED_QUEUES_MAX`]
    /// queues: the apply then waits for the store and its record names its batch alone.
    fn unsynced_with(
        &self,
        applied: &mut Applied,
        plan: &Plan<'_>,
        always: bool,
    ) -> Result<Option<Unsynced>, StorageError> {
        if always {
            return Ok(None);
        }
        let durable = |ticket: Option<CommitTicket>| {
            ticket.map_or(Ok(true), |ticket| {
                self.store
                    .is_durable(ticket)
                    .map_err(|error| io_error(&error))
            })
        };
        if durable(applied.ticket)? && durable(applied.positions_ticket)? {
            applied.ticket = None;
            applied.positions_ticket = None;
            applied.unsynced = None;
            return Ok(None);
        }
        let Some(mut unsynced) = applied.unsynced.take() else {
            return Ok(None);
        };
        if unsynced.batches >= UNSYNCED_BATCHES_MAX {
            return Ok(None);
        }
        for (queue, (start, next)) in &plan.queues {
            unsynced
                .queues
                .entry(queue.clone())
                .and_modify(|(_, end)| *end = *next)
                .or_insert((*start, *next));
        }
        if unsynced.queues.len() > UNSYNCED_QUEUES_MAX {
            return Ok(None);
        }
        Ok(Some(unsynced))
    }

    /// Tells the observer of the messages `batch` stored in readers' queues (not the shard's
    /// own records: producers' runs, the delete counter, delay slots).
    fn tell_appended(&self, batch: &[(Bytes, Bytes, u64)]) {
        let Some(observer) = &self.observer else {
            return;
        };
        let appended: Vec<(&[u8], u64, &[u8])> = batch
            .iter()
            .filter(|(queue, _, _)| {
                !queue.starts_with(levee_broker::names::PRODUCER_PREFIX)
                    && !queue.starts_with(levee_broker::names::SHARD_DELETES_PREFIX)
                    && !queue.starts_with(levee_broker::names::DELAY_PREFIX)
            })
            .map(|(queue, payload, offset)| (&queue[..], *offset, &payload[..]))
            .collect();
        if !appended.is_empty() {
            observer.appended(self.shard, &appended);
        }
    }

    /// Applies one `ShardCommand::Deliver` at `now_ms` (see [`Plan::deliver`]): the previous
    /// batch made durable, the due slots read and planned, an apply record naming the slots,
    /// the marks before and the time, then the messages appended and made durable, and only
    /// then the slots deleted. A crash in between is finished at the next start (planned again
    /// while the appends are not whole, the slots deleted again).
    fn apply_deliver(
        &self,
        log_id: LogId<NodeId>,
        now_ms: u64,
    ) -> Result<ShardResponse, StorageError> {
        let mut guard = self.lock();
        let applied = &mut *guard;
        // The slots' last entries readable, and the batch before whole.
        self.wait_applied(applied)?;
        let marks_before = applied.wheel.taken_below();
        let mut wheel = applied.wheel.clone();
        let mut partial = applied.partial.clone();
        let start_of = |queue: &[u8]| next_offset(&self.store, queue);
        let producer_limit = |_: &[u8]| None;
        let mut plan = Plan::new((&self.store, self.shard), &start_of, &producer_limit);
        let (slots, due) = plan.deliver(&mut wheel, now_ms, &mut partial);
        if plan.batch.is_empty()
            && slots.is_empty()
            && wheel.taken_below() == marks_before
            && partial == applied.partial
        {
            // Nothing was due after all (an earlier `Deliver` took it): nothing to record.
            applied.last = Some(log_id);
            return Ok(ShardResponse::Done);
        }
        let queues = queue_starts(&plan.queues);
        self.log.write_meta_binary_grouped(
            APPLYING_KEY,
            &Applying {
                from: log_id.index,
                last: log_id,
                membership: applied.membership.clone(),
                queues,
                deleted: None,
                delay_marks: wheel.taken_below(),
                delay_partial: partial_record(partial.as_ref()),
                delivered: Some(Delivered {
                    now_ms,
                    marks_before,
                    partial_before: partial_record(applied.partial.as_ref()),
                    slots: slots.iter().map(|slot| slot.to_vec()).collect(),
                }),
            },
        )?;
        let (offsets, ticket) = self
            .store
            .append_batch_deferred(&store_batch(&plan.batch))
            .map_err(|error| io_error(&error))?;
        if offsets
            .iter()
            .zip(&plan.batch)
            .any(|(stored, (_, _, planned))| stored != planned)
        {
            return Err(io_error(&std::io::Error::other(
                "a delivery's messages got other offsets than the shard planned; this \
                 replica's queues differ from the log",
            )));
        }
        self.store
            .wait_durable(ticket)
            .map_err(|error| io_error(&error))?;
        for slot in &slots {
            self.store
                .delete_queue(slot)
                .map_err(|error| io_error(&error))?;
        }
        self.publish_delays(&wheel);
        applied.wheel = wheel;
        applied.partial = partial;
        applied.last = Some(log_id);
        drop(guard);
        self.tell_appended(&plan.batch);
        if let Some(observer) = &self.observer
            && !due.is_empty()
        {
            observer.delivered(self.shard, now_ms, &due);
        }
        Ok(ShardResponse::Done)
    }
}

/// `mutex` locked, even if a holder panicked.
fn locked<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A new snapshot's id at `last`: its term, its index and this node's time, so two taken at
/// one entry differ.
fn snapshot_id(last: LogId<NodeId>) -> String {
    format!("{}-{}-{}", last.leader_id.term, last.index, unix_nanos())
}

/// Nanoseconds since the Unix epoch, by this node's clock (names snapshot files apart).
fn unix_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos())
}

/// Makes a rename in `folder` durable.
fn sync_folder(folder: &Path) -> std::io::Result<()> {
    std::fs::File::open(folder)?.sync_all()
}

impl ShardStateMachine {
    /// Snapshots this replica installed, and snapshot files it wrote, since it started.
    pub fn snapshot_counts(&self) -> (u64, u64) {
        (
            self.snapshots.installed.load(Ordering::Relaxed),
            self.snapshots.written.load(Ordering::Relaxed),
        )
    }

    fn snapshot_path(&self, file: &str) -> PathBuf {
        self.snapshots.path.join(file)
    }

    /// Whether a queue of the node's store is the shard's.
    fn is_ours(&self, queue: &[u8]) -> bool {
        snapshot::shard_of_stored(queue, self.shards) == Some(self.shard)
    }

    /// Records the built mark (see the module's text): the store made durable up to the last
    /// applied entry, which the mark names. Blocking; applies wait meanwhile.
    fn mark_built(&self) -> Result<SnapshotMeta<NodeId, NodeInfo>, StorageError> {
        let mut applied = self.lock();
        applied.ticket = None;
        applied.positions_ticket = None;
        applied.unsynced = None;
        self.store.flush().map_err(|error| io_error(&error))?;
        let meta = SnapshotMeta {
            last_log_id: applied.last,
            last_membership: applied.membership.clone(),
            snapshot_id: applied.last.map_or_else(|| "empty".to_owned(), snapshot_id),
        };
        self.log.write_meta(BUILT_KEY, &meta)?;
        Ok(meta)
    }

    /// The snapshot to send: the file on disk when it covers the built mark, else the one
    /// being written when it does, else one started now at the last applied entry
    /// ([`ShardStateMachine::start_writing`]). `None` before anything was applied.
    async fn current_snapshot(&self) -> Result<Option<Snapshot<ShardConfig>>, StorageError> {
        let built = self
            .log
            .read_meta::<SnapshotMeta<NodeId, NodeInfo>>(BUILT_KEY)?
            .and_then(|built| built.last_log_id);
        if let Some(record) = self.log.read_meta::<SnapshotRecord>(DATA_KEY)?
            && record.meta.last_log_id >= built
            && self.snapshot_path(&record.file).exists()
        {
            return self.open_snapshot(record).await.map(Some);
        }
        let under_way = locked(&self.snapshots.writing).clone().filter(|writing| {
            writing.meta.last_log_id >= built && !matches!(&*writing.written.borrow(), Some(Err(_)))
        });
        let writing = if let Some(writing) = under_way {
            writing
        } else {
            let _gate = self.gate.lock().await;
            match self.blocking(Self::start_writing).await? {
                Some(writing) => writing,
                None => return Ok(None),
            }
        };
        let written = writing.written.clone();
        let meta = writing.meta.clone();
        Ok(Some(Snapshot {
            meta,
            snapshot: Box::new(SnapshotFile::when_written(move || writing.start(), written)),
        }))
    }

    /// Captures the shard at the last applied entry (offsets, positions, the delay marks:
    /// cheap) and writes its delay slots, which deliveries delete, while applies wait; then
    /// writes the other queues on a thread of its own, applies going on (appends past the
    /// capture are left out; a delete applied meanwhile fails the write, and the next ask
    /// captures again). Blocking.
    fn start_writing(&self) -> Result<Option<Arc<WritingSnapshot>>, StorageError> {
        let applied = self.lock();
        let Some(last) = applied.last else {
            return Ok(None);
        };
        self.store.flush().map_err(|error| io_error(&error))?;
        let positions = match &self.observer {
            Some(observer) => observer
                .shard_positions(self.shard, &|queue| self.is_ours(queue))
                .map_err(|error| io_error(&std::io::Error::other(error)))?,
            None => Vec::new(),
        };
        let tail = ShardTail {
            delay_marks: applied.wheel.taken_below(),
            delay_partial: partial_record(applied.partial.as_ref()),
        };
        let captured = snapshot::capture(&self.store, (self.shard, self.shards), positions, tail)
            .map_err(|error| io_error(&error))?;
        let deletes = next_offset(&self.store, &deletes_queue(self.shard));
        let meta = SnapshotMeta {
            last_log_id: Some(last),
            last_membership: applied.membership.clone(),
            snapshot_id: snapshot_id(last),
        };
        let file = format!("{}.snap", meta.snapshot_id);
        let part = self.snapshot_path(&format!("{file}.part"));
        let (slots, others): (Vec<_>, Vec<_>) = captured
            .queues
            .iter()
            .cloned()
            .partition(|queue| queue.name.starts_with(levee_broker::names::DELAY_PREFIX));
        let of = StreamOf {
            shard: self.shard,
            shards: self.shards,
            snapshot_id: &meta.snapshot_id,
        };
        let mut out = std::io::BufWriter::new(
            std::fs::File::create(&part).map_err(|error| io_error(&error))?,
        );
        let head = snapshot::write_start(of, &mut out)
            .and_then(|()| snapshot::write_queues(&self.store, &slots, &|| true, &mut out));
        drop(applied);
        if let Err(error) = head {
            let _ = std::fs::remove_file(&part);
            return Err(io_error(&error));
        }
        let (sender, written) = tokio::sync::watch::channel(None);
        let (go, wait_go) = std::sync::mpsc::sync_channel(1);
        let writing = Arc::new(WritingSnapshot {
            meta: meta.clone(),
            written,
            go: Mutex::new(Some(go)),
        });
        *locked(&self.snapshots.writing) = Some(Arc::clone(&writing));
        let installs = self.snapshots.installs.load(Ordering::Acquire);
        let machine = self.clone();
        std::thread::Builder::new()
            .name(format!("shard-{}-snapshot", self.shard))
            .spawn(move || {
                if wait_go.recv().is_err() {
                    let _ = std::fs::remove_file(&part);
                    tracing::debug!(shard = machine.shard, "a captured snapshot no replica read was dropped unwritten");
                    sender.send_replace(Some(Err(
                        "no replica read the captured snapshot".to_owned()
                    )));
                    return;
                }
                let outcome = machine.finish_writing(
                    (meta, file, &part),
                    (&captured, &others, (deletes, installs)),
                    out,
                );
                match &outcome {
                    Ok(_) => {
                        machine.snapshots.written.fetch_add(1, Ordering::Relaxed);
                        if let Some(observer) = &machine.observer {
                            observer.snapshot_written(machine.shard);
                        }
                    }
                    Err(error) => {
                        let _ = std::fs::remove_file(&part);
                        tracing::warn!(shard = machine.shard, %error, "writing the shard's snapshot failed; the next replica that needs one has it captured again");
                    }
                }
                sender.send_replace(Some(outcome));
            })
            .map_err(|error| io_error(&error))?;
        Ok(Some(writing))
    }

    /// The rest of [`ShardStateMachine::start_writing`]'s file: the queues but the slots, the
    /// positions and the tail; then the file made durable, renamed, and recorded as the one to
    /// send. Stops early when an install or a delete comes.
    fn finish_writing(
        &self,
        (meta, file, part): (SnapshotMeta<NodeId, NodeInfo>, String, &Path),
        (captured, others, (deletes, installs)): (
            &snapshot::Captured,
            &[snapshot::CapturedQueue],
            (u64, u64),
        ),
        mut out: std::io::BufWriter<std::fs::File>,
    ) -> Result<PathBuf, String> {
        let _alone = locked(&self.snapshots.streaming);
        let still = || {
            self.snapshots.installs.load(Ordering::Acquire) == installs
                && next_offset(&self.store, &deletes_queue(self.shard)) == deletes
        };
        let text = |error: &dyn std::fmt::Display| error.to_string();
        snapshot::write_queues(&self.store, others, &still, &mut out)
            .and_then(|()| snapshot::write_end(captured, &mut out))
            .map_err(|error| text(&error))?;
        if !still() {
            return Err("the shard changed while its snapshot was written".to_owned());
        }
        out.into_inner()
            .map_err(|error| text(&error.into_error()))?
            .sync_all()
            .map_err(|error| text(&error))?;
        let path = self.snapshot_path(&file);
        std::fs::rename(part, &path)
            .and_then(|()| sync_folder(&self.snapshots.path))
            .map_err(|error| text(&error))?;
        let last = meta.last_log_id.map(|id| id.index);
        let record = SnapshotRecord { meta, file };
        self.log
            .write_meta(DATA_KEY, &record)
            .map_err(|error| text(&error))?;
        self.remove_snapshot_files_but(&record.file);
        tracing::info!(shard = self.shard, last, file = %record.file, "wrote the shard's snapshot to send it");
        Ok(path)
    }

    /// Removes every file of the snapshot folder but `kept` (older snapshots, parts a stop
    /// left); a failure leaves them for the next time.
    fn remove_snapshot_files_but(&self, kept: &str) {
        let Ok(entries) = std::fs::read_dir(&self.snapshots.path) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            // A file being received or written stays (removed at the next start if left).
            if name != kept && !name.starts_with("receiving-") && !name.ends_with(".part") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// Installs the snapshot in `received` (blocking): the file kept under its final name and
    /// recorded as being installed, then [`ShardStateMachine::finish_install`].
    fn install_blocking(
        &self,
        meta: &SnapshotMeta<NodeId, NodeInfo>,
        received: &Path,
    ) -> Result<(), StorageError> {
        // A snapshot being written here (as a leader, before) stops first.
        self.snapshots.installs.fetch_add(1, Ordering::AcqRel);
        let _alone = locked(&self.snapshots.streaming);
        *locked(&self.snapshots.writing) = None;
        let mut applied = self.lock();
        let file = format!("installing-{}.snap", unix_nanos());
        std::fs::rename(received, self.snapshot_path(&file))
            .and_then(|()| sync_folder(&self.snapshots.path))
            .map_err(|error| io_error(&error))?;
        let record = SnapshotRecord {
            meta: meta.clone(),
            file,
        };
        self.log.write_meta(INSTALLING_KEY, &record)?;
        self.finish_install(&mut applied, &record)
    }

    /// Replaces the shard's queues and its consumers' positions with the snapshot's, durably,
    /// then records it as applied (the apply record, the built mark, the file to send) and
    /// drops the install record. Doing it again from the start changes nothing more.
    fn finish_install(
        &self,
        applied: &mut Applied,
        record: &SnapshotRecord,
    ) -> Result<(), StorageError> {
        let mut recorded = Vec::new();
        let tail = {
            let mut input = std::io::BufReader::new(
                std::fs::File::open(self.snapshot_path(&record.file))
                    .map_err(|error| io_error(&error))?,
            );
            let mut on_positions = |consumer: &str, positions: &[ConsumerPosition]| {
                let Some(observer) = &self.observer else {
                    return Ok(());
                };
                if let Some(ticket) = observer.positions(self.shard, consumer, positions)? {
                    recorded.push(ticket);
                }
                Ok(())
            };
            snapshot::install_shard(
                &self.store,
                StreamOf {
                    shard: self.shard,
                    shards: self.shards,
                    snapshot_id: &record.meta.snapshot_id,
                },
                &mut input,
                &mut on_positions,
            )
            .map_err(|error| io_error(&error))?
        };
        self.store.flush().map_err(|error| io_error(&error))?;
        if let Some(last) = record.meta.last_log_id {
            self.log.write_meta(
                APPLYING_KEY,
                &Applying {
                    from: last.index + 1,
                    last,
                    membership: record.meta.last_membership.clone(),
                    queues: Vec::new(),
                    deleted: None,
                    delay_marks: tail.delay_marks,
                    delay_partial: tail.delay_partial.clone(),
                    delivered: None,
                },
            )?;
        }
        self.log.write_meta(DATA_KEY, record)?;
        self.log.write_meta(BUILT_KEY, &record.meta)?;
        self.log.remove_meta(INSTALLING_KEY)?;
        self.remove_snapshot_files_but(&record.file);
        applied.last = record.meta.last_log_id;
        applied.membership = record.meta.last_membership.clone();
        applied.ticket = None;
        applied.positions_ticket = None;
        applied.unsynced = None;
        applied.producers = ShardProducers::default();
        applied.wheel = shard_wheel(&self.store, self.shard, tail.delay_marks);
        applied.partial = tail
            .delay_partial
            .map(|(queue, offset)| (Bytes::from(queue), offset));
        self.publish_delays(&applied.wheel);
        self.snapshots.installed.fetch_add(1, Ordering::Relaxed);
        tracing::info!(shard = self.shard, snapshot = %record.meta.snapshot_id, "installed a snapshot of the shard");
        if let Some(observer) = &self.observer {
            observer.installed(self.shard);
        }
        Ok(())
    }

    /// Runs `work` on the blocking pool with this machine.
    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Self) -> Result<T, StorageError> + Send + 'static,
    ) -> Result<T, StorageError> {
        let machine = self.clone();
        tokio::task::spawn_blocking(move || work(&machine))
            .await
            .map_err(|error| io_error(&error))?
    }

    /// The snapshot `record` names, opened to send.
    async fn open_snapshot(
        &self,
        record: SnapshotRecord,
    ) -> Result<Snapshot<ShardConfig>, StorageError> {
        let file = SnapshotFile::open(&self.snapshot_path(&record.file))
            .await
            .map_err(|error| io_error(&error))?;
        Ok(Snapshot {
            meta: record.meta,
            snapshot: Box::new(file),
        })
    }

    /// An empty file to stand for a snapshot whose bytes nobody reads (the built mark's).
    async fn no_bytes(&self) -> Result<Box<SnapshotFile>, StorageError> {
        SnapshotFile::create(&self.snapshot_path("empty"))
            .await
            .map(Box::new)
            .map_err(|error| io_error(&error))
    }
}

impl RaftSnapshotBuilder<ShardConfig> for ShardStateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<ShardConfig>, StorageError> {
        let meta = {
            let _gate = self.gate.lock().await;
            self.blocking(Self::mark_built).await?
        };
        // openraft reads only the meta of a snapshot it asked to build.
        Ok(Snapshot {
            meta,
            snapshot: self.no_bytes().await?,
        })
    }
}

impl RaftStateMachine<ShardConfig> for ShardStateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, NodeInfo>), StorageError> {
        let applied = self.lock();
        Ok((applied.last, applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<ShardResponse>, StorageError>
    where
        I: IntoIterator<Item = Entry<ShardConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry<ShardConfig>> = entries.into_iter().collect();
        let count = entries.len();
        let started = std::time::Instant::now();
        let _gate = self.gate.lock().await;
        let (responses, waited) = self.apply_entries(entries).await?;
        if let Some(observer) = &self.observer {
            observer.applied(self.shard, count, (waited, started.elapsed()));
        }
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<SnapshotFile>, StorageError> {
        let path = self.snapshot_path(&format!("receiving-{}.part", unix_nanos()));
        SnapshotFile::create(&path)
            .await
            .map(Box::new)
            .map_err(|error| io_error(&error))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, NodeInfo>,
        mut snapshot: Box<SnapshotFile>,
    ) -> Result<(), StorageError> {
        snapshot.sync().await.map_err(|error| io_error(&error))?;
        let received = snapshot.path().to_owned();
        drop(snapshot);
        let meta = meta.clone();
        let _gate = self.gate.lock().await;
        self.blocking(move |machine| machine.install_blocking(&meta, &received))
            .await
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<ShardConfig>>, StorageError> {
        if self.snapshots.starting.swap(false, Ordering::AcqRel) {
            // openraft's start reads the meta only: the built mark's, no file written.
            let built = self
                .log
                .read_meta::<SnapshotMeta<NodeId, NodeInfo>>(BUILT_KEY)?;
            return match built {
                Some(meta) => Ok(Some(Snapshot {
                    meta,
                    snapshot: self.no_bytes().await?,
                })),
                None => Ok(None),
            };
        }
        self.current_snapshot().await
    }
}

#[cfg(test)]
mod tests {
    use levee_store::StoreOptions;
    use openraft::{CommittedLeaderId, EntryPayload, LogId};

    use super::*;
    use crate::log_store::open_keyspace;
    use crate::shard::{AppendRequest, QueueMessage, RefusedCode};
    use crate::syncer::JournalSyncer;

    fn append(index: u64, messages: &[(&str, &str)]) -> Entry<ShardConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(ShardCommand::Append {
                producer: None,
                messages: messages
                    .iter()
                    .map(|(queue, payload)| QueueMessage {
                        queue: Bytes::copy_from_slice(queue.as_bytes()),
                        payload: Bytes::copy_from_slice(payload.as_bytes()),
                        sequence: 0,
                    })
                    .collect(),
            }),
        }
    }

    fn open(directory: &std::path::Path) -> (Arc<Store>, ShardStateMachine) {
        let (store, _) =
            Store::open(directory.join("store"), StoreOptions::default()).expect("a store");
        let store = Arc::new(store);
        let log = LogStore::<ShardConfig>::open_in(
            open_keyspace(&directory.join("log")).expect("a keyspace"),
            "-0",
        )
        .expect("a log");
        let machine = ShardStateMachine::open(
            (0, 1),
            (Arc::clone(&store), log, &directory.join("snapshots")),
            None,
        )
        .expect("a machine");
        (store, machine)
    }

    /// Every message of `queue` in `store`, from offset 0.
    fn messages(store: &Store, queue: &str) -> Vec<String> {
        let mut all = Vec::new();
        loop {
            let batch = store
                .read(queue.as_bytes(), all.len() as u64, 1_000, 1 << 20)
                .expect("a read");
            if batch.is_empty() {
                return all;
            }
            let (data, ends) = batch.into_parts();
            let mut start = 0;
            for end in ends {
                all.push(String::from_utf8(data[start..end].to_vec()).unwrap());
                start = end;
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_entries_when_applied_then_each_append_answers_its_offsets_in_order()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        let (store, mut machine) = open(directory.path());
        let responses = machine
            .apply(vec![
                append(1, &[("a", "a0"), ("b", "b0"), ("a", "a1")]),
                append(2, &[("a", "a2")]),
            ])
            .await?;
        assert_eq!(
            responses,
            [
                ShardResponse::Appended {
                    offsets: vec![0, 0, 1]
                },
                ShardResponse::Appended { offsets: vec![2] },
            ]
        );
        assert_eq!(messages(&store, "a"), ["a0", "a1", "a2"]);
        assert_eq!(machine.applied_state().await?.0.map(|id| id.index), Some(2));
        let refused = machine
            .apply(vec![append(3, &[("a", "ok"), ("", "no queue")])])
            .await?;
        assert!(
            matches!(&refused[0], ShardResponse::Refused { reason, .. } if reason.contains("1 to 255")),
            "{refused:?}"
        );
        assert_eq!(
            messages(&store, "a").len(),
            3,
            "a refused entry stores nothing"
        );
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_light_and_heavy_runs_when_applied_then_both_store_their_messages_alike()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        let (store, mut machine) = open(directory.path());
        // Light runs are applied on the state machine's task, heavy ones (more than
        // APPLY_INLINE_WEIGHT_MAX messages) on a blocking thread; light, heavy, light.
        let heavy: Vec<(String, String)> = (0..=APPLY_INLINE_WEIGHT_MAX)
            .map(|number| (format!("q{}", number % 3), format!("h{number}")))
            .collect();
        let heavy: Vec<(&str, &str)> = heavy
            .iter()
            .map(|(queue, payload)| (queue.as_str(), payload.as_str()))
            .collect();
        let mut responses = machine.apply(vec![append(1, &[("q0", "first")])]).await?;
        responses.extend(machine.apply(vec![append(2, &heavy)]).await?);
        responses.extend(machine.apply(vec![append(3, &[("q0", "last")])]).await?);
        assert_eq!(responses[0], ShardResponse::Appended { offsets: vec![0] });
        let ShardResponse::Appended { offsets } = &responses[1] else {
            panic!("{:?}", responses[1]);
        };
        assert_eq!(offsets.len(), heavy.len());
        assert_eq!(&offsets[..4], [1, 0, 0, 2]);
        let stored = messages(&store, "q0");
        assert_eq!(stored.len(), 2 + heavy.len().div_ceil(3));
        assert_eq!(stored.first().map(String::as_str), Some("first"));
        assert_eq!(stored.get(1).map(String::as_str), Some("h0"));
        assert_eq!(stored.last().map(String::as_str), Some("last"));
        assert_eq!(
            responses[2],
            ShardResponse::Appended {
                offsets: vec![u64::try_from(stored.len() - 1).expect("small")]
            }
        );
        assert_eq!(machine.applied_state().await?.0.map(|id| id.index), Some(3));
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_batch_cut_short_by_a_crash_when_reopened_then_only_the_missing_messages_are_appended()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        {
            let (store, mut machine) = open(directory.path());
            machine
                .apply(vec![append(1, &[("q1", "x"), ("q1", "y"), ("q2", "z")])])
                .await?;
            // Entries 2 and 3 are in the log, their batch's record written, and only the
            // first of their messages reached the store before the crash.
            let batch = [
                append(2, &[("q1", "a"), ("q2", "c"), ("q1", "b")]),
                append(3, &[("q1", "d")]),
            ];
            machine.log.write_entries(batch.iter().cloned())?;
            machine.log.write_meta(
                APPLYING_KEY,
                &Applying {
                    from: 2,
                    last: batch[1].log_id,
                    membership: StoredMembership::default(),
                    deleted: None,
                    delay_marks: (0, 0),
                    delay_partial: None,
                    delivered: None,
                    queues: vec![
                        QueueStart {
                            queue: Bytes::from_static(b"q1"),
                            start: 2,
                            count: 3,
                        },
                        QueueStart {
                            queue: Bytes::from_static(b"q2"),
                            start: 1,
                            count: 1,
                        },
                    ],
                },
            )?;
            store.append(b"q1", b"a").expect("an append");
            store.sync().expect("a sync");
        }
        let (store, mut reopened) = open(directory.path());
        assert_eq!(messages(&store, "q1"), ["x", "y", "a", "b", "d"]);
        assert_eq!(messages(&store, "q2"), ["z", "c"]);
        assert_eq!(
            reopened.applied_state().await?.0.map(|id| id.index),
            Some(3)
        );
        // Reopened again: nothing more to do.
        drop((store, reopened));
        let (store, _) = open(directory.path());
        assert_eq!(messages(&store, "q1"), ["x", "y", "a", "b", "d"]);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_batches_the_store_has_not_synced_when_applied_then_one_record_names_them_all()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        let (store, mut machine) = open(directory.path());
        store
            .set_sync_policy(SyncPolicy::Interval {
                interval_ms: 60_000,
            })
            .expect("a policy");
        let sorted = |record: &Applying| {
            let mut queues: Vec<(Bytes, u64, u64)> = record
                .queues
                .iter()
                .map(|queue| (queue.queue.clone(), queue.start, queue.count))
                .collect();
            queues.sort();
            queues
        };
        machine
            .apply(vec![append(1, &[("q1", "a"), ("q2", "b")])])
            .await?;
        machine
            .apply(vec![append(2, &[("q1", "c"), ("q3", "d")])])
            .await?;
        // The first batch is not durable in the store: the record names both, each queue from
        // where the first found it.
        let record: Applying = machine.log.read_meta(APPLYING_KEY)?.expect("a record");
        assert_eq!((record.from, record.last.index), (1, 2));
        let q = |name: &'static [u8], start, count| (Bytes::from_static(name), start, count);
        assert_eq!(
            sorted(&record),
            [q(b"q1", 0, 2), q(b"q2", 0, 1), q(b"q3", 0, 1)]
        );
        // Once the store holds them durably, a record names its own batch alone.
        store.sync().expect("a sync");
        machine.apply(vec![append(3, &[("q2", "e")])]).await?;
        let record: Applying = machine.log.read_meta(APPLYING_KEY)?.expect("a record");
        assert_eq!((record.from, record.last.index), (3, 3));
        assert_eq!(sorted(&record), [q(b"q2", 1, 1)]);
        // Applied as planned.
        assert_eq!(messages(&store, "q1"), ["a", "c"]);
        assert_eq!(messages(&store, "q2"), ["b", "e"]);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_records_fenced_by_the_store_when_applied_then_each_is_noted_and_fsynced_before_the_store_writes()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        let open_fenced = || {
            let (store, _) = Store::open(
                directory.path().join("store"),
                StoreOptions {
                    sync: SyncPolicy::Interval {
                        interval_ms: 60_000,
                    },
                    ..StoreOptions::default()
                },
            )
            .expect("a store");
            let store = Arc::new(store);
            let keyspace = open_keyspace(&directory.path().join("log")).expect("a keyspace");
            let syncer = JournalSyncer::start(keyspace.clone(), &directory.path().join("log"))
                .expect("a syncer");
            store.set_write_barrier(syncer.write_barrier());
            let log = LogStore::<ShardConfig>::open_in(keyspace, "-0")
                .expect("a log")
                .with_syncer(syncer.clone());
            let machine = ShardStateMachine::open(
                (0, 1),
                (Arc::clone(&store), log, &directory.path().join("snapshots")),
                None,
            )
            .expect("a machine")
            .with_records_fenced();
            (store, syncer, machine)
        };
        let (store, syncer, mut machine) = open_fenced();
        machine
            .apply(vec![append(1, &[("q1", "a"), ("q2", "b")])])
            .await?;
        machine.apply(vec![append(2, &[("q1", "c")])]).await?;
        // Answered without an fsync of their records: each only noted.
        assert_eq!(syncer.noted_counts(), (0, 2));
        assert_eq!(messages(&store, "q1"), ["a", "c"], "readable at once");
        let record: Applying = machine.log.read_meta(APPLYING_KEY)?.expect("a record");
        assert_eq!((record.from, record.last.index), (1, 2));
        // The store's round fsyncs them before it writes the messages they name.
        store.flush().expect("a round");
        assert_eq!(syncer.noted_counts(), (2, 2));
        machine.apply(vec![append(3, &[("q2", "d")])]).await?;
        store.flush().expect("a round");
        assert_eq!(syncer.noted_counts(), (3, 3));
        syncer.stop();
        drop((store, syncer, machine));
        let (store, _, machine) = open_fenced();
        assert_eq!(machine.last_applied().map(|id| id.index), Some(3));
        assert_eq!(messages(&store, "q1"), ["a", "c"]);
        assert_eq!(messages(&store, "q2"), ["b", "d"]);
        Ok(())
    }

    /// Records the positions it is handed.
    #[derive(Default)]
    struct Positions(Mutex<Vec<(String, Vec<ConsumerPosition>)>>);

    impl ShardObserver for Positions {
        fn appended(&self, _: ShardId, _: &[(&[u8], u64, &[u8])]) {}

        fn positions(
            &self,
            _: ShardId,
            consumer: &str,
            positions: &[ConsumerPosition],
        ) -> Result<Option<levee_store::CommitTicket>, String> {
            self.0
                .lock()
                .unwrap()
                .push((consumer.to_owned(), positions.to_vec()));
            Ok(None)
        }
    }

    fn positions(index: u64, consumer: &str, queue: &str, next: u64) -> Entry<ShardConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(ShardCommand::Positions {
                consumer: consumer.to_owned(),
                positions: vec![ConsumerPosition {
                    queue: Bytes::copy_from_slice(queue.as_bytes()),
                    epoch: 0,
                    next,
                }],
            }),
        }
    }

    #[tokio::test]
    async fn given_several_consumers_positions_in_one_entry_then_each_is_recorded_as_its_own_entry_would_be()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        let observer = Arc::new(Positions::default());
        let (_store, mut machine) = open(directory.path());
        machine.observer = Some(observer.clone());
        let at = |queue: &str, next| ConsumerPosition {
            queue: Bytes::copy_from_slice(queue.as_bytes()),
            epoch: 0,
            next,
        };
        let together = Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), 2),
            payload: EntryPayload::Normal(ShardCommand::PositionsOf {
                consumers: vec![
                    ("app".to_owned(), vec![at("q1", 1), at("q2", 3)]),
                    ("audit".to_owned(), vec![at("q1", 1)]),
                ],
            }),
        };
        let answers = machine
            .apply(vec![append(1, &[("q1", "x"), ("q2", "y")]), together])
            .await?;
        assert_eq!(answers[1], ShardResponse::Done);
        assert_eq!(
            *observer.0.lock().unwrap(),
            [
                ("app".to_owned(), vec![at("q1", 1), at("q2", 3)]),
                ("audit".to_owned(), vec![at("q1", 1)]),
            ]
        );
        Ok(())
    }

    #[tokio::test]
    async fn given_positions_in_the_log_when_applied_or_recovered_then_the_observer_records_them()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        let observer = Arc::new(Positions::default());
        {
            let (store, mut machine) = open(directory.path());
            machine.observer = Some(observer.clone());
            let answers = machine
                .apply(vec![
                    append(1, &[("q1", "x")]),
                    positions(2, "app", "q1", 1),
                    positions(3, "app", "q1", 1),
                ])
                .await?;
            assert_eq!(answers[1], ShardResponse::Done);
            assert_eq!(observer.0.lock().unwrap().len(), 2);
            // A batch whose record was written, cut short before its messages and positions
            // reached the store.
            let batch = [append(4, &[("q1", "y")]), positions(5, "app", "q1", 2)];
            machine.log.write_entries(batch.iter().cloned())?;
            machine.log.write_meta(
                APPLYING_KEY,
                &Applying {
                    from: 4,
                    last: batch[1].log_id,
                    membership: StoredMembership::default(),
                    deleted: None,
                    delay_marks: (0, 0),
                    delay_partial: None,
                    delivered: None,
                    queues: vec![QueueStart {
                        queue: Bytes::from_static(b"q1"),
                        start: 1,
                        count: 1,
                    }],
                },
            )?;
            drop(store);
        }
        observer.0.lock().unwrap().clear();
        // Reopened: the recovered batch's message is stored and its positions handed over.
        let (store, _) =
            Store::open(directory.path().join("store"), StoreOptions::default()).expect("a store");
        let store = Arc::new(store);
        let log = LogStore::<ShardConfig>::open_in(
            open_keyspace(&directory.path().join("log")).expect("a keyspace"),
            "-0",
        )
        .expect("a log");
        let told: Arc<dyn ShardObserver> = observer.clone();
        let reopened = ShardStateMachine::open(
            (0, 1),
            (Arc::clone(&store), log, &directory.path().join("snapshots")),
            Some(told),
        )?;
        assert_eq!(messages(&store, "q1"), ["x", "y"]);
        assert_eq!(reopened.last_applied().map(|id| id.index), Some(5));
        let recorded = observer.0.lock().unwrap().clone();
        assert_eq!(recorded.len(), 1, "{recorded:?}");
        assert_eq!(recorded[0].0, "app");
        assert_eq!(recorded[0].1[0].next, 2);
        Ok(())
    }

    fn delete(index: u64, queue: &str) -> Entry<ShardConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(ShardCommand::Delete {
                queue: Bytes::copy_from_slice(queue.as_bytes()),
            }),
        }
    }

    /// What a [`Deletes`] was told: (queue, epoch) before each delete, the queue after.
    type Told = (Vec<(String, u64)>, Vec<String>);

    /// Records the deletes it is told of.
    #[derive(Default)]
    struct Deletes(Mutex<Told>);

    impl ShardObserver for Deletes {
        fn appended(&self, _: ShardId, _: &[(&[u8], u64, &[u8])]) {}

        fn deleting(&self, _: ShardId, queue: &[u8], epoch: u64) -> Result<(), String> {
            let name = String::from_utf8_lossy(queue).into_owned();
            self.0.lock().unwrap().0.push((name, epoch));
            Ok(())
        }

        fn deleted(&self, _: ShardId, queue: &[u8]) {
            let name = String::from_utf8_lossy(queue).into_owned();
            self.0.lock().unwrap().1.push(name);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_delete_between_appends_when_applied_then_the_queue_starts_again_at_offset_0_in_a_new_epoch()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        let (store, mut machine) = open(directory.path());
        let observer = Arc::new(Deletes::default());
        machine.observer = Some(observer.clone());
        let answers = machine
            .apply(vec![
                append(1, &[("q", "a0"), ("q", "a1"), ("other", "o0")]),
                delete(2, "q"),
                append(3, &[("q", "b0")]),
                delete(4, "never"),
                delete(5, ""),
            ])
            .await?;
        assert_eq!(
            answers[0],
            ShardResponse::Appended {
                offsets: vec![0, 1, 0]
            }
        );
        assert_eq!(answers[1], ShardResponse::Deleted { existed: true });
        assert_eq!(answers[2], ShardResponse::Appended { offsets: vec![0] });
        assert_eq!(answers[3], ShardResponse::Deleted { existed: false });
        assert!(
            matches!(&answers[4], ShardResponse::Refused { code: RefusedCode::Invalid, reason } if reason.contains("1 to 255")),
            "{answers:?}"
        );
        assert_eq!(messages(&store, "q"), ["b0"]);
        assert_eq!(messages(&store, "other"), ["o0"]);
        assert_eq!(crate::shard::plan::delete_epoch(&store, 0), 2);
        let told = observer.0.lock().unwrap().clone();
        assert_eq!(told.0, [("q".to_owned(), 1), ("never".to_owned(), 2)]);
        assert_eq!(told.1, ["q", "never"]);
        assert_eq!(machine.applied_state().await?.0.map(|id| id.index), Some(5));
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_delete_cut_short_by_a_crash_when_reopened_then_it_is_finished_and_counted_once()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        for counted in [false, true] {
            let (store, machine) = open(directory.path());
            let base = if counted { 10 } else { 0 };
            machine
                .log
                .write_entries([append(base + 1, &[("q", "a0")])].into_iter())?;
            store.append(b"q", b"a0").expect("an append");
            let epoch = crate::shard::plan::delete_epoch(&store, 0);
            // The delete's record written; its count reached the store or not, the delete
            // itself did not.
            let entry = delete(base + 2, "q");
            machine.log.write_entries([entry.clone()].into_iter())?;
            machine.log.write_meta(
                APPLYING_KEY,
                &Applying {
                    from: base + 2,
                    last: entry.log_id,
                    membership: StoredMembership::default(),
                    queues: vec![QueueStart {
                        queue: deletes_queue(0),
                        start: epoch,
                        count: 1,
                    }],
                    deleted: Some(b"q".to_vec()),
                    delay_marks: (0, 0),
                    delay_partial: None,
                    delivered: None,
                },
            )?;
            if counted {
                store.append(&deletes_queue(0), b"").expect("an append");
            }
            store.sync().expect("a sync");
            drop((store, machine));
            let (store, reopened) = open(directory.path());
            assert!(store.queue_info(b"q").unwrap().is_none(), "deleted");
            assert_eq!(crate::shard::plan::delete_epoch(&store, 0), epoch + 1);
            assert_eq!(reopened.last_applied().map(|id| id.index), Some(base + 2));
        }
        Ok(())
    }

    fn idempotent(
        index: u64,
        producer: &str,
        queue: &str,
        sequences: std::ops::Range<u64>,
    ) -> Entry<ShardConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(ShardCommand::Append {
                producer: Some(producer.to_owned()),
                messages: sequences
                    .map(|sequence| QueueMessage {
                        queue: Bytes::copy_from_slice(queue.as_bytes()),
                        payload: Bytes::from(format!("{producer}-{sequence}")),
                        sequence,
                    })
                    .collect(),
            }),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_requests_merged_into_one_appends_entry_then_each_is_answered_and_stored_as_its_own_entry_would_be()
    -> Result<(), StorageError> {
        // Plain, refused (no queue name), idempotent, a resend, a gap, then one that follows.
        let requests = [
            append(0, &[("q", "a0"), ("r", "b0")]),
            append(0, &[("q", "a1"), ("", "no queue")]),
            idempotent(0, "p", "q", 0..3),
            idempotent(0, "p", "q", 1..3),
            idempotent(0, "p", "q", 5..6),
            idempotent(0, "p", "q", 3..4),
            append(0, &[("r", "b1")]),
        ];
        let as_entries = {
            let directory = tempfile::tempdir().expect("a directory");
            let (store, mut machine) = open(directory.path());
            let entries: Vec<_> = requests
                .iter()
                .enumerate()
                .map(|(index, request)| Entry {
                    log_id: LogId::new(CommittedLeaderId::new(1, 1), index as u64 + 1),
                    payload: request.payload.clone(),
                })
                .collect();
            let answers = machine.apply(entries).await?;
            (answers, messages(&store, "q"), messages(&store, "r"))
        };
        let directory = tempfile::tempdir().expect("a directory");
        let (store, mut machine) = open(directory.path());
        let merged = requests
            .iter()
            .map(|request| match &request.payload {
                EntryPayload::Normal(ShardCommand::Append { producer, messages }) => {
                    AppendRequest {
                        producer: producer.clone(),
                        messages: messages.clone(),
                    }
                }
                other => panic!("an append was built, got {other:?}"),
            })
            .collect();
        let answers = machine
            .apply(vec![Entry {
                log_id: LogId::new(CommittedLeaderId::new(1, 1), 1),
                payload: EntryPayload::Normal(ShardCommand::Appends { requests: merged }),
            }])
            .await?;
        assert_eq!(
            answers,
            [ShardResponse::Each {
                responses: as_entries.0.clone()
            }]
        );
        assert!(
            matches!(&as_entries.0[1], ShardResponse::Refused { .. })
                && matches!(
                    &as_entries.0[4],
                    ShardResponse::Refused {
                        code: RefusedCode::SequenceGap,
                        ..
                    }
                ),
            "{:?}",
            as_entries.0
        );
        assert_eq!(messages(&store, "q"), as_entries.1);
        assert_eq!(messages(&store, "q"), ["a0", "p-0", "p-1", "p-2", "p-3"]);
        assert_eq!(messages(&store, "r"), as_entries.2);
        assert_eq!(machine.applied_state().await?.0.map(|id| id.index), Some(1));
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_an_idempotent_producer_when_it_resends_then_the_original_offsets_answer_and_nothing_is_stored_twice()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        {
            let (store, mut machine) = open(directory.path());
            let answers = machine
                .apply(vec![
                    append(1, &[("q", "other")]),
                    idempotent(2, "p", "q", 0..3),
                    // A resend in the same batch.
                    idempotent(3, "p", "q", 0..3),
                ])
                .await?;
            assert_eq!(
                answers[1],
                ShardResponse::Appended {
                    offsets: vec![1, 2, 3]
                }
            );
            assert_eq!(answers[2], answers[1]);
            let later = machine
                .apply(vec![
                    idempotent(4, "p", "q", 1..3),
                    idempotent(5, "p", "q", 5..6),
                    idempotent(6, "p", "q", 3..4),
                ])
                .await?;
            assert_eq!(
                later[0],
                ShardResponse::Appended {
                    offsets: vec![2, 3]
                }
            );
            assert!(
                matches!(
                    &later[1],
                    ShardResponse::Refused {
                        code: RefusedCode::SequenceGap,
                        ..
                    }
                ),
                "{later:?}"
            );
            assert_eq!(later[2], ShardResponse::Appended { offsets: vec![4] });
            assert_eq!(messages(&store, "q"), ["other", "p-0", "p-1", "p-2", "p-3"]);
        }
        // After a restart the producer's runs come back from its queue.
        let (store, mut machine) = open(directory.path());
        let resent = machine.apply(vec![idempotent(7, "p", "q", 0..3)]).await?;
        assert_eq!(
            resent[0],
            ShardResponse::Appended {
                offsets: vec![1, 2, 3]
            }
        );
        assert_eq!(messages(&store, "q").len(), 5);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_crash_before_a_producer_record_was_stored_when_reopened_then_a_resend_is_still_recognised()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        {
            let (store, machine) = open(directory.path());
            // Entry 1 planned: q gets p-0 and p-1 at 0 and 1, the producer's record at 0 of
            // its queue; only the data reached the store.
            let entry = idempotent(1, "p", "q", 0..2);
            machine.log.write_entries([entry.clone()])?;
            machine.log.write_meta(
                APPLYING_KEY,
                &Applying {
                    from: 1,
                    last: entry.log_id,
                    membership: StoredMembership::default(),
                    deleted: None,
                    delay_marks: (0, 0),
                    delay_partial: None,
                    delivered: None,
                    queues: vec![
                        QueueStart {
                            queue: Bytes::from_static(b"q"),
                            start: 0,
                            count: 2,
                        },
                        QueueStart {
                            queue: crate::shard::plan::producer_queue(0, "p"),
                            start: 0,
                            count: 1,
                        },
                    ],
                },
            )?;
            store
                .append_batch(&[(b"q", b"p-0"), (b"q", b"p-1")])
                .expect("appends");
        }
        let (store, mut machine) = open(directory.path());
        assert_eq!(messages(&store, "q"), ["p-0", "p-1"]);
        let resent = machine.apply(vec![idempotent(2, "p", "q", 0..2)]).await?;
        assert_eq!(
            resent[0],
            ShardResponse::Appended {
                offsets: vec![0, 1]
            }
        );
        assert_eq!(messages(&store, "q"), ["p-0", "p-1"]);
        Ok(())
    }

    fn membership(index: u64, configs: Vec<Vec<u64>>) -> Entry<ShardConfig> {
        let nodes: std::collections::BTreeMap<u64, NodeInfo> = configs
            .iter()
            .flatten()
            .map(|node| (*node, NodeInfo::default()))
            .collect();
        let configs = configs
            .into_iter()
            .map(|config| config.into_iter().collect())
            .collect();
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Membership(openraft::Membership::new(configs, nodes)),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_membership_changes_then_appends_when_reopened_then_the_last_membership_is_reported()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        {
            let (_store, mut machine) = open(directory.path());
            machine
                .apply(vec![membership(1, vec![vec![1], vec![1, 2, 3]])])
                .await?;
            machine
                .apply(vec![membership(2, vec![vec![1, 2, 3]])])
                .await?;
            machine.apply(vec![append(3, &[("q", "a")])]).await?;
        }
        let (_store, mut machine) = open(directory.path());
        let (last, stored) = machine.applied_state().await?;
        assert_eq!(last.map(|id| id.index), Some(3));
        assert_eq!(stored.log_id().map(|id| id.index), Some(2), "{stored:?}");
        Ok(())
    }

    fn delay(index: u64, now_ms: u64, entries: &[(u64, &str)]) -> Entry<ShardConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(ShardCommand::Delay {
                now_ms,
                entries: entries
                    .iter()
                    .map(|(due_ms, body)| {
                        Bytes::from(
                            levee_broker::delay::DelayedEntry {
                                due_ms: *due_ms,
                                topic: "t".to_owned(),
                                target: b"t".to_vec(),
                                body: body.as_bytes().to_vec(),
                            }
                            .encode(),
                        )
                    })
                    .collect(),
            }),
        }
    }

    fn deliver(index: u64, now_ms: u64) -> Entry<ShardConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(ShardCommand::Deliver { now_ms }),
        }
    }

    /// The shard's slot queues in `store`.
    fn slots(store: &Store) -> Vec<Vec<u8>> {
        let mut found = Vec::new();
        store.for_each_queue_with_prefix(&levee_broker::delay::shard_slots_prefix(0), |name| {
            found.push(name.to_vec());
        });
        found
    }

    /// Copies the snapshot `sent` into a file `replica` receives, as openraft does chunk by
    /// chunk.
    async fn receive(
        replica: &mut ShardStateMachine,
        sent: &mut Snapshot<ShardConfig>,
    ) -> Box<SnapshotFile> {
        let mut receiving = replica.begin_receiving_snapshot().await.expect("a file");
        tokio::io::copy(&mut sent.snapshot, &mut receiving)
            .await
            .expect("copied");
        receiving.sync().await.expect("synced");
        receiving
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_built_mark_when_a_replica_needs_the_shard_then_a_snapshot_written_at_the_last_entry_installs_it_there_exactly()
    -> Result<(), StorageError> {
        let now = 1_000_000;
        let (one, two) = (
            tempfile::tempdir().expect("a directory"),
            tempfile::tempdir().expect("a directory"),
        );
        let (store, mut machine) = open(one.path());
        machine
            .apply(vec![
                append(1, &[("a", "a0"), ("b", "b0")]),
                delay(2, now, &[(now + 500, "later")]),
            ])
            .await?;
        let built = machine
            .get_snapshot_builder()
            .await
            .build_snapshot()
            .await?;
        assert_eq!(built.meta.last_log_id.map(|id| id.index), Some(2));
        assert_eq!(machine.snapshot_counts(), (0, 0), "a mark writes no file");
        machine.apply(vec![append(3, &[("a", "a1")])]).await?;
        // openraft's start looks first, for the mark; a replica's need then writes the file,
        // at the last applied entry.
        let first = machine.get_current_snapshot().await?.expect("the mark");
        assert_eq!(first.meta.last_log_id.map(|id| id.index), Some(2));
        let mut sent = machine.get_current_snapshot().await?.expect("a snapshot");
        assert_eq!(sent.meta.last_log_id.map(|id| id.index), Some(3));
        // Applies go on while the file is written; it holds the shard as captured.
        let during = append(4, &[("a", "a2")]);
        machine.apply(vec![during.clone()]).await?;
        // A replica that held an older, different state of the shard.
        let (replica_store, mut replica) = open(two.path());
        replica.apply(vec![append(1, &[("a", "stale")])]).await?;
        let received = receive(&mut replica, &mut sent).await;
        assert_eq!(machine.snapshot_counts(), (0, 1));
        let again = machine.get_current_snapshot().await?.expect("a snapshot");
        assert_eq!(
            again.meta.snapshot_id, sent.meta.snapshot_id,
            "the file on disk answers while it covers the mark"
        );
        assert_eq!(machine.snapshot_counts(), (0, 1));
        replica.install_snapshot(&sent.meta, received).await?;
        assert_eq!(replica.applied_state().await?.0, sent.meta.last_log_id);
        assert_eq!(messages(&replica_store, "a"), ["a0", "a1"]);
        replica.apply(vec![during]).await?;
        assert_eq!(messages(&replica_store, "b"), ["b0"]);
        assert_eq!(replica.delayed_waiting(), 1);
        assert_eq!(replica.next_due_ms(), machine.next_due_ms());
        assert_eq!(replica.snapshot_counts(), (1, 0));
        // Both go on alike, the delayed message included.
        let next = vec![deliver(5, now + 600)];
        assert_eq!(
            machine.apply(next.clone()).await?,
            replica.apply(next).await?
        );
        assert_eq!(messages(&replica_store, "a"), messages(&store, "a"));
        assert_eq!(messages(&replica_store, "t"), ["later"]);
        // Restarted, the replica reports what it applied and offers the installed snapshot.
        drop((replica, replica_store));
        let (_, mut reopened) = open(two.path());
        assert_eq!(
            reopened.applied_state().await?.0.map(|id| id.index),
            Some(5)
        );
        let offered = reopened.get_current_snapshot().await?.expect("a mark");
        assert_eq!(offered.meta.snapshot_id, sent.meta.snapshot_id);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[allow(
        clippy::await_holding_lock,
        reason = "the writer thread must wait on the lock while the delete is applied"
    )]
    async fn given_a_delete_applied_while_a_snapshot_is_written_then_that_write_fails_and_the_next_ask_captures_again()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        let (_store, mut machine) = open(directory.path());
        machine
            .apply(vec![append(1, &[("a", "a0"), ("b", "b0")])])
            .await?;
        machine.get_current_snapshot().await?;
        let mut failed = {
            // The writer waits here until the delete is applied.
            let held = Arc::clone(&machine.snapshots);
            let _writer_waits = held.streaming.lock().unwrap();
            let failed = machine.get_current_snapshot().await?.expect("a snapshot");
            machine.apply(vec![delete(2, "b")]).await?;
            failed
        };
        let mut bytes = Vec::new();
        let read = tokio::io::AsyncReadExt::read_to_end(&mut failed.snapshot, &mut bytes).await;
        assert!(read.is_err(), "{read:?}");
        let mut again = machine.get_current_snapshot().await?.expect("a snapshot");
        assert_ne!(again.meta.snapshot_id, failed.meta.snapshot_id);
        assert_eq!(again.meta.last_log_id.map(|id| id.index), Some(2));
        tokio::io::AsyncReadExt::read_to_end(&mut again.snapshot, &mut bytes)
            .await
            .expect("the second write is whole");
        assert_eq!(machine.snapshot_counts(), (0, 1));
        Ok(())
    }

    /// The snapshot folder's snapshot files (written or being written), sorted.
    fn snapshot_files(directory: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(directory.join("snapshots"))
            .expect("the folder")
            .map(|entry| {
                entry
                    .expect("an entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .filter(|name| name != "empty" && !name.starts_with("receiving-"))
            .collect();
        names.sort();
        names
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_snapshots_asked_for_but_never_read_then_no_file_is_written_until_one_is_read()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        let (_store, mut machine) = open(directory.path());
        machine.apply(vec![append(1, &[("a", "a0")])]).await?;
        machine.get_current_snapshot().await?;
        // openraft asks for a replica that turns out to be down: nothing reads it.
        let unread = machine.get_current_snapshot().await?.expect("a snapshot");
        machine.apply(vec![append(2, &[("a", "a1")])]).await?;
        machine
            .get_snapshot_builder()
            .await
            .build_snapshot()
            .await?;
        drop(unread);
        // Asked again after a new mark: captured again, the first capture dropped unwritten.
        let mut sent = machine.get_current_snapshot().await?.expect("a snapshot");
        assert_eq!(sent.meta.last_log_id.map(|id| id.index), Some(2));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while snapshot_files(directory.path()).len() > 1 {
            assert!(
                std::time::Instant::now() < deadline,
                "the first capture's part stays: {:?}",
                snapshot_files(directory.path())
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let files = snapshot_files(directory.path());
        assert!(
            files.len() == 1
                && Path::new(&files[0])
                    .extension()
                    .is_some_and(|extension| extension == "part"),
            "only the pending capture's head: {files:?}"
        );
        assert_eq!(machine.snapshot_counts(), (0, 0), "no file written unread");
        // Read (a replica answered): written whole, at the capture.
        let (replica_directory, mut replica) = {
            let replica_directory = tempfile::tempdir().expect("a directory");
            let (replica_store, replica) = open(replica_directory.path());
            drop(replica_store);
            (replica_directory, replica)
        };
        let received = receive(&mut replica, &mut sent).await;
        assert_eq!(machine.snapshot_counts(), (0, 1));
        replica.install_snapshot(&sent.meta, received).await?;
        assert_eq!(replica.applied_state().await?.0, sent.meta.last_log_id);
        drop((replica, replica_directory));
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_an_install_cut_short_by_a_stop_when_reopened_then_it_is_installed_again_whole()
    -> Result<(), StorageError> {
        let (one, two) = (
            tempfile::tempdir().expect("a directory"),
            tempfile::tempdir().expect("a directory"),
        );
        let (_store, mut machine) = open(one.path());
        machine
            .apply(vec![append(1, &[("a", "a0"), ("a", "a1")])])
            .await?;
        machine.get_current_snapshot().await?;
        let mut sent = machine.get_current_snapshot().await?.expect("a snapshot");
        {
            let (replica_store, mut replica) = open(two.path());
            replica
                .apply(vec![append(1, &[("a", "stale"), ("c", "gone")])])
                .await?;
            // Received and recorded as being installed; the stop came after the first queue
            // of the shard was deleted.
            let received = receive(&mut replica, &mut sent).await;
            let record = SnapshotRecord {
                meta: sent.meta.clone(),
                file: "installing-1.snap".to_owned(),
            };
            std::fs::rename(received.path(), replica.snapshot_path(&record.file)).expect("renamed");
            replica.log.write_meta(INSTALLING_KEY, &record)?;
            replica_store.delete_queue(b"c").expect("deleted");
        }
        let (replica_store, mut replica) = open(two.path());
        assert_eq!(messages(&replica_store, "a"), ["a0", "a1"]);
        assert!(replica_store.queue_info(b"c").expect("info").is_none());
        assert_eq!(replica.applied_state().await?.0, sent.meta.last_log_id);
        assert_eq!(replica.snapshot_counts(), (1, 0));
        assert!(
            replica
                .log
                .read_meta::<SnapshotRecord>(INSTALLING_KEY)?
                .is_none()
        );
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_delayed_entries_when_their_slots_come_due_then_replicas_deliver_them_alike_across_a_restart()
    -> Result<(), StorageError> {
        use levee_broker::delay::{COARSE_MS, FINE_MS, HORIZON_MS, SPREAD_AHEAD_MS};
        let now = 1_000_000;
        let far = now + HORIZON_MS + 2 * COARSE_MS;
        let entries = [
            delay(1, now, &[(now, "now"), (now + 50, "soon"), (far, "far")]),
            // Nothing due yet; the fine slots up to `now + 30` are taken all the same.
            deliver(2, now + 30),
            // A proposer whose clock is behind: its entry's slot was taken, so it goes at once.
            delay(
                3,
                now + 20,
                &[(now + 25, "late-clock"), (now + 20, "at-once")],
            ),
            deliver(4, now + 100),
            deliver(5, far - SPREAD_AHEAD_MS),
            deliver(6, far + FINE_MS),
        ];
        let one = tempfile::tempdir().expect("a directory");
        let two = tempfile::tempdir().expect("a directory");
        let (store, mut machine) = open(one.path());
        let mut answers = Vec::new();
        for entry in &entries {
            answers.extend(machine.apply(vec![entry.clone()]).await?);
        }
        assert_eq!(
            answers[0],
            ShardResponse::Appended {
                offsets: vec![0, 0, 0]
            },
            "the first at once (offset 0), the others wait"
        );
        assert_eq!(
            answers[2],
            ShardResponse::Appended {
                offsets: vec![1, 2]
            }
        );
        let delivered = ["now", "late-clock", "at-once", "soon", "far"];
        assert_eq!(messages(&store, "t"), delivered);
        assert!(slots(&store).is_empty(), "every slot deleted");
        assert_eq!(machine.next_due_ms(), None);
        // Another replica, restarted before the late clock's entry: its marks come back with
        // it, so it places that entry at once too, and delivers alike.
        {
            let (_, mut replica) = open(two.path());
            replica.apply(entries[..2].to_vec()).await?;
            assert_eq!(replica.delayed_waiting(), 2);
        }
        let (replica_store, mut replica) = open(two.path());
        assert_eq!(replica.delayed_waiting(), 2, "the slots found again");
        assert_eq!(replica.next_due_ms(), Some(now + 60));
        replica.apply(entries[2..].to_vec()).await?;
        assert_eq!(messages(&replica_store, "t"), delivered);
        assert!(slots(&replica_store).is_empty());
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_delivery_cut_short_by_a_crash_when_reopened_then_it_is_finished_once()
    -> Result<(), StorageError> {
        let now = 5_000_000;
        let entries = [
            delay(1, now, &[(now + 5, "a"), (now + 6, "b"), (now + 7, "c")]),
            deliver(2, now + 20),
        ];
        // What a replica that was not cut short recorded for the delivery.
        let whole = tempfile::tempdir().expect("a directory");
        let (whole_store, mut reference) = open(whole.path());
        reference.apply(entries.to_vec()).await?;
        assert_eq!(messages(&whole_store, "t"), ["a", "b", "c"]);
        let record: Applying = reference.log.read_meta(APPLYING_KEY)?.expect("a record");
        assert!(record.delivered.is_some(), "{record:?}");
        let directory = tempfile::tempdir().expect("a directory");
        {
            let (store, mut machine) = open(directory.path());
            machine.apply(vec![entries[0].clone()]).await?;
            // The delivery's record written, and only its first message stored, when the
            // process died.
            machine
                .log
                .write_entries(std::iter::once(entries[1].clone()))?;
            machine.log.write_meta(APPLYING_KEY, &record)?;
            store.append(b"t", b"a").expect("an append");
            store.sync().expect("a sync");
            assert_eq!(slots(&store).len(), 1);
        }
        let (store, mut reopened) = open(directory.path());
        assert_eq!(messages(&store, "t"), ["a", "b", "c"]);
        assert!(slots(&store).is_empty(), "the slot deleted once delivered");
        assert_eq!(reopened.delayed_waiting(), 0);
        assert_eq!(
            reopened.applied_state().await?.0.map(|id| id.index),
            Some(2)
        );
        drop((store, reopened));
        let (store, _) = open(directory.path());
        assert_eq!(messages(&store, "t"), ["a", "b", "c"], "nothing twice");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_largest_message_when_delayed_then_one_due_is_taken_and_one_waiting_refused_whole()
    -> Result<(), StorageError> {
        let directory = tempfile::tempdir().expect("a directory");
        let (store, mut machine) = open(directory.path());
        let largest = "x".repeat(store.options().message_bytes_max);
        let now = 9_000_000;
        let answers = machine
            .apply(vec![
                // Due at once: appended to its target as a lone server would, at full size.
                delay(1, now, &[(now, &largest)]),
                // Waiting: its slot's message (the entry) would pass the limit: refused, and
                // nothing of its entry stored.
                delay(2, now, &[(now, "small"), (now + 50, &largest)]),
            ])
            .await?;
        assert_eq!(answers[0], ShardResponse::Appended { offsets: vec![0] });
        assert!(
            matches!(&answers[1], ShardResponse::Refused { code: RefusedCode::Invalid, reason } if reason.contains("bytes")),
            "{:?}",
            answers[1]
        );
        assert_eq!(messages(&store, "t").len(), 1);
        assert!(slots(&store).is_empty());
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn given_a_slot_larger_than_one_delivery_then_it_is_delivered_in_parts_across_a_crash()
    -> Result<(), StorageError> {
        use crate::shard::plan::DELIVER_MESSAGES_MAX;
        let now = 7_000_000;
        let bodies: Vec<String> = (0..DELIVER_MESSAGES_MAX * 5 / 2)
            .map(|number| format!("m{number}"))
            .collect();
        // Every entry due in one fine slot, written in entries of 5,000.
        let mut entries: Vec<Entry<ShardConfig>> = bodies
            .chunks(5_000)
            .enumerate()
            .map(|(index, chunk)| {
                let chunk: Vec<(u64, &str)> =
                    chunk.iter().map(|body| (now + 5, body.as_str())).collect();
                delay(index as u64 + 1, now, &chunk)
            })
            .collect();
        let first_deliver = entries.len() as u64 + 1;
        for offset in 0..3 {
            entries.push(deliver(first_deliver + offset, now + 20 + offset));
        }
        let delivers = entries.len() - 3;
        // A replica that applies everything: 10,000 at a time, due again at once in between.
        let whole = tempfile::tempdir().expect("a directory");
        let (whole_store, mut reference) = open(whole.path());
        reference.apply(entries[..=delivers].to_vec()).await?;
        assert_eq!(messages(&whole_store, "t").len(), DELIVER_MESSAGES_MAX);
        assert!(
            reference.next_due_ms().is_some_and(|due| due <= now + 20),
            "the rest is due at once"
        );
        reference.apply(vec![entries[delivers + 1].clone()]).await?;
        let record: Applying = reference.log.read_meta(APPLYING_KEY)?.expect("a record");
        assert!(
            record
                .delivered
                .as_ref()
                .is_some_and(|delivered| delivered.partial_before.is_some()),
            "{record:?}"
        );
        reference.apply(vec![entries[delivers + 2].clone()]).await?;
        assert_eq!(messages(&whole_store, "t"), bodies);
        assert!(slots(&whole_store).is_empty());
        assert_eq!(reference.next_due_ms(), None);
        // Another whose second delivery was cut short by a crash, one message in.
        let directory = tempfile::tempdir().expect("a directory");
        {
            let (store, mut machine) = open(directory.path());
            machine.apply(entries[..=delivers].to_vec()).await?;
            machine
                .log
                .write_entries(std::iter::once(entries[delivers + 1].clone()))?;
            machine.log.write_meta(APPLYING_KEY, &record)?;
            store
                .append(b"t", bodies[DELIVER_MESSAGES_MAX].as_bytes())
                .expect("an append");
            store.sync().expect("a sync");
        }
        let (store, mut reopened) = open(directory.path());
        assert_eq!(messages(&store, "t").len(), 2 * DELIVER_MESSAGES_MAX);
        reopened.apply(vec![entries[delivers + 2].clone()]).await?;
        assert_eq!(messages(&store, "t"), bodies, "each once, in order");
        assert!(slots(&store).is_empty());
        Ok(())
    }

    /// One step of [`delayed_entries_are_placed_and_delivered_alike_on_every_replica`].
    #[derive(Debug, Clone)]
    enum Step {
        /// Entries due `delays` ms after the clock of a proposer `behind` ms behind the time
        /// of the last delivery (so some are due before it: their slots were taken).
        Delay { behind: u64, delays: Vec<u64> },
        /// A delivery, after the time moved on this many ms.
        Deliver { advance: u64 },
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            (
                0_u64..60,
                proptest::collection::vec(
                    prop_oneof![0_u64..1, 0_u64..60, 0_u64..200, 100_000_u64..400_000],
                    1..6
                )
            )
                .prop_map(|(behind, delays)| Step::Delay { behind, delays }),
            prop_oneof![0_u64..40, 1_000_u64..90_000].prop_map(|advance| Step::Deliver { advance }),
        ]
    }

    /// The log entries of `steps` from `now`, the last a delivery after everything is due.
    fn step_entries(steps: &[Step], mut now: u64) -> Vec<Entry<ShardConfig>> {
        let mut entries = Vec::new();
        let mut number = 0;
        for step in steps {
            let index = entries.len() as u64 + 1;
            match step {
                Step::Delay { behind, delays } => {
                    let clock = now.saturating_sub(*behind);
                    let bodies: Vec<(u64, String)> = delays
                        .iter()
                        .map(|delay| {
                            number += 1;
                            (clock + delay, format!("{number}@{}", clock + delay))
                        })
                        .collect();
                    let borrowed: Vec<(u64, &str)> = bodies
                        .iter()
                        .map(|(due, body)| (*due, body.as_str()))
                        .collect();
                    entries.push(delay(index, clock, &borrowed));
                }
                Step::Deliver { advance } => {
                    now += advance;
                    entries.push(deliver(index, now));
                }
            }
        }
        entries.push(deliver(entries.len() as u64 + 1, now + 1_000_000));
        entries
    }

    /// Applies `entries` one at a time on a machine in `directory`, checking that no delivery
    /// appends an entry due after its time; the target's messages.
    async fn apply_one_by_one(
        directory: &std::path::Path,
        entries: &[Entry<ShardConfig>],
    ) -> Vec<String> {
        let (store, mut machine) = open(directory);
        for entry in entries {
            let before = messages(&store, "t").len();
            machine.apply(vec![entry.clone()]).await.expect("applied");
            if let EntryPayload::Normal(ShardCommand::Deliver { now_ms }) = &entry.payload {
                for body in &messages(&store, "t")[before..] {
                    let due: u64 = body.split('@').nth(1).unwrap().parse().unwrap();
                    assert!(due <= *now_ms, "{body} delivered at {now_ms}");
                }
            }
        }
        assert!(slots(&store).is_empty(), "every slot delivered");
        messages(&store, "t")
    }

    /// Applies `entries` on a replica in `replica` that applied the first `stale` of them,
    /// then installed the snapshot a machine in `source` took after the first `snapshot_at`;
    /// the target's messages.
    async fn apply_from_a_snapshot(
        (source, replica): (&std::path::Path, &std::path::Path),
        entries: &[Entry<ShardConfig>],
        (stale, snapshot_at): (usize, usize),
    ) -> Vec<String> {
        let snapshot_at = snapshot_at.clamp(1, entries.len());
        let stale = stale.min(snapshot_at);
        let (_taken, mut taker) = open(source);
        taker
            .apply(entries[..snapshot_at].to_vec())
            .await
            .expect("applied");
        taker
            .get_current_snapshot()
            .await
            .expect("the start's look");
        let mut sent = taker
            .get_current_snapshot()
            .await
            .expect("a snapshot")
            .expect("one");
        let (store, mut behind) = open(replica);
        if stale > 0 {
            behind
                .apply(entries[..stale].to_vec())
                .await
                .expect("applied");
        }
        let received = receive(&mut behind, &mut sent).await;
        behind
            .install_snapshot(&sent.meta, received)
            .await
            .expect("installed");
        for entry in &entries[snapshot_at..] {
            behind.apply(vec![entry.clone()]).await.expect("applied");
        }
        assert!(slots(&store).is_empty(), "every slot delivered");
        messages(&store, "t")
    }

    /// Applies `entries` in batches of `batch` on a machine in `directory`, reopened after
    /// the first `restart_at`; the target's messages.
    async fn apply_with_a_restart(
        directory: &std::path::Path,
        entries: &[Entry<ShardConfig>],
        (batch, restart_at): (usize, usize),
    ) -> Vec<String> {
        let restart_at = restart_at.min(entries.len());
        {
            let (_, mut replica) = open(directory);
            for chunk in entries[..restart_at].chunks(batch) {
                replica.apply(chunk.to_vec()).await.expect("applied");
            }
        }
        let (store, mut replica) = open(directory);
        for chunk in entries[restart_at..].chunks(batch) {
            replica.apply(chunk.to_vec()).await.expect("applied");
        }
        assert!(slots(&store).is_empty(), "every slot delivered");
        messages(&store, "t")
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]

        /// Three replicas apply the same log: one entry at a time; in batches with a restart
        /// in between; and one that applied a part, then installed a snapshot another took
        /// later, then applied the rest. Their targets get the same messages in the same
        /// order, every entry exactly once, and no delivery appends an entry due after its
        /// time.
        #[test]
        fn delayed_entries_are_placed_and_delivered_alike_on_every_replica(
            steps in proptest::collection::vec(step(), 1..30),
            batch in 1_usize..6,
            restart_at in 0_usize..30,
            (stale, snapshot_at) in (0_usize..30, 1_usize..30),
        ) {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .build()
                .expect("a runtime");
            let entries = step_entries(&steps, 50_000_000);
            let (one, two) = (
                tempfile::tempdir().expect("a directory"),
                tempfile::tempdir().expect("a directory"),
            );
            let first = runtime.block_on(apply_one_by_one(one.path(), &entries));
            let second =
                runtime.block_on(apply_with_a_restart(two.path(), &entries, (batch, restart_at)));
            let (taker, three) = (
                tempfile::tempdir().expect("a directory"),
                tempfile::tempdir().expect("a directory"),
            );
            let third = runtime.block_on(apply_from_a_snapshot(
                (taker.path(), three.path()),
                &entries,
                (stale, snapshot_at),
            ));
            proptest::prop_assert_eq!(&first, &third);
            let placed: usize = steps
                .iter()
                .map(|step| match step {
                    Step::Delay { delays, .. } => delays.len(),
                    Step::Deliver { .. } => 0,
                })
                .sum();
            proptest::prop_assert_eq!(&first, &second);
            proptest::prop_assert_eq!(first.len(), placed);
            let unique: std::collections::BTreeSet<&String> = first.iter().collect();
            proptest::prop_assert_eq!(unique.len(), placed, "each entry once");
        }
    }
}
