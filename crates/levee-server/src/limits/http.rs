//! The `/v1/limits` routes of the admin port (docs/LIMITS.md): the same rules and
//! descriptions as the gRPC service, as JSON.

use levee_proto::WireError;
use levee_proto::limits_json::{AdaptiveBody, BreakerBody, PerKeyBody, describe_json, rule_json};
use levee_proto::v1::limits_server::Limits;
use levee_proto::v1::{
    DeleteLimitRuleRequest, DescribeResourceRequest, ErrorCode, LimitRule, ListLimitRulesRequest,
    SetLimitRuleRequest,
};
use tonic::{Request, Status};

use super::LimitsService;

/// The body of `PUT /v1/limits/{resource}`: a budget as permits per period, or per second or
/// minute.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleBody {
    permits: Option<u64>,
    period_ms: Option<u64>,
    per_second: Option<u64>,
    per_minute: Option<u64>,
    per_key: Option<PerKeyBody>,
    breaker: Option<BreakerBody>,
    adaptive: Option<AdaptiveBody>,
}

/// The `/v1/limits` routes over `service`.
pub fn router(service: LimitsService) -> axum::Router {
    use axum::routing::get;
    axum::Router::new()
        .route("/v1/limits", get(http_rules))
        .route(
            "/v1/limits/{resource}",
            get(http_describe).put(http_set).delete(http_delete),
        )
        .with_state(service)
}

type HttpResult = Result<axum::Json<serde_json::Value>, crate::api_error::ApiError>;

fn api(status: &Status) -> crate::api_error::ApiError {
    crate::api_error::ApiError(WireError::from_status(status))
}

async fn http_rules(
    axum::extract::State(service): axum::extract::State<LimitsService>,
) -> HttpResult {
    let rules = service
        .list_rules(Request::new(ListLimitRulesRequest {}))
        .await
        .map_err(|status| api(&status))?
        .into_inner()
        .rules;
    Ok(axum::Json(
        serde_json::json!({"rules": rules.iter().map(rule_json).collect::<Vec<_>>()}),
    ))
}

async fn http_describe(
    axum::extract::State(service): axum::extract::State<LimitsService>,
    axum::extract::Path(resource): axum::extract::Path<String>,
) -> HttpResult {
    let described = service
        .describe_resource(Request::new(DescribeResourceRequest { resource }))
        .await
        .map_err(|status| api(&status))?
        .into_inner();
    Ok(axum::Json(describe_json(&described)))
}

async fn http_set(
    axum::extract::State(service): axum::extract::State<LimitsService>,
    axum::extract::Path(resource): axum::extract::Path<String>,
    axum::Json(body): axum::Json<RuleBody>,
) -> HttpResult {
    let (permits, period_ms) = match (
        body.permits,
        body.period_ms,
        body.per_second,
        body.per_minute,
    ) {
        (Some(permits), Some(period_ms), None, None) => (permits, period_ms),
        (None, None, Some(per_second), None) => (per_second, 1_000),
        (None, None, None, Some(per_minute)) => (per_minute, 60_000),
        _ => {
            return Err(crate::api_error::ApiError(WireError::new(
                ErrorCode::InvalidArgument,
                "give {\"permits\", \"period_ms\"}, or {\"per_second\"}, or {\"per_minute\"} \
                 (with optional \"per_key\", \"breaker\", \"adaptive\")",
            )));
        }
    };
    let rule = LimitRule {
        resource,
        permits,
        period_ms,
        per_key: body.per_key.map(PerKeyBody::spec),
        breaker: body.breaker.as_ref().map(BreakerBody::spec),
        adaptive: body.adaptive.as_ref().map(AdaptiveBody::spec),
    };
    service
        .set_rule(Request::new(SetLimitRuleRequest {
            rule: Some(rule.clone()),
        }))
        .await
        .map_err(|status| api(&status))?;
    Ok(axum::Json(rule_json(&rule)))
}

async fn http_delete(
    axum::extract::State(service): axum::extract::State<LimitsService>,
    axum::extract::Path(resource): axum::extract::Path<String>,
) -> HttpResult {
    let existed = service
        .delete_rule(Request::new(DeleteLimitRuleRequest {
            resource: resource.clone(),
        }))
        .await
        .map_err(|status| api(&status))?
        .into_inner()
        .existed;
    Ok(axum::Json(
        serde_json::json!({"resource": resource, "existed": existed}),
    ))
}
