//! Names: the one home of every name rule and every reserved queue name. A queue whose name
//! starts with a zero byte belongs to the server; users never see, read, write or delete one.
//! This module owns:
//!
//! - the bounds of every kind of name (queue, topic, group, producer name, consumer), tied to
//!   the store's queue-name bound by `const` assertions so that every reserved name built from
//!   them fits;
//! - the reserved prefixes and the functions that build each reserved name;
//! - one check per kind of name, returning a [`NameError`] whose message names the problem
//!   and the fix.

pub use levee_store::format::QUEUE_NAME_BYTES_MAX;

/// The first byte of every reserved (server-owned) queue name.
pub const RESERVED_PREFIX: u8 = 0;
/// The metadata catalog's queue: one record per change (see [`crate::catalog`]).
pub const META_QUEUE: &[u8] = b"\0meta";
/// Prefix of every topic partition's queue: `\0topic\0{topic}\0{partition}`.
pub const PARTITION_PREFIX: &[u8] = b"\0topic\0";
/// Prefix of every group's commit queue: `\0commit\0{group}\0{topic}`.
pub const COMMIT_PREFIX: &[u8] = b"\0commit\0";
/// Prefix of every consumer position queue: `\0position\0{consumer}\0{hash of the queue}`.
pub const POSITION_PREFIX: &[u8] = b"\0position\0";
/// Prefix of every position log generation: `\0poslog\0{generation as 16 hex}{consumer}`.
pub const POSITION_LOG_PREFIX: &[u8] = b"\0poslog\0";
/// Prefix of every idempotent producer's queue of runs: `\0producer\0{producer id}`.
pub const PRODUCER_PREFIX: &[u8] = b"\0producer\0";
/// Prefix of every shard's delete counter of a replicated cluster: `\0sdel\0{shard as 4
/// big-endian bytes}`, one empty message per queue deleted through the shard, so its next
/// offset is the shard's delete epoch (the same on every replica).
pub const SHARD_DELETES_PREFIX: &[u8] = b"\0sdel\0";
/// Prefix of every group's queue of retries ready for delivery, one per partition:
/// `\0r\0{group}\0{topic}\0{partition}` (short, so that it fits with the longest names).
pub const RETRY_PREFIX: &[u8] = b"\0r\0";
/// Prefix of every group's dead-letter queue: `\0dlq\0{group}\0{topic}`.
pub const DEAD_LETTER_PREFIX: &[u8] = b"\0dlq\0";
/// Prefix of every group's queue of redriven dead letters' offsets: `\0dlx\0{group}\0{topic}`.
pub const REDRIVEN_PREFIX: &[u8] = b"\0dlx\0";
/// Prefix of every delay slot's queue: `\0delay\0` then `f` (a fine slot) or `c` (a coarse
/// one) and the slot number in 16 hex digits (see [`crate::delay`]).
pub const DELAY_PREFIX: &[u8] = b"\0delay\0";
/// The reserved queues whose only newest records matter (positions, commits, producers'
/// runs): retention trims them to a small size instead of applying users' rules.
pub const LOG_QUEUE_PREFIXES: [&[u8]; 3] = [POSITION_PREFIX, COMMIT_PREFIX, PRODUCER_PREFIX];

/// Most bytes of a topic name.
pub const TOPIC_BYTES_MAX: usize = 200;
/// Most partitions of one topic.
pub const PARTITIONS_MAX: u32 = 1_024;
/// Most bytes of a consumer group's name.
pub const GROUP_BYTES_MAX: usize = 64;
/// Most bytes of a producer name (rate limits).
pub const PRODUCER_NAME_BYTES_MAX: usize = 64;
/// Most bytes of an idempotent producer's id.
pub const PRODUCER_ID_BYTES_MAX: usize = 64;
/// Most bytes of a consumer's name (subscriptions and mailboxes).
pub const CONSUMER_BYTES_MAX: usize = 64;
/// Most bytes of a consumer group member's id.
pub const MEMBER_BYTES_MAX: usize = 64;
/// Most bytes of a queue-name prefix (retention rules, listings).
pub const NAME_PREFIX_BYTES_MAX: usize = QUEUE_NAME_BYTES_MAX;
/// Most bytes of a group's and its topic's names together: the commit queue's name holds
/// both and must fit in [`QUEUE_NAME_BYTES_MAX`].
pub const GROUP_AND_TOPIC_BYTES_MAX: usize = QUEUE_NAME_BYTES_MAX - COMMIT_PREFIX.len() - 1;

