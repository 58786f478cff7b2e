//! The committer thread: the only writer of segment files. Each round takes the log records
//! every shard gathered since the last round (the appended messages, trims and deletes), seals
//! the write buffers that are due into chunk records (a queue's consecutive messages
//! together), writes it all in one sequential write, fsyncs once, publishes the chunks in the
//! index and wakes every append waiting on that round (group commit). Under `interval` the
//! chunks are published as their writes land, between the round's later writes. After a round
//! it deletes the oldest segment files once nothing live remains in them.
//!
//! This module owns the [`Committer`] (the state kept from round to round), its thread loop
//! ([`run_guarded`]) and the completion of a round (waking its waiters). The steps of a round,
//! in the order a round runs them, each in a file of its own:
//!
//! - `plan.rs`: waiting for work and choosing what a round takes ([`plan::Plan`]): the
//!   round's number, and the buffered queues a budget flush or a checkpoint seals; freeing
//!   the spare write buffers of an idle store.
//! - `floor.rs`: the log floor: refreshing the buffered list's stale entries, remembering
//!   where rounds start, the floor written at the head of a new segment, and the segment
//!   deletion floor a checkpoint allows.
//! - `round.rs`: one round from start to end: take the shard logs, seal, write, fsync,
//!   publish, complete, then collect old segments.
//! - `seal.rs`: sealing queues' write buffers into chunk records in the round buffer
//!   ([`seal::Seal`], [`seal::RunEntry`], [`seal::Placed`]).
//! - `writer.rs`: the active segment ([`Writer`]): writing the round buffer, rotating to a
//!   new segment, and the fsynced appends made outside a round.
//! - `publish.rs`: publishing written chunks in the index and applying trim and delete
//!   effects, at the round's end or (under `interval`) as its writes land.
//! - `failure.rs`: a failed round: cut the segment back, put its log records and queues
//!   back for a retry (full disk), or poison the store.
//! - `collect.rs`: deleting the oldest segments once nothing live remains in them, copying
//!   forward the trim records they still carry.
//! - `relocate.rs`: copying the few live chunks of a mostly dead oldest segment forward.

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::error::WriteError;
use crate::format::LogFloor;
use crate::options::SyncPolicy;
use crate::store::{FAILURES_MAX, Inner, Listed, lock};

use seal::{Placed, RunEntry};
pub(crate) use writer::Writer;

mod collect;
mod failure;
mod floor;
mod plan;
mod publish;
mod relocate;
mod round;
mod seal;
mod writer;

/// Most queues the committer seals or publishes under one shard lock before letting
/// appenders in: a few hundred microseconds of work.
const FREEZE_QUEUES_PER_LOCK_MAX: usize = 256;

/// After a round failed for lack of space, the committer waits this long before the next.
const FULL_DISK_RETRY_WAIT: Duration = Duration::from_millis(10);

/// The committer's state, kept from round to round; each step of a round adds its methods
/// in its own file (see the module comment).
struct Committer<'a> {
    inner: &'a Inner,
    writer: Writer,
    last_round: Instant,
    /// The sync policy's interval the current round runs under (taken when it is planned,
    /// so that a round is handled under one policy if [`crate::Store::set_sync_policy`]
    /// changes it meanwhile); `None` under `always`.
    round_interval: Option<Duration>,
    /// Every log record still needed (its messages not yet in a chunk) is in this segment or
    /// a later one; older segments may be deleted once they hold no live chunk.
    log_floor: u32,
    /// Garbage collection found the oldest segment pinned by log records only.
    checkpoint_wanted: bool,
    /// The last round failed for lack of space: wait a little before the next one.
    backing_off: bool,
    /// Bytes of the current round already written (see `StoreOptions::round_write_bytes`).
    round_flushed: u64,
    /// Bytes of log records at the start of the round buffer, not yet written.
    round_log_buffered: usize,
    /// The current round's log records, kept once the buffer holding them was written early:
    /// a failed round puts them back in the shard logs.
    round_log: Vec<u8>,
    /// How many of the current round's chunks (the first of `placed`) are published already:
    /// under `interval` a round publishes its chunks as their writes land, between its later
    /// writes (see `Committer::publish_written`). Its trim and delete effects are applied
    /// with the first of them (they were written before them).
    published: usize,
    /// Where rounds started, oldest first, at most one per
    /// `floor::ROUND_START_SPACING_BYTES` of a segment; round 0 stands for the log replayed
    /// at open (it starts at the recovered floor). Pruned to the floor at each rotation.
    round_starts: VecDeque<(u64, LogFloor)>,
    /// The floor written at the start of the next segment: every log record before it is
    /// dead. Refreshed before each rotation at the start of a round.
    floor: LogFloor,
    /// Buffered-list entries of queues found deleted (or deleted and created again), each with
    /// a round whose log holds the delete record or a later one: the floor still counts them
    /// until that round is complete, because until then a crash brings the queue back with
    /// the log records the entry stands for.
    gone: Vec<(Listed, u64)>,
    /// The queues to seal and the chunks sealed, kept empty between rounds so that their
    /// allocations are reused: allocated afresh, their growth to a round's thousands of
    /// entries took fresh pages from the kernel every round (a tenth of the committer's time
    /// with 4 KiB messages). Bounded by the entries of one round.
    spare_run: Vec<RunEntry>,
    spare_placed: Vec<Placed>,
    /// Since when no work was found (`None` while rounds run), for
    /// `plan::SPARE_RELEASE_IDLE`.
    idle_since: Option<Instant>,
    /// A round kept emptied write buffers as spares since they were last released.
    spares_kept: bool,
}

