"""Where keys go: hot-key reports by rendezvous hashing over servers, topic keys by XXH3.

Hot-key routing is identical to the Rust client's (crates/levee-client/src/hotkey.rs): a key's
hash and each server address's seed are `foldhash::fast::FixedState::with_seed(HOT_KEY_SEED)
.hash_one(bytes)` (foldhash 0.1.5 on a 64-bit little-endian machine, ported below), and the
key goes to the eligible server with the highest `splitmix64(key_hash ^ seed)`, the first on a
tie. A key therefore reaches the same server from a Rust and a Python app server, so its
counts add up on one server. conformance/vectors/routing-and-partitions.json holds vectors
printed by the Rust code (conformance/vectors/generate.rs); the tests check them.

Topic partitioning is `XXH3_64(key, seed 0) mod partitions` (proto/levee/v1/topic.proto).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import xxhash

MASK64 = (1 << 64) - 1
HOT_KEY_SEED = 0x686F_746B_6579_7321

# foldhash 0.1.5 constants.
_ARBITRARY3 = 0x082EFA98EC4E6C89
_FOLD_SEED = 0x452821E638D01377  # ARBITRARY4: the fixed shared seed's seeds[0]
_EXPAND_SEED = 0xBE5466CF34E90C6C  # ARBITRARY5
_EXPAND_SEED2 = 0xC0AC29B7C97C50DD  # ARBITRARY6
_EXPAND_SEED3 = 0x3F84D5B5B5470917  # ARBITRARY7
_PER_HASHER_SEED = HOT_KEY_SEED ^ _ARBITRARY3


def _folded_multiply(x: int, y: int) -> int:
    full = x * y
    return (full & MASK64) ^ (full >> 64)


def _rotate_right(x: int, r: int) -> int:
    r %= 64
    return ((x >> r) | (x << (64 - r))) & MASK64


def _u64(data: bytes, at: int) -> int:
    return int.from_bytes(data[at : at + 8], "little")


def _hash_medium(data: bytes, s0: int, s1: int, fold_seed: int) -> int:
    length = len(data)
    index = 0
    while index + 16 <= length:
        hi_end = length - index
        if index >= hi_end:
            break
        a = _u64(data, index)
        b = _u64(data, index + 8)
        c = _u64(data, hi_end - 16)
        d = _u64(data, hi_end - 8)
        s0 = _folded_multiply(a ^ s0, c ^ fold_seed)
        s1 = _folded_multiply(b ^ s1, d ^ fold_seed)
        index += 16
    return s0 ^ s1


def _hash_long(data: bytes, s0: int, s1: int, s2: int, s3: int, fold_seed: int) -> int:
    length = len(data)
    chunks = length // 64
    for chunk in range(chunks):
        at = chunk * 64
        s0 = _folded_multiply(_u64(data, at) ^ s0, _u64(data, at + 32) ^ fold_seed)
        s1 = _folded_multiply(_u64(data, at + 8) ^ s1, _u64(data, at + 40) ^ fold_seed)
        s2 = _folded_multiply(_u64(data, at + 16) ^ s2, _u64(data, at + 48) ^ fold_seed)
        s3 = _folded_multiply(_u64(data, at + 24) ^ s3, _u64(data, at + 56) ^ fold_seed)
    s0 ^= s2
    s1 ^= s3
    remainder = length - chunks * 64
    if remainder > 0:
        return _hash_medium(data[length - max(remainder, 16) :], s0, s1, fold_seed)
    return s0 ^ s1


def key_hash(key: bytes) -> int:
    """`FixedState::with_seed(HOT_KEY_SEED).hash_one(key)` of Rust's foldhash 0.1.5: the
    slice's length goes into the sponge (as a usize), then its bytes are hashed."""
    length = len(key)
    accumulator = _PER_HASHER_SEED
    base_seed = _rotate_right(accumulator, length)
    if length <= 16:
        s0 = base_seed
        s1 = _EXPAND_SEED
        if length >= 8:
            s0 ^= _u64(key, 0)
            s1 ^= _u64(key, length - 8)
        elif length >= 4:
            s0 ^= int.from_bytes(key[0:4], "little")
            s1 ^= int.from_bytes(key[length - 4 :], "little")
        elif length > 0:
            s0 ^= key[0]
            s1 ^= (key[length - 1] << 8) | key[length // 2]
        accumulator = _folded_multiply(s0, s1)
    elif length < 256:
        accumulator = _hash_medium(key, base_seed, (base_seed + _EXPAND_SEED) & MASK64, _FOLD_SEED)
    else:
        accumulator = _hash_long(
            key,
            base_seed,
            (base_seed + _EXPAND_SEED) & MASK64,
            (base_seed + _EXPAND_SEED2) & MASK64,
            (base_seed + _EXPAND_SEED3) & MASK64,
            _FOLD_SEED,
        )
    # finish(): the sponge holds the 64-bit length (lo) and nothing above it (hi = 0).
    return _folded_multiply(length ^ accumulator, _FOLD_SEED)


def server_seed(address: str) -> int:
    """A server's rendezvous seed: the hash of its address as given."""
    return key_hash(address.encode("utf-8"))


def _splitmix64(value: int) -> int:
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def rendezvous(
    key_hash_value: int,
    seeds: Sequence[int],
    eligible: Optional[Callable[[int], bool]] = None,
) -> Optional[int]:
    """The index of the eligible seed with the highest score for the key (the last on a tie,
    as Rust's `max_by_key`); None when no server is eligible."""
    best: Optional[int] = None
    best_score = -1
    for index, seed in enumerate(seeds):
        if eligible is not None and not eligible(index):
            continue
        score = _splitmix64(key_hash_value ^ seed)
        if score >= best_score:
            best, best_score = index, score
    return best


def topic_partition(key: bytes, partitions: int) -> int:
    """The partition of a topic with `partitions` partitions that `key` is published to."""
    if partitions <= 0:
        raise ValueError("a topic has at least one partition")
    return xxhash.xxh3_64_intdigest(key) % partitions


SHARD_REPLICAS_MAX = 3


def shard_of(routing_name: str, shards: int) -> int:
    """The shard of a queue in a cluster of `shards` shards (docs/CLUSTER.md, "Part 2"):
    XXH3_64 of the routing name's UTF-8 bytes, seed 0, mod shards. The routing name is the
    queue's name (a plain queue, a mailbox) or the topic's name (a topic's partitions)."""
    return shard_of_bytes(routing_name.encode("utf-8"), shards)


def shard_of_bytes(routing_name: bytes, shards: int) -> int:
    """`shard_of` for a name given as bytes (queue names are bytes on the wire)."""
    if shards <= 0:
        raise ValueError("a cluster has at least one shard")
    return xxhash.xxh3_64_intdigest(routing_name) % shards


def shard_replicas(shard: int, voters: Sequence[int]) -> List[int]:
    """The voters (node ids) that hold `shard`, the preferred one first: the highest
    XXH3_64(node id as 8 little-endian bytes, seed = shard), a tie to the lower id, at most 3."""
    scored = sorted(
        {node: xxhash.xxh3_64_intdigest(node.to_bytes(8, "little"), seed=shard)
         for node in voters}.items(),
        key=lambda item: (-item[1], item[0]),
    )
    return [node for node, _ in scored[:SHARD_REPLICAS_MAX]]
