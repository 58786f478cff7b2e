//! [`Store`]: the public handle. Appends go into per-queue write buffers inside sharded maps;
//! the committer thread (see `committer/`) turns buffers into chunk records, writes them,
//! fsyncs and wakes the waiting appenders. Reads take chunk locations from the index under the
//! shard lock and read the chunks without it.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::committer::{self, Writer};
use crate::error::{InputError, OpenError, ReadError, WriteError};
use crate::format::{self, QUEUE_NAME_BYTES_MAX, RECORD_HEADER_BYTES, Record};
use crate::options::{StoreOptions, SyncPolicy};
use crate::queue::{ChunkEntry, QueueState, SpareBuffers, WriteBuffer};
use crate::read::ReadBatch;
use crate::recovery::{self, OpenReport};
use crate::storage::{OsStorage, Storage, StorageFile};

/// Number of lock shards of the queue map; a power of two.
pub(crate) const SHARD_COUNT: usize = 64;
/// Most chunks one read visits.
const READ_CHUNKS_MAX: usize = 64;
/// The first `pread` of a chunk asks for this many times the queue's average record bytes per
/// message (times the chunk's messages); a longer record takes a second `pread`.
const READ_GUESS_SLACK: u64 = 2;
/// Smallest first `pread` of a chunk.
const READ_GUESS_BYTES_MIN: usize = 256;
/// Most bytes a read reserves up front for the messages it returns (it may grow past).
const READ_RESERVE_BYTES_MAX: usize = 1 << 20;
/// Most messages a read reserves room for up front (it may grow past).
const READ_RESERVE_MESSAGES_MAX: usize = 4096;
/// Under `interval`, appends wait while the last completed full round started more than this
/// many intervals ago: when rounds take longer than the interval (the committer is short of
/// CPU), appenders slow down instead of the interval promise silently slipping.
pub(crate) const INTERVAL_LATE_FACTOR: u64 = 2;
/// Most messages of a batch append buffered under one shard lock.
const BATCH_RUN_MESSAGES_MAX: usize = 256;
/// Most budget bytes a batch append reserves at once (a single larger message excepted; and
/// at most an eighth of the budget), so one reservation stays far below the budget.
const BATCH_RUN_BYTES_MAX: usize = 64 << 10;
/// Past this fraction of the budget (numerator, denominator), an append asks for a budget
/// flush without waiting, so the committer seals while appenders go on instead of after they
/// have all stopped at a full budget.
pub(crate) const BUDGET_SOFT_FRACTION: (usize, usize) = (7, 8);
/// Under `interval`, once the messages waiting to be sealed as chunks by the next round (those
/// of queues on a direct list) reach this fraction (1 / divisor) of the budget, an append asks
/// for that round at once instead of at the end of the interval. Without it, large messages
/// filled the whole budget between two rounds and then waited while one round wrote it all:
/// the appenders and the disk took turns instead of working at once.
const DIRECT_ROUND_DIVISOR: usize = 16;
/// Budget bytes a buffered message costs beyond its payload (its length field).
pub(crate) const MESSAGE_OVERHEAD_BYTES: usize = crate::queue::FRAME_BYTES;

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
    pub options: StoreOptions,
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
    /// [`DIRECT_ROUND_DIVISOR`] of the budget an append asks for the next round at once.
    pub direct_unwritten_bytes: AtomicUsize,
    /// A budget flush was asked for (early, past [`BUDGET_SOFT_FRACTION`] of the budget, or
    /// by an append that found the budget full); the committer clears it after each round,
    /// so appends ask at most once per round.
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

/// Retention of one queue: chunks are removed, oldest first, while either bound is passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Retention {
    /// Remove chunks sealed more than this many ms before `now_ms`.
    pub max_age_ms: Option<u64>,
    /// Remove oldest chunks while the queue's chunk records take more than this many bytes.
    pub max_bytes: Option<u64>,
}

/// What one [`Store::enforce_retention`] pass removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RetentionReport {
    /// Queues that lost chunks.
    pub queues_trimmed: u64,
    /// Chunks removed.
    pub chunks_removed: u64,
    /// Messages removed.
    pub messages_removed: u64,
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

/// Returned by deferred appends: the commit round that makes them durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CommitTicket {
    round: u64,
}

/// The queue store. See the crate docs for how it works.
pub struct Store {
    inner: Arc<Inner>,
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

