//! [`MetaStateMachine`]: the metadata group's replicated state: the broker's catalog, the
//! hot-key settings and the membership, applied from the log. A snapshot is the state as JSON
//! (the catalog as the records that rebuild it), kept in one file written whole (a temporary file, fsynced,
//! renamed); a restarted node loads it and openraft replays the log after it.

use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use levee_broker::catalog::{Catalog, CatalogRecord};
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    Entry, EntryPayload, LogId, OptionalSend, RaftSnapshotBuilder, SnapshotMeta, StorageIOError,
    StoredMembership,
};
use serde::{Deserialize, Serialize};

use crate::command::{HotKeyMeta, HotKeyObserver, LimitMeta, MetaCommand, MetaResponse};
use crate::{MetaConfig, NodeId, NodeInfo, StorageError};

/// The snapshot's file name in the state machine's directory.
pub const SNAPSHOT_FILE_NAME: &str = "snapshot.json";

/// The state the log builds.
#[derive(Debug, Default)]
struct MetaState {
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, NodeInfo>,
    catalog: Catalog,
    hot_keys: HotKeyMeta,
    limits: LimitMeta,
    /// The cluster's shards, once the first node fixed them.
    shards: Option<u32>,
    /// Whether the cluster replicates its plain queues over its shards (fixed with them).
    replicated_queues: bool,
    /// Snapshots built so far by this process, to tell their ids apart.
    snapshots_built: u64,
}

/// The state a snapshot carries.
#[derive(Debug, Serialize, Deserialize)]
struct SnapshotState {
    catalog: Vec<CatalogRecord>,
    /// Absent from snapshots of versions before hot keys were replicated.
    #[serde(default)]
    hot_keys: HotKeyMeta,
    /// Absent from snapshots of versions before limits.
    #[serde(default)]
    limits: LimitMeta,
    /// Absent from snapshots of versions before shards.
    #[serde(default)]
    shards: Option<u32>,
    /// Absent from snapshots of versions before replicated queues.
    #[serde(default)]
    replicated_queues: bool,
}

/// A snapshot as its file holds it.
#[derive(Debug, Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, NodeInfo>,
    data: Vec<u8>,
}

/// The replicated metadata. Clones share the state (the snapshot builder is a clone).
#[derive(Debug, Clone)]
pub struct MetaStateMachine {
    state: Arc<RwLock<MetaState>>,
    directory: PathBuf,
    observer: Option<Arc<dyn HotKeyObserver>>,
}

fn read_error(error: &impl std::error::Error) -> StorageError {
    StorageIOError::read_state_machine(&std::io::Error::other(error.to_string())).into()
}

fn write_error(error: &impl std::error::Error) -> StorageError {
    StorageIOError::write_state_machine(&std::io::Error::other(error.to_string())).into()
}

impl MetaState {
    /// Applies one command; what it did.
    fn apply_command(
        &mut self,
        command: &MetaCommand,
        index: u64,
        observer: Option<&dyn HotKeyObserver>,
    ) -> MetaResponse {
        match command {
            MetaCommand::SetLimitRule { .. } | MetaCommand::DeleteLimitRule { .. } => {
                self.limits.apply(command).unwrap_or_default()
            }
            MetaCommand::SetHotKeyRules { .. }
            | MetaCommand::SetManualHotKey { .. }
            | MetaCommand::RemoveHotKey { .. } => {
                let response = self.hot_keys.apply(command).unwrap_or_default();
                if let Some(observer) = observer.filter(|_| response.refused_at_bound.is_none()) {
                    tell(observer, command);
                }
                response
            }
            MetaCommand::InitShards { shards, replicated } => match self.shards {
                None => {
                    self.shards = Some(*shards);
                    self.replicated_queues = *replicated;
                    MetaResponse {
                        changed: true,
                        ..MetaResponse::default()
                    }
                }
                Some(fixed) if fixed == *shards => MetaResponse::default(),
                Some(fixed) => MetaResponse {
                    refused_at_bound: Some(format!(
                        "the cluster has {fixed} shards, fixed when it was created; it keeps them"
                    )),
                    ..MetaResponse::default()
                },
            },
            MetaCommand::Import(records) => {
                let mut imported = self.catalog.clone();
                for record in records {
                    if let Err(error) = imported.apply(record, index) {
                        return MetaResponse {
                            refused: Some(error),
                            ..MetaResponse::default()
                        };
                    }
                }
                let changed = imported != self.catalog;
                self.catalog = imported;
                MetaResponse {
                    changed,
                    ..MetaResponse::default()
                }
            }
            MetaCommand::Catalog(command) => {
                let decided = self
                    .catalog
                    .decide(command)
                    .and_then(|record| match record {
                        Some(record) => self.catalog.apply(&record, index).map(|()| true),
                        None => Ok(false),
                    });
                match decided {
                    Ok(changed) => MetaResponse {
                        changed,
                        ..MetaResponse::default()
                    },
                    Err(error) => MetaResponse {
                        refused: Some(error),
                        ..MetaResponse::default()
                    },
                }
            }
        }
    }

