//! [`Store`]: the public handle. Appends go into per-queue write buffers inside sharded maps;
//! the committer thread (see `committer/`) turns buffers into chunk records, writes them,
//! fsyncs and wakes the waiting appenders. Reads take chunk locations from the index under the
//! shard lock and read the chunks without it.
//!
//! This file owns the state the store's parts share ([`Inner`]: the lock shards of queues,
//! the pending lists, the commit state, the segments, the counters), opening and closing the
//! store, the queue catalog (info, listing, deletion), sync and flush, and the statistics.
//! The store's verbs each have a file of their own: appending in `append.rs`, reading in
//! `read.rs`, retention in `retention.rs`.

use std::collections::BTreeMap;
use std::collections::BinaryHeap;
use std::collections::HashMap;
use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::committer::{self, Writer};
use crate::error::{InputError, OpenError, OptionsError, WriteError};
use crate::format::{self, QUEUE_NAME_BYTES_MAX};
use crate::options::{StoreOptions, SyncPolicy};
use crate::queue::{ChunkEntry, QueueState, SpareBuffers, WriteBuffer};
use crate::recovery::{self, OpenReport};
use crate::storage::{OsStorage, Storage, StorageFile};

/// Number of lock shards of the queue map; a power of two.
pub(crate) const SHARD_COUNT: usize = 64;

pub(crate) type QueueMap = HashMap<Arc<[u8]>, QueueState, foldhash::fast::FixedState>;

/// One lock shard: the queues whose name hashes to it, and the log records appended to them
/// since the committer last took this shard's log.
#[derive(Debug)]
pub(crate) struct Shard {
    pub queues: QueueMap,
    /// Encoded log batch, trim and delete records, in the order they were appended.
    pub log: Vec<u8>,
    /// The log batch record open at the end of `log`, if any: appends add runs to it; it is
    /// sealed ([`Shard::seal_log`]) before anything else goes into `log` or `log` is read.
    pub open_log: Option<format::OpenLogBatch>,
    /// What each trim or delete record in `log` does once durable, in the same order.
    pub log_effects: Vec<RecordEffect>,
    /// Budget bytes reserved for `log`, given back once the committer wrote it.
    pub log_budget_bytes: usize,
    /// Queues whose unsealed messages reached `chunk_bytes` (`QueueState::direct_round` is
    /// `log_round`): the round that takes this log seals everything they logged through it
    /// into chunks, so their messages appended since they were listed have no log record.
    pub direct: Vec<QueueKey>,
    /// The commit round that will write `log`: set by the committer when it takes the log
    /// (to the next round), so an appender knows exactly which round makes its record
    /// durable.
    pub log_round: u64,
    /// Write buffers that commit rounds emptied in this shard, kept for its next queues
    /// that need one (see [`SpareBuffers`]).
    pub spare: SpareBuffers,
}

impl Default for Shard {
    fn default() -> Self {
        Self {
            queues: QueueMap::default(),
            log: Vec::new(),
            open_log: None,
            log_effects: Vec::new(),
            log_budget_bytes: 0,
            direct: Vec::new(),
            // Rounds are numbered from 1.
            log_round: 1,
            spare: SpareBuffers::default(),
        }
    }
}

impl Shard {
    /// Seals the open log batch record, if any, so that `log` holds only whole records.
    pub fn seal_log(&mut self) {
        if let Some(open) = self.open_log.take() {
            format::seal_log_batch(&mut self.log, open);
        }
    }
}

/// Names one incarnation of a queue in the committer's lists.
#[derive(Debug, Clone)]
pub(crate) struct QueueKey {
    pub name: Arc<[u8]>,
    pub incarnation: u64,
}

/// A queue on the buffered list, with a round no later than the one whose log records hold its
/// oldest unsealed message: the committer's log floor (FORMAT.md, floor record) is computed
/// from these.
#[derive(Debug, Clone)]
pub(crate) struct Listed {
    pub key: QueueKey,
    pub since_round: u64,
}

/// What a trim or delete record does once it is durable: `dead` chunks stop counting as live,
/// and for a trim the queue's `trim_segment` moves to where the record went.
#[derive(Debug)]
pub(crate) struct RecordEffect {
    pub dead: Vec<(u32, u64)>,
    pub trim_of: Option<QueueKey>,
}

