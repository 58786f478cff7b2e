//! Every error a Levee gRPC port answers carries a Levee code (the `levee-error-code` and
//! `levee-error-reason` trailers `errors.proto` promises). The services answer with Levee
//! errors; the gRPC library and the transport raise a few of their own without that metadata
//! (a message over the size limit, an unknown method, a request that is not gRPC). [`complete`]
//! rewrites such a status where the metrics layer sees it (the headers of a trailers-only
//! response, or the trailers) into the Levee error [`WireError::from_transport`] gives.

use levee_proto::{ERROR_CODE_METADATA_KEY, WireError};

/// The gRPC status header.
const GRPC_STATUS_HEADER: &str = "grpc-status";

/// Gives a non-OK status in `headers` that lacks Levee's code the Levee error it stands for.
/// Headers without a status, an OK status and Levee's own errors are left as they are.
pub(crate) fn complete(headers: &mut http::HeaderMap) {
    let Some(value) = headers.get(GRPC_STATUS_HEADER) else {
        return;
    };
    if value.as_bytes() == b"0" || headers.contains_key(ERROR_CODE_METADATA_KEY) {
        return;
    }
    let Some(status) = tonic::Status::from_header_map(headers) else {
        return;
    };
    let levee = tonic::Status::from(WireError::from_transport(&status));
    // Writing a status of our own making cannot fail (its message is percent-encoded).
    let _ = levee.add_header(headers);
}

#[cfg(test)]
mod tests {
    use levee_proto::v1::ErrorCode;

    use super::*;

    #[test]
    fn given_the_transports_own_errors_then_each_gets_a_levee_code() {
        let mut too_large = http::HeaderMap::new();
        tonic::Status::out_of_range(
            "Error, decoded message length too large: found 20000000 bytes, the limit is: 16777216 bytes",
        )
        .add_header(&mut too_large)
        .unwrap();
        complete(&mut too_large);
        let error = WireError::from_status(&tonic::Status::from_header_map(&too_large).unwrap());
        assert_eq!(error.code, ErrorCode::InvalidArgument);
        assert!(error.message.contains("size limit"), "{error}");
        assert_eq!(too_large[GRPC_STATUS_HEADER], "3");

        let mut unknown = http::HeaderMap::new();
        tonic::Status::unimplemented("")
            .add_header(&mut unknown)
            .unwrap();
        complete(&mut unknown);
        assert_eq!(unknown[ERROR_CODE_METADATA_KEY], "1009");

        let mut levee = http::HeaderMap::new();
        tonic::Status::from(WireError::new(ErrorCode::OffsetOutOfRange, "past the end"))
            .add_header(&mut levee)
            .unwrap();
        let before = levee.clone();
        complete(&mut levee);
        assert_eq!(levee, before, "a Levee error is left as it is");
    }
}
