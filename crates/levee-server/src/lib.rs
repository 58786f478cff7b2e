//! Levee's server: wires the engines to tokio, gRPC (tonic) and the admin HTTP port (axum).
//!
//! - [`config`]: embedded defaults, TOML file, `LEVEE_*` environment and flags, validated.
//! - [`data_dir`]: the data directory, created, checked writable and locked against a second
//!   server.
//! - [`server`]: [`RunningServer`] binds the listeners, serves, and shuts down gracefully.
//! - [`admin_service`]: the `levee.v1.Admin` gRPC service; the standard gRPC health service is
//!   served beside it.
//! - [`cluster_service`]: the `levee.v1.Cluster` gRPC service (members, their health, adding
//!   and removing nodes); [`cluster_http`]: `/v1/cluster`.
//! - [`admin_http`]: `/healthz`, `/readyz`, `/metrics`, `/v1/server`.
//! - [`metrics`], [`grpc_metrics`], [`connection`]: Prometheus metrics, the layer that measures
//!   every gRPC call, and the connection cap and gauge.
//! - [`hotkey`]: hot keys over the network: sharded engines, app-server sessions that push hot
//!   and cool events, the admin calls on gRPC and JSON, and the rules file.
//! - [`queue`]: the `levee.v1.Queues` gRPC service on the embedded queue store.
//! - [`metadata`]: the metadata group's writes and linearizable reads as wire errors.
//! - [`limits`]: the `levee.v1.Limits` gRPC service: rules as metadata, leases from the leader.
//! - [`logging`]: tracing in text or JSON.
//!
//! A request's path: the accept loop in [`connection`] takes a connection permit and counts the
//! connection; tonic decodes HTTP/2 and the call passes through [`grpc_metrics`] into the
//! service; the status and latency are recorded when the response's trailers are sent.

#![deny(missing_docs)]

// Public: what the `levee` binary needs to configure, log and run a server. Everything else
// is the server's own; clients speak to it through `levee-proto` and `levee-client`.

mod admin_http;
mod admin_service;
mod api_error;
mod cluster_http;
mod cluster_service;
pub mod config;
mod connection;
mod data_dir;
mod grpc_metrics;
mod grpc_status;
mod hotkey;
mod limits;
pub mod logging;
mod metadata;
mod metrics;
mod queue;
pub mod server;
mod state;

pub use config::Config;
pub use server::{RunningServer, ShutdownOutcome, StartError};
