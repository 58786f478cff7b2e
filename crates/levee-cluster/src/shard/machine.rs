//! [`ShardStateMachine`]: a shard's queues, applied from its log to the node's queue store.
//!
//! Applying writes the messages to the store without waiting for the store's fsync: the Raft
//! log already holds them durably. What makes a restart exact is the **apply record**, kept
//! in the shard's log partition and fsynced before a batch of entries touches the store: the
//! batch's log range, the membership after it, and where each of its queues stood before it
//! (the queue's next offset) and how many messages it adds. Before writing the record of a
//! batch, the previous batch's store appends are waited durable, so at a restart every batch
//! before the recorded one is whole in the store, and the recorded one is partly there: for
//! each of its queues, the messages past the recorded start are counted (a queue's messages
//! are recovered as a prefix), and only those missing are appended again, from the log. No
//! message is stored twice, none is lost, and every replica holds the same offsets.
//!
//! Snapshots are not built yet (docs/CLUSTER.md, "Part 2"): the log is kept whole, and a new
//! replica is fed from the log.

use std::collections::HashMap;
use std::io::Cursor;
use std::sync::{Arc, Mutex, PoisonError};

use levee_store::{CommitTicket, Store};
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    Entry, EntryPayload, LogId, OptionalSend, RaftSnapshotBuilder, SnapshotMeta, StorageIOError,
    StoredMembership,
};
use serde::{Deserialize, Serialize};

use crate::log_store::LogStore;
use crate::shard::{QueueMessage, ShardCommand, ShardConfig, ShardId, ShardResponse};
use crate::{NodeId, NodeInfo, StorageError};

/// The apply record's key in the shard's log meta partition.
const APPLYING_KEY: &str = "applying";
/// Longest queue name the store takes.
const QUEUE_NAME_BYTES_MAX: usize = 255;

/// Told of every message a shard stores, once it is readable (on every replica).
pub trait ShardObserver: Send + Sync {
    /// `appended` holds each stored message's queue, offset and payload.
    fn appended(&self, shard: ShardId, appended: &[(&[u8], u64, &[u8])]);
}

/// One queue's part of a batch: where it stood before, and how many messages the batch adds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct QueueStart {
    queue: Vec<u8>,
    start: u64,
    count: u64,
}

/// The apply record (see the module's text).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Applying {
    /// The batch's first index.
    from: u64,
    /// The batch's last log id: applied once the batch is in the store.
    last: LogId<NodeId>,
    /// The membership after the batch.
    membership: StoredMembership<NodeId, NodeInfo>,
    /// The batch's queues.
    queues: Vec<QueueStart>,
}

#[derive(Debug, Default)]
struct Applied {
    last: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, NodeInfo>,
    /// The store round that makes the last batch durable.
    ticket: Option<CommitTicket>,
}

/// A shard's state machine over the node's queue store. Clones share it.
#[derive(Clone)]
pub struct ShardStateMachine {
    shard: ShardId,
    store: Arc<Store>,
    log: LogStore<ShardConfig>,
    applied: Arc<Mutex<Applied>>,
    observer: Option<Arc<dyn ShardObserver>>,
}

impl std::fmt::Debug for ShardStateMachine {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "ShardStateMachine({})", self.shard)
    }
}

