//! The `levee.v1.Limits` gRPC service (proto/levee/v1/limits.proto, docs/LIMITS.md): rules are
//! the cluster's metadata (written through the metadata group, read from its state machine);
//! leases are granted by the metadata group's leader from one [`LeaseAllocator`] per resource,
//! so the whole cluster shares one budget. [`router`] serves the rules as JSON on the admin
//! port: `GET /v1/limits` (every rule), `GET`/`PUT`/`DELETE /v1/limits/{resource}` (describe;
//! set with `{"permits": N, "period_ms": M}`, or `{"per_second": N}` / `{"per_minute": N}`;
//! remove).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use levee_cluster::{Manager, MetaCommand, MetaStateMachine, MetaWriter};
use levee_limit::{LeaseAllocator, LeaseRule};
use levee_proto::WireError;
use levee_proto::v1::limits_server::{Limits, LimitsServer};
use levee_proto::v1::{
    DeleteLimitRuleRequest, DeleteLimitRuleResponse, DescribeResourceRequest,
    DescribeResourceResponse, ErrorCode, LeaseGrant, LeaseRequest, LeaseResponse, LimitRule,
    ListLimitRulesRequest, ListLimitRulesResponse, SetLimitRuleRequest, SetLimitRuleResponse,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::metrics::{Metrics, ResourceLabels};

/// Longest resource name, in bytes.
pub const RESOURCE_BYTES_MAX: usize = 128;
/// Most demands in one lease request.
pub const DEMANDS_PER_REQUEST_MAX: usize = 1_000;
/// Lease answers queued for a slow client before its requests wait.
const LEASE_ANSWERS_QUEUED: usize = 16;
/// The shortest and longest rule period, in milliseconds.
const PERIOD_MS_MIN: u64 = 1_000;
const PERIOD_MS_MAX: u64 = 86_400_000;

/// The Limits service.
#[derive(Clone)]
pub struct LimitsService {
    machine: MetaStateMachine,
    writer: MetaWriter,
    manager: Manager,
    allocators: Arc<Mutex<HashMap<String, LeaseAllocator>>>,
    started: Instant,
    closing: watch::Receiver<bool>,
    metrics: Metrics,
}

impl std::fmt::Debug for LimitsService {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("LimitsService")
    }
}

fn invalid(message: String) -> Status {
    WireError::new(ErrorCode::InvalidArgument, message).into()
}

fn check_resource(resource: &str) -> Result<(), Status> {
    if resource.is_empty() || resource.len() > RESOURCE_BYTES_MAX {
        return Err(invalid(format!(
            "resource: 1 to {RESOURCE_BYTES_MAX} bytes, got {}; use a shorter name",
            resource.len()
        )));
    }
    Ok(())
}

/// The allocator rule of a replicated rule: `permits` per `period_ms`, leases of 100 ms.
fn lease_rule(permits: u64, period_ms: u64) -> LeaseRule {
    LeaseRule {
        permits,
        period_ns: period_ms.saturating_mul(1_000_000),
        ..LeaseRule::per_second(permits)
    }
}

impl LimitsService {
    /// The service over the metadata group's state machine, written with `writer`; lease
    /// streams end when `closing` turns true.
    pub fn new(
        (machine, writer, manager): (MetaStateMachine, MetaWriter, Manager),
        metrics: Metrics,
        closing: watch::Receiver<bool>,
    ) -> Self {
        Self {
            machine,
            writer,
            manager,
            allocators: Arc::default(),
            started: Instant::now(),
            closing,
            metrics,
        }
    }

