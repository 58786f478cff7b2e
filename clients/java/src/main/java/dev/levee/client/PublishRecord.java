package dev.levee.client;

/**
 * One message to publish to a topic: by key ({@code XXH3_64(key) mod partitions}) or to a
 * given partition.
 *
 * @param key the key (empty: partition 0 unless a partition is given)
 * @param payload the message
 * @param partition the partition, or -1 to choose by key
 * @param sequence with a producer id: this producer's sequence number on the partition
 */
public record PublishRecord(byte[] key, byte[] payload, int partition, long sequence) {
    /** A message published by key. */
    public static PublishRecord keyed(byte[] key, byte[] payload) {
        return new PublishRecord(key, payload, -1, 0);
    }
}
