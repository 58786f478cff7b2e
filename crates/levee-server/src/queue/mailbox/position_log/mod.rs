//! Positions of many-queue streams (`SubscribeMany`): one log per consumer instead of one
//! position queue per (consumer, queue). An ack batch appends its positions to the consumer's
//! log as a few records of many entries, so a million mailboxes cost a few store appends per
//! ack batch, not a million position queues.
//!
//! The records, their epochs and the rule that the **largest** position wins (so entries may
//! be applied in any order and read twice) are the broker engine's
//! (`levee_broker::position`); this module keeps them in the store: where, when a
//! generation is compacted, how a log is loaded.
//!
//! The log lives in generations, store queues named [`LOG_PREFIX`], the generation (16 hex
//! digits) and the consumer. When a generation holds more than twice the entries of the last
//! snapshot (and at least the configured minimum), it is compacted: acks switch to the next
//! generation, the old one is read whole into the book, positions of queues that no longer
//! exist are dropped from it, the book is written to the new one as
//! a snapshot (records of at most 64 KiB and at most the store's message size), and once that
//! is durable the head record (a position queue, trimmed like the others, whose newest record
//! names the current generation) is written and the old generation deleted. A compaction that
//! fails (a full disk) leaves the old generation in place and is retried from where it
//! stopped, without switching again, once the generation has grown by as much again: so the
//! generations on disk are always within one of the head. Loading reads the head's
//! generation and its neighbours (a crash can leave the previous one undeleted, or the next
//! one written before the head), takes the largest as current, and has an interrupted
//! compaction finished at the first ack.
//!
//! The book (every position the log holds) stays in memory while a stream of the consumer is
//! open; acks do not touch it: it catches up from the log when a stream adds mailboxes or a
//! compaction runs. Position queues written by older versions (and by single-queue
//! subscriptions) are still read: a mailbox starts at the larger of the two.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use levee_broker::names::{POSITION_LOG_PREFIX as LOG_PREFIX, POSITION_PREFIX};
pub use levee_broker::position::Position;
use levee_broker::position::{
    LOG_ENTRY_BYTES_MAX, PositionBook, encode_log_records, encode_stamped_records,
};
use levee_proto::WireError;
use levee_store::{CommitTicket, Store};
use prometheus_client::metrics::counter::Counter;

use crate::queue::{last_record, lock, storage_error, write_error};

/// Records the current generation of a log no stream has loaded may hold before a delete's
/// forget loads and compacts it, by default (tests give a [`PositionLogs`] fewer, so that the
/// path runs often).
const UNLOADED_RECORDS_MAX: u64 = 4_096;
/// The queue whose next offset is the delete epoch: each delete of a queue appends one empty
/// message to it before it writes its forgets. Never a consumer's position queue (that name
/// has a consumer of at least one byte before its `\0`).
fn epoch_queue() -> Vec<u8> {
    let mut name = POSITION_PREFIX.to_vec();
    name.extend_from_slice(b"\0delete-epoch");
    name
}
/// Most bytes of one log record (an ack batch or a snapshot spans several).
const RECORD_BYTES_MAX: usize = 64 << 10;
/// Messages one read of a generation asks for.
const READ_MESSAGES: usize = 1_024;
/// Bytes one read of a generation asks for.
const READ_BYTES: usize = 4 << 20;

/// A generation's store queue.
fn generation_queue(consumer: &str, generation: u64) -> Vec<u8> {
    let mut name = LOG_PREFIX.to_vec();
    name.extend_from_slice(format!("{generation:016x}").as_bytes());
    name.extend_from_slice(consumer.as_bytes());
    name
}

/// The head queue: a position queue (trimmed with them) whose newest record is the current
/// generation. Its last 16 bytes are not hex, so it never equals a per-queue position queue.
fn head_queue(consumer: &str) -> Vec<u8> {
    let mut name = POSITION_PREFIX.to_vec();
    name.extend_from_slice(consumer.as_bytes());
    name.extend_from_slice(b"\0log-generation..");
    name
}

