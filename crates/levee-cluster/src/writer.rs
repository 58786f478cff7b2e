//! [`MetaWriter`]: how a node writes a metadata command, whichever node leads: proposed here
//! when this node is the leader, else forwarded over the peer port to the leader it knows,
//! which answers once the command is committed and applied (docs/CLUSTER.md, writes). While
//! no leader is known (an election) it retries every [`LEADER_WAIT_STEP`] for up to
//! [`WRITE_WAIT_MAX`], then fails: without a quorum a write fails fast, it never hangs.

use std::time::{Duration, Instant};

use levee_proto::peer_v1::PeerMessage;
use levee_proto::peer_v1::peer_client::PeerClient;
use openraft::error::{ClientWriteError, RaftError};
use serde::{Deserialize, Serialize};

use crate::network::{PeerDialer, Raft};
use crate::{MetaCommand, MetaResponse, NodeId, NodeInfo};

/// Longest a write waits for a leader (an election, a forward that must be tried again).
pub const WRITE_WAIT_MAX: Duration = Duration::from_secs(2);
/// The pause between two tries while no leader is known.
pub const LEADER_WAIT_STEP: Duration = Duration::from_millis(50);

/// Why a metadata write failed; nothing is known to have been applied then, and a retry is
/// safe (metadata commands are idempotent).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WriteError {
    /// No leader could take the write in time: the cluster has no quorum reachable from here.
    #[error(
        "no leader took the write within {waited_ms} ms: the cluster has no quorum reachable \
         from this node ({reason}); retry, or check the cluster's nodes with levee cluster status"
    )]
    NoLeader {
        /// How long the write waited.
        waited_ms: u64,
        /// The last thing that went wrong.
        reason: String,
    },
    /// The Raft instance stopped (a storage failure, or shutdown).
    #[error("this node's metadata group stopped ({0}); write through another node")]
    Stopped(String),
}

/// Writes metadata commands through a node's Raft instance.
#[derive(Clone)]
pub struct MetaWriter {
    raft: Raft,
    dialer: PeerDialer,
}

impl std::fmt::Debug for MetaWriter {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("MetaWriter")
    }
}

/// The leader's answer to a forwarded command: what applying it did, and its log index.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Forwarded {
    /// What applying the command answered.
    pub response: MetaResponse,
    /// Where the command sits in the log.
    pub log_index: u64,
}

/// What one try did.
enum Attempt {
    Done(MetaResponse),
    /// Committed through the leader at this log index; applied here once this node has
    /// applied that far.
    Forwarded(Forwarded),
    /// Try again after a pause; why.
    Again(String),
}

impl MetaWriter {
    /// A writer over `raft`.
    pub fn new(raft: Raft) -> Self {
        Self {
            raft,
            dialer: PeerDialer::default(),
        }
    }

    /// The writer forwarding with `dialer`.
    #[must_use]
    pub fn with_dialer(mut self, dialer: PeerDialer) -> Self {
        self.dialer = dialer;
        self
    }

    /// Writes `command` and answers what applying it did, once committed.
    pub async fn write(&self, command: MetaCommand) -> Result<MetaResponse, WriteError> {
        let started = Instant::now();
        loop {
            match self.attempt(&command).await? {
                Attempt::Done(response) => return Ok(response),
                Attempt::Forwarded(forwarded) => {
                    // Reads here come from this node's state machine: wait until it has the
                    // write, so whoever wrote through this node reads what they wrote.
                    let applied = self
                        .raft
                        .wait(Some(WRITE_WAIT_MAX))
                        .applied_index_at_least(Some(forwarded.log_index), "the write applied")
                        .await;
                    if let Err(error) = applied {
                        tracing::warn!(%error, "a forwarded write is committed, not yet applied here");
                    }
                    return Ok(forwarded.response);
                }
                Attempt::Again(reason) => {
                    if started.elapsed() >= WRITE_WAIT_MAX {
                        return Err(WriteError::NoLeader {
                            waited_ms: u64::try_from(started.elapsed().as_millis())
                                .unwrap_or(u64::MAX),
                            reason,
                        });
                    }
                    tokio::time::sleep(LEADER_WAIT_STEP).await;
                }
            }
        }
    }

    async fn attempt(&self, command: &MetaCommand) -> Result<Attempt, WriteError> {
        // A leader cut off from the majority cannot commit: give up on it in time (the entry may
        // still commit later if the partition heals; a retry is safe, commands are idempotent).
        let Ok(written) =
            tokio::time::timeout(WRITE_WAIT_MAX, self.raft.client_write(command.clone())).await
        else {
            return Ok(Attempt::Again(
                "the leader did not commit the write in time: it cannot reach a majority; the \
                 write may still be applied if it does"
                    .to_owned(),
            ));
        };
        match written {
            Ok(written) => Ok(Attempt::Done(written.data)),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(forward))) => {
                match (forward.leader_id, forward.leader_node) {
                    (Some(leader), Some(node)) => {
                        Ok(forward_to(self.dialer, leader, &node, command).await)
                    }
                    _ => Ok(Attempt::Again("no leader is known yet".to_owned())),
                }
            }
            Err(RaftError::APIError(other)) => Ok(Attempt::Again(other.to_string())),
            Err(RaftError::Fatal(fatal)) => Err(WriteError::Stopped(fatal.to_string())),
        }
    }
}

/// Sends `command` to the leader's peer port.
async fn forward_to(
    dialer: PeerDialer,
    leader: NodeId,
    node: &NodeInfo,
    command: &MetaCommand,
) -> Attempt {
    let json = match serde_json::to_vec(command) {
        Ok(json) => json,
        Err(error) => return Attempt::Again(format!("cannot encode the command: {error}")),
    };
    let channel = match dialer.channel(&node.peer_addr) {
        Ok(channel) => channel,
        Err(error) => return Attempt::Again(format!("leader {leader}: {error}")),
    };
    let answer = tokio::time::timeout(
        WRITE_WAIT_MAX,
        PeerClient::new(channel).forward(PeerMessage { json }),
    )
    .await;
    let message = match answer {
        Ok(Ok(message)) => message.into_inner(),
        Ok(Err(status)) => return Attempt::Again(format!("forward to leader {leader}: {status}")),
        Err(_) => return Attempt::Again(format!("forward to leader {leader} timed out")),
    };
    match serde_json::from_slice::<Result<Forwarded, String>>(&message.json) {
        Ok(Ok(forwarded)) => Attempt::Forwarded(forwarded),
        Ok(Err(reason)) => Attempt::Again(format!("leader {leader}: {reason}")),
        Err(error) => Attempt::Again(format!("leader {leader}'s answer is unreadable: {error}")),
    }
}
