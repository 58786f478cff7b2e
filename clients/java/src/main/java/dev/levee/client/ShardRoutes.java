package dev.levee.client;

import dev.levee.v1.ClusterGrpc;
import dev.levee.v1.ErrorCode;
import dev.levee.v1.GetClusterRequest;
import dev.levee.v1.GetClusterResponse;
import dev.levee.v1.Member;
import dev.levee.v1.ShardPlacement;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ScheduledThreadPoolExecutor;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.logging.Level;
import java.util.logging.Logger;

/**
 * Where a replicated cluster's plain-queue appends go (docs/CLUSTER.md, "Part 2"), as the Rust
 * client's {@code ShardRoutes} (crates/levee-client/src/routing.rs). Any node takes any append
 * and forwards each shard's part to the shard's leader; a producer that knows the shard map
 * sends each part straight to its leader and saves the hop.
 *
 * <p>It owns: the view (the cluster's shard count, each shard's leader, the member that
 * answered the last refresh when it was not the seed), one client per member (by node id, its
 * channel opened on first use; at most one per member, closed when the member leaves the
 * cluster or its address changes, and all of them on {@link #close}), and the thread that
 * refreshes the view from {@code GetCluster} every {@link #REFRESH_INTERVAL} and soon after a
 * failed send ({@link #refreshSoon}), asking the seed node first, then every other member
 * known, until one answers. A cluster that does not replicate its queues (or a server without
 * the Cluster service) gives a view that routes nothing: every message goes to the seed.
 */
final class ShardRoutes implements AutoCloseable {
    private static final Logger LOG = Logger.getLogger(ShardRoutes.class.getName());
    /** How often the view is asked for again while the producer runs. */
    static final Duration REFRESH_INTERVAL = Duration.ofSeconds(1);
    /** Deadline of one GetCluster call (a dead member is given up on soon). */
    static final Duration REFRESH_CALL_TIMEOUT = Duration.ofSeconds(1);
    /** Least time between the end of a refresh and one asked for by a failure. */
    static final long REFRESH_AFTER_FAILURE_MIN_NANOS = TimeUnit.MILLISECONDS.toNanos(50);

    /** A member the producer may send to. */
    static final class Route {
        final long nodeId;
        final String address;
        final LeveeClient client;
        /** Whether its channel is the routes' own (the seed's belongs to the producer's client). */
        final boolean owned;
        /** Append requests answered through it (for tests and operators). */
        final AtomicLong appends = new AtomicLong();

        Route(long nodeId, String address, LeveeClient client, boolean owned) {
            this.nodeId = nodeId;
            this.address = address;
            this.client = client;
            this.owned = owned;
        }

        /** Closes its channel if it is the routes' own: at once, or letting calls finish. */
        void close(boolean now) {
            if (!owned) {
                return;
            }
            if (now) {
                client.close();
            } else {
                client.channel().shutdown();
            }
        }
    }

    /** What one refresh learnt; replaced whole, never changed. */
    static final class View {
        /** The cluster's shards; 0: nothing routed (not known, or queues not replicated). */
        final int shards;
        /** Each shard's leader node id (0: none known). */
        final long[] leaders;
        /** The member routes by node id. */
        final Map<Long, Route> routes;
        /**
         * Where a message without a known leader goes: the seed, or the member that answered
         * the refresh when the seed did not (any node of a replicating cluster forwards).
         */
        final Route fallback;

        View(int shards, long[] leaders, Map<Long, Route> routes, Route fallback) {
            this.shards = shards;
            this.leaders = leaders;
            this.routes = routes;
            this.fallback = fallback;
        }

        /** Whether messages are split by their shard's leader. */
        boolean routing() {
            return shards > 0;
        }

        /** Where {@code queue}'s appends go: its shard's leader when known, else the fallback. */
        Route route(byte[] queue) {
            if (shards == 0) {
                return fallback;
            }
            long leader = leaders[Routing.shardOf(queue, shards)];
            Route route = leader == 0 ? null : routes.get(leader);
            return route != null ? route : fallback;
        }
    }

    private final Route seed;
    private final ClientOptions memberOptions;
    private final ScheduledThreadPoolExecutor refresher;
    private volatile View view;
    /** Guarded by this: the members' routes, by node id (at most one per member). */
    private final Map<Long, Route> members = new HashMap<>();
    /** Guarded by this: a refresh asked for by a failure and not started yet. */
    private CompletableFuture<Void> pending;
    /** Guarded by this: when the last refresh ended (System.nanoTime), or 0. */
    private long refreshedNanos;
    private boolean closed;

    /** Routes learnt through {@code seed}; nothing is routed until the first refresh answers. */
    ShardRoutes(LeveeClient seed) {
        this.seed = new Route(0, seed.address(), seed, false);
        this.memberOptions = seed.options().copy();
        this.view = new View(0, new long[0], Map.of(), this.seed);
        this.refresher = new ScheduledThreadPoolExecutor(1, runnable -> {
            Thread thread = new Thread(runnable, "levee-producer-routes");
            thread.setDaemon(true);
            return thread;
        });
        refresher.scheduleWithFixedDelay(this::refreshQuietly, 0, REFRESH_INTERVAL.toNanos(), TimeUnit.NANOSECONDS);
    }

    View view() {
        return view;
    }

