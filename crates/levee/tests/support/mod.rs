//! Starts the real `levee` binary on free loopback ports and talks to it over the network.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a server may take to become ready.
const SERVER_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The `levee` binary, with no LEVEE_* variables inherited from the test's environment.
pub fn levee_command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_levee"));
    for (name, _) in std::env::vars() {
        if name.starts_with("LEVEE_") {
            command.env_remove(name);
        }
    }
    command.env_remove("RUST_BACKTRACE");
    command
}

/// A running `levee server` child process.
pub struct LeveeProcess {
    child: Child,
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// The peer (Raft) address, when started with `--peer-addr`.
    pub peer_addr: Option<SocketAddr>,
    pub data_dir: PathBuf,
    log_lines: mpsc::Receiver<String>,
    pub logs: Vec<String>,
    temporary_dir: Option<tempfile::TempDir>,
}

impl LeveeProcess {
    /// Starts a server on free ports with a fresh data dir, plus `extra` flags.
    pub fn start(extra: &[&str]) -> Self {
        let temporary = tempfile::tempdir().unwrap();
        let data_dir = temporary.path().join("data");
        let mut process = Self::start_in(&data_dir, extra);
        process.temporary_dir = Some(temporary);
        process
    }

    /// Starts a server on free ports with `data_dir`, plus `extra` flags.
    pub fn start_in(data_dir: &Path, extra: &[&str]) -> Self {
        Self::start_at("127.0.0.1:0", data_dir, extra)
    }

