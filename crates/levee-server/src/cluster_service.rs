//! The `levee.v1.Cluster` gRPC service (proto/levee/v1/cluster.proto): this node's view of the
//! cluster, a stream of the members for clients that follow the cluster, and adding and
//! removing nodes. [`probe_members`] keeps every member's health: whether its API answered
//! this node's last probe.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use levee_cluster::manage::JoinRequest;
use levee_cluster::{Manager, MetaStateMachine, NodeId, NodeInfo, Refusal, RefusalKind};
use levee_proto::WireError;
use levee_proto::v1::admin_client::AdminClient;
use levee_proto::v1::cluster_server::{Cluster, ClusterServer};
use levee_proto::v1::{
    AddNodeRequest, AddNodeResponse, ErrorCode, GetClusterRequest, GetClusterResponse,
    GetServerInfoRequest, Member, MemberRole, RemoveNodeRequest, RemoveNodeResponse,
    ShardPlacement, WatchMembersRequest, WatchMembersResponse,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::state::ServerState;
use levee_cluster::shard::ShardSlot;

/// How often every member's API is probed.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(250);
/// How long a probe may take before the member counts as unhealthy.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// Member lists a `WatchMembers` stream may have queued for a slow client.
const WATCH_QUEUE: usize = 4;

/// Each member's health as this node last saw it.
pub type MemberHealth = watch::Receiver<BTreeMap<NodeId, bool>>;

/// The Cluster service.
#[derive(Debug, Clone)]
pub struct ClusterService {
    manager: Manager,
    machine: MetaStateMachine,
    shards: ShardSlot,
    state: Arc<ServerState>,
    health: MemberHealth,
    closing: watch::Receiver<bool>,
}

impl ClusterService {
    /// The service over `manager`; `health` from [`probe_members`]; streams end when
    /// `closing` turns true.
    pub fn new(
        (manager, machine, shards): (Manager, MetaStateMachine, ShardSlot),
        state: Arc<ServerState>,
        health: MemberHealth,
        closing: watch::Receiver<bool>,
    ) -> Self {
        Self {
            manager,
            machine,
            shards,
            state,
            health,
            closing,
        }
    }
}

/// The members as `metrics` and `health` say, by node id.
/// Each shard's replicas over the voters (empty while the cluster's shards are not fixed).
pub fn shard_map(
    machine: &MetaStateMachine,
    metrics: &levee_cluster::network::RaftMetrics,
    shards: &ShardSlot,
) -> Vec<ShardPlacement> {
    let voters: Vec<u64> = metrics.membership_config.membership().voter_ids().collect();
    let groups: BTreeMap<u32, levee_cluster::shard::groups::ShardStatus> = shards
        .get()
        .map(|groups| {
            groups
                .status()
                .into_iter()
                .map(|group| (group.shard, group))
                .collect()
        })
        .unwrap_or_default();
    (0..machine.shards().unwrap_or(0))
        .map(|shard| ShardPlacement {
            shard,
            replicas: levee_proto::shards::replicas(shard, &voters),
            leader_id: groups
                .get(&shard)
                .and_then(|group| group.leader)
                .unwrap_or(0),
            voters: groups
                .get(&shard)
                .map(|group| group.voters.clone())
                .unwrap_or_default(),
            changing: groups.get(&shard).is_some_and(|group| group.changing),
        })
        .collect()
}

fn members(
    metrics: &levee_cluster::network::RaftMetrics,
    health: &BTreeMap<NodeId, bool>,
) -> Vec<Member> {
    let membership = metrics.membership_config.membership();
    let last_log_index = metrics.last_log_index.unwrap_or(0);
    membership
        .nodes()
        .map(|(id, node)| {
            let role = if Some(*id) == metrics.current_leader {
                MemberRole::Leader
            } else if membership.voter_ids().any(|voter| voter == *id) {
                MemberRole::Voter
            } else {
                MemberRole::Learner
            };
            let lag_entries = metrics
                .replication
                .as_ref()
                .and_then(|replication| replication.get(id))
                .map(|matched| last_log_index.saturating_sub(matched.map_or(0, |log| log.index)));
            Member {
                node_id: *id,
                role: role.into(),
                grpc_addr: node.grpc_addr.clone(),
                admin_addr: node.admin_addr.clone(),
                peer_addr: node.peer_addr.clone(),
                healthy: health.get(id).copied().unwrap_or(false),
                lag_entries,
            }
        })
        .collect()
}

/// A refusal as a wire error.
fn wire(refusal: Refusal) -> Status {
    let code = match refusal.kind {
        RefusalKind::NotFound => ErrorCode::NotFound,
        RefusalKind::AlreadyExists => ErrorCode::AlreadyExists,
        RefusalKind::FailedPrecondition => ErrorCode::FailedPrecondition,
        RefusalKind::NotLeader | RefusalKind::Unavailable | RefusalKind::NotCaughtUp => {
            ErrorCode::Unavailable
        }
    };
    WireError::new(code, refusal.message).into()
}

fn invalid(message: String) -> Status {
    WireError::new(ErrorCode::InvalidArgument, message).into()
}

/// Checks that `value`, the field `field`, is a host:port address.
fn check_address(field: &str, value: &str) -> Result<(), Status> {
    let valid = value
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    if valid {
        Ok(())
    } else {
        Err(invalid(format!(
            "{field}: expected host:port, got {value:?}; give the address the node was started \
             with"
        )))
    }
}

#[tonic::async_trait]
impl Cluster for ClusterService {
    async fn get_cluster(
        &self,
        _request: Request<GetClusterRequest>,
    ) -> Result<Response<GetClusterResponse>, Status> {
        let metrics = self.manager.raft().metrics().borrow().clone();
        let health = self.health.borrow().clone();
        Ok(Response::new(GetClusterResponse {
            cluster_id: self.manager.cluster_id(),
            node_id: self.state.cluster.node_id,
            leader_id: metrics.current_leader.unwrap_or(0),
            term: metrics.current_term,
            last_log_index: metrics.last_log_index.unwrap_or(0),
            applied_index: metrics.last_applied.map_or(0, |log_id| log_id.index),
            members: members(&metrics, &health),
            shards: self.machine.shards().unwrap_or(0),
            shard_map: shard_map(&self.machine, &metrics, &self.shards),
            replicated_queues: self.machine.replicated_queues(),
        }))
    }

    type WatchMembersStream = ReceiverStream<Result<WatchMembersResponse, Status>>;

    async fn watch_members(
        &self,
        _request: Request<WatchMembersRequest>,
    ) -> Result<Response<Self::WatchMembersStream>, Status> {
        let (sender, receiver) = mpsc::channel(WATCH_QUEUE);
        let mut metrics = self.manager.raft().metrics();
        let mut health = self.health.clone();
        let mut closing = self.closing.clone();
        tokio::spawn(async move {
            let mut last: Option<WatchMembersResponse> = None;
            loop {
                let current = {
                    let metrics = metrics.borrow_and_update().clone();
                    WatchMembersResponse {
                        leader_id: metrics.current_leader.unwrap_or(0),
                        members: members(&metrics, &health.borrow_and_update()),
                    }
                };
                if last.as_ref() != Some(&current) {
                    if sender.send(Ok(current.clone())).await.is_err() {
                        return;
                    }
                    last = Some(current);
                }
                tokio::select! {
                    changed = metrics.changed() => if changed.is_err() { break },
                    changed = health.changed() => if changed.is_err() { break },
                    () = sender.closed() => return,
                    _ = closing.wait_for(|closing| *closing) => break,
                }
            }
            let _ = sender
                .send(Err(WireError::new(
                    ErrorCode::Unavailable,
                    "the server is shutting down; follow the members already learnt",
                )
                .into()))
                .await;
        });
        Ok(Response::new(ReceiverStream::new(receiver)))
    }

    async fn add_node(
        &self,
        request: Request<AddNodeRequest>,
    ) -> Result<Response<AddNodeResponse>, Status> {
        let request = request.into_inner();
        if request.node_id == 0 {
            return Err(invalid(
                "node_id: 0 is not a node id; give the --node-id the node was started with"
                    .to_owned(),
            ));
        }
        check_address("peer_addr", &request.peer_addr)?;
        check_address("grpc_addr", &request.grpc_addr)?;
        check_address("admin_addr", &request.admin_addr)?;
        let my_peer = {
            let metrics = self.manager.raft().metrics().borrow().clone();
            metrics
                .membership_config
                .membership()
                .get_node(&metrics.id)
                .map(|node| node.peer_addr.clone())
                .unwrap_or_default()
        };
        if my_peer.is_empty() {
            return Err(wire(Refusal {
                kind: RefusalKind::FailedPrecondition,
                message: "this server has no peer port, so no other node can reach it; restart \
                          it with --peer-addr to grow a cluster"
                    .to_owned(),
                leader_peer_addr: None,
            }));
        }
        let joined = self
            .manager
            .add(&JoinRequest {
                node_id: request.node_id,
                node: NodeInfo {
                    grpc_addr: request.grpc_addr,
                    admin_addr: request.admin_addr,
                    peer_addr: request.peer_addr,
                },
                voter: Some(!request.learner),
                cluster_id: None,
            })
            .await
            .map_err(wire)?;
        let role = if joined.voter {
            MemberRole::Voter
        } else {
            MemberRole::Learner
        };
        Ok(Response::new(AddNodeResponse { role: role.into() }))
    }

    async fn remove_node(
        &self,
        request: Request<RemoveNodeRequest>,
    ) -> Result<Response<RemoveNodeResponse>, Status> {
        self.manager
            .remove(request.into_inner().node_id)
            .await
            .map_err(wire)?;
        Ok(Response::new(RemoveNodeResponse {}))
    }
}

/// The Cluster service, its member probes (and what they find, for others to read) and the
/// count of leader changes, which stop (and its streams end) when `closing` turns true.
pub fn serve(
    (manager, machine, shards): (&Manager, &MetaStateMachine, &ShardSlot),
    state: &Arc<ServerState>,
    closing: &watch::Sender<bool>,
) -> (
    ClusterServer<ClusterService>,
    Vec<tokio::task::JoinHandle<()>>,
    MemberHealth,
) {
    let (health, probe_task) =
        probe_members(manager.clone(), Arc::clone(state), closing.subscribe());
    let members_health = health.clone();
    let count_task = tokio::spawn(count_leader_changes(
        manager.clone(),
        state.metrics.cluster_leader_changes.clone(),
        closing.subscribe(),
    ));
    let service = ClusterService::new(
        (manager.clone(), machine.clone(), shards.clone()),
        Arc::clone(state),
        health,
        closing.subscribe(),
    );
    (
        ClusterServer::new(service),
        vec![probe_task, count_task],
        members_health,
    )
}

/// Probes every other member's API every [`PROBE_INTERVAL`] until `stop` turns true, and says
/// who answered; this node counts as healthy while `state` is ready.
pub fn probe_members(
    manager: Manager,
    state: Arc<ServerState>,
    mut stop: watch::Receiver<bool>,
) -> (MemberHealth, tokio::task::JoinHandle<()>) {
    let (sender, receiver) = watch::channel(BTreeMap::new());
    let task = tokio::spawn(async move {
        let mut channels: HashMap<String, Channel> = HashMap::new();
        let mut ticker = tokio::time::interval(PROBE_INTERVAL);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.wait_for(|stop| *stop) => return,
            }
            let metrics = manager.raft().metrics().borrow().clone();
            let nodes: Vec<(NodeId, String)> = metrics
                .membership_config
                .membership()
                .nodes()
                .map(|(id, node)| (*id, node.grpc_addr.clone()))
                .collect();
            channels.retain(|address, _| nodes.iter().any(|(_, known)| known == address));
            let probes = nodes.into_iter().map(|(id, address)| {
                let channel = if id == metrics.id {
                    None
                } else {
                    channel_to(&mut channels, &address, PROBE_TIMEOUT)
                };
                let ready = state.is_ready();
                async move {
                    let healthy = match channel {
                        None => id == metrics.id && ready,
                        Some(channel) => probe(channel).await,
                    };
                    (id, healthy)
                }
            });
            let health: BTreeMap<NodeId, bool> = futures_util::future::join_all(probes)
                .await
                .into_iter()
                .collect();
            sender.send_if_modified(|known| {
                let changed = *known != health;
                *known = health;
                changed
            });
        }
    });
    (receiver, task)
}