#[derive(Debug, Default)]
pub(crate) struct Pending {
    /// Every queue with a write buffer (flag `QueueState::queued`), oldest buffer first; the
    /// budget flushes seal from the front, a checkpoint seals them all.
    pub buffered: VecDeque<Listed>,
    /// `sync`, `enforce_retention`: seal every buffer into chunks in the next round.
    pub checkpoint_requested: bool,
    pub budget_flush_requested: bool,
    pub shutdown: bool,
}

#[derive(Debug, Default)]
pub(crate) struct CommitState {
    pub completed: u64,
    /// Recent rounds that failed, with the error their waiters get.
    pub failures: Vec<(u64, WriteError)>,
    pub poisoned: Option<String>,
}

/// Most failed rounds remembered for late waiters.
pub(crate) const FAILURES_MAX: usize = 64;

#[derive(Debug)]
pub(crate) struct SegmentEntry {
    pub file: Arc<dyn StorageFile>,
    /// Chunks of this segment still in the index.
    pub live_chunks: u64,
    /// Chunk records ever written to this segment.
    pub chunks_total: u64,
}

/// Counters the bench and the server export.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub file_syncs: AtomicU64,
    pub dir_syncs: AtomicU64,
    pub bytes_written: AtomicU64,
    pub rounds: AtomicU64,
    pub segments_deleted: AtomicU64,
    pub chunks_relocated: AtomicU64,
    pub budget_flushes: AtomicU64,
    pub checkpoints: AtomicU64,
    pub late_round_waits: AtomicU64,
}

#[derive(Debug)]
pub(crate) struct Inner {
    /// As opened; the sync policy in force is `sync` ([`Store::set_sync_policy`]).
    pub options: StoreOptions,
    /// The sync policy in force, encoded by [`encode_sync`].
    pub sync: AtomicU64,
    pub storage: Arc<dyn Storage>,
    pub hasher: foldhash::fast::FixedState,
    pub shards: Box<[Mutex<Shard>]>,
    pub pending: Mutex<Pending>,
    pub work: Condvar,
    pub commit: Mutex<CommitState>,
    pub committed: Condvar,
    pub segments: Mutex<BTreeMap<u32, SegmentEntry>>,
    pub rounds_started: AtomicU64,
    /// Highest round completed (successfully or not; a failed round's messages are rolled
    /// back or kept unacknowledged before it is marked complete).
    pub completed_round: AtomicU64,
    /// Runs of log records appended to shard logs since the committer last took them.
    pub log_pending: AtomicU64,
    /// The committer is (about to be) waiting for work; appenders under `always` wake it.
    pub committer_sleeping: AtomicBool,
    /// Highest round any caller waits for; the committer runs rounds until it is reached.
    pub wanted_round: AtomicU64,
    pub buffered_bytes: AtomicUsize,
    /// The part of `buffered_bytes` that is shard logs not yet taken by a round: a budget
    /// flush only takes the logs when they hold a large share (see `Committer::next_plan`).
    pub unwritten_log_bytes: AtomicUsize,
    /// Message bytes appended to queues on a direct list since the committer last took the
    /// lists (about: a trigger, not an account). Under `interval`, past
    /// `append::DIRECT_ROUND_DIVISOR` of the budget an append asks for the next round at once.
    pub direct_unwritten_bytes: AtomicUsize,
    /// A budget flush was asked for (early, past `append::BUDGET_SOFT_FRACTION` of the
    /// budget, or by an append that found the budget full); the committer clears it after
    /// each round, so appends ask at most once per round.
    pub flush_soon: AtomicBool,
    pub next_incarnation: AtomicU64,
    /// Under `interval`, a write failed for lack of space: appends are refused until the
    /// committer writes the buffered data.
    pub disk_full: AtomicBool,
    /// Set (after `CommitState::poisoned`) when the store is poisoned.
    pub poisoned: AtomicBool,
    /// Time base of `durable_through_ms`.
    pub opened: Instant,
    /// Under `interval`: ms since `opened` before which every append is fsynced (the start
    /// of the last completed full round, or the last moment nothing was buffered).
    pub durable_through_ms: AtomicU64,
    pub counters: Counters,
    /// Run by the committer before each write of appended messages ([`Store::set_write_barrier`]).
    pub write_barrier: Barrier,
}

