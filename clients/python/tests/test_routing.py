"""Hot-key routing and topic partitioning against the values the Rust code gives
(conformance/vectors/routing-and-partitions.json, printed by conformance/vectors/generate.rs),
and partitioning against the real server's choice."""

from __future__ import annotations

import json
import pathlib

import levee
from levee import routing
from levee.hotkeys import HotKeysOptions

from conftest import run

VECTORS = json.loads(
    (pathlib.Path(__file__).resolve().parents[3] / "conformance" / "vectors"
     / "routing-and-partitions.json").read_text()
)
KEYS = [bytes.fromhex(entry["key_hex"]) for entry in VECTORS["key_hashes"]]


def test_given_rust_vectors_then_every_key_hash_matches_foldhash() -> None:
    lengths = {len(key) for key in KEYS}
    assert {0, 3, 8, 16, 17, 255, 256, 300, 1024} <= lengths, "every branch of the hash is covered"
    for key, entry in zip(KEYS, VECTORS["key_hashes"]):
        assert routing.key_hash(key) == int(entry["hash"], 16), f"key of {len(key)} bytes"


def test_given_rust_vectors_then_xxh3_matches_the_reference_values() -> None:
    for key, entry in zip(KEYS, VECTORS["key_hashes"]):
        assert routing.xxhash.xxh3_64_intdigest(key) == int(entry["xxh3_64"], 16)
    assert routing.xxhash.xxh3_64_intdigest(b"") == 0x2D06800538D394C2
    assert routing.xxhash.xxh3_64_intdigest(b"abc") == 0x78AF5F94892F3950


def test_given_rust_vectors_then_servers_seeds_and_routes_match() -> None:
    for route in VECTORS["routes"]:
        seeds = [routing.server_seed(address) for address in route["servers"]]
        assert seeds == [int(seed, 16) for seed in route["seeds"]]
        assert [routing.rendezvous(routing.key_hash(k), seeds) for k in KEYS] == route["server_of"]
        without_first = [routing.rendezvous(routing.key_hash(k), seeds, lambda i: i != 0) for k in KEYS]
        assert without_first == route["server_of_without_first"]


def test_given_hot_keys_client_then_server_of_follows_the_vectors() -> None:
    route = VECTORS["routes"][3]
    hot_keys = levee.HotKeys(HotKeysOptions(app="shop", servers=route["servers"]))
    assert [hot_keys.server_of(key) for key in KEYS] == route["server_of"]


def test_given_server_removed_then_only_its_keys_move_and_they_spread_over_the_rest() -> None:
    seeds = [routing.server_seed(f"10.0.0.{n}:7070") for n in range(1, 6)]
    moved_to = [0] * 5
    for number in range(5000):
        key_hash = routing.key_hash(f"key-{number}".encode())
        before = routing.rendezvous(key_hash, seeds)
        after = routing.rendezvous(key_hash, seeds, lambda index: index != 2)
        if before == 2:
            assert after != 2
            moved_to[after] += 1  # type: ignore[index]
        else:
            assert before == after, f"key-{number} moved although its server stayed"
    assert all(count > 100 for server, count in enumerate(moved_to) if server != 2)


def test_given_rust_vectors_then_partitions_match() -> None:
    for entry in VECTORS["partitions"]:
        computed = [levee.topic_partition(key, entry["partitions"]) for key in KEYS]
        assert computed == entry["partition_of"], entry["partitions"]


def test_given_many_keys_then_client_partition_equals_the_servers(server, unique) -> None:  # type: ignore[no-untyped-def]
    topic = unique("partitioned")

    async def main() -> None:
        async with await levee.Client.connect(server.grpc_addr) as client:
            for partitions in (7, 64):
                await client.create_topic(f"{topic}-{partitions}", partitions)
                keys = [f"customer-{number}".encode() for number in range(500)] + KEYS
                published = await client.publish(
                    f"{topic}-{partitions}", [(key, b"") for key in keys]
                )
                assert [p.partition for p in published] == [
                    levee.topic_partition(key, partitions) for key in keys
                ]

    run(main())


SHARDS = json.loads(
    (pathlib.Path(__file__).resolve().parents[3] / "conformance" / "vectors"
     / "shards.json").read_text()
)


def test_given_rust_vectors_then_shards_and_their_replicas_match() -> None:
    names = SHARDS["names"]
    for entry in SHARDS["shard_of"]:
        assert [routing.shard_of(name, entry["shards"]) for name in names] == entry["shard_of"]
        as_bytes = [routing.shard_of_bytes(name.encode(), entry["shards"]) for name in names]
        assert as_bytes == entry["shard_of"]
    for entry in SHARDS["replicas"]:
        placed = [routing.shard_replicas(shard, entry["voters"]) for shard in range(16)]
        assert placed == entry["replicas_of_shards_0_to_15"]
