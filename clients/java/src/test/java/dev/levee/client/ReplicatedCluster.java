package dev.levee.client;

import static org.junit.jupiter.api.Assertions.assertTrue;

import dev.levee.v1.GetClusterResponse;
import dev.levee.v1.ShardPlacement;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.concurrent.TimeUnit;
import java.util.function.BooleanSupplier;

/**
 * Three {@code levee server} processes forming a cluster that replicates its queues
 * (docs/CLUSTER.md, "Part 2"), as crates/levee/tests/support starts them: node 1 creates the
 * cluster, nodes 2 and 3 join it, and the tests wait until every shard is placed on the three
 * nodes and led by its preferred replica.
 */
final class ReplicatedCluster {
    static final long[] VOTERS = {1, 2, 3};
    /** How long the cluster may take to form and place its shards, or elect a new leader. */
    static final long CONVERGE_MS = 30_000;

    private ReplicatedCluster() {}

    /** Waits (polling every 50 ms) until {@code condition} holds; fails after {@code millis}. */
    static void await(String what, long millis, BooleanSupplier condition) throws InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(millis);
        while (!condition.getAsBoolean()) {
            assertTrue(System.nanoTime() < deadline, "timed out waiting for " + what);
            Thread.sleep(50);
        }
    }

    /**
     * Starts nodes 1, 2 and 3 of a new cluster of {@code shards} shards that replicates its
     * queues (2 and 3 joining node 1), adding each to {@code nodes} as it starts (so the caller
     * closes those started even when a later one fails).
     */
    static List<LeveeServer> threeNodes(List<LeveeServer> nodes, int shards) throws Exception {
        for (int id = 1; id <= 3; id++) {
            List<String> flags = new ArrayList<>(List.of("--node-id", Integer.toString(id), "--peer-addr",
                    "127.0.0.1:0", "--shards", Integer.toString(shards), "--replicated-queues", "true"));
            if (id > 1) {
                flags.addAll(List.of("--join", nodes.get(0).peerAddr));
            }
            LeveeServer node = new LeveeServer(flags);
            nodes.add(node);
            node.start();
        }
        return nodes;
    }

    /**
     * Waits until every node answers GetCluster with every shard on the three nodes, none
     * changing, led by its preferred replica, all nodes agreeing; returns each shard's leader.
     */
    static Map<Integer, Long> waitSettled(List<LeveeClient> clients, int shards) throws InterruptedException {
        Map<Integer, Long> leaders = new TreeMap<>();
        await("every shard placed on the three nodes and led by its preferred replica", CONVERGE_MS, () -> {
            leaders.clear();
            for (LeveeClient client : clients) {
                GetClusterResponse cluster;
                try {
                    cluster = client.clusterStatus();
                } catch (LeveeException notYet) {
                    return false;
                }
                if (!cluster.getReplicatedQueues() || cluster.getShards() != shards
                        || cluster.getShardMapCount() != shards) {
                    return false;
                }
                for (ShardPlacement placement : cluster.getShardMapList()) {
                    Set<Long> voters = new HashSet<>(placement.getVotersList());
                    long preferred = Routing.shardReplicas(placement.getShard(), VOTERS).get(0);
                    if (placement.getChanging() || !voters.equals(Set.of(1L, 2L, 3L))
                            || placement.getLeaderId() != preferred) {
                        return false;
                    }
                    leaders.put(placement.getShard(), placement.getLeaderId());
                }
            }
            return true;
        });
        return leaders;
    }
}
