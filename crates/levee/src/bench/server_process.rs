//! A `levee server` child process for the load tools: started on free loopback ports with a
//! temporary data dir, stopped with SIGTERM when dropped.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// How long the child may take to become ready.
const SERVER_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A server the load tool started.
#[derive(Debug)]
pub struct ServerProcess {
    child: Child,
    /// Its gRPC address.
    pub grpc_addr: String,
    /// The temporary data dir, removed when the server is dropped (none when the caller owns it).
    temporary_dir: Option<tempfile::TempDir>,
}

impl ServerProcess {
    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The server's peak resident memory so far, in bytes (0 if unknown).
    pub fn peak_rss_bytes(&self) -> u64 {
        super::peak_rss_bytes(&self.child.id().to_string())
    }

    /// Starts `levee server` (this same binary) on free loopback ports and a temporary data
    /// dir, with `extra` flags.
    pub fn start(extra: &[&str]) -> anyhow::Result<Self> {
        let data_dir = tempfile::tempdir().context("creating a temporary data dir")?;
        let mut server = Self::start_in(
            data_dir.path(),
            &[
                &["--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"],
                extra,
            ]
            .concat(),
        )?;
        server.temporary_dir = Some(data_dir);
        Ok(server)
    }

    /// Starts `levee server` on `data_dir` (kept when the server stops) with `flags`.
    pub fn start_in(data_dir: &std::path::Path, flags: &[&str]) -> anyhow::Result<Self> {
        let executable = std::env::current_exe().context("finding the levee binary")?;
        let mut child = Command::new(executable)
            .arg("server")
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--log-format", "json"])
            // The server's own default level unless asked for another.
            .args(
                std::env::var("LEVEE_BENCH_SERVER_LOG_LEVEL")
                    .ok()
                    .map(|level| ["--log-level".to_owned(), level])
                    .into_iter()
                    .flatten(),
            )
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting levee server")?;
        let stderr = child
            .stderr
            .take()
            .context("capturing the server's stderr")?;
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let _ = sender.send(line);
            }
        });
        let deadline = Instant::now() + SERVER_READY_TIMEOUT;
        let mut last_error = String::new();
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = lines.recv_timeout(remaining) else {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "the levee server did not become ready within {SERVER_READY_TIMEOUT:?} \
                     (last error: {last_error})"
                );
            };
            let Ok(event) = serde_json::from_str::<serde_json::Value>(&line) else {
                last_error = line;
                continue;
            };
            if event["level"] == "ERROR" {
                last_error = event["message"].to_string();
            }
            if event["message"] == "levee server ready" {
                let grpc_addr = event["grpc_addr"].as_str().unwrap_or_default().to_owned();
                // Keep draining the server's logs so that it never blocks on a full pipe; kept
                // in LEVEE_BENCH_SERVER_LOGS/server-<pid>.log when that names a directory.
                let kept = std::env::var_os("LEVEE_BENCH_SERVER_LOGS").and_then(|directory| {
                    let path =
                        std::path::Path::new(&directory).join(format!("server-{}.log", child.id()));
                    std::fs::File::create(path).ok()
                });
                std::thread::spawn(move || {
                    let mut kept = kept.map(std::io::BufWriter::new);
                    while let Ok(line) = lines.recv() {
                        if let Some(file) = &mut kept {
                            let _ = std::io::Write::write_all(file, line.as_bytes());
                            let _ = std::io::Write::write_all(file, b"\n");
                            let _ = std::io::Write::flush(file);
                        }
                    }
                });
                return Ok(Self {
                    child,
                    grpc_addr,
                    temporary_dir: None,
                });
            }
        }
    }

    /// The server at `given`, or a server started with `flags` (kept alive by the returned
    /// handle): its gRPC address either way.
    pub fn given_or_started(
        given: Option<&String>,
        flags: &[&str],
    ) -> anyhow::Result<(String, Option<Self>)> {
        if let Some(address) = given {
            return Ok((address.clone(), None));
        }
        let server = Self::start(flags)?;
        Ok((server.grpc_addr.clone(), Some(server)))
    }

    /// Kills the server with SIGKILL (no shutdown, as a crash) and reaps it.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let stopped = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .is_ok_and(|status| status.success());
        let deadline = Instant::now() + Duration::from_secs(15);
        while stopped && Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
