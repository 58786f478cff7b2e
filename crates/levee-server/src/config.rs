//! The server's configuration: embedded defaults, overridden by a TOML file, then by `LEVEE_*`
//! environment variables, then by command-line flags (flag > env > file > default).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Default gRPC API address.
pub const GRPC_ADDR_DEFAULT: &str = "127.0.0.1:7070";
/// Default admin HTTP address.
pub const ADMIN_ADDR_DEFAULT: &str = "127.0.0.1:7071";
/// Default data directory, relative to the working directory.
pub const DATA_DIR_DEFAULT: &str = "./levee-data";
/// Default time in-flight requests get to finish after a shutdown signal.
pub const SHUTDOWN_GRACE_MS_DEFAULT: u64 = 10_000;
/// Longest allowed shutdown grace period (one hour).
pub const SHUTDOWN_GRACE_MS_MAX: u64 = 3_600_000;
/// Default cap on open gRPC connections; more wait in the kernel's accept queue.
pub const CONNECTIONS_MAX_DEFAULT: u32 = 10_000;
/// Highest allowed connection cap.
pub const CONNECTIONS_MAX_MAX: u32 = 1_000_000;
/// Default memory budget of the hot-key engines, all shards together, in MiB.
pub const HOTKEY_MEMORY_BUDGET_MB_DEFAULT: u64 = 256;
/// Largest hot-key memory budget, in MiB (64 GiB).
pub const HOTKEY_MEMORY_BUDGET_MB_MAX: u64 = 65_536;
/// Default longest hot key, in bytes.
pub const HOTKEY_KEY_BYTES_MAX_DEFAULT: u32 = 1_024;
/// Highest allowed `hotkey_key_bytes_max`.
pub const HOTKEY_KEY_BYTES_MAX_MAX: u32 = 65_536;
/// Default most keys in one report batch.
pub const HOTKEY_BATCH_KEYS_MAX_DEFAULT: u32 = 10_000;
/// Default largest queue message, in bytes (1 MiB).
pub const QUEUE_MESSAGE_BYTES_MAX_DEFAULT: u32 = 1 << 20;
/// Lowest allowed `queue_message_bytes_max`: the server's own records (consumer positions,
/// group commits, idempotent producers' runs) must fit in a message.
pub const QUEUE_MESSAGE_BYTES_MAX_MIN: u32 = 1 << 10;
/// Highest allowed `queue_message_bytes_max` (4 MiB, under the gRPC message limit).
pub const QUEUE_MESSAGE_BYTES_MAX_MAX: u32 = 4 << 20;
/// Default memory budget of the queue store's write buffers and unwritten logs, in MiB.
pub const QUEUE_BUFFER_BUDGET_MB_DEFAULT: u64 = 320;
/// Smallest queue buffer budget, in MiB: above the largest allowed message.
pub const QUEUE_BUFFER_BUDGET_MB_MIN: u64 = 8;
/// Largest queue buffer budget, in MiB (64 GiB).
pub const QUEUE_BUFFER_BUDGET_MB_MAX: u64 = 65_536;
/// Default `queue_position_log_compact_entries`.
pub const QUEUE_POSITION_LOG_COMPACT_ENTRIES_DEFAULT: u64 = 1_000_000;
/// Highest allowed `queue_position_log_compact_entries`.
pub const QUEUE_POSITION_LOG_COMPACT_ENTRIES_MAX: u64 = 1_000_000_000;
/// Default `shard_snapshot_entries`.
pub const SHARD_SNAPSHOT_ENTRIES_DEFAULT: u64 = 1_000;
/// Highest allowed `shard_snapshot_entries`.
pub const SHARD_SNAPSHOT_ENTRIES_MAX: u64 = 100_000_000;
/// Highest allowed `node_id`.
pub const NODE_ID_MAX: u64 = 1_000_000;
/// Highest allowed `hotkey_batch_keys_max`.
pub const HOTKEY_BATCH_KEYS_MAX_MAX: u32 = 65_536;
/// Most bytes one hot-key report message may take on the wire: `hotkey_key_bytes_max` and
/// `hotkey_batch_keys_max` together must allow no larger batch.
pub const HOTKEY_REPORT_MESSAGE_BYTES_MAX: usize = 64 << 20;
/// The gRPC library's own default limit, under which every other hot-key call stays.
const GRPC_DEFAULT_MESSAGE_BYTES_MAX: usize = 4 << 20;

