//! `levee server`: resolves the configuration, starts the server and handles signals.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::ArgMatches;
use clap::parser::ValueSource;
use levee_server::config::{Override, Overrides, Source};
use levee_server::{Config, RunningServer, ShutdownOutcome};
use tokio::signal::unix::{Signal, SignalKind, signal};

/// Exit code for bad start-up input: configuration, addresses, data dir.
const EXIT_BAD_START: u8 = 2;
/// Exit code when the server fails while running.
const EXIT_FAILED: u8 = 1;

#[derive(Debug, clap::Args)]
pub struct ServerArgs {
    /// gRPC API address [default: 127.0.0.1:7070]
    #[arg(long, env = "LEVEE_GRPC_ADDR", value_name = "HOST:PORT")]
    grpc_addr: Option<String>,
    /// Admin HTTP address: /healthz, /readyz, /metrics [default: 127.0.0.1:7071]
    #[arg(long, env = "LEVEE_ADMIN_ADDR", value_name = "HOST:PORT")]
    admin_addr: Option<String>,
    /// Data directory, created if missing [default: ./levee-data]
    #[arg(long, env = "LEVEE_DATA_DIR", value_name = "DIR")]
    data_dir: Option<String>,
    /// TOML config file; flags and LEVEE_* variables override its keys
    #[arg(long, env = "LEVEE_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Log level or tracing directives, such as info or info,levee_server=debug [default: info]
    #[arg(long, env = "LEVEE_LOG_LEVEL", value_name = "FILTER")]
    log_level: Option<String>,
    /// Log format: text or json [default: text]
    #[arg(long, env = "LEVEE_LOG_FORMAT", value_name = "FORMAT")]
    log_format: Option<String>,
    /// Time in-flight requests get to finish after SIGINT or SIGTERM [default: 10000]
    #[arg(long, env = "LEVEE_SHUTDOWN_GRACE_MS", value_name = "MS")]
    shutdown_grace_ms: Option<String>,
    /// Most gRPC connections open at once; more wait to be accepted [default: 10000]
    #[arg(long, env = "LEVEE_CONNECTIONS_MAX", value_name = "COUNT")]
    connections_max: Option<String>,
    /// Memory budget of the hot-key engines, in MiB [default: 256]
    #[arg(long, env = "LEVEE_HOTKEY_MEMORY_BUDGET_MB", value_name = "MIB")]
    hotkey_memory_budget_mb: Option<String>,
    /// Longest key a hot-key report may carry, in bytes [default: 1024]
    #[arg(long, env = "LEVEE_HOTKEY_KEY_BYTES_MAX", value_name = "BYTES")]
    hotkey_key_bytes_max: Option<String>,
    /// Most keys in one hot-key report batch [default: 10000]
    #[arg(long, env = "LEVEE_HOTKEY_BATCH_KEYS_MAX", value_name = "COUNT")]
    hotkey_batch_keys_max: Option<String>,
    /// Reports for an app without rules: create (with the default rule) or refuse [default: create]
    #[arg(long, env = "LEVEE_HOTKEY_UNKNOWN_APP", value_name = "POLICY")]
    hotkey_unknown_app: Option<String>,
    /// When queue appends are fsynced: always (before the answer) or interval(MS) [default: always]
    #[arg(long, env = "LEVEE_QUEUE_SYNC", value_name = "POLICY")]
    queue_sync: Option<String>,
    /// Largest queue message, in bytes [default: 1048576]
    #[arg(long, env = "LEVEE_QUEUE_MESSAGE_BYTES_MAX", value_name = "BYTES")]
    queue_message_bytes_max: Option<String>,
    /// Memory for the queue store's write buffers and unwritten logs, in MiB; with many queues
    /// a larger budget makes larger chunks and a smaller index [default: 320]
    #[arg(long, env = "LEVEE_QUEUE_BUFFER_BUDGET_MB", value_name = "MIB")]
    queue_buffer_budget_mb: Option<String>,
    /// Acks a consumer's position log (many-queue streams) takes before it is compacted, at
    /// the least [default: 1000000]
    #[arg(
        long,
        env = "LEVEE_QUEUE_POSITION_LOG_COMPACT_ENTRIES",
        value_name = "ACKS"
    )]
    queue_position_log_compact_entries: Option<String>,
    /// Entries a shard's log applies between two snapshot marks, after each of which it is
    /// purged but its last 1000 entries (or this many, the fewer), 10 to 100000000
    /// [default: 1000]
    #[arg(long, env = "LEVEE_SHARD_SNAPSHOT_ENTRIES", value_name = "ENTRIES")]
    shard_snapshot_entries: Option<String>,
    /// The shards of a cluster this node creates, 1 to 1024; fixed when the cluster is created
    /// (a joining node takes the cluster's) [default: 16]
    #[arg(long, env = "LEVEE_SHARDS", value_name = "COUNT")]
    shards: Option<String>,
    /// Whether a cluster this node creates replicates its plain queues over its shards, true or
    /// false; fixed when the cluster is created (a joining node takes the cluster's)
    /// [default: false]
    #[arg(long, env = "LEVEE_REPLICATED_QUEUES", value_name = "BOOL")]
    replicated_queues: Option<String>,
    /// This node's id in its cluster, 1 to 1000000; the data dir keeps it and will not start as
    /// another node [default: 1]
    #[arg(long, env = "LEVEE_NODE_ID", value_name = "ID")]
    node_id: Option<String>,
    /// Where this node listens for its cluster's other nodes, HOST:PORT [default: none, a lone
    /// server needs no peer port]
    #[arg(long, env = "LEVEE_PEER_ADDR", value_name = "HOST:PORT")]
    peer_addr: Option<String>,
    /// The address the other nodes reach this node's peer port at, HOST:PORT, when it is not
    /// --peer-addr (a proxy, NAT, a container's published port) [default: --peer-addr as bound]
    #[arg(long, env = "LEVEE_PEER_ADVERTISE_ADDR", value_name = "HOST:PORT")]
    peer_advertise_addr: Option<String>,
    /// Join the cluster of the member whose peer address this is, on this node's first start
    /// (needs --peer-addr)
    #[arg(long, env = "LEVEE_JOIN", value_name = "HOST:PORT")]
    join: Option<String>,
    /// Once ready, write the bound addresses and process id to this file as JSON (removed on
    /// a graceful shutdown) [default: none]
    #[arg(long, env = "LEVEE_READY_FILE", value_name = "PATH")]
    ready_file: Option<String>,
    /// Print the effective configuration as TOML and exit
    #[arg(long)]
    print_config: bool,
}