    /// The gRPC server of this service.
    pub fn grpc(self) -> LimitsServer<Self> {
        LimitsServer::new(self)
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// `UNAVAILABLE` naming the leader when this node does not lead the metadata group.
    fn require_leader(&self) -> Result<(), Status> {
        let metrics = self.manager.raft().metrics().borrow().clone();
        if metrics.current_leader == Some(metrics.id) {
            return Ok(());
        }
        let leader = metrics.current_leader.and_then(|leader| {
            metrics
                .membership_config
                .membership()
                .get_node(&leader)
                .map(|node| format!("node {leader} at {}", node.grpc_addr))
        });
        Err(WireError::new(
            ErrorCode::Unavailable,
            match leader {
                Some(leader) => {
                    format!("leases are granted by the metadata leader, {leader}; connect there")
                }
                None => "no metadata leader is known (an election, or no quorum); retry".to_owned(),
            },
        )
        .into())
    }

    /// The grants of one request.
    fn grant(&self, request: &LeaseRequest) -> Result<LeaseResponse, Status> {
        if request.demands.len() > DEMANDS_PER_REQUEST_MAX {
            return Err(invalid(format!(
                "demands: at most {DEMANDS_PER_REQUEST_MAX} resources a request, got {}; split \
                 the request",
                request.demands.len()
            )));
        }
        if request.client_id == 0 {
            return Err(invalid(
                "client_id: 0 is not an id; choose a random non-zero id for the session".into(),
            ));
        }
        self.require_leader()?;
        let now = self.now_ns();
        let rules = self.machine.with_limits(|limits| {
            request
                .demands
                .iter()
                .map(|demand| limits.rules.get(&demand.resource).copied())
                .collect::<Vec<_>>()
        });
        let mut allocators = self
            .allocators
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut grants = Vec::with_capacity(request.demands.len());
        for (demand, rule) in request.demands.iter().zip(rules) {
            check_resource(&demand.resource)?;
            let Some((permits, period_ms)) = rule else {
                allocators.remove(&demand.resource);
                grants.push(LeaseGrant {
                    resource: demand.resource.clone(),
                    unknown_resource: true,
                    ..LeaseGrant::default()
                });
                continue;
            };
            let rule = lease_rule(permits, period_ms);
            if !allocators.contains_key(&demand.resource) {
                let allocator =
                    LeaseAllocator::new(rule).map_err(|error| invalid(error.to_string()))?;
                allocators.insert(demand.resource.clone(), allocator);
            }
            let Some(allocator) = allocators.get_mut(&demand.resource) else {
                continue;
            };
            if allocator.rule() != rule {
                allocator
                    .set_rule(rule)
                    .map_err(|error| invalid(error.to_string()))?;
            }
            let grant = allocator.request(request.client_id, demand.demand, now);
            let labels = ResourceLabels {
                resource: demand.resource.clone(),
            };
            let metrics = &self.metrics;
            metrics
                .limits_permits_granted
                .get_or_create(&labels)
                .inc_by(grant.permits);
            metrics
                .limits_permits_demanded
                .get_or_create(&labels)
                .inc_by(demand.demand);
            #[allow(clippy::cast_precision_loss, reason = "a rate for a gauge")]
            let per_second = permits as f64 * 1_000.0 / period_ms.max(1) as f64;
            metrics
                .limits_budget_per_second
                .get_or_create(&labels)
                .set(per_second);
            grants.push(LeaseGrant {
                resource: demand.resource.clone(),
                permits: grant.permits,
                valid_ms: grant.expires_at.saturating_sub(now) / 1_000_000,
                starts_in_ms: grant.starts_at.saturating_sub(now).div_ceil(1_000_000),
                unknown_resource: false,
                refused: grant.refused,
            });
        }
        Ok(LeaseResponse { grants })
    }
}

#[tonic::async_trait]
impl Limits for LimitsService {
    async fn set_rule(
        &self,
        request: Request<SetLimitRuleRequest>,
    ) -> Result<Response<SetLimitRuleResponse>, Status> {
        let rule = request
            .into_inner()
            .rule
            .ok_or_else(|| invalid("rule: missing; give the resource and its budget".into()))?;
        check_resource(&rule.resource)?;
        if !(PERIOD_MS_MIN..=PERIOD_MS_MAX).contains(&rule.period_ms) {
            return Err(invalid(format!(
                "period_ms: {PERIOD_MS_MIN} to {PERIOD_MS_MAX}, got {}; give 1000 for per second, \
                 60000 for per minute",
                rule.period_ms
            )));
        }
        lease_rule(rule.permits, rule.period_ms)
            .validate()
            .map_err(|error| invalid(error.to_string()))?;
        let command = MetaCommand::SetLimitRule {
            resource: rule.resource,
            permits: rule.permits,
            period_ms: rule.period_ms,
        };
        crate::metadata::write(&self.writer, command).await?;
        Ok(Response::new(SetLimitRuleResponse {}))
    }

    async fn list_rules(
        &self,
        _request: Request<ListLimitRulesRequest>,
    ) -> Result<Response<ListLimitRulesResponse>, Status> {
        crate::metadata::linearize(&self.manager).await?;
        let rules = self.machine.with_limits(|limits| {
            limits
                .rules
                .iter()
                .map(|(resource, (permits, period_ms))| LimitRule {
                    resource: resource.clone(),
                    permits: *permits,
                    period_ms: *period_ms,
                })
                .collect()
        });
        Ok(Response::new(ListLimitRulesResponse { rules }))
    }

