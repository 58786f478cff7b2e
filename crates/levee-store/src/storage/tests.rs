//! Tests of the file interface: positioned and direct writes read back, in every order and
//! alignment.

use super::*;

/// Writes `writes` (position, length, fill byte) through a file of `storage` and checks the
/// file holds what a plain model of the same writes holds, after each write.
fn write_and_compare(storage: &OsStorage, name: &str, writes: &[(u64, usize, u8)]) -> OsFile {
    write_and_compare_at(storage, name, writes, true)
}

/// As [`write_and_compare`]; with `check_each` false, checks only after the last write, so
/// writes follow each other while earlier ones are still in flight.
fn write_and_compare_at(
    storage: &OsStorage,
    name: &str,
    writes: &[(u64, usize, u8)],
    check_each: bool,
) -> OsFile {
    let file = create_file(storage, name);
    let mut model: Vec<u8> = Vec::new();
    for &(position, length, fill) in writes {
        let data = write_data(length, fill);
        file.write_at(position, &data).unwrap();
        write_model(&mut model, position, &data);
        if !check_each {
            continue;
        }
        assert_eq!(file.len().unwrap(), model.len() as u64);
        assert_holds(
            &file,
            &model,
            &format!("after writing {length} bytes at {position}"),
        );
    }
    file.sync().unwrap();
    assert_holds(&file, &model, "after its writes");
    file
}

/// Asserts that `file` starts with exactly the bytes of `model` (`when` names the moment).
fn assert_holds(file: &OsFile, model: &[u8], when: &str) {
    let mut read = vec![0; model.len()];
    file.read_at(0, &mut read).unwrap();
    assert!(read == model, "the file differs {when}");
}

/// As [`write_and_compare_at`] (checking after the last write only), each write made with
/// [`StorageFile::write_bytes`] from one [`WriteBytes`] kept across them, so that its memory
/// goes to the background writer and comes back as another's; with `moved`, the bytes are
/// appended to its `Vec` without making room first, so that the buffer may move and lose
/// its layout.
fn write_bytes_and_compare(
    storage: &OsStorage,
    name: &str,
    writes: &[(u64, usize, u8)],
    moved: bool,
) -> OsFile {
    let file = create_file(storage, name);
    let mut model: Vec<u8> = Vec::new();
    let mut bytes = WriteBytes::new();
    for &(position, length, fill) in writes {
        let data = write_data(length, fill);
        if bytes.position() != position {
            bytes.reset(position);
        }
        if moved {
            bytes.vec_mut().extend_from_slice(&data);
        } else {
            bytes.extend_from_slice(&data);
        }
        assert!(moved || bytes.laid_out());
        file.write_bytes(&mut bytes).unwrap();
        assert!(bytes.is_empty());
        assert_eq!(bytes.position(), position + length as u64);
        assert!(bytes.laid_out(), "emptied for the next bytes, laid out");
        write_model(&mut model, position, &data);
    }
    file.sync().unwrap();
    assert_holds(&file, &model, "after its writes");
    file
}

/// A new file `segment` of `storage` (in `directory`) whose "direct" handle is opened
/// read-only: every direct write fails (EBADF).
fn failing_direct_file(directory: &tempfile::TempDir, storage: &OsStorage) -> OsFile {
    let file = create_file(storage, "segment");
    let read_only = File::open(directory.path().join("segment")).unwrap();
    file.direct.set(Some(Arc::new(read_only))).unwrap();
    file
}

/// A new file of `storage`.
fn create_file(storage: &OsStorage, name: &str) -> OsFile {
    let handle = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(storage.directory().join(name))
        .unwrap();
    storage.os_file(name, handle)
}

/// Writes `data` at `position` of a plain model of a file.
fn write_model(model: &mut Vec<u8>, position: u64, data: &[u8]) {
    let start = usize::try_from(position).unwrap();
    if model.len() < start + data.len() {
        model.resize(start + data.len(), 0);
    }
    model[start..start + data.len()].copy_from_slice(data);
}

/// Distinct bytes within a write, so a block written to the wrong place shows.
fn write_data(length: usize, fill: u8) -> Vec<u8> {
    (0..length)
        .map(|index| fill.wrapping_add((index / 4096).to_le_bytes()[0]) ^ index.to_le_bytes()[0])
        .collect()
}

/// A fresh directory and its storage with direct writes.
fn direct_storage() -> (tempfile::TempDir, OsStorage) {
    let directory = tempfile::tempdir().unwrap();
    let storage = OsStorage::new(directory.path())
        .unwrap()
        .with_direct_writes(true);
    (directory, storage)
}

#[test]
fn given_direct_writes_when_runs_of_any_size_and_position_are_written_should_read_back_as_written()
{
    let (directory, storage) = direct_storage();
    // Appends: unaligned ends, exactly aligned, larger than the 8 MiB copy, tiny between
    // large ones; then an overwrite of written data and an append after it.
    let mut writes = Vec::new();
    let mut end = 0_u64;
    for (length, fill) in [
        (10, 1),
        (70_000, 2),
        (3, 3),
        (65_536 + 4_093, 4),
        (131_072, 5),
        (BOUNCE_BYTES + 12_345, 6),
        (1, 7),
        (200_000, 8),
    ] {
        writes.push((end, length, fill));
        end += length as u64;
    }
    writes.push((5_000, 300_000, 9));
    writes.push((end, 100_000, 10));
    let file = write_and_compare(&storage, "segment", &writes);
    let direct_open = file.direct.get().is_some_and(Option::is_some);
    if !direct_open {
        eprintln!(
            "the file system of {} refuses O_DIRECT",
            directory.path().display()
        );
    }
    assert!(!file.writes.direct_refused.load(Ordering::Relaxed) || !direct_open);
}

