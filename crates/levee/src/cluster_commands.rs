//! `levee cluster ...`: the cluster's members and roles, and adding and removing nodes
//! (docs/CLUSTER.md), through the Rust SDK's Cluster calls.

use std::process::ExitCode;

use levee_client::{AddNodeRequest, Client, ClusterView, Member, MemberRole};
use serde_json::{Value, json};

use crate::client_commands::ServerAddress;

#[derive(Debug, clap::Subcommand)]
pub enum ClusterCommand {
    /// Show the members, their roles and health, the leader, the term, this node's log and
    /// apply positions and (asked of the leader) each member's lag
    Status(StatusArgs),
    /// Add a running node that is not a member: a learner first, a voter once caught up
    /// (unless --learner); also makes a learner a voter
    AddNode(AddNodeArgs),
    /// Remove a member; it stops serving
    RemoveNode(RemoveNodeArgs),
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    address: ServerAddress,
}

#[derive(Debug, clap::Args)]
pub struct AddNodeArgs {
    #[command(flatten)]
    address: ServerAddress,
    /// The node's id (its --node-id)
    #[arg(long)]
    node_id: u64,
    /// The node's peer address (its --peer-addr)
    #[arg(long, value_name = "HOST:PORT")]
    peer_addr: String,
    /// The node's gRPC API address (its --grpc-addr)
    #[arg(long, value_name = "HOST:PORT")]
    grpc_addr: String,
    /// The node's admin HTTP address (its --admin-addr)
    #[arg(long, value_name = "HOST:PORT")]
    admin_addr: String,
    /// Add it as a learner only (it gets the log but does not vote)
    #[arg(long)]
    learner: bool,
}

#[derive(Debug, clap::Args)]
pub struct RemoveNodeArgs {
    #[command(flatten)]
    address: ServerAddress,
    /// The member's node id
    #[arg(long)]
    node_id: u64,
}

pub fn run(command: &ClusterCommand) -> ExitCode {
    let address = match command {
        ClusterCommand::Status(args) => &args.address,
        ClusterCommand::AddNode(args) => &args.address,
        ClusterCommand::RemoveNode(args) => &args.address,
    };
    crate::client_commands::print_result(address.json, cluster(command, &address.server))
}

/// A role's name in the CLI's JSON.
pub fn role_name(role: MemberRole) -> &'static str {
    match role {
        MemberRole::Leader => "leader",
        MemberRole::Voter => "voter",
        MemberRole::Learner => "learner",
        MemberRole::Unspecified => "unknown",
    }
}

fn member_json(member: &Member) -> Value {
    json!({
        "node_id": member.node_id,
        "role": role_name(member.role()),
        "healthy": member.healthy,
        "grpc_addr": member.grpc_addr,
        "admin_addr": member.admin_addr,
        "peer_addr": member.peer_addr,
        "lag_entries": member.lag_entries,
    })
}

/// The CLI's JSON of a node's view of the cluster.
pub fn view_json(view: &ClusterView) -> Value {
    json!({
        "cluster_id": view.cluster_id,
        "node_id": view.node_id,
        "leader_id": (view.leader_id != 0).then_some(view.leader_id),
        "term": view.term,
        "last_log_index": view.last_log_index,
        "applied_index": view.applied_index,
        "members": view.members.iter().map(member_json).collect::<Vec<_>>(),
        "shards": (view.shards != 0).then_some(view.shards),
        "shard_map": view
            .shard_map
            .iter()
            .map(|placement| json!({"shard": placement.shard, "replicas": placement.replicas}))
            .collect::<Vec<_>>(),
    })
}

async fn cluster(command: &ClusterCommand, server: &str) -> anyhow::Result<Value> {
    let client = Client::connect(server).await?;
    Ok(match command {
        ClusterCommand::Status(_) => {
            let view = client.cluster().await?;
            // Lags are known on the leader: ask it when this node does not lead.
            let leader = view
                .members
                .iter()
                .find(|member| member.node_id == view.leader_id && member.node_id != view.node_id);
            let leader_view = match leader {
                Some(leader) => match Client::connect(&leader.grpc_addr).await {
                    Ok(leader_client) => leader_client.cluster().await.ok(),
                    Err(_) => None,
                },
                None => None,
            };
            let mut shown = view_json(&view);
            if let Some(leader_view) = leader_view {
                shown["members"] = leader_view.members.iter().map(member_json).collect();
            }
            shown
        }
        ClusterCommand::AddNode(args) => {
            let role = client
                .add_node(AddNodeRequest {
                    node_id: args.node_id,
                    peer_addr: args.peer_addr.clone(),
                    grpc_addr: args.grpc_addr.clone(),
                    admin_addr: args.admin_addr.clone(),
                    learner: args.learner,
                })
                .await?;
            json!({"node_id": args.node_id, "role": role_name(role)})
        }
        ClusterCommand::RemoveNode(args) => {
            client.remove_node(args.node_id).await?;
            json!({"node_id": args.node_id, "removed": true})
        }
    })
}
