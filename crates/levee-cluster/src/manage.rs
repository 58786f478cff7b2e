//! What only the leader can do, asked from any node (docs/CLUSTER.md, forming a cluster):
//! add a node (a learner, then a voter once caught up), remove one, and give a read index for
//! linearizable reads. [`Manager`] serves these on the leader and, on any other node, asks the
//! leader over the peer port (`Join`, `Manage`), following the leader each refusal names.
//! A removed node is told so (`Leave`) and stops.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use levee_proto::peer_v1::PeerMessage;
use levee_proto::peer_v1::peer_client::PeerClient;
use openraft::ChangeMembers;
use openraft::error::{CheckIsLeaderError, ClientWriteError, RaftError};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::network::{PeerDialer, Raft};
use crate::writer::{LEADER_WAIT_STEP, WRITE_WAIT_MAX};
use crate::{NodeId, NodeInfo};

/// Nodes that join become voters while the voters are fewer than this; later ones learners.
pub const VOTERS_AUTO_MAX: usize = 3;
/// The most voters a cluster may have (`AddNode` refuses a sixth).
pub const VOTERS_MAX: usize = 5;
/// Longest the leader waits for a new learner's log to catch up before it refuses to make it a
/// voter.
pub const CATCH_UP_WAIT_MAX: Duration = Duration::from_secs(10);
/// A learner is caught up when its log is at most this many entries behind the leader's.
const CATCH_UP_LAG_MAX: u64 = 16;
/// How many times, and how far apart, the leader tells a removed node so.
const LEAVE_TRIES: u32 = 10;
const LEAVE_RETRY_PAUSE: Duration = Duration::from_millis(250);

/// A node asking to be added.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinRequest {
    /// Its id.
    pub node_id: NodeId,
    /// Its addresses.
    pub node: NodeInfo,
    /// `Some(false)`: a learner only; `Some(true)`: a voter (refused beyond [`VOTERS_MAX`]);
    /// `None`: a voter while the voters are fewer than [`VOTERS_AUTO_MAX`], else a learner.
    #[serde(default)]
    pub voter: Option<bool>,
    /// The cluster the node's data dir already belongs to, if it does: a member of another
    /// cluster refuses it (a node cannot move between clusters with its data).
    #[serde(default)]
    pub cluster_id: Option<String>,
}

/// What the leader did with a [`JoinRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Joined {
    /// The cluster's id, which a new node adopts.
    pub cluster_id: String,
    /// Whether the node is now a voter (else a learner).
    pub voter: bool,
}

/// A request only the leader serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ManageRequest {
    /// Remove this node from the membership.
    Remove {
        /// The node.
        node_id: NodeId,
    },
    /// The log index a linearizable read must see applied (the leader confirmed it still leads).
    ReadIndex,
}

/// The leader's answer to a [`ManageRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ManageAnswer {
    /// The node is removed.
    Removed,
    /// Read once this index is applied.
    ReadIndex(u64),
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefusalKind {
    /// The node asked does not lead; ask the leader.
    NotLeader,
    /// No leader could be reached in time (no quorum); retry.
    Unavailable,
    /// The node named is not a member.
    NotFound,
    /// The node id is a member's with other addresses.
    AlreadyExists,
    /// The change would leave no voter, or more than [`VOTERS_MAX`], or the request does not
    /// fit this node (no peer port).
    FailedPrecondition,
    /// The new node did not catch up in time; it stays a learner.
    NotCaughtUp,
}

/// A refused request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    /// What kind.
    pub kind: RefusalKind,
    /// What went wrong, and the fix.
    pub message: String,
    /// The leader's peer address, when the node that answered does not lead.
    pub leader_peer_addr: Option<String>,
}

impl Refusal {
    fn new(kind: RefusalKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            leader_peer_addr: None,
        }
    }

    /// True when asking again (of the leader, or later) may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self.kind, RefusalKind::NotLeader | RefusalKind::Unavailable)
    }
}

/// What the leader tells a node it removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaveNotice {
    /// The cluster it was removed from.
    pub cluster_id: String,
    /// The removed node.
    pub node_id: NodeId,
    /// The leader that removed it.
    pub leader_id: NodeId,
}

