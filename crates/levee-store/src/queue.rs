//! Per-queue state: offsets, the sparse index of chunks on disk and the lazily allocated write
//! buffer of messages not yet on disk.

use std::collections::VecDeque;

/// A write buffer remembers the byte position of every message whose offset is a multiple of
/// this, so that a read from the middle of a large buffer walks at most this many frames.
pub const BUFFER_POSITION_STRIDE: u64 = 16;
use std::sync::Arc;

use crate::format::{ByteSink, put_varint};

/// No trim record of the queue is live.
pub const NO_SEGMENT: u32 = u32::MAX;

/// Where one chunk of a queue is on disk: 16 bytes per chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ChunkEntry {
    /// Offset of the chunk's first message.
    pub first_offset: u64,
    /// Segment id.
    pub segment: u32,
    /// Byte position of the record in the segment.
    pub position: u32,
}

/// Entries per block of a [`ChunkIndex`]: a lookup decodes at most this many.
pub const INDEX_BLOCK_ENTRIES: usize = 1 << INDEX_POPPED_BITS;
/// Bits of [`ChunkIndex::counts`] that count the popped entries of the first block.
const INDEX_POPPED_BITS: u32 = 5;

/// Low bits of an entry's header varint that say how its segment and position are encoded.
const INDEX_CODE_BITS: u32 = 2;
/// Same segment as the entry before; the position is that one's plus a varint.
const INDEX_SAME_AFTER: u64 = 0;
/// Same segment as the entry before; the position is that one's minus a varint.
const INDEX_SAME_BEFORE: u64 = 1;
/// The segment after the entry before's; the position is a varint.
const INDEX_NEXT_SEGMENT: u64 = 2;
/// Segment and position are varints.
const INDEX_ANY_SEGMENT: u64 = 3;

/// The chunks of one queue on disk, in offset order, delta-encoded: at a million queues a
/// chunk costs about 5 bytes here (one byte of offset delta and segment change, the position
/// in four) instead of 16 as a [`ChunkEntry`]. Entries come in blocks of
/// [`INDEX_BLOCK_ENTRIES`]: a block's first entry is written in full (three LEB128 varints:
/// first offset, segment, position) and each later one against the entry before it (a varint
/// `offset delta << 2 | code`, then the position, and the segment for code 3), so a lookup
/// binary-searches the blocks and decodes at most one block. Appending encodes against the
/// last entry (kept decoded); popping from the front drops a block's bytes once all of its
/// entries are popped.
#[derive(Debug, Default)]
pub struct ChunkIndex {
    /// The blocks back to back.
    bytes: Vec<u8>,
    /// Byte position in `bytes` of every block after the first; none (no allocation) while
    /// there is one block.
    #[allow(
        clippy::box_collection,
        reason = "8 bytes in every queue's state instead of 24; most queues have one block"
    )]
    restarts: Option<Box<Vec<u64>>>,
    /// The last entry (meaningless while empty).
    last: ChunkEntry,
    /// The entries in the index, shifted left by [`INDEX_POPPED_BITS`], plus the entries at
    /// the start of the first block that were popped (their bytes stay until the whole block
    /// is popped): one word, so that a million idle queues pay little for their index.
    counts: u64,
}

impl ChunkIndex {
    /// Entries in the index.
    pub fn len(&self) -> usize {
        usize::try_from(self.counts >> INDEX_POPPED_BITS).unwrap_or(usize::MAX)
    }

    /// Whether the index has no entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Popped entries whose bytes are still in the first block.
    fn popped(&self) -> usize {
        usize::try_from(self.counts & ((1 << INDEX_POPPED_BITS) - 1)).unwrap_or(0)
    }

    fn set_counts(&mut self, len: usize, popped: usize) {
        debug_assert!(popped < INDEX_BLOCK_ENTRIES);
        self.counts = ((len as u64) << INDEX_POPPED_BITS) | popped as u64;
    }

