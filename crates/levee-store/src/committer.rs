//! The committer thread: the only writer of segment files. Each round takes the log records
//! every shard gathered since the last round (the appended messages, trims and deletes), seals
//! the write buffers that are due into chunk records (a queue's consecutive messages
//! together), writes it all in one sequential write, fsyncs once, publishes the chunks in the
//! index and wakes every append waiting on that round (group commit). Under `interval` the
//! chunks are published as their writes land, between the round's later writes. After a round
//! it deletes the oldest segment files once nothing live remains in them.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::error::WriteError;
use crate::format::{
    self, FLOOR_RECORD_BYTES, LogFloor, RECORD_HEADER_BYTES, Record, SEGMENT_HEADER_BYTES,
};
use crate::options::SyncPolicy;
use crate::queue::{ChunkEntry, FRAME_BYTES, NO_SEGMENT};
use crate::recovery::Scanner;
use crate::storage::{StorageFile, WriteBytes};
use crate::store::{
    FAILURES_MAX, Inner, Listed, QueueKey, RecordEffect, SHARD_COUNT, SegmentEntry, Shard, lock,
};

/// Round starts are remembered at most once per this many bytes of a segment (an earlier one
/// stands for the rounds after it, conservatively: see `Committer::floor_for`).
const ROUND_START_SPACING_BYTES: u64 = 1 << 20;

/// Most buffered-list entries one round refreshes (see `Committer::refresh_listed`).
const REFRESH_PER_ROUND_MAX: usize = 1024;

/// The oldest segment is relocated once at most 1 in this many of its chunks is still live.
const RELOCATE_LIVE_RATIO_MAX: u64 = 4;

/// Past this position a round starts a new segment even mid-round, so positions fit in u32.
const POSITION_SOFT_MAX: u64 = 3 << 30;

/// A budget flush seals this fraction (1 / divisor) of the buffered queues, the oldest: a
/// small fraction keeps the buffers near the budget, so chunks are larger (about
/// `(2 - 1/divisor)` times the average buffer instead of 1.5 times with halves).
const BUDGET_FLUSH_DIVISOR: usize = 8;
/// A budget flush seals nothing from the buffered list while the shard logs not yet written
/// hold at least this fraction (1 / divisor) of the budget: writing them frees enough.
const BUDGET_LOG_SHARE_DIVISOR: usize = 4;
/// Garbage collection asks for a checkpoint when the oldest segment is kept only by log
/// records of buffered messages and the active segment is this many segments ahead.
const CHECKPOINT_LAG_SEGMENTS: u32 = 2;
/// Most queues the committer seals or publishes under one shard lock before letting
/// appenders in: a few hundred microseconds of work.
const FREEZE_QUEUES_PER_LOCK_MAX: usize = 256;

/// A shard log whose capacity grew past this is given back after the round (bursts must not
/// pin memory in 64 shards).
const SHARD_LOG_CAPACITY_KEPT_MAX: usize = 1 << 20;

/// After a round failed for lack of space, the committer waits this long before the next.
const FULL_DISK_RETRY_WAIT: Duration = Duration::from_millis(10);

/// Under `always`, the committer looks for work at least this often even without a wake-up.
const ALWAYS_IDLE_WAIT: Duration = Duration::from_millis(50);
/// With nothing appended for this long, the shards' spare write buffers are freed (see
/// `SpareBuffers`): they serve queues appended to round after round, and an idle store
/// should give their memory back.
const SPARE_RELEASE_IDLE: Duration = Duration::from_millis(200);

/// How to seal one queue's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seal {
    /// Everything logged through the round, the last chunk possibly short (the queue came
    /// from a shard's direct list: some of its messages have no log record).
    Round,
    /// Everything logged so far (the queue came from the buffered list: a budget flush or a
    /// checkpoint); its `queued` flag is cleared, or the key goes back on the list if
    /// messages remain. Holds the list entry's `since_round`.
    All(u64),
}

/// A queue to seal: its shard index, how, and its key.
type RunEntry = (usize, Seal, QueueKey);

/// The active segment and the bytes of the round being built.
#[derive(Debug)]
pub(crate) struct Writer {
    segment: u32,
    file: Arc<dyn StorageFile>,
    length: u64,
    /// The round's bytes not yet written, for position `length`.
    buffer: WriteBytes,
}

impl Writer {
    pub(crate) fn new(segment: u32, file: Arc<dyn StorageFile>, length: u64) -> Self {
        let mut buffer = WriteBytes::new();
        buffer.reset(length);
        Self {
            segment,
            file,
            length,
            buffer,
        }
    }

    fn position(&self) -> u32 {
        // Invariant: rounds rotate before POSITION_SOFT_MAX plus one record (< 4 GiB).
        u32::try_from(self.length + self.buffer.len() as u64).expect("segment position fits u32")
    }
}

/// A chunk a round sealed, applied to the index after the write.
#[derive(Debug)]
struct Placed {
    key: QueueKey,
    /// Index of the queue's lock shard.
    shard: usize,
    entry: ChunkEntry,
    count: usize,
    /// Bytes of the messages in the queue's write buffer (payload and lengths).
    buffered_bytes: usize,
    record_bytes: u64,
}

/// What a round took from the shard logs.
#[derive(Debug, Default)]
struct TakenLog {
    /// Bytes of log, trim and delete records at the start of the round buffer.
    bytes: usize,
    /// The trim and delete records' effects, in order, with the segment each went to.
    effects: Vec<(RecordEffect, u32)>,
    /// Budget bytes reserved for the log records.
    budget_bytes: usize,
}

/// The queues a round took off the shards' direct lists and the buffered list.
#[derive(Debug, Default)]
struct TakenKeys {
    direct: Vec<QueueKey>,
    all: Vec<Listed>,
}

/// A live chunk being relocated: its queue, first offset, old position and its position in
/// the copied bytes.
type Moved = (QueueKey, u64, u32, usize);

/// How copying trim records forward before a segment deletion went.
enum Carried {
    Done,
    /// The disk is full: the segment stays for now.
    NoSpace,
    Poisoned,
}

struct Plan {
    round: u64,
    /// Queues taken from the buffered list (budget flush or checkpoint).
    all: Vec<Listed>,
    is_checkpoint: bool,
    /// The round answers a budget flush request (see `Inner::flush_soon`).
    budget_flush: bool,
    shutdown: bool,
}

struct Committer<'a> {
    inner: &'a Inner,
    writer: Writer,
    last_round: Instant,
    /// Every log record still needed (its messages not yet in a chunk) is in this segment or
    /// a later one; older segments may be deleted once they hold no live chunk.
    log_floor: u32,
    /// Garbage collection found the oldest segment pinned by log records only.
    checkpoint_wanted: bool,
    /// The last round failed for lack of space: wait a little before the next one.
    backing_off: bool,
    /// Bytes of the current round already written (see `StoreOptions::round_write_bytes`).
    round_flushed: u64,
    /// Bytes of log records at the start of the round buffer, not yet written.
    round_log_buffered: usize,
    /// The current round's log records, kept once the buffer holding them was written early:
    /// a failed round puts them back in the shard logs.
    round_log: Vec<u8>,
    /// How many of the current round's chunks (the first of `placed`) are published already:
    /// under `interval` a round publishes its chunks as their writes land, between its later
    /// writes (see `Committer::publish_written`). Its trim and delete effects are applied
    /// with the first of them (they were written before them).
    published: usize,
    /// Where rounds started, oldest first, at most one per [`ROUND_START_SPACING_BYTES`] of a
    /// segment; round 0 stands for the log replayed at open (it starts at the recovered
    /// floor). Pruned to the floor at each rotation.
    round_starts: VecDeque<(u64, LogFloor)>,
    /// The floor written at the start of the next segment: every log record before it is
    /// dead. Refreshed before each rotation at the start of a round.
    floor: LogFloor,
    /// Buffered-list entries of queues found deleted (or deleted and created again), each with
    /// a round whose log holds the delete record or a later one: the floor still counts them
    /// until that round is complete, because until then a crash brings the queue back with
    /// the log records the entry stands for.
    gone: Vec<(Listed, u64)>,
    /// The queues to seal and the chunks sealed, kept empty between rounds so that their
    /// allocations are reused: allocated afresh, their growth to a round's thousands of
    /// entries took fresh pages from the kernel every round (a tenth of the committer's time
    /// with 4 KiB messages). Bounded by the entries of one round.
    spare_run: Vec<RunEntry>,
    spare_placed: Vec<Placed>,
    /// Since when no work was found (`None` while rounds run), for [`SPARE_RELEASE_IDLE`].
    idle_since: Option<Instant>,
    /// A round kept emptied write buffers as spares since they were last released.
    spares_kept: bool,
}

