//! The committed fixtures of the on-disk format, one per version (`tests/fixtures/format-vN/`,
//! all written by the same workload). Every later version of the crate must still open each of
//! them and find exactly these messages. The generator is `#[ignore]`d: run it only to create
//! the fixture of a new format version, never to refresh an existing one.

use std::path::PathBuf;

use levee_store::format::FORMAT_VERSION;
use levee_store::{Retention, Store, StoreOptions};

/// The format versions with a committed fixture.
const FIXTURE_VERSIONS: [u32; 4] = [1, 2, 3, 4];

/// Where the fixture of `version` is. The crate's directory is read when the test runs (cargo
/// sets it), not when it was compiled: checkouts in other places that share one target
/// directory reuse the compiled test, and the place it was compiled in may be gone.
fn fixture_directory(version: u32) -> PathBuf {
    let crate_directory = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    crate_directory.join(format!("tests/fixtures/format-v{version}"))
}

/// A copy of the fixture of `version` in a temporary directory; the id of its last segment.
fn copy_fixture(version: u32) -> (tempfile::TempDir, u32) {
    let copy = tempfile::tempdir().unwrap();
    let mut last_id = 0;
    let mut files = 0;
    for entry in std::fs::read_dir(fixture_directory(version)).expect("fixture committed") {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.path().join(entry.file_name())).unwrap();
        let name = entry.file_name().into_string().unwrap();
        last_id = last_id.max(levee_store::format::parse_segment_file_name(&name).unwrap());
        files += 1;
    }
    assert!(
        files > 1,
        "the fixture of version {version} spans several segments"
    );
    (copy, last_id)
}

fn options() -> StoreOptions {
    StoreOptions {
        segment_bytes_max: 4096,
        chunk_bytes: 256,
        buffer_budget_bytes: 4096,
        message_bytes_max: 1024,
        ..StoreOptions::default()
    }
}

fn alpha(index: u64) -> Vec<u8> {
    if index == 50 {
        Vec::new()
    } else {
        format!("alpha-{index}").into_bytes()
    }
}

fn beta(index: u64) -> Vec<u8> {
    vec![b'b' + u8::try_from(index).unwrap(); 300]
}

#[test]
#[ignore = "writes the committed fixture; run only for a new format version"]
fn generate_fixture_of_this_format_version() {
    let directory = fixture_directory(FORMAT_VERSION);
    let _ = std::fs::remove_dir_all(&directory);
    let (store, _) = Store::open(&directory, options()).unwrap();
    for index in 0..51 {
        store.append(b"alpha", &alpha(index)).unwrap();
    }
    for index in 0..10 {
        store.append(b"beta", &beta(index)).unwrap();
    }
    for index in 0..5 {
        store
            .append(b"gamma", format!("gamma-old-{index}").as_bytes())
            .unwrap();
    }
    store.delete_queue(b"gamma").unwrap();
    for index in 0..2 {
        store
            .append(b"gamma", format!("gamma-new-{index}").as_bytes())
            .unwrap();
    }
    for index in 0..40 {
        store
            .append(b"delta", format!("delta-{index}").as_bytes())
            .unwrap();
    }
    let policy = |queue: &[u8]| {
        if queue == b"delta" {
            Retention {
                max_bytes: Some(150),
                max_age_ms: None,
                before_offset: None,
            }
        } else {
            Retention::default()
        }
    };
    store.enforce_retention(0, policy).unwrap();
    store.close().unwrap();
    // The lock file is created by every open: not part of the fixture.
    std::fs::remove_file(directory.join(levee_store::LOCK_FILE_NAME)).unwrap();
}

fn read_all(store: &Store, queue: &[u8]) -> (u64, Vec<Vec<u8>>) {
    let info = store.queue_info(queue).unwrap().expect("queue in fixture");
    let mut messages = Vec::new();
    let mut offset = info.first_offset;
    loop {
        let batch = store.read(queue, offset, 7, 1000).unwrap();
        if batch.is_empty() {
            return (info.first_offset, messages);
        }
        messages.extend(batch.iter().map(<[u8]>::to_vec));
        offset = batch.next_offset();
    }
}

#[test]
fn given_each_format_fixture_when_opening_should_read_every_message() {
    for version in FIXTURE_VERSIONS {
        let (copy, _) = copy_fixture(version);
        let (store, report) = Store::open(copy.path(), options()).unwrap();
        assert!(report.truncated.is_empty(), "version {version}: {report:?}");
        assert_eq!(report.queues, 4, "version {version}");
        check_fixture_messages(&store);
    }
}

