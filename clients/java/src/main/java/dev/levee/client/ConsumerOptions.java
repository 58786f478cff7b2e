package dev.levee.client;

import java.time.Duration;

/** How a {@link GroupConsumer} runs. Fluent setters; checked when it is made. */
public final class ConsumerOptions {
    String member;
    int parallelism = 16;
    boolean ordered = true;
    int creditMessages = 1000;
    Duration commitInterval = Duration.ofMillis(100);
    Duration lease = Duration.ofSeconds(10);
    Duration backoffInitial = Duration.ofMillis(100);
    Duration backoffMax = Duration.ofSeconds(5);

    public static ConsumerOptions defaults() {
        return new ConsumerOptions();
    }

    /** This member's id (default: a fresh one). A second stream with the same id replaces the first. */
    public ConsumerOptions member(String value) {
        member = value;
        return this;
    }

    /** Handlers running at once (default 16). */
    public ConsumerOptions parallelism(int value) {
        parallelism = value;
        return this;
    }

    /** One message at a time per partition, in offset order (default). Commits stay in order either way. */
    public ConsumerOptions ordered(boolean value) {
        ordered = value;
        return this;
    }

    /** Messages delivered but not finished, at most (1 to 100000; default 1000). */
    public ConsumerOptions creditMessages(int value) {
        creditMessages = value;
        return this;
    }

    /** How often finished offsets are committed (default 100 ms). */
    public ConsumerOptions commitInterval(Duration value) {
        commitInterval = value;
        return this;
    }

    /** The server drops the member if it hears nothing for this long (1 to 300 s); heartbeats every third. */
    public ConsumerOptions lease(Duration value) {
        lease = value;
        return this;
    }

    /** Rejoin backoff after a broken stream: from {@code initial}, doubling to {@code max}. */
    public ConsumerOptions backoff(Duration initial, Duration max) {
        backoffInitial = initial;
        backoffMax = max;
        return this;
    }

    void validate() {
        if (parallelism < 1 || creditMessages < 1 || creditMessages > Validation.CREDIT_MESSAGES_MAX
                || commitInterval.isZero() || commitInterval.isNegative()
                || lease.compareTo(Duration.ofSeconds(1)) < 0 || lease.compareTo(Duration.ofSeconds(300)) > 0) {
            throw Validation.invalid("parallelism must be at least 1, credit_messages 1 to 100000, "
                    + "commit_interval above 0 and lease 1 to 300 s");
        }
    }
}
