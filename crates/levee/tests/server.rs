//! The real `levee server` process over the network: health, readiness, metrics, graceful
//! shutdown, and every bad start-up input with its exit code and one-line message.

mod support;

use std::time::{Duration, Instant};

use levee_client::{Client, ErrorCode, HealthStatus};
use support::{LeveeProcess, http_get, http_raw, run_to_exit, runtime};

#[test]
fn given_running_server_then_grpc_health_healthz_readyz_and_info_answer() {
    let server = LeveeProcess::start(&[]);
    assert_eq!(
        http_get(server.admin_addr, "/healthz"),
        (200, "ok\n".to_owned())
    );
    assert_eq!(
        http_get(server.admin_addr, "/readyz"),
        (200, "ready\n".to_owned())
    );
    runtime().block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        assert_eq!(client.health("").await.unwrap(), HealthStatus::Serving);
        assert_eq!(
            client.health("levee.v1.Admin").await.unwrap(),
            HealthStatus::Serving
        );
        let info = client.server_info().await.unwrap();
        assert_eq!(info.grpc_addr, server.grpc());
        assert_eq!(info.process_id, server.pid());
        assert_eq!(info.data_dir, server.data_dir.display().to_string());
    });
    let (status, body) = http_get(server.admin_addr, "/v1/server");
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(json["ready"], true);
}

