//! Every decoder of the broker that reads bytes from disk or the network, fed arbitrary bytes
//! and valid records with bytes flipped, cut or appended: never a panic, never unbounded
//! memory (nothing here allocates more than its input), always a clear error or a value that
//! later calls handle without panicking either.

use levee_broker::catalog::{Catalog, CatalogRecord};
use levee_broker::group::{GroupCoordinator, decode_committed, encode_committed};
use levee_broker::position::{
    PositionBook, decode_queue_position, encode_log_records, encode_queue_position,
};
use levee_broker::producer::{ProducerRuns, Run, encode_runs};
use proptest::prelude::*;

/// A valid record with one byte replaced, then cut to `keep` bytes and `tail` appended.
fn mutate(mut record: Vec<u8>, at: usize, byte: u8, keep: usize, tail: &[u8]) -> Vec<u8> {
    if !record.is_empty() {
        let index = at % record.len();
        record[index] = byte;
    }
    record.truncate(keep.max(1).min(record.len()));
    record.extend_from_slice(tail);
    record
}

fn valid_records() -> Vec<Vec<u8>> {
    let run = |first_sequence, count, first_offset| Run {
        first_sequence,
        count,
        first_offset,
        ticket: None,
    };
    vec![
        encode_log_records([(&b"q"[..], 5), (b"orders", 9)].into_iter(), 3, 1 << 10).remove(0),
        encode_queue_position(7, b"orders"),
        encode_committed(&[1, 2, 3]),
        encode_runs(&[(&b"q"[..], run(0, 2, 10)), (b"r", run(5, 1, 0))]),
        CatalogRecord::Topic {
            topic: "orders".to_owned(),
            partitions: 8,
        }
        .encode(),
        br#"{"kind":"retention","prefix_hex":"6472","max_age_ms":5,"max_bytes":0}"#.to_vec(),
        br#"{"kind":"producer_rate","producer_name":"p","messages_per_s":5.0}"#.to_vec(),
        // Well-formed, but over every bound: applying it must refuse, not build four billion
        // partitions.
        br#"{"kind":"topic","topic":"huge","partitions":4000000000}"#.to_vec(),
    ]
}

/// Feeds `bytes` to every decoder, and what they decode to the calls that use it.
fn decode_everything(bytes: &[u8]) {
    let mut book = PositionBook::default();
    let _ = book.apply_record(bytes);
    let _ = book.snapshot_records(1 << 10);
    let _ = decode_queue_position(bytes, b"orders");
    let committed = decode_committed(bytes);
    assert!(committed.len() <= bytes.len() / 8);
    let mut group = GroupCoordinator::new(4, committed);
    group.join("m", 1, 1_000, 0).unwrap();
    let _ = group.commit("m", 0, 1, 5, 10);
    let mut runs = ProducerRuns::default();
    runs.load_record(bytes);
    for queue in [&b"q"[..], b"r", b""] {
        for (first, last) in [(0, 0), (5, 9), (u64::MAX - 1, u64::MAX)] {
            let _ = runs.judge(queue, first, last);
        }
    }
    if let Ok(record) = CatalogRecord::decode(bytes, 0) {
        let mut catalog = Catalog::default();
        let _ = catalog.apply(&record, 0);
        let _ = catalog.retention().rule_for(b"driver-7");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn given_arbitrary_bytes_then_no_decoder_panics(
        bytes in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        decode_everything(&bytes);
    }

    #[test]
    fn given_valid_records_with_bytes_flipped_cut_or_added_then_no_decoder_panics(
        which in 0_usize..8,
        at in any::<usize>(),
        byte in any::<u8>(),
        keep in 0_usize..200,
        tail in proptest::collection::vec(any::<u8>(), 0..40),
    ) {
        let record = valid_records().swap_remove(which);
        decode_everything(&mutate(record, at, byte, keep, &tail));
    }
}
