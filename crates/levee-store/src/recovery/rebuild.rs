//! One queue being rebuilt ([`Recovering`]) from its chunk, trim and log records, in any
//! order of its chunks' offsets (relocation copies a chunk to the end of the log), settled
//! into a queue's state once every segment is replayed.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::format::{self};
use crate::queue::{ChunkEntry, QueueState, WriteBuffer};

use super::Problem;

/// A queue being rebuilt. Chunks may arrive out of offset order (a live chunk relocated
/// from an old segment is copied to the end of the log), so offsets are settled in `finish`.
pub(super) struct Recovering {
    name: Arc<[u8]>,
    incarnation: u64,
    /// Segment of the latest trim record, or [`crate::queue::NO_SEGMENT`].
    trim_segment: u32,
    /// The chunks in offset order, with their sizes: one deque, so replaying a record touches
    /// one place in memory (`state.chunks` is filled in `finish`).
    chunks: VecDeque<RecoveredChunk>,
    /// Highest first retained offset of the replayed trim records.
    trimmed_to: u64,
    /// Messages after the chunks known only from log records, framed as in a write buffer
    /// (boxed: most queues have none, and a small entry keeps the replay's map small).
    tail: Option<Box<WriteBuffer>>,
}

/// One chunk of a queue being rebuilt.
#[derive(Debug, Clone, Copy)]
struct RecoveredChunk {
    entry: ChunkEntry,
    /// Record bytes, header included.
    record_bytes: u32,
    /// Messages in the chunk.
    count: u32,
}

impl RecoveredChunk {
    fn end_offset(&self) -> u64 {
        self.entry.first_offset + u64::from(self.count)
    }
}

impl Recovering {
    pub(super) fn new(name: Arc<[u8]>, incarnation: u64, trimmed_to: u64) -> Self {
        Self {
            name,
            incarnation,
            trim_segment: crate::queue::NO_SEGMENT,
            chunks: VecDeque::new(),
            trimmed_to,
            tail: None,
        }
    }

    /// End of the chunks, or the trim point if later.
    fn chunks_end(&self) -> u64 {
        self.chunks.back().map_or(self.trimmed_to, |last| {
            last.end_offset().max(self.trimmed_to)
        })
    }

    /// Drops the tail messages before `offset`.
    fn drop_tail_before(&mut self, offset: u64) {
        let Some(tail) = self.tail.as_mut() else {
            return;
        };
        if offset <= tail.first_offset {
            return;
        }
        if offset >= tail.end_offset() {
            tail.reset(offset);
            return;
        }
        let drop = usize::try_from(offset - tail.first_offset).unwrap_or(usize::MAX);
        let position = tail.position_of(offset);
        tail.frozen = drop;
        tail.frozen_bytes = position;
        tail.drain_front(drop, position);
    }

