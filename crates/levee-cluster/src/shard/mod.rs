//! Shard groups (docs/CLUSTER.md, "Part 2"): every plain queue of a cluster created with
//! replicated queues belongs to one of its shards, and each shard is an openraft group of its
//! own, up to three replicas placed by `levee_proto::shards::replicas`.
//!
//! - [`ShardCommand`] / [`ShardResponse`]: what a shard's log carries (appends to its queues)
//!   and what applying an entry answered (the messages' offsets).
//! - [`machine`]: [`ShardStateMachine`], which applies the log to the node's queue store, with
//!   a crash-safe record of what it applied.
//! - [`network`]: the shards' openraft calls over the peer port, one connection per peer for
//!   every shard, bodies in postcard.
//! - [`groups`]: [`ShardGroups`], a node's Raft instance of every shard, writes from any node
//!   (proposed on the shard's leader, forwarded to it from the others), and the placement of
//!   replicas as voters come and go.

use levee_proto::Bytes;
use openraft::Entry;
use serde::{Deserialize, Serialize};

use crate::log_store::LogCodec;
use crate::{NodeInfo, StorageError};

pub mod appender;
pub mod groups;
pub mod link;
pub mod machine;
pub mod network;
pub mod plan;
pub mod snapshot;
pub mod watch;

pub use groups::{ShardGroups, ShardSlot, ShardWriteError};
pub use machine::{ShardObserver, ShardStateMachine};

openraft::declare_raft_types!(
    /// A shard group's types for openraft.
    pub ShardConfig:
        D = ShardCommand,
        R = ShardResponse,
        Node = NodeInfo,
        SnapshotData = snapshot::SnapshotFile,
);

/// A shard's Raft instance.
pub type ShardRaft = openraft::Raft<ShardConfig>;

/// A shard's number, 0 to the cluster's shards - 1.
pub type ShardId = u32;

/// One message for a queue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueMessage {
    /// The queue's name.
    #[serde(deserialize_with = "shared_bytes")]
    pub queue: Bytes,
    /// The message.
    #[serde(deserialize_with = "shared_bytes")]
    pub payload: Bytes,
    /// Its idempotent producer's sequence on the queue (0 without a producer).
    pub sequence: u64,
}

/// A consumer's position on one queue: the next offset to deliver, under the queue's delete
/// epoch (the largest position wins, so positions may be applied in any order, and twice).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerPosition {
    /// The queue's name.
    pub queue: Bytes,
    /// The queue's delete epoch the position belongs to.
    pub epoch: u64,
    /// The next offset to deliver to the consumer.
    pub next: u64,
}

/// A change to a shard's queues.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShardCommand {
    /// Appends messages to queues of the shard; those of one queue keep their order.
    Append {
        /// The idempotent producer's id, if the request named one: resent runs are answered
        /// with their original offsets and not stored again.
        producer: Option<String>,
        /// The messages, in order.
        messages: Vec<QueueMessage>,
    },
    /// A consumer's acked positions on queues of the shard (every replica records them, so a
    /// consumer that moves to another node resumes where it acked).
    Positions {
        /// The consumer's name.
        consumer: String,
        /// Its positions.
        positions: Vec<ConsumerPosition>,
    },
    /// Changes nothing: a node that wrote it has applied everything the shard committed
    /// before it (a read barrier).
    Barrier,
    /// Deletes a queue of the shard with all its messages, and makes every consumer forget
    /// its position on it (a queue created again under the name starts at offset 0 and is
    /// delivered from its start).
    Delete {
        /// The queue's name.
        queue: Bytes,
    },
    /// Messages that wait for their time (a consumer group's retries, delayed publishes),
    /// each a `levee_broker::delay::DelayedEntry`'s bytes, placed by the shard's delay wheel
    /// as of `now_ms` (the proposer's clock, ms since the Unix epoch): appended at once to its
    /// target when due, else to one of the shard's slot queues. Answered with each entry's
    /// offset in its target when appended at once, 0 when it waits.
    Delay {
        /// The proposer's clock.
        now_ms: u64,
        /// The entries.
        entries: Vec<Bytes>,
    },
    /// Takes the shard's slots due at `now_ms` (the leader's clock, ms since the Unix epoch):
    /// the coarse ones' entries placed again, the fine ones' delivered to their targets, then
    /// the slots deleted. Proposed by the shard's leader only, when a slot is due.
    Deliver {
        /// The leader's clock.
        now_ms: u64,
    },
    /// Several consumers' acked positions on queues of the shard, in one entry: what a node's
    /// streams acked while its previous positions write waited (`ShardGroups::write_positions`).
    /// Applied as a `Positions` per consumer, in order. (Last: a variant's place is its code
    /// in the log.)
    PositionsOf {
        /// Each consumer's name and positions.
        consumers: Vec<(String, Vec<ConsumerPosition>)>,
    },
    /// Several append requests in one entry: those a node's appender took for the shard
    /// while its previous append entries waited (`ShardGroups::append`). Applied as an
    /// `Append` per request, in order, each answered on its own
    /// ([`ShardResponse::Each`]). (Last: a variant's place is its code in the log.)
    Appends {
        /// The requests, in the order they reached the appender.
        requests: Vec<AppendRequest>,
    },
}