/// The effective configuration of one server process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Config {
    /// Where the gRPC API listens. Port 0 picks a free port.
    pub grpc_addr: ListenAddress,
    /// Where the admin HTTP port (health, readiness, metrics) listens. Port 0 picks a free port.
    pub admin_addr: ListenAddress,
    /// Where the server keeps its data; created if missing, locked while the server runs.
    pub data_dir: PathBuf,
    /// A tracing filter: `info`, `debug`, or directives such as `info,levee_server=debug`.
    pub log_level: LogLevel,
    /// `text` (human, coloured on a terminal) or `json` (one object per line).
    pub log_format: LogFormat,
    /// How long in-flight requests may take to finish after a shutdown signal.
    pub shutdown_grace_ms: u64,
    /// Most gRPC connections open at once.
    pub connections_max: u32,
    /// Memory budget of the hot-key engines, in MiB.
    pub hotkey_memory_budget_mb: u64,
    /// Longest key a hot-key report may carry, in bytes.
    pub hotkey_key_bytes_max: u32,
    /// Most keys in one hot-key report batch.
    pub hotkey_batch_keys_max: u32,
    /// What a report for an app without rules does: `create` it with the default rule, or
    /// `refuse` it.
    pub hotkey_unknown_app: UnknownApp,
    /// When queue appends are fsynced: `always` (before the append is answered, by group
    /// commit) or `interval(MS)` (within MS milliseconds).
    pub queue_sync: QueueSync,
    /// Largest queue message, in bytes.
    pub queue_message_bytes_max: u32,
    /// Memory bound of the queue store's write buffers and not yet written log records, in
    /// MiB. With many queues it sets the chunk size, so the index per message: see
    /// docs/ARCHITECTURE-store.md, memory budget.
    pub queue_buffer_budget_mb: u64,
    /// Acks a consumer's position log (`SubscribeMany`) takes before it is compacted, at the
    /// least (and twice its last snapshot): see docs/ARCHITECTURE.md, queues step 7.
    pub queue_position_log_compact_entries: u64,
    /// Entries a shard's log applies between two snapshot marks, after each of which the log
    /// is purged but its last 1,000 entries (or this many, the fewer) (docs/CLUSTER.md, "Snapshots"); this node's own
    /// setting.
    pub shard_snapshot_entries: u64,
    /// The shards of a cluster this node creates (docs/CLUSTER.md, "Part 2"): written by the
    /// first node, fixed for the cluster's life; a node joining a cluster takes its number.
    pub shards: u32,
    /// Whether a cluster this node creates replicates its plain queues over its shards
    /// (docs/CLUSTER.md, "Part 2", step 2): fixed when the cluster is created, like `shards`;
    /// a joining node takes the cluster's.
    pub replicated_queues: bool,
    /// This node's id in its cluster (1 for a lone server); kept in the data dir, which will
    /// not start as another node.
    pub node_id: u64,
    /// Where this node listens for its cluster's other nodes (docs/CLUSTER.md); none for a
    /// lone server, which needs no peer port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_addr: Option<ListenAddress>,
    /// The address the other nodes reach this node's peer port at, when it is not the bound
    /// one (a proxy, NAT, or a container's published port); needs `peer_addr`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_advertise_addr: Option<String>,
    /// A member's peer address to join its cluster through, on this node's first start (a
    /// node that has joined rejoins by itself after).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub join: Option<String>,
    /// A file the `levee server` command writes once the server is ready: its bound
    /// addresses and process id as JSON (so a script that started it on port 0 learns them),
    /// removed on a graceful shutdown. None by default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ready_file: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            grpc_addr: ListenAddress(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 7070)),
            admin_addr: ListenAddress(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 7071)),
            data_dir: PathBuf::from(DATA_DIR_DEFAULT),
            log_level: LogLevel("info,openraft=warn".to_owned()),
            log_format: LogFormat::Text,
            shutdown_grace_ms: SHUTDOWN_GRACE_MS_DEFAULT,
            connections_max: CONNECTIONS_MAX_DEFAULT,
            hotkey_memory_budget_mb: HOTKEY_MEMORY_BUDGET_MB_DEFAULT,
            hotkey_key_bytes_max: HOTKEY_KEY_BYTES_MAX_DEFAULT,
            hotkey_batch_keys_max: HOTKEY_BATCH_KEYS_MAX_DEFAULT,
            hotkey_unknown_app: UnknownApp::Create,
            queue_sync: QueueSync(levee_store::SyncPolicy::Always),
            queue_message_bytes_max: QUEUE_MESSAGE_BYTES_MAX_DEFAULT,
            queue_buffer_budget_mb: QUEUE_BUFFER_BUDGET_MB_DEFAULT,
            queue_position_log_compact_entries: QUEUE_POSITION_LOG_COMPACT_ENTRIES_DEFAULT,
            shard_snapshot_entries: SHARD_SNAPSHOT_ENTRIES_DEFAULT,
            shards: levee_proto::shards::SHARDS_DEFAULT,
            replicated_queues: false,
            node_id: 1,
            peer_addr: None,
            peer_advertise_addr: None,
            join: None,
            ready_file: None,
        }
    }
}