    /// Replays a log record, or one run of a log batch (`count` messages of queue `name` from
    /// offset `start`): its messages past what chunks and the tail already hold join the tail.
    pub(super) fn add_log<'a>(
        &mut self,
        (name, start, count): (&[u8], u64, u32),
        messages: impl Iterator<Item = &'a [u8]>,
        chunk_bytes: usize,
    ) -> Result<(), Problem> {
        let end = start + u64::from(count);
        let tail_count = self.tail.as_ref().map_or(0, |tail| tail.count);
        let have = match &self.tail {
            Some(tail) if tail.count > 0 => tail.end_offset(),
            _ => self.chunks_end(),
        };
        if end <= have {
            return Ok(());
        }
        if start > have && tail_count > 0 {
            return Err(Problem::Inconsistent(format!(
                "log record of queue {:?} at offsets {start}..{end} leaves a gap after {have}",
                String::from_utf8_lossy(name)
            )));
        }
        let tail = self.tail.get_or_insert_with(Box::default);
        if tail_count == 0 {
            // If `start > have`, the chunks before it are relocated copies still to come (their
            // originals sat in a deleted segment), or were trimmed: `finish` checks which.
            tail.reset(have.max(start));
        }
        let skip = usize::try_from(have.saturating_sub(start)).unwrap_or(usize::MAX);
        for message in messages.skip(skip) {
            tail.push_toward_chunk(message, chunk_bytes);
        }
        Ok(())
    }

    pub(super) fn add_chunk(
        &mut self,
        chunk: &format::Chunk<'_>,
        entry: ChunkEntry,
        record_bytes: u32,
    ) -> Result<(), Problem> {
        let start = chunk.first_offset;
        let end = start + u64::from(chunk.count);
        if end <= self.trimmed_to {
            return Ok(());
        }
        let recovered = RecoveredChunk {
            entry,
            record_bytes,
            count: chunk.count,
        };
        // The usual case: the chunk follows the last one.
        if self
            .chunks
            .back()
            .is_none_or(|last| last.end_offset() <= start)
        {
            self.chunks.push_back(recovered);
            self.drop_tail_before(end);
            return Ok(());
        }
        let inconsistent = |what: &str| {
            Problem::Inconsistent(format!(
                "chunk of queue {:?} at offsets {start}..{end} {what}",
                String::from_utf8_lossy(chunk.name)
            ))
        };
        let index = self
            .chunks
            .partition_point(|known| known.entry.first_offset < start);
        if let Some(known) = self.chunks.get_mut(index)
            && known.entry.first_offset == start
        {
            // A copy of a relocated chunk: it replaces the original.
            if known.count != chunk.count {
                return Err(inconsistent("differs from the chunk it copies"));
            }
            known.entry = entry;
            known.record_bytes = record_bytes;
            return Ok(());
        }
        if self
            .tail
            .as_ref()
            .is_some_and(|tail| tail.count > 0 && start > tail.first_offset)
        {
            return Err(inconsistent("starts inside messages only logged so far"));
        }
        if index > 0 && self.chunks[index - 1].end_offset() > start {
            return Err(inconsistent("overlaps the chunk before it"));
        }
        if self
            .chunks
            .get(index)
            .is_some_and(|next| end > next.entry.first_offset)
        {
            return Err(inconsistent("overlaps the chunk after it"));
        }
        self.chunks.insert(index, recovered);
        Ok(())
    }

    pub(super) fn trim(&mut self, first_retained_offset: u64, segment: u32) {
        self.trim_segment = segment;
        self.trimmed_to = self.trimmed_to.max(first_retained_offset);
        while self
            .chunks
            .front()
            .is_some_and(|front| front.end_offset() <= self.trimmed_to)
        {
            self.chunks.pop_front();
        }
        self.drop_tail_before(self.trimmed_to);
    }

    /// Settles the offsets: the queue starts at its first chunk (older chunks sat in deleted
    /// segments) or its trim point, and its chunks must follow each other without a gap.
    pub(super) fn finish(self) -> Result<QueueState, String> {
        let mut state = QueueState::new(self.name, self.incarnation, self.trimmed_to);
        state.trim_segment = self.trim_segment;
        state.first_offset = self.chunks.front().map_or(self.trimmed_to, |front| {
            front.entry.first_offset.max(self.trimmed_to)
        });
        state.next_offset = self.trimmed_to;
        for (index, chunk) in self.chunks.iter().enumerate() {
            let start = chunk.entry.first_offset;
            if index > 0 && start != state.next_offset {
                return Err(format!(
                    "queue {:?} has no chunk for offsets {}..{start}",
                    String::from_utf8_lossy(&state.name),
                    state.next_offset
                ));
            }
            state.next_offset = chunk.end_offset();
        }
        state.next_offset = state.next_offset.max(self.trimmed_to);
        if let Some(mut tail) = self.tail.filter(|tail| tail.count > 0) {
            if tail.first_offset != state.next_offset && !self.chunks.is_empty() {
                return Err(format!(
                    "queue {:?} has no chunk or log record for offsets {}..{}",
                    String::from_utf8_lossy(&state.name),
                    state.next_offset,
                    tail.first_offset
                ));
            }
            if self.chunks.is_empty() {
                state.first_offset = tail.first_offset.max(self.trimmed_to);
            }
            tail.logged_end = tail.end_offset();
            state.next_offset = tail.end_offset();
            state.queued = true;
            state.buffer = Some(tail);
        }
        state.stored_bytes = self
            .chunks
            .iter()
            .map(|chunk| u64::from(chunk.record_bytes))
            .sum();
        // Exactly sized: an idle queue keeps no growth slack for the past.
        state.chunks = self.chunks.iter().map(|chunk| chunk.entry).collect();
        Ok(state)
    }
}
