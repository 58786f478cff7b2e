package dev.levee.client;

/**
 * XXH3-64 with seed 0 and the default secret (xxHash 0.8), the hash topic partitioning uses:
 * {@code XXH3_64(key) mod partitions}. A plain port of the reference algorithm for every input
 * length (0-16, 17-128, 129-240 and the striped long path); the tests compare it with the
 * values the Rust xxhash-rust crate printed (conformance/vectors/).
 */
public final class Xxh3 {
    private static final long PRIME32_1 = 0x9E3779B1L;
    private static final long PRIME32_2 = 0x85EBCA77L;
    private static final long PRIME32_3 = 0xC2B2AE3DL;
    private static final long PRIME64_1 = 0x9E3779B185EBCA87L;
    private static final long PRIME64_2 = 0xC2B2AE3D27D4EB4FL;
    private static final long PRIME64_3 = 0x165667B19E3779F9L;
    private static final long PRIME64_4 = 0x85EBCA77C2B2AE63L;
    private static final long PRIME64_5 = 0x27D4EB2F165667C5L;
    private static final long PRIME_MX1 = 0x165667919E3779F9L;
    private static final long PRIME_MX2 = 0x9FB21C651E98DF25L;

    private static final int STRIPE_BYTES = 64;
    private static final int SECRET_CONSUME_RATE = 8;
    private static final int ACCUMULATORS = 8;
    private static final int SECRET_MERGEACCS_START = 11;
    private static final int SECRET_LASTACC_START = 7;
    private static final int MIDSIZE_LASTOFFSET = 17;
    private static final int SECRET_SIZE_MIN = 136;

    private static final byte[] SECRET = bytes(
            0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
            0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
            0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
            0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
            0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
            0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
            0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
            0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
            0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
            0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
            0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
            0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e);

    private Xxh3() {}

    private static byte[] bytes(int... values) {
        byte[] out = new byte[values.length];
        for (int i = 0; i < values.length; i++) {
            out[i] = (byte) values[i];
        }
        return out;
    }

    private static long secret64(int at) {
        return Routing.u64(SECRET, at);
    }

    private static long mul128Fold64(long x, long y) {
        return Routing.foldedMultiply(x, y);
    }

    private static long avalanche(long h) {
        h ^= h >>> 37;
        h *= PRIME_MX1;
        return h ^ (h >>> 32);
    }

    private static long xxh64Avalanche(long h) {
        h ^= h >>> 33;
        h *= PRIME64_2;
        h ^= h >>> 29;
        h *= PRIME64_3;
        return h ^ (h >>> 32);
    }

    private static long rrmxmx(long h, long length) {
        h ^= Long.rotateLeft(h, 49) ^ Long.rotateLeft(h, 24);
        h *= PRIME_MX2;
        h ^= (h >>> 35) + length;
        h *= PRIME_MX2;
        return h ^ (h >>> 28);
    }

    private static long mix16(byte[] input, int at, int secretAt) {
        long low = Routing.u64(input, at);
        long high = Routing.u64(input, at + 8);
        return mul128Fold64(low ^ secret64(secretAt), high ^ secret64(secretAt + 8));
    }

    /**
     * XXH3-64 of {@code value} as 8 little-endian bytes with {@code seed} (the reference's
     * 4-to-8-byte path, seeded): the score of a shard's replica, {@code seed} being the shard.
     */
    public static long hash64Seeded8(long value, long seed) {
        long folded = seed ^ ((long) Integer.reverseBytes((int) seed) << 32);
        long first = value & 0xffffffffL;
        long last = value >>> 32;
        long bitflip = (secret64(8) ^ secret64(16)) - folded;
        long keyed = (last + (first << 32)) ^ bitflip;
        return rrmxmx(keyed, 8);
    }

