//! Tests of the position log: acks, generations, compaction, forgets, failures.

use super::*;
use levee_store::{StoreOptions, SyncPolicy};

impl ConsumerLog {
    /// Next offsets only.
    fn nexts(&self, queues: &[Box<[u8]>]) -> Result<Vec<u64>, WireError> {
        Ok(self
            .positions(queues)?
            .into_iter()
            .map(|position| position.next)
            .collect())
    }

    /// Acks as a stream does: each in its queue's epoch (the book's entry's, or its floor
    /// epoch), as far as the book has been read.
    fn ack<'a>(
        &self,
        entries: impl ExactSizeIterator<Item = (&'a [u8], u64)>,
    ) -> Result<(Option<CommitTicket>, bool), WireError> {
        let stamped: Vec<(&[u8], u64, u64)> = {
            let book = lock(&self.book);
            entries
                .map(|(queue, next)| {
                    let epoch = book
                        .positions
                        .get(queue)
                        .map_or(book.floor_epoch, |position| position.epoch);
                    (queue, epoch, next)
                })
                .collect()
        };
        self.append(stamped.into_iter())
    }
}

fn open(directory: &std::path::Path, sync: SyncPolicy) -> Arc<Store> {
    let options = StoreOptions {
        sync,
        ..StoreOptions::default()
    };
    Arc::new(Store::open(directory, options).unwrap().0)
}

/// Unloaded records before a forget compacts, in tests: a few, so that the path runs.
const TEST_UNLOADED_RECORDS_MAX: u64 = 16;

