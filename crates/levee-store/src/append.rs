//! Appending: [`crate::Store::append`] and its batch and deferred forms. An append checks its
//! input, waits while rounds run late (under `interval`), reserves room in the buffer budget
//! (asking for a budget flush when it fills), puts the message in its queue's write buffer
//! and its log record in the shard's log, all of a batch's messages of one shard under one
//! lock; [`CommitTicket`] names the round that makes it durable.

use std::sync::Arc;
use std::sync::PoisonError;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::error::{InputError, WriteError};
use crate::format;
use crate::options::SyncPolicy;
use crate::queue::QueueState;
use crate::store::{Inner, Listed, QueueKey, QueueMap, SHARD_COUNT, Store, check_name, lock};

/// Under `interval`, appends wait while the last completed full round started more than this
/// many intervals ago: when rounds take longer than the interval (the committer is short of
/// CPU), appenders slow down instead of the interval promise silently slipping.
pub(crate) const INTERVAL_LATE_FACTOR: u64 = 2;
/// Most messages of a batch append buffered under one shard lock.
const BATCH_RUN_MESSAGES_MAX: usize = 256;
/// Most budget bytes a batch append reserves at once (a single larger message excepted; and
/// at most an eighth of the budget), so one reservation stays far below the budget.
const BATCH_RUN_BYTES_MAX: usize = 64 << 10;
/// Past this fraction of the budget (numerator, denominator), an append asks for a budget
/// flush without waiting, so the committer seals while appenders go on instead of after they
/// have all stopped at a full budget.
pub(crate) const BUDGET_SOFT_FRACTION: (usize, usize) = (7, 8);
/// Under `interval`, once the messages waiting to be sealed as chunks by the next round (those
/// of queues on a direct list) reach this fraction (1 / divisor) of the budget, an append asks
/// for that round at once instead of at the end of the interval. Without it, large messages
/// filled the whole budget between two rounds and then waited while one round wrote it all:
/// the appenders and the disk took turns instead of working at once.
const DIRECT_ROUND_DIVISOR: usize = 16;
/// Budget bytes a buffered message costs beyond its payload (its length field).
pub(crate) const MESSAGE_OVERHEAD_BYTES: usize = crate::queue::FRAME_BYTES;

/// Returned by deferred appends: the commit round that makes them durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct CommitTicket {
    round: u64,
}

impl Store {
    /// Appends `message` to `queue` (created on first append) and returns its offset. Under
    /// [`SyncPolicy::Always`] it returns after the message is fsynced.
    pub fn append(&self, queue: &[u8], message: &[u8]) -> Result<u64, WriteError> {
        let (offset, ticket) = self.append_deferred(queue, message)?;
        if self.inner.sync() == SyncPolicy::Always {
            self.inner.wait_round(ticket.round)?;
        }
        Ok(offset)
    }

    /// Appends many messages, to any queues, and returns their offsets in the same order.
    /// Messages of one queue keep their order. Inputs are all checked first; a later failure
    /// (full disk, poisoned store) may leave part of the batch stored (the messages are
    /// buffered grouped by lock shard, not in batch order).
    pub fn append_batch(&self, batch: &[(&[u8], &[u8])]) -> Result<Vec<u64>, WriteError> {
        let (offsets, ticket) = self.append_batch_deferred(batch)?;
        if self.inner.sync() == SyncPolicy::Always && !batch.is_empty() {
            self.inner.wait_round(ticket.round)?;
        }
        Ok(offsets)
    }

    /// Like [`Store::append`] but never waits for the fsync: the message is readable at once
    /// and durable once [`Store::wait_durable`] returns `Ok` for the ticket. Lets one thread
    /// keep many appends in flight (a server acknowledging asynchronously, a pipelined load
    /// tool); an error from `wait_durable` means the append may not be stored. Tickets are
    /// ordered but a later append may get an earlier one (a round takes the shard logs one
    /// by one, so an append to a shard it has not reached yet joins it): to cover many
    /// appends, wait on the highest of their tickets, not the last.
    pub fn append_deferred(
        &self,
        queue: &[u8],
        message: &[u8],
    ) -> Result<(u64, CommitTicket), WriteError> {
        self.check_input(queue, message)?;
        let (offset, round) = self.inner.buffer_message(queue, message)?;
        Ok((offset, CommitTicket { round }))
    }

