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
use levee_limit::LeaseAllocator;
use levee_proto::WireError;
use levee_proto::v1::limits_server::{Limits, LimitsServer};
use levee_proto::v1::{
    BreakerStatus, CallStats, DeleteLimitRuleRequest, DeleteLimitRuleResponse,
    DescribeResourceRequest, DescribeResourceResponse, ErrorCode, LeaseGrant, LeaseRequest,
    LeaseResponse, LimitRule, ListLimitRulesRequest, ListLimitRulesResponse, SetLimitRuleRequest,
    SetLimitRuleResponse,
};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::hotkey::hub::HotKeyHub;
use crate::metrics::{Metrics, ResourceLabels};

mod http;
mod peer_hot;
mod policy;

pub use http::router;
use policy::{ResourceState, lease_rule};

/// Longest resource name, in bytes.
pub const RESOURCE_BYTES_MAX: usize = 128;
/// Most demands in one lease request.
pub const DEMANDS_PER_REQUEST_MAX: usize = 1_000;
/// Lease answers queued for a slow client before its requests wait.
const LEASE_ANSWERS_QUEUED: usize = 16;
/// The shortest and longest rule period, in milliseconds.
const PERIOD_MS_MIN: u64 = 1_000;
const PERIOD_MS_MAX: u64 = 86_400_000;

/// What the leader keeps while it grants: each resource's state, for one term (a node that
/// lost and won the lead again starts afresh: breakers closed, adaptive budgets full).
#[derive(Debug, Default)]
struct Granting {
    term: u64,
    resources: HashMap<String, ResourceState>,
}

/// The Limits service.
#[derive(Clone)]
pub struct LimitsService {
    machine: MetaStateMachine,
    writer: MetaWriter,
    manager: Manager,
    resources: Arc<Mutex<Granting>>,
    hub: Arc<HotKeyHub>,
    peers: peer_hot::PeerHotKeys,
    started: Instant,
    closing: watch::Receiver<bool>,
    metrics: Metrics,
}

impl std::fmt::Debug for LimitsService {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("LimitsService")
    }
}