/// Runs the committer until shutdown or a fatal error, poisoning the store if it panics (a
/// bug), so that appenders waiting for a round get an error instead of waiting forever.
/// `floor` is the log floor recovery used: every log record it replayed is at or after it.
pub(crate) fn run_guarded(inner: &Inner, writer: Writer, log_floor: u32, floor: LogFloor) {
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run(inner, writer, log_floor, floor);
    }));
    if let Err(panic) = ran {
        let what = panic
            .downcast_ref::<&str>()
            .map(ToString::to_string)
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let mut commit = lock(&inner.commit);
        commit.poisoned = Some(format!("the committer thread panicked: {what}"));
        inner.poisoned.store(true, Ordering::Release);
        inner.committed.notify_all();
    }
}

fn run(inner: &Inner, writer: Writer, log_floor: u32, floor: LogFloor) {
    let mut committer = Committer {
        inner,
        writer,
        last_round: Instant::now(),
        log_floor,
        checkpoint_wanted: false,
        backing_off: false,
        round_flushed: 0,
        round_log_buffered: 0,
        round_log: Vec::new(),
        published: 0,
        round_starts: VecDeque::from([(0, floor)]),
        floor,
        gone: Vec::new(),
        spare_run: Vec::new(),
        spare_placed: Vec::new(),
        idle_since: None,
        spares_kept: false,
    };
    loop {
        let plan = committer.next_plan();
        let shutdown = plan.shutdown;
        let round_started_ms = inner.elapsed_ms();
        committer.last_round = Instant::now();
        if !committer.run_round(plan) {
            return;
        }
        if std::mem::take(&mut committer.backing_off) {
            // The disk is full: retrying at once would only spin (and push the failures of
            // earlier rounds out of `CommitState::failures` before their waiters read them).
            std::thread::sleep(FULL_DISK_RETRY_WAIT);
        }
        if !inner.disk_full.load(Ordering::SeqCst) {
            // Everything appended before the round started is now fsynced.
            inner
                .durable_through_ms
                .fetch_max(round_started_ms, Ordering::Release);
        }
        if shutdown {
            // Nothing can be appended while the store is being dropped: one round suffices.
            return;
        }
    }
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    let elapsed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
}

fn is_no_space(error: &io::Error) -> bool {
    error.kind() == io::ErrorKind::StorageFull || error.raw_os_error() == Some(28)
}

