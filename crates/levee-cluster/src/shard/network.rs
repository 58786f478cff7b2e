//! The shard groups' transport (docs/CLUSTER.md, "Part 2"): openraft's calls of every shard
//! over the one `Shard` call of the peer service, requests in postcard (they carry queue
//! data), answers in JSON. [`ShardNetwork`] shares one channel per peer address among all of
//! a node's shards (tonic multiplexes the calls over one HTTP/2 connection).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use levee_proto::Bytes;
use levee_proto::peer_v1::peer_client::PeerClient;
use levee_proto::peer_v1::{ShardCall, ShardMessage};
use openraft::OptionalSend;
use openraft::error::{
    Fatal, InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, ReplicationClosed,
    StreamingError, Unreachable,
};
use openraft::network::snapshot_transport::{Chunked, SnapshotTransport};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::SnapshotResponse;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::transport::Channel;

use crate::network::{CallError, PeerDialer, status_error};
use crate::shard::link::{LINK_CALL_BYTES_MAX, Link};
use crate::shard::machine::ShardObserver;
use crate::shard::watch::Heard;
use crate::shard::{ShardConfig, ShardId, to_postcard};
use crate::{NodeId, NodeInfo};

/// How long a shard's leader waits for a replica's answer to [`ShardCall::Probe`] before a
/// snapshot is sent to it.
const PROBE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Channels to peers by peer address, shared by every shard of a node, and the [`Link`] on
/// each.
#[derive(Clone)]
pub struct PeerChannels {
    dialer: PeerDialer,
    channels: Arc<Mutex<HashMap<String, Channel>>>,
    links: Arc<Mutex<HashMap<String, Links>>>,
    /// [`LINK_RETRY_AFTER`], shorter in tests.
    link_retry_after: Duration,
    /// Told of each stream opened.
    observer: Option<Arc<dyn ShardObserver>>,
    /// Told of each vote request a replica with a longer log refused (`shard::watch`).
    heard: Option<Arc<Heard>>,
}

impl std::fmt::Debug for PeerChannels {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("PeerChannels")
            .field("dialer", &self.dialer)
            .finish_non_exhaustive()
    }
}

/// The link to one peer.
#[derive(Debug)]
enum Links {
    Open(Arc<Link>),
    /// The peer had no `ShardStream` (an older version) when last tried: its calls go one
    /// by one until [`LINK_RETRY_AFTER`] has passed (it may have been upgraded since).
    Unsupported(Instant),
}

/// How long a node calls a peer without `ShardStream` one call at a time before it tries a
/// stream again.
pub const LINK_RETRY_AFTER: Duration = Duration::from_secs(60);

impl PeerChannels {
    /// Channels dialed with `dialer`.
    pub fn new(dialer: PeerDialer) -> Self {
        Self {
            dialer,
            channels: Arc::default(),
            links: Arc::default(),
            link_retry_after: LINK_RETRY_AFTER,
            observer: None,
            heard: None,
        }
    }

    /// Channels that tell `heard` of each vote request a replica with a longer log refused.
    #[must_use]
    pub fn with_heard(self, heard: Arc<Heard>) -> Self {
        Self {
            heard: Some(heard),
            ..self
        }
    }

    /// Channels that tell `observer` of each stream they open.
    #[must_use]
    pub fn with_observer(self, observer: Arc<dyn ShardObserver>) -> Self {
        Self {
            observer: Some(observer),
            ..self
        }
    }

    /// Channels that try a stream again this soon after a peer had none.
    #[cfg(test)]
    pub(crate) fn with_link_retry_after(self, link_retry_after: Duration) -> Self {
        Self {
            link_retry_after,
            ..self
        }
    }

    /// The open link to the peer at `address`, a new one when the last closed; `None` when
    /// the peer has no `ShardStream`.
    pub(crate) fn link(&self, address: &str) -> Result<Option<Arc<Link>>, String> {
        let mut links = self.links.lock().unwrap_or_else(PoisonError::into_inner);
        match links.get(address) {
            Some(Links::Unsupported(since)) if since.elapsed() < self.link_retry_after => {
                return Ok(None);
            }
            Some(Links::Open(link)) if link.closed().is_none() => {
                return Ok(Some(Arc::clone(link)));
            }
            _ => {}
        }
        let link = Link::open(self.client(address)?);
        links.insert(address.to_owned(), Links::Open(Arc::clone(&link)));
        if let Some(observer) = &self.observer {
            observer.peer_stream_opened();
        }
        Ok(Some(link))
    }

