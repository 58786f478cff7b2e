//! [`MetaCommand`]: one entry of the metadata log; [`MetaResponse`]: what applying it
//! answered; [`NodeInfo`]: a member's addresses, as the membership keeps them.

use levee_broker::catalog::{CatalogCommand, CatalogError, CatalogRecord};
use serde::{Deserialize, Serialize};

/// A change to the replicated metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum MetaCommand {
    /// A change of the broker's catalog (topics, rates, retention rules).
    Catalog(CatalogCommand),
    /// The catalog a data dir kept before the cluster (its `\0meta` queue), as records, applied
    /// once into an empty catalog when a node first starts on it.
    Import(Vec<CatalogRecord>),
}

/// What applying one entry did. Entries that carry no command (blank and membership entries)
/// answer the default: nothing changed, nothing refused.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct MetaResponse {
    /// Whether the command changed the state (false for a repeat, such as a topic created
    /// again with its count).
    pub changed: bool,
    /// Why the command was refused, if it was; nothing changed then.
    pub refused: Option<CatalogError>,
}

/// A member of the cluster as the membership records it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Its gRPC API address.
    pub grpc_addr: String,
    /// Its admin HTTP address.
    pub admin_addr: String,
    /// The address its peers reach it at.
    pub peer_addr: String,
}
