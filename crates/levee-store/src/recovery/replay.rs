//! The applying side of the replay ([`Replay`]): the checked records of each window are
//! applied to the queues being rebuilt, in log order per queue, on the scanning thread or,
//! with two cores, on [`APPLIERS`] threads (each its share of the lock shards) a window
//! behind the scanner.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};

use crate::error::OpenError;
use crate::format::{self, RECORD_HEADER_BYTES, Record};
use crate::queue::ChunkEntry;
use crate::storage::StorageFile;

use super::rebuild::Recovering;
use super::scan::{Contradiction, PendingRecord, SCAN_BLOCK_BYTES, ScanState};
use super::{OpenReport, Problem, RecoveringMap};

/// Read windows queued between the scanning and the applying thread (besides the one each
/// holds): the log alternates between stretches of chunk records (work for the applier) and of
/// skipped log records (work for the scanner only), and a queue lets the applier catch up
/// meanwhile. Bounds the memory at a few windows more.
const WINDOWS_QUEUED: usize = 16;

/// Applying threads where there are two cores or more: each rebuilds the queues of its share
/// of the shards.
const APPLIERS: usize = 2;

/// Says an applying thread refused a record; its own error replaces this one.
const APPLIER_FAILED: &str = "a record contradicts the log (see the applying thread's error)";

/// What the scanner reports once an applying thread failed: the thread's own contradiction,
/// with its position, replaces it.
fn applier_failed() -> Contradiction {
    Contradiction {
        position: 0,
        reason: APPLIER_FAILED.to_string(),
    }
}

/// Replays the records: a scanning side (read, frame, checksum) and an applying side (rebuild
/// the queues), run on two threads where there are two cores, one window apart.
pub(super) struct Replay {
    pub(super) scan: ScanState,
    pub(super) apply: ApplyState,
    /// Scan and apply on two threads.
    pub(super) parallel: bool,
}

/// The queues being rebuilt.
pub(super) struct ApplyState {
    pub(super) shards: Vec<RecoveringMap>,
    /// The store's chunk size: a tail grows toward it (see `WriteBuffer::push_toward_chunk`).
    pub(super) chunk_bytes: usize,
    /// Next incarnation for a queue created by the replay.
    pub(super) next_incarnation: u64,
}

/// A read window and the checked records in it, sent by the scanner to every applying thread
/// (and back, emptied, for reuse).
#[derive(Default)]
struct Batch {
    /// The scanner's read window: the segment's bytes the records lie in.
    window: Vec<u8>,
    /// The checked records in `window`, in log order.
    records: Vec<PendingRecord>,
}

/// The queues of a run of shards, rebuilt by one applying thread, and how that thread numbers
/// the queues it creates: `next_incarnation`, then every `step`th number after it, so two
/// threads never hand out the same one.
struct ShardRange<'a> {
    shards: &'a mut [RecoveringMap],
    /// Index of `shards[0]` among all shards.
    first: usize,
    next_incarnation: u64,
    step: u64,
    chunk_bytes: usize,
}

