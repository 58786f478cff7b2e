//! The conformance scenarios (`conformance/scenarios/*.json`, format in
//! `conformance/README.md`) run with the Rust client against real `levee server` processes:
//! the same scenarios every Levee client passes. Each `op_*` below is one operation of the
//! vocabulary and returns the result object the step's `expect` is matched against.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use levee_client::{
    Client, ClientError, ClientOptions, ConsumerOptions, GroupConsumer, HotKeyRule, HotKeys,
    HotKeysOptions, Mailboxes, MatchKind, Message, Producer, ProducerOptions, Subscription,
};
use levee_proto::WireError;
use levee_proto::v1::consume_request::Kind as ConsumeKind;
use levee_proto::v1::topics_client::TopicsClient;
use levee_proto::v1::{
    Commit, CommitBatch, ConsumeRequest, ConsumeResponse, ConsumeStart, Credit, ErrorCode,
    Heartbeat, HotKeySource, PublishMessage, PublishRequest,
};
use serde_json::{Map, Value, json};
use support::LeveeProcess;
use tokio::sync::mpsc;

/// How often waiting operations look again.
const POLL: Duration = Duration::from_millis(10);

type Outcome = Result<Value, Failure>;

/// Why an operation did not give a result: the client's typed error, or the scenario broke.
enum Failure {
    Client(ClientError),
    Scenario(String),
}

impl From<ClientError> for Failure {
    fn from(error: ClientError) -> Self {
        Failure::Client(error)
    }
}

impl From<WireError> for Failure {
    fn from(error: WireError) -> Self {
        Failure::Client(ClientError::Server(error))
    }
}

fn broke(message: impl Into<String>) -> Failure {
    Failure::Scenario(message.into())
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn scenarios_directory() -> PathBuf {
    let crate_directory = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    crate_directory.join("../../conformance/scenarios")
}

/// A scenario's bytes: text as UTF-8, `{"hex": ...}`, or `{"repeat": s, "times": n}`.
fn to_bytes(value: &Value) -> Result<Vec<u8>, Failure> {
    match value {
        Value::String(text) => Ok(text.as_bytes().to_vec()),
        Value::Object(object) if object.contains_key("hex") => {
            levee_proto::json::key_from_hex(object["hex"].as_str().unwrap_or_default())
                .ok_or_else(|| broke(format!("bad hex {value}")))
        }
        Value::Object(object) if object.contains_key("repeat") => {
            let text = object["repeat"].as_str().unwrap_or_default();
            let times = object["times"].as_u64().unwrap_or(0);
            Ok(text
                .repeat(usize::try_from(times).unwrap_or(0))
                .into_bytes())
        }
        other => Err(broke(format!("not a bytes value: {other}"))),
    }
}

/// Bytes in a result: text when printable UTF-8, else `{"hex": ...}`.
fn from_bytes(bytes: &[u8]) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(text) if text.chars().all(|c| !c.is_control()) => json!(text),
        _ => json!({"hex": levee_proto::json::key_hex(bytes)}),
    }
}

/// None when `actual` meets `expected`, else why not.
fn mismatch(expected: &Value, actual: &Value, path: &str) -> Option<String> {
    if let Value::Object(object) = expected
        && object.len() == 1
    {
        let (operator, operand) = object.iter().next().unwrap();
        let number = |value: &Value| value.as_f64().unwrap_or(f64::NAN);
        let holds = match operator.as_str() {
            "at_least" => Some(number(actual) >= number(operand)),
            "at_most" => Some(number(actual) <= number(operand)),
            "contains" | "not_contains" => {
                let has = match actual {
                    Value::Array(items) => items.contains(operand),
                    Value::String(text) => text.contains(operand.as_str().unwrap_or("\u{0}")),
                    _ => false,
                };
                Some(has == (operator == "contains"))
            }
            "length" => Some(match actual {
                Value::Array(items) => json!(items.len()) == *operand,
                Value::String(text) => json!(text.len()) == *operand,
                _ => false,
            }),
            "unordered" => Some(match (actual, operand) {
                (Value::Array(got), Value::Array(want)) => {
                    let mut got: Vec<String> = got.iter().map(Value::to_string).collect();
                    let mut want: Vec<String> = want.iter().map(Value::to_string).collect();
                    got.sort();
                    want.sort();
                    got == want
                }
                _ => false,
            }),
            _ => None,
        };
        if let Some(holds) = holds {
            return (!holds).then(|| format!("{path}: {actual} is not {operator} {operand}"));
        }
    }
    match (expected, actual) {
        (Value::Object(want), Value::Object(got)) => want.iter().find_map(|(key, value)| {
            let path = format!("{path}.{key}");
            match got.get(key) {
                Some(actual) => mismatch(value, actual, &path),
                None => Some(format!("{path}: missing from {actual}")),
            }
        }),
        (Value::Array(want), Value::Array(got)) if want.len() == got.len() => want
            .iter()
            .zip(got)
            .enumerate()
            .find_map(|(index, (want, got))| mismatch(want, got, &format!("{path}[{index}]"))),
        _ if numbers_equal(expected, actual) => None,
        _ => Some(format!("{path}: expected {expected}, got {actual}")),
    }
}

fn numbers_equal(left: &Value, right: &Value) -> bool {
    match (left.as_f64(), right.as_f64()) {
        (Some(left), Some(right)) if left.is_finite() => (left - right).abs() < 1e-9,
        _ => left == right,
    }
}

fn lookup(result: &Value, path: &str) -> Value {
    path.split('.')
        .fold(result.clone(), |value, part| match part.parse::<usize>() {
            Ok(index) => value[index].clone(),
            Err(_) => value[part].clone(),
        })
}

/// One raw Consume stream, read in the background.
#[derive(Default)]
struct MemberState {
    assignments: Vec<levee_proto::v1::Assignment>,
    deliveries: Vec<levee_proto::v1::TopicDelivery>,
    commit_results: Vec<Vec<levee_proto::v1::CommitResult>>,
    error: Option<WireError>,
}

struct Member {
    sender: mpsc::Sender<ConsumeRequest>,
    state: Arc<Mutex<MemberState>>,
    reader: tokio::task::JoinHandle<()>,
}

/// Shards of the three-node clusters the scenarios also run against.
const CLUSTER_SHARDS: u32 = 4;