/// Runs the committer until shutdown or a fatal error, poisoning the store if it panics (a
/// bug), so that appenders waiting for a round get an error instead of waiting forever.
/// `floor` is the log floor recovery used: every log record it replayed is at or after it.
pub(crate) fn run_guarded(inner: &Inner, writer: Writer, log_floor: u32, floor: LogFloor) {
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run(inner, writer, log_floor, floor);
    }));
    if let Err(panic) = ran {
        let what = panic
            .downcast_ref::<&str>()
            .map(ToString::to_string)
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let mut commit = lock(&inner.commit);
        commit.poisoned = Some(format!("the committer thread panicked: {what}"));
        inner.poisoned.store(true, Ordering::Release);
        inner.committed.notify_all();
    }
}

fn run(inner: &Inner, writer: Writer, log_floor: u32, floor: LogFloor) {
    let mut committer = Committer {
        inner,
        writer,
        last_round: Instant::now(),
        round_interval: interval_of(inner.sync()),
        log_floor,
        checkpoint_wanted: false,
        backing_off: false,
        round_flushed: 0,
        round_log_buffered: 0,
        round_log: Vec::new(),
        published: 0,
        round_starts: VecDeque::from([(0, floor)]),
        floor,
        gone: Vec::new(),
        spare_run: Vec::new(),
        spare_placed: Vec::new(),
        idle_since: None,
        spares_kept: false,
    };
    loop {
        let plan = committer.next_plan();
        let shutdown = plan.shutdown;
        let round_started_ms = inner.elapsed_ms();
        committer.last_round = Instant::now();
        if !committer.run_round(plan) {
            return;
        }
        if std::mem::take(&mut committer.backing_off) {
            // The disk is full: retrying at once would only spin (and push the failures of
            // earlier rounds out of `CommitState::failures` before their waiters read them).
            std::thread::sleep(FULL_DISK_RETRY_WAIT);
        }
        if !inner.disk_full.load(Ordering::SeqCst) {
            // Everything appended before the round started is now fsynced.
            inner
                .durable_through_ms
                .fetch_max(round_started_ms, Ordering::Release);
        }
        if shutdown {
            // Nothing can be appended while the store is being dropped: one round suffices.
            return;
        }
    }
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> u64 {
    let elapsed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
}

fn is_no_space(error: &io::Error) -> bool {
    error.kind() == io::ErrorKind::StorageFull || error.raw_os_error() == Some(28)
}

/// The interval of a sync policy; `None` under `always`.
fn interval_of(policy: SyncPolicy) -> Option<Duration> {
    match policy {
        SyncPolicy::Always => None,
        SyncPolicy::Interval { interval_ms } => Some(Duration::from_millis(interval_ms)),
    }
}

impl Committer<'_> {
    /// The interval of the round under way (see `round_interval`).
    fn interval(&self) -> Option<Duration> {
        self.round_interval
    }

    fn complete(&self, round: u64, error: Option<WriteError>) {
        let mut commit = lock(&self.inner.commit);
        commit.completed = commit.completed.max(round);
        self.inner
            .completed_round
            .fetch_max(round, Ordering::SeqCst);
        if let Some(error) = error {
            commit.failures.push((round, error));
            if commit.failures.len() > FAILURES_MAX {
                commit.failures.remove(0);
            }
        }
        self.inner.committed.notify_all();
    }
}
