//! `levee bench store` end to end at a tiny scale: the JSON report and its flags.

use std::process::Command;

fn bench_store(directory: &std::path::Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_levee"))
        .args(["bench", "store", "--queues", "50", "--messages", "2000"])
        .args(["--threads", "2", "--json", "--dir"])
        .arg(directory)
        .args(extra)
        .output()
        .expect("the levee binary runs")
}

#[test]
fn given_interval_flags_then_the_report_counts_every_message_and_the_store_rounds() {
    let directory = tempfile::tempdir().unwrap();
    let output = bench_store(
        directory.path(),
        &[
            "--sync",
            "interval",
            "--interval-ms",
            "5",
            "--buffer-budget-mb",
            "8",
        ],
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["messages"], 2000);
    // 10 messages from every one of the 50 queues, each read back and compared.
    assert_eq!(report["random_check_messages"], 500);
    // The random check ran right after the put too, and the store's files were read once.
    assert!(
        report["random_check_after_put_gets_per_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(
        report["page_cache_fill_bytes"].as_u64().unwrap() >= 2000 * 58,
        "{report}"
    );
    assert_eq!(report["direct_writes"], true);
    let buffered = report["raw_disk_write_buffered_mb_per_s"].as_f64().unwrap();
    let best = report["raw_disk_write_mb_per_s"].as_f64().unwrap();
    assert!(buffered > 0.0 && best >= buffered, "{report}");
    let stats = &report["store_stats"];
    assert_eq!(stats["buffer_budget_bytes"], 8 << 20);
    assert!(stats["commit_rounds"].as_u64().unwrap() >= 1, "{stats}");
    assert!(
        stats["bytes_written"].as_u64().unwrap() >= 2000 * 58,
        "{stats}"
    );
    let recovery = &report["recovery"];
    assert!(recovery["segments"].as_u64().unwrap() >= 1, "{recovery}");
    assert!(recovery["records"].as_u64().unwrap() >= 1, "{recovery}");
    assert!(
        recovery["bytes_scanned"].as_u64().unwrap() > 0,
        "{recovery}"
    );
}

#[test]
fn given_an_interval_or_budget_the_store_refuses_then_the_bench_names_the_flag() {
    let directory = tempfile::tempdir().unwrap();
    for flags in [["--interval-ms", "0"], ["--buffer-budget-mb", "0"]] {
        let mut args = vec!["--sync", "interval"];
        args.extend(flags);
        let output = bench_store(directory.path(), &args);
        assert!(!output.status.success(), "{flags:?} was accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("--buffer-budget-mb and --interval-ms"),
            "{flags:?}: {stderr}"
        );
    }
}

#[test]
fn given_a_dir_that_does_not_exist_then_the_bench_makes_it() {
    let directory = tempfile::tempdir().unwrap();
    let missing = directory.path().join("not").join("yet");
    let output = bench_store(&missing, &["--sync", "interval"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(missing.is_dir());
}