/// The keys a config file may hold; every key is optional and an unknown key is an error.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    grpc_addr: Option<String>,
    admin_addr: Option<String>,
    data_dir: Option<PathBuf>,
    log_level: Option<String>,
    log_format: Option<String>,
    shutdown_grace_ms: Option<u64>,
    connections_max: Option<u32>,
    hotkey_memory_budget_mb: Option<u64>,
    hotkey_key_bytes_max: Option<u32>,
    hotkey_batch_keys_max: Option<u32>,
    hotkey_unknown_app: Option<String>,
    queue_sync: Option<String>,
    queue_message_bytes_max: Option<u32>,
    queue_buffer_budget_mb: Option<u64>,
    queue_position_log_compact_entries: Option<u64>,
    shard_snapshot_entries: Option<u64>,
    shards: Option<u32>,
    replicated_queues: Option<bool>,
    node_id: Option<u64>,
    peer_addr: Option<String>,
    peer_advertise_addr: Option<String>,
    join: Option<String>,
    ready_file: Option<PathBuf>,
}

/// Where a setting's value came from, so an error can point at it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A command-line flag, such as `--grpc-addr`.
    Flag(String),
    /// An environment variable, such as `LEVEE_GRPC_ADDR`.
    Environment(String),
    /// The config file at this path.
    File(PathBuf),
}

impl fmt::Display for Source {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Flag(flag) => write!(formatter, "flag {flag}"),
            Source::Environment(name) => write!(formatter, "environment variable {name}"),
            Source::File(path) => write!(formatter, "config file {}", path.display()),
        }
    }
}

/// A value given on the command line or in the environment, not yet validated.
#[derive(Debug, Clone)]
pub struct Override {
    /// The raw text.
    pub value: String,
    /// Where it came from.
    pub source: Source,
}

/// Values from flags and environment variables; `None` keeps the file's or default value.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `--grpc-addr` / `LEVEE_GRPC_ADDR`.
    pub grpc_addr: Option<Override>,
    /// `--admin-addr` / `LEVEE_ADMIN_ADDR`.
    pub admin_addr: Option<Override>,
    /// `--data-dir` / `LEVEE_DATA_DIR`.
    pub data_dir: Option<Override>,
    /// `--log-level` / `LEVEE_LOG_LEVEL`.
    pub log_level: Option<Override>,
    /// `--log-format` / `LEVEE_LOG_FORMAT`.
    pub log_format: Option<Override>,
    /// `--shutdown-grace-ms` / `LEVEE_SHUTDOWN_GRACE_MS`.
    pub shutdown_grace_ms: Option<Override>,
    /// `--connections-max` / `LEVEE_CONNECTIONS_MAX`.
    pub connections_max: Option<Override>,
    /// `--hotkey-memory-budget-mb` / `LEVEE_HOTKEY_MEMORY_BUDGET_MB`.
    pub hotkey_memory_budget_mb: Option<Override>,
    /// `--hotkey-key-bytes-max` / `LEVEE_HOTKEY_KEY_BYTES_MAX`.
    pub hotkey_key_bytes_max: Option<Override>,
    /// `--hotkey-batch-keys-max` / `LEVEE_HOTKEY_BATCH_KEYS_MAX`.
    pub hotkey_batch_keys_max: Option<Override>,
    /// `--hotkey-unknown-app` / `LEVEE_HOTKEY_UNKNOWN_APP`.
    pub hotkey_unknown_app: Option<Override>,
    /// `--queue-sync` / `LEVEE_QUEUE_SYNC`.
    pub queue_sync: Option<Override>,
    /// `--queue-message-bytes-max` / `LEVEE_QUEUE_MESSAGE_BYTES_MAX`.
    pub queue_message_bytes_max: Option<Override>,
    /// `--queue-buffer-budget-mb` / `LEVEE_QUEUE_BUFFER_BUDGET_MB`.
    pub queue_buffer_budget_mb: Option<Override>,
    /// `--queue-position-log-compact-entries` / `LEVEE_QUEUE_POSITION_LOG_COMPACT_ENTRIES`.
    pub queue_position_log_compact_entries: Option<Override>,
    /// `--shard-snapshot-entries` / `LEVEE_SHARD_SNAPSHOT_ENTRIES`.
    pub shard_snapshot_entries: Option<Override>,
    /// `--shards` / `LEVEE_SHARDS`.
    pub shards: Option<Override>,
    /// `--replicated-queues` / `LEVEE_REPLICATED_QUEUES`.
    pub replicated_queues: Option<Override>,
    /// `--node-id` / `LEVEE_NODE_ID`.
    pub node_id: Option<Override>,
    /// `--peer-addr` / `LEVEE_PEER_ADDR`.
    pub peer_addr: Option<Override>,
    /// `--peer-advertise-addr` / `LEVEE_PEER_ADVERTISE_ADDR`.
    pub peer_advertise_addr: Option<Override>,
    /// `--join` / `LEVEE_JOIN`.
    pub join: Option<Override>,
    /// `--ready-file` / `LEVEE_READY_FILE`.
    pub ready_file: Option<Override>,
}

