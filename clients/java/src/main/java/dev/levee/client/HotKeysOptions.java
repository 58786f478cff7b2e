package dev.levee.client;

import java.lang.management.ManagementFactory;
import java.time.Duration;
import java.util.List;

/** How a {@link HotKeys} reports and reconnects. Fluent setters; checked when it starts. */
public final class HotKeysOptions {
    public static final Duration REPORT_INTERVAL_MIN = Duration.ofMillis(1);
    public static final Duration REPORT_INTERVAL_MAX = Duration.ofMillis(500);
    /** Protobuf bytes around each key of a report, at most (levee-proto's constant). */
    public static final int REPORT_KEY_OVERHEAD_BYTES = 1 + 3 + 1 + 5 + 1 + 3;
    public static final int REPORT_BATCH_OVERHEAD_BYTES = 1 + 5;
    public static final int REPORT_BATCH_BYTES_MAX_DEFAULT = 4 << 20;
    public static final int REPORT_BATCH_BYTES_MIN = (64 << 10) + REPORT_KEY_OVERHEAD_BYTES + REPORT_BATCH_OVERHEAD_BYTES;

    final String app;
    final List<String> servers;
    String clientId = "pid-" + ManagementFactory.getRuntimeMXBean().getPid();
    Duration reportInterval = Duration.ofMillis(100);
    int bufferKeysMax = 100_000;
    int batchKeysMax = 10_000;
    int batchBytesMax = REPORT_BATCH_BYTES_MAX_DEFAULT;
    int batchesQueuedPerServerMax = 64;
    Duration reconnectBackoffMin = Duration.ofMillis(100);
    Duration reconnectBackoffMax = Duration.ofSeconds(5);
    boolean followCluster = true;

    /** Options for {@code app} (1 to 128 of [A-Za-z0-9._-]) over the servers' gRPC addresses. */
    public HotKeysOptions(String app, List<String> servers) {
        this.app = app;
        this.servers = List.copyOf(servers);
    }

    /** Names the app server in the servers' debug logs. */
    public HotKeysOptions clientId(String value) {
        clientId = value;
        return this;
    }

    /** How often buffered accesses are reported, 1 to 500 ms (default 100 ms). */
    public HotKeysOptions reportInterval(Duration value) {
        reportInterval = value;
        return this;
    }

    /** Distinct keys buffered between reports (default 100000); further keys are dropped and counted. */
    public HotKeysOptions bufferKeysMax(int value) {
        bufferKeysMax = value;
        return this;
    }

    /** Keys per report message (default 10000, the server's hotkey_batch_keys_max). */
    public HotKeysOptions batchKeysMax(int value) {
        batchKeysMax = value;
        return this;
    }

    /** Bytes per report message (default 4 MiB). */
    public HotKeysOptions batchBytesMax(int value) {
        batchBytesMax = value;
        return this;
    }

    /** Report batches waiting per server (default 64); a batch that does not fit is counted unsent. */
    public HotKeysOptions batchesQueuedPerServerMax(int value) {
        batchesQueuedPerServerMax = value;
        return this;
    }

    /**
     * Whether the servers are seeds of a cluster (default true): the client follows the
     * cluster's members ({@code Cluster.WatchMembers}), holds a session with every member and
     * routes keys over them, following every change, as the Rust client. False: exactly the
     * servers given (independent lone servers).
     */
    public HotKeysOptions followCluster(boolean value) {
        followCluster = value;
        return this;
    }

    /** Reconnect backoff: from {@code min}, doubling to {@code max}. */
    public HotKeysOptions reconnectBackoff(Duration min, Duration max) {
        reconnectBackoffMin = min;
        reconnectBackoffMax = max;
        return this;
    }

    void validate() {
        Validation.checkApp(app);
        if (servers.isEmpty()) {
            throw Validation.invalid("servers: give at least one server address");
        }
        if (reportInterval.compareTo(REPORT_INTERVAL_MIN) < 0 || reportInterval.compareTo(REPORT_INTERVAL_MAX) > 0) {
            throw Validation.invalid("report_interval must be 1 to 500 ms, got " + reportInterval.toMillis() + " ms");
        }
        if (bufferKeysMax < 1 || batchKeysMax < 1) {
            throw Validation.invalid("buffer_keys_max and batch_keys_max must be at least 1");
        }
        if (batchesQueuedPerServerMax < 1) {
            throw Validation.invalid("batches_queued_per_server_max must be at least 1");
        }
        if (batchBytesMax < REPORT_BATCH_BYTES_MIN) {
            throw Validation.invalid("batch_bytes_max must be at least " + REPORT_BATCH_BYTES_MIN
                    + " (a key of the largest size fits, with its framing), got " + batchBytesMax);
        }
        if (reconnectBackoffMin.isNegative() || reconnectBackoffMin.isZero()
                || reconnectBackoffMin.compareTo(reconnectBackoffMax) > 0) {
            throw Validation.invalid("reconnect_backoff_min must be above 0 and at most reconnect_backoff_max");
        }
    }
}
