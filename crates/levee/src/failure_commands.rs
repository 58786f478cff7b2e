//! `levee group retry-policy|set-retry-policy|dead-letters|redrive|reset-offsets`: what an
//! operator does when consumers fail (docs/ARCHITECTURE.md, "When consumers fail").

use levee_client::{Client, ResetTo};
use serde_json::{Value, json};

use crate::client_commands::ServerAddress;

#[derive(Debug, clap::Args)]
pub struct RetryPolicyArgs {
    #[command(flatten)]
    pub address: ServerAddress,
    /// The consumer group
    #[arg(long)]
    group: String,
}

#[derive(Debug, clap::Args)]
pub struct SetRetryPolicyArgs {
    #[command(flatten)]
    pub address: ServerAddress,
    /// The consumer group
    #[arg(long)]
    group: String,
    /// Delays before the 2nd, 3rd, ... attempt in ms, comma-separated (the last repeats):
    /// 1 to 32 steps of 1 to 604800000
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "default",
        conflicts_with = "default"
    )]
    delays_ms: Vec<u64>,
    /// Deliveries a message gets, the first included, before it is dead-lettered (1 to 100)
    #[arg(long, required_unless_present = "default", conflicts_with = "default")]
    max_attempts: Option<u32>,
    /// Give the group the default policy again (1 s, 10 s, 1 min, 10 min; 5 attempts)
    #[arg(long)]
    default: bool,
}

/// A group on a topic, on a server.
#[derive(Debug, clap::Args)]
pub struct GroupTopicArgs {
    #[command(flatten)]
    pub address: ServerAddress,
    /// The consumer group
    #[arg(long)]
    group: String,
    /// The topic it consumes
    #[arg(long)]
    topic: String,
}

#[derive(Debug, clap::Args)]
pub struct DeadLettersArgs {
    #[command(flatten)]
    pub on: GroupTopicArgs,
    /// Start at this dead letter's offset
    #[arg(long, default_value_t = 0)]
    from: u64,
    /// At most this many (1 to 1000)
    #[arg(long, default_value_t = 100)]
    max: u32,
}

#[derive(Debug, clap::Args)]
pub struct RedriveArgs {
    #[command(flatten)]
    pub on: GroupTopicArgs,
    /// The dead letters' offsets (as `levee group dead-letters` lists them), comma-separated
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "all",
        conflicts_with = "all"
    )]
    offsets: Vec<u64>,
    /// Every dead letter
    #[arg(long)]
    all: bool,
}

#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("to").required(true).args(["earliest", "latest", "offset", "timestamp_ms"])))]
pub struct ResetArgs {
    #[command(flatten)]
    pub on: GroupTopicArgs,
    /// Only these partitions, comma-separated (default: every one)
    #[arg(long, value_delimiter = ',')]
    partitions: Vec<u32>,
    /// To the oldest retained message (replay everything kept)
    #[arg(long)]
    earliest: bool,
    /// To the end (skip everything published so far)
    #[arg(long)]
    latest: bool,
    /// To this offset in every partition reset
    #[arg(long)]
    offset: Option<u64>,
    /// To the first message written at or after this time, in ms since the Unix epoch (up to
    /// one 4 KiB chunk earlier, never later)
    #[arg(long)]
    timestamp_ms: Option<u64>,
    /// Reset while members consume: their streams end and they join again at the new offsets
    #[arg(long)]
    force: bool,
}

pub async fn retry_policy(client: &Client, args: &RetryPolicyArgs) -> anyhow::Result<Value> {
    let described = client.retry_policy(&args.group).await?;
    Ok(levee_proto::json::retry_policy_json(&described))
}

pub async fn set_retry_policy(client: &Client, args: &SetRetryPolicyArgs) -> anyhow::Result<Value> {
    if args.default {
        client.clear_retry_policy(&args.group).await?;
    } else {
        let delays: Vec<std::time::Duration> = args
            .delays_ms
            .iter()
            .map(|&ms| std::time::Duration::from_millis(ms))
            .collect();
        let attempts = args
            .max_attempts
            .ok_or_else(|| anyhow::anyhow!("give --max-attempts"))?;
        client
            .set_retry_policy(&args.group, &delays, attempts)
            .await?;
    }
    let described = client.retry_policy(&args.group).await?;
    Ok(levee_proto::json::retry_policy_json(&described))
}

pub async fn dead_letters(client: &Client, args: &DeadLettersArgs) -> anyhow::Result<Value> {
    let page = client
        .dead_letters(&args.on.group, &args.on.topic, args.from, args.max)
        .await?;
    Ok(levee_proto::json::dead_letters_json(&page))
}

pub async fn redrive(client: &Client, args: &RedriveArgs) -> anyhow::Result<Value> {
    let offsets = (!args.all).then_some(args.offsets.as_slice());
    let redriven = client
        .redrive_dead_letters(&args.on.group, &args.on.topic, offsets)
        .await?;
    Ok(json!({"group": args.on.group, "topic": args.on.topic, "redriven": redriven}))
}

pub async fn reset(client: &Client, args: &ResetArgs) -> anyhow::Result<Value> {
    let to = match (args.earliest, args.latest, args.offset, args.timestamp_ms) {
        (true, _, _, _) => ResetTo::Earliest(true),
        (_, true, _, _) => ResetTo::Latest(true),
        (_, _, Some(offset), _) => ResetTo::Offset(offset),
        (_, _, _, Some(timestamp_ms)) => ResetTo::TimestampMs(timestamp_ms),
        _ => anyhow::bail!("give --earliest, --latest, --offset or --timestamp-ms"),
    };
    let reset = client
        .reset_group_offsets(
            &args.on.group,
            &args.on.topic,
            &args.partitions,
            to,
            args.force,
        )
        .await?;
    Ok(levee_proto::json::reset_json(&reset))
}