/// Why the configuration could not be built. Each message names the problem and the fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}; check the --config path", path = path.display())]
    FileRead {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The config file is not valid TOML or has an unknown key or a wrong type.
    #[error("config file {path}{location}: {message}; fix or remove that line", path = path.display())]
    FileParse {
        /// The file.
        path: PathBuf,
        /// ` line L, column C` when known.
        location: String,
        /// What the parser said, on one line.
        message: String,
    },
    /// A setting has a value that cannot be used.
    #[error("invalid {key} '{value}' from {origin}: {expected}")]
    InvalidValue {
        /// The setting's name, as in the config file.
        key: &'static str,
        /// The value given.
        value: String,
        /// Where it came from.
        origin: Source,
        /// What is allowed, with an example.
        expected: String,
    },
    /// Settings that are each valid but not together.
    #[error("{keys}: {message}")]
    Combination {
        /// The settings.
        keys: &'static str,
        /// What is wrong and how to fix it.
        message: String,
    },
}

impl Config {
    /// Builds the effective configuration from an optional file and the overrides.
    #[allow(
        clippy::too_many_lines,
        reason = "one layer per setting, in the README's order"
    )]
    pub fn load(file: Option<&Path>, overrides: &Overrides) -> Result<Self, ConfigError> {
        let (file_config, file_path) = match file {
            Some(path) => (read_file(path)?, Some(path.to_path_buf())),
            None => (FileConfig::default(), None),
        };
        let file_source = || Source::File(file_path.clone().unwrap_or_default());
        let defaults = Config::default();

        let pick = |key: &'static str,
                    flag: &Option<Override>,
                    from_file: Option<String>|
         -> Option<(String, Source, &'static str)> {
            flag.as_ref()
                .map(|given| (given.value.clone(), given.source.clone(), key))
                .or_else(|| from_file.map(|value| (value, file_source(), key)))
        };

        let mut config = defaults;
        // Each setting: the flag or environment value if given, else the file's, parsed and
        // checked by `parse`; else the default stays.
        macro_rules! layer {
            ($key:ident, $from_file:expr, $parse:expr) => {
                if let Some(raw) = pick(stringify!($key), &overrides.$key, $from_file) {
                    config.$key = $parse(raw)?;
                }
            };
        }
        let text = |value: Option<u64>| value.map(|value| value.to_string());
        let small = |value: Option<u32>| value.map(|value| value.to_string());
        layer!(grpc_addr, file_config.grpc_addr, parse_setting);
        layer!(admin_addr, file_config.admin_addr, parse_setting);
        layer!(
            data_dir,
            file_config
                .data_dir
                .map(|path| path.to_string_lossy().into_owned()),
            parse_data_dir
        );
        layer!(log_level, file_config.log_level, parse_setting);
        layer!(log_format, file_config.log_format, parse_setting);
        layer!(
            shutdown_grace_ms,
            text(file_config.shutdown_grace_ms),
            |raw| { parse_bounded(raw, 0, SHUTDOWN_GRACE_MS_MAX) }
        );
        layer!(connections_max, small(file_config.connections_max), |raw| {
            parse_bounded(raw, 1, CONNECTIONS_MAX_MAX)
        });
        layer!(
            hotkey_memory_budget_mb,
            text(file_config.hotkey_memory_budget_mb),
            |raw| { parse_bounded(raw, 1, HOTKEY_MEMORY_BUDGET_MB_MAX) }
        );
        layer!(
            hotkey_key_bytes_max,
            small(file_config.hotkey_key_bytes_max),
            |raw| { parse_bounded(raw, 1, HOTKEY_KEY_BYTES_MAX_MAX) }
        );
        layer!(
            hotkey_batch_keys_max,
            small(file_config.hotkey_batch_keys_max),
            |raw| { parse_bounded(raw, 1, HOTKEY_BATCH_KEYS_MAX_MAX) }
        );
        layer!(
            hotkey_unknown_app,
            file_config.hotkey_unknown_app,
            parse_setting
        );
        layer!(queue_sync, file_config.queue_sync, parse_setting);
        layer!(
            queue_message_bytes_max,
            small(file_config.queue_message_bytes_max),
            |raw| {
                parse_bounded(
                    raw,
                    QUEUE_MESSAGE_BYTES_MAX_MIN,
                    QUEUE_MESSAGE_BYTES_MAX_MAX,
                )
            }
        );
        layer!(
            queue_buffer_budget_mb,
            text(file_config.queue_buffer_budget_mb),
            |raw| { parse_bounded(raw, QUEUE_BUFFER_BUDGET_MB_MIN, QUEUE_BUFFER_BUDGET_MB_MAX) }
        );
        layer!(
            queue_position_log_compact_entries,
            text(file_config.queue_position_log_compact_entries),
            |raw| { parse_bounded(raw, 1, QUEUE_POSITION_LOG_COMPACT_ENTRIES_MAX) }
        );
        layer!(
            shard_snapshot_entries,
            text(file_config.shard_snapshot_entries),
            |raw| { parse_bounded(raw, 10, SHARD_SNAPSHOT_ENTRIES_MAX) }
        );
        layer!(shards, small(file_config.shards), |raw| {
            parse_bounded(raw, 1, levee_proto::shards::SHARDS_MAX)
        });
        layer!(
            replicated_queues,
            file_config.replicated_queues.map(|value| value.to_string()),
            parse_bool
        );
        layer!(node_id, text(file_config.node_id), |raw| {
            parse_bounded(raw, 1, NODE_ID_MAX)
        });
        layer!(peer_addr, file_config.peer_addr, |raw| parse_setting(raw)
            .map(Some));
        layer!(
            peer_advertise_addr,
            file_config.peer_advertise_addr,
            |raw: (String, Source, &'static str)| {
                parse_setting::<ListenAddress>(raw.clone()).map(|_| Some(raw.0))
            }
        );
        layer!(join, file_config.join, |raw: (
            String,
            Source,
            &'static str
        )| {
            parse_setting::<ListenAddress>(raw.clone()).map(|_| Some(raw.0))
        });
        layer!(
            ready_file,
            file_config
                .ready_file
                .map(|path| path.to_string_lossy().into_owned()),
            parse_ready_file
        );
        config.check_combinations()?;
        Ok(config)
    }

    /// The largest hot-key message the server takes: the largest report batch its key and
    /// batch limits allow, encoded (at least the gRPC library's default 4 MiB).
    pub fn hotkey_report_message_bytes_max(&self) -> usize {
        let keys = self.hotkey_batch_keys_max as usize;
        let key_bytes = self.hotkey_key_bytes_max as usize;
        (keys * (key_bytes + levee_proto::REPORT_KEY_OVERHEAD_BYTES)
            + levee_proto::REPORT_BATCH_OVERHEAD_BYTES)
            .max(GRPC_DEFAULT_MESSAGE_BYTES_MAX)
    }

    /// Checks settings that bound each other.
    fn check_combinations(&self) -> Result<(), ConfigError> {
        if self.peer_advertise_addr.is_some() && self.peer_addr.is_none() {
            return Err(ConfigError::Combination {
                keys: "peer_advertise_addr and peer_addr",
                message: "peer_advertise_addr says where the peer port is reached; give \
                          --peer-addr too, where it listens"
                    .to_owned(),
            });
        }
        if self.join.is_some() && self.peer_addr.is_none() {
            return Err(ConfigError::Combination {
                keys: "join and peer_addr",
                message: "a node that joins a cluster needs --peer-addr, where the other nodes \
                          reach it"
                    .to_owned(),
            });
        }
        let report_bytes = self.hotkey_report_message_bytes_max();
        if report_bytes > HOTKEY_REPORT_MESSAGE_BYTES_MAX {
            return Err(ConfigError::Combination {
                keys: "hotkey_key_bytes_max and hotkey_batch_keys_max",
                message: format!(
                    "{} keys of {} bytes make report batches of up to {report_bytes} bytes, over \
                     the {HOTKEY_REPORT_MESSAGE_BYTES_MAX} bytes a message may take; lower one \
                     of the two",
                    self.hotkey_batch_keys_max, self.hotkey_key_bytes_max
                ),
            });
        }
        Ok(())
    }

    /// The configuration as a TOML document that `--config` accepts back.
    pub fn to_toml(&self) -> String {
        toml::to_string(self)
            .unwrap_or_else(|error| format!("# cannot print the configuration: {error}\n"))
    }
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::FileRead {
        path: path.to_path_buf(),
        source,
    })?;
    toml::from_str(&text).map_err(|error| {
        let location = error
            .span()
            .map(|span| {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let column = before.len() - before.rfind('\n').map_or(0, |index| index + 1) + 1;
                format!(" line {line}, column {column}")
            })
            .unwrap_or_default();
        let message = error
            .message()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        ConfigError::FileParse {
            path: path.to_path_buf(),
            location,
            message,
        }
    })
}