#[test]
fn given_calls_then_metrics_count_them_by_rpc_and_code_with_latency_and_process_figures() {
    let server = LeveeProcess::start(&[]);
    runtime().block_on(async {
        let client = Client::connect(&server.grpc()).await.unwrap();
        for _ in 0..3 {
            client.echo(b"ping".to_vec(), Duration::ZERO).await.unwrap();
        }
        let error = client
            .echo(vec![0; 70_000], Duration::ZERO)
            .await
            .unwrap_err();
        assert_eq!(error.code(), Some(ErrorCode::InvalidArgument));
        assert!(error.to_string().contains("at most 65536 bytes"), "{error}");
        let (status, text) = http_get(server.admin_addr, "/metrics");
        assert_eq!(status, 200);
        for expected in [
            "levee_grpc_requests_total{rpc=\"/levee.v1.Admin/Echo\",code=\"OK\"} 3",
            "levee_grpc_requests_total{rpc=\"/levee.v1.Admin/Echo\",code=\"INVALID_ARGUMENT\"} 1",
            "levee_grpc_request_duration_seconds_count{rpc=\"/levee.v1.Admin/Echo\"} 4",
            "levee_grpc_connections_open 1",
            "process_resident_memory_bytes ",
            "process_cpu_seconds_total ",
        ] {
            assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
        }
        drop(client);
    });
    // Once the client is gone, so is its connection.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !http_get(server.admin_addr, "/metrics")
        .1
        .contains("levee_grpc_connections_open 0")
    {
        assert!(
            Instant::now() < deadline,
            "connection gauge never went back to 0"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn given_request_in_flight_when_sigterm_then_it_completes_and_exit_is_zero() {
    let mut server = LeveeProcess::start(&[]);
    let address = server.grpc();
    let runtime = runtime();
    let in_flight = runtime.spawn(async move {
        let client = Client::connect(&address).await.unwrap();
        client
            .echo(b"finish me".to_vec(), Duration::from_millis(1_500))
            .await
    });
    std::thread::sleep(Duration::from_millis(400));
    server.signal("TERM");
    // While the request drains, the admin port still answers, and says not ready.
    let deadline = Instant::now() + Duration::from_secs(5);
    while http_get(server.admin_addr, "/readyz").0 != 503 {
        assert!(
            Instant::now() < deadline,
            "/readyz never said 503 during the drain"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !in_flight.is_finished(),
        "the request must still be in flight"
    );
    let answer = runtime.block_on(in_flight).unwrap();
    assert_eq!(answer.unwrap(), b"finish me");
    let status = server.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "logs: {:#?}", server.logs);
    assert!(
        server.logged("shutdown complete"),
        "logs: {:#?}",
        server.logs
    );
    assert!(
        server.logged("queue store closed"),
        "logs: {:#?}",
        server.logs
    );
    assert!(
        server.logged("data dir flushed and unlocked"),
        "logs: {:#?}",
        server.logs
    );
    let refused = runtime.block_on(Client::connect(&server.grpc()));
    assert!(refused.is_err(), "the gRPC port must be closed after exit");
}

#[test]
fn given_request_longer_than_grace_when_sigint_then_cut_off_at_deadline_and_exit_zero() {
    let mut server = LeveeProcess::start(&["--shutdown-grace-ms", "300"]);
    let address = server.grpc();
    let runtime = runtime();
    let in_flight = runtime.spawn(async move {
        let client = Client::connect(&address).await.unwrap();
        client
            .echo(b"too slow".to_vec(), Duration::from_secs(20))
            .await
    });
    std::thread::sleep(Duration::from_millis(400));
    let signalled = Instant::now();
    server.signal("INT");
    let status = server.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(0), "logs: {:#?}", server.logs);
    assert!(
        signalled.elapsed() < Duration::from_secs(5),
        "took {:?}",
        signalled.elapsed()
    );
    assert!(server.logged("did not finish within the shutdown grace period"));
    assert!(runtime.block_on(in_flight).unwrap().is_err());
}

#[test]
fn given_draining_server_when_second_signal_then_exits_at_once() {
    let mut server = LeveeProcess::start(&["--shutdown-grace-ms", "60000"]);
    let address = server.grpc();
    let runtime = runtime();
    let _in_flight = runtime.spawn(async move {
        let client = Client::connect(&address).await.unwrap();
        client.echo(Vec::new(), Duration::from_secs(30)).await
    });
    std::thread::sleep(Duration::from_millis(400));
    server.signal("TERM");
    std::thread::sleep(Duration::from_millis(300));
    let signalled = Instant::now();
    server.signal("INT");
    let status = server.wait_exit(Duration::from_secs(10));
    assert_eq!(status.code(), Some(130), "logs: {:#?}", server.logs);
    assert!(signalled.elapsed() < Duration::from_secs(5));
}

/// Asserts a failed start: exit code 2 and exactly one line on stderr containing `expected`.
fn assert_bad_start(args: &[&str], environment: &[(&str, &str)], expected: &str) {
    let (code, _stdout, stderr) = run_to_exit(args, environment);
    assert_eq!(code, Some(2), "args {args:?}; stderr: {stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|line| !line.trim().is_empty())
        .collect();
    assert_eq!(lines.len(), 1, "one line expected, got: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(
        lines[0].contains(expected),
        "expected {expected:?} in: {stderr}"
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "{stderr}"
    );
}

#[test]
fn given_unknown_config_key_then_exit_2_naming_the_key_and_line() {
    let directory = tempfile::tempdir().unwrap();
    let config = write_config(
        &directory,
        "admin_addr = \"127.0.0.1:0\"\ngrpc_adr = \"127.0.0.1:0\"\n",
    );
    let config = config.to_str().unwrap();
    assert_bad_start(
        &["server", "--config", config],
        &[],
        "unknown field `grpc_adr`",
    );
    assert_bad_start(&["server", "--config", config], &[], "line 2");
    assert_bad_start(
        &["server", "--config", "/nonexistent/levee.toml"],
        &[],
        "cannot read config file /nonexistent/levee.toml",
    );
}

#[test]
fn given_malformed_address_then_exit_2_naming_the_source_and_an_example() {
    assert_bad_start(
        &["server", "--grpc-addr", "127.0.0.1:notaport"],
        &[],
        "invalid grpc_addr '127.0.0.1:notaport' from flag --grpc-addr",
    );
    assert_bad_start(
        &["server"],
        &[("LEVEE_ADMIN_ADDR", "nowhere")],
        "invalid admin_addr 'nowhere' from environment variable LEVEE_ADMIN_ADDR",
    );
}

#[test]
fn given_port_in_use_then_exit_2_naming_address_and_flag() {
    let directory = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let data_dir = directory.path().join("data");
    let data_dir = data_dir.to_str().unwrap();
    assert_bad_start(
        &[
            "server",
            "--data-dir",
            data_dir,
            "--grpc-addr",
            &taken,
            "--admin-addr",
            "127.0.0.1:0",
        ],
        &[],
        &format!("gRPC address {taken} is already in use"),
    );
    assert_bad_start(
        &[
            "server",
            "--data-dir",
            data_dir,
            "--grpc-addr",
            "127.0.0.1:0",
            "--admin-addr",
            &taken,
        ],
        &[],
        "choose another address with --admin-addr",
    );
}

#[test]
fn given_data_dir_not_writable_then_exit_2_with_the_fix() {
    let directory = tempfile::tempdir().unwrap();
    let file = directory.path().join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let file = file.to_str().unwrap();
    let free = ["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"];
    let with = |data_dir: &str| {
        let mut args = vec!["server", "--data-dir", data_dir];
        args.extend(free);
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let args = with(file);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_bad_start(&args, &[], "is not a directory");

    // Root may write anywhere on a normal file system; sysfs refuses even root.
    let unwritable = "/sys/levee-test-data";
    let args = with(unwritable);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_bad_start(&args, &[], "is not writable");
    assert_bad_start(&args, &[], "choose another with --data-dir");
}

#[test]
fn given_data_dir_in_use_by_running_server_then_second_server_exits_2_naming_its_pid() {
    let first = LeveeProcess::start(&[]);
    let data_dir = first.data_dir.to_str().unwrap().to_owned();
    assert_bad_start(
        &[
            "server",
            "--data-dir",
            &data_dir,
            "--grpc-addr",
            "127.0.0.1:0",
            "--admin-addr",
            "127.0.0.1:0",
        ],
        &[],
        &format!(
            "is locked by another running levee server (pid {})",
            first.pid()
        ),
    );
    // The first server is unaffected.
    assert_eq!(http_get(first.admin_addr, "/readyz").0, 200);
}

#[test]
fn given_flag_env_and_file_then_print_config_shows_flag_over_env_over_file() {
    let directory = tempfile::tempdir().unwrap();
    let config = write_config(
        &directory,
        "grpc_addr = \"127.0.0.1:1001\"\nadmin_addr = \"127.0.0.1:1002\"\n",
    );
    let config = config.to_str().unwrap();
    let (code, stdout, _) = run_to_exit(
        &[
            "server",
            "--config",
            config,
            "--print-config",
            "--grpc-addr",
            "127.0.0.1:3001",
            "--queue-buffer-budget-mb",
            "96",
        ],
        &[
            ("LEVEE_GRPC_ADDR", "127.0.0.1:2001"),
            ("LEVEE_ADMIN_ADDR", "127.0.0.1:2002"),
        ],
    );
    assert_eq!(code, Some(0));
    assert!(stdout.contains("queue_buffer_budget_mb = 96"), "{stdout}");
    assert!(
        stdout.contains("grpc_addr = \"127.0.0.1:3001\""),
        "{stdout}"
    );
    assert!(
        stdout.contains("admin_addr = \"127.0.0.1:2002\""),
        "{stdout}"
    );
    assert!(stdout.contains("data_dir = \"./levee-data\""), "{stdout}");
    let (_, stdout, _) = run_to_exit(&["server", "--config", config, "--print-config"], &[]);
    assert!(
        stdout.contains("grpc_addr = \"127.0.0.1:1001\""),
        "{stdout}"
    );
}

#[test]
fn given_cli_health_command_then_exit_code_says_whether_serving() {
    let server = LeveeProcess::start(&[]);
    let (code, stdout, _) = run_to_exit(&["health", "--server", &server.grpc()], &[]);
    assert_eq!((code, stdout.trim()), (Some(0), "SERVING"));
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let (code, stdout, stderr) =
        run_to_exit(&["health", "--json", "--server", &closed.to_string()], &[]);
    assert_eq!(code, Some(1), "{stderr}");
    let json: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(json["status"], "UNREACHABLE");
}

#[test]
fn given_queue_store_dir_holding_something_else_then_exit_2_saying_what_was_found() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    std::fs::create_dir_all(data_dir.join("queues")).unwrap();
    std::fs::write(data_dir.join("queues/notes.txt"), "not a segment").unwrap();
    let data_dir = data_dir.to_str().unwrap();
    assert_bad_start(
        &[
            "server",
            "--data-dir",
            data_dir,
            "--grpc-addr",
            "127.0.0.1:0",
            "--admin-addr",
            "127.0.0.1:0",
        ],
        &[],
        "is not a Levee queue store",
    );
}

/// Writes `text` as `levee.toml` in `directory` and returns its path.
fn write_config(directory: &tempfile::TempDir, text: &str) -> std::path::PathBuf {
    let path = directory.path().join("levee.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// A request the admin port refuses, and the status and Levee code it answers.
struct BadRequest {
    method: &'static str,
    path: &'static str,
    content_type: &'static str,
    body: Vec<u8>,
    status: u16,
    code: i64,
}

#[test]
fn given_bad_admin_requests_then_every_error_answer_is_the_one_json_shape() {
    let server = LeveeProcess::start(&[]);
    let rules = "/v1/hotkeys/apps/shop/rules";
    let case = |method, path, content_type, body: &[u8], status, code| BadRequest {
        method,
        path,
        content_type,
        body: body.to_vec(),
        status,
        code,
    };
    let cases = [
        case("GET", "/nope", "application/json", b"", 404, 1009),
        case("DELETE", "/healthz", "application/json", b"", 405, 1009),
        case("PUT", rules, "text/plain", b"[]", 415, 1001),
        case("PUT", rules, "application/json", b"[{", 400, 1001),
        case("PUT", rules, "application/json", b"{\"x\": 1}", 422, 1001),
        case(
            "PUT",
            rules,
            "application/json",
            &vec![b' '; 3 << 20],
            413,
            1001,
        ),
    ];
    for BadRequest {
        method,
        path,
        content_type,
        body,
        status,
        code,
    } in cases
    {
        let (answered, text) = http_raw(server.admin_addr, method, path, content_type, &body);
        assert_eq!(answered, status, "{method} {path}: {text}");
        let json: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|error| panic!("{method} {path}: not JSON ({error}): {text}"));
        assert_eq!(json["error"]["code"], code, "{method} {path}: {text}");
        assert!(json["error"]["reason"].is_string(), "{text}");
        assert!(
            !json["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .is_empty(),
            "{text}"
        );
    }
}

#[test]
fn given_a_ready_file_then_a_script_learns_the_bound_addresses_without_reading_logs() {
    let directory = tempfile::tempdir().unwrap();
    let ready_file = directory.path().join("levee.ready");
    let mut child = support::levee_command()
        .args([
            "server",
            "--grpc-addr",
            "127.0.0.1:0",
            "--admin-addr",
            "127.0.0.1:0",
        ])
        .arg("--data-dir")
        .arg(directory.path().join("data"))
        .arg("--ready-file")
        .arg(&ready_file)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    support::wait_for("the ready file", Duration::from_secs(30), || {
        ready_file.exists()
    });
    let facts: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&ready_file).unwrap()).unwrap();
    assert_eq!(facts["pid"], child.id());
    let admin_addr: std::net::SocketAddr = facts["admin_addr"].as_str().unwrap().parse().unwrap();
    assert_eq!(http_get(admin_addr, "/readyz"), (200, "ready\n".to_owned()));
    let grpc_addr = facts["grpc_addr"].as_str().unwrap().to_owned();
    runtime().block_on(async {
        let client = Client::connect(&grpc_addr).await.unwrap();
        assert_eq!(client.health("").await.unwrap(), HealthStatus::Serving);
    });
    // A graceful shutdown removes it: a waiting script never reads a stale one.
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(child.wait().unwrap().success());
    assert!(!ready_file.exists());
}

#[test]
fn given_a_data_dir_of_node_1_then_it_will_not_start_as_node_2() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    let mut server = LeveeProcess::start_in(&data_dir, &[]);
    let (_, body) = http_get(server.admin_addr, "/v1/server");
    let facts: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(facts["node_id"], 1);
    let cluster_id = facts["cluster_id"].as_str().unwrap().to_owned();
    assert_eq!(cluster_id.len(), 32);
    server.signal("TERM");
    assert_eq!(server.wait_exit(Duration::from_secs(10)).code(), Some(0));

    let data_dir_text = data_dir.to_str().unwrap();
    let (code, _, stderr) = run_to_exit(
        &[
            "server",
            "--grpc-addr",
            "127.0.0.1:0",
            "--admin-addr",
            "127.0.0.1:0",
            "--data-dir",
            data_dir_text,
            "--node-id",
            "2",
        ],
        &[],
    );
    assert_eq!(code, Some(2), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("belongs to node 1")
            && stderr.contains(&cluster_id)
            && stderr.contains("--node-id 1"),
        "{stderr}"
    );
}

#[test]
fn given_a_lone_server_then_it_fixes_the_default_shards_all_on_itself() {
    let server = LeveeProcess::start(&[]);
    let view = || {
        let (code, stdout, stderr) = server.cli(&["cluster", "status"]);
        assert_eq!(code, Some(0), "{stderr}");
        serde_json::from_str::<serde_json::Value>(&stdout).unwrap()
    };
    support::wait_for("the shards fixed", Duration::from_secs(10), || {
        view()["shards"] == 16
    });
    let map = view()["shard_map"].clone();
    assert_eq!(map.as_array().unwrap().len(), 16);
    assert!(
        map.as_array()
            .unwrap()
            .iter()
            .all(|placement| placement["replicas"] == serde_json::json!([1])),
        "{map}"
    );
    let (status, body) = http_get(server.admin_addr, "/v1/cluster");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"shards\":16"), "{body}");
}
