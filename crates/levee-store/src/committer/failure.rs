//! A failed round. A full disk is retried: the segment is cut back to where the round started
//! (or to its last published chunk), the round's log records, direct queues and buffered-list
//! entries are put back, and under `always` the round and the next fail as a whole. Anything
//! else poisons the store: it refuses writes rather than risk corruption.

use std::io;
use std::sync::atomic::Ordering;

use super::round::{TakenKeys, TakenLog};
use super::seal::Placed;
use super::{Committer, is_no_space};
use crate::error::WriteError;
use crate::format::{self, RECORD_HEADER_BYTES};
use crate::queue::NO_SEGMENT;
use crate::store::{Listed, QueueKey, RecordEffect, SHARD_COUNT, Shard, lock};

impl Committer<'_> {
    /// Handles a failed round. A full disk (before any mid-round rotation) is recoverable: the
    /// round's bytes were truncated away. Anything else poisons the store.
    #[allow(
        clippy::too_many_arguments,
        reason = "everything the failed round took, put back by policy below"
    )]
    pub(super) fn fail_round(
        &mut self,
        round: u64,
        error: &io::Error,
        operation: &str,
        taken: TakenLog,
        placed: Vec<Placed>,
        taken_keys: TakenKeys,
        fatal: bool,
    ) -> bool {
        if fatal || !is_no_space(error) {
            return self.poison(format!(
                "{operation} in segment {}: {error}",
                self.writer.segment
            ));
        }
        let failure = WriteError::StorageFull {
            operation: operation.to_string(),
        };
        self.backing_off = true;
        // The round's delete records go back into the logs for the next round that writes
        // (under `always` the one after next: both fail): the floor counts the deleted queues'
        // entries until it completes.
        let next = if self.interval().is_some() {
            round + 1
        } else {
            round + 2
        };
        for (_, until) in &mut self.gone {
            *until = (*until).max(next);
        }
        let round_bytes = std::mem::take(&mut self.writer.buffer);
        // The round's log records: those written (and truncated away with the rest of the
        // round) were kept aside, the others are still at the start of its buffer.
        let mut round_log = std::mem::take(&mut self.round_log);
        round_log.extend_from_slice(&round_bytes[..self.round_log_buffered]);
        self.round_log_buffered = 0;
        if self.interval().is_some() {
            self.requeue_failed_round(round, taken, &round_log, placed, taken_keys);
            self.writer.buffer = round_bytes;
            self.complete(round, Some(failure));
        } else {
            self.drop_failed_rounds(round, taken, &round_log, taken_keys.all);
            self.writer.buffer = round_bytes;
            self.complete(round, Some(failure.clone()));
            self.complete(round + 1, Some(failure));
        }
        true
    }

    /// Under `interval`, puts back everything failed round `round` took, to be retried: its
    /// messages are acknowledged, so they stay buffered (unfrozen), their log records
    /// (`log_bytes`, with `taken`) go back in the shard logs, its direct queues and the
    /// queues it took off the buffered list are listed again, and appends are refused until
    /// a round succeeds (`disk_full`).
    fn requeue_failed_round(
        &mut self,
        round: u64,
        taken: TakenLog,
        log_bytes: &[u8],
        placed: Vec<Placed>,
        taken_keys: TakenKeys,
    ) {
        let mut unfreeze: Vec<QueueKey> = placed.into_iter().map(|chunk| chunk.key).collect();
        unfreeze.extend(taken_keys.all.iter().map(|listed| listed.key.clone()));
        let sealed_keys = taken_keys.all;
        // Messages of the direct queues have no log record to put back: list the queues
        // again, so that the next round seals them.
        for key in taken_keys.direct {
            let mut guard = lock(self.inner.shard(&key.name));
            let shard = &mut *guard;
            if let Some(state) = shard.queues.get_mut(&*key.name)
                && state.incarnation == key.incarnation
                && state.direct_round < shard.log_round
            {
                state.direct_round = shard.log_round;
                shard.direct.push(key);
                self.inner.log_pending.fetch_add(1, Ordering::SeqCst);
            }
        }
        // Acknowledged messages must not be dropped: keep them buffered, put their log
        // records back, and retry.
        for key in &unfreeze {
            let mut shard = lock(self.inner.shard(&key.name));
            if let Some(state) = shard.queues.get_mut(&*key.name)
                && let Some(buffer) = state.buffer.as_mut()
            {
                buffer.frozen = 0;
                buffer.frozen_bytes = 0;
                // Unknown again: an earlier part of the queue may have been published
                // this round (see `publish_written`), which raised it past the messages
                // still buffered.
                state.unsealed_since = 0;
            }
        }
        self.requeue_log(&mut lock(&self.inner.shards[0]), taken, log_bytes, true);
        // Lock order shard -> pending: flag the queues first, then list them.
        let mut relisted = Vec::new();
        for listed in sealed_keys.into_iter().rev() {
            let key = &listed.key;
            let inner = self.inner;
            let mut shard = lock(inner.shard(&key.name));
            match shard
                .queues
                .get_mut(&*key.name)
                .filter(|state| state.incarnation == key.incarnation)
            {
                // Taken off the buffered list by this round (sealed or not): list it again
                // (at worst twice, which only costs a look), with its `since_round`.
                Some(state) if state.buffer.is_some() => {
                    state.queued = true;
                    drop(shard);
                    relisted.push(listed);
                }
                // Nothing buffered: unlisted, so its next append lists it again.
                Some(state) => state.queued = false,
                // Deleted: the floor counts it until its delete record is rewritten.
                None => {
                    drop(shard);
                    self.gone.push((listed, round + 1));
                }
            }
        }
        let mut pending = lock(&self.inner.pending);
        for key in relisted {
            pending.buffered.push_front(key);
        }
        self.inner.disk_full.store(true, Ordering::SeqCst);
        drop(pending);
    }

    /// Under `always`, fails round `round` and the next as a whole: drops their messages
    /// from the write buffers (none is acknowledged yet) and keeps only the trim and delete
    /// records of their logs (`log_bytes`, with `taken`); `sealed_keys`, the queues the round
    /// took off the buffered list, are listed again.
    fn drop_failed_rounds(
        &mut self,
        round: u64,
        taken: TakenLog,
        log_bytes: &[u8],
        sealed_keys: Vec<Listed>,
    ) {
        // Under `always` no message of this round or the next is acknowledged yet: drop them
        // all and fail every waiter of both. Holding every shard lock means no append is half
        // done.
        let mut shards: Vec<_> = self.inner.shards.iter().map(|shard| lock(shard)).collect();
        let mut pending = lock(&self.inner.pending);
        let mut dropped_bytes = 0;
        for shard in &mut shards {
            let shard = &mut **shard;
            shard.queues.retain(|_, state| {
                if let Some(buffer) = state.buffer.as_mut() {
                    buffer.frozen = 0;
                    buffer.frozen_bytes = 0;
                    let keep = buffer.logged_through(round - 1);
                    dropped_bytes += buffer.truncate_to(keep);
                    state.next_offset = buffer.end_offset();
                    if buffer.count == 0 {
                        state.buffer = None;
                    }
                }
                !(state.next_offset == 0 && state.trim_segment == NO_SEGMENT)
            });
            // The next round's log: keep only its trim and delete records.
            shard.seal_log();
            let log = std::mem::take(&mut shard.log);
            let effects = std::mem::take(&mut shard.log_effects);
            let budget = std::mem::take(&mut shard.log_budget_bytes);
            self.inner
                .unwritten_log_bytes
                .fetch_sub(budget, Ordering::Relaxed);
            let mut pending_taken = TakenLog {
                bytes: log.len(),
                effects: effects.into_iter().map(|effect| (effect, 0)).collect(),
                budget_bytes: budget,
            };
            let mut only_records = Shard::default();
            self.requeue_log(
                &mut only_records,
                std::mem::take(&mut pending_taken),
                &log,
                false,
            );
            shard.log = only_records.log;
            shard.log_effects = only_records.log_effects;
            shard.log_budget_bytes = only_records.log_budget_bytes;
            // Rounds `round` and `round + 1` fail as a whole: later appends go to the next.
            shard.log_round = round + 2;
        }
        self.requeue_log(&mut shards[0], taken, log_bytes, false);
        self.inner
            .buffered_bytes
            .fetch_sub(dropped_bytes, Ordering::SeqCst);
        debug_assert_eq!(shards.len(), SHARD_COUNT);
        for listed in sealed_keys {
            let key = &listed.key;
            let index = self.inner.shard_index(&key.name);
            match shards[index]
                .queues
                .get_mut(&*key.name)
                .filter(|state| state.incarnation == key.incarnation)
            {
                Some(state) if state.buffer.is_some() => {
                    state.queued = true;
                    pending.buffered.push_front(listed);
                }
                // As under `interval`; the delete record goes out in `round + 2`.
                Some(state) => state.queued = false,
                None => self.gone.push((listed, round + 2)),
            }
        }
        for shard in &mut shards {
            // The direct queues' messages of both rounds were dropped above.
            shard.direct.clear();
            for state in shard.queues.values_mut() {
                state.direct_round = 0;
            }
        }
        // Appenders that buffered before now wait for `round` or `round + 1`: fail both.
        self.inner.rounds_started.store(round + 1, Ordering::SeqCst);
        drop(pending);
        drop(shards);
    }

    /// Fails round `round` after some of its chunks (`placed` up to `last`) were published
    /// (see `publish_written`): those were written, after its log records (whose effects are
    /// applied), so the round stands up to its last published chunk and the rest is cut off
    /// and retried as a failed round's. Fatal where it cannot be cut off.
    #[allow(
        clippy::too_many_arguments,
        reason = "the round's state, passed on to fail_round"
    )]
    pub(super) fn fail_published_round(
        &mut self,
        round: u64,
        error: io::Error,
        rotated_mid_round: bool,
        log_budget_bytes: usize,
        mut placed: Vec<Placed>,
        last: usize,
        taken_keys: TakenKeys,
    ) -> bool {
        let cut = u64::from(placed[last].entry.position) + placed[last].record_bytes;
        let (failure, doing, fatal) = self.cut_failed_round(cut, error, rotated_mid_round);
        // The log records stay written: only their budget is left to free.
        self.inner
            .buffered_bytes
            .fetch_sub(log_budget_bytes, Ordering::SeqCst);
        self.round_log.clear();
        self.round_log_buffered = 0;
        let unpublished = placed.split_off(last + 1);
        self.fail_round(
            round,
            &failure,
            doing,
            TakenLog::default(),
            unpublished,
            taken_keys,
            fatal,
        )
    }

    /// Cuts the active segment back to `cut` after a round's write failed with `error`:
    /// the failure to report, what failed and whether it is fatal (the round rotated mid-way
    /// or its partial write cannot be cut off; otherwise a full disk is retried).
    pub(super) fn cut_failed_round(
        &mut self,
        cut: u64,
        error: io::Error,
        rotated_mid_round: bool,
    ) -> (io::Error, &'static str, bool) {
        if rotated_mid_round {
            (error, "writing a commit round", true)
        } else if let Err(truncate_error) = self.writer.file.truncate(cut) {
            (truncate_error, "truncating", true)
        } else {
            self.writer.length = cut;
            (error, "writing a commit round", false)
        }
    }

    /// Puts the trim and delete records of a failed round back at the front of shard 0's
    /// log (with their effects), so they are retried before anything appended later; under
    /// `interval` the log records of messages too (they are acknowledged).
    fn requeue_log(&self, shard: &mut Shard, taken: TakenLog, round_bytes: &[u8], keep_all: bool) {
        let mut kept = Vec::new();
        let mut position = 0;
        while position < taken.bytes {
            let body =
                usize::try_from(format::read_u32(round_bytes, position + 4)).unwrap_or(usize::MAX);
            let end = position + RECORD_HEADER_BYTES + body;
            let record = &round_bytes[position..end];
            if keep_all || format::is_trim_or_delete(format::record_kind(record)) {
                kept.extend_from_slice(record);
            }
            position = end;
        }
        let requeued = !kept.is_empty() || !taken.effects.is_empty();
        // Appends made since keep going to a record of their own, after the kept ones.
        shard.seal_log();
        kept.extend_from_slice(&shard.log);
        shard.log = kept;
        let mut effects: Vec<RecordEffect> = taken
            .effects
            .into_iter()
            .map(|(effect, _)| effect)
            .collect();
        effects.append(&mut shard.log_effects);
        shard.log_effects = effects;
        shard.log_budget_bytes += taken.budget_bytes;
        self.inner
            .unwritten_log_bytes
            .fetch_add(taken.budget_bytes, Ordering::Relaxed);
        if requeued {
            self.inner.log_pending.fetch_add(1, Ordering::SeqCst);
        }
    }

    pub(super) fn poison(&self, reason: String) -> bool {
        let mut commit = lock(&self.inner.commit);
        commit.poisoned = Some(reason);
        self.inner.poisoned.store(true, Ordering::Release);
        self.inner.committed.notify_all();
        false
    }
}