    /// Remembers that the peer at `address` has no `ShardStream`.
    fn no_link(&self, address: &str) {
        self.links
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(address.to_owned(), Links::Unsupported(Instant::now()));
    }

    /// The client of the peer at `address`, its channel made on first use (connecting
    /// lazily; tonic reconnects it).
    pub fn client(&self, address: &str) -> Result<PeerClient<Channel>, String> {
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        let channel = if let Some(channel) = channels.get(address) {
            channel.clone()
        } else {
            let channel = self.dialer.channel(address)?;
            channels.insert(address.to_owned(), channel.clone());
            channel
        };
        Ok(PeerClient::new(channel)
            .max_decoding_message_size(crate::shard::groups::PEER_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(crate::shard::groups::PEER_MESSAGE_BYTES_MAX))
    }
}

/// openraft's network of one shard.
#[derive(Debug, Clone)]
pub struct ShardNetwork {
    shard: ShardId,
    channels: PeerChannels,
}

impl ShardNetwork {
    /// Shard `shard`'s network over `channels`.
    pub fn new(shard: ShardId, channels: PeerChannels) -> Self {
        Self { shard, channels }
    }
}

impl RaftNetworkFactory<ShardConfig> for ShardNetwork {
    type Network = ShardConnection;

    async fn new_client(&mut self, target: NodeId, node: &NodeInfo) -> Self::Network {
        ShardConnection {
            target,
            shard: self.shard,
            address: node.peer_addr.clone(),
            channels: self.channels.clone(),
        }
    }
}

/// One peer of one shard, as openraft calls it.
#[derive(Debug)]
pub struct ShardConnection {
    target: NodeId,
    shard: ShardId,
    address: String,
    channels: PeerChannels,
}

/// Sends one shard call to the peer at `address` within `limit` and returns the answer's
/// body: on the peer's [`Link`] when it is small ([`LINK_CALL_BYTES_MAX`]), else (and to a
/// peer without links) as a call of its own. A large call costs little more alone, and on a
/// link the calls behind it would wait for it whole (HTTP/2 interleaves separate calls), a
/// heartbeat past its 50 ms.
pub(crate) async fn send(
    channels: &PeerChannels,
    address: &str,
    (shard, call): (ShardId, ShardCall),
    body: Vec<u8>,
    limit: std::time::Duration,
) -> Result<Bytes, tonic::Status> {
    let message = ShardMessage {
        shard,
        call: call.into(),
        body: body.into(),
    };
    if call != ShardCall::InstallSnapshot
        && message.body.len() <= LINK_CALL_BYTES_MAX
        && let Some(link) = channels.link(address).map_err(tonic::Status::unavailable)?
    {
        match link.call(message.clone(), limit).await {
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                tracing::info!(
                    peer = address,
                    "the peer has no stream of shard calls (an older version): calls go one by one"
                );
                channels.no_link(address);
            }
            answer => return Ok(answer?.body),
        }
    }
    let mut client = channels
        .client(address)
        .map_err(tonic::Status::unavailable)?;
    let answer = tokio::time::timeout(limit, client.shard(message))
        .await
        .map_err(|_| tonic::Status::deadline_exceeded(format!("no answer within {limit:?}")))??;
    Ok(answer.into_inner().body)
}

impl ShardConnection {
    async fn call<Req, Resp, E>(
        &mut self,
        call: ShardCall,
        request: &Req,
        option: &RPCOption,
    ) -> Result<Resp, CallError<E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let body =
            to_postcard(request).map_err(|error| RPCError::Network(NetworkError::new(&error)))?;
        let answer = send(
            &self.channels,
            &self.address,
            (self.shard, call),
            body,
            option.hard_ttl(),
        )
        .await
        .map_err(|status| status_error(&status))?;
        let result: Result<Resp, RaftError<NodeId, E>> = serde_json::from_slice(&answer)
            .map_err(|error| RPCError::Network(NetworkError::new(&error)))?;
        result.map_err(|error| RPCError::RemoteError(RemoteError::new(self.target, error)))
    }
}

/// Bytes of entries (their queue names and payloads, [`crate::shard::ShardCommand::bytes`]) after which an
/// `AppendEntries` call carries no more entries (a larger first entry goes alone). openraft
/// gives each call one heartbeat interval (50 ms) to be answered, so a replica catching up on
/// large entries is sent a few at a time rather than up to
/// `groups::APPEND_ENTRIES_MAX` in one call that could never be answered in time on a busy
/// machine.
pub const APPEND_ENTRIES_BYTES_MAX: usize = 1 << 20;