fn invalid((value, source, key): (String, Source, &'static str), expected: String) -> ConfigError {
    ConfigError::InvalidValue {
        key,
        value,
        origin: source,
        expected,
    }
}

fn parse_ready_file(raw: (String, Source, &'static str)) -> Result<Option<PathBuf>, ConfigError> {
    if raw.0.is_empty() {
        return Err(invalid(
            raw,
            "a file path, such as ./levee.ready".to_owned(),
        ));
    }
    Ok(Some(PathBuf::from(raw.0)))
}

fn parse_data_dir(raw: (String, Source, &'static str)) -> Result<PathBuf, ConfigError> {
    if raw.0.is_empty() {
        return Err(invalid(
            raw,
            "a directory path, such as ./levee-data".to_owned(),
        ));
    }
    Ok(PathBuf::from(raw.0))
}

fn parse_setting<T>(raw: (String, Source, &'static str)) -> Result<T, ConfigError>
where
    T: FromStr<Err = String>,
{
    raw.0
        .parse::<T>()
        .map_err(|expected| invalid(raw, expected))
}

fn parse_bool(raw: (String, Source, &'static str)) -> Result<bool, ConfigError> {
    match raw.0.trim() {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(invalid(raw, "true or false".to_owned())),
    }
}

fn parse_bounded<T>(
    raw: (String, Source, &'static str),
    minimum: T,
    maximum: T,
) -> Result<T, ConfigError>
where
    T: FromStr + PartialOrd + fmt::Display + Copy,
{
    match raw.0.trim().parse::<T>() {
        Ok(value) if (minimum..=maximum).contains(&value) => Ok(value),
        _ => Err(invalid(
            raw,
            format!("an integer from {minimum} to {maximum}"),
        )),
    }
}

/// An address to listen on: an IP address or `localhost`, and a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenAddress(pub SocketAddr);

impl FromStr for ListenAddress {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let expected = || {
            "expected HOST:PORT with an IP address or localhost as HOST and a port from 0 to \
             65535, such as 127.0.0.1:7070 or [::1]:7070"
                .to_owned()
        };
        if let Ok(address) = text.parse::<SocketAddr>() {
            return Ok(Self(address));
        }
        let (host, port) = text.rsplit_once(':').ok_or_else(expected)?;
        let port: u16 = port.parse().map_err(|_| expected())?;
        if host.eq_ignore_ascii_case("localhost") {
            return Ok(Self(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port)));
        }
        Err(expected())
    }
}

impl fmt::Display for ListenAddress {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(formatter)
    }
}

impl Serialize for ListenAddress {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// A validated tracing filter such as `info` or `warn,levee_server=debug`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct LogLevel(String);

impl LogLevel {
    /// The filter text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for LogLevel {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        tracing_subscriber::EnvFilter::try_new(text).map_err(|error| {
            format!(
                "expected a level (error, warn, info, debug, trace) or tracing directives such \
                 as info,levee_server=debug ({error})"
            )
        })?;
        if text.trim().is_empty() {
            return Err("expected a level such as info".to_owned());
        }
        Ok(Self(text.to_owned()))
    }
}

/// What a hot-key report for an app without rules does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum UnknownApp {
    /// Create the app with the default rule (`*`: 1000 hits in 5 s, hot for 60 s).
    Create,
    /// Refuse the session with `NOT_FOUND` until an operator sets the app's rules.
    Refuse,
}

impl FromStr for UnknownApp {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "create" => Ok(Self::Create),
            "refuse" => Ok(Self::Refuse),
            _ => Err("expected create or refuse".to_owned()),
        }
    }
}