impl ShardCommand {
    /// About the bytes the command carries: its queue names, payloads and positions' names
    /// (what bounds an `AppendEntries` call, [`network::APPEND_ENTRIES_BYTES_MAX`]).
    pub fn bytes(&self) -> usize {
        let messages = |messages: &[QueueMessage]| {
            messages
                .iter()
                .map(|message| message.queue.len() + message.payload.len())
                .sum::<usize>()
        };
        let positions = |positions: &[ConsumerPosition]| {
            positions
                .iter()
                .map(|position| position.queue.len() + 16)
                .sum::<usize>()
        };
        match self {
            Self::Append { messages: of, .. } => messages(of),
            Self::Appends { requests } => requests
                .iter()
                .map(|request| messages(&request.messages))
                .sum(),
            Self::Positions {
                positions: of,
                consumer,
            } => consumer.len() + positions(of),
            Self::PositionsOf { consumers } => consumers
                .iter()
                .map(|(consumer, of)| consumer.len() + positions(of))
                .sum(),
            Self::Delay { entries, .. } => entries.iter().map(Bytes::len).sum(),
            Self::Delete { queue } => queue.len(),
            Self::Barrier | Self::Deliver { .. } => 0,
        }
    }
}

/// One append request of a [`ShardCommand::Appends`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppendRequest {
    /// The idempotent producer's id, if the request named one.
    pub producer: Option<String>,
    /// The messages, in order.
    pub messages: Vec<QueueMessage>,
}

/// What applying one entry did.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ShardResponse {
    /// A blank or membership entry: nothing to say.
    #[default]
    Done,
    /// The messages of an append were stored at these offsets, in order.
    Appended {
        /// Each message's offset in its queue.
        offsets: Vec<u64>,
    },
    /// The command was refused on every replica (a message the store cannot take, or
    /// sequences an idempotent producer may not send), and nothing of it was stored.
    Refused {
        /// What kind of refusal.
        code: RefusedCode,
        /// Why, in words.
        reason: String,
    },
    /// The queue was deleted; whether it existed.
    Deleted {
        /// Whether the queue existed.
        existed: bool,
    },
    /// The answer of each request of a [`ShardCommand::Appends`], in order: `Appended` or
    /// `Refused` (a refused request stored nothing; the others are stored all the same).
    Each {
        /// The answers.
        responses: Vec<ShardResponse>,
    },
}

/// What kind of refusal a [`ShardResponse::Refused`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefusedCode {
    /// A message the store cannot take, or sequences not consecutive within a request.
    Invalid,
    /// An idempotent producer's sequence skips ahead.
    SequenceGap,
    /// An idempotent producer's resend older than every remembered run.
    SequenceTooOld,
}

