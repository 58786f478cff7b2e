//! One commit round, in order: take the shard logs into the round buffer, seal the due write
//! buffers after them, write what is left, wait for the writes, fsync, publish, complete the
//! round and collect old segments. Owns what a round took ([`TakenLog`], [`TakenKeys`]), kept
//! to put back if it fails.

use std::io;
use std::sync::atomic::Ordering;

use super::plan::Plan;
use super::seal::{Placed, RunEntry, Seal};
use super::{Committer, now_ms};
use crate::format;
use crate::store::{Listed, QueueKey, RecordEffect, lock};

/// A shard log whose capacity grew past this is given back after the round (bursts must not
/// pin memory in 64 shards).
const SHARD_LOG_CAPACITY_KEPT_MAX: usize = 1 << 20;

/// What a round took from the shard logs.
#[derive(Debug, Default)]
pub(super) struct TakenLog {
    /// Bytes of log, trim and delete records at the start of the round buffer.
    pub(super) bytes: usize,
    /// The trim and delete records' effects, in order, with the segment each went to.
    pub(super) effects: Vec<(RecordEffect, u32)>,
    /// Budget bytes reserved for the log records.
    pub(super) budget_bytes: usize,
}

/// The queues a round took off the shards' direct lists and the buffered list.
#[derive(Debug, Default)]
pub(super) struct TakenKeys {
    pub(super) direct: Vec<QueueKey>,
    pub(super) all: Vec<Listed>,
}

