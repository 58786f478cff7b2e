//! The small file-system interface the store uses: one flat directory of files that are read
//! at positions, appended to, synced and truncated. [`OsStorage`] is the real one;
//! [`crate::SimulatedDisk`] is a test double that loses unsynced data at a simulated crash.

use std::fmt;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

/// A directory of files. Names are plain file names, never paths.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Names of the files in the directory.
    fn list(&self) -> io::Result<Vec<String>>;
    /// Creates an empty file; fails if it exists. Durable only after [`Storage::sync_dir`].
    fn create(&self, name: &str) -> io::Result<Arc<dyn StorageFile>>;
    /// Opens an existing file for reading and writing.
    fn open(&self, name: &str) -> io::Result<Arc<dyn StorageFile>>;
    /// Removes a file. Durable only after [`Storage::sync_dir`]; open handles stay readable.
    fn remove(&self, name: &str) -> io::Result<()>;
    /// Makes creations and removals in the directory durable (fsync of the directory).
    fn sync_dir(&self) -> io::Result<()>;
    /// Takes an exclusive lock on the directory for as long as this storage lives, so two
    /// processes never write the same store. Fails if another holder has it.
    fn lock_directory(&self) -> io::Result<()>;
}

/// Name of the lock file [`OsStorage`] keeps in the data directory.
pub const LOCK_FILE_NAME: &str = "LOCK";

/// One open file.
#[allow(
    clippy::len_without_is_empty,
    reason = "nothing asks whether a segment is empty"
)]
pub trait StorageFile: Send + Sync + fmt::Debug {
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// Fills `buffer` from `position`; an error if the file ends first.
    fn read_at(&self, position: u64, buffer: &mut [u8]) -> io::Result<()>;
    /// Reads into `buffer` from `position` as many bytes as the file holds there, up to the
    /// buffer's length; returns how many (fewer only at the end of the file).
    fn read_up_to(&self, position: u64, buffer: &mut [u8]) -> io::Result<usize>;
    /// Writes all of `data` at `position`.
    fn write_at(&self, position: u64, data: &[u8]) -> io::Result<()>;
    /// Makes every write so far durable (fdatasync).
    fn sync(&self) -> io::Result<()>;
    /// Cuts the file to `length` bytes.
    fn truncate(&self, length: u64) -> io::Result<()>;
}

/// [`Storage`] on a real directory.
#[derive(Debug, Clone)]
pub struct OsStorage {
    directory: PathBuf,
    lock: Arc<OnceLock<File>>,
    /// With direct writes: the aligned copy they go through, shared by every file of the
    /// directory (allocated at the first, 8 MiB; only the committer writes large runs).
    bounce: Option<Arc<Mutex<Vec<u8>>>>,
}

impl OsStorage {
    /// Uses `directory`, creating it (and its parents) if missing.
    pub fn new(directory: impl AsRef<Path>) -> io::Result<Self> {
        let directory = directory.as_ref().to_path_buf();
        fs::create_dir_all(&directory)?;
        Ok(Self {
            directory,
            lock: Arc::new(OnceLock::new()),
            bounce: None,
        })
    }

    /// Writes large runs with `O_DIRECT` (see [`crate::StoreOptions::direct_writes`]): the
    /// block-aligned middle of every write of 64 KiB or more goes to the disk without passing
    /// through the page cache; the unaligned ends, and smaller writes, go through it. Where the
    /// file system refuses `O_DIRECT`, files are written through the page cache as without it.
    #[must_use]
    pub fn with_direct_writes(mut self, direct: bool) -> Self {
        self.bounce = direct.then(|| Arc::new(Mutex::new(Vec::new())));
        self
    }

    fn file(&self, name: &str, file: File) -> Arc<dyn StorageFile> {
        Arc::new(self.os_file(name, file))
    }

    fn os_file(&self, name: &str, file: File) -> OsFile {
        OsFile {
            file,
            path: self.directory.join(name),
            direct: OnceLock::new(),
            direct_refused: AtomicBool::new(false),
            bounce: self.bounce.clone(),
        }
    }

