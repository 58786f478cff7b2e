//! The peers' transport of the metadata group (docs/CLUSTER.md, ports): openraft's calls over
//! the `levee.peer.v1.Peer` gRPC service on each node's peer port, bodies as JSON of
//! openraft's own request and response types.
//!
//! - [`PeerNetwork`]: openraft's network factory; a [`PeerConnection`] per target node, its
//!   channel made on first use and kept (tonic reconnects it), every call bounded by the time
//!   openraft gives it.
//! - [`PeerService`]: the server side, handing each call to the local [`Raft`], and proposing
//!   the commands other nodes forward (see [`crate::writer`]).

use std::time::Duration;

use levee_proto::peer_v1::PeerMessage;
use levee_proto::peer_v1::peer_client::PeerClient;
use levee_proto::peer_v1::peer_server::{Peer, PeerServer};
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::net::IpAddr;

use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};

use crate::manage::Manager;
use crate::shard::ShardSlot;
use crate::writer::Forwarded;
use crate::{MetaCommand, MetaConfig, NodeId, NodeInfo};
use levee_proto::peer_v1::{ShardFrame, ShardMessage};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::shard::link::serve_frames;

/// The metadata group's Raft instance.
pub type Raft = openraft::Raft<MetaConfig>;
/// What the Raft instance says of itself.
pub type RaftMetrics = openraft::RaftMetrics<NodeId, NodeInfo>;

/// Longest a shard call waits for this node's shard groups to open.
const SHARDS_OPEN_WAIT_MAX: Duration = Duration::from_secs(2);

/// How long a connection to a peer may take to open.
pub const PEER_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// The error of one call to a peer.
pub(crate) type CallError<E> = RPCError<NodeId, NodeInfo, RaftError<NodeId, E>>;

/// How a node opens connections to its peers: from the IP address of its own peer listener
/// (when it listens on one address, not all), so that a peer, a firewall or a fault-injecting
/// proxy sees which node a connection comes from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerDialer {
    local_ip: Option<IpAddr>,
}

impl PeerDialer {
    /// Dials from `listen_ip` (none for an unspecified address such as 0.0.0.0).
    pub fn from(listen_ip: Option<IpAddr>) -> Self {
        Self {
            local_ip: listen_ip.filter(|ip| !ip.is_unspecified()),
        }
    }

    /// A channel to the peer at `address` (host:port), connecting lazily; tonic reconnects it.
    pub fn channel(self, address: &str) -> Result<Channel, String> {
        Ok(Endpoint::from_shared(format!("http://{address}"))
            .map_err(|error| format!("peer address {address}: {error}"))?
            .local_address(self.local_ip)
            .connect_timeout(PEER_CONNECT_TIMEOUT)
            .connect_lazy())
    }
}

/// openraft's network: connections to peers by their peer address.
#[derive(Debug, Default, Clone)]
pub struct PeerNetwork {
    dialer: PeerDialer,
}

impl PeerNetwork {
    /// The network of a node that dials with `dialer`.
    pub fn new(dialer: PeerDialer) -> Self {
        Self { dialer }
    }
}

impl RaftNetworkFactory<MetaConfig> for PeerNetwork {
    type Network = PeerConnection;

    async fn new_client(&mut self, target: NodeId, node: &NodeInfo) -> Self::Network {
        PeerConnection {
            target,
            address: node.peer_addr.clone(),
            dialer: self.dialer,
            client: None,
        }
    }
}

/// One peer, as openraft calls it.
#[derive(Debug)]
pub struct PeerConnection {
    target: NodeId,
    address: String,
    dialer: PeerDialer,
    client: Option<PeerClient<Channel>>,
}

/// A failed peer call as openraft's error: a peer that cannot be reached (openraft backs
/// off), or a network failure.
pub(crate) fn status_error<E: std::error::Error>(status: &Status) -> CallError<E> {
    if status.code() == tonic::Code::Unavailable {
        RPCError::Unreachable(Unreachable::new(status))
    } else {
        RPCError::Network(NetworkError::new(status))
    }
}

/// Which call.
#[derive(Debug, Clone, Copy)]
enum Call {
    AppendEntries,
    Vote,
    InstallSnapshot,
}

impl PeerConnection {
    /// The peer's client, its channel made on first use (connecting lazily).
    fn client<E: std::error::Error>(&mut self) -> Result<PeerClient<Channel>, CallError<E>> {
        if let Some(client) = &self.client {
            return Ok(client.clone());
        }
        let channel = self.dialer.channel(&self.address).map_err(|error| {
            RPCError::Unreachable(Unreachable::new(&std::io::Error::other(error)))
        })?;
        let client = PeerClient::new(channel);
        self.client = Some(client.clone());
        Ok(client)
    }

    async fn call<Req, Resp, E>(
        &mut self,
        call: Call,
        request: &Req,
        option: &RPCOption,
    ) -> Result<Resp, CallError<E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let json = serde_json::to_vec(request)
            .map_err(|error| RPCError::Network(NetworkError::new(&error)))?;
        let mut client = self.client()?;
        let message = PeerMessage { json };
        let answer = tokio::time::timeout(option.hard_ttl(), async move {
            match call {
                Call::AppendEntries => client.append_entries(message).await,
                Call::Vote => client.vote(message).await,
                Call::InstallSnapshot => client.install_snapshot(message).await,
            }
        })
        .await
        .map_err(|elapsed| RPCError::Network(NetworkError::new(&elapsed)))?
        .map_err(|status| status_error(&status))?;
        let result: Result<Resp, RaftError<NodeId, E>> =
            serde_json::from_slice(&answer.into_inner().json)
                .map_err(|error| RPCError::Network(NetworkError::new(&error)))?;
        result.map_err(|error| RPCError::RemoteError(RemoteError::new(self.target, error)))
    }
}