/// What the committer runs before it writes appended messages to a segment file: something
/// that must be durable before they are (see [`Store::set_write_barrier`]).
pub type WriteBarrier = Arc<dyn Fn() -> std::io::Result<()> + Send + Sync>;

/// The store's [`WriteBarrier`], if one is set.
#[derive(Default)]
pub(crate) struct Barrier(Mutex<Option<WriteBarrier>>);

impl std::fmt::Debug for Barrier {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = lock(&self.0).is_some();
        formatter
            .debug_struct("Barrier")
            .field("set", &set)
            .finish()
    }
}

impl Barrier {
    /// Runs the barrier, if one is set.
    pub(crate) fn run(&self) -> std::io::Result<()> {
        let barrier = lock(&self.0).clone();
        barrier.map_or(Ok(()), |barrier| barrier())
    }
}

/// Locks a mutex, ignoring poisoning: every critical section leaves its data consistent
/// before it can panic (the only panics are assertions on invariants).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// First retained offset and length of one queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueInfo {
    /// First offset still retained.
    pub first_offset: u64,
    /// Offset the next appended message gets (the queue's length counted from 0), including
    /// appends still waiting for their fsync.
    pub next_offset: u64,
}

impl QueueInfo {
    /// Messages retained.
    pub fn retained(&self) -> u64 {
        self.next_offset - self.first_offset
    }
}

/// Counters and sizes for monitoring and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StoreStats {
    /// Queues that exist.
    pub queues: u64,
    /// Segment files.
    pub segments: u64,
    /// Bytes of all segment files.
    pub disk_bytes: u64,
    /// Bytes written since open.
    pub bytes_written: u64,
    /// fsyncs of segment files since open.
    pub file_syncs: u64,
    /// fsyncs of the directory since open.
    pub dir_syncs: u64,
    /// Group-commit rounds since open.
    pub commit_rounds: u64,
    /// Segment files deleted since open.
    pub segments_deleted: u64,
    /// Live chunks copied out of old segments so those could be deleted, since open.
    pub chunks_relocated: u64,
    /// Rounds since open that answered a full (or nearly full) buffer budget, by writing the
    /// logs or sealing the oldest buffers. Many of them at many queues mean small chunks: a
    /// larger `buffer_budget_bytes` makes larger chunks and a smaller index.
    pub budget_flushes: u64,
    /// Rounds since open that sealed every write buffer (`sync`, retention, close, or to free
    /// a segment kept only by log records).
    pub checkpoints: u64,
    /// Append calls (one per `append`, or per `append_batch` whatever its size) under
    /// `interval` since open that waited because the last completed round started more than
    /// two intervals earlier: the committer, or the disk's fsyncs, did not keep up with the
    /// interval, and appenders were held back so that an acknowledged message stays durable
    /// within about two intervals.
    pub late_round_waits: u64,
    /// Bytes buffered in memory, not yet written.
    pub buffered_bytes: u64,
}

/// Memory the store holds, by part (see docs/ARCHITECTURE-store.md for the arithmetic).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryUsage {
    /// Queues counted.
    pub queues: u64,
    /// Chunk entries in the sparse index.
    pub index_entries: u64,
    /// Bytes of index entries (capacity included).
    pub index_bytes: u64,
    /// Bytes of write buffers (capacity included).
    pub buffer_bytes: u64,
    /// Bytes of emptied write buffers kept for reuse while appends keep coming (boxes and
    /// capacity; at most half the buffer budget; freed once nothing was appended for a fifth
    /// of a second).
    pub spare_buffer_bytes: u64,
    /// Bytes of queue states, names and hash-map slots.
    pub queue_bytes: u64,
    /// All of the above.
    pub total_bytes: u64,
}

/// The queue store. See the crate docs for how it works.
pub struct Store {
    pub(crate) inner: Arc<Inner>,
    committer: Option<JoinHandle<()>>,
}

