//! Mailboxes: per-entity queues consumed with acks, each consumer's position durable. It owns:
//!
//! - `subscription`: one consumer's `Subscribe` stream on one queue, and the position queue
//!   that keeps its acks;
//! - `many`: one `SubscribeMany` stream over up to a million queues, one credit, acks batched;
//! - `position_log`: the per-consumer log of many-queue acks, compacted in generations.

pub mod many;
pub mod position_log;
pub mod subscription;
