//! One running server: opens the data directory, binds the gRPC and admin listeners, serves
//! both until told to stop, then drains in-flight requests within a grace period and closes
//! storage.

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use levee_proto::v1::admin_server::AdminServer;
use levee_proto::v1::cluster_server::ClusterServer;
use levee_proto::v1::hot_keys_server::HotKeysServer;
use levee_proto::v1::queues_server::QueuesServer;
use levee_proto::v1::topics_server::TopicsServer;
use levee_store::{OpenError, Store, StoreOptions};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::admin_http;
use crate::admin_service::AdminService;
use crate::cluster_service::{self, ClusterService};
use crate::config::Config;
use crate::connection::accept_connections;
use crate::data_dir::{DataDir, DataDirError};
use crate::grpc_metrics::GrpcMetricsLayer;
use crate::hotkey::admin::HotKeyAdmin;
use crate::hotkey::hub::HotKeyHub;
use crate::hotkey::observer::HubObserver;
use crate::hotkey::rules_file::RulesFileError;
use crate::hotkey::service::HotKeyService;
use crate::hotkey::{self, TICK_INTERVAL};
use crate::metrics::Metrics;
use crate::queue::STORE_DIR_NAME;
use crate::queue::StoreCalls;
use crate::queue::limits::group_rate::Pacers;
use crate::queue::limits::producer_rate::ProducerRates;
use crate::queue::mailbox::position_log::PositionLogs;
use crate::queue::retention::{self, POSITION_TRIM_INTERVAL};
use crate::queue::service::QueueService;
use crate::queue::topic::catalog::{Topics, legacy_records};
use crate::queue::topic::consume::ConsumeContext;
use crate::queue::topic::group::Groups;
use crate::queue::topic::service::TopicService;
use crate::queue::waiters::Waiters;
use crate::state::ServerState;
use levee_broker::names::META_QUEUE;
use levee_cluster::join::join;
use levee_cluster::manage::{JoinRequest, Joined, check_same_cluster};
use levee_cluster::{
    LeaveNotice, LogStore, Manager, MetaCommand, MetaStateMachine, MetaWriter, NodeInfo,
    PeerNetwork, PeerService, Raft, network::PeerDialer, shard::ShardSlot,
};
use std::collections::BTreeMap;

/// How often consumer-group leases are checked (the shortest lease is 1 s).
const LEASE_CHECK_INTERVAL: Duration = Duration::from_millis(250);
const _: () = assert!(
    LEASE_CHECK_INTERVAL.as_millis() * 4 <= crate::queue::topic::consume::LEASE_MS_MIN as u128,
    "a lease is checked at least four times within the shortest lease"
);
/// Most concurrent gRPC streams on one connection (HTTP/2 `MAX_CONCURRENT_STREAMS`).
pub const STREAMS_PER_CONNECTION_MAX: u32 = 1_024;
/// Largest gRPC message the queue service takes or sends (an append of many messages).
pub(crate) const GRPC_MESSAGE_BYTES_MAX: usize = 16 << 20;
/// How often an idle HTTP/2 connection is pinged to detect dead peers.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long a keepalive ping may go unanswered before the connection is closed.
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the server could not start. Each message is one line naming the problem and the fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The data directory cannot be used.
    #[error(transparent)]
    DataDir(#[from] DataDirError),
    /// The saved hot-key rules cannot be read.
    #[error(transparent)]
    HotKeyRules(#[from] RulesFileError),
    /// The queue store cannot be opened.
    #[error("queue store {path}: {source}", path = path.display())]
    Store {
        /// The store's directory.
        path: std::path::PathBuf,
        /// What the store said.
        source: OpenError,
    },
    /// The metadata group (its log, state or start) failed.
    #[error(
        "metadata group in {path}: {message}; restore the data dir from a backup, or move it \
         away to start a new node",
        path = path.display()
    )]
    Metadata {
        /// The group's directory.
        path: std::path::PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A thread could not be started.
    #[error("cannot start a thread ({0}); raise the process's thread or memory limits")]
    Thread(std::io::Error),
    /// Another process listens on the address.
    #[error(
        "{listener} address {address} is already in use by another process; stop that process \
         or choose another address with {flag}"
    )]
    AddressInUse {
        /// `gRPC` or `admin HTTP`.
        listener: &'static str,
        /// The address.
        address: SocketAddr,
        /// The flag that sets it.
        flag: &'static str,
    },
    /// The address cannot be bound for another reason.
    #[error("cannot listen on {listener} address {address} ({source}); choose another with {flag}")]
    Bind {
        /// `gRPC` or `admin HTTP`.
        listener: &'static str,
        /// The address.
        address: SocketAddr,
        /// The flag that sets it.
        flag: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// How a shutdown ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownOutcome {
    /// Every in-flight request finished within the grace period.
    Drained,
    /// The grace period passed; requests still running were cut off.
    GraceExpired,
}

/// A server that is serving. Stop it with [`RunningServer::shutdown`].
#[derive(Debug)]
pub struct RunningServer {
    state: Arc<ServerState>,
    data_dir: DataDir,
    health: HealthReporter,
    stop_grpc: watch::Sender<bool>,
    stop_admin: watch::Sender<bool>,
    stop_sessions: watch::Sender<bool>,
    /// Tasks that run until `stop_sessions`: the hot-key tick, retention, leases, member
    /// probes, following the catalog.
    background: Vec<JoinHandle<()>>,
    raft: MetadataGroup,
    store: Arc<Store>,
    grpc_task: JoinHandle<Result<(), tonic::transport::Error>>,
    admin_task: JoinHandle<std::io::Result<()>>,
    peer_addr: Option<SocketAddr>,
}

