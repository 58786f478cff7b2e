//! Positions of many-queue streams (`SubscribeMany`): one log per consumer instead of one
//! position queue per (consumer, queue). An ack batch appends its positions to the consumer's
//! log as a few records of many entries, so a million mailboxes cost a few store appends per
//! ack batch, not a million position queues.
//!
//! A log record is a version byte ([`RECORD_VERSION`]) then entries, each the queue name's
//! length (one byte; names are 1 to 255 bytes), the name, and the next offset to deliver
//! (u64 little-endian). A queue's position is the **largest** next offset any entry gives it:
//! positions only grow (acks below the acked position change nothing), so entries may be
//! applied in any order and read twice.
//!
//! The log lives in generations, store queues named [`LOG_PREFIX`], the generation (16 hex
//! digits) and the consumer. When a generation holds more than twice the entries of the last
//! snapshot (and at least the configured minimum), it is compacted: acks switch to the next
//! generation, the old one is read whole into the book, the book is written to the new one as
//! a snapshot, and once that is durable the head record (a position queue, trimmed like the
//! others, whose newest record names the current generation) is written and the old
//! generation deleted. Loading reads the head's generation and its neighbours (a crash can
//! leave the previous one undeleted, or the next one written before the head), takes the
//! largest as current, and finishes an interrupted compaction before anything else.
//!
//! The book (every position the log holds) stays in memory while a stream of the consumer is
//! open; acks do not touch it: it catches up from the log when a stream adds mailboxes or a
//! compaction runs. Position queues written by older versions (and by single-queue
//! subscriptions) are still read: a mailbox starts at the larger of the two.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use levee_proto::WireError;
use levee_store::{CommitTicket, Store};
use prometheus_client::metrics::counter::Counter;

use super::{last_record, lock, storage_error, write_error};

/// The prefix of every position log generation's name.
pub const LOG_PREFIX: &[u8] = b"\0poslog\0";
/// The version byte every log record starts with.
const RECORD_VERSION: u8 = 1;
/// Most bytes of one log record (an ack batch or a snapshot spans several).
const RECORD_BYTES_MAX: usize = 64 << 10;
/// Messages one read of a generation asks for.
const READ_MESSAGES: usize = 1_024;
/// Bytes one read of a generation asks for.
const READ_BYTES: usize = 4 << 20;
/// The default minimum of entries a generation holds before it is compacted.
pub const COMPACT_ENTRIES_MIN: u64 = 1_000_000;

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
    let mut name = super::subscription::POSITION_PREFIX.to_vec();
    name.extend_from_slice(consumer.as_bytes());
    name.extend_from_slice(b"\0log-generation..");
    name
}

/// Encodes `entries` (queue, next offset) as log records of at most [`RECORD_BYTES_MAX`].
pub(crate) fn encode_records<'a>(entries: impl Iterator<Item = (&'a [u8], u64)>) -> Vec<Vec<u8>> {
    let mut records = Vec::new();
    let mut record = vec![RECORD_VERSION];
    for (queue, next) in entries {
        let Ok(length) = u8::try_from(queue.len()) else {
            continue; // Mailbox names are checked to be 1 to 255 bytes on add.
        };
        if record.len() + 1 + queue.len() + 8 > RECORD_BYTES_MAX {
            records.push(std::mem::replace(&mut record, vec![RECORD_VERSION]));
        }
        record.push(length);
        record.extend_from_slice(queue);
        record.extend_from_slice(&next.to_le_bytes());
    }
    if record.len() > 1 {
        records.push(record);
    }
    records
}

/// Applies one log record to `book`; an error names what is wrong with it.
fn apply_record(book: &mut HashMap<Box<[u8]>, u64>, record: &[u8]) -> Result<(), String> {
    let Some((&version, mut rest)) = record.split_first() else {
        return Err("an empty record".to_owned());
    };
    if version != RECORD_VERSION {
        return Err(format!(
            "record version {version}, this server reads {RECORD_VERSION}"
        ));
    }
    while let Some((&length, after)) = rest.split_first() {
        let length = usize::from(length);
        if length == 0 || after.len() < length + 8 {
            return Err(format!(
                "an entry of {length} name bytes runs past the record's end"
            ));
        }
        let (queue, after) = after.split_at(length);
        let (next, after) = after.split_at(8);
        let next = u64::from_le_bytes(next.try_into().unwrap_or([0; 8]));
        match book.get_mut(queue) {
            Some(known) => *known = (*known).max(next),
            None => {
                book.insert(queue.into(), next);
            }
        }
        rest = after;
    }
    Ok(())
}

