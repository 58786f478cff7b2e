//! Behaviour of the public API: bad input, reopening, refusing foreign directories, torn and
//! damaged tails, deletes, retention, listing, a full disk, fatal I/O errors.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use levee_store::{
    CrashMode, Fault, InputError, OpenError, OptionsError, Retention, SimulatedDisk, Storage,
    StorageFile, Store, StoreOptions, SyncPolicy, WriteError, format,
};

fn tiny() -> StoreOptions {
    StoreOptions {
        segment_bytes_max: 4096,
        chunk_bytes: 64,
        buffer_budget_bytes: 4096,
        message_bytes_max: 1024,
        round_write_bytes: 256,
        ..StoreOptions::default()
    }
}

fn open_sim(disk: &SimulatedDisk, options: StoreOptions) -> Store {
    Store::open_with_storage(Arc::new(disk.clone()), options)
        .expect("open")
        .0
}

fn read_all(store: &Store, queue: &[u8]) -> Vec<Vec<u8>> {
    let mut messages = Vec::new();
    let mut offset = 0;
    loop {
        let batch = store.read(queue, offset, 1000, usize::MAX).unwrap();
        if batch.is_empty() {
            return messages;
        }
        messages.extend(batch.iter().map(<[u8]>::to_vec));
        offset = batch.next_offset();
    }
}

/// Retries an append refused for a full disk until the store takes it (at most 5 s).
fn append_once_space_returns(store: &Store, queue: &[u8], message: &[u8]) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while store.append(queue, message).is_err() {
        assert!(std::time::Instant::now() < deadline, "writes never resumed");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

#[test]
fn given_appends_when_reading_should_return_dense_offsets_and_respect_limits() {
    let directory = tempfile::tempdir().unwrap();
    let (store, report) = Store::open(directory.path(), tiny()).unwrap();
    assert_eq!(report.queues, 0);
    for index in 0..100_u64 {
        let message = format!("message {index}");
        assert_eq!(store.append(b"orders", message.as_bytes()).unwrap(), index);
    }
    let batch = store.read(b"orders", 10, 5, usize::MAX).unwrap();
    assert_eq!(batch.first_offset, 10);
    assert_eq!(batch.len(), 5);
    assert_eq!(batch.message(0), Some(&b"message 10"[..]));
    assert_eq!(batch.next_offset(), 15);
    let small = store.read(b"orders", 0, 100, 25).unwrap();
    assert_eq!(
        small.len(),
        2,
        "two 9-10 byte messages fit in 25 bytes, three do not"
    );
    let one = store.read(b"orders", 0, 100, 1).unwrap();
    assert_eq!(one.len(), 1, "a read returns at least one message");
    assert!(store.read(b"orders", 100, 10, 1000).unwrap().is_empty());
    assert!(store.read(b"orders", 5000, 10, 1000).unwrap().is_empty());
    assert!(store.read(b"unknown", 0, 10, 1000).unwrap().is_empty());
    let info = store.queue_info(b"orders").unwrap().unwrap();
    assert_eq!(
        (info.first_offset, info.next_offset, info.retained()),
        (0, 100, 100)
    );
    assert!(store.stats().segments > 1, "tiny segments rotate");
    store.close().unwrap();
    let (store, report) = Store::open(directory.path(), tiny()).unwrap();
    assert_eq!((report.queues, report.messages), (1, 100));
    assert!(report.truncated.is_empty());
    let messages = read_all(&store, b"orders");
    assert_eq!(messages.len(), 100);
    assert_eq!(messages[99], b"message 99");
}

#[test]
fn given_bad_input_when_appending_should_refuse_with_clear_errors() {
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, tiny());
    assert_eq!(
        store.append(b"", b"x"),
        Err(WriteError::Input(InputError::QueueName(0)))
    );
    let long = vec![b'q'; 256];
    assert_eq!(
        store.append(&long, b"x"),
        Err(WriteError::Input(InputError::QueueName(256)))
    );
    assert!(store.append(&long[..255], b"x").is_ok());
    let big = vec![0; 1025];
    let error = store.append(b"q", &big).unwrap_err();
    assert_eq!(
        error.to_string(),
        "message of 1025 bytes is over message_bytes_max (1024)"
    );
    assert!(
        store.append(b"q", &big[..1024]).is_ok(),
        "a message may be larger than a chunk"
    );
    assert!(store.append(b"q", b"").is_ok(), "empty messages are fine");
    assert_eq!(read_all(&store, b"q"), vec![vec![0; 1024], Vec::new()]);
    let batch: Vec<(&[u8], &[u8])> = vec![(b"a", b"1"), (b"", b"2")];
    assert!(store.append_batch(&batch).is_err());
    assert!(
        store.queue_info(b"a").unwrap().is_none(),
        "a refused batch stores nothing"
    );
}

#[test]
fn given_directory_of_other_files_when_opening_should_refuse_and_say_what_was_found() {
    let directory = tempfile::tempdir().unwrap();
    std::fs::write(directory.path().join("notes.txt"), b"hello").unwrap();
    let error = Store::open(directory.path(), tiny()).unwrap_err();
    assert!(matches!(error, OpenError::NotAStore { .. }));
    assert!(error.to_string().contains("notes.txt"), "{error}");

    let disk = SimulatedDisk::new();
    disk.put_file(
        &format::segment_file_name(1),
        b"PK\x03\x04 this is a zip file, not a segment",
    );
    let error = Store::open_with_storage(Arc::new(disk), tiny()).unwrap_err();
    assert!(error.to_string().contains("not a Levee segment"), "{error}");
}

#[test]
fn given_segment_of_another_version_when_opening_should_refuse_with_versions() {
    let disk = SimulatedDisk::new();
    let mut header = format::encode_segment_header(1);
    let newer = format::FORMAT_VERSION + 1;
    header[8..12].copy_from_slice(&newer.to_le_bytes());
    disk.put_file(&format::segment_file_name(1), &header);
    let error = Store::open_with_storage(Arc::new(disk), tiny()).unwrap_err();
    assert!(
        matches!(
            error,
            OpenError::UnsupportedVersion { found, supported, .. }
                if found == newer && supported == format::FORMAT_VERSION
        ),
        "{error:?}"
    );
    assert!(
        error
            .to_string()
            .contains(&format!("format version {newer}")),
        "{error}"
    );
}

#[test]
fn given_torn_tail_when_reopening_should_truncate_report_and_keep_synced_data() {
    let disk = SimulatedDisk::new();
    let store = open_sim(
        &disk,
        StoreOptions {
            segment_bytes_max: 1 << 20,
            ..tiny()
        },
    );
    for index in 0..20_u32 {
        store.append(b"q", &index.to_le_bytes()).unwrap();
    }
    drop(store);
    let name = format::segment_file_name(1);
    let mut bytes = disk.file_bytes(&name).unwrap();
    let intact = bytes.len();
    // Half a record of garbage at the end, as a torn write leaves it.
    bytes.extend_from_slice(&[0x11, 0, 0, 0, 200, 0, 0, 0, 1, 2, 3]);
    disk.put_file(&name, &bytes);
    let (store, report) = Store::open_with_storage(Arc::new(disk.clone()), tiny()).unwrap();
    assert_eq!(report.truncated.len(), 1);
    assert_eq!(report.truncated[0].position, intact as u64);
    assert_eq!(report.truncated[0].bytes_dropped, 11);
    assert_eq!(read_all(&store, b"q").len(), 20);
    store.append(b"q", b"after").unwrap();
    drop(store);
    let (store, report) = Store::open_with_storage(Arc::new(disk), tiny()).unwrap();
    assert!(report.truncated.is_empty(), "the cut is durable");
    assert_eq!(read_all(&store, b"q").last().unwrap(), b"after");
}

#[test]
fn given_flipped_byte_when_reopening_should_never_serve_it() {
    let disk = SimulatedDisk::new();
    let options = StoreOptions {
        segment_bytes_max: 1 << 20,
        ..tiny()
    };
    let store = open_sim(&disk, options.clone());
    for index in 0..10_u32 {
        store
            .append(b"q", format!("payload-{index}").as_bytes())
            .unwrap();
    }
    drop(store);
    let name = format::segment_file_name(1);
    let length = disk.file_bytes(&name).unwrap().len();
    // Every message is in a log batch record (kind 6) and, after the checkpoint at close, in a
    // chunk too: damage before the end of the last log record must lose messages, damage in
    // a chunk after it may not (the log records still hold every message).
    let intact = disk.file_bytes(&name).unwrap();
    let mut log_end = 0;
    let mut position = 32;
    while position < intact.len() {
        let body = format::read_u32(&intact, position + 4) as usize;
        let end = position + 8 + body;
        if matches!(
            format::decode_checked(&intact[position..end]),
            Ok(format::Record::Log(_) | format::Record::LogBatch(_))
        ) {
            log_end = end;
        }
        position = end;
    }
    assert!(log_end > 32, "the appends wrote log records");
    let mut opened = 0;
    for position in (32..length).step_by(7) {
        let damaged = SimulatedDisk::new();
        damaged.put_file(&name, &disk.file_bytes(&name).unwrap());
        damaged.damage(&name, position);
        let Ok((store, report)) = Store::open_with_storage(Arc::new(damaged), options.clone())
        else {
            continue;
        };
        assert_eq!(
            report.truncated.len(),
            1,
            "damage at {position} must be reported"
        );
        let messages = read_all(&store, b"q");
        for (index, message) in messages.iter().enumerate() {
            assert_eq!(message, format!("payload-{index}").as_bytes());
        }
        if position < log_end {
            assert!(
                messages.len() < 10,
                "damage at {position} was cut with what follows"
            );
        } else {
            assert_eq!(messages.len(), 10, "the log records hold every message");
        }
        opened += 1;
    }
    assert!(
        opened > 10,
        "damage in the last segment is a tail to cut, not a refusal"
    );
}

