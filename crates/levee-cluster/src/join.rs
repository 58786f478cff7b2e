//! Joining a cluster (docs/CLUSTER.md, forming a cluster): a new node asks a member's peer
//! port to add it ([`join`]); the leader adds it as a learner, waits for it to catch up, then
//! makes it a voter while the voters are fewer than three ([`crate::manage`]). A member that
//! does not lead answers with the leader's peer address, and the new node asks there.

use std::time::{Duration, Instant};

use crate::manage::{JoinRequest, Joined, RefusalKind, Rpc, ask};
use crate::network::PeerDialer;

/// Longest a node tries to join before it gives up.
pub const JOIN_WAIT_MAX: Duration = Duration::from_secs(30);
/// The pause between two tries.
const JOIN_RETRY_PAUSE: Duration = Duration::from_millis(200);

/// On the new node: asks the member at `seed` (a peer address) to add this node, following
/// the leader it names, until added or [`JOIN_WAIT_MAX`] passed.
pub async fn join(dialer: PeerDialer, seed: &str, request: &JoinRequest) -> Result<Joined, String> {
    let started = Instant::now();
    let mut address = seed.to_owned();
    let json = serde_json::to_vec(request).map_err(|error| error.to_string())?;
    loop {
        let reason = match ask::<Joined>(dialer, Rpc::Join, &address, json.clone()).await {
            Ok(joined) => return Ok(joined),
            Err(refusal) if refusal.is_retryable() || refusal.kind == RefusalKind::NotCaughtUp => {
                if let Some(leader) = refusal.leader_peer_addr.filter(|leader| !leader.is_empty()) {
                    address = leader;
                }
                refusal.message
            }
            Err(refusal) => return Err(refusal.message),
        };
        if started.elapsed() >= JOIN_WAIT_MAX {
            return Err(format!(
                "could not join through {seed} within {} s (last: {reason}); check that \
                 --join names a running member's peer address",
                JOIN_WAIT_MAX.as_secs()
            ));
        }
        tokio::time::sleep(JOIN_RETRY_PAUSE).await;
    }
}