/// The generation acks go to, and how many entries it holds.
#[derive(Debug, Default)]
struct Writing {
    generation: u64,
    entries: u64,
}

/// What the log holds, as far as it has been read.
#[derive(Debug, Default)]
struct Book {
    loaded: bool,
    positions: HashMap<Box<[u8]>, u64>,
    /// The generation read last and the offset in it read up to.
    generation: u64,
    applied: u64,
}

/// One consumer's position log; see the module docs.
#[derive(Debug)]
pub struct ConsumerLog {
    consumer: String,
    store: Arc<Store>,
    compact_entries_min: u64,
    compactions: Counter,
    /// Acks append under this lock, so a generation switch waits for appends in progress.
    writing: Mutex<Writing>,
    /// Loading, catching up, lookups and compaction; never taken while `writing` is held.
    book: Mutex<Book>,
    compacting: AtomicBool,
    /// Entries of the last snapshot (the book's size then).
    snapshot_entries: AtomicU64,
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
        entries: impl ExactSizeIterator<Item = (&'a [u8], u64)>,
    ) -> Result<(Option<CommitTicket>, bool), WireError> {
        let count = entries.len() as u64;
        let records = encode_records(entries);
        if records.is_empty() {
            return Ok((None, false));
        }
        let mut writing = lock(&self.writing);
        let name = generation_queue(&self.consumer, writing.generation);
        let batch: Vec<(&[u8], &[u8])> = records
            .iter()
            .map(|record| (name.as_slice(), record.as_slice()))
            .collect();
        let (_, ticket) = self
            .store
            .append_batch_deferred(&batch)
            .map_err(write_error)?;
        writing.entries += count;
        let threshold = self
            .compact_entries_min
            .max(2 * self.snapshot_entries.load(Ordering::Relaxed));
        let due = writing.entries >= threshold && !self.compacting.swap(true, Ordering::AcqRel);
        Ok((Some(ticket), due))
    }

    /// The next offset to deliver on each of `queues` for this consumer: the largest of its
    /// log's and its position queue's (older versions, single-queue subscriptions), 0 if
    /// neither knows it. Blocks on the store: call it on the blocking pool.
    pub fn positions(&self, queues: &[Box<[u8]>]) -> Result<Vec<u64>, WireError> {
        let mut book = lock(&self.book);
        self.load(&mut book)?;
        self.catch_up(&mut book)?;
        queues
            .iter()
            .map(|queue| {
                let logged = book.positions.get(&queue[..]).copied().unwrap_or(0);
                let legacy =
                    super::subscription::load_position(&self.store, &self.consumer, queue)?;
                Ok(logged.max(legacy))
            })
            .collect()
    }

    /// Compacts the log (see the module docs) after [`ConsumerLog::append`] said it is due.
    /// Blocks on the store: call it on the blocking pool.
    pub fn compact(&self) -> Result<(), WireError> {
        let result = self.compact_now();
        if result.is_err() {
            // Retry once the generation has grown by as much again.
            let entries = lock(&self.writing).entries;
            self.snapshot_entries.store(entries, Ordering::Relaxed);
        }
        self.compacting.store(false, Ordering::Release);
        result
    }

    fn compact_now(&self) -> Result<(), WireError> {
        let mut book = lock(&self.book);
        self.load(&mut book)?;
        let old = {
            let mut writing = lock(&self.writing);
            let old = writing.generation;
            writing.generation = old + 1;
            writing.entries = 0;
            old
        };
        // Nothing is appended to `old` any more: read it to its end.
        self.catch_up(&mut book)?;
        debug_assert_eq!(book.generation, old);
        book.generation = old + 1;
        book.applied = 0;
        self.finish(&book, &[old])?;
        self.compactions.inc();
        Ok(())
    }