    /** The seed's route (node 0: the node the producer's client is connected to). */
    Route seed() {
        return seed;
    }

    /**
     * Asks for a refresh after a failed send; the future completes once a refresh that started
     * after this call has ended (at once when one ended a moment ago, or the routes are closed).
     * Refreshes asked for together share one.
     */
    synchronized CompletableFuture<Void> refreshSoon() {
        if (closed || (refreshedNanos != 0 && System.nanoTime() - refreshedNanos < REFRESH_AFTER_FAILURE_MIN_NANOS)) {
            return CompletableFuture.completedFuture(null);
        }
        if (pending != null) {
            return pending;
        }
        CompletableFuture<Void> soon = new CompletableFuture<>();
        pending = soon;
        try {
            refresher.execute(() -> {
                synchronized (this) {
                    pending = null;
                }
                try {
                    refreshQuietly();
                } finally {
                    soon.complete(null);
                }
            });
        } catch (java.util.concurrent.RejectedExecutionException stopped) {
            pending = null;
            soon.complete(null);
        }
        return soon;
    }

    /**
     * A periodic refresh: a failure of one (a bug, an answer it cannot take) must not end the
     * schedule, which a task that throws would; the view it had stays.
     */
    private void refreshQuietly() {
        try {
            refresh();
        } catch (RuntimeException error) {
            LOG.log(Level.WARNING, "refreshing a producer's shard routes failed; the routes known stay in use", error);
        }
    }

    /** Asks the seed, then each other member known, for the cluster; takes the first answer. */
    void refresh() {
        List<Route> asked = new ArrayList<>();
        asked.add(seed);
        synchronized (this) {
            if (closed) {
                return;
            }
            asked.addAll(new TreeMap<>(members).values());
        }
        for (Route route : asked) {
            GetClusterResponse cluster;
            try {
                cluster = route.client.call(() -> ClusterGrpc.newBlockingStub(route.client.channel())
                        .withDeadlineAfter(REFRESH_CALL_TIMEOUT.toNanos(), TimeUnit.NANOSECONDS)
                        .getCluster(GetClusterRequest.getDefaultInstance()));
            } catch (LeveeException error) {
                if (error.code() == ErrorCode.ERROR_CODE_UNIMPLEMENTED) {
                    break; // a server without the Cluster service: nothing to route
                }
                continue; // this member is down or cut off: ask the next
            } catch (RuntimeException error) {
                continue;
            }
            learn(cluster, route);
            return;
        }
        synchronized (this) {
            refreshedNanos = System.nanoTime();
        }
    }

    /** Takes what {@code answering} said: the shard map, the leaders and the members. */
    private synchronized void learn(GetClusterResponse cluster, Route answering) {
        refreshedNanos = System.nanoTime();
        if (closed) {
            return;
        }
        Map<Long, String> addresses = new HashMap<>();
        for (Member member : cluster.getMembersList()) {
            if (member.getNodeId() != 0 && !member.getGrpcAddr().isEmpty()) {
                addresses.put(member.getNodeId(), member.getGrpcAddr());
            }
        }
        // One route per member: a member gone, or at another address, has its channel closed
        // (gracefully: a request on it finishes; a resend goes to the route then known).
        members.entrySet().removeIf(entry -> {
            String address = addresses.get(entry.getKey());
            if (address != null && address.equals(entry.getValue().address)) {
                return false;
            }
            entry.getValue().close(false);
            return true;
        });
        for (Map.Entry<Long, String> member : addresses.entrySet()) {
            if (members.containsKey(member.getKey())) {
                continue;
            }
            String address = member.getValue();
            // The seed's own node shares the seed's channel.
            members.put(member.getKey(), Channels.target(address).equals(Channels.target(seed.address))
                    ? new Route(member.getKey(), address, seed.client, false)
                    : new Route(member.getKey(), address,
                            LeveeClient.lazy(address, memberOptions, seed.client.producerName()), true));
        }
        if (!cluster.getReplicatedQueues() || cluster.getShards() == 0) {
            // Each node's queues are its own: every append goes to the seed, as without routes.
            view = new View(0, new long[0], Map.of(), seed);
            return;
        }
        Route fallback = answering == seed ? seed : members.getOrDefault(answering.nodeId, seed);
        int shards = cluster.getShards();
        long[] leaders = new long[shards];
        for (ShardPlacement placement : cluster.getShardMapList()) {
            if (placement.getShard() >= 0 && placement.getShard() < shards) {
                leaders[placement.getShard()] = placement.getLeaderId();
            }
        }
        view = new View(shards, leaders, Map.copyOf(members), fallback);
    }

    /** Append requests answered through {@code nodeId}'s route (0: the seed); for tests. */
    long appendsThrough(long nodeId) {
        if (nodeId == 0) {
            return seed.appends.get();
        }
        synchronized (this) {
            Route route = members.get(nodeId);
            return route == null ? 0 : route.appends.get();
        }
    }

    /** Stops refreshing and closes every member's channel (the seed's is its owner's). */
    @Override
    public void close() {
        List<Route> routes;
        synchronized (this) {
            closed = true;
            routes = new ArrayList<>(members.values());
            members.clear();
            view = new View(0, new long[0], Map.of(), seed);
        }
        refresher.shutdownNow();
        for (Route route : routes) {
            route.close(true);
        }
    }
}