#[test]
fn given_damage_in_older_segment_when_opening_should_refuse_as_corrupt() {
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, tiny());
    for index in 0..200_u32 {
        store.append(b"q", &index.to_le_bytes()).unwrap();
    }
    drop(store);
    let name = format::segment_file_name(1);
    disk.damage(&name, 40);
    let error = Store::open_with_storage(Arc::new(disk), tiny()).unwrap_err();
    assert!(matches!(error, OpenError::Corrupt { .. }), "{error}");
}

#[test]
fn given_deleted_queue_when_reopening_should_stay_deleted_and_restart_at_zero() {
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, tiny());
    for _ in 0..30 {
        store.append(b"gone", b"old message").unwrap();
        store.append(b"kept", b"kept message").unwrap();
    }
    assert!(store.delete_queue(b"gone").unwrap());
    assert!(!store.delete_queue(b"gone").unwrap());
    assert!(store.read(b"gone", 0, 10, 1000).unwrap().is_empty());
    assert_eq!(store.append(b"gone", b"new").unwrap(), 0);
    let survivor = disk.crash(CrashMode::DropUnsynced, 1);
    drop(store);
    let store = open_sim(&survivor, tiny());
    assert_eq!(read_all(&store, b"gone"), vec![b"new".to_vec()]);
    assert_eq!(read_all(&store, b"kept").len(), 30);
}

#[test]
fn given_retention_when_enforced_should_trim_persist_and_delete_dead_segments() {
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, tiny());
    for index in 0..300_u32 {
        store
            .append(b"log", format!("entry {index:04}").as_bytes())
            .unwrap();
    }
    let before = store.stats();
    assert!(before.segments > 3);
    let policy = |_: &[u8]| Retention {
        max_bytes: Some(600),
        max_age_ms: None,
        before_offset: None,
    };
    let report = store.enforce_retention(0, policy).unwrap();
    assert!(report.messages_removed > 200, "{report:?}");
    let info = store.queue_info(b"log").unwrap().unwrap();
    assert_eq!(info.first_offset, report.messages_removed);
    let batch = store.read(b"log", 0, 1, 1000).unwrap();
    assert!(batch.skipped_to_first_retained);
    assert_eq!(batch.first_offset, info.first_offset);
    // The committer deletes dead segments after the round that wrote the trim.
    store.sync().unwrap();
    let after = store.stats();
    assert!(after.segments_deleted > 0, "{after:?}");
    assert!(after.segments < before.segments);
    // Everything expires by age; the queue keeps its offsets.
    let all = |_: &[u8]| Retention {
        max_age_ms: Some(0),
        max_bytes: None,
        before_offset: None,
    };
    store.enforce_retention(u64::MAX / 2, all).unwrap();
    let info = store.queue_info(b"log").unwrap().unwrap();
    assert_eq!((info.first_offset, info.next_offset), (300, 300));
    for _ in 0..5 {
        store.sync().unwrap();
    }
    let survivor = disk.crash(CrashMode::DropUnsynced, 2);
    drop(store);
    let store = open_sim(&survivor, tiny());
    let info = store.queue_info(b"log").unwrap().unwrap();
    assert_eq!((info.first_offset, info.next_offset), (300, 300));
    assert_eq!(store.append(b"log", b"next").unwrap(), 300);
}

#[test]
fn given_a_queue_created_at_an_offset_when_reopening_after_crashes_and_churn_should_keep_its_offsets()
 {
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, tiny());
    assert!(store.create_queue_at(b"imported", 1_000).unwrap());
    assert!(store.create_queue_at(b"empty", 77).unwrap());
    assert!(
        !store.create_queue_at(b"imported", 5).unwrap(),
        "an existing queue is left as it is"
    );
    let info = store.queue_info(b"imported").unwrap().unwrap();
    assert_eq!((info.first_offset, info.next_offset), (1_000, 1_000));
    assert_eq!(store.append(b"imported", b"a").unwrap(), 1_000);
    assert_eq!(store.append(b"imported", b"b").unwrap(), 1_001);
    let batch = store.read(b"imported", 0, 10, 1000).unwrap();
    assert!(batch.skipped_to_first_retained);
    assert_eq!(batch.first_offset, 1_000);
    assert!(matches!(
        store.create_queue_at(b"", 3),
        Err(WriteError::Input(InputError::QueueName(0)))
    ));
    // Durable on return: a crash that drops everything unsynced keeps both.
    let survivor = disk.crash(CrashMode::DropUnsynced, 3);
    drop(store);
    let store = open_sim(&survivor, tiny());
    let empty = store.queue_info(b"empty").unwrap().unwrap();
    assert_eq!((empty.first_offset, empty.next_offset), (77, 77));
    let imported = store.queue_info(b"imported").unwrap().unwrap();
    assert_eq!(
        (imported.first_offset, imported.next_offset),
        (1_000, 1_002)
    );
    // Many segments later (the first ones collected), the empty queue's place is carried.
    for round in 0..40_u32 {
        for index in 0..10_u32 {
            store
                .append(b"busy", format!("{round}-{index}-padding").as_bytes())
                .unwrap();
        }
        let busy_only = |queue: &[u8]| {
            if queue == b"busy" {
                Retention {
                    max_bytes: Some(300),
                    ..Retention::default()
                }
            } else {
                Retention::default()
            }
        };
        store.enforce_retention(0, busy_only).unwrap();
    }
    store.sync().unwrap();
    assert!(store.stats().segments_deleted > 0);
    let survivor = survivor.crash(CrashMode::TearUnsynced, 4);
    drop(store);
    let store = open_sim(&survivor, tiny());
    let empty = store.queue_info(b"empty").unwrap().unwrap();
    assert_eq!((empty.first_offset, empty.next_offset), (77, 77));
    assert_eq!(
        read_all(&store, b"imported"),
        vec![b"a".to_vec(), b"b".to_vec()]
    );
    assert_eq!(store.append(b"empty", b"first").unwrap(), 77);
}

#[test]
fn given_many_queues_when_listing_in_pages_should_return_each_once() {
    let disk = SimulatedDisk::new();
    let store = open_sim(
        &disk,
        StoreOptions {
            sync: SyncPolicy::Interval { interval_ms: 5 },
            ..tiny()
        },
    );
    let mut expected: Vec<Vec<u8>> = (0..500)
        .map(|index| format!("q{index}").into_bytes())
        .collect();
    for name in &expected {
        store.append(name, b"m").unwrap();
    }
    let mut listed = Vec::new();
    let mut after: Option<Vec<u8>> = None;
    loop {
        let page = store.list_queues(after.as_deref(), 64);
        assert!(page.len() <= 64);
        if page.is_empty() {
            break;
        }
        after = page.last().cloned();
        listed.extend(page);
    }
    listed.sort();
    expected.sort();
    assert_eq!(listed, expected);
}

#[test]
fn given_queues_of_two_prefixes_when_visiting_one_prefix_should_name_only_its_queues() {
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, tiny());
    for index in 0..200 {
        store.append(format!("a-{index}").as_bytes(), b"m").unwrap();
        store.append(format!("b-{index}").as_bytes(), b"m").unwrap();
    }
    assert!(store.delete_queue(b"a-7").unwrap());
    let mut visited = Vec::new();
    store.for_each_queue_with_prefix(b"a-", |name| visited.push(name.to_vec()));
    visited.sort();
    let mut expected: Vec<Vec<u8>> = (0..200)
        .filter(|index| *index != 7)
        .map(|index| format!("a-{index}").into_bytes())
        .collect();
    expected.sort();
    assert_eq!(visited, expected);
}

#[test]
fn given_full_disk_under_always_when_appending_should_fail_cleanly_and_resume() {
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, tiny());
    store.append(b"q", b"before").unwrap();
    disk.set_fault(Fault::NoSpace);
    let error = store.append(b"q", b"during").unwrap_err();
    assert!(matches!(error, WriteError::StorageFull { .. }), "{error}");
    assert_eq!(
        read_all(&store, b"q"),
        vec![b"before".to_vec()],
        "still readable"
    );
    assert_eq!(
        store.queue_info(b"q").unwrap().unwrap().next_offset,
        1,
        "offset not used"
    );
    disk.set_fault(Fault::None);
    assert_eq!(store.append(b"q", b"after").unwrap(), 1);
    let survivor = disk.crash(CrashMode::DropUnsynced, 3);
    drop(store);
    let store = open_sim(&survivor, tiny());
    assert_eq!(
        read_all(&store, b"q"),
        vec![b"before".to_vec(), b"after".to_vec()]
    );
}

