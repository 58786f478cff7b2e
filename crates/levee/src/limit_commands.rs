//! `levee limit ...`: the cluster-wide limits' rules (docs/LIMITS.md), through the Limits
//! gRPC service.

use std::process::ExitCode;

use levee_proto::limits_json::{describe_json, rule_json};
use levee_proto::v1::limits_client::LimitsClient;
use levee_proto::v1::{
    AdaptiveSpec, BreakerSpec, DeleteLimitRuleRequest, DescribeResourceRequest, KeyLimit,
    LimitRule, ListLimitRulesRequest, PerKeyLimit, SetLimitRuleRequest,
};
use serde_json::{Value, json};

use crate::client_commands::ServerAddress;

#[derive(Debug, clap::Subcommand)]
pub enum LimitCommand {
    /// Set a resource's budget, shared by every client through leases (creating the resource)
    SetRule(Box<SetRuleArgs>),
    /// List every resource's rule
    Rules(ServerOnly),
    /// Show a resource's rule and its current lease period: granted, budget, clients, the
    /// breaker's state, the adaptive budget, the calls reported, the hot keys limited
    Describe(ResourceArgs),
    /// Remove a resource's rule
    DeleteRule(ResourceArgs),
}

#[derive(Debug, clap::Args)]
pub struct ServerOnly {
    #[command(flatten)]
    address: ServerAddress,
}

#[derive(Debug, clap::Args)]
pub struct ResourceArgs {
    #[command(flatten)]
    address: ServerAddress,
    /// The resource (1 to 128 bytes)
    #[arg(long)]
    resource: String,
}

#[derive(Debug, clap::Args)]
pub struct SetRuleArgs {
    #[command(flatten)]
    resource: ResourceArgs,
    /// Permits per second over all clients
    #[arg(
        long,
        conflicts_with = "per_minute",
        required_unless_present = "per_minute"
    )]
    per_second: Option<u64>,
    /// Permits per minute over all clients (such as 21000000)
    #[arg(long)]
    per_minute: Option<u64>,
    #[command(flatten)]
    per_key: PerKeyArgs,
    #[command(flatten)]
    breaker: BreakerArgs,
    #[command(flatten)]
    adaptive: AdaptiveArgs,
}

/// Per-key limits, in the rule's period (second or minute).
#[derive(Debug, clap::Args)]
pub struct PerKeyArgs {
    /// Every key's limit over all clients (0: only the keys below are limited)
    #[arg(long)]
    per_key: Option<u64>,
    /// A key with its own limit, as KEY=PERMITS (repeatable, at most 100)
    #[arg(long, value_name = "KEY=PERMITS")]
    key_limit: Vec<String>,
    /// A hot-key app: its keys that turn hot are limited to --hot-key-permits
    #[arg(long, requires = "hot_key_permits")]
    hot_key_app: Option<String>,
    /// A hot key's limit over all clients
    #[arg(long, requires = "hot_key_app")]
    hot_key_permits: Option<u64>,
}

/// A circuit breaker over the calls clients report (one trip).
#[derive(Debug, clap::Args)]
pub struct BreakerArgs {
    /// Open when this percentage of calls failed (1 to 100)
    #[arg(long)]
    breaker_error_percent: Option<u32>,
    /// Open when this many calls failed
    #[arg(long)]
    breaker_error_count: Option<u64>,
    /// Open when this percentage of calls were slower than --slow-call-ms (1 to 100)
    #[arg(long, requires = "slow_call_ms")]
    breaker_slow_percent: Option<u32>,
    /// How slow a slow call is, in milliseconds
    #[arg(long)]
    slow_call_ms: Option<u64>,
    /// The breaker's window in milliseconds (default 10000)
    #[arg(long)]
    breaker_window_ms: Option<u64>,
    /// Calls the window must hold before it trips (default 20)
    #[arg(long)]
    breaker_min_calls: Option<u64>,
    /// How long it stays open in milliseconds (default 5000)
    #[arg(long)]
    breaker_open_ms: Option<u64>,
    /// Calls let through half-open (default 5)
    #[arg(long)]
    breaker_probes: Option<u32>,
}

/// An adaptive budget (AIMD from the calls clients report).
#[derive(Debug, clap::Args)]
pub struct AdaptiveArgs {
    /// The adaptive budget's floor, in the rule's period (turns the adaptive budget on)
    #[arg(long = "adaptive-min", id = "adaptive_min")]
    min: Option<u64>,
    /// A mean latency above this (ms) is an overload
    #[arg(long = "adaptive-latency-ms", requires = "adaptive_min")]
    latency_ms: Option<u64>,
    /// An error percentage above this is an overload (default 10)
    #[arg(long = "adaptive-error-percent", requires = "adaptive_min")]
    error_percent: Option<u32>,
}