/// A consumer's positions on some queues, by queue.
pub type HeldPositions = Vec<(Box<[u8]>, Position)>;

/// The generation acks go to, how many entries it got, and at how many a compaction is due.
#[derive(Debug, Default)]
struct Writing {
    generation: u64,
    entries: u64,
    due_at: u64,
}

/// The least delete epoch of a queue's positions, beyond the server's own (see
/// [`PositionLogs::with_epoch_floor`]).
#[derive(Clone)]
pub struct EpochFloor(Arc<FloorOf>);

/// A queue's floor.
type FloorOf = dyn Fn(&[u8]) -> u64 + Send + Sync;

impl EpochFloor {
    /// The floor `floor` computes for each queue.
    pub fn new(floor: impl Fn(&[u8]) -> u64 + Send + Sync + 'static) -> Self {
        Self(Arc::new(floor))
    }

    fn of(&self, queue: &[u8]) -> u64 {
        (self.0)(queue)
    }
}

impl std::fmt::Debug for EpochFloor {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("EpochFloor")
    }
}

/// What the log holds, as far as it has been read.
#[derive(Debug, Default)]
struct Book {
    loaded: bool,
    positions: PositionBook,
    /// The generation read last and the offset in it read up to; every older generation
    /// still on disk has been read whole.
    generation: u64,
    applied: u64,
    /// The epoch of acks on a queue without an entry: the delete epoch when the book was
    /// loaded or last compacted, so at least that of every forget the book left out or
    /// dropped (a forget of a queue without an entry can only be one of those), and the same
    /// for every stream of the consumer until the next compaction.
    floor_epoch: u64,
    /// Older generations still on disk: deleted once a snapshot in the current one is durable
    /// and the head names it. While any remain, acks do not move to a newer generation, so
    /// the generations on disk stay within one of the head.
    stale: Vec<u64>,
}

/// One consumer's position log; see the module docs.
#[derive(Debug)]
pub struct ConsumerLog {
    consumer: String,
    store: Arc<Store>,
    compact_entries_min: u64,
    unloaded_records_max: u64,
    record_bytes_max: usize,
    compactions: Counter,
    /// Acks append under this lock, so a generation switch waits for appends in progress.
    writing: Mutex<Writing>,
    /// Loading, catching up, lookups and compaction; never taken while `writing` is held.
    book: Mutex<Book>,
    compacting: AtomicBool,
    /// Entries of the last snapshot (the book's size then).
    snapshot_entries: AtomicU64,
    /// The server's delete epoch (the book's floor epoch is read from it).
    epoch: Arc<AtomicU64>,
    /// A queue's least epoch beyond that (replicated queues: their shard's delete epoch).
    floor: Option<EpochFloor>,
    /// The consumers a delete writes forgets to; this one joins before its first write.
    writers: Arc<Mutex<std::collections::HashSet<String>>>,
    /// Whether this consumer is in `writers` already.
    noted: AtomicBool,
}

impl ConsumerLog {
    /// The consumer this log belongs to.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Appends positions (queue, next offset to deliver) to the current generation without
    /// waiting for durability; returns the highest ticket (`None` for no entries) and whether
    /// the generation is due for compaction (then call [`ConsumerLog::compact`] once, on the
    /// blocking pool). Cheap: call it inline.
    pub fn append<'a>(
        &self,
        entries: impl ExactSizeIterator<Item = (&'a [u8], u64, u64)>,
    ) -> Result<(Option<CommitTicket>, bool), WireError> {
        let count = entries.len() as u64;
        let records = encode_stamped_records(
            entries.map(|(queue, epoch, next)| (queue, Position { epoch, next })),
            self.record_bytes_max,
        );
        if records.is_empty() {
            return Ok((None, false));
        }
        if !self.noted.load(Ordering::Acquire) {
            note_writer(&self.writers, &self.consumer);
            self.noted.store(true, Ordering::Release);
        }
        let mut writing = lock(&self.writing);
        let ticket = self.append_records(writing.generation, &records)?;
        writing.entries += count;
        let due =
            writing.entries >= writing.due_at && !self.compacting.swap(true, Ordering::AcqRel);
        Ok((Some(ticket), due))
    }