/// A postcard encoding (entries on disk, peer messages): binary, payloads copied whole.
pub(crate) fn to_postcard<T: Serialize>(value: &T) -> Result<Vec<u8>, postcard::Error> {
    postcard::to_allocvec(value)
}

thread_local! {
    /// The buffer [`from_postcard_shared`] is decoding, while it does.
    static DECODING: std::cell::RefCell<Option<Bytes>> = const { std::cell::RefCell::new(None) };
}

/// Decodes `bytes` from postcard with every message's queue and payload a slice of `bytes`
/// (sharing its buffer) rather than a copy: entries read from the log and received from
/// peers carry thousands of messages, and an allocation and copy each was a tenth of a
/// replica's CPU.
pub(crate) fn from_postcard_shared<T: serde::de::DeserializeOwned>(
    bytes: &Bytes,
) -> Result<T, postcard::Error> {
    /// Forgets the buffer however the decode ends.
    struct Done;
    impl Drop for Done {
        fn drop(&mut self) {
            DECODING.with(|decoding| decoding.borrow_mut().take());
        }
    }
    DECODING.with(|decoding| *decoding.borrow_mut() = Some(bytes.clone()));
    let _done = Done;
    postcard::from_bytes(bytes)
}

/// Deserializes a `Bytes` field: a slice of the buffer [`from_postcard_shared`] decodes when
/// the field lies in it, else a copy (any other decode, or a format that does not lend its
/// input).
fn shared_bytes<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Bytes, D::Error> {
    /// Takes the bytes however the format offers them.
    struct Visitor;
    impl<'de> serde::de::Visitor<'de> for Visitor {
        type Value = Bytes;

        fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            formatter.write_str("bytes")
        }

        fn visit_borrowed_bytes<E: serde::de::Error>(self, value: &'de [u8]) -> Result<Bytes, E> {
            Ok(DECODING.with(|decoding| {
                let decoding = decoding.borrow();
                match decoding.as_ref() {
                    Some(buffer)
                        if !value.is_empty()
                            && buffer.as_ptr_range().contains(&value.as_ptr())
                            && value.as_ptr_range().end <= buffer.as_ptr_range().end =>
                    {
                        buffer.slice_ref(value)
                    }
                    _ => Bytes::copy_from_slice(value),
                }
            }))
        }

        fn visit_bytes<E: serde::de::Error>(self, value: &[u8]) -> Result<Bytes, E> {
            Ok(Bytes::copy_from_slice(value))
        }

        fn visit_byte_buf<E: serde::de::Error>(self, value: Vec<u8>) -> Result<Bytes, E> {
            Ok(Bytes::from(value))
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Bytes, A::Error> {
            let mut bytes = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
            while let Some(byte) = seq.next_element::<u8>()? {
                bytes.push(byte);
            }
            Ok(Bytes::from(bytes))
        }
    }
    deserializer.deserialize_bytes(Visitor)
}

impl LogCodec for ShardConfig {
    fn encode_entry(entry: &Entry<Self>) -> Result<Vec<u8>, StorageError> {
        to_postcard(entry).map_err(|error| openraft::StorageIOError::write_logs(&error).into())
    }