/// A lazily connected channel to `address` (connecting within `timeout`), made once and kept
/// in `channels`.
pub(crate) fn channel_to(
    channels: &mut HashMap<String, Channel>,
    address: &str,
    timeout: Duration,
) -> Option<Channel> {
    if let Some(channel) = channels.get(address) {
        return Some(channel.clone());
    }
    let channel = Channel::from_shared(format!("http://{address}"))
        .ok()?
        .connect_timeout(timeout)
        .connect_lazy();
    channels.insert(address.to_owned(), channel.clone());
    Some(channel)
}

/// Whether the API behind `channel` answers within [`PROBE_TIMEOUT`].
async fn probe(channel: Channel) -> bool {
    let mut client = AdminClient::new(channel);
    let call = client.get_server_info(GetServerInfoRequest {});
    matches!(tokio::time::timeout(PROBE_TIMEOUT, call).await, Ok(Ok(_)))
}

/// Counts changes of the leader this node knows into `leader_changes` until `stop` turns true (an
/// election that ends with the same leader is not a change; a spell without a leader is not
/// one either).
async fn count_leader_changes(
    manager: Manager,
    leader_changes: prometheus_client::metrics::counter::Counter,
    mut stop: watch::Receiver<bool>,
) {
    let mut metrics = manager.raft().metrics();
    let mut leader = metrics.borrow_and_update().current_leader;
    loop {
        tokio::select! {
            changed = metrics.changed() => if changed.is_err() { return },
            _ = stop.wait_for(|stop| *stop) => return,
        }
        let now = metrics.borrow_and_update().current_leader;
        if let Some(now) = now {
            if leader.is_some_and(|before| before != now) {
                leader_changes.inc();
            }
            leader = Some(now);
        }
    }
}
