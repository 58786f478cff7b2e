//! Topics: named sets of partitions, each a queue of the store named
//! `\0topic\0{topic}\0{partition}`. Topic definitions, group and producer rate limits and queue
//! retention rules are kept as JSON records in the server's metadata queue (`\0meta`), written through the
//! store's log and replayed on start, so they survive restarts.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

use levee_proto::WireError;
use levee_proto::v1::ErrorCode;
use levee_store::Store;
use serde::{Deserialize, Serialize};

use super::rate::RATE_MIN_PER_S;
use super::{lock, write_error};

/// Most partitions of one topic.
pub const PARTITIONS_MAX: u32 = 1_024;
/// Most bytes of a topic name.
pub const TOPIC_BYTES_MAX: usize = 200;
/// Most topics on one server.
pub const TOPICS_MAX: usize = 10_000;
/// Most bytes of a group name.
pub const GROUP_BYTES_MAX: usize = 64;
/// Most bytes of a producer name.
pub const PRODUCER_NAME_BYTES_MAX: usize = 64;
/// Most producer names with a rate limit at once.
pub const PRODUCER_RATES_MAX: usize = 10_000;
/// The metadata queue.
const META_QUEUE: &[u8] = b"\0meta";
/// Prefix of every partition queue.
pub const PARTITION_PREFIX: &[u8] = b"\0topic\0";

/// One topic.
#[derive(Debug)]
pub struct Topic {
    /// Its name.
    pub name: String,
    /// Its partitions' queue names, by partition number.
    pub queues: Vec<Vec<u8>>,
}

impl Topic {
    pub(crate) fn new(name: &str, partitions: u32) -> Self {
        Self {
            name: name.to_owned(),
            queues: (0..partitions)
                .map(|partition| partition_queue(name, partition))
                .collect(),
        }
    }

    /// Its partition count.
    pub fn partitions(&self) -> u32 {
        u32::try_from(self.queues.len()).unwrap_or(u32::MAX)
    }
}

/// The queue name of `topic`'s partition `partition`.
pub fn partition_queue(topic: &str, partition: u32) -> Vec<u8> {
    let mut name = PARTITION_PREFIX.to_vec();
    name.extend_from_slice(topic.as_bytes());
    name.push(0);
    name.extend_from_slice(partition.to_string().as_bytes());
    name
}

/// One record of the metadata queue.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum MetaRecord {
    Topic {
        topic: String,
        partitions: u32,
    },
    GroupRate {
        group: String,
        messages_per_s: f64,
    },
    ProducerRate {
        producer_name: String,
        messages_per_s: f64,
    },
    Retention {
        prefix_hex: String,
        max_age_ms: u64,
        max_bytes: u64,
    },
}

/// Most retention rules.
pub const RETENTION_RULES_MAX: usize = 10_000;

/// A retention rule's bounds (0: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RetentionRule {
    /// Remove messages older than this.
    pub max_age_ms: u64,
    /// Remove the oldest messages while the queue holds more than this.
    pub max_bytes: u64,
}

impl RetentionRule {
    /// As the store's retention.
    pub fn to_store(self) -> levee_store::Retention {
        levee_store::Retention {
            max_age_ms: (self.max_age_ms > 0).then_some(self.max_age_ms),
            max_bytes: (self.max_bytes > 0).then_some(self.max_bytes),
        }
    }
}

fn to_hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes.iter().fold(String::new(), |mut text, byte| {
        let _ = write!(text, "{byte:02x}");
        text
    })
}

fn from_hex(text: &str) -> Option<Vec<u8>> {
    (0..text.len())
        .step_by(2)
        .map(|at| u8::from_str_radix(text.get(at..at + 2)?, 16).ok())
        .collect()
}

