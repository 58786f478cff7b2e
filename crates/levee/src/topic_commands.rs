//! `levee topic ...`, `levee group ...` and `levee producer ...`: operators' commands for
//! topics, consumer groups and producer rate limits, through the Rust SDK.

use std::process::ExitCode;

use levee_client::Client;
use serde_json::{Value, json};

use crate::client_commands::ServerAddress;
use crate::failure_commands;

#[derive(Debug, clap::Subcommand)]
pub enum TopicCommand {
    /// Create a topic with a fixed number of partitions (again with the same count: no change)
    Create(CreateArgs),
    /// Show a topic's partitions with their first retained and next offsets
    Describe(TopicArgs),
    /// List every topic with its partition count
    List(ServerOnly),
    /// Publish one message by key (partition = XXH3-64(key) mod partitions)
    Publish(PublishArgs),
}

#[derive(Debug, clap::Subcommand)]
pub enum GroupCommand {
    /// Show a consumer group's members, partition owners, epochs, committed offsets, lag, rate
    Describe(GroupArgs),
    /// Set a consumer group's delivery rate limit (0 clears it); takes effect at once
    SetRate(SetRateArgs),
    /// Show a consumer group's retry policy (delays and attempts before dead letters)
    RetryPolicy(failure_commands::RetryPolicyArgs),
    /// Set a consumer group's retry policy, or give it the default again
    SetRetryPolicy(failure_commands::SetRetryPolicyArgs),
    /// List a consumer group's dead letters on a topic with their history, oldest first
    DeadLetters(failure_commands::DeadLettersArgs),
    /// Put dead letters (selected, or all) back into the group's retry path
    Redrive(failure_commands::RedriveArgs),
    /// Set a group's committed offsets: earliest, latest, an offset or a time (replay, skip)
    ResetOffsets(failure_commands::ResetArgs),
}

#[derive(Debug, clap::Subcommand)]
pub enum ProducerCommand {
    /// Show a producer name's append rate limit, messages admitted under it, seconds waited
    Describe(ProducerArgs),
    /// Set the append rate limit of every request naming this producer (0 clears it); takes
    /// effect at once and is kept across restarts
    SetRate(SetProducerRateArgs),
}

#[derive(Debug, clap::Args)]
pub struct ServerOnly {
    #[command(flatten)]
    address: ServerAddress,
}

#[derive(Debug, clap::Args)]
pub struct TopicArgs {
    #[command(flatten)]
    address: ServerAddress,
    /// The topic's name
    #[arg(long)]
    topic: String,
}

#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    #[command(flatten)]
    topic: TopicArgs,
    /// Partitions (1 to 1024); fixed for the topic's life
    #[arg(long)]
    partitions: u32,
}

#[derive(Debug, clap::Args)]
pub struct PublishArgs {
    #[command(flatten)]
    topic: TopicArgs,
    /// The key that picks the partition
    #[arg(long, default_value = "")]
    key: String,
    /// The message, as text
    #[arg(long)]
    message: String,
    /// Deliver it no earlier than this many ms from now (at most 604800000, 7 days)
    #[arg(long)]
    delay_ms: Option<u64>,
}

#[derive(Debug, clap::Args)]
pub struct GroupArgs {
    #[command(flatten)]
    address: ServerAddress,
    /// The consumer group
    #[arg(long)]
    group: String,
    /// The topic the group consumes
    #[arg(long)]
    topic: String,
}

#[derive(Debug, clap::Args)]
pub struct SetRateArgs {
    #[command(flatten)]
    address: ServerAddress,
    /// The consumer group
    #[arg(long)]
    group: String,
    #[command(flatten)]
    rate: RateArgs,
}

#[derive(Debug, clap::Args)]
pub struct ProducerArgs {
    #[command(flatten)]
    address: ServerAddress,
    /// The producer name its clients send (1 to 64 bytes)
    #[arg(long)]
    producer: String,
}

#[derive(Debug, clap::Args)]
pub struct SetProducerRateArgs {
    #[command(flatten)]
    producer: ProducerArgs,
    #[command(flatten)]
    rate: RateArgs,
}

#[derive(Debug, clap::Args)]
pub struct RateArgs {
    /// Messages per second (0 clears the limit)
    #[arg(
        long,
        conflicts_with = "per_minute",
        required_unless_present = "per_minute"
    )]
    per_second: Option<f64>,
    /// Messages per minute (such as 21000000)
    #[arg(long)]
    per_minute: Option<f64>,
}

impl RateArgs {
    fn per_second(&self) -> anyhow::Result<f64> {
        match (self.per_second, self.per_minute) {
            (Some(per_second), _) => Ok(per_second),
            (None, Some(per_minute)) => Ok(per_minute / 60.0),
            (None, None) => anyhow::bail!("give --per-second or --per-minute"),
        }
    }
}