/// Serves and asks for what only the leader can do.
#[derive(Clone)]
pub struct Manager {
    raft: Raft,
    cluster_id: watch::Receiver<String>,
    left: watch::Sender<Option<LeaveNotice>>,
    dialer: PeerDialer,
}

impl std::fmt::Debug for Manager {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("Manager")
    }
}

fn leader_refusal<E: std::fmt::Display>(
    error: RaftError<NodeId, E>,
    forward: impl FnOnce(&E) -> Option<Option<NodeInfo>>,
) -> Refusal {
    match error {
        RaftError::APIError(api) => match forward(&api) {
            Some(leader) => Refusal {
                kind: RefusalKind::NotLeader,
                message: "this node does not lead the cluster".to_owned(),
                leader_peer_addr: leader.map(|node| node.peer_addr),
            },
            None => Refusal::new(RefusalKind::Unavailable, api.to_string()),
        },
        RaftError::Fatal(fatal) => Refusal::new(RefusalKind::Unavailable, fatal.to_string()),
    }
}

fn write_refusal(error: RaftError<NodeId, ClientWriteError<NodeId, NodeInfo>>) -> Refusal {
    leader_refusal(error, |api| match api {
        ClientWriteError::ForwardToLeader(forward) => Some(forward.leader_node.clone()),
        ClientWriteError::ChangeMembershipError(_) => None,
    })
}

fn read_refusal(error: RaftError<NodeId, CheckIsLeaderError<NodeId, NodeInfo>>) -> Refusal {
    leader_refusal(error, |api| match api {
        CheckIsLeaderError::ForwardToLeader(forward) => Some(forward.leader_node.clone()),
        CheckIsLeaderError::QuorumNotEnough(_) => None,
    })
}

impl Manager {
    /// The manager of `raft`. `cluster_id` is what a joining node is told to adopt; `left`
    /// is told when this node is removed.
    pub fn new(
        raft: Raft,
        cluster_id: watch::Receiver<String>,
        left: watch::Sender<Option<LeaveNotice>>,
    ) -> Self {
        Self {
            raft,
            cluster_id,
            left,
            dialer: PeerDialer::default(),
        }
    }

    /// The manager dialing its peers with `dialer`.
    #[must_use]
    pub fn with_dialer(mut self, dialer: PeerDialer) -> Self {
        self.dialer = dialer;
        self
    }

    /// The Raft instance.
    pub fn raft(&self) -> &Raft {
        &self.raft
    }

    /// The cluster's id as this node knows it.
    pub fn cluster_id(&self) -> String {
        self.cluster_id.borrow().clone()
    }

    /// On the leader: adds `request`'s node as a learner, waits for it to catch up, then makes
    /// it a voter if asked (or, by default, while the voters are fewer than
    /// [`VOTERS_AUTO_MAX`]).
    pub async fn serve_join(&self, request: JoinRequest) -> Result<Joined, Refusal> {
        if let Some(theirs) = request
            .cluster_id
            .as_ref()
            .filter(|theirs| **theirs != self.cluster_id())
        {
            return Err(Refusal::new(
                RefusalKind::FailedPrecondition,
                format!(
                    "node {}'s data dir belongs to cluster {theirs}, not to this cluster ({}); \
                     start it with an empty data dir to join this one",
                    request.node_id,
                    self.cluster_id()
                ),
            ));
        }
        let membership = self.raft.metrics().borrow().membership_config.clone();
        let membership = membership.membership();
        // The same node asking again (its first answer was lost) is added again, harmlessly;
        // another node under a member's id would take that member's place, so it is refused.
        if let Some(member) = membership
            .get_node(&request.node_id)
            .filter(|member| member.peer_addr != request.node.peer_addr)
        {
            return Err(Refusal::new(
                RefusalKind::AlreadyExists,
                format!(
                    "node id {} is taken by the member at peer address {}; use an unused node id (--node-id)",
                    request.node_id, member.peer_addr
                ),
            ));
        }
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let already_voter = voters.contains(&request.node_id);
        let voter = match request.voter {
            Some(voter) => voter,
            None => already_voter || voters.len() < VOTERS_AUTO_MAX,
        };
        if voter && !already_voter && voters.len() >= VOTERS_MAX {
            return Err(Refusal::new(
                RefusalKind::FailedPrecondition,
                format!(
                    "the cluster has {} voters, the most it may have; add node {} as a learner",
                    voters.len(),
                    request.node_id
                ),
            ));
        }
        if !already_voter {
            self.raft
                .add_learner(request.node_id, request.node, false)
                .await
                .map_err(write_refusal)?;
            self.wait_caught_up(request.node_id).await?;
        }
        if voter && !already_voter {
            self.raft
                .change_membership(
                    ChangeMembers::AddVoterIds(BTreeSet::from([request.node_id])),
                    false,
                )
                .await
                .map_err(write_refusal)?;
        }
        Ok(Joined {
            cluster_id: self.cluster_id(),
            voter: voter || already_voter,
        })
    }

