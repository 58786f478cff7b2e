//! Queues over the network: the broker engine (`levee-broker`) decides, the embedded queue
//! store (`levee-store`, in the `queues` directory of the data dir) keeps the data, and this
//! module adapts both to gRPC and the admin HTTP port. A room per capability:
//!
//! - `service`: the `levee.v1.Queues` gRPC service: append (idempotent with a producer id),
//!   read, info, list, delete, retention, and the mailbox streams.
//! - `mailbox/`: single-queue subscriptions, many-queue mailbox streams, consumers' position
//!   logs.
//! - `topic/`: topics (the catalog), consumer groups, a member's `Consume` stream, the
//!   `levee.v1.Topics` gRPC service.
//! - `producer/`: idempotent producers' remembered runs.
//! - `limits/`: group delivery pacing and producer append admission.
//! - `delay`: messages that wait for their time (retries, delayed publishes) in slot queues.
//! - Shared by the rooms: `stream` (the transport-neutral session streams; `grpc_stream`
//!   adapts them to tonic), `waiters` (who waits on which queue), `credit` (a stream's flow
//!   control), `retention` (retention passes), `durable` (waiting for fsyncs without a
//!   thread), [`StoreCalls`] and the mapping of engine errors to wire errors (here), `http`
//!   (topics, groups and producer limits as JSON).
//!
//! Reserved (`\0`-prefixed) queue names, name rules and bounds have one home:
//! `levee_broker::names`.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use levee_broker::catalog::CatalogError;
use levee_broker::group::GroupError;
use levee_broker::names::NameError;
use levee_proto::WireError;
use levee_proto::v1::ErrorCode;
use levee_store::{CommitTicket, Store, SyncPolicy, WriteError};
use tokio::sync::Semaphore;

pub mod credit;
pub mod delay;
pub mod durable;
pub mod grpc_stream;
pub mod http;
pub mod limits;
pub mod mailbox;
pub mod producer;
pub mod replicated;
pub mod retention;
pub mod service;
pub mod stream;
pub mod topic;
pub mod waiters;

/// The store's directory inside the data dir.
pub const STORE_DIR_NAME: &str = "queues";
/// Store calls running at once on the blocking pool.
pub const BLOCKING_CALLS_MAX: usize = 256;

/// Locks `mutex`, taking the data of a poisoned one (every critical section leaves it valid).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The messages of a read as payloads that share the batch's one buffer (no copy each).
pub(crate) fn payloads(batch: levee_store::ReadBatch) -> impl Iterator<Item = levee_proto::Bytes> {
    let (data, ends) = batch.into_parts();
    let data = levee_proto::Bytes::from(data);
    ends.into_iter().scan(0, move |start, end| {
        let payload = data.slice(*start..end);
        *start = end;
        Some(payload)
    })
}

/// A store failure as a wire error.
pub(crate) fn storage_error(error: &impl std::fmt::Display) -> WireError {
    WireError::new(ErrorCode::StorageFailed, error.to_string())
}

/// The newest record of a server-owned log queue (consumer positions, group commits), or
/// `None` if it holds none. Under `always` a reader sees only fsynced records, so a record
/// appended but not yet fsynced (an ack whose round is still running when its stream ends and
/// the consumer comes back) is not readable yet: then this waits for one commit round and
/// reads again. Blocks on the store: call it on the blocking pool.
pub(crate) fn last_record(store: &Store, queue: &[u8]) -> Result<Option<Vec<u8>>, WireError> {
    let Some(info) = store
        .queue_info(queue)
        .map_err(|error| storage_error(&error))?
    else {
        return Ok(None);
    };
    if info.next_offset <= info.first_offset {
        return Ok(None);
    }
    let read = || {
        store
            .read(queue, info.next_offset - 1, 1, usize::MAX)
            .map(|batch| batch.iter().next().map(<[u8]>::to_vec))
            .map_err(|error| storage_error(&error))
    };
    if let Some(record) = read()? {
        return Ok(Some(record));
    }
    store.flush().map_err(write_error)?;
    read()?.map(Some).ok_or_else(|| {
        storage_error(&format!(
            "the newest record of a log queue ({} bytes of name) is unreadable after a flush",
            queue.len()
        ))
    })
}

/// An `INVALID_ARGUMENT` wire error with `message` (which names the problem and the fix).
pub(crate) fn invalid(message: String) -> WireError {
    WireError::new(ErrorCode::InvalidArgument, message)
}

/// A refused name as a wire error.
pub(crate) fn name_error(error: &NameError) -> WireError {
    WireError::new(ErrorCode::InvalidArgument, error.to_string())
}