pub(crate) fn check_name(queue: &[u8]) -> Result<(), InputError> {
    if queue.is_empty() || queue.len() > QUEUE_NAME_BYTES_MAX {
        return Err(InputError::QueueName(queue.len()));
    }
    Ok(())
}

impl Store {
    /// Opens (or creates) the store in directory `directory` and recovers it.
    pub fn open(
        directory: impl AsRef<Path>,
        options: StoreOptions,
    ) -> Result<(Store, OpenReport), OpenError> {
        let storage = OsStorage::new(directory.as_ref())
            .map_err(|source| OpenError::Io {
                operation: format!("creating directory {}", directory.as_ref().display()),
                source,
            })?
            .with_direct_writes(options.direct_writes);
        Self::open_with_storage(Arc::new(storage), options)
    }

    /// Opens the store on any [`Storage`], such as [`crate::SimulatedDisk`].
    pub fn open_with_storage(
        storage: Arc<dyn Storage>,
        options: StoreOptions,
    ) -> Result<(Store, OpenReport), OpenError> {
        options.validate()?;
        let recovered = recovery::recover(storage.as_ref(), &options)?;
        let inner = Arc::new(Inner {
            sync: AtomicU64::new(encode_sync(options.sync)),
            options,
            storage,
            hasher: shard_hasher(),
            shards: recovered.shards.into_iter().map(Mutex::new).collect(),
            pending: Mutex::new(Pending {
                buffered: recovered.buffered,
                ..Pending::default()
            }),
            work: Condvar::new(),
            commit: Mutex::new(CommitState::default()),
            committed: Condvar::new(),
            segments: Mutex::new(recovered.segments),
            rounds_started: AtomicU64::new(0),
            completed_round: AtomicU64::new(0),
            log_pending: AtomicU64::new(0),
            committer_sleeping: AtomicBool::new(false),
            wanted_round: AtomicU64::new(0),
            buffered_bytes: AtomicUsize::new(recovered.buffered_bytes),
            unwritten_log_bytes: AtomicUsize::new(0),
            direct_unwritten_bytes: AtomicUsize::new(0),
            flush_soon: AtomicBool::new(false),
            next_incarnation: AtomicU64::new(recovered.next_incarnation),
            disk_full: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            opened: Instant::now(),
            durable_through_ms: AtomicU64::new(0),
            counters: Counters::default(),
            write_barrier: Barrier::default(),
        });
        inner
            .counters
            .file_syncs
            .store(recovered.file_syncs, Ordering::Relaxed);
        inner
            .counters
            .dir_syncs
            .store(recovered.dir_syncs, Ordering::Relaxed);
        let writer = Writer::new(
            recovered.active_segment,
            recovered.active_file,
            recovered.active_bytes,
        );
        let log_floor = recovered.log_floor;
        let floor = recovered.floor;
        let thread_inner = inner.clone();
        let committer = std::thread::Builder::new()
            .name("levee-store-committer".to_string())
            .spawn(move || committer::run_guarded(&thread_inner, writer, log_floor, floor))
            .map_err(|source| OpenError::Io {
                operation: "starting the committer thread".to_string(),
                source,
            })?;
        Ok((
            Store {
                inner,
                committer: Some(committer),
            },
            recovered.report,
        ))
    }

    /// First retained offset and next offset of `queue`, or `None` if it does not exist.
    pub fn queue_info(&self, queue: &[u8]) -> Result<Option<QueueInfo>, InputError> {
        check_name(queue)?;
        let shard = lock(self.inner.shard(queue));
        Ok(shard.queues.get(queue).map(|state| QueueInfo {
            first_offset: state.first_offset,
            next_offset: state.next_offset,
        }))
    }

    /// Up to `limit` queue names after `after` (`None`: from the start), in byte order; pass
    /// the last name of a page as `after` to get the next page. Queues created or deleted
    /// meanwhile may or may not show.
    pub fn list_queues(&self, after: Option<&[u8]>, limit: usize) -> Vec<Vec<u8>> {
        self.list_queues_with_prefix(after, b"", limit)
    }