    /// Appends `message` to `queue` (created on first append) and returns its offset. Under
    /// [`SyncPolicy::Always`] it returns after the message is fsynced.
    pub fn append(&self, queue: &[u8], message: &[u8]) -> Result<u64, WriteError> {
        let (offset, ticket) = self.append_deferred(queue, message)?;
        if self.inner.options.sync == SyncPolicy::Always {
            self.inner.wait_round(ticket.round)?;
        }
        Ok(offset)
    }

    /// Appends many messages, to any queues, and returns their offsets in the same order.
    /// Messages of one queue keep their order. Inputs are all checked first; a later failure
    /// (full disk, poisoned store) may leave part of the batch stored (the messages are
    /// buffered grouped by lock shard, not in batch order).
    pub fn append_batch(&self, batch: &[(&[u8], &[u8])]) -> Result<Vec<u64>, WriteError> {
        let (offsets, ticket) = self.append_batch_deferred(batch)?;
        if self.inner.options.sync == SyncPolicy::Always && !batch.is_empty() {
            self.inner.wait_round(ticket.round)?;
        }
        Ok(offsets)
    }

    /// Like [`Store::append`] but never waits for the fsync: the message is readable at once
    /// and durable once [`Store::wait_durable`] returns `Ok` for the ticket. Lets one thread
    /// keep many appends in flight (a server acknowledging asynchronously, a pipelined load
    /// tool); an error from `wait_durable` means the append may not be stored. Tickets are
    /// ordered but a later append may get an earlier one (a round takes the shard logs one
    /// by one, so an append to a shard it has not reached yet joins it): to cover many
    /// appends, wait on the highest of their tickets, not the last.
    pub fn append_deferred(
        &self,
        queue: &[u8],
        message: &[u8],
    ) -> Result<(u64, CommitTicket), WriteError> {
        self.check_input(queue, message)?;
        let (offset, round) = self.inner.buffer_message(queue, message)?;
        Ok((offset, CommitTicket { round }))
    }

    /// [`Store::append_batch`] without waiting for the fsync; see [`Store::append_deferred`].
    pub fn append_batch_deferred(
        &self,
        batch: &[(&[u8], &[u8])],
    ) -> Result<(Vec<u64>, CommitTicket), WriteError> {
        for (queue, message) in batch {
            self.check_input(queue, message)?;
        }
        let mut offsets = vec![0; batch.len()];
        let round = self.inner.buffer_batch(batch, &mut offsets)?;
        Ok((offsets, CommitTicket { round }))
    }

    /// Blocks until the appends behind `ticket` are fsynced (rounds complete in order, so
    /// every earlier successful round is durable too). Under [`SyncPolicy::Interval`] this
    /// starts the round at once instead of at the next interval. A full disk fails whole
    /// rounds: a caller that pipelines must wait on each ticket it holds to learn each
    /// outcome, since a later ticket can succeed after an earlier one failed.
    pub fn wait_durable(&self, ticket: CommitTicket) -> Result<(), WriteError> {
        self.inner.wait_round(ticket.round)
    }

    fn check_input(&self, queue: &[u8], message: &[u8]) -> Result<(), InputError> {
        check_name(queue)?;
        let max = self.inner.options.message_bytes_max;
        if message.len() > max {
            return Err(InputError::MessageTooLarge {
                length: message.len(),
                max,
            });
        }
        Ok(())
    }