    fn restarts(&self) -> &[u64] {
        self.restarts.as_deref().map_or(&[], Vec::as_slice)
    }

    /// Heap bytes the index holds (capacity included).
    pub fn heap_bytes(&self) -> usize {
        self.bytes.capacity()
            + self.restarts.as_ref().map_or(0, |restarts| {
                std::mem::size_of::<Vec<u64>>() + restarts.capacity() * std::mem::size_of::<u64>()
            })
    }

    /// Gives back the growth slack (for an index that is done growing for now).
    pub fn shrink_to_fit(&mut self) {
        self.bytes.shrink_to_fit();
        if let Some(restarts) = &mut self.restarts {
            restarts.shrink_to_fit();
        }
    }

    /// Appends an entry; its first offset is above every other's.
    pub fn push_back(&mut self, entry: ChunkEntry) {
        debug_assert!(self.is_empty() || entry.first_offset > self.last.first_offset);
        let (len, popped) = (self.len(), self.popped());
        if len == 0 {
            *self = Self::default();
        }
        let full = len == 0 || (popped + len).is_multiple_of(INDEX_BLOCK_ENTRIES);
        let mut encoded = EntryBytes::default();
        if full {
            encode_full(&mut encoded, entry);
        } else {
            encode_next(&mut encoded, self.last, entry);
        }
        let encoded = &encoded.bytes[..encoded.len];
        if self.bytes.capacity() - self.bytes.len() < encoded.len() {
            // Grow by an eighth, not by doubling: a million queues' indexes would otherwise
            // carry a third of slack on average (measured: 2.35 instead of 1.42 B/message).
            self.bytes
                .reserve_exact(encoded.len().max(self.bytes.len() / 8));
        }
        if full && len > 0 {
            let start = self.bytes.len() as u64;
            self.restarts.get_or_insert_with(Box::default).push(start);
        }
        self.bytes.extend_from_slice(encoded);
        self.last = entry;
        self.set_counts(len + 1, if len == 0 { 0 } else { popped });
    }

    /// The first entry.
    pub fn front(&self) -> Option<ChunkEntry> {
        self.iter().next()
    }

    /// Removes and returns the first entry.
    pub fn pop_front(&mut self) -> Option<ChunkEntry> {
        let front = self.front()?;
        let (len, popped) = (self.len() - 1, self.popped() + 1);
        if len == 0 {
            *self = Self::default();
        } else if popped == INDEX_BLOCK_ENTRIES {
            // Invariant: entries remain after a full first block, so a second block exists.
            let restarts = self.restarts.get_or_insert_with(Box::default);
            let cut = restarts.remove(0);
            for restart in restarts.iter_mut() {
                *restart -= cut;
            }
            if restarts.is_empty() {
                self.restarts = None;
            }
            let cut_bytes = usize::try_from(cut).expect("block start within the index");
            self.bytes.drain(..cut_bytes);
            self.set_counts(len, 0);
        } else {
            self.set_counts(len, popped);
        }
        Some(front)
    }

    /// Entries (from the front) for which `before` holds, `before` being true then false along
    /// the index, as [`slice::partition_point`].
    pub fn partition_point(&self, before: impl Fn(&ChunkEntry) -> bool) -> usize {
        if self.is_empty() {
            return 0;
        }
        // Blocks whose first entry (popped or not) is before: the answer is in the last one.
        let blocks = self.restarts().len() + 1;
        let mut low = 0;
        let mut high = blocks;
        while low < high {
            let middle = low + (high - low) / 2;
            let mut at = self.block_start(middle);
            if before(&decode_full(&self.bytes, &mut at)) {
                low = middle + 1;
            } else {
                high = middle;
            }
        }
        let Some(block) = low.checked_sub(1) else {
            return 0;
        };
        let mut absolute = block * INDEX_BLOCK_ENTRIES;
        let end = self.popped() + self.len();
        for entry in self.entries_from(absolute) {
            if !before(&entry) {
                break;
            }
            absolute += 1;
        }
        absolute.min(end).saturating_sub(self.popped())
    }

