package dev.levee.client;

import java.nio.charset.StandardCharsets;
import java.util.function.IntPredicate;

/**
 * Where keys go: hot-key reports by rendezvous hashing over servers, topic keys by XXH3.
 *
 * <p>Hot-key routing is identical to the Rust client's (crates/levee-client/src/hotkey.rs): a
 * key's hash and each server address's seed are {@code foldhash::fast::FixedState::with_seed(
 * HOT_KEY_SEED).hash_one(bytes)} (foldhash 0.1.5 on a 64-bit little-endian machine, ported
 * below), and the key goes to the eligible server with the highest {@code splitmix64(key_hash ^
 * seed)}, the later one on a tie. A key therefore reaches the same server from a Rust, Python or
 * Java app server, so its counts add up on one server. The tests compare with the vectors that
 * the Rust code printed (conformance/vectors/routing-and-partitions.json).
 *
 * <p>Topic partitioning is {@code XXH3_64(key, seed 0) mod partitions} (topic.proto), see
 * {@link Xxh3}.
 */
public final class Routing {
    /** The fixed seed of the hot-key routing hash ("hotkeys!"). */
    public static final long HOT_KEY_SEED = 0x686f746b65797321L;

    // foldhash 0.1.5 constants.
    private static final long ARBITRARY3 = 0x082efa98ec4e6c89L;
    private static final long FOLD_SEED = 0x452821e638d01377L; // ARBITRARY4
    private static final long EXPAND_SEED = 0xbe5466cf34e90c6cL; // ARBITRARY5
    private static final long EXPAND_SEED2 = 0xc0ac29b7c97c50ddL; // ARBITRARY6
    private static final long EXPAND_SEED3 = 0x3f84d5b5b5470917L; // ARBITRARY7
    private static final long PER_HASHER_SEED = HOT_KEY_SEED ^ ARBITRARY3;

    private Routing() {}

    static long foldedMultiply(long x, long y) {
        long low = x * y;
        long high = Math.multiplyHigh(x, y) + ((x >> 63) & y) + ((y >> 63) & x);
        return low ^ high;
    }

    static long u64(byte[] data, int at) {
        return (data[at] & 0xffL) | (data[at + 1] & 0xffL) << 8 | (data[at + 2] & 0xffL) << 16
                | (data[at + 3] & 0xffL) << 24 | (data[at + 4] & 0xffL) << 32
                | (data[at + 5] & 0xffL) << 40 | (data[at + 6] & 0xffL) << 48
                | (data[at + 7] & 0xffL) << 56;
    }

    static long u32(byte[] data, int at) {
        return (data[at] & 0xffL) | (data[at + 1] & 0xffL) << 8 | (data[at + 2] & 0xffL) << 16
                | (data[at + 3] & 0xffL) << 24;
    }

    private static long hashMedium(byte[] data, int from, int length, long s0, long s1) {
        int index = 0;
        while (index + 16 <= length) {
            int highEnd = length - index;
            if (index >= highEnd) {
                break;
            }
            long a = u64(data, from + index);
            long b = u64(data, from + index + 8);
            long c = u64(data, from + highEnd - 16);
            long d = u64(data, from + highEnd - 8);
            s0 = foldedMultiply(a ^ s0, c ^ FOLD_SEED);
            s1 = foldedMultiply(b ^ s1, d ^ FOLD_SEED);
            index += 16;
        }
        return s0 ^ s1;
    }

    private static long hashLong(byte[] data, long s0, long s1, long s2, long s3) {
        int length = data.length;
        int chunks = length / 64;
        for (int chunk = 0; chunk < chunks; chunk++) {
            int at = chunk * 64;
            s0 = foldedMultiply(u64(data, at) ^ s0, u64(data, at + 32) ^ FOLD_SEED);
            s1 = foldedMultiply(u64(data, at + 8) ^ s1, u64(data, at + 40) ^ FOLD_SEED);
            s2 = foldedMultiply(u64(data, at + 16) ^ s2, u64(data, at + 48) ^ FOLD_SEED);
            s3 = foldedMultiply(u64(data, at + 24) ^ s3, u64(data, at + 56) ^ FOLD_SEED);
        }
        s0 ^= s2;
        s1 ^= s3;
        int remainder = length - chunks * 64;
        if (remainder > 0) {
            int tail = Math.max(remainder, 16);
            return hashMedium(data, length - tail, tail, s0, s1);
        }
        return s0 ^ s1;
    }