#[test]
fn given_full_disk_under_interval_when_space_returns_should_write_buffered_messages() {
    let disk = SimulatedDisk::new();
    let options = StoreOptions {
        sync: SyncPolicy::Interval { interval_ms: 2 },
        ..tiny()
    };
    let store = open_sim(&disk, options.clone());
    store.append(b"q", b"one").unwrap();
    store.sync().unwrap();
    disk.set_fault(Fault::NoSpace);
    store.append(b"q", b"two").unwrap();
    assert!(matches!(store.sync(), Err(WriteError::StorageFull { .. })));
    assert!(matches!(
        store.append(b"q", b"three"),
        Err(WriteError::StorageFull { .. })
    ));
    assert_eq!(
        read_all(&store, b"q").len(),
        2,
        "acknowledged data stays readable"
    );
    disk.set_fault(Fault::None);
    append_once_space_returns(&store, b"q", b"three");
    store.sync().unwrap();
    disk.set_fault(Fault::NoSpace);
    store.append(b"q", b"four").unwrap();
    let closed = store.close();
    assert!(
        matches!(closed, Err(WriteError::StorageFull { .. })),
        "{closed:?}"
    );
    disk.set_fault(Fault::None);
    let survivor = disk.crash(CrashMode::DropUnsynced, 4);
    let store = open_sim(&survivor, options);
    assert_eq!(
        read_all(&store, b"q"),
        vec![b"one".to_vec(), b"two".to_vec(), b"three".to_vec()]
    );
}

#[test]
fn given_io_error_when_writing_should_poison_the_store_but_keep_it_readable() {
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, tiny());
    store.append(b"q", b"kept").unwrap();
    disk.set_fault(Fault::Io);
    assert!(matches!(
        store.append(b"q", b"lost"),
        Err(WriteError::Poisoned(_))
    ));
    disk.set_fault(Fault::None);
    let error = store.append(b"q", b"refused").unwrap_err();
    assert!(error.to_string().contains("refuses writes"), "{error}");
    assert_eq!(
        store.read(b"q", 0, 10, 1000).unwrap().message(0),
        Some(&b"kept"[..])
    );
    assert!(store.close().is_err());
    let store = open_sim(&disk, tiny());
    assert_eq!(read_all(&store, b"q"), vec![b"kept".to_vec()]);
}

#[test]
fn given_many_threads_when_appending_and_reading_should_keep_per_queue_order() {
    const THREADS: usize = 8;
    const MESSAGES: u32 = 300;
    let disk = SimulatedDisk::new();
    let store = Arc::new(open_sim(
        &disk,
        StoreOptions {
            buffer_budget_bytes: 2048,
            ..tiny()
        },
    ));
    let mut handles = Vec::new();
    for thread in 0..THREADS {
        let store = store.clone();
        handles.push(std::thread::spawn(move || {
            // Two threads share each queue; each checks its own messages keep their order.
            let queue = format!("queue-{}", thread / 2).into_bytes();
            let mut last_offset = None;
            for index in 0..MESSAGES {
                let message = format!("{thread}:{index}");
                let offset = store.append(&queue, message.as_bytes()).unwrap();
                assert!(last_offset.is_none_or(|last| offset > last));
                last_offset = Some(offset);
                if index % 50 == 0 {
                    let batch = store.read(&queue, offset, 1, 100).unwrap();
                    assert_eq!(batch.message(0), Some(message.as_bytes()));
                }
            }
        }));
    }
    let reader = {
        let store = store.clone();
        std::thread::spawn(move || {
            for _ in 0..200 {
                let batch = store.read(b"queue-0", 0, 1000, usize::MAX).unwrap();
                assert!(batch.len() <= 2 * MESSAGES as usize);
            }
        })
    };
    for handle in handles {
        handle.join().unwrap();
    }
    reader.join().unwrap();
    let stats = store.stats();
    let total = THREADS as u64 * u64::from(MESSAGES);
    assert!(
        stats.commit_rounds < total,
        "group commit shares rounds: {stats:?}"
    );
    let store = Arc::try_unwrap(store).unwrap();
    drop(store);
    let store = open_sim(&disk, tiny());
    for pair in 0..THREADS / 2 {
        let messages = read_all(&store, format!("queue-{pair}").as_bytes());
        assert_eq!(messages.len(), 2 * MESSAGES as usize);
        for thread in [2 * pair, 2 * pair + 1] {
            let prefix = format!("{thread}:");
            let own: Vec<u32> = messages
                .iter()
                .filter_map(|message| {
                    std::str::from_utf8(message)
                        .ok()?
                        .strip_prefix(&prefix)?
                        .parse()
                        .ok()
                })
                .collect();
            assert_eq!(own, (0..MESSAGES).collect::<Vec<_>>());
        }
    }
}

#[test]
fn given_idle_queues_when_measuring_memory_should_hold_no_buffers() {
    let disk = SimulatedDisk::new();
    let store = open_sim(
        &disk,
        StoreOptions {
            chunk_bytes: 4096,
            ..tiny()
        },
    );
    for index in 0..1000 {
        store
            .append(format!("queue-{index}").as_bytes(), b"0123456789")
            .unwrap();
    }
    // Each queue keeps its acknowledged message in a small write buffer until the buffer
    // fills or a checkpoint seals it: still within 1 KiB per queue, buffers included.
    let usage = store.memory_usage();
    assert_eq!(usage.queues, 1000);
    assert!(usage.total_bytes / usage.queues <= 1024, "{usage:?}");
    store.sync().unwrap();
    let usage = store.memory_usage();
    assert_eq!(
        usage.buffer_bytes, 0,
        "after a checkpoint idle queues hold no buffer: {usage:?}"
    );
    assert!(usage.total_bytes / usage.queues <= 1024, "{usage:?}");
}

#[test]
fn given_buffers_emptied_by_rounds_when_appends_stop_should_reuse_then_free_the_spares() {
    let disk = SimulatedDisk::new();
    let options = StoreOptions {
        buffer_budget_bytes: 1 << 20,
        ..tiny()
    };
    let store = open_sim(&disk, options.clone());
    // Each message fills a chunk: its round seals it and empties the queue's buffer, which
    // the shard keeps for the next queue (or the same one) that needs a buffer.
    let names: Vec<String> = (0..40).map(|index| format!("queue-{index}")).collect();
    let message = |round: u8, index: usize| vec![round ^ index.to_le_bytes()[0]; 100];
    for round in 0..10_u8 {
        for (index, name) in names.iter().enumerate() {
            store
                .append(name.as_bytes(), &message(round, index))
                .unwrap();
        }
    }
    let usage = store.memory_usage();
    assert_eq!(usage.buffer_bytes, 0, "every buffer was sealed: {usage:?}");
    assert!(
        usage.spare_buffer_bytes > 0,
        "emptied buffers are kept: {usage:?}"
    );
    assert!(
        usage.spare_buffer_bytes <= u64::try_from(options.buffer_budget_bytes / 2).unwrap(),
        "{usage:?}"
    );
    for (index, name) in names.iter().enumerate() {
        let expected: Vec<Vec<u8>> = (0..10).map(|round| message(round, index)).collect();
        assert_eq!(read_all(&store, name.as_bytes()), expected, "{name}");
    }
    // Idle: the spares are freed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while store.memory_usage().spare_buffer_bytes > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "spares kept while idle: {:?}",
            store.memory_usage()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    store.append(b"queue-0", b"after").unwrap();
    store.close().unwrap();
    let store = open_sim(&disk, options);
    let mut expected: Vec<Vec<u8>> = (0..10).map(|round| message(round, 0)).collect();
    expected.push(b"after".to_vec());
    assert_eq!(read_all(&store, b"queue-0"), expected);
}

#[test]
fn given_open_store_when_opening_same_directory_again_should_refuse_until_closed() {
    let directory = tempfile::tempdir().unwrap();
    let (store, _) = Store::open(directory.path(), tiny()).unwrap();
    store.append(b"q", b"m").unwrap();
    let error = Store::open(directory.path(), tiny()).unwrap_err();
    assert!(
        error.to_string().contains("in use by another process"),
        "{error}"
    );
    store.close().unwrap();
    let (store, report) = Store::open(directory.path(), tiny()).unwrap();
    assert_eq!(report.messages, 1);
    assert!(
        report.ignored_files.is_empty(),
        "the lock file is ours: {report:?}"
    );
    drop(store);
}

#[test]
fn given_deferred_appends_when_waiting_on_the_highest_ticket_should_make_all_durable() {
    // Many crash points: the committer runs on while the disk is cut. A later append can hold
    // an earlier ticket than the one before it (a round takes the shard logs one by one, so
    // an append to a shard not yet taken joins that round): the highest ticket covers all.
    for seed in 0..200 {
        let disk = SimulatedDisk::new();
        let store = open_sim(&disk, tiny());
        let mut highest = None;
        for index in 0..500_u32 {
            let queue = format!("q{}", index % 7);
            let (offset, ticket) = store
                .append_deferred(queue.as_bytes(), &index.to_le_bytes())
                .unwrap();
            assert_eq!(offset, u64::from(index / 7));
            highest = highest.max(Some(ticket));
        }
        store.wait_durable(highest.unwrap()).unwrap();
        assert!(
            store.stats().file_syncs < 500,
            "pipelined appends share fsyncs"
        );
        let survivor = disk.crash(CrashMode::DropUnsynced, seed);
        drop(store);
        let store = open_sim(&survivor, tiny());
        for queue in 0..7_u32 {
            let expected: Vec<Vec<u8>> = (0..500_u32)
                .filter(|index| index % 7 == queue)
                .map(|index| index.to_le_bytes().to_vec())
                .collect();
            let name = format!("q{queue}");
            assert_eq!(
                read_all(&store, name.as_bytes()),
                expected,
                "seed {seed}, {name}"
            );
        }
    }
}