/// Every topic and group rate, and the store they live in.
#[derive(Debug)]
pub struct Topics {
    by_name: RwLock<BTreeMap<String, Arc<Topic>>>,
    rates: Mutex<BTreeMap<String, f64>>,
    /// Producer names with a limit (none at 0).
    producer_rates: Mutex<BTreeMap<String, f64>>,
    retention: RwLock<BTreeMap<Vec<u8>, RetentionRule>>,
    /// Serialises metadata writes so the last record of a name is the newest.
    writing: Mutex<()>,
}

fn invalid(message: String) -> WireError {
    WireError::new(ErrorCode::InvalidArgument, message)
}

/// Checks a topic name: 1 to [`TOPIC_BYTES_MAX`] bytes of letters, digits, `.`, `_`, `-`.
pub fn check_topic_name(topic: &str) -> Result<(), WireError> {
    let valid_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if topic.is_empty() || topic.len() > TOPIC_BYTES_MAX || !topic.chars().all(valid_char) {
        return Err(invalid(format!(
            "topic '{topic}': a name is 1 to {TOPIC_BYTES_MAX} ASCII letters, digits, '.', '_' \
             or '-'"
        )));
    }
    Ok(())
}

/// Checks a rate limit: 0 (none), or at least [`RATE_MIN_PER_S`] messages per second.
fn check_rate(messages_per_s: f64) -> Result<(), WireError> {
    if !messages_per_s.is_finite()
        || messages_per_s < 0.0
        || (messages_per_s > 0.0 && messages_per_s < RATE_MIN_PER_S)
    {
        return Err(invalid(format!(
            "messages_per_s must be 0 (no limit) or at least one message an hour \
             ({RATE_MIN_PER_S:.6}), got {messages_per_s}"
        )));
    }
    Ok(())
}

/// Checks a producer name: 1 to [`PRODUCER_NAME_BYTES_MAX`] bytes.
pub fn check_producer_name(producer_name: &str) -> Result<(), WireError> {
    if producer_name.is_empty() || producer_name.len() > PRODUCER_NAME_BYTES_MAX {
        return Err(invalid(format!(
            "producer_name must be 1 to {PRODUCER_NAME_BYTES_MAX} bytes, got {}",
            producer_name.len()
        )));
    }
    Ok(())
}

/// Checks a group name: 1 to [`GROUP_BYTES_MAX`] bytes.
pub fn check_group_name(group: &str) -> Result<(), WireError> {
    if group.is_empty() || group.len() > GROUP_BYTES_MAX {
        return Err(invalid(format!(
            "group must be 1 to {GROUP_BYTES_MAX} bytes, got {}",
            group.len()
        )));
    }
    Ok(())
}

impl Topics {
    /// Replays the metadata queue. Blocks on the store.
    pub fn load(store: &Store) -> Result<Self, String> {
        let mut topics = BTreeMap::new();
        let mut rates = BTreeMap::new();
        let mut producer_rates = BTreeMap::new();
        let mut retention = BTreeMap::new();
        let info = store
            .queue_info(META_QUEUE)
            .map_err(|error| error.to_string())?;
        if let Some(info) = info {
            let mut offset = info.first_offset;
            while offset < info.next_offset {
                let batch = store
                    .read(META_QUEUE, offset, 1_000, 1 << 20)
                    .map_err(|error| error.to_string())?;
                if batch.is_empty() {
                    break;
                }
                for (record, at) in batch.iter().zip(offset..) {
                    match serde_json::from_slice::<MetaRecord>(record) {
                        Ok(MetaRecord::Topic { topic, partitions }) => {
                            let loaded = Arc::new(Topic::new(&topic, partitions));
                            topics.insert(topic, loaded);
                        }
                        Ok(MetaRecord::GroupRate {
                            group,
                            messages_per_s,
                        }) => {
                            rates.insert(group, messages_per_s);
                        }
                        Ok(MetaRecord::ProducerRate {
                            producer_name,
                            messages_per_s,
                        }) => {
                            if messages_per_s > 0.0 {
                                producer_rates.insert(producer_name, messages_per_s);
                            } else {
                                producer_rates.remove(&producer_name);
                            }
                        }
                        Ok(MetaRecord::Retention {
                            prefix_hex,
                            max_age_ms,
                            max_bytes,
                        }) => {
                            let prefix = from_hex(&prefix_hex).ok_or_else(|| {
                                format!("metadata record {at}: prefix_hex is not hex")
                            })?;
                            if max_age_ms == 0 && max_bytes == 0 {
                                retention.remove(&prefix);
                            } else {
                                let rule = RetentionRule {
                                    max_age_ms,
                                    max_bytes,
                                };
                                retention.insert(prefix, rule);
                            }
                        }
                        Err(error) => {
                            return Err(format!("metadata record {at} is not readable: {error}"));
                        }
                    }
                }
                offset = batch.next_offset();
            }
        }
        Ok(Self {
            by_name: RwLock::new(topics),
            rates: Mutex::new(rates),
            producer_rates: Mutex::new(producer_rates),
            retention: RwLock::new(retention),
            writing: Mutex::new(()),
        })
    }

