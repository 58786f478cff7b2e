package dev.levee.client;

import static org.junit.jupiter.api.Assertions.assertTrue;

import com.google.protobuf.ByteString;
import dev.levee.v1.HotKeyRule;
import dev.levee.v1.MatchKind;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.function.BooleanSupplier;
import org.junit.jupiter.api.Test;

/**
 * Two app servers, each given a different node of a three-node cluster as its only seed, hold
 * sessions with all three nodes, and a key detected hot by whichever node owns it reaches both.
 */
class HotKeysClusterTest {
    private static void await(String what, long millis, BooleanSupplier condition) throws InterruptedException {
        long deadline = System.nanoTime() + Duration.ofMillis(millis).toNanos();
        while (!condition.getAsBoolean()) {
            assertTrue(System.nanoTime() < deadline, "timed out waiting for " + what);
            Thread.sleep(20);
        }
    }

    @Test
    void given_a_three_node_cluster_when_seeded_with_one_node_should_follow_every_member() throws Exception {
        List<LeveeServer> nodes = new ArrayList<>();
        try {
            nodes.add(new LeveeServer(List.of("--node-id", "1", "--peer-addr", "127.0.0.1:0")).start());
            for (String id : List.of("2", "3")) {
                nodes.add(new LeveeServer(List.of("--node-id", id, "--peer-addr", "127.0.0.1:0",
                        "--join", nodes.get(0).peerAddr)).start());
            }
            try (LeveeClient client = LeveeClient.connect(nodes.get(1).grpcAddr)) {
                client.setHotKeyRules("cluster-shop", List.of(HotKeyRule.newBuilder()
                        .setMatchKind(MatchKind.MATCH_KIND_PREFIX).setKey(ByteString.copyFromUtf8("sku-"))
                        .setWindowMs(1_000).setThreshold(50).setHotDurationMs(5_000).build()));
            }
            HotKeysOptions options = new HotKeysOptions("cluster-shop", List.of(nodes.get(0).grpcAddr))
                    .reportInterval(Duration.ofMillis(20)).reconnectBackoff(Duration.ofMillis(20), Duration.ofMillis(200));
            try (HotKeys<Object> reporter = HotKeys.start(options);
                    HotKeys<Object> watcher = HotKeys.start(new HotKeysOptions("cluster-shop", List.of(nodes.get(2).grpcAddr))
                            .reportInterval(Duration.ofMillis(20))
                            .reconnectBackoff(Duration.ofMillis(20), Duration.ofMillis(200)))) {
                await("sessions with all three nodes", 20_000, () -> reporter.stats().serversConnected() == 3
                        && watcher.stats().serversConnected() == 3);
                List<byte[]> keys = new ArrayList<>();
                for (int number = 0; number < 8; number++) {
                    keys.add(("sku-" + number).getBytes(StandardCharsets.UTF_8));
                }
                // Reported again until hot: the rules, set through another node, reach each node
                // within a heartbeat, and a key's owner counts it only once it has them.
                long deadline = System.nanoTime() + Duration.ofSeconds(10).toNanos();
                while (!keys.stream().allMatch(watcher::isHotNow)) {
                    assertTrue(System.nanoTime() < deadline, "the keys hot at the other app server");
                    for (byte[] key : keys) {
                        reporter.record(key, 60);
                    }
                    Thread.sleep(200);
                }
            }
        } finally {
            for (LeveeServer node : nodes) {
                node.close();
            }
        }
    }
}