    /// [`Store::list_queues`] of the names that start with `prefix`. A page is one pass over
    /// every queue name (each shard under its lock in turn), keeping the `limit` smallest in
    /// a heap: a scan, not a lookup, so its cost grows with the queues held, not the page.
    pub fn list_queues_with_prefix(
        &self,
        after: Option<&[u8]>,
        prefix: &[u8],
        limit: usize,
    ) -> Vec<Vec<u8>> {
        if limit == 0 {
            return Vec::new();
        }
        // A max-heap of the smallest names seen: its top is the first to give way.
        let mut smallest: BinaryHeap<Arc<[u8]>> = BinaryHeap::with_capacity(limit + 1);
        for shard in &self.inner.shards {
            let shard = lock(shard);
            for name in shard.queues.keys() {
                if !name.starts_with(prefix) || after.is_some_and(|after| **name <= *after) {
                    continue;
                }
                if smallest.len() < limit {
                    smallest.push(Arc::clone(name));
                } else if smallest.peek().is_some_and(|largest| **name < **largest) {
                    smallest.pop();
                    smallest.push(Arc::clone(name));
                }
            }
        }
        smallest
            .into_sorted_vec()
            .into_iter()
            .map(|name| name.to_vec())
            .collect()
    }

    /// Calls `visit` with the name of every queue that starts with `prefix`, one shard at a
    /// time under its lock (keep `visit` short). Every queue pays a prefix comparison: a
    /// scan, not a lookup.
    pub fn for_each_queue_with_prefix(&self, prefix: &[u8], mut visit: impl FnMut(&[u8])) {
        for shard in &self.inner.shards {
            let shard = lock(shard);
            for name in shard.queues.keys() {
                if name.starts_with(prefix) {
                    visit(name);
                }
            }
        }
    }

    /// Deletes `queue` and all its messages; returns whether it existed. Durable on return
    /// under both sync policies. A new queue of the same name starts again at offset 0. On an
    /// error from a full disk the queue is already gone for readers and writers and its
    /// delete record is written again by the next round that succeeds; a crash before that
    /// brings the queue back whole: retry the delete once space returns.
    pub fn delete_queue(&self, queue: &[u8]) -> Result<bool, WriteError> {
        check_name(queue)?;
        self.inner.check_writable()?;
        let round = {
            let mut shard = lock(self.inner.shard(queue));
            let Some(state) = shard.queues.remove(queue) else {
                return Ok(false);
            };
            if let Some(buffer) = &state.buffer {
                self.inner
                    .buffered_bytes
                    .fetch_sub(buffer.budget_bytes(), Ordering::SeqCst);
            }
            let dead = count_by_segment(state.chunks.iter());
            shard.seal_log();
            format::encode_delete(&mut shard.log, queue);
            self.inner.push_record(
                &mut shard,
                RecordEffect {
                    dead,
                    trim_of: None,
                },
            )
        };
        self.inner.wait_round(round)?;
        Ok(true)
    }

    /// Creates `queue` empty, the first message appended to it to get `next_offset`: a
    /// replica importing a queue from another's copy keeps its offsets. Returns whether it was
    /// created (`false`: a queue of that name exists, and is left as it is). Durable on return
    /// under both sync policies (a trim record at `next_offset`, kept as long as the queue has
    /// no chunk, like a trimmed queue's). Messages appended afterwards follow as usual.
    pub fn create_queue_at(&self, queue: &[u8], next_offset: u64) -> Result<bool, WriteError> {
        check_name(queue)?;
        self.inner.check_writable()?;
        let round = {
            let mut shard = lock(self.inner.shard(queue));
            if shard.queues.contains_key(queue) {
                return Ok(false);
            }
            let incarnation = self.inner.next_incarnation.fetch_add(1, Ordering::Relaxed);
            let name: Arc<[u8]> = Arc::from(queue);
            shard.queues.insert(
                name.clone(),
                QueueState::new(name.clone(), incarnation, next_offset),
            );
            shard.seal_log();
            format::encode_trim(&mut shard.log, queue, next_offset);
            self.inner.push_record(
                &mut shard,
                RecordEffect {
                    dead: Vec::new(),
                    trim_of: Some(QueueKey { name, incarnation }),
                },
            )
        };
        self.inner.wait_round(round)?;
        Ok(true)
    }

