//! Queues over the network: the `levee.v1.Queues` gRPC service on the embedded queue store
//! (`levee-store`), which lives in the `queues` directory of the data dir.

pub mod service;
pub mod subscription;

/// The store's directory inside the data dir.
pub const STORE_DIR_NAME: &str = "queues";
