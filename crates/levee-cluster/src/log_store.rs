//! [`LogStore`]: a Raft group's log, vote, committed and purge points in a fjall keyspace
//! (docs/CLUSTER.md, storage): the metadata group's in a keyspace of its own, every shard
//! group's in two partitions of one shared keyspace (so one journal fsync can cover the
//! appends of many shards). Entries are keyed by their index (big-endian, so the keyspace's
//! order is the log's), encoded by the group's [`LogCodec`] (the metadata group's as JSON, a
//! shard's in postcard, binary); the vote and the points are JSON in a second partition (a
//! shard's apply record postcard, [`LogStore::write_meta_binary_grouped`]).
//! Every append, vote, truncation and purge is persisted with `SyncAll` before it returns, so
//! what openraft is told is durable is on disk.

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::path::Path;

use bytes::Bytes;
use fjall::{Config, Keyspace, PartitionCreateOptions, PartitionHandle, PersistMode};
use openraft::entry::RaftPayload;
use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{
    Entry, LogId, OptionalSend, RaftLogReader, RaftTypeConfig, StorageIOError, StoredMembership,
    Vote,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::syncer::JournalSyncer;
use crate::{MetaConfig, NodeId, NodeInfo, StorageError};

/// How a group's log entries are written on disk.
pub trait LogCodec: RaftTypeConfig<NodeId = NodeId, Node = NodeInfo, Entry = Entry<Self>> {
    /// An entry's bytes.
    fn encode_entry(entry: &Entry<Self>) -> Result<Vec<u8>, StorageError>;
    /// An entry from its bytes.
    fn decode_entry(bytes: &Bytes) -> Result<Entry<Self>, StorageError>;
}

impl LogCodec for MetaConfig {
    fn encode_entry(entry: &Entry<Self>) -> Result<Vec<u8>, StorageError> {
        to_json(entry)
    }

    fn decode_entry(bytes: &Bytes) -> Result<Entry<Self>, StorageError> {
        from_json(bytes)
    }
}

/// The vote's key in the meta partition.
const VOTE_KEY: &str = "vote";
/// The last purged log id's key.
const PURGED_KEY: &str = "purged";
/// The last committed log id's key.
const COMMITTED_KEY: &str = "committed";
/// The key of the last membership entries written to the log.
const MEMBERSHIPS_KEY: &str = "memberships";
/// Membership entries the log keeps track of (openraft has at most one uncommitted).
const MEMBERSHIPS_KEPT: usize = 2;

/// The Raft log on disk. Clones share the keyspace (a reader is a clone).
pub struct LogStore<C = MetaConfig> {
    keyspace: Keyspace,
    entries: PartitionHandle,
    meta: PartitionHandle,
    /// The keyspace's group commit, when shared with other logs; without it every append
    /// fsyncs on its own.
    syncer: Option<JournalSyncer>,
    /// Told how long each append took until durable, if set.
    flush_timer: Option<FlushTimer>,
    codec: std::marker::PhantomData<fn() -> C>,
}

/// Told how long an append of entries took from the call until fsynced.
pub type FlushTimer = std::sync::Arc<dyn Fn(std::time::Duration) + Send + Sync>;

impl<C> Clone for LogStore<C> {
    fn clone(&self) -> Self {
        Self {
            keyspace: self.keyspace.clone(),
            entries: self.entries.clone(),
            meta: self.meta.clone(),
            syncer: self.syncer.clone(),
            flush_timer: self.flush_timer.clone(),
            codec: std::marker::PhantomData,
        }
    }
}

impl<C> Debug for LogStore<C> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("LogStore")
    }
}

/// An entry's key: its index, big-endian.
fn index_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

pub(crate) fn to_json<T: Serialize>(value: &T) -> Result<Vec<u8>, StorageError> {
    serde_json::to_vec(value).map_err(|error| StorageIOError::write(&error).into())
}

pub(crate) fn from_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, StorageError> {
    serde_json::from_slice(bytes).map_err(|error| StorageIOError::read(&error).into())
}

/// The first byte of a meta value written in postcard ([`LogStore::write_meta_binary_grouped`]);
/// a JSON value starts with a printable character, never this.
const BINARY_META: u8 = 0;

/// A meta value: postcard after [`BINARY_META`], else JSON.
fn decode_meta<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, StorageError> {
    match bytes.split_first() {
        Some((&BINARY_META, body)) => {
            postcard::from_bytes(body).map_err(|error| StorageIOError::read(&error).into())
        }
        _ => from_json(bytes),
    }
}

/// `value` as a meta value in postcard: [`BINARY_META`], then its bytes.
fn binary_meta<T: Serialize>(value: &T) -> Result<Vec<u8>, StorageError> {
    let mut bytes = vec![BINARY_META];
    postcard::to_io(value, &mut bytes).map_err(|error| StorageIOError::write(&error))?;
    Ok(bytes)
}

