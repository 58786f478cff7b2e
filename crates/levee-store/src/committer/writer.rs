//! The active segment ([`Writer`]): the file, its length and the bytes of the round being
//! built. Owns writing the round buffer (no fsync), rotation to a new segment (mid-round near
//! the u32 position limit, or at a round's start), and the fsynced appends made outside a
//! round (relocated chunks, trim records carried forward).

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{Committer, is_no_space};
use crate::format::{self, FLOOR_RECORD_BYTES, SEGMENT_HEADER_BYTES};
use crate::storage::{StorageFile, WriteBytes};
use crate::store::{SegmentEntry, lock};

/// Past this position a round starts a new segment even mid-round, so positions fit in u32.
pub(super) const POSITION_SOFT_MAX: u64 = 3 << 30;

/// The active segment and the bytes of the round being built.
#[derive(Debug)]
pub(crate) struct Writer {
    pub(super) segment: u32,
    pub(super) file: Arc<dyn StorageFile>,
    pub(super) length: u64,
    /// The round's bytes not yet written, for position `length`.
    pub(super) buffer: WriteBytes,
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

    pub(super) fn position(&self) -> u32 {
        // Invariant: rounds rotate before POSITION_SOFT_MAX plus one record (< 4 GiB).
        u32::try_from(self.length + self.buffer.len() as u64).expect("segment position fits u32")
    }
}

impl Committer<'_> {
    /// Writes the round buffer so far (no fsync) and empties it; its log records are kept
    /// aside for a failure. A failed round truncates the segment back to where it started.
    pub(super) fn write_round_buffer(&mut self) -> io::Result<()> {
        if self.round_log_buffered > 0 {
            // The file may keep the buffer's memory (see `StorageFile::write_bytes`).
            self.round_log
                .extend_from_slice(&self.writer.buffer[..self.round_log_buffered]);
            self.round_log_buffered = 0;
        }
        debug_assert_eq!(self.writer.buffer.position(), self.writer.length);
        let written = self.writer.buffer.len() as u64;
        self.inner.write_barrier.run()?;
        self.writer.file.write_bytes(&mut self.writer.buffer)?;
        self.writer.length += written;
        self.round_flushed += written;
        Ok(())
    }

    /// Starts a new segment mid-round when the active one nears the u32 position limit.
    pub(super) fn overflow_rotate(&mut self, rotated: &mut bool) -> io::Result<()> {
        if self.writer.length + (self.writer.buffer.len() as u64) < POSITION_SOFT_MAX {
            return Ok(());
        }
        *rotated = true;
        self.round_log_buffered = 0;
        let written = self.writer.buffer.len() as u64;
        self.inner.write_barrier.run()?;
        self.writer.file.write_bytes(&mut self.writer.buffer)?;
        self.writer.length += written;
        self.rotate()
    }

    /// Closes the active segment and starts the next one: fsync the old file, create the new
    /// one, write and fsync its header, fsync the directory.
    pub(super) fn rotate(&mut self) -> io::Result<()> {
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

    /// Appends `bytes` to the active segment outside a round and fsyncs it; returns where
    /// they start. `Err(None)`: the disk is full and the segment was cut back to where it was.
    pub(super) fn append_synced(&mut self, bytes: &[u8]) -> Result<u64, Option<io::Error>> {
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
}
