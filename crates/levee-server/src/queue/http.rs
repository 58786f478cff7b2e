//! Topics and consumer groups as JSON on the admin HTTP port: `GET /v1/topics`,
//! `GET /v1/topics/{topic}/groups/{group}` (members, owners, epochs, committed offsets, lag,
//! rate) and `GET`/`PUT /v1/groups/{group}/rate` with `{"messages_per_s": N}` or
//! `{"messages_per_minute": N}` (0 clears the limit; it takes effect at once and is kept across
//! restarts); `GET`/`PUT /v1/producers/{producer_name}/rate` likewise for a producer name's
//! append limit (the GET also gives the messages admitted under it and the seconds waited).

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::response::Json;
use axum::routing::get;
use levee_proto::WireError;
use levee_proto::json::{group_json, producer_json};
use levee_proto::v1::ErrorCode;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api_error::ApiError;
use crate::queue::topic::consume::ConsumeContext;
use crate::queue::topic::service::TopicService;

/// The topic and group routes.
pub fn router(context: Arc<ConsumeContext>) -> Router {
    Router::new()
        .route("/v1/topics", get(list_topics))
        .route("/v1/topics/{topic}/groups/{group}", get(describe_group))
        .route("/v1/groups/{group}/rate", get(get_rate).put(put_rate))
        .route(
            "/v1/producers/{producer_name}/rate",
            get(get_producer_rate).put(put_producer_rate),
        )
        .with_state(context)
}

async fn list_topics(State(context): State<Arc<ConsumeContext>>) -> Json<Value> {
    let topics: Vec<Value> = context
        .topics
        .list()
        .iter()
        .map(|topic| json!({"topic": topic.name, "partitions": topic.partitions()}))
        .collect();
    Json(json!({ "topics": topics }))
}

async fn describe_group(
    State(context): State<Arc<ConsumeContext>>,
    Path((topic, group)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let described = TopicService::describe_group_now(&context, &group, &topic).await?;
    Ok(Json(group_json(&described)))
}

async fn get_rate(
    State(context): State<Arc<ConsumeContext>>,
    Path(group): Path<String>,
) -> Json<Value> {
    Json(json!({"group": group, "messages_per_s": context.topics.rate(&group)}))
}

/// The body of `PUT /v1/groups/{group}/rate` and `/v1/producers/{producer_name}/rate`: exactly
/// one of the two.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RateBody {
    messages_per_s: Option<f64>,
    messages_per_minute: Option<f64>,
}

async fn put_rate(
    State(context): State<Arc<ConsumeContext>>,
    Path(group): Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let rate = parse_rate(&body)?;
    TopicService::set_rate(&context, group.clone(), rate).await?;
    Ok(Json(json!({"group": group, "messages_per_s": rate})))
}

async fn get_producer_rate(
    State(context): State<Arc<ConsumeContext>>,
    Path(producer_name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let described = TopicService::describe_producer_now(&context, &producer_name)?;
    Ok(Json(producer_json(&described)))
}

async fn put_producer_rate(
    State(context): State<Arc<ConsumeContext>>,
    Path(producer_name): Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let rate = parse_rate(&body)?;
    TopicService::set_producer_rate(&context, producer_name.clone(), rate).await?;
    Ok(Json(
        json!({"producer_name": producer_name, "messages_per_s": rate}),
    ))
}

/// A rate body's limit in messages per second.
fn parse_rate(body: &[u8]) -> Result<f64, ApiError> {
    let invalid = |message: String| ApiError(WireError::new(ErrorCode::InvalidArgument, message));
    // The body is read as JSON whatever its Content-Type (curl -d sends a form type).
    let body: RateBody = serde_json::from_slice(body).map_err(|error| {
        invalid(format!(
            "the body must be JSON like {{\"messages_per_s\": 1000}} or \
             {{\"messages_per_minute\": 21000000}}: {error}"
        ))
    })?;
    match (body.messages_per_s, body.messages_per_minute) {
        (Some(per_s), None) => Ok(per_s),
        (None, Some(per_minute)) => Ok(per_minute / 60.0),
        _ => Err(invalid(
            "give exactly one of messages_per_s and messages_per_minute".to_owned(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// A rate body of arbitrary bytes, or a well-formed one with any number: a rate or
        /// INVALID_ARGUMENT, never a panic.
        #[test]
        fn given_hostile_rate_bodies_then_parse_answers_without_panicking(
            bytes in proptest::collection::vec(any::<u8>(), 0..200),
            number in any::<f64>(),
        ) {
            if let Err(error) = parse_rate(&bytes) {
                prop_assert_eq!(error.0.code, ErrorCode::InvalidArgument);
            }
            for key in ["messages_per_s", "messages_per_minute"] {
                let body = format!("{{\"{key}\": {number}}}");
                match parse_rate(body.as_bytes()) {
                    Ok(rate) => prop_assert!(!rate.is_nan() || number.is_nan()),
                    Err(error) => prop_assert_eq!(error.0.code, ErrorCode::InvalidArgument),
                }
            }
        }
    }
}