    /// Replaces the state with a snapshot's.
    fn restore(
        &mut self,
        meta: &SnapshotMeta<NodeId, NodeInfo>,
        data: &[u8],
    ) -> Result<(), StorageError> {
        let state: SnapshotState =
            serde_json::from_slice(data).map_err(|error| read_error(&error))?;
        let mut catalog = Catalog::default();
        for (offset, record) in (0_u64..).zip(&state.catalog) {
            catalog
                .apply(record, offset)
                .map_err(|error| read_error(&error))?;
        }
        self.catalog = catalog;
        self.hot_keys = state.hot_keys;
        self.limits = state.limits;
        self.shards = state.shards;
        self.replicated_queues = state.replicated_queues;
        self.last_applied = meta.last_log_id;
        self.membership = meta.last_membership.clone();
        Ok(())
    }
}

/// Tells `observer` what a hot-key command did.
fn tell(observer: &dyn HotKeyObserver, command: &MetaCommand) {
    match command {
        MetaCommand::SetHotKeyRules { app, rules } => observer.rules(app, rules),
        MetaCommand::SetManualHotKey {
            app,
            key,
            expires_at_ms,
            ..
        } => observer.manual_hot(app, key, *expires_at_ms),
        MetaCommand::RemoveHotKey { app, key, .. } => observer.cooled(app, key),
        MetaCommand::Catalog(_)
        | MetaCommand::Import(_)
        | MetaCommand::InitShards { .. }
        | MetaCommand::SetLimitRule { .. }
        | MetaCommand::DeleteLimitRule { .. } => {}
    }
}

impl MetaStateMachine {
    /// The state machine kept in `directory` (created if missing): empty, or the state of the
    /// snapshot found there.
    pub fn open(directory: &Path) -> Result<Self, StorageError> {
        std::fs::create_dir_all(directory).map_err(|error| write_error(&error))?;
        let machine = Self {
            state: Arc::new(RwLock::new(MetaState::default())),
            directory: directory.to_path_buf(),
            observer: None,
        };
        if let Some(stored) = machine.read_snapshot()? {
            machine.lock().restore(&stored.meta, &stored.data)?;
        }
        Ok(machine)
    }

    /// Tells `observer` of every hot-key change from now on, starting with the whole state as
    /// it stands. Set it before the Raft instance starts applying the log.
    #[must_use]
    pub fn with_observer(mut self, observer: Arc<dyn HotKeyObserver>) -> Self {
        observer.reset(&self.read().hot_keys);
        self.observer = Some(observer);
        self
    }

    /// The cluster's shards, once fixed (docs/CLUSTER.md, "Part 2").
    pub fn shards(&self) -> Option<u32> {
        self.read().shards
    }

    /// Whether the cluster replicates its plain queues over its shards (fixed with them).
    pub fn replicated_queues(&self) -> bool {
        self.read().replicated_queues
    }