    /// [`Store::append_batch`] without waiting for the fsync; see [`Store::append_deferred`].
    pub fn append_batch_deferred(
        &self,
        batch: &[(&[u8], &[u8])],
    ) -> Result<(Vec<u64>, CommitTicket), WriteError> {
        for (queue, message) in batch {
            self.check_input(queue, message)?;
        }
        let mut offsets = vec![0; batch.len()];
        let round = self.inner.buffer_batch(batch, &mut offsets)?;
        Ok((offsets, CommitTicket { round }))
    }

    /// Blocks until the appends behind `ticket` are fsynced (rounds complete in order, so
    /// every earlier successful round is durable too). Under [`SyncPolicy::Interval`] this
    /// starts the round at once instead of at the next interval. A full disk fails whole
    /// rounds: a caller that pipelines must wait on each ticket it holds to learn each
    /// outcome, since a later ticket can succeed after an earlier one failed.
    pub fn wait_durable(&self, ticket: CommitTicket) -> Result<(), WriteError> {
        self.inner.wait_round(ticket.round)
    }

    /// Whether the appends `ticket` covers are durable already (never waits, and never
    /// starts a round: under [`SyncPolicy::Interval`] they become durable at the next one);
    /// the round's error if it failed.
    pub fn is_durable(&self, ticket: CommitTicket) -> Result<bool, WriteError> {
        self.inner.round_done(ticket.round)
    }

    /// Whether an append now would wait for the committer (under `interval`, while its
    /// rounds are more than [`INTERVAL_LATE_FACTOR`] intervals behind: the back-pressure of
    /// [`Store::append_deferred`]); never waits itself. A caller that must not block (an
    /// async task) hands its append to a blocking thread then.
    #[must_use]
    pub fn is_late(&self) -> bool {
        self.inner.is_late()
    }

    fn check_input(&self, queue: &[u8], message: &[u8]) -> Result<(), InputError> {
        check_name(queue)?;
        let max = self.inner.options.message_bytes_max;
        if message.len() > max {
            return Err(InputError::MessageTooLarge {
                length: message.len(),
                max,
            });
        }
        Ok(())
    }
}

impl Inner {
    /// Asks the committer for a budget flush, once per round: a flush already asked for
    /// (early, or by another append) frees bytes when it completes, and a second one queued
    /// behind it would seal more buffers than needed, so smaller chunks.
    fn request_budget_flush(&self) {
        if !self.flush_soon.swap(true, Ordering::SeqCst) {
            lock(&self.pending).budget_flush_requested = true;
            self.work.notify_one();
        }
    }

