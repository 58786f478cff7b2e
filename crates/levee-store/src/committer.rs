//! The committer thread: the only writer of segment files. Each round takes the pending work,
//! seals buffered messages into chunk records, writes them in one sequential write, updates the
//! index, fsyncs once and wakes every append waiting on that round (group commit). After a
//! round it deletes the oldest segment files once nothing live remains in them.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::error::WriteError;
use crate::format::{self, RECORD_HEADER_BYTES, Record, SEGMENT_HEADER_BYTES};
use crate::options::SyncPolicy;
use crate::queue::{ChunkEntry, FRAME_BYTES, NO_SEGMENT};
use crate::recovery::Scanner;
use crate::storage::StorageFile;
use crate::store::{
    FAILURES_MAX, Inner, PendingItem, QueueKey, SHARD_COUNT, SegmentEntry, Shard, lock,
};

/// The oldest segment is relocated once at most 1 in this many of its chunks is still live.
const RELOCATE_LIVE_RATIO_MAX: u64 = 4;

/// Past this position a round starts a new segment even mid-round, so positions fit in u32.
const POSITION_SOFT_MAX: u64 = 3 << 30;

/// Most queues the committer freezes or publishes under one shard lock before letting
/// appenders in: a few hundred microseconds of work.
const FREEZE_QUEUES_PER_LOCK_MAX: usize = 256;

/// A queue to freeze: its shard index, whether it came from the pending list (not the full
/// list), and its key.
type RunEntry = (usize, bool, QueueKey);

/// The active segment and the bytes of the round being built.
#[derive(Debug)]
pub(crate) struct Writer {
    segment: u32,
    file: Arc<dyn StorageFile>,
    length: u64,
    buffer: Vec<u8>,
}

impl Writer {
    pub(crate) fn new(segment: u32, file: Arc<dyn StorageFile>, length: u64) -> Self {
        Self {
            segment,
            file,
            length,
            buffer: Vec::new(),
        }
    }

    fn position(&self) -> u32 {
        // Invariant: rounds rotate before POSITION_SOFT_MAX plus one record (< 4 GiB).
        u32::try_from(self.length + self.buffer.len() as u64).expect("segment position fits u32")
    }
}

/// What a round put on disk, applied to the index after the write.
#[derive(Debug)]
enum Placed {
    Chunk {
        key: QueueKey,
        /// Index of the queue's lock shard.
        shard: usize,
        entry: ChunkEntry,
        count: usize,
        /// Bytes of the messages in the queue's write buffer (payload and lengths).
        buffered_bytes: usize,
        record_bytes: u64,
    },
    Record {
        segment: u32,
        item: PendingItem,
    },
}

/// A live chunk being relocated: its queue, first offset, old position and its position in
/// the copied bytes.
type Moved = (QueueKey, u64, u32, usize);

struct Plan {
    round: u64,
    items: Vec<PendingItem>,
    /// Queues from the full list (flushed without clearing their pending-list flag).
    full: Vec<QueueKey>,
    is_full_round: bool,
    shutdown: bool,
}

struct Committer<'a> {
    inner: &'a Inner,
    writer: Writer,
    last_full_round: Instant,
}

/// Runs the committer until shutdown or a fatal error.
pub(crate) fn run(inner: &Inner, writer: Writer) {
    let mut committer = Committer {
        inner,
        writer,
        last_full_round: Instant::now(),
    };
    loop {
        let plan = committer.next_plan();
        let shutdown = plan.shutdown;
        let full_round_started_ms = plan.is_full_round.then(|| inner.elapsed_ms());
        if plan.is_full_round {
            committer.last_full_round = Instant::now();
        }
        if !committer.run_round(plan) {
            return;
        }
        if let Some(started_ms) = full_round_started_ms
            && !inner.disk_full.load(Ordering::SeqCst)
        {
            // Everything appended before the round started is now fsynced.
            inner
                .durable_through_ms
                .fetch_max(started_ms, Ordering::Release);
        }
        if shutdown {
            // Nothing can be appended while the store is being dropped: one round suffices.
            return;
        }
    }
}