    /** XXH3-64 of {@code input} with seed 0. */
    public static long hash64(byte[] input) {
        int length = input.length;
        if (length <= 16) {
            if (length > 8) {
                long low = Routing.u64(input, 0) ^ (secret64(24) ^ secret64(32));
                long high = Routing.u64(input, length - 8) ^ (secret64(40) ^ secret64(48));
                long accumulator = length + Long.reverseBytes(low) + high + mul128Fold64(low, high);
                return avalanche(accumulator);
            }
            if (length >= 4) {
                long first = Routing.u32(input, 0);
                long last = Routing.u32(input, length - 4);
                long keyed = (last + (first << 32)) ^ (secret64(8) ^ secret64(16));
                return rrmxmx(keyed, length);
            }
            if (length > 0) {
                long c1 = input[0] & 0xffL;
                long c2 = input[length >> 1] & 0xffL;
                long c3 = input[length - 1] & 0xffL;
                long combined = (c1 << 16) | (c2 << 24) | c3 | ((long) length << 8);
                long bitflip = (Routing.u32(SECRET, 0) ^ Routing.u32(SECRET, 4));
                return xxh64Avalanche(combined ^ bitflip);
            }
            return xxh64Avalanche(secret64(56) ^ secret64(64));
        }
        if (length <= 128) {
            long accumulator = length * PRIME64_1;
            if (length > 32) {
                if (length > 64) {
                    if (length > 96) {
                        accumulator += mix16(input, 48, 96);
                        accumulator += mix16(input, length - 64, 112);
                    }
                    accumulator += mix16(input, 32, 64);
                    accumulator += mix16(input, length - 48, 80);
                }
                accumulator += mix16(input, 16, 32);
                accumulator += mix16(input, length - 32, 48);
            }
            accumulator += mix16(input, 0, 0);
            accumulator += mix16(input, length - 16, 16);
            return avalanche(accumulator);
        }
        if (length <= 240) {
            long accumulator = length * PRIME64_1;
            int rounds = length / 16;
            for (int i = 0; i < 8; i++) {
                accumulator += mix16(input, 16 * i, 16 * i);
            }
            accumulator = avalanche(accumulator);
            for (int i = 8; i < rounds; i++) {
                accumulator += mix16(input, 16 * i, 16 * (i - 8) + 3);
            }
            accumulator += mix16(input, length - 16, SECRET_SIZE_MIN - MIDSIZE_LASTOFFSET);
            return avalanche(accumulator);
        }
        return hashLong(input);
    }

    private static void accumulate512(long[] accumulators, byte[] input, int at, int secretAt) {
        for (int i = 0; i < ACCUMULATORS; i++) {
            long value = Routing.u64(input, at + 8 * i);
            long keyed = value ^ secret64(secretAt + 8 * i);
            accumulators[i ^ 1] += value;
            accumulators[i] += (keyed & 0xffffffffL) * (keyed >>> 32);
        }
    }

    private static void scramble(long[] accumulators, int secretAt) {
        for (int i = 0; i < ACCUMULATORS; i++) {
            long accumulator = accumulators[i];
            accumulator ^= accumulator >>> 47;
            accumulator ^= secret64(secretAt + 8 * i);
            accumulators[i] = accumulator * PRIME32_1;
        }
    }

    private static long hashLong(byte[] input) {
        int length = input.length;
        long[] accumulators = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
        int stripesPerBlock = (SECRET.length - STRIPE_BYTES) / SECRET_CONSUME_RATE;
        int blockBytes = STRIPE_BYTES * stripesPerBlock;
        int blocks = (length - 1) / blockBytes;
        for (int block = 0; block < blocks; block++) {
            for (int stripe = 0; stripe < stripesPerBlock; stripe++) {
                accumulate512(accumulators, input, block * blockBytes + stripe * STRIPE_BYTES, stripe * SECRET_CONSUME_RATE);
            }
            scramble(accumulators, SECRET.length - STRIPE_BYTES);
        }
        int stripes = ((length - 1) - blockBytes * blocks) / STRIPE_BYTES;
        for (int stripe = 0; stripe < stripes; stripe++) {
            accumulate512(accumulators, input, blocks * blockBytes + stripe * STRIPE_BYTES, stripe * SECRET_CONSUME_RATE);
        }
        accumulate512(accumulators, input, length - STRIPE_BYTES, SECRET.length - STRIPE_BYTES - SECRET_LASTACC_START);
        long result = length * PRIME64_1;
        for (int i = 0; i < 4; i++) {
            result += mul128Fold64(accumulators[2 * i] ^ secret64(SECRET_MERGEACCS_START + 16 * i),
                    accumulators[2 * i + 1] ^ secret64(SECRET_MERGEACCS_START + 16 * i + 8));
        }
        return avalanche(result);
    }
}
