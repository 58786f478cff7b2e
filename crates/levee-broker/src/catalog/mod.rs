//! The metadata catalog: everything an operator sets that is not queue data. It owns
//!
//! - topics and their partition counts ([`Topic`]),
//! - consumer groups' delivery rates and producer names' append rates,
//! - retention rules ([`retention`]),
//! - the logged form of each change ([`CatalogRecord`]).
//!
//! It is a state machine in two steps, as a replicated log needs: [`Catalog::decide`] checks a
//! [`CatalogCommand`] against the current state and returns the record to log (or a
//! [`CatalogError`] that names the problem and the fix, or `None` when the command changes
//! nothing); the runtime makes the record durable, then [`Catalog::apply`] applies it.
//! Replaying the log applies every record in order, so every replica that applies the same
//! records holds the same catalog. Nothing here reads a clock or does I/O.

mod record;
pub mod retention;

use std::collections::BTreeMap;
use std::sync::Arc;

pub use record::CatalogRecord;
use record::{from_hex, to_hex};
pub use retention::{RETENTION_RULES_MAX, RetentionRule, RetentionRules};

use crate::names::{
    self, NameError, PARTITIONS_MAX, check_group_name, check_name_prefix, check_producer_name,
    check_topic_name,
};
use crate::rate::RATE_MIN_PER_S;
use crate::retry::{RetryError, RetryPolicy};

/// Most topics on one server.
pub const TOPICS_MAX: usize = 10_000;
/// Most producer names with a rate limit at once.
pub const PRODUCER_RATES_MAX: usize = 10_000;
/// Most consumer groups with a rate limit at once.
pub const GROUP_RATES_MAX: usize = 10_000;
/// Most groups with a retry policy of their own.
pub const RETRY_POLICIES_MAX: usize = 10_000;

/// One topic: a fixed set of partitions, each a queue of the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topic {
    /// Its name.
    pub name: String,
    /// Its partitions' queue names, by partition number.
    pub queues: Vec<Vec<u8>>,
}

impl Topic {
    /// `name` with `partitions` partitions (checked by the caller).
    pub fn new(name: &str, partitions: u32) -> Self {
        Self {
            name: name.to_owned(),
            queues: (0..partitions)
                .map(|partition| names::partition_queue(name, partition))
                .collect(),
        }
    }

    /// Its partition count.
    pub fn partitions(&self) -> u32 {
        // At most PARTITIONS_MAX queues, built from a u32 count.
        u32::try_from(self.queues.len()).unwrap_or(u32::MAX)
    }
}

/// A change an operator asks for (also what a replicated log carries).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum CatalogCommand {
    /// Create a topic (nothing changes if it exists with that count).
    CreateTopic {
        /// Its name.
        topic: String,
        /// 1 to [`PARTITIONS_MAX`].
        partitions: u32,
    },
    /// Set a group's delivery rate, messages per second (0 clears it).
    SetGroupRate {
        /// The group.
        group: String,
        /// 0, or at least [`RATE_MIN_PER_S`].
        messages_per_s: f64,
    },
    /// Set a producer name's append rate, messages per second (0 clears it).
    SetProducerRate {
        /// The producer name.
        producer_name: String,
        /// 0, or at least [`RATE_MIN_PER_S`].
        messages_per_s: f64,
    },
    /// Set a group's retry policy (`None` restores the default).
    SetRetryPolicy {
        /// The group.
        group: String,
        /// The policy.
        policy: Option<RetryPolicy>,
    },
    /// Set the retention of queues starting with `prefix` (a rule of zeros removes it).
    SetRetention {
        /// The prefix.
        prefix: Vec<u8>,
        /// The bounds.
        rule: RetentionRule,
    },
}

