//! [`ShardRoutes`]: where a replicated cluster's plain-queue appends go (docs/CLUSTER.md,
//! "Part 2"). Any node takes any append and forwards each shard's part to the shard's leader;
//! a client that knows the shard map sends each part straight to its leader and saves the hop.
//! The routes come from `GetCluster` (the cluster's shards, whether it replicates its queues,
//! each shard's leader and every member's API address), asked of the seed node and refreshed
//! every [`REFRESH_INTERVAL`] and after a failed append. A cluster that does not replicate its
//! queues, or a route not known yet, sends to the seed node, as without routes.

use std::collections::HashMap;
use std::sync::{PoisonError, RwLock};
use std::time::{Duration, Instant};

use levee_proto::v1::GetClusterResponse;

use crate::client::{Client, ClientOptions};
use crate::error::ClientError;

/// How often a producer's routes are asked for again while it runs.
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(1);
/// How long a connection to a member may take to open (a dead member is given up on soon).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Least time between two refreshes asked for by failures.
const REFRESH_AFTER_FAILURE_MIN: Duration = Duration::from_millis(50);

/// What the routes know.
#[derive(Debug, Default)]
struct Table {
    /// The cluster's shards (0: routes not known, or queues not replicated).
    shards: u32,
    /// Each shard's leader (0: none known).
    leaders: Vec<u64>,
    /// A client per member, by node id (connecting on first use).
    nodes: HashMap<u64, (String, Client)>,
    refreshed: Option<Instant>,
    /// The member that answered the last refresh, when not the seed (a cluster that
    /// replicates its queues only).
    fallback: Option<Client>,
}

/// A replicated cluster's shard leaders, as a client learns them.
#[derive(Debug)]
pub struct ShardRoutes {
    seed: Client,
    options: ClientOptions,
    table: RwLock<Table>,
}

impl ShardRoutes {
    /// Routes learned through `seed` (nothing known until the first [`ShardRoutes::refresh`]).
    pub fn new(seed: Client) -> Self {
        Self {
            seed,
            options: ClientOptions {
                connect_timeout: CONNECT_TIMEOUT,
                ..ClientOptions::default()
            },
            table: RwLock::new(Table::default()),
        }
    }

    /// Asks for the shard map and leaders again: the seed node first, then the other members
    /// known, until one answers.
    pub async fn refresh(&self) -> Result<(), ClientError> {
        let others: Vec<Client> = {
            let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
            table
                .nodes
                .values()
                .map(|(_, client)| client.clone())
                .collect()
        };
        let mut failure = None;
        for (answering, asked) in std::iter::once(&self.seed).chain(&others).enumerate() {
            match asked.cluster().await {
                Ok(cluster) => {
                    self.learn(&cluster, (answering > 0).then(|| asked.clone()));
                    return Ok(());
                }
                Err(error) => failure = Some(error),
            }
        }
        Err(failure.unwrap_or_else(|| unreachable!("the seed was asked")))
    }

    /// Takes what `GetCluster` answered (through `answering`, when not the seed).
    fn learn(&self, cluster: &GetClusterResponse, answering: Option<Client>) {
        let mut table = self.table.write().unwrap_or_else(PoisonError::into_inner);
        table.refreshed = Some(Instant::now());
        if !cluster.replicated_queues || cluster.shards == 0 {
            // Each node's queues are its own: everything goes to the seed, even while it is
            // down (another node would store the messages in queues of its own).
            table.shards = 0;
            table.fallback = None;
            return;
        }
        table.fallback = answering;
        table.shards = cluster.shards;
        table.leaders = vec![0; cluster.shards as usize];
        for placement in &cluster.shard_map {
            if let Some(leader) = table.leaders.get_mut(placement.shard as usize) {
                *leader = placement.leader_id;
            }
        }
        for member in &cluster.members {
            let known = table
                .nodes
                .get(&member.node_id)
                .is_some_and(|(address, _)| *address == member.grpc_addr);
            if known || member.grpc_addr.is_empty() {
                continue;
            }
            match Client::connect_lazy(&member.grpc_addr, &self.options) {
                Ok(client) => {
                    let client = client.with_producer_name_of(&self.seed);
                    table
                        .nodes
                        .insert(member.node_id, (member.grpc_addr.clone(), client));
                }
                Err(error) => tracing::debug!(%error, "a member's address"),
            }
        }
    }

    /// Refreshes after a failed append, unless a refresh ran a moment ago.
    pub async fn refresh_after_failure(&self) {
        let recent = self
            .table
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .refreshed
            .is_some_and(|at| at.elapsed() < REFRESH_AFTER_FAILURE_MIN);
        if !recent && let Err(error) = self.refresh().await {
            tracing::debug!(%error, "refreshing the shard routes");
        }
    }

    /// Whether messages are routed by shard (the cluster replicates its queues and its shard
    /// map is known); when not, every message goes to one node and a batch is not split.
    pub fn routing(&self) -> bool {
        self.table
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .shards
            != 0
    }

    /// The node `queue`'s appends go to and its client: the shard's leader when known, else
    /// (node 0) the node that answered the last refresh, the seed first.
    pub fn route(&self, queue: &[u8]) -> (u64, Client) {
        let table = self.table.read().unwrap_or_else(PoisonError::into_inner);
        let fallback = || (0, table.fallback.as_ref().unwrap_or(&self.seed).clone());
        if table.shards == 0 {
            return fallback();
        }
        let shard = levee_proto::shards::shard_of_bytes(queue, table.shards);
        let leader = table.leaders.get(shard as usize).copied().unwrap_or(0);
        match table.nodes.get(&leader) {
            Some((_, client)) if leader != 0 => (leader, client.clone()),
            _ => fallback(),
        }
    }
}
