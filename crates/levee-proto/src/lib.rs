//! Levee's wire types, generated at build time from the `.proto` files under `proto/`, which
//! are the API's single source of truth (the Java and Python clients generate from the same
//! files).
//!
//! - [`v1`]: messages, gRPC clients and gRPC servers of the `levee.v1` package.
//! - [`WireError`]: the wire error codes, how each maps to a gRPC status, and how a client reads
//!   them back out of a `tonic::Status`.

mod wire_error;

pub use wire_error::{ERROR_CODE_METADATA_KEY, ERROR_REASON_METADATA_KEY, WireError};

/// The `levee.v1` protobuf package.
#[allow(missing_docs, clippy::pedantic, missing_debug_implementations)]
pub mod v1 {
    tonic::include_proto!("levee.v1");
}