/// Decimal digits of the highest partition number.
const PARTITION_DIGITS_MAX: usize = (PARTITIONS_MAX - 1).ilog10() as usize + 1;
const _: () = assert!(
    PARTITION_PREFIX.len() + TOPIC_BYTES_MAX + 1 + PARTITION_DIGITS_MAX <= QUEUE_NAME_BYTES_MAX,
    "every partition queue's name fits the store's bound"
);
const _: () = assert!(
    POSITION_PREFIX.len() + CONSUMER_BYTES_MAX + 1 + 16 <= QUEUE_NAME_BYTES_MAX,
    "every position queue's name fits the store's bound"
);
const _: () = assert!(
    POSITION_LOG_PREFIX.len() + 16 + CONSUMER_BYTES_MAX <= QUEUE_NAME_BYTES_MAX,
    "every position log generation's name fits the store's bound"
);
const _: () = assert!(
    PRODUCER_PREFIX.len() + PRODUCER_ID_BYTES_MAX <= QUEUE_NAME_BYTES_MAX,
    "every producer queue's name fits the store's bound"
);
const _: () = assert!(
    RETRY_PREFIX.len() + 1 + 1 + PARTITION_DIGITS_MAX <= COMMIT_PREFIX.len() + 1
        && DEAD_LETTER_PREFIX.len() <= COMMIT_PREFIX.len()
        && REDRIVEN_PREFIX.len() <= COMMIT_PREFIX.len(),
    "a group's retry and dead-letter queues fit wherever its commit queue fits"
);
const _: () = assert!(
    GROUP_BYTES_MAX <= GROUP_AND_TOPIC_BYTES_MAX && TOPIC_BYTES_MAX <= GROUP_AND_TOPIC_BYTES_MAX,
    "a group and a topic each fit the commit queue alone"
);

/// A name that breaks its rule; the message names the rule and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum NameError {
    /// A queue name of no bytes or too many.
    #[error("queue name must be 1 to {QUEUE_NAME_BYTES_MAX} bytes, got {length}")]
    QueueLength {
        /// Its length.
        length: usize,
    },
    /// A queue name starting with the reserved zero byte.
    #[error("queue names starting with a zero byte are reserved for the server")]
    QueueReserved,
    /// A topic name outside its alphabet or length.
    #[error(
        "topic '{topic}': a name is 1 to {TOPIC_BYTES_MAX} ASCII letters, digits, '.', '_' or '-'"
    )]
    Topic {
        /// The name given.
        topic: String,
    },
    /// A group name of no bytes or too many.
    #[error("group must be 1 to {GROUP_BYTES_MAX} bytes, got {length}")]
    Group {
        /// Its length.
        length: usize,
    },
    /// A group and topic whose names together are too long for the commit queue.
    #[error(
        "group '{group}' on topic '{topic}': the two names together must be at most \
         {GROUP_AND_TOPIC_BYTES_MAX} bytes, got {length}; use a shorter group name"
    )]
    GroupOnTopic {
        /// The group.
        group: String,
        /// The topic.
        topic: String,
        /// Their lengths added.
        length: usize,
    },
    /// A producer name of no bytes or too many.
    #[error("producer_name must be 1 to {PRODUCER_NAME_BYTES_MAX} bytes, got {length}")]
    ProducerName {
        /// Its length.
        length: usize,
    },
    /// A consumer name of no bytes or too many.
    #[error("consumer must be 1 to {CONSUMER_BYTES_MAX} bytes, got {length}")]
    Consumer {
        /// Its length.
        length: usize,
    },
    /// A group member id of no bytes or too many.
    #[error("member must be 1 to {MEMBER_BYTES_MAX} bytes, got {length}")]
    Member {
        /// Its length.
        length: usize,
    },
    /// A queue-name prefix too long or reserved.
    #[error(
        "prefix must be 0 to {NAME_PREFIX_BYTES_MAX} bytes and not start with a zero byte \
         (the server's own queues), got {length} bytes"
    )]
    Prefix {
        /// Its length.
        length: usize,
    },
}