impl Committer<'_> {
    fn interval(&self) -> Option<Duration> {
        match self.inner.options.sync {
            SyncPolicy::Always => None,
            SyncPolicy::Interval { interval_ms } => Some(Duration::from_millis(interval_ms)),
        }
    }

    /// Sleeps until there is work and takes it.
    fn next_plan(&mut self) -> Plan {
        let interval = self.interval();
        let inner = self.inner;
        let mut pending = lock(&inner.pending);
        loop {
            // Set before looking for work, so an appender that publishes work after the look
            // sees the flag and wakes us (see `Inner::wake_committer`).
            inner.committer_sleeping.store(true, Ordering::SeqCst);
            let log_work = inner.log_pending.load(Ordering::SeqCst) > 0;
            // Under `interval` a round that failed on a full disk is retried every interval,
            // even with nothing logged (a failed checkpoint or budget flush), so appends,
            // refused meanwhile, resume once space returns.
            let retry = inner.disk_full.load(Ordering::SeqCst);
            let due = match interval {
                None => log_work,
                Some(interval) => (log_work || retry) && self.last_round.elapsed() >= interval,
            };
            let is_checkpoint =
                pending.shutdown || pending.checkpoint_requested || self.checkpoint_wanted;
            let wanted = inner.wanted_round.load(Ordering::SeqCst)
                > inner.rounds_started.load(Ordering::SeqCst);
            if due || is_checkpoint || wanted || pending.budget_flush_requested {
                self.idle_since = None;
                inner.committer_sleeping.store(false, Ordering::SeqCst);
                let round = inner.rounds_started.fetch_add(1, Ordering::SeqCst) + 1;
                let all: Vec<Listed> = if is_checkpoint {
                    pending.buffered.drain(..).collect()
                } else if pending.budget_flush_requested
                    && inner.unwritten_log_bytes.load(Ordering::Relaxed)
                        < inner.options.buffer_budget_bytes / BUDGET_LOG_SHARE_DIVISOR
                {
                    // The budget is (nearly) full of write buffers: seal the older part of
                    // the buffered queues (write buffers stay after their round, so only
                    // sealing frees their bytes). When the shard logs hold a large share
                    // instead, the round frees them by writing them and seals nothing more:
                    // buffers left to grow make larger chunks, so a smaller index.
                    let older = pending.buffered.len().div_ceil(BUDGET_FLUSH_DIVISOR);
                    pending.buffered.drain(..older).collect()
                } else {
                    Vec::new()
                };
                let budget_flush = std::mem::take(&mut pending.budget_flush_requested);
                pending.checkpoint_requested = false;
                self.checkpoint_wanted = false;
                return Plan {
                    round,
                    all,
                    is_checkpoint,
                    budget_flush,
                    shutdown: pending.shutdown,
                };
            }
            if !log_work && !retry {
                let idle_since = *self.idle_since.get_or_insert_with(Instant::now);
                if self.spares_kept && idle_since.elapsed() >= SPARE_RELEASE_IDLE {
                    // Shard locks come before the pending lock: release it meanwhile.
                    drop(pending);
                    self.release_spares();
                    pending = lock(&inner.pending);
                    continue;
                }
            }
            if interval.is_some() && !log_work {
                // Between rounds with nothing appended: nothing acknowledged is unwritten.
                inner
                    .durable_through_ms
                    .fetch_max(inner.elapsed_ms(), Ordering::Release);
            }
            let wait = match interval {
                None => ALWAYS_IDLE_WAIT,
                Some(interval) if log_work => interval
                    .saturating_sub(self.last_round.elapsed())
                    .max(Duration::from_millis(1)),
                Some(interval) => interval,
            };
            pending = inner
                .work
                .wait_timeout(pending, wait)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Frees every shard's spare write buffers.
    fn release_spares(&mut self) {
        self.spares_kept = false;
        for shard in &self.inner.shards {
            let spares = std::mem::take(&mut lock(shard).spare);
            // Freed out of the lock.
            drop(spares);
        }
    }

    /// Appends every shard's log to the round buffer (writing it early once it passes
    /// `round_write_bytes`) and moves its direct list to `direct`; later appends go to round
    /// `round + 1`. What it took is in `taken`, also when it fails.
    fn take_logs(
        &mut self,
        round: u64,
        direct: &mut Vec<RunEntry>,
        rotated_mid_round: &mut bool,
        taken: &mut TakenLog,
    ) -> io::Result<()> {
        self.inner.log_pending.store(0, Ordering::SeqCst);
        self.inner
            .direct_unwritten_bytes
            .store(0, Ordering::Relaxed);
        for (shard_index, shard) in self.inner.shards.iter().enumerate() {
            let open_log = {
                let mut shard = lock(shard);
                debug_assert!(shard.log_round <= round);
                shard.log_round = round + 1;
                direct.extend(
                    shard
                        .direct
                        .drain(..)
                        .map(|key| (shard_index, Seal::Round, key)),
                );
                if shard.log.is_empty() && shard.log_budget_bytes == 0 {
                    continue;
                }
                // The open log batch record is sealed in the round buffer, out of the lock.
                let open_log = shard
                    .open_log
                    .take()
                    .map(|open| open.rebased(self.writer.buffer.len()));
                self.writer.buffer.extend_from_slice(&shard.log);
                shard.log.clear();
                if shard.log.capacity() > SHARD_LOG_CAPACITY_KEPT_MAX {
                    shard.log = Vec::new();
                }
                let segment = self.writer.segment;
                taken
                    .effects
                    .extend(shard.log_effects.drain(..).map(|effect| (effect, segment)));
                let budget = std::mem::take(&mut shard.log_budget_bytes);
                self.inner
                    .unwritten_log_bytes
                    .fetch_sub(budget, Ordering::Relaxed);
                taken.budget_bytes += budget;
                open_log
            };
            if let Some(open) = open_log {
                format::seal_log_batch(&mut self.writer.buffer, open);
            }
            self.round_log_buffered = self.writer.buffer.len();
            taken.bytes = self.round_log.len() + self.writer.buffer.len();
            // Rotation fsyncs: never with a shard locked.
            self.overflow_rotate(rotated_mid_round)?;
            if self.writer.buffer.len() >= self.inner.options.round_write_bytes {
                self.write_round_buffer()?;
            }
        }
        Ok(())
    }

    /// Runs one round; false once the store is poisoned.
    fn run_round(&mut self, plan: Plan) -> bool {
        let budget_flush = plan.budget_flush;
        let running = self.run_planned_round(plan);
        if budget_flush {
            // Also when the round failed (a successful one cleared it after publishing): an
            // append may ask for a flush again.
            self.inner.flush_soon.store(false, Ordering::SeqCst);
        }
        running
    }

    #[allow(
        clippy::too_many_lines,
        reason = "the steps of a round in order, easier to audit in one place"
    )]
    fn run_planned_round(&mut self, plan: Plan) -> bool {
        self.round_flushed = 0;
        self.round_log_buffered = 0;
        self.round_log.clear();
        self.published = 0;
        // The queues this round took off the pending lists, to put back if it fails.
        let mut taken_keys = TakenKeys {
            direct: Vec::new(),
            all: plan.all.clone(),
        };
        self.refresh_listed(plan.round);
        if self.writer.length >= self.inner.options.segment_bytes_max
            && let Err(error) = self.rotate_with_floor(plan.round, &plan.all)
        {
            return self.fail_round(
                plan.round,
                &error,
                "starting a new segment",
                TakenLog::default(),
                Vec::new(),
                taken_keys,
                false,
            );
        }
        let round_start = self.writer.length;
        let log_segment = self.writer.segment;
        self.note_round_start(plan.round);
        let timestamp_ms = now_ms();
        let mut placed = std::mem::take(&mut self.spare_placed);
        let mut rotated_mid_round = false;
        self.writer.buffer.reset(self.writer.length);
        // Queues are sealed in shard order (see `freeze_run`); a queue's chunks follow its
        // log records, which are already in the round buffer.
        let mut run = std::mem::take(&mut self.spare_run);
        let mut taken = TakenLog::default();
        let mut result = self.take_logs(plan.round, &mut run, &mut rotated_mid_round, &mut taken);
        taken_keys
            .direct
            .extend(run.iter().map(|(_, _, key)| key.clone()));
        run.extend(plan.all.into_iter().map(|listed| {
            (
                self.inner.shard_index(&listed.key.name),
                Seal::All(listed.since_round),
                listed.key,
            )
        }));
        let mut requeue = Vec::new();
        if result.is_ok() {
            result = self.freeze_run(
                &mut run,
                plan.round,
                timestamp_ms,
                &mut placed,
                &mut taken,
                &mut requeue,
                &mut rotated_mid_round,
            );
        }
        if !requeue.is_empty() {
            lock(&self.inner.pending).buffered.extend(requeue);
        }
        if run.is_empty() {
            // Emptied by `freeze_run` (not when the round failed before it).
            self.spare_run = run;
        }
        if result.is_ok() && !self.writer.buffer.is_empty() {
            result = self.write_round_buffer();
        }
        if result.is_ok() {
            // Writes may still be on their way (direct writes): a failed one fails the round
            // like a failed write, before the fsync.
            result = self.writer.file.finish_writes();
        }
        let result = match (result, self.published.checked_sub(1)) {
            (Err(error), Some(last)) => {
                return self.fail_published_round(
                    plan.round,
                    error,
                    rotated_mid_round,
                    taken.budget_bytes,
                    placed,
                    last,
                    taken_keys,
                );
            }
            (result, _) => result,
        };
        if let Err(error) = result {
            let (failure, doing, fatal) =
                self.cut_failed_round(round_start, error, rotated_mid_round);
            return self.fail_round(
                plan.round, &failure, doing, taken, placed, taken_keys, fatal,
            );
        }
        let written = self.round_flushed;
        self.inner
            .counters
            .bytes_written
            .fetch_add(written, Ordering::Relaxed);
        if written > 0 || rotated_mid_round {
            if let Err(error) = self.writer.file.sync() {
                return self.fail_round(
                    plan.round,
                    &error,
                    "fsyncing a segment",
                    TakenLog::default(),
                    Vec::new(),
                    taken_keys,
                    true,
                );
            }
            self.inner
                .counters
                .file_syncs
                .fetch_add(1, Ordering::Relaxed);
        }
        // Whatever the round had to write is durable (with nothing to write, nothing
        // acknowledged waits for the disk): appends may be taken again, and a later round
        // that fails sets the flag again.
        self.inner.disk_full.store(false, Ordering::SeqCst);
        // Published only once durable: under `always` readers see exactly the indexed chunks
        // and the buffered messages of completed rounds, so they never see a message that a
        // crash or a full disk could still take back. Emptied write buffers become spares
        // (see `release_spares`).
        self.spares_kept |= !placed.is_empty();
        self.spare_placed = self.apply(plan.round, placed, taken);
        if plan.is_checkpoint {
            self.inner
                .counters
                .checkpoints
                .fetch_add(1, Ordering::Relaxed);
        }
        if plan.budget_flush {
            self.inner
                .counters
                .budget_flushes
                .fetch_add(1, Ordering::Relaxed);
            // Budget freed: an append may ask for a flush again, without waiting for the
            // garbage collection below (relocation and deletions fsync).
            self.inner.flush_soon.store(false, Ordering::SeqCst);
        }
        self.inner.counters.rounds.fetch_add(1, Ordering::Relaxed);
        self.complete(plan.round, None);
        if plan.is_checkpoint
            && let Some(segment) = self.checkpoint_floor(plan.round, log_segment)
        {
            self.log_floor = self.log_floor.max(segment);
        }
        self.collect_garbage()
    }

    /// The segment-deletion floor a completed checkpoint round `round`, whose log went to
    /// `log_segment`, allows. Every message logged in this round or earlier is now in a chunk,
    /// except those marked with a later round, whose log records are in this round's log (in
    /// `log_segment` or later) or in later rounds; and except those of queues deleted with
    /// their delete record still to be written (`gone`): their log records must stay until it
    /// is durable, so the floor stops at the segment where the oldest of those began (`None`:
    /// not known, no raise). Stopping there rather than not raising at all matters: garbage
    /// collection asks for another checkpoint while the floor does not move.
    fn checkpoint_floor(&self, round: u64, log_segment: u32) -> Option<u32> {
        let Some(oldest) = self
            .gone
            .iter()
            .filter(|(_, until)| *until > round)
            .map(|(listed, _)| listed.since_round)
            .min()
        else {
            return Some(log_segment);
        };
        let known = self
            .round_starts
            .partition_point(|(started, _)| *started <= oldest);
        let start = self.round_starts.get(known.checked_sub(1)?)?;
        Some(start.1.segment.min(log_segment))
    }

    /// Remembers where round `round` starts (the end of the active segment), unless a round
    /// started less than [`ROUND_START_SPACING_BYTES`] before in the same segment.
    fn note_round_start(&mut self, round: u64) {
        let here = LogFloor {
            segment: self.writer.segment,
            position: self.writer.length,
        };
        let near = self.round_starts.back().is_some_and(|(_, last)| {
            last.segment == here.segment
                && here.position.saturating_sub(last.position) < ROUND_START_SPACING_BYTES
        });
        if !near {
            self.round_starts.push_back((round, here));
        }
    }

    /// Raises stale entries at the front of the buffered list, before round `round`: a queue
    /// stays listed, with the round it was first listed in, while rounds seal its buffer
    /// chunk by chunk (its messages keep coming), so the entry says far older than the
    /// queue's oldest unsealed message (its `unsealed_since`) and would hold the log floor,
    /// and so recovery's replay, back. From the front, at most [`REFRESH_PER_ROUND_MAX`]
    /// entries a round: a stale one goes to the back with its queue's round; one of a queue
    /// with nothing buffered is dropped (and the queue unlisted); one of a deleted queue
    /// moves to `gone` until its delete record is durable; the first accurate one stops the
    /// walk (that queue really holds an old message; the budget flush or a checkpoint seals
    /// it). Runs between rounds on the committer, the only thread that takes entries off the
    /// list; shard locks are taken without the pending lock (the order is shard, then
    /// pending).
    fn refresh_listed(&mut self, round: u64) {
        // The rounds before `round` are complete: so are the delete records they held.
        self.gone.retain(|(_, until)| *until >= round);
        let front: Vec<Listed> = {
            let mut pending = lock(&self.inner.pending);
            let count = pending.buffered.len().min(REFRESH_PER_ROUND_MAX);
            pending.buffered.drain(..count).collect()
        };
        let mut kept = Vec::new();
        let mut moved = Vec::new();
        let mut entries = front.into_iter();
        for mut listed in entries.by_ref() {
            let since = {
                let mut shard = lock(self.inner.shard(&listed.key.name));
                match shard.queues.get_mut(&*listed.key.name) {
                    Some(state) if state.incarnation == listed.key.incarnation => {
                        if !state.queued {
                            Some(None)
                        } else if state.buffer.is_none() {
                            // Nothing unsealed (between rounds nothing is frozen): unlisted;
                            // its next append lists it again.
                            state.queued = false;
                            Some(None)
                        } else {
                            Some(Some(state.unsealed_since))
                        }
                    }
                    // Deleted: the delete record is in this round's log at the latest.
                    _ => None,
                }
            };
            match since {
                None => self.gone.push((listed, round)),
                Some(None) => {}
                Some(Some(since)) if since > listed.since_round => {
                    listed.since_round = since;
                    moved.push(listed);
                }
                Some(Some(_)) => {
                    kept.push(listed);
                    break;
                }
            }
        }
        kept.extend(entries);
        if kept.is_empty() && moved.is_empty() {
            return;
        }
        let mut pending = lock(&self.inner.pending);
        for listed in kept.into_iter().rev() {
            pending.buffered.push_front(listed);
        }
        pending.buffered.extend(moved);
    }

    /// The log floor before round `round` starts, `all` being the queues it took off the
    /// buffered list. Every message logged but not yet sealed belongs to a queue on the
    /// buffered list or in `all` (the rounds before `round` are complete, so nothing is
    /// frozen), and each such entry's `since_round` is no later than the round that logged
    /// the queue's oldest unsealed message. So every log record before the start of the
    /// oldest such round is dead: its messages are in chunks of completed rounds, or trimmed,
    /// or deleted. A remembered start at or before that round stands for it (positions only
    /// grow). Prunes the starts before the one used.
    fn floor_for(&mut self, round: u64, all: &[Listed]) -> LogFloor {
        let oldest = {
            let pending = lock(&self.inner.pending);
            pending
                .buffered
                .iter()
                .chain(all)
                .chain(self.gone.iter().map(|(listed, _)| listed))
                .map(|listed| listed.since_round)
                .min()
                .unwrap_or(round)
        };
        if oldest >= round {
            // Nothing unsealed was logged before this round: all of the log so far is dead.
            return LogFloor {
                segment: self.writer.segment,
                position: self.writer.length,
            };
        }
        let known = self
            .round_starts
            .partition_point(|(started, _)| *started <= oldest);
        if known == 0 {
            // Not expected (round 0 is always known); the last floor stays true.
            return self.floor;
        }
        self.round_starts.drain(..known - 1);
        self.round_starts[0].1
    }

    /// Rotates at the start of round `round` (see `floor_for` for `all`), writing the log
    /// floor as of now at the start of the new segment.
    fn rotate_with_floor(&mut self, round: u64, all: &[Listed]) -> io::Result<()> {
        // A floor may come out lower than the last one (a remembered round start stands
        // for later rounds, and a rotation that failed wrote its floor nowhere); both are
        // true, so the higher one is kept.
        let floor = self.floor_for(round, all);
        self.floor = floor.max(self.floor);
        self.rotate()?;
        // Segments before the floor's hold no needed log record.
        self.log_floor = self.log_floor.max(self.floor.segment);
        Ok(())
    }

    /// Writes the round buffer so far (no fsync) and empties it; its log records are kept
    /// aside for a failure. A failed round truncates the segment back to where it started.
    fn write_round_buffer(&mut self) -> io::Result<()> {
        if self.round_log_buffered > 0 {
            // The file may keep the buffer's memory (see `StorageFile::write_bytes`).
            self.round_log
                .extend_from_slice(&self.writer.buffer[..self.round_log_buffered]);
            self.round_log_buffered = 0;
        }
        debug_assert_eq!(self.writer.buffer.position(), self.writer.length);
        let written = self.writer.buffer.len() as u64;
        self.writer.file.write_bytes(&mut self.writer.buffer)?;
        self.writer.length += written;
        self.round_flushed += written;
        Ok(())
    }

    /// Starts a new segment mid-round when the active one nears the u32 position limit.
    fn overflow_rotate(&mut self, rotated: &mut bool) -> io::Result<()> {
        if self.writer.length + (self.writer.buffer.len() as u64) < POSITION_SOFT_MAX {
            return Ok(());
        }
        *rotated = true;
        self.round_log_buffered = 0;
        let written = self.writer.buffer.len() as u64;
        self.writer.file.write_bytes(&mut self.writer.buffer)?;
        self.writer.length += written;
        self.rotate()
    }

    /// Seals the queues of `run` (emptied) in shard order, stable so that a queue's two
    /// entries keep their order: each shard is locked once per [`FREEZE_QUEUES_PER_LOCK_MAX`]
    /// queues instead of once per queue, which matters when many appenders compete for the
    /// shard locks and the CPU. Keys of queues sealed with [`Seal::All`] that keep buffered
    /// messages go to `requeue`.
    #[allow(
        clippy::too_many_arguments,
        reason = "the round's state, passed down from run_planned_round"
    )]
    fn freeze_run(
        &mut self,
        run: &mut Vec<RunEntry>,
        round: u64,
        timestamp_ms: u64,
        placed: &mut Vec<Placed>,
        taken: &mut TakenLog,
        requeue: &mut Vec<Listed>,
        rotated_mid_round: &mut bool,
    ) -> io::Result<()> {
        run.sort_by_key(|(shard_index, _, _)| *shard_index);
        let inner = self.inner;
        let mut held: Option<(usize, usize, MutexGuard<'_, Shard>)> = None;
        for (shard_index, seal, key) in run.drain(..) {
            if self.writer.length + (self.writer.buffer.len() as u64) >= POSITION_SOFT_MAX {
                // Rotation fsyncs: never with a shard locked.
                held = None;
                self.overflow_rotate(rotated_mid_round)?;
            }
            if self.writer.buffer.len() >= self.inner.options.round_write_bytes {
                // A write takes a while: never with a shard locked.
                held = None;
                self.write_round_buffer()?;
                if !*rotated_mid_round {
                    self.publish_written(round, placed, taken);
                }
            }
            let reuse = held.as_ref().is_some_and(|(index, frozen, _)| {
                *index == shard_index && *frozen < FREEZE_QUEUES_PER_LOCK_MAX
            });
            if !reuse {
                // One shard lock at a time: release the previous one first.
                drop(held.take());
                held = Some((shard_index, 0, lock(&inner.shards[shard_index])));
            }
            // Invariant: `held` was set just above.
            let (_, frozen, shard) = held.as_mut().expect("shard locked above");
            *frozen += 1;
            if let Some(since_round) =
                self.freeze(shard, shard_index, &key, seal, round, timestamp_ms, placed)
            {
                requeue.push(Listed { key, since_round });
            }
        }
        Ok(())
    }

    /// Seals the unfrozen messages of one queue that are logged in round `round` or earlier
    /// into chunk records in the round buffer: whole chunks of `chunk_bytes`, then the rest.
    /// Returns the `since_round` with which the key must go back on the buffered list, if it
    /// must.
    #[allow(
        clippy::too_many_arguments,
        reason = "the round's context, passed down from freeze_run"
    )]
    fn freeze(
        &mut self,
        shard: &mut Shard,
        shard_index: usize,
        key: &QueueKey,
        seal: Seal,
        round: u64,
        timestamp_ms: u64,
        placed: &mut Vec<Placed>,
    ) -> Option<u64> {
        let chunk_bytes = self.inner.options.chunk_bytes;
        let Some(state) = shard
            .queues
            .get_mut(&*key.name)
            .filter(|state| state.incarnation == key.incarnation)
        else {
            // Deleted: its delete record may be in the next round's log (the delete came after
            // this round took that shard's log), and the floor must count the entry till then.
            if let Seal::All(since_round) = seal {
                let listed = Listed {
                    key: key.clone(),
                    since_round,
                };
                self.gone.push((listed, round + 1));
            }
            return None;
        };
        if matches!(seal, Seal::All(_)) {
            state.queued = false;
        }
        let buffer = state.buffer.as_mut()?;
        let logged_end = buffer.logged_through(round);
        let sealable = usize::try_from(logged_end - buffer.first_offset)
            .unwrap_or(usize::MAX)
            .min(buffer.count);
        let mut index = buffer.frozen;
        let mut byte_start = buffer.frozen_bytes;
        while index < sealable {
            // Messages index..end, framed in data[byte_start..byte_end], payload bytes in all.
            let mut end = index;
            let mut byte_end = byte_start;
            let mut payload = 0;
            let mut whole = false;
            while end < sealable {
                let length = buffer.length_at(byte_end);
                if end > index && payload + length > chunk_bytes {
                    whole = true;
                    break;
                }
                payload += length;
                byte_end += FRAME_BYTES + length;
                end += 1;
            }
            whole |= payload >= chunk_bytes;
            debug_assert!(whole || end == sealable);
            let position = self.writer.position();
            let before = self.writer.buffer.len();
            let first_offset = buffer.first_offset + index as u64;
            // Room first: the encoder appends to the buffer's `Vec`, which must not move.
            self.writer.buffer.reserve(format::chunk_record_bytes(
                key.name.len(),
                end - index,
                payload,
            ));
            format::encode_chunk_framed(
                self.writer.buffer.vec_mut(),
                &key.name,
                first_offset,
                timestamp_ms,
                end - index,
                payload,
                &buffer.bytes()[byte_start..byte_end],
            );
            let entry = ChunkEntry {
                first_offset,
                segment: self.writer.segment,
                position,
            };
            placed.push(Placed {
                key: key.clone(),
                shard: shard_index,
                entry,
                count: end - index,
                buffered_bytes: byte_end - byte_start,
                record_bytes: (self.writer.buffer.len() - before) as u64,
            });
            index = end;
            byte_start = byte_end;
        }
        buffer.frozen = index;
        buffer.frozen_bytes = byte_start;
        if let Seal::All(since_round) = seal
            && buffer.count > buffer.frozen
        {
            // Messages of a later round stay buffered: keep the queue on the buffered list.
            // Their marks say they were logged after this round, which holds unless marks
            // were merged.
            state.queued = true;
            return Some(if buffer.marks_merged {
                since_round
            } else {
                round + 1
            });
        }
        if state.direct_round < shard.log_round && buffer.unfrozen_payload_bytes() >= chunk_bytes {
            // A whole chunk is still due (its messages were logged in the next round): the
            // next round seals it, and the queue's appends in it need no log record.
            state.direct_round = shard.log_round;
            shard.direct.push(key.clone());
            self.inner.log_pending.fetch_add(1, Ordering::SeqCst);
        }
        None
    }

    /// Publishes a written round in the index. Chunks come grouped by shard (see
    /// `freeze_run`), so each shard is locked once per run of at most
    /// [`FREEZE_QUEUES_PER_LOCK_MAX`] chunks; the segments' live counts and the budget are
    /// updated once per publication. The trim and delete records' effects come first: they
    /// were written before the chunks. Only what `publish_written` left is published here.
    /// Returns `placed`, emptied, for the next round.
    fn apply(&mut self, round: u64, mut placed: Vec<Placed>, taken: TakenLog) -> Vec<Placed> {
        if self.published == 0 {
            self.apply_effects(taken.effects);
        }
        let freed_bytes = taken.budget_bytes + self.apply_chunks(round, &placed[self.published..]);
        self.inner
            .buffered_bytes
            .fetch_sub(freed_bytes, Ordering::SeqCst);
        placed.clear();
        placed
    }

    /// Under `interval`, publishes the chunks of the round being built whose writes have
    /// landed (whole queues at a time), after the round's trim and delete effects; frees
    /// their budget at once and wakes the appends waiting for it. The disk meanwhile writes
    /// the round's later pieces, so publishing no longer leaves it idle at the round's end,
    /// and appends waiting for budget go on while the round is written. Published before
    /// the round's fsync is what `interval` promises (an acknowledged append is readable at
    /// once, durable within the interval); under `always` chunks wait for the fsync.
    fn publish_written(&mut self, round: u64, placed: &[Placed], taken: &mut TakenLog) {
        if self.interval().is_none() || self.published == placed.len() {
            return;
        }
        let through = self.writer.file.written_through();
        let mut end = self.published;
        while end < placed.len()
            && u64::from(placed[end].entry.position) + placed[end].record_bytes <= through
        {
            end += 1;
        }
        // A queue's chunks are published together (see `apply_chunks`).
        while end > self.published
            && end < placed.len()
            && Arc::ptr_eq(&placed[end - 1].key.name, &placed[end].key.name)
            && placed[end - 1].key.incarnation == placed[end].key.incarnation
        {
            end -= 1;
        }
        if end == self.published {
            return;
        }
        if self.published == 0 {
            self.apply_effects(std::mem::take(&mut taken.effects));
        }
        let freed_bytes = self.apply_chunks(round, &placed[self.published..end]);
        self.published = end;
        self.inner
            .buffered_bytes
            .fetch_sub(freed_bytes, Ordering::SeqCst);
        let _commit = lock(&self.inner.commit);
        self.inner.committed.notify_all();
    }

    /// Applies a round's trim and delete records' effects, in order, with the segment each
    /// went to.
    fn apply_effects(&self, effects: Vec<(RecordEffect, u32)>) {
        let inner = self.inner;
        for (effect, segment) in effects {
            {
                let mut segments = lock(&inner.segments);
                for (dead_segment, count) in effect.dead {
                    if let Some(entry) = segments.get_mut(&dead_segment) {
                        entry.live_chunks = entry.live_chunks.saturating_sub(count);
                    }
                }
            }
            if let Some(key) = effect.trim_of {
                let mut shard = lock(inner.shard(&key.name));
                if let Some(state) = shard.queues.get_mut(&*key.name)
                    && state.incarnation == key.incarnation
                {
                    state.trim_segment = segment;
                }
            }
        }
    }

    /// Publishes `placed` (whole queues: a queue's chunks are consecutive in it) in the index
    /// and drains them from the write buffers; returns the bytes drained.
    fn apply_chunks(&self, round: u64, placed: &[Placed]) -> usize {
        let inner = self.inner;
        let mut held: Option<(usize, usize, MutexGuard<'_, Shard>)> = None;
        let mut live_added: Vec<(u32, u64)> = Vec::new();
        let mut freed_bytes = 0;
        let spare_bytes_max = inner.spare_bytes_max();
        let mut chunks: Vec<&Placed> = Vec::new();
        let mut drained = placed.iter().peekable();
        while let Some(first) = drained.next() {
            // A queue's chunks are consecutive in `placed` (see `freeze`): publish them under one
            // lock and drain the buffer once, not once per chunk (each drain moves the rest of
            // the buffer, which is quadratic for a queue that sealed many chunks in a round).
            chunks.clear();
            chunks.push(first);
            while let Some(next) = drained.next_if(|next| {
                Arc::ptr_eq(&next.key.name, &chunks[0].key.name)
                    && next.key.incarnation == chunks[0].key.incarnation
            }) {
                chunks.push(next);
            }
            let (shard_index, key) = (chunks[0].shard, chunks[0].key.clone());
            let reuse = held.as_ref().is_some_and(|(index, applied, _)| {
                *index == shard_index && *applied < FREEZE_QUEUES_PER_LOCK_MAX
            });
            if !reuse {
                drop(held.take());
                held = Some((shard_index, 0, lock(&inner.shards[shard_index])));
            }
            // Invariant: `held` was set just above.
            let (_, applied, guard) = held.as_mut().expect("shard locked above");
            *applied += 1;
            let shard = &mut **guard;
            let Some(state) = shard.queues.get_mut(&*key.name) else {
                continue;
            };
            if state.incarnation != key.incarnation {
                continue;
            }
            let (mut count, mut bytes) = (0, 0);
            for chunk in &chunks {
                state.chunks.push_back(chunk.entry);
                state.stored_bytes += chunk.record_bytes;
                match live_added.last_mut() {
                    Some((segment, added)) if *segment == chunk.entry.segment => *added += 1,
                    _ => live_added.push((chunk.entry.segment, 1)),
                }
                count += chunk.count;
                bytes += chunk.buffered_bytes;
            }
            // Invariant: frozen messages stay buffered until this drain.
            let buffer = state.buffer.as_mut().expect("frozen messages are buffered");
            debug_assert_eq!(buffer.first_offset, chunks[0].entry.first_offset);
            buffer.drain_front(count, bytes);
            // The round sealed everything this queue logged through it, unless merged marks
            // hid a message's round (see `WriteBuffer::marks`).
            if !buffer.marks_merged {
                state.unsealed_since = state.unsealed_since.max(round + 1);
            }
            if buffer.count == 0
                && let Some(emptied) = state.buffer.take()
            {
                shard.spare.keep(emptied, spare_bytes_max);
            }
            freed_bytes += bytes;
        }
        drop(held);
        let mut segments = lock(&inner.segments);
        for (segment, count) in live_added {
            if let Some(entry) = segments.get_mut(&segment) {
                entry.live_chunks += count;
                entry.chunks_total += count;
            }
        }
        drop(segments);
        freed_bytes
    }

    fn complete(&self, round: u64, error: Option<WriteError>) {
        let mut commit = lock(&self.inner.commit);
        commit.completed = commit.completed.max(round);
        self.inner
            .completed_round
            .fetch_max(round, Ordering::SeqCst);
        if let Some(error) = error {
            commit.failures.push((round, error));
            if commit.failures.len() > FAILURES_MAX {
                commit.failures.remove(0);
            }
        }
        self.inner.committed.notify_all();
    }

    fn poison(&self, reason: String) -> bool {
        let mut commit = lock(&self.inner.commit);
        commit.poisoned = Some(reason);
        self.inner.poisoned.store(true, Ordering::Release);
        self.inner.committed.notify_all();
        false
    }

    /// Puts the trim and delete records of a failed round back at the front of shard 0's
    /// log (with their effects), so they are retried before anything appended later; under
    /// `interval` the log records of messages too (they are acknowledged).
    fn requeue_log(&self, shard: &mut Shard, taken: TakenLog, round_bytes: &[u8], keep_all: bool) {
        let mut kept = Vec::new();
        let mut position = 0;
        while position < taken.bytes {
            let body =
                usize::try_from(format::read_u32(round_bytes, position + 4)).unwrap_or(usize::MAX);
            let end = position + RECORD_HEADER_BYTES + body;
            let record = &round_bytes[position..end];
            if keep_all || format::is_trim_or_delete(format::record_kind(record)) {
                kept.extend_from_slice(record);
            }
            position = end;
        }
        let requeued = !kept.is_empty() || !taken.effects.is_empty();
        // Appends made since keep going to a record of their own, after the kept ones.
        shard.seal_log();
        kept.extend_from_slice(&shard.log);
        shard.log = kept;
        let mut effects: Vec<RecordEffect> = taken
            .effects
            .into_iter()
            .map(|(effect, _)| effect)
            .collect();
        effects.append(&mut shard.log_effects);
        shard.log_effects = effects;
        shard.log_budget_bytes += taken.budget_bytes;
        self.inner
            .unwritten_log_bytes
            .fetch_add(taken.budget_bytes, Ordering::Relaxed);
        if requeued {
            self.inner.log_pending.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Cuts the active segment back to `cut` after a round's write failed with `error`:
    /// the failure to report, what failed and whether it is fatal (the round rotated mid-way
    /// or its partial write cannot be cut off; otherwise a full disk is retried).
    fn cut_failed_round(
        &mut self,
        cut: u64,
        error: io::Error,
        rotated_mid_round: bool,
    ) -> (io::Error, &'static str, bool) {
        if rotated_mid_round {
            (error, "writing a commit round", true)
        } else if let Err(truncate_error) = self.writer.file.truncate(cut) {
            (truncate_error, "truncating", true)
        } else {
            self.writer.length = cut;
            (error, "writing a commit round", false)
        }
    }

    /// Fails round `round` after some of its chunks (`placed` up to `last`) were published
    /// (see `publish_written`): those were written, after its log records (whose effects are
    /// applied), so the round stands up to its last published chunk and the rest is cut off
    /// and retried as a failed round's. Fatal where it cannot be cut off.
    #[allow(
        clippy::too_many_arguments,
        reason = "the round's state, passed on to fail_round"
    )]
    fn fail_published_round(
        &mut self,
        round: u64,
        error: io::Error,
        rotated_mid_round: bool,
        log_budget_bytes: usize,
        mut placed: Vec<Placed>,
        last: usize,
        taken_keys: TakenKeys,
    ) -> bool {
        let cut = u64::from(placed[last].entry.position) + placed[last].record_bytes;
        let (failure, doing, fatal) = self.cut_failed_round(cut, error, rotated_mid_round);
        // The log records stay written: only their budget is left to free.
        self.inner
            .buffered_bytes
            .fetch_sub(log_budget_bytes, Ordering::SeqCst);
        self.round_log.clear();
        self.round_log_buffered = 0;
        let unpublished = placed.split_off(last + 1);
        self.fail_round(
            round,
            &failure,
            doing,
            TakenLog::default(),
            unpublished,
            taken_keys,
            fatal,
        )
    }

    /// Handles a failed round. A full disk (before any mid-round rotation) is recoverable: the
    /// round's bytes were truncated away. Anything else poisons the store.
    #[allow(
        clippy::too_many_arguments,
        clippy::too_many_lines,
        reason = "everything the failed round took, put back in one place for both policies"
    )]
    fn fail_round(
        &mut self,
        round: u64,
        error: &io::Error,
        operation: &str,
        taken: TakenLog,
        placed: Vec<Placed>,
        taken_keys: TakenKeys,
        fatal: bool,
    ) -> bool {
        if fatal || !is_no_space(error) {
            return self.poison(format!(
                "{operation} in segment {}: {error}",
                self.writer.segment
            ));
        }
        let failure = WriteError::StorageFull {
            operation: operation.to_string(),
        };
        self.backing_off = true;
        // The round's delete records go back into the logs for the next round that writes
        // (under `always` the one after next: both fail): the floor counts the deleted queues'
        // entries until it completes.
        let next = if self.interval().is_some() {
            round + 1
        } else {
            round + 2
        };
        for (_, until) in &mut self.gone {
            *until = (*until).max(next);
        }
        let round_bytes = std::mem::take(&mut self.writer.buffer);
        // The round's log records: those written (and truncated away with the rest of the
        // round) were kept aside, the others are still at the start of its buffer.
        let mut round_log = std::mem::take(&mut self.round_log);
        round_log.extend_from_slice(&round_bytes[..self.round_log_buffered]);
        self.round_log_buffered = 0;
        let log_bytes = &round_log[..];
        let mut unfreeze: Vec<QueueKey> = placed.into_iter().map(|chunk| chunk.key).collect();
        unfreeze.extend(taken_keys.all.iter().map(|listed| listed.key.clone()));
        let sealed_keys = taken_keys.all;
        if self.interval().is_some() {
            // Messages of the direct queues have no log record to put back: list the queues
            // again, so that the next round seals them.
            for key in taken_keys.direct {
                let mut guard = lock(self.inner.shard(&key.name));
                let shard = &mut *guard;
                if let Some(state) = shard.queues.get_mut(&*key.name)
                    && state.incarnation == key.incarnation
                    && state.direct_round < shard.log_round
                {
                    state.direct_round = shard.log_round;
                    shard.direct.push(key);
                    self.inner.log_pending.fetch_add(1, Ordering::SeqCst);
                }
            }
            // Acknowledged messages must not be dropped: keep them buffered, put their log
            // records back, and retry.
            for key in &unfreeze {
                let mut shard = lock(self.inner.shard(&key.name));
                if let Some(state) = shard.queues.get_mut(&*key.name)
                    && let Some(buffer) = state.buffer.as_mut()
                {
                    buffer.frozen = 0;
                    buffer.frozen_bytes = 0;
                    // Unknown again: an earlier part of the queue may have been published
                    // this round (see `publish_written`), which raised it past the messages
                    // still buffered.
                    state.unsealed_since = 0;
                }
            }
            self.requeue_log(&mut lock(&self.inner.shards[0]), taken, log_bytes, true);
            // Lock order shard -> pending: flag the queues first, then list them.
            let mut relisted = Vec::new();
            for listed in sealed_keys.into_iter().rev() {
                let key = &listed.key;
                let inner = self.inner;
                let mut shard = lock(inner.shard(&key.name));
                match shard
                    .queues
                    .get_mut(&*key.name)
                    .filter(|state| state.incarnation == key.incarnation)
                {
                    // Taken off the buffered list by this round (sealed or not): list it again
                    // (at worst twice, which only costs a look), with its `since_round`.
                    Some(state) if state.buffer.is_some() => {
                        state.queued = true;
                        drop(shard);
                        relisted.push(listed);
                    }
                    // Nothing buffered: unlisted, so its next append lists it again.
                    Some(state) => state.queued = false,
                    // Deleted: the floor counts it until its delete record is rewritten.
                    None => {
                        drop(shard);
                        self.gone.push((listed, round + 1));
                    }
                }
            }
            let mut pending = lock(&self.inner.pending);
            for key in relisted {
                pending.buffered.push_front(key);
            }
            self.inner.disk_full.store(true, Ordering::SeqCst);
            drop(pending);
            self.writer.buffer = round_bytes;
            self.complete(round, Some(failure));
            return true;
        }
        // Under `always` no message of this round or the next is acknowledged yet: drop them
        // all and fail every waiter of both. Holding every shard lock means no append is half
        // done.
        let mut shards: Vec<_> = self.inner.shards.iter().map(|shard| lock(shard)).collect();
        let mut pending = lock(&self.inner.pending);
        let mut dropped_bytes = 0;
        for shard in &mut shards {
            let shard = &mut **shard;
            shard.queues.retain(|_, state| {
                if let Some(buffer) = state.buffer.as_mut() {
                    buffer.frozen = 0;
                    buffer.frozen_bytes = 0;
                    let keep = buffer.logged_through(round - 1);
                    dropped_bytes += buffer.truncate_to(keep);
                    state.next_offset = buffer.end_offset();
                    if buffer.count == 0 {
                        state.buffer = None;
                    }
                }
                !(state.next_offset == 0 && state.trim_segment == NO_SEGMENT)
            });
            // The next round's log: keep only its trim and delete records.
            shard.seal_log();
            let log = std::mem::take(&mut shard.log);
            let effects = std::mem::take(&mut shard.log_effects);
            let budget = std::mem::take(&mut shard.log_budget_bytes);
            self.inner
                .unwritten_log_bytes
                .fetch_sub(budget, Ordering::Relaxed);
            let mut pending_taken = TakenLog {
                bytes: log.len(),
                effects: effects.into_iter().map(|effect| (effect, 0)).collect(),
                budget_bytes: budget,
            };
            let mut only_records = Shard::default();
            self.requeue_log(
                &mut only_records,
                std::mem::take(&mut pending_taken),
                &log,
                false,
            );
            shard.log = only_records.log;
            shard.log_effects = only_records.log_effects;
            shard.log_budget_bytes = only_records.log_budget_bytes;
            // Rounds `round` and `round + 1` fail as a whole: later appends go to the next.
            shard.log_round = round + 2;
        }
        self.requeue_log(&mut shards[0], taken, log_bytes, false);
        self.inner
            .buffered_bytes
            .fetch_sub(dropped_bytes, Ordering::SeqCst);
        debug_assert_eq!(shards.len(), SHARD_COUNT);
        for listed in sealed_keys {
            let key = &listed.key;
            let index = self.inner.shard_index(&key.name);
            match shards[index]
                .queues
                .get_mut(&*key.name)
                .filter(|state| state.incarnation == key.incarnation)
            {
                Some(state) if state.buffer.is_some() => {
                    state.queued = true;
                    pending.buffered.push_front(listed);
                }
                // As under `interval`; the delete record goes out in `round + 2`.
                Some(state) => state.queued = false,
                None => self.gone.push((listed, round + 2)),
            }
        }
        for shard in &mut shards {
            // The direct queues' messages of both rounds were dropped above.
            shard.direct.clear();
            for state in shard.queues.values_mut() {
                state.direct_round = 0;
            }
        }
        // Appenders that buffered before now wait for `round` or `round + 1`: fail both.
        self.inner.rounds_started.store(round + 1, Ordering::SeqCst);
        drop(pending);
        drop(shards);
        self.writer.buffer = round_bytes;
        self.complete(round, Some(failure.clone()));
        self.complete(round + 1, Some(failure));
        true
    }

    /// Closes the active segment and starts the next one: fsync the old file, create the new
    /// one, write and fsync its header, fsync the directory.
    fn rotate(&mut self) -> io::Result<()> {
        // A failed fsync is never "disk full": the kernel may have dropped the dirty pages, so
        // it must poison the store rather than be retried.
        let fatal = |error: io::Error| io::Error::other(format!("fsync failed: {error}"));
        self.writer.file.sync().map_err(fatal)?;
        self.inner
            .counters
            .file_syncs
            .fetch_add(1, Ordering::Relaxed);
        let segment = self.writer.segment + 1;
        let name = format::segment_file_name(segment);
        let file = self.inner.storage.create(&name)?;
        let mut header = format::encode_segment_header(segment).to_vec();
        format::encode_floor(&mut header, self.floor);
        let written = file.write_at(0, &header).and_then(|()| {
            file.sync().map_err(fatal)?;
            self.inner.storage.sync_dir().map_err(fatal)
        });
        if let Err(error) = written {
            // Best effort, so a retry can create it again; recovery also copes with a last
            // segment that holds only its header or is shorter than it.
            let _ = self.inner.storage.remove(&name);
            return Err(error);
        }
        self.inner
            .counters
            .file_syncs
            .fetch_add(1, Ordering::Relaxed);
        self.inner
            .counters
            .dir_syncs
            .fetch_add(1, Ordering::Relaxed);
        lock(&self.inner.segments).insert(
            segment,
            SegmentEntry {
                file: file.clone(),
                live_chunks: 0,
                chunks_total: 0,
            },
        );
        // The round buffer (empty here) keeps its capacity: growing it again after every
        // rotation faulted in and zeroed fresh pages, a seventh of the CPU under budget flushes.
        let mut buffer = std::mem::take(&mut self.writer.buffer);
        let length = SEGMENT_HEADER_BYTES + FLOOR_RECORD_BYTES as u64;
        buffer.reset(length);
        self.writer = Writer {
            segment,
            file,
            length,
            buffer,
        };
        Ok(())
    }

    /// The live chunk records of segment `oldest`, copied back to back, and for each the
    /// queue, its first offset, its old position and its position in the copy.
    fn live_chunks_of(
        &self,
        oldest: u32,
        file: &dyn StorageFile,
    ) -> Result<(Vec<u8>, Vec<Moved>), String> {
        let length = file.len().map_err(|error| error.to_string())?;
        let mut scanner = Scanner::new(file, length);
        let mut copy = Vec::new();
        let mut moved = Vec::new();
        let mut position = SEGMENT_HEADER_BYTES;
        while position + RECORD_HEADER_BYTES as u64 <= length {
            let total = scanner.bytes(position, RECORD_HEADER_BYTES).map(|header| {
                let body = u64::from(format::read_u32(header, 4));
                (RECORD_HEADER_BYTES as u64 + body).min(length - position)
            });
            let record = total
                .and_then(|total| {
                    scanner.bytes(position, usize::try_from(total).unwrap_or(usize::MAX))
                })
                .map_err(|error| error.to_string())?;
            let record_bytes = record.len() as u64;
            let chunk = match format::decode_checked(record) {
                Ok(Record::Chunk(chunk)) => chunk,
                Ok(_) => {
                    position += record_bytes;
                    continue;
                }
                Err(reason) => return Err(format!("record at {position}: {reason}")),
            };
            let old_position = u32::try_from(position).unwrap_or(u32::MAX);
            let live = {
                let shard = lock(self.inner.shard(chunk.name));
                shard.queues.get(chunk.name).and_then(|state| {
                    let (_, known) = state.chunks.find(chunk.first_offset)?;
                    (known.segment == oldest && known.position == old_position).then(|| QueueKey {
                        name: state.name.clone(),
                        incarnation: state.incarnation,
                    })
                })
            };
            if let Some(key) = live {
                moved.push((key, chunk.first_offset, old_position, copy.len()));
                copy.extend_from_slice(record);
            }
            position += record_bytes;
        }
        Ok((copy, moved))
    }

    /// Copies the live chunk records of segment `oldest` to the end of the active segment,
    /// fsyncs, and points the index at the copies; the old segment is then dead and deleted.
    /// Replay treats a chunk seen twice as moved (FORMAT.md). Returns false once poisoned.
    fn relocate(&mut self, oldest: u32) -> bool {
        let Some(file) = lock(&self.inner.segments)
            .get(&oldest)
            .map(|entry| entry.file.clone())
        else {
            return true;
        };
        let (copy, moved) = match self.live_chunks_of(oldest, file.as_ref()) {
            Ok(found) => found,
            Err(reason) => return self.poison(format!("relocating segment {oldest}: {reason}")),
        };
        if copy.is_empty() {
            return true;
        }
        if self.writer.length >= self.inner.options.segment_bytes_max
            && let Err(error) = self.rotate()
        {
            return is_no_space(&error) || self.poison(format!("rotating to relocate: {error}"));
        }
        if self.writer.length + copy.len() as u64 >= POSITION_SOFT_MAX {
            return true;
        }
        let base = match self.append_synced(&copy) {
            Ok(base) => base,
            Err(None) => return true,
            Err(Some(error)) => return self.poison(format!("writing relocated chunks: {error}")),
        };
        let new_segment = self.writer.segment;
        for (key, first_offset, old_position, offset_in_copy) in moved {
            let mut shard = lock(self.inner.shard(&key.name));
            let Some(state) = shard.queues.get_mut(&*key.name) else {
                continue;
            };
            if state.incarnation != key.incarnation {
                continue;
            }
            let Some((index, known)) = state.chunks.find(first_offset) else {
                continue;
            };
            if known.segment != oldest || known.position != old_position {
                // Trimmed or deleted meanwhile: the copy is dead on arrival.
                continue;
            }
            state.chunks.set(
                index,
                ChunkEntry {
                    first_offset,
                    segment: new_segment,
                    // Invariant: base + copy length < POSITION_SOFT_MAX (checked above).
                    position: u32::try_from(base + offset_in_copy as u64).expect("position fits"),
                },
            );
            let mut segments = lock(&self.inner.segments);
            if let Some(old) = segments.get_mut(&oldest) {
                old.live_chunks = old.live_chunks.saturating_sub(1);
            }
            if let Some(new) = segments.get_mut(&new_segment) {
                new.live_chunks += 1;
                new.chunks_total += 1;
            }
            self.inner
                .counters
                .chunks_relocated
                .fetch_add(1, Ordering::Relaxed);
        }
        true
    }

    /// Appends `bytes` to the active segment outside a round and fsyncs it; returns where
    /// they start. `Err(None)`: the disk is full and the segment was cut back to where it was.
    fn append_synced(&mut self, bytes: &[u8]) -> Result<u64, Option<io::Error>> {
        let written = self.writer.file.write_at(self.writer.length, bytes);
        if let Err(error) = written.and_then(|()| self.writer.file.sync()) {
            if is_no_space(&error) && self.writer.file.truncate(self.writer.length).is_ok() {
                return Err(None);
            }
            return Err(Some(error));
        }
        let base = self.writer.length;
        self.writer.length += bytes.len() as u64;
        self.inner
            .counters
            .bytes_written
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.inner
            .counters
            .file_syncs
            .fetch_add(1, Ordering::Relaxed);
        Ok(base)
    }

    /// Copies to the active segment (and fsyncs it) the trim records of `oldest` that still
    /// carry a queue's offsets: queues with no chunk left, whose trim record is in it.
    fn carry_trims_forward(&mut self, oldest: u32) -> Carried {
        let mut carry = Vec::new();
        let mut carried = Vec::new();
        for shard in &self.inner.shards {
            let shard = lock(shard);
            for state in shard.queues.values() {
                if state.trim_segment == oldest && state.chunks.is_empty() {
                    format::encode_trim(&mut carry, &state.name, state.first_offset);
                    carried.push(QueueKey {
                        name: state.name.clone(),
                        incarnation: state.incarnation,
                    });
                }
            }
        }
        if !carry.is_empty() {
            match self.append_synced(&carry) {
                Ok(_) => {}
                Err(None) => return Carried::NoSpace,
                Err(Some(error)) => {
                    self.poison(format!("copying trim records forward: {error}"));
                    return Carried::Poisoned;
                }
            }
            for key in carried {
                let mut shard = lock(self.inner.shard(&key.name));
                if let Some(state) = shard.queues.get_mut(&*key.name)
                    && state.incarnation == key.incarnation
                {
                    state.trim_segment = self.writer.segment;
                }
            }
        }
        Carried::Done
    }

    /// Deletes the oldest segments while nothing live remains in them. Trim records in such a
    /// segment that still carry a queue's offsets (queues with no chunk left) are first
    /// copied to the active segment. Returns false once poisoned.
    fn collect_garbage(&mut self) -> bool {
        let mut relocated = false;
        loop {
            let (oldest, relocate) = {
                let segments = lock(&self.inner.segments);
                match segments.first_key_value() {
                    Some((&id, entry))
                        if id != self.writer.segment
                            && entry.live_chunks == 0
                            && id >= self.log_floor =>
                    {
                        // Only log records of buffered messages keep it. Budget flushes seal
                        // the oldest buffers first, so the floor usually passes it by a later
                        // rotation; else, once `CHECKPOINT_LAG_SEGMENTS` behind, seal every
                        // buffer in the next round (a checkpoint: a million small chunks at
                        // a million queues, which is why it waits), then it can go.
                        if self.writer.segment - id >= CHECKPOINT_LAG_SEGMENTS {
                            self.checkpoint_wanted = true;
                        }
                        return true;
                    }
                    Some((&id, entry)) if id != self.writer.segment && entry.live_chunks == 0 => {
                        (id, false)
                    }
                    // Mostly dead and with two newer segments: copy its few live chunks forward
                    // so a long-lived queue does not pin every later segment on disk.
                    Some((&id, entry))
                        if !relocated
                            && segments.len() > 2
                            && entry.live_chunks * RELOCATE_LIVE_RATIO_MAX
                                <= entry.chunks_total =>
                    {
                        (id, true)
                    }
                    _ => return true,
                }
            };
            if relocate {
                relocated = true;
                if !self.relocate(oldest) {
                    return false;
                }
                continue;
            }
            match self.carry_trims_forward(oldest) {
                Carried::Done => {}
                Carried::NoSpace => return true,
                Carried::Poisoned => return false,
            }
            let name = format::segment_file_name(oldest);
            if let Err(error) = self.inner.storage.remove(&name) {
                return self.poison(format!("deleting segment {name}: {error}"));
            }
            lock(&self.inner.segments).remove(&oldest);
            self.inner
                .counters
                .segments_deleted
                .fetch_add(1, Ordering::Relaxed);
            match self.inner.storage.sync_dir() {
                Ok(()) => {
                    self.inner
                        .counters
                        .dir_syncs
                        .fetch_add(1, Ordering::Relaxed);
                }
                // The unlink is not durable yet; if the file comes back after a crash it only
                // holds dead chunks and copied-forward trims, and the next directory fsync
                // (rotation or deletion) makes this unlink durable too.
                Err(error) if is_no_space(&error) => return true,
                Err(error) => {
                    return self.poison(format!(
                        "fsyncing the directory after deleting {name}: {error}"
                    ));
                }
            }
        }
    }
}
