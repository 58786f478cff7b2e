//! `levee queue ...`: operators' commands for queues, through the Rust SDK.

use std::process::ExitCode;

use anyhow::Context;
use levee_client::Client;
use serde_json::{Value, json};

use crate::client_commands::ServerAddress;

#[derive(Debug, clap::Subcommand)]
pub enum QueueCommand {
    /// Append one message; prints its offset once it is durable
    Append(AppendArgs),
    /// Read messages from an offset
    Read(ReadArgs),
    /// Show a queue's first retained offset and next offset
    Info(QueueArgs),
    /// List queue names, a page at a time
    List(ListArgs),
    /// Delete a queue and its messages (refused while a subscription holds it; every
    /// consumer's position on it is forgotten, so a queue created again starts from 0)
    Delete(QueueArgs),
    /// Set the retention of queues starting with a prefix (kept across restarts)
    Retention(RetentionArgs),
}

#[derive(Debug, clap::Args)]
pub struct RetentionArgs {
    #[command(flatten)]
    address: ServerAddress,
    /// Queue-name prefix (the longest matching prefix wins; empty: every queue)
    #[arg(long, default_value = "")]
    prefix: String,
    /// Remove messages older than this many ms (0: no age bound)
    #[arg(long, default_value_t = 0)]
    max_age_ms: u64,
    /// Remove the oldest messages while a queue holds more than this many bytes (0: no bound)
    #[arg(long, default_value_t = 0)]
    max_bytes: u64,
}

#[derive(Debug, clap::Args)]
pub struct QueueArgs {
    #[command(flatten)]
    address: ServerAddress,
    /// The queue's name
    #[arg(long)]
    queue: String,
}

#[derive(Debug, clap::Args)]
pub struct AppendArgs {
    #[command(flatten)]
    queue: QueueArgs,
    /// The message, as text
    #[arg(long)]
    message: String,
}

#[derive(Debug, clap::Args)]
pub struct ReadArgs {
    #[command(flatten)]
    queue: QueueArgs,
    /// First offset to read
    #[arg(long, default_value_t = 0)]
    offset: u64,
    /// Most messages to read (1 to 10000)
    #[arg(long, default_value_t = 100)]
    max_messages: u32,
}

#[derive(Debug, clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    address: ServerAddress,
    /// Only names that start with this
    #[arg(long, default_value = "")]
    prefix: String,
    /// The next page: the `next_page_token` a previous list printed
    #[arg(long, default_value = "")]
    page_token: String,
    /// Most names (1 to 10000)
    #[arg(long, default_value_t = 1_000)]
    limit: u32,
}

fn text(bytes: &[u8]) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(text) => json!(text),
        Err(_) => json!({"hex": levee_proto::json::key_hex(bytes)}),
    }
}

pub fn run(command: &QueueCommand) -> ExitCode {
    let address = match command {
        QueueCommand::Append(args) => &args.queue.address,
        QueueCommand::Read(args) => &args.queue.address,
        QueueCommand::Info(args) | QueueCommand::Delete(args) => &args.address,
        QueueCommand::List(args) => &args.address,
        QueueCommand::Retention(args) => &args.address,
    };
    crate::client_commands::print_result(address.json, call(command, &address.server))
}

async fn call(command: &QueueCommand, server: &str) -> anyhow::Result<Value> {
    let client = Client::connect(server).await?;
    Ok(match command {
        QueueCommand::Append(args) => {
            let queue = args.queue.queue.as_bytes();
            let offset = client.append(queue, args.message.as_bytes()).await?;
            json!({"queue": args.queue.queue, "offset": offset})
        }
        QueueCommand::Read(args) => {
            let queue = args.queue.queue.as_bytes();
            let read = client
                .read(queue, args.offset, args.max_messages, 0)
                .await?;
            let messages: Vec<Value> = read
                .payloads
                .iter()
                .zip(read.first_offset..)
                .map(|(payload, offset)| json!({"offset": offset, "message": text(payload)}))
                .collect();
            json!({
                "queue": args.queue.queue,
                "messages": messages,
                "next_offset": read.next_offset,
                "queue_next_offset": read.queue_next_offset,
                "skipped_to_first_retained": read.skipped_to_first_retained,
            })
        }
        QueueCommand::Info(args) => {
            let info = client.queue_info(args.queue.as_bytes()).await?;
            json!({
                "queue": args.queue,
                "first_offset": info.first_offset,
                "next_offset": info.next_offset,
                "retention_max_age_ms": info.retention_max_age_ms,
                "retention_max_bytes": info.retention_max_bytes,
            })
        }
        QueueCommand::List(args) => {
            let token = levee_proto::json::key_from_hex(&args.page_token)
                .context("--page-token is the hex next_page_token a list printed")?;
            let page = client
                .list_queue_page(args.prefix.as_bytes(), &token, args.limit)
                .await?;
            json!({
                "queues": page.queues.iter().map(|name| text(name)).collect::<Vec<_>>(),
                "next_page_token": levee_proto::json::key_hex(&page.next_page_token),
            })
        }
        QueueCommand::Retention(args) => {
            let removed = client
                .set_retention(args.prefix.as_bytes(), args.max_age_ms, args.max_bytes)
                .await?;
            json!({
                "prefix": args.prefix,
                "max_age_ms": args.max_age_ms,
                "max_bytes": args.max_bytes,
                "messages_removed": removed,
            })
        }
        QueueCommand::Delete(args) => {
            let existed = client.delete_queue(args.queue.as_bytes()).await?;
            json!({"queue": args.queue, "existed": existed})
        }
    })
}
