package dev.levee.client;

import java.time.Duration;

/**
 * One message to publish to a topic: by key ({@code XXH3_64(key) mod partitions}) or to a
 * given partition, at once or after a delay.
 *
 * @param key the key (empty: partition 0 unless a partition is given)
 * @param payload the message
 * @param partition the partition, or -1 to choose by key
 * @param sequence with a producer id: this producer's sequence number on the partition
 * @param delayMs deliver no earlier than this many ms from now (0: at once; at most
 *     {@link Validation#DELAY_MS_MAX}, 7 days). A delayed message is stored durably at once,
 *     waits on the server and is appended to its partition (chosen at publish time) when due,
 *     getting its offset then; it cannot be published with a producer id.
 */
public record PublishRecord(byte[] key, byte[] payload, int partition, long sequence, long delayMs) {
    /** A message published at once. */
    public PublishRecord(byte[] key, byte[] payload, int partition, long sequence) {
        this(key, payload, partition, sequence, 0);
    }

    /** A message published by key. */
    public static PublishRecord keyed(byte[] key, byte[] payload) {
        return new PublishRecord(key, payload, -1, 0);
    }

    /**
     * This message, delivered no earlier than {@code delay} from now (whole milliseconds; at
     * most 7 days, checked when published).
     */
    public PublishRecord withDelay(Duration delay) {
        return new PublishRecord(key, payload, partition, sequence, Validation.delayMs(delay));
    }
}