fn now_ms() -> u64 {
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
        let mut pending = lock(&self.inner.pending);
        loop {
            let interval_due = interval
                .is_some_and(|interval| self.last_full_round.elapsed() >= interval)
                && !pending.items.is_empty();
            let is_full_round = pending.shutdown
                || pending.full_round_requested
                || (interval.is_none() && !pending.items.is_empty())
                || interval_due
                || self.inner.wanted_round.load(Ordering::SeqCst)
                    > self.inner.rounds_started.load(Ordering::SeqCst);
            let selective = !pending.full.is_empty() || pending.budget_flush_requested;
            if is_full_round || selective {
                let round = self.inner.rounds_started.fetch_add(1, Ordering::SeqCst) + 1;
                let shutdown = pending.shutdown;
                pending.budget_flush_requested = false;
                if is_full_round {
                    pending.full_round_requested = false;
                    pending.full.clear();
                    let items = std::mem::take(&mut pending.items);
                    return Plan {
                        round,
                        items,
                        full: Vec::new(),
                        is_full_round,
                        shutdown,
                    };
                }
                let full = std::mem::take(&mut pending.full);
                // Over budget: flush the older half of the buffered queues.
                let older_half = if self.inner.buffered_bytes.load(Ordering::SeqCst)
                    > self.inner.options.buffer_budget_bytes / 2
                {
                    pending.items.len().div_ceil(2)
                } else {
                    0
                };
                let items = pending.items.drain(..older_half).collect();
                return Plan {
                    round,
                    items,
                    full,
                    is_full_round,
                    shutdown,
                };
            }
            if interval.is_some() && pending.items.is_empty() && pending.full.is_empty() {
                // Between rounds with no queue waiting: nothing buffered is unwritten.
                self.inner
                    .durable_through_ms
                    .fetch_max(self.inner.elapsed_ms(), Ordering::Release);
            }
            pending.committer_sleeping = true;
            pending = match interval {
                None => self
                    .inner
                    .work
                    .wait(pending)
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
                Some(interval) => {
                    let left = interval.saturating_sub(self.last_full_round.elapsed());
                    let left = left.max(Duration::from_millis(1));
                    self.inner
                        .work
                        .wait_timeout(pending, left)
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .0
                }
            };
            pending.committer_sleeping = false;
        }
    }

    /// Runs one round; false once the store is poisoned.
    fn run_round(&mut self, plan: Plan) -> bool {
        if self.writer.length >= self.inner.options.segment_bytes_max
            && let Err(error) = self.rotate()
        {
            return self.fail_round(
                plan.round,
                &error,
                "starting a new segment",
                Vec::new(),
                false,
            );
        }
        let round_start = self.writer.length;
        let timestamp_ms = now_ms();
        let mut placed = Vec::new();
        let mut rotated_mid_round = false;
        self.writer.buffer.clear();
        // Queues between two records are frozen in shard order (see `freeze_run`); records keep
        // their place in the list, so every queue's chunks and records keep their order.
        let mut run: Vec<RunEntry> = plan
            .full
            .into_iter()
            .map(|key| (self.inner.shard_index(&key.name), false, key))
            .collect();
        let mut result = Ok(());
        for item in plan.items {
            match item {
                PendingItem::Queue(key) => run.push((self.inner.shard_index(&key.name), true, key)),
                PendingItem::Record { ref bytes, .. } => {
                    result = self
                        .freeze_run(&mut run, timestamp_ms, &mut placed, &mut rotated_mid_round)
                        .and_then(|()| self.overflow_rotate(&mut rotated_mid_round));
                    if result.is_err() {
                        break;
                    }
                    self.writer.buffer.extend_from_slice(bytes);
                    placed.push(Placed::Record {
                        segment: self.writer.segment,
                        item,
                    });
                }
            }
        }
        if result.is_ok() {
            result = self.freeze_run(&mut run, timestamp_ms, &mut placed, &mut rotated_mid_round);
        }
        let written = self.writer.buffer.len() as u64;
        if result.is_ok() && written > 0 {
            result = self
                .writer
                .file
                .write_at(self.writer.length, &self.writer.buffer);
        }
        if let Err(error) = result {
            if rotated_mid_round {
                return self.fail_round(plan.round, &error, "writing a commit round", placed, true);
            }
            if let Err(truncate_error) = self.writer.file.truncate(round_start) {
                return self.fail_round(plan.round, &truncate_error, "truncating", placed, true);
            }
            self.writer.length = round_start;
            return self.fail_round(plan.round, &error, "writing a commit round", placed, false);
        }
        self.writer.length += written;
        self.inner
            .counters
            .bytes_written
            .fetch_add(written, Ordering::Relaxed);
        if written > 0 || rotated_mid_round {
            if let Err(error) = self.writer.file.sync() {
                return self.fail_round(plan.round, &error, "fsyncing a segment", Vec::new(), true);
            }
            self.inner
                .counters
                .file_syncs
                .fetch_add(1, Ordering::Relaxed);
            self.inner.disk_full.store(false, Ordering::SeqCst);
        }
        // Published only once durable: under `always` readers see exactly the indexed chunks,
        // so they never see a message that a crash or a full disk could still take back.
        self.apply(placed);
        self.inner.counters.rounds.fetch_add(1, Ordering::Relaxed);
        self.complete(plan.round, None);
        self.collect_garbage()
    }

    /// Starts a new segment mid-round when the active one nears the u32 position limit.
    fn overflow_rotate(&mut self, rotated: &mut bool) -> io::Result<()> {
        if self.writer.length + (self.writer.buffer.len() as u64) < POSITION_SOFT_MAX {
            return Ok(());
        }
        *rotated = true;
        self.writer
            .file
            .write_at(self.writer.length, &self.writer.buffer)?;
        self.writer.length += self.writer.buffer.len() as u64;
        self.writer.buffer.clear();
        self.rotate()
    }

    /// Freezes the queues of `run` (emptied) in shard order, stable so that a queue's two
    /// entries (full list, then pending list) keep their order: each shard is locked once per
    /// [`FREEZE_QUEUES_PER_LOCK_MAX`] queues instead of once per queue, which matters when many
    /// appenders compete for the shard locks and the CPU.
    fn freeze_run(
        &mut self,
        run: &mut Vec<RunEntry>,
        timestamp_ms: u64,
        placed: &mut Vec<Placed>,
        rotated_mid_round: &mut bool,
    ) -> io::Result<()> {
        run.sort_by_key(|(shard_index, _, _)| *shard_index);
        let inner = self.inner;
        let mut held: Option<(usize, usize, MutexGuard<'_, Shard>)> = None;
        for (shard_index, from_items, key) in run.drain(..) {
            if self.writer.length + (self.writer.buffer.len() as u64) >= POSITION_SOFT_MAX {
                // Rotation fsyncs: never with a shard locked.
                held = None;
                self.overflow_rotate(rotated_mid_round)?;
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
            self.freeze(shard, shard_index, &key, from_items, timestamp_ms, placed);
        }
        Ok(())
    }

    /// Seals the unfrozen messages of one queue into chunk records in the round buffer.
    fn freeze(
        &mut self,
        shard: &mut Shard,
        shard_index: usize,
        key: &QueueKey,
        from_items: bool,
        timestamp_ms: u64,
        placed: &mut Vec<Placed>,
    ) {
        let chunk_bytes = self.inner.options.chunk_bytes;
        let Some(state) = shard.queues.get_mut(&*key.name) else {
            return;
        };
        if state.incarnation != key.incarnation {
            return;
        }
        if from_items {
            state.queued = false;
        }
        state.full_queued = false;
        let Some(buffer) = state.buffer.as_mut() else {
            return;
        };
        let mut index = buffer.frozen;
        let mut byte_start = buffer.frozen_bytes;
        while index < buffer.count {
            // Messages index..end, framed in data[byte_start..byte_end], payload bytes in all.
            let mut end = index;
            let mut byte_end = byte_start;
            let mut payload = 0;
            while end < buffer.count {
                let length = buffer.length_at(byte_end);
                if end > index && payload + length > chunk_bytes {
                    break;
                }
                payload += length;
                byte_end += FRAME_BYTES + length;
                end += 1;
            }
            let position = self.writer.position();
            let before = self.writer.buffer.len();
            let first_offset = buffer.first_offset + index as u64;
            format::encode_chunk_framed(
                &mut self.writer.buffer,
                &key.name,
                first_offset,
                timestamp_ms,
                end - index,
                payload,
                &buffer.data[byte_start..byte_end],
            );
            let entry = ChunkEntry {
                first_offset,
                segment: self.writer.segment,
                position,
            };
            placed.push(Placed::Chunk {
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
    }

    /// Publishes a written round in the index. Chunks come grouped by shard (see
    /// `freeze_run`), so each shard is locked once per run of at most
    /// [`FREEZE_QUEUES_PER_LOCK_MAX`] chunks; the segments' live counts and the budget are
    /// updated once per round (and before each trim or delete record, which lowers counts).
    fn apply(&self, placed: Vec<Placed>) {
        let inner = self.inner;
        let mut held: Option<(usize, usize, MutexGuard<'_, Shard>)> = None;
        let mut live_added: Vec<(u32, u64)> = Vec::new();
        let mut freed_bytes = 0;
        for placed in placed {
            match placed {
                Placed::Chunk {
                    key,
                    shard: shard_index,
                    entry,
                    count,
                    buffered_bytes,
                    record_bytes,
                } => {
                    let reuse = held.as_ref().is_some_and(|(index, applied, _)| {
                        *index == shard_index && *applied < FREEZE_QUEUES_PER_LOCK_MAX
                    });
                    if !reuse {
                        drop(held.take());
                        held = Some((shard_index, 0, lock(&inner.shards[shard_index])));
                    }
                    // Invariant: `held` was set just above.
                    let (_, applied, shard) = held.as_mut().expect("shard locked above");
                    *applied += 1;
                    let Some(state) = shard.queues.get_mut(&*key.name) else {
                        continue;
                    };
                    if state.incarnation != key.incarnation {
                        continue;
                    }
                    // Invariant: frozen messages stay buffered until this drain.
                    let buffer = state.buffer.as_mut().expect("frozen messages are buffered");
                    debug_assert_eq!(buffer.first_offset, entry.first_offset);
                    buffer.drain_front(count, buffered_bytes);
                    if buffer.count == 0 {
                        state.buffer = None;
                    }
                    state.chunks.push_back(entry);
                    state.stored_bytes += record_bytes;
                    match live_added.last_mut() {
                        Some((segment, added)) if *segment == entry.segment => *added += 1,
                        _ => live_added.push((entry.segment, 1)),
                    }
                    freed_bytes += buffered_bytes;
                }
                Placed::Record { segment, item } => {
                    held = None;
                    self.add_live_chunks(&mut live_added);
                    let PendingItem::Record { dead, trim_of, .. } = item else {
                        continue;
                    };
                    {
                        let mut segments = lock(&self.inner.segments);
                        for (dead_segment, count) in dead {
                            if let Some(entry) = segments.get_mut(&dead_segment) {
                                entry.live_chunks = entry.live_chunks.saturating_sub(count);
                            }
                        }
                    }
                    if let Some(key) = trim_of {
                        let mut shard = lock(self.inner.shard(&key.name));
                        if let Some(state) = shard.queues.get_mut(&*key.name)
                            && state.incarnation == key.incarnation
                        {
                            state.trim_segment = segment;
                        }
                    }
                }
            }
        }
        drop(held);
        self.add_live_chunks(&mut live_added);
        self.inner
            .buffered_bytes
            .fetch_sub(freed_bytes, Ordering::SeqCst);
    }

    /// Counts published chunks as live in their segments; empties `added`.
    fn add_live_chunks(&self, added: &mut Vec<(u32, u64)>) {
        if added.is_empty() {
            return;
        }
        let mut segments = lock(&self.inner.segments);
        for (segment, count) in added.drain(..) {
            if let Some(entry) = segments.get_mut(&segment) {
                entry.live_chunks += count;
                entry.chunks_total += count;
            }
        }
    }

    fn complete(&self, round: u64, error: Option<WriteError>) {
        let mut commit = lock(&self.inner.commit);
        commit.completed = commit.completed.max(round);
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

    /// Handles a failed round. A full disk (before any mid-round rotation) is recoverable: the
    /// round's bytes were truncated away. Anything else poisons the store.
    fn fail_round(
        &mut self,
        round: u64,
        error: &io::Error,
        operation: &str,
        placed: Vec<Placed>,
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
        let mut records = Vec::new();
        let mut queues = Vec::new();
        for placed in placed {
            match placed {
                Placed::Record { item, .. } => records.push(item),
                Placed::Chunk { key, .. } => queues.push(key),
            }
        }
        if self.interval().is_some() {
            // Acknowledged messages must not be dropped: keep them buffered and retry.
            for key in &queues {
                let mut shard = lock(self.inner.shard(&key.name));
                if let Some(state) = shard.queues.get_mut(&*key.name)
                    && let Some(buffer) = state.buffer.as_mut()
                {
                    buffer.frozen = 0;
                    buffer.frozen_bytes = 0;
                    state.queued = true;
                }
            }
            let mut pending = lock(&self.inner.pending);
            let requeued = queues.into_iter().map(PendingItem::Queue);
            let mut items: Vec<PendingItem> = records.into_iter().chain(requeued).collect();
            items.append(&mut pending.items);
            pending.items = items;
            self.inner.disk_full.store(true, Ordering::SeqCst);
            drop(pending);
            self.complete(round, Some(failure));
            return true;
        }
        // Under `always` no buffered message is acknowledged yet: drop them all and fail
        // every waiter. Holding every shard lock means no append is half done.
        let mut shards: Vec<_> = self.inner.shards.iter().map(|shard| lock(shard)).collect();
        let mut pending = lock(&self.inner.pending);
        for shard in &mut shards {
            shard.queues.retain(|_, state| {
                if let Some(buffer) = state.buffer.take() {
                    state.next_offset = buffer.first_offset;
                    self.inner
                        .buffered_bytes
                        .fetch_sub(buffer.budget_bytes(), Ordering::SeqCst);
                }
                state.queued = false;
                state.full_queued = false;
                !(state.next_offset == 0 && state.trim_segment == NO_SEGMENT)
            });
        }
        debug_assert_eq!(shards.len(), SHARD_COUNT);
        pending
            .items
            .retain(|item| matches!(item, PendingItem::Record { .. }));
        let mut items = records;
        items.append(&mut pending.items);
        pending.items = items;
        pending.full.clear();
        // Appenders that buffered before now wait for `round` or `round + 1`: fail both.
        self.inner.rounds_started.store(round + 1, Ordering::SeqCst);
        drop(pending);
        drop(shards);
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
        let header = format::encode_segment_header(segment);
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
        self.writer = Writer::new(segment, file, SEGMENT_HEADER_BYTES);
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
                    let index = state
                        .chunks
                        .partition_point(|known| known.first_offset < chunk.first_offset);
                    let known = state.chunks.get(index)?;
                    (known.first_offset == chunk.first_offset
                        && known.segment == oldest
                        && known.position == old_position)
                        .then(|| QueueKey {
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
        let written = self.writer.file.write_at(self.writer.length, &copy);
        if let Err(error) = written.and_then(|()| self.writer.file.sync()) {
            if is_no_space(&error) && self.writer.file.truncate(self.writer.length).is_ok() {
                return true;
            }
            return self.poison(format!("writing relocated chunks: {error}"));
        }
        let base = self.writer.length;
        self.writer.length += copy.len() as u64;
        self.inner
            .counters
            .bytes_written
            .fetch_add(copy.len() as u64, Ordering::Relaxed);
        self.inner
            .counters
            .file_syncs
            .fetch_add(1, Ordering::Relaxed);
        let new_segment = self.writer.segment;
        for (key, first_offset, old_position, offset_in_copy) in moved {
            let mut shard = lock(self.inner.shard(&key.name));
            let Some(state) = shard.queues.get_mut(&*key.name) else {
                continue;
            };
            if state.incarnation != key.incarnation {
                continue;
            }
            let index = state
                .chunks
                .partition_point(|known| known.first_offset < first_offset);
            let Some(known) = state.chunks.get_mut(index) else {
                continue;
            };
            if known.first_offset != first_offset
                || known.segment != oldest
                || known.position != old_position
            {
                // Trimmed or deleted meanwhile: the copy is dead on arrival.
                continue;
            }
            // Invariant: base + copy length < POSITION_SOFT_MAX (checked above).
            known.position = u32::try_from(base + offset_in_copy as u64).expect("position fits");
            known.segment = new_segment;
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

    /// Deletes the oldest segments while nothing live remains in them. Trim records in such a
    /// segment that still carry a queue's offsets (queues with no chunk left) are first
    /// copied to the active segment. Returns false once poisoned.
    fn collect_garbage(&mut self) -> bool {
        let mut relocated = false;
        loop {
            let (oldest, relocate) = {
                let segments = lock(&self.inner.segments);
                match segments.first_key_value() {
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
                let written = self.writer.file.write_at(self.writer.length, &carry);
                if let Err(error) = written.and_then(|()| self.writer.file.sync()) {
                    if is_no_space(&error) && self.writer.file.truncate(self.writer.length).is_ok()
                    {
                        return true;
                    }
                    return self.poison(format!("copying trim records forward: {error}"));
                }
                self.writer.length += carry.len() as u64;
                self.inner
                    .counters
                    .bytes_written
                    .fetch_add(carry.len() as u64, Ordering::Relaxed);
                self.inner
                    .counters
                    .file_syncs
                    .fetch_add(1, Ordering::Relaxed);
                for key in carried {
                    let mut shard = lock(self.inner.shard(&key.name));
                    if let Some(state) = shard.queues.get_mut(&*key.name)
                        && state.incarnation == key.incarnation
                    {
                        state.trim_segment = self.writer.segment;
                    }
                }
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
