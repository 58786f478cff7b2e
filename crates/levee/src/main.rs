//! The `levee` binary: `levee server` runs the server; the other commands talk to a running
//! server through the Rust SDK.

mod client_commands;
mod server_command;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

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
    Server(server_command::ServerArgs),
    /// Ask a running server whether it is serving (exit 0 if it is, 1 if not).
    Health(client_commands::HealthArgs),
    /// Show a running server's version, addresses, data directory and uptime.
    Info(client_commands::InfoArgs),
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
    }
}
