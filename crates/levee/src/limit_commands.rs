//! `levee limit ...`: the cluster-wide limits' rules (docs/LIMITS.md), through the Limits
//! gRPC service.

use std::process::ExitCode;

use levee_proto::v1::limits_client::LimitsClient;
use levee_proto::v1::{
    DeleteLimitRuleRequest, DescribeResourceRequest, LimitRule, ListLimitRulesRequest,
    SetLimitRuleRequest,
};
use serde_json::{Value, json};

use crate::client_commands::ServerAddress;

#[derive(Debug, clap::Subcommand)]
pub enum LimitCommand {
    /// Set a resource's budget, shared by every client through leases (creating the resource)
    SetRule(SetRuleArgs),
    /// List every resource's rule
    Rules(ServerOnly),
    /// Show a resource's rule and its current lease period: granted, budget, clients
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
}

pub fn run(command: &LimitCommand) -> ExitCode {
    let address = match command {
        LimitCommand::SetRule(args) => &args.resource.address,
        LimitCommand::Rules(args) => &args.address,
        LimitCommand::Describe(args) | LimitCommand::DeleteRule(args) => &args.address,
    };
    crate::client_commands::print_result(address.json, limit(command, &address.server))
}

fn rule_json(rule: &LimitRule) -> Value {
    json!({"resource": rule.resource, "permits": rule.permits, "period_ms": rule.period_ms})
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
            json!({
                "rule": described.rule.as_ref().map(rule_json),
                "granted": described.granted,
                "budget": described.budget,
                "clients": described.clients,
                "lease_period_ms": described.lease_period_ms,
            })
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