pub fn run_topic(command: &TopicCommand) -> ExitCode {
    let address = match command {
        TopicCommand::Create(args) => &args.topic.address,
        TopicCommand::Describe(args) => &args.address,
        TopicCommand::List(args) => &args.address,
        TopicCommand::Publish(args) => &args.topic.address,
    };
    crate::client_commands::print_result(address.json, topic(command, &address.server))
}

pub fn run_group(command: &GroupCommand) -> ExitCode {
    let address = match command {
        GroupCommand::Describe(args) => &args.address,
        GroupCommand::SetRate(args) => &args.address,
        GroupCommand::RetryPolicy(args) => &args.address,
        GroupCommand::SetRetryPolicy(args) => &args.address,
        GroupCommand::DeadLetters(args) => &args.on.address,
        GroupCommand::Redrive(args) => &args.on.address,
        GroupCommand::ResetOffsets(args) => &args.on.address,
    };
    crate::client_commands::print_result(address.json, group(command, &address.server))
}

async fn topic(command: &TopicCommand, server: &str) -> anyhow::Result<Value> {
    let client = Client::connect(server).await?;
    Ok(match command {
        TopicCommand::Create(args) => {
            let existed = client
                .create_topic(&args.topic.topic, args.partitions)
                .await?;
            json!({"topic": args.topic.topic, "partitions": args.partitions, "existed": existed})
        }
        TopicCommand::Describe(args) => {
            let described = client.describe_topic(&args.topic).await?;
            let partitions: Vec<Value> = described
                .partitions
                .iter()
                .map(|partition| {
                    json!({
                        "partition": partition.partition,
                        "first_offset": partition.first_offset,
                        "next_offset": partition.next_offset,
                    })
                })
                .collect();
            json!({"topic": described.topic, "partitions": partitions})
        }
        TopicCommand::List(_) => {
            let topics: Vec<Value> = client
                .list_topics()
                .await?
                .iter()
                .map(|topic| json!({"topic": topic.topic, "partitions": topic.partitions}))
                .collect();
            json!({ "topics": topics })
        }
        TopicCommand::Publish(args) if args.delay_ms.is_some() => {
            let delay = std::time::Duration::from_millis(args.delay_ms.unwrap_or_default());
            let published = client
                .publish_delayed(
                    &args.topic.topic,
                    &[(args.key.as_bytes(), args.message.as_bytes())],
                    delay,
                )
                .await?;
            let (partition, deliver_at_ms) = published.first().copied().unwrap_or_default();
            json!({
                "topic": args.topic.topic,
                "partition": partition,
                "deliver_at_ms": deliver_at_ms,
            })
        }
        TopicCommand::Publish(args) => {
            let published = client
                .publish(
                    &args.topic.topic,
                    &[(args.key.as_bytes(), args.message.as_bytes())],
                )
                .await?;
            let (partition, offset) = published.first().copied().unwrap_or_default();
            json!({"topic": args.topic.topic, "partition": partition, "offset": offset})
        }
    })
}

async fn group(command: &GroupCommand, server: &str) -> anyhow::Result<Value> {
    let client = Client::connect(server).await?;
    Ok(match command {
        GroupCommand::Describe(args) => {
            let described = client.describe_group(&args.group, &args.topic).await?;
            levee_proto::json::group_json(&described)
        }
        GroupCommand::SetRate(args) => {
            let per_second = args.rate.per_second()?;
            client.set_group_rate(&args.group, per_second).await?;
            json!({"group": args.group, "messages_per_s": per_second})
        }
        GroupCommand::RetryPolicy(args) => failure_commands::retry_policy(&client, args).await?,
        GroupCommand::SetRetryPolicy(args) => {
            failure_commands::set_retry_policy(&client, args).await?
        }
        GroupCommand::DeadLetters(args) => failure_commands::dead_letters(&client, args).await?,
        GroupCommand::Redrive(args) => failure_commands::redrive(&client, args).await?,
        GroupCommand::ResetOffsets(args) => failure_commands::reset(&client, args).await?,
    })
}

pub fn run_producer(command: &ProducerCommand) -> ExitCode {
    let address = match command {
        ProducerCommand::Describe(args) => &args.address,
        ProducerCommand::SetRate(args) => &args.producer.address,
    };
    crate::client_commands::print_result(address.json, producer(command, &address.server))
}

async fn producer(command: &ProducerCommand, server: &str) -> anyhow::Result<Value> {
    let client = Client::connect(server).await?;
    Ok(match command {
        ProducerCommand::Describe(args) => {
            let described = client.describe_producer(&args.producer).await?;
            levee_proto::json::producer_json(&described)
        }
        ProducerCommand::SetRate(args) => {
            let per_second = args.rate.per_second()?;
            client
                .set_producer_rate(&args.producer.producer, per_second)
                .await?;
            json!({"producer_name": args.producer.producer, "messages_per_s": per_second})
        }
    })
}