    /// The directory.
    pub fn directory(&self) -> &Path {
        &self.directory
    }
}

impl Storage for OsStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in fs::read_dir(&self.directory)? {
            names.push(entry?.file_name().to_string_lossy().into_owned());
        }
        Ok(names)
    }

    fn create(&self, name: &str) -> io::Result<Arc<dyn StorageFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(self.directory.join(name))?;
        Ok(self.file(name, file))
    }

    fn open(&self, name: &str) -> io::Result<Arc<dyn StorageFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.directory.join(name))?;
        Ok(self.file(name, file))
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        fs::remove_file(self.directory.join(name))
    }

    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.directory)?.sync_all()
    }

    fn lock_directory(&self) -> io::Result<()> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(self.directory.join(LOCK_FILE_NAME))?;
        file.try_lock().map_err(|error| match error {
            TryLockError::WouldBlock => io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("{} is in use by another process", self.directory.display()),
            ),
            TryLockError::Error(error) => error,
        })?;
        // The lock lives as long as the last clone of this storage.
        let _ = self.lock.set(file);
        Ok(())
    }
}

/// Direct writes are aligned to this (the page size, and a multiple of every logical block
/// size in use).
const DIRECT_ALIGN_BYTES: usize = 4096;
const DIRECT_ALIGN: u64 = DIRECT_ALIGN_BYTES as u64;
/// Writes with less than this many aligned bytes go through the page cache only.
const DIRECT_MIN_BYTES: u64 = 64 << 10;
/// The most one direct write copies at a time.
const BOUNCE_BYTES: usize = 8 << 20;

#[derive(Debug)]
struct OsFile {
    file: File,
    path: PathBuf,
    /// The same file opened with `O_DIRECT`, at its first large write; `None` where the file
    /// system refuses it.
    direct: OnceLock<Option<File>>,
    /// Set when a direct write was refused as invalid (an alignment the device does not take):
    /// the file is written through the page cache from then on.
    direct_refused: AtomicBool,
    bounce: Option<Arc<Mutex<Vec<u8>>>>,
}

impl OsFile {
    fn direct(&self) -> Option<&File> {
        self.direct
            .get_or_init(|| {
                use std::os::unix::fs::OpenOptionsExt;
                OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&self.path)
                    .ok()
            })
            .as_ref()
    }

    /// Writes the block-aligned middle of `data` with `O_DIRECT` (through the page cache it
    /// would cost a page-cache page per 4 KiB, which on a VM whose freed memory the host takes
    /// back is a host page fault each) and its unaligned ends through the page cache. Returns
    /// false (nothing written) where that does not apply.
    fn write_direct(&self, position: u64, data: &[u8]) -> io::Result<bool> {
        let Some(bounce) = &self.bounce else {
            return Ok(false);
        };
        if self.direct_refused.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let end = position + data.len() as u64;
        let body_start = position.next_multiple_of(DIRECT_ALIGN);
        let body_end = end / DIRECT_ALIGN * DIRECT_ALIGN;
        if body_end < body_start + DIRECT_MIN_BYTES {
            return Ok(false);
        }
        let Some(direct) = self.direct() else {
            return Ok(false);
        };
        let offset = |at: u64| usize::try_from(at - position).unwrap_or(usize::MAX);
        // The first block's rest after the previous write (which left that block cached).
        self.file
            .write_all_at(&data[..offset(body_start)], position)?;
        let mut bounce = bounce.lock().unwrap_or_else(PoisonError::into_inner);
        if bounce.is_empty() {
            bounce.resize(BOUNCE_BYTES + DIRECT_ALIGN_BYTES, 0);
        }
        let skip = bounce.as_ptr().align_offset(DIRECT_ALIGN_BYTES);
        let aligned = &mut bounce[skip..skip + BOUNCE_BYTES];
        let mut at = body_start;
        while at < body_end {
            let length =
                usize::try_from((body_end - at).min(BOUNCE_BYTES as u64)).unwrap_or(BOUNCE_BYTES);
            aligned[..length].copy_from_slice(&data[offset(at)..offset(at) + length]);
            let mut written = 0;
            while written < length {
                match direct.write_at(&aligned[written..length], at + written as u64) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(count) => written += count,
                    Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                    Err(error)
                        if error.kind() == io::ErrorKind::InvalidInput && at == body_start =>
                    {
                        // Nothing written yet: the whole write goes through the page cache.
                        self.direct_refused.store(true, Ordering::Relaxed);
                        return Ok(false);
                    }
                    Err(error) => return Err(error),
                }
                if written % DIRECT_ALIGN_BYTES != 0 {
                    // A short direct write leaves an unaligned rest: through the page cache.
                    self.file
                        .write_all_at(&aligned[written..length], at + written as u64)?;
                    written = length;
                }
            }
            at += length as u64;
        }
        drop(bounce);
        // The last block's start, which the next write completes from the page cache.
        self.file
            .write_all_at(&data[offset(body_end)..], body_end)?;
        Ok(true)
    }
}