    /// Waits until `node_id`'s log is within a few entries of the leader's.
    async fn wait_caught_up(&self, node_id: NodeId) -> Result<(), Refusal> {
        self.raft
            .wait(Some(CATCH_UP_WAIT_MAX))
            .metrics(
                |metrics| {
                    let last = metrics.last_log_index.unwrap_or(0);
                    metrics
                        .replication
                        .as_ref()
                        .and_then(|replication| replication.get(&node_id))
                        .is_some_and(|matched| {
                            last.saturating_sub(matched.map_or(0, |log_id| log_id.index))
                                <= CATCH_UP_LAG_MAX
                        })
                },
                "the new node caught up",
            )
            .await
            .map(|_| ())
            .map_err(|_| {
                Refusal::new(
                    RefusalKind::NotCaughtUp,
                    format!(
                        "node {node_id} was added as a learner but its log did not catch up \
                         within {} s; check that it runs at its peer address, or remove it",
                        CATCH_UP_WAIT_MAX.as_secs()
                    ),
                )
            })
    }

    /// On the leader: serves a [`ManageRequest`].
    pub async fn serve_manage(&self, request: ManageRequest) -> Result<ManageAnswer, Refusal> {
        match request {
            ManageRequest::Remove { node_id } => self.serve_remove(node_id).await,
            ManageRequest::ReadIndex => {
                let (read, _applied) = self.raft.get_read_log_id().await.map_err(read_refusal)?;
                Ok(ManageAnswer::ReadIndex(
                    read.map_or(0, |log_id| log_id.index),
                ))
            }
        }
    }

    async fn serve_remove(&self, node_id: NodeId) -> Result<ManageAnswer, Refusal> {
        let metrics = self.raft.metrics().borrow().clone();
        if metrics.current_leader != Some(metrics.id) {
            return Err(Refusal {
                kind: RefusalKind::NotLeader,
                message: "this node does not lead the cluster".to_owned(),
                leader_peer_addr: None,
            });
        }
        let membership = metrics.membership_config.membership();
        let Some(node) = membership.get_node(&node_id).cloned() else {
            return Err(Refusal::new(
                RefusalKind::NotFound,
                format!("node {node_id} is not a member; levee cluster status lists the members"),
            ));
        };
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let change = if voters.contains(&node_id) {
            if voters.len() == 1 {
                return Err(Refusal::new(
                    RefusalKind::FailedPrecondition,
                    format!("node {node_id} is the cluster's last voter; add another voter first"),
                ));
            }
            ChangeMembers::RemoveVoters(BTreeSet::from([node_id]))
        } else {
            ChangeMembers::RemoveNodes(BTreeSet::from([node_id]))
        };
        self.raft
            .change_membership(change, false)
            .await
            .map_err(write_refusal)?;
        let notice = LeaveNotice {
            cluster_id: self.cluster_id(),
            node_id,
            leader_id: metrics.id,
        };
        if node_id == metrics.id {
            self.left.send_replace(Some(notice));
        } else {
            tokio::spawn(tell_removed(self.dialer, node, notice));
        }
        Ok(ManageAnswer::Removed)
    }