impl RaftNetwork<MetaConfig> for PeerConnection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<MetaConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, CallError<openraft::error::Infallible>> {
        self.call(Call::AppendEntries, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<MetaConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, CallError<InstallSnapshotError>> {
        self.call(Call::InstallSnapshot, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, CallError<openraft::error::Infallible>> {
        self.call(Call::Vote, &rpc, &option).await
    }
}

/// The server side of the peer protocol, over the local Raft.
#[derive(Clone)]
pub struct PeerService {
    raft: Raft,
    manager: Manager,
    shards: ShardSlot,
}

impl std::fmt::Debug for PeerService {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("PeerService")
    }
}

impl PeerService {
    /// The service of `manager`'s Raft instance, for a tonic server on the peer port, and of
    /// the shard groups once `shards` holds them.
    pub fn server(manager: Manager, shards: ShardSlot) -> PeerServer<Self> {
        PeerServer::new(Self {
            raft: manager.raft().clone(),
            manager,
            shards,
        })
        .max_decoding_message_size(crate::shard::groups::PEER_MESSAGE_BYTES_MAX)
    }

    /// A shard call ([`crate::shard::groups::ShardGroups::serve`]), whether it came alone or
    /// on a stream.
    async fn serve_shard(&self, message: ShardMessage) -> Result<ShardMessage, Status> {
        // A node placed on a shard just as it joins may be asked before its groups are open:
        // wait for them a moment rather than send the leader's replication into backoff.
        let started = std::time::Instant::now();
        let groups = loop {
            if let Some(groups) = self.shards.get() {
                break groups;
            }
            if started.elapsed() >= SHARDS_OPEN_WAIT_MAX {
                return Err(Status::unavailable(
                    "this node runs no shard groups yet (starting, or its cluster does not \
                     replicate queues)",
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        groups.serve(message).await
    }
}

/// A request's JSON as openraft's request type.
fn decode<T: DeserializeOwned>(request: Request<PeerMessage>) -> Result<T, Status> {
    serde_json::from_slice(&request.into_inner().json).map_err(|error| {
        Status::invalid_argument(format!(
            "a peer request this node cannot read ({error}); do the cluster's nodes run one \
             version?"
        ))
    })
}

/// An answer as JSON.
fn encode<T: Serialize>(answer: &T) -> Result<Response<PeerMessage>, Status> {
    serde_json::to_vec(answer)
        .map(|json| Response::new(PeerMessage { json }))
        .map_err(|error| Status::internal(format!("cannot encode a peer answer: {error}")))
}

#[tonic::async_trait]
impl Peer for PeerService {
    async fn append_entries(
        &self,
        request: Request<PeerMessage>,
    ) -> Result<Response<PeerMessage>, Status> {
        let answer = self.raft.append_entries(decode(request)?).await;
        encode(&answer)
    }

    async fn vote(&self, request: Request<PeerMessage>) -> Result<Response<PeerMessage>, Status> {
        let answer = self.raft.vote(decode(request)?).await;
        encode(&answer)
    }

    async fn install_snapshot(
        &self,
        request: Request<PeerMessage>,
    ) -> Result<Response<PeerMessage>, Status> {
        let answer = self.raft.install_snapshot(decode(request)?).await;
        encode(&answer)
    }

    async fn join(&self, request: Request<PeerMessage>) -> Result<Response<PeerMessage>, Status> {
        let answer = self.manager.serve_join(decode(request)?).await;
        encode(&answer)
    }

    async fn manage(&self, request: Request<PeerMessage>) -> Result<Response<PeerMessage>, Status> {
        let answer = self.manager.serve_manage(decode(request)?).await;
        encode(&answer)
    }

    async fn leave(&self, request: Request<PeerMessage>) -> Result<Response<PeerMessage>, Status> {
        let answer = self.manager.serve_leave(decode(request)?);
        encode(&answer)
    }

    async fn shard(
        &self,
        request: Request<ShardMessage>,
    ) -> Result<Response<ShardMessage>, Status> {
        self.serve_shard(request.into_inner())
            .await
            .map(Response::new)
    }

    type ShardStreamStream = ReceiverStream<Result<ShardFrame, Status>>;

    async fn shard_stream(
        &self,
        request: Request<Streaming<ShardFrame>>,
    ) -> Result<Response<Self::ShardStreamStream>, Status> {
        let service = self.clone();
        Ok(Response::new(serve_frames(
            request.into_inner(),
            move |message| {
                let service = service.clone();
                async move { service.serve_shard(message).await }
            },
        )))
    }
    async fn forward(
        &self,
        request: Request<PeerMessage>,
    ) -> Result<Response<PeerMessage>, Status> {
        let command: MetaCommand = decode(request)?;
        // Proposed here only: a node that lost the lead since answers so, and the sender
        // tries again with the leader it then knows.
        let answer: Result<Forwarded, String> = self
            .raft
            .client_write(command)
            .await
            .map(|written| Forwarded {
                response: written.data,
                log_index: written.log_id.index,
            })
            .map_err(|error| error.to_string());
        encode(&answer)
    }
}
