//! Recovery tests that need its internals: replaying log batches of many shards, and
//! recovering on one thread or three.

use super::*;
use crate::queue::ChunkEntry;
use crate::{CrashMode, SimulatedDisk, Store};

/// A queue after a recovery: name, offsets, chunk entries, buffered count and bytes.
type Rebuilt = (Vec<u8>, u64, u64, Vec<ChunkEntry>, usize, Vec<u8>);

/// Every queue after a recovery, sorted by name.
fn queues(recovered: &Recovered) -> Vec<Rebuilt> {
    let mut queues: Vec<Rebuilt> = recovered
        .shards
        .iter()
        .flat_map(|shard| shard.queues.values())
        .map(|state| {
            (
                state.name.to_vec(),
                state.first_offset,
                state.next_offset,
                state.chunks.iter().collect(),
                state.buffer.as_ref().map_or(0, |buffer| buffer.count),
                state
                    .buffer
                    .as_ref()
                    .map_or_else(Vec::new, |buffer| buffer.bytes().to_vec()),
            )
        })
        .collect();
    queues.sort_by(|one, other| one.0.cmp(&other.0));
    queues
}

#[test]
fn given_a_log_batch_naming_queues_of_many_shards_when_recovering_should_replay_every_run() {
    // The writer never mixes lock shards in one record; the format allows it.
    let mut bytes = format::encode_segment_header(1).to_vec();
    format::encode_floor(&mut bytes, format::LogFloor::default());
    let mut open = None;
    let names: Vec<Vec<u8>> = (0..40)
        .map(|index| format!("queue-{index}").into_bytes())
        .collect();
    for (index, name) in names.iter().enumerate() {
        let first = format!("first-{index}");
        format::append_log_run(&mut bytes, &mut open, name, 0, 1, &[first.as_bytes()]);
    }
    for name in &names {
        format::append_log_run(&mut bytes, &mut open, name, 1, 1, &[b"second", b"third"]);
    }
    format::seal_log_batch(&mut bytes, open.unwrap());
    let hasher = crate::store::shard_hasher();
    let shards: std::collections::HashSet<usize> = names
        .iter()
        .map(|name| crate::store::shard_of(hasher, name))
        .collect();
    assert!(shards.len() > 10, "runs of many shards in one record");
    let disk = SimulatedDisk::new();
    disk.put_file(&format::segment_file_name(1), &bytes);
    let (store, report) =
        Store::open_with_storage(Arc::new(disk), StoreOptions::default()).unwrap();
    assert!(report.truncated.is_empty(), "{report:?}");
    assert_eq!((report.queues, report.messages), (40, 120));
    for (index, name) in names.iter().enumerate() {
        let batch = store.read(name, 0, 10, 1 << 20).unwrap();
        let messages: Vec<&[u8]> = batch.iter().collect();
        let first = format!("first-{index}");
        assert_eq!(messages, vec![first.as_bytes(), b"second", b"third"]);
    }
}

#[test]
fn given_a_crashed_store_when_recovering_on_one_thread_or_three_then_the_queues_match() {
    let options = StoreOptions {
        segment_bytes_max: 16 << 10,
        chunk_bytes: 64,
        buffer_budget_bytes: 32 << 10,
        message_bytes_max: 1024,
        ..StoreOptions::default()
    };
    let disk = SimulatedDisk::new();
    let (store, _) = Store::open_with_storage(Arc::new(disk.clone()), options.clone()).unwrap();
    for index in 0..6_000_u32 {
        let queue = format!("queue-{}", index % 97);
        store
            .append(queue.as_bytes(), &index.to_le_bytes())
            .unwrap();
        if index % 1_500 == 0 {
            store.delete_queue(b"queue-5").unwrap();
        }
    }
    let survivor = disk.crash(CrashMode::DropUnsynced, 1);
    drop(store);
    let one = recover_on(&survivor.crash(CrashMode::DropUnsynced, 2), &options, false);
    let three = recover_on(&survivor.crash(CrashMode::DropUnsynced, 3), &options, true);
    let (one, three) = (one.unwrap(), three.unwrap());
    assert_eq!(one.report.messages, three.report.messages);
    assert_eq!(
        one.report.log_records_skipped,
        three.report.log_records_skipped
    );
    assert_eq!(queues(&one), queues(&three));
    assert_eq!(queues(&one).len(), 97);
    // Both paths had work: log records skipped before the floor, tails replayed after it.
    assert!(one.report.log_records_skipped > 0, "{:?}", one.report);
    assert!(queues(&one).iter().any(|queue| queue.4 > 0));
    // Incarnations are unique on both paths.
    for recovered in [&one, &three] {
        let mut seen: Vec<u64> = recovered
            .shards
            .iter()
            .flat_map(|shard| shard.queues.values().map(|state| state.incarnation))
            .collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 97);
        assert!(
            seen.iter()
                .all(|incarnation| *incarnation < recovered.next_incarnation)
        );
    }
}
