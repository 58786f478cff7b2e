"""Benchmarks of the Python client: `is_hot` latency and producer throughput against a local
server. Not a test: run it by hand and record what it prints (docs/benchmarks.md).

    LEVEE_BIN=target/release/levee python bench/bench.py [--messages 200000] [--sync always] [--json]

It starts its own server on free loopback ports (or uses --server HOST:PORT) with a fresh data
directory. `is_hot`: the mean over a tight loop (the figure to compare with the target), and
percentiles of single timed calls (which include the timer's own cost, about 50-100 ns).
Producer: messages sent through one batching `Producer` by pipelining (`enqueue`), each
answered once durable under the server's sync policy; messages per second over the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE.parent / "tests")]

import levee  # noqa: E402
from support import LeveeServer  # noqa: E402


def percentile(sorted_values: list, fraction: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


def bench_is_hot(address: str, calls: int, keys_count: int) -> dict:
    app = f"bench-{os.getpid()}"
    keys = [f"item-{number}".encode() for number in range(keys_count)]
    hot = keys[: keys_count // 10]

    async def set_hot() -> None:
        async with await levee.Client.connect(address) as client:
            for key in hot:
                await client.set_hot_key(app, key, 600_000)

    hot_keys: levee.HotKeys = levee.HotKeys.start(levee.HotKeysOptions(app=app, servers=[address]))
    try:
        asyncio.run(set_hot())
        deadline = time.monotonic() + 10
        while not all(hot_keys.is_hot_now(key) for key in hot):
            if time.monotonic() > deadline:
                raise SystemExit("the hot keys never reached the client")
            time.sleep(0.01)
        is_hot = hot_keys.is_hot
        rounds = calls // keys_count
        for key in keys:  # warm up
            is_hot(key)
        started = time.perf_counter()
        hits = 0
        for _ in range(rounds):
            for key in keys:
                if is_hot(key):
                    hits += 1
        elapsed = time.perf_counter() - started
        total = rounds * keys_count
        assert hits == rounds * len(hot), "every hot key answered hot, every other one cold"
        samples = []
        clock = time.perf_counter_ns
        for _ in range(max(1, 200_000 // keys_count)):
            for key in keys:
                before = clock()
                is_hot(key)
                samples.append(clock() - before)
        samples.sort()
        stats = hot_keys.stats()
        return {
            "calls": total,
            "mean_ns": round(elapsed / total * 1e9, 1),
            "calls_per_s": round(total / elapsed),
            "single_call_ns": {
                "p50": percentile(samples, 0.50), "p99": percentile(samples, 0.99),
                "p999": percentile(samples, 0.999), "max": samples[-1],
            },
            "keys_unsent": stats.keys_unsent,
            "accesses_dropped": stats.accesses_dropped,
        }
    finally:
        hot_keys.close()


async def bench_producer(address: str, messages: int, payload_bytes: int, queues: int,
                         idempotent: bool) -> dict:
    payload = b"x" * payload_bytes
    names = [f"bench-{os.getpid()}-{queues}-{idempotent}-{n}".encode() for n in range(queues)]
    async with await levee.Client.connect(address) as client:
        producer = levee.Producer(client, levee.ProducerOptions(idempotent=idempotent))
        started = time.perf_counter()
        cpu_started = time.process_time()
        futures = [await producer.enqueue(names[n % queues], payload) for n in range(messages)]
        offsets = await asyncio.gather(*futures)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
        await producer.close()
        stats = producer.stats()
        assert len(offsets) == messages and stats.messages_failed == 0
        total = sum([(await client.queue_info(name)).next_offset for name in names])
        assert total == messages, f"stored {total} of {messages}"
        return {
            "messages": messages, "payload_bytes": payload_bytes, "queues": queues,
            "idempotent": idempotent, "seconds": round(elapsed, 3),
            "messages_per_s": round(messages / elapsed), "batches": stats.batches_sent,
            "retries": stats.retries,
            "client_cpu_us_per_message": round(cpu / messages * 1e6, 2),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", help="use this server (HOST:PORT) instead of starting one")
    parser.add_argument("--sync", default="always", help="--queue-sync of the started server")
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--payload-bytes", type=int, default=100)
    parser.add_argument("--is-hot-calls", type=int, default=2_000_000)
    parser.add_argument("--json", action="store_true")
    arguments = parser.parse_args()
    server = None
    address = arguments.server
    if address is None:
        server = LeveeServer(extra=["--queue-sync", arguments.sync]).start()
        address = server.grpc_addr
    try:
        result = {
            "python": platform.python_version(), "cpus": os.cpu_count(), "sync": arguments.sync,
            "is_hot": bench_is_hot(address, arguments.is_hot_calls, 10_000),
            "producer": [
                asyncio.run(bench_producer(address, arguments.messages, arguments.payload_bytes, 1, False)),
                asyncio.run(bench_producer(address, arguments.messages, arguments.payload_bytes, 100, False)),
                asyncio.run(bench_producer(address, arguments.messages, arguments.payload_bytes, 1, True)),
            ],
        }
    finally:
        if server is not None:
            server.cleanup()
    if arguments.json:
        print(json.dumps(result, indent=2))
        return
    hot = result["is_hot"]
    print(f"is_hot: mean {hot['mean_ns']} ns over {hot['calls']:,} calls "
          f"({hot['calls_per_s']:,}/s); single calls p50/p99/p999/max "
          f"{hot['single_call_ns']['p50']}/{hot['single_call_ns']['p99']}/"
          f"{hot['single_call_ns']['p999']}/{hot['single_call_ns']['max']} ns (timer included)")
    for run in result["producer"]:
        print(f"producer: {run['messages_per_s']:,} msg/s ({run['messages']:,} x {run['payload_bytes']} B "
              f"to {run['queues']} queue(s), idempotent={run['idempotent']}, sync={arguments.sync}, "
              f"{run['batches']} batches, {run['retries']} retries, "
              f"client CPU {run['client_cpu_us_per_message']} us/message)")


if __name__ == "__main__":
    main()