#[test]
fn given_direct_writes_in_flight_when_small_writes_follow_should_land_in_the_order_made() {
    let (_directory, storage) = direct_storage();
    // Small writes made while the large ones are on their way: appends, an overwrite of
    // a direct piece's middle (it must land after that piece), and one of a small write's
    // bytes by the next large write.
    let large = 3 * BOUNCE_BYTES + 5_000;
    let second = 100 + large as u64;
    let writes = [
        (0, 100, 1),
        (100, large, 2),
        (second, 30, 3),
        (5_000, 20, 4),
        (second + 30, 60_000, 5),
        (second + 10, large, 6),
        (BOUNCE_BYTES as u64 + 4_000, 9_000, 7),
    ];
    write_and_compare_at(&storage, "segment", &writes, false);
}

#[test]
fn given_write_bytes_when_runs_of_any_size_and_position_are_handed_over_should_read_back_as_written()
 {
    // Appends of every kind (small, unaligned, larger than a buffer of the writer, more
    // in a row than it has buffers), then an overwrite and an append after it; laid out
    // and, the second time, moved (written through a copy instead).
    let mut writes = Vec::new();
    let mut end = 0_u64;
    let mut lengths = vec![
        10,
        70_000,
        3,
        65_536 + 4_093,
        131_072,
        BOUNCE_BYTES + 12_345,
    ];
    lengths.extend([300_000; 2 * BOUNCE_BUFFERS]);
    lengths.extend([1, 200_000]);
    for (fill, length) in lengths.into_iter().enumerate() {
        writes.push((end, length, u8::try_from(fill).unwrap()));
        end += length as u64;
    }
    writes.push((5_000, 300_000, 99));
    writes.push((end, 100_000, 100));
    for moved in [false, true] {
        let (_directory, storage) = direct_storage();
        write_bytes_and_compare(&storage, "segment", &writes, moved);
    }
}

#[test]
fn given_write_bytes_whose_middle_fails_when_finished_should_report_it() {
    let (directory, storage) = direct_storage();
    let file = failing_direct_file(&directory, &storage);
    let mut bytes = WriteBytes::new();
    bytes.reset(100);
    bytes.extend_from_slice(&vec![2; 1 << 20]);
    file.write_bytes(&mut bytes).unwrap();
    let failed = file.finish_writes().unwrap_err();
    assert_eq!(failed.raw_os_error(), Some(libc::EBADF), "{failed}");
}

#[test]
fn given_no_direct_writes_when_a_large_run_is_written_should_not_open_the_file_for_direct_io() {
    let directory = tempfile::tempdir().unwrap();
    let storage = OsStorage::new(directory.path()).unwrap();
    let file = write_and_compare(&storage, "segment", &[(0, 1 << 20, 1), (1 << 20, 7, 2)]);
    assert!(file.direct.get().is_none());
}

#[test]
fn given_a_direct_write_that_fails_when_finished_should_report_it_once_and_forget_it_when_cut_off()
{
    let (directory, storage) = direct_storage();
    let file = failing_direct_file(&directory, &storage);
    file.write_at(0, &[1; 100]).unwrap();
    // Its middle fails in the background (its end is written behind it).
    file.write_at(100, &vec![2; 1 << 20]).unwrap();
    let failed = file.finish_writes().unwrap_err();
    assert_eq!(failed.raw_os_error(), Some(libc::EBADF), "{failed}");
    assert!(file.finish_writes().is_ok(), "a failure is reported once");
    // Failed again, then cut off before it: forgotten.
    file.write_at(100, &vec![2; 1 << 20]).unwrap();
    file.truncate(100).unwrap();
    assert!(file.finish_writes().is_ok());
    assert!(file.sync().is_ok());
    // Failed again and not cut off: the next write reports it.
    file.write_at(100, &vec![2; 1 << 20]).unwrap();
    file.writes.wait(0..u64::MAX);
    file.truncate(50_000).unwrap();
    assert!(file.write_at(50_000, &[3]).is_err());
}

#[test]
fn written_through_is_the_start_of_the_first_piece_in_flight() {
    let writes = FileWrites::default();
    assert_eq!(writes.written_through(), u64::MAX, "nothing in flight");
    let first = writes.started(4096, 8192);
    let second = writes.started(12_288, 100);
    assert_eq!(writes.written_through(), 4096);
    writes.finished(first, Ok(()));
    assert_eq!(writes.written_through(), 12_288);
    writes.finished(second, Ok(()));
    assert_eq!(writes.written_through(), u64::MAX);
    let third = writes.started(12_388, 10);
    writes.finished(third, Err(io::Error::other("refused")));
    assert_eq!(
        writes.written_through(),
        0,
        "a failed write not yet reported"
    );
    assert!(writes.finish().is_err());
    assert_eq!(writes.written_through(), u64::MAX, "reported");
}
