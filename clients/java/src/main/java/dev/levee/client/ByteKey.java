package dev.levee.client;

import java.util.Arrays;

/** A byte-array key for hash maps: equal by content, its hash computed once. */
final class ByteKey {
    final byte[] bytes;
    private final int hash;

    ByteKey(byte[] bytes) {
        this.bytes = bytes;
        this.hash = Arrays.hashCode(bytes);
    }

    /** A key that owns its bytes (the caller may reuse its array). */
    ByteKey copy() {
        return new ByteKey(bytes.clone());
    }

    @Override
    public int hashCode() {
        return hash;
    }

    @Override
    public boolean equals(Object other) {
        return other instanceof ByteKey && ((ByteKey) other).hash == hash && Arrays.equals(((ByteKey) other).bytes, bytes);
    }
}
