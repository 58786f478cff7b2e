//! Hot keys against the real server process: detection and push to several app servers, cool
//! events, manual hot keys, snapshots on (re)connect, rules that survive a restart, routing over
//! two servers, the JSON admin API, and bad input.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use levee_client::{
    Client, ErrorCode, HotKeyChange, HotKeyRule, HotKeys, HotKeysOptions, MatchKind,
};
use support::{LeveeProcess, http_get, http_request, runtime, wait_for};

const APP: &str = "shop";
const WAIT: Duration = Duration::from_secs(10);

fn prefix_rule(prefix: &str, window_ms: u32, threshold: u64, hot_duration_ms: u64) -> HotKeyRule {
    HotKeyRule {
        match_kind: MatchKind::Prefix as i32,
        key: prefix.as_bytes().to_vec(),
        window_ms,
        threshold,
        hot_duration_ms,
        description: "test".to_owned(),
    }
}

fn options(servers: Vec<String>) -> HotKeysOptions {
    let mut options = HotKeysOptions::new(APP, servers);
    options.report_interval = Duration::from_millis(10);
    options.reconnect_backoff_min = Duration::from_millis(20);
    options.reconnect_backoff_max = Duration::from_millis(200);
    options
}

fn start_client(server: &LeveeProcess) -> HotKeys {
    HotKeys::start(options(vec![server.grpc()])).unwrap()
}

fn set_rules(runtime: &tokio::runtime::Runtime, server: &LeveeProcess, rules: Vec<HotKeyRule>) {
    runtime.block_on(async {
        Client::connect(&server.grpc())
            .await
            .unwrap()
            .set_hot_key_rules(APP, rules)
            .await
            .unwrap();
    });
}

fn connected(clients: &[HotKeys], servers: u64) -> bool {
    clients
        .iter()
        .all(|client| client.stats().servers_connected == servers)
}

#[test]
fn given_rule_when_key_crosses_threshold_then_every_app_server_sees_it_hot_then_cool() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    let _entered = runtime.enter();
    set_rules(
        &runtime,
        &server,
        vec![prefix_rule("pin_", 2_000, 20, 1_500)],
    );
    let clients: Vec<HotKeys> = (0..3).map(|_| start_client(&server)).collect();
    let changes: Arc<Mutex<Vec<HotKeyChange>>> = Arc::default();
    let seen = Arc::clone(&changes);
    clients[2].on_change(move |change| seen.lock().unwrap().push(change.clone()));
    wait_for("clients to connect", WAIT, || connected(&clients, 1));

    for _ in 0..25 {
        clients[0].is_hot(b"pin_42");
    }
    for _ in 0..5 {
        clients[1].is_hot(b"pin_7");
    }
    wait_for("pin_42 hot on every app server", WAIT, || {
        clients.iter().all(|client| client.is_hot_now(b"pin_42"))
    });
    assert!(
        clients.iter().all(|client| !client.is_hot_now(b"pin_7")),
        "5 hits < threshold 20"
    );

    // The hot duration ends: a cool event reaches every app server.
    wait_for("pin_42 cool again", WAIT, || {
        clients.iter().all(|client| !client.is_hot_now(b"pin_42"))
    });
    wait_for("the cool callback", WAIT, || {
        changes
            .lock()
            .unwrap()
            .iter()
            .any(|change| change.key == b"pin_42" && !change.hot)
    });
    let changes = changes.lock().unwrap();
    let hot = changes
        .iter()
        .find(|change| change.key == b"pin_42" && change.hot)
        .unwrap();
    assert!(!hot.manual);
    assert!(hot.hot_for <= Duration::from_millis(1_500));

    let (status, metrics) = http_get(server.admin_addr, "/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("levee_hotkey_hot_detected_total{app=\"shop\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("levee_hotkey_clients_connected{app=\"shop\"} 3"),
        "{metrics}"
    );
}

