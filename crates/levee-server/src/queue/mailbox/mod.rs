//! Mailboxes: per-entity queues consumed with acks, each consumer's position durable. It owns:
//!
//! - `subscription`: one consumer's `Subscribe` stream on one queue, and the position queue
//!   that keeps its acks;
//! - `many`: one `SubscribeMany` stream over up to a million queues, one credit, acks batched;
//! - `spread`: a `SubscribeMany` stream on a node holding some shards only, served in parts
//!   by the nodes that hold them;
//! - `position_log`: the per-consumer log of many-queue acks, compacted in generations.

use levee_proto::WireError;
use levee_proto::v1::ErrorCode;

pub mod many;
pub mod position_log;
pub mod spread;
pub mod subscription;

/// The error for an ack of `offset` on `what` (this stream, or one of its mailboxes) where
/// `next` is the next offset to deliver: it acks what was not delivered.
pub(crate) fn ack_past_delivered(what: &str, offset: u64, next: u64) -> WireError {
    let delivered = match next.checked_sub(1) {
        Some(last) => format!("the last delivered offset {last}"),
        None => "what was delivered: nothing yet".to_owned(),
    };
    WireError::new(
        ErrorCode::OffsetOutOfRange,
        format!(
            "ack of offset {offset} on {what} is beyond {delivered}; ack only what was delivered"
        ),
    )
}

/// Looks at the replicated deletes applied since the first `seen`: fails the stream if one of
/// them deleted a queue it reads (`reads`), or if too many came to tell; otherwise the new
/// count of deletes seen.
pub(crate) fn check_not_deleted(
    waiters: &crate::queue::waiters::Waiters,
    seen: u64,
    reads: impl Fn(&[u8]) -> bool,
) -> Result<u64, WireError> {
    let Some((deleted, now)) = waiters.deleted_since(seen) else {
        return Err(WireError::new(
            ErrorCode::Unavailable,
            format!(
                "more than {} queues were deleted in the cluster since this stream last looked; \
                 it cannot tell whether one of its own was: open the stream again",
                crate::queue::waiters::RECENT_DELETES_MAX
            ),
        ));
    };
    match deleted.iter().find(|queue| reads(queue)) {
        Some(queue) => Err(deleted_under_stream(queue)),
        None => Ok(now),
    }
}

/// The error ending a stream whose queue was deleted (through any node of a cluster that
/// replicates its queues) while the stream read it.
pub(crate) fn deleted_under_stream(queue: &[u8]) -> WireError {
    WireError::new(
        ErrorCode::FailedPrecondition,
        format!(
            "queue '{}' was deleted while this stream read it: its messages and the consumer's \
             position on it are gone; open the stream again to read a queue created again \
             under the name, from offset 0",
            String::from_utf8_lossy(queue)
        ),
    )
}
