//! `/v1/cluster` on the admin port: this node's view of the metadata group (docs/CLUSTER.md),
//! as JSON: the leader it knows, the term, how far its log and state machine are, and every
//! member with its role and addresses. On the leader, each follower's replication lag too.
//! Then the cluster's shards and where each is placed (docs/CLUSTER.md, "Part 2"), and, in a
//! cluster that replicates its queues, the shard groups this node is a member of
//! (`shard_groups`: each one's leader, voters, this node's log and applied index, and what waits
//! in its delay slots).

use axum::Router;
use axum::extract::State;
use axum::response::Json;
use axum::routing::get;
use levee_cluster::shard::ShardSlot;
use levee_cluster::{MetaStateMachine, Raft};
use serde_json::{Value, json};

/// The router of `/v1/cluster` over this node's Raft instance and metadata.
pub fn router(raft: Raft, machine: MetaStateMachine, shards: ShardSlot) -> Router {
    Router::new()
        .route("/v1/cluster", get(cluster))
        .with_state((raft, machine, shards))
}

async fn cluster(
    State((raft, machine, shards)): State<(Raft, MetaStateMachine, ShardSlot)>,
) -> Json<Value> {
    let metrics = raft.metrics().borrow().clone();
    let membership = metrics.membership_config.membership();
    let last_log_index = metrics.last_log_index.unwrap_or(0);
    let nodes: Vec<Value> = membership
        .nodes()
        .map(|(id, node)| {
            let role = if Some(*id) == metrics.current_leader {
                "leader"
            } else if membership.voter_ids().any(|voter| voter == *id) {
                "voter"
            } else {
                "learner"
            };
            // Known on the leader only: how far each node's log matches the leader's.
            let matched = metrics
                .replication
                .as_ref()
                .and_then(|replication| replication.get(id))
                .map(|matched| matched.map_or(0, |log_id| log_id.index));
            json!({
                "node_id": id,
                "role": role,
                "grpc_addr": node.grpc_addr,
                "admin_addr": node.admin_addr,
                "peer_addr": node.peer_addr,
                "lag_entries": matched.map(|matched| last_log_index.saturating_sub(matched)),
            })
        })
        .collect();
    Json(json!({
        "node_id": metrics.id,
        "state": format!("{:?}", metrics.state).to_lowercase(),
        "leader_id": metrics.current_leader,
        "term": metrics.current_term,
        "last_log_index": metrics.last_log_index,
        "last_applied_index": metrics.last_applied.map(|log_id| log_id.index),
        "nodes": nodes,
        "shards": machine.shards(),
        "replicated_queues": machine.replicated_queues(),
        "shard_groups": shards.get().map(levee_cluster::shard::ShardGroups::status),
        "shard_map": crate::cluster_service::shard_map(&machine, &metrics, &shards)
            .iter()
            .map(|placement| {
                json!({
                    "shard": placement.shard,
                    "replicas": placement.replicas,
                    "leader_id": (placement.leader_id != 0).then_some(placement.leader_id),
                })
            })
            .collect::<Vec<_>>(),
    }))
}