impl Replay {
    /// Applies every record of one segment; returns where the valid records end. With two
    /// cores, a second thread applies each window's records while this one reads and checks
    /// the next window.
    pub(super) fn scan(
        &mut self,
        segment: u32,
        name: &str,
        file: &dyn StorageFile,
        length: u64,
        last: bool,
        report: &mut OpenReport,
    ) -> Result<u64, OpenError> {
        let version = self.scan.segment_version;
        let scan = &mut self.scan;
        if !self.parallel {
            let mut ranges = self.apply.ranges(1);
            let range = &mut ranges[0];
            let mut flush = |window: &mut Vec<u8>, pending: &mut Vec<PendingRecord>| {
                let applied = range.apply(window, pending, segment, version);
                pending.clear();
                applied
            };
            let scanned = scan.scan(segment, name, file, length, last, report, &mut flush);
            let next_incarnation = ranges[0].next_incarnation;
            self.apply.next_incarnation = next_incarnation;
            return scanned;
        }
        let failed = &AtomicBool::new(false);
        let ranges = self.apply.ranges(APPLIERS);
        let (next_incarnation, scanned) = std::thread::scope(|scope| {
            // Each window goes to every applier, each applying the records of its own shards
            // (a queue's records stay in log order); the last one done returns the buffers.
            let (returned, spares) = mpsc::sync_channel::<Batch>(WINDOWS_QUEUED + 1);
            let mut senders = Vec::with_capacity(APPLIERS);
            let mut appliers = Vec::with_capacity(APPLIERS);
            for mut range in ranges {
                let (batches, received) = mpsc::sync_channel::<Arc<Batch>>(WINDOWS_QUEUED);
                senders.push(batches);
                let returned = returned.clone();
                appliers.push(scope.spawn(move || {
                    let mut applied = Ok(());
                    for batch in received {
                        if applied.is_ok() {
                            applied = range.apply(&batch.window, &batch.records, segment, version);
                            if applied.is_err() {
                                failed.store(true, Ordering::Relaxed);
                            }
                        }
                        // A window grown for one large record, or a full return queue (the
                        // scanner is done): the buffers are dropped.
                        if let Some(Batch {
                            window,
                            records: mut pending,
                        }) = Arc::into_inner(batch)
                            && window.len() <= SCAN_BLOCK_BYTES
                        {
                            pending.clear();
                            let _ = returned.try_send(Batch {
                                window,
                                records: pending,
                            });
                        }
                    }
                    applied.map(|()| range.next_incarnation)
                }));
            }
            drop(returned);
            let mut flush = move |window: &mut Vec<u8>, pending: &mut Vec<PendingRecord>| {
                if failed.load(Ordering::Relaxed) {
                    return Err(applier_failed());
                }
                let spare = spares.try_recv().unwrap_or_default();
                let full = Arc::new(Batch {
                    window: std::mem::replace(window, spare.window),
                    records: std::mem::replace(pending, spare.records),
                });
                // The scanner keeps no reference, so an applier is always the last holder.
                let gone = |_| applier_failed();
                if let Some((last, others)) = senders.split_last() {
                    for sender in others {
                        sender.send(Arc::clone(&full)).map_err(gone)?;
                    }
                    last.send(full).map_err(gone)?;
                }
                Ok(())
            };
            let scanned = scan.scan(segment, name, file, length, last, report, &mut flush);
            // Closes the channels: the appliers end after the last window.
            drop(flush);
            let mut next_incarnation = 0;
            let mut first_error: Option<Contradiction> = None;
            for applier in appliers {
                // Invariant: `apply` returns errors rather than panicking on any input.
                match applier.join().expect("recovery applier finished") {
                    Ok(next) => next_incarnation = next_incarnation.max(next),
                    Err(error) => {
                        if first_error
                            .as_ref()
                            .is_none_or(|first| error.position < first.position)
                        {
                            first_error = Some(error);
                        }
                    }
                }
            }
            // The appliers' records all precede any damage the scan found.
            let scanned = match first_error {
                Some(Contradiction { position, reason }) => Err(OpenError::Corrupt {
                    file: name.to_string(),
                    position,
                    reason,
                }),
                None => scanned,
            };
            (next_incarnation, scanned)
        });
        self.apply.next_incarnation = self.apply.next_incarnation.max(next_incarnation);
        scanned
    }
}

impl ApplyState {
    /// The shards split into `parts` runs (one per applying thread).
    fn ranges(&mut self, parts: usize) -> Vec<ShardRange<'_>> {
        let per_part = self.shards.len().div_ceil(parts);
        let (next_incarnation, chunk_bytes) = (self.next_incarnation, self.chunk_bytes);
        (0_u64..)
            .zip(self.shards.chunks_mut(per_part))
            .map(|(part, shards)| ShardRange {
                first: usize::try_from(part).unwrap_or(0) * per_part,
                shards,
                next_incarnation: next_incarnation + part,
                step: parts as u64,
                chunk_bytes,
            })
            .collect()
    }
}

