package dev.levee.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.google.protobuf.ByteString;
import dev.levee.v1.BreakerSpec;
import dev.levee.v1.BreakerStatus;
import dev.levee.v1.KeyLimit;
import dev.levee.v1.LimitRule;
import dev.levee.v1.LimitsGrpc;
import dev.levee.v1.PerKeyLimit;
import dev.levee.v1.SetLimitRuleRequest;
import io.grpc.ManagedChannel;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.List;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;

/**
 * Limiter against a real server: clients of uneven demand share the budget and never pass it;
 * a key is held to this client's share of its limit; reported failures open the rule's
 * breaker; bad options name the option.
 */
class LimiterTest {
    private static LeveeServer server;

    @BeforeAll
    static void startServer() throws Exception {
        server = new LeveeServer(List.of()).start();
    }

    @AfterAll
    static void stopServer() throws Exception {
        server.close();
    }

    private static void setRule(LimitRule rule) {
        ManagedChannel channel = Channels.open(server.grpcAddr);
        try {
            LimitsGrpc.newBlockingStub(channel).setRule(SetLimitRuleRequest.newBuilder().setRule(rule).build());
        } finally {
            channel.shutdownNow();
        }
    }

    private static long offer(Limiter limiter, String resource, byte[] key, int perMs, long millis) throws Exception {
        long admitted = 0;
        long deadline = System.nanoTime() + Duration.ofMillis(millis).toNanos();
        while (System.nanoTime() < deadline) {
            for (int i = 0; i < perMs; i++) {
                boolean ok = key == null ? limiter.tryAcquire(resource) : limiter.tryAcquireKey(resource, key, 1);
                admitted += ok ? 1 : 0;
            }
            Thread.sleep(1);
        }
        return admitted;
    }

    private static void awaitLease(Limiter limiter, String resource) throws Exception {
        long deadline = System.nanoTime() + Duration.ofSeconds(5).toNanos();
        while (!limiter.tryAcquire(resource)) {
            assertTrue(System.nanoTime() < deadline, "no lease within 5 s");
            Thread.sleep(10);
        }
    }

    @Test
    void given_bad_options_when_starting_should_name_the_option() {
        LeveeException servers = assertThrows(LeveeException.class, () -> Limiter.start(LimiterOptions.of(List.of())));
        assertTrue(servers.getMessage().contains("servers"), servers.getMessage());
        LeveeException fallback = assertThrows(LeveeException.class,
                () -> Limiter.start(LimiterOptions.of(List.of("127.0.0.1:1")).withFallbackPermits(-1)));
        assertTrue(fallback.getMessage().contains("fallbackPermits"), fallback.getMessage());
    }

    @Test
    void given_negative_permits_when_asked_should_refuse_and_count_nothing() throws Exception {
        try (Limiter limiter = Limiter.start(LimiterOptions.of(List.of("127.0.0.1:1")).withFallbackPermits(5))) {
            assertTrue(!limiter.tryAcquire("r", -5));
            assertTrue(!limiter.tryAcquireKey("r", new byte[] {1}, -5));
            assertTrue(!limiter.acquire("r", -5, Duration.ofMillis(10)));
            assertEquals(0, limiter.stats().admitted() + limiter.stats().refused());
        }
    }

    @Test
    void given_two_limiters_of_uneven_demand_when_they_run_should_share_the_budget_and_never_pass_it() throws Exception {
        setRule(LimitRule.newBuilder().setResource("java-pay").setPermits(1_000).setPeriodMs(1_000).build());
        try (Limiter greedy = Limiter.start(LimiterOptions.of(List.of(server.grpcAddr)));
                Limiter modest = Limiter.start(LimiterOptions.of(List.of(server.grpcAddr)))) {
            long started = System.nanoTime();
            long greedyAdmitted = offer(greedy, "java-pay", null, 5, 2_000);
            long modestAdmitted = offer(modest, "java-pay", null, 1, 2_000);
            long elapsedMs = Duration.ofNanos(System.nanoTime() - started).toMillis();
            assertTrue(greedyAdmitted + modestAdmitted <= elapsedMs + 200, greedyAdmitted + " + " + modestAdmitted);
            assertTrue(greedyAdmitted >= 800, "greedy " + greedyAdmitted);
            // Under the budget, the modest client gets most of what it asks for (the first
            // lease period of a resource has no lease yet).
            Limiter.Stats stats = modest.stats();
            assertTrue(stats.admitted() >= 0.6 * (stats.admitted() + stats.refused()), "modest " + stats);
            assertTrue(greedy.stats().connected() && greedy.stats().leasesReceived() >= 10);
        }
        try (Limiter unruled = Limiter.start(LimiterOptions.of(List.of(server.grpcAddr)))) {
            assertEquals(0, offer(unruled, "java-no-rule", null, 1, 300));
            assertTrue(unruled.stats().fallbackDecisions() > 0);
        }
    }

