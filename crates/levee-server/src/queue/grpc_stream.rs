//! The gRPC adapters of the session streams ([`super::stream`]): tonic's request stream as an
//! [`Incoming`], a session's [`Responses`] as tonic's response stream, errors both ways
//! through the wire error's gRPC status and trailers.

use std::pin::Pin;

use levee_proto::WireError;
use tokio_stream::{Stream, StreamExt};
use tonic::{Status, Streaming};

use super::stream::{Incoming, Responses};

/// A response stream as tonic serves it.
pub type GrpcResponses<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The client's messages of a gRPC stream.
pub fn incoming<T: Send + 'static>(streaming: Streaming<T>) -> Incoming<T> {
    Incoming::new(
        streaming.map(|message| message.map_err(|status| WireError::from_transport(&status))),
    )
}

/// A session's responses as a gRPC response stream.
pub fn responses<T: Send + 'static>(responses: Responses<T>) -> GrpcResponses<T> {
    Box::pin(responses.map(|response| response.map_err(Status::from)))
}