    /// Reads the replicated limits rules as they stand.
    pub fn with_limits<T>(&self, read: impl FnOnce(&LimitMeta) -> T) -> T {
        read(&self.read().limits)
    }

    /// Reads the replicated hot-key settings as they stand.
    pub fn with_hot_keys<T>(&self, read: impl FnOnce(&HotKeyMeta) -> T) -> T {
        read(&self.read().hot_keys)
    }

    fn lock(&self) -> RwLockWriteGuard<'_, MetaState> {
        self.state.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn read(&self) -> RwLockReadGuard<'_, MetaState> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reads the catalog as it stands (a shared lock: readers do not wait for each other).
    pub fn with_catalog<T>(&self, read: impl FnOnce(&Catalog) -> T) -> T {
        read(&self.read().catalog)
    }

    fn read_snapshot(&self) -> Result<Option<StoredSnapshot>, StorageError> {
        match std::fs::read(self.directory.join(SNAPSHOT_FILE_NAME)) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|error| read_error(&error)),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(read_error(&error)),
        }
    }

    fn write_snapshot(&self, stored: &StoredSnapshot) -> Result<(), StorageError> {
        let bytes = serde_json::to_vec(stored).map_err(|error| write_error(&error))?;
        let path = self.directory.join(SNAPSHOT_FILE_NAME);
        let temporary = self.directory.join(format!("{SNAPSHOT_FILE_NAME}.partial"));
        let written = (|| {
            let mut file = std::fs::File::create(&temporary)?;
            std::io::Write::write_all(&mut file, &bytes)?;
            file.sync_all()?;
            std::fs::rename(&temporary, &path)?;
            std::fs::File::open(&self.directory)?.sync_all()
        })();
        written.map_err(|error| write_error(&error))
    }
}

impl RaftSnapshotBuilder<MetaConfig> for MetaStateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<MetaConfig>, StorageError> {
        let (meta, data) = {
            let mut state = self.lock();
            state.snapshots_built += 1;
            let data = serde_json::to_vec(&SnapshotState {
                catalog: state.catalog.records(),
                hot_keys: state.hot_keys.clone(),
                limits: state.limits.clone(),
                shards: state.shards,
                replicated_queues: state.replicated_queues,
            })
            .map_err(|error| write_error(&error))?;
            let last_index = state.last_applied.map_or(0, |log_id| log_id.index);
            let meta = SnapshotMeta {
                last_log_id: state.last_applied,
                last_membership: state.membership.clone(),
                snapshot_id: format!("{last_index}-{}", state.snapshots_built),
            };
            (meta, data)
        };
        self.write_snapshot(&StoredSnapshot {
            meta: meta.clone(),
            data: data.clone(),
        })?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl RaftStateMachine<MetaConfig> for MetaStateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, NodeInfo>), StorageError> {
        let state = self.lock();
        Ok((state.last_applied, state.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<MetaResponse>, StorageError>
    where
        I: IntoIterator<Item = Entry<MetaConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut state = self.lock();
        let mut responses = Vec::new();
        for entry in entries {
            state.last_applied = Some(entry.log_id);
            let response = match entry.payload {
                EntryPayload::Blank => MetaResponse::default(),
                EntryPayload::Normal(command) => {
                    state.apply_command(&command, entry.log_id.index, self.observer.as_deref())
                }
                EntryPayload::Membership(membership) => {
                    state.membership = StoredMembership::new(Some(entry.log_id), membership);
                    MetaResponse::default()
                }
            };
            responses.push(response);
        }
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, NodeInfo>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        {
            let mut state = self.lock();
            state.restore(meta, &data)?;
            if let Some(observer) = &self.observer {
                observer.reset(&state.hot_keys);
            }
        }
        self.write_snapshot(&StoredSnapshot {
            meta: meta.clone(),
            data,
        })
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<MetaConfig>>, StorageError> {
        Ok(self.read_snapshot()?.map(|stored| Snapshot {
            meta: stored.meta,
            snapshot: Box::new(Cursor::new(stored.data)),
        }))
    }
}
