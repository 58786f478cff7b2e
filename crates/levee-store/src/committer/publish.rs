//! Publishing a written round: its trim and delete records' effects first, then its chunks in
//! the index (drained from the write buffers, their budget freed). At the round's end after
//! the fsync, or under `interval` as the round's writes land, between its later writes.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use super::round::TakenLog;
use super::seal::Placed;
use super::{Committer, FREEZE_QUEUES_PER_LOCK_MAX};
use crate::store::{RecordEffect, Shard, lock};

impl Committer<'_> {
    /// Under `interval`, publishes the chunks of the round being built whose writes have
    /// landed (whole queues at a time), after the round's trim and delete effects; frees
    /// their budget at once and wakes the appends waiting for it. The disk meanwhile writes
    /// the round's later pieces, so publishing no longer leaves it idle at the round's end,
    /// and appends waiting for budget go on while the round is written. Published before
    /// the round's fsync is what `interval` promises (an acknowledged append is readable at
    /// once, durable within the interval); under `always` chunks wait for the fsync.
    pub(super) fn publish_written(&mut self, round: u64, placed: &[Placed], taken: &mut TakenLog) {
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

    /// Publishes a written round in the index. Chunks come grouped by shard (see
    /// `freeze_run`), so each shard is locked once per run of at most
    /// [`FREEZE_QUEUES_PER_LOCK_MAX`] chunks; the segments' live counts and the budget are
    /// updated once per publication. The trim and delete records' effects come first: they
    /// were written before the chunks. Only what `publish_written` left is published here.
    /// Returns `placed`, emptied, for the next round.
    pub(super) fn apply(
        &mut self,
        round: u64,
        mut placed: Vec<Placed>,
        taken: TakenLog,
    ) -> Vec<Placed> {
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
}