    /// Appends `records` to `generation` without waiting for durability.
    fn append_records(
        &self,
        generation: u64,
        records: &[Vec<u8>],
    ) -> Result<CommitTicket, WireError> {
        let name = generation_queue(&self.consumer, generation);
        let batch: Vec<(&[u8], &[u8])> = records
            .iter()
            .map(|record| (name.as_slice(), record.as_slice()))
            .collect();
        let (_, ticket) = self
            .store
            .append_batch_deferred(&batch)
            .map_err(write_error)?;
        Ok(ticket)
    }

    /// The next offset to deliver on each of `queues` for this consumer: the largest of its
    /// log's and its position queue's (older versions, single-queue subscriptions), 0 if
    /// neither knows it. Blocks on the store: call it on the blocking pool.
    pub fn positions(&self, queues: &[Box<[u8]>]) -> Result<Vec<Position>, WireError> {
        let mut book = lock(&self.book);
        self.load(&mut book)?;
        self.catch_up_all(&mut book)?;
        queues
            .iter()
            .map(|queue| {
                let Position {
                    epoch,
                    next: logged,
                } = book.positions.get(queue).unwrap_or_else(|| Position {
                    epoch: book
                        .floor_epoch
                        .max(self.floor.as_ref().map_or(0, |floor| floor.of(queue))),
                    next: 0,
                });
                let legacy = crate::queue::mailbox::subscription::load_position(
                    &self.store,
                    &self.consumer,
                    queue,
                )?;
                Ok(Position {
                    epoch,
                    next: logged.max(legacy),
                })
            })
            .collect()
    }

    /// Every position the log holds on a queue `keep` says yes to, sorted by queue. Blocks
    /// on the store: call it on the blocking pool.
    pub fn positions_where(
        &self,
        keep: &dyn Fn(&[u8]) -> bool,
    ) -> Result<HeldPositions, WireError> {
        let mut book = lock(&self.book);
        self.load(&mut book)?;
        self.catch_up_all(&mut book)?;
        let mut held: HeldPositions = book
            .positions
            .iter()
            .filter(|(queue, _)| keep(queue))
            .map(|(queue, position)| (queue.into(), position))
            .collect();
        held.sort_unstable();
        Ok(held)
    }

