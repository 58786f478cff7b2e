//! levee-store: the queue-store engine.
#![deny(missing_docs)]

mod committer;
mod error;
pub mod format;
mod options;
mod queue;
mod read;
mod recovery;
mod simulated;
mod storage;
mod store;

pub use error::{InputError, OpenError, OptionsError, ReadError, WriteError};
pub use options::{StoreOptions, SyncPolicy};
pub use read::ReadBatch;
pub use recovery::{OpenReport, TruncatedTail};
pub use simulated::{CrashMode, Fault, SimulatedDisk};
pub use storage::{OsStorage, Storage, StorageFile};
pub use store::{MemoryUsage, QueueInfo, Retention, RetentionReport, Store, StoreStats};