/// Checks a user's queue name: 1 to [`QUEUE_NAME_BYTES_MAX`] bytes, not reserved.
pub fn check_queue_name(queue: &[u8]) -> Result<(), NameError> {
    if queue.is_empty() || queue.len() > QUEUE_NAME_BYTES_MAX {
        return Err(NameError::QueueLength {
            length: queue.len(),
        });
    }
    check_not_reserved(queue)
}

/// Checks that a queue name a user gave is not a reserved one (the length is the store's).
pub fn check_not_reserved(queue: &[u8]) -> Result<(), NameError> {
    if is_reserved(queue) {
        return Err(NameError::QueueReserved);
    }
    Ok(())
}

/// Whether `queue` is a server-owned queue.
pub fn is_reserved(queue: &[u8]) -> bool {
    queue.first() == Some(&RESERVED_PREFIX)
}

/// The name a queue is placed by in a cluster's shards (docs/CLUSTER.md, "Part 2"): the
/// topic of a topic's partition and of a group's commit, retry, dead-letter and redrive
/// queues on it (so a topic's partitions and its groups' state share one shard), else the
/// queue's own name.
pub fn routing_name(queue: &[u8]) -> &[u8] {
    // `{topic}\0{partition}`: the topic.
    let before_last_zero = |rest: &[u8]| -> Option<usize> { rest.iter().rposition(|b| *b == 0) };
    if let Some(rest) = queue.strip_prefix(PARTITION_PREFIX)
        && let Some(end) = before_last_zero(rest)
    {
        return &rest[..end];
    }
    // `{group}\0{topic}`: the topic (a topic holds no zero byte).
    for prefix in [COMMIT_PREFIX, DEAD_LETTER_PREFIX, REDRIVEN_PREFIX] {
        if let Some(rest) = queue.strip_prefix(prefix)
            && let Some(start) = before_last_zero(rest)
        {
            return &rest[start + 1..];
        }
    }
    // `{group}\0{topic}\0{partition}`: the topic.
    if let Some(rest) = queue.strip_prefix(RETRY_PREFIX)
        && let Some(end) = before_last_zero(rest)
        && let Some(start) = before_last_zero(&rest[..end])
    {
        return &rest[start + 1..end];
    }
    queue
}

/// The largest name that is reserved or sorts before every user's name: a zero byte, then
/// 0xff to the longest name. Every reserved name sorts at or before it and every user's name
/// after it, so a listing of users' queues starts after it.
pub fn reserved_names_end() -> Vec<u8> {
    let mut name = vec![u8::MAX; QUEUE_NAME_BYTES_MAX];
    name[0] = RESERVED_PREFIX;
    name
}

/// Checks a topic name: 1 to [`TOPIC_BYTES_MAX`] bytes of ASCII letters, digits, `.`, `_`, `-`.
pub fn check_topic_name(topic: &str) -> Result<(), NameError> {
    let valid_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if topic.is_empty() || topic.len() > TOPIC_BYTES_MAX || !topic.chars().all(valid_char) {
        return Err(NameError::Topic {
            topic: topic.to_owned(),
        });
    }
    Ok(())
}

/// Checks a group name: 1 to [`GROUP_BYTES_MAX`] bytes.
pub fn check_group_name(group: &str) -> Result<(), NameError> {
    if group.is_empty() || group.len() > GROUP_BYTES_MAX {
        return Err(NameError::Group {
            length: group.len(),
        });
    }
    Ok(())
}

