//! Per-queue state: offsets, the sparse index of chunks on disk and the lazily allocated write
//! buffer of messages not yet on disk.

use std::collections::VecDeque;

/// A write buffer remembers the byte position of every message whose offset is a multiple of
/// this, so that a read from the middle of a large buffer walks at most this many frames.
pub const BUFFER_POSITION_STRIDE: u64 = 16;
use std::sync::Arc;

/// No trim record of the queue is live.
pub const NO_SEGMENT: u32 = u32::MAX;

/// Where one chunk of a queue is on disk: 16 bytes per chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkEntry {
    /// Offset of the chunk's first message.
    pub first_offset: u64,
    /// Segment id.
    pub segment: u32,
    /// Byte position of the record in the segment.
    pub position: u32,
}

/// Bytes before each message in a [`WriteBuffer`]: its length, a little-endian u32.
pub const FRAME_BYTES: usize = 4;

/// Messages appended but not yet in a chunk record, in one allocation: each message is its
/// length ([`FRAME_BYTES`]) then its bytes. The first `frozen` messages are being sealed into
/// chunks by the committer; later ones are not yet picked up. Every message is also in a log
/// record of some commit round; `marks` says which round, so the committer seals only
/// messages whose log record is already written or in the round it writes, and a reader under
/// `always` sees only messages whose round completed.
#[derive(Debug, Default)]
pub struct WriteBuffer {
    /// Offset of the first buffered message.
    pub first_offset: u64,
    /// The framed messages back to back.
    pub data: Vec<u8>,
    /// Messages in `data`.
    pub count: usize,
    /// Messages handed to the committer.
    pub frozen: usize,
    /// Bytes of `data` those take.
    pub frozen_bytes: usize,
    /// Messages before this offset are in log records of completed rounds.
    pub logged_end: u64,
    /// Later messages: `(round, end offset)`, oldest first, for rounds not yet known to have
    /// completed; the first `marks_count` entries are used. Two suffice: an appender sees at
    /// most the round being written and the next one (see `mark`).
    pub marks: [(u64, u64); MARKS_MAX],
    /// Entries of `marks` in use.
    pub marks_count: usize,
    /// Two marks were merged (see `mark`): some messages may be logged in an earlier round
    /// than their mark says, so the committer must not assume otherwise.
    pub marks_merged: bool,
    /// `(offset, drained_bytes + position in data)` of the buffered messages whose offset is a
    /// multiple of [`BUFFER_POSITION_STRIDE`], oldest first.
    pub positions: VecDeque<(u64, u64)>,
    /// Bytes drained from the front of `data` since the buffer was made.
    pub drained_bytes: u64,
}

/// Rounds a write buffer tracks at once (see [`WriteBuffer::marks`]).
pub const MARKS_MAX: usize = 2;

impl WriteBuffer {
    /// Bytes this buffer counts against the global budget: payload plus a length per message.
    pub fn budget_bytes(&self) -> usize {
        self.data.len()
    }

    /// Appends one message.
    pub fn push(&mut self, message: &[u8]) {
        // Invariant: message_bytes_max <= 64 MiB (checked by StoreOptions::validate).
        let length = u32::try_from(message.len()).expect("message length checked");
        let offset = self.end_offset();
        if offset.is_multiple_of(BUFFER_POSITION_STRIDE) {
            self.positions
                .push_back((offset, self.drained_bytes + self.data.len() as u64));
        }
        // One growth for length and bytes together: an empty buffer gets one allocation of
        // the framed message, not one for the length and a reallocation for the bytes.
        self.data.reserve(FRAME_BYTES + message.len());
        self.data.extend_from_slice(&length.to_le_bytes());
        self.data.extend_from_slice(message);
        self.count += 1;
    }

    /// Notes that the messages before `end_offset` are in the log record of round `round`
    /// (or an earlier one); `completed` is the last completed round.
    pub fn mark(&mut self, round: u64, end_offset: u64, completed: u64) {
        self.prune(completed);
        if self.marks_count > 0 && self.marks[self.marks_count - 1].0 >= round {
            let last = &mut self.marks[self.marks_count - 1];
            last.1 = last.1.max(end_offset);
            return;
        }
        if self.marks_count == MARKS_MAX {
            // Not expected (see `marks`); merging into the newer round is safe: the older
            // messages are then treated as logged later than they are (seen and sealed later).
            self.marks[0] = self.marks[1];
            self.marks_count = 1;
            self.marks_merged = true;
        }
        self.marks[self.marks_count] = (round, end_offset);
        self.marks_count += 1;
    }