impl ShardRange<'_> {
    /// Applies, in log order, the checked records of a window that belong to its shards;
    /// returns the position of the first record that contradicts the log, and why.
    fn apply(
        &mut self,
        window: &[u8],
        pending: &[PendingRecord],
        segment: u32,
        segment_version: u32,
    ) -> Result<(), Contradiction> {
        for record in pending {
            let Some(shard) = record
                .shard
                .checked_sub(self.first)
                .and_then(|index| self.shards.get_mut(index))
            else {
                continue;
            };
            let bytes = &window[record.window_start..record.window_start + record.bytes];
            let outcome = format::decode_record(&bytes[RECORD_HEADER_BYTES..])
                .map_err(|reason| Problem::Inconsistent(reason.to_string()))
                .and_then(|decoded| {
                    apply_record(
                        shard,
                        decoded,
                        (segment, record),
                        segment_version,
                        (&mut self.next_incarnation, self.step),
                        self.chunk_bytes,
                    )
                });
            if let Err(Problem::Inconsistent(reason) | Problem::Damaged(reason)) = outcome {
                return Err(Contradiction {
                    position: u64::from(record.position),
                    reason,
                });
            }
        }
        Ok(())
    }
}

/// Applies one checked record to the queues of its shard being rebuilt.
fn apply_record(
    shard: &mut RecoveringMap,
    record: Record<'_>,
    (segment, at): (u32, &PendingRecord),
    segment_version: u32,
    (next_incarnation, step): (&mut u64, u64),
    chunk_bytes: usize,
) -> Result<(), Problem> {
    let (position, record_bytes) = (at.position, at.bytes);
    let mut new_queue = |name: &[u8], trimmed_to: u64| {
        let name: Arc<[u8]> = Arc::from(name);
        let queue = Recovering::new(name.clone(), *next_incarnation, trimmed_to);
        *next_incarnation += step;
        (name, queue)
    };
    // Record bodies are at most 2^30 bytes (checked when scanned), so the size fits in u32.
    let record_bytes = u32::try_from(record_bytes).unwrap_or(u32::MAX);
    match record {
        Record::Chunk(chunk) => {
            let entry = ChunkEntry {
                first_offset: chunk.first_offset,
                segment,
                position,
            };
            if let Some(queue) = shard.get_mut(chunk.name) {
                return queue.add_chunk(&chunk, entry, record_bytes);
            }
            let (name, mut queue) = new_queue(chunk.name, 0);
            queue.add_chunk(&chunk, entry, record_bytes)?;
            shard.insert(name, queue);
        }
        Record::Trim {
            name,
            first_retained_offset,
        } => {
            if let Some(queue) = shard.get_mut(name) {
                queue.trim(first_retained_offset, segment);
                return Ok(());
            }
            let (name, mut queue) = new_queue(name, first_retained_offset);
            queue.trim(first_retained_offset, segment);
            shard.insert(name, queue);
        }
        Record::Delete { name } => {
            shard.remove(name);
        }
        Record::Log(_) if segment_version < 2 => {
            return Err(Problem::Inconsistent(
                "log record in a segment of format version 1".to_string(),
            ));
        }
        // Never queued: handled in `next_record`.
        Record::Floor(_) => {}
        Record::Log(log) => {
            let run = (log.name, log.first_offset, log.count);
            replay_log(shard, &mut new_queue, run, log.messages(), chunk_bytes)?;
        }
        Record::LogBatch(batch) => {
            let hasher = at.mixed.then(crate::store::shard_hasher);
            for run in batch.runs() {
                if hasher.is_some_and(|hasher| crate::store::shard_of(hasher, run.name) != at.shard)
                {
                    continue;
                }
                let messages = run.messages();
                let run = (run.name, run.first_offset, run.count);
                replay_log(shard, &mut new_queue, run, messages, chunk_bytes)?;
            }
        }
    }
    Ok(())
}

/// Replays a log record or log batch run into its queue, created if unknown.
fn replay_log<'a>(
    shard: &mut RecoveringMap,
    new_queue: &mut impl FnMut(&[u8], u64) -> (Arc<[u8]>, Recovering),
    run: (&[u8], u64, u32),
    messages: impl Iterator<Item = &'a [u8]>,
    chunk_bytes: usize,
) -> Result<(), Problem> {
    if let Some(queue) = shard.get_mut(run.0) {
        return queue.add_log(run, messages, chunk_bytes);
    }
    let (name, mut queue) = new_queue(run.0, 0);
    queue.add_log(run, messages, chunk_bytes)?;
    shard.insert(name, queue);
    Ok(())
}
