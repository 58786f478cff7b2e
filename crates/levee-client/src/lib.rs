//! Levee's Rust SDK. The CLI, the load tools and the integration tests all use it.
//!
//! - [`Client`]: one long-lived HTTP/2 connection to a server (calls are multiplexed over it,
//!   never one connection per request), with typed calls for each service.
//! - [`HotKeys`]: the app-server side of hot-key detection: `is_hot`, a local cache of hot
//!   keys' values with single-flight loading, callbacks, batched reports, reconnection, and
//!   rendezvous routing over several servers.
//! - [`Producer`]: batches appends from many tasks; optionally idempotent (resends never store
//!   a message twice).
//! - [`Subscription`]: one consumer's mailbox stream on one queue, with credits and acks.
//! - [`Mailboxes`]: one consumer's stream over many queues (up to a million), one credit,
//!   batched acks.
//! - [`Limiter`]: cluster-wide limits decided locally from leases (`try_acquire`).
//! - [`GroupConsumer`]: a consumer-group member on a topic: leases, bounded parallelism, commits
//!   strictly in order, rejoin with backoff.
//! - [`ClientError`]: what went wrong; server errors carry Levee's stable [`ErrorCode`].
//!
//! ```no_run
//! # async fn run() -> Result<(), levee_client::ClientError> {
//! let client = levee_client::Client::connect("127.0.0.1:7070").await?;
//! let info = client.server_info().await?;
//! println!("levee {} up for {} ms", info.version, info.uptime_ms);
//! # Ok(())
//! # }
//! ```

#![deny(missing_docs)]

mod breaker;
mod client;
mod consumer;
mod error;
mod failures;
mod following;
pub mod hotkey;
mod limit_keys;
mod limiter;
mod mailboxes;
mod producer;
pub mod routing;
mod subscription;

pub use breaker::{Breaker, BreakerRule, BreakerState, CallGuard, Trip};
pub use client::{Client, ClientOptions, HealthStatus};
pub use consumer::{ConsumerOptions, ConsumerStats, GroupConsumer, Message, Outcome};
pub use error::ClientError;
pub use hotkey::{HotKeyChange, HotKeys, HotKeysOptions, HotKeysStats};
pub use levee_proto::v1::{
    AddNodeRequest, Delivery, DescribeGroupResponse as GroupDescription,
    DescribeTopicResponse as TopicDescription, ErrorCode, GetAppStatsResponse as AppStats,
    GetClusterResponse as ClusterView, GetServerInfoResponse as ServerInfo, HotKeyEvent,
    HotKeyRule, KeyCount, ListQueuesResponse as QueuePage, MailboxDelivery, MatchKind, Member,
    MemberRole, TopicSummary, WatchMembersResponse as MembersUpdate,
};
pub use levee_proto::v1::{
    DeadLetter, DescribeRetryPolicyResponse as RetryPolicyDescription,
    ListDeadLettersResponse as DeadLetterPage, PartitionReset,
    ResetGroupOffsetsResponse as OffsetsReset, reset_group_offsets_request::To as ResetTo,
};
pub use levee_proto::{Bytes, WireError};
pub use levee_proto::{shards, topic_partition};
pub use limit_keys::{KEYS_TRACKED_MAX, LimitCall};
pub use limiter::{LimitedResource, Limiter, LimiterOptions, LimiterStats};
pub use mailboxes::{MAILBOXES_PER_REQUEST_MAX, Mailboxes};
pub use producer::{Producer, ProducerOptions};
pub use subscription::Subscription;
