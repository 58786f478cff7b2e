//! Joining a cluster (docs/CLUSTER.md, forming a cluster): a new node asks a member's peer
//! port to add it ([`join`]); the leader adds it as a learner, waits for it to catch up, then
//! makes it a voter. A member that does not lead answers with the leader's peer address, and
//! the new node asks there.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use levee_proto::peer_v1::PeerMessage;
use levee_proto::peer_v1::peer_client::PeerClient;
use openraft::ChangeMembers;
use openraft::error::{ClientWriteError, RaftError};
use serde::{Deserialize, Serialize};
use tonic::transport::Channel;

use crate::network::{PEER_CONNECT_TIMEOUT, Raft};
use crate::{NodeId, NodeInfo};

/// Longest a node tries to join before it gives up.
pub const JOIN_WAIT_MAX: Duration = Duration::from_secs(30);
/// The pause between two tries.
const JOIN_RETRY_PAUSE: Duration = Duration::from_millis(200);

/// A node asking to join.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinRequest {
    /// Its id.
    pub node_id: NodeId,
    /// Its addresses.
    pub node: NodeInfo,
}

/// Why a member did not add the node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinRefusal {
    /// What went wrong.
    pub message: String,
    /// The leader's peer address, when the member that answered does not lead.
    pub leader_peer_addr: Option<String>,
    /// True when asking again cannot help (the node id is taken).
    #[serde(default)]
    pub permanent: bool,
}

/// On the member: adds `request`'s node, as a learner then a voter, if this node leads.
/// Answers the cluster's id, which the new node adopts.
pub async fn add_node(
    raft: &Raft,
    cluster_id: &str,
    request: JoinRequest,
) -> Result<String, JoinRefusal> {
    let refused = |error: RaftError<NodeId, ClientWriteError<NodeId, NodeInfo>>| match error {
        RaftError::APIError(ClientWriteError::ForwardToLeader(forward)) => JoinRefusal {
            message: "this node does not lead the cluster".to_owned(),
            leader_peer_addr: forward.leader_node.map(|node| node.peer_addr),
            permanent: false,
        },
        other => JoinRefusal {
            message: other.to_string(),
            leader_peer_addr: None,
            permanent: false,
        },
    };
    let member = raft
        .metrics()
        .borrow()
        .membership_config
        .membership()
        .get_node(&request.node_id)
        .cloned();
    // The same node asking again (its first answer was lost) is added again, harmlessly; another
    // node under a member's id would take that member's place, so it is refused.
    if let Some(member) = member.filter(|member| member.peer_addr != request.node.peer_addr) {
        return Err(JoinRefusal {
            message: format!(
                "node id {} is taken by the member at peer address {}; start this node with an \
                 unused --node-id",
                request.node_id, member.peer_addr
            ),
            leader_peer_addr: None,
            permanent: true,
        });
    }
    raft.add_learner(request.node_id, request.node, true)
        .await
        .map_err(refused)?;
    raft.change_membership(
        ChangeMembers::AddVoterIds(BTreeSet::from([request.node_id])),
        false,
    )
    .await
    .map_err(refused)?;
    Ok(cluster_id.to_owned())
}

/// On the new node: asks the member at `seed` (a peer address) to add this node, following
/// the leader it names, until added or [`JOIN_WAIT_MAX`] passed. Answers the cluster's id.
pub async fn join(seed: &str, request: &JoinRequest) -> Result<String, String> {
    let started = Instant::now();
    let mut address = seed.to_owned();
    let json = serde_json::to_vec(request).map_err(|error| error.to_string())?;
    loop {
        let reason = match ask(&address, json.clone()).await {
            Ok(Ok(cluster_id)) => return Ok(cluster_id),
            Ok(Err(refusal)) if refusal.permanent => return Err(refusal.message),
            Ok(Err(refusal)) => {
                if let Some(leader) = refusal.leader_peer_addr.filter(|leader| !leader.is_empty()) {
                    address = leader;
                }
                refusal.message
            }
            Err(error) => error,
        };
        if started.elapsed() >= JOIN_WAIT_MAX {
            return Err(format!(
                "could not join through {seed} within {} s (last: {reason}); check that \
                 --join names a running member's peer address",
                JOIN_WAIT_MAX.as_secs()
            ));
        }
        tokio::time::sleep(JOIN_RETRY_PAUSE).await;
    }
}

async fn ask(address: &str, json: Vec<u8>) -> Result<Result<String, JoinRefusal>, String> {
    let channel = Channel::from_shared(format!("http://{address}"))
        .map_err(|error| error.to_string())?
        .connect_timeout(PEER_CONNECT_TIMEOUT)
        .connect_lazy();
    let answer = PeerClient::new(channel)
        .join(PeerMessage { json })
        .await
        .map_err(|status| format!("{address}: {status}"))?;
    serde_json::from_slice(&answer.into_inner().json).map_err(|error| error.to_string())
}