    fn write(store: &Store, record: &MetaRecord) -> Result<(), WireError> {
        let bytes = serde_json::to_vec(record)
            .map_err(|error| WireError::new(ErrorCode::Internal, error.to_string()))?;
        let (_, ticket) = store
            .append_deferred(META_QUEUE, &bytes)
            .map_err(write_error)?;
        // Always durable before it is answered, whatever the sync policy.
        store.wait_durable(ticket).map_err(write_error)
    }

    /// Creates `topic` with `partitions` partitions; `Ok(true)` if it existed already with
    /// that count. Blocks on the store.
    pub fn create(&self, store: &Store, topic: &str, partitions: u32) -> Result<bool, WireError> {
        check_topic_name(topic)?;
        if !(1..=PARTITIONS_MAX).contains(&partitions) {
            return Err(invalid(format!(
                "partitions must be 1 to {PARTITIONS_MAX}, got {partitions}"
            )));
        }
        let _writing = lock(&self.writing);
        if let Some(existing) = self.get(topic) {
            if existing.partitions() == partitions {
                return Ok(true);
            }
            return Err(WireError::new(
                ErrorCode::AlreadyExists,
                format!(
                    "topic '{topic}' exists with {} partitions; partitions cannot change (keys \
                     would move): create a topic with another name",
                    existing.partitions()
                ),
            ));
        }
        if self.len() >= TOPICS_MAX {
            return Err(WireError::new(
                ErrorCode::ResourceExhausted,
                format!("{TOPICS_MAX} topics exist on this server, the most it holds"),
            ));
        }
        Self::write(
            store,
            &MetaRecord::Topic {
                topic: topic.to_owned(),
                partitions,
            },
        )?;
        let created = Arc::new(Topic::new(topic, partitions));
        self.by_name
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(topic.to_owned(), created);
        Ok(false)
    }

    /// The topic, if it exists.
    pub fn get(&self, topic: &str) -> Option<Arc<Topic>> {
        self.by_name
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(topic)
            .cloned()
    }

    /// The topic, or a `NOT_FOUND` error that says how to create it.
    pub fn require(&self, topic: &str) -> Result<Arc<Topic>, WireError> {
        self.get(topic).ok_or_else(|| {
            WireError::new(
                ErrorCode::NotFound,
                format!(
                    "topic '{topic}' does not exist; create it first (levee topic create --topic \
                     {topic} --partitions N)"
                ),
            )
        })
    }

