//! Error types, one per operation family.

use std::io;

use thiserror::Error;

/// An option out of its bounds.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OptionsError {
    /// `segment_bytes_max` out of bounds.
    #[error("segment_bytes_max must be between 4096 and 2147483648, got {0}")]
    SegmentBytes(u64),
    /// `chunk_bytes` out of bounds.
    #[error("chunk_bytes must be between 1 and 536870912, got {0}")]
    ChunkBytes(usize),
    /// `message_bytes_max` out of bounds.
    #[error("message_bytes_max must be between 1 and 67108864, got {0}")]
    MessageBytes(usize),
    /// `buffer_budget_bytes` smaller than a chunk or a message.
    #[error("buffer_budget_bytes must be at least chunk_bytes and message_bytes_max, got {0}")]
    BufferBudget(usize),
    /// Sync interval out of bounds.
    #[error("sync interval must be between 1 and 60000 ms, got {0}")]
    SyncInterval(u64),
    /// A zero round write size.
    #[error("round_write_bytes must be at least 1, got 0")]
    RoundWriteBytes,
    /// Unparseable sync policy.
    #[error("sync policy must be 'always', 'interval' or 'interval(MS)', got '{0}'")]
    SyncPolicy(String),
}

/// A queue name or message refused at the API boundary.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InputError {
    /// Queue names are 1 to 255 bytes.
    #[error("queue name must be 1 to 255 bytes, got {0} bytes")]
    QueueName(usize),
    /// The message is longer than `message_bytes_max`.
    #[error("message of {length} bytes is over message_bytes_max ({max})")]
    MessageTooLarge {
        /// Length of the message.
        length: usize,
        /// The configured maximum.
        max: usize,
    },
}

/// Why [`crate::Store::open`] failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum OpenError {
    /// Invalid options.
    #[error("invalid store options: {0}")]
    Options(#[from] OptionsError),
    /// The directory holds something that is not a Levee queue store.
    #[error("{directory} is not a Levee queue store: {found}")]
    NotAStore {
        /// The data directory.
        directory: String,
        /// What was found instead.
        found: String,
    },
    /// A Levee store of a format version this build cannot read.
    #[error(
        "segment {file} has format version {found}; this build reads versions 1 to {supported} only"
    )]
    UnsupportedVersion {
        /// The segment file.
        file: String,
        /// Version found in its header.
        found: u32,
        /// Newest version this build reads (it reads every version from 1).
        supported: u32,
    },
    /// Damage before the tail of the log: acknowledged data would be lost by truncating, so
    /// the store refuses to open.
    #[error("segment {file} is corrupt at byte {position}: {reason}")]
    Corrupt {
        /// The segment file.
        file: String,
        /// Byte position of the bad record.
        position: u64,
        /// What is wrong.
        reason: String,
    },
    /// An I/O error, with the operation that failed.
    #[error("I/O error while {operation}: {source}")]
    Io {
        /// What the store was doing.
        operation: String,
        /// The error.
        source: io::Error,
    },
}

/// Why a write (append, delete, retention, sync) failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WriteError {
    /// Bad queue name or message.
    #[error(transparent)]
    Input(#[from] InputError),
    /// The disk is full. The messages of the failed call were not stored; the store stays
    /// readable and writes are retried by later calls.
    #[error("no space left on the device while {operation}; the write was not stored")]
    StorageFull {
        /// What the store was doing.
        operation: String,
    },
    /// An earlier fatal I/O error poisoned the store: it refuses writes until reopened.
    #[error("store refuses writes after a fatal I/O error: {0}")]
    Poisoned(String),
    /// The store is closing.
    #[error("store is closed")]
    Closed,
}

/// Why a read failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ReadError {
    /// Bad queue name.
    #[error(transparent)]
    Input(#[from] InputError),
    /// A chunk failed its checksum or could not be read.
    #[error("reading segment {segment} at byte {position}: {reason}")]
    Storage {
        /// Segment id.
        segment: u32,
        /// Byte position of the chunk.
        position: u32,
        /// What went wrong.
        reason: String,
    },
}