impl RunningServer {
    /// Opens storage, binds both listeners and starts serving. Fails fast, before serving
    /// anything, if any of them cannot be had.
    pub async fn start(config: &Config) -> Result<Self, StartError> {
        let data_dir = DataDir::open(&config.data_dir)?;
        let mut cluster = data_dir.identity(config.node_id)?;
        let metrics = Metrics::new();
        let shard_count = std::thread::available_parallelism().map_or(1, usize::from);
        let hub = Arc::new(HotKeyHub::open(config, shard_count).with_metrics(metrics.clone()));
        let grpc_listener = bind("gRPC", config.grpc_addr.0, "--grpc-addr").await?;
        let admin_listener = bind("admin HTTP", config.admin_addr.0, "--admin-addr").await?;
        let grpc_addr = grpc_listener.local_addr().unwrap_or(config.grpc_addr.0);
        let admin_addr = admin_listener.local_addr().unwrap_or(config.admin_addr.0);
        let (peer_listener, peer_addr, me) = bind_peer(config, grpc_addr, admin_addr).await?;
        // Recovery may take a while: it runs after the cheap checks above have passed.
        let store = Arc::new(open_store(config).await?);
        metrics.attach_store(&store);
        let opened = (&data_dir, &mut cluster);
        let (raft, topics) =
            open_metadata((&store, &hub), config, opened, me, peer_listener).await?;
        let hotkey_admin = raft.hotkey_admin(&hub);
        metrics.attach_raft(&raft.raft);
        let state = Arc::new(ServerState::new(
            grpc_addr,
            admin_addr,
            data_dir.path().to_path_buf(),
            cluster,
            metrics,
        ));

        let (stop_grpc, _) = watch::channel(false);
        let (stop_admin, _) = watch::channel(false);
        let (stop_sessions, _) = watch::channel(false);
        let mut background = vec![tokio::spawn(tick(
            Arc::clone(&hub),
            stop_sessions.subscribe(),
        ))];
        let cluster = (&raft.manager, &raft.machine, &raft.shards);
        let (cluster_service, cluster_tasks, members_health) =
            cluster_service::serve(cluster, &state, &stop_sessions);
        background.extend(cluster_tasks);
        let (health, health_service) = serving_health().await;
        let (queue_service, topic_service, consume_context, apply_here) = queue_services(
            (&store, &raft, members_health),
            topics,
            config,
            &state.metrics,
            &stop_sessions,
        )?;
        let shards = (&store, apply_here);
        background.extend(raft.spawn_shards(config, shards, &stop_sessions));
        background.push(tokio::spawn(crate::queue::limits::follow_catalog(
            Arc::clone(&consume_context),
            raft.raft.metrics(),
            stop_sessions.subscribe(),
        )));
        background.extend(group_tasks(&consume_context, &stop_sessions));
        let hotkey_service = HotKeyService::new(
            hotkey_admin.clone(),
            state.metrics.clone(),
            stop_sessions.subscribe(),
        );

        let limits = raft.limits_service(&hub, &state.metrics, stop_sessions.subscribe());
        background.push(limits.follow_peer_hot_keys(stop_sessions.subscribe()));
        let incoming =
            accept_connections(grpc_listener, config.connections_max, state.metrics.clone());
        let grpc_server = tonic::transport::Server::builder()
            .max_concurrent_streams(Some(STREAMS_PER_CONNECTION_MAX))
            .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
            .layer(GrpcMetricsLayer::new(state.metrics.clone()))
            .add_service(health_service)
            .add_service(AdminServer::new(AdminService::new(Arc::clone(&state))))
            .add_service(cluster_service)
            .add_service(limits.clone().grpc())
            .add_service(
                HotKeysServer::new(hotkey_service)
                    .max_decoding_message_size(config.hotkey_report_message_bytes_max()),
            )
            .add_service(queue_service)
            .add_service(topic_service)
            .serve_with_incoming_shutdown(incoming, stopped(stop_grpc.subscribe()));
        let grpc_task = tokio::spawn(grpc_server);

        let admin_router = admin_router(&state, &raft, (hotkey_admin, limits), consume_context);
        let admin_server = axum::serve(admin_listener, admin_router)
            .with_graceful_shutdown(stopped(stop_admin.subscribe()));
        let admin_task = tokio::spawn(async move { admin_server.await });

        state.set_ready(true);
        log_ready(&state, peer_addr);
        Ok(Self {
            state,
            data_dir,
            health,
            stop_grpc,
            stop_admin,
            stop_sessions,
            background,
            raft,
            store,
            grpc_task,
            admin_task,
            peer_addr,
        })
    }

    /// The bound gRPC address (the real port when configured with port 0).
    pub fn grpc_addr(&self) -> SocketAddr {
        self.state.grpc_addr
    }