    /// Every topic, by name.
    pub fn list(&self) -> Vec<Arc<Topic>> {
        self.by_name
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    fn len(&self) -> usize {
        self.by_name
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// Sets `group`'s rate (0 clears it), durably, then calls `apply` (which enforces it)
    /// before another metadata write can start. Blocks on the store.
    pub fn set_rate(
        &self,
        store: &Store,
        group: &str,
        messages_per_s: f64,
        apply: impl FnOnce(),
    ) -> Result<(), WireError> {
        check_group_name(group)?;
        check_rate(messages_per_s)?;
        let _writing = lock(&self.writing);
        Self::write(
            store,
            &MetaRecord::GroupRate {
                group: group.to_owned(),
                messages_per_s,
            },
        )?;
        lock(&self.rates).insert(group.to_owned(), messages_per_s);
        apply();
        Ok(())
    }

    /// Sets the append rate limit of `producer_name` (0 clears it), durably, then calls
    /// `apply` (which enforces it) before another metadata write can start, so concurrent
    /// changes apply in the order they were logged. Blocks on the store.
    pub fn set_producer_rate(
        &self,
        store: &Store,
        producer_name: &str,
        messages_per_s: f64,
        apply: impl FnOnce(),
    ) -> Result<(), WireError> {
        check_producer_name(producer_name)?;
        check_rate(messages_per_s)?;
        let _writing = lock(&self.writing);
        {
            let rates = lock(&self.producer_rates);
            if messages_per_s > 0.0
                && !rates.contains_key(producer_name)
                && rates.len() >= PRODUCER_RATES_MAX
            {
                return Err(WireError::new(
                    ErrorCode::ResourceExhausted,
                    format!(
                        "at most {PRODUCER_RATES_MAX} producer names may have a rate limit; \
                         clear one (rate 0) before limiting '{producer_name}'"
                    ),
                ));
            }
        }
        Self::write(
            store,
            &MetaRecord::ProducerRate {
                producer_name: producer_name.to_owned(),
                messages_per_s,
            },
        )?;
        let mut rates = lock(&self.producer_rates);
        if messages_per_s > 0.0 {
            rates.insert(producer_name.to_owned(), messages_per_s);
        } else {
            rates.remove(producer_name);
        }
        drop(rates);
        apply();
        Ok(())
    }

    /// Every producer name with a rate limit, and the limit.
    pub fn producer_rates(&self) -> BTreeMap<String, f64> {
        lock(&self.producer_rates).clone()
    }

    /// Sets the retention of queues starting with `prefix` (both bounds 0: removes the rule),
    /// durably. Blocks on the store.
    pub fn set_retention(
        &self,
        store: &Store,
        prefix: &[u8],
        rule: RetentionRule,
    ) -> Result<(), WireError> {
        if prefix.len() > 255 || prefix.first() == Some(&0) {
            return Err(invalid(format!(
                "prefix must be 0 to 255 bytes and not start with a zero byte (the server's own \
                 queues), got {} bytes",
                prefix.len()
            )));
        }
        let _writing = lock(&self.writing);
        let mut rules = self
            .retention
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let removing = rule == RetentionRule::default();
        if !removing && !rules.contains_key(prefix) && rules.len() >= RETENTION_RULES_MAX {
            return Err(WireError::new(
                ErrorCode::ResourceExhausted,
                format!("{RETENTION_RULES_MAX} retention rules exist, the most the server holds"),
            ));
        }
        Self::write(
            store,
            &MetaRecord::Retention {
                prefix_hex: to_hex(prefix),
                max_age_ms: rule.max_age_ms,
                max_bytes: rule.max_bytes,
            },
        )?;
        if removing {
            rules.remove(prefix);
        } else {
            rules.insert(prefix.to_vec(), rule);
        }
        Ok(())
    }

    /// The rule of the longest prefix of `queue` (the default when none matches).
    pub fn retention_for(&self, queue: &[u8]) -> RetentionRule {
        let rules = self
            .retention
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Longest first: walk the candidate prefixes of the name from the whole name down.
        (0..=queue.len().min(255))
            .rev()
            .find_map(|length| rules.get(&queue[..length]).copied())
            .unwrap_or_default()
    }

    /// Whether any retention rule exists.
    pub fn has_retention(&self) -> bool {
        !self
            .retention
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_empty()
    }

    /// `group`'s rate in messages per second, 0 for none.
    pub fn rate(&self, group: &str) -> f64 {
        lock(&self.rates).get(group).copied().unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
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
