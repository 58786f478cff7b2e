//! Levee's server: wires the engines to tokio, gRPC (tonic) and the admin HTTP port (axum).
//!
//! - [`config`]: embedded defaults, TOML file, `LEVEE_*` environment and flags, validated.
//! - [`data_dir`]: the data directory, created, checked writable and locked against a second
//!   server.
//! - [`server`]: [`RunningServer`] binds the listeners, serves, and shuts down gracefully.
//! - [`admin_service`]: the `levee.v1.Admin` gRPC service; the standard gRPC health service is
//!   served beside it.
//! - [`admin_http`]: `/healthz`, `/readyz`, `/metrics`, `/v1/server`.
//! - [`metrics`], [`grpc_metrics`], [`connection`]: Prometheus metrics, the layer that measures
//!   every gRPC call, and the connection cap and gauge.
//! - [`hotkey`]: hot keys over the network: sharded engines, app-server sessions that push hot
//!   and cool events, the admin calls on gRPC and JSON, and the rules file.
//! - [`queue`]: the `levee.v1.Queues` gRPC service on the embedded queue store.
//! - [`logging`]: tracing in text or JSON.
//!
//! A request's path: the accept loop in [`connection`] takes a connection permit and counts the
//! connection; tonic decodes HTTP/2 and the call passes through [`grpc_metrics`] into the
//! service; the status and latency are recorded when the response's trailers are sent.

#![deny(missing_docs)]

pub mod admin_http;
pub mod admin_service;
pub mod config;
pub mod connection;
pub mod data_dir;
pub mod grpc_metrics;
pub mod hotkey;
pub mod logging;
pub mod metrics;
pub mod queue;
pub mod server;
pub mod state;

pub use config::Config;
pub use server::{RunningServer, ShutdownOutcome, StartError};