fn logs(store: &Arc<Store>, compact_entries_min: u64) -> PositionLogs {
    PositionLogs::new(Arc::clone(store), compact_entries_min, Counter::default())
        .with_unloaded_records_max(TEST_UNLOADED_RECORDS_MAX)
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
fn given_acks_then_a_fresh_load_and_a_reopened_store_give_the_same_positions() {
    for sync in [SyncPolicy::Always, SyncPolicy::Interval { interval_ms: 5 }] {
        let directory = tempfile::tempdir().unwrap();
        let store = open(directory.path(), sync);
        let log = logs(&store, 1_000).open("app");
        assert_eq!(log.nexts(&names(&["a", "b"])).unwrap(), vec![0, 0]);
        log.ack([(&b"a"[..], 3), (&b"b"[..], 1)].into_iter())
            .unwrap();
        // Not waited for: under `always` loading waits for the round.
        log.ack([(&b"a"[..], 5)].into_iter()).unwrap();
        let fresh = logs(&store, 1_000).open("app");
        assert_eq!(
            fresh.nexts(&names(&["a", "b", "c"])).unwrap(),
            vec![5, 1, 0]
        );
        assert_eq!(
            logs(&store, 1_000)
                .open("other")
                .nexts(&names(&["a"]))
                .unwrap(),
            vec![0]
        );
        drop((log, fresh));
        Arc::try_unwrap(store).unwrap().close().unwrap();
        let store = open(directory.path(), sync);
        let log = logs(&store, 1_000).open("app");
        assert_eq!(
            log.nexts(&names(&["a", "b"])).unwrap(),
            vec![5, 1],
            "{sync:?}"
        );
    }
}

#[test]
fn given_a_position_queue_of_older_versions_then_the_larger_position_wins() {
    use crate::queue::mailbox::subscription::position_queue;
    use levee_broker::position::encode_queue_position;
    let directory = tempfile::tempdir().unwrap();
    let store = open(directory.path(), SyncPolicy::Always);
    store
        .append(
            &position_queue("app", b"a"),
            &encode_queue_position(8, b"a"),
        )
        .unwrap();
    store
        .append(
            &position_queue("app", b"b"),
            &encode_queue_position(2, b"b"),
        )
        .unwrap();
    let log = logs(&store, 1_000).open("app");
    log.ack([(&b"a"[..], 4), (&b"b"[..], 6)].into_iter())
        .unwrap();
    assert_eq!(log.nexts(&names(&["a", "b"])).unwrap(), vec![8, 6]);
}

#[test]
fn given_a_grown_log_then_compaction_keeps_every_position_and_bounds_the_log() {
    let directory = tempfile::tempdir().unwrap();
    let store = open(directory.path(), SyncPolicy::Interval { interval_ms: 5 });
    let compactions = Counter::default();
    let positions = PositionLogs::new(Arc::clone(&store), 100, compactions.clone())
        .with_unloaded_records_max(TEST_UNLOADED_RECORDS_MAX);
    let log = positions.open("app");
    let queues: Vec<String> = (0..50).map(|queue| format!("queue-{queue}")).collect();
    for queue in &queues {
        store.append(queue.as_bytes(), b"m").unwrap();
    }
    assert_eq!(log.nexts(&names(&["queue-0"])).unwrap(), vec![0]);
    let mut due_count = 0;
    for round in 1..=40_u64 {
        let entries: Vec<(&[u8], u64)> = queues
            .iter()
            .map(|queue| (queue.as_bytes(), round))
            .collect();
        let (_, due) = log.ack(entries.into_iter()).unwrap();
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
    assert_eq!(fresh.nexts(&all).unwrap(), vec![40; 50]);
}

#[test]
fn given_deleted_queues_then_compaction_drops_their_positions_and_keeps_the_rest() {
    let directory = tempfile::tempdir().unwrap();
    let store = open(directory.path(), SyncPolicy::Always);
    let log = logs(&store, 1).open("app");
    for queue in ["kept", "deleted", "recreated"] {
        store.append(queue.as_bytes(), b"m").unwrap();
    }
    let entries: [(&[u8], u64); 3] = [(b"kept", 7), (b"deleted", 8), (b"recreated", 9)];
    log.ack(entries.into_iter()).unwrap();
    assert!(store.delete_queue(b"deleted").unwrap());
    assert!(store.delete_queue(b"recreated").unwrap());
    store.append(b"recreated", b"new").unwrap();
    log.compact().unwrap();
    let queues = names(&["kept", "deleted", "recreated"]);
    // "recreated" exists at the compaction, so its old position stays: deleted here
    // without the server's forget (see the test of deletes below).
    assert_eq!(log.nexts(&queues).unwrap(), vec![7, 0, 9]);
    assert_eq!(log.snapshot_entries.load(Ordering::Relaxed), 2);
    // A fresh load (a restart) reads the snapshot: the dropped position stays dropped.
    let fresh = logs(&store, 1).open("app");
    assert_eq!(fresh.nexts(&queues).unwrap(), vec![7, 0, 9]);
}

#[test]
fn given_a_compaction_cut_short_then_loading_finishes_it_without_losing_a_position() {
    let directory = tempfile::tempdir().unwrap();
    let store = open(directory.path(), SyncPolicy::Always);
    let record = |entries: &[(&str, u64)]| {
        encode_log_records(
            entries
                .iter()
                .map(|(queue, next)| (queue.as_bytes(), *next)),
            0,
            RECORD_BYTES_MAX,
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
    assert_eq!(log.nexts(&names(&["a", "b", "c"])).unwrap(), vec![3, 9, 5]);
    assert!(
        exists(&store, "app", 0),
        "kept until a snapshot replaces it"
    );
    // The interrupted compaction is due at the first ack and finishes without a switch.
    let (_, due) = log.ack([(&b"d"[..], 1)].into_iter()).unwrap();
    assert!(due);
    log.compact().unwrap();
    assert!(
        !exists(&store, "app", 0),
        "the older generation goes once the snapshot is durable"
    );
    assert!(exists(&store, "app", 1));
    let head = last_record(&store, &head_queue("app")).unwrap().unwrap();
    assert_eq!(
        head[..8],
        1_u64.to_le_bytes(),
        "the head names generation 1"
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
        reloaded.nexts(&names(&["a", "b", "c", "d"])).unwrap(),
        vec![3, 9, 7, 1]
    );
    let (_, due) = reloaded.ack([(&b"d"[..], 2)].into_iter()).unwrap();
    assert!(due);
    reloaded.compact().unwrap();
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
        positions.open("app").nexts(&names(&["a"])).unwrap(),
        vec![0]
    );
}

// Failure paths found in review: a compaction that fails (a full disk) or cannot write.
use levee_store::{Fault, SimulatedDisk};

fn sim_store(disk: &SimulatedDisk) -> Arc<Store> {
    let options = StoreOptions {
        sync: SyncPolicy::Always,
        ..StoreOptions::default()
    };
    Arc::new(
        Store::open_with_storage(Arc::new(disk.clone()), options)
            .unwrap()
            .0,
    )
}

/// An ack as `MailboxAcks` does it under `always`: append, then answered once durable.
fn durable_ack(store: &Store, log: &ConsumerLog, queue: &str, next: u64) {
    let (ticket, _) = log.ack([(queue.as_bytes(), next)].into_iter()).unwrap();
    store.wait_durable(ticket.unwrap()).unwrap();
}

/// A store on `disk` with queues "a", "b" and "c" (compaction keeps only the positions of
/// queues that exist), a consumer's log compacted at every ack, and "a" acked through 0.
fn acked_once(disk: &SimulatedDisk) -> (Arc<Store>, Arc<ConsumerLog>) {
    let store = sim_store(disk);
    for queue in ["a", "b", "c"] {
        store.append(queue.as_bytes(), b"m").unwrap();
    }
    let log = logs(&store, 1).open("app");
    assert_eq!(log.nexts(&names(&["a"])).unwrap(), vec![0]);
    durable_ack(&store, &log, "a", 1);
    (store, log)
}

/// Space is back: one successful round clears the store's full-disk flag.
fn space_returns(disk: &SimulatedDisk, store: &Store) {
    disk.set_fault(Fault::None);
    for _ in 0..10 {
        if store.sync().is_ok() {
            return;
        }
    }
    panic!("the store did not recover");
}

#[test]
fn given_two_failed_compactions_then_a_reload_keeps_every_answered_ack() {
    let disk = SimulatedDisk::new();
    let (store, log) = acked_once(&disk);
    // Compaction 0 -> 1 fails writing the snapshot (full disk): head stays 0.
    disk.set_fault(Fault::NoSpace);
    assert!(log.compact().is_err());
    space_returns(&disk, &store);
    durable_ack(&store, &log, "b", 2); // goes to generation 1
    // The retry fails the same way: acks stay on generation 1 (no second switch while
    // generation 0 is still on disk), the head on 0.
    disk.set_fault(Fault::NoSpace);
    assert!(log.compact().is_err());
    space_returns(&disk, &store);
    durable_ack(&store, &log, "c", 3); // answered
    assert_eq!(lock(&log.writing).generation, 1);
    assert_eq!(log.nexts(&names(&["a", "b", "c"])).unwrap(), vec![1, 2, 3]);
    drop(log); // the consumer's last stream ends; it comes back (or the server restarts)
    let back = logs(&store, 1).open("app");
    assert_eq!(
        back.nexts(&names(&["a", "b", "c"])).unwrap(),
        vec![1, 2, 3],
        "a reload keeps every answered ack"
    );
}

#[test]
fn given_a_failed_then_a_good_compaction_then_no_generation_is_left_behind() {
    let disk = SimulatedDisk::new();
    let (store, log) = acked_once(&disk);
    disk.set_fault(Fault::NoSpace);
    assert!(log.compact().is_err());
    space_returns(&disk, &store);
    durable_ack(&store, &log, "b", 2);
    log.compact().unwrap(); // finishes the first: head 1, generation 0 deleted
    assert_eq!(lock(&log.writing).generation, 1);
    assert!(!exists(&store, "app", 0));
    drop(log);
    let back = logs(&store, 1).open("app");
    back.nexts(&names(&["a"])).unwrap();
    assert!(
        !exists(&store, "app", 0),
        "generation 0 (a whole log's worth of entries) is deleted"
    );
}

/// A catch-up error inside `compact_now` (here: a flush failing on a full disk while an
/// ack's round is in flight) leaves `writing` on old+1 and the book on old: adds and the
/// next compaction still read both.
#[test]
fn given_a_compaction_failing_in_its_catch_up_then_later_acks_are_seen_and_kept() {
    for _ in 0..2_000 {
        let disk = SimulatedDisk::new();
        let (store, log) = acked_once(&disk);
        disk.set_fault(Fault::NoSpace);
        // An ack whose round fails (it is answered with an error).
        let records: Vec<(&[u8], u64)> = (0..2_000).map(|_| (&b"a"[..], 2)).collect();
        let _ = log.ack(records.into_iter());
        let result = log.compact();
        space_returns(&disk, &store);
        let (book_generation, writing_generation) =
            (lock(&log.book).generation, lock(&log.writing).generation);
        if book_generation == writing_generation {
            continue; // the round failed before the catch-up looked: not this interleaving
        }
        assert!(result.is_err());
        durable_ack(&store, &log, "b", 5); // to generation 1, answered
        let seen = log.nexts(&names(&["b"])).unwrap();
        assert_eq!(
            seen,
            vec![5],
            "an add after the failed compaction sees b's ack"
        );
        log.compact().unwrap();
        assert!(!exists(&store, "app", 0));
        drop(log);
        let back = logs(&store, 1)
            .open("app")
            .nexts(&names(&["a", "b"]))
            .unwrap();
        assert_eq!(
            back,
            vec![1, 5],
            "the acked positions survive the compaction"
        );
        return;
    }
    panic!("interleaving never hit");
}

/// A store whose messages are at most `message_bytes_max`, a loaded log on it, and
/// `count` mailbox queues (one message each).
fn limited(
    directory: &std::path::Path,
    message_bytes_max: usize,
    count: usize,
) -> (Arc<Store>, Arc<ConsumerLog>, Vec<String>) {
    let options = StoreOptions {
        sync: SyncPolicy::Always,
        message_bytes_max,
        ..StoreOptions::default()
    };
    let store = Arc::new(Store::open(directory, options).unwrap().0);
    let log = logs(&store, 1_000).open("app");
    log.nexts(&names(&["a"])).unwrap();
    let queues: Vec<String> = (0..count)
        .map(|index| format!("user-mailbox-{index:08}"))
        .collect();
    let created: Vec<(&[u8], &[u8])> = queues
        .iter()
        .map(|queue| (queue.as_bytes(), &b"m"[..]))
        .collect();
    store.append_batch(&created).unwrap();
    (store, log, queues)
}

#[test]
fn given_a_small_message_limit_then_ack_batches_fit_in_records() {
    let directory = tempfile::tempdir().unwrap();
    // 200 mailboxes of 20-byte names: 5.8 KB of entries, more than one message holds.
    let (_store, log, queues) = limited(directory.path(), 4_096, 200);
    let entries: Vec<(&[u8], u64)> = queues.iter().map(|queue| (queue.as_bytes(), 1)).collect();
    let result = log.ack(entries.into_iter());
    assert!(result.is_ok(), "{:?}", result.err());
}

#[test]
fn given_a_16k_message_limit_then_compactions_succeed_and_a_reload_keeps_positions() {
    let directory = tempfile::tempdir().unwrap();
    let (store, log, queues) = limited(directory.path(), 16 << 10, 1_000);
    let mut compactions = 0;
    for round in 1..=10_u64 {
        for chunk in queues.chunks(100) {
            let entries: Vec<(&[u8], u64)> = chunk
                .iter()
                .map(|queue| (queue.as_bytes(), round))
                .collect();
            let (ticket, due) = log.ack(entries.into_iter()).unwrap();
            store.wait_durable(ticket.unwrap()).unwrap();
            if due {
                log.compact().unwrap();
                compactions += 1;
            }
        }
    }
    assert!(compactions >= 3, "{compactions}");
    drop(log);
    let all: Vec<Box<[u8]>> = queues.iter().map(|queue| queue.as_bytes().into()).collect();
    let back = logs(&store, 1_000).open("app").nexts(&all).unwrap();
    assert_eq!(back, vec![10; 1_000], "acked positions after a reload");
}

// Adds and compactions while other streams of the consumer ack.

/// `threads` streams of the consumer acking "a"-queues as `MailboxAcks` does under
/// `always` (append, then wait for durability), until `stop`.
fn ackers(
    store: &Arc<Store>,
    log: &Arc<ConsumerLog>,
    threads: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..threads)
        .map(|thread| {
            let (store, log, stop) = (Arc::clone(store), Arc::clone(log), Arc::clone(stop));
            std::thread::spawn(move || {
                let queue = format!("acked-{thread}");
                let mut next = 1;
                while !stop.load(Ordering::Relaxed) {
                    let (ticket, _) = log.ack([(queue.as_bytes(), next)].into_iter()).unwrap();
                    store.wait_durable(ticket.unwrap()).unwrap();
                    next += 1;
                }
            })
        })
        .collect()
}

/// Runs `call` `times` times while four streams of the consumer ack; its errors.
fn failures_while_acking(
    times: usize,
    call: impl Fn(&ConsumerLog) -> Result<(), WireError>,
) -> Vec<String> {
    let directory = tempfile::tempdir().unwrap();
    let store = open(directory.path(), SyncPolicy::Always);
    let log = logs(&store, 1_000_000).open("app");
    log.nexts(&names(&["a"])).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let threads = ackers(&store, &log, 4, &stop);
    let failures = (0..times)
        .filter_map(|_| call(&log).err().map(|error| error.message))
        .collect();
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().unwrap();
    }
    failures
}

#[test]
fn given_acks_on_another_stream_then_an_add_does_not_fail() {
    let failures = failures_while_acking(300, |log| log.nexts(&names(&["b"])).map(drop));
    assert!(
        failures.is_empty(),
        "{} of 300 adds failed: {:?}",
        failures.len(),
        failures.first()
    );
}

#[test]
fn given_steady_acks_then_compaction_succeeds() {
    let failures = failures_while_acking(100, ConsumerLog::compact);
    assert!(
        failures.is_empty(),
        "{} of 100 compactions failed: {:?}",
        failures.len(),
        failures.first()
    );
}

/// A store in `directory` holding one message in each of `queues`.
fn store_with(directory: &std::path::Path, sync: SyncPolicy, queues: &[&str]) -> Arc<Store> {
    let store = open(directory, sync);
    for queue in queues {
        store.append(queue.as_bytes(), b"m").unwrap();
    }
    store
}

/// Deletes `queue` the way the server does: forget, then the store's delete.
fn delete(store: &Store, positions: &PositionLogs, queue: &[u8]) {
    let _count = positions.counting_delete();
    positions.forget(queue).unwrap();
    assert!(store.delete_queue(queue).unwrap());
}

#[test]
fn given_a_queue_deleted_and_created_again_then_every_consumer_starts_it_from_its_start() {
    use crate::queue::mailbox::subscription::position_queue;
    use levee_broker::position::encode_queue_position;
    for sync in [SyncPolicy::Always, SyncPolicy::Interval { interval_ms: 5 }] {
        let directory = tempfile::tempdir().unwrap();
        let store = store_with(directory.path(), sync, &["orders", "kept"]);
        {
            // "idle" acked on an earlier run and has no stream now; "single" has a
            // single subscription's position queue only.
            let positions = logs(&store, 1_000);
            let idle = positions.open("idle");
            assert_eq!(idle.nexts(&names(&["orders"])).unwrap(), vec![0]);
            idle.ack([(&b"orders"[..], 500), (&b"kept"[..], 4)].into_iter())
                .unwrap();
        }
        store
            .append(
                &position_queue("single", b"orders"),
                &encode_queue_position(300, b"orders"),
            )
            .unwrap();
        // A restart: the consumers are found in the store.
        let positions = logs(&store, 1_000);
        let live = positions.open("live");
        assert_eq!(live.nexts(&names(&["orders"])).unwrap(), vec![0]);
        live.ack([(&b"orders"[..], 200)].into_iter()).unwrap();
        assert_eq!(positions.deletes(), 0);
        delete(&store, &positions, b"orders");
        assert_eq!(positions.deletes(), 1);
        store.append(b"orders", b"new").unwrap();
        assert!(
            store
                .queue_info(&position_queue("single", b"orders"))
                .unwrap()
                .is_none(),
            "the single subscription's position queue is deleted"
        );
        let both = names(&["orders", "kept"]);
        for consumer in ["idle", "live", "single"] {
            assert_eq!(
                positions.open(consumer).nexts(&both).unwrap()[0],
                0,
                "{consumer} {sync:?}"
            );
        }
        assert_eq!(live.nexts(&both).unwrap(), vec![0, 0], "loaded log");
        assert_eq!(
            positions.open("idle").nexts(&both).unwrap(),
            vec![0, 4],
            "other queues keep their positions"
        );
        // Acks after the delete count again, also after a compaction and a restart.
        live.ack([(&b"orders"[..], 1)].into_iter()).unwrap();
        assert_eq!(live.nexts(&both).unwrap(), vec![1, 0]);
        live.compact().unwrap();
        drop((live, positions));
        Arc::try_unwrap(store).unwrap().close().unwrap();
        let store = open(directory.path(), sync);
        let positions = logs(&store, 1_000);
        assert_eq!(positions.open("live").nexts(&both).unwrap(), vec![1, 0]);
        assert_eq!(positions.open("idle").nexts(&both).unwrap(), vec![0, 4]);
        // The epoch survived the restart: an ack now outranks the forget too (a stream
        // reads positions when it adds the queue, then acks).
        let idle = positions.open("idle");
        assert_eq!(idle.nexts(&both).unwrap(), vec![0, 4]);
        idle.ack([(&b"orders"[..], 1)].into_iter()).unwrap();
        assert_eq!(idle.nexts(&both).unwrap(), vec![1, 4], "{sync:?}");
    }
}

#[test]
fn given_positions_in_several_epochs_then_a_snapshot_keeps_each_entry_in_its_epoch() {
    let directory = tempfile::tempdir().unwrap();
    let store = store_with(directory.path(), SyncPolicy::Always, &["a", "b", "c"]);
    let positions = logs(&store, 1_000);
    let log = positions.open("app");
    assert_eq!(log.nexts(&names(&["a"])).unwrap(), vec![0]);
    log.ack([(&b"a"[..], 7), (&b"b"[..], 8)].into_iter())
        .unwrap();
    delete(&store, &positions, b"b");
    store.append(b"b", b"m").unwrap();
    // "c" has no entry: its acks are in the book's floor epoch, the epoch when it was
    // loaded (a delete since does not change it until a compaction).
    assert_eq!(
        log.positions(&names(&["c"])).unwrap(),
        vec![Position { epoch: 0, next: 0 }]
    );
    log.ack([(&b"c"[..], 9)].into_iter()).unwrap();
    log.compact().unwrap();
    let fresh = logs(&store, 1_000).open("app");
    let all = names(&["a", "b", "c"]);
    // Not "b" yet: a lookup of a queue without an entry pins one in memory.
    assert_eq!(fresh.nexts(&names(&["a", "c"])).unwrap(), vec![7, 9]);
    {
        let book = lock(&fresh.book);
        assert_eq!(
            book.positions.get(b"a"),
            Some(Position { epoch: 0, next: 7 })
        );
        assert_eq!(
            book.positions.get(b"c"),
            Some(Position { epoch: 0, next: 9 })
        );
        assert_eq!(book.floor_epoch, 1, "the epoch when it was loaded");
        assert!(
            book.positions.get(b"b").is_none(),
            "the snapshot leaves the forget out"
        );
    }
    // Without the forget, "b"'s acks are in the floor epoch (the current one since the
    // compaction): they count.
    assert_eq!(fresh.nexts(&all).unwrap(), vec![7, 0, 9]);
    fresh.ack([(&b"b"[..], 1)].into_iter()).unwrap();
    assert_eq!(fresh.nexts(&all).unwrap(), vec![7, 1, 9]);
    assert_eq!(
        logs(&store, 1_000).open("app").nexts(&all).unwrap(),
        vec![7, 1, 9]
    );
}

#[test]
fn given_two_streams_of_a_consumer_and_a_delete_between_their_acks_then_the_position_only_grows() {
    let directory = tempfile::tempdir().unwrap();
    let store = store_with(directory.path(), SyncPolicy::Always, &["q", "other"]);
    let positions = logs(&store, 1_000);
    let log = positions.open("app");
    // Both streams add "q" (the epoch is read then), one acks far, another queue is
    // deleted, the lagging one acks less: the larger position stays.
    let queues = names(&["q"]);
    let first = log.positions(&queues).unwrap()[0];
    let second = log.positions(&queues).unwrap()[0];
    log.append([(&b"q"[..], first.epoch, 100)].into_iter())
        .unwrap();
    delete(&store, &positions, b"other");
    log.append([(&b"q"[..], second.epoch, 10)].into_iter())
        .unwrap();
    assert_eq!(log.nexts(&queues).unwrap(), vec![100]);
    assert_eq!(
        logs(&store, 1_000).open("app").nexts(&queues).unwrap(),
        vec![100]
    );
    // A stream adding it after the delete finds its entry and acks in its epoch.
    assert_eq!(
        log.positions(&queues).unwrap()[0],
        Position {
            epoch: 0,
            next: 100
        }
    );
    // The same for a queue without an entry yet: the first add pins its epoch, so the
    // two streams ack in one epoch though a delete raised the current one in between.
    store.append(b"fresh", b"m").unwrap();
    store.append(b"other", b"m").unwrap();
    let fresh = names(&["fresh"]);
    let first = log.positions(&fresh).unwrap()[0];
    delete(&store, &positions, b"other");
    let second = log.positions(&fresh).unwrap()[0];
    assert_eq!(first, second);
    log.append([(&b"fresh"[..], second.epoch, 5)].into_iter())
        .unwrap();
    log.append([(&b"fresh"[..], first.epoch, 1_000)].into_iter())
        .unwrap();
    assert_eq!(
        logs(&store, 1_000).open("app").nexts(&fresh).unwrap(),
        vec![1_000]
    );
}

#[test]
fn given_a_consumer_that_never_comes_back_then_forgets_do_not_grow_its_log_for_good() {
    let directory = tempfile::tempdir().unwrap();
    let store = store_with(
        directory.path(),
        SyncPolicy::Interval { interval_ms: 5 },
        &["kept"],
    );
    {
        let log = logs(&store, 1_000).open("gone");
        assert_eq!(log.nexts(&names(&["kept"])).unwrap(), vec![0]);
        log.ack([(&b"kept"[..], 1)].into_iter()).unwrap();
    }
    let positions = logs(&store, 1_000);
    for index in 0..3 * TEST_UNLOADED_RECORDS_MAX {
        let queue = format!("session-{index}");
        store.append(queue.as_bytes(), b"m").unwrap();
        delete(&store, &positions, queue.as_bytes());
    }
    let log = logs(&store, 1_000).open("gone");
    assert_eq!(log.nexts(&names(&["kept"])).unwrap(), vec![1]);
    let generation = lock(&log.writing).generation;
    assert!(
        generation >= 2,
        "compacted as forgets came: generation {generation}"
    );
    let records = store
        .queue_info(&generation_queue("gone", generation))
        .unwrap()
        .unwrap()
        .next_offset;
    assert!(
        records <= TEST_UNLOADED_RECORDS_MAX + 1,
        "{records} records in the current generation"
    );
    let entries = lock(&log.book).positions.len();
    assert!(
        entries <= 1 + usize::try_from(TEST_UNLOADED_RECORDS_MAX).unwrap(),
        "forgets since the last compaction only: {entries} entries"
    );
}

#[test]
fn given_a_log_compacted_to_a_later_generation_and_not_loaded_then_a_forget_reaches_it() {
    let directory = tempfile::tempdir().unwrap();
    let store = store_with(directory.path(), SyncPolicy::Always, &["q"]);
    {
        let positions = logs(&store, 1);
        let log = positions.open("app");
        assert_eq!(log.nexts(&names(&["q"])).unwrap(), vec![0]);
        let mut compactions = 0;
        for next in 1..=20 {
            let (_, due) = log.ack([(&b"q"[..], next)].into_iter()).unwrap();
            if due {
                log.compact().unwrap();
                compactions += 1;
            }
            if compactions == 3 {
                break;
            }
        }
        assert_eq!(lock(&log.writing).generation, 3);
    }
    let positions = logs(&store, 1);
    delete(&store, &positions, b"q");
    store.append(b"q", b"new").unwrap();
    assert_eq!(
        logs(&store, 1).open("app").nexts(&names(&["q"])).unwrap(),
        vec![0],
        "the forget went to the generation the head names"
    );
}

#[test]
fn given_an_idle_consumer_with_a_large_snapshot_then_deletes_compact_it_only_as_forgets_pile_up() {
    let directory = tempfile::tempdir().unwrap();
    let (store, log, queues) = limited(directory.path(), 1_024, 2_000);
    let entries: Vec<(&[u8], u64)> = queues.iter().map(|queue| (queue.as_bytes(), 1)).collect();
    log.ack(entries.into_iter()).unwrap();
    log.compact().unwrap();
    let (_, snapshot) = log.head().unwrap();
    assert!(
        snapshot > TEST_UNLOADED_RECORDS_MAX,
        "the snapshot alone spans {snapshot} records"
    );
    drop(log);
    let compactions = Counter::default();
    let positions = PositionLogs::new(Arc::clone(&store), 1_000, compactions.clone())
        .with_unloaded_records_max(TEST_UNLOADED_RECORDS_MAX);
    let deletes = usize::try_from(TEST_UNLOADED_RECORDS_MAX).unwrap() - 2;
    for queue in &queues[..deletes] {
        delete(&store, &positions, queue.as_bytes());
    }
    assert_eq!(compactions.get(), 0, "{deletes} forgets: not yet");
    for queue in &queues[deletes..deletes + 4] {
        delete(&store, &positions, queue.as_bytes());
    }
    assert_eq!(compactions.get(), 1, "once the forgets reached the limit");
    let all: Vec<Box<[u8]>> = queues.iter().map(|queue| queue.as_bytes().into()).collect();
    let nexts = positions.open("app").nexts(&all).unwrap();
    assert_eq!(
        nexts[..deletes + 4]
            .iter()
            .filter(|next| **next != 0)
            .count(),
        0
    );
    assert!(nexts[deletes + 4..].iter().all(|next| *next == 1));
}