fn io_error(error: &(impl std::error::Error + 'static)) -> StorageError {
    StorageIOError::write_state_machine(error).into()
}

/// Why the store would refuse a message, if it would (checked the same way on every replica,
/// before anything of the entry is written).
fn refusal(store: &Store, message: &QueueMessage) -> Option<String> {
    let max = store.options().message_bytes_max;
    if message.queue.is_empty() || message.queue.len() > QUEUE_NAME_BYTES_MAX {
        return Some(format!(
            "a queue name is 1 to {QUEUE_NAME_BYTES_MAX} bytes, got {}",
            message.queue.len()
        ));
    }
    (message.payload.len() > max).then(|| {
        format!(
            "a message of {} bytes is over message_bytes_max ({max})",
            message.payload.len()
        )
    })
}

/// A queue's next offset in the store (0 for one that does not exist).
fn next_offset(store: &Store, queue: &[u8]) -> u64 {
    store
        .queue_info(queue)
        .ok()
        .flatten()
        .map_or(0, |info| info.next_offset)
}

impl ShardStateMachine {
    /// Shard `shard`'s state machine over `store`, its apply record in `log`. Finishes the
    /// batch a crash interrupted, if any (see the module's text).
    pub fn open(
        shard: ShardId,
        store: Arc<Store>,
        log: LogStore<ShardConfig>,
    ) -> Result<Self, StorageError> {
        let machine = Self {
            shard,
            store,
            log,
            applied: Arc::new(Mutex::new(Applied::default())),
            observer: None,
        };
        if let Some(applying) = machine.log.read_meta::<Applying>(APPLYING_KEY)? {
            machine.recover(&applying)?;
        }
        Ok(machine)
    }

    /// Tells `observer` of every message applied from now on.
    #[must_use]
    pub fn with_observer(mut self, observer: Arc<dyn ShardObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// The last applied log id.
    pub fn last_applied(&self) -> Option<LogId<NodeId>> {
        self.lock().last
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Applied> {
        self.applied.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Appends what the recorded batch has not stored yet.
    fn recover(&self, applying: &Applying) -> Result<(), StorageError> {
        let mut missing: HashMap<&[u8], (u64, u64)> = applying
            .queues
            .iter()
            .map(|queue| {
                let present = next_offset(&self.store, &queue.queue)
                    .saturating_sub(queue.start)
                    .min(queue.count);
                (&queue.queue[..], (present, 0))
            })
            .collect();
        let entries = self.log.entries(&(applying.from..=applying.last.index))?;
        let mut batch: Vec<(&[u8], &[u8])> = Vec::new();
        for entry in &entries {
            let EntryPayload::Normal(ShardCommand::Append { messages }) = &entry.payload else {
                continue;
            };
            if messages
                .iter()
                .any(|message| refusal(&self.store, message).is_some())
            {
                continue;
            }
            for message in messages {
                if let Some((present, seen)) = missing.get_mut(&message.queue[..]) {
                    if *seen >= *present {
                        batch.push((&message.queue, &message.payload));
                    }
                    *seen += 1;
                }
            }
        }
        let (_, ticket) = self
            .store
            .append_batch_deferred(&batch)
            .map_err(|error| io_error(&error))?;
        self.store
            .wait_durable(ticket)
            .map_err(|error| io_error(&error))?;
        tracing::info!(
            shard = self.shard,
            restored = batch.len(),
            last = applying.last.index,
            "finished the shard's last applied batch"
        );
        let mut applied = self.lock();
        applied.last = Some(applying.last);
        applied.membership = applying.membership.clone();
        Ok(())
    }

    /// Applies `entries` (blocking: store and log writes).
    fn apply_blocking(
        &self,
        entries: &[Entry<ShardConfig>],
    ) -> Result<Vec<ShardResponse>, StorageError> {
        let Some(last_entry) = entries.last() else {
            return Ok(Vec::new());
        };
        let mut applied = self.lock();
        let mut membership = applied.membership.clone();
        let mut responses = Vec::with_capacity(entries.len());
        let mut batch: Vec<(&[u8], &[u8])> = Vec::new();
        // Each accepted append's first message in `batch` and its length.
        let mut spans = Vec::with_capacity(entries.len());
        for entry in entries {
            match &entry.payload {
                EntryPayload::Blank => responses.push(ShardResponse::Done),
                EntryPayload::Membership(changed) => {
                    membership = StoredMembership::new(Some(entry.log_id), changed.clone());
                    responses.push(ShardResponse::Done);
                }
                EntryPayload::Normal(ShardCommand::Append { messages }) => {
                    if let Some(reason) = messages
                        .iter()
                        .find_map(|message| refusal(&self.store, message))
                    {
                        responses.push(ShardResponse::Refused { reason });
                        continue;
                    }
                    spans.push((responses.len(), batch.len(), messages.len()));
                    responses.push(ShardResponse::Done);
                    batch.extend(
                        messages
                            .iter()
                            .map(|message| (&message.queue[..], &message.payload[..])),
                    );
                }
            }
        }
        if batch.is_empty() {
            applied.last = Some(last_entry.log_id);
            applied.membership = membership;
            return Ok(responses);
        }
        // The previous batch whole in the store before this one's record replaces its own.
        if let Some(ticket) = applied.ticket.take() {
            self.store
                .wait_durable(ticket)
                .map_err(|error| io_error(&error))?;
        }
        let mut counts: HashMap<&[u8], u64> = HashMap::new();
        for (queue, _) in &batch {
            *counts.entry(queue).or_default() += 1;
        }
        let queues: Vec<QueueStart> = counts
            .iter()
            .map(|(queue, count)| QueueStart {
                queue: queue.to_vec(),
                start: next_offset(&self.store, queue),
                count: *count,
            })
            .collect();
        self.log.write_meta(
            APPLYING_KEY,
            &Applying {
                from: entries[0].log_id.index,
                last: last_entry.log_id,
                membership: membership.clone(),
                queues,
            },
        )?;
        let (offsets, ticket) = self
            .store
            .append_batch_deferred(&batch)
            .map_err(|error| io_error(&error))?;
        applied.ticket = Some(ticket);
        applied.last = Some(last_entry.log_id);
        applied.membership = membership;
        drop(applied);
        for (response, first, length) in spans {
            responses[response] = ShardResponse::Appended {
                offsets: offsets[first..first + length].to_vec(),
            };
        }
        if let Some(observer) = &self.observer {
            let appended: Vec<(&[u8], u64, &[u8])> = batch
                .iter()
                .zip(&offsets)
                .map(|(&(queue, payload), &offset)| (queue, offset, payload))
                .collect();
            observer.appended(self.shard, &appended);
        }
        Ok(responses)
    }
}

impl RaftSnapshotBuilder<ShardConfig> for ShardStateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<ShardConfig>, StorageError> {
        Err(StorageIOError::read_state_machine(&std::io::Error::other(
            "shard snapshots are not built yet: the shard's log is kept whole",
        ))
        .into())
    }
}

impl RaftStateMachine<ShardConfig> for ShardStateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, NodeInfo>), StorageError> {
        let applied = self.lock();
        Ok((applied.last, applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<ShardResponse>, StorageError>
    where
        I: IntoIterator<Item = Entry<ShardConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<Entry<ShardConfig>> = entries.into_iter().collect();
        let machine = self.clone();
        tokio::task::spawn_blocking(move || machine.apply_blocking(&entries))
            .await
            .map_err(|error| io_error(&error))?
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Err(StorageIOError::read_state_machine(&std::io::Error::other(
            "shard snapshots are not installed yet",
        ))
        .into())
    }

    async fn install_snapshot(
        &mut self,
        _meta: &SnapshotMeta<NodeId, NodeInfo>,
        _snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        Err(StorageIOError::read_state_machine(&std::io::Error::other(
            "shard snapshots are not installed yet",
        ))
        .into())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<ShardConfig>>, StorageError> {
        Ok(None)
    }
}
