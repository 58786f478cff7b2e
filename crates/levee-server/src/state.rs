//! What every service and endpoint of one server shares: its addresses, readiness and metrics.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::data_dir::ClusterIdentity;
use crate::metrics::Metrics;

/// Shared, read-mostly facts about the running server.
#[derive(Debug)]
pub struct ServerState {
    /// When the server started.
    pub started: Instant,
    /// The bound gRPC address.
    pub grpc_addr: SocketAddr,
    /// The bound admin HTTP address.
    pub admin_addr: SocketAddr,
    /// The data directory, as configured.
    pub data_dir: PathBuf,
    /// The cluster this node belongs to, and its node id.
    pub cluster: ClusterIdentity,
    /// The server's metrics.
    pub metrics: Metrics,
    ready: AtomicBool,
}

impl ServerState {
    /// State of a server that is not ready yet.
    pub fn new(
        grpc_addr: SocketAddr,
        admin_addr: SocketAddr,
        data_dir: PathBuf,
        cluster: ClusterIdentity,
        metrics: Metrics,
    ) -> Self {
        Self {
            started: Instant::now(),
            grpc_addr,
            admin_addr,
            data_dir,
            cluster,
            metrics,
            ready: AtomicBool::new(false),
        }
    }

    /// Whether the server accepts work: storage open, listeners bound, not shutting down.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Marks the server ready or not.
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    /// Milliseconds since start.
    pub fn uptime_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}