/// A refused catalog change as a wire error.
pub(crate) fn catalog_error(error: &CatalogError) -> WireError {
    let code = match error {
        CatalogError::PartitionsChanged { .. } => ErrorCode::AlreadyExists,
        CatalogError::TopicsFull
        | CatalogError::ProducerRatesFull { .. }
        | CatalogError::GroupRatesFull { .. }
        | CatalogError::RetentionRulesFull
        | CatalogError::RetryPoliciesFull { .. } => ErrorCode::ResourceExhausted,
        CatalogError::TopicNotFound { .. } => ErrorCode::NotFound,
        CatalogError::Unreadable { .. } => ErrorCode::StorageFailed,
        _ => ErrorCode::InvalidArgument,
    };
    WireError::new(code, error.to_string())
}

/// A refused join or commit of `group` as a wire error.
pub(crate) fn group_error(group: &str, error: &GroupError) -> WireError {
    let code = match error {
        GroupError::MembersFull => ErrorCode::ResourceExhausted,
        GroupError::Fenced { .. } => ErrorCode::Fenced,
        GroupError::PastEnd { .. } => ErrorCode::OffsetOutOfRange,
        GroupError::MembersActive { .. } => ErrorCode::FailedPrecondition,
        _ => ErrorCode::InvalidArgument,
    };
    let message = match error {
        GroupError::MembersFull | GroupError::MembersActive { .. } => {
            format!("group '{group}': {error}")
        }
        _ => error.to_string(),
    };
    WireError::new(code, message)
}

/// A failed write as a wire error that says what to do.
pub(crate) fn write_error(error: WriteError) -> WireError {
    match error {
        WriteError::Input(input) => WireError::new(
            ErrorCode::InvalidArgument,
            format!("{input}; fix the request"),
        ),
        WriteError::StorageFull { .. } => WireError::new(
            ErrorCode::StorageFailed,
            format!("{error}; free disk space on the server, then retry"),
        ),
        WriteError::Closed => WireError::new(ErrorCode::Unavailable, "server shutting down"),
        other => WireError::new(
            ErrorCode::StorageFailed,
            format!("{other}; the server refuses writes until it is restarted"),
        ),
    }
}

/// How the services call the store. Appends and reads run inline on the runtime: buffering an
/// append and reading from the index and page cache do not wait for the disk (except the
/// store's back-pressure when its buffers or rounds are late, which is meant to slow callers
/// down). Waiting for an fsync is async, through the [`durable::DurabilityWaiter`], so no
/// thread is parked per request. Calls that may block for long (deletes, metadata writes that
/// force a sync) run on tokio's blocking pool, at most [`BLOCKING_CALLS_MAX`] at once: further
/// calls wait for a slot, which is back-pressure, not an error.
#[derive(Debug, Clone)]
pub struct StoreCalls {
    /// The store.
    pub store: Arc<Store>,
    /// The store's sync policy.
    pub sync: SyncPolicy,
    slots: Arc<Semaphore>,
    durability: Arc<durable::DurabilityWaiter>,
}

impl StoreCalls {
    /// Calls on `store`, opened with `sync`; starts the durability waiter's thread.
    pub fn new(store: Arc<Store>, sync: SyncPolicy) -> std::io::Result<Self> {
        let durability = Arc::new(durable::DurabilityWaiter::start(&store)?);
        Ok(Self {
            store,
            sync,
            slots: Arc::new(Semaphore::new(BLOCKING_CALLS_MAX)),
            durability,
        })
    }

    /// Returns once appends behind `ticket` are durable under the sync policy: under `always`
    /// when their round is fsynced, under `interval` at once.
    pub async fn durable(&self, ticket: Option<CommitTicket>) -> Result<(), WireError> {
        match ticket {
            Some(ticket) if self.sync == SyncPolicy::Always => self.durability.wait(ticket).await,
            _ => Ok(()),
        }
    }

    /// Appends a batch and returns its offsets once durable under the sync policy.
    pub async fn append_batch(&self, batch: &[(&[u8], &[u8])]) -> Result<Vec<u64>, WireError> {
        let (offsets, ticket) = self
            .store
            .append_batch_deferred(batch)
            .map_err(write_error)?;
        self.durable(Some(ticket)).await?;
        Ok(offsets)
    }

    /// Runs `call` on the blocking pool once a slot is free.
    pub async fn run<T, F>(&self, call: F) -> Result<T, WireError>
    where
        F: FnOnce(&Store) -> Result<T, WireError> + Send + 'static,
        T: Send + 'static,
    {
        let slot = Arc::clone(&self.slots)
            .acquire_owned()
            .await
            .map_err(|_| WireError::new(ErrorCode::Unavailable, "server shutting down"))?;
        let store = Arc::clone(&self.store);
        tokio::task::spawn_blocking(move || {
            let result = call(&store);
            drop(slot);
            result
        })
        .await
        .map_err(|error| {
            WireError::new(ErrorCode::Internal, format!("store call failed: {error}"))
        })?
    }
}