/// Ops a scenario run against a three-node cluster may not use: stopping or restarting its
/// only server (the cluster's other nodes would go on).
const NOT_ON_A_CLUSTER: [&str; 3] = ["stop_server", "start_server", "restart_server"];

/// Whether `scenario` also runs against a three-node cluster: one server, and no op of
/// [`NOT_ON_A_CLUSTER`].
fn runs_on_a_cluster(scenario: &Value) -> bool {
    scenario["servers"].as_u64().unwrap_or(1) == 1
        && scenario["steps"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|step| !NOT_ON_A_CLUSTER.contains(&step["op"].as_str().unwrap_or_default()))
}

/// One scenario's servers, clients and named streams.
struct Runner {
    directory: tempfile::TempDir,
    server_args: Vec<String>,
    servers: Vec<Option<LeveeProcess>>,
    /// Against a cluster: the nodes other than the one the scenario talks to.
    other_nodes: Vec<LeveeProcess>,
    addresses: Vec<String>,
    clients: HashMap<usize, Client>,
    variables: HashMap<String, Value>,
    hot_keys: HashMap<String, HotKeys>,
    changes: HashMap<String, Arc<Mutex<Vec<Value>>>>,
    members: HashMap<String, Member>,
    subscriptions: HashMap<String, Subscription>,
    many: HashMap<String, Mailboxes>,
}

fn arg<'a>(args: &'a Map<String, Value>, name: &str) -> Result<&'a Value, Failure> {
    args.get(name)
        .ok_or_else(|| broke(format!("missing argument {name}")))
}

fn text<'a>(args: &'a Map<String, Value>, name: &str) -> Result<&'a str, Failure> {
    arg(args, name)?
        .as_str()
        .ok_or_else(|| broke(format!("{name} is not a string")))
}

fn number(args: &Map<String, Value>, name: &str, default: u64) -> u64 {
    args.get(name).and_then(Value::as_u64).unwrap_or(default)
}

fn millis(args: &Map<String, Value>, name: &str, default: u64) -> Duration {
    Duration::from_millis(number(args, name, default))
}

fn small(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}

async fn until(mut condition: impl FnMut() -> bool, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(POLL).await;
    }
}