pub(crate) fn invalid(message: String) -> Status {
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

impl LimitsService {
    /// The service over the metadata group's state machine, written with `writer`; lease
    /// streams end when `closing` turns true.
    pub fn new(
        (machine, writer, manager): (MetaStateMachine, MetaWriter, Manager),
        hub: Arc<HotKeyHub>,
        metrics: Metrics,
        closing: watch::Receiver<bool>,
    ) -> Self {
        Self {
            machine,
            writer,
            manager,
            resources: Arc::default(),
            hub,
            peers: peer_hot::PeerHotKeys::default(),
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

    /// `UNAVAILABLE` naming the leader when this node does not lead the metadata group; its
    /// term when it does.
    fn require_leader(&self) -> Result<u64, Status> {
        let metrics = self.manager.raft().metrics().borrow().clone();
        if metrics.current_leader == Some(metrics.id) {
            return Ok(metrics.current_term);
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
        let term = self.require_leader()?;
        let now = self.now_ns();
        let mut granting = self
            .resources
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if granting.term != term {
            *granting = Granting {
                term,
                resources: HashMap::new(),
            };
        }
        let resources = &mut granting.resources;
        // Each resource follows its replicated rule (compared in place: a policy is copied
        // only when it changed).
        let rules = self.machine.with_limits(|limits| {
            request
                .demands
                .iter()
                .map(|demand| {
                    let Some(budget) = limits.rules.get(&demand.resource).copied() else {
                        return Ok(None);
                    };
                    let policy = limits
                        .policies
                        .get(&demand.resource)
                        .map_or(&[][..], Vec::as_slice);
                    if let Some(state) = resources.get_mut(&demand.resource) {
                        state.sync(budget, policy)?;
                    } else {
                        let state = ResourceState::new(budget, policy, now)?;
                        resources.insert(demand.resource.clone(), state);
                    }
                    Ok(Some(budget))
                })
                .collect::<Result<Vec<_>, Status>>()
        })?;
        let mut grants = Vec::with_capacity(request.demands.len());
        for (demand, rule) in request.demands.iter().zip(rules) {
            check_resource(&demand.resource)?;
            let (Some(_), Some(state)) = (rule, resources.get_mut(&demand.resource)) else {
                resources.remove(&demand.resource);
                grants.push(LeaseGrant {
                    resource: demand.resource.clone(),
                    unknown_resource: true,
                    ..LeaseGrant::default()
                });
                continue;
            };
            state.record(demand.stats.as_ref(), now)?;
            let grant = state.allocator.request_returning(
                request.client_id,
                demand.demand,
                demand.returned,
                now,
            );
            let extras = state.extras(
                grant.permits,
                demand.keys_version,
                |app| self.hot_keys(app),
                now,
            );
            self.count(&demand.resource, demand, state, extras.permits);
            grants.push(LeaseGrant {
                resource: demand.resource.clone(),
                permits: extras.permits,
                valid_ms: grant.expires_at.saturating_sub(now) / 1_000_000,
                starts_in_ms: grant.starts_at.saturating_sub(now).div_ceil(1_000_000),
                unknown_resource: false,
                refused: grant.refused,
                breaker: extras.breaker.into(),
                slow_call_ms: extras.slow_call_ms,
                key_limits: extras.key_limits,
                // Top-ups only while calls pass freely (not past a breaker's probes).
                top_up: if matches!(
                    extras.breaker,
                    BreakerStatus::Closed | BreakerStatus::Unspecified
                ) {
                    grant.top_up
                } else {
                    0
                },
            });
        }
        Ok(LeaseResponse { grants })
    }

    /// The hot keys of `app`: this node's, and those the other members answered last.
    fn hot_keys(&self, app: &str) -> Vec<Vec<u8>> {
        let mut keys = self.peers.hot_keys(app);
        keys.extend(self.hub.hot_keys(app).into_iter().map(|event| event.key));
        keys.into_iter().collect()
    }

    /// Follows the other members' hot keys of the apps the rules name while this node leads
    /// (`peer_hot`), until `stop` turns true.
    pub fn follow_peer_hot_keys(&self, stop: watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        self.peers
            .follow(self.machine.clone(), self.manager.clone(), stop)
    }

    /// The metrics of one grant.
    fn count(
        &self,
        resource: &str,
        demand: &levee_proto::v1::LeaseDemand,
        state: &mut ResourceState,
        granted: u64,
    ) {
        let labels = ResourceLabels {
            resource: resource.to_owned(),
        };
        let metrics = &self.metrics;
        metrics
            .limits_permits_granted
            .get_or_create(&labels)
            .inc_by(granted);
        metrics
            .limits_permits_demanded
            .get_or_create(&labels)
            .inc_by(demand.demand);
        let rule = state.allocator.rule();
        #[allow(clippy::cast_precision_loss, reason = "a rate for a gauge")]
        let per_second = rule.permits as f64 * 1e9 / rule.period_ns.max(1) as f64;
        metrics
            .limits_budget_per_second
            .get_or_create(&labels)
            .set(per_second);
        if let Some(stats) = &demand.stats {
            metrics
                .limits_calls_reported
                .get_or_create(&labels)
                .inc_by(stats.calls.min(policy::REPORTED_CALLS_MAX));
            metrics
                .limits_call_errors_reported
                .get_or_create(&labels)
                .inc_by(
                    stats
                        .errors
                        .min(stats.calls)
                        .min(policy::REPORTED_CALLS_MAX),
                );
        }
        let status = state.breaker_status(self.now_ns());
        if let Some(breaker) = &state.breaker {
            metrics
                .limits_breaker_state
                .get_or_create(&labels)
                .set(state_gauge(status));
            metrics
                .limits_breaker_opens
                .get_or_create(&labels)
                .set(i64::try_from(breaker.times_opened()).unwrap_or(i64::MAX));
        }
    }
}

/// A breaker state as the gauge shows it: 0 closed, 1 half-open, 2 open.
fn state_gauge(status: levee_proto::v1::BreakerStatus) -> i64 {
    use levee_proto::v1::BreakerStatus;
    match status {
        BreakerStatus::Unspecified | BreakerStatus::Closed => 0,
        BreakerStatus::HalfOpen => 1,
        BreakerStatus::Open => 2,
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
        policy::check(&rule)?;
        let command = MetaCommand::SetLimitRule {
            policy: ResourceState::policy_bytes(&rule),
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
                .map(|(resource, (permits, period_ms))| {
                    policy::with_policy(
                        LimitRule {
                            resource: resource.clone(),
                            permits: *permits,
                            period_ms: *period_ms,
                            ..LimitRule::default()
                        },
                        limits.policies.get(resource),
                    )
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
        let Some(((permits, period_ms), policy_bytes)) = self.machine.with_limits(|limits| {
            limits
                .rules
                .get(&resource)
                .map(|budget| (*budget, limits.policies.get(&resource).cloned()))
        }) else {
            return Err(WireError::new(
                ErrorCode::NotFound,
                format!("resource '{resource}' has no rule; set one with SetRule"),
            )
            .into());
        };
        let now = self.now_ns();
        let mut granting = self
            .resources
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let resources = &mut granting.resources;
        let now_window = now / lease_rule(permits, period_ms).window_ns;
        let rule = policy::with_policy(
            LimitRule {
                resource: resource.clone(),
                permits,
                period_ms,
                ..LimitRule::default()
            },
            policy_bytes.as_ref(),
        );
        let mut described = DescribeResourceResponse {
            budget: lease_budget(permits, period_ms, now_window),
            lease_period_ms: lease_rule(permits, period_ms).window_ns / 1_000_000,
            permits_now: permits,
            breaker: if rule.breaker.is_some() {
                BreakerStatus::Closed.into()
            } else {
                BreakerStatus::Unspecified.into()
            },
            ..DescribeResourceResponse::default()
        };
        if let Some(state) = resources.get_mut(&resource) {
            described.granted = state.allocator.granted(now_window);
            described.budget = state.allocator.budget(now_window);
            described.clients = state.allocator.active_clients(now) as u64;
            described.breaker = state.breaker_status(now).into();
            described.breaker_opened = state
                .breaker
                .as_ref()
                .map_or(0, levee_limit::CircuitBreaker::times_opened);
            described.permits_now = state.permits_now();
            described.calls = Some(CallStats {
                calls: state.total.calls,
                errors: state.total.errors,
                slow: state.total.slow,
                latency_sum_us: state.total.latency_sum_ns / 1_000,
            });
            described.hot_keys_limited = state.hot_keys_limited();
        }
        described.rule = Some(rule);
        Ok(Response::new(described))
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