impl PerKeyArgs {
    fn spec(&self) -> anyhow::Result<Option<PerKeyLimit>> {
        if self.per_key.is_none() && self.key_limit.is_empty() && self.hot_key_app.is_none() {
            return Ok(None);
        }
        let exceptions = self
            .key_limit
            .iter()
            .map(|pair| {
                let (key, permits) = pair.rsplit_once('=').ok_or_else(|| {
                    anyhow::anyhow!("--key-limit {pair}: give KEY=PERMITS, such as user-42=10")
                })?;
                let permits = permits.parse().map_err(|_| {
                    anyhow::anyhow!("--key-limit {pair}: PERMITS must be a whole number")
                })?;
                Ok(KeyLimit {
                    key: key.as_bytes().to_vec(),
                    permits,
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Some(PerKeyLimit {
            permits: self.per_key.unwrap_or(0),
            exceptions,
            hot_key_app: self.hot_key_app.clone().unwrap_or_default(),
            hot_key_permits: self.hot_key_permits.unwrap_or(0),
        }))
    }
}

impl BreakerArgs {
    fn spec(&self) -> anyhow::Result<Option<BreakerSpec>> {
        let trip = self.breaker_error_percent.is_some()
            || self.breaker_error_count.is_some()
            || self.breaker_slow_percent.is_some();
        let options = self.slow_call_ms.is_some()
            || self.breaker_window_ms.is_some()
            || self.breaker_min_calls.is_some()
            || self.breaker_open_ms.is_some()
            || self.breaker_probes.is_some();
        if options && !trip {
            anyhow::bail!(
                "a breaker needs a trip: give --breaker-error-percent, --breaker-error-count or \
                 --breaker-slow-percent with the other --breaker-* options"
            );
        }
        Ok(trip.then(|| BreakerSpec {
            error_ratio_percent: self.breaker_error_percent.unwrap_or(0),
            error_count: self.breaker_error_count.unwrap_or(0),
            slow_ratio_percent: self.breaker_slow_percent.unwrap_or(0),
            slow_call_ms: self.slow_call_ms.unwrap_or(0),
            window_ms: self.breaker_window_ms.unwrap_or(0),
            min_calls: self.breaker_min_calls.unwrap_or(0),
            open_ms: self.breaker_open_ms.unwrap_or(0),
            probes: self.breaker_probes.unwrap_or(0),
        }))
    }
}

impl AdaptiveArgs {
    fn spec(&self) -> Option<AdaptiveSpec> {
        self.min.map(|min_permits| AdaptiveSpec {
            min_permits,
            latency_ms: self.latency_ms.unwrap_or(0),
            error_ratio_percent: self.error_percent.unwrap_or(0),
        })
    }
}

pub fn run(command: &LimitCommand) -> ExitCode {
    let address = match command {
        LimitCommand::SetRule(args) => &args.resource.address,
        LimitCommand::Rules(args) => &args.address,
        LimitCommand::Describe(args) | LimitCommand::DeleteRule(args) => &args.address,
    };
    crate::client_commands::print_result(address.json, limit(command, &address.server))
}

async fn limit(command: &LimitCommand, server: &str) -> anyhow::Result<Value> {
    let mut limits = LimitsClient::connect(format!("http://{server}")).await?;
    let wire = |status| anyhow::Error::from(levee_client::ClientError::from(status));
    Ok(match command {
        LimitCommand::SetRule(args) => {
            let (permits, period_ms) = match (args.per_second, args.per_minute) {
                (Some(per_second), _) => (per_second, 1_000),
                (None, Some(per_minute)) => (per_minute, 60_000),
                (None, None) => anyhow::bail!("give --per-second or --per-minute"),
            };
            let rule = LimitRule {
                resource: args.resource.resource.clone(),
                permits,
                period_ms,
                per_key: args.per_key.spec()?,
                breaker: args.breaker.spec()?,
                adaptive: args.adaptive.spec(),
            };
            limits
                .set_rule(SetLimitRuleRequest {
                    rule: Some(rule.clone()),
                })
                .await
                .map_err(wire)?;
            rule_json(&rule)
        }
        LimitCommand::Rules(_) => {
            let rules = limits
                .list_rules(ListLimitRulesRequest {})
                .await
                .map_err(wire)?
                .into_inner()
                .rules;
            json!({"rules": rules.iter().map(rule_json).collect::<Vec<_>>()})
        }
        LimitCommand::Describe(args) => {
            let described = limits
                .describe_resource(DescribeResourceRequest {
                    resource: args.resource.clone(),
                })
                .await
                .map_err(wire)?
                .into_inner();
            describe_json(&described)
        }
        LimitCommand::DeleteRule(args) => {
            let existed = limits
                .delete_rule(DeleteLimitRuleRequest {
                    resource: args.resource.clone(),
                })
                .await
                .map_err(wire)?
                .into_inner()
                .existed;
            json!({"resource": args.resource, "existed": existed})
        }
    })
}