/// Why a catalog command was refused, or a log could not be replayed.
#[derive(Debug, Clone, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum CatalogError {
    /// A name breaks its rule.
    #[error(transparent)]
    Name(#[from] NameError),
    /// A partition count out of range.
    #[error("partitions must be 1 to {PARTITIONS_MAX}, got {partitions}")]
    Partitions {
        /// The count given.
        partitions: u32,
    },
    /// A rate neither 0 nor at least the minimum.
    #[error(
        "messages_per_s must be 0 (no limit) or at least one message an hour \
         ({RATE_MIN_PER_S:.6}), got {messages_per_s}"
    )]
    Rate {
        /// The rate given.
        messages_per_s: f64,
    },
    /// A topic exists with another partition count.
    #[error(
        "topic '{topic}' exists with {partitions} partitions; partitions cannot change (keys \
         would move): create a topic with another name"
    )]
    PartitionsChanged {
        /// The topic.
        topic: String,
        /// Its partition count.
        partitions: u32,
    },
    /// [`TOPICS_MAX`] topics exist.
    #[error("{TOPICS_MAX} topics exist on this server, the most it holds")]
    TopicsFull,
    /// [`PRODUCER_RATES_MAX`] producer names have a limit.
    #[error(
        "at most {PRODUCER_RATES_MAX} producer names may have a rate limit; clear one (rate 0) \
         before limiting '{producer_name}'"
    )]
    ProducerRatesFull {
        /// The name that would be one more.
        producer_name: String,
    },
    /// [`GROUP_RATES_MAX`] groups have a limit.
    #[error(
        "at most {GROUP_RATES_MAX} consumer groups may have a rate limit; clear one (rate 0) \
         before limiting '{group}'"
    )]
    GroupRatesFull {
        /// The group that would be one more.
        group: String,
    },
    /// A retry policy out of its bounds.
    #[error(transparent)]
    Retry(#[from] RetryError),
    /// [`RETRY_POLICIES_MAX`] groups have a policy.
    #[error(
        "at most {RETRY_POLICIES_MAX} consumer groups may have a retry policy of their own; \
         clear one before setting '{group}'s"
    )]
    RetryPoliciesFull {
        /// The group that would be one more.
        group: String,
    },
    /// [`RETENTION_RULES_MAX`] rules exist.
    #[error("{RETENTION_RULES_MAX} retention rules exist, the most the server holds")]
    RetentionRulesFull,
    /// No such topic.
    #[error(
        "topic '{topic}' does not exist; create it first (levee topic create --topic {topic} \
         --partitions N)"
    )]
    TopicNotFound {
        /// The topic.
        topic: String,
    },
    /// A logged record that cannot be read back.
    #[error("metadata record {offset} is not readable: {reason}")]
    Unreadable {
        /// Its offset in the log.
        offset: u64,
        /// What is wrong with it.
        reason: String,
    },
}

/// The catalog's state.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Catalog {
    topics: BTreeMap<String, Arc<Topic>>,
    group_rates: BTreeMap<String, f64>,
    producer_rates: BTreeMap<String, f64>,
    retry_policies: BTreeMap<String, RetryPolicy>,
    retention: RetentionRules,
}

/// Checks a rate limit: 0 (none), or at least [`RATE_MIN_PER_S`] messages per second.
fn check_rate(messages_per_s: f64) -> Result<(), CatalogError> {
    if !messages_per_s.is_finite()
        || messages_per_s < 0.0
        || (messages_per_s > 0.0 && messages_per_s < RATE_MIN_PER_S)
    {
        return Err(CatalogError::Rate { messages_per_s });
    }
    Ok(())
}

