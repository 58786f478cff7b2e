//! The data directory: created if missing, checked writable, and locked for the life of the
//! process so that two servers can never open the same directory.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The lock file inside the data directory. It holds the owning process's id.
pub const LOCK_FILE_NAME: &str = "levee.lock";

/// An open, locked data directory.
#[derive(Debug)]
pub struct DataDir {
    path: PathBuf,
    lock_file: File,
}

/// Why the data directory could not be opened. Each message names the problem and the fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataDirError {
    /// The path exists but is a file or something else.
    #[error(
        "data dir {path} exists but is not a directory; remove it or choose another with \
         --data-dir",
        path = path.display()
    )]
    NotADirectory {
        /// The configured path.
        path: PathBuf,
    },
    /// The directory or its lock file cannot be created or written.
    #[error(
        "data dir {path} is not writable ({source}); fix its permissions or choose another \
         with --data-dir",
        path = path.display()
    )]
    NotWritable {
        /// The path that failed.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Another running process holds the lock.
    #[error(
        "data dir {path} is locked by another running levee server{owner}; stop that server \
         or choose another with --data-dir",
        path = path.display()
    )]
    Locked {
        /// The configured path.
        path: PathBuf,
        /// ` (pid N)` when the lock file names its owner.
        owner: String,
    },
}

impl DataDir {
    /// Creates the directory if needed and takes its exclusive lock.
    pub fn open(path: &Path) -> Result<Self, DataDirError> {
        let path = path.to_path_buf();
        match std::fs::metadata(&path) {
            Ok(metadata) if !metadata.is_dir() => {
                return Err(DataDirError::NotADirectory { path });
            }
            Ok(_) => {}
            Err(error) if error.kind() == ErrorKind::NotFound => {
                std::fs::create_dir_all(&path).map_err(|source| {
                    if source.kind() == ErrorKind::NotADirectory {
                        DataDirError::NotADirectory { path: path.clone() }
                    } else {
                        DataDirError::NotWritable {
                            path: path.clone(),
                            source,
                        }
                    }
                })?;
            }
            Err(error) if error.kind() == ErrorKind::NotADirectory => {
                return Err(DataDirError::NotADirectory { path });
            }
            Err(source) => return Err(DataDirError::NotWritable { path, source }),
        }

        let lock_path = path.join(LOCK_FILE_NAME);
        let mut lock_file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(|source| DataDirError::NotWritable {
                path: lock_path.clone(),
                source,
            })?;
        match lock_file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut owner = String::new();
                let _ = lock_file.read_to_string(&mut owner);
                let owner = owner.trim();
                let owner = if owner.is_empty() {
                    String::new()
                } else {
                    format!(" (pid {owner})")
                };
                return Err(DataDirError::Locked { path, owner });
            }
            Err(TryLockError::Error(source)) => {
                return Err(DataDirError::NotWritable {
                    path: lock_path,
                    source,
                });
            }
        }
        let write_owner = |file: &mut File| -> std::io::Result<()> {
            file.set_len(0)?;
            file.seek(SeekFrom::Start(0))?;
            writeln!(file, "{}", std::process::id())?;
            file.sync_all()
        };
        write_owner(&mut lock_file).map_err(|source| DataDirError::NotWritable {
            path: lock_path,
            source,
        })?;
        Ok(Self { path, lock_file })
    }

    /// The directory's path, as configured.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Flushes what the directory holds and releases the lock.
    pub fn close(self) -> std::io::Result<()> {
        File::open(&self.path)?.sync_all()?;
        self.lock_file.unlock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_missing_dir_when_opened_then_created_and_locked_with_pid() {
        let parent = tempfile::tempdir().unwrap();
        let path = parent.path().join("a/b/data");
        let data_dir = DataDir::open(&path).unwrap();
        let owner = std::fs::read_to_string(path.join(LOCK_FILE_NAME)).unwrap();
        assert_eq!(owner.trim(), std::process::id().to_string());
        data_dir.close().unwrap();
    }

    #[test]
    fn given_locked_dir_when_opened_again_then_refused_until_closed() {
        let dir = tempfile::tempdir().unwrap();
        let first = DataDir::open(dir.path()).unwrap();
        let message = DataDir::open(dir.path()).unwrap_err().to_string();
        assert!(
            message.contains("locked by another running levee server"),
            "{message}"
        );
        assert!(
            message.contains(&format!("pid {}", std::process::id())),
            "{message}"
        );
        first.close().unwrap();
        DataDir::open(dir.path()).unwrap().close().unwrap();
    }

    #[test]
    fn given_path_is_a_file_then_error_says_not_a_directory() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let error = DataDir::open(file.path()).unwrap_err();
        assert!(
            matches!(error, DataDirError::NotADirectory { .. }),
            "{error}"
        );
        let below = file.path().join("data");
        let error = DataDir::open(&below).unwrap_err();
        assert!(
            matches!(error, DataDirError::NotADirectory { .. }),
            "{error}"
        );
    }
}
