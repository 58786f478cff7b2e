//! Sealing: turning queues' write buffers into chunk records in the round buffer, in shard
//! order, a shard lock held over many queues. Owns how a queue is sealed ([`Seal`]), the
//! queues to seal ([`RunEntry`]) and the chunks sealed ([`Placed`]), which the round publishes
//! once written.

use std::io;
use std::sync::MutexGuard;
use std::sync::atomic::Ordering;

use super::round::TakenLog;
use super::writer::POSITION_SOFT_MAX;
use super::{Committer, FREEZE_QUEUES_PER_LOCK_MAX};
use crate::format;
use crate::queue::{ChunkEntry, FRAME_BYTES};
use crate::store::{Listed, QueueKey, Shard, lock};

/// How to seal one queue's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Seal {
    /// Everything logged through the round, the last chunk possibly short (the queue came
    /// from a shard's direct list: some of its messages have no log record).
    Round,
    /// Everything logged so far (the queue came from the buffered list: a budget flush or a
    /// checkpoint); its `queued` flag is cleared, or the key goes back on the list if
    /// messages remain. Holds the list entry's `since_round`.
    All(u64),
}

/// A queue to seal.
#[derive(Debug)]
pub(super) struct RunEntry {
    /// Index of the queue's lock shard.
    pub(super) shard_index: usize,
    /// How to seal its buffer.
    pub(super) seal: Seal,
    pub(super) key: QueueKey,
}

/// A chunk a round sealed, applied to the index after the write.
#[derive(Debug)]
pub(super) struct Placed {
    pub(super) key: QueueKey,
    /// Index of the queue's lock shard.
    pub(super) shard: usize,
    pub(super) entry: ChunkEntry,
    pub(super) count: usize,
    /// Bytes of the messages in the queue's write buffer (payload and lengths).
    pub(super) buffered_bytes: usize,
    pub(super) record_bytes: u64,
}

