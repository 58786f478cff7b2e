//! The `levee` binary: `levee server` runs the server; the other commands talk to a running
//! server through the Rust SDK.

// Doc comments on clap types are the CLI's help text, where backticks would show.
#![allow(clippy::doc_markdown)]

mod bench;
mod client_commands;
mod cluster_commands;
mod failure_commands;
mod hotkey_commands;
mod limit_commands;
mod queue_commands;
mod server_command;
mod topic_commands;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// Every message crosses the server as a few small allocations (decoded payloads, batches,
/// responses); glibc's allocator was a fifth of the CPU under `levee bench queue`.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Levee keeps backend services standing through traffic peaks.
#[derive(Debug, Parser)]
#[command(name = "levee", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the server (no configuration needed: embedded defaults apply).
    Server(Box<server_command::ServerArgs>),
    /// Ask a running server whether it is serving (exit 0 if it is, 1 if not).
    Health(client_commands::HealthArgs),
    /// Show a running server's version, addresses, data directory and uptime.
    Info(client_commands::InfoArgs),
    /// Queues: append, read, info, list, delete.
    #[command(subcommand)]
    Queue(queue_commands::QueueCommand),
    /// Topics: create, describe, list, publish by key.
    #[command(subcommand)]
    Topic(topic_commands::TopicCommand),
    /// Consumer groups: describe, set a rate limit, retry policy, dead letters, offset resets.
    #[command(subcommand)]
    Group(topic_commands::GroupCommand),
    /// Producers: describe, set an append rate limit per producer name.
    #[command(subcommand)]
    Producer(topic_commands::ProducerCommand),
    /// Hot keys: rules, hot keys by hand, top keys, stats.
    #[command(subcommand)]
    Hotkey(hotkey_commands::HotKeyCommand),
    /// Limits: cluster-wide budgets shared through leases (set a rule, list, describe, delete).
    #[command(subcommand)]
    Limit(limit_commands::LimitCommand),
    /// The cluster: status, add a node, remove a node.
    #[command(subcommand)]
    Cluster(cluster_commands::ClusterCommand),
    /// Load tools that drive a server through the real client over loopback.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Delayed delivery: a million delayed messages waiting at once (server memory), and how
    /// late each reaches its handler after its time.
    Delay(bench::delay::DelayBenchArgs),
    /// Cluster failover: kill -9 the leader again and again while writing metadata; failover
    /// time percentiles and acknowledged writes lost (must be 0).
    Failover(bench::failover::FailoverBenchArgs),
    /// Limits: local decisions per second, and a cluster-wide cap's accuracy with many clients.
    Limits(bench::limits::LimitsBenchArgs),
    /// Hot keys: ingestion, detection latency, precision and recall, push throughput.
    Hotkey(bench::hotkey::HotKeyBenchArgs),
    /// Queues over the network: producers and subscriptions, append-to-delivery latency.
    Queue(bench::queue::QueueBenchArgs),
    /// Queue store: the Tianchi race shape (put, random check, sequential check, recovery).
    Store(bench::store::StoreBenchArgs),
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|error| error.exit());
    match cli.command {
        Command::Server(args) => {
            let server_matches = matches.subcommand_matches("server").unwrap_or(&matches);
            server_command::run(&args, server_matches)
        }
        Command::Health(args) => client_commands::health(&args),
        Command::Info(args) => client_commands::info(&args),
        Command::Hotkey(command) => hotkey_commands::run(&command),
        Command::Queue(command) => queue_commands::run(&command),
        Command::Topic(command) => topic_commands::run_topic(&command),
        Command::Group(command) => topic_commands::run_group(&command),
        Command::Producer(command) => topic_commands::run_producer(&command),
        Command::Cluster(command) => cluster_commands::run(&command),
        Command::Limit(command) => limit_commands::run(&command),
        Command::Bench(command) => {
            let result = match command {
                BenchCommand::Delay(args) => bench::delay::run(&args),
                BenchCommand::Failover(args) => bench::failover::run(&args),
                BenchCommand::Hotkey(args) => bench::hotkey::run(&args),
                BenchCommand::Limits(args) => bench::limits::run(&args),
                BenchCommand::Store(args) => bench::store::run(&args),
                BenchCommand::Queue(args) => bench::queue::run(&args),
            };
            match result {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => {
                    eprintln!("error: {error:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
