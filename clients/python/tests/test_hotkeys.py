"""HotKeys: is_hot stays local and never raises, bounded buffers count what they drop, the value
cache loads once per hot key, callbacks cannot break a session, reports split by keys and bytes."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import levee
from levee.hotkeys import REPORT_BATCH_BYTES_MAX_DEFAULT, HotKeys, HotKeysOptions, batch_length

from conftest import eventually, run

NOWHERE = "127.0.0.1:1"  # nothing listens there


def options(servers, **overrides) -> HotKeysOptions:  # type: ignore[no-untyped-def]
    settings = dict(app="shop", servers=servers, report_interval_s=0.02,
                    reconnect_backoff_min_s=0.02, reconnect_backoff_max_s=0.2)
    settings.update(overrides)
    return HotKeysOptions(**settings)  # type: ignore[arg-type]


def test_given_reports_then_batches_split_by_keys_and_by_bytes() -> None:
    small = [10] * 10
    assert batch_length(small, 4, 1 << 20) == 4, "by keys"
    assert batch_length(small, 100, 6 + 3 * 24) == 3, "by bytes: 24 each with framing, 6 for the batch"
    assert batch_length(small, 100, 1 << 20) == 10
    large = [1024] * 10_000
    assert batch_length(large, 10_000, REPORT_BATCH_BYTES_MAX_DEFAULT) == (REPORT_BATCH_BYTES_MAX_DEFAULT - 6) // 1038
    assert batch_length([100], 10, 50) == 1, "one key always goes"


def test_given_bad_options_then_errors_name_the_option() -> None:
    with pytest.raises(levee.InvalidArgumentError, match="report_interval must be 1 to 500 ms"):
        HotKeys.start(options([NOWHERE], report_interval_s=0.6))
    with pytest.raises(levee.InvalidArgumentError, match="servers"):
        HotKeys.start(options([]))
    with pytest.raises(levee.InvalidArgumentError, match="app name"):
        HotKeys.start(options([NOWHERE], app="bad app"))


def test_given_no_server_then_is_hot_answers_false_never_raises_and_counts_unsent_keys() -> None:
    hot_keys: HotKeys = HotKeys.start(options([NOWHERE]))
    try:
        started = time.monotonic()
        for value in (b"a", "text", bytearray(b"b"), memoryview(b"c"), b"", None, 42, object()):
            assert hot_keys.is_hot(value) is False  # type: ignore[arg-type]
        assert time.monotonic() - started < 0.5, "is_hot never waits on the network"
        hot_keys.flush()
        stats = hot_keys.stats()
        assert stats.servers_connected == 0
        assert stats.keys_unsent == 4, "a, text, b and c could not be sent"
        assert stats.accesses_dropped == 4, "the empty key and the three values that are no key are dropped and counted"
    finally:
        hot_keys.close()


def test_given_full_buffer_then_new_keys_are_dropped_and_counted_but_known_keys_add_up() -> None:
    hot_keys: HotKeys = HotKeys.start(options([NOWHERE], buffer_keys_max=2, report_interval_s=0.5))
    try:
        hot_keys.record(b"a", 1)
        hot_keys.record(b"b", 1)
        hot_keys.record(b"c", 5)
        hot_keys.record(b"a", 3)
        stats = hot_keys.stats()
        assert (stats.accesses_recorded, stats.accesses_dropped) == (10, 5)
        assert not hot_keys.is_hot(b"a"), "nothing is hot without a server"
    finally:
        hot_keys.close()


@pytest.fixture
def hot_key(server, unique):  # type: ignore[no-untyped-def]
    """A started HotKeys on the shared server and a key of its app set hot by hand."""
    app, key = unique("app"), b"hot-item"

    async def set_hot() -> None:
        async with await levee.Client.connect(server.grpc_addr) as client:
            await client.set_hot_key(app, key, 60_000)

    hot_keys: HotKeys = HotKeys.start(options([server.grpc_addr], app=app))
    run(set_hot())
    deadline = time.monotonic() + 10
    while not hot_keys.is_hot_now(key):
        assert time.monotonic() < deadline, "the manual hot key never arrived"
        time.sleep(0.01)
    yield hot_keys, key
    hot_keys.close()


def test_given_hot_key_then_threads_load_its_value_once_and_cold_keys_always_load(hot_key) -> None:  # type: ignore[no-untyped-def]
    hot_keys, key = hot_key
    calls = []

    def load() -> str:
        calls.append(1)
        time.sleep(0.05)
        return "value"

    results = []
    threads = [threading.Thread(target=lambda: results.append(hot_keys.get_or_load_sync(key, load)))
               for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == ["value"] * 16
    assert len(calls) == 1, "one load for all the callers of a hot key"
    assert hot_keys.get(key) == "value"
    assert hot_keys.get_or_load_sync(key, load) == "value" and len(calls) == 1, "served from the cache"
    for _ in range(3):
        hot_keys.get_or_load_sync(b"cold-key", load)
    assert len(calls) == 4, "cold keys always load"
    assert hot_keys.get(b"cold-key") is None and not hot_keys.set(b"cold-key", "v")


def test_given_hot_key_then_coroutines_load_once_and_a_failed_load_fails_every_waiter(hot_key) -> None:  # type: ignore[no-untyped-def]
    hot_keys, key = hot_key
    calls = []

    async def failing() -> str:
        calls.append("failing")
        await asyncio.sleep(0.05)
        raise RuntimeError("database down")

    async def working() -> str:
        calls.append("working")
        await asyncio.sleep(0.05)
        return "fresh"

    async def main() -> None:
        outcomes = await asyncio.gather(*[hot_keys.get_or_load(key, failing) for _ in range(8)],
                                        return_exceptions=True)
        assert all(isinstance(outcome, RuntimeError) for outcome in outcomes)
        assert calls == ["failing"] and hot_keys.get(key) is None, "nothing cached"
        values = await asyncio.gather(*[hot_keys.get_or_load(key, working) for _ in range(8)])
        assert values == ["fresh"] * 8 and calls == ["failing", "working"]

    run(main())


def test_given_callbacks_then_a_raising_one_is_counted_and_others_still_run(server, unique) -> None:  # type: ignore[no-untyped-def]
    app = unique("callbacks")
    hot_keys: HotKeys = HotKeys.start(options([server.grpc_addr], app=app))
    seen = []

    def broken(change: levee.HotKeyChange) -> None:
        raise ValueError("bug in the application's callback")

    hot_keys.on_change(broken)
    hot_keys.on_change(seen.append)

    async def main() -> None:
        await eventually(lambda: hot_keys.stats().servers_connected == 1)
        async with await levee.Client.connect(server.grpc_addr) as client:
            await client.set_hot_key(app, b"k1", 60_000)
            await eventually(lambda: hot_keys.is_hot_now(b"k1"))
            await client.set_hot_key(app, b"k2", 60_000)
            await eventually(lambda: hot_keys.is_hot_now(b"k2"))
            # Callbacks run on the background thread just after the key turns hot locally.
            await eventually(lambda: len(seen) == 2)

    try:
        run(main())
        stats = hot_keys.stats()
        assert [change.key for change in seen] == [b"k1", b"k2"], (seen, stats)
        assert all(change.hot and change.manual for change in seen), seen
        assert seen[0].hot_for_s > 59, seen
        assert stats.callback_errors == 2, (seen, stats)
        assert hot_keys.hot_keys() == [b"k1", b"k2"]
    finally:
        hot_keys.close()


def test_given_detection_then_reports_are_batched_and_counted(server, unique) -> None:  # type: ignore[no-untyped-def]
    from levee.v1 import hotkey_pb2

    app = unique("batched")
    hot_keys: HotKeys = HotKeys.start(options([server.grpc_addr], app=app, batch_keys_max=10))

    async def main() -> None:
        async with await levee.Client.connect(server.grpc_addr) as client:
            await client.set_hot_key_rules(app, [hotkey_pb2.HotKeyRule(
                match_kind=hotkey_pb2.MATCH_KIND_DEFAULT, window_ms=10_000, threshold=1_000,
                hot_duration_ms=5_000)])
            await eventually(lambda: hot_keys.stats().servers_connected == 1)
            for number in range(95):
                hot_keys.record(f"k{number}", 3)
            hot_keys.flush()
            await eventually(lambda: hot_keys.stats().keys_reported == 95)
            stats = await client.app_stats(app)
            deadline = asyncio.get_running_loop().time() + 5
            while stats.hits_received < 285 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
                stats = await client.app_stats(app)
            assert (stats.hits_received, stats.reports_received) == (285, 95)

    try:
        run(main())
        assert hot_keys.stats().keys_unsent == 0
    finally:
        hot_keys.close()


def test_given_full_server_queue_then_batches_that_do_not_fit_are_counted_as_unsent() -> None:
    hot_keys: HotKeys = HotKeys(options(["127.0.0.1:1", "127.0.0.1:2"], batch_keys_max=1,
                                        batches_queued_per_server_max=1))

    async def main() -> None:
        queues = [asyncio.Queue(1), asyncio.Queue(1)]
        hot_keys._queues = queues  # type: ignore[assignment]  # both servers "connected"
        keys = [b"key-%d" % n for n in range(8)]
        for key in keys:
            hot_keys.record(key, 2)
        await hot_keys._flush_async()
        servers = {hot_keys.server_of(key) for key in keys}
        assert servers == {0, 1}, "the keys spread over both servers"
        stats = hot_keys.stats()
        assert stats.keys_reported == 2, "one batch of one key fits in each server's queue"
        assert (stats.keys_unsent, stats.batches_unsent) == (6, 6)
        for server, queue in enumerate(queues):
            message, count = queue.get_nowait()
            assert count == 1 and hot_keys.server_of(message.report.keys[0].key) == server
            assert message.report.keys[0].count == 2

    run(main())


def test_given_a_three_node_cluster_then_app_servers_seeded_with_one_node_follow_every_member() -> None:
    """Two app servers, each given a different node as its only seed, hold sessions with all
    three nodes, and a key detected hot by whichever node owns it reaches both."""
    from levee.v1 import hotkey_pb2
    from support import LeveeServer

    first = LeveeServer(extra=["--node-id", "1", "--peer-addr", "127.0.0.1:0"]).start()
    nodes = [first]
    try:
        for node_id in ("2", "3"):
            nodes.append(LeveeServer(extra=[
                "--node-id", node_id, "--peer-addr", "127.0.0.1:0", "--join", first.peer_addr,
            ]).start())
        reporter: HotKeys = HotKeys.start(options([nodes[0].grpc_addr], app="cluster-shop"))
        watcher: HotKeys = HotKeys.start(options([nodes[2].grpc_addr], app="cluster-shop"))

        async def main() -> None:
            async with await levee.Client.connect(nodes[1].grpc_addr) as client:
                await client.set_hot_key_rules("cluster-shop", [hotkey_pb2.HotKeyRule(
                    match_kind=hotkey_pb2.MATCH_KIND_PREFIX, key=b"sku-", window_ms=1_000,
                    threshold=50, hot_duration_ms=5_000)])
            await eventually(lambda: reporter.stats().servers_connected == 3
                             and watcher.stats().servers_connected == 3, timeout_s=20)
            keys = [f"sku-{number}".encode() for number in range(8)]
            # Reported again until hot: the rules, set through another node, reach each node
            # within a heartbeat, and a key's owner counts it only once it has them.
            deadline = asyncio.get_running_loop().time() + 10
            while not all(watcher.is_hot_now(key) for key in keys):
                assert asyncio.get_running_loop().time() < deadline, "keys not hot in time"
                for key in keys:
                    reporter.record(key, 60)
                reporter.flush()
                await asyncio.sleep(0.2)

        try:
            run(main())
        finally:
            reporter.close()
            watcher.close()
    finally:
        for node in nodes:
            node.cleanup()