    /// Whether the consumer has a position log at all (a head, or a first generation).
    fn exists(&self) -> Result<bool, WireError> {
        for name in [
            head_queue(&self.consumer),
            generation_queue(&self.consumer, 0),
        ] {
            if self
                .store
                .queue_info(&name)
                .map_err(|error| storage_error(&error))?
                .is_some()
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Writes a forget of `queue` in a delete's `epoch`: the queue's position reads 0 until an
    /// ack of a later epoch (see [`Position`]). Returns the ticket to wait for (`None` if the
    /// consumer has no log). Blocks on the store: call it on the blocking pool.
    fn forget(&self, queue: &[u8], epoch: u64) -> Result<Option<CommitTicket>, WireError> {
        let book = lock(&self.book);
        if !book.loaded {
            // Not read by any stream: the forget goes to the generation acks would go to,
            // found without reading the log; the book's lock keeps a load from starting
            // meanwhile (and no compaction runs on a log not loaded).
            if !self.exists()? {
                return Ok(None);
            }
            let (head, existing) = self.generations_on_disk()?;
            let records =
                encode_log_records([(queue, 0)].into_iter(), epoch, self.record_bytes_max);
            let current = existing.last().copied().unwrap_or(head);
            let ticket = self.append_records(current, &records)?;
            // A consumer that never comes back would gather a forget per delete for good:
            // once its generation holds many records past its snapshot, load and compact it
            // (forgets go).
            let snapshot = if current == head { self.head()?.1 } else { 0 };
            let records = self
                .store
                .queue_info(&generation_queue(&self.consumer, current))
                .ok()
                .flatten()
                .map_or(0, |info| info.next_offset);
            drop(book);
            if records >= snapshot + self.unloaded_records_max
                && !self.compacting.swap(true, Ordering::AcqRel)
            {
                let loaded = self.load(&mut lock(&self.book));
                match loaded {
                    // Its guard clears `compacting`.
                    Ok(()) => self.warn_compaction(self.compact()),
                    Err(error) => {
                        self.compacting.store(false, Ordering::Release);
                        self.warn_compaction(Err(error));
                    }
                }
            }
            return Ok(Some(ticket));
        }
        drop(book);
        let (ticket, due) = self.append([(queue, epoch, 0)].into_iter())?;
        if due {
            self.warn_compaction(self.compact());
        }
        Ok(ticket)
    }

    /// Logs a compaction that failed (it is retried once the log has grown as much again).
    fn warn_compaction(&self, compacted: Result<(), WireError>) {
        if let Err(error) = compacted {
            tracing::warn!(
                consumer = self.consumer,
                %error,
                "compacting a position log failed; retried once it has grown as much again"
            );
        }
    }

    /// Compacts the log (see the module docs) after [`ConsumerLog::append`] said it is due.
    /// A failed compaction is retried (from where it stopped) once the generation has grown
    /// by as much again. Blocks on the store: call it on the blocking pool.
    pub fn compact(&self) -> Result<(), WireError> {
        /// Clears `compacting` however the compaction ends (a panic included).
        struct Done<'a>(&'a AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _done = Done(&self.compacting);
        let step = || {
            self.compact_entries_min
                .max(2 * self.snapshot_entries.load(Ordering::Relaxed))
        };
        // Until it succeeds, the next attempt is due once as many entries came again (so one
        // that fails, or panics, is not retried at every ack).
        {
            let mut writing = lock(&self.writing);
            writing.due_at = writing.entries.saturating_add(step());
        }
        self.compact_now()?;
        lock(&self.writing).due_at = step();
        Ok(())
    }

    fn compact_now(&self) -> Result<(), WireError> {
        let (generation, records, stale) = {
            let mut book = lock(&self.book);
            self.load(&mut book)?;
            if book.stale.is_empty() {
                let mut writing = lock(&self.writing);
                book.stale.push(writing.generation);
                writing.generation += 1;
                writing.entries = 0;
            }
            // Nothing is appended to the stale generations any more: read them to their end.
            self.catch_up_all(&mut book)?;
            // Positions of queues deleted since are dropped, so the book does not keep every
            // queue the consumer ever acked (per-session mailboxes come and go). Dropping one
            // is always safe: at worst its messages are delivered again. (A queue deleted and
            // created again is not left with its old position either way: the delete wrote
            // a forget, see [`PositionLogs::forget`].)
            // Forgets (next offset 0) go too: without an entry a queue's acks are written in
            // the floor epoch, set just below to the current one, which no forget outranks.
            book.positions.retain(|queue, position| {
                position.next > 0 && matches!(self.store.queue_info(queue), Ok(Some(_)))
            });
            book.floor_epoch = self.epoch.load(Ordering::Acquire);
            // Each entry keeps its epoch: sorted by it, one run of records per epoch.
            let records = book.positions.snapshot_records(self.record_bytes_max);
            self.snapshot_entries
                .store(book.positions.len() as u64, Ordering::Relaxed);
            (book.generation, records, book.stale.clone())
        };
        // The writes run without the book's lock, so adds of the consumer's streams go on
        // meanwhile: they read the snapshot's records too (positions only grow).
        self.finish(generation, &records, &stale)?;
        lock(&self.book)
            .stale
            .retain(|generation| !stale.contains(generation));
        self.compactions.inc();
        Ok(())
    }

    /// Loads the book from the log once: the head's generation and its neighbours.
    fn load(&self, book: &mut Book) -> Result<(), WireError> {
        if book.loaded {
            return Ok(());
        }
        let (head, existing) = self.generations_on_disk()?;
        let current = existing.last().copied().unwrap_or(head);
        let mut current_entries = 0;
        for &generation in &existing {
            book.generation = generation;
            book.applied = 0;
            current_entries = self.catch_up(book)?;
        }
        book.generation = current;
        book.stale = existing
            .iter()
            .copied()
            .filter(|generation| *generation != current)
            .collect();
        book.loaded = true;
        book.floor_epoch = self.epoch.load(Ordering::Acquire);
        let snapshot = book.positions.len() as u64;
        self.snapshot_entries.store(snapshot, Ordering::Relaxed);
        let mut writing = lock(&self.writing);
        writing.generation = current;
        writing.entries = current_entries;
        // An interrupted compaction (older generations left, or the head behind) is finished
        // by the first compaction, due at the first ack.
        writing.due_at = if book.stale.is_empty() && current == head {
            self.compact_entries_min.max(2 * snapshot)
        } else {
            0
        };
        Ok(())
    }

    /// The generation the head names, and the generations on disk around it (a crash can
    /// leave the previous one undeleted, or the next one written before the head), oldest
    /// first: the last one is where acks go.
    fn generations_on_disk(&self) -> Result<(u64, Vec<u64>), WireError> {
        let (head, _) = self.head()?;
        let mut existing = Vec::new();
        for generation in head.saturating_sub(1)..=head + 1 {
            let name = generation_queue(&self.consumer, generation);
            if self
                .store
                .queue_info(&name)
                .map_err(|error| storage_error(&error))?
                .is_some()
            {
                existing.push(generation);
            }
        }
        Ok((head, existing))
    }

    /// The head record: the current generation and the records of its snapshot (0 for a
    /// head written before the count was, or none).
    fn head(&self) -> Result<(u64, u64), WireError> {
        let Some(record) = last_record(&self.store, &head_queue(&self.consumer))? else {
            return Ok((0, 0));
        };
        let word = |range: std::ops::Range<usize>| {
            record
                .get(range)
                .and_then(|bytes| bytes.try_into().ok())
                .map(u64::from_le_bytes)
        };
        let generation = word(0..8).ok_or_else(|| {
            storage_error(&format!(
                "consumer '{}': its position log head record is {} bytes, fewer than 8",
                self.consumer,
                record.len()
            ))
        })?;
        Ok((generation, word(8..16).unwrap_or(0)))
    }

    /// Reads every generation from the book's to the one acks go to (see [`Book`]).
    fn catch_up_all(&self, book: &mut Book) -> Result<(), WireError> {
        let writing = lock(&self.writing).generation;
        self.catch_up(book)?;
        while book.generation < writing {
            book.generation += 1;
            book.applied = 0;
            self.catch_up(book)?;
        }
        Ok(())
    }

    /// Reads the book's generation from where it stopped to its end (waiting for a commit
    /// round when the newest records are not readable yet) and applies it.
    fn catch_up(&self, book: &mut Book) -> Result<u64, WireError> {
        let name = generation_queue(&self.consumer, book.generation);
        let mut flushed = false;
        let mut entries = 0;
        // What was appended before the flush: acks appended during it are in the next round,
        // not readable yet, and not needed (the callers need what was answered before them).
        let mut target = 0;
        loop {
            let Some(info) = self
                .store
                .queue_info(&name)
                .map_err(|error| storage_error(&error))?
            else {
                return Ok(entries);
            };
            while book.applied < info.next_offset {
                let batch = self
                    .store
                    .read(&name, book.applied, READ_MESSAGES, READ_BYTES)
                    .map_err(|error| storage_error(&error))?;
                if batch.is_empty() {
                    break;
                }
                for record in batch.iter() {
                    entries += book.positions.apply_record(record).map_err(|error| {
                        storage_error(&format!(
                            "consumer '{}': its position log holds a record this server cannot \
                             read ({error}); a newer version wrote it or it is damaged: run \
                             the newer version, or subscribe with another consumer name (whose \
                             positions start over)",
                            self.consumer
                        ))
                    })?;
                }
                book.applied = batch.next_offset();
            }
            if book.applied >= info.next_offset || (flushed && book.applied >= target) {
                return Ok(entries);
            }
            if flushed {
                return Err(storage_error(&format!(
                    "consumer '{}': its position log reads to offset {} of {} after a commit \
                     round",
                    self.consumer, book.applied, info.next_offset
                )));
            }
            // Under `always` the newest records are readable once fsynced.
            target = info.next_offset;
            self.store.flush().map_err(write_error)?;
            flushed = true;
        }
    }

    /// Writes a snapshot (`records`) into `generation`, waits until it is durable, points the
    /// head at it, and deletes the `stale` generations.
    fn finish(&self, generation: u64, records: &[Vec<u8>], stale: &[u64]) -> Result<(), WireError> {
        let name = generation_queue(&self.consumer, generation);
        for chunk in records.chunks(64) {
            let batch: Vec<(&[u8], &[u8])> = chunk
                .iter()
                .map(|record| (name.as_slice(), record.as_slice()))
                .collect();
            self.store.append_batch(&batch).map_err(write_error)?;
        }
        self.store.flush().map_err(write_error)?;
        let mut head = generation.to_le_bytes().to_vec();
        head.extend_from_slice(&(records.len() as u64).to_le_bytes());
        self.store
            .append(&head_queue(&self.consumer), &head)
            .map_err(write_error)?;
        self.store.flush().map_err(write_error)?;
        for &generation in stale {
            self.store
                .delete_queue(&generation_queue(&self.consumer, generation))
                .map_err(write_error)?;
        }
        Ok(())
    }
}

/// Adds `consumer` to `writers` if it is not there.
fn note_writer(writers: &Mutex<std::collections::HashSet<String>>, consumer: &str) {
    let mut writers = lock(writers);
    if !writers.contains(consumer) {
        writers.insert(consumer.to_owned());
    }
}

/// The position logs of the consumers with open streams, and what a queue's delete does to
/// every consumer's positions.
#[derive(Debug)]
pub struct PositionLogs {
    store: Arc<Store>,
    compact_entries_min: u64,
    unloaded_records_max: u64,
    compactions: Counter,
    logs: Mutex<(HashMap<String, Weak<ConsumerLog>>, usize)>,
    /// Every consumer that may hold a position: those with positions in the store at start,
    /// and every consumer that wrote one since (one entry per consumer name, each with a
    /// position queue or log in the store, so bounded by what the store holds).
    writers: Arc<Mutex<std::collections::HashSet<String>>>,
    /// The delete epoch ([`epoch_queue`]'s next offset), written with every ack record.
    epoch: Arc<AtomicU64>,
    /// A queue's least epoch beyond that (see [`PositionLogs::with_epoch_floor`]).
    floor: Option<EpochFloor>,
    /// Deletes completed since the start (see [`PositionLogs::deletes`]).
    deletes: AtomicU64,
    /// Positions forgotten: forgets written, position queues deleted.
    forgets: Counter,
}

impl PositionLogs {
    /// Logs on `store`, compacted past `compact_entries_min` entries (and twice the last
    /// snapshot); `compactions` counts compactions. Finds every consumer with positions in
    /// the store: one pass over the store's queue names.
    pub fn new(store: Arc<Store>, compact_entries_min: u64, compactions: Counter) -> Self {
        let mut consumers = std::collections::HashSet::new();
        // Generation queues: the prefix, 16 hex digits, the consumer.
        store.for_each_queue_with_prefix(LOG_PREFIX, |name| {
            if let Some(consumer) = name.get(LOG_PREFIX.len() + 16..) {
                consumers.insert(String::from_utf8_lossy(consumer).into_owned());
            }
        });
        // Position queues and log heads: the prefix, the consumer, `\0` and what follows
        // (16 hex digits, or `log-generation..`: neither holds a `\0`).
        store.for_each_queue_with_prefix(POSITION_PREFIX, |name| {
            let rest = &name[POSITION_PREFIX.len()..];
            if let Some(end) = rest.iter().rposition(|byte| *byte == 0)
                && end > 0
            {
                consumers.insert(String::from_utf8_lossy(&rest[..end]).into_owned());
            }
        });
        let epoch = store
            .queue_info(&epoch_queue())
            .ok()
            .flatten()
            .map_or(0, |info| info.next_offset);
        Self {
            store,
            compact_entries_min,
            unloaded_records_max: UNLOADED_RECORDS_MAX,
            compactions,
            logs: Mutex::new((HashMap::new(), 64)),
            writers: Arc::new(Mutex::new(consumers)),
            epoch: Arc::new(AtomicU64::new(epoch)),
            floor: None,
            deletes: AtomicU64::new(0),
            forgets: Counter::default(),
        }
    }

    /// Compacts a log no stream has loaded once its generation holds `records` past its
    /// snapshot (tests use a few, so that the path runs).
    #[cfg(test)]
    #[must_use]
    pub fn with_unloaded_records_max(self, records: u64) -> Self {
        Self {
            unloaded_records_max: records,
            ..self
        }
    }

    /// Positions on a queue without one take the larger of the server's delete epoch and
    /// `floor(queue)`: in a cluster that replicates its queues, the queue's shard's delete
    /// epoch, the same on every replica, so that positions from any node compare alike with
    /// a replicated delete's forget ([`PositionLogs::forget_replicated`]).
    #[must_use]
    pub fn with_epoch_floor(self, floor: EpochFloor) -> Self {
        Self {
            floor: Some(floor),
            ..self
        }
    }

    /// Counts the positions deletes forget in `forgets`.
    #[must_use]
    pub fn count_forgets(self, forgets: Counter) -> Self {
        Self { forgets, ..self }
    }

    /// Deletes completed since the start. A stream that read positions before it registered
    /// its queues compares this before and after: if a delete completed in between, the
    /// positions it read may predate that delete's forget, and it reads them again.
    pub fn deletes(&self) -> u64 {
        self.deletes.load(Ordering::Acquire)
    }

    /// Makes every consumer forget its position on `queue`, before the queue is deleted, so
    /// a queue created again under the name is delivered from its start: takes a new delete
    /// epoch (durably), writes a forget in it to every consumer's log and deletes every
    /// consumer's position queue of `queue`, and waits until all of it is durable. The caller
    /// makes sure no stream holds `queue` meanwhile (no ack of it can race the forget), then
    /// deletes the queue, holding [`PositionLogs::counting_delete`] from before this call to
    /// the end. Costs a store write per consumer that has a log. Blocks on the store: call it
    /// on the blocking pool.
    pub fn forget(&self, queue: &[u8]) -> Result<(), WireError> {
        let (offset, ticket) = self
            .store
            .append_deferred(&epoch_queue(), &[])
            .map_err(write_error)?;
        self.store.wait_durable(ticket).map_err(write_error)?;
        // Acks from now on are of this epoch or later, so they outrank the forget.
        let epoch = offset + 1;
        self.epoch.fetch_max(epoch, Ordering::AcqRel);
        self.forget_in(queue, epoch)
    }

    /// [`PositionLogs::forget`] for a replicated delete (applied from a shard's log, on every
    /// replica): the forget is written in `epoch`, the queue's shard's delete epoch after the
    /// delete, which every replica gives it alike; positions taken on any node before the
    /// delete carry an older one and lose to it. Count the delete done with
    /// [`PositionLogs::delete_done`] once the queue is deleted.
    pub fn forget_replicated(&self, queue: &[u8], epoch: u64) -> Result<(), WireError> {
        self.forget_in(queue, epoch)
    }

    /// Counts a replicated delete as completed (see [`PositionLogs::deletes`]).
    pub fn delete_done(&self) {
        self.deletes.fetch_add(1, Ordering::AcqRel);
    }

    /// Writes a forget of `queue` in `epoch` to every consumer's log, deletes every
    /// consumer's position queue of it, and waits until all of it is durable.
    fn forget_in(&self, queue: &[u8], epoch: u64) -> Result<(), WireError> {
        let consumers: Vec<String> = lock(&self.writers).iter().cloned().collect();
        let mut tickets = Vec::new();
        for consumer in &consumers {
            let single = crate::queue::mailbox::subscription::position_queue(consumer, queue);
            if matches!(self.store.queue_info(&single), Ok(Some(_))) {
                self.store.delete_queue(&single).map_err(write_error)?;
                self.forgets.inc();
            }
            if let Some(ticket) = self.open(consumer).forget(queue, epoch)? {
                self.forgets.inc();
                tickets.push(ticket);
            }
        }
        for ticket in tickets {
            self.store.wait_durable(ticket).map_err(write_error)?;
        }
        Ok(())
    }

    /// Every consumer's positions on the queues `keep` says yes to (those with none left
    /// out), sorted by consumer: what a replicated shard's snapshot carries. Loads each
    /// consumer's log; blocks on the store: call it on the blocking pool.
    pub fn positions_where(
        &self,
        keep: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Vec<(String, HeldPositions)>, WireError> {
        let mut consumers: Vec<String> = lock(&self.writers).iter().cloned().collect();
        consumers.sort_unstable();
        let mut all = Vec::new();
        for consumer in consumers {
            let held = self.open(&consumer).positions_where(keep)?;
            if !held.is_empty() {
                all.push((consumer, held));
            }
        }
        Ok(all)
    }

    /// Notes that `consumer` is about to write a position (a `Subscribe` ack), so deletes
    /// write it forgets from now on. Position logs note their consumer themselves.
    pub fn note_writer(&self, consumer: &str) {
        note_writer(&self.writers, consumer);
    }

    /// Counts a delete as completed when dropped: hold it across [`PositionLogs::forget`] and
    /// the store's delete, so the delete counts however they end.
    pub fn counting_delete(&self) -> impl Drop + '_ {
        /// Counts a delete when dropped.
        struct Counting<'a>(&'a AtomicU64);
        impl Drop for Counting<'_> {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::AcqRel);
            }
        }
        Counting(&self.deletes)
    }

    /// The consumer's log, shared by its open streams; loaded from the store on its first
    /// [`ConsumerLog::positions`]. Cheap: call it inline.
    pub fn open(&self, consumer: &str) -> Arc<ConsumerLog> {
        let mut logs = lock(&self.logs);
        let (map, prune_at) = &mut *logs;
        if let Some(log) = map.get(consumer).and_then(Weak::upgrade) {
            return log;
        }

        if map.len() >= *prune_at {
            map.retain(|_, log| log.strong_count() > 0);
            *prune_at = (2 * map.len()).max(64);
        }
        let log = Arc::new(ConsumerLog {
            consumer: consumer.to_owned(),
            store: Arc::clone(&self.store),
            compact_entries_min: self.compact_entries_min,
            unloaded_records_max: self.unloaded_records_max,
            // The server keeps messages at least 1 KiB (its configuration's minimum).
            record_bytes_max: RECORD_BYTES_MAX
                .min(self.store.options().message_bytes_max)
                .max(1 + LOG_ENTRY_BYTES_MAX),
            compactions: self.compactions.clone(),
            writing: Mutex::new(Writing {
                due_at: self.compact_entries_min,
                ..Writing::default()
            }),
            book: Mutex::new(Book::default()),
            compacting: AtomicBool::new(false),
            snapshot_entries: AtomicU64::new(0),
            epoch: Arc::clone(&self.epoch),
            floor: self.floor.clone(),
            writers: Arc::clone(&self.writers),
            noted: AtomicBool::new(false),
        });
        map.insert(consumer.to_owned(), Arc::downgrade(&log));
        log
    }
}

#[cfg(test)]
mod tests;
