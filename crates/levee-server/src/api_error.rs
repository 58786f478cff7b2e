//! [`ApiError`]: the one error shape of the admin HTTP port. Every answer that is not a 2xx
//! has a JSON body `{"error": {"code", "reason", "message"}}` with a Levee error code:
//! the JSON endpoints (hot keys, topics, groups, producer limits) answer [`ApiError`]s, and
//! [`json_errors`] rewrites everything else the port answers (unknown paths, wrong methods,
//! rejected bodies, `/readyz` while not ready) into the same shape, keeping its HTTP status.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Json, Response};
use levee_proto::WireError;
use levee_proto::v1::ErrorCode;
use serde_json::json;

/// Most bytes of a non-JSON error body carried over as the JSON error's message; a longer
/// body is replaced by the status's reason.
const ERROR_BODY_BYTES_MAX: usize = 4 << 10;

/// A wire error as an HTTP response with a JSON body.
pub(crate) struct ApiError(pub(crate) WireError);

impl From<WireError> for ApiError {
    fn from(error: WireError) -> Self {
        Self(error)
    }
}

/// The JSON body of an error.
fn error_body(error: &WireError) -> Json<serde_json::Value> {
    Json(json!({"error": {
        "code": error.code as i32,
        "reason": error.code.reason(),
        "message": error.message,
    }}))
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match self.0.code {
            ErrorCode::InvalidArgument | ErrorCode::OffsetOutOfRange => StatusCode::BAD_REQUEST,
            ErrorCode::NotFound => StatusCode::NOT_FOUND,
            ErrorCode::AlreadyExists | ErrorCode::FailedPrecondition | ErrorCode::Fenced => {
                StatusCode::CONFLICT
            }
            ErrorCode::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::Unavailable | ErrorCode::StorageFailed => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (status, error_body(&self.0)).into_response()
    }
}

/// The Levee code of an HTTP error status the port answers outside the JSON endpoints.
fn code_of(status: StatusCode) -> ErrorCode {
    match status {
        StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED => ErrorCode::Unimplemented,
        StatusCode::SERVICE_UNAVAILABLE => ErrorCode::Unavailable,
        StatusCode::TOO_MANY_REQUESTS => ErrorCode::ResourceExhausted,
        status if status.is_client_error() => ErrorCode::InvalidArgument,
        _ => ErrorCode::Internal,
    }
}

/// Middleware: an answer that is not a 2xx and not JSON already becomes the JSON error shape,
/// keeping its status; its text (if any) becomes the message.
pub(crate) async fn json_errors(request: Request, next: Next) -> Response {
    let (method, path) = (request.method().clone(), request.uri().path().to_owned());
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/json"));
    if status.is_success() || status.is_informational() || is_json {
        return response;
    }
    let body = axum::body::to_bytes(response.into_body(), ERROR_BODY_BYTES_MAX)
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&body).trim().to_owned();
    let message = match status {
        StatusCode::NOT_FOUND => no_endpoint(&path),
        StatusCode::METHOD_NOT_ALLOWED => format!("{method} is not allowed on {path}"),
        _ if !text.is_empty() => text,
        _ => status
            .canonical_reason()
            .unwrap_or("request refused")
            .to_owned(),
    };
    let error = WireError::new(code_of(status), message);
    let mut answer = error_body(&error).into_response();
    *answer.status_mut() = status;
    answer
}

/// What an unknown path is told.
fn no_endpoint(path: &str) -> String {
    format!("no admin endpoint at {path}; the endpoints are listed in README.md and docs/")
}

/// An unknown path, as the JSON error shape.
pub(crate) async fn not_found(request: Request<Body>) -> Response {
    let mut answer = error_body(&WireError::new(
        ErrorCode::Unimplemented,
        no_endpoint(request.uri().path()),
    ))
    .into_response();
    *answer.status_mut() = StatusCode::NOT_FOUND;
    answer
}
