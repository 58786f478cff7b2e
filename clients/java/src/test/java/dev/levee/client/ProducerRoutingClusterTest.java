package dev.levee.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import dev.levee.v1.ErrorCode;
import dev.levee.v1.GetClusterResponse;
import dev.levee.v1.ReadResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicLong;
import java.util.function.BooleanSupplier;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * A routing producer against three {@code levee server} processes forming a cluster that
 * replicates its queues (docs/CLUSTER.md, "Part 2"), as crates/levee/tests/replicated.rs starts
 * them: appends through node 1 go straight to each shard's leader and every node holds every
 * acknowledged message once at its acknowledged offset; kill -9 the seed node while it leads a
 * shard under appends: the producer learns the new leaders from the other members, appends go
 * on, and the survivors hold every acknowledged message exactly once.
 */
class ProducerRoutingClusterTest {
    /** Shards of the test's cluster: node 1 is the preferred replica of shard 1. */
    private static final int SHARDS = 4;
    /** How long the cluster may take to form and place its shards, or elect a new leader. */
    private static final long CONVERGE_MS = ReplicatedCluster.CONVERGE_MS;
    /** How long one append may take to be answered (retries included). */
    private static final long ANSWER_S = 30;

    private static void await(String what, long millis, BooleanSupplier condition) throws InterruptedException {
        ReplicatedCluster.await(what, millis, condition);
    }

    /** Nodes 1, 2 and 3 of a new cluster that replicates its queues (2 and 3 joining node 1). */
    private static List<LeveeServer> threeNodes(List<LeveeServer> nodes) throws Exception {
        return ReplicatedCluster.threeNodes(nodes, SHARDS);
    }

    /** {@link ReplicatedCluster#waitSettled}: each shard's leader. */
    private static Map<Integer, Long> waitSettled(List<LeveeClient> clients) throws InterruptedException {
        return ReplicatedCluster.waitSettled(clients, SHARDS);
    }

    /** Every message of {@code queue} on a node, from offset 0; the offsets must be dense. */
    private static List<String> readWhole(LeveeClient client, byte[] queue) {
        List<String> messages = new ArrayList<>();
        while (true) {
            ReadResponse read;
            try {
                read = client.read(queue, messages.size(), 10_000, 0);
            } catch (LeveeException error) {
                if (error.code() == ErrorCode.ERROR_CODE_NOT_FOUND) {
                    return messages;
                }
                throw error;
            }
            if (read.getPayloadsCount() == 0) {
                return messages;
            }
            assertEquals(messages.size(), read.getFirstOffset(), "offsets are dense");
            read.getPayloadsList().forEach(payload -> messages.add(payload.toStringUtf8()));
        }
    }

    /**
     * Checks a node's copy of every queue: each acknowledged payload once, at the offset it was
     * acknowledged at, and no payload twice. Waits (bounded) for the node to hold them all: a
     * follower may be a heartbeat behind.
     */
    private static void assertHoldsExactly(String node, LeveeClient client, Map<String, Map<Long, String>> acked)
            throws InterruptedException {
        for (Map.Entry<String, Map<Long, String>> queue : acked.entrySet()) {
            byte[] name = queue.getKey().getBytes(StandardCharsets.UTF_8);
            long needed = queue.getValue().keySet().stream().mapToLong(Long::longValue).max().orElse(-1) + 1;
            List<List<String>> read = new ArrayList<>(List.of(List.of()));
            await(node + " holding " + needed + " messages of " + queue.getKey(), 10_000, () -> {
                read.set(0, readWhole(client, name));
                return read.get(0).size() >= needed;
            });
            List<String> messages = read.get(0);
            assertEquals(messages.size(), new HashSet<>(messages).size(), node + ": a message of " + queue.getKey()
                    + " is stored twice");
            for (Map.Entry<Long, String> message : queue.getValue().entrySet()) {
                assertEquals(message.getValue(), messages.get(Math.toIntExact(message.getKey())),
                        node + ": " + queue.getKey() + " at offset " + message.getKey());
            }
        }
    }

    private static void closeAll(List<LeveeClient> clients, List<LeveeServer> nodes) throws Exception {
        for (LeveeClient client : clients) {
            client.close();
        }
        for (LeveeServer node : nodes) {
            node.close();
        }
    }

