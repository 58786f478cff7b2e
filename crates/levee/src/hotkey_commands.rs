//! `levee hotkey ...`: operators' commands for hot keys, through the Rust SDK.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use levee_client::{Client, HotKeyEvent};
use levee_proto::json::{RuleRecord, key_hex};
use serde_json::{Value, json};

use crate::client_commands::ServerAddress;

#[derive(Debug, clap::Subcommand)]
pub enum HotKeyCommand {
    /// List the apps the server knows
    Apps(ServerAddress),
    /// Show an app's rules
    Rules(AppArgs),
    /// Replace an app's rules with a JSON file: [{"match":"prefix","key":"pin_","window_ms":2000,
    /// "threshold":20,"hot_duration_ms":30000,"description":"hot users"}]
    SetRules(SetRulesArgs),
    /// List an app's hot keys
    Hot(AppArgs),
    /// Set a key hot by hand; it is pushed to every app server of the app
    Add(KeyArgs),
    /// Cool a hot key by hand
    Remove(KeyArgs),
    /// Show the keys with the highest window counts
    Top(TopArgs),
    /// Show an app's counters
    Stats(AppArgs),
}

#[derive(Debug, clap::Args)]
pub struct AppArgs {
    #[command(flatten)]
    address: ServerAddress,
    /// The app
    #[arg(long)]
    app: String,
}

#[derive(Debug, clap::Args)]
pub struct SetRulesArgs {
    #[command(flatten)]
    app: AppArgs,
    /// The JSON file with the rules
    #[arg(long)]
    file: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct KeyArgs {
    #[command(flatten)]
    app: AppArgs,
    /// The key
    #[arg(long)]
    key: String,
    /// How long it stays hot, in milliseconds (add only)
    #[arg(long, default_value_t = 60_000)]
    duration_ms: u64,
}

#[derive(Debug, clap::Args)]
pub struct TopArgs {
    #[command(flatten)]
    app: AppArgs,
    /// How many keys
    #[arg(long, default_value_t = 10)]
    limit: u32,
}

fn key_value(key: &[u8]) -> Value {
    match std::str::from_utf8(key) {
        Ok(text) => json!({"key": text}),
        Err(_) => json!({"key_hex": key_hex(key)}),
    }
}

fn hot_value(event: &HotKeyEvent) -> Value {
    let mut value = key_value(&event.key);
    value["hot_for_ms"] = json!(event.hot_for_ms);
    value["count"] = json!(event.count);
    value
}

pub fn run(command: &HotKeyCommand) -> ExitCode {
    let (address, json) = match command {
        HotKeyCommand::Apps(address) => (address, address.json),
        HotKeyCommand::Rules(args) | HotKeyCommand::Hot(args) | HotKeyCommand::Stats(args) => {
            (&args.address, args.address.json)
        }
        HotKeyCommand::SetRules(args) => (&args.app.address, args.app.address.json),
        HotKeyCommand::Add(args) | HotKeyCommand::Remove(args) => {
            (&args.app.address, args.app.address.json)
        }
        HotKeyCommand::Top(args) => (&args.app.address, args.app.address.json),
    };
    crate::client_commands::print_result(json, call(command, &address.server))
}

async fn call(command: &HotKeyCommand, server: &str) -> anyhow::Result<Value> {
    let client = Client::connect(server).await?;
    Ok(match command {
        HotKeyCommand::Apps(_) => json!({"apps": client.hot_key_apps().await?}),
        HotKeyCommand::Rules(args) => {
            let rules = client.hot_key_rules(&args.app).await?;
            let records: Vec<RuleRecord> = rules.iter().map(RuleRecord::from_wire).collect();
            json!({"app": args.app, "rules": records})
        }
        HotKeyCommand::SetRules(args) => {
            let text = std::fs::read_to_string(&args.file)
                .with_context(|| format!("reading {}", args.file.display()))?;
            let records: Vec<RuleRecord> = serde_json::from_str(&text)
                .with_context(|| format!("{} is not a JSON array of rules", args.file.display()))?;
            let rules = records
                .iter()
                .map(RuleRecord::to_wire)
                .collect::<Result<Vec<_>, _>>()
                .map_err(anyhow::Error::msg)?;
            client.set_hot_key_rules(&args.app.app, rules).await?;
            json!({"app": args.app.app, "rules_set": records.len()})
        }
        HotKeyCommand::Hot(args) => {
            let hot: Vec<Value> = client
                .hot_keys(&args.app)
                .await?
                .iter()
                .map(hot_value)
                .collect();
            json!({"app": args.app, "hot": hot})
        }
        HotKeyCommand::Add(args) => {
            let duration = Duration::from_millis(args.duration_ms);
            client
                .set_hot_key(&args.app.app, args.key.as_bytes(), duration)
                .await?;
            json!({"app": args.app.app, "key": args.key, "hot": true})
        }
        HotKeyCommand::Remove(args) => {
            let was_hot = client
                .remove_hot_key(&args.app.app, args.key.as_bytes())
                .await?;
            json!({"app": args.app.app, "key": args.key, "was_hot": was_hot})
        }
        HotKeyCommand::Top(args) => {
            let keys: Vec<Value> = client
                .top_keys(&args.app.app, args.limit)
                .await?
                .iter()
                .map(|entry| {
                    let mut value = key_value(&entry.key);
                    value["count"] = json!(entry.count);
                    value
                })
                .collect();
            json!({"app": args.app.app, "keys": keys})
        }
        HotKeyCommand::Stats(args) => {
            let stats = client.hot_key_stats(&args.app).await?;
            json!({
                "app": args.app,
                "hits_received": stats.hits_received,
                "reports_received": stats.reports_received,
                "hot_detected": stats.hot_detected,
                "hot_now": stats.hot_now,
                "keys_tracked": stats.keys_tracked,
                "clients_connected": stats.clients_connected,
            })
        }
    })
}
