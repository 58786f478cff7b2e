//! Topics and the rest of the metadata catalog over the store: the broker engine's
//! [`Catalog`] decides each change, this module logs its record durably in the server's
//! metadata queue (`\0meta`, written through the store's log, fsynced before answered whatever
//! the sync policy) and then applies it; on start the queue is replayed, so topics, group and
//! producer rate limits and queue retention rules survive restarts.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard};

use levee_broker::catalog::{Catalog, CatalogCommand, CatalogRecord};
pub use levee_broker::catalog::{RetentionRule, Topic};
use levee_broker::names::META_QUEUE;
use levee_proto::WireError;
use levee_store::Store;

use crate::queue::{catalog_error, lock, write_error};

/// Records one read of the metadata queue asks for on start.
const REPLAY_READ_MESSAGES: usize = 1_000;
/// Bytes one read of the metadata queue asks for on start.
const REPLAY_READ_BYTES: usize = 1 << 20;

/// The catalog, and the store its records live in.
#[derive(Debug)]
pub struct Topics {
    catalog: RwLock<Catalog>,
    /// Serialises metadata writes so records are logged and applied in one order.
    writing: Mutex<()>,
}

impl Topics {
    /// Replays the metadata queue. Blocks on the store.
    pub fn load(store: &Store) -> Result<Self, String> {
        let mut catalog = Catalog::default();
        let info = store
            .queue_info(META_QUEUE)
            .map_err(|error| error.to_string())?;
        if let Some(info) = info {
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
        }
        Ok(Self {
            catalog: RwLock::new(catalog),
            writing: Mutex::new(()),
        })
    }

    fn read(&self) -> RwLockReadGuard<'_, Catalog> {
        self.catalog.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Decides `command`, logs its record durably, applies it, then calls `enforce` before
    /// another metadata write can start (so concurrent changes take effect in log order).
    /// `Ok(false)` when the command changed nothing. Blocks on the store.
    fn change(
        &self,
        store: &Store,
        command: &CatalogCommand,
        enforce: impl FnOnce(),
    ) -> Result<bool, WireError> {
        let _writing = lock(&self.writing);
        let Some(record) = self
            .read()
            .decide(command)
            .map_err(|error| catalog_error(&error))?
        else {
            return Ok(false);
        };
        let (offset, ticket) = store
            .append_deferred(META_QUEUE, &record.encode())
            .map_err(write_error)?;
        // Always durable before it is answered, whatever the sync policy.
        store.wait_durable(ticket).map_err(write_error)?;
        self.catalog
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .apply(&record, offset)
            .map_err(|error| catalog_error(&error))?;
        enforce();
        Ok(true)
    }

    /// Creates `topic` with `partitions` partitions; `Ok(true)` if it existed already with
    /// that count. Blocks on the store.
    pub fn create(&self, store: &Store, topic: &str, partitions: u32) -> Result<bool, WireError> {
        let command = CatalogCommand::CreateTopic {
            topic: topic.to_owned(),
            partitions,
        };
        self.change(store, &command, || {}).map(|created| !created)
    }

    /// The topic, or a `NOT_FOUND` error that says how to create it.
    pub fn require(&self, topic: &str) -> Result<Arc<Topic>, WireError> {
        self.read()
            .require_topic(topic)
            .cloned()
            .map_err(|error| catalog_error(&error))
    }

    /// Every topic, by name.
    pub fn list(&self) -> Vec<Arc<Topic>> {
        self.read().topics().cloned().collect()
    }

    /// Sets `group`'s rate (0 clears it), durably, then calls `enforce` before another
    /// metadata write can start. Blocks on the store.
    pub fn set_rate(
        &self,
        store: &Store,
        group: &str,
        messages_per_s: f64,
        enforce: impl FnOnce(),
    ) -> Result<(), WireError> {
        let command = CatalogCommand::SetGroupRate {
            group: group.to_owned(),
            messages_per_s,
        };
        self.change(store, &command, enforce).map(drop)
    }