/// Opens (or creates) the fjall keyspace in `directory`.
pub fn open_keyspace(directory: &Path) -> Result<Keyspace, StorageError> {
    Config::new(directory)
        .open()
        .map_err(|error| StorageIOError::read_logs(&error).into())
}

/// Opens (or creates) the fjall keyspace in `directory`, its partitions' memtables together
/// holding at most `write_buffer_bytes` before the largest is flushed to disk (fjall's default
/// is 64 MiB).
pub fn open_keyspace_sized(
    directory: &Path,
    write_buffer_bytes: u64,
) -> Result<Keyspace, StorageError> {
    Config::new(directory)
        .max_write_buffer_size(write_buffer_bytes)
        .open()
        .map_err(|error| StorageIOError::read_logs(&error).into())
}

impl LogStore<MetaConfig> {
    /// Opens (or creates) the metadata group's log in `directory`.
    pub fn open(directory: &Path) -> Result<Self, StorageError> {
        Self::open_in(open_keyspace(directory)?, "")
    }
}

impl<C> LogStore<C> {
    /// Opens (or creates) a log in `keyspace`, in the partitions `entries{suffix}` and
    /// `meta{suffix}`.
    pub fn open_in(keyspace: Keyspace, suffix: &str) -> Result<Self, StorageError> {
        Self::open_in_sized(keyspace, suffix, None)
    }

    /// [`LogStore::open_in`], the entries partition's memtable flushed to disk past
    /// `entries_memtable_bytes` (fjall's default, 16 MiB, when `None`). Like every partition
    /// option it applies when the partition is created; an existing one keeps its own.
    pub fn open_in_sized(
        keyspace: Keyspace,
        suffix: &str,
        entries_memtable_bytes: Option<u32>,
    ) -> Result<Self, StorageError> {
        let open = |name: String, memtable_bytes: Option<u32>| {
            let options = memtable_bytes.map_or_else(PartitionCreateOptions::default, |bytes| {
                PartitionCreateOptions::default().max_memtable_size(bytes)
            });
            keyspace
                .open_partition(&name, options)
                .map_err(|error| StorageError::from(StorageIOError::read_logs(&error)))
        };
        let (entries, meta) = (
            open(format!("entries{suffix}"), entries_memtable_bytes)?,
            open(format!("meta{suffix}"), None)?,
        );
        Ok(Self {
            keyspace,
            entries,
            meta,
            syncer: None,
            flush_timer: None,
            codec: std::marker::PhantomData,
        })
    }

    /// The log fsyncing appends through `syncer` (the keyspace's group commit): an append
    /// returns once written, and openraft is told it is durable after the fsync that covers it.
    #[must_use]
    pub fn with_syncer(mut self, syncer: JournalSyncer) -> Self {
        self.syncer = Some(syncer);
        self
    }

    /// This log, telling `timer` how long each append took until durable (through the group
    /// commit: only with a syncer).
    #[must_use]
    pub fn with_flush_timer(mut self, timer: FlushTimer) -> Self {
        self.flush_timer = Some(timer);
        self
    }

    /// Writes `bytes` under `key`, durable through the group commit when there is one.
    fn write_meta_value_grouped(&self, key: &str, bytes: Vec<u8>) -> Result<(), StorageError> {
        self.meta
            .insert(key, bytes)
            .map_err(|error| StorageIOError::write(&error))?;
        self.persist()
    }

    /// Writes `value` under `key` in the meta partition, in postcard (binary: the apply
    /// record, written at every apply, is compact and cheap to encode so; [`LogStore::read_meta`]
    /// reads it or JSON), and waits for it to be fsynced through the group commit (alone when
    /// there is none).
    pub(crate) fn write_meta_binary_grouped<T: Serialize>(
        &self,
        key: &str,
        value: &T,
    ) -> Result<(), StorageError> {
        self.write_meta_value_grouped(key, binary_meta(value)?)
    }

