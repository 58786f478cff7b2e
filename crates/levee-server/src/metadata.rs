//! The metadata group's writes and linearizable reads as Levee wire errors, one mapping for
//! every service that keeps its settings there (topics, hot keys, limits): no quorum is
//! `UNAVAILABLE` (retry: every metadata command is idempotent), a bound of the replicated state
//! `RESOURCE_EXHAUSTED` naming it.

use levee_cluster::{Manager, MetaCommand, MetaResponse, MetaWriter};
use levee_proto::WireError;
use levee_proto::v1::ErrorCode;

/// Writes `command` through the group; what applying it answered.
pub async fn write(writer: &MetaWriter, command: MetaCommand) -> Result<MetaResponse, WireError> {
    let response = writer
        .write(command)
        .await
        .map_err(|error| WireError::new(ErrorCode::Unavailable, error.to_string()))?;
    match response.refused_at_bound {
        Some(message) => Err(WireError::new(ErrorCode::ResourceExhausted, message)),
        None => Ok(response),
    }
}

/// Waits until this node has applied every metadata write committed before the call, so that
/// what it reads next is linearizable (docs/CLUSTER.md, reads); `UNAVAILABLE` when no leader
/// confirms within 2 s (no quorum).
pub async fn linearize(manager: &Manager) -> Result<(), WireError> {
    manager.linearize().await.map_err(|refusal| {
        WireError::new(
            ErrorCode::Unavailable,
            format!("a linearizable read failed: {refusal}"),
        )
    })
}