/// Checks a group on a topic: each name valid, and both together short enough for the
/// group's commit queue.
pub fn check_group_on_topic(group: &str, topic: &str) -> Result<(), NameError> {
    check_group_name(group)?;
    check_topic_name(topic)?;
    let length = group.len() + topic.len();
    if length > GROUP_AND_TOPIC_BYTES_MAX {
        return Err(NameError::GroupOnTopic {
            group: group.to_owned(),
            topic: topic.to_owned(),
            length,
        });
    }
    Ok(())
}

/// Checks a producer name: 1 to [`PRODUCER_NAME_BYTES_MAX`] bytes.
pub fn check_producer_name(producer_name: &str) -> Result<(), NameError> {
    if producer_name.is_empty() || producer_name.len() > PRODUCER_NAME_BYTES_MAX {
        return Err(NameError::ProducerName {
            length: producer_name.len(),
        });
    }
    Ok(())
}

/// Checks a consumer name: 1 to [`CONSUMER_BYTES_MAX`] bytes.
pub fn check_consumer_name(consumer: &str) -> Result<(), NameError> {
    if consumer.is_empty() || consumer.len() > CONSUMER_BYTES_MAX {
        return Err(NameError::Consumer {
            length: consumer.len(),
        });
    }
    Ok(())
}

/// Checks a group member's id: 1 to [`MEMBER_BYTES_MAX`] bytes.
pub fn check_member_name(member: &str) -> Result<(), NameError> {
    if member.is_empty() || member.len() > MEMBER_BYTES_MAX {
        return Err(NameError::Member {
            length: member.len(),
        });
    }
    Ok(())
}

/// Checks a queue-name prefix (a retention rule's, a listing's): at most
/// [`NAME_PREFIX_BYTES_MAX`] bytes, not reserved (the empty prefix matches every user queue).
pub fn check_name_prefix(prefix: &[u8]) -> Result<(), NameError> {
    if prefix.len() > NAME_PREFIX_BYTES_MAX || is_reserved(prefix) {
        return Err(NameError::Prefix {
            length: prefix.len(),
        });
    }
    Ok(())
}

/// The queue name of `topic`'s partition `partition`.
pub fn partition_queue(topic: &str, partition: u32) -> Vec<u8> {
    let mut name = PARTITION_PREFIX.to_vec();
    name.extend_from_slice(topic.as_bytes());
    name.push(0);
    name.extend_from_slice(partition.to_string().as_bytes());
    name
}

/// The commit queue of `group` on `topic` (checked by [`check_group_on_topic`] to fit).
pub fn commit_queue(group: &str, topic: &str) -> Vec<u8> {
    group_topic_queue(COMMIT_PREFIX, group, topic)
}

/// `prefix`, the group, a zero byte, the topic.
fn group_topic_queue(prefix: &[u8], group: &str, topic: &str) -> Vec<u8> {
    let mut name = prefix.to_vec();
    name.extend_from_slice(group.as_bytes());
    name.push(0);
    name.extend_from_slice(topic.as_bytes());
    name
}

/// The queue of `group`'s retries of `topic`'s partition `partition` that are due (checked by
/// [`check_group_on_topic`] to fit).
pub fn retry_queue(group: &str, topic: &str, partition: u32) -> Vec<u8> {
    let mut name = group_topic_queue(RETRY_PREFIX, group, topic);
    name.push(0);
    name.extend_from_slice(partition.to_string().as_bytes());
    name
}

/// The dead-letter queue of `group` on `topic`.
pub fn dead_letter_queue(group: &str, topic: &str) -> Vec<u8> {
    group_topic_queue(DEAD_LETTER_PREFIX, group, topic)
}

/// The queue of the offsets of `group`'s redriven dead letters of `topic`.
pub fn redriven_queue(group: &str, topic: &str) -> Vec<u8> {
    group_topic_queue(REDRIVEN_PREFIX, group, topic)
}