#[test]
fn given_queues_sealed_chunk_by_chunk_when_recovering_should_skip_their_old_log() {
    // Two busy queues, never idle and never flushed for the budget: rounds seal their buffers
    // a chunk at a time while they stay on the buffered list. The log floor must still follow
    // them, so recovery after a crash replays only a recent part of the log.
    let options = StoreOptions {
        segment_bytes_max: 16 << 10,
        chunk_bytes: 256,
        buffer_budget_bytes: 1 << 20,
        ..StoreOptions::default()
    };
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, options.clone());
    let message = [7_u8; 32];
    for index in 0..4_000_u32 {
        let queue: &[u8] = if index % 2 == 0 { b"a" } else { b"b" };
        store.append(queue, &message).unwrap();
    }
    let survivor = disk.crash(CrashMode::DropUnsynced, 9);
    drop(store);
    let (store, report) = Store::open_with_storage(Arc::new(survivor), options).unwrap();
    assert_eq!(report.messages, 4_000);
    assert_eq!(read_all(&store, b"a").len(), 2_000);
    assert_eq!(read_all(&store, b"b").len(), 2_000);
    // About 6 in 7 messages have a log record (the rest are sealed straight from their
    // buffer): most of those records must lie before the floor.
    assert!(
        report.log_records_skipped > 2_000,
        "only {} log records skipped: {report:?}",
        report.log_records_skipped
    );
}

#[test]
fn given_appends_deletes_retention_and_reads_at_once_when_running_should_not_deadlock() {
    let directory = tempfile::tempdir().unwrap();
    for sync in [SyncPolicy::Always, SyncPolicy::Interval { interval_ms: 1 }] {
        let path = directory.path().join(sync.to_string());
        let options = StoreOptions {
            sync,
            buffer_budget_bytes: 2048,
            ..tiny()
        };
        let store = Arc::new(Store::open(&path, options.clone()).unwrap().0);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut handles = Vec::new();
        for thread in 0..4_u32 {
            let (store, stop) = (store.clone(), stop.clone());
            handles.push(std::thread::spawn(move || {
                let mut sent = 0_u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // Queues "stable-*" are never deleted; "churn-*" are deleted meanwhile.
                    let stable = format!("stable-{thread}");
                    store
                        .append(stable.as_bytes(), &sent.to_le_bytes())
                        .unwrap();
                    let churn = format!("churn-{}", sent % 3);
                    store.append(churn.as_bytes(), b"churn").unwrap();
                    sent += 1;
                }
                sent
            }));
        }
        let admin = {
            let (store, stop) = (store.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut round = 0_u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    store
                        .delete_queue(format!("churn-{}", round % 3).as_bytes())
                        .unwrap();
                    let policy = |queue: &[u8]| {
                        if queue.starts_with(b"churn") {
                            Retention {
                                max_bytes: Some(100),
                                max_age_ms: None,
                                before_offset: None,
                            }
                        } else {
                            Retention::default()
                        }
                    };
                    store.enforce_retention(0, policy).unwrap();
                    let _ = store.read(b"stable-0", round, 10, 1000).unwrap();
                    let _ = store.list_queues(None, 100);
                    round += 1;
                }
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(300));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let sent: Vec<u32> = handles
            .into_iter()
            .map(|handle| handle.join().unwrap())
            .collect();
        admin.join().unwrap();
        let store = Arc::try_unwrap(store).unwrap();
        store.close().unwrap();
        let (store, _) = Store::open(&path, options).unwrap();
        for (thread, sent) in sent.into_iter().enumerate() {
            let messages = read_all(&store, format!("stable-{thread}").as_bytes());
            let expected: Vec<Vec<u8>> = (0..sent)
                .map(|index| index.to_le_bytes().to_vec())
                .collect();
            assert_eq!(messages, expected, "stable-{thread} under {sync}");
        }
    }
}

#[test]
fn given_sync_always_when_message_not_yet_fsynced_should_not_be_readable() {
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, tiny());
    store.append(b"q", b"durable").unwrap();
    disk.set_fault(Fault::NoSpace);
    let (offset, ticket) = store.append_deferred(b"q", b"doomed").unwrap();
    assert_eq!(offset, 1);
    let batch = store.read(b"q", 0, 10, 1000).unwrap();
    assert_eq!(
        batch.iter().collect::<Vec<_>>(),
        vec![&b"durable"[..]],
        "only fsynced data"
    );
    assert_eq!(batch.visible_end_offset, 1);
    assert!(matches!(
        store.wait_durable(ticket),
        Err(WriteError::StorageFull { .. })
    ));
    disk.set_fault(Fault::None);
    assert_eq!(
        store.append(b"q", b"next").unwrap(),
        1,
        "the failed offset is reused"
    );
    assert_eq!(
        read_all(&store, b"q"),
        vec![b"durable".to_vec(), b"next".to_vec()]
    );
}

#[test]
fn given_long_lived_queue_in_old_segment_when_others_are_trimmed_should_relocate_and_free_disk() {
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, tiny());
    store.append(b"keeper", b"first and only").unwrap();
    for round in 0..40_u32 {
        for index in 0..10_u32 {
            store
                .append(
                    b"busy",
                    format!("{round}-{index}-padding-padding").as_bytes(),
                )
                .unwrap();
        }
        let policy = |queue: &[u8]| {
            if queue == b"busy" {
                Retention {
                    max_bytes: Some(300),
                    max_age_ms: None,
                    before_offset: None,
                }
            } else {
                Retention::default()
            }
        };
        store.enforce_retention(0, policy).unwrap();
    }
    store.sync().unwrap();
    let stats = store.stats();
    assert!(stats.chunks_relocated > 0, "{stats:?}");
    assert!(
        stats.segments <= 4,
        "the keeper no longer pins old segments: {stats:?}"
    );
    assert_eq!(
        read_all(&store, b"keeper"),
        vec![b"first and only".to_vec()]
    );
    let survivor = disk.crash(CrashMode::TearUnsynced, 6);
    drop(store);
    let (store, report) = Store::open_with_storage(Arc::new(survivor), tiny()).unwrap();
    assert_eq!(
        read_all(&store, b"keeper"),
        vec![b"first and only".to_vec()],
        "{report:?}"
    );
    let busy = store.queue_info(b"busy").unwrap().unwrap();
    assert_eq!(busy.next_offset, 400);
    let messages = read_all(&store, b"busy");
    assert_eq!(messages.len() as u64, busy.retained());
    assert_eq!(messages.last().unwrap(), b"39-9-padding-padding");
}

#[test]
fn given_messages_only_in_log_records_when_crashing_should_recover_them_into_buffers() {
    let disk = SimulatedDisk::new();
    let options = StoreOptions {
        chunk_bytes: 4096,
        ..tiny()
    };
    let store = open_sim(&disk, options.clone());
    for index in 0..5_u32 {
        store
            .append(b"q", format!("message-{index}").as_bytes())
            .unwrap();
    }
    assert!(store.memory_usage().buffer_bytes > 0, "not sealed yet");
    assert_eq!(store.memory_usage().index_entries, 0, "no chunk yet");
    let survivor = disk.crash(CrashMode::DropUnsynced, 1);
    drop(store);
    let (store, report) =
        Store::open_with_storage(Arc::new(survivor.clone()), options.clone()).expect("open");
    assert_eq!(report.messages, 5, "{report:?}");
    let expected: Vec<Vec<u8>> = (0..5)
        .map(|index| format!("message-{index}").into_bytes())
        .collect();
    assert_eq!(read_all(&store, b"q"), expected);
    assert_eq!(store.append(b"q", b"message-5").unwrap(), 5);
    // A checkpoint seals the recovered and the new messages into chunks.
    store.sync().unwrap();
    let usage = store.memory_usage();
    assert_eq!(usage.buffer_bytes, 0, "{usage:?}");
    assert!(usage.index_entries > 0, "{usage:?}");
    let survivor = survivor.crash(CrashMode::TearAndDamage, 3);
    drop(store);
    let store = open_sim(&survivor, options);
    let mut expected = expected;
    expected.push(b"message-5".to_vec());
    assert_eq!(read_all(&store, b"q"), expected);
}

