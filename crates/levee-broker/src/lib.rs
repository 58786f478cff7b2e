//! Levee's broker engine: the decisions of topics, consumer groups and their flow control as a
//! deterministic state machine with no networking, no threads and no clock. A call takes its
//! input and the current time; what it returns is the whole decision. The server
//! (`levee-server`) owns sockets, the store, clocks and tasks, and carries the decisions out;
//! a cluster will run the same calls on every replica from a replicated log.
//!
//! The parts, and how data flows through them:
//!
//! - [`names`]: every name rule and bound, and every reserved (`\0`-prefixed) queue name.
//!   Requests are checked here first.
//! - [`catalog`]: what operators set: topics, group and producer rates, retention rules.
//!   `decide(command)` gives the record to log; once the runtime has logged it durably,
//!   `apply(record)` changes the state. Replaying the log rebuilds the same catalog.
//! - [`group`]: one consumer group on one topic: joins, leases, sticky rebalancing, epochs
//!   that fence stale owners, committed offsets that only move forward. The runtime logs the
//!   committed snapshot after each accepted commit batch and tells members their assignment.
//! - [`position`]: mailbox positions: each consumer's position on each queue, the records
//!   acks write, and the book a log of them replays into (the largest position wins).
//! - [`producer`]: idempotent producers: each one's recent runs, and the judgement of a
//!   request's sequences against them (new, a resend, or refused).
//! - [`rate`]: the token bucket that paces a group's deliveries and a producer's appends.
//! - [`retry`]: a group's retry policy, the decision for each failed message (retry after a
//!   delay, or dead-letter) and the record a retried or dead message travels in.
//! - [`delay`]: where messages that must wait (retries, delayed publishes) wait: slots of
//!   due times, each a store queue, and the wheel that says which are due.
//!
//! Dependencies: `levee-store` for its bounds and retention type only; never tonic, prost
//! types or tokio.

#![deny(missing_docs)]

pub mod catalog;
pub mod delay;
pub mod group;
pub mod names;
pub mod position;
pub mod producer;
pub mod rate;
pub mod retry;
