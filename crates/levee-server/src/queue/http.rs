//! Topics and consumer groups as JSON on the admin HTTP port: `GET /v1/topics`,
//! `GET /v1/topics/{topic}/groups/{group}` (members, owners, epochs, committed offsets, lag,
//! rate) and `GET`/`PUT /v1/groups/{group}/rate` with `{"messages_per_s": N}` or
//! `{"messages_per_minute": N}` (0 clears the limit; it takes effect at once and is kept across
//! restarts); `GET`/`PUT /v1/producers/{producer_name}/rate` likewise for a producer name's
//! append limit (the GET also gives the messages admitted under it and the seconds waited).
//! When consumers fail: `GET`/`PUT`/`DELETE /v1/groups/{group}/retry-policy` (`{"delays_ms":
//! [1000, 10000], "max_attempts": 5}`; DELETE restores the default),
//! `GET /v1/groups/{group}/topics/{topic}/dead-letters?from_offset=N&max_messages=N`,
//! `POST /v1/groups/{group}/topics/{topic}/dead-letters/redrive` (`{"offsets": [..]}` or
//! `{"all": true}`) and `POST /v1/groups/{group}/topics/{topic}/offsets/reset` (`{"to":
//! "earliest" | "latest" | {"offset": N} | {"timestamp_ms": N}, "partitions": [..], "force":
//! false}`).

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::response::Json;
use axum::routing::{get, post};
use levee_proto::WireError;
use levee_proto::json::{
    dead_letters_json, group_json, producer_json, reset_json, retry_policy_json,
};
use levee_proto::v1::reset_group_offsets_request::To;
use levee_proto::v1::{ErrorCode, ListDeadLettersRequest, ResetGroupOffsetsRequest};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api_error::ApiError;
use crate::queue::topic::consume::ConsumeContext;
use crate::queue::topic::retry;
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
        .route(
            "/v1/groups/{group}/retry-policy",
            get(get_retry_policy)
                .put(put_retry_policy)
                .delete(delete_retry_policy),
        )
        .route(
            "/v1/groups/{group}/topics/{topic}/dead-letters",
            get(list_dead_letters),
        )
        .route(
            "/v1/groups/{group}/topics/{topic}/dead-letters/redrive",
            post(redrive),
        )
        .route(
            "/v1/groups/{group}/topics/{topic}/offsets/reset",
            post(reset_offsets),
        )
        .with_state(context)
}

fn invalid(message: String) -> ApiError {
    ApiError(WireError::new(ErrorCode::InvalidArgument, message))
}

/// `body` as JSON of type `T` (whatever its Content-Type), or `INVALID_ARGUMENT` showing
/// `example`.
fn json_body<T: serde::de::DeserializeOwned>(body: &[u8], example: &str) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|error| invalid(format!("the body must be JSON like {example}: {error}")))
}

async fn get_retry_policy(
    State(context): State<Arc<ConsumeContext>>,
    Path(group): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let described = TopicService::describe_retry_policy_now(&context, group)?;
    Ok(Json(retry_policy_json(&described)))
}

async fn put_retry_policy(
    State(context): State<Arc<ConsumeContext>>,
    Path(group): Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let policy: levee_broker::retry::RetryPolicy = json_body(
        &body,
        r#"{"delays_ms": [1000, 10000, 60000], "max_attempts": 4}"#,
    )?;
    retry::set_policy(&context, &group, Some(policy)).await?;
    get_retry_policy(State(context), Path(group)).await
}

async fn delete_retry_policy(
    State(context): State<Arc<ConsumeContext>>,
    Path(group): Path<String>,
) -> Result<Json<Value>, ApiError> {
    retry::set_policy(&context, &group, None).await?;
    get_retry_policy(State(context), Path(group)).await
}

/// The query of a dead-letter list.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    #[serde(default)]
    from_offset: u64,
    #[serde(default)]
    max_messages: u32,
}

async fn list_dead_letters(
    State(context): State<Arc<ConsumeContext>>,
    Path((group, topic)): Path<(String, String)>,
    Query(query): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let request = ListDeadLettersRequest {
        group,
        topic,
        from_offset: query.from_offset,
        max_messages: query.max_messages,
    };
    // A replicated cluster's coordinator serves them, once it applied what the shard holds.
    if let Some(lead) = context.lead_here(&request.topic)? {
        lead.settle().await?;
    }
    let page = retry::list_dead_letters(&context, request).await?;
    Ok(Json(dead_letters_json(&page)))
}

/// The body of a redrive.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RedriveBody {
    #[serde(default)]
    offsets: Vec<u64>,
    #[serde(default)]
    all: bool,
}

async fn redrive(
    State(context): State<Arc<ConsumeContext>>,
    Path((group, topic)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let body: RedriveBody = json_body(&body, r#"{"offsets": [0, 3]} or {"all": true}"#)?;
    let lead = context.lead_here(&topic)?;
    let redriven = retry::redrive(&context, (group, topic), (body.offsets, body.all), lead).await?;
    Ok(Json(json!({ "redriven": redriven })))
}

/// Where a reset goes, as JSON.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum ResetTarget {
    Earliest,
    Latest,
    Offset(u64),
    TimestampMs(u64),
}

/// The body of a reset.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResetBody {
    to: ResetTarget,
    #[serde(default)]
    partitions: Vec<u32>,
    #[serde(default)]
    force: bool,
}

async fn reset_offsets(
    State(context): State<Arc<ConsumeContext>>,
    Path((group, topic)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    let body: ResetBody = json_body(
        &body,
        r#"{"to": "earliest"} or {"to": {"timestamp_ms": 1764300000000}, "force": true}"#,
    )?;
    let to = match body.to {
        ResetTarget::Earliest => To::Earliest(true),
        ResetTarget::Latest => To::Latest(true),
        ResetTarget::Offset(offset) => To::Offset(offset),
        ResetTarget::TimestampMs(timestamp_ms) => To::TimestampMs(timestamp_ms),
    };
    let request = ResetGroupOffsetsRequest {
        group,
        topic,
        partitions: body.partitions,
        to: Some(to),
        force: body.force,
    };
    let lead = context.lead_here(&request.topic)?;
    let reset = retry::reset_offsets(&context, request, lead).await?;
    Ok(Json(reset_json(&reset)))
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
    let lead = context.lead_here(&topic)?;
    let described = TopicService::describe_group_now(&context, (&group, &topic), lead).await?;
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