    /// Writes and fsyncs everything appended so far, and seals every write buffer into
    /// chunk records (a checkpoint: afterwards no queue holds a buffer unless appended to
    /// meanwhile). Costs one pass over the queues with buffers.
    pub fn sync(&self) -> Result<(), WriteError> {
        self.inner.check_poisoned()?;
        let round = {
            let mut pending = lock(&self.inner.pending);
            pending.checkpoint_requested = true;
            self.inner.work.notify_one();
            self.inner.rounds_started.load(Ordering::SeqCst) + 1
        };
        self.inner.wait_round(round)
    }

    /// Blocks until every append acknowledged before the call is fsynced: one commit round,
    /// started at once (under [`SyncPolicy::Interval`](crate::SyncPolicy::Interval), instead
    /// of within the interval). Unlike [`Store::sync`] it seals no write buffer into chunks:
    /// the messages are durable in the round's log records, and the buffers go on growing
    /// into full chunks.
    pub fn flush(&self) -> Result<(), WriteError> {
        self.inner.check_poisoned()?;
        // Each shard's log goes out in its `log_round`: the highest covers every append so far.
        let round = self
            .inner
            .shards
            .iter()
            .map(|shard| lock(shard).log_round)
            .max()
            .unwrap_or(1);
        self.inner.wait_round(round)
    }

    /// The options the store was opened with.
    pub fn options(&self) -> &StoreOptions {
        &self.inner.options
    }

    /// The sync policy in force: the options' until [`Store::set_sync_policy`] changes it.
    pub fn sync_policy(&self) -> SyncPolicy {
        self.inner.sync()
    }

    /// Changes the sync policy of the open store. Appends that already wait for their
    /// round keep waiting for it; from then on appends, reads and the committer follow the
    /// new policy (a commit round started before the change finishes under the old one). A
    /// node whose queues are rebuilt from elsewhere after a crash (a replicated cluster's,
    /// from its shards' Raft logs) sets `interval` so that the store's copy is fsynced
    /// lazily. Refuses an interval outside 1 to [`crate::SYNC_INTERVAL_MS_MAX`] ms.
    pub fn set_sync_policy(&self, policy: SyncPolicy) -> Result<(), OptionsError> {
        StoreOptions {
            sync: policy,
            ..self.inner.options.clone()
        }
        .validate()?;
        // Late-round back-pressure under `interval` measures from the last durable moment.
        self.inner
            .durable_through_ms
            .fetch_max(self.inner.elapsed_ms(), Ordering::Release);
        self.inner.sync.store(encode_sync(policy), Ordering::SeqCst);
        self.inner.wake_committer();
        Ok(())
    }

    /// Sets what the committer runs before each write of appended messages to a segment file
    /// (the messages of a round, written once or in parts): every message appended before
    /// the barrier was called reaches the disk only after the barrier returned `Ok`. An error
    /// fails the round as a failed write (other than for lack of space) does: nothing of it is
    /// written and the store is poisoned ([`WriteError::Poisoned`], naming the error), since
    /// what it guards is not durable either. Replaces the barrier set before. A node's replicated shards set one
    /// that fsyncs their logs' apply records, so that the store never holds on disk a message
    /// whose apply record a crash could take back (docs/CLUSTER.md, "The state machine").
    pub fn set_write_barrier(&self, barrier: WriteBarrier) {
        *lock(&self.inner.write_barrier.0) = Some(barrier);
    }

    /// Counters and sizes.
    pub fn stats(&self) -> StoreStats {
        let counters = &self.inner.counters;
        let (segments, disk_bytes) = {
            let segments = lock(&self.inner.segments);
            let bytes = segments
                .values()
                .filter_map(|segment| segment.file.len().ok())
                .sum();
            (segments.len() as u64, bytes)
        };
        let queues = self
            .inner
            .shards
            .iter()
            .map(|shard| lock(shard).queues.len() as u64)
            .sum();
        StoreStats {
            queues,
            segments,
            disk_bytes,
            bytes_written: counters.bytes_written.load(Ordering::Relaxed),
            file_syncs: counters.file_syncs.load(Ordering::Relaxed),
            dir_syncs: counters.dir_syncs.load(Ordering::Relaxed),
            commit_rounds: counters.rounds.load(Ordering::Relaxed),
            segments_deleted: counters.segments_deleted.load(Ordering::Relaxed),
            chunks_relocated: counters.chunks_relocated.load(Ordering::Relaxed),
            budget_flushes: counters.budget_flushes.load(Ordering::Relaxed),
            checkpoints: counters.checkpoints.load(Ordering::Relaxed),
            late_round_waits: counters.late_round_waits.load(Ordering::Relaxed),
            buffered_bytes: self.inner.buffered_bytes.load(Ordering::Relaxed) as u64,
        }
    }