#[test]
fn given_many_records_per_window_when_recovering_should_rebuild_every_queue_in_order() {
    // Thousands of records over several 4 MiB read windows: recovery checks them on one
    // thread and applies them on another, a window behind, which must keep every queue's order
    // and numbering, and cut a torn tail in a later window with nothing after it applied.
    let disk = SimulatedDisk::new();
    let options = StoreOptions {
        segment_bytes_max: 64 << 20,
        chunk_bytes: 4096,
        buffer_budget_bytes: 1 << 20,
        message_bytes_max: 1024,
        ..StoreOptions::default()
    };
    let store = open_sim(&disk, options.clone());
    let queues: Vec<Vec<u8>> = (0..300)
        .map(|queue| format!("q{queue}").into_bytes())
        .collect();
    let mut expected: Vec<Vec<Vec<u8>>> = vec![Vec::new(); queues.len()];
    for round in 0..120_u32 {
        let batch: Vec<(Vec<u8>, Vec<u8>)> = (0..queues.len())
            .filter(|queue| !(queue + round as usize).is_multiple_of(3))
            .map(|queue| {
                let mut message = format!("{queue}:{round}:").into_bytes();
                message.resize(300, b'.');
                (queues[queue].clone(), message)
            })
            .collect();
        let refs: Vec<(&[u8], &[u8])> = batch
            .iter()
            .map(|(queue, message)| (queue.as_slice(), message.as_slice()))
            .collect();
        store.append_batch(&refs).unwrap();
        for (queue, message) in &batch {
            let index = queues.iter().position(|name| name == queue).unwrap();
            expected[index].push(message.clone());
        }
    }
    assert!(store.delete_queue(&queues[7]).unwrap());
    expected[7].clear();
    let survivor = disk.crash(CrashMode::DropUnsynced, 5);
    drop(store);
    let name = format::segment_file_name(1);
    let length = survivor.file_bytes(&name).unwrap().len();
    assert!(
        length > 3 * (4 << 20),
        "several read windows: {length} bytes"
    );
    let (store, report) =
        Store::open_with_storage(Arc::new(survivor.clone()), options.clone()).expect("open");
    assert!(report.records > 5_000, "{report:?}");
    for (queue, messages) in queues.iter().zip(&expected) {
        assert_eq!(&read_all(&store, queue), messages, "queue {queue:?}");
    }
    // Incarnations stay unique: a recreated queue and new appends work.
    assert_eq!(store.append(&queues[7], b"again").unwrap(), 0);
    assert_eq!(
        store.append(&queues[8], b"more").unwrap(),
        expected[8].len() as u64
    );
    drop(store);
    // A torn write in the third window: what precedes it is kept, what follows never served.
    let torn = SimulatedDisk::new();
    let mut bytes = survivor.file_bytes(&name).unwrap();
    bytes.truncate(length - 1);
    let cut_at = (9 << 20) + 4321;
    bytes[cut_at] ^= 0x5a;
    torn.put_file(&name, &bytes);
    let (store, report) = Store::open_with_storage(Arc::new(torn), options).expect("open");
    assert_eq!(report.truncated.len(), 1, "{report:?}");
    assert!(report.truncated[0].position <= cut_at as u64, "{report:?}");
    assert!(report.truncated[0].position > 8 << 20, "{report:?}");
    // (Queue 7's delete record was cut off with the tail: it is back, not checked here.)
    for (queue, messages) in queues
        .iter()
        .zip(&expected)
        .filter(|(queue, _)| *queue != b"q7")
    {
        let read = read_all(&store, queue);
        assert!(messages.starts_with(&read), "queue {queue:?}: a prefix");
    }
}

#[test]
fn given_many_rotations_when_crashing_should_skip_dead_log_records_and_keep_every_message() {
    let options = StoreOptions {
        segment_bytes_max: 8192,
        chunk_bytes: 256,
        buffer_budget_bytes: 2048,
        ..tiny()
    };
    let names: Vec<Vec<u8>> = (0..50)
        .map(|index| format!("q-{index}").into_bytes())
        .collect();
    let mut model: Vec<Vec<Vec<u8>>> = vec![Vec::new(); names.len()];
    let mut disk = SimulatedDisk::new();
    let mut skipped_total = 0;
    for (crash, mode) in [CrashMode::DropUnsynced, CrashMode::TearAndDamage]
        .into_iter()
        .enumerate()
    {
        let store = open_sim(&disk, options.clone());
        for round in 0..40 {
            let messages: Vec<Vec<u8>> = (0..names.len())
                .map(|queue| format!("{crash}-{round}-{queue}").into_bytes())
                .collect();
            let batch: Vec<(&[u8], &[u8])> = names
                .iter()
                .zip(&messages)
                .map(|(name, message)| (&name[..], &message[..]))
                .collect();
            store.append_batch(&batch).unwrap();
            for (queue, message) in messages.into_iter().enumerate() {
                model[queue].push(message);
            }
        }
        disk = disk.crash(mode, 7 + crash as u64);
        drop(store);
        let (store, report) =
            Store::open_with_storage(Arc::new(disk.clone()), options.clone()).unwrap();
        assert!(report.segments > 2, "{report:?}");
        skipped_total += report.log_records_skipped;
        for (name, expected) in names.iter().zip(&model) {
            assert_eq!(&read_all(&store, name), expected, "queue {name:?}");
        }
        store.close().unwrap();
    }
    assert!(
        skipped_total > 0,
        "recovery skipped no log record before the floor"
    );
}

#[test]
fn given_log_records_filling_the_budget_when_appending_should_write_them_without_sealing_small_chunks()
 {
    // Long names and tiny messages: the log records take twenty times the bytes of the
    // buffered messages. A full budget is freed by writing the logs, so the buffers keep
    // growing into chunks of a dozen messages or more (sealing the oldest buffers at every
    // flush, as before, made about 200 chunks of one to six messages).
    const QUEUES: usize = 40;
    const ROUNDS: usize = 30;
    let disk = SimulatedDisk::new();
    let options = StoreOptions {
        sync: SyncPolicy::Interval {
            interval_ms: 60_000,
        },
        segment_bytes_max: 1 << 20,
        chunk_bytes: 1024,
        buffer_budget_bytes: 8192,
        ..tiny()
    };
    let store = open_sim(&disk, options.clone());
    let names: Vec<Vec<u8>> = (0..QUEUES)
        .map(|queue| format!("{queue:0>200}").into_bytes())
        .collect();
    for round in 0..ROUNDS {
        for name in &names {
            let message = format!("m{round:05}");
            assert_eq!(
                store.append(name, message.as_bytes()).unwrap(),
                round as u64
            );
        }
    }
    let messages = QUEUES * ROUNDS;
    let stats = store.stats();
    assert!(stats.budget_flushes > 0, "{stats:?}");
    assert_eq!(stats.checkpoints, 0, "{stats:?}");
    let usage = store.memory_usage();
    assert!(
        usage.index_entries <= (messages / 12) as u64,
        "{} chunks for {messages} messages",
        usage.index_entries
    );
    let expected: Vec<Vec<u8>> = (0..ROUNDS)
        .map(|round| format!("m{round:05}").into_bytes())
        .collect();
    for name in &names {
        assert_eq!(read_all(&store, name), expected);
    }
    store.sync().unwrap();
    assert_eq!(store.stats().checkpoints, 1, "sync is a checkpoint");
    store.close().unwrap();
    let store = open_sim(&disk, options);
    for name in &names {
        assert_eq!(read_all(&store, name), expected);
    }
}

#[test]
fn given_interval_appends_when_flushed_should_survive_a_crash_without_sealing_buffers() {
    let options = StoreOptions {
        sync: SyncPolicy::Interval {
            interval_ms: 60_000,
        },
        chunk_bytes: 1024,
        ..tiny()
    };
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, options.clone());
    for index in 0..20_u64 {
        store.append(b"q", format!("m-{index}").as_bytes()).unwrap();
    }
    store.flush().unwrap();
    let usage = store.memory_usage();
    assert_eq!(usage.index_entries, 0, "flush seals no buffer: {usage:?}");
    assert_eq!(store.stats().checkpoints, 0);
    // Appended after the flush, within the interval: a crash may take these back.
    store.append(b"q", b"late").unwrap();
    let crashed = disk.crash(CrashMode::DropUnsynced, 3);
    drop(store);
    let store = open_sim(&crashed, options);
    let messages = read_all(&store, b"q");
    let expected: Vec<Vec<u8>> = (0..20)
        .map(|index| format!("m-{index}").into_bytes())
        .collect();
    assert_eq!(messages[..20], expected[..]);
    assert!(messages.len() <= 21);
}

#[test]
fn given_a_checkpoint_failing_on_a_full_disk_with_nothing_logged_when_space_returns_should_resume()
{
    // Every message is already durable in log records; only the sealing round fails. Appends
    // are refused while the disk is full, and must be taken again once space returns without
    // anyone calling `sync`.
    let disk = SimulatedDisk::new();
    let options = StoreOptions {
        sync: SyncPolicy::Interval { interval_ms: 2 },
        ..tiny()
    };
    let store = open_sim(&disk, options.clone());
    for index in 0..5 {
        store.append(b"q", format!("m-{index}").as_bytes()).unwrap();
    }
    store.flush().unwrap();
    disk.set_fault(Fault::NoSpace);
    assert!(matches!(store.sync(), Err(WriteError::StorageFull { .. })));
    disk.set_fault(Fault::None);
    append_once_space_returns(&store, b"q", b"m-5");
    store.close().unwrap();
    let store = open_sim(&disk, options);
    let expected: Vec<Vec<u8>> = (0..6)
        .map(|index| format!("m-{index}").into_bytes())
        .collect();
    assert_eq!(read_all(&store, b"q"), expected);
}