    /// The entry whose first offset is `first_offset`, with its index.
    pub fn find(&self, first_offset: u64) -> Option<(usize, ChunkEntry)> {
        let index = self.partition_point(|entry| entry.first_offset < first_offset);
        self.iter_from(index)
            .next()
            .filter(|entry| entry.first_offset == first_offset)
            .map(|entry| (index, entry))
    }

    /// Replaces the entry at `index` with one of the same first offset (a relocated chunk):
    /// re-encodes its block.
    pub fn set(&mut self, index: usize, entry: ChunkEntry) {
        let len = self.len();
        assert!(index < len, "index {index} past {len} entries");
        let absolute = self.popped() + index;
        let block = absolute / INDEX_BLOCK_ENTRIES;
        let start = self.block_start(block);
        let end = self
            .restarts()
            .get(block)
            .map_or(self.bytes.len(), |&next| {
                usize::try_from(next).expect("block start within the index")
            });
        let mut entries: Vec<ChunkEntry> = self
            .entries_from(block * INDEX_BLOCK_ENTRIES)
            .take(INDEX_BLOCK_ENTRIES)
            .collect();
        let slot = &mut entries[absolute % INDEX_BLOCK_ENTRIES];
        debug_assert_eq!(slot.first_offset, entry.first_offset);
        *slot = entry;
        let mut encoded = Vec::with_capacity(end - start + 8);
        let mut previous = None;
        for &entry in &entries {
            match previous {
                None => encode_full(&mut encoded, entry),
                Some(previous) => encode_next(&mut encoded, previous, entry),
            }
            previous = Some(entry);
        }
        let (old_bytes, new_bytes) = ((end - start) as u64, encoded.len() as u64);
        // A longer block grows the bytes exactly, not by doubling (see `push_back`).
        self.bytes
            .reserve_exact(encoded.len().saturating_sub(end - start));
        self.bytes.splice(start..end, encoded);
        let restarts = self
            .restarts
            .as_deref_mut()
            .map_or(&mut [][..], Vec::as_mut_slice);
        for restart in &mut restarts[block..] {
            *restart = *restart - old_bytes + new_bytes;
        }
        if index + 1 == len {
            self.last = entry;
        }
    }

    /// The entries, in offset order.
    pub fn iter(&self) -> impl Iterator<Item = ChunkEntry> + '_ {
        self.iter_from(0)
    }

    /// The entries from index `index` on.
    pub fn iter_from(&self, index: usize) -> impl Iterator<Item = ChunkEntry> + '_ {
        let absolute = self.popped() + index.min(self.len());
        let block = absolute / INDEX_BLOCK_ENTRIES;
        self.entries_from(block * INDEX_BLOCK_ENTRIES)
            .skip(absolute % INDEX_BLOCK_ENTRIES)
    }

    /// Entries from the start of a block, popped ones included, to the end.
    fn entries_from(&self, absolute: usize) -> Entries<'_> {
        debug_assert!(absolute.is_multiple_of(INDEX_BLOCK_ENTRIES));
        let end = self.popped() + self.len();
        Entries {
            bytes: &self.bytes,
            at: if absolute < end {
                self.block_start(absolute / INDEX_BLOCK_ENTRIES)
            } else {
                self.bytes.len()
            },
            next: absolute.min(end),
            end,
            previous: ChunkEntry::default(),
        }
    }

    /// Byte position of a block.
    fn block_start(&self, block: usize) -> usize {
        block.checked_sub(1).map_or(0, |index| {
            usize::try_from(self.restarts()[index]).expect("block start within the index")
        })
    }
}