    /// Walks every queue and adds up the memory it holds (O(queues); for benchmarks and
    /// diagnostics, not for a hot path).
    pub fn memory_usage(&self) -> MemoryUsage {
        let mut usage = MemoryUsage::default();
        let slot_bytes = std::mem::size_of::<(Arc<[u8]>, QueueState)>() + 1;
        for shard in &self.inner.shards {
            let shard = lock(shard);
            usage.queue_bytes += (shard.queues.capacity() * slot_bytes) as u64;
            usage.spare_buffer_bytes += shard.spare.bytes() as u64;
            for (name, state) in &shard.queues {
                usage.queues += 1;
                usage.index_entries += state.chunks.len() as u64;
                usage.index_bytes += state.chunks.heap_bytes() as u64;
                let buffer = state.buffer.as_ref().map_or(0, |buffer| {
                    std::mem::size_of::<WriteBuffer>()
                        + buffer.data.capacity()
                        + buffer.positions.capacity() * std::mem::size_of::<(u64, u64)>()
                });
                usage.buffer_bytes += buffer as u64;
                // Name bytes plus the Arc's two counters.
                usage.queue_bytes += (name.len() + 16) as u64;
            }
        }
        usage.total_bytes =
            usage.index_bytes + usage.buffer_bytes + usage.spare_buffer_bytes + usage.queue_bytes;
        usage
    }

    /// Writes everything buffered, stops the committer and reports a fatal error, or a full
    /// disk that kept buffered messages from being written. Dropping the store does the same
    /// but cannot report.
    pub fn close(mut self) -> Result<(), WriteError> {
        self.shutdown();
        self.inner.check_poisoned()?;
        if self.inner.buffered_bytes.load(Ordering::SeqCst) > 0 {
            // Only a full disk leaves messages behind at close: they are lost with the process.
            return Err(WriteError::StorageFull {
                operation: "writing buffered messages at close".to_string(),
            });
        }
        Ok(())
    }

    fn shutdown(&mut self) {
        let Some(committer) = self.committer.take() else {
            return;
        };
        {
            let mut pending = lock(&self.inner.pending);
            pending.shutdown = true;
            self.inner.work.notify_all();
        }
        // A panic in the committer already poisoned the store; nothing more to report here.
        let _ = committer.join();
    }
}

impl std::fmt::Debug for Store {
    /// Options only: a store can hold millions of queues, which must not end up in a log line.
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Store")
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The hasher that picks a queue's lock shard (recovery uses the same one).
pub(crate) fn shard_hasher() -> foldhash::fast::FixedState {
    foldhash::fast::FixedState::with_seed(0x1e7e_e5e0)
}

/// The lock shard of `queue` under `hasher` (from [`shard_hasher`]).
pub(crate) fn shard_of(hasher: foldhash::fast::FixedState, queue: &[u8]) -> usize {
    use std::hash::BuildHasher;
    // Truncation is intended: only the low bits pick the shard.
    #[allow(clippy::cast_possible_truncation)]
    let hash = hasher.hash_one(queue) as usize;
    hash & (SHARD_COUNT - 1)
}

pub(crate) fn count_by_segment(chunks: impl Iterator<Item = ChunkEntry>) -> Vec<(u32, u64)> {
    let mut dead: Vec<(u32, u64)> = Vec::new();
    for chunk in chunks {
        match dead.last_mut() {
            Some((segment, count)) if *segment == chunk.segment => *count += 1,
            _ => dead.push((chunk.segment, 1)),
        }
    }
    dead
}

impl Inner {
    pub(crate) fn shard_index(&self, queue: &[u8]) -> usize {
        shard_of(self.hasher, queue)
    }

