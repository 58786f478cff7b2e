//! levee-store: the queue-store engine. Durable, ordered queues, a million and more on one
//! node, without a file per queue and without networking.
//!
//! # Parts and how data flows
//!
//! - [`Store`] (`store.rs`, with its verbs in `append.rs`, `read.rs` and `retention.rs`): the
//!   handle. Queues live in 64 lock shards chosen by a hash of the name; each queue holds
//!   its offsets, a sparse index of its chunks on disk (16 bytes per chunk) and, while it has
//!   messages in no chunk yet, a write buffer. Each shard also gathers the log of the
//!   messages appended to it since the last round (one log batch record, a run per queue).
//! - The committer thread (`committer/`, a file per step of a round): the only writer. A
//!   round takes the 64 shard logs (which make the appended messages durable), seals the
//!   write buffers that are due (full, over budget, or all of them at a checkpoint) into
//!   chunk records (a queue's consecutive messages together), writes the round in one
//!   sequential write, fsyncs once, publishes the chunks in the index and wakes every waiting
//!   append (group commit). It also rotates segment files and deletes the oldest ones once
//!   nothing live remains in them, first copying forward the few live chunks of a mostly dead
//!   oldest segment.
//! - Segment files ([`mod@format`]): a few shared append-only files with a versioned header and
//!   CRC32C-checked records: chunk, trim, delete, floor, log batch (and log records, read
//!   from older versions). docs/FORMAT.md has every byte.
//! - Recovery (`recovery/`: scanning, replaying, rebuilding): on open, every segment is
//!   scanned in order to rebuild the queues, the index and, from log records, the write
//!   buffers; a torn or corrupt tail of the last segment is cut and reported in
//!   [`OpenReport`], damage anywhere else refuses the open.
//! - [`Storage`]: the small file interface all I/O goes through; [`OsStorage`] for real
//!   directories, [`SimulatedDisk`] for tests that crash, tear writes and inject a full disk.
//!
//! An append: check the input, reserve room in the global buffer budget, put the message in
//! its queue's buffer (offset = the queue's next offset) and its log record in the shard's
//! log; under [`SyncPolicy::Always`] wait for the round that fsyncs it. A read: under the shard
//! lock, find the chunks from the offset in the index and copy any buffered messages; then
//! read and checksum the chunks without the lock.
//!
//! # Example
//!
//! ```
//! use levee_store::{Store, StoreOptions};
//!
//! let directory = tempfile::tempdir()?;
//! let (store, report) = Store::open(directory.path(), StoreOptions::default())?;
//! assert!(report.truncated.is_empty());
//! assert_eq!(store.append(b"orders", b"first")?, 0);
//! assert_eq!(store.append(b"orders", b"second")?, 1);
//! let batch = store.read(b"orders", 0, 10, 1 << 20)?;
//! assert_eq!(batch.iter().collect::<Vec<_>>(), vec![&b"first"[..], b"second"]);
//! store.close()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![deny(missing_docs)]

mod append;
mod committer;
mod error;
pub mod format;
mod options;
mod queue;
mod read;
mod recovery;
mod retention;
mod simulated;
mod storage;
mod store;

pub use append::CommitTicket;
pub use error::{InputError, OpenError, OptionsError, ReadError, WriteError};
pub use options::{
    MESSAGE_BYTES_MAX_LIMIT, SEGMENT_BYTES_MAX_LIMIT, SYNC_INTERVAL_MS_DEFAULT,
    SYNC_INTERVAL_MS_MAX, StoreOptions, SyncPolicy,
};
pub use read::ReadBatch;
pub use recovery::{OpenReport, TruncatedTail};
pub use retention::{Retention, RetentionReport};
pub use simulated::{CrashMode, Fault, SimulatedDisk};
pub use storage::{LOCK_FILE_NAME, OsStorage, Storage, StorageFile, WriteBytes};
pub use store::{MemoryUsage, QueueInfo, Store, StoreStats, WriteBarrier};
