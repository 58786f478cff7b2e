//! The data directory: created if missing, checked writable, and locked for the life of the
//! process so that two servers can never open the same directory. It also holds the node's
//! cluster identity ([`ClusterIdentity`], `cluster.json`): the cluster it belongs to and its
//! node id, made on first start and checked on every start after (docs/CLUSTER.md).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// The lock file inside the data directory. It holds the owning process's id.
pub const LOCK_FILE_NAME: &str = "levee.lock";
/// The cluster identity file inside the data directory.
pub const CLUSTER_FILE_NAME: &str = "cluster.json";

/// Which cluster a data directory belongs to, and which node of it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ClusterIdentity {
    /// 128 random bits, in hex, made when the directory first started a server.
    pub cluster_id: String,
    /// The node's id in that cluster.
    pub node_id: u64,
    /// Set when the cluster's leader removed this node: it will not serve again unless added
    /// back (`--join`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub removed: bool,
}

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
    /// The directory belongs to another node id.
    #[error(
        "data dir {path} belongs to node {found} of cluster {cluster_id}, not node {given}; \
         start it with --node-id {found}, or give node {given} its own --data-dir",
        path = path.display()
    )]
    WrongNode {
        /// The configured path.
        path: PathBuf,
        /// The directory's cluster.
        cluster_id: String,
        /// The node id it belongs to.
        found: u64,
        /// The node id given.
        given: u64,
    },
    /// The identity file cannot be read.
    #[error(
        "data dir {path}: {CLUSTER_FILE_NAME} is not readable ({reason}); restore it, or move \
         the data dir away to start a new node",
        path = path.display()
    )]
    BadIdentity {
        /// The configured path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
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

    /// The directory's cluster identity for node `node_id`: read and checked when the
    /// directory has one, else made (a new cluster id) and written durably.
    pub fn identity(&self, node_id: u64) -> Result<ClusterIdentity, DataDirError> {
        let file = self.path.join(CLUSTER_FILE_NAME);
        let bad = |reason: String| DataDirError::BadIdentity {
            path: self.path.clone(),
            reason,
        };
        match std::fs::read(&file) {
            Ok(bytes) => {
                let identity: ClusterIdentity =
                    serde_json::from_slice(&bytes).map_err(|error| bad(error.to_string()))?;
                if identity.node_id != node_id {
                    return Err(DataDirError::WrongNode {
                        path: self.path.clone(),
                        cluster_id: identity.cluster_id,
                        found: identity.node_id,
                        given: node_id,
                    });
                }
                Ok(identity)
            }
            Err(error) if error.kind() == ErrorKind::NotFound => {
                let identity = ClusterIdentity {
                    cluster_id: new_cluster_id(),
                    node_id,
                    removed: false,
                };
                self.write_identity(&identity)?;
                Ok(identity)
            }
            Err(source) => Err(DataDirError::NotWritable { path: file, source }),
        }
    }

    /// Makes `identity` the directory's, durably: a node that joined a cluster takes the
    /// cluster's id in place of the one it made on its first start.
    pub fn write_identity(&self, identity: &ClusterIdentity) -> Result<(), DataDirError> {
        let file = self.path.join(CLUSTER_FILE_NAME);
        let bytes =
            serde_json::to_vec_pretty(identity).map_err(|error| DataDirError::BadIdentity {
                path: self.path.clone(),
                reason: error.to_string(),
            })?;
        let temporary = self.path.join(format!("{CLUSTER_FILE_NAME}.partial"));
        let written = (|| {
            let mut out = File::create(&temporary)?;
            out.write_all(&bytes)?;
            out.sync_all()?;
            std::fs::rename(&temporary, &file)?;
            File::open(&self.path)?.sync_all()
        })();
        written.map_err(|source| DataDirError::NotWritable { path: file, source })
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

/// 128 bits from the process's random hasher keys (seeded from the OS), the time and the pid,
/// as 32 hex digits.
fn new_cluster_id() -> String {
    use std::hash::{BuildHasher, Hash, Hasher};
    let part = |salt: u64| {
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        salt.hash(&mut hasher);
        std::process::id().hash(&mut hasher);
        std::time::SystemTime::now().hash(&mut hasher);
        hasher.finish()
    };
    format!("{:016x}{:016x}", part(1), part(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_a_data_dir_then_its_identity_is_made_once_and_another_node_id_is_refused() {
        let directory = tempfile::tempdir().unwrap();
        let data_dir = DataDir::open(directory.path()).unwrap();
        let made = data_dir.identity(1).unwrap();
        assert_eq!(made.cluster_id.len(), 32);
        assert_eq!(
            data_dir.identity(1).unwrap(),
            made,
            "read back, not made again"
        );
        let error = data_dir.identity(2).unwrap_err().to_string();
        assert!(
            error.contains("belongs to node 1") && error.contains("--node-id 1"),
            "{error}"
        );
        std::fs::write(directory.path().join(CLUSTER_FILE_NAME), b"{").unwrap();
        let error = data_dir.identity(1).unwrap_err().to_string();
        assert!(error.contains("not readable"), "{error}");
        assert_ne!(new_cluster_id(), new_cluster_id());
    }

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
