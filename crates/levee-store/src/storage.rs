//! The small file-system interface the store uses: one flat directory of files that are read
//! at positions, appended to, synced and truncated. [`OsStorage`] is the real one;
//! [`crate::SimulatedDisk`] is a test double that loses unsynced data at a simulated crash.

use std::fmt;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

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
}

impl OsStorage {
    /// Uses `directory`, creating it (and its parents) if missing.
    pub fn new(directory: impl AsRef<Path>) -> io::Result<Self> {
        let directory = directory.as_ref().to_path_buf();
        fs::create_dir_all(&directory)?;
        Ok(Self {
            directory,
            lock: Arc::new(OnceLock::new()),
        })
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
        Ok(Arc::new(OsFile { file }))
    }

    fn open(&self, name: &str) -> io::Result<Arc<dyn StorageFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.directory.join(name))?;
        Ok(Arc::new(OsFile { file }))
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

#[derive(Debug)]
struct OsFile {
    file: File,
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
        self.file.write_all_at(data, position)
    }

    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn truncate(&self, length: u64) -> io::Result<()> {
        self.file.set_len(length)
    }
}
