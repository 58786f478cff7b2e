//! kill -9 of a real writer process: this test runs its own executable again as the writer
//! (selected by an environment variable), reads the writer's acknowledgements from its stdout,
//! kills it with SIGKILL in the middle of appending, reopens the store and checks that every
//! acknowledged message is there at its offset. (The page cache survives a killed process, so
//! this covers process crashes; power loss is covered by the simulated disk.)

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;

use levee_store::{Store, StoreOptions};

const CHILD_DIRECTORY: &str = "LEVEE_STORE_KILL_TEST_DIRECTORY";
const TEST_NAME: &str = "given_writer_killed_with_sigkill_when_reopening_should_keep_acknowledged";
const ACKNOWLEDGED_BEFORE_KILL: usize = 3000;

fn options() -> StoreOptions {
    StoreOptions {
        segment_bytes_max: 64 << 10,
        chunk_bytes: 256,
        ..StoreOptions::default()
    }
}

/// The writer: 4 threads append to 8 queues forever and print `ack QUEUE OFFSET MESSAGE` after
/// each append returns (under sync=always, i.e. after its fsync).
fn writer(directory: &str) -> ! {
    let (store, _) = Store::open(directory, options()).expect("writer opens the store");
    let store = Arc::new(store);
    let threads: Vec<_> = (0..4)
        .map(|thread| {
            let store = store.clone();
            std::thread::spawn(move || {
                for sequence in 0_u64.. {
                    let queue = format!("queue-{}", (sequence + thread) % 8);
                    let message = format!(
                        "t{thread}-s{sequence}-{}",
                        "x".repeat((sequence % 50) as usize)
                    );
                    let offset = store.append(queue.as_bytes(), message.as_bytes()).unwrap();
                    let mut stdout = std::io::stdout().lock();
                    writeln!(stdout, "ack {queue} {offset} {message}").unwrap();
                    stdout.flush().unwrap();
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    unreachable!("the writer runs until killed")
}

#[test]
fn given_writer_killed_with_sigkill_when_reopening_should_keep_acknowledged() {
    if let Ok(directory) = std::env::var(CHILD_DIRECTORY) {
        writer(&directory);
    }
    let directory = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads", "1"])
        .env(CHILD_DIRECTORY, directory.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut acknowledged: HashMap<(String, u64), String> = HashMap::new();
    let stdout = child.stdout.take().unwrap();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        let Some(rest) = line.strip_prefix("ack ") else {
            continue;
        };
        let mut parts = rest.splitn(3, ' ');
        let (Some(queue), Some(offset), Some(message)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        acknowledged.insert(
            (queue.to_string(), offset.parse().unwrap()),
            message.to_string(),
        );
        if acknowledged.len() >= ACKNOWLEDGED_BEFORE_KILL {
            break;
        }
    }
    child.kill().unwrap(); // SIGKILL on Unix
    child.wait().unwrap();
    assert_eq!(
        acknowledged.len(),
        ACKNOWLEDGED_BEFORE_KILL,
        "the writer stopped early"
    );

    let (store, report) = Store::open(directory.path(), options()).unwrap();
    assert!(
        report.segments > 1,
        "the writer rotated segments: {report:?}"
    );
    for ((queue, offset), message) in &acknowledged {
        let batch = store
            .read(queue.as_bytes(), *offset, 1, usize::MAX)
            .unwrap();
        assert_eq!(batch.first_offset, *offset);
        assert_eq!(
            batch.message(0),
            Some(message.as_bytes()),
            "{queue} at {offset}"
        );
    }
    // Offsets stay dense: every queue's messages up to its end can be read back.
    for queue in 0..8 {
        let name = format!("queue-{queue}");
        let info = store.queue_info(name.as_bytes()).unwrap().unwrap();
        let mut offset = 0;
        while offset < info.next_offset {
            let batch = store
                .read(name.as_bytes(), offset, 1000, usize::MAX)
                .unwrap();
            assert!(!batch.is_empty());
            offset = batch.next_offset();
        }
    }
}