/// The queue of an idempotent producer's runs.
pub fn producer_queue(producer: &str) -> Vec<u8> {
    let mut name = PRODUCER_PREFIX.to_vec();
    name.extend_from_slice(producer.as_bytes());
    name
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_a_partition_or_a_plain_queue_then_its_routing_name_is_the_topic_or_the_queue() {
        assert_eq!(
            routing_name(&partition_queue("orders.eu", 17)),
            b"orders.eu"
        );
        assert_eq!(routing_name(&partition_queue("t", 0)), b"t");
        assert_eq!(routing_name(b"user-42"), b"user-42");
        assert_eq!(
            routing_name(b"\0topic\0no-partition"),
            b"\0topic\0no-partition"
        );
        // A group's queues on a topic go with the topic.
        for queue in [
            commit_queue("billing", "orders.eu"),
            retry_queue("billing", "orders.eu", 7),
            dead_letter_queue("billing", "orders.eu"),
            redriven_queue("billing", "orders.eu"),
        ] {
            assert_eq!(routing_name(&queue), b"orders.eu");
        }
        assert_eq!(routing_name(b"\0r\0no-topic"), b"\0r\0no-topic");
    }

    #[test]
    fn given_longest_names_then_every_reserved_name_fits_the_store() {
        let topic = "t".repeat(TOPIC_BYTES_MAX);
        assert!(partition_queue(&topic, PARTITIONS_MAX - 1).len() <= QUEUE_NAME_BYTES_MAX);
        let group = "g".repeat(GROUP_BYTES_MAX);
        let topic = "t".repeat(GROUP_AND_TOPIC_BYTES_MAX - GROUP_BYTES_MAX);
        check_group_on_topic(&group, &topic).unwrap();
        assert_eq!(commit_queue(&group, &topic).len(), QUEUE_NAME_BYTES_MAX);
        assert!(retry_queue(&group, &topic, PARTITIONS_MAX - 1).len() <= QUEUE_NAME_BYTES_MAX);
        assert!(dead_letter_queue(&group, &topic).len() <= QUEUE_NAME_BYTES_MAX);
        assert!(redriven_queue(&group, &topic).len() <= QUEUE_NAME_BYTES_MAX);
        assert!(producer_queue(&"p".repeat(PRODUCER_ID_BYTES_MAX)).len() <= QUEUE_NAME_BYTES_MAX);
    }

    #[test]
    fn given_a_long_group_on_a_long_topic_then_refused_with_the_bound() {
        let group = "g".repeat(GROUP_BYTES_MAX);
        let topic = "t".repeat(TOPIC_BYTES_MAX);
        let error = check_group_on_topic(&group, &topic).unwrap_err();
        assert!(
            error.to_string().contains("at most 246 bytes, got 264"),
            "{error}"
        );
    }

    #[test]
    fn given_names_then_each_check_accepts_its_rule_and_refuses_the_rest() {
        assert!(check_queue_name(b"orders").is_ok());
        assert_eq!(
            check_queue_name(b""),
            Err(NameError::QueueLength { length: 0 })
        );
        assert_eq!(check_queue_name(b"\0meta"), Err(NameError::QueueReserved));
        assert!(check_queue_name(&[b'q'; QUEUE_NAME_BYTES_MAX]).is_ok());
        assert!(check_queue_name(&[b'q'; QUEUE_NAME_BYTES_MAX + 1]).is_err());
        assert!(check_topic_name("pay.ments_v-1").is_ok());
        for bad in ["", "bad name", "ü"] {
            assert!(check_topic_name(bad).is_err(), "{bad}");
        }
        assert!(check_group_name("").is_err());
        assert!(check_producer_name(&"p".repeat(PRODUCER_NAME_BYTES_MAX + 1)).is_err());
        assert!(check_consumer_name("c").is_ok());
        assert!(check_name_prefix(b"").is_ok());
        assert!(check_name_prefix(b"\0position").is_err());
        assert_eq!(
            partition_queue("orders", 3),
            b"\0topic\0orders\x003".to_vec()
        );
    }
}