impl Runner {
    fn new(scenario: &Value) -> Self {
        let server_args = scenario["server_args"]
            .as_array()
            .map(|args| {
                args.iter()
                    .filter_map(|arg| arg.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        Self {
            directory: tempfile::tempdir().unwrap(),
            server_args,
            servers: Vec::new(),
            other_nodes: Vec::new(),
            addresses: Vec::new(),
            clients: HashMap::new(),
            variables: HashMap::new(),
            hot_keys: HashMap::new(),
            changes: HashMap::new(),
            members: HashMap::new(),
            subscriptions: HashMap::new(),
            many: HashMap::new(),
        }
    }

    fn data_dir(&self, server: usize) -> PathBuf {
        self.directory.path().join(format!("server-{server}"))
    }

    fn start_server(&mut self, server: usize, address: &str) -> LeveeProcess {
        let args: Vec<&str> = self.server_args.iter().map(String::as_str).collect();
        LeveeProcess::start_at(address, &self.data_dir(server), &args)
    }

    /// Starts the scenario's lone servers (none if a cluster was started).
    fn start_servers(&mut self, scenario: &Value) {
        if !self.servers.is_empty() {
            return;
        }
        for server in 0..usize::try_from(scenario["servers"].as_u64().unwrap_or(1)).unwrap() {
            let process = self.start_server(server, "127.0.0.1:0");
            self.addresses.push(process.grpc());
            self.servers.push(Some(process));
        }
    }

    /// A three-node cluster replicating its queues, every shard placed and led by its
    /// preferred replica, the scenario's server 0 being node `entry` + 1 (so some of its
    /// shards are led by the others, and its appends are forwarded).
    fn start_cluster(&mut self, entry: usize) {
        let mut nodes = support::three_replicated_nodes(self.directory.path(), CLUSTER_SHARDS);
        let all: Vec<&LeveeProcess> = nodes.iter().flatten().collect();
        support::wait_settled(&all, CLUSTER_SHARDS);
        let process = nodes[entry].take().unwrap();
        self.addresses.push(process.grpc());
        self.servers.push(Some(process));
        self.other_nodes.extend(nodes.into_iter().flatten());
    }

    /// A cluster of four voters replicating its queues (three nodes, then a fourth that
    /// joins and is made a voter), every shard on the replicas the placement names and led by
    /// its preferred one, the scenario's server 0 being node 4: it holds some shards only, so
    /// it serves the others' requests through their replicas (forwarded reads and streams,
    /// many-queue streams in parts, merged listings).
    fn start_cluster_of_four(&mut self) {
        let nodes = support::three_replicated_nodes(self.directory.path(), CLUSTER_SHARDS);
        let all: Vec<&LeveeProcess> = nodes.iter().flatten().collect();
        support::wait_settled(&all, CLUSTER_SHARDS);
        let seed = all[0].peer_addr.unwrap().to_string();
        let fourth = support::start_replicated(
            self.directory.path(),
            "4",
            ("127.0.0.1:0", Some(&seed)),
            CLUSTER_SHARDS,
        );
        let runtime = support::runtime();
        let client = runtime.block_on(Client::connect(&all[0].grpc())).unwrap();
        runtime
            .block_on(support::make_voter(&client, 4, &fourth))
            .unwrap();
        drop(runtime);
        let placed: Vec<(u64, &LeveeProcess)> = (1..=3)
            .zip(all.iter().copied())
            .chain([(4, &fourth)])
            .collect();
        support::wait_placed_over(&placed, &[1, 2, 3, 4], CLUSTER_SHARDS);
        self.addresses.push(fourth.grpc());
        self.servers.push(Some(fourth));
        self.other_nodes.extend(nodes.into_iter().flatten());
    }

    async fn run(&mut self, scenario: &Value) -> Result<(), String> {
        self.start_servers(scenario);
        let steps = scenario["steps"].as_array().cloned().unwrap_or_default();
        for (number, step) in steps.iter().enumerate() {
            self.step(number + 1, step).await?;
        }
        Ok(())
    }

    fn resolve(&self, value: &Value) -> Value {
        match value {
            Value::Object(object) if object.len() == 1 && object.contains_key("$var") => self
                .variables
                .get(object["$var"].as_str().unwrap_or_default())
                .cloned()
                .unwrap_or(Value::Null),
            Value::Object(object) => Value::Object(
                object
                    .iter()
                    .map(|(key, item)| (key.clone(), self.resolve(item)))
                    .collect(),
            ),
            Value::Array(items) => {
                Value::Array(items.iter().map(|item| self.resolve(item)).collect())
            }
            other => other.clone(),
        }
    }

    async fn step(&mut self, number: usize, step: &Value) -> Result<(), String> {
        let op = step["op"].as_str().unwrap_or_default();
        let args = self.resolve(&step["args"]);
        let args = args.as_object().cloned().unwrap_or_default();
        let expect = self.resolve(&step["expect"]);
        let expect = if expect.is_null() { json!({}) } else { expect };
        let result = match self.operate(op, &args).await {
            Ok(result) => result,
            Err(Failure::Client(error)) => match error.code() {
                Some(code) => json!({
                    "error": code.as_str_name().trim_start_matches("ERROR_CODE_"),
                    "code": code as i32,
                    "message": error_message(&error),
                }),
                None => json!({"error": "CLIENT", "code": 0, "message": error.to_string()}),
            },
            Err(Failure::Scenario(message)) => {
                return Err(format!("step {number} ({op}): {message}"));
            }
        };
        if expect.get("error").is_none() && result.get("error").is_some() {
            return Err(format!("step {number} ({op}): unexpected error {result}"));
        }
        if let Some(problem) = mismatch(&expect, &result, "result") {
            let args = Value::Object(args).to_string();
            return Err(format!(
                "step {number} ({op} {}): {problem}; result {}",
                &args[..args.len().min(300)],
                &result.to_string()[..result.to_string().len().min(300)]
            ));
        }
        if let Some(saves) = step["save"].as_object() {
            for (name, path) in saves {
                let value = lookup(&result, path.as_str().unwrap_or_default());
                self.variables.insert(name.clone(), value);
            }
        }
        Ok(())
    }

    async fn client(&mut self, args: &Map<String, Value>) -> Result<Client, Failure> {
        let server = usize::try_from(number(args, "server", 0)).unwrap();
        if let Some(client) = self.clients.get(&server) {
            return Ok(client.clone());
        }
        let options = ClientOptions {
            request_timeout: Duration::from_secs(20),
            ..ClientOptions::default()
        };
        let client = Client::connect_with(&self.addresses[server], &options).await?;
        self.clients.insert(server, client.clone());
        Ok(client)
    }

    async fn operate(&mut self, op: &str, args: &Map<String, Value>) -> Outcome {
        match op {
            "server_info" | "stop_server" | "start_server" | "restart_server" | "echo"
            | "sleep" => self.admin_op(op, args).await,
            "set_rules" | "get_rules" | "set_hot_key" | "remove_hot_key" | "list_hot_keys"
            | "top_keys" => self.hotkey_admin_op(op, args).await,
            "hotkeys_open" | "hotkeys_close" | "access" | "flush" | "is_hot" | "await_hot"
            | "await_cool" | "await_connected" | "changes" | "hotkeys_stats" | "server_of" => {
                self.hotkey_session_op(op, args).await
            }
            "append" | "read" | "queue_info" | "delete_queue" | "set_producer_rate" | "produce" => {
                self.queue_op(op, args).await
            }
            "create_topic" | "partition_of" | "publish" | "describe_topic" | "describe_group"
            | "group_consume" => self.topic_op(op, args).await,
            "member_join"
            | "member_await_assignment"
            | "member_receive"
            | "member_commit"
            | "member_heartbeat"
            | "member_leave"
            | "member_status" => self.member_op(op, args).await,
            "subscribe" | "receive" | "ack" | "unsubscribe" | "mailboxes_open"
            | "mailboxes_add" | "mailboxes_receive" | "mailboxes_ack" | "mailboxes_close" => {
                self.mailbox_op(op, args).await
            }
            other => Err(broke(format!("unknown op '{other}'"))),
        }
    }

    async fn admin_op(&mut self, op: &str, args: &Map<String, Value>) -> Outcome {
        let server = usize::try_from(number(args, "server", 0)).unwrap();
        match op {
            "server_info" => {
                let info = self.client(args).await?.server_info().await?;
                Ok(json!({"version": info.version, "grpc_addr": info.grpc_addr}))
            }
            "stop_server" => {
                if let Some(mut process) = self.servers[server].take() {
                    process.signal("TERM");
                    process.wait_exit(Duration::from_secs(20));
                }
                Ok(json!({}))
            }
            "start_server" => {
                let address = self.addresses[server].clone();
                let process = self.start_server(server, &address);
                self.servers[server] = Some(process);
                Ok(json!({}))
            }
            "restart_server" => {
                Box::pin(self.admin_op("stop_server", args)).await?;
                Box::pin(self.admin_op("start_server", args)).await
            }
            "echo" => {
                let mut client = self.client(args).await?;
                let timeout_ms = number(args, "timeout_ms", 0);
                if timeout_ms > 0 {
                    let options = ClientOptions {
                        request_timeout: Duration::from_millis(timeout_ms),
                        ..ClientOptions::default()
                    };
                    client = Client::connect_with(&self.addresses[server], &options).await?;
                }
                let payload = to_bytes(args.get("payload").unwrap_or(&json!("")))?;
                let echoed = client.echo(payload, millis(args, "delay_ms", 0)).await?;
                Ok(json!({"payload": from_bytes(&echoed)}))
            }
            _ => {
                tokio::time::sleep(millis(args, "ms", 0)).await;
                Ok(json!({}))
            }
        }
    }

    async fn hotkey_admin_op(&mut self, op: &str, args: &Map<String, Value>) -> Outcome {
        let client = self.client(args).await?;
        let app = text(args, "app")?;
        match op {
            "set_rules" => {
                let mut rules = Vec::new();
                for rule in arg(args, "rules")?.as_array().cloned().unwrap_or_default() {
                    let match_kind = match rule["match"].as_str().unwrap_or_default() {
                        "exact" => MatchKind::Exact,
                        "prefix" => MatchKind::Prefix,
                        "default" => MatchKind::Default,
                        other => return Err(broke(format!("unknown match {other}"))),
                    };
                    rules.push(HotKeyRule {
                        match_kind: match_kind as i32,
                        key: to_bytes(rule.get("key").unwrap_or(&json!("")))?,
                        window_ms: small(rule["window_ms"].as_u64().unwrap_or(0)),
                        threshold: rule["threshold"].as_u64().unwrap_or(0),
                        hot_duration_ms: rule["hot_duration_ms"].as_u64().unwrap_or(0),
                        description: rule["description"].as_str().unwrap_or_default().to_owned(),
                    });
                }
                client.set_hot_key_rules(app, rules).await?;
                Ok(json!({}))
            }
            "get_rules" => {
                let rules: Vec<Value> = client
                    .hot_key_rules(app)
                    .await?
                    .iter()
                    .map(|rule| {
                        let name = match rule.match_kind() {
                            MatchKind::Exact => "exact",
                            MatchKind::Prefix => "prefix",
                            MatchKind::Default => "default",
                            MatchKind::Unspecified => "unspecified",
                        };
                        json!({
                            "match": name, "key": from_bytes(&rule.key),
                            "window_ms": rule.window_ms, "threshold": rule.threshold,
                            "hot_duration_ms": rule.hot_duration_ms,
                            "description": rule.description,
                        })
                    })
                    .collect();
                Ok(json!({ "rules": rules }))
            }
            "set_hot_key" => {
                let key = to_bytes(arg(args, "key")?)?;
                client
                    .set_hot_key(app, &key, millis(args, "duration_ms", 0))
                    .await?;
                Ok(json!({}))
            }
            "remove_hot_key" => {
                let key = to_bytes(arg(args, "key")?)?;
                Ok(json!({"was_hot": client.remove_hot_key(app, &key).await?}))
            }
            "list_hot_keys" => {
                let events = client.hot_keys(app).await?;
                let source = |event: &levee_client::HotKeyEvent| match event.source() {
                    HotKeySource::Detected => "DETECTED",
                    HotKeySource::Manual => "MANUAL",
                    HotKeySource::Unspecified => "UNSPECIFIED",
                };
                Ok(json!({
                    "keys": events.iter().map(|event| from_bytes(&event.key)).collect::<Vec<_>>(),
                    "sources": events.iter().map(source).collect::<Vec<_>>(),
                }))
            }
            _ => {
                let keys = client
                    .top_keys(app, small(number(args, "limit", 10)))
                    .await?;
                Ok(json!({
                    "keys": keys.iter().map(|key| from_bytes(&key.key)).collect::<Vec<_>>(),
                    "counts": keys.iter().map(|key| key.count).collect::<Vec<_>>(),
                }))
            }
        }
    }

    fn session(&self, args: &Map<String, Value>) -> Result<HotKeys, Failure> {
        let name = text(args, "session")?;
        self.hot_keys
            .get(name)
            .cloned()
            .ok_or_else(|| broke(format!("no session {name}")))
    }

    async fn hotkey_session_op(&mut self, op: &str, args: &Map<String, Value>) -> Outcome {
        if op == "hotkeys_open" {
            return self.hotkeys_open(args).await;
        }
        let session = self.session(args)?;
        let key = || to_bytes(arg(args, "key")?);
        let within = millis(args, "within_ms", 5_000);
        Ok(match op {
            "hotkeys_close" => {
                session.close();
                self.hot_keys.remove(text(args, "session")?);
                json!({})
            }
            "access" => {
                let key = key()?;
                let hot = (0..number(args, "times", 1)).fold(false, |_, _| session.is_hot(&key));
                json!({ "hot": hot })
            }
            "flush" => {
                session.flush();
                json!({})
            }
            "is_hot" => json!({"hot": session.is_hot_now(&key()?)}),
            "await_hot" => {
                let key = key()?;
                json!({"hot": until(|| session.is_hot_now(&key), within).await})
            }
            "await_cool" => {
                let key = key()?;
                let cooled = until(|| !session.is_hot_now(&key), within).await;
                if cooled {
                    // The hot set turns cool a moment before the change callbacks run: wait
                    // for this cool change too, as the app would see it (bounded).
                    let changes = Arc::clone(&self.changes[text(args, "session")?]);
                    let wanted = from_bytes(&key);
                    let seen = || {
                        lock(&changes)
                            .iter()
                            .any(|change| change["key"] == wanted && change["hot"] == false)
                    };
                    until(seen, Duration::from_secs(1)).await;
                }
                json!({ "hot": !cooled })
            }
            "await_connected" => {
                let servers = number(args, "servers", 1);
                let connected =
                    until(|| session.stats().servers_connected == servers, within).await;
                json!({ "connected": connected })
            }
            "changes" => {
                let changes = lock(&self.changes[text(args, "session")?]).clone();
                json!({ "changes": changes })
            }
            "hotkeys_stats" => {
                let stats = session.stats();
                json!({
                    "keys_reported": stats.keys_reported, "keys_unsent": stats.keys_unsent,
                    "batches_unsent": stats.batches_unsent,
                    "sessions_opened": stats.sessions_opened,
                    "servers_connected": stats.servers_connected,
                    "events_received": stats.events_received,
                    "accesses_recorded": stats.accesses_recorded,
                    "accesses_dropped": stats.accesses_dropped,
                })
            }
            _ => json!({"server": session.server_of(&key()?)}),
        })
    }

    async fn hotkeys_open(&mut self, args: &Map<String, Value>) -> Outcome {
        let indexes: Vec<usize> = args.get("servers").and_then(Value::as_array).map_or_else(
            || vec![0],
            |servers| {
                servers
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|index| usize::try_from(index).unwrap())
                    .collect()
            },
        );
        let servers = indexes
            .iter()
            .map(|index| self.addresses[*index].clone())
            .collect();
        let mut options = HotKeysOptions::new(text(args, "app")?, servers);
        options.report_interval = millis(args, "report_interval_ms", 20);
        options.reconnect_backoff_min = Duration::from_millis(50);
        options.reconnect_backoff_max = Duration::from_millis(500);
        // The scenarios' servers are lone servers, each its own cluster: the list as given.
        options.follow_cluster = false;
        let session: HotKeys = HotKeys::start(options)?;
        let observed = Arc::new(Mutex::new(Vec::new()));
        let recorder = Arc::clone(&observed);
        session.on_change(move |change| {
            lock(&recorder).push(json!({
                "key": from_bytes(&change.key), "hot": change.hot, "manual": change.manual,
            }));
        });
        let name = text(args, "session")?.to_owned();
        self.changes.insert(name.clone(), observed);
        self.hot_keys.insert(name, session.clone());
        let count = indexes.len() as u64;
        let connected = until(
            || session.stats().servers_connected == count,
            Duration::from_secs(10),
        )
        .await;
        Ok(json!({ "connected": connected }))
    }

    async fn queue_op(&mut self, op: &str, args: &Map<String, Value>) -> Outcome {
        let mut client = self.client(args).await?;
        match op {
            "append" => {
                let mut messages: Vec<(Vec<u8>, Vec<u8>, u64)> = Vec::new();
                if let Some(listed) = args.get("messages").and_then(Value::as_array) {
                    for message in listed {
                        messages.push((
                            to_bytes(&message["queue"])?,
                            to_bytes(message.get("payload").unwrap_or(&json!("")))?,
                            message["sequence"].as_u64().unwrap_or(0),
                        ));
                    }
                } else {
                    let queue = to_bytes(arg(args, "queue")?)?;
                    let sequences = args.get("sequences").and_then(Value::as_array);
                    let payloads = arg(args, "payloads")?
                        .as_array()
                        .cloned()
                        .unwrap_or_default();
                    for (index, payload) in payloads.iter().enumerate() {
                        let sequence = sequences
                            .and_then(|sequences| sequences.get(index))
                            .and_then(Value::as_u64)
                            .unwrap_or(0);
                        messages.push((queue.clone(), to_bytes(payload)?, sequence));
                    }
                }
                if let Some(name) = args.get("producer_name").and_then(Value::as_str)
                    && !name.is_empty()
                {
                    client = client.with_producer_name(name);
                }
                let producer_id = args
                    .get("producer_id")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let borrowed: Vec<(&[u8], &[u8], u64)> = messages
                    .iter()
                    .map(|(queue, payload, sequence)| (&queue[..], &payload[..], *sequence))
                    .collect();
                let offsets = client.append_idempotent(producer_id, &borrowed).await?;
                Ok(json!({ "offsets": offsets }))
            }
            "read" => {
                let queue = to_bytes(arg(args, "queue")?)?;
                let read = client
                    .read(
                        &queue,
                        number(args, "offset", 0),
                        small(number(args, "max_messages", 0)),
                        0,
                    )
                    .await?;
                Ok(json!({
                    "payloads": read.payloads.iter().map(|payload| from_bytes(payload)).collect::<Vec<_>>(),
                    "first_offset": read.first_offset, "next_offset": read.next_offset,
                    "queue_next_offset": read.queue_next_offset,
                }))
            }
            "queue_info" => {
                let info = client.queue_info(&to_bytes(arg(args, "queue")?)?).await?;
                Ok(json!({"first_offset": info.first_offset, "next_offset": info.next_offset}))
            }
            "delete_queue" => {
                let existed = client.delete_queue(&to_bytes(arg(args, "queue")?)?).await?;
                Ok(json!({ "existed": existed }))
            }
            "set_producer_rate" => {
                let rate = arg(args, "messages_per_s")?.as_f64().unwrap_or(0.0);
                client
                    .set_producer_rate(text(args, "producer_name")?, rate)
                    .await?;
                Ok(json!({}))
            }
            _ => Self::produce(client, args).await,
        }
    }

    /// The client's batching producer: `count` messages "0".."count-1", sent concurrently.
    async fn produce(client: Client, args: &Map<String, Value>) -> Outcome {
        let queue = to_bytes(arg(args, "queue")?)?;
        let count = number(args, "count", 0);
        let options = ProducerOptions {
            idempotent: args
                .get("idempotent")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            ..ProducerOptions::default()
        };
        let producer = Arc::new(Producer::new(client, options)?);
        let sends: Vec<_> = (0..count)
            .map(|index| {
                let (producer, queue) = (Arc::clone(&producer), queue.clone());
                tokio::spawn(
                    async move { producer.send(&queue, index.to_string().as_bytes()).await },
                )
            })
            .collect();
        let mut offsets = Vec::new();
        let mut failed = 0_u64;
        for send in sends {
            match send.await {
                Ok(Ok(offset)) => offsets.push(offset),
                _ => failed += 1,
            }
        }
        let distinct: std::collections::BTreeSet<u64> = offsets.iter().copied().collect();
        Ok(json!({
            "offsets_distinct": distinct.len() as u64 == count,
            "first_offset": offsets.iter().min(), "last_offset": offsets.iter().max(),
            "messages_failed": failed,
        }))
    }

    async fn topic_op(&mut self, op: &str, args: &Map<String, Value>) -> Outcome {
        if op == "partition_of" {
            let key = to_bytes(arg(args, "key")?)?;
            let partitions = small(number(args, "partitions", 1));
            return Ok(json!({"partition": levee_client::topic_partition(&key, partitions)}));
        }
        let client = self.client(args).await?;
        match op {
            "create_topic" => {
                let existed = client
                    .create_topic(text(args, "topic")?, small(number(args, "partitions", 0)))
                    .await?;
                Ok(json!({ "existed": existed }))
            }
            "publish" => {
                let mut messages = Vec::new();
                for message in arg(args, "messages")?
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                {
                    messages.push(PublishMessage {
                        key: to_bytes(message.get("key").unwrap_or(&json!("")))?.into(),
                        payload: to_bytes(message.get("payload").unwrap_or(&json!("")))?.into(),
                        partition_plus_one: message["partition"]
                            .as_u64()
                            .map_or(0, |partition| small(partition) + 1),
                        sequence: message["sequence"].as_u64().unwrap_or(0),
                        delay_ms: message["delay_ms"].as_u64().unwrap_or(0),
                        ..PublishMessage::default()
                    });
                }
                let request = PublishRequest {
                    topic: text(args, "topic")?.to_owned(),
                    messages,
                    producer_id: args
                        .get("producer_id")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned(),
                    producer_name: String::new(),
                };
                let published = client.publish_request(request).await?;
                Ok(json!({
                    "partitions": published.iter().map(|(partition, _)| partition).collect::<Vec<_>>(),
                    "offsets": published.iter().map(|(_, offset)| offset).collect::<Vec<_>>(),
                }))
            }
            "describe_topic" => {
                let described = client.describe_topic(text(args, "topic")?).await?;
                let next: Vec<u64> = described
                    .partitions
                    .iter()
                    .map(|partition| partition.next_offset)
                    .collect();
                Ok(json!({ "next_offsets": next }))
            }
            "describe_group" => {
                let described = client
                    .describe_group(text(args, "group")?, text(args, "topic")?)
                    .await?;
                let mut members: Vec<&str> = described
                    .members
                    .iter()
                    .map(|member| member.member.as_str())
                    .collect();
                members.sort_unstable();
                let partitions = &described.partitions;
                Ok(json!({
                    "generation": described.generation, "members": members,
                    "owners": partitions.iter().map(|p| p.owner.clone()).collect::<Vec<_>>(),
                    "epochs": partitions.iter().map(|p| p.epoch).collect::<Vec<_>>(),
                    "committed": partitions.iter().map(|p| p.committed_offset).collect::<Vec<_>>(),
                }))
            }
            _ => Self::group_consume(client, args).await,
        }
    }

    /// The client's group consumer until `count` messages are handled; handlers of even
    /// offsets take longer than odd ones, so completions come out of order.
    async fn group_consume(client: Client, args: &Map<String, Value>) -> Outcome {
        let count = number(args, "count", 0);
        let parallelism = usize::try_from(number(args, "parallelism", 4)).unwrap();
        let mut options = ConsumerOptions {
            parallelism,
            ordered: args.get("ordered").and_then(Value::as_bool).unwrap_or(true),
            commit_interval: Duration::from_millis(20),
            ..ConsumerOptions::default()
        };
        options.member = args
            .get("member")
            .and_then(Value::as_str)
            .map(str::to_owned);
        let consumer =
            GroupConsumer::new(client, text(args, "topic")?, text(args, "group")?, options)?;
        let seen: Arc<Mutex<BTreeMap<u32, Vec<u64>>>> = Arc::default();
        let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let done = Arc::new(tokio::sync::Notify::new());
        let handler = {
            let (seen, running, most, done) = (
                Arc::clone(&seen),
                Arc::clone(&running),
                Arc::clone(&most),
                Arc::clone(&done),
            );
            move |message: Message| {
                let (seen, running, most, done) = (
                    Arc::clone(&seen),
                    Arc::clone(&running),
                    Arc::clone(&most),
                    Arc::clone(&done),
                );
                async move {
                    use std::sync::atomic::Ordering::SeqCst;
                    let now = running.fetch_add(1, SeqCst) + 1;
                    most.fetch_max(now, SeqCst);
                    let pause = if message.offset.is_multiple_of(2) {
                        4
                    } else {
                        1
                    };
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                    let handled = {
                        let mut seen = lock(&seen);
                        seen.entry(message.partition)
                            .or_default()
                            .push(message.offset);
                        seen.values().map(Vec::len).sum::<usize>() as u64
                    };
                    running.fetch_sub(1, SeqCst);
                    if handled >= count {
                        done.notify_one();
                    }
                }
            }
        };
        let stop = {
            let done = Arc::clone(&done);
            async move { done.notified().await }
        };
        let within = millis(args, "within_ms", 20_000);
        let stats = tokio::time::timeout(within, consumer.run(handler, stop))
            .await
            .map_err(|_| broke("group_consume did not finish in time"))??;
        let in_order = lock(&seen).values().all(|offsets| offsets.is_sorted());
        let most = most.load(std::sync::atomic::Ordering::SeqCst);
        Ok(json!({
            "handled": stats.handled, "ordered_per_partition": in_order,
            "most_running_at_most_parallelism": most <= parallelism,
            "fenced_commits": stats.fenced_commits,
        }))
    }

    fn member(&self, args: &Map<String, Value>) -> Result<&Member, Failure> {
        let name = text(args, "member")?;
        self.members
            .get(name)
            .ok_or_else(|| broke(format!("no member {name}")))
    }

    async fn member_op(&mut self, op: &str, args: &Map<String, Value>) -> Outcome {
        let within = millis(args, "within_ms", 5_000);
        match op {
            "member_join" => {
                let member = self.member_join(args).await?;
                self.members
                    .insert(text(args, "member")?.to_owned(), member);
                Box::pin(self.member_op("member_await_assignment", args)).await
            }
            "member_await_assignment" => {
                let state = Arc::clone(&self.member(args)?.state);
                until(
                    || {
                        let state = lock(&state);
                        !state.assignments.is_empty() || state.error.is_some()
                    },
                    within,
                )
                .await;
                let mut state = lock(&state);
                let latest = state.assignments.pop();
                state.assignments.clear();
                let Some(assignment) = latest else {
                    return Err(state
                        .error
                        .clone()
                        .map_or_else(|| broke("no assignment"), Failure::from));
                };
                Ok(json!({
                    "generation": assignment.generation,
                    "partitions": assignment.partitions.iter().map(|p| p.partition).collect::<Vec<_>>(),
                    "epochs": assignment.partitions.iter().map(|p| p.epoch).collect::<Vec<_>>(),
                    "start_offsets": assignment.partitions.iter().map(|p| p.start_offset).collect::<Vec<_>>(),
                }))
            }
            "member_receive" => {
                let state = Arc::clone(&self.member(args)?.state);
                let count = usize::try_from(number(args, "count", 1)).unwrap();
                until(
                    || {
                        let state = lock(&state);
                        state.deliveries.len() >= count || state.error.is_some()
                    },
                    within,
                )
                .await;
                let mut state = lock(&state);
                let take = count.min(state.deliveries.len());
                let taken: Vec<_> = state.deliveries.drain(..take).collect();
                Ok(json!({
                    "partitions": taken.iter().map(|d| d.partition).collect::<Vec<_>>(),
                    "offsets": taken.iter().map(|d| d.offset).collect::<Vec<_>>(),
                    "epochs": taken.iter().map(|d| d.epoch).collect::<Vec<_>>(),
                    "payloads": taken.iter().map(|d| from_bytes(&d.payload)).collect::<Vec<_>>(),
                }))
            }
            "member_commit" => self.member_commit(args, within).await,
            "member_heartbeat" => {
                let request = ConsumeRequest {
                    kind: Some(ConsumeKind::Heartbeat(Heartbeat {})),
                };
                self.member(args)?
                    .sender
                    .send(request)
                    .await
                    .map_err(|_| broke("the stream is closed"))?;
                Ok(json!({}))
            }
            "member_leave" => {
                if let Some(member) = self.members.remove(text(args, "member")?) {
                    // This side closes; once the server ended the stream the member has left.
                    drop(member.sender);
                    let mut reader = member.reader;
                    if tokio::time::timeout(Duration::from_secs(5), &mut reader)
                        .await
                        .is_err()
                    {
                        reader.abort();
                        return Err(broke(
                            "the server did not end a left member's stream in 5 s".to_owned(),
                        ));
                    }
                }
                Ok(json!({}))
            }
            _ => {
                let state = lock(&self.member(args)?.state);
                Ok(match &state.error {
                    Some(error) => {
                        json!({"error": error.code.as_str_name().trim_start_matches("ERROR_CODE_")})
                    }
                    None => json!({"open": true}),
                })
            }
        }
    }

    /// Sends a commit batch on a member's stream and waits for its answer.
    async fn member_commit(&self, args: &Map<String, Value>, within: Duration) -> Outcome {
        let member = self.member(args)?;
        let mut commits = Vec::new();
        for commit in arg(args, "commits")?
            .as_array()
            .cloned()
            .unwrap_or_default()
        {
            commits.push(Commit {
                partition: small(commit["partition"].as_u64().unwrap_or(0)),
                epoch: commit["epoch"].as_u64().unwrap_or(0),
                next_offset: commit["next_offset"].as_u64().unwrap_or(0),
                retry: false,
            });
        }
        let request = ConsumeRequest {
            kind: Some(ConsumeKind::Commit(CommitBatch { commits })),
        };
        member
            .sender
            .send(request)
            .await
            .map_err(|_| broke("the stream is closed"))?;
        let state = Arc::clone(&member.state);
        until(
            || {
                let state = lock(&state);
                !state.commit_results.is_empty() || state.error.is_some()
            },
            within,
        )
        .await;
        let mut state = lock(&state);
        if state.commit_results.is_empty() {
            return Err(state
                .error
                .clone()
                .map_or_else(|| broke("no commit answer"), Failure::from));
        }
        let results = state.commit_results.remove(0);
        let codes: Vec<&str> = results
            .iter()
            .map(|result| match result.code() {
                ErrorCode::Unspecified => "OK",
                code => code.as_str_name().trim_start_matches("ERROR_CODE_"),
            })
            .collect();
        Ok(json!({
            "codes": codes,
            "next_offsets": results.iter().map(|r| r.next_offset).collect::<Vec<_>>(),
        }))
    }

    /// Opens a raw Consume stream and reads it in the background.
    async fn member_join(&mut self, args: &Map<String, Value>) -> Result<Member, Failure> {
        let server = usize::try_from(number(args, "server", 0)).unwrap();
        let channel =
            tonic::transport::Endpoint::from_shared(format!("http://{}", self.addresses[server]))
                .map_err(|error| broke(error.to_string()))?
                .connect()
                .await
                .map_err(|error| broke(error.to_string()))?;
        let (sender, receiver) = mpsc::channel(64);
        let start = ConsumeStart {
            topic: text(args, "topic")?.to_owned(),
            group: text(args, "group")?.to_owned(),
            member: text(args, "member")?.to_owned(),
            credit: Some(Credit {
                messages: small(number(args, "credit", 1_000)),
                bytes: 0,
            }),
            lease_ms: small(number(args, "lease_ms", 10_000)),
        };
        sender
            .send(ConsumeRequest {
                kind: Some(ConsumeKind::Start(start)),
            })
            .await
            .map_err(|_| broke("cannot start the stream"))?;
        let state = Arc::new(Mutex::new(MemberState::default()));
        let reading = Arc::clone(&state);
        let reader = tokio::spawn(async move {
            let stream = TopicsClient::new(channel)
                .consume(tokio_stream::wrappers::ReceiverStream::new(receiver))
                .await;
            let mut stream = match stream {
                Ok(stream) => stream.into_inner(),
                Err(status) => {
                    lock(&reading).error = Some(WireError::from_status(&status));
                    return;
                }
            };
            loop {
                match stream.message().await {
                    Ok(Some(response)) => record(&reading, response),
                    Ok(None) => {
                        lock(&reading).error = Some(WireError::new(
                            ErrorCode::Unavailable,
                            "the consume stream closed",
                        ));
                        return;
                    }
                    Err(status) => {
                        lock(&reading).error = Some(WireError::from_status(&status));
                        return;
                    }
                }
            }
        });
        Ok(Member {
            sender,
            state,
            reader,
        })
    }

    async fn mailbox_op(&mut self, op: &str, args: &Map<String, Value>) -> Outcome {
        let within = millis(args, "within_ms", 5_000);
        match op {
            "subscribe" => {
                let client = self.client(args).await?;
                let subscription = client
                    .subscribe(
                        &to_bytes(arg(args, "queue")?)?,
                        text(args, "consumer")?,
                        small(number(args, "credit", 100)),
                    )
                    .await?;
                let start = subscription.start_offset();
                self.subscriptions
                    .insert(text(args, "subscription")?.to_owned(), subscription);
                Ok(json!({ "start_offset": start }))
            }
            "receive" => {
                let name = text(args, "subscription")?;
                let subscription = self
                    .subscriptions
                    .get_mut(name)
                    .ok_or_else(|| broke("no subscription"))?;
                let count = usize::try_from(number(args, "count", 1)).unwrap();
                let deadline = tokio::time::Instant::now() + within;
                let mut received = Vec::new();
                while received.len() < count {
                    match tokio::time::timeout_at(deadline, subscription.next()).await {
                        Ok(Ok(Some(delivery))) => received.push(delivery),
                        Ok(Err(error)) => return Err(error.into()),
                        Ok(Ok(None)) | Err(_) => break,
                    }
                }
                Ok(json!({
                    "offsets": received.iter().map(|d| d.offset).collect::<Vec<_>>(),
                    "payloads": received.iter().map(|d| from_bytes(&d.payload)).collect::<Vec<_>>(),
                }))
            }
            "ack" => {
                let name = text(args, "subscription")?;
                let subscription = self
                    .subscriptions
                    .get_mut(name)
                    .ok_or_else(|| broke("no subscription"))?;
                subscription.ack(number(args, "offset", 0)).await?;
                Ok(json!({}))
            }
            "unsubscribe" => {
                self.subscriptions.remove(text(args, "subscription")?);
                Ok(json!({}))
            }
            "mailboxes_open" => {
                let client = self.client(args).await?;
                let mailboxes = client
                    .subscribe_many(
                        text(args, "consumer")?,
                        small(number(args, "credit", 1_000)),
                    )
                    .await?;
                self.many
                    .insert(text(args, "stream")?.to_owned(), mailboxes);
                Ok(json!({}))
            }
            "mailboxes_close" => {
                self.many.remove(text(args, "stream")?);
                Ok(json!({}))
            }
            _ => self.many_op(op, args, within).await,
        }
    }

    async fn many_op(&mut self, op: &str, args: &Map<String, Value>, within: Duration) -> Outcome {
        let name = text(args, "stream")?.to_owned();
        let mailboxes = self.many.get_mut(&name).ok_or_else(|| broke("no stream"))?;
        match op {
            "mailboxes_add" => {
                let mut queues = Vec::new();
                for queue in arg(args, "queues")?.as_array().cloned().unwrap_or_default() {
                    queues.push(to_bytes(&queue)?);
                }
                let borrowed: Vec<&[u8]> = queues.iter().map(Vec::as_slice).collect();
                let numbers: Vec<u32> = mailboxes.add(&borrowed).await?.collect();
                Ok(json!({ "mailboxes": numbers }))
            }
            "mailboxes_receive" => {
                let count = usize::try_from(number(args, "count", 1)).unwrap();
                let deadline = tokio::time::Instant::now() + within;
                let mut received = Vec::new();
                while received.len() < count {
                    match tokio::time::timeout_at(deadline, mailboxes.next()).await {
                        Ok(Ok(Some(delivery))) => received.push(json!({
                            "mailbox": delivery.mailbox, "offset": delivery.offset,
                            "payload": from_bytes(&delivery.payload),
                        })),
                        Ok(Err(error)) => return Err(error.into()),
                        Ok(Ok(None)) | Err(_) => break,
                    }
                }
                Ok(json!({ "deliveries": received }))
            }
            _ => {
                for ack in arg(args, "acks")?.as_array().cloned().unwrap_or_default() {
                    mailboxes.ack(
                        small(ack["mailbox"].as_u64().unwrap_or(0)),
                        ack["offset"].as_u64().unwrap_or(0),
                    );
                }
                mailboxes.flush_acks().await?;
                Ok(json!({}))
            }
        }
    }
}

/// Keeps what a Consume stream answered.
fn record(state: &Mutex<MemberState>, response: ConsumeResponse) {
    let mut state = lock(state);
    if let Some(assignment) = response.assignment {
        state.assignments.push(assignment);
    }
    state.deliveries.extend(response.deliveries);
    if !response.commit_results.is_empty() {
        state.commit_results.push(response.commit_results);
    }
}

/// The message of a client error as the server (or the client in its place) gave it.
fn error_message(error: &ClientError) -> String {
    match error {
        ClientError::Server(wire) => wire.message.clone(),
        other => other.to_string(),
    }
}

/// Runs the scenario at `path` against lone servers, or against a three-node cluster talking
/// to node `entry` + 1 (if it [`runs_on_a_cluster`]; `Ok(false)` if not).
fn run_scenario(path: &Path, cluster_entry: Option<usize>) -> Result<bool, String> {
    let scenario: Value =
        serde_json::from_slice(&std::fs::read(path).unwrap()).map_err(|error| error.to_string())?;
    let mut runner = Runner::new(&scenario);
    if let Some(entry) = cluster_entry {
        if !runs_on_a_cluster(&scenario) {
            return Ok(false);
        }
        if entry == FOURTH_VOTER {
            runner.start_cluster_of_four();
        } else {
            runner.start_cluster(entry);
        }
    }
    let runtime = support::runtime();
    let outcome = runtime.block_on(runner.run(&scenario));
    for session in runner.hot_keys.values() {
        session.close();
    }
    for member in runner.members.values() {
        member.reader.abort();
    }
    drop(runtime);
    outcome.map(|()| true)
}

/// The cluster entry of [`run_scenario`] that runs a scenario against a fourth voter
/// ([`Runner::start_cluster_of_four`]).
const FOURTH_VOTER: usize = usize::MAX;

fn scenario_paths() -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(scenarios_directory())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.extension()
                .is_some_and(|extension| extension == "json")
        })
        .collect();
    paths.sort();
    paths
}