impl Catalog {
    /// Checks `command` against the current state: the record to log, `None` if the command
    /// changes nothing (a topic created again with its count), or why it is refused.
    pub fn decide(&self, command: &CatalogCommand) -> Result<Option<CatalogRecord>, CatalogError> {
        let record = match command {
            CatalogCommand::CreateTopic { topic, partitions } => {
                check_topic_name(topic)?;
                let partitions = *partitions;
                if !(1..=PARTITIONS_MAX).contains(&partitions) {
                    return Err(CatalogError::Partitions { partitions });
                }
                if let Some(existing) = self.topics.get(topic) {
                    if existing.partitions() == partitions {
                        return Ok(None);
                    }
                    return Err(CatalogError::PartitionsChanged {
                        topic: topic.clone(),
                        partitions: existing.partitions(),
                    });
                }
                if self.topics.len() >= TOPICS_MAX {
                    return Err(CatalogError::TopicsFull);
                }
                CatalogRecord::Topic {
                    topic: topic.clone(),
                    partitions,
                }
            }
            CatalogCommand::SetGroupRate {
                group,
                messages_per_s,
            } => {
                check_group_name(group)?;
                check_rate(*messages_per_s)?;
                if *messages_per_s > 0.0
                    && !self.group_rates.contains_key(group)
                    && self.group_rates.len() >= GROUP_RATES_MAX
                {
                    return Err(CatalogError::GroupRatesFull {
                        group: group.clone(),
                    });
                }
                CatalogRecord::GroupRate {
                    group: group.clone(),
                    messages_per_s: *messages_per_s,
                }
            }
            CatalogCommand::SetProducerRate {
                producer_name,
                messages_per_s,
            } => {
                check_producer_name(producer_name)?;
                check_rate(*messages_per_s)?;
                if *messages_per_s > 0.0
                    && !self.producer_rates.contains_key(producer_name)
                    && self.producer_rates.len() >= PRODUCER_RATES_MAX
                {
                    return Err(CatalogError::ProducerRatesFull {
                        producer_name: producer_name.clone(),
                    });
                }
                CatalogRecord::ProducerRate {
                    producer_name: producer_name.clone(),
                    messages_per_s: *messages_per_s,
                }
            }
            CatalogCommand::SetRetryPolicy { group, policy } => {
                check_group_name(group)?;
                if let Some(policy) = policy {
                    policy.check()?;
                    if !self.retry_policies.contains_key(group)
                        && self.retry_policies.len() >= RETRY_POLICIES_MAX
                    {
                        return Err(CatalogError::RetryPoliciesFull {
                            group: group.clone(),
                        });
                    }
                }
                CatalogRecord::RetryPolicy {
                    group: group.clone(),
                    policy: policy.clone(),
                }
            }
            CatalogCommand::SetRetention { prefix, rule } => {
                check_name_prefix(prefix)?;
                if !rule.is_none()
                    && !self.retention.contains(prefix)
                    && self.retention.len() >= RETENTION_RULES_MAX
                {
                    return Err(CatalogError::RetentionRulesFull);
                }
                CatalogRecord::Retention {
                    prefix_hex: to_hex(prefix),
                    max_age_ms: rule.max_age_ms,
                    max_bytes: rule.max_bytes,
                }
            }
        };
        Ok(Some(record))
    }

