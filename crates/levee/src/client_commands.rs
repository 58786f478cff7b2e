//! Commands that talk to a running server through the Rust SDK.

use std::process::ExitCode;

use levee_client::{Client, HealthStatus};

const EXIT_UNHEALTHY: u8 = 1;

#[derive(Debug, clap::Args)]
pub struct ServerAddress {
    /// The server's gRPC address
    #[arg(
        long,
        env = "LEVEE_SERVER",
        value_name = "HOST:PORT",
        default_value = "127.0.0.1:7070"
    )]
    pub server: String,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct HealthArgs {
    #[command(flatten)]
    address: ServerAddress,
    /// The service to ask about; empty for the whole server
    #[arg(long, default_value = "")]
    service: String,
}

#[derive(Debug, clap::Args)]
pub struct InfoArgs {
    #[command(flatten)]
    address: ServerAddress,
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

pub fn health(args: &HealthArgs) -> ExitCode {
    let result = runtime().map_err(anyhow::Error::from).and_then(|runtime| {
        runtime.block_on(async {
            let client = Client::connect(&args.address.server).await?;
            Ok::<_, anyhow::Error>(client.health(&args.service).await?)
        })
    });
    let (status, detail) = match &result {
        Ok(HealthStatus::Serving) => ("SERVING", String::new()),
        Ok(HealthStatus::NotServing) => ("NOT_SERVING", String::new()),
        Ok(HealthStatus::Unknown) => ("UNKNOWN", String::new()),
        Err(error) => ("UNREACHABLE", error.to_string()),
    };
    if args.address.json {
        println!(
            "{}",
            serde_json::json!({"server": args.address.server, "status": status, "error": detail})
        );
    } else if detail.is_empty() {
        println!("{status}");
    } else {
        eprintln!("error: {detail}");
        println!("{status}");
    }
    if matches!(result, Ok(HealthStatus::Serving)) {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_UNHEALTHY)
    }
}

pub fn info(args: &InfoArgs) -> ExitCode {
    let result = runtime().map_err(anyhow::Error::from).and_then(|runtime| {
        runtime.block_on(async {
            let client = Client::connect(&args.address.server).await?;
            Ok::<_, anyhow::Error>(client.server_info().await?)
        })
    });
    match result {
        Ok(info) => {
            if args.address.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "version": info.version,
                        "grpc_addr": info.grpc_addr,
                        "admin_addr": info.admin_addr,
                        "data_dir": info.data_dir,
                        "uptime_ms": info.uptime_ms,
                        "process_id": info.process_id,
                    })
                );
            } else {
                println!("version     {}", info.version);
                println!("grpc_addr   {}", info.grpc_addr);
                println!("admin_addr  {}", info.admin_addr);
                println!("data_dir    {}", info.data_dir);
                println!("uptime_ms   {}", info.uptime_ms);
                println!("process_id  {}", info.process_id);
            }
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::from(EXIT_UNHEALTHY)
        }
    }
}

/// Runs an admin call on a small runtime and prints its JSON result (compact with `--json`,
/// pretty otherwise); exit 0 on success, 1 with `error: ...` on standard error otherwise.
pub fn print_result(
    json: bool,
    call: impl std::future::Future<Output = anyhow::Result<serde_json::Value>>,
) -> ExitCode {
    let result = runtime()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| runtime.block_on(call));
    match result {
        Ok(value) if json => {
            println!("{value}");
            ExitCode::SUCCESS
        }
        Ok(value) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&value).unwrap_or_default()
            );
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