    /// Folds the marks of rounds up to `completed` into `logged_end`.
    pub fn prune(&mut self, completed: u64) {
        let mut kept = 0;
        for index in 0..self.marks_count {
            let (round, end) = self.marks[index];
            if round <= completed {
                self.logged_end = self.logged_end.max(end);
            } else {
                self.marks[kept] = (round, end);
                kept += 1;
            }
        }
        self.marks_count = kept;
    }

    /// End of the messages whose log records are in rounds up to `round`.
    pub fn logged_through(&self, round: u64) -> u64 {
        self.marks[..self.marks_count]
            .iter()
            .filter(|(mark_round, _)| *mark_round <= round)
            .fold(
                self.logged_end.max(self.first_offset),
                |end, (_, mark_end)| end.max(*mark_end),
            )
    }

    /// End offset of the buffered messages.
    pub fn end_offset(&self) -> u64 {
        self.first_offset + self.count as u64
    }

    /// Byte position in `data` of the message at `offset` (`data.len()` at or past the end,
    /// 0 before the start): from the nearest remembered position, at most
    /// [`BUFFER_POSITION_STRIDE`] frames are walked.
    pub fn position_of(&self, offset: u64) -> usize {
        let offset = offset.clamp(self.first_offset, self.end_offset());
        let known = self
            .positions
            .partition_point(|(known_offset, _)| *known_offset <= offset);
        let (mut at, mut position) = match known.checked_sub(1).map(|index| self.positions[index]) {
            Some((known_offset, absolute)) if known_offset >= self.first_offset => {
                // Invariant: a remembered position is within `data` (entries before the
                // buffer's start are dropped with the bytes they point into).
                let position = usize::try_from(absolute - self.drained_bytes)
                    .expect("remembered position within the buffer");
                (known_offset, position)
            }
            _ => (self.first_offset, 0),
        };
        while at < offset {
            position = self.message_at(position).1;
            at += 1;
        }
        position
    }

    /// Empties the buffer; the next message pushed gets `first_offset`.
    pub fn reset(&mut self, first_offset: u64) {
        self.drained_bytes += self.data.len() as u64;
        self.data.clear();
        self.positions.clear();
        self.count = 0;
        self.frozen = 0;
        self.frozen_bytes = 0;
        self.first_offset = first_offset;
        self.marks_merged = false;
    }

    /// Drops every message at or after `end_offset` (nothing frozen may remain), and the marks
    /// past it; returns the bytes dropped.
    pub fn truncate_to(&mut self, end_offset: u64) -> usize {
        debug_assert_eq!(self.frozen, 0);
        let keep = usize::try_from(end_offset.saturating_sub(self.first_offset))
            .unwrap_or(usize::MAX)
            .min(self.count);
        let position = self.position_of(self.first_offset + keep as u64);
        while self
            .positions
            .back()
            .is_some_and(|(offset, _)| *offset >= self.first_offset + keep as u64)
        {
            self.positions.pop_back();
        }
        let dropped = self.data.len() - position;
        self.data.truncate(position);
        self.count = keep;
        let end = self.end_offset();
        self.logged_end = self.logged_end.min(end);
        for mark in &mut self.marks[..self.marks_count] {
            mark.1 = mark.1.min(end);
        }
        dropped
    }

    /// Payload bytes of the messages not yet frozen.
    pub fn unfrozen_payload_bytes(&self) -> usize {
        self.data.len() - self.frozen_bytes - FRAME_BYTES * (self.count - self.frozen)
    }

    /// Drops the first `count` messages (`bytes` of `data`) after they reached the disk.
    pub fn drain_front(&mut self, count: usize, bytes: usize) {
        self.data.drain(..bytes);
        self.drained_bytes += bytes as u64;
        self.first_offset += count as u64;
        while self
            .positions
            .front()
            .is_some_and(|(offset, _)| *offset < self.first_offset)
        {
            self.positions.pop_front();
        }
        self.count -= count;
        self.frozen -= count;
        self.frozen_bytes -= bytes;
    }