impl FromIterator<ChunkEntry> for ChunkIndex {
    fn from_iter<I: IntoIterator<Item = ChunkEntry>>(entries: I) -> Self {
        let mut index = Self::default();
        for entry in entries {
            index.push_back(entry);
        }
        index.shrink_to_fit();
        index
    }
}

/// Decodes entries of a [`ChunkIndex`] from the start of a block.
struct Entries<'a> {
    bytes: &'a [u8],
    at: usize,
    /// Absolute number of the next entry.
    next: usize,
    end: usize,
    previous: ChunkEntry,
}

impl Iterator for Entries<'_> {
    type Item = ChunkEntry;

    fn next(&mut self) -> Option<ChunkEntry> {
        if self.next >= self.end {
            return None;
        }
        let entry = if self.next.is_multiple_of(INDEX_BLOCK_ENTRIES) {
            decode_full(self.bytes, &mut self.at)
        } else {
            decode_next(self.bytes, &mut self.at, self.previous)
        };
        self.previous = entry;
        self.next += 1;
        Some(entry)
    }
}

/// One encoded entry: at most a 10-byte varint (offset, or its delta with the code) and two
/// 5-byte varints (segment, position).
#[derive(Default)]
struct EntryBytes {
    bytes: [u8; 20],
    len: usize,
}

/// Index entries are encoded into a block being rebuilt (a `Vec<u8>`) or, one at a time, into
/// this (so `push_back` knows an entry's size before growing the index).
impl ByteSink for EntryBytes {
    fn put(&mut self, byte: u8) {
        self.bytes[self.len] = byte;
        self.len += 1;
    }
}

/// Reads a varint written by [`put_varint`] (the index only holds its own encodings).
fn get_varint(bytes: &[u8], at: &mut usize) -> u64 {
    let mut value = 0;
    let mut shift = 0;
    loop {
        let byte = bytes[*at];
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return value;
        }
        shift += 7;
    }
}

fn encode_full(bytes: &mut impl ByteSink, entry: ChunkEntry) {
    put_varint(bytes, entry.first_offset);
    put_varint(bytes, u64::from(entry.segment));
    put_varint(bytes, u64::from(entry.position));
}

fn decode_full(bytes: &[u8], at: &mut usize) -> ChunkEntry {
    let first_offset = get_varint(bytes, at);
    // The index holds only what `encode_full` wrote from u32 values.
    let segment = u32::try_from(get_varint(bytes, at)).unwrap_or(u32::MAX);
    let position = u32::try_from(get_varint(bytes, at)).unwrap_or(u32::MAX);
    ChunkEntry {
        first_offset,
        segment,
        position,
    }
}

fn encode_next(bytes: &mut impl ByteSink, previous: ChunkEntry, entry: ChunkEntry) {
    let delta = entry.first_offset - previous.first_offset;
    let (code, position) = if entry.segment == previous.segment {
        if entry.position >= previous.position {
            (INDEX_SAME_AFTER, entry.position - previous.position)
        } else {
            (INDEX_SAME_BEFORE, previous.position - entry.position)
        }
    } else if Some(entry.segment) == previous.segment.checked_add(1) {
        (INDEX_NEXT_SEGMENT, entry.position)
    } else {
        (INDEX_ANY_SEGMENT, entry.position)
    };
    put_varint(bytes, (delta << INDEX_CODE_BITS) | code);
    if code == INDEX_ANY_SEGMENT {
        put_varint(bytes, u64::from(entry.segment));
    }
    put_varint(bytes, u64::from(position));
}