impl Committer<'_> {
    /// Seals the queues of `run` (emptied) in shard order, stable so that a queue's two
    /// entries keep their order: each shard is locked once per [`FREEZE_QUEUES_PER_LOCK_MAX`]
    /// queues instead of once per queue, which matters when many appenders compete for the
    /// shard locks and the CPU. Keys of queues sealed with [`Seal::All`] that keep buffered
    /// messages go to `requeue`.
    #[allow(
        clippy::too_many_arguments,
        reason = "the round's state, passed down from run_planned_round"
    )]
    pub(super) fn freeze_run(
        &mut self,
        run: &mut Vec<RunEntry>,
        round: u64,
        timestamp_ms: u64,
        placed: &mut Vec<Placed>,
        taken: &mut TakenLog,
        requeue: &mut Vec<Listed>,
        rotated_mid_round: &mut bool,
    ) -> io::Result<()> {
        run.sort_by_key(|entry| entry.shard_index);
        let inner = self.inner;
        let mut held: Option<(usize, usize, MutexGuard<'_, Shard>)> = None;
        for RunEntry {
            shard_index,
            seal,
            key,
        } in run.drain(..)
        {
            if self.writer.length + (self.writer.buffer.len() as u64) >= POSITION_SOFT_MAX {
                // Rotation fsyncs: never with a shard locked.
                held = None;
                self.overflow_rotate(rotated_mid_round)?;
            }
            if self.writer.buffer.len() >= self.inner.options.round_write_bytes {
                // A write takes a while: never with a shard locked.
                held = None;
                self.write_round_buffer()?;
                if !*rotated_mid_round {
                    self.publish_written(round, placed, taken);
                }
            }
            let reuse = held.as_ref().is_some_and(|(index, frozen, _)| {
                *index == shard_index && *frozen < FREEZE_QUEUES_PER_LOCK_MAX
            });
            if !reuse {
                // One shard lock at a time: release the previous one first.
                drop(held.take());
                held = Some((shard_index, 0, lock(&inner.shards[shard_index])));
            }
            // Invariant: `held` was set just above.
            let (_, frozen, shard) = held.as_mut().expect("shard locked above");
            *frozen += 1;
            if let Some(since_round) =
                self.freeze(shard, shard_index, &key, seal, round, timestamp_ms, placed)
            {
                requeue.push(Listed { key, since_round });
            }
        }
        Ok(())
    }

    /// Seals the unfrozen messages of one queue that are logged in round `round` or earlier
    /// into chunk records in the round buffer: whole chunks of `chunk_bytes`, then the rest.
    /// Returns the `since_round` with which the key must go back on the buffered list, if it
    /// must.
    #[allow(
        clippy::too_many_arguments,
        reason = "the round's context, passed down from freeze_run"
    )]
    fn freeze(
        &mut self,
        shard: &mut Shard,
        shard_index: usize,
        key: &QueueKey,
        seal: Seal,
        round: u64,
        timestamp_ms: u64,
        placed: &mut Vec<Placed>,
    ) -> Option<u64> {
        let chunk_bytes = self.inner.options.chunk_bytes;
        let Some(state) = shard
            .queues
            .get_mut(&*key.name)
            .filter(|state| state.incarnation == key.incarnation)
        else {
            // Deleted: its delete record may be in the next round's log (the delete came after
            // this round took that shard's log), and the floor must count the entry till then.
            if let Seal::All(since_round) = seal {
                let listed = Listed {
                    key: key.clone(),
                    since_round,
                };
                self.gone.push((listed, round + 1));
            }
            return None;
        };
        if matches!(seal, Seal::All(_)) {
            state.queued = false;
        }
        let buffer = state.buffer.as_mut()?;
        let logged_end = buffer.logged_through(round);
        let sealable = usize::try_from(logged_end - buffer.first_offset)
            .unwrap_or(usize::MAX)
            .min(buffer.count);
        let mut index = buffer.frozen;
        let mut byte_start = buffer.frozen_bytes;
        while index < sealable {
            // Messages index..end, framed in data[byte_start..byte_end], payload bytes in all.
            let mut end = index;
            let mut byte_end = byte_start;
            let mut payload = 0;
            let mut whole = false;
            while end < sealable {
                let length = buffer.length_at(byte_end);
                if end > index && payload + length > chunk_bytes {
                    whole = true;
                    break;
                }
                payload += length;
                byte_end += FRAME_BYTES + length;
                end += 1;
            }
            whole |= payload >= chunk_bytes;
            debug_assert!(whole || end == sealable);
            let position = self.writer.position();
            let before = self.writer.buffer.len();
            let first_offset = buffer.first_offset + index as u64;
            // Room first: the encoder appends to the buffer's `Vec`, which must not move.
            self.writer.buffer.reserve(format::chunk_record_bytes(
                key.name.len(),
                end - index,
                payload,
            ));
            format::encode_chunk_framed(
                self.writer.buffer.vec_mut(),
                &key.name,
                first_offset,
                timestamp_ms,
                end - index,
                payload,
                &buffer.bytes()[byte_start..byte_end],
            );
            let entry = ChunkEntry {
                first_offset,
                segment: self.writer.segment,
                position,
            };
            placed.push(Placed {
                key: key.clone(),
                shard: shard_index,
                entry,
                count: end - index,
                buffered_bytes: byte_end - byte_start,
                record_bytes: (self.writer.buffer.len() - before) as u64,
            });
            index = end;
            byte_start = byte_end;
        }
        buffer.frozen = index;
        buffer.frozen_bytes = byte_start;
        if let Seal::All(since_round) = seal
            && buffer.count > buffer.frozen
        {
            // Messages of a later round stay buffered: keep the queue on the buffered list.
            // Their marks say they were logged after this round, which holds unless marks
            // were merged.
            state.queued = true;
            return Some(if buffer.marks_merged {
                since_round
            } else {
                round + 1
            });
        }
        if state.direct_round < shard.log_round && buffer.unfrozen_payload_bytes() >= chunk_bytes {
            // A whole chunk is still due (its messages were logged in the next round): the
            // next round seals it, and the queue's appends in it need no log record.
            state.direct_round = shard.log_round;
            shard.direct.push(key.clone());
            self.inner.log_pending.fetch_add(1, Ordering::SeqCst);
        }
        None
    }
}
