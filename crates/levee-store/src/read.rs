//! Reading a queue: [`crate::Store::read`] takes the locations of the chunks from the offset
//! out of the index and copies any buffered messages under the shard lock, then reads and
//! checksums the chunks without it; the messages come back copied into one buffer, a
//! [`ReadBatch`].

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::error::ReadError;
use crate::format::{self, RECORD_HEADER_BYTES, Record};
use crate::options::SyncPolicy;
use crate::queue::ChunkEntry;
use crate::storage::StorageFile;
use crate::store::{Inner, Store, check_name, lock};

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

/// Messages read from one queue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadBatch {
    /// Offset of the first message returned (or where reading would start).
    pub first_offset: u64,
    /// The requested offset was before the first retained one, so reading started there.
    pub skipped_to_first_retained: bool,
    /// End of what a read could see when it ran: under `always` the end of the fsynced
    /// messages, under `interval` the queue's next offset (acknowledged, maybe not yet
    /// fsynced).
    pub visible_end_offset: u64,
    data: Vec<u8>,
    ends: Vec<usize>,
}

impl ReadBatch {
    pub(crate) fn new(first_offset: u64, skipped: bool, visible_end_offset: u64) -> Self {
        Self {
            first_offset,
            skipped_to_first_retained: skipped,
            visible_end_offset,
            data: Vec::new(),
            ends: Vec::new(),
        }
    }

    pub(crate) fn reserve(&mut self, messages: usize, bytes: usize) {
        self.ends.reserve(messages);
        self.data.reserve(bytes);
    }

    pub(crate) fn push(&mut self, message: &[u8]) {
        self.data.extend_from_slice(message);
        self.ends.push(self.data.len());
    }

    /// Bytes of all messages.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Number of messages.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// No message was returned.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Offset after the last message returned: where the next read continues.
    pub fn next_offset(&self) -> u64 {
        self.first_offset + self.ends.len() as u64
    }

    /// Message `index` (0 is the message at `first_offset`).
    pub fn message(&self, index: usize) -> Option<&[u8]> {
        let end = *self.ends.get(index)?;
        let start = if index == 0 { 0 } else { self.ends[index - 1] };
        Some(&self.data[start..end])
    }

    /// The messages' bytes back to back and the end of each message in them, for a caller
    /// that hands out the messages without copying them again.
    pub fn into_parts(self) -> (Vec<u8>, Vec<usize>) {
        (self.data, self.ends)
    }

    /// The messages in offset order.
    pub fn iter(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.ends.len()).filter_map(|index| self.message(index))
    }
}

impl Store {
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
}

impl Inner {
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
            let visible_end = match self.sync() {
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
