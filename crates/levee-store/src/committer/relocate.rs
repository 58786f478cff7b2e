//! Relocation: the few live chunks of a mostly dead oldest segment are copied to the end of the
//! active segment and the index pointed at the copies, so a long-lived queue does not pin
//! every later segment on disk.

use std::sync::atomic::Ordering;

use super::writer::POSITION_SOFT_MAX;
use super::{Committer, is_no_space};
use crate::format::{self, RECORD_HEADER_BYTES, Record, SEGMENT_HEADER_BYTES};
use crate::queue::ChunkEntry;
use crate::recovery::Scanner;
use crate::storage::StorageFile;
use crate::store::{QueueKey, lock};

/// A live chunk being relocated.
#[derive(Debug)]
struct Moved {
    /// The queue whose index points at the chunk.
    key: QueueKey,
    /// The chunk's first offset: its index entry's key.
    first_offset: u64,
    /// The chunk record's position in the old segment.
    old_position: u32,
    /// Where the record starts in the copied bytes ([`LiveChunks::copy`]).
    offset_in_copy: usize,
}

/// The live chunk records of a segment, copied back to back, and where each came from.
#[derive(Debug)]
struct LiveChunks {
    copy: Vec<u8>,
    moved: Vec<Moved>,
}

impl Committer<'_> {
    /// Copies the live chunk records of segment `oldest` to the end of the active segment,
    /// fsyncs, and points the index at the copies; the old segment is then dead and deleted.
    /// Replay treats a chunk seen twice as moved (FORMAT.md). Returns false once poisoned.
    pub(super) fn relocate(&mut self, oldest: u32) -> bool {
        let Some(file) = lock(&self.inner.segments)
            .get(&oldest)
            .map(|entry| entry.file.clone())
        else {
            return true;
        };
        let LiveChunks { copy, moved } = match self.live_chunks_of(oldest, file.as_ref()) {
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
        for Moved {
            key,
            first_offset,
            old_position,
            offset_in_copy,
        } in moved
        {
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

    /// The live chunk records of segment `oldest`, copied back to back, and for each the
    /// queue, its first offset, its old position and its position in the copy.
    fn live_chunks_of(&self, oldest: u32, file: &dyn StorageFile) -> Result<LiveChunks, String> {
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
                moved.push(Moved {
                    key,
                    first_offset: chunk.first_offset,
                    old_position,
                    offset_in_copy: copy.len(),
                });
                copy.extend_from_slice(record);
            }
            position += record_bytes;
        }
        Ok(LiveChunks { copy, moved })
    }
}