    /// Writes `value` under `key` in the meta partition, in postcard as
    /// [`LogStore::write_meta_binary_grouped`] does, without waiting: the future it returns
    /// ends once the write is fsynced through the group commit (alone, before it returns, when
    /// there is none), holding no thread meanwhile.
    pub(crate) fn write_meta_binary_then_sync<T: Serialize>(
        &self,
        key: &str,
        value: &T,
    ) -> Result<impl Future<Output = Result<(), StorageError>> + Send + 'static, StorageError> {
        self.insert_meta_binary(key, value)?;
        let synced = if let Some(syncer) = &self.syncer {
            Some(syncer.synced())
        } else {
            self.persist()?;
            None
        };
        Ok(async move {
            match synced {
                Some(synced) => synced
                    .await
                    .map_err(|error| StorageIOError::write(&std::io::Error::other(error)).into()),
                None => Ok(()),
            }
        })
    }

    /// Writes `value` under `key` in the meta partition, in postcard as
    /// [`LogStore::write_meta_binary_grouped`] does, without fsyncing it: it is noted with the
    /// group commit ([`JournalSyncer::note_write`]) and durable before the next write that the
    /// syncer's write barrier guards. Without a group commit it is fsynced before it returns.
    pub(crate) fn write_meta_binary_noted<T: Serialize>(
        &self,
        key: &str,
        value: &T,
    ) -> Result<(), StorageError> {
        self.insert_meta_binary(key, value)?;
        match &self.syncer {
            Some(syncer) => {
                syncer.note_write();
                Ok(())
            }
            None => self.persist(),
        }
    }

    /// Writes `value` under `key` in the meta partition, in postcard, without fsyncing it.
    fn insert_meta_binary<T: Serialize>(&self, key: &str, value: &T) -> Result<(), StorageError> {
        self.meta
            .insert(key, binary_meta(value)?)
            .map_err(|error| StorageIOError::write(&error).into())
    }

    /// Whether this log fsyncs through a group commit.
    pub(crate) fn has_syncer(&self) -> bool {
        self.syncer.is_some()
    }

    /// Makes everything written so far durable: through the group commit when there is one
    /// (which fsyncs without holding fjall's journal lock, so the other logs of the keyspace
    /// keep writing), else with fjall's own fsync.
    fn persist(&self) -> Result<(), StorageError> {
        if let Some(syncer) = &self.syncer {
            return syncer
                .sync()
                .map_err(|error| StorageIOError::write_logs(&std::io::Error::other(error)).into());
        }
        self.keyspace
            .persist(PersistMode::SyncAll)
            .map_err(|error| StorageIOError::write_logs(&error).into())
    }

    pub(crate) fn read_meta<T: DeserializeOwned>(
        &self,
        key: &str,
    ) -> Result<Option<T>, StorageError> {
        let value = self
            .meta
            .get(key)
            .map_err(|error| StorageIOError::read(&error))?;
        value.map(|bytes| decode_meta(&bytes)).transpose()
    }

    pub(crate) fn write_meta<T: Serialize>(
        &self,
        key: &str,
        value: &T,
    ) -> Result<(), StorageError> {
        self.meta
            .insert(key, to_json(value)?)
            .map_err(|error| StorageIOError::write(&error))?;
        self.persist()
    }

    /// Removes `key` from the meta partition, durably.
    pub(crate) fn remove_meta(&self, key: &str) -> Result<(), StorageError> {
        self.meta
            .remove(key)
            .map_err(|error| StorageIOError::write(&error))?;
        self.persist()
    }

    /// Removes the entries whose index is in `range`.
    fn remove(&self, range: (Bound<u64>, Bound<u64>)) -> Result<(), StorageError> {
        let bound = |bound: Bound<u64>| bound.map(index_key);
        let keys: Vec<_> = self
            .entries
            .range((bound(range.0), bound(range.1)))
            .map(|pair| pair.map(|(key, _)| key))
            .collect::<Result<_, _>>()
            .map_err(|error| StorageIOError::read_logs(&error))?;
        let mut batch = self.keyspace.batch();
        for key in keys {
            batch.remove(&self.entries, key);
        }
        batch
            .commit()
            .map_err(|error| StorageIOError::write_logs(&error))?;
        self.persist()
    }
}

impl<C: LogCodec> LogStore<C> {
    /// The entries whose index is in `range`, in order.
    pub fn entries<RB: RangeBounds<u64>>(&self, range: &RB) -> Result<Vec<Entry<C>>, StorageError> {
        let bound = |bound: Bound<&u64>| bound.map(|index| index_key(*index));
        self.entries
            .range((bound(range.start_bound()), bound(range.end_bound())))
            .map(|pair| {
                let (_, value) = pair.map_err(|error| StorageIOError::read_logs(&error))?;
                C::decode_entry(&Bytes::from_owner(value))
            })
            .collect()
    }
}

/// A membership as the log holds it.
type Logged = StoredMembership<NodeId, NodeInfo>;

impl<C: LogCodec> LogStore<C> {
    /// The last [`MEMBERSHIPS_KEPT`] membership entries written to the log, oldest first.
    pub(crate) fn memberships(&self) -> Result<Vec<Logged>, StorageError> {
        Ok(self.read_meta(MEMBERSHIPS_KEY)?.unwrap_or_default())
    }

    /// The last membership entry of the log at or before `index`, if the log keeps it.
    pub(crate) fn membership_at(&self, index: u64) -> Result<Option<Logged>, StorageError> {
        Ok(self
            .memberships()?
            .into_iter()
            .rev()
            .find(|kept| kept.log_id().is_some_and(|id| id.index <= index)))
    }

