//! Topics and the rest of the metadata catalog, through the metadata Raft group
//! (docs/CLUSTER.md): a change is written with the cluster's [`MetaWriter`] (committed to the
//! group's log, fsynced, whatever the queue sync policy; from a node that does not lead it is
//! forwarded to the leader) and applied by the broker engine's [`Catalog`] in the
//! [`MetaStateMachine`], which every read here consults. A lone server is a group of one.
//!
//! Data dirs of versions before the cluster kept the catalog in the store's `\0meta` queue:
//! [`legacy_records`] reads it, and the server imports it into the group once.

use std::collections::BTreeMap;
use std::sync::Arc;

use levee_broker::catalog::{Catalog, CatalogCommand, CatalogRecord};
pub use levee_broker::catalog::{RetentionRule, Topic};
use levee_broker::names::META_QUEUE;
use levee_cluster::{Manager, MetaCommand, MetaStateMachine, MetaWriter};
use levee_proto::WireError;
use levee_proto::v1::ErrorCode;
use levee_store::Store;

use crate::queue::catalog_error;

/// Records one read of the metadata queue asks for on import.
const REPLAY_READ_MESSAGES: usize = 1_000;
/// Bytes one read of the metadata queue asks for on import.
const REPLAY_READ_BYTES: usize = 1 << 20;

/// The catalog: written through the metadata group, read from its state machine.
#[derive(Debug)]
pub struct Topics {
    machine: MetaStateMachine,
    writer: MetaWriter,
    manager: Manager,
    /// Serialises this node's metadata writes so each is enforced (rates applied to pacers)
    /// in the order it was committed.
    writing: tokio::sync::Mutex<()>,
}

/// The catalog a data dir's `\0meta` queue holds, as records that rebuild it (`None` when the
/// queue does not exist). Blocks on the store.
pub fn legacy_records(store: &Store) -> Result<Option<Vec<CatalogRecord>>, String> {
    let Some(info) = store
        .queue_info(META_QUEUE)
        .map_err(|error| error.to_string())?
    else {
        return Ok(None);
    };
    let mut catalog = Catalog::default();
    let mut offset = info.first_offset;
    while offset < info.next_offset {
        let batch = store
            .read(META_QUEUE, offset, REPLAY_READ_MESSAGES, REPLAY_READ_BYTES)
            .map_err(|error| error.to_string())?;
        if batch.is_empty() {
            break;
        }
        for (bytes, at) in batch.iter().zip(offset..) {
            CatalogRecord::decode(bytes, at)
                .and_then(|record| catalog.apply(&record, at))
                .map_err(|error| error.to_string())?;
        }
        offset = batch.next_offset();
    }
    Ok(Some(catalog.records()))
}

impl Topics {
    /// The catalog of the group `writer` writes to, whose state `machine` holds.
    pub fn new(machine: MetaStateMachine, writer: MetaWriter, manager: Manager) -> Self {
        Self {
            machine,
            writer,
            manager,
            writing: tokio::sync::Mutex::new(()),
        }
    }

    /// Writes `command` and, once committed and applied, calls `enforce` if it changed
    /// anything, before another write of this node starts. `Ok(false)` when it changed
    /// nothing.
    async fn change(
        &self,
        command: CatalogCommand,
        enforce: impl FnOnce(),
    ) -> Result<bool, WireError> {
        let _writing = self.writing.lock().await;
        let response = crate::metadata::write(&self.writer, MetaCommand::Catalog(command)).await?;
        if let Some(error) = response.refused {
            return Err(catalog_error(&error));
        }
        if response.changed {
            enforce();
        }
        Ok(response.changed)
    }

    /// Creates `topic` with `partitions` partitions; `Ok(true)` if it existed already with
    /// that count.
    pub async fn create(&self, topic: &str, partitions: u32) -> Result<bool, WireError> {
        let command = CatalogCommand::CreateTopic {
            topic: topic.to_owned(),
            partitions,
        };
        self.change(command, || {}).await.map(|created| !created)
    }

    /// Waits until this node has applied every metadata write committed before the call
    /// ([`crate::metadata::linearize`]).
    pub async fn linearize(&self) -> Result<(), WireError> {
        crate::metadata::linearize(&self.manager).await
    }

