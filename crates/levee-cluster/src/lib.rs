//! Levee's cluster: the metadata Raft group (docs/CLUSTER.md), on openraft 0.9. This crate
//! holds what openraft asks an application for, without networking:
//!
//! - [`command`]: what the log carries ([`MetaCommand`]: a broker command), what applying an
//!   entry answers ([`MetaResponse`]), and what the membership records of a node
//!   ([`NodeInfo`]: its addresses).
//! - [`log_store`]: [`LogStore`], the Raft log, vote and purge point in a fjall keyspace; every
//!   append and vote is persisted (fsynced) before openraft is told it is durable.
//! - [`join`]: a new node asks a member to add it; the leader adds it as a learner, then a
//!   voter.
//! - [`manage`]: [`Manager`], what only the leader does (add and remove nodes, read indexes
//!   for linearizable reads), served there and asked for from any node.
//! - [`network`]: openraft's calls between nodes over the peer gRPC service.
//! - [`state_machine`]: [`MetaStateMachine`], the replicated state (the broker's catalog and
//!   the membership) applied from the log, with its snapshot in a file.
//!
//! A command is decided and applied by the broker engine on every replica, in log order, so
//! every replica reaches the same state and gives the same answer: nothing in `apply` reads a
//! clock or the network. [`writer`]: [`MetaWriter`] writes a command from any node (proposed
//! on the leader, forwarded to it from the others).

#![deny(missing_docs)]
#![allow(
    clippy::result_large_err,
    reason = "openraft's StorageError (224 bytes) is what its storage traits return"
)]

use std::io::Cursor;

pub mod command;
pub mod join;
pub mod log_store;
pub mod manage;
pub mod network;
pub mod shard;
pub mod state_machine;
pub mod syncer;
pub mod writer;

pub use command::{HotKeyMeta, HotKeyObserver, LimitMeta, MetaCommand, MetaResponse, NodeInfo};
pub use log_store::{LogCodec, LogStore};
pub use manage::{LeaveNotice, Manager, Refusal, RefusalKind};
pub use network::{PeerNetwork, PeerService, Raft};
pub use state_machine::MetaStateMachine;
pub use writer::{MetaWriter, WriteError};

openraft::declare_raft_types!(
    /// The metadata group's types for openraft.
    pub MetaConfig:
        D = MetaCommand,
        R = MetaResponse,
        Node = NodeInfo,
        SnapshotData = Cursor<Vec<u8>>,
);

/// A node's id in the cluster.
pub type NodeId = u64;
/// An openraft storage error of this cluster.
pub type StorageError = openraft::StorageError<NodeId>;
