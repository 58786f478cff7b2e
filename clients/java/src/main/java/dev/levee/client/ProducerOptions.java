package dev.levee.client;

import java.time.Duration;

/** How a {@link Producer} batches, retries and routes. Fluent setters; checked when it is made. */
public final class ProducerOptions {
    Duration linger = Duration.ofMillis(1);
    boolean sendWhenIdle = true;
    int batchMessagesMax = 1000;
    int batchBytesMax = 4 << 20;
    int queuedMessagesMax = 100_000;
    int requestsInFlightMax = 8;
    boolean idempotent;
    int retriesMax = 10;
    Duration retryBackoff = Duration.ofMillis(10);
    Duration retryBackoffMax = Duration.ofMillis(100);
    int sequenceQueuesMax = 100_000;
    boolean routeToShardLeaders = true;

    public static ProducerOptions defaults() {
        return new ProducerOptions();
    }

    /** Most time a message waits for others to join its batch (default 1 ms). */
    public ProducerOptions linger(Duration value) {
        linger = value;
        return this;
    }

    /** Send at once when no request is in flight (default true). */
    public ProducerOptions sendWhenIdle(boolean value) {
        sendWhenIdle = value;
        return this;
    }

    /** Messages per request, 1 to 10000 (default 1000). */
    public ProducerOptions batchMessagesMax(int value) {
        batchMessagesMax = value;
        return this;
    }

    /** Payload bytes per request (default 4 MiB). */
    public ProducerOptions batchBytesMax(int value) {
        batchBytesMax = value;
        return this;
    }

    /** Messages queued or in flight (default 100000); further sends wait for room. */
    public ProducerOptions queuedMessagesMax(int value) {
        queuedMessagesMax = value;
        return this;
    }

    /**
     * Batches in flight at once (default 8); a batch split over shard leaders is one request
     * per leader.
     */
    public ProducerOptions requestsInFlightMax(int value) {
        requestsInFlightMax = value;
        return this;
    }

    /** Take a producer id and number each queue's messages, so retries store nothing twice. */
    public ProducerOptions idempotent(boolean value) {
        idempotent = value;
        return this;
    }

    /**
     * Resends of a batch after a retryable failure (idempotent only; default 10, as the Rust
     * producer's). With the default pauses (10 ms doubling up to 100 ms: about 0.75 s of
     * pauses in all, plus each resend's own time, which a node without the shard's leader
     * spends up to 2 s on) they ride out a shard leader's failover in a cluster (one to two
     * seconds).
     */
    public ProducerOptions retriesMax(int value) {
        retriesMax = value;
        return this;
    }

    /** First pause before a resend, doubling up to {@link #retryBackoffMax} (default 10 ms). */
    public ProducerOptions retryBackoff(Duration value) {
        retryBackoff = value;
        return this;
    }

    /**
     * Longest pause between two resends (default 100 ms, as the Rust producer's): the pause
     * doubles from {@link #retryBackoff} until it reaches this. A retryBackoff above it is kept
     * as it is (no doubling).
     */
    public ProducerOptions retryBackoffMax(Duration value) {
        retryBackoffMax = value;
        return this;
    }

    /** Queues with a sequence counter; past it the producer takes a new id (default 100000). */
    public ProducerOptions sequenceQueuesMax(int value) {
        sequenceQueuesMax = value;
        return this;
    }

    /**
     * In a cluster that replicates its queues: send each batch's messages straight to their
     * shards' leaders, one request per leader, saving the hop a node takes forwarding them
     * (default true). The leaders are learnt from GetCluster every second and soon after a
     * failed send. Elsewhere it changes nothing: every batch goes to the producer's client.
     */
    public ProducerOptions routeToShardLeaders(boolean value) {
        routeToShardLeaders = value;
        return this;
    }

    void validate() {
        if (batchMessagesMax < 1 || batchMessagesMax > Validation.MESSAGES_PER_REQUEST_MAX) {
            throw Validation.invalid("batch_messages_max must be 1 to " + Validation.MESSAGES_PER_REQUEST_MAX + ", got "
                    + batchMessagesMax);
        }
        if (batchBytesMax < 1 || queuedMessagesMax < 1 || requestsInFlightMax < 1 || sequenceQueuesMax < 1) {
            throw Validation.invalid("batch_bytes_max, queued_messages_max, requests_in_flight_max and "
                    + "sequence_queues_max must be at least 1");
        }
        if (linger.isNegative() || retriesMax < 0 || retryBackoff.isNegative() || retryBackoffMax.isNegative()) {
            throw Validation.invalid("linger, retry_backoff, retry_backoff_max and retries_max must not be negative");
        }
    }
}