    /// Sets the append rate limit of `producer_name` (0 clears it), durably, then calls
    /// `enforce` before another metadata write can start. Blocks on the store.
    pub fn set_producer_rate(
        &self,
        store: &Store,
        producer_name: &str,
        messages_per_s: f64,
        enforce: impl FnOnce(),
    ) -> Result<(), WireError> {
        let command = CatalogCommand::SetProducerRate {
            producer_name: producer_name.to_owned(),
            messages_per_s,
        };
        self.change(store, &command, enforce).map(drop)
    }

    /// Every producer name with a rate limit, and the limit.
    pub fn producer_rates(&self) -> BTreeMap<String, f64> {
        self.read().producer_rates().clone()
    }

    /// Sets the retention of queues starting with `prefix` (both bounds 0: removes the rule),
    /// durably. Blocks on the store.
    pub fn set_retention(
        &self,
        store: &Store,
        prefix: &[u8],
        rule: RetentionRule,
    ) -> Result<(), WireError> {
        let command = CatalogCommand::SetRetention {
            prefix: prefix.to_vec(),
            rule,
        };
        self.change(store, &command, || {}).map(drop)
    }

    /// The rule of the longest prefix of `queue` (the default when none matches).
    pub fn retention_for(&self, queue: &[u8]) -> RetentionRule {
        self.read().retention().rule_for(queue)
    }

    /// `group`'s rate in messages per second, 0 for none.
    pub fn rate(&self, group: &str) -> f64 {
        self.read().group_rate(group)
    }
}

#[cfg(test)]
mod tests {
    use levee_proto::v1::ErrorCode;

    use super::*;

    #[test]
    fn given_topics_and_rates_when_reopened_then_replayed() {
        let directory = tempfile::tempdir().unwrap();
        let (store, _) =
            Store::open(directory.path(), levee_store::StoreOptions::default()).unwrap();
        let topics = Topics::load(&store).unwrap();
        assert!(!topics.create(&store, "orders", 8).unwrap());
        assert!(topics.create(&store, "orders", 8).unwrap(), "same count");
        let error = topics.create(&store, "orders", 4).unwrap_err();
        assert_eq!(error.code, ErrorCode::AlreadyExists);
        assert_eq!(
            topics.create(&store, "bad name", 1).unwrap_err().code,
            ErrorCode::InvalidArgument
        );
        assert_eq!(
            topics.create(&store, "big", 5_000).unwrap_err().code,
            ErrorCode::InvalidArgument
        );
        topics
            .set_rate(&store, "billing", 350_000.0 / 60.0, || {})
            .unwrap();
        let applied = std::cell::Cell::new(0);
        let apply = || applied.set(applied.get() + 1);
        topics
            .set_producer_rate(&store, "checkout", 500.0, apply)
            .unwrap();
        topics
            .set_producer_rate(&store, "cleared", 20.0, apply)
            .unwrap();
        topics
            .set_producer_rate(&store, "cleared", 0.0, apply)
            .unwrap();
        for (name, rate) in [("", 1.0), ("checkout", f64::NAN), ("checkout", 1e-20)] {
            let refused = topics.set_producer_rate(&store, name, rate, apply);
            assert_eq!(refused.unwrap_err().code, ErrorCode::InvalidArgument);
        }
        assert_eq!(applied.get(), 3, "applied only when written");
        store.close().unwrap();

        let (store, _) =
            Store::open(directory.path(), levee_store::StoreOptions::default()).unwrap();
        let topics = Topics::load(&store).unwrap();
        let orders = topics.require("orders").unwrap();
        assert_eq!(orders.partitions(), 8);
        assert_eq!(orders.queues[3], b"\0topic\0orders\x003".to_vec());
        assert!((topics.rate("billing") - 350_000.0 / 60.0).abs() < 1e-9);
        let producer_rates: Vec<(String, f64)> = topics.producer_rates().into_iter().collect();
        assert_eq!(producer_rates, vec![("checkout".to_owned(), 500.0)]);
        assert_eq!(
            topics.require("none").unwrap_err().code,
            ErrorCode::NotFound
        );
    }
}