    /// The topic, read linearizably when this node does not know it yet (created through
    /// another node a moment ago): else `NOT_FOUND`, saying how to create it.
    pub async fn require_current(&self, topic: &str) -> Result<Arc<Topic>, WireError> {
        match self.require(topic) {
            Ok(found) => Ok(found),
            Err(missing) if missing.code == ErrorCode::NotFound => {
                self.linearize().await?;
                self.require(topic)
            }
            Err(other) => Err(other),
        }
    }

    /// The topic as this node has applied the catalog, or a `NOT_FOUND` error that says how
    /// to create it.
    pub fn require(&self, topic: &str) -> Result<Arc<Topic>, WireError> {
        self.machine.with_catalog(|catalog| {
            catalog
                .require_topic(topic)
                .cloned()
                .map_err(|error| catalog_error(&error))
        })
    }

    /// Every topic, by name.
    pub fn list(&self) -> Vec<Arc<Topic>> {
        self.machine
            .with_catalog(|catalog| catalog.topics().cloned().collect())
    }

    /// Sets `group`'s rate (0 clears it), durably, then calls `enforce`.
    pub async fn set_rate(
        &self,
        group: &str,
        messages_per_s: f64,
        enforce: impl FnOnce(),
    ) -> Result<(), WireError> {
        let command = CatalogCommand::SetGroupRate {
            group: group.to_owned(),
            messages_per_s,
        };
        self.change(command, enforce).await.map(drop)
    }

    /// Sets the append rate limit of `producer_name` (0 clears it), durably, then calls
    /// `enforce`.
    pub async fn set_producer_rate(
        &self,
        producer_name: &str,
        messages_per_s: f64,
        enforce: impl FnOnce(),
    ) -> Result<(), WireError> {
        let command = CatalogCommand::SetProducerRate {
            producer_name: producer_name.to_owned(),
            messages_per_s,
        };
        self.change(command, enforce).await.map(drop)
    }

    /// Every group with a delivery rate, and every producer name with a rate limit.
    pub fn rates(&self) -> (BTreeMap<String, f64>, BTreeMap<String, f64>) {
        self.machine.with_catalog(|catalog| {
            (
                catalog.group_rates().clone(),
                catalog.producer_rates().clone(),
            )
        })
    }

    /// Every producer name with a rate limit, and the limit.
    pub fn producer_rates(&self) -> BTreeMap<String, f64> {
        self.machine
            .with_catalog(|catalog| catalog.producer_rates().clone())
    }

    /// Sets the retention of queues starting with `prefix` (both bounds 0: removes the rule),
    /// durably.
    pub async fn set_retention(&self, prefix: &[u8], rule: RetentionRule) -> Result<(), WireError> {
        let command = CatalogCommand::SetRetention {
            prefix: prefix.to_vec(),
            rule,
        };
        self.change(command, || {}).await.map(drop)
    }

    /// The rule of the longest prefix of `queue` (the default when none matches).
    pub fn retention_for(&self, queue: &[u8]) -> RetentionRule {
        self.machine
            .with_catalog(|catalog| catalog.retention().rule_for(queue))
    }

    /// Sets `group`'s retry policy (`None`: back to the default), durably.
    pub async fn set_retry_policy(
        &self,
        group: &str,
        policy: Option<levee_broker::retry::RetryPolicy>,
    ) -> Result<(), WireError> {
        let command = CatalogCommand::SetRetryPolicy {
            group: group.to_owned(),
            policy,
        };
        self.change(command, || {}).await.map(drop)
    }

    /// `group`'s retry policy, and whether it is the default (the group has none of its own).
    pub fn retry_policy(&self, group: &str) -> (levee_broker::retry::RetryPolicy, bool) {
        self.machine.with_catalog(|catalog| {
            (
                catalog.retry_policy(group),
                !catalog.retry_policies().contains_key(group),
            )
        })
    }

    /// `group`'s rate in messages per second, 0 for none.
    pub fn rate(&self, group: &str) -> f64 {
        self.machine
            .with_catalog(|catalog| catalog.group_rate(group))
    }
}