    /// The bound admin HTTP address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.state.admin_addr
    }

    /// The bound peer (Raft) address, when the server was given `--peer-addr`.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer_addr
    }

    /// Completes only if a listener task stops on its own, which is a fatal error.
    /// Also completes when the cluster's leader removed this node, which then stops serving
    /// (and records the removal in its data dir, so that it does not serve again unless added
    /// back with `--join`).
    pub async fn failed(&mut self) -> String {
        let left = &mut self.raft.left;
        let notice = tokio::select! {
            result = &mut self.grpc_task => return format!("gRPC server stopped: {result:?}"),
            result = &mut self.admin_task => {
                return format!("admin HTTP server stopped: {result:?}");
            }
            Ok(notice) = left.wait_for(Option::is_some) => {
                notice.clone().unwrap_or_else(|| unreachable!("waited for Some"))
            }
        };
        let identity = crate::data_dir::ClusterIdentity {
            removed: true,
            ..self.state.cluster.clone()
        };
        if let Err(error) = self.data_dir.write_identity(&identity) {
            tracing::error!(%error, "cannot record the removal in the data dir");
        }
        self.raft.drain_shards().await;
        format!(
            "node {} was removed from cluster {} by leader {}; it stops serving. Start it with \
             --join <a member's peer address> to add it back",
            notice.node_id, notice.cluster_id, notice.leader_id
        )
    }

    /// Stops accepting, lets in-flight requests finish within `grace`, then closes storage.
    ///
    /// The admin port keeps answering while the gRPC port drains, so `/readyz` says 503 (not
    /// "connection refused") to load balancers for the whole drain.
    pub async fn shutdown(self, grace: Duration) -> ShutdownOutcome {
        let Self {
            state,
            data_dir,
            health,
            stop_grpc,
            stop_admin,
            stop_sessions,
            background,
            raft,
            store,
            mut grpc_task,
            mut admin_task,
            peer_addr: _,
        } = self;
        state.set_ready(false);
        health
            .set_service_status("", ServingStatus::NotServing)
            .await;
        health.set_not_serving::<AdminServer<AdminService>>().await;
        health
            .set_not_serving::<HotKeysServer<HotKeyService>>()
            .await;
        // Long-lived sessions end first (app servers reconnect elsewhere), then the drain.
        let _ = stop_sessions.send(true);
        for task in background {
            let _ = task.await;
        }
        if let Err(error) = raft.raft.shutdown().await {
            tracing::warn!(%error, "the metadata group did not stop cleanly");
        }
        let _ = raft.stop_peers.send(true);
        if let Some(peer_task) = raft.peer_task {
            let _ = peer_task.await;
        }
        let _ = stop_grpc.send(true);

        let drained = tokio::time::timeout(grace, async {
            let grpc = (&mut grpc_task).await;
            let _ = stop_admin.send(true);
            let admin = (&mut admin_task).await;
            (grpc, admin)
        })
        .await;
        let outcome = if let Ok((grpc, admin)) = drained {
            if let Ok(Err(error)) = grpc {
                tracing::warn!(%error, "gRPC server ended with an error");
            }
            if let Ok(Err(error)) = admin {
                tracing::warn!(%error, "admin HTTP server ended with an error");
            }
            ShutdownOutcome::Drained
        } else {
            {
                tracing::warn!(
                    grace_ms = grace.as_millis(),
                    "in-flight requests did not finish within the shutdown grace period; \
                     cutting them off"
                );
                grpc_task.abort();
                admin_task.abort();
                ShutdownOutcome::GraceExpired
            }
        };
        close_store(store).await;
        if let Err(error) = data_dir.close() {
            tracing::error!(%error, "closing the data dir failed");
        } else {
            tracing::info!(data_dir = %state.data_dir.display(), "data dir flushed and unlocked");
        }
        outcome
    }
}

/// The line scripts and tests wait for.
fn log_ready(state: &ServerState, peer_addr: Option<SocketAddr>) {
    tracing::info!(
        grpc_addr = %state.grpc_addr,
        admin_addr = %state.admin_addr,
        peer_addr = peer_addr.map(tracing::field::display),
        data_dir = %state.data_dir.display(),
        cluster_id = %state.cluster.cluster_id,
        node_id = state.cluster.node_id,
        "levee server ready"
    );
}

/// The standard gRPC health service, with every Levee service serving.
async fn serving_health() -> (
    HealthReporter,
    tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
) {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<ClusterServer<ClusterService>>().await;
    health.set_serving::<AdminServer<AdminService>>().await;
    health.set_serving::<HotKeysServer<HotKeyService>>().await;
    health.set_serving::<QueuesServer<QueueService>>().await;
    health.set_serving::<TopicsServer<TopicService>>().await;
    (health, health_service)
}

/// The Queues and Topics services, and what consume streams share.
type QueueServices = (
    QueuesServer<QueueService>,
    TopicsServer<TopicService>,
    Arc<ConsumeContext>,
    Arc<crate::queue::replicated::ApplyHere>,
);

/// In a cluster that replicates its queues, a queue's least position epoch is its shard's
/// delete epoch (0 otherwise).
fn shard_delete_epochs(
    store: &Arc<Store>,
    machine: &MetaStateMachine,
) -> crate::queue::mailbox::position_log::EpochFloor {
    let (store, machine) = (Arc::clone(store), machine.clone());
    crate::queue::mailbox::position_log::EpochFloor::new(move |queue| match machine.shards() {
        Some(shards) if machine.replicated_queues() => levee_cluster::shard::plan::delete_epoch(
            &store,
            crate::queue::replicated::shard_of_queue(queue, shards),
        ),
        _ => 0,
    })
}