impl ServerArgs {
    fn overrides(&self, matches: &ArgMatches) -> Overrides {
        // Each setting's flag and variable follow from its key: `queue_sync` is
        // `--queue-sync` and `LEVEE_QUEUE_SYNC`.
        let given = |id: &str, value: &Option<String>| {
            let value = value.clone()?;
            let source = match matches.value_source(id) {
                Some(ValueSource::EnvVariable) => {
                    Source::Environment(format!("LEVEE_{}", id.to_uppercase()))
                }
                _ => Source::Flag(format!("--{}", id.replace('_', "-"))),
            };
            Some(Override { value, source })
        };
        Overrides {
            grpc_addr: given("grpc_addr", &self.grpc_addr),
            admin_addr: given("admin_addr", &self.admin_addr),
            data_dir: given("data_dir", &self.data_dir),
            log_level: given("log_level", &self.log_level),
            log_format: given("log_format", &self.log_format),
            shutdown_grace_ms: given("shutdown_grace_ms", &self.shutdown_grace_ms),
            connections_max: given("connections_max", &self.connections_max),
            hotkey_memory_budget_mb: given(
                "hotkey_memory_budget_mb",
                &self.hotkey_memory_budget_mb,
            ),
            hotkey_key_bytes_max: given("hotkey_key_bytes_max", &self.hotkey_key_bytes_max),
            hotkey_batch_keys_max: given("hotkey_batch_keys_max", &self.hotkey_batch_keys_max),
            hotkey_unknown_app: given("hotkey_unknown_app", &self.hotkey_unknown_app),
            queue_sync: given("queue_sync", &self.queue_sync),
            queue_message_bytes_max: given(
                "queue_message_bytes_max",
                &self.queue_message_bytes_max,
            ),
            queue_buffer_budget_mb: given("queue_buffer_budget_mb", &self.queue_buffer_budget_mb),
            queue_position_log_compact_entries: given(
                "queue_position_log_compact_entries",
                &self.queue_position_log_compact_entries,
            ),
            shard_snapshot_entries: given("shard_snapshot_entries", &self.shard_snapshot_entries),
            shards: given("shards", &self.shards),
            replicated_queues: given("replicated_queues", &self.replicated_queues),
            node_id: given("node_id", &self.node_id),
            peer_addr: given("peer_addr", &self.peer_addr),
            peer_advertise_addr: given("peer_advertise_addr", &self.peer_advertise_addr),
            join: given("join", &self.join),
            ready_file: given("ready_file", &self.ready_file),
        }
    }
}