/// How many of `entries`, from the first, one call carries: those within
/// [`APPEND_ENTRIES_BYTES_MAX`], and at least one.
fn entries_within(entries: &[openraft::Entry<ShardConfig>]) -> usize {
    let mut bytes = 0;
    for (count, entry) in entries.iter().enumerate() {
        if let openraft::EntryPayload::Normal(command) = &entry.payload {
            bytes += command.bytes();
        }
        if bytes > APPEND_ENTRIES_BYTES_MAX {
            return count.max(1);
        }
    }
    entries.len()
}

impl RaftNetwork<ShardConfig> for ShardConnection {
    /// Sends the entries within [`APPEND_ENTRIES_BYTES_MAX`]; when that is not all of them,
    /// a success is told to openraft as a partial one up to the last entry sent, and openraft
    /// sends the rest in the next calls.
    async fn append_entries(
        &mut self,
        mut rpc: AppendEntriesRequest<ShardConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, CallError<openraft::error::Infallible>> {
        let within = entries_within(&rpc.entries);
        if within == rpc.entries.len() {
            return self.call(ShardCall::AppendEntries, &rpc, &option).await;
        }
        rpc.entries.truncate(within);
        let last = rpc.entries.last().map(|entry| entry.log_id);
        let answer = self.call(ShardCall::AppendEntries, &rpc, &option).await?;
        Ok(match answer {
            AppendEntriesResponse::Success => AppendEntriesResponse::PartialSuccess(last),
            other => other,
        })
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<ShardConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, CallError<InstallSnapshotError>> {
        self.call(ShardCall::InstallSnapshot, &rpc, &option).await
    }

    /// Asks the target first ([`ShardCall::Probe`], within [`PROBE_WAIT`]): a snapshot's
    /// file is written only when first read, so a replica that is down or cut off costs no
    /// file (openraft backs off and asks again). Then openraft's chunked transfer.
    async fn full_snapshot(
        &mut self,
        vote: openraft::Vote<NodeId>,
        snapshot: openraft::Snapshot<ShardConfig>,
        cancel: impl std::future::Future<Output = ReplicationClosed> + OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<NodeId>, StreamingError<ShardConfig, Fatal<NodeId>>> {
        if let Err(status) = send(
            &self.channels,
            &self.address,
            (self.shard, ShardCall::Probe),
            Vec::new(),
            PROBE_WAIT,
        )
        .await
        {
            return Err(StreamingError::Unreachable(Unreachable::new(&status)));
        }
        Chunked::send_snapshot(self, vote, snapshot, cancel, option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> Result<VoteResponse<NodeId>, CallError<openraft::error::Infallible>> {
        let answer: VoteResponse<NodeId> = self.call(ShardCall::Vote, &rpc, &option).await?;
        if !answer.vote_granted
            && answer.last_log_id > rpc.last_log_id
            && let Some(heard) = &self.channels.heard
        {
            heard.outlogged(self.shard);
        }
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId};

    use super::*;
    use crate::shard::{QueueMessage, ShardCommand};

    fn entry(index: u64, payload_bytes: usize) -> Entry<ShardConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(ShardCommand::Append {
                producer: None,
                messages: vec![QueueMessage {
                    queue: Bytes::from_static(b"q"),
                    payload: Bytes::from(vec![0_u8; payload_bytes]),
                    sequence: 0,
                }],
            }),
        }
    }

    #[test]
    fn given_entries_over_the_bound_then_a_call_carries_a_prefix_within_it_and_at_least_one() {
        let quarter = APPEND_ENTRIES_BYTES_MAX / 4;
        let small: Vec<_> = (1..=3).map(|index| entry(index, quarter)).collect();
        assert_eq!(entries_within(&small), 3);
        let many: Vec<_> = (1..=6).map(|index| entry(index, quarter)).collect();
        assert_eq!(
            entries_within(&many),
            3,
            "4 quarters plus 4 queue-name bytes are over"
        );
        let large = [entry(1, 3 * APPEND_ENTRIES_BYTES_MAX), entry(2, 1)];
        assert_eq!(entries_within(&large), 1, "a large first entry goes alone");
        let blank = [Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), 1),
            payload: EntryPayload::Blank,
        }];
        assert_eq!(entries_within(&blank), 1);
        assert_eq!(entries_within(&[]), 0);
    }
}