/// The Queues and Topics services over the store, and what consume streams share.
fn queue_services(
    (store, raft, members_health): (&Arc<Store>, &MetadataGroup, cluster_service::MemberHealth),
    topics: Arc<Topics>,
    config: &Config,
    metrics: &crate::metrics::Metrics,
    stop_sessions: &watch::Sender<bool>,
) -> Result<QueueServices, StartError> {
    let calls =
        StoreCalls::new(Arc::clone(store), config.queue_sync.0).map_err(StartError::Thread)?;
    let waiters = Arc::new(Waiters::default());
    let producer_rates = Arc::new(ProducerRates::new(
        metrics.clone(),
        &topics.producer_rates(),
    ));
    let positions = Arc::new(
        PositionLogs::new(
            Arc::clone(store),
            config.queue_position_log_compact_entries,
            metrics.queue_position_log_compactions.clone(),
        )
        .count_forgets(metrics.queue_position_forgets.clone())
        .with_epoch_floor(shard_delete_epochs(store, &raft.machine)),
    );
    let replication = crate::queue::replicated::Replication::new(
        raft.machine.clone(),
        raft.shards.clone(),
        (raft.raft.metrics(), members_health),
    );
    let queues = QueueService::new(
        calls.clone(),
        Arc::clone(&waiters),
        Arc::clone(&topics),
        Arc::clone(&producer_rates),
        Arc::clone(&positions),
        metrics.clone(),
        stop_sessions.subscribe(),
    )
    .with_replication(replication.clone());
    let delayer = Arc::new(
        crate::queue::delay::Delayer::open(calls.clone(), Arc::clone(&waiters), metrics.clone())
            .with_replication(replication.clone()),
    );
    let consume_context = Arc::new(ConsumeContext {
        calls,
        topics,
        groups: Arc::new(Groups::default()),
        pacers: Arc::new(Pacers::new(metrics.clone())),
        producer_rates,
        waiters,
        delayer,
        dead_letters: std::sync::Mutex::new(()),
        dead_letters_through_shards: tokio::sync::Mutex::new(()),
        replication,
        metrics: metrics.clone(),
        closing: stop_sessions.subscribe(),
    });
    let topic_service = TopicsServer::new(TopicService::new(
        queues.clone(),
        Arc::clone(&consume_context),
    ))
    .max_decoding_message_size(GRPC_MESSAGE_BYTES_MAX)
    .max_encoding_message_size(GRPC_MESSAGE_BYTES_MAX);
    let queue_service = QueuesServer::new(queues)
        .max_decoding_message_size(GRPC_MESSAGE_BYTES_MAX)
        .max_encoding_message_size(GRPC_MESSAGE_BYTES_MAX);
    let apply_here = Arc::new(
        crate::queue::replicated::ApplyHere::new(
            Arc::clone(&consume_context.waiters),
            positions,
            Some(Arc::clone(&consume_context.delayer)),
        )
        .count_snapshots(
            metrics.shard_snapshots_installed.clone(),
            metrics.shard_snapshots_written.clone(),
        )
        .count_positions(
            metrics.shard_positions_writes.clone(),
            metrics.shard_positions_entries.clone(),
        )
        .count_appends(
            metrics.shard_append_requests.clone(),
            metrics.shard_append_entries.clone(),
        )
        .count_peer_streams(metrics.shard_peer_streams_opened.clone())
        .count_leaders_gone(metrics.shard_leaders_gone.clone())
        .time_shards(crate::queue::replicated::ShardTimings {
            log_append: metrics.shard_log_append_seconds.clone(),
            apply_wait: metrics.shard_apply_wait_seconds.clone(),
            apply: metrics.shard_apply_seconds.clone(),
            commit: metrics.shard_commit_seconds.clone(),
        }),
    );
    Ok((queue_service, topic_service, consume_context, apply_here))
}

/// This node's Raft instance of the metadata group, and its peer server (if it has a peer
/// port).
struct MetadataGroup {
    raft: Raft,
    machine: MetaStateMachine,
    writer: MetaWriter,
    /// This start created the cluster (a first node's first start): it fixes the shards.
    created: bool,
    manager: Manager,
    /// Set when the leader removed this node.
    left: watch::Receiver<Option<LeaveNotice>>,
    peer_task: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    stop_peers: watch::Sender<bool>,
    /// This node's shard groups, once opened (a cluster that replicates its queues).
    shards: ShardSlot,
    /// This node's addresses, as the cluster knows them.
    me: NodeInfo,
    /// How this node dials its peers.
    dialer: PeerDialer,
}

/// Longest a removed node keeps its shard replicas running after its removal, until the
/// shards' leaders moved them off it.
const DRAIN_SHARDS_MAX: Duration = Duration::from_secs(10);
/// How long a removed node stays up while some shard may need its vote to move off it (the
/// nodes that stay are no majority of its voters, as when every other replica was removed
/// too) before it stops anyway.
const DRAIN_NEEDED_MAX: Duration = Duration::from_secs(300);
/// How long no shard must have needed a removed node's vote before it stops (past
/// [`DRAIN_SHARDS_MAX`]): longer than a shard's election.
const NEEDED_GRACE: Duration = Duration::from_secs(2);

impl MetadataGroup {
    /// The voters that stay in the cluster, as this removed node's view of the metadata group
    /// has them: the new voters of the change that removed it (or the voters, once it holds
    /// the change's end), this node left out.
    fn remaining_voters(
        &self,
    ) -> std::collections::BTreeMap<levee_cluster::NodeId, levee_cluster::NodeInfo> {
        let metrics = self.raft.metrics().borrow().clone();
        let membership = metrics.membership_config.membership();
        let voters: std::collections::BTreeSet<levee_cluster::NodeId> = membership
            .get_joint_config()
            .last()
            .cloned()
            .unwrap_or_default();
        voters
            .into_iter()
            .filter(|id| *id != metrics.id)
            .filter_map(|id| membership.get_node(&id).map(|node| (id, node.clone())))
            .collect()
    }