/// The queue store's sync policy: `always`, `interval` (100 ms) or `interval(MS)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSync(pub levee_store::SyncPolicy);

impl FromStr for QueueSync {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        text.parse::<levee_store::SyncPolicy>()
            .ok()
            .filter(|policy| match policy {
                levee_store::SyncPolicy::Interval { interval_ms } => {
                    (1..=levee_store::SYNC_INTERVAL_MS_MAX).contains(interval_ms)
                }
                levee_store::SyncPolicy::Always => true,
            })
            .map(Self)
            .ok_or_else(|| {
                format!(
                    "expected always, interval or interval(MS) with MS from 1 to {}, such as \
                     interval(100)",
                    levee_store::SYNC_INTERVAL_MS_MAX
                )
            })
    }
}

impl Serialize for QueueSync {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&self.0)
    }
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// For people; coloured when standard error is a terminal.
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            _ => Err("expected text or json".to_owned()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flag(value: &str, name: &str) -> Override {
        Override {
            value: value.to_owned(),
            source: Source::Flag(name.to_owned()),
        }
    }

    fn environment(value: &str, name: &str) -> Override {
        Override {
            value: value.to_owned(),
            source: Source::Environment(name.to_owned()),
        }
    }

    fn write_file(text: &str) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), text).unwrap();
        file
    }

    #[test]
    fn given_nothing_then_embedded_defaults_apply() {
        let config = Config::load(None, &Overrides::default()).unwrap();
        assert_eq!(config.grpc_addr.to_string(), GRPC_ADDR_DEFAULT);
        assert_eq!(config.admin_addr.to_string(), ADMIN_ADDR_DEFAULT);
        assert_eq!(config.data_dir, PathBuf::from(DATA_DIR_DEFAULT));
        assert_eq!(config.shutdown_grace_ms, 10_000);
        assert_eq!(config.log_format, LogFormat::Text);
    }

    #[test]
    fn given_file_and_override_then_override_wins_and_file_beats_default() {
        let file = write_file("grpc_addr = \"127.0.0.1:9000\"\nadmin_addr = \"127.0.0.1:9001\"\n");
        let overrides = Overrides {
            grpc_addr: Some(flag("127.0.0.1:9100", "--grpc-addr")),
            ..Overrides::default()
        };
        let config = Config::load(Some(file.path()), &overrides).unwrap();
        assert_eq!(config.grpc_addr.to_string(), "127.0.0.1:9100");
        assert_eq!(config.admin_addr.to_string(), "127.0.0.1:9001");
        assert_eq!(config.shutdown_grace_ms, SHUTDOWN_GRACE_MS_DEFAULT);
    }

    #[test]
    fn given_unknown_key_in_file_then_error_names_key_line_and_fix() {
        let file = write_file("grpc_addr = \"127.0.0.1:9000\"\ngrpc_adr = \"x\"\n");
        let message = Config::load(Some(file.path()), &Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(message.contains("unknown field `grpc_adr`"), "{message}");
        assert!(message.contains("line 2"), "{message}");
        assert!(
            message.contains("grpc_addr"),
            "should list the known keys: {message}"
        );
        assert!(!message.contains('\n'), "one line: {message}");
    }

    #[test]
    fn given_malformed_address_then_error_names_source_and_example() {
        let overrides = Overrides {
            admin_addr: Some(environment("not-an-address", "LEVEE_ADMIN_ADDR")),
            ..Overrides::default()
        };
        let message = Config::load(None, &overrides).unwrap_err().to_string();
        assert!(
            message.contains("invalid admin_addr 'not-an-address'"),
            "{message}"
        );
        assert!(message.contains("LEVEE_ADMIN_ADDR"), "{message}");
        assert!(message.contains("127.0.0.1:7070"), "{message}");
    }

    #[test]
    fn given_localhost_and_ipv6_addresses_then_both_parse() {
        assert_eq!(
            "localhost:80".parse::<ListenAddress>().unwrap().to_string(),
            "127.0.0.1:80"
        );
        assert_eq!(
            "[::1]:80".parse::<ListenAddress>().unwrap().to_string(),
            "[::1]:80"
        );
        assert!("localhost:99999".parse::<ListenAddress>().is_err());
        assert!("example.com:80".parse::<ListenAddress>().is_err());
    }

    #[test]
    fn given_out_of_range_numbers_then_error_states_the_range() {
        let overrides = Overrides {
            connections_max: Some(flag("0", "--connections-max")),
            ..Overrides::default()
        };
        let message = Config::load(None, &overrides).unwrap_err().to_string();
        assert!(message.contains("from 1 to 1000000"), "{message}");
        // The server's own records (positions, commits) must fit in a message.
        let overrides = Overrides {
            queue_message_bytes_max: Some(flag("512", "--queue-message-bytes-max")),
            ..Overrides::default()
        };
        let message = Config::load(None, &overrides).unwrap_err().to_string();
        assert!(message.contains("from 1024 to 4194304"), "{message}");
        let file = write_file("shutdown_grace_ms = \"ten\"\n");
        assert!(Config::load(Some(file.path()), &Overrides::default()).is_err());
    }

    #[test]
    fn given_hot_key_limits_then_their_largest_batch_must_fit_a_message() {
        let defaults = Config::load(None, &Overrides::default()).unwrap();
        // 10,000 keys of 1,024 bytes: about 10 MB, over the gRPC library's 4 MiB default.
        assert_eq!(
            defaults.hotkey_report_message_bytes_max(),
            10_000 * 1_038 + 6
        );
        let overrides = Overrides {
            hotkey_key_bytes_max: Some(flag("65536", "--hotkey-key-bytes-max")),
            ..Overrides::default()
        };
        let message = Config::load(None, &overrides).unwrap_err().to_string();
        assert!(
            message.contains("hotkey_key_bytes_max and hotkey_batch_keys_max")
                && message.contains("lower one"),
            "{message}"
        );
        let overrides = Overrides {
            hotkey_key_bytes_max: Some(flag("65536", "--hotkey-key-bytes-max")),
            hotkey_batch_keys_max: Some(flag("1000", "--hotkey-batch-keys-max")),
            ..Overrides::default()
        };
        let config = Config::load(None, &overrides).unwrap();
        assert!(config.hotkey_report_message_bytes_max() <= HOTKEY_REPORT_MESSAGE_BYTES_MAX);
    }

    #[test]
    fn given_queue_buffer_budget_then_file_and_environment_apply_within_range() {
        assert_eq!(
            Config::load(None, &Overrides::default())
                .unwrap()
                .queue_buffer_budget_mb,
            QUEUE_BUFFER_BUDGET_MB_DEFAULT
        );
        let file = write_file("queue_buffer_budget_mb = 64\n");
        let config = Config::load(Some(file.path()), &Overrides::default()).unwrap();
        assert_eq!(config.queue_buffer_budget_mb, 64);
        let overrides = Overrides {
            queue_buffer_budget_mb: Some(environment("4", "LEVEE_QUEUE_BUFFER_BUDGET_MB")),
            ..Overrides::default()
        };
        let message = Config::load(Some(file.path()), &overrides)
            .unwrap_err()
            .to_string();
        assert!(message.contains("from 8 to 65536"), "{message}");
        assert!(
            message.contains("LEVEE_QUEUE_BUFFER_BUDGET_MB"),
            "{message}"
        );
    }

    #[test]
    fn given_bad_log_settings_then_errors_say_what_is_allowed() {
        let overrides = Overrides {
            log_format: Some(flag("xml", "--log-format")),
            ..Overrides::default()
        };
        let message = Config::load(None, &overrides).unwrap_err().to_string();
        assert!(message.contains("expected text or json"), "{message}");
        let overrides = Overrides {
            log_level: Some(flag("info,[[[", "--log-level")),
            ..Overrides::default()
        };
        assert!(Config::load(None, &overrides).is_err());
    }

    #[test]
    fn given_printed_config_when_loaded_back_then_it_is_the_same() {
        let overrides = Overrides {
            grpc_addr: Some(flag("[::1]:1234", "--grpc-addr")),
            log_format: Some(flag("json", "--log-format")),
            shutdown_grace_ms: Some(flag("250", "--shutdown-grace-ms")),
            ..Overrides::default()
        };
        let config = Config::load(None, &overrides).unwrap();
        let file = write_file(&config.to_toml());
        assert_eq!(
            Config::load(Some(file.path()), &Overrides::default()).unwrap(),
            config
        );
    }
}