impl StorageFile for OsFile {
    fn len(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }

    fn read_at(&self, position: u64, buffer: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buffer, position)
    }

    fn read_up_to(&self, position: u64, buffer: &mut [u8]) -> io::Result<usize> {
        let mut filled = 0;
        while filled < buffer.len() {
            match self
                .file
                .read_at(&mut buffer[filled..], position + filled as u64)
            {
                Ok(0) => break,
                Ok(read) => filled += read,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
        Ok(filled)
    }

    fn write_at(&self, position: u64, data: &[u8]) -> io::Result<()> {
        if self.write_direct(position, data)? {
            return Ok(());
        }
        self.file.write_all_at(data, position)
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn truncate(&self, length: u64) -> io::Result<()> {
        self.file.set_len(length)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `writes` (position, length, fill byte) through a file of `storage` and checks the
    /// file holds what a plain model of the same writes holds.
    fn write_and_compare(storage: &OsStorage, name: &str, writes: &[(u64, usize, u8)]) -> OsFile {
        let handle = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(storage.directory().join(name))
            .unwrap();
        let file = storage.os_file(name, handle);
        let mut model: Vec<u8> = Vec::new();
        for &(position, length, fill) in writes {
            // Distinct bytes within a write, so a block written to the wrong place shows.
            let data: Vec<u8> = (0..length)
                .map(|index| {
                    fill.wrapping_add((index / 4096).to_le_bytes()[0]) ^ index.to_le_bytes()[0]
                })
                .collect();
            file.write_at(position, &data).unwrap();
            let start = usize::try_from(position).unwrap();
            if model.len() < start + length {
                model.resize(start + length, 0);
            }
            model[start..start + length].copy_from_slice(&data);
            assert_eq!(file.len().unwrap(), model.len() as u64);
            let mut read = vec![0; model.len()];
            file.read_at(0, &mut read).unwrap();
            assert!(
                read == model,
                "the file differs after writing {length} bytes at {position}"
            );
        }
        file.sync().unwrap();
        file
    }

    #[test]
    fn given_direct_writes_when_runs_of_any_size_and_position_are_written_should_read_back_as_written()
     {
        let directory = tempfile::tempdir().unwrap();
        let storage = OsStorage::new(directory.path())
            .unwrap()
            .with_direct_writes(true);
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
        assert!(!file.direct_refused.load(Ordering::Relaxed) || !direct_open);
    }

    #[test]
    fn given_no_direct_writes_when_a_large_run_is_written_should_not_open_the_file_for_direct_io() {
        let directory = tempfile::tempdir().unwrap();
        let storage = OsStorage::new(directory.path()).unwrap();
        let file = write_and_compare(&storage, "segment", &[(0, 1 << 20, 1), (1 << 20, 7, 2)]);
        assert!(file.direct.get().is_none());
    }
}