    /// On a node removed from the cluster: keeps its shard replicas running until no shard
    /// counts it as a replica any more (it hands over the shards it leads, the shards' other
    /// leaders move them off it, and a shard whose replicas are this node and one other needs
    /// its vote to do so), or [`DRAIN_SHARDS_MAX`] passed; up to [`DRAIN_NEEDED_MAX`] while a
    /// shard may need its vote to move (`ShardGroups::held_needed`).
    async fn drain_shards(&self) {
        let Some(groups) = self.shards.get() else {
            return;
        };
        let started = tokio::time::Instant::now();
        let held = |groups: &levee_cluster::shard::ShardGroups| {
            (0..groups.shards())
                .filter(|shard| groups.replicates(*shard))
                .count()
        };
        if held(groups) == 0 {
            return;
        }
        tracing::info!(
            shards = held(groups),
            "removed from the cluster: waiting for the shards' replicas here to move to the others"
        );
        let remaining = self.remaining_voters();
        let ids: std::collections::BTreeSet<levee_cluster::NodeId> =
            remaining.keys().copied().collect();
        let mut told = started;
        // When a shard last needed this node: an election under way hides a group's leader
        // for a moment, which must not let the node go.
        let mut last_needed = started;
        loop {
            let needed = groups.held_needed(&ids);
            if !needed.is_empty() {
                last_needed = tokio::time::Instant::now();
            }
            let waited = started.elapsed();
            if held(groups) == 0
                || (waited >= DRAIN_SHARDS_MAX
                    && (last_needed.elapsed() >= NEEDED_GRACE || waited >= DRAIN_NEEDED_MAX))
            {
                break;
            }
            if !needed.is_empty() && told.elapsed() >= DRAIN_SHARDS_MAX {
                told = tokio::time::Instant::now();
                tracing::warn!(
                    shards = ?needed,
                    waited_s = waited.as_secs(),
                    "removed from the cluster, but the nodes that stay are no majority of these \
                     shards' replicas yet: staying up to vote while they move"
                );
            }
            // The shards it leads it hands over itself (first moving those no node that stays
            // holds onto the nodes that stay): the cluster's placement no longer runs here.
            // The others' leaders move the rest off it.
            let handed = tokio::time::timeout(DRAIN_SHARDS_MAX, groups.step_out(&remaining)).await;
            if matches!(handed, Ok(0)) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        tracing::info!(
            shards_left_here = held(groups),
            waited_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            "stopping after the removal"
        );
    }
    /// The Limits service over this group; its lease streams end when `closing` turns true.
    fn limits_service(
        &self,
        hub: &Arc<HotKeyHub>,
        metrics: &Metrics,
        closing: watch::Receiver<bool>,
    ) -> crate::limits::LimitsService {
        crate::limits::LimitsService::new(
            (
                self.machine.clone(),
                self.writer.clone(),
                self.manager.clone(),
            ),
            Arc::clone(hub),
            metrics.clone(),
            closing,
        )
    }

    /// Opens this node's shard groups once the cluster's shards are fixed, if the cluster
    /// replicates its queues, and places their replicas until `stop`; also fixes the cluster's
    /// shards when this start created it (`init_shards`).
    fn spawn_shards(
        &self,
        config: &Config,
        (store, apply_here): (&Arc<Store>, Arc<crate::queue::replicated::ApplyHere>),
        stop: &watch::Sender<bool>,
    ) -> [JoinHandle<()>; 2] {
        let node_id = self.raft.metrics().borrow().id;
        [
            tokio::spawn(init_shards(
                self,
                (config.shards, config.replicated_queues),
                stop.subscribe(),
            )),
            tokio::spawn(crate::queue::replicated::run_shards(
                (self.raft.clone(), self.machine.clone(), self.shards.clone()),
                (
                    node_id,
                    self.me.clone(),
                    self.created,
                    config.shard_snapshot_entries,
                ),
                (
                    config
                        .data_dir
                        .join(crate::queue::replicated::SHARDS_DIR_NAME),
                    Arc::clone(store),
                    apply_here,
                ),
                self.dialer,
                stop.subscribe(),
            )),
        ]
    }

    /// The operator's hot-key calls on `hub`, written through this group.
    fn hotkey_admin(&self, hub: &Arc<HotKeyHub>) -> HotKeyAdmin {
        HotKeyAdmin::new(Arc::clone(hub), self.writer.clone(), self.manager.clone())
    }
}

impl std::fmt::Debug for MetadataGroup {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("MetadataGroup")
    }
}

/// Binds the peer listener, if the configuration names a peer address, and says this node's
/// addresses as the cluster will know them.
async fn bind_peer(
    config: &Config,
    grpc_addr: SocketAddr,
    admin_addr: SocketAddr,
) -> Result<(Option<TcpListener>, Option<SocketAddr>, NodeInfo), StartError> {
    let peer_listener = match config.peer_addr {
        Some(address) => Some(bind("peer", address.0, "--peer-addr").await?),
        None => None,
    };
    let peer_addr = peer_listener
        .as_ref()
        .and_then(|listener| listener.local_addr().ok());
    let advertised = config.peer_advertise_addr.clone();
    let me = NodeInfo {
        grpc_addr: grpc_addr.to_string(),
        admin_addr: admin_addr.to_string(),
        peer_addr: advertised
            .or_else(|| peer_addr.map(|address| address.to_string()))
            .unwrap_or_default(),
    };
    Ok((peer_listener, peer_addr, me))
}