    /// Waits, while the budget is exhausted, until `bytes` more fit.
    fn reserve_budget(&self, bytes: usize) -> Result<(), WriteError> {
        let budget = self.options.buffer_budget_bytes;
        // A round that fails after we start waiting (a full disk) fails this append too:
        // write buffers hold their bytes until sealed, so waiting could last forever.
        let first_round = self.rounds_started.load(Ordering::SeqCst) + 1;
        loop {
            let before = self.buffered_bytes.fetch_add(bytes, Ordering::SeqCst);
            if before == 0 || before + bytes <= budget {
                let (numerator, denominator) = BUDGET_SOFT_FRACTION;
                if before + bytes > budget / denominator * numerator {
                    self.request_budget_flush();
                }
                return Ok(());
            }
            self.buffered_bytes.fetch_sub(bytes, Ordering::SeqCst);
            // Under a full disk the budget frees only once space returns: fail fast instead.
            self.check_writable()?;
            self.request_budget_flush();
            let commit = lock(&self.commit);
            if let Some(reason) = &commit.poisoned {
                return Err(WriteError::Poisoned(reason.clone()));
            }
            if let Some((_, error)) = commit
                .failures
                .iter()
                .rev()
                .find(|(round, _)| *round >= first_round)
            {
                return Err(error.clone());
            }
            let _wait = self
                .committed
                .wait_timeout(commit, Duration::from_millis(10))
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// See [`Store::is_late`].
    fn is_late(&self) -> bool {
        let SyncPolicy::Interval { interval_ms } = self.sync() else {
            return false;
        };
        let behind_ms = self
            .elapsed_ms()
            .saturating_sub(self.durable_through_ms.load(Ordering::Acquire));
        behind_ms > interval_ms.saturating_mul(INTERVAL_LATE_FACTOR)
    }

    /// Under `interval`, waits while the committer is more than [`INTERVAL_LATE_FACTOR`]
    /// intervals behind (back-pressure that keeps "fsynced within the interval" close to
    /// true under overload); fails fast on a full disk or a poisoned store.
    fn wait_for_late_rounds(&self) -> Result<(), WriteError> {
        let SyncPolicy::Interval { interval_ms } = self.sync() else {
            return Ok(());
        };
        let late_ms = interval_ms.saturating_mul(INTERVAL_LATE_FACTOR);
        let mut waited = false;
        loop {
            let behind_ms = self
                .elapsed_ms()
                .saturating_sub(self.durable_through_ms.load(Ordering::Acquire));
            if behind_ms <= late_ms {
                return Ok(());
            }
            self.check_writable()?;
            let commit = lock(&self.commit);
            if let Some(reason) = &commit.poisoned {
                return Err(WriteError::Poisoned(reason.clone()));
            }
            if !waited {
                waited = true;
                self.counters
                    .late_round_waits
                    .fetch_add(1, Ordering::Relaxed);
            }
            let _wait = self
                .committed
                .wait_timeout(commit, Duration::from_millis(10))
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Puts one message into its queue's buffer; returns its offset and the commit round
    /// that will make it durable.
    fn buffer_message(&self, queue: &[u8], message: &[u8]) -> Result<(u64, u64), WriteError> {
        self.wait_for_late_rounds()?;
        let mut offset = [0];
        let run = [(self.shard_index(queue), 0)];
        let round = self.buffer_run(&[(queue, message)], &run, &mut offset, &mut Vec::new())?;
        Ok((offset[0], round))
    }

    /// Buffers a batch: messages are grouped by shard (a stable sort, so a queue's messages
    /// keep their order) and each group is buffered under one lock of its shard and one budget
    /// reservation, in runs of at most [`BATCH_RUN_MESSAGES_MAX`] messages and
    /// [`BATCH_RUN_BYTES_MAX`] bytes. Writes the offsets (in batch order) into `offsets` and
    /// returns the commit round that makes every message durable.
    fn buffer_batch(
        &self,
        batch: &[(&[u8], &[u8])],
        offsets: &mut [u64],
    ) -> Result<u64, WriteError> {
        self.wait_for_late_rounds()?;
        let run_bytes_max = BATCH_RUN_BYTES_MAX.min(self.options.buffer_budget_bytes / 8);
        // A counting sort by shard: stable, so a queue's messages keep their order.
        let shards: Vec<usize> = batch
            .iter()
            .map(|(queue, _)| self.shard_index(queue))
            .collect();
        let mut next_slot = [0_usize; SHARD_COUNT];
        for &shard_index in &shards {
            next_slot[shard_index] += 1;
        }
        let mut slot = 0;
        for count in &mut next_slot {
            (*count, slot) = (slot, slot + *count);
        }
        let mut order = vec![(0, 0); batch.len()];
        for (index, &shard_index) in shards.iter().enumerate() {
            order[next_slot[shard_index]] = (shard_index, index);
            next_slot[shard_index] += 1;
        }
        let mut wakes = Vec::new();
        let mut round = 0;
        let mut start = 0;
        while start < order.len() {
            let shard_index = order[start].0;
            let mut end = start;
            let mut cost = 0;
            while end < order.len()
                && order[end].0 == shard_index
                && end - start < BATCH_RUN_MESSAGES_MAX
            {
                let message_cost = batch[order[end].1].1.len() + MESSAGE_OVERHEAD_BYTES;
                if end > start && cost + message_cost > run_bytes_max {
                    break;
                }
                cost += message_cost;
                end += 1;
            }
            let run_round = self.buffer_run(batch, &order[start..end], offsets, &mut wakes)?;
            round = round.max(run_round);
            start = end;
        }
        Ok(round)
    }

    /// Buffers the messages `run` (pairs of shard index and index into `batch`, all of one
    /// shard) under one lock of that shard, and encodes their log records into the shard's
    /// log (one record per run of consecutive messages to one queue); returns the commit round
    /// that makes them durable. `wakes` is scratch space, reused between runs.
    fn buffer_run(
        &self,
        batch: &[(&[u8], &[u8])],
        run: &[(usize, usize)],
        offsets: &mut [u64],
        wakes: &mut Vec<QueueKey>,
    ) -> Result<u64, WriteError> {
        self.check_writable()?;
        let log_cost: usize = run
            .iter()
            .map(|(_, index)| log_budget_bytes(batch[*index].0, batch[*index].1))
            .sum();
        let buffer_cost: usize = run
            .iter()
            .map(|(_, index)| batch[*index].1.len() + MESSAGE_OVERHEAD_BYTES)
            .sum();
        self.reserve_budget(log_cost + buffer_cost)?;
        let Some(&(shard_index, _)) = run.first() else {
            return Ok(0);
        };
        let timestamp_ms = crate::committer::now_ms();
        let chunk_bytes = self.options.chunk_bytes;
        let mut messages: Vec<&[u8]> = Vec::new();
        let mut guard = lock(&self.shards[shard_index]);
        let shard = &mut *guard;
        // Under the shard lock: the round that will take this shard's log.
        let round = shard.log_round;
        let completed = self.completed_round.load(Ordering::SeqCst);
        wakes.clear();
        if run.len() > 1 {
            warm_queues(&shard.queues, run.iter().map(|&(_, index)| batch[index].0));
        }
        // The log budget reserved for messages that get no log run, and their bytes (their
        // queue is on a direct list: round `round` seals them as chunks).
        let mut unused_log_cost = 0;
        let mut direct_bytes = 0;
        let mut start = 0;
        while start < run.len() {
            let queue = batch[run[start].1].0;
            let mut end = start + 1;
            while end < run.len() && batch[run[end].1].0 == queue {
                end += 1;
            }
            let state = match shard.queues.get_mut(queue) {
                Some(state) => state,
                None => self.insert_queue(&mut shard.queues, queue),
            };
            let first_offset = state.next_offset;
            let buffer = match &mut state.buffer {
                Some(buffer) => buffer,
                none => none.insert(shard.spare.take(first_offset)),
            };
            let mut direct = state.direct_round == round;
            messages.clear();
            for &(_, index) in &run[start..end] {
                let message = batch[index].1;
                offsets[index] = state.next_offset;
                state.next_offset += 1;
                buffer.push_toward_chunk(message, chunk_bytes);
                messages.push(message);
            }
            buffer.mark(round, state.next_offset, completed);
            if !direct && buffer.unfrozen_payload_bytes() >= chunk_bytes {
                // A chunk's worth is waiting: round `round` seals everything this queue logged
                // through it, so these messages need no log record of their own.
                state.direct_round = round;
                direct = true;
                shard.direct.push(QueueKey {
                    name: state.name.clone(),
                    incarnation: state.incarnation,
                });
            }
            if direct {
                direct_bytes += messages.iter().map(|message| message.len()).sum::<usize>();
                unused_log_cost += messages
                    .iter()
                    .map(|message| log_budget_bytes(queue, message))
                    .sum::<usize>();
            } else {
                format::append_log_run(
                    &mut shard.log,
                    &mut shard.open_log,
                    queue,
                    first_offset,
                    timestamp_ms,
                    &messages,
                );
            }
            if !state.queued {
                state.queued = true;
                wakes.push(QueueKey {
                    name: state.name.clone(),
                    incarnation: state.incarnation,
                });
            }
            start = end;
        }
        shard.log_budget_bytes +=
            self.note_run_buffered(log_cost, unused_log_cost, direct_bytes, round);
        if !wakes.is_empty() {
            // Still under the shard lock (order shard -> pending), so the committer never
            // sees a queue's key before its buffer.
            // Every message of these queues not yet sealed is logged in `round` or later.
            lock(&self.pending)
                .buffered
                .extend(wakes.drain(..).map(|key| Listed {
                    key,
                    since_round: round,
                }));
        }
        drop(guard);
        Ok(round)
    }

    /// Creates `queue`, not yet in a shard's map.
    fn insert_queue<'map>(&self, queues: &'map mut QueueMap, queue: &[u8]) -> &'map mut QueueState {
        let incarnation = self.next_incarnation.fetch_add(1, Ordering::Relaxed);
        let name: Arc<[u8]> = Arc::from(queue);
        queues
            .entry(name.clone())
            .or_insert(QueueState::new(name, incarnation, 0))
    }

    /// Accounts for a run just buffered for round `round` that reserved `log_cost` of budget
    /// for its logs: gives back `unused_log_cost` of it (messages with no log run), counts the
    /// rest as shard logs and `direct_bytes` of messages on direct lists, and tells the
    /// committer; returns the log budget the shard's log holds now. Under `interval`, once the
    /// direct bytes reach [`DIRECT_ROUND_DIVISOR`] of the budget, asks for round `round` at
    /// once.
    fn note_run_buffered(
        &self,
        log_cost: usize,
        unused_log_cost: usize,
        direct_bytes: usize,
        round: u64,
    ) -> usize {
        let logged_cost = log_cost - unused_log_cost;
        self.unwritten_log_bytes
            .fetch_add(logged_cost, Ordering::Relaxed);
        self.buffered_bytes
            .fetch_sub(unused_log_cost, Ordering::SeqCst);
        self.note_log_appended();
        if direct_bytes == 0 {
            return logged_cost;
        }
        let before = self
            .direct_unwritten_bytes
            .fetch_add(direct_bytes, Ordering::Relaxed);
        if self.sync() != SyncPolicy::Always
            && before + direct_bytes >= self.options.buffer_budget_bytes / DIRECT_ROUND_DIVISOR
            && self.wanted_round.fetch_max(round, Ordering::SeqCst) < round
        {
            self.wake_committer();
        }
        logged_cost
    }

    /// Tells the committer that a shard log grew; under `always` wakes it.
    fn note_log_appended(&self) {
        self.log_pending.fetch_add(1, Ordering::SeqCst);
        if self.sync() == SyncPolicy::Always {
            self.wake_committer();
        }
    }
}

/// Budget bytes one message's log may take: a log batch run of its own, in a new record.
fn log_budget_bytes(queue: &[u8], message: &[u8]) -> usize {
    format::log_run_bytes_max(queue.len(), &[message])
}

/// Looks up each queue of a run and reads the end of its write buffer, only to bring them into
/// the cache: these loads do not depend on each other, so the CPU overlaps their misses, where
/// the appending loop, one queue after another, waits for each in turn (with 100,000 queues
/// appended to round-robin, the first touch of a queue's map entry was 10% of the put's CPU).
fn warm_queues<'a>(queues: &QueueMap, names: impl Iterator<Item = &'a [u8]>) {
    let mut touched = 0_u8;
    for name in names {
        if let Some(buffer) = queues.get(name).and_then(|state| state.buffer.as_ref()) {
            touched ^= buffer.data.last().copied().unwrap_or(0);
        }
    }
    // Keeps the loads from being optimised away.
    std::hint::black_box(touched);
}
