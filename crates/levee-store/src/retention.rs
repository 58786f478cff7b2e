//! Retention: [`crate::Store::enforce_retention`] removes the oldest chunks of each queue past
//! its [`Retention`] (age or size), with a trim record per queue trimmed; what it removed is
//! in a [`RetentionReport`].

use crate::error::WriteError;
use crate::format::{self, RECORD_HEADER_BYTES};
use crate::queue::{ChunkEntry, QueueState};
use crate::store::{Inner, QueueKey, RecordEffect, Store, count_by_segment, lock};

/// Retention of one queue: chunks are removed, oldest first, while either bound is passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Retention {
    /// Remove chunks sealed more than this many ms before `now_ms`.
    pub max_age_ms: Option<u64>,
    /// Remove oldest chunks while the queue's chunk records take more than this many bytes.
    pub max_bytes: Option<u64>,
    /// Remove oldest chunks whose messages are all below this offset (their reader is done
    /// with them: a consumer group's committed offset).
    pub before_offset: Option<u64>,
}

/// What one [`Store::enforce_retention`] pass removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RetentionReport {
    /// Queues that lost chunks.
    pub queues_trimmed: u64,
    /// Chunks removed.
    pub chunks_removed: u64,
    /// Messages removed.
    pub messages_removed: u64,
}

impl Store {
    /// Removes, from every queue, the oldest chunks that `retention_for(queue name)` says
    /// are past their age (against `now_ms`, ms since the Unix epoch) or size. It first seals
    /// every write buffer into chunks (like [`Store::sync`]); messages appended meanwhile stay
    /// buffered and are never removed. Durable on return; dead segment files are deleted by
    /// the committer afterwards.
    pub fn enforce_retention(
        &self,
        now_ms: u64,
        retention_for: impl Fn(&[u8]) -> Retention,
    ) -> Result<RetentionReport, WriteError> {
        self.inner.check_writable()?;
        self.sync()?;
        let mut report = RetentionReport::default();
        let mut round = 0;
        let mut bytes = Vec::new();
        let mut effects = Vec::new();
        for shard in &self.inner.shards {
            let mut shard = lock(shard);
            let shard = &mut *shard;
            bytes.clear();
            for state in shard.queues.values_mut() {
                let retention = retention_for(&state.name);
                if retention == Retention::default() {
                    continue;
                }
                if let Some(effect) =
                    self.inner
                        .trim_queue(state, retention, now_ms, &mut report, &mut bytes)
                {
                    effects.push(effect);
                }
            }
            shard.seal_log();
            shard.log.extend_from_slice(&bytes);
            for effect in effects.drain(..) {
                round = self.inner.push_record(shard, effect);
            }
        }
        if round > 0 {
            self.inner.wait_round(round)?;
        }
        Ok(report)
    }
}

impl Store {
    /// Where `queue`'s messages written at or after `timestamp_ms` (ms since the Unix epoch)
    /// start, to within one chunk, never later: the first offset of the oldest retained chunk
    /// sealed at or after it (a chunk is stamped when it is sealed, so it may hold messages
    /// appended before, up to `chunk_bytes` of them), else the first message not yet sealed
    /// (unstamped), else the next offset. `None` if the queue does not exist. Reads one chunk
    /// header per step of a binary search over the queue's chunks.
    pub fn offset_at_time(&self, queue: &[u8], timestamp_ms: u64) -> Result<Option<u64>, String> {
        crate::store::check_name(queue).map_err(|error| error.to_string())?;
        let (chunks, end) = {
            let shard = lock(self.inner.shard(queue));
            let Some(state) = shard.queues.get(queue) else {
                return Ok(None);
            };
            let chunks: Vec<ChunkEntry> = state.chunks.iter().collect();
            (chunks, state.disk_end_offset())
        };
        let (mut low, mut high) = (0, chunks.len());
        while low < high {
            let middle = low + (high - low) / 2;
            let (_, stamped_ms) = self.inner.chunk_header(chunks[middle])?;
            if stamped_ms >= timestamp_ms {
                high = middle;
            } else {
                low = middle + 1;
            }
        }
        Ok(Some(
            chunks.get(low).map_or(end, |chunk| chunk.first_offset),
        ))
    }
}

impl Inner {
    /// Removes the oldest chunks of one queue past `retention`; encodes the trim record into
    /// `bytes` and returns what it does once durable.
    fn trim_queue(
        &self,
        state: &mut QueueState,
        retention: Retention,
        now_ms: u64,
        report: &mut RetentionReport,
        bytes: &mut Vec<u8>,
    ) -> Option<RecordEffect> {
        let mut removed = Vec::new();
        while let Some(front) = state.chunks.front() {
            let over_size = retention
                .max_bytes
                .is_some_and(|max| state.stored_bytes > max);
            let Ok((record_bytes, timestamp_ms)) = self.chunk_header(front) else {
                break;
            };
            let too_old = retention
                .max_age_ms
                .is_some_and(|max_age| timestamp_ms.saturating_add(max_age) < now_ms);
            let done = retention.before_offset.is_some_and(|before| {
                let end = state
                    .chunks
                    .iter()
                    .nth(1)
                    .map_or_else(|| state.disk_end_offset(), |next| next.first_offset);
                end <= before
            });
            if !(over_size || too_old || done) {
                break;
            }
            state.chunks.pop_front();
            state.stored_bytes = state.stored_bytes.saturating_sub(record_bytes);
            removed.push(front);
        }
        if removed.is_empty() {
            return None;
        }
        let old_first = state.first_offset;
        state.first_offset = state
            .chunks
            .front()
            .map_or_else(|| state.disk_end_offset(), |chunk| chunk.first_offset);
        report.queues_trimmed += 1;
        report.chunks_removed += removed.len() as u64;
        report.messages_removed += state.first_offset - old_first;
        format::encode_trim(bytes, &state.name, state.first_offset);
        let key = QueueKey {
            name: state.name.clone(),
            incarnation: state.incarnation,
        };
        Some(RecordEffect {
            dead: count_by_segment(removed.into_iter()),
            trim_of: Some(key),
        })
    }

    /// Record length and timestamp of a chunk, read from its record header.
    fn chunk_header(&self, chunk: ChunkEntry) -> Result<(u64, u64), String> {
        let file = lock(&self.segments)
            .get(&chunk.segment)
            .map(|segment| segment.file.clone())
            .ok_or("segment missing")?;
        let mut header = [0_u8; RECORD_HEADER_BYTES + format::CHUNK_FIXED_BYTES];
        file.read_at(u64::from(chunk.position), &mut header)
            .map_err(|error| error.to_string())?;
        let body_bytes = u64::from(format::read_u32(&header, 4));
        let timestamp_ms = format::read_u64(&header, RECORD_HEADER_BYTES + 16);
        Ok((body_bytes + RECORD_HEADER_BYTES as u64, timestamp_ms))
    }
}