pub fn run(args: &ServerArgs, matches: &ArgMatches) -> ExitCode {
    let config = match Config::load(args.config.as_deref(), &args.overrides(matches)) {
        Ok(config) => config,
        Err(error) => return fail_start(&error),
    };
    if args.print_config {
        print!("{}", config.to_toml());
        return ExitCode::SUCCESS;
    }
    if let Err(error) = levee_server::logging::init(&config.log_level, config.log_format) {
        return fail_start(&format!("cannot start logging: {error}"));
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => return fail_start(&format!("cannot start the tokio runtime: {error}")),
    };
    runtime.block_on(serve(config))
}

fn fail_start(error: &dyn std::fmt::Display) -> ExitCode {
    eprintln!("error: {error}");
    ExitCode::from(EXIT_BAD_START)
}

async fn serve(config: Config) -> ExitCode {
    let (mut terminate, mut interrupt) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(terminate), Ok(interrupt)) => (terminate, interrupt),
        (Err(error), _) | (_, Err(error)) => {
            return fail_start(&format!("cannot install signal handlers: {error}"));
        }
    };
    // A file left by an earlier run must not tell a waiting script this one is ready.
    remove_ready_file(&config);
    let mut server = match RunningServer::start(&config).await {
        Ok(server) => server,
        Err(error) => return fail_start(&error),
    };
    if let Some(path) = &config.ready_file
        && let Err(error) = write_ready_file(path, &server)
    {
        let _ = server.shutdown(Duration::ZERO).await;
        return fail_start(&format!(
            "cannot write the ready file {}: {error}; choose a writable path with --ready-file",
            path.display()
        ));
    }
    let (name, _) = tokio::select! {
        received = next_signal(&mut terminate, &mut interrupt) => received,
        failure = server.failed() => {
            remove_ready_file(&config);
            tracing::error!(%failure, "the server failed; exiting");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    let grace = Duration::from_millis(config.shutdown_grace_ms);
    tracing::info!(
        signal = name,
        grace_ms = config.shutdown_grace_ms,
        "shutting down: no new connections; in-flight requests may finish (signal again to exit \
         at once)"
    );
    tokio::spawn(async move {
        let (name, number) = next_signal(&mut terminate, &mut interrupt).await;
        tracing::warn!(signal = name, "second signal: exiting at once");
        std::process::exit(128 + number);
    });
    // Not ready any more: a script waiting for the file must not find a stale one.
    remove_ready_file(&config);
    match server.shutdown(grace).await {
        ShutdownOutcome::Drained => tracing::info!("shutdown complete"),
        ShutdownOutcome::GraceExpired => {
            tracing::info!("shutdown complete after cutting off unfinished requests");
        }
    }
    ExitCode::SUCCESS
}

/// Writes the ready file: `{"grpc_addr", "admin_addr", "peer_addr", "pid"}`, whole or not at all (a
/// temporary file beside it, renamed).
fn write_ready_file(path: &std::path::Path, server: &RunningServer) -> std::io::Result<()> {
    let facts = serde_json::json!({
        "grpc_addr": server.grpc_addr().to_string(),
        "admin_addr": server.admin_addr().to_string(),
        "peer_addr": server.peer_addr().map(|address| address.to_string()),
        "pid": std::process::id(),
    });
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".partial");
    let written = std::fs::write(&temporary, format!("{facts}\n"))
        .and_then(|()| std::fs::rename(&temporary, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written
}

/// Removes the ready file, if the configuration names one and it is there.
fn remove_ready_file(config: &Config) {
    if let Some(path) = &config.ready_file {
        let _ = std::fs::remove_file(path);
    }
}

async fn next_signal(terminate: &mut Signal, interrupt: &mut Signal) -> (&'static str, i32) {
    tokio::select! {
        _ = terminate.recv() => ("SIGTERM", libc_signal::TERMINATE),
        _ = interrupt.recv() => ("SIGINT", libc_signal::INTERRUPT),
    }
}

/// Signal numbers, for the 128 + N exit code of a second signal.
mod libc_signal {
    pub const INTERRUPT: i32 = 2;
    pub const TERMINATE: i32 = 15;
}