    @Test
    @Timeout(value = 90, unit = TimeUnit.SECONDS)
    void given_a_replicated_cluster_when_appending_through_one_node_should_send_to_each_shard_leader_and_store_each_message_once()
            throws Exception {
        List<LeveeServer> nodes = new ArrayList<>();
        List<LeveeClient> clients = new ArrayList<>();
        try {
            threeNodes(nodes);
            for (LeveeServer node : nodes) {
                clients.add(LeveeClient.connect(node.grpcAddr));
            }
            Map<Integer, Long> leaders = waitSettled(clients);
            Map<String, Map<Long, String>> acked = new TreeMap<>();
            try (Producer producer = new Producer(clients.get(0), ProducerOptions.defaults().idempotent(true)
                    .batchMessagesMax(64).linger(Duration.ofMillis(2)))) {
                await("the producer learning the shard leaders", 5_000,
                        () -> producer.routes().view().routing() && producer.routes().view().routes.size() == 3);
                Map<String, CompletableFuture<Long>> sent = new HashMap<>();
                for (int number = 0; number < 2_000; number++) {
                    String queue = "routed-" + (number % 32);
                    String payload = queue + "/" + number;
                    sent.put(payload, producer.send(queue.getBytes(StandardCharsets.UTF_8),
                            payload.getBytes(StandardCharsets.UTF_8)));
                }
                for (Map.Entry<String, CompletableFuture<Long>> message : sent.entrySet()) {
                    long offset = message.getValue().get(ANSWER_S, TimeUnit.SECONDS);
                    String queue = message.getKey().substring(0, message.getKey().indexOf('/'));
                    String earlier = acked.computeIfAbsent(queue, ignored -> new TreeMap<>()).put(offset, message.getKey());
                    assertEquals(null, earlier, "two messages acknowledged at " + queue + " offset " + offset);
                }
                // Straight to the leaders: nothing through the seed, and every leader had some.
                assertEquals(0, producer.routes().appendsThrough(0), "appends sent to the seed instead of a leader");
                for (long leader : new HashSet<>(leaders.values())) {
                    assertTrue(producer.routes().appendsThrough(leader) > 0, "no append sent to node " + leader
                            + ", which leads shards " + leaders);
                }
                assertEquals(0, producer.stats().messagesFailed());
            }
            for (int index = 0; index < nodes.size(); index++) {
                assertHoldsExactly("node " + (index + 1), clients.get(index), acked);
            }
        } finally {
            closeAll(clients, nodes);
        }
    }

    @Test
    @Timeout(value = 60, unit = TimeUnit.SECONDS)
    void given_a_cluster_that_does_not_replicate_its_queues_when_producing_should_append_through_the_client_only()
            throws Exception {
        List<LeveeServer> nodes = new ArrayList<>();
        List<LeveeClient> clients = new ArrayList<>();
        try {
            for (int id = 1; id <= 3; id++) {
                List<String> flags = new ArrayList<>(List.of("--node-id", Integer.toString(id), "--peer-addr",
                        "127.0.0.1:0", "--shards", Integer.toString(SHARDS)));
                if (id > 1) {
                    flags.addAll(List.of("--join", nodes.get(0).peerAddr));
                }
                LeveeServer node = new LeveeServer(flags);
                nodes.add(node);
                node.start();
                clients.add(LeveeClient.connect(node.grpcAddr));
            }
            LeveeClient second = clients.get(1);
            await("node 2 knowing three members and the shards", CONVERGE_MS, () -> {
                GetClusterResponse cluster = second.clusterStatus();
                return cluster.getMembersCount() == 3 && cluster.getShards() == SHARDS;
            });
            assertTrue(!second.clusterStatus().getReplicatedQueues(), "the cluster does not replicate its queues");
            try (Producer producer = new Producer(second, ProducerOptions.defaults().idempotent(true))) {
                producer.routes().refresh();
                assertTrue(!producer.routes().view().routing(), "nothing is routed by shard");
                List<CompletableFuture<Long>> sent = new ArrayList<>();
                for (int number = 0; number < 200; number++) {
                    sent.add(producer.send(("own-" + (number % 8)).getBytes(StandardCharsets.UTF_8),
                            ("m" + number).getBytes(StandardCharsets.UTF_8)));
                }
                for (CompletableFuture<Long> answer : sent) {
                    answer.get(ANSWER_S, TimeUnit.SECONDS);
                }
                assertEquals(producer.stats().batchesSent(), producer.routes().appendsThrough(0),
                        "every append went through the producer's client");
            }
            // Each node's queues are its own: node 2 holds them all, the others none.
            for (int index = 0; index < 3; index++) {
                long held = 0;
                for (int queue = 0; queue < 8; queue++) {
                    held += readWhole(clients.get(index), ("own-" + queue).getBytes(StandardCharsets.UTF_8)).size();
                }
                assertEquals(index == 1 ? 200 : 0, held, "messages held by node " + (index + 1));
            }
        } finally {
            closeAll(clients, nodes);
        }
    }

