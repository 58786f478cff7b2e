//! Flow control enforced on the server's streams and appends; the limits themselves are set
//! through the broker's catalog (logged, replayed on start) and their pacing is the broker's
//! token bucket. It owns:
//!
//! - `group_rate`: each consumer group's delivery pacer and its figures;
//! - `producer_rate`: each producer name's append admission (requests held in order, refused
//!   past the longest wait) and its figures.

pub mod group_rate;
pub mod producer_rate;