// A queue deleted while on the buffered list must not let the log floor pass its log records
// before its delete record is durable, or a crash in between brings the queue back neither
// deleted nor intact. `CutStorage` cuts the power at the first round write after a rotation.

#[derive(Debug)]
struct Cut {
    disk: SimulatedDisk,
    armed: AtomicBool,
    survivor: Mutex<Option<SimulatedDisk>>,
}

#[derive(Debug, Clone)]
struct CutStorage(Arc<Cut>);

/// A file of the simulated disk whose writes first ask `before_write`: an error refuses the
/// write (the storages below fail writes with it).
struct HookFile {
    inner: Arc<dyn StorageFile>,
    before_write: Box<dyn Fn() -> io::Result<()> + Send + Sync>,
}

impl std::fmt::Debug for HookFile {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("HookFile").finish_non_exhaustive()
    }
}

impl StorageFile for HookFile {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }
    fn read_at(&self, position: u64, buffer: &mut [u8]) -> io::Result<()> {
        self.inner.read_at(position, buffer)
    }
    fn read_up_to(&self, position: u64, buffer: &mut [u8]) -> io::Result<usize> {
        self.inner.read_up_to(position, buffer)
    }
    fn write_at(&self, position: u64, data: &[u8]) -> io::Result<()> {
        (self.before_write)()?;
        self.inner.write_at(position, data)
    }
    fn sync(&self) -> io::Result<()> {
        self.inner.sync()
    }
    fn truncate(&self, length: u64) -> io::Result<()> {
        self.inner.truncate(length)
    }
}

impl Storage for CutStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        self.0.disk.list()
    }
    fn create(&self, name: &str) -> io::Result<Arc<dyn StorageFile>> {
        let file = self.0.disk.create(name)?;
        if self.0.armed.load(Ordering::SeqCst) {
            // First write: header and floor (rotation). Second: the round. Power is cut there.
            let writes = AtomicUsize::new(0);
            let cut = self.0.clone();
            return Ok(Arc::new(HookFile {
                inner: file,
                before_write: Box::new(move || {
                    if writes.fetch_add(1, Ordering::SeqCst) == 1 {
                        let survivor = cut.disk.crash(CrashMode::DropUnsynced, 0);
                        *cut.survivor.lock().unwrap() = Some(survivor);
                        return Err(io::Error::other("power cut"));
                    }
                    Ok(())
                }),
            }));
        }
        Ok(file)
    }
    fn open(&self, name: &str) -> io::Result<Arc<dyn StorageFile>> {
        self.0.disk.open(name)
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.0.disk.remove(name)
    }
    fn sync_dir(&self) -> io::Result<()> {
        self.0.disk.sync_dir()
    }
    fn lock_directory(&self) -> io::Result<()> {
        self.0.disk.lock_directory()
    }
}

fn active_segment_length(disk: &SimulatedDisk) -> (String, u64) {
    let mut names: Vec<String> = disk
        .list()
        .unwrap()
        .into_iter()
        .filter(|name| name != levee_store::LOCK_FILE_NAME)
        .collect();
    names.sort();
    let last = names.pop().unwrap();
    let length = disk.file_bytes(&last).unwrap().len() as u64;
    (last, length)
}

/// Queue `q` with a chunk in the first segment, log records after it into the second, and the
/// active segment full (the next round rotates); returns the store and `q`'s message count.
fn listed_queue_before_a_rotation(cut: &Arc<Cut>, options: &StoreOptions) -> (Store, u64) {
    let storage = CutStorage(cut.clone());
    let (store, _) = Store::open_with_storage(Arc::new(storage), options.clone()).unwrap();
    let message = [7_u8; 32];
    let mut q_count = 0_u64;
    for _ in 0..3 {
        store.append(b"q", &message).unwrap();
        q_count += 1;
    }
    store.sync().unwrap(); // q gets a chunk in the first segment
    let (first_segment, _) = active_segment_length(&cut.disk);
    // q's log records fill the first segment and spill into the next.
    loop {
        store.append(b"q", &message).unwrap();
        q_count += 1;
        if active_segment_length(&cut.disk).0 != first_segment {
            break;
        }
    }
    for _ in 0..5 {
        store.append(b"q", &message).unwrap();
        q_count += 1;
    }
    store.append(b"p", b"pin").unwrap();
    // Fill the active segment: the next round rotates.
    while active_segment_length(&cut.disk).1 < options.segment_bytes_max {
        store.append(b"q", &message).unwrap();
        q_count += 1;
    }
    (store, q_count)
}

/// Reopens what survived the cut: `q` must be deleted or whole, `p` whole.
fn assert_deleted_or_intact(cut: &Cut, options: StoreOptions, q_count: u64) {
    let survivor = cut
        .survivor
        .lock()
        .unwrap()
        .take()
        .expect("power was cut after the rotation");
    let opened = Store::open_with_storage(Arc::new(survivor), options);
    let (store, report) = match opened {
        Ok(opened) => opened,
        Err(error) => panic!("open refused after a crash mid-delete: {error}"),
    };
    let q = read_all(&store, b"q");
    let info = store.queue_info(b"q").unwrap();
    assert!(
        q.is_empty() && info.is_none() || q.len() as u64 == q_count,
        "q neither deleted nor intact: {} of {q_count} messages, {info:?}, {report:?}",
        q.len()
    );
    assert_eq!(read_all(&store, b"p")[0], b"pin".to_vec());
}

fn cut_options() -> StoreOptions {
    StoreOptions {
        segment_bytes_max: 4096,
        chunk_bytes: 1 << 16,
        buffer_budget_bytes: 1 << 22,
        message_bytes_max: 1024,
        ..StoreOptions::default()
    }
}

fn new_cut() -> Arc<Cut> {
    Arc::new(Cut {
        disk: SimulatedDisk::new(),
        armed: AtomicBool::new(false),
        survivor: Mutex::new(None),
    })
}

#[test]
fn given_a_listed_queue_deleted_when_power_is_cut_after_the_rotation_should_be_deleted_or_intact() {
    let (options, cut) = (cut_options(), new_cut());
    let (store, q_count) = listed_queue_before_a_rotation(&cut, &options);
    cut.armed.store(true, Ordering::SeqCst);
    // The round that rotates (writing the floor) and would write the delete record is cut.
    let deleted = store.delete_queue(b"q");
    assert!(deleted.is_err(), "the delete's round was cut: {deleted:?}");
    drop(store);
    assert_deleted_or_intact(&cut, options, q_count);
}

#[test]
fn given_a_delete_failed_on_a_full_disk_when_power_is_cut_at_the_next_rotation_should_be_deleted_or_intact()
 {
    // Under `always` a failed round's delete record is written two rounds later.
    let (options, cut) = (cut_options(), new_cut());
    let (store, q_count) = listed_queue_before_a_rotation(&cut, &options);
    cut.disk.set_fault(Fault::NoSpace);
    let deleted = store.delete_queue(b"q");
    assert!(
        matches!(deleted, Err(WriteError::StorageFull { .. })),
        "{deleted:?}"
    );
    cut.disk.set_fault(Fault::None);
    cut.armed.store(true, Ordering::SeqCst);
    let _ = store.append(b"p", b"after");
    drop(store);
    assert_deleted_or_intact(&cut, options, q_count);
}

/// A queue whose every append is a whole chunk (sealed at once, its buffer freed, its list
/// entry left behind), then a checkpoint that fails on a full disk: later appends must still
/// be listed, sealed and recovered.
fn queue_listed_again_after_a_failed_checkpoint(sync: SyncPolicy) {
    let options = StoreOptions {
        segment_bytes_max: 4096,
        chunk_bytes: 64,
        buffer_budget_bytes: 1 << 22,
        message_bytes_max: 1024,
        sync,
        ..StoreOptions::default()
    };
    let disk = SimulatedDisk::new();
    let (store, _) = Store::open_with_storage(Arc::new(disk.clone()), options.clone()).unwrap();
    let whole_chunk = [1_u8; 64];
    let mut expected: Vec<Vec<u8>> = Vec::new();
    while active_segment_length(&disk).1 < options.segment_bytes_max {
        let (_, ticket) = store.append_deferred(b"a", &whole_chunk).unwrap();
        store.wait_durable(ticket).unwrap();
        expected.push(whole_chunk.to_vec());
    }
    disk.set_fault(Fault::NoSpace);
    assert!(store.sync().is_err());
    disk.set_fault(Fault::None);
    let message = b"small-0".to_vec();
    append_once_space_returns(&store, b"a", &message);
    expected.push(message);
    for index in 1..3 {
        let message = format!("small-{index}").into_bytes();
        store.append(b"a", &message).unwrap();
        expected.push(message);
    }
    store.sync().unwrap();
    // Another queue's traffic rotates twice: a's log records fall behind the floor.
    let mut last = active_segment_length(&disk).0;
    let mut rotations = 0;
    while rotations < 2 {
        let (_, ticket) = store.append_deferred(b"f", &whole_chunk).unwrap();
        store.wait_durable(ticket).unwrap();
        let now = active_segment_length(&disk).0;
        if now != last {
            rotations += 1;
            last = now;
        }
    }
    assert_eq!(read_all(&store, b"a"), expected, "before the crash");
    drop(store);
    let survivor = disk.crash(CrashMode::DropUnsynced, 0);
    let (store, report) = Store::open_with_storage(Arc::new(survivor), options).unwrap();
    assert_eq!(
        read_all(&store, b"a"),
        expected,
        "after the crash: {report:?}"
    );
}