fn decode_next(bytes: &[u8], at: &mut usize, previous: ChunkEntry) -> ChunkEntry {
    let header = get_varint(bytes, at);
    let code = header & ((1 << INDEX_CODE_BITS) - 1);
    let first_offset = previous.first_offset + (header >> INDEX_CODE_BITS);
    let segment = match code {
        INDEX_SAME_AFTER | INDEX_SAME_BEFORE => previous.segment,
        INDEX_NEXT_SEGMENT => previous.segment.wrapping_add(1),
        _ => u32::try_from(get_varint(bytes, at)).unwrap_or(u32::MAX),
    };
    let value = u32::try_from(get_varint(bytes, at)).unwrap_or(u32::MAX);
    let position = match code {
        INDEX_SAME_AFTER => previous.position.wrapping_add(value),
        INDEX_SAME_BEFORE => previous.position.wrapping_sub(value),
        _ => value,
    };
    ChunkEntry {
        first_offset,
        segment,
        position,
    }
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
    /// The framed messages back to back, from `head` on: the bytes before it were drained
    /// (see [`WriteBuffer::drain_front`]) and are dropped when the buffer next grows or
    /// empties, not at once, so a drain does not move the messages behind it. Read it
    /// through [`WriteBuffer::bytes`].
    pub data: Vec<u8>,
    /// Bytes at the start of `data` already drained.
    pub head: usize,
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
    /// multiple of [`BUFFER_POSITION_STRIDE`], oldest first, except a message pushed into an
    /// empty buffer (it is at position 0).
    pub positions: VecDeque<(u64, u64)>,
    /// Bytes drained from the front of `data` since the buffer was made.
    pub drained_bytes: u64,
}

/// Emptied write buffers kept, allocation and all, for the next queues that need one (a
/// shard's, under its lock), newest last. Freed at once by the committer, a queue appended
/// to round after round got a fresh allocation each round, which the appender then grew by
/// copying and, on memory fresh from the kernel, faulted in: a third of an appender's time
/// with 4 KiB messages.
#[derive(Debug, Default)]
pub struct SpareBuffers {
    #[allow(
        clippy::vec_box,
        reason = "queues hold their buffers boxed: the box is reused with the data"
    )]
    buffers: Vec<Box<WriteBuffer>>,
    /// Memory of the kept buffers: each one's box and its data's capacity.
    bytes: usize,
}

impl SpareBuffers {
    /// A write buffer for a queue whose next message has offset `first_offset`: a kept one if
    /// any, else a new one.
    pub fn take(&mut self, first_offset: u64) -> Box<WriteBuffer> {
        let Some(mut buffer) = self.buffers.pop() else {
            return Box::new(WriteBuffer {
                first_offset,
                logged_end: first_offset,
                ..WriteBuffer::default()
            });
        };
        self.bytes -= Self::memory_of(&buffer);
        let mut data = std::mem::take(&mut buffer.data);
        data.clear();
        *buffer = WriteBuffer {
            first_offset,
            logged_end: first_offset,
            data,
            ..WriteBuffer::default()
        };
        buffer
    }

    /// Keeps an emptied write buffer if the kept ones stay within `bytes_max` bytes of memory
    /// (boxes and data); drops it otherwise.
    pub fn keep(&mut self, buffer: Box<WriteBuffer>, bytes_max: usize) {
        let memory = Self::memory_of(&buffer);
        if buffer.data.capacity() > 0 && self.bytes + memory <= bytes_max {
            self.bytes += memory;
            self.buffers.push(buffer);
        }
    }

    fn memory_of(buffer: &WriteBuffer) -> usize {
        std::mem::size_of::<WriteBuffer>() + buffer.data.capacity()
    }

    /// Memory of the kept buffers (boxes and data), in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// How many buffers are kept.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.buffers.len()
    }
}

/// Rounds a write buffer tracks at once (see [`WriteBuffer::marks`]).
pub const MARKS_MAX: usize = 2;

impl WriteBuffer {
    /// Bytes this buffer counts against the global budget: payload plus a length per message.
    pub fn budget_bytes(&self) -> usize {
        self.data.len() - self.head
    }

    /// The framed messages buffered, back to back.
    pub fn bytes(&self) -> &[u8] {
        &self.data[self.head..]
    }

