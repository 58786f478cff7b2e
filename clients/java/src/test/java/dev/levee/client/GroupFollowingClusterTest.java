package dev.levee.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import dev.levee.v1.ErrorCode;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.TreeSet;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * A group member that follows the cluster ({@link GroupConsumer#following}) against three
 * processes of a cluster that replicates its queues, as crates/levee/tests/replicated.rs tests
 * the Rust one: the member joins through node 2 and handles what was published; node 2 is
 * killed (kill -9); every message published through node 1 after the kill is handled (at least
 * once), which only a member that rejoined through another node can do.
 */
class GroupFollowingClusterTest {
    private static final int SHARDS = 4;
    private static final int PARTITIONS = 4;
    private static final String TOPIC = "shipments";
    /** Messages published before the kill, and as many after it. */
    private static final int MESSAGES = 20;
    /** Longest the test waits for one phase's messages to be handled (a rejoin included). */
    private static final long HANDLED_MS = 30_000;
    /** Longest a publish retries while a shard elects a new leader. */
    private static final long PUBLISH_MS = 30_000;

    /**
     * Publishes {@code keys} through {@code client} as producer "p", spread over the partitions
     * with each partition's next sequence (so a resend after an unanswered try is stored once),
     * retrying while the topic's shard has no leader.
     */
    private static void publishIdempotent(LeveeClient client, List<String> keys, Map<Integer, Long> sequences)
            throws InterruptedException {
        List<PublishRecord> records = new ArrayList<>();
        for (int index = 0; index < keys.size(); index++) {
            int partition = index % PARTITIONS;
            long sequence = sequences.merge(partition, 1L, Long::sum) - 1;
            byte[] key = keys.get(index).getBytes(StandardCharsets.UTF_8);
            records.add(new PublishRecord(key, key, partition, sequence));
        }
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(PUBLISH_MS);
        while (true) {
            try {
                assertEquals(keys.size(), client.publish(TOPIC, records, "p").size());
                return;
            } catch (LeveeException error) {
                boolean retry = error.code() == ErrorCode.ERROR_CODE_UNAVAILABLE
                        || error.code() == ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED;
                if (!retry || System.nanoTime() - deadline >= 0) {
                    throw error;
                }
                Thread.sleep(50);
            }
        }
    }

    private static List<String> keys(int first, int count) {
        List<String> keys = new ArrayList<>();
        for (int number = first; number < first + count; number++) {
            keys.add("parcel-" + number);
        }
        return keys;
    }

    @Test
    @Timeout(value = 150, unit = TimeUnit.SECONDS)
    void given_a_following_group_member_through_node_2_when_node_2_is_killed_should_rejoin_and_handle_every_message()
            throws Exception {
        List<LeveeServer> nodes = new ArrayList<>();
        List<LeveeClient> clients = new ArrayList<>();
        GroupConsumer consumer = null;
        Thread running = null;
        try {
            ReplicatedCluster.threeNodes(nodes, SHARDS);
            for (LeveeServer node : nodes) {
                clients.add(LeveeClient.connect(node.grpcAddr));
            }
            ReplicatedCluster.waitSettled(clients, SHARDS);
            LeveeClient first = clients.get(0);
            assertTrue(!first.createTopic(TOPIC, PARTITIONS), "a new topic");
            Map<Integer, Long> sequences = new TreeMap<>();
            List<String> before = keys(0, MESSAGES);
            publishIdempotent(first, before, sequences);

            Set<String> handled = ConcurrentHashMap.newKeySet();
            consumer = new GroupConsumer(clients.get(1), TOPIC, "billing", ConsumerOptions.defaults()).following();
            GroupConsumer member = consumer;
            AtomicReference<Object> outcome = new AtomicReference<>();
            running = new Thread(() -> {
                try {
                    outcome.set(member.run(message -> handled.add(new String(message.payload(), StandardCharsets.UTF_8))));
                } catch (RuntimeException error) {
                    outcome.set(error);
                }
            }, "group-following-member");
            running.setDaemon(true);
            running.start();
            ReplicatedCluster.await("the messages published before the kill handled through node 2", HANDLED_MS,
                    () -> handled.containsAll(before));

            // Node 2 dies: the member rejoins through another node and goes on (from the
            // group's commits on the topic's shard: messages may come again, none is missed).
            nodes.get(1).kill();
            List<String> after = keys(MESSAGES, MESSAGES);
            publishIdempotent(first, after, sequences);
            ReplicatedCluster.await("every message published after the kill handled", HANDLED_MS,
                    () -> handled.containsAll(after));

            consumer.stop();
            running.join(TimeUnit.SECONDS.toMillis(15));
            assertTrue(!running.isAlive(), "run returned after stop");
            Object result = outcome.get();
            assertTrue(result instanceof ConsumerStats, "run ended with " + result);
            ConsumerStats stats = (ConsumerStats) result;
            assertTrue(stats.streams() > 1, "the member joined again after the kill: " + stats);
            Set<String> missing = new TreeSet<>(before);
            missing.addAll(after);
            missing.removeAll(handled);
            assertNull(missing.isEmpty() ? null : missing, "every message handled");
        } finally {
            if (consumer != null) {
                consumer.stop();
            }
            if (running != null) {
                running.join(TimeUnit.SECONDS.toMillis(15));
            }
            for (LeveeClient client : clients) {
                client.close();
            }
            for (LeveeServer node : nodes) {
                node.close();
            }
        }
    }
}
