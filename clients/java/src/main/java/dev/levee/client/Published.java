package dev.levee.client;

/**
 * Where a published message went.
 *
 * @param partition the partition
 * @param offset its offset in the partition (0 for a delayed message: it gets its offset when
 *     delivered)
 * @param deliverAtMs when a delayed message will be delivered, in ms since the Unix epoch by
 *     the server's clock; 0 for a message stored at once
 */
public record Published(int partition, long offset, long deliverAtMs) {
    /** A message stored at once. */
    public Published(int partition, long offset) {
        this(partition, offset, 0);
    }

    /** Whether the message waits on the server to be delivered ({@link #deliverAtMs} set). */
    public boolean delayed() {
        return deliverAtMs != 0;
    }
}
