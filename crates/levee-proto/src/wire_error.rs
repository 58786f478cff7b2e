//! The wire error: one [`ErrorCode`] from `proto/levee/v1/errors.proto` plus a message for
//! people, carried in a `tonic::Status` whose trailers hold the numeric code and reason.

use std::fmt;

use tonic::metadata::MetadataValue;

use crate::v1::ErrorCode;

/// Metadata key of the numeric error code, in decimal.
pub const ERROR_CODE_METADATA_KEY: &str = "levee-error-code";
/// Metadata key of the error code's stable reason string, such as `INVALID_ARGUMENT`.
pub const ERROR_REASON_METADATA_KEY: &str = "levee-error-reason";

const REASON_PREFIX: &str = "ERROR_CODE_";

impl ErrorCode {
    /// The gRPC status code this error is always sent with.
    pub fn grpc_code(self) -> tonic::Code {
        match self {
            ErrorCode::Unspecified => tonic::Code::Unknown,
            ErrorCode::Internal => tonic::Code::Internal,
            ErrorCode::InvalidArgument => tonic::Code::InvalidArgument,
            ErrorCode::Unavailable | ErrorCode::StorageFailed => tonic::Code::Unavailable,
            ErrorCode::ResourceExhausted => tonic::Code::ResourceExhausted,
            ErrorCode::DeadlineExceeded => tonic::Code::DeadlineExceeded,
            ErrorCode::NotFound => tonic::Code::NotFound,
            ErrorCode::AlreadyExists => tonic::Code::AlreadyExists,
            ErrorCode::FailedPrecondition
            | ErrorCode::Fenced
            | ErrorCode::SequenceGap
            | ErrorCode::SequenceTooOld => tonic::Code::FailedPrecondition,
            ErrorCode::Unimplemented => tonic::Code::Unimplemented,
            ErrorCode::OffsetOutOfRange => tonic::Code::OutOfRange,
        }
    }

    /// The stable reason string: the proto name without its `ERROR_CODE_` prefix.
    pub fn reason(self) -> &'static str {
        let name = self.as_str_name();
        name.strip_prefix(REASON_PREFIX).unwrap_or(name)
    }
}

/// An error as it crosses the wire: a stable code and a message that names the problem and the
/// fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError {
    /// The stable code clients branch on.
    pub code: ErrorCode,
    /// For people: what went wrong and how to fix it.
    pub message: String,
}

impl WireError {
    /// An error with `code` and `message`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// Reads a Levee error back out of a status. A status without Levee's metadata (one made by
    /// a proxy or by the gRPC library itself) is mapped from its gRPC code alone.
    pub fn from_status(status: &tonic::Status) -> Self {
        let code = status
            .metadata()
            .get(ERROR_CODE_METADATA_KEY)
            .and_then(|value| value.to_str().ok())
            .and_then(|text| text.parse::<i32>().ok())
            .and_then(|number| ErrorCode::try_from(number).ok())
            .unwrap_or_else(|| code_from_grpc(status.code()));
        Self {
            code,
            message: status.message().to_owned(),
        }
    }
}

impl WireError {
    /// The Levee error of a status the gRPC library or the transport raised on its own (no
    /// Levee metadata), as the server answers it: a message over the size limit is
    /// `INVALID_ARGUMENT` (tonic says `OUT_OF_RANGE`, which in Levee means an offset past the
    /// end), an unknown method `UNIMPLEMENTED`, the rest mapped from the gRPC code. A status
    /// that carries a Levee code keeps it.
    pub fn from_transport(status: &tonic::Status) -> Self {
        if status.metadata().contains_key(ERROR_CODE_METADATA_KEY) {
            return Self::from_status(status);
        }
        let message = status.message();
        match status.code() {
            tonic::Code::OutOfRange if message.contains("message length too large") => Self::new(
                ErrorCode::InvalidArgument,
                format!(
                    "{message}: the message is over the server's size limit for this call; \
                     send less per message (the limits are in the proto comments)"
                ),
            ),
            // The call's deadline (its grpc-timeout) ran out, on the server or in the client:
            // tonic cancels the call with this message.
            tonic::Code::Cancelled if message.contains("Timeout expired") => Self::new(
                ErrorCode::DeadlineExceeded,
                format!(
                    "{message}: the request's deadline passed on the server; retry with a longer deadline"
                ),
            ),
            // The connection broke (the server died or went away mid-call): tonic says
            // UNKNOWN; the request may or may not have been served, and another server (or
            // this one, back) may take a retry.
            tonic::Code::Unknown if message.contains("transport error") => Self::broken(message),
            // A stream whose connection broke mid-body: tonic says UNKNOWN or INTERNAL with
            // h2's words.
            tonic::Code::Unknown | tonic::Code::Internal
                if message.contains("h2 protocol error") =>
            {
                Self::broken(message)
            }
            _ => Self::from_status(status),
        }
    }