    /// Reads up to `max_messages` messages of `queue` from `offset`, stopping before
    /// `max_bytes` would be passed (but returning at least one message if any is there). An
    /// offset at or past the end, or an unknown queue, gives an empty batch. An offset before
    /// the first retained message starts there and sets `skipped_to_first_retained`. Under
    /// [`SyncPolicy::Always`] only fsynced messages are returned, so a reader never sees a
    /// message that a crash or a full disk could take back; under `interval` every
    /// acknowledged message is.
    pub fn read(
        &self,
        queue: &[u8],
        offset: u64,
        max_messages: usize,
        max_bytes: usize,
    ) -> Result<ReadBatch, ReadError> {
        check_name(queue)?;
        self.inner.read(queue, offset, max_messages, max_bytes)
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

    /// Up to `limit` queue names after `after` (`None`: from the start). The order is stable
    /// but not lexicographic (by name hash, then name); pass the last name of a page as
    /// `after` to get the next page. Queues created or deleted meanwhile may or may not show.
    pub fn list_queues(&self, after: Option<&[u8]>, limit: usize) -> Vec<Vec<u8>> {
        let first_shard = after.map_or(0, |name| self.inner.shard_index(name));
        let mut names = Vec::new();
        for index in first_shard..SHARD_COUNT {
            if names.len() >= limit {
                break;
            }
            let shard = lock(&self.inner.shards[index]);
            let mut shard_names: Vec<&Arc<[u8]>> = shard
                .queues
                .keys()
                .filter(|name| index != first_shard || after.is_none_or(|after| ***name > *after))
                .collect();
            shard_names.sort_unstable();
            let room = limit - names.len();
            names.extend(shard_names.into_iter().take(room).map(|name| name.to_vec()));
        }
        names
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

    /// Removes, from every queue, the oldest chunks that `retention_for(queue name)` says
    /// are past their age (against `now_ms`, ms since the Unix epoch) or size. It first seals
    /// every write buffer into chunks (like [`Store::sync`]); messages appended meanwhile stay
    /// buffered and are never removed. Durable on return; dead segment files are deleted by
    /// the committer afterwards.
    pub fn enforce_retention(
        &self,
        now_ms: u64,
        retention_for: impl Fn(&[u8]) -> Retention,
    ) -> Result<RetentionReport, WriteError> {
        self.inner.check_writable()?;
        self.sync()?;
        let mut report = RetentionReport::default();
        let mut round = 0;
        let mut bytes = Vec::new();
        let mut effects = Vec::new();
        for shard in &self.inner.shards {
            let mut shard = lock(shard);
            let shard = &mut *shard;
            bytes.clear();
            for state in shard.queues.values_mut() {
                let retention = retention_for(&state.name);
                if retention == Retention::default() {
                    continue;
                }
                if let Some(effect) =
                    self.inner
                        .trim_queue(state, retention, now_ms, &mut report, &mut bytes)
                {
                    effects.push(effect);
                }
            }
            shard.seal_log();
            shard.log.extend_from_slice(&bytes);
            for effect in effects.drain(..) {
                round = self.inner.push_record(shard, effect);
            }
        }
        if round > 0 {
            self.inner.wait_round(round)?;
        }
        Ok(report)
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
    /// started at once (under [`SyncPolicy::Interval`], instead of within the interval).
    /// Unlike [`Store::sync`] it seals no write buffer into chunks: the messages are durable
    /// in the round's log records, and the buffers go on growing into full chunks.
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

/// Budget bytes one message's log may take: a log batch run of its own, in a new record.
fn log_budget_bytes(queue: &[u8], message: &[u8]) -> usize {
    format::log_run_bytes_max(queue.len(), &[message])
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

    fn check_writable(&self) -> Result<(), WriteError> {
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
    fn push_record(&self, shard: &mut Shard, effect: RecordEffect) -> u64 {
        shard.log_effects.push(effect);
        let round = shard.log_round;
        self.log_pending.fetch_add(1, Ordering::SeqCst);
        self.wake_committer();
        round
    }

    /// Waits, while the budget is exhausted, until `bytes` more fit.
    /// Asks the committer for a budget flush, once per round: a flush already asked for
    /// (early, or by another append) frees bytes when it completes, and a second one queued
    /// behind it would seal more buffers than needed, so smaller chunks.
    fn request_budget_flush(&self) {
        if !self.flush_soon.swap(true, Ordering::SeqCst) {
            lock(&self.pending).budget_flush_requested = true;
            self.work.notify_one();
        }
    }

    fn reserve_budget(&self, bytes: usize) -> Result<(), WriteError> {
        let budget = self.options.buffer_budget_bytes;
        // A round that fails after we start waiting (a full disk) fails this append too:
        // write buffers hold their bytes until sealed, so waiting could last forever.
        let first_round = self.rounds_started.load(Ordering::SeqCst) + 1;
        loop {
            let before = self.buffered_bytes.fetch_add(bytes, Ordering::SeqCst);
            if before == 0 || before + bytes <= budget {
                let (numerator, denominator) = BUDGET_SOFT_FRACTION;
                if before + bytes > budget / denominator * numerator {
                    self.request_budget_flush();
                }
                return Ok(());
            }
            self.buffered_bytes.fetch_sub(bytes, Ordering::SeqCst);
            // Under a full disk the budget frees only once space returns: fail fast instead.
            self.check_writable()?;
            self.request_budget_flush();
            let commit = lock(&self.commit);
            if let Some(reason) = &commit.poisoned {
                return Err(WriteError::Poisoned(reason.clone()));
            }
            if let Some((_, error)) = commit
                .failures
                .iter()
                .rev()
                .find(|(round, _)| *round >= first_round)
            {
                return Err(error.clone());
            }
            let _wait = self
                .committed
                .wait_timeout(commit, Duration::from_millis(10))
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Milliseconds since the store was opened.
    pub(crate) fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Under `interval`, waits while the committer is more than [`INTERVAL_LATE_FACTOR`]
    /// intervals behind (back-pressure that keeps "fsynced within the interval" close to
    /// true under overload); fails fast on a full disk or a poisoned store.
    fn wait_for_late_rounds(&self) -> Result<(), WriteError> {
        let SyncPolicy::Interval { interval_ms } = self.options.sync else {
            return Ok(());
        };
        let late_ms = interval_ms.saturating_mul(INTERVAL_LATE_FACTOR);
        let mut waited = false;
        loop {
            let behind_ms = self
                .elapsed_ms()
                .saturating_sub(self.durable_through_ms.load(Ordering::Acquire));
            if behind_ms <= late_ms {
                return Ok(());
            }
            self.check_writable()?;
            let commit = lock(&self.commit);
            if let Some(reason) = &commit.poisoned {
                return Err(WriteError::Poisoned(reason.clone()));
            }
            if !waited {
                waited = true;
                self.counters
                    .late_round_waits
                    .fetch_add(1, Ordering::Relaxed);
            }
            let _wait = self
                .committed
                .wait_timeout(commit, Duration::from_millis(10))
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Puts one message into its queue's buffer; returns its offset and the commit round
    /// that will make it durable.
    fn buffer_message(&self, queue: &[u8], message: &[u8]) -> Result<(u64, u64), WriteError> {
        self.wait_for_late_rounds()?;
        let mut offset = [0];
        let run = [(self.shard_index(queue), 0)];
        let round = self.buffer_run(&[(queue, message)], &run, &mut offset, &mut Vec::new())?;
        Ok((offset[0], round))
    }

    /// Buffers a batch: messages are grouped by shard (a stable sort, so a queue's messages
    /// keep their order) and each group is buffered under one lock of its shard and one budget
    /// reservation, in runs of at most [`BATCH_RUN_MESSAGES_MAX`] messages and
    /// [`BATCH_RUN_BYTES_MAX`] bytes. Writes the offsets (in batch order) into `offsets` and
    /// returns the commit round that makes every message durable.
    fn buffer_batch(
        &self,
        batch: &[(&[u8], &[u8])],
        offsets: &mut [u64],
    ) -> Result<u64, WriteError> {
        self.wait_for_late_rounds()?;
        let run_bytes_max = BATCH_RUN_BYTES_MAX.min(self.options.buffer_budget_bytes / 8);
        // A counting sort by shard: stable, so a queue's messages keep their order.
        let shards: Vec<usize> = batch
            .iter()
            .map(|(queue, _)| self.shard_index(queue))
            .collect();
        let mut next_slot = [0_usize; SHARD_COUNT];
        for &shard_index in &shards {
            next_slot[shard_index] += 1;
        }
        let mut slot = 0;
        for count in &mut next_slot {
            (*count, slot) = (slot, slot + *count);
        }
        let mut order = vec![(0, 0); batch.len()];
        for (index, &shard_index) in shards.iter().enumerate() {
            order[next_slot[shard_index]] = (shard_index, index);
            next_slot[shard_index] += 1;
        }
        let mut wakes = Vec::new();
        let mut round = 0;
        let mut start = 0;
        while start < order.len() {
            let shard_index = order[start].0;
            let mut end = start;
            let mut cost = 0;
            while end < order.len()
                && order[end].0 == shard_index
                && end - start < BATCH_RUN_MESSAGES_MAX
            {
                let message_cost = batch[order[end].1].1.len() + MESSAGE_OVERHEAD_BYTES;
                if end > start && cost + message_cost > run_bytes_max {
                    break;
                }
                cost += message_cost;
                end += 1;
            }
            let run_round = self.buffer_run(batch, &order[start..end], offsets, &mut wakes)?;
            round = round.max(run_round);
            start = end;
        }
        Ok(round)
    }

    /// Buffers the messages `run` (pairs of shard index and index into `batch`, all of one
    /// shard) under one lock of that shard, and encodes their log records into the shard's
    /// log (one record per run of consecutive messages to one queue); returns the commit round
    /// that makes them durable. `wakes` is scratch space, reused between runs.
    fn buffer_run(
        &self,
        batch: &[(&[u8], &[u8])],
        run: &[(usize, usize)],
        offsets: &mut [u64],
        wakes: &mut Vec<QueueKey>,
    ) -> Result<u64, WriteError> {
        self.check_writable()?;
        let log_cost: usize = run
            .iter()
            .map(|(_, index)| log_budget_bytes(batch[*index].0, batch[*index].1))
            .sum();
        let buffer_cost: usize = run
            .iter()
            .map(|(_, index)| batch[*index].1.len() + MESSAGE_OVERHEAD_BYTES)
            .sum();
        self.reserve_budget(log_cost + buffer_cost)?;
        let Some(&(shard_index, _)) = run.first() else {
            return Ok(0);
        };
        let timestamp_ms = crate::committer::now_ms();
        let chunk_bytes = self.options.chunk_bytes;
        let mut messages: Vec<&[u8]> = Vec::new();
        let mut guard = lock(&self.shards[shard_index]);
        let shard = &mut *guard;
        // Under the shard lock: the round that will take this shard's log.
        let round = shard.log_round;
        let completed = self.completed_round.load(Ordering::SeqCst);
        wakes.clear();
        if run.len() > 1 {
            warm_queues(&shard.queues, run.iter().map(|&(_, index)| batch[index].0));
        }
        // The log budget reserved for messages that get no log run, and their bytes (their
        // queue is on a direct list: round `round` seals them as chunks).
        let mut unused_log_cost = 0;
        let mut direct_bytes = 0;
        let mut start = 0;
        while start < run.len() {
            let queue = batch[run[start].1].0;
            let mut end = start + 1;
            while end < run.len() && batch[run[end].1].0 == queue {
                end += 1;
            }
            let state = match shard.queues.get_mut(queue) {
                Some(state) => state,
                None => self.insert_queue(&mut shard.queues, queue),
            };
            let first_offset = state.next_offset;
            let buffer = match &mut state.buffer {
                Some(buffer) => buffer,
                none => none.insert(shard.spare.take(first_offset)),
            };
            let mut direct = state.direct_round == round;
            messages.clear();
            for &(_, index) in &run[start..end] {
                let message = batch[index].1;
                offsets[index] = state.next_offset;
                state.next_offset += 1;
                buffer.push_toward_chunk(message, chunk_bytes);
                messages.push(message);
            }
            buffer.mark(round, state.next_offset, completed);
            if !direct && buffer.unfrozen_payload_bytes() >= chunk_bytes {
                // A chunk's worth is waiting: round `round` seals everything this queue logged
                // through it, so these messages need no log record of their own.
                state.direct_round = round;
                direct = true;
                shard.direct.push(QueueKey {
                    name: state.name.clone(),
                    incarnation: state.incarnation,
                });
            }
            if direct {
                direct_bytes += messages.iter().map(|message| message.len()).sum::<usize>();
                unused_log_cost += messages
                    .iter()
                    .map(|message| log_budget_bytes(queue, message))
                    .sum::<usize>();
            } else {
                format::append_log_run(
                    &mut shard.log,
                    &mut shard.open_log,
                    queue,
                    first_offset,
                    timestamp_ms,
                    &messages,
                );
            }
            if !state.queued {
                state.queued = true;
                wakes.push(QueueKey {
                    name: state.name.clone(),
                    incarnation: state.incarnation,
                });
            }
            start = end;
        }
        shard.log_budget_bytes +=
            self.note_run_buffered(log_cost, unused_log_cost, direct_bytes, round);
        if !wakes.is_empty() {
            // Still under the shard lock (order shard -> pending), so the committer never
            // sees a queue's key before its buffer.
            // Every message of these queues not yet sealed is logged in `round` or later.
            lock(&self.pending)
                .buffered
                .extend(wakes.drain(..).map(|key| Listed {
                    key,
                    since_round: round,
                }));
        }
        drop(guard);
        Ok(round)
    }

    /// Creates `queue`, not yet in a shard's map.
    fn insert_queue<'map>(&self, queues: &'map mut QueueMap, queue: &[u8]) -> &'map mut QueueState {
        let incarnation = self.next_incarnation.fetch_add(1, Ordering::Relaxed);
        let name: Arc<[u8]> = Arc::from(queue);
        queues
            .entry(name.clone())
            .or_insert(QueueState::new(name, incarnation, 0))
    }

    /// Accounts for a run just buffered for round `round` that reserved `log_cost` of budget
    /// for its logs: gives back `unused_log_cost` of it (messages with no log run), counts the
    /// rest as shard logs and `direct_bytes` of messages on direct lists, and tells the
    /// committer; returns the log budget the shard's log holds now. Under `interval`, once the
    /// direct bytes reach [`DIRECT_ROUND_DIVISOR`] of the budget, asks for round `round` at
    /// once.
    fn note_run_buffered(
        &self,
        log_cost: usize,
        unused_log_cost: usize,
        direct_bytes: usize,
        round: u64,
    ) -> usize {
        let logged_cost = log_cost - unused_log_cost;
        self.unwritten_log_bytes
            .fetch_add(logged_cost, Ordering::Relaxed);
        self.buffered_bytes
            .fetch_sub(unused_log_cost, Ordering::SeqCst);
        self.note_log_appended();
        if direct_bytes == 0 {
            return logged_cost;
        }
        let before = self
            .direct_unwritten_bytes
            .fetch_add(direct_bytes, Ordering::Relaxed);
        if self.options.sync != SyncPolicy::Always
            && before + direct_bytes >= self.options.buffer_budget_bytes / DIRECT_ROUND_DIVISOR
            && self.wanted_round.fetch_max(round, Ordering::SeqCst) < round
        {
            self.wake_committer();
        }
        logged_cost
    }

    /// Tells the committer that a shard log grew; under `always` wakes it.
    fn note_log_appended(&self) {
        self.log_pending.fetch_add(1, Ordering::SeqCst);
        if self.options.sync == SyncPolicy::Always {
            self.wake_committer();
        }
    }

    /// Blocks until commit round `round` is done; its error if it failed.
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

    /// Removes the oldest chunks of one queue past `retention`; encodes the trim record into
    /// `bytes` and returns what it does once durable.
    fn trim_queue(
        &self,
        state: &mut QueueState,
        retention: Retention,
        now_ms: u64,
        report: &mut RetentionReport,
        bytes: &mut Vec<u8>,
    ) -> Option<RecordEffect> {
        let mut removed = Vec::new();
        while let Some(front) = state.chunks.front() {
            let over_size = retention
                .max_bytes
                .is_some_and(|max| state.stored_bytes > max);
            let Ok((record_bytes, timestamp_ms)) = self.chunk_header(front) else {
                break;
            };
            let too_old = retention
                .max_age_ms
                .is_some_and(|max_age| timestamp_ms.saturating_add(max_age) < now_ms);
            if !(over_size || too_old) {
                break;
            }
            state.chunks.pop_front();
            state.stored_bytes = state.stored_bytes.saturating_sub(record_bytes);
            removed.push(front);
        }
        if removed.is_empty() {
            return None;
        }
        let old_first = state.first_offset;
        state.first_offset = state
            .chunks
            .front()
            .map_or_else(|| state.disk_end_offset(), |chunk| chunk.first_offset);
        report.queues_trimmed += 1;
        report.chunks_removed += removed.len() as u64;
        report.messages_removed += state.first_offset - old_first;
        format::encode_trim(bytes, &state.name, state.first_offset);
        let key = QueueKey {
            name: state.name.clone(),
            incarnation: state.incarnation,
        };
        Some(RecordEffect {
            dead: count_by_segment(removed.into_iter()),
            trim_of: Some(key),
        })
    }

    /// Record length and timestamp of a chunk, read from its record header.
    fn chunk_header(&self, chunk: ChunkEntry) -> Result<(u64, u64), String> {
        let file = lock(&self.segments)
            .get(&chunk.segment)
            .map(|segment| segment.file.clone())
            .ok_or("segment missing")?;
        let mut header = [0_u8; RECORD_HEADER_BYTES + format::CHUNK_FIXED_BYTES];
        file.read_at(u64::from(chunk.position), &mut header)
            .map_err(|error| error.to_string())?;
        let body_bytes = u64::from(format::read_u32(&header, 4));
        let timestamp_ms = format::read_u64(&header, RECORD_HEADER_BYTES + 16);
        Ok((body_bytes + RECORD_HEADER_BYTES as u64, timestamp_ms))
    }

    #[allow(
        clippy::too_many_lines,
        reason = "one pass: plan under the lock, read without it"
    )]
    fn read(
        &self,
        queue: &[u8],
        offset: u64,
        max_messages: usize,
        max_bytes: usize,
    ) -> Result<ReadBatch, ReadError> {
        // Each chunk to read, the index of its segment's file in `files`, its first read size.
        let mut planned: Vec<(ChunkEntry, usize, usize)> = Vec::new();
        let mut files: Vec<Arc<dyn StorageFile>> = Vec::new();
        // A full chunk: payload, per-message lengths and headers, with room to spare.
        let full_guess_bytes =
            (self.options.chunk_bytes + self.options.chunk_bytes / 4 + 512).min(1 << 20);
        let mut buffered = ReadBatch::default();
        let mut batch;
        let disk_end;
        {
            let shard = lock(self.shard(queue));
            let Some(state) = shard.queues.get(queue) else {
                return Ok(ReadBatch::default());
            };
            // Under `always` only fsynced messages are visible (the indexed chunks); under
            // `interval` acknowledged messages still in the buffer are too.
            disk_end = state.disk_end_offset();
            let visible_end = match self.options.sync {
                SyncPolicy::Always => state.buffer.as_ref().map_or(disk_end, |buffer| {
                    buffer.logged_through(self.completed_round.load(Ordering::SeqCst))
                }),
                SyncPolicy::Interval { .. } => state.next_offset,
            };
            let start = offset.max(state.first_offset);
            batch = ReadBatch::new(start, offset < state.first_offset, visible_end);
            if start >= visible_end || max_messages == 0 {
                return Ok(batch);
            }
            let wanted_end = start.saturating_add(max_messages as u64);
            // Room for the messages the read can return, from the queue's average size, so
            // the batch does not grow by doubling; bounded by READ_RESERVE_BYTES_MAX.
            let messages = wanted_end.min(visible_end) - start;
            let average_bytes =
                state.stored_bytes / disk_end.saturating_sub(state.first_offset).max(1);
            let bytes = usize::try_from(messages.saturating_mul(average_bytes))
                .unwrap_or(usize::MAX)
                .min(max_bytes)
                .min(READ_RESERVE_BYTES_MAX);
            batch.reserve(
                usize::try_from(messages)
                    .unwrap_or(usize::MAX)
                    .min(READ_RESERVE_MESSAGES_MAX),
                bytes,
            );
            if start < disk_end {
                let first = state
                    .chunks
                    .partition_point(|chunk| chunk.first_offset <= start);
                // Record bytes per message of this queue on average, so a chunk of a few
                // small messages is read with a small `pread`, not one sized for a full chunk.
                let disk_messages = disk_end.saturating_sub(state.first_offset).max(1);
                let per_message_bytes = state.stored_bytes / disk_messages;
                let segments = lock(&self.segments);
                let first = first.saturating_sub(1);
                let mut chunks = state.chunks.iter_from(first).peekable();
                for _ in 0..READ_CHUNKS_MAX {
                    let Some(chunk) = chunks.next() else {
                        break;
                    };
                    if chunk.first_offset >= wanted_end {
                        break;
                    }
                    let chunk_end = chunks.peek().map_or(disk_end, |next| next.first_offset);
                    let guess = (chunk_end - chunk.first_offset)
                        .saturating_mul(per_message_bytes)
                        .saturating_mul(READ_GUESS_SLACK);
                    let guess = usize::try_from(guess)
                        .unwrap_or(usize::MAX)
                        .clamp(READ_GUESS_BYTES_MIN, full_guess_bytes);
                    // Consecutive chunks are mostly in one segment: one `Arc` clone (an
                    // atomic on a line every reader shares) per segment, not per chunk.
                    if planned
                        .last()
                        .is_none_or(|(last, _, _)| last.segment != chunk.segment)
                    {
                        let file = segments
                            .get(&chunk.segment)
                            .map(|segment| segment.file.clone())
                            .ok_or_else(|| ReadError::Storage {
                                segment: chunk.segment,
                                position: chunk.position,
                                reason: "segment file missing".to_string(),
                            })?;
                        files.push(file);
                    }
                    planned.push((chunk, files.len() - 1, guess));
                }
            }
            if let Some(buffer) = &state.buffer
                && visible_end > buffer.first_offset
                && wanted_end > buffer.first_offset
            {
                let skip = usize::try_from(start.saturating_sub(buffer.first_offset))
                    .unwrap_or(usize::MAX);
                let mut position = buffer.position_of(start);
                let visible = usize::try_from(visible_end - buffer.first_offset)
                    .unwrap_or(usize::MAX)
                    .min(buffer.count);
                let mut taken_bytes = 0;
                for index in skip..visible.min(skip.saturating_add(max_messages)) {
                    let (message, next_position) = buffer.message_at(position);
                    position = next_position;
                    taken_bytes += message.len();
                    if taken_bytes > max_bytes && index > skip {
                        break;
                    }
                    buffered.push(message);
                }
            }
        }
        let mut next = batch.first_offset;
        let mut record = Vec::new();
        for (chunk, file_index, guess_bytes) in planned {
            let file = &files[file_index];
            if batch.len() >= max_messages || next >= disk_end {
                return Ok(batch);
            }
            read_record(file.as_ref(), chunk, guess_bytes, &mut record)?;
            let Ok(Record::Chunk(decoded)) = format::decode_checked(&record) else {
                return Err(ReadError::Storage {
                    segment: chunk.segment,
                    position: chunk.position,
                    reason: "chunk record failed its checksum or is malformed".to_string(),
                });
            };
            for (index, message) in decoded.messages().enumerate() {
                let message_offset = decoded.first_offset + index as u64;
                if message_offset < next {
                    continue;
                }
                if batch.len() >= max_messages
                    || (!batch.is_empty() && batch.bytes() + message.len() > max_bytes)
                {
                    return Ok(batch);
                }
                batch.push(message);
                next += 1;
            }
        }
        if next < disk_end {
            // The chunk limit stopped the read; the rest comes with the next read.
            return Ok(batch);
        }
        for message in buffered.iter() {
            if batch.len() >= max_messages
                || (!batch.is_empty() && batch.bytes() + message.len() > max_bytes)
            {
                break;
            }
            batch.push(message);
        }
        Ok(batch)
    }
}

/// Reads the whole record at `chunk` into `out`: one read of `guess_bytes` (enough for a
/// typical chunk), and a second one only if the record is longer.
fn read_record(
    file: &dyn StorageFile,
    chunk: ChunkEntry,
    guess_bytes: usize,
    out: &mut Vec<u8>,
) -> Result<(), ReadError> {
    let storage_error = |reason: String| ReadError::Storage {
        segment: chunk.segment,
        position: chunk.position,
        reason,
    };
    let position = u64::from(chunk.position);
    out.clear();
    out.resize(guess_bytes.max(RECORD_HEADER_BYTES), 0);
    let read = file
        .read_up_to(position, out)
        .map_err(|error| storage_error(error.to_string()))?;
    if read < RECORD_HEADER_BYTES {
        return Err(storage_error(
            "record header past the end of the segment".to_string(),
        ));
    }
    let body_bytes = usize::try_from(format::read_u32(out, 4)).unwrap_or(usize::MAX);
    if body_bytes > format::RECORD_BODY_BYTES_MAX {
        return Err(storage_error("record length field is corrupt".to_string()));
    }
    let total = RECORD_HEADER_BYTES + body_bytes;
    if total <= read {
        out.truncate(total);
        return Ok(());
    }
    out.resize(total, 0);
    file.read_at(position + read as u64, &mut out[read..])
        .map_err(|error| storage_error(error.to_string()))
}

/// Looks up each queue of a run and reads the end of its write buffer, only to bring them into
/// the cache: these loads do not depend on each other, so the CPU overlaps their misses, where
/// the appending loop, one queue after another, waits for each in turn (with 100,000 queues
/// appended to round-robin, the first touch of a queue's map entry was 10% of the put's CPU).
fn warm_queues<'a>(queues: &QueueMap, names: impl Iterator<Item = &'a [u8]>) {
    let mut touched = 0_u8;
    for name in names {
        if let Some(buffer) = queues.get(name).and_then(|state| state.buffer.as_ref()) {
            touched ^= buffer.data.last().copied().unwrap_or(0);
        }
    }
    // Keeps the loads from being optimised away.
    std::hint::black_box(touched);
}