    /// Length of the message framed at byte `position` of `data`.
    pub fn length_at(&self, position: usize) -> usize {
        let mut length = [0; FRAME_BYTES];
        length.copy_from_slice(&self.data[position..position + FRAME_BYTES]);
        u32::from_le_bytes(length) as usize
    }

    /// The message framed at byte `position` of `data`, and the position of the next one.
    pub fn message_at(&self, position: usize) -> (&[u8], usize) {
        let start = position + FRAME_BYTES;
        let end = start + self.length_at(position);
        (&self.data[start..end], end)
    }
}

/// One queue.
#[derive(Debug)]
pub struct QueueState {
    /// The queue name (the same allocation as the map key).
    pub name: Arc<[u8]>,
    /// Distinguishes this queue from an earlier deleted queue of the same name.
    pub incarnation: u64,
    /// First retained offset.
    pub first_offset: u64,
    /// Offset the next message gets.
    pub next_offset: u64,
    /// Chunks on disk covering `[first_offset, disk_end_offset())`, in offset order.
    pub chunks: VecDeque<ChunkEntry>,
    /// Messages after the chunks; `None` while the queue is idle.
    pub buffer: Option<Box<WriteBuffer>>,
    /// Bytes of this queue's live chunk records on disk.
    pub stored_bytes: u64,
    /// Segment of the queue's latest trim record, or [`NO_SEGMENT`].
    pub trim_segment: u32,
    /// The queue has an entry in the committer's pending list.
    pub queued: bool,
    /// The round whose shard list `Shard::direct` holds this queue (0: none): that round
    /// seals the queue's buffer, and its appends in that round write no log record.
    pub direct_round: u64,
}

impl QueueState {
    /// An empty queue whose next message gets `next_offset`.
    pub fn new(name: Arc<[u8]>, incarnation: u64, next_offset: u64) -> Self {
        Self {
            name,
            incarnation,
            first_offset: next_offset,
            next_offset,
            chunks: VecDeque::new(),
            buffer: None,
            stored_bytes: 0,
            trim_segment: NO_SEGMENT,
            queued: false,
            direct_round: 0,
        }
    }

    /// End of the on-disk chunks: the first buffered offset, or `next_offset`.
    pub fn disk_end_offset(&self) -> u64 {
        self.buffer
            .as_ref()
            .map_or(self.next_offset, |buffer| buffer.first_offset)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The byte position of the message at `offset`, walked from the start.
    fn walked(buffer: &WriteBuffer, offset: u64) -> usize {
        let mut position = 0;
        let steps = offset.clamp(buffer.first_offset, buffer.end_offset()) - buffer.first_offset;
        for _ in 0..steps {
            position = buffer.message_at(position).1;
        }
        position
    }

    #[derive(Debug, Clone)]
    enum Step {
        Push(usize),
        Drain(usize),
        Truncate(usize),
        Reset(u64),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            8 => (0_usize..40).prop_map(Step::Push),
            1 => (0_usize..200).prop_map(Step::Drain),
            1 => (0_usize..200).prop_map(Step::Truncate),
            1 => (0_u64..1000).prop_map(Step::Reset),
        ]
    }

    proptest! {
        #[test]
        fn given_pushes_drains_and_truncations_when_locating_should_match_a_walk(
            first_offset in 0_u64..300,
            steps in prop::collection::vec(step(), 1..400),
        ) {
            let mut buffer = WriteBuffer { first_offset, ..WriteBuffer::default() };
            for step in steps {
                match step {
                    Step::Push(length) => buffer.push(&vec![7; length]),
                    Step::Drain(count) => {
                        let count = count.min(buffer.count);
                        let bytes = walked(&buffer, buffer.first_offset + count as u64);
                        buffer.frozen = count;
                        buffer.frozen_bytes = bytes;
                        buffer.drain_front(count, bytes);
                    }
                    Step::Truncate(keep) => {
                        buffer.truncate_to(buffer.first_offset + keep as u64);
                    }
                    Step::Reset(offset) => buffer.reset(offset),
                }
                for offset in buffer.first_offset.saturating_sub(2)..buffer.end_offset() + 2 {
                    prop_assert_eq!(buffer.position_of(offset), walked(&buffer, offset));
                }
            }
        }
    }
}