    /// Appends one message to a buffer that the committer seals once it holds `chunk_bytes`:
    /// the data grows by doubling, except that the step past a chunk goes to a chunk and a
    /// quarter, not to twice the last size (most of which a sealed buffer never used: with
    /// 4 KiB chunks and 62-byte framed messages, 7,936 bytes held for 4,154).
    pub fn push_toward_chunk(&mut self, message: &[u8], chunk_bytes: usize) {
        let needed = self.budget_bytes() + FRAME_BYTES + message.len();
        let capacity = self.data.capacity();
        if needed <= capacity && self.head + needed > capacity {
            // Room once the drained bytes go: the live ones move to the front.
            self.data.drain(..self.head);
            self.head = 0;
        } else if needed > capacity {
            let step = chunk_bytes + chunk_bytes / 4;
            let doubled = capacity.saturating_mul(2);
            let target = if needed <= step && doubled > step {
                step
            } else {
                doubled.max(needed)
            };
            if self.head == 0 {
                self.data.reserve_exact(target - self.data.len());
            } else {
                // Only the live bytes go to the new allocation.
                let mut grown = Vec::with_capacity(target);
                grown.extend_from_slice(self.bytes());
                self.data = grown;
                self.head = 0;
            }
        }
        // Invariant: message_bytes_max <= 64 MiB (checked by StoreOptions::validate).
        let length = u32::try_from(message.len()).expect("message length checked");
        let offset = self.end_offset();
        // The first message's position is 0: not remembered, so a buffer of a few messages
        // (a mailbox's) allocates no position list and a read does not touch one.
        if offset.is_multiple_of(BUFFER_POSITION_STRIDE) && self.count > 0 {
            self.positions
                .push_back((offset, self.drained_bytes + self.budget_bytes() as u64));
        }
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

    /// Byte position in [`Self::bytes`] of the message at `offset` (its length at or past the end,
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
        self.drained_bytes += self.budget_bytes() as u64;
        self.data.clear();
        self.head = 0;
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
        let dropped = self.budget_bytes() - position;
        self.data.truncate(self.head + position);
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
        self.budget_bytes() - self.frozen_bytes - FRAME_BYTES * (self.count - self.frozen)
    }

    /// Drops the first `count` messages (`bytes` of [`Self::bytes`]) after they reached the
    /// disk. The messages behind them stay where they are (moving them cost a sealed 4 KiB
    /// message's committer as much as sealing it, when more had arrived behind it); the bytes
    /// go when the buffer grows or empties.
    pub fn drain_front(&mut self, count: usize, bytes: usize) {
        if bytes == self.budget_bytes() {
            self.data.clear();
            self.head = 0;
        } else {
            self.head += bytes;
        }
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
        length.copy_from_slice(&self.bytes()[position..position + FRAME_BYTES]);
        u32::from_le_bytes(length) as usize
    }

    /// The message framed at byte `position` of `data`, and the position of the next one.
    pub fn message_at(&self, position: usize) -> (&[u8], usize) {
        let start = position + FRAME_BYTES;
        let end = start + self.length_at(position);
        (&self.bytes()[start..end], end)
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
    pub chunks: ChunkIndex,
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
    /// No buffered message of this queue not yet sealed was logged before this round (0:
    /// unknown). Set when a round seals the queue (it seals everything logged through it);
    /// the committer raises the queue's stale buffered-list entry to it, so a queue sealed
    /// chunk by chunk does not hold the log floor at the round it was first listed in.
    pub unsealed_since: u64,
}

impl QueueState {
    /// An empty queue whose next message gets `next_offset`.
    pub fn new(name: Arc<[u8]>, incarnation: u64, next_offset: u64) -> Self {
        Self {
            name,
            incarnation,
            first_offset: next_offset,
            next_offset,
            chunks: ChunkIndex::default(),
            buffer: None,
            stored_bytes: 0,
            trim_segment: NO_SEGMENT,
            queued: false,
            direct_round: 0,
            unsealed_since: 0,
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
mod tests;