/// Every route of the admin HTTP port, with Levee's JSON errors.
fn admin_router(
    state: &Arc<ServerState>,
    raft: &MetadataGroup,
    (hotkey_admin, limits): (HotKeyAdmin, crate::limits::LimitsService),
    consume_context: Arc<ConsumeContext>,
) -> axum::Router {
    admin_http::router(Arc::clone(state))
        .merge(crate::cluster_http::router(
            raft.raft.clone(),
            raft.machine.clone(),
            raft.shards.clone(),
        ))
        .merge(hotkey::http::router(hotkey_admin))
        .merge(crate::limits::router(limits))
        .merge(crate::queue::http::router(consume_context))
        .fallback(crate::api_error::not_found)
        .layer(axum::middleware::from_fn(crate::api_error::json_errors))
}

/// The metadata group's directory inside the data dir.
pub const RAFT_DIR_NAME: &str = "raft";
/// Longest a lone node waits to lead its own metadata group at start.
const LEAD_WAIT_MAX: Duration = Duration::from_secs(10);

/// Opens this node's metadata group (docs/CLUSTER.md): its log and state machine in the data
/// dir, and its Raft instance. A lone server is a group of one: initialised with itself as
/// the only voter on first start, it leads at once. A catalog kept by an older version in the
/// store's `\0meta` queue is imported into the group once, then the queue is deleted. A node
/// that joins a cluster takes its id, in `cluster.json` too.
async fn open_metadata(
    (store, hub): (&Arc<Store>, &Arc<HotKeyHub>),
    config: &Config,
    (data_dir, cluster): (&DataDir, &mut crate::data_dir::ClusterIdentity),
    me: NodeInfo,
    peer_listener: Option<TcpListener>,
) -> Result<(MetadataGroup, Arc<Topics>), StartError> {
    let directory = config.data_dir.join(RAFT_DIR_NAME);
    let failed = |message: String| StartError::Metadata {
        path: directory.clone(),
        message,
    };
    let log = LogStore::open(&directory.join("log")).map_err(|error| failed(error.to_string()))?;
    // Peer connections leave from the peer listener's own address.
    let dialer = PeerDialer::from(config.peer_addr.map(|address| address.0.ip()));
    let machine = MetaStateMachine::open(&directory.join("state"))
        .map_err(|error| failed(error.to_string()))?
        .with_observer(Arc::new(HubObserver(Arc::clone(hub))));
    let raft_config = openraft::Config {
        cluster_name: cluster.cluster_id.clone(),
        heartbeat_interval: 50,
        election_timeout_min: 150,
        election_timeout_max: 300,
        ..openraft::Config::default()
    }
    .validate()
    .map_err(|error| failed(error.to_string()))?;
    let node_id = cluster.node_id;
    let raft = Raft::new(
        node_id,
        Arc::new(raft_config),
        PeerNetwork::new(dialer),
        log,
        machine.clone(),
    )
    .await
    .map_err(|error| failed(error.to_string()))?;
    // Peers reach this node's Raft before it joins: the leader replicates to it while adding it.
    let (stop_peers, _) = watch::channel(false);
    let mut stopped_peers = stop_peers.subscribe();
    let (cluster_id, told_joiners) = watch::channel(cluster.cluster_id.clone());
    let (left, left_notice) = watch::channel(None);
    let manager = Manager::new(raft.clone(), told_joiners, left).with_dialer(dialer);
    let shard_slot = ShardSlot::default();
    let peer_task = peer_listener.map(|listener| {
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PeerService::server(manager.clone(), shard_slot.clone()))
                .serve_with_incoming_shutdown(
                    // No Nagle delay on peer answers: a small AppendEntries answer held back
                    // for the peer's delayed ACK cost a shard write up to 40 ms.
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                    async move {
                        let _ = stopped_peers.wait_for(|stop| *stop).await;
                    },
                ),
        )
    });
    let mut created = false;
    let joined = join_or_initialize(&raft, (config, dialer), (cluster, &mut created), me.clone())
        .await
        .map_err(failed)?;
    raft.wait(Some(LEAD_WAIT_MAX))
        .metrics(
            |metrics| metrics.current_leader.is_some(),
            "the metadata group has a leader",
        )
        .await
        .map_err(|error| {
            failed(format!(
                "no leader of the metadata group within {} s ({error}); start a majority of the \
                 cluster's nodes",
                LEAD_WAIT_MAX.as_secs()
            ))
        })?;
    let writer = MetaWriter::new(raft.clone()).with_dialer(dialer);
    if let Some(joined) = &joined {
        cluster_id.send_replace(joined.cluster_id.clone());
        cluster.cluster_id.clone_from(&joined.cluster_id);
        cluster.removed = false;
        data_dir.write_identity(cluster)?;
    } else {
        import_legacy(store, &machine, &writer)
            .await
            .map_err(&failed)?;
        import_rules_file(&config.data_dir, &machine, &writer)
            .await
            .map_err(failed)?;
    }
    let group = MetadataGroup {
        raft,
        machine: machine.clone(),
        writer: writer.clone(),
        created,
        manager,
        left: left_notice,
        peer_task,
        stop_peers,
        shards: shard_slot,
        me,
        dialer,
    };
    let topics = Topics::new(group.machine.clone(), writer, group.manager.clone());
    Ok((group, Arc::new(topics)))
}