    async fn delete_rule(
        &self,
        request: Request<DeleteLimitRuleRequest>,
    ) -> Result<Response<DeleteLimitRuleResponse>, Status> {
        let resource = request.into_inner().resource;
        check_resource(&resource)?;
        let response =
            crate::metadata::write(&self.writer, MetaCommand::DeleteLimitRule { resource }).await?;
        Ok(Response::new(DeleteLimitRuleResponse {
            existed: response.changed,
        }))
    }

    type LeasesStream = ReceiverStream<Result<LeaseResponse, Status>>;

    async fn leases(
        &self,
        request: Request<Streaming<LeaseRequest>>,
    ) -> Result<Response<Self::LeasesStream>, Status> {
        self.require_leader()?;
        let mut requests = request.into_inner();
        let (sender, receiver) = mpsc::channel(LEASE_ANSWERS_QUEUED);
        let service = self.clone();
        let mut closing = self.closing.clone();
        tokio::spawn(async move {
            let sessions = service.metrics.limits_lease_sessions.clone();
            sessions.inc();
            let _open = scopeguard(move || {
                sessions.dec();
            });
            loop {
                let next = tokio::select! {
                    next = requests.message() => Some(next),
                    _ = closing.wait_for(|closing| *closing) => None,
                };
                let Some(next) = next else {
                    let closed = WireError::new(
                        ErrorCode::Unavailable,
                        "the server is shutting down; open the session on another node",
                    );
                    let _ = sender.send(Err(closed.into())).await;
                    return;
                };
                let answer = match next {
                    Ok(Some(request)) => service.grant(&request),
                    Ok(None) | Err(_) => return,
                };
                let failed = answer.is_err();
                if sender.send(answer).await.is_err() || failed {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(receiver)))
    }

    async fn describe_resource(
        &self,
        request: Request<DescribeResourceRequest>,
    ) -> Result<Response<DescribeResourceResponse>, Status> {
        let resource = request.into_inner().resource;
        let Some((permits, period_ms)) = self
            .machine
            .with_limits(|limits| limits.rules.get(&resource).copied())
        else {
            return Err(WireError::new(
                ErrorCode::NotFound,
                format!("resource '{resource}' has no rule; set one with SetRule"),
            )
            .into());
        };
        let allocators = self
            .allocators
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now_window = self.now_ns() / lease_rule(permits, period_ms).window_ns;
        let (granted, budget, clients) = allocators.get(&resource).map_or_else(
            || (0, lease_budget(permits, period_ms, now_window), 0),
            |allocator| {
                (
                    allocator.granted(now_window),
                    allocator.budget(now_window),
                    allocator.clients() as u64,
                )
            },
        );
        Ok(Response::new(DescribeResourceResponse {
            rule: Some(LimitRule {
                resource,
                permits,
                period_ms,
            }),
            granted,
            budget,
            clients,
            lease_period_ms: lease_rule(permits, period_ms).window_ns / 1_000_000,
        }))
    }
}

/// Runs `release` when dropped (however the session task ends).
fn scopeguard(release: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(release) = self.0.take() {
                release();
            }
        }
    }
    Guard(Some(release))
}

/// The budget of window `window` of a rule no allocator holds yet.
fn lease_budget(permits: u64, period_ms: u64, window: u64) -> u64 {
    LeaseAllocator::new(lease_rule(permits, period_ms))
        .map_or(0, |allocator| allocator.budget(window))
}

/// The body of `PUT /v1/limits/{resource}`: a budget as permits per period, or per second or
/// minute.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleBody {
    permits: Option<u64>,
    period_ms: Option<u64>,
    per_second: Option<u64>,
    per_minute: Option<u64>,
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

fn rule_json(rule: &LimitRule) -> serde_json::Value {
    serde_json::json!({"resource": rule.resource, "permits": rule.permits, "period_ms": rule.period_ms})
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
    Ok(axum::Json(serde_json::json!({
        "rule": described.rule.as_ref().map(rule_json),
        "granted": described.granted,
        "budget": described.budget,
        "clients": described.clients,
        "lease_period_ms": described.lease_period_ms,
    })))
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
                "give {\"permits\", \"period_ms\"}, or {\"per_second\"}, or {\"per_minute\"}",
            )));
        }
    };
    let rule = LimitRule {
        resource,
        permits,
        period_ms,
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