    /// Applies a logged record (one [`Catalog::decide`] returned, or one read back from the
    /// log, logged at `offset`). A record read back is checked again as `decide` checks a
    /// command (a damaged log must not build a topic of four billion partitions): one that
    /// breaks a rule is refused as [`CatalogError::Unreadable`] and changes nothing.
    pub fn apply(&mut self, record: &CatalogRecord, offset: u64) -> Result<(), CatalogError> {
        let unreadable = |reason: String| CatalogError::Unreadable { offset, reason };
        match record {
            CatalogRecord::Topic { topic, partitions } => {
                check_topic_name(topic).map_err(|error| unreadable(error.to_string()))?;
                if !(1..=PARTITIONS_MAX).contains(partitions) {
                    return Err(unreadable(
                        CatalogError::Partitions {
                            partitions: *partitions,
                        }
                        .to_string(),
                    ));
                }
                self.topics
                    .insert(topic.clone(), Arc::new(Topic::new(topic, *partitions)));
            }
            CatalogRecord::GroupRate {
                group,
                messages_per_s,
            } => {
                check_group_name(group).map_err(|error| unreadable(error.to_string()))?;
                check_rate(*messages_per_s).map_err(|error| unreadable(error.to_string()))?;
                if *messages_per_s > 0.0 {
                    self.group_rates.insert(group.clone(), *messages_per_s);
                } else {
                    self.group_rates.remove(group);
                }
            }
            CatalogRecord::ProducerRate {
                producer_name,
                messages_per_s,
            } => {
                check_producer_name(producer_name)
                    .map_err(|error| unreadable(error.to_string()))?;
                check_rate(*messages_per_s).map_err(|error| unreadable(error.to_string()))?;
                if *messages_per_s > 0.0 {
                    self.producer_rates
                        .insert(producer_name.clone(), *messages_per_s);
                } else {
                    self.producer_rates.remove(producer_name);
                }
            }
            CatalogRecord::RetryPolicy { group, policy } => {
                check_group_name(group).map_err(|error| unreadable(error.to_string()))?;
                match policy {
                    Some(policy) => {
                        policy
                            .check()
                            .map_err(|error| unreadable(error.to_string()))?;
                        self.retry_policies.insert(group.clone(), policy.clone());
                    }
                    None => {
                        self.retry_policies.remove(group);
                    }
                }
            }
            CatalogRecord::Retention {
                prefix_hex,
                max_age_ms,
                max_bytes,
            } => {
                let prefix = from_hex(prefix_hex)
                    .ok_or_else(|| unreadable("prefix_hex is not hex".to_owned()))?;
                check_name_prefix(&prefix).map_err(|error| unreadable(error.to_string()))?;
                let rule = RetentionRule {
                    max_age_ms: *max_age_ms,
                    max_bytes: *max_bytes,
                };
                self.retention.set(prefix, rule);
            }
        }
        Ok(())
    }

    /// The topic, if it exists.
    pub fn topic(&self, topic: &str) -> Option<&Arc<Topic>> {
        self.topics.get(topic)
    }

    /// The topic, or an error that says how to create it.
    pub fn require_topic(&self, topic: &str) -> Result<&Arc<Topic>, CatalogError> {
        self.topics
            .get(topic)
            .ok_or_else(|| CatalogError::TopicNotFound {
                topic: topic.to_owned(),
            })
    }

    /// Every topic, by name.
    pub fn topics(&self) -> impl Iterator<Item = &Arc<Topic>> {
        self.topics.values()
    }

    /// `group`'s delivery rate in messages per second, 0 for none.
    pub fn group_rate(&self, group: &str) -> f64 {
        self.group_rates.get(group).copied().unwrap_or(0.0)
    }

    /// Every group with a delivery rate, and the rate.
    pub fn group_rates(&self) -> &BTreeMap<String, f64> {
        &self.group_rates
    }

    /// Every producer name with a rate limit, and the limit.
    pub fn producer_rates(&self) -> &BTreeMap<String, f64> {
        &self.producer_rates
    }

    /// `group`'s retry policy (the default unless one was set).
    pub fn retry_policy(&self, group: &str) -> RetryPolicy {
        self.retry_policies.get(group).cloned().unwrap_or_default()
    }

    /// Every group with a retry policy of its own.
    pub fn retry_policies(&self) -> &BTreeMap<String, RetryPolicy> {
        &self.retry_policies
    }

    /// The retention rules.
    pub fn retention(&self) -> &RetentionRules {
        &self.retention
    }