    /// On the removed node: takes the leader's notice, if it is meant for this node.
    pub fn serve_leave(&self, notice: LeaveNotice) -> Result<(), Refusal> {
        let me = self.raft.metrics().borrow().id;
        if notice.node_id != me || notice.cluster_id != self.cluster_id() {
            return Err(Refusal::new(
                RefusalKind::FailedPrecondition,
                format!(
                    "a removal of node {} of cluster {} sent to node {me} of cluster {}",
                    notice.node_id,
                    notice.cluster_id,
                    self.cluster_id()
                ),
            ));
        }
        tracing::warn!(
            leader_id = notice.leader_id,
            "this node was removed from the cluster"
        );
        self.left.send_replace(Some(notice));
        Ok(())
    }

    /// Adds a node, from any node: served here when this node leads, else asked of the leader.
    pub async fn add(&self, request: &JoinRequest) -> Result<Joined, Refusal> {
        self.ask_leader(Rpc::Join, request, |manager| {
            let request = request.clone();
            async move { manager.serve_join(request).await }
        })
        .await
    }

    /// Removes a node, from any node.
    pub async fn remove(&self, node_id: NodeId) -> Result<(), Refusal> {
        let request = ManageRequest::Remove { node_id };
        self.ask_leader(Rpc::Manage, &request, |manager| async move {
            manager.serve_manage(request).await
        })
        .await
        .map(|_| ())
    }

    /// Waits until this node has applied everything committed before the call: what it then
    /// reads from its state machine is linearizable. Fails with [`RefusalKind::Unavailable`]
    /// when no leader confirms within [`WRITE_WAIT_MAX`].
    pub async fn linearize(&self) -> Result<(), Refusal> {
        let request = ManageRequest::ReadIndex;
        let answer = self
            .ask_leader(Rpc::Manage, &request, |manager| async move {
                manager.serve_manage(request).await
            })
            .await?;
        let ManageAnswer::ReadIndex(index) = answer else {
            return Err(Refusal::new(
                RefusalKind::Unavailable,
                "the leader answered a read index request with something else",
            ));
        };
        self.raft
            .wait(Some(WRITE_WAIT_MAX))
            .applied_index_at_least(Some(index), "the read index applied")
            .await
            .map(|_| ())
            .map_err(|error| {
                Refusal::new(
                    RefusalKind::Unavailable,
                    format!("this node did not apply the leader's log in time ({error}); retry"),
                )
            })
    }

    /// Serves `request` here while this node leads, else asks the leader's peer port, following
    /// the leader each refusal names, for up to [`WRITE_WAIT_MAX`] of refusals that a retry
    /// may cure.
    async fn ask_leader<Req, Ans, Local, Served>(
        &self,
        rpc: Rpc,
        request: &Req,
        local: Local,
    ) -> Result<Ans, Refusal>
    where
        Req: Serialize,
        Ans: DeserializeOwned,
        Local: Fn(Self) -> Served,
        Served: Future<Output = Result<Ans, Refusal>>,
    {
        let started = Instant::now();
        let json = serde_json::to_vec(request)
            .map_err(|error| Refusal::new(RefusalKind::FailedPrecondition, error.to_string()))?;
        let mut hint: Option<String> = None;
        loop {
            let (me, leader) = {
                let metrics = self.raft.metrics().borrow().clone();
                let leader = metrics.current_leader.and_then(|leader| {
                    metrics
                        .membership_config
                        .membership()
                        .get_node(&leader)
                        .map(|node| (leader, node.peer_addr.clone()))
                });
                (metrics.id, leader)
            };
            let target = hint
                .take()
                .or_else(|| leader.as_ref().map(|(_, address)| address.clone()));
            let outcome = match (&leader, target) {
                (Some((leader, _)), _) if *leader == me => {
                    // A leader cut off from the majority may wait for ever: not longer than a
                    // remote ask would.
                    tokio::time::timeout(rpc.timeout(), local(self.clone()))
                        .await
                        .unwrap_or_else(|_| {
                            Err(Refusal::new(
                                RefusalKind::Unavailable,
                                "this node leads but no majority answered it in time",
                            ))
                        })
                }
                (_, Some(address)) => ask(self.dialer, rpc, &address, json.clone()).await,
                (_, None) => Err(Refusal::new(
                    RefusalKind::Unavailable,
                    "no leader is known yet",
                )),
            };
            match outcome {
                Err(refusal) if refusal.is_retryable() => {
                    if started.elapsed() >= WRITE_WAIT_MAX {
                        return Err(Refusal::new(
                            RefusalKind::Unavailable,
                            format!(
                                "no leader answered within {} ms: the cluster has no quorum \
                                 reachable from this node (last: {}); retry",
                                started.elapsed().as_millis(),
                                refusal.message
                            ),
                        ));
                    }
                    hint = refusal
                        .leader_peer_addr
                        .filter(|address| !address.is_empty());
                    if hint.is_none() {
                        tokio::time::sleep(LEADER_WAIT_STEP).await;
                    }
                }
                other => return other,
            }
        }
    }
}