/// On a node's first start, joins the cluster `--join` names or, without it, initialises a
/// group of one with this node as its only voter (setting `created`). The cluster's id when the
/// node joined.
async fn join_or_initialize(
    raft: &Raft,
    (config, dialer): (&Config, PeerDialer),
    (cluster, created): (&crate::data_dir::ClusterIdentity, &mut bool),
    me: NodeInfo,
) -> Result<Option<Joined>, String> {
    let node_id = cluster.node_id;
    let initialized = raft
        .is_initialized()
        .await
        .map_err(|error| error.to_string())?;
    if cluster.removed && config.join.is_none() {
        return Err(format!(
            "node {node_id} was removed from cluster {}; start it with --join <a member's peer \
             address> to add it back, or with an empty data dir as a new node",
            cluster.cluster_id
        ));
    }
    if initialized && !cluster.removed {
        if let Some(seed) = &config.join {
            let request = JoinRequest {
                node_id,
                node: me,
                voter: None,
                cluster_id: Some(cluster.cluster_id.clone()),
            };
            check_same_cluster(dialer, seed, &request).await?;
        }
        return Ok(None);
    }
    if let Some(seed) = &config.join {
        let request = JoinRequest {
            node_id,
            node: me,
            voter: None,
            // A removed node rejoins the cluster it was removed from; a new one adopts any.
            cluster_id: cluster.removed.then(|| cluster.cluster_id.clone()),
        };
        return join(dialer, seed, &request).await.map(Some);
    }
    raft.initialize(BTreeMap::from([(node_id, me)]))
        .await
        .map_err(|error| error.to_string())?;
    *created = true;
    Ok(None)
}

/// Imports the hot-key rules file an older version kept in the data dir into the group, unless
/// the group has rules already, then removes the file.
async fn import_rules_file(
    data_dir: &std::path::Path,
    machine: &MetaStateMachine,
    writer: &MetaWriter,
) -> Result<(), String> {
    let path = data_dir.join(crate::hotkey::rules_file::RULES_FILE_NAME);
    if !path.exists() {
        return Ok(());
    }
    let apps = crate::hotkey::rules_file::load(data_dir).map_err(|error| error.to_string())?;
    if machine.with_hot_keys(|meta| meta.rules.is_empty()) {
        for (app, rules) in apps {
            let rules = rules
                .iter()
                .map(crate::hotkey::convert::rule_to_record)
                .collect();
            writer
                .write(MetaCommand::SetHotKeyRules { app, rules })
                .await
                .map_err(|error| format!("importing {}: {error}", path.display()))?;
        }
    }
    std::fs::remove_file(&path)
        .and_then(|()| std::fs::File::open(data_dir)?.sync_all())
        .map_err(|error| format!("removing {} once imported: {error}", path.display()))
}

/// On the start that created the cluster, fixes its shards to `shards` (retrying every second
/// until written); on a node of a cluster whose shards differ from its own setting, says so
/// once (the cluster's stand). Only the creating node writes, so the number is always the
/// first node's, and a cluster of an older version (never created by this one) is never
/// written to by a node its other members could not follow.
fn init_shards(
    raft: &MetadataGroup,
    (shards, replicated): (u32, bool),
    mut stop: watch::Receiver<bool>,
) -> impl std::future::Future<Output = ()> + use<> {
    let (machine, writer, created) = (raft.machine.clone(), raft.writer.clone(), raft.created);
    async move {
        loop {
            match machine.shards() {
                Some(fixed) => {
                    if fixed != shards {
                        tracing::warn!(
                            cluster_shards = fixed,
                            setting = shards,
                            "the cluster's shards were fixed when it was created; this node's \
                             `shards` setting is ignored"
                        );
                    }
                    return;
                }
                None if created => {
                    if let Err(error) = writer
                        .write(MetaCommand::InitShards { shards, replicated })
                        .await
                    {
                        tracing::debug!(%error, "fixing the cluster's shards; retrying");
                    }
                }
                // Not replicated here yet, or a cluster created by an older version: wait.
                None => {}
            }
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = stop.wait_for(|stop| *stop) => return,
            }
        }
    }
}

/// Imports a catalog kept by an older version in the store's `\0meta` queue into the group,
/// unless the group already has one, then deletes the queue.
async fn import_legacy(
    store: &Arc<Store>,
    machine: &MetaStateMachine,
    writer: &MetaWriter,
) -> Result<(), String> {
    let legacy_store = Arc::clone(store);
    let legacy = tokio::task::spawn_blocking(move || legacy_records(&legacy_store))
        .await
        .unwrap_or_else(|error| Err(error.to_string()))
        .map_err(|message| format!("the catalog of the \\0meta queue: {message}"))?;
    let Some(records) = legacy else {
        return Ok(());
    };
    if machine.with_catalog(|catalog| catalog.records().is_empty()) {
        let response = writer
            .write(MetaCommand::Import(records))
            .await
            .map_err(|error| error.to_string())?;
        if let Some(error) = response.refused {
            return Err(format!("importing the \\0meta queue: {error}"));
        }
    }
    // Imported now (or before a crash that kept the queue): it is read no more.
    let delete_store = Arc::clone(store);
    tokio::task::spawn_blocking(move || delete_store.delete_queue(META_QUEUE))
        .await
        .map_err(|error| error.to_string())?
        .map(|_deleted| ())
        .map_err(|error| error.to_string())
}