#[test]
fn given_a_failed_checkpoint_under_always_when_appending_again_should_keep_the_queue_listed() {
    queue_listed_again_after_a_failed_checkpoint(SyncPolicy::Always);
}

#[test]
fn given_a_failed_checkpoint_under_interval_when_appending_again_should_keep_the_queue_listed() {
    queue_listed_again_after_a_failed_checkpoint(SyncPolicy::Interval { interval_ms: 2 });
}

#[test]
fn given_queues_created_and_deleted_between_checkpoints_should_delete_old_segments() {
    // Every checkpoint meets a queue deleted since the last one (its delete record still to
    // be written): old segments must still go (the rotations' floors and the checkpoints'
    // raises, which stop where such a queue's records begin), not pile up.
    let options = StoreOptions {
        segment_bytes_max: 4096,
        chunk_bytes: 1 << 12,
        buffer_budget_bytes: 1 << 22,
        message_bytes_max: 1024,
        ..StoreOptions::default()
    };
    let disk = SimulatedDisk::new();
    let (store, _) = Store::open_with_storage(Arc::new(disk.clone()), options).unwrap();
    let message = [3_u8; 100];
    for index in 0..600_u32 {
        let name = format!("t{index}");
        store.append(name.as_bytes(), &message).unwrap();
        store.append(name.as_bytes(), &message).unwrap();
        if index > 0 {
            store
                .delete_queue(format!("t{}", index - 1).as_bytes())
                .unwrap();
        }
        store.sync().unwrap();
    }
    let segments = disk
        .list()
        .unwrap()
        .iter()
        .filter(|name| name.starts_with("segment-"))
        .count();
    assert!(segments <= 8, "{segments} segment files for one live queue");
}

#[test]
fn given_a_disk_slower_than_the_interval_then_appends_wait_for_the_late_round_and_are_counted() {
    let disk = SimulatedDisk::new();
    // Rounds every 20 ms: late past 40 ms.
    let options = StoreOptions {
        sync: SyncPolicy::Interval { interval_ms: 20 },
        ..StoreOptions::default()
    };
    let store = open_sim(&disk, options);
    store.append(b"q", b"before").unwrap();
    store.flush().unwrap();
    assert!(!store.is_late(), "a round just completed");
    // Every fsync now takes 1 s: the round that takes the next message is stuck in it (long
    // enough that a stalled test thread still finds it stuck).
    let slow = std::time::Duration::from_secs(1);
    disk.set_fault(Fault::SlowSync(slow));
    store.append(b"q", b"slow").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    // The last completed round started over two intervals ago: this append waits for the
    // slow round (back-pressure), so "durable within about two intervals" stays true. (An
    // earlier append may have been counted too if the machine stalled: only the growth is
    // checked.)
    let counted = store.stats().late_round_waits;
    assert!(
        store.is_late(),
        "the next append would wait: an async caller is told so"
    );
    let waiting = std::time::Instant::now();
    store.append(b"q", b"held").unwrap();
    assert!(
        waiting.elapsed() >= std::time::Duration::from_millis(50),
        "held back until the slow round completed: {:?}",
        waiting.elapsed()
    );
    assert!(store.stats().late_round_waits > counted);
    disk.set_fault(Fault::None);
    store.flush().unwrap();
    assert_eq!(
        read_all(&store, b"q"),
        vec![b"before".to_vec(), b"slow".to_vec(), b"held".to_vec()]
    );
}

/// Options under which every 1,000-byte message fills a chunk: its queue goes on a direct
/// list and the message is sealed with no log record; the minute-long interval does not end
/// in a test.
fn large_messages_long_interval(buffer_budget_bytes: usize) -> StoreOptions {
    StoreOptions {
        sync: SyncPolicy::Interval {
            interval_ms: 60_000,
        },
        segment_bytes_max: 1 << 20,
        chunk_bytes: 256,
        buffer_budget_bytes,
        ..tiny()
    }
}

/// Opens a store on `disk` (see [`large_messages_long_interval`]) and appends one 1,000-byte
/// message to each of `queues` queues, `q0`, `q1`, ...; returns the store and the message.
fn append_one_large_message_each(
    disk: &SimulatedDisk,
    buffer_budget_bytes: usize,
    queues: usize,
) -> (Store, Vec<u8>) {
    let store = open_sim(disk, large_messages_long_interval(buffer_budget_bytes));
    let message = vec![7_u8; 1000];
    for queue in 0..queues {
        store
            .append(format!("q{queue}").as_bytes(), &message)
            .unwrap();
    }
    (store, message)
}

#[test]
fn given_large_messages_under_interval_when_a_sixteenth_of_the_budget_waits_should_write_them_before_the_interval()
 {
    // 64 KiB of budget: past 4 KiB of messages waiting to be sealed, an append asks for the
    // round at once. Without that, these would wait a minute for the interval.
    let disk = SimulatedDisk::new();
    let (store, message) = append_one_large_message_each(&disk, 64 << 10, 8);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while store.stats().buffered_bytes > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no round wrote the messages: {:?}",
            store.stats()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let survivor = disk.crash(CrashMode::DropUnsynced, 4);
    drop(store);
    let store = open_sim(&survivor, large_messages_long_interval(64 << 10));
    for queue in 0..8 {
        assert_eq!(
            read_all(&store, format!("q{queue}").as_bytes()),
            vec![message.clone()],
            "q{queue}"
        );
    }
}

#[test]
fn given_messages_sealed_without_a_log_record_when_appended_should_hold_only_their_buffer_budget() {
    // 1 MiB of budget: ten 1,000-byte messages stay below the sixteenth that asks for a round.
    let (store, _) = append_one_large_message_each(&SimulatedDisk::new(), 1 << 20, 10);
    let stats = store.stats();
    assert_eq!(stats.commit_rounds, 0, "{stats:?}");
    // Each holds its bytes and a 4-byte length; the most its log run could take is given back.
    assert_eq!(stats.buffered_bytes, 10 * 1004, "{stats:?}");
    store.sync().unwrap();
    assert_eq!(store.stats().buffered_bytes, 0);
}

// Under `interval` a round publishes its chunks as their writes land, before its later writes
// (and its fsync). `SpaceStorage` refuses writes for lack of space once a set number of them
// has been made, so a round can fail after publishing part of its chunks: what it published
// stays written and readable, the rest stays buffered and is written once space returns.

#[derive(Debug, Clone)]
struct SpaceStorage {
    disk: SimulatedDisk,
    /// Writes still allowed (`usize::MAX`: no limit).
    writes_left: Arc<AtomicUsize>,
}

impl SpaceStorage {
    fn wrap(&self, file: Arc<dyn StorageFile>) -> Arc<dyn StorageFile> {
        let writes_left = self.writes_left.clone();
        Arc::new(HookFile {
            inner: file,
            before_write: Box::new(move || {
                writes_left
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                        if left == usize::MAX {
                            Some(left)
                        } else {
                            left.checked_sub(1)
                        }
                    })
                    .map(|_| ())
                    .map_err(|_| io::Error::new(io::ErrorKind::StorageFull, "no space left"))
            }),
        })
    }
}

impl Storage for SpaceStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        self.disk.list()
    }
    fn create(&self, name: &str) -> io::Result<Arc<dyn StorageFile>> {
        Ok(self.wrap(self.disk.create(name)?))
    }
    fn open(&self, name: &str) -> io::Result<Arc<dyn StorageFile>> {
        Ok(self.wrap(self.disk.open(name)?))
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.disk.remove(name)
    }
    fn sync_dir(&self) -> io::Result<()> {
        self.disk.sync_dir()
    }
    fn lock_directory(&self) -> io::Result<()> {
        self.disk.lock_directory()
    }
}

/// Appends message `index` (of 40 bytes or so) to each of `queues`, noting it in `expected`.
fn append_to_each(store: &Store, queues: &[Vec<u8>], index: usize, expected: &mut [Vec<Vec<u8>>]) {
    for (queue, messages) in queues.iter().zip(expected.iter_mut()) {
        let message = format!(
            "{}: message {index:04} {}",
            String::from_utf8_lossy(queue),
            "x".repeat(index % 7)
        );
        store.append(queue, message.as_bytes()).unwrap();
        messages.push(message.into_bytes());
    }
}