    fn decode_entry(bytes: &Bytes) -> Result<Entry<Self>, StorageError> {
        from_postcard_shared(bytes)
            .map_err(|error| openraft::StorageIOError::read_logs(&error).into())
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, EntryPayload, LogId, Membership};
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    fn entry(index: u64, payload: EntryPayload<ShardConfig>) -> Entry<ShardConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(3, 2), index),
            payload,
        }
    }

    #[test]
    fn given_each_kind_of_entry_when_encoded_then_decoding_gives_it_back()
    -> Result<(), StorageError> {
        let append = ShardCommand::Append {
            producer: Some("p".to_owned()),
            messages: vec![QueueMessage {
                queue: Bytes::from_static(b"orders"),
                payload: Bytes::from(vec![7_u8; 300]),
                sequence: 4,
            }],
        };
        let membership = Membership::new(
            vec![BTreeSet::from([1, 2])],
            BTreeMap::from([(1, NodeInfo::default()), (2, NodeInfo::default())]),
        );
        for entry in [
            entry(1, EntryPayload::Blank),
            entry(2, EntryPayload::Normal(append)),
            entry(3, EntryPayload::Membership(membership)),
            entry(
                4,
                EntryPayload::Normal(ShardCommand::Delay {
                    now_ms: 17,
                    entries: vec![Bytes::from_static(b"entry")],
                }),
            ),
            entry(
                5,
                EntryPayload::Normal(ShardCommand::Deliver { now_ms: 18 }),
            ),
            entry(
                6,
                EntryPayload::Normal(ShardCommand::Appends {
                    requests: vec![
                        AppendRequest {
                            producer: None,
                            messages: Vec::new(),
                        },
                        AppendRequest {
                            producer: Some("p".to_owned()),
                            messages: vec![QueueMessage {
                                queue: Bytes::from_static(b"q"),
                                payload: Bytes::from_static(b"m"),
                                sequence: 9,
                            }],
                        },
                    ],
                }),
            ),
        ] {
            let bytes = Bytes::from(ShardConfig::encode_entry(&entry)?);
            let decoded = ShardConfig::decode_entry(&bytes)?;
            assert_eq!(decoded.log_id, entry.log_id);
            assert_eq!(
                format!("{:?}", decoded.payload),
                format!("{:?}", entry.payload)
            );
        }
        Ok(())
    }

    #[test]
    fn given_a_payload_when_encoded_then_its_bytes_are_written_whole_not_one_number_each()
    -> Result<(), StorageError> {
        let append = ShardCommand::Append {
            producer: None,
            messages: vec![QueueMessage {
                queue: Bytes::from_static(b"q"),
                payload: Bytes::from(vec![200_u8; 1000]),
                sequence: 0,
            }],
        };
        let bytes = ShardConfig::encode_entry(&entry(9, EntryPayload::Normal(append)))?;
        assert!(
            bytes.len() < 1030,
            "{} bytes for a 1000-byte payload",
            bytes.len()
        );
        Ok(())
    }

    #[test]
    fn given_an_entry_read_shared_when_decoded_then_its_payloads_are_slices_of_its_bytes()
    -> Result<(), StorageError> {
        let append = ShardCommand::Append {
            producer: None,
            messages: vec![QueueMessage {
                queue: Bytes::from_static(b"queue"),
                payload: Bytes::from(vec![7_u8; 100]),
                sequence: 0,
            }],
        };
        let bytes = Bytes::from(ShardConfig::encode_entry(&entry(
            3,
            EntryPayload::Normal(append.clone()),
        ))?);
        let within = |part: &Bytes| bytes.as_ptr_range().contains(&part.as_ptr());
        let decoded = ShardConfig::decode_entry(&bytes)?;
        let EntryPayload::Normal(ShardCommand::Append { messages, .. }) = &decoded.payload else {
            panic!("an append: {decoded:?}");
        };
        assert!(within(&messages[0].queue) && within(&messages[0].payload));
        assert_eq!(decoded.payload, EntryPayload::Normal(append.clone()));
        // Any other decode copies (the buffer is forgotten once the shared one ends).
        let copied: Entry<ShardConfig> = postcard::from_bytes(&bytes).expect("decoded");
        let EntryPayload::Normal(ShardCommand::Append { messages, .. }) = &copied.payload else {
            panic!("an append: {copied:?}");
        };
        assert!(!within(&messages[0].payload));
        assert_eq!(copied.payload, EntryPayload::Normal(append));
        // A damaged entry is refused, and forgets the buffer too.
        assert!(ShardConfig::decode_entry(&bytes.slice(..bytes.len() - 10)).is_err());
        assert!(DECODING.with(|decoding| decoding.borrow().is_none()));
        Ok(())
    }
}