    pub(crate) fn shard(&self, queue: &[u8]) -> &Mutex<Shard> {
        &self.shards[self.shard_index(queue)]
    }

    /// The most memory (boxes and capacity) each shard keeps in emptied write buffers (see
    /// [`SpareBuffers`]):
    /// over all shards, half the buffer budget (a round can empty that much, and the next
    /// one refills it). Freed after a moment without appends.
    pub(crate) fn spare_bytes_max(&self) -> usize {
        self.options.buffer_budget_bytes / 2 / SHARD_COUNT
    }

    pub(crate) fn check_poisoned(&self) -> Result<(), WriteError> {
        // Fast path without the commit lock: every append passes here.
        if !self.poisoned.load(Ordering::Acquire) {
            return Ok(());
        }
        match &lock(&self.commit).poisoned {
            Some(reason) => Err(WriteError::Poisoned(reason.clone())),
            None => Ok(()),
        }
    }

    pub(crate) fn check_writable(&self) -> Result<(), WriteError> {
        self.check_poisoned()?;
        if self.disk_full.load(Ordering::SeqCst) {
            return Err(WriteError::StorageFull {
                operation: "waiting for buffered data to be written".to_string(),
            });
        }
        Ok(())
    }

    /// Wakes the committer if it is waiting for work. Callers first publish their work (an
    /// atomic or a list under the pending lock) and then call this: the committer sets
    /// `committer_sleeping` before it looks for work, so one of the two sees the other.
    pub(crate) fn wake_committer(&self) {
        if self.committer_sleeping.load(Ordering::SeqCst) {
            let _pending = lock(&self.pending);
            self.work.notify_one();
        }
    }

    /// Notes a trim or delete record just encoded at the end of `shard.log`; returns the
    /// round that makes it durable. Called under the shard lock.
    pub(crate) fn push_record(&self, shard: &mut Shard, effect: RecordEffect) -> u64 {
        shard.log_effects.push(effect);
        let round = shard.log_round;
        self.log_pending.fetch_add(1, Ordering::SeqCst);
        self.wake_committer();
        round
    }

    /// Milliseconds since the store was opened.
    pub(crate) fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Blocks until commit round `round` is done; its error if it failed.
    /// Whether commit round `round` is done (its error if it failed), without waiting.
    pub(crate) fn round_done(&self, round: u64) -> Result<bool, WriteError> {
        let commit = lock(&self.commit);
        if commit.completed >= round {
            return match commit.failures.iter().find(|(failed, _)| *failed == round) {
                Some((_, error)) => Err(error.clone()),
                None => Ok(true),
            };
        }
        match &commit.poisoned {
            Some(reason) => Err(WriteError::Poisoned(reason.clone())),
            None => Ok(false),
        }
    }

    pub(crate) fn wait_round(&self, round: u64) -> Result<(), WriteError> {
        // The message may have been frozen by the round already running (round - 1), and then
        // nothing else would start round `round`: make sure the committer runs it. Only the
        // first waiter of a round takes the pending lock.
        if self.wanted_round.fetch_max(round, Ordering::SeqCst) < round {
            self.wake_committer();
        }
        let mut commit = lock(&self.commit);
        loop {
            if commit.completed >= round {
                return match commit.failures.iter().find(|(failed, _)| *failed == round) {
                    Some((_, error)) => Err(error.clone()),
                    None => Ok(()),
                };
            }
            if let Some(reason) = &commit.poisoned {
                return Err(WriteError::Poisoned(reason.clone()));
            }
            commit = self
                .committed
                .wait(commit)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// A sync policy as one number: 0 for `always`, the interval plus one for `interval`.
fn encode_sync(policy: SyncPolicy) -> u64 {
    match policy {
        SyncPolicy::Always => 0,
        SyncPolicy::Interval { interval_ms } => interval_ms.saturating_add(1),
    }
}

impl Inner {
    /// The sync policy in force.
    pub(crate) fn sync(&self) -> SyncPolicy {
        match self.sync.load(Ordering::SeqCst) {
            0 => SyncPolicy::Always,
            encoded => SyncPolicy::Interval {
                interval_ms: encoded - 1,
            },
        }
    }
}