#[test]
fn given_manual_hot_key_then_pushed_cached_and_removed_by_hand() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    let _entered = runtime.enter();
    let admin = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    let clients: Vec<HotKeys> = (0..2).map(|_| start_client(&server)).collect();
    wait_for("clients to connect", WAIT, || connected(&clients, 1));

    runtime
        .block_on(admin.set_hot_key(APP, b"sku-1", Duration::from_secs(60)))
        .unwrap();
    wait_for("sku-1 hot everywhere", WAIT, || {
        clients.iter().all(|client| client.is_hot_now(b"sku-1"))
    });
    // The local cache holds values of hot keys only, and one loader runs for many callers.
    assert!(clients[0].set(b"sku-1", b"cached".to_vec()));
    assert_eq!(clients[0].get(b"sku-1").unwrap(), b"cached");
    assert!(!clients[0].set(b"sku-2", b"cold".to_vec()));
    let loads = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let values = runtime.block_on(async {
        // Spawned all at once (collected), so the loads really overlap.
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let (client, loads) = (clients[1].clone(), Arc::clone(&loads));
                tokio::spawn(async move {
                    client
                        .get_or_load(b"sku-1", || async move {
                            loads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            Ok::<_, std::convert::Infallible>(b"loaded".to_vec())
                        })
                        .await
                })
            })
            .collect();
        futures_join(calls.into_iter()).await
    });
    assert!(values.iter().all(|value| value == b"loaded"));
    assert_eq!(
        loads.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "single flight"
    );

    let hot = runtime.block_on(admin.hot_keys(APP)).unwrap();
    assert_eq!(hot.len(), 1);
    assert!(
        runtime
            .block_on(admin.remove_hot_key(APP, b"sku-1"))
            .unwrap()
    );
    wait_for("sku-1 cool everywhere", WAIT, || {
        clients.iter().all(|client| !client.is_hot_now(b"sku-1"))
    });
    assert!(
        clients[0].get(b"sku-1").is_none(),
        "a cooled key's value is gone"
    );
    assert!(
        !runtime
            .block_on(admin.remove_hot_key(APP, b"sku-1"))
            .unwrap()
    );
}

async fn futures_join<T: Send + 'static>(
    handles: impl Iterator<Item = tokio::task::JoinHandle<Result<T, std::convert::Infallible>>>,
) -> Vec<T> {
    let mut values = Vec::new();
    for handle in handles {
        values.push(handle.await.unwrap().unwrap());
    }
    values
}

#[test]
fn given_hot_keys_when_app_server_connects_or_reconnects_then_snapshot_replaces_its_view() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    let mut server = LeveeProcess::start_in(&data_dir, &[]);
    let address = server.grpc();
    let runtime = runtime();
    let _entered = runtime.enter();
    let admin = runtime.block_on(Client::connect(&address)).unwrap();
    runtime
        .block_on(admin.set_hot_key(APP, b"before", Duration::from_secs(60)))
        .unwrap();

    // A late joiner gets the hot key from the snapshot.
    let client = start_client(&server);
    wait_for("snapshot on connect", WAIT, || client.is_hot_now(b"before"));

    // Another server with no hot keys (an empty data dir: manual hot keys are kept across
    // restarts) takes the address: the new session's snapshot drops the stale key.
    server.signal("TERM");
    assert_eq!(server.wait_exit(WAIT).code(), Some(0));
    let server = LeveeProcess::start_at(&address, &directory.path().join("other"), &[]);
    wait_for("reconnect", WAIT, || client.stats().sessions_opened >= 2);
    wait_for("stale key dropped", WAIT, || !client.is_hot_now(b"before"));
    let admin = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    runtime
        .block_on(admin.set_hot_key(APP, b"after", Duration::from_secs(60)))
        .unwrap();
    wait_for("events after reconnect", WAIT, || {
        client.is_hot_now(b"after")
    });
}

#[test]
fn given_the_rules_file_of_an_older_version_then_it_is_imported_once_and_removed() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    std::fs::create_dir_all(&data_dir).unwrap();
    let file = data_dir.join("hotkey-rules.json");
    std::fs::write(
        &file,
        r#"{"format_version": 1, "apps": {"shop": [{"match": "prefix", "key": "sku-",
            "window_ms": 1000, "threshold": 5, "hot_duration_ms": 2000, "description": "old"}]}}"#,
    )
    .unwrap();
    let server = LeveeProcess::start_in(&data_dir, &[]);
    let runtime = runtime();
    let rules = runtime.block_on(async {
        let admin = Client::connect(&server.grpc()).await.unwrap();
        admin.hot_key_rules("shop").await.unwrap()
    });
    assert_eq!(
        rules,
        [prefix_rule("sku-", 1_000, 5, 2_000)].map(|mut rule| {
            rule.description = "old".to_owned();
            rule
        })
    );
    assert!(!file.exists(), "the file is removed once imported");
}

#[test]
fn given_rules_when_server_restarts_then_rules_are_kept() {
    let directory = tempfile::tempdir().unwrap();
    let data_dir = directory.path().join("data");
    let mut server = LeveeProcess::start_in(&data_dir, &[]);
    let runtime = runtime();
    let rules = vec![
        prefix_rule("pin_", 2_000, 20, 30_000),
        prefix_rule("api/", 100, 5, 1_000),
    ];
    set_rules(&runtime, &server, rules.clone());
    runtime.block_on(async {
        let admin = Client::connect(&server.grpc()).await.unwrap();
        admin
            .set_hot_key(APP, b"pinned", Duration::from_secs(600))
            .await
            .unwrap();
    });
    server.signal("TERM");
    assert_eq!(server.wait_exit(WAIT).code(), Some(0));

    // Rules and keys set hot by hand are kept (the metadata log); their expiry too.
    let server = LeveeProcess::start_in(&data_dir, &[]);
    let (kept, hot) = runtime.block_on(async {
        let admin = Client::connect(&server.grpc()).await.unwrap();
        (
            admin.hot_key_rules(APP).await.unwrap(),
            admin.hot_keys(APP).await.unwrap(),
        )
    });
    assert_eq!(kept, rules);
    assert_eq!(hot.len(), 1, "{hot:?}");
    assert_eq!(hot[0].key, b"pinned");
    assert!(
        hot[0].hot_for_ms <= 600_000 && hot[0].hot_for_ms > 500_000,
        "{hot:?}"
    );
}

