package dev.levee.client;

import java.time.Duration;
import java.util.List;

/**
 * How a {@link Limiter} connects and falls back.
 *
 * @param servers any of the cluster's nodes, HOST:PORT (the limiter finds the leader)
 * @param leaseInterval the server's lease period (100 ms)
 * @param fallbackPermits permits per lease period a resource may use while no lease is held (0: refuse)
 * @param connectTimeout most time to reach a node and to wait for a lease answer
 */
public record LimiterOptions(List<String> servers, Duration leaseInterval, long fallbackPermits,
        Duration connectTimeout) {
    /** Options against {@code servers}, refusing while no lease is held. */
    public static LimiterOptions of(List<String> servers) {
        return new LimiterOptions(servers, Duration.ofMillis(100), 0, Duration.ofSeconds(2));
    }

    /** The same options with another fallback. */
    public LimiterOptions withFallbackPermits(long permits) {
        return new LimiterOptions(servers, leaseInterval, permits, connectTimeout);
    }

    void validate() {
        if (servers == null || servers.isEmpty()) {
            throw Limiter.invalid("servers: give at least one server");
        }
        if (leaseInterval == null || leaseInterval.toMillis() < 10 || leaseInterval.toMillis() > 10_000) {
            throw Limiter.invalid("leaseInterval must be 10 ms to 10 s, got " + leaseInterval
                    + "; the server's lease period is 100 ms");
        }
        if (fallbackPermits < 0) {
            throw Limiter.invalid("fallbackPermits must be 0 or more, got " + fallbackPermits);
        }
        if (connectTimeout == null || connectTimeout.isNegative() || connectTimeout.isZero()) {
            throw Limiter.invalid("connectTimeout must be above 0, got " + connectTimeout);
        }
    }
}
