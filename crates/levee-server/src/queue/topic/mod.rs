//! Topics and consumer groups over the store. It owns:
//!
//! - `catalog`: topics, rates and retention rules, decided by the broker's catalog and logged
//!   durably in the metadata queue;
//! - `group`: every consumer group, decided by the broker's group coordinator, with their
//!   commit queues and the watch channels that tell members their assignment;
//! - `consume`: one group member's `Consume` stream;
//! - `retry`: failed messages (outcomes into the retry path or the dead letters), dead
//!   letters (list, redrive), retry policies and offset resets;
//! - `service`: the `levee.v1.Topics` gRPC service (create, describe, publish, consume, rates).

pub mod catalog;
pub mod consume;
pub mod group;
pub mod retry;
pub mod service;