fn check_fixture_messages(store: &Store) {
    let (first, messages) = read_all(store, b"alpha");
    assert_eq!(first, 0);
    assert_eq!(messages, (0..51).map(alpha).collect::<Vec<_>>());

    let (first, messages) = read_all(store, b"beta");
    assert_eq!(first, 0);
    assert_eq!(messages, (0..10).map(beta).collect::<Vec<_>>());

    let (first, messages) = read_all(store, b"gamma");
    assert_eq!(first, 0, "a deleted and re-created queue restarts at 0");
    assert_eq!(
        messages,
        vec![b"gamma-new-0".to_vec(), b"gamma-new-1".to_vec()]
    );

    let (first, messages) = read_all(store, b"delta");
    assert!(
        first > 0 && first < 40,
        "delta was trimmed: first retained {first}"
    );
    let expected: Vec<Vec<u8>> = (first..40)
        .map(|index| format!("delta-{index}").into_bytes())
        .collect();
    assert_eq!(messages, expected);

    let mut names = store.list_queues(None, 10);
    names.sort();
    assert_eq!(
        names,
        vec![
            b"alpha".to_vec(),
            b"beta".to_vec(),
            b"delta".to_vec(),
            b"gamma".to_vec()
        ]
    );
}

#[test]
fn given_an_older_format_fixture_when_appending_should_continue_in_a_segment_of_this_version() {
    for version in FIXTURE_VERSIONS
        .into_iter()
        .filter(|version| *version < FORMAT_VERSION)
    {
        let (copy, last_id) = copy_fixture(version);
        let (store, _) = Store::open(copy.path(), options()).unwrap();
        assert_eq!(store.append(b"alpha", b"alpha-51").unwrap(), 51);
        store.close().unwrap();
        let version_of = |id: u32| {
            let path = copy.path().join(levee_store::format::segment_file_name(id));
            let bytes = std::fs::read(path).unwrap();
            u32::from_le_bytes(bytes[8..12].try_into().unwrap())
        };
        assert_eq!(
            version_of(last_id),
            version,
            "the version-{version} segment is left as it was"
        );
        assert_eq!(
            version_of(last_id + 1),
            FORMAT_VERSION,
            "new records go to a segment of this version"
        );
        let (store, report) = Store::open(copy.path(), options()).unwrap();
        assert!(report.truncated.is_empty(), "{report:?}");
        let (_, messages) = read_all(&store, b"alpha");
        let mut expected: Vec<Vec<u8>> = (0..51).map(alpha).collect();
        expected.push(b"alpha-51".to_vec());
        assert_eq!(messages, expected, "version {version}");
    }
}

#[test]
fn given_the_version_4_fixture_when_decoding_its_log_batches_should_find_every_append() {
    // Its log batch records are dead (the close sealed every message into chunks, and the
    // newest floor covers them), so an open checks their checksums but does not replay them:
    // decode them here, so that the kind-6 bytes stay pinned too.
    let directory = fixture_directory(4);
    let mut runs: Vec<(Vec<u8>, u64, Vec<Vec<u8>>)> = Vec::new();
    for id in 1..=3 {
        let path = directory.join(levee_store::format::segment_file_name(id));
        let bytes = std::fs::read(path).unwrap();
        let mut position = 32;
        while position < bytes.len() {
            let body = u32::from_le_bytes(bytes[position + 4..position + 8].try_into().unwrap());
            let end = position + 8 + body as usize;
            let record = levee_store::format::decode_checked(&bytes[position..end]).unwrap();
            if let levee_store::format::Record::LogBatch(batch) = record {
                for run in batch.runs() {
                    let messages = run.messages().map(<[u8]>::to_vec).collect();
                    runs.push((run.name.to_vec(), run.first_offset, messages));
                }
            }
            position = end;
        }
    }
    // One append per call under `always`: one run per record, in append order; a message
    // that filled its queue's chunk (here offset 33) went straight into a chunk, with no log.
    let alpha_runs: Vec<(u64, Vec<Vec<u8>>)> = runs
        .iter()
        .filter(|(name, _, _)| name == b"alpha")
        .map(|(_, offset, messages)| (*offset, messages.clone()))
        .collect();
    let expected: Vec<(u64, Vec<Vec<u8>>)> = (0..51)
        .filter(|&index| index != 33)
        .map(|index| (index, vec![alpha(index)]))
        .collect();
    assert_eq!(alpha_runs, expected);
    let gammas: Vec<&[Vec<u8>]> = runs
        .iter()
        .filter(|(name, _, _)| name == b"gamma")
        .map(|(_, _, messages)| messages.as_slice())
        .collect();
    assert_eq!(gammas.len(), 7, "five before the delete, two after");
    assert_eq!(gammas[5], [b"gamma-new-0".to_vec()]);
}
