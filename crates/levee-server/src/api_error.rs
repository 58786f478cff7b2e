//! [`ApiError`]: the one error type of every JSON endpoint on the admin HTTP port (hot keys,
//! topics, groups, producer limits): a Levee wire error answered with the HTTP status that
//! fits its code and a JSON body `{"error": {"code", "reason", "message"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use levee_proto::WireError;
use levee_proto::v1::ErrorCode;
use serde_json::json;

/// A wire error as an HTTP response with a JSON body.
pub(crate) struct ApiError(pub(crate) WireError);

impl From<WireError> for ApiError {
    fn from(error: WireError) -> Self {
        Self(error)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match self.0.code {
            ErrorCode::InvalidArgument => StatusCode::BAD_REQUEST,
            ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::AlreadyExists | ErrorCode::FailedPrecondition | ErrorCode::Fenced => {
                StatusCode::CONFLICT
            }
            ErrorCode::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::Unavailable | ErrorCode::StorageFailed => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let body = json!({"error": {
            "code": self.0.code as i32,
            "reason": self.0.code.reason(),
            "message": self.0.message,
        }});
        (status, Json(body)).into_response()
    }
}
