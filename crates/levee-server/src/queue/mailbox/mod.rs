//! Mailboxes: per-entity queues consumed with acks, each consumer's position durable. It owns:
//!
//! - `subscription`: one consumer's `Subscribe` stream on one queue, and the position queue
//!   that keeps its acks;
//! - `many`: one `SubscribeMany` stream over up to a million queues, one credit, acks batched;
//! - `position_log`: the per-consumer log of many-queue acks, compacted in generations.

use levee_proto::WireError;
use levee_proto::v1::ErrorCode;

pub mod many;
pub mod position_log;
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