    /// Records that rebuild this catalog when applied in order to an empty one (a snapshot).
    pub fn records(&self) -> Vec<CatalogRecord> {
        let topics = self.topics.values().map(|topic| CatalogRecord::Topic {
            topic: topic.name.clone(),
            partitions: topic.partitions(),
        });
        let group_rates = self
            .group_rates
            .iter()
            .map(|(group, rate)| CatalogRecord::GroupRate {
                group: group.clone(),
                messages_per_s: *rate,
            });
        let producer_rates =
            self.producer_rates
                .iter()
                .map(|(producer_name, rate)| CatalogRecord::ProducerRate {
                    producer_name: producer_name.clone(),
                    messages_per_s: *rate,
                });
        let retention = self
            .retention
            .iter()
            .map(|(prefix, rule)| CatalogRecord::Retention {
                prefix_hex: to_hex(prefix),
                max_age_ms: rule.max_age_ms,
                max_bytes: rule.max_bytes,
            });
        let retry_policies =
            self.retry_policies
                .iter()
                .map(|(group, policy)| CatalogRecord::RetryPolicy {
                    group: group.clone(),
                    policy: Some(policy.clone()),
                });
        topics
            .chain(group_rates)
            .chain(producer_rates)
            .chain(retry_policies)
            .chain(retention)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create(topic: &str, partitions: u32) -> CatalogCommand {
        CatalogCommand::CreateTopic {
            topic: topic.to_owned(),
            partitions,
        }
    }

    fn run(catalog: &mut Catalog, command: &CatalogCommand) -> Result<bool, CatalogError> {
        match catalog.decide(command)? {
            Some(record) => {
                catalog.apply(&record, 0)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    #[test]
    fn given_topic_commands_then_created_once_and_never_resized() {
        let mut catalog = Catalog::default();
        assert_eq!(run(&mut catalog, &create("orders", 8)), Ok(true));
        assert_eq!(run(&mut catalog, &create("orders", 8)), Ok(false));
        assert!(matches!(
            run(&mut catalog, &create("orders", 4)),
            Err(CatalogError::PartitionsChanged { partitions: 8, .. })
        ));
        assert!(matches!(
            run(&mut catalog, &create("bad name", 1)),
            Err(CatalogError::Name(NameError::Topic { .. }))
        ));
        for partitions in [0, PARTITIONS_MAX + 1] {
            assert_eq!(
                run(&mut catalog, &create("big", partitions)),
                Err(CatalogError::Partitions { partitions })
            );
        }
        let orders = catalog.require_topic("orders").unwrap();
        assert_eq!(orders.queues[3], b"\0topic\0orders\x003".to_vec());
        assert!(matches!(
            catalog.require_topic("none"),
            Err(CatalogError::TopicNotFound { .. })
        ));
    }

    #[test]
    fn given_the_most_topics_then_one_more_is_refused() {
        let mut catalog = Catalog::default();
        for index in 0..TOPICS_MAX {
            run(&mut catalog, &create(&format!("t{index}"), 1)).unwrap();
        }
        assert_eq!(
            run(&mut catalog, &create("one-more", 1)),
            Err(CatalogError::TopicsFull)
        );
        assert_eq!(
            run(&mut catalog, &create("t0", 1)),
            Ok(false),
            "an existing one still answers"
        );
    }

    #[test]
    fn given_the_most_limits_then_only_changes_and_clears_pass() {
        let mut catalog = Catalog::default();
        for index in 0..PRODUCER_RATES_MAX {
            let command = CatalogCommand::SetProducerRate {
                producer_name: format!("p{index}"),
                messages_per_s: 1.0,
            };
            run(&mut catalog, &command).unwrap();
        }
        let limit = |name: &str, messages_per_s: f64| CatalogCommand::SetProducerRate {
            producer_name: name.to_owned(),
            messages_per_s,
        };
        assert!(matches!(
            run(&mut catalog, &limit("new", 1.0)),
            Err(CatalogError::ProducerRatesFull { .. })
        ));
        assert_eq!(run(&mut catalog, &limit("p0", 5.0)), Ok(true));
        assert_eq!(run(&mut catalog, &limit("p1", 0.0)), Ok(true));
        assert_eq!(run(&mut catalog, &limit("new", 1.0)), Ok(true));
        for rate in [f64::NAN, -1.0, 1e-20, f64::INFINITY] {
            assert!(matches!(
                run(&mut catalog, &limit("p0", rate)),
                Err(CatalogError::Rate { .. })
            ));
        }
    }

    #[test]
    fn given_records_that_break_a_rule_then_apply_refuses_them_and_changes_nothing() {
        let topic = |topic: &str, partitions| CatalogRecord::Topic {
            topic: topic.to_owned(),
            partitions,
        };
        let mut catalog = Catalog::default();
        for record in [
            topic("huge", 4_000_000_000),
            topic("none", 0),
            topic("bad name", 1),
            CatalogRecord::GroupRate {
                group: String::new(),
                messages_per_s: 1.0,
            },
            CatalogRecord::ProducerRate {
                producer_name: "p".to_owned(),
                messages_per_s: f64::NAN,
            },
        ] {
            let error = catalog.apply(&record, 3).unwrap_err();
            assert!(
                matches!(error, CatalogError::Unreadable { offset: 3, .. }),
                "{error}"
            );
        }
        assert_eq!(catalog, Catalog::default());
    }

    #[test]
    fn given_retry_policies_then_set_checked_kept_in_snapshots_and_cleared() {
        let mut catalog = Catalog::default();
        assert_eq!(catalog.retry_policy("g"), RetryPolicy::default());
        let policy = RetryPolicy {
            delays_ms: vec![5, 50],
            max_attempts: 3,
        };
        let set = CatalogCommand::SetRetryPolicy {
            group: "g".to_owned(),
            policy: Some(policy.clone()),
        };
        assert!(run(&mut catalog, &set).unwrap());
        assert_eq!(catalog.retry_policy("g"), policy);
        let mut rebuilt = Catalog::default();
        for (record, offset) in catalog.records().iter().zip(0..) {
            rebuilt.apply(record, offset).unwrap();
        }
        assert_eq!(rebuilt, catalog, "the snapshot keeps policies");
        let empty = CatalogCommand::SetRetryPolicy {
            group: "g".to_owned(),
            policy: Some(RetryPolicy {
                delays_ms: vec![],
                max_attempts: 3,
            }),
        };
        assert!(matches!(
            catalog.decide(&empty),
            Err(CatalogError::Retry(RetryError::Steps { steps: 0 }))
        ));
        let clear = CatalogCommand::SetRetryPolicy {
            group: "g".to_owned(),
            policy: None,
        };
        assert!(run(&mut catalog, &clear).unwrap());
        assert!(catalog.retry_policies().is_empty());
    }

    #[test]
    fn given_the_most_group_limits_then_a_new_one_is_refused_and_a_clear_frees_its_slot() {
        let mut catalog = Catalog::default();
        let limit = |group: &str, messages_per_s: f64| CatalogCommand::SetGroupRate {
            group: group.to_owned(),
            messages_per_s,
        };
        for index in 0..GROUP_RATES_MAX {
            run(&mut catalog, &limit(&format!("g{index}"), 1.0)).unwrap();
        }
        assert!(matches!(
            run(&mut catalog, &limit("new", 1.0)),
            Err(CatalogError::GroupRatesFull { .. })
        ));
        assert_eq!(run(&mut catalog, &limit("g0", 0.0)), Ok(true));
        assert!(catalog.group_rate("g0").abs() < f64::EPSILON);
        assert_eq!(run(&mut catalog, &limit("new", 1.0)), Ok(true));
    }

    #[test]
    fn given_a_record_with_bad_hex_then_apply_names_its_offset() {
        let record = CatalogRecord::Retention {
            prefix_hex: "xy".to_owned(),
            max_age_ms: 1,
            max_bytes: 0,
        };
        let error = Catalog::default().apply(&record, 12).unwrap_err();
        assert_eq!(
            error.to_string(),
            "metadata record 12 is not readable: prefix_hex is not hex"
        );
    }
}