    @Test
    @Timeout(value = 120, unit = TimeUnit.SECONDS)
    void given_a_routing_idempotent_producer_when_the_seed_node_leading_a_shard_is_killed_should_go_on_without_loss_or_duplicates()
            throws Exception {
        List<LeveeServer> nodes = new ArrayList<>();
        List<LeveeClient> clients = new ArrayList<>();
        try {
            threeNodes(nodes);
            for (LeveeServer node : nodes) {
                clients.add(LeveeClient.connect(node.grpcAddr));
            }
            Map<Integer, Long> leaders = waitSettled(clients);
            assertTrue(leaders.containsValue(1L), "node 1 leads a shard once settled: " + leaders);
            assertTrue(java.util.stream.IntStream.range(0, 16)
                    .anyMatch(index -> leaders.get(Routing.shardOf("failover-" + index, SHARDS)) == 1L),
                    "some queue appended to is in a shard node 1 leads");
            // queue -> offset -> payload, for every acknowledged append.
            Map<String, Map<Long, String>> acked = new ConcurrentHashMap<>();
            AtomicLong acknowledged = new AtomicLong();
            List<String> failures = java.util.Collections.synchronizedList(new ArrayList<>());
            AtomicBoolean stop = new AtomicBoolean();
            // The default resends ride out the failover: 10 of them, 10 ms doubling up to 100 ms.
            ProducerOptions options = ProducerOptions.defaults().idempotent(true).batchMessagesMax(32)
                    .linger(Duration.ofMillis(2));
            try (Producer producer = new Producer(clients.get(0), options)) {
                await("the producer learning the shard leaders", 5_000, () -> producer.routes().view().routing());
                Thread writer = new Thread(() -> {
                    // Rounds of appends over every shard, each round awaited: bounded by the
                    // stop flag, a count, and the answer timeout.
                    for (int round = 0; round < 10_000 && !stop.get() && failures.isEmpty(); round++) {
                        Map<String, CompletableFuture<Long>> sent = new HashMap<>();
                        for (int index = 0; index < 32; index++) {
                            String queue = "failover-" + (index % 16);
                            String payload = queue + "/" + round + "/" + index;
                            sent.put(payload, producer.send(queue.getBytes(StandardCharsets.UTF_8),
                                    payload.getBytes(StandardCharsets.UTF_8)));
                        }
                        for (Map.Entry<String, CompletableFuture<Long>> message : sent.entrySet()) {
                            String queue = message.getKey().substring(0, message.getKey().indexOf('/'));
                            try {
                                long offset = message.getValue().get(ANSWER_S, TimeUnit.SECONDS);
                                String earlier = acked.computeIfAbsent(queue, ignored -> new ConcurrentHashMap<>())
                                        .put(offset, message.getKey());
                                if (earlier != null) {
                                    failures.add("two messages acknowledged at " + queue + " offset " + offset);
                                }
                                acknowledged.incrementAndGet();
                            } catch (Exception error) {
                                failures.add(message.getKey() + ": " + error);
                            }
                        }
                    }
                }, "appender");
                writer.start();
                try {
                    await("appends before the kill", 20_000, () -> acknowledged.get() >= 500 || !failures.isEmpty());
                    nodes.get(0).kill();
                    long atKill = acknowledged.get();
                    await("appends going on after the election", CONVERGE_MS,
                            () -> acknowledged.get() >= atKill + 1_000 || !failures.isEmpty());
                } finally {
                    stop.set(true);
                    writer.join(TimeUnit.SECONDS.toMillis(ANSWER_S * 2));
                }
                assertTrue(!writer.isAlive(), "the appender stopped");
                assertEquals(List.of(), failures, "appends failed or were acknowledged twice");
                assertTrue(producer.stats().retries() > 0, "the kill made the producer resend");
            }
            Map<String, Map<Long, String>> whole = new TreeMap<>(acked);
            for (int index = 1; index < nodes.size(); index++) {
                assertHoldsExactly("node " + (index + 1), clients.get(index), whole);
            }
        } finally {
            closeAll(clients, nodes);
        }
    }
}