/// Opens (and recovers) the queue store in the data dir, on the blocking pool.
async fn open_store(config: &Config) -> Result<Store, StartError> {
    let path = config.data_dir.join(STORE_DIR_NAME);
    let options = StoreOptions {
        sync: config.queue_sync.0,
        message_bytes_max: config.queue_message_bytes_max as usize,
        // At most 64 GiB (checked by the config), so the shift cannot overflow on 64 bits.
        buffer_budget_bytes: usize::try_from(config.queue_buffer_budget_mb << 20)
            .unwrap_or(usize::MAX),
        ..StoreOptions::default()
    };
    let opening = path.clone();
    let opened = tokio::task::spawn_blocking(move || Store::open(&opening, options)).await;
    let (store, report) = match opened {
        Ok(result) => result.map_err(|source| StartError::Store { path, source })?,
        Err(error) => {
            return Err(StartError::Store {
                path,
                source: OpenError::Io {
                    operation: "opening".to_owned(),
                    source: std::io::Error::other(error.to_string()),
                },
            });
        }
    };
    for tail in &report.truncated {
        tracing::warn!(
            file = %tail.file,
            position = tail.position,
            bytes_dropped = tail.bytes_dropped,
            "queue store: cut a torn or corrupt tail (never acknowledged)"
        );
    }
    tracing::info!(
        queues = report.queues,
        messages = report.messages,
        segments = report.segments,
        recovery_ms = report.elapsed.as_millis(),
        sync = %config.queue_sync.0,
        "queue store opened"
    );
    Ok(store)
}

/// Closes the store (its last writes fsynced) if nothing else holds it, else fsyncs it.
async fn close_store(store: Arc<Store>) {
    let closed = tokio::task::spawn_blocking(move || match Arc::try_unwrap(store) {
        Ok(store) => store.close(),
        Err(shared) => shared.sync(),
    })
    .await;
    match closed {
        Ok(Ok(())) => tracing::info!("queue store closed"),
        Ok(Err(error)) => tracing::error!(%error, "closing the queue store failed"),
        Err(error) => tracing::error!(%error, "closing the queue store panicked"),
    }
}

async fn bind(
    listener: &'static str,
    address: SocketAddr,
    flag: &'static str,
) -> Result<TcpListener, StartError> {
    TcpListener::bind(address).await.map_err(|source| {
        if source.kind() == ErrorKind::AddrInUse {
            StartError::AddressInUse {
                listener,
                address,
                flag,
            }
        } else {
            StartError::Bind {
                listener,
                address,
                flag,
                source,
            }
        }
    })
}

async fn tick(hub: Arc<HotKeyHub>, mut stop: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(TICK_INTERVAL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = interval.tick() => hub.tick(),
            _ = stop.wait_for(|stop| *stop) => return,
        }
    }
}

/// Every [`LEASE_CHECK_INTERVAL`] until told to stop: drops consumer-group members whose lease
/// ran out (a stream stuck sending renews nothing), so their partitions move.
/// The queues' background tasks: retention passes, lease expiry and the delivery of waiting
/// messages.
fn group_tasks(
    context: &Arc<ConsumeContext>,
    stop_sessions: &watch::Sender<bool>,
) -> [JoinHandle<()>; 3] {
    [
        tokio::spawn(enforce_retention(
            Arc::clone(context),
            stop_sessions.subscribe(),
        )),
        tokio::spawn(Arc::clone(&context.delayer).run(stop_sessions.subscribe())),
        tokio::spawn(expire_leases(
            Arc::clone(&context.groups),
            stop_sessions.subscribe(),
        )),
    ]
}

async fn expire_leases(groups: Arc<Groups>, mut stop: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(LEASE_CHECK_INTERVAL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = interval.tick() => {
                groups.expire_leases(crate::queue::topic::consume::now_ms());
            }
            _ = stop.wait_for(|stop| *stop) => return,
        }
    }
}

/// Every [`POSITION_TRIM_INTERVAL`] until told to stop: applies the retention rules, trims
/// the server's own log queues (mailbox positions, group commits, producers' runs) and the
/// loaded groups' retry queues below their committed offsets.
async fn enforce_retention(context: Arc<ConsumeContext>, mut stop: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(POSITION_TRIM_INTERVAL);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = stop.wait_for(|stop| *stop) => return,
        }
        let store = Arc::clone(&context.calls.store);
        let now_ms = crate::queue::delay::unix_ms();
        let topics = Arc::clone(&context.topics);
        let retried = context.groups.retry_offsets();
        let trimmed = tokio::task::spawn_blocking(move || {
            retention::enforce_retention(
                &store,
                now_ms,
                |name| topics.retention_for(name).to_store(),
                |name| retried.get(name).copied(),
            )
        })
        .await;
        match trimmed {
            Ok(Ok(removed)) if removed > 0 => {
                tracing::debug!(removed, "retention removed messages");
            }
            Ok(Ok(_)) => {}
            Ok(Err(error)) => tracing::warn!(%error, "enforcing retention failed"),
            Err(error) => tracing::warn!(%error, "enforcing retention panicked"),
        }
    }
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    // An error means the sender is gone, which also means stop.
    let _ = stop.wait_for(|stop| *stop).await;
}