    /// Starts a server with its gRPC API on `grpc_addr`, `data_dir`, plus `extra` flags. A
    /// fixed address freed a moment ago may be held briefly by another socket (a client that
    /// reconnects to it can, on loopback, connect to itself from that very port): a start
    /// refused for an address in use is tried again, for up to [`SERVER_READY_TIMEOUT`].
    pub fn start_at(grpc_addr: &str, data_dir: &Path, extra: &[&str]) -> Self {
        let deadline = Instant::now() + SERVER_READY_TIMEOUT;
        loop {
            match Self::try_start_at(grpc_addr, data_dir, extra) {
                Ok(process) => return process,
                Err(logs) if Instant::now() < deadline => {
                    assert!(
                        logs.iter().any(|line| line.contains("already in use")),
                        "server did not become ready; logs: {logs:#?}"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(logs) => panic!("server did not become ready; logs: {logs:#?}"),
            }
        }
    }

    /// One start; the logs when the server exits or times out before it is ready.
    fn try_start_at(grpc_addr: &str, data_dir: &Path, extra: &[&str]) -> Result<Self, Vec<String>> {
        let mut child = levee_command()
            .args([
                "server",
                "--grpc-addr",
                grpc_addr,
                "--admin-addr",
                "127.0.0.1:0",
            ])
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--log-format", "json"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (sender, log_lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        let mut logs = Vec::new();
        let deadline = Instant::now() + SERVER_READY_TIMEOUT;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = log_lines.recv_timeout(remaining) else {
                let _ = child.kill();
                let _ = child.wait();
                return Err(logs);
            };
            logs.push(line.clone());
            let Ok(event) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            if event["message"] == "levee server ready" {
                let address = |key: &str| event[key].as_str().unwrap().parse().unwrap();
                return Ok(Self {
                    grpc_addr: address("grpc_addr"),
                    admin_addr: address("admin_addr"),
                    peer_addr: event["peer_addr"]
                        .as_str()
                        .map(|peer| peer.parse().unwrap()),
                    child,
                    data_dir: data_dir.to_path_buf(),
                    log_lines,
                    logs,
                    temporary_dir: None,
                });
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn grpc(&self) -> String {
        self.grpc_addr.to_string()
    }

    /// Sends a signal by name, such as `TERM` or `INT`.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{name} failed");
    }

    /// Waits up to `timeout` for the process to exit and collects its remaining logs.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                while let Ok(line) = self.log_lines.recv_timeout(Duration::from_millis(500)) {
                    self.logs.push(line);
                }
                return status;
            }
            if Instant::now() >= deadline {
                while let Ok(line) = self.log_lines.try_recv() {
                    self.logs.push(line);
                }
                let last = &self.logs[self.logs.len().saturating_sub(40)..];
                panic!("server did not exit within {timeout:?}; its last logs: {last:#?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether any log line so far contains `text`.
    pub fn logged(&mut self, text: &str) -> bool {
        while let Ok(line) = self.log_lines.try_recv() {
            self.logs.push(line);
        }
        self.logs.iter().any(|line| line.contains(text))
    }
}

impl Drop for LeveeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // `LEVEE_TEST_LOGS_DIR=dir`: every server's log kept there, one file per process.
        if let Some(directory) = std::env::var_os("LEVEE_TEST_LOGS_DIR") {
            while let Ok(line) = self.log_lines.recv_timeout(Duration::from_millis(200)) {
                self.logs.push(line);
            }
            let path = Path::new(&directory).join(format!("{}.log", self.child.id()));
            let _ = std::fs::write(path, self.logs.join("\n"));
        }
    }
}

impl LeveeProcess {
    /// Runs the CLI with `args` against this server's gRPC port, answering in JSON: its exit
    /// code, stdout and stderr.
    pub fn cli(&self, args: &[&str]) -> (Option<i32>, String, String) {
        let address = self.grpc();
        let mut all = args.to_vec();
        all.extend(["--server", &address, "--json"]);
        run_to_exit(&all, &[])
    }
}

/// Runs `levee` with `args` to completion (at most 30 s); returns its exit code and stderr.
pub fn run_to_exit(args: &[&str], environment: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut child = levee_command()
        .args(args)
        .envs(environment.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("levee {args:?} did not exit within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stdout = String::new();
    let mut stderr = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    (status.code(), stdout, stderr)
}

/// A plain HTTP/1.1 GET; returns the status code and body.
pub fn http_get(address: SocketAddr, path: &str) -> (u16, String) {
    http_request(address, "GET", path, "")
}

/// The value of one series in the server's `/metrics` (its name, with labels if it has any,
/// as exposed), 0 if it is not there.
pub fn metric_value(server: &LeveeProcess, series: &str) -> u64 {
    let (_, metrics) = http_get(server.admin_addr, "/metrics");
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}

/// A plain HTTP/1.1 request with a JSON body; returns the status code and body.
pub fn http_request(address: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    http_raw(address, method, path, "application/json", body.as_bytes())
}

/// A raw HTTP/1.1 request with a body of `content_type`; returns the status and body.
pub fn http_raw(
    address: SocketAddr,
    method: &str,
    path: &str,
    content_type: &str,
    body: &[u8],
) -> (u16, String) {
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(5)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\
         Content-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    // The server may answer (413) before it read the whole body.
    let _ = stream.write_all(body);
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let response = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    (status, body.to_owned())
}

/// A tokio runtime for calling the async client from a plain test.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Polls `condition` every 10 ms until it holds; panics with `what` after `timeout`.
pub fn wait_for(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !condition() {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Each shard group `node` replicates, from its `/v1/cluster`: the shard, the leader it knows
/// and the voters (none listed while they are changing).
pub fn shard_groups(
    node: &LeveeProcess,
) -> std::collections::BTreeMap<u64, (Option<u64>, Vec<u64>)> {
    let (code, body) = http_get(node.admin_addr, "/v1/cluster");
    assert_eq!(code, 200, "{body}");
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    view["shard_groups"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|group| {
            let changing = group["changing"].as_bool().unwrap();
            let voters = group["voters"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|_| !changing)
                .map(|voter| voter.as_u64().unwrap())
                .collect();
            (
                group["shard"].as_u64().unwrap(),
                (group["leader"].as_u64(), voters),
            )
        })
        .collect()
}

/// How long a replicated cluster may take to form, place its shards, or elect a leader.
pub const CLUSTER_CONVERGE_TIMEOUT: Duration = Duration::from_secs(30);

/// Node `node_id` of a cluster that replicates its queues over `shards` shards, its peer port
/// at `peer`, joining `join` (else creating the cluster), its data in `directory/n<id>`.
pub fn start_replicated(
    directory: &Path,
    node_id: &str,
    (peer, join): (&str, Option<&str>),
    shards: u32,
) -> LeveeProcess {
    start_replicated_with(directory, node_id, (peer, join), shards, &[])
}

/// [`start_replicated`] with `extra` flags.
pub fn start_replicated_with(
    directory: &Path,
    node_id: &str,
    (peer, join): (&str, Option<&str>),
    shards: u32,
    extra: &[&str],
) -> LeveeProcess {
    let shards = shards.to_string();
    let mut flags = vec![
        "--node-id",
        node_id,
        "--peer-addr",
        peer,
        "--shards",
        &shards,
        "--replicated-queues",
        "true",
    ];
    if let Some(seed) = join {
        flags.extend(["--join", seed]);
    }
    flags.extend(extra);
    LeveeProcess::start_in(&directory.join(format!("n{node_id}")), &flags)
}

/// Nodes 1, 2 and 3 of a new cluster that replicates its queues (2 and 3 joining node 1).
pub fn three_replicated_nodes(directory: &Path, shards: u32) -> [Option<LeveeProcess>; 3] {
    three_replicated_nodes_with(directory, shards, &[])
}

/// [`three_replicated_nodes`], each started with `extra` flags.
pub fn three_replicated_nodes_with(
    directory: &Path,
    shards: u32,
    extra: &[&str],
) -> [Option<LeveeProcess>; 3] {
    let first = start_replicated_with(directory, "1", ("127.0.0.1:0", None), shards, extra);
    let seed = first.peer_addr.unwrap().to_string();
    let joining =
        |id| start_replicated_with(directory, id, ("127.0.0.1:0", Some(&seed)), shards, extra);
    [Some(first), Some(joining("2")), Some(joining("3"))]
}

/// Waits until every node is a voter of every shard and sees one leader for each; each
/// shard's leader.
pub fn wait_placed(
    nodes: &[&LeveeProcess],
    voters: &[u64],
    shards: u32,
) -> std::collections::BTreeMap<u64, u64> {
    let mut leaders = std::collections::BTreeMap::new();
    wait_for(
        "every shard placed on the nodes",
        CLUSTER_CONVERGE_TIMEOUT,
        || {
            let views: Vec<_> = nodes.iter().map(|node| shard_groups(node)).collect();
            leaders.clear();
            (0..u64::from(shards)).all(|shard| {
                views.iter().all(|view| {
                    view.get(&shard).is_some_and(|(leader, members)| {
                        members == voters
                            && leader.is_some()
                            && *leaders.entry(shard).or_insert(leader.unwrap()) == leader.unwrap()
                    })
                })
            })
        },
    );
    leaders
}

/// [`wait_placed`] on nodes 1, 2 and 3, then until every shard is led by its preferred
/// replica (it claims the lead soon after the cluster forms; a plain append then would fail
/// as "may be stored").
pub fn wait_settled(nodes: &[&LeveeProcess], shards: u32) -> std::collections::BTreeMap<u64, u64> {
    let mut leaders = std::collections::BTreeMap::new();
    wait_for(
        "every shard led by its preferred replica",
        CLUSTER_CONVERGE_TIMEOUT,
        || {
            leaders = wait_placed(nodes, &[1, 2, 3], shards);
            (0..shards).all(|shard| {
                leaders[&u64::from(shard)] == levee_proto::shards::replicas(shard, &[1, 2, 3])[0]
            })
        },
    );
    leaders
}

/// Waits until every shard's replicas are those the placement over `voters` names, each seen
/// so by every one of its replicas among `nodes` (node id, process), with no learner left
/// (replicas moved off a node are gone) and led by its preferred replica.
pub fn wait_placed_over(nodes: &[(u64, &LeveeProcess)], voters: &[u64], shards: u32) {
    wait_for(
        "every shard on the replicas the placement names, led by its preferred one",
        CLUSTER_CONVERGE_TIMEOUT,
        || {
            let views: std::collections::BTreeMap<u64, serde_json::Value> = nodes
                .iter()
                .map(|(id, node)| {
                    let (_, body) = http_get(node.admin_addr, "/v1/cluster");
                    (*id, serde_json::from_str(&body).unwrap_or_default())
                })
                .collect();
            (0..shards).all(|shard| {
                let mut expected = levee_proto::shards::replicas(shard, voters);
                let preferred = expected[0];
                expected.sort_unstable();
                expected.iter().all(|id| {
                    views.get(id).is_none_or(|view| {
                        view["shard_groups"].as_array().is_some_and(|groups| {
                            groups.iter().any(|group| {
                                let ids = |key: &str| -> Vec<u64> {
                                    group[key]
                                        .as_array()
                                        .into_iter()
                                        .flatten()
                                        .filter_map(serde_json::Value::as_u64)
                                        .collect()
                                };
                                group["shard"] == shard
                                    && group["changing"] == false
                                    && group["leader"] == preferred
                                    && ids("voters") == expected
                                    && ids("learners").is_empty()
                            })
                        })
                    })
                })
            })
        },
    );
}

/// Adds `node` (node `node_id`, started with `--join`) as a voter, through `client`'s node.
pub async fn make_voter(
    client: &levee_client::Client,
    node_id: u64,
    node: &LeveeProcess,
) -> Result<levee_proto::v1::MemberRole, levee_client::ClientError> {
    client
        .add_node(levee_proto::v1::AddNodeRequest {
            node_id,
            peer_addr: node.peer_addr.unwrap().to_string(),
            grpc_addr: node.grpc(),
            admin_addr: node.admin_addr.to_string(),
            learner: false,
        })
        .await
}