    /// Loads the book from the log once: the head's generation and its neighbours.
    fn load(&self, book: &mut Book) -> Result<(), WireError> {
        if book.loaded {
            return Ok(());
        }
        let head = match last_record(&self.store, &head_queue(&self.consumer))? {
            Some(record) => u64::from_le_bytes(
                record
                    .get(..8)
                    .and_then(|bytes| bytes.try_into().ok())
                    .ok_or_else(|| {
                        storage_error(&format!(
                            "consumer '{}': its position log head record is {} bytes, not 8",
                            self.consumer,
                            record.len()
                        ))
                    })?,
            ),
            None => 0,
        };
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
        let current = existing.last().copied().unwrap_or(head);
        for &generation in &existing {
            book.generation = generation;
            book.applied = 0;
            self.catch_up(book)?;
        }
        book.generation = current;
        lock(&self.writing).generation = current;
        let stale: Vec<u64> = existing
            .iter()
            .copied()
            .filter(|generation| *generation != current)
            .collect();
        if !stale.is_empty() || current != head {
            // An interrupted compaction: the current generation may hold only part of the
            // snapshot, so write it again before the older generations go.
            self.finish(book, &stale)?;
        }
        self.snapshot_entries
            .store(book.positions.len() as u64, Ordering::Relaxed);
        book.loaded = true;
        Ok(())
    }