#[test]
fn given_every_conformance_scenario_then_the_rust_client_passes_it() {
    let paths = scenario_paths();
    assert!(paths.len() >= 14, "{paths:?}");
    let failures: Vec<String> = paths
        .iter()
        .filter_map(|path| {
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            run_scenario(path, None)
                .err()
                .map(|error| format!("{name}: {error}"))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} scenarios failed:\n{}",
        failures.len(),
        paths.len(),
        failures.join("\n")
    );
}

/// The scenarios again, each against a new three-node cluster that replicates its queues,
/// talking to one node (node 1, 2 and 3 in turn): appends go to shards some of which other
/// nodes lead, topics' catalog is the cluster's, streams are served by the node. Scenarios
/// that stop their server are left out ([`NOT_ON_A_CLUSTER`]).
#[test]
fn given_a_three_node_cluster_then_the_rust_client_passes_every_scenario_it_can_run() {
    run_on_clusters("a cluster", |ran| ran % 3);
}

/// The scenarios again against a cluster of four voters, talking to the fourth
/// ([`Runner::start_cluster_of_four`]): it holds some shards only, so what it serves of the
/// others goes through their replicas.
#[test]
fn given_a_fourth_voter_holding_some_shards_then_the_rust_client_passes_every_scenario_it_can_run()
{
    run_on_clusters("a fourth voter", |_| FOURTH_VOTER);
}

/// Runs every scenario that [`runs_on_a_cluster`] against a new cluster each, entered as
/// `entry` says (given how many ran before), and asserts that at least 13 ran and all passed
/// against `what`.
fn run_on_clusters(what: &str, entry: impl Fn(usize) -> usize) {
    let paths = scenario_paths();
    let mut ran = Vec::new();
    let mut failures = Vec::new();
    for path in &paths {
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        match run_scenario(path, Some(entry(ran.len()))) {
            Ok(true) => ran.push(name),
            Ok(false) => {}
            Err(error) => {
                ran.push(name.clone());
                failures.push(format!("{name}: {error}"));
            }
        }
    }
    assert!(ran.len() >= 13, "only {ran:?} ran on {what}");
    assert!(
        failures.is_empty(),
        "{} of {} scenarios failed against {what}:\n{}",
        failures.len(),
        ran.len(),
        failures.join("\n")
    );
}