    /**
     * The routing hash of a key: {@code FixedState::with_seed(HOT_KEY_SEED).hash_one(key)} of
     * foldhash 0.1.5 (the slice's length goes into the sponge as a usize, then its bytes).
     */
    public static long keyHash(byte[] key) {
        int length = key.length;
        long baseSeed = Long.rotateRight(PER_HASHER_SEED, length);
        long accumulator;
        if (length <= 16) {
            long s0 = baseSeed;
            long s1 = EXPAND_SEED;
            if (length >= 8) {
                s0 ^= u64(key, 0);
                s1 ^= u64(key, length - 8);
            } else if (length >= 4) {
                s0 ^= u32(key, 0);
                s1 ^= u32(key, length - 4);
            } else if (length > 0) {
                s0 ^= key[0] & 0xffL;
                s1 ^= (key[length - 1] & 0xffL) << 8 | (key[length / 2] & 0xffL);
            }
            accumulator = foldedMultiply(s0, s1);
        } else if (length < 256) {
            accumulator = hashMedium(key, 0, length, baseSeed, baseSeed + EXPAND_SEED);
        } else {
            accumulator = hashLong(key, baseSeed, baseSeed + EXPAND_SEED, baseSeed + EXPAND_SEED2,
                    baseSeed + EXPAND_SEED3);
        }
        // finish(): the sponge holds the 64-bit length and nothing above it.
        return foldedMultiply(length ^ accumulator, FOLD_SEED);
    }

    /** A server's rendezvous seed: the routing hash of its address as given. */
    public static long serverSeed(String address) {
        return keyHash(address.getBytes(StandardCharsets.UTF_8));
    }

    static long splitmix64(long value) {
        value = (value ^ (value >>> 30)) * 0xbf58476d1ce4e5b9L;
        value = (value ^ (value >>> 27)) * 0x94d049bb133111ebL;
        return value ^ (value >>> 31);
    }

    /**
     * The index of the eligible seed with the highest score for the key (the last on a tie, as
     * Rust's {@code max_by_key}); -1 when no server is eligible.
     */
    public static int rendezvous(long keyHash, long[] seeds, IntPredicate eligible) {
        int best = -1;
        long bestScore = 0;
        for (int index = 0; index < seeds.length; index++) {
            if (eligible != null && !eligible.test(index)) {
                continue;
            }
            long score = splitmix64(keyHash ^ seeds[index]);
            if (best < 0 || Long.compareUnsigned(score, bestScore) >= 0) {
                best = index;
                bestScore = score;
            }
        }
        return best;
    }

    /** The most replicas of a shard. */
    public static final int SHARD_REPLICAS_MAX = 3;

    /**
     * The shard of a queue in a cluster of {@code shards} shards (docs/CLUSTER.md, "Part 2"):
     * XXH3_64 of the routing name's UTF-8 bytes, seed 0, mod shards. The routing name is the
     * queue's name (a plain queue, a mailbox) or the topic's name (a topic's partitions).
     */
    public static int shardOf(String routingName, int shards) {
        return shardOf(routingName.getBytes(StandardCharsets.UTF_8), shards);
    }

    /** {@link #shardOf(String, int)} of a name given as its bytes (a queue's name as appended). */
    public static int shardOf(byte[] routingName, int shards) {
        if (shards <= 0) {
            throw new IllegalArgumentException("a cluster has at least one shard");
        }
        return (int) Long.remainderUnsigned(Xxh3.hash64(routingName), shards);
    }

    /**
     * The voters (node ids) that hold {@code shard}, the preferred one first: the highest
     * XXH3_64(node id as 8 little-endian bytes, seed = shard), a tie to the lower id, at most 3.
     */
    public static java.util.List<Long> shardReplicas(int shard, long[] voters) {
        java.util.List<long[]> scored = new java.util.ArrayList<>();
        java.util.Set<Long> seen = new java.util.HashSet<>();
        for (long node : voters) {
            if (seen.add(node)) {
                scored.add(new long[] {Xxh3.hash64Seeded8(node, Integer.toUnsignedLong(shard)), node});
            }
        }
        scored.sort((left, right) -> {
            int byScore = Long.compareUnsigned(right[0], left[0]);
            return byScore != 0 ? byScore : Long.compareUnsigned(left[1], right[1]);
        });
        java.util.List<Long> replicas = new java.util.ArrayList<>();
        for (int i = 0; i < Math.min(SHARD_REPLICAS_MAX, scored.size()); i++) {
            replicas.add(scored.get(i)[1]);
        }
        return replicas;
    }

    /** The partition of a topic with {@code partitions} partitions that {@code key} goes to. */
    public static int topicPartition(byte[] key, int partitions) {
        if (partitions <= 0) {
            throw new IllegalArgumentException("a topic has at least one partition");
        }
        return (int) Long.remainderUnsigned(Xxh3.hash64(key), partitions);
    }
}