#[test]
fn given_two_servers_when_one_stops_then_its_keys_move_to_the_other() {
    let first = LeveeProcess::start(&[]);
    let mut second = LeveeProcess::start(&[]);
    let runtime = runtime();
    let _entered = runtime.enter();
    for server in [&first, &second] {
        set_rules(
            &runtime,
            server,
            vec![prefix_rule("pin_", 2_000, 10, 30_000)],
        );
    }
    // Two lone servers, not one cluster: the clients take the list as given.
    let fixed = || {
        let mut options = options(vec![first.grpc(), second.grpc()]);
        options.follow_cluster = false;
        options
    };
    let client: HotKeys = HotKeys::start(fixed()).unwrap();
    let watcher: HotKeys = HotKeys::start(fixed()).unwrap();
    wait_for("both sessions", WAIT, || {
        connected(&[client.clone(), watcher.clone()], 2)
    });

    let keys: Vec<String> = (0..64).map(|index| format!("pin_{index}")).collect();
    let on_second: Vec<&String> = keys
        .iter()
        .filter(|key| client.server_of(key.as_bytes()) == 1)
        .collect();
    let on_first: Vec<&String> = keys
        .iter()
        .filter(|key| client.server_of(key.as_bytes()) == 0)
        .collect();
    assert!(
        !on_second.is_empty() && !on_first.is_empty(),
        "64 keys spread over both"
    );

    // A key owned by the second server is counted there, and pushed to every app server.
    let key = on_second[0].as_bytes();
    client.record(key, 10);
    wait_for("hot via the second server", WAIT, || {
        watcher.is_hot_now(key)
    });
    let hot_on = |server: &LeveeProcess, key: &[u8]| {
        runtime.block_on(async {
            let admin = Client::connect(&server.grpc()).await.unwrap();
            admin
                .hot_keys(APP)
                .await
                .unwrap()
                .iter()
                .any(|event| event.key == key)
        })
    };
    assert!(hot_on(&second, key) && !hot_on(&first, key));

    // The second server stops: its share moves to the first, which now detects such keys.
    second.signal("TERM");
    assert_eq!(second.wait_exit(WAIT).code(), Some(0));
    wait_for("one server left", WAIT, || {
        client.stats().servers_connected == 1
    });
    let moved = on_second[1].as_bytes();
    client.record(moved, 10);
    wait_for("hot via the first server", WAIT, || {
        watcher.is_hot_now(moved)
    });
    assert!(hot_on(&first, moved));
}

#[test]
fn given_json_admin_api_then_rules_hot_keys_top_and_stats_work() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    let _entered = runtime.enter();
    // Keys reach an exact window (and top-K) at threshold / 8 hits: 12 here.
    let rules = r#"[{"match":"prefix","key":"pin_","window_ms":5000,"threshold":100,"hot_duration_ms":1000},
                    {"match":"default","window_ms":5000,"threshold":1000000,"hot_duration_ms":1000}]"#;
    let (status, body) = http_request(
        server.admin_addr,
        "PUT",
        "/v1/hotkeys/apps/shop/rules",
        rules,
    );
    assert_eq!(status, 200, "{body}");
    let (status, body) = http_request(
        server.admin_addr,
        "PUT",
        "/v1/hotkeys/apps/shop/rules",
        r#"[{"match":"prefix","key":"x","window_ms":5,"threshold":1,"hot_duration_ms":1}]"#,
    );
    assert_eq!(status, 400);
    assert!(
        body.contains("window_ms"),
        "the error names the field: {body}"
    );

    let client = start_client(&server);
    wait_for("client connected", WAIT, || {
        client.stats().servers_connected == 1
    });
    client.record(b"pin_1", 30);
    client.record(b"pin_2", 20);
    client.record(b"other", 10);
    wait_for("top keys", WAIT, || {
        let (_, body) = http_get(server.admin_addr, "/v1/hotkeys/apps/shop/top?limit=2");
        body.contains("\"pin_1\"") && body.contains("\"pin_2\"")
    });
    let (_, body) = http_get(server.admin_addr, "/v1/hotkeys/apps/shop/top?limit=2");
    let top: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(top["keys"][0]["key"], "pin_1");
    assert_eq!(top["keys"][0]["count"], 30);
    assert_eq!(top["keys"].as_array().unwrap().len(), 2);

    let (status, _) = http_request(
        server.admin_addr,
        "POST",
        "/v1/hotkeys/apps/shop/hot",
        r#"{"key":"flash-sale","duration_ms":60000}"#,
    );
    assert_eq!(status, 200);
    wait_for("manual key pushed", WAIT, || {
        client.is_hot_now(b"flash-sale")
    });
    let (_, body) = http_get(server.admin_addr, "/v1/hotkeys/apps/shop/hot");
    assert!(
        body.contains("\"flash-sale\"") && body.contains("\"manual\""),
        "{body}"
    );
    let (_, body) = http_request(
        server.admin_addr,
        "DELETE",
        "/v1/hotkeys/apps/shop/hot?key=flash-sale",
        "",
    );
    assert!(body.contains("\"was_hot\":true"), "{body}");

    let (status, body) = http_get(server.admin_addr, "/v1/hotkeys/apps/shop/stats");
    assert_eq!(status, 200);
    let counters: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(counters["hits_received"], 60);
    assert_eq!(counters["clients_connected"], 1);
    let (status, body) = http_get(server.admin_addr, "/v1/hotkeys/apps/nope/stats");
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("\"reason\":\"NOT_FOUND\""), "{body}");
}