    /// Writes `entries` in one batch, without waiting for the fsync.
    pub(crate) fn write_entries(
        &self,
        entries: impl IntoIterator<Item = Entry<C>>,
    ) -> Result<(), StorageError> {
        let mut batch = self.keyspace.batch();
        let mut memberships: Option<Vec<Logged>> = None;
        for entry in entries {
            if let Some(membership) = entry.get_membership() {
                let list = match &mut memberships {
                    Some(list) => list,
                    None => memberships.insert(self.memberships()?),
                };
                list.retain(|kept| kept.log_id().map(|id| id.index) < Some(entry.log_id.index));
                list.push(StoredMembership::new(
                    Some(entry.log_id),
                    membership.clone(),
                ));
                if list.len() > MEMBERSHIPS_KEPT {
                    list.remove(0);
                }
            }
            batch.insert(
                &self.entries,
                index_key(entry.log_id.index),
                C::encode_entry(&entry)?,
            );
        }
        if let Some(list) = memberships {
            batch.insert(&self.meta, MEMBERSHIPS_KEY, to_json(&list)?);
        }
        batch
            .commit()
            .map_err(|error| StorageIOError::write_logs(&error).into())
    }
}

impl<C: LogCodec> RaftLogReader<C> for LogStore<C> {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<C>>, StorageError> {
        self.entries(&range)
    }
}

impl<C: LogCodec> RaftLogStorage<C> for LogStore<C> {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<C>, StorageError> {
        let last_purged_log_id: Option<LogId<NodeId>> = self.read_meta(PURGED_KEY)?;
        let last = self
            .entries
            .last_key_value()
            .map_err(|error| StorageIOError::read_logs(&error))?;
        let last_log_id = match last {
            Some((_, value)) => Some(C::decode_entry(&Bytes::from_owner(value))?.log_id),
            None => last_purged_log_id,
        };
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        let Some(syncer) = &self.syncer else {
            return self.write_meta(VOTE_KEY, vote);
        };
        // Through the group commit, awaited without holding a runtime thread: after a node
        // dies every shard it led votes at once, and as many fsyncs in a row on the runtime's
        // threads would hold up the heartbeats of every other shard.
        self.meta
            .insert(VOTE_KEY, to_json(vote)?)
            .map_err(|error| StorageIOError::write_vote(&error))?;
        syncer
            .synced()
            .await
            .map_err(|error| StorageIOError::write_vote(&std::io::Error::other(error)).into())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.read_meta(VOTE_KEY)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError> {
        // Not fsynced: the committed point only lets a restarted node apply sooner, and one
        // lost in a crash is learned again from the leader. An fsync here would stall the
        // group's Raft core at every commit.
        self.meta
            .insert(COMMITTED_KEY, to_json(&committed)?)
            .map_err(|error| StorageIOError::write(&error).into())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError> {
        Ok(self
            .read_meta::<Option<LogId<NodeId>>>(COMMITTED_KEY)?
            .flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<C>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry<C>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut entries = entries.into_iter().peekable();
        if entries.peek().is_none() {
            // Nothing written, nothing to flush.
            callback.log_io_completed(Ok(()));
            return Ok(());
        }
        let started = std::time::Instant::now();
        self.write_entries(entries)?;
        if let Some(syncer) = &self.syncer {
            let timer = self.flush_timer.clone();
            syncer.after_sync(Box::new(move |result| {
                if let (Some(timer), Ok(())) = (&timer, &result) {
                    timer(started.elapsed());
                }
                callback.log_io_completed(result.map_err(std::io::Error::other));
            }));
            return Ok(());
        }
        // One fsync for the whole batch: the group commit of the log.
        let persisted = self
            .keyspace
            .persist(PersistMode::SyncAll)
            .map_err(std::io::Error::other);
        let failed = persisted
            .as_ref()
            .err()
            .map(std::string::ToString::to_string);
        callback.log_io_completed(persisted);
        match failed {
            Some(error) => Err(StorageIOError::write_logs(&std::io::Error::other(error)).into()),
            None => Ok(()),
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        let mut memberships = self.memberships()?;
        let kept = memberships.len();
        memberships
            .retain(|membership| membership.log_id().map(|id| id.index) < Some(log_id.index));
        if memberships.len() != kept {
            self.write_meta(MEMBERSHIPS_KEY, &memberships)?;
        }
        self.remove((Bound::Included(log_id.index), Bound::Unbounded))
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError> {
        // The purge point first: a crash between the two leaves entries openraft will purge
        // again, never a point behind what is gone.
        self.write_meta(PURGED_KEY, &log_id)?;
        self.remove((Bound::Unbounded, Bound::Included(log_id.index)))
    }
}
