//! The store's decoders fed hostile bytes: arbitrary bytes to the record decoders, and a real
//! store's files with several bytes changed, cut short or grown, reopened. Never a panic; the
//! open answers an error or a store whose every message reads back exactly as written (a
//! damaged record is cut with what follows it, never served).

use std::sync::{Arc, OnceLock};

use levee_store::{SimulatedDisk, Store, StoreOptions, format};
use proptest::prelude::*;

fn options() -> StoreOptions {
    StoreOptions {
        segment_bytes_max: 1 << 20,
        chunk_bytes: 64,
        buffer_budget_bytes: 4096,
        message_bytes_max: 1024,
        round_write_bytes: 256,
        ..StoreOptions::default()
    }
}

const QUEUES: [&[u8]; 3] = [b"a", b"orders", b"\0position\0app\0x"];

fn message(queue: usize, index: usize) -> Vec<u8> {
    format!("{queue}-{index}-{}", "x".repeat(index % 7)).into_bytes()
}

/// A store's files after appends to three queues, a trim and a reopen, made once.
fn written() -> &'static Vec<(String, Vec<u8>)> {
    static FILES: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    FILES.get_or_init(|| {
        let disk = SimulatedDisk::new();
        let store = Store::open_with_storage(Arc::new(disk.clone()), options())
            .unwrap()
            .0;
        for index in 0..30 {
            for (queue, name) in QUEUES.iter().enumerate() {
                store.append(name, &message(queue, index)).unwrap();
            }
        }
        store.close().unwrap();
        (1..=8)
            .map(format::segment_file_name)
            .filter_map(|name| disk.file_bytes(&name).map(|bytes| (name, bytes)))
            .collect()
    })
}

fn read_all(store: &Store, queue: &[u8]) -> Option<(u64, Vec<Vec<u8>>)> {
    let info = store.queue_info(queue).ok()??;
    let mut messages = Vec::new();
    let mut offset = info.first_offset;
    loop {
        let batch = store.read(queue, offset, 1_000, usize::MAX).ok()?;
        if batch.is_empty() {
            return Some((info.first_offset, messages));
        }
        messages.extend(batch.iter().map(<[u8]>::to_vec));
        offset = batch.next_offset();
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn given_arbitrary_bytes_then_the_record_decoders_answer_without_panicking(
        bytes in proptest::collection::vec(any::<u8>(), 0..600),
    ) {
        let _ = format::decode_checked(&bytes);
        let _ = format::decode_record(&bytes);
        let _ = format::checksum_matches(&bytes);
        let _ = format::is_log_record(&bytes);
        if let Ok(header) = <[u8; 32]>::try_from(bytes.get(..32).unwrap_or_default()) {
            let _ = format::decode_segment_header(&header);
        }
    }

    #[test]
    fn given_damaged_files_when_reopened_then_no_panic_and_nothing_corrupt_is_served(
        file in any::<prop::sample::Index>(),
        changes in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..5),
        cut in proptest::option::of(any::<prop::sample::Index>()),
        grown in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let files = written();
        let target = file.index(files.len());
        let disk = SimulatedDisk::new();
        for (index, (name, bytes)) in files.iter().enumerate() {
            let mut bytes = bytes.clone();
            if index == target {
                for (at, byte) in &changes {
                    let at = at.index(bytes.len());
                    bytes[at] = *byte;
                }
                if let Some(cut) = cut {
                    bytes.truncate(cut.index(bytes.len()));
                }
                bytes.extend_from_slice(&grown);
            }
            disk.put_file(name, &bytes);
        }
        let Ok((store, _report)) = Store::open_with_storage(Arc::new(disk), options()) else {
            return Ok(());
        };
        for (queue, name) in QUEUES.iter().enumerate() {
            let Some((first, messages)) = read_all(&store, name) else { continue };
            for (offset, got) in (first..).zip(&messages) {
                let index = usize::try_from(offset).unwrap();
                prop_assert!(index < 30, "queue {queue}: offset {offset} was never written");
                prop_assert_eq!(got, &message(queue, index), "queue {} offset {}", queue, offset);
            }
        }
    }
}

#[test]
fn given_the_written_files_then_they_hold_every_message() {
    let files = written();
    assert!(!files.is_empty());
    let disk = SimulatedDisk::new();
    for (name, bytes) in files {
        disk.put_file(name, bytes);
    }
    let store = Store::open_with_storage(Arc::new(disk), options())
        .unwrap()
        .0;
    for (queue, name) in QUEUES.iter().enumerate() {
        let (first, messages) = read_all(&store, name).unwrap();
        assert_eq!(first, 0);
        assert_eq!(messages.len(), 30, "queue {queue}");
    }
}