    @Test
    void given_a_per_key_limit_when_two_limiters_ask_should_hold_the_key_to_it() throws Exception {
        byte[] vip = "vip".getBytes(StandardCharsets.UTF_8);
        setRule(LimitRule.newBuilder().setResource("java-search").setPermits(1_000_000).setPeriodMs(1_000)
                .setPerKey(PerKeyLimit.newBuilder()
                        .addExceptions(KeyLimit.newBuilder().setKey(ByteString.copyFrom(vip)).setPermits(100)))
                .build());
        try (Limiter first = Limiter.start(LimiterOptions.of(List.of(server.grpcAddr)));
                Limiter second = Limiter.start(LimiterOptions.of(List.of(server.grpcAddr)))) {
            awaitLease(first, "java-search");
            awaitLease(second, "java-search");
            Thread.sleep(300);
            long started = System.nanoTime();
            long admitted = 0;
            while (System.nanoTime() - started < Duration.ofSeconds(1).toNanos()) {
                admitted += (first.tryAcquireKey("java-search", vip, 1) ? 1 : 0)
                        + (second.tryAcquireKey("java-search", vip, 1) ? 1 : 0);
                Thread.sleep(1);
            }
            double elapsedS = (System.nanoTime() - started) / 1e9;
            // 100 a second over both (50 each, a burst of 5 each), a doubled share for a period.
            assertTrue(admitted <= 100 * elapsedS + 10 + 10, "vip " + admitted);
            assertTrue(admitted >= 50, "vip " + admitted);
            assertTrue(first.stats().keyRefused() > 0);
            // A key without a limit of its own is never refused by a key limit (only, while the
            // lease grows to its demand, by the lease).
            long refused = first.stats().keyRefused();
            assertTrue(offer(first, "java-search", "cold".getBytes(StandardCharsets.UTF_8), 2, 300) > 0);
            assertEquals(refused, first.stats().keyRefused());
        }
    }

    @Test
    void given_failing_calls_when_reported_should_open_the_rules_breaker() throws Exception {
        setRule(LimitRule.newBuilder().setResource("java-db").setPermits(10_000).setPeriodMs(1_000)
                .setBreaker(BreakerSpec.newBuilder().setErrorCount(5).setMinCalls(5).setWindowMs(2_000).setOpenMs(5_000))
                .build());
        try (Limiter limiter = Limiter.start(LimiterOptions.of(List.of(server.grpcAddr)))) {
            awaitLease(limiter, "java-db");
            int failed = 0;
            long deadline = System.nanoTime() + Duration.ofSeconds(5).toNanos();
            // Five failures trip it (more may find the leases empty once it opens).
            while (failed < 5 && System.nanoTime() < deadline) {
                try (Limiter.Call call = limiter.tryCall("java-db")) {
                    if (call != null) {
                        failed++; // closed unreported: a failure
                    }
                }
                Thread.sleep(5);
            }
            assertEquals(5, failed);
            long open = System.nanoTime() + Duration.ofSeconds(2).toNanos();
            while (limiter.breaker("java-db") != BreakerStatus.BREAKER_STATUS_OPEN) {
                assertTrue(System.nanoTime() < open, "the breaker did not open");
                Thread.sleep(10);
            }
        }
    }
}
