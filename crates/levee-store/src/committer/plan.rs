//! Choosing what a round writes: the committer sleeps until there is work (appended log
//! records, a wanted round, a checkpoint or budget flush request, a retry after a full disk)
//! and takes it as a [`Plan`]: the round's number and the buffered queues it seals whole (all
//! of them at a checkpoint, the oldest share for a budget flush). An idle committer also
//! frees the shards' spare write buffers.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Committer;
use crate::store::{Listed, lock};

/// A budget flush seals this fraction (1 / divisor) of the buffered queues, the oldest: a
/// small fraction keeps the buffers near the budget, so chunks are larger (about
/// `(2 - 1/divisor)` times the average buffer instead of 1.5 times with halves).
const BUDGET_FLUSH_DIVISOR: usize = 8;
/// A budget flush seals nothing from the buffered list while the shard logs not yet written
/// hold at least this fraction (1 / divisor) of the budget: writing them frees enough.
const BUDGET_LOG_SHARE_DIVISOR: usize = 4;

/// Under `always`, the committer looks for work at least this often even without a wake-up.
const ALWAYS_IDLE_WAIT: Duration = Duration::from_millis(50);
/// With nothing appended for this long, the shards' spare write buffers are freed (see
/// `SpareBuffers`): they serve queues appended to round after round, and an idle store
/// should give their memory back.
const SPARE_RELEASE_IDLE: Duration = Duration::from_millis(200);

pub(super) struct Plan {
    pub(super) round: u64,
    /// Queues taken from the buffered list (budget flush or checkpoint).
    pub(super) all: Vec<Listed>,
    pub(super) is_checkpoint: bool,
    /// The round answers a budget flush request (see `Inner::flush_soon`).
    pub(super) budget_flush: bool,
    pub(super) shutdown: bool,
}

impl Committer<'_> {
    /// Sleeps until there is work and takes it.
    pub(super) fn next_plan(&mut self) -> Plan {
        let inner = self.inner;
        let mut pending = lock(&inner.pending);
        loop {
            // Read each time: `Store::set_sync_policy` may change it (and wakes us).
            let interval = super::interval_of(inner.sync());
            // Set before looking for work, so an appender that publishes work after the look
            // sees the flag and wakes us (see `Inner::wake_committer`).
            inner.committer_sleeping.store(true, Ordering::SeqCst);
            let log_work = inner.log_pending.load(Ordering::SeqCst) > 0;
            // Under `interval` a round that failed on a full disk is retried every interval,
            // even with nothing logged (a failed checkpoint or budget flush), so appends,
            // refused meanwhile, resume once space returns.
            let retry = inner.disk_full.load(Ordering::SeqCst);
            let due = match interval {
                None => log_work,
                Some(interval) => (log_work || retry) && self.last_round.elapsed() >= interval,
            };
            let is_checkpoint =
                pending.shutdown || pending.checkpoint_requested || self.checkpoint_wanted;
            let wanted = inner.wanted_round.load(Ordering::SeqCst)
                > inner.rounds_started.load(Ordering::SeqCst);
            if due || is_checkpoint || wanted || pending.budget_flush_requested {
                self.round_interval = interval;
                self.idle_since = None;
                inner.committer_sleeping.store(false, Ordering::SeqCst);
                let round = inner.rounds_started.fetch_add(1, Ordering::SeqCst) + 1;
                let all: Vec<Listed> = if is_checkpoint {
                    pending.buffered.drain(..).collect()
                } else if pending.budget_flush_requested
                    && inner.unwritten_log_bytes.load(Ordering::Relaxed)
                        < inner.options.buffer_budget_bytes / BUDGET_LOG_SHARE_DIVISOR
                {
                    // The budget is (nearly) full of write buffers: seal the older part of
                    // the buffered queues (write buffers stay after their round, so only
                    // sealing frees their bytes). When the shard logs hold a large share
                    // instead, the round frees them by writing them and seals nothing more:
                    // buffers left to grow make larger chunks, so a smaller index.
                    let older = pending.buffered.len().div_ceil(BUDGET_FLUSH_DIVISOR);
                    pending.buffered.drain(..older).collect()
                } else {
                    Vec::new()
                };
                let budget_flush = std::mem::take(&mut pending.budget_flush_requested);
                pending.checkpoint_requested = false;
                self.checkpoint_wanted = false;
                return Plan {
                    round,
                    all,
                    is_checkpoint,
                    budget_flush,
                    shutdown: pending.shutdown,
                };
            }
            if !log_work && !retry {
                let idle_since = *self.idle_since.get_or_insert_with(Instant::now);
                if self.spares_kept && idle_since.elapsed() >= SPARE_RELEASE_IDLE {
                    // Shard locks come before the pending lock: release it meanwhile.
                    drop(pending);
                    self.release_spares();
                    pending = lock(&inner.pending);
                    continue;
                }
            }
            if interval.is_some() && !log_work {
                // Between rounds with nothing appended: nothing acknowledged is unwritten.
                inner
                    .durable_through_ms
                    .fetch_max(inner.elapsed_ms(), Ordering::Release);
            }
            let wait = match interval {
                None => ALWAYS_IDLE_WAIT,
                Some(interval) if log_work => interval
                    .saturating_sub(self.last_round.elapsed())
                    .max(Duration::from_millis(1)),
                Some(interval) => interval,
            };
            pending = inner
                .work
                .wait_timeout(pending, wait)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }

    /// Frees every shard's spare write buffers.
    fn release_spares(&mut self) {
        self.spares_kept = false;
        for shard in &self.inner.shards {
            let spares = std::mem::take(&mut lock(shard).spare);
            // Freed out of the lock.
            drop(spares);
        }
    }
}