#[test]
fn given_a_disk_filling_mid_round_under_interval_when_space_returns_should_keep_every_message_in_order()
 {
    let options = StoreOptions {
        sync: SyncPolicy::Interval { interval_ms: 20 },
        segment_bytes_max: 1 << 20,
        chunk_bytes: 64,
        buffer_budget_bytes: 1 << 20,
        message_bytes_max: 1024,
        round_write_bytes: 256,
        ..StoreOptions::default()
    };
    let queues: Vec<Vec<u8>> = (0..40)
        .map(|queue| format!("queue-{queue}").into_bytes())
        .collect();
    let mut partly_published = 0;
    for allowed in 0..32 {
        let disk = SimulatedDisk::new();
        let writes_left = Arc::new(AtomicUsize::new(usize::MAX));
        let storage = SpaceStorage {
            disk: disk.clone(),
            writes_left: writes_left.clone(),
        };
        let (store, _) = Store::open_with_storage(Arc::new(storage), options.clone()).unwrap();
        let mut expected = vec![Vec::new(); queues.len()];
        for index in 0..3 {
            append_to_each(&store, &queues, index, &mut expected);
        }
        store.sync().unwrap();
        let (_, before) = active_segment_length(&disk);
        for index in 3..6 {
            append_to_each(&store, &queues, index, &mut expected);
        }
        writes_left.store(allowed, Ordering::SeqCst);
        let synced = store.sync();
        if let Err(error) = synced {
            assert!(matches!(error, WriteError::StorageFull { .. }), "{error:?}");
            let (_, after) = active_segment_length(&disk);
            if after > before {
                partly_published += 1;
            }
        }
        for (queue, messages) in queues.iter().zip(&expected) {
            assert_eq!(
                &read_all(&store, queue),
                messages,
                "readable after {allowed} writes"
            );
        }
        writes_left.store(usize::MAX, Ordering::SeqCst);
        append_once_space_returns(&store, &queues[0], b"after");
        expected[0].push(b"after".to_vec());
        for index in 6..8 {
            append_to_each(&store, &queues, index, &mut expected);
        }
        store.sync().unwrap();
        let survivor = disk.crash(CrashMode::DropUnsynced, allowed as u64);
        drop(store);
        let reopened = open_sim(&survivor, options.clone());
        for (queue, messages) in queues.iter().zip(&expected) {
            assert_eq!(
                &read_all(&reopened, queue),
                messages,
                "durable after {allowed} writes"
            );
        }
    }
    assert!(
        partly_published > 0,
        "no round failed after publishing part of its chunks: {partly_published}"
    );
}

#[test]
fn given_chunks_sealed_over_time_when_asked_for_a_time_should_give_the_first_offset_at_or_after() {
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, tiny());
    let now_ms = || {
        u64::try_from(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis(),
        )
        .unwrap()
    };
    for index in 0..10_u32 {
        store.append(b"log", &index.to_le_bytes()).unwrap();
    }
    store.sync().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(5));
    let between = now_ms();
    std::thread::sleep(std::time::Duration::from_millis(5));
    for index in 10..20_u32 {
        store.append(b"log", &index.to_le_bytes()).unwrap();
    }
    store.sync().unwrap();
    assert_eq!(store.offset_at_time(b"log", 0).unwrap(), Some(0));
    assert_eq!(store.offset_at_time(b"log", between).unwrap(), Some(10));
    assert_eq!(
        store.offset_at_time(b"log", now_ms() + 60_000).unwrap(),
        Some(20),
        "nothing newer: the next offset"
    );
    assert_eq!(store.offset_at_time(b"none", 0).unwrap(), None);
}

#[test]
fn given_a_done_offset_when_retention_runs_should_remove_only_chunks_wholly_below_it() {
    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, tiny());
    for index in 0..300_u32 {
        store
            .append(b"retries", format!("entry {index:04}").as_bytes())
            .unwrap();
    }
    store.sync().unwrap();
    let done = |_: &[u8]| Retention {
        before_offset: Some(200),
        ..Retention::default()
    };
    let report = store.enforce_retention(0, done).unwrap();
    let info = store.queue_info(b"retries").unwrap().unwrap();
    assert!(report.messages_removed > 0, "{report:?}");
    assert!(
        info.first_offset <= 200,
        "offset 200 is not done: kept, got first {}",
        info.first_offset
    );
    assert_eq!(info.first_offset, report.messages_removed);
    let batch = store.read(b"retries", 200, 1, 1000).unwrap();
    assert_eq!(batch.iter().next(), Some(&b"entry 0200"[..]));
    // Nothing is done: nothing goes.
    let none = |_: &[u8]| Retention {
        before_offset: Some(0),
        ..Retention::default()
    };
    assert_eq!(
        store.enforce_retention(0, none).unwrap().messages_removed,
        0
    );
}

#[test]
fn given_a_store_switched_from_always_to_interval_then_appends_are_readable_before_their_fsync() {
    let lazy = SyncPolicy::Interval {
        interval_ms: 60_000,
    };
    // Each store appends the same way; the first crashes before waiting for its ticket.
    for wait in [false, true] {
        let disk = SimulatedDisk::new();
        let store = open_sim(&disk, tiny());
        store.append(b"q", b"durable").unwrap();
        store.set_sync_policy(lazy).unwrap();
        assert_eq!(store.sync_policy(), lazy);
        assert_eq!(
            store.options().sync,
            SyncPolicy::Always,
            "the options as opened"
        );
        // Within the minute-long interval no round runs unless asked: readable, not fsynced.
        let (offset, ticket) = store.append_deferred(b"q", b"buffered").unwrap();
        assert_eq!(offset, 1);
        assert_eq!(
            read_all(&store, b"q"),
            vec![b"durable".to_vec(), b"buffered".to_vec()]
        );
        if wait {
            store.wait_durable(ticket).unwrap();
        }
        let crashed = disk.crash(CrashMode::DropUnsynced, 5);
        drop(store);
        let mut expected = vec![b"durable".to_vec()];
        if wait {
            expected.push(b"buffered".to_vec());
        }
        assert_eq!(
            read_all(&open_sim(&crashed, tiny()), b"q"),
            expected,
            "durable only once its ticket was waited for (waited: {wait})"
        );
    }
}

#[test]
fn given_a_store_switched_back_to_always_then_an_unsynced_append_is_not_readable() {
    let disk = SimulatedDisk::new();
    let store = open_sim(
        &disk,
        StoreOptions {
            sync: SyncPolicy::Interval { interval_ms: 5 },
            ..tiny()
        },
    );
    store.set_sync_policy(SyncPolicy::Always).unwrap();
    store.append(b"q", b"durable").unwrap();
    disk.set_fault(Fault::NoSpace);
    let (_, ticket) = store.append_deferred(b"q", b"doomed").unwrap();
    assert_eq!(
        read_all(&store, b"q"),
        vec![b"durable".to_vec()],
        "only fsynced data under always"
    );
    assert!(matches!(
        store.wait_durable(ticket),
        Err(WriteError::StorageFull { .. })
    ));
}

#[test]
fn given_an_interval_out_of_bounds_when_set_then_it_is_refused_and_the_policy_kept() {
    let store = open_sim(&SimulatedDisk::new(), tiny());
    for interval_ms in [0, levee_store::SYNC_INTERVAL_MS_MAX + 1] {
        let refused = store.set_sync_policy(SyncPolicy::Interval { interval_ms });
        assert!(
            matches!(refused, Err(OptionsError::SyncInterval(ms)) if ms == interval_ms),
            "{refused:?}"
        );
    }
    assert_eq!(store.sync_policy(), SyncPolicy::Always);
}

#[test]
fn given_a_write_barrier_when_a_round_writes_then_it_runs_first_and_its_failure_writes_nothing() {
    let barrier_of = |disk: &SimulatedDisk, seen: &Arc<Mutex<Vec<u64>>>, fails: bool| {
        let (disk, seen) = (disk.clone(), Arc::clone(seen));
        Arc::new(move || {
            seen.lock().unwrap().push(disk.total_bytes());
            if fails {
                Err(io::Error::other("the log's fsync failed"))
            } else {
                Ok(())
            }
        })
    };
    let interval = StoreOptions {
        sync: SyncPolicy::Interval { interval_ms: 1 },
        ..tiny()
    };

    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, interval.clone());
    let seen = Arc::new(Mutex::new(Vec::new()));
    store.set_write_barrier(barrier_of(&disk, &seen, false));
    let before = disk.total_bytes();
    store.append(b"orders", b"first").unwrap();
    store.flush().expect("a round");
    assert!(disk.total_bytes() > before, "the message written");
    let seen_then = seen.lock().unwrap().clone();
    assert_eq!(
        seen_then,
        vec![before],
        "the barrier ran once, before the round's write, not after"
    );
    let reopened = open_sim(&disk.crash(CrashMode::DropUnsynced, 7), tiny());
    assert_eq!(read_all(&reopened, b"orders"), vec![b"first".to_vec()]);

    let disk = SimulatedDisk::new();
    let store = open_sim(&disk, interval);
    store.set_write_barrier(barrier_of(&disk, &seen, true));
    let before = disk.total_bytes();
    let (_, ticket) = store.append_deferred(b"orders", b"second").unwrap();
    let error = store
        .wait_durable(ticket)
        .expect_err("the barrier failed the round");
    assert!(
        matches!(&error, WriteError::Poisoned(reason) if reason.contains("the log's fsync failed")),
        "a failed barrier fails the store as a failed write does, naming it: {error}"
    );
    assert_eq!(
        disk.total_bytes(),
        before,
        "nothing written past a failed barrier"
    );
}
