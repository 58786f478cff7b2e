//! The scanning side of the replay: reads a segment through a window ([`Scanner`]), frames
//! and checksums every record, skips the log records before the floor, routes each record to
//! its lock shard and hands the checked records to the applying side window by window
//! ([`Flush`]); a damaged tail of the last segment is cut, damage elsewhere refuses the open.

use std::collections::BTreeMap;

use crate::error::OpenError;
use crate::format::{
    self, LogFloor, RECORD_BODY_BYTES_MAX, RECORD_HEADER_BYTES, Record, SEGMENT_HEADER_BYTES,
};
use crate::storage::StorageFile;

use super::{FLOOR_VERSION, LOG_BATCH_VERSION, OpenReport, Problem, TruncatedTail};

/// Bytes read at a time while scanning a segment.
pub(super) const SCAN_BLOCK_BYTES: usize = 4 << 20;

/// What scanning needs: it checks records and queues them for
/// [`ApplyState`](super::replay::ApplyState).
pub(super) struct ScanState {
    pub(super) hasher: foldhash::fast::FixedState,
    /// Chunk records seen per segment.
    pub(super) chunk_records: BTreeMap<u32, u64>,
    /// Format version of the segment being scanned.
    pub(super) segment_version: u32,
    /// Log records before this are skipped (their messages are in chunks).
    pub(super) floor: LogFloor,
    /// Log records skipped so far.
    pub(super) log_records_skipped: u64,
}

/// A checked record waiting in the scanner's window to be applied.
pub(super) struct PendingRecord {
    /// Where the record starts in the window.
    pub(super) window_start: usize,
    /// Record bytes, header included.
    pub(super) bytes: usize,
    /// Where the record starts in its segment.
    pub(super) position: u32,
    /// Its queue's lock shard.
    pub(super) shard: usize,
    /// A log batch record with runs of more than one lock shard (pushed once per shard):
    /// only the runs of `shard` are applied.
    pub(super) mixed: bool,
}

/// Called with the scanner's window and the checked records in it before the window moves:
/// applies them (or hands them to the applying thread) and leaves both empty for reuse.
pub(super) type Flush<'f> =
    dyn FnMut(&mut Vec<u8>, &mut Vec<PendingRecord>) -> Result<(), Contradiction> + 'f;

/// A well-formed record that contradicts the log, found by the applying side: where it
/// starts in its segment and why (position 0: an applying thread failed, and its own
/// contradiction says where).
#[derive(Debug)]
pub(super) struct Contradiction {
    pub(super) position: u64,
    pub(super) reason: String,
}

/// Reads a segment through a window of [`SCAN_BLOCK_BYTES`].
pub(crate) struct Scanner<'a> {
    file: &'a dyn StorageFile,
    length: u64,
    /// The buffer; its first `filled` bytes are the file's from `window_start`.
    window: Vec<u8>,
    filled: usize,
    window_start: u64,
}

impl<'a> Scanner<'a> {
    pub(crate) fn new(file: &'a dyn StorageFile, length: u64) -> Self {
        Self {
            file,
            length,
            window: Vec::new(),
            filled: 0,
            window_start: 0,
        }
    }

    /// Whether `count` bytes at `position` are in the current window (no read needed).
    fn contains(&self, position: u64, count: usize) -> bool {
        position >= self.window_start
            && position + count as u64 <= self.window_start + self.filled as u64
    }

    /// `count` bytes at `position`; the caller keeps `position + count` within the length.
    pub(crate) fn bytes(&mut self, position: u64, count: usize) -> std::io::Result<&[u8]> {
        if !self.contains(position, count) {
            let left = usize::try_from(self.length - position).unwrap_or(usize::MAX);
            let read = count.max(SCAN_BLOCK_BYTES).min(left);
            if self.window.len() < read {
                self.window.resize(read, 0);
            }
            self.filled = 0;
            self.file.read_at(position, &mut self.window[..read])?;
            self.filled = read;
            self.window_start = position;
        }
        let start = usize::try_from(position - self.window_start).unwrap_or(usize::MAX);
        Ok(&self.window[start..start + count])
    }

    /// Hands the window's buffer to `flush` (which leaves another in its place): the next
    /// read fills the new one.
    fn flush_window(
        &mut self,
        pending: &mut Vec<PendingRecord>,
        flush: &mut Flush<'_>,
    ) -> Result<(), Contradiction> {
        self.filled = 0;
        flush(&mut self.window, pending)
    }
}