    /// Reads the book's generation from where it stopped to its end (waiting for a commit
    /// round when the newest records are not readable yet) and applies it.
    fn catch_up(&self, book: &mut Book) -> Result<(), WireError> {
        let name = generation_queue(&self.consumer, book.generation);
        let mut flushed = false;
        loop {
            let Some(info) = self
                .store
                .queue_info(&name)
                .map_err(|error| storage_error(&error))?
            else {
                return Ok(());
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
                    apply_record(&mut book.positions, record).map_err(|error| {
                        storage_error(&format!(
                            "consumer '{}': a position log record is damaged ({error}); its \
                             mailboxes may start from older positions after deleting the \
                             queues named with this consumer",
                            self.consumer
                        ))
                    })?;
                }
                book.applied = batch.next_offset();
            }
            if book.applied >= info.next_offset || flushed {
                return Ok(());
            }
            // Under `always` the newest records are readable once fsynced.
            self.store.flush().map_err(write_error)?;
            flushed = true;
        }
    }

    /// Writes the book as a snapshot into its generation, waits until it is durable, points
    /// the head at it, and deletes the `stale` generations.
    fn finish(&self, book: &Book, stale: &[u64]) -> Result<(), WireError> {
        let name = generation_queue(&self.consumer, book.generation);
        let records = encode_records(
            book.positions
                .iter()
                .map(|(queue, next)| (&queue[..], *next)),
        );
        for chunk in records.chunks(64) {
            let batch: Vec<(&[u8], &[u8])> = chunk
                .iter()
                .map(|record| (name.as_slice(), record.as_slice()))
                .collect();
            self.store.append_batch(&batch).map_err(write_error)?;
        }
        self.store.flush().map_err(write_error)?;
        self.store
            .append(&head_queue(&self.consumer), &book.generation.to_le_bytes())
            .map_err(write_error)?;
        self.store.flush().map_err(write_error)?;
        for &generation in stale {
            self.store
                .delete_queue(&generation_queue(&self.consumer, generation))
                .map_err(write_error)?;
        }
        self.snapshot_entries
            .store(book.positions.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// The position logs of the consumers with open streams.
#[derive(Debug)]
pub struct PositionLogs {
    store: Arc<Store>,
    compact_entries_min: u64,
    compactions: Counter,
    logs: Mutex<(HashMap<String, Weak<ConsumerLog>>, usize)>,
}

impl PositionLogs {
    /// Logs on `store`, compacted past `compact_entries_min` entries (and twice the last
    /// snapshot); `compactions` counts compactions.
    pub fn new(store: Arc<Store>, compact_entries_min: u64, compactions: Counter) -> Self {
        Self {
            store,
            compact_entries_min,
            compactions,
            logs: Mutex::new((HashMap::new(), 64)),
        }
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
            compactions: self.compactions.clone(),
            writing: Mutex::new(Writing::default()),
            book: Mutex::new(Book::default()),
            compacting: AtomicBool::new(false),
            snapshot_entries: AtomicU64::new(0),
        });
        map.insert(consumer.to_owned(), Arc::downgrade(&log));
        log
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use levee_store::{StoreOptions, SyncPolicy};

    fn open(directory: &std::path::Path, sync: SyncPolicy) -> Arc<Store> {
        let options = StoreOptions {
            sync,
            ..StoreOptions::default()
        };
        Arc::new(Store::open(directory, options).unwrap().0)
    }

    fn logs(store: &Arc<Store>, compact_entries_min: u64) -> PositionLogs {
        PositionLogs::new(Arc::clone(store), compact_entries_min, Counter::default())
    }

    fn names(queues: &[&str]) -> Vec<Box<[u8]>> {
        queues.iter().map(|queue| queue.as_bytes().into()).collect()
    }

    fn exists(store: &Store, consumer: &str, generation: u64) -> bool {
        store
            .queue_info(&generation_queue(consumer, generation))
            .unwrap()
            .is_some()
    }

    #[test]
    fn given_entries_then_records_split_and_apply_as_the_largest_position() {
        let long = vec![b'q'; 255];
        let entries: Vec<(Vec<u8>, u64)> = (0..1_000_u64)
            .map(|index| {
                let mut name = long.clone();
                name.extend_from_slice(&index.to_le_bytes());
                name.truncate(255);
                name[..8].copy_from_slice(&index.to_le_bytes());
                (name, index)
            })
            .collect();
        let records = encode_records(entries.iter().map(|(name, next)| (&name[..], *next)));
        assert!(records.len() > 1, "264 KB of entries span several records");
        assert!(
            records
                .iter()
                .all(|record| record.len() <= RECORD_BYTES_MAX)
        );
        let mut book = HashMap::new();
        for record in &records {
            apply_record(&mut book, record).unwrap();
        }
        assert_eq!(book.len(), 1_000);
        // An older position read later changes nothing; a newer one wins.
        apply_record(
            &mut book,
            &encode_records([(&entries[5].0[..], 1)].into_iter())[0],
        )
        .unwrap();
        assert_eq!(book[&entries[5].0[..]], 5);
        apply_record(
            &mut book,
            &encode_records([(&entries[5].0[..], 9)].into_iter())[0],
        )
        .unwrap();
        assert_eq!(book[&entries[5].0[..]], 9);

        let cut = &records[0][..records[0].len() - 3];
        assert!(
            apply_record(&mut book, cut)
                .unwrap_err()
                .contains("runs past")
        );
        let mut other_version = records[0].clone();
        other_version[0] = 7;
        assert!(
            apply_record(&mut book, &other_version)
                .unwrap_err()
                .contains("version 7")
        );
    }

    #[test]
    fn given_acks_then_a_fresh_load_and_a_reopened_store_give_the_same_positions() {
        for sync in [SyncPolicy::Always, SyncPolicy::Interval { interval_ms: 5 }] {
            let directory = tempfile::tempdir().unwrap();
            let store = open(directory.path(), sync);
            let log = logs(&store, 1_000).open("app");
            assert_eq!(log.positions(&names(&["a", "b"])).unwrap(), vec![0, 0]);
            log.append([(&b"a"[..], 3), (&b"b"[..], 1)].into_iter())
                .unwrap();
            // Not waited for: under `always` loading waits for the round.
            log.append([(&b"a"[..], 5)].into_iter()).unwrap();
            let fresh = logs(&store, 1_000).open("app");
            assert_eq!(
                fresh.positions(&names(&["a", "b", "c"])).unwrap(),
                vec![5, 1, 0]
            );
            assert_eq!(
                logs(&store, 1_000)
                    .open("other")
                    .positions(&names(&["a"]))
                    .unwrap(),
                vec![0]
            );
            drop((log, fresh));
            Arc::try_unwrap(store).unwrap().close().unwrap();
            let store = open(directory.path(), sync);
            let log = logs(&store, 1_000).open("app");
            assert_eq!(
                log.positions(&names(&["a", "b"])).unwrap(),
                vec![5, 1],
                "{sync:?}"
            );
        }
    }

    #[test]
    fn given_a_position_queue_of_older_versions_then_the_larger_position_wins() {
        use super::super::subscription::{position_queue, position_record};
        let directory = tempfile::tempdir().unwrap();
        let store = open(directory.path(), SyncPolicy::Always);
        store
            .append(&position_queue("app", b"a"), &position_record(8, b"a"))
            .unwrap();
        store
            .append(&position_queue("app", b"b"), &position_record(2, b"b"))
            .unwrap();
        let log = logs(&store, 1_000).open("app");
        log.append([(&b"a"[..], 4), (&b"b"[..], 6)].into_iter())
            .unwrap();
        assert_eq!(log.positions(&names(&["a", "b"])).unwrap(), vec![8, 6]);
    }

    #[test]
    fn given_a_grown_log_then_compaction_keeps_every_position_and_bounds_the_log() {
        let directory = tempfile::tempdir().unwrap();
        let store = open(directory.path(), SyncPolicy::Interval { interval_ms: 5 });
        let compactions = Counter::default();
        let positions = PositionLogs::new(Arc::clone(&store), 100, compactions.clone());
        let log = positions.open("app");
        let queues: Vec<String> = (0..50).map(|queue| format!("queue-{queue}")).collect();
        assert_eq!(log.positions(&names(&["queue-0"])).unwrap(), vec![0]);
        let mut due_count = 0;
        for round in 1..=40_u64 {
            let entries: Vec<(&[u8], u64)> = queues
                .iter()
                .map(|queue| (queue.as_bytes(), round))
                .collect();
            let (_, due) = log.append(entries.into_iter()).unwrap();
            if due {
                due_count += 1;
                log.compact().unwrap();
            }
        }
        assert!(
            due_count >= 5,
            "40 x 50 entries against a minimum of 100: {due_count}"
        );
        assert_eq!(compactions.get(), due_count);
        let current = lock(&log.writing).generation;
        assert_eq!(current, due_count);
        for generation in 0..current {
            assert!(
                !exists(&store, "app", generation),
                "generation {generation} deleted"
            );
        }
        let size = store
            .queue_info(&generation_queue("app", current))
            .unwrap()
            .unwrap();
        assert!(
            size.next_offset < 10,
            "the log holds a snapshot and a few acks: {size:?}"
        );
        let all: Vec<Box<[u8]>> = queues.iter().map(|queue| queue.as_bytes().into()).collect();
        let fresh = logs(&store, 100).open("app");
        assert_eq!(fresh.positions(&all).unwrap(), vec![40; 50]);
    }

    #[test]
    fn given_a_compaction_cut_short_then_loading_finishes_it_without_losing_a_position() {
        let directory = tempfile::tempdir().unwrap();
        let store = open(directory.path(), SyncPolicy::Always);
        let record = |entries: &[(&str, u64)]| {
            encode_records(
                entries
                    .iter()
                    .map(|(queue, next)| (queue.as_bytes(), *next)),
            )
            .remove(0)
        };
        // Generation 0 holds everything; generation 1 got a part of the snapshot and a newer
        // ack; the head was never moved (the crash came before it).
        store
            .append(
                &generation_queue("app", 0),
                &record(&[("a", 3), ("b", 4), ("c", 5)]),
            )
            .unwrap();
        store
            .append(&generation_queue("app", 1), &record(&[("a", 3), ("b", 9)]))
            .unwrap();
        let log = logs(&store, 1_000).open("app");
        assert_eq!(
            log.positions(&names(&["a", "b", "c"])).unwrap(),
            vec![3, 9, 5]
        );
        assert!(
            !exists(&store, "app", 0),
            "the older generation goes once the snapshot is durable"
        );
        assert!(exists(&store, "app", 1));
        assert_eq!(
            last_record(&store, &head_queue("app")).unwrap().unwrap(),
            1_u64.to_le_bytes()
        );
        assert_eq!(lock(&log.writing).generation, 1);
        // A crash after the head moved but before the delete: the same again one later.
        store
            .append(&generation_queue("app", 2), &record(&[("c", 7)]))
            .unwrap();
        store
            .append(&head_queue("app"), &2_u64.to_le_bytes())
            .unwrap();
        let reloaded = logs(&store, 1_000).open("app");
        assert_eq!(
            reloaded.positions(&names(&["a", "b", "c"])).unwrap(),
            vec![3, 9, 7]
        );
        assert!(!exists(&store, "app", 1));
        assert_eq!(lock(&reloaded.writing).generation, 2);
    }

    #[test]
    fn given_streams_of_one_consumer_then_they_share_one_log_until_the_last_one_ends() {
        let directory = tempfile::tempdir().unwrap();
        let store = open(directory.path(), SyncPolicy::Always);
        let positions = logs(&store, 1_000);
        let first = positions.open("app");
        let second = positions.open("app");
        assert!(Arc::ptr_eq(&first, &second));
        assert!(!Arc::ptr_eq(&first, &positions.open("other")));
        drop((first, second));
        assert_eq!(
            positions.open("app").positions(&names(&["a"])).unwrap(),
            vec![0]
        );
    }
}
