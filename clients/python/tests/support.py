"""Starts the real `levee` binary on free loopback ports, as the Rust integration tests do
(crates/levee/tests/support/mod.rs): `--grpc-addr 127.0.0.1:0`, JSON logs on stderr, and the
"levee server ready" line tells the bound addresses."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from typing import Deque, List, Optional

READY_TIMEOUT_S = 30.0
LOG_LINES_KEPT = 200


def levee_bin() -> str:
    """LEVEE_BIN, else $CARGO_TARGET_DIR/debug/levee, else target/debug/levee."""
    repo = pathlib.Path(__file__).resolve().parents[3]
    candidates = [os.environ.get("LEVEE_BIN", "")]
    if os.environ.get("CARGO_TARGET_DIR"):
        candidates.append(os.path.join(os.environ["CARGO_TARGET_DIR"], "debug", "levee"))
    candidates.append(str(repo / "target" / "debug" / "levee"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError("no levee binary: set LEVEE_BIN or build target/debug/levee")


class LeveeServer:
    """A running `levee server` child process."""

    def __init__(self, data_dir: Optional[str] = None, extra: Optional[List[str]] = None) -> None:
        self._temporary = None if data_dir else tempfile.mkdtemp(prefix="levee-py-")
        self.data_dir = data_dir or os.path.join(self._temporary, "data")  # type: ignore[arg-type]
        self.extra = list(extra or [])
        self.logs: Deque[str] = deque(maxlen=LOG_LINES_KEPT)
        self.process: Optional[subprocess.Popen] = None
        self.grpc_addr = ""
        self.admin_addr = ""
        self.peer_addr = ""
        self._started = False

    def start(self, grpc_addr: str = "127.0.0.1:0") -> "LeveeServer":
        """Starts the server (again, on a stopped one). A first start that fails removes the
        temporary directory: no caller holds the server to `cleanup` it."""
        try:
            self._start(grpc_addr)
        except BaseException:
            if not self._started:
                self.cleanup()
            raise
        self._started = True
        return self

    def _start(self, grpc_addr: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                self._try_start(grpc_addr)
                return
            except RuntimeError:
                # A fixed address freed a moment ago may still be held: try again.
                if grpc_addr.endswith(":0") or time.monotonic() > deadline:
                    raise
                if not any("already in use" in line for line in self.logs):
                    raise
                time.sleep(0.1)

    def _try_start(self, grpc_addr: str) -> None:
        environment = {k: v for k, v in os.environ.items() if not k.startswith("LEVEE_")}
        self.process = subprocess.Popen(
            [levee_bin(), "server", "--grpc-addr", grpc_addr, "--admin-addr", "127.0.0.1:0",
             "--data-dir", self.data_dir, "--log-format", "json", *self.extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            env=environment, text=True,
        )
        ready = threading.Event()

        def read_logs(stream) -> None:  # type: ignore[no-untyped-def]
            for line in stream:
                self.logs.append(line.rstrip("\n"))
                if not ready.is_set():
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if event.get("message") == "levee server ready":
                        self.grpc_addr = event["grpc_addr"]
                        self.admin_addr = event["admin_addr"]
                        self.peer_addr = event.get("peer_addr", "")
                        ready.set()

        threading.Thread(target=read_logs, args=(self.process.stderr,), daemon=True).start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.wait(0.05):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                self.process.wait()
                raise RuntimeError("server did not become ready; logs:\n" + "\n".join(self.logs))

    def stop(self, kill: bool = False) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def restart(self) -> None:
        """Stops the server and starts it again on the same address and data dir."""
        address = self.grpc_addr
        self.stop()
        self.start(address)

    def cleanup(self) -> None:
        self.stop(kill=True)
        if self._temporary:
            shutil.rmtree(self._temporary, ignore_errors=True)


def start_replicated_cluster(nodes: int = 3, shards: int = 4) -> List[LeveeServer]:
    """Nodes 1..`nodes` of a new cluster that replicates its plain queues over `shards` shards
    (node 1 creates it, the others join it), as crates/levee/tests/replicated.rs starts one.
    On a failure every node started is stopped."""
    flags = ["--peer-addr", "127.0.0.1:0", "--shards", str(shards), "--replicated-queues", "true"]
    started: List[LeveeServer] = []
    try:
        started.append(LeveeServer(extra=["--node-id", "1", *flags]).start())
        for node_id in range(2, nodes + 1):
            started.append(LeveeServer(extra=[
                "--node-id", str(node_id), *flags, "--join", started[0].peer_addr,
            ]).start())
    except BaseException:
        for server in started:
            server.cleanup()
        raise
    return started