/// On a node whose data dir already belongs to a cluster and that was given a seed: asks the
/// seed once whether it is of the same cluster. `Err` only when the seed answered that it is
/// not (an unreachable seed, or a member that does not lead, is no reason to stop).
pub async fn check_same_cluster(
    dialer: PeerDialer,
    seed: &str,
    request: &JoinRequest,
) -> Result<(), String> {
    let Ok(json) = serde_json::to_vec(request) else {
        return Ok(());
    };
    match ask::<Joined>(dialer, Rpc::Join, seed, json).await {
        Err(refusal) if refusal.kind == RefusalKind::FailedPrecondition => Err(refusal.message),
        _ => Ok(()),
    }
}

/// Which peer call carries a request to the leader.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Rpc {
    Join,
    Manage,
}

impl Rpc {
    /// How long an answer may take: adding a node waits for it to catch up.
    fn timeout(self) -> std::time::Duration {
        match self {
            Rpc::Join => CATCH_UP_WAIT_MAX + WRITE_WAIT_MAX,
            Rpc::Manage => WRITE_WAIT_MAX,
        }
    }
}

/// Asks the node at peer address `address`.
pub(crate) async fn ask<Ans: DeserializeOwned>(
    dialer: PeerDialer,
    rpc: Rpc,
    address: &str,
    json: Vec<u8>,
) -> Result<Ans, Refusal> {
    let unreachable = |message: String| Refusal::new(RefusalKind::Unavailable, message);
    let channel = dialer.channel(address).map_err(unreachable)?;
    let mut client = PeerClient::new(channel);
    let message = PeerMessage { json };
    let answer = tokio::time::timeout(rpc.timeout(), async move {
        match rpc {
            Rpc::Join => client.join(message).await,
            Rpc::Manage => client.manage(message).await,
        }
    })
    .await
    .map_err(|_| unreachable(format!("{address} did not answer in time")))?
    .map_err(|status| unreachable(format!("{address}: {}", status.message())))?;
    serde_json::from_slice::<Result<Ans, Refusal>>(&answer.into_inner().json)
        .map_err(|error| unreachable(format!("{address}'s answer is unreadable: {error}")))?
}

/// Tells a removed node so, a few times while it does not answer.
async fn tell_removed(dialer: PeerDialer, node: NodeInfo, notice: LeaveNotice) {
    let Ok(json) = serde_json::to_vec(&notice) else {
        return;
    };
    for _ in 0..LEAVE_TRIES {
        let told = async {
            let channel = dialer.channel(&node.peer_addr).ok()?;
            PeerClient::new(channel)
                .leave(PeerMessage { json: json.clone() })
                .await
                .ok()
        };
        if tokio::time::timeout(WRITE_WAIT_MAX, told)
            .await
            .ok()
            .flatten()
            .is_some()
        {
            return;
        }
        tokio::time::sleep(LEAVE_RETRY_PAUSE).await;
    }
    tracing::warn!(
        node_id = notice.node_id,
        peer_addr = %node.peer_addr,
        "a removed node could not be told; it stops serving once restarted"
    );
}
