//! The SDK's error type.

use levee_proto::WireError;

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The address cannot be turned into an endpoint.
    #[error("invalid server address '{address}': {reason}; use HOST:PORT such as 127.0.0.1:7070")]
    InvalidAddress {
        /// The address given.
        address: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No connection could be made.
    #[error(
        "cannot connect to the levee server at {address} ({source}); check that it is running \
         and listening there"
    )]
    Connect {
        /// The address tried.
        address: String,
        /// The transport error.
        source: tonic::transport::Error,
    },
    /// Options that cannot work; the message names the option and the allowed values.
    #[error("invalid options: {0}")]
    InvalidOptions(String),
    /// The server (or the connection) answered with an error.
    #[error(transparent)]
    Server(#[from] WireError),
}

impl ClientError {
    /// The stable error code, when the server answered.
    pub fn code(&self) -> Option<levee_proto::v1::ErrorCode> {
        match self {
            ClientError::Server(error) => Some(error.code),
            _ => None,
        }
    }
}

impl From<tonic::Status> for ClientError {
    /// A status with Levee's code keeps it; one the gRPC library raised on its own (the call's
    /// deadline passing, a message over a size limit) gets the code the server would send.
    fn from(status: tonic::Status) -> Self {
        ClientError::Server(WireError::from_transport(&status))
    }
}
