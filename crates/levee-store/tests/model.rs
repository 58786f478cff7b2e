//! Property test: the store against a `HashMap<queue, Vec<message>>` model, on a simulated
//! disk that crashes at random points. After every recovery each acknowledged message must be
//! there, in order, at its offset, and nothing else.
#![allow(
    clippy::too_many_lines,
    clippy::cast_possible_truncation,
    clippy::needless_pass_by_value,
    reason = "test driver: one long match over operations, small values"
)]

use std::collections::BTreeMap;
use std::sync::Arc;

use levee_store::{
    CrashMode, Fault, Retention, SimulatedDisk, Store, StoreOptions, SyncPolicy, WriteError,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Operation {
    /// Under `always`: an append while the disk is full must fail and change nothing.
    AppendOnFullDisk {
        queue: u8,
        length: usize,
    },
    Append {
        queue: u8,
        length: usize,
    },
    AppendBatch {
        messages: Vec<(u8, usize)>,
    },
    /// Many messages to one queue, to fill segments and make old ones mostly dead.
    Flood {
        queue: u8,
        count: usize,
    },
    Read {
        queue: u8,
        offset: u64,
        max_messages: usize,
        max_bytes: usize,
    },
    Delete {
        queue: u8,
    },
    TrimToBytes {
        queue: u8,
        max_bytes: u64,
    },
    Sync,
    Reopen,
    Crash {
        mode: u8,
        seed: u64,
    },
}

fn operation() -> impl Strategy<Value = Operation> {
    let length = prop_oneof![8 => 0_usize..40, 1 => 40_usize..300];
    prop_oneof![
        20 => (0_u8..5, length.clone()).prop_map(|(queue, length)| Operation::Append { queue, length }),
        5 => prop::collection::vec((0_u8..5, length), 1..12)
            .prop_map(|messages| Operation::AppendBatch { messages }),
        5 => (0_u8..5, 0_u64..60, 1_usize..20, 1_usize..400).prop_map(
            |(queue, offset, max_messages, max_bytes)| Operation::Read { queue, offset, max_messages, max_bytes }
        ),
        1 => (0_u8..5).prop_map(|queue| Operation::Delete { queue }),
        2 => (0_u8..5, 10_usize..60).prop_map(|(queue, count)| Operation::Flood { queue, count }),
        2 => (0_u8..5, 0_u64..400).prop_map(|(queue, max_bytes)| Operation::TrimToBytes { queue, max_bytes }),
        1 => Just(Operation::Sync),
        1 => Just(Operation::Reopen),
        3 => (0_u8..3, any::<u64>()).prop_map(|(mode, seed)| Operation::Crash { mode, seed }),
        2 => (0_u8..5, 0_usize..300).prop_map(|(queue, length)| Operation::AppendOnFullDisk { queue, length }),
    ]
}

#[derive(Debug, Default, Clone)]
struct ModelQueue {
    first: u64,
    /// Every message from offset 0; entries before `first` are trimmed.
    messages: Vec<Vec<u8>>,
    /// Under `interval`: messages known durable (up to the last sync or delete).
    durable: usize,
}

fn queue_name(queue: u8) -> Vec<u8> {
    format!("queue-{queue}").into_bytes()
}

fn message(sequence: &mut u64, length: usize) -> Vec<u8> {
    *sequence += 1;
    let stamp = format!("#{sequence}#");
    let mut bytes = stamp.into_bytes();
    bytes.resize(length, b'a' + u8::try_from(*sequence % 26).unwrap());
    bytes.truncate(length);
    bytes
}

fn open(disk: &SimulatedDisk, options: &StoreOptions) -> Store {
    let (store, _report) =
        Store::open_with_storage(Arc::new(disk.clone()), options.clone()).expect("open");
    store
}

/// The store must hold exactly the model.
fn check_equal(store: &Store, model: &BTreeMap<Vec<u8>, ModelQueue>) {
    let mut listed = Vec::new();
    let mut after: Option<Vec<u8>> = None;
    loop {
        let page = store.list_queues(after.as_deref(), 2);
        if page.is_empty() {
            break;
        }
        after = page.last().cloned();
        listed.extend(page);
    }
    listed.sort();
    let expected: Vec<Vec<u8>> = model.keys().cloned().collect();
    assert_eq!(listed, expected, "listed queues");
    for (name, queue) in model {
        let info = store.queue_info(name).unwrap().expect("queue exists");
        assert_eq!(info.first_offset, queue.first, "first offset of {name:?}");
        assert_eq!(
            info.next_offset,
            queue.messages.len() as u64,
            "next offset of {name:?}"
        );
        let mut offset = 0;
        let mut first_read = true;
        loop {
            let batch = store.read(name, offset, 7, 150).unwrap();
            if first_read {
                assert_eq!(batch.skipped_to_first_retained, queue.first > 0);
                first_read = false;
            }
            if batch.is_empty() {
                break;
            }
            for (index, message) in batch.iter().enumerate() {
                let at = usize::try_from(batch.first_offset).unwrap() + index;
                assert_eq!(message, &queue.messages[at][..], "message {at} of {name:?}");
            }
            offset = batch.next_offset();
        }
        assert_eq!(
            offset.max(queue.first),
            queue.messages.len() as u64,
            "read all of {name:?}"
        );
    }
}

fn run(operations: Vec<Operation>, options: StoreOptions) {
    let interval = options.sync != SyncPolicy::Always;
    let mut disk = SimulatedDisk::new();
    let mut store = open(&disk, &options);
    let mut model: BTreeMap<Vec<u8>, ModelQueue> = BTreeMap::new();
    let mut sequence = 0;
    for operation in operations {
        match operation {
            Operation::Append { queue, length } => {
                let name = queue_name(queue);
                let bytes = message(&mut sequence, length);
                let offset = store.append(&name, &bytes).unwrap();
                let entry = model.entry(name).or_default();
                assert_eq!(offset, entry.messages.len() as u64);
                entry.messages.push(bytes);
                if !interval {
                    entry.durable = entry.messages.len();
                }
            }
            Operation::AppendBatch { messages } => {
                let owned: Vec<(Vec<u8>, Vec<u8>)> = messages
                    .iter()
                    .map(|(queue, length)| (queue_name(*queue), message(&mut sequence, *length)))
                    .collect();
                let batch: Vec<(&[u8], &[u8])> = owned
                    .iter()
                    .map(|(name, bytes)| (&name[..], &bytes[..]))
                    .collect();
                let offsets = store.append_batch(&batch).unwrap();
                for ((name, bytes), offset) in owned.into_iter().zip(offsets) {
                    let entry = model.entry(name).or_default();
                    assert_eq!(offset, entry.messages.len() as u64);
                    entry.messages.push(bytes);
                    if !interval {
                        entry.durable = entry.messages.len();
                    }
                }
            }
            Operation::Flood { queue, count } => {
                let name = queue_name(queue);
                let owned: Vec<Vec<u8>> = (0..count).map(|_| message(&mut sequence, 80)).collect();
                let batch: Vec<(&[u8], &[u8])> =
                    owned.iter().map(|bytes| (&name[..], &bytes[..])).collect();
                let offsets = store.append_batch(&batch).unwrap();
                let entry = model.entry(name).or_default();
                for (bytes, offset) in owned.into_iter().zip(offsets) {
                    assert_eq!(offset, entry.messages.len() as u64);
                    entry.messages.push(bytes);
                }
                if !interval {
                    entry.durable = entry.messages.len();
                }
            }
            Operation::Read {
                queue,
                offset,
                max_messages,
                max_bytes,
            } => {
                let name = queue_name(queue);
                let batch = store.read(&name, offset, max_messages, max_bytes).unwrap();
                let Some(entry) = model.get(&name) else {
                    assert!(batch.is_empty());
                    continue;
                };
                let start = offset.max(entry.first);
                assert_eq!(batch.first_offset, start);
                assert_eq!(batch.skipped_to_first_retained, offset < entry.first);
                assert!(batch.len() <= max_messages);
                let available = (entry.messages.len() as u64).saturating_sub(start);
                if available > 0 {
                    assert!(
                        !batch.is_empty(),
                        "read at {start} of {available} available"
                    );
                }
                if batch.len() > 1 {
                    assert!(batch.bytes() <= max_bytes);
                }
                for (index, message) in batch.iter().enumerate() {
                    let at = usize::try_from(start).unwrap() + index;
                    assert_eq!(message, &entry.messages[at][..]);
                }
            }
            Operation::Delete { queue } => {
                let name = queue_name(queue);
                let existed = store.delete_queue(&name).unwrap();
                assert_eq!(existed, model.remove(&name).is_some());
                // Under `interval` a delete waits for the round that writes its own record
                // only: appends to other shards that came after the committer took their logs
                // for that round go out in the next one, so nothing else is known durable (the
                // model once assumed otherwise and failed, rarely, on that timing).
            }
            Operation::TrimToBytes { queue, max_bytes } => {
                let name = queue_name(queue);
                let policy = |candidate: &[u8]| {
                    if candidate == &name[..] {
                        Retention {
                            max_bytes: Some(max_bytes),
                            max_age_ms: None,
                            before_offset: None,
                        }
                    } else {
                        Retention::default()
                    }
                };
                let report = store.enforce_retention(0, policy).unwrap();
                if let Some(entry) = model.get_mut(&name) {
                    let info = store.queue_info(&name).unwrap().unwrap();
                    assert!(info.first_offset >= entry.first);
                    assert!(info.first_offset <= entry.messages.len() as u64);
                    assert_eq!(report.messages_removed, info.first_offset - entry.first);
                    entry.first = info.first_offset;
                    if report.messages_removed > 0 && interval {
                        for entry in model.values_mut() {
                            entry.durable = entry.messages.len();
                        }
                    }
                } else {
                    assert_eq!(report.messages_removed, 0);
                }
            }
            Operation::Sync => {
                store.sync().unwrap();
                for entry in model.values_mut() {
                    entry.durable = entry.messages.len();
                }
            }
            Operation::Reopen => {
                store.close().unwrap();
                store = open(&disk, &options);
                for entry in model.values_mut() {
                    entry.durable = entry.messages.len();
                }
            }
            Operation::AppendOnFullDisk { queue, length } => {
                if interval {
                    continue;
                }
                let bytes = message(&mut sequence, length);
                disk.set_fault(Fault::NoSpace);
                let result = store.append(&queue_name(queue), &bytes);
                disk.set_fault(Fault::None);
                assert!(
                    matches!(result, Err(WriteError::StorageFull { .. })),
                    "{result:?}"
                );
            }
            Operation::Crash { mode, seed } => {
                let mode = match mode {
                    0 => CrashMode::DropUnsynced,
                    1 => CrashMode::TearUnsynced,
                    _ => CrashMode::TearAndDamage,
                };
                let survivor = disk.crash(mode, seed);
                drop(store);
                disk = survivor;
                store = open(&disk, &options);
                if !interval {
                    check_equal(&store, &model);
                }
                if interval {
                    // Unsynced messages may be lost, but only from the end of a queue.
                    let mut recovered = BTreeMap::new();
                    for (name, mut entry) in std::mem::take(&mut model) {
                        let info = store.queue_info(&name).unwrap();
                        let next = info.map_or(0, |info| info.next_offset);
                        assert!(
                            next as usize >= entry.durable,
                            "lost a synced message of {name:?}"
                        );
                        assert!(
                            next as usize <= entry.messages.len(),
                            "invented messages in {name:?}"
                        );
                        entry.messages.truncate(usize::try_from(next).unwrap());
                        entry.durable = entry.messages.len();
                        match info {
                            Some(info) => {
                                entry.first = info.first_offset.max(entry.first.min(next));
                                recovered.insert(name, entry);
                            }
                            None => assert_eq!(entry.durable, 0),
                        }
                    }
                    model = recovered;
                }
            }
        }
    }
    check_equal(&store, &model);
    store.close().unwrap();
    let store = open(&disk, &options);
    check_equal(&store, &model);
}

fn small_options() -> impl Strategy<Value = StoreOptions> {
    (4096_u64..6000, 16_usize..300, 0_usize..4000, 64_usize..3000).prop_map(
        |(segment, chunk, extra, round_write)| StoreOptions {
            sync: SyncPolicy::Always,
            segment_bytes_max: segment,
            chunk_bytes: chunk,
            buffer_budget_bytes: 512 + extra,
            message_bytes_max: 512,
            round_write_bytes: round_write,
            direct_writes: false,
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn given_sync_always_when_crashing_anywhere_should_keep_every_acknowledged_message(
        operations in prop::collection::vec(operation(), 1..100),
        options in small_options(),
    ) {
        run(operations, options);
    }

    #[test]
    fn given_sync_interval_when_crashing_anywhere_should_keep_synced_prefix(
        operations in prop::collection::vec(operation(), 1..100),
        options in small_options(),
        interval_ms in 1_u64..5,
    ) {
        run(operations, StoreOptions { sync: SyncPolicy::Interval { interval_ms }, ..options });
    }
}