#[test]
fn given_bad_reports_then_they_are_refused_and_counted() {
    let server = LeveeProcess::start(&[
        "--hotkey-batch-keys-max",
        "50",
        "--hotkey-key-bytes-max",
        "64",
    ]);
    let runtime = runtime();
    let _entered = runtime.enter();
    let client = start_client(&server);
    wait_for("client connected", WAIT, || {
        client.stats().servers_connected == 1
    });
    client.record(&[b'x'; 65], 1);
    client.record(b"fine", 1);
    wait_for("too-long key counted", WAIT, || {
        http_get(server.admin_addr, "/metrics")
            .1
            .contains("levee_hotkey_reports_rejected_total{reason=\"key_too_long\"} 1")
    });
    // A batch above the server's maximum ends the session; the client reconnects. (A flush
    // may split one round of 60 keys, so rounds repeat until one goes whole.)
    wait_for("oversize batch counted", WAIT, || {
        for index in 0..60 {
            client.record(format!("key-{index}").as_bytes(), 1);
        }
        std::thread::sleep(Duration::from_millis(30));
        http_get(server.admin_addr, "/metrics")
            .1
            .contains("levee_hotkey_reports_rejected_total{reason=\"batch_too_large\"}")
    });
    wait_for("reconnected", WAIT, || client.stats().sessions_opened >= 2);
}

#[test]
fn given_refuse_policy_then_unknown_app_is_refused_until_its_rules_exist() {
    let server = LeveeProcess::start(&["--hotkey-unknown-app", "refuse"]);
    let runtime = runtime();
    let _entered = runtime.enter();
    let admin = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    let error = runtime.block_on(admin.hot_key_rules(APP)).unwrap_err();
    assert_eq!(error.code(), Some(ErrorCode::NotFound));
    // A key set by hand for the unknown app is refused the same way a session is.
    let error = runtime
        .block_on(admin.set_hot_key(APP, b"sku-1", Duration::from_secs(60)))
        .unwrap_err();
    assert_eq!(error.code(), Some(ErrorCode::NotFound), "{error}");
    let client = start_client(&server);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        client.stats().sessions_opened,
        0,
        "sessions for an unknown app are refused"
    );
    set_rules(
        &runtime,
        &server,
        vec![prefix_rule("pin_", 2_000, 20, 1_000)],
    );
    wait_for("session once the app exists", WAIT, || {
        client.stats().sessions_opened >= 1
    });
}

#[test]
fn given_a_rule_with_a_key_too_long_then_the_error_names_it_without_sending_it_back_whole() {
    let server = LeveeProcess::start(&[]);
    let runtime = runtime();
    let admin = runtime.block_on(Client::connect(&server.grpc())).unwrap();
    let mut rule = prefix_rule("", 1_000, 10, 1_000);
    rule.match_kind = MatchKind::Exact as i32;
    rule.key = vec![b'k'; 1_025];
    let error = runtime
        .block_on(admin.set_hot_key_rules(APP, vec![rule]))
        .unwrap_err();
    assert_eq!(error.code(), Some(ErrorCode::InvalidArgument), "{error}");
    let message = error.to_string();
    assert!(message.contains("(1025 bytes)"), "{message}");
    assert!(message.len() < 400, "{} bytes: {message}", message.len());
}