impl ScanState {
    /// Checks every record of one segment, handing them to `flush` window by window; returns
    /// where the valid records end.
    #[allow(
        clippy::too_many_arguments,
        reason = "the segment, where to report and where to send records"
    )]
    pub(super) fn scan(
        &mut self,
        segment: u32,
        name: &str,
        file: &dyn StorageFile,
        length: u64,
        last: bool,
        report: &mut OpenReport,
        flush: &mut Flush<'_>,
    ) -> Result<u64, OpenError> {
        let mut scanner = Scanner::new(file, length);
        let mut position = SEGMENT_HEADER_BYTES;
        let mut pending = Vec::new();
        let inconsistent = |Contradiction { position, reason }| OpenError::Corrupt {
            file: name.to_string(),
            position,
            reason,
        };
        while position < length {
            let problem =
                match self.next_record(&mut scanner, segment, position, &mut pending, flush) {
                    Ok(record_bytes) => {
                        report.records += 1;
                        position += record_bytes;
                        continue;
                    }
                    Err((_, Problem::Damaged(problem))) => problem,
                    Err((position, Problem::Inconsistent(reason))) => {
                        // The record passed its checksum: this is not a torn write, and cutting
                        // here could drop acknowledged data. Refuse instead.
                        return Err(inconsistent(Contradiction { position, reason }));
                    }
                };
            if !last {
                return Err(OpenError::Corrupt {
                    file: name.to_string(),
                    position,
                    reason: problem,
                });
            }
            // The records before the damage are good: apply them, then cut.
            scanner
                .flush_window(&mut pending, flush)
                .map_err(inconsistent)?;
            report.truncated.push(TruncatedTail {
                file: name.to_string(),
                position,
                bytes_dropped: length - position,
                reason: problem,
            });
            return Ok(position);
        }
        scanner
            .flush_window(&mut pending, flush)
            .map_err(inconsistent)?;
        Ok(position)
    }

    /// Checks the record at `position` and queues it in `pending` (flushing the pending ones
    /// first if the record needs the window moved); returns its length, or what is wrong and
    /// where.
    fn next_record(
        &mut self,
        scanner: &mut Scanner<'_>,
        segment: u32,
        position: u64,
        pending: &mut Vec<PendingRecord>,
        flush: &mut Flush<'_>,
    ) -> Result<u64, (u64, Problem)> {
        let damaged = |reason: String| (position, Problem::Damaged(reason));
        let mut flush_window = |scanner: &mut Scanner<'_>, pending: &mut Vec<PendingRecord>| {
            scanner
                .flush_window(pending, flush)
                .map_err(|found| (found.position, Problem::Inconsistent(found.reason)))
        };
        let left = scanner.length - position;
        if left < RECORD_HEADER_BYTES as u64 {
            return Err(damaged(format!(
                "record header cut short ({left} bytes left)"
            )));
        }
        if !scanner.contains(position, RECORD_HEADER_BYTES) {
            flush_window(scanner, pending)?;
        }
        let header = scanner
            .bytes(position, RECORD_HEADER_BYTES)
            .map_err(|error| damaged(error.to_string()))?;
        let body_bytes = usize::try_from(format::read_u32(header, 4)).unwrap_or(usize::MAX);
        if body_bytes == 0 || body_bytes > RECORD_BODY_BYTES_MAX {
            return Err(damaged(format!("record length {body_bytes} out of bounds")));
        }
        let record_bytes = (RECORD_HEADER_BYTES + body_bytes) as u64;
        if record_bytes > left {
            return Err(damaged(format!(
                "record of {record_bytes} bytes runs past the end of the file"
            )));
        }
        let bytes = usize::try_from(record_bytes).unwrap_or(usize::MAX);
        if !scanner.contains(position, bytes) {
            flush_window(scanner, pending)?;
        }
        let record = scanner
            .bytes(position, bytes)
            .map_err(|error| damaged(error.to_string()))?;
        if format::is_log_record(record) && self.floor.covers(segment, position) {
            // Its messages are in chunks (FORMAT.md, floor record): not needed, not decoded;
            // checked still, so that a damaged length is caught where it is.
            if !format::checksum_matches(record) {
                return Err(damaged("record checksum mismatch".to_string()));
            }
            self.log_records_skipped += 1;
            return Ok(record_bytes);
        }
        let decoded =
            format::decode_checked(record).map_err(|reason| damaged(reason.to_string()))?;
        let too_new = |what: &str, version: u32| {
            Err((
                position,
                Problem::Inconsistent(format!(
                    "{what} record in a segment of format version {} (first in {version})",
                    self.segment_version
                )),
            ))
        };
        let name = match &decoded {
            Record::Chunk(chunk) | Record::Log(chunk) => chunk.name,
            Record::Trim { name, .. } | Record::Delete { name } => name,
            Record::Floor(_) if self.segment_version < FLOOR_VERSION => {
                return too_new("floor", FLOOR_VERSION);
            }
            // Used before the scan (`find_floor`).
            Record::Floor(_) => return Ok(record_bytes),
            Record::LogBatch(_) if self.segment_version < LOG_BATCH_VERSION => {
                return too_new("log batch", LOG_BATCH_VERSION);
            }
            // Routed by its first run's queue; the other shards it names are found below.
            Record::LogBatch(batch) => batch.runs().next().map_or(&[][..], |run| run.name),
        };
        let shard = crate::store::shard_of(self.hasher, name);
        if matches!(decoded, Record::Chunk(_)) {
            *self.chunk_records.entry(segment).or_default() += 1;
        }
        let record_position = u32::try_from(position).map_err(|_| {
            (
                position,
                Problem::Inconsistent("record position past 4 GiB".to_string()),
            )
        })?;
        // Other lock shards named by a log batch. The writer puts in one record only runs of
        // one shard's queues (its log), but the format allows any: then each shard named gets
        // the record, applying only its own runs.
        let mut others: Vec<usize> = Vec::new();
        if let Record::LogBatch(batch) = &decoded {
            for run in batch.runs().skip(1) {
                let other = crate::store::shard_of(self.hasher, run.name);
                if other != shard && !others.contains(&other) {
                    others.push(other);
                }
            }
        }
        let record = PendingRecord {
            window_start: usize::try_from(position - scanner.window_start).unwrap_or(usize::MAX),
            bytes,
            position: record_position,
            shard,
            mixed: !others.is_empty(),
        };
        for other in others {
            pending.push(PendingRecord {
                shard: other,
                ..record
            });
        }
        pending.push(record);
        Ok(record_bytes)
    }
}
