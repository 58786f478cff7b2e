//! Hot keys over the network: the engines sharded behind [`hub::HotKeyHub`], the
//! `levee.v1.HotKeys` gRPC service, the JSON admin routes, the operator's settings written
//! through the cluster ([`admin`]) and followed by every node ([`observer`]), and the rules
//! file of versions before the cluster (imported once).

pub mod admin;
pub mod clock;
pub mod convert;
pub mod http;
pub mod hub;
pub mod observer;
pub mod rules_file;
pub mod service;

/// How often hot keys are expired and idle windows reclaimed.
pub const TICK_INTERVAL: std::time::Duration = std::time::Duration::from_millis(5);