impl Committer<'_> {
    /// Runs one round; false once the store is poisoned.
    pub(super) fn run_round(&mut self, plan: Plan) -> bool {
        let budget_flush = plan.budget_flush;
        let running = self.run_planned_round(plan);
        if budget_flush {
            // Also when the round failed (a successful one cleared it after publishing): an
            // append may ask for a flush again.
            self.inner.flush_soon.store(false, Ordering::SeqCst);
        }
        running
    }

    /// Takes the shard logs, seals the due write buffers and writes the round; a failure
    /// before the fsync goes to `fail_round` (or `fail_published_round`), a round written
    /// whole to `finish_round`.
    fn run_planned_round(&mut self, mut plan: Plan) -> bool {
        self.round_flushed = 0;
        self.round_log_buffered = 0;
        self.round_log.clear();
        self.published = 0;
        // The queues this round took off the pending lists, to put back if it fails.
        let mut taken_keys = TakenKeys {
            direct: Vec::new(),
            all: plan.all.clone(),
        };
        self.refresh_listed(plan.round);
        if self.writer.length >= self.inner.options.segment_bytes_max
            && let Err(error) = self.rotate_with_floor(plan.round, &plan.all)
        {
            return self.fail_round(
                plan.round,
                &error,
                "starting a new segment",
                TakenLog::default(),
                Vec::new(),
                taken_keys,
                false,
            );
        }
        let round_start = self.writer.length;
        let log_segment = self.writer.segment;
        self.note_round_start(plan.round);
        let timestamp_ms = now_ms();
        let mut placed = std::mem::take(&mut self.spare_placed);
        let mut rotated_mid_round = false;
        self.writer.buffer.reset(self.writer.length);
        // Queues are sealed in shard order (see `freeze_run`); a queue's chunks follow its
        // log records, which are already in the round buffer.
        let mut run = std::mem::take(&mut self.spare_run);
        let mut taken = TakenLog::default();
        let mut result = self.take_logs(plan.round, &mut run, &mut rotated_mid_round, &mut taken);
        taken_keys
            .direct
            .extend(run.iter().map(|entry| entry.key.clone()));
        run.extend(
            std::mem::take(&mut plan.all)
                .into_iter()
                .map(|listed| RunEntry {
                    shard_index: self.inner.shard_index(&listed.key.name),
                    seal: Seal::All(listed.since_round),
                    key: listed.key,
                }),
        );
        let mut requeue = Vec::new();
        if result.is_ok() {
            result = self.freeze_run(
                &mut run,
                plan.round,
                timestamp_ms,
                &mut placed,
                &mut taken,
                &mut requeue,
                &mut rotated_mid_round,
            );
        }
        if !requeue.is_empty() {
            lock(&self.inner.pending).buffered.extend(requeue);
        }
        if run.is_empty() {
            // Emptied by `freeze_run` (not when the round failed before it).
            self.spare_run = run;
        }
        if result.is_ok() && !self.writer.buffer.is_empty() {
            result = self.write_round_buffer();
        }
        if result.is_ok() {
            // Writes may still be on their way (direct writes): a failed one fails the round
            // like a failed write, before the fsync.
            result = self.writer.file.finish_writes();
        }
        let result = match (result, self.published.checked_sub(1)) {
            (Err(error), Some(last)) => {
                return self.fail_published_round(
                    plan.round,
                    error,
                    rotated_mid_round,
                    taken.budget_bytes,
                    placed,
                    last,
                    taken_keys,
                );
            }
            (result, _) => result,
        };
        if let Err(error) = result {
            let (failure, doing, fatal) =
                self.cut_failed_round(round_start, error, rotated_mid_round);
            return self.fail_round(
                plan.round, &failure, doing, taken, placed, taken_keys, fatal,
            );
        }
        self.finish_round(
            &plan,
            log_segment,
            rotated_mid_round,
            placed,
            taken,
            taken_keys,
        )
    }

    /// Ends a round whose writes all landed: fsyncs them, publishes the round (only once
    /// durable), counts and completes it, raises the deletion floor after a checkpoint whose
    /// log went to `log_segment`, and collects old segments. False once the store is
    /// poisoned.
    fn finish_round(
        &mut self,
        plan: &Plan,
        log_segment: u32,
        rotated_mid_round: bool,
        placed: Vec<Placed>,
        taken: TakenLog,
        taken_keys: TakenKeys,
    ) -> bool {
        let written = self.round_flushed;
        self.inner
            .counters
            .bytes_written
            .fetch_add(written, Ordering::Relaxed);
        if written > 0 || rotated_mid_round {
            if let Err(error) = self.writer.file.sync() {
                return self.fail_round(
                    plan.round,
                    &error,
                    "fsyncing a segment",
                    TakenLog::default(),
                    Vec::new(),
                    taken_keys,
                    true,
                );
            }
            self.inner
                .counters
                .file_syncs
                .fetch_add(1, Ordering::Relaxed);
        }
        // Whatever the round had to write is durable (with nothing to write, nothing
        // acknowledged waits for the disk): appends may be taken again, and a later round
        // that fails sets the flag again.
        self.inner.disk_full.store(false, Ordering::SeqCst);
        // Published only once durable: under `always` readers see exactly the indexed chunks
        // and the buffered messages of completed rounds, so they never see a message that a
        // crash or a full disk could still take back. Emptied write buffers become spares
        // (see `release_spares`).
        self.spares_kept |= !placed.is_empty();
        self.spare_placed = self.apply(plan.round, placed, taken);
        if plan.is_checkpoint {
            self.inner
                .counters
                .checkpoints
                .fetch_add(1, Ordering::Relaxed);
        }
        if plan.budget_flush {
            self.inner
                .counters
                .budget_flushes
                .fetch_add(1, Ordering::Relaxed);
            // Budget freed: an append may ask for a flush again, without waiting for the
            // garbage collection below (relocation and deletions fsync).
            self.inner.flush_soon.store(false, Ordering::SeqCst);
        }
        self.inner.counters.rounds.fetch_add(1, Ordering::Relaxed);
        self.complete(plan.round, None);
        if plan.is_checkpoint
            && let Some(segment) = self.checkpoint_floor(plan.round, log_segment)
        {
            self.log_floor = self.log_floor.max(segment);
        }
        self.collect_garbage()
    }

    /// Appends every shard's log to the round buffer (writing it early once it passes
    /// `round_write_bytes`) and moves its direct list to `direct`; later appends go to round
    /// `round + 1`. What it took is in `taken`, also when it fails.
    fn take_logs(
        &mut self,
        round: u64,
        direct: &mut Vec<RunEntry>,
        rotated_mid_round: &mut bool,
        taken: &mut TakenLog,
    ) -> io::Result<()> {
        self.inner.log_pending.store(0, Ordering::SeqCst);
        self.inner
            .direct_unwritten_bytes
            .store(0, Ordering::Relaxed);
        for (shard_index, shard) in self.inner.shards.iter().enumerate() {
            let open_log = {
                let mut shard = lock(shard);
                debug_assert!(shard.log_round <= round);
                shard.log_round = round + 1;
                direct.extend(shard.direct.drain(..).map(|key| RunEntry {
                    shard_index,
                    seal: Seal::Round,
                    key,
                }));
                if shard.log.is_empty() && shard.log_budget_bytes == 0 {
                    continue;
                }
                // The open log batch record is sealed in the round buffer, out of the lock.
                let open_log = shard
                    .open_log
                    .take()
                    .map(|open| open.rebased(self.writer.buffer.len()));
                self.writer.buffer.extend_from_slice(&shard.log);
                shard.log.clear();
                if shard.log.capacity() > SHARD_LOG_CAPACITY_KEPT_MAX {
                    shard.log = Vec::new();
                }
                let segment = self.writer.segment;
                taken
                    .effects
                    .extend(shard.log_effects.drain(..).map(|effect| (effect, segment)));
                let budget = std::mem::take(&mut shard.log_budget_bytes);
                self.inner
                    .unwritten_log_bytes
                    .fetch_sub(budget, Ordering::Relaxed);
                taken.budget_bytes += budget;
                open_log
            };
            if let Some(open) = open_log {
                format::seal_log_batch(&mut self.writer.buffer, open);
            }
            self.round_log_buffered = self.writer.buffer.len();
            taken.bytes = self.round_log.len() + self.writer.buffer.len();
            // Rotation fsyncs: never with a shard locked.
            self.overflow_rotate(rotated_mid_round)?;
            if self.writer.buffer.len() >= self.inner.options.round_write_bytes {
                self.write_round_buffer()?;
            }
        }
        Ok(())
    }
}