    /// A call whose connection broke: UNAVAILABLE, saying the request may have been served.
    fn broken(message: &str) -> Self {
        Self::new(
            ErrorCode::Unavailable,
            format!(
                "{message}: the connection to the server broke; the request may or may not \
                 have been served"
            ),
        )
    }
}

impl From<WireError> for tonic::Status {
    fn from(error: WireError) -> Self {
        let mut status = tonic::Status::new(error.code.grpc_code(), error.message);
        let metadata = status.metadata_mut();
        metadata.insert(
            ERROR_CODE_METADATA_KEY,
            MetadataValue::from(error.code as i32),
        );
        metadata.insert(
            ERROR_REASON_METADATA_KEY,
            MetadataValue::from_static(error.code.reason()),
        );
        status
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "{} ({}): {}",
            self.code.reason(),
            self.code as i32,
            self.message
        )
    }
}

impl std::error::Error for WireError {}

fn code_from_grpc(code: tonic::Code) -> ErrorCode {
    match code {
        tonic::Code::InvalidArgument => ErrorCode::InvalidArgument,
        tonic::Code::OutOfRange => ErrorCode::OffsetOutOfRange,
        tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Aborted => {
            ErrorCode::Unavailable
        }
        tonic::Code::ResourceExhausted => ErrorCode::ResourceExhausted,
        tonic::Code::DeadlineExceeded => ErrorCode::DeadlineExceeded,
        tonic::Code::NotFound => ErrorCode::NotFound,
        tonic::Code::AlreadyExists => ErrorCode::AlreadyExists,
        tonic::Code::FailedPrecondition | tonic::Code::PermissionDenied => {
            ErrorCode::FailedPrecondition
        }
        tonic::Code::Unimplemented => ErrorCode::Unimplemented,
        tonic::Code::Ok
        | tonic::Code::Unknown
        | tonic::Code::Internal
        | tonic::Code::DataLoss
        | tonic::Code::Unauthenticated => ErrorCode::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code ever published, with its number, gRPC code and reason. A code is never
    /// renumbered or reused: add rows, never edit them.
    const PINNED: &[(ErrorCode, i32, tonic::Code, &str)] = &[
        (
            ErrorCode::Unspecified,
            0,
            tonic::Code::Unknown,
            "UNSPECIFIED",
        ),
        (ErrorCode::Internal, 1000, tonic::Code::Internal, "INTERNAL"),
        (
            ErrorCode::InvalidArgument,
            1001,
            tonic::Code::InvalidArgument,
            "INVALID_ARGUMENT",
        ),
        (
            ErrorCode::Unavailable,
            1002,
            tonic::Code::Unavailable,
            "UNAVAILABLE",
        ),
        (
            ErrorCode::ResourceExhausted,
            1003,
            tonic::Code::ResourceExhausted,
            "RESOURCE_EXHAUSTED",
        ),
        (
            ErrorCode::DeadlineExceeded,
            1004,
            tonic::Code::DeadlineExceeded,
            "DEADLINE_EXCEEDED",
        ),
        (
            ErrorCode::NotFound,
            1005,
            tonic::Code::NotFound,
            "NOT_FOUND",
        ),
        (
            ErrorCode::AlreadyExists,
            1006,
            tonic::Code::AlreadyExists,
            "ALREADY_EXISTS",
        ),
        (
            ErrorCode::FailedPrecondition,
            1007,
            tonic::Code::FailedPrecondition,
            "FAILED_PRECONDITION",
        ),
        (
            ErrorCode::StorageFailed,
            1008,
            tonic::Code::Unavailable,
            "STORAGE_FAILED",
        ),
        (
            ErrorCode::Unimplemented,
            1009,
            tonic::Code::Unimplemented,
            "UNIMPLEMENTED",
        ),
        (
            ErrorCode::Fenced,
            3001,
            tonic::Code::FailedPrecondition,
            "FENCED",
        ),
        (
            ErrorCode::SequenceGap,
            3002,
            tonic::Code::FailedPrecondition,
            "SEQUENCE_GAP",
        ),
        (
            ErrorCode::SequenceTooOld,
            3003,
            tonic::Code::FailedPrecondition,
            "SEQUENCE_TOO_OLD",
        ),
        (
            ErrorCode::OffsetOutOfRange,
            3004,
            tonic::Code::OutOfRange,
            "OFFSET_OUT_OF_RANGE",
        ),
    ];

    #[test]
    fn given_pinned_table_then_every_code_keeps_its_number_status_and_reason() {
        for &(code, number, grpc, reason) in PINNED {
            assert_eq!(code as i32, number, "{code:?} was renumbered");
            assert_eq!(code.grpc_code(), grpc, "{code:?} changed its gRPC status");
            assert_eq!(code.reason(), reason, "{code:?} changed its reason");
        }
    }

    #[test]
    fn given_proto_enum_then_every_defined_code_is_pinned() {
        let defined: Vec<i32> = (0..10_000)
            .filter(|number| ErrorCode::try_from(*number).is_ok())
            .collect();
        let pinned: Vec<i32> = PINNED.iter().map(|row| row.1).collect();
        assert_eq!(
            defined, pinned,
            "a code was added to errors.proto without pinning it here"
        );
    }

    #[test]
    fn given_wire_error_when_sent_as_status_then_client_reads_same_code_and_message() {
        let sent = WireError::new(ErrorCode::InvalidArgument, "payload: at most 65536 bytes");
        let status = tonic::Status::from(sent.clone());
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert_eq!(
            status.metadata().get(ERROR_REASON_METADATA_KEY).unwrap(),
            "INVALID_ARGUMENT"
        );
        assert_eq!(WireError::from_status(&status), sent);
    }

    #[test]
    fn given_the_servers_own_timeout_then_the_error_is_deadline_exceeded() {
        let status = tonic::Status::cancelled("Timeout expired");
        let error = WireError::from_transport(&status);
        assert_eq!(error.code, ErrorCode::DeadlineExceeded);
        assert!(error.message.contains("deadline"), "{}", error.message);
        let cancelled = tonic::Status::cancelled("the client went away");
        assert_eq!(
            WireError::from_transport(&cancelled).code,
            ErrorCode::Unavailable
        );
    }

    #[test]
    fn given_status_without_levee_metadata_then_code_comes_from_grpc_code() {
        let status = tonic::Status::unavailable("connection refused");
        assert_eq!(WireError::from_status(&status).code, ErrorCode::Unavailable);
    }

    #[test]
    fn given_a_broken_connection_when_read_as_a_wire_error_then_it_is_unavailable_and_says_so() {
        let broken = WireError::from_transport(&tonic::Status::unknown("transport error"));
        assert_eq!(broken.code, ErrorCode::Unavailable);
        assert!(
            broken.message.contains("may or may not"),
            "{}",
            broken.message
        );
        // A stream cut mid-body.
        for cut in [
            tonic::Status::unknown("h2 protocol error: error reading a body from connection"),
            tonic::Status::internal("h2 protocol error: error reading a body from connection"),
        ] {
            assert_eq!(WireError::from_transport(&cut).code, ErrorCode::Unavailable);
        }
        // Any other UNKNOWN or INTERNAL keeps the usual mapping.
        let other = WireError::from_transport(&tonic::Status::unknown("something else"));
        assert_eq!(other.code, ErrorCode::Internal);
        let other = WireError::from_transport(&tonic::Status::internal("a server bug"));
        assert_eq!(other.code, ErrorCode::Internal);
    }
}
