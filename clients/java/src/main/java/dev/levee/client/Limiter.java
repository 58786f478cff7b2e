package dev.levee.client;

import dev.levee.v1.BreakerStatus;
import dev.levee.v1.CallStats;
import dev.levee.v1.ClusterGrpc;
import dev.levee.v1.ErrorCode;
import dev.levee.v1.GetClusterRequest;
import dev.levee.v1.GetClusterResponse;
import dev.levee.v1.KeyLimit;
import dev.levee.v1.KeyLimits;
import dev.levee.v1.LeaseDemand;
import dev.levee.v1.LeaseGrant;
import dev.levee.v1.LeaseRequest;
import dev.levee.v1.LeaseResponse;
import dev.levee.v1.LimitsGrpc;
import dev.levee.v1.Member;
import dev.levee.v1.MemberRole;
import io.grpc.ManagedChannel;
import io.grpc.stub.StreamObserver;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ArrayBlockingQueue;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.ThreadLocalRandom;
import java.util.concurrent.TimeUnit;

/**
 * Cluster-wide limits decided locally (docs/LIMITS.md), as the Rust client's {@code Limiter}.
 * {@link #tryAcquire} spends permits from the lease this client holds for the resource: no
 * network, never throws. A background thread keeps one {@code Limits.Leases} session with the
 * cluster's leader (found through any node's {@code GetCluster}) and, a little before each
 * lease ends, asks for each resource's lease of the next period, sized from the permits asked
 * for in the last period; a period's grants never pass the resource's budget, so the cap can
 * only be missed from below. While no lease is held (a resource's first period; the leader out
 * of reach) a resource answers from its fallback: {@link LimiterOptions#fallbackPermits()} per
 * lease period (0: refuse), counted in {@link Stats#fallbackDecisions()}.
 *
 * <p>Beside the permits: {@link #tryAcquireKey} holds a key to this client's share of the
 * rule's per-key limits; {@link #tryCall} takes a permit and reports how the call ended (for
 * the rule's breaker and adaptive budget); {@link #breaker} says what the last grant said of
 * the rule's breaker. Every method is safe from any thread.
 */
public final class Limiter implements AutoCloseable {
    /** Most resources one limiter follows (the server takes at most 1000 a request). */
    public static final int RESOURCES_MAX = 1_000;
    /** Keys one resource's per-key table holds at once. */
    public static final int KEYS_TRACKED_MAX = 100_000;
    private static final long DAY_NANOS = TimeUnit.DAYS.toNanos(1);

    /** What a limiter did so far. */
    public record Stats(long admitted, long refused, long keyRefused, long fallbackDecisions,
            long leasesReceived, boolean connected) {}

    private static final class Slot {
        long tokens;
        long starts;
        long expires;

        boolean isCurrent(long now) {
            return starts <= now && now < expires;
        }
    }

    /** This client's share of a rule's per-key limits: GCRA per key. */
    private static final class KeyShares {
        final long version;
        final long clients;
        final long periodNanos;
        final long[] fallbackRule;
        final boolean limitAll;
        final Map<ByteKey, long[]> listed = new HashMap<>();
        final Map<ByteKey, Long> tat = new HashMap<>();

        KeyShares(KeyLimits limits) {
            version = limits.getVersion();
            clients = Math.max(1, limits.getClients());
            periodNanos = TimeUnit.MILLISECONDS.toNanos(Math.max(1, limits.getPeriodMs()));
            limitAll = limits.getDefaultPermits() > 0;
            fallbackRule = limitAll ? rule(limits.getDefaultPermits()) : null;
            for (KeyLimit limit : limits.getKeysList()) {
                listed.put(new ByteKey(limit.getKey().toByteArray()), rule(limit.getPermits()));
            }
        }

        /** {nanoseconds per permit, burst}; null when the share rounds to nothing. */
        long[] rule(long permits) {
            double sharePeriod = (double) periodNanos * clients;
            double share = permits;
            if (sharePeriod > DAY_NANOS) {
                share = Math.floor(permits * (DAY_NANOS / sharePeriod));
                sharePeriod = DAY_NANOS;
            }
            if (share < 1) {
                return null;
            }
            long burst = Math.min(Math.max(1, permits / (clients * 10)), (long) share);
            return new long[] {(long) Math.ceil(sharePeriod / share), burst};
        }

        boolean tryAcquire(ByteKey key, long permits, long now) {
            long[] rule;
            if (listed.containsKey(key)) {
                rule = listed.get(key);
            } else if (limitAll) {
                rule = fallbackRule;
            } else {
                return true;
            }
            if (rule == null) {
                return false;
            }
            if (permits > rule[1]) {
                return false;
            }
            Long known = tat.get(key);
            if (known == null && tat.size() >= KEYS_TRACKED_MAX) {
                // Recovered keys answer as fresh ones would: drop those among a few; else
                // refuse the new key.
                int looked = 0;
                for (Iterator<Map.Entry<ByteKey, Long>> it = tat.entrySet().iterator(); it.hasNext() && looked < 32;) {
                    looked++;
                    if (it.next().getValue() - now <= 0) {
                        it.remove();
                    }
                }
                if (tat.size() >= KEYS_TRACKED_MAX) {
                    return false;
                }
            }
            long from = known == null || known - now < 0 ? now : known;
            long next = from + rule[0] * permits;
            if (next - now > rule[0] * rule[1]) {
                return false;
            }
            tat.put(key, next);
            return true;
        }
    }

    private static final class Resource {
        final Slot[] slots = {new Slot(), new Slot()};
        long wanted;
        long fallback;
        long calls;
        long errors;
        long slow;
        long latencySumMicros;
        long slowCallNanos;
        BreakerStatus breaker = BreakerStatus.BREAKER_STATUS_UNSPECIFIED;
        KeyShares keys;

        Slot current(long now) {
            for (Slot slot : slots) {
                if (slot.isCurrent(now)) {
                    return slot;
                }
            }
            return null;
        }
    }

    private final LimiterOptions options;
    private final long clientId = ThreadLocalRandom.current().nextLong(1, Long.MAX_VALUE);
    private final Map<String, Resource> resources = new HashMap<>();
    private final Thread thread;
    private volatile boolean closed;
    private volatile boolean connected;
    private long admitted;
    private long refused;
    private long keyRefused;
    private long fallbackDecisions;
    private long leasesReceived;

    private Limiter(LimiterOptions options) {
        this.options = options;
        this.thread = new Thread(this::run, "levee-limiter");
        this.thread.setDaemon(true);
    }

    /** Starts the lease session in the background; returns at once. */
    public static Limiter start(LimiterOptions options) {
        options.validate();
        Limiter limiter = new Limiter(options);
        limiter.thread.start();
        return limiter;
    }

    /** This limiter's client id in its lease session. */
    public long clientId() {
        return clientId;
    }

    private Resource resource(String name) {
        Resource state = resources.get(name);
        if (state == null && resources.size() < RESOURCES_MAX) {
            state = new Resource();
            state.fallback = options.fallbackPermits();
            resources.put(name, state);
        }
        return state;
    }

    private boolean decide(Resource state, long permits, long now) {
        boolean ok = false;
        if (state != null) {
            state.wanted += permits;
            Slot slot = state.current(now);
            if (slot != null) {
                ok = slot.tokens >= permits;
                if (ok) {
                    slot.tokens -= permits;
                }
            } else {
                fallbackDecisions++;
                ok = state.fallback >= permits;
                if (ok) {
                    state.fallback -= permits;
                }
            }
        }
        if (ok) {
            admitted += permits;
        } else {
            refused += permits;
        }
        return ok;
    }

    /** Takes {@code permits} of {@code resource} if the lease (or the fallback) has them. */
    public synchronized boolean tryAcquire(String resource, long permits) {
        if (permits < 0) {
            return false; // refused, counted nowhere
        }
        return decide(resource(resource), permits, System.nanoTime());
    }

    /** Takes one permit of {@code resource}; as {@link #tryAcquire(String, long)}. */
    public boolean tryAcquire(String resource) {
        return tryAcquire(resource, 1);
    }

    /**
     * Takes {@code permits} of {@code key}: its share of the rule's per-key limits, then the
     * lease. A key refused by its limit is counted refused and not as demand.
     */
    public synchronized boolean tryAcquireKey(String resource, byte[] key, long permits) {
        if (permits < 0) {
            return false; // refused, counted nowhere
        }
        long now = System.nanoTime();
        Resource state = resource(resource);
        if (state != null && state.keys != null && !state.keys.tryAcquire(new ByteKey(key), permits, now)) {
            refused += permits;
            keyRefused += permits;
            return false;
        }
        return decide(state, permits, now);
    }

    /**
     * Takes {@code permits}, waiting up to {@code timeout} for a later lease (blocking); the
     * demand is counted again for each lease period it waits.
     */
    public boolean acquire(String resource, long permits, Duration timeout) throws InterruptedException {
        if (permits < 0) {
            return false;
        }
        if (tryAcquire(resource, permits)) {
            return true;
        }
        long deadline = System.nanoTime() + timeout.toNanos();
        long period = options.leaseInterval().toNanos();
        long wantedAgain = System.nanoTime() + period;
        while (System.nanoTime() < deadline) {
            Thread.sleep(5);
            synchronized (this) {
                long now = System.nanoTime();
                Resource state = resource(resource);
                if (state == null) {
                    return false;
                }
                if (now >= wantedAgain) {
                    state.wanted += permits;
                    wantedAgain = now + period;
                }
                Slot slot = state.current(now);
                if (slot != null && slot.tokens >= permits) {
                    slot.tokens -= permits;
                } else if (slot == null && state.fallback >= permits) {
                    state.fallback -= permits;
                } else {
                    continue;
                }
                refused -= permits;
                admitted += permits;
                return true;
            }
        }
        return false;
    }

    /** Reports a call that ended (for the rule's breaker and adaptive budget). */
    public synchronized void record(String resource, boolean succeeded, Duration latency) {
        Resource state = resource(resource);
        if (state == null) {
            return;
        }
        state.calls++;
        if (!succeeded) {
            state.errors++;
            return;
        }
        long nanos = latency.toNanos();
        if (state.slowCallNanos > 0 && nanos > state.slowCallNanos) {
            state.slow++;
        }
        state.latencySumMicros += nanos / 1_000;
    }

    /** A call admitted by {@link #tryCall}: {@link #success()} reports it done; closing it unreported is a failure. */
    public final class Call implements AutoCloseable {
        private final String resource;
        private final long started = System.nanoTime();
        private boolean reported;

        private Call(String resource) {
            this.resource = resource;
        }

        /** The call succeeded. */
        public void success() {
            report(true);
        }

        /** The call failed. */
        public void failure() {
            report(false);
        }

        private void report(boolean succeeded) {
            if (!reported) {
                reported = true;
                record(resource, succeeded, Duration.ofNanos(System.nanoTime() - started));
            }
        }

        @Override
        public void close() {
            report(false);
        }
    }

    /** One permit of {@code resource} and a {@link Call} to report its outcome; null when refused. */
    public Call tryCall(String resource) {
        return tryAcquire(resource, 1) ? new Call(resource) : null;
    }

    /** The rule's breaker as the last grant said ({@code UNSPECIFIED}: none, or no grant yet). */
    public synchronized BreakerStatus breaker(String resource) {
        Resource state = resources.get(resource);
        return state == null ? BreakerStatus.BREAKER_STATUS_UNSPECIFIED : state.breaker;
    }

    /** What the limiter did so far. */
    public synchronized Stats stats() {
        return new Stats(admitted, refused, keyRefused, fallbackDecisions, leasesReceived, connected);
    }

    /** Stops the lease session. */
    @Override
    public void close() throws InterruptedException {
        closed = true;
        thread.interrupt();
        thread.join(5_000);
    }

    // ---- the background thread

    private void run() {
        int turn = 0;
        while (!closed) {
            String seed = options.servers().get(turn++ % options.servers().size());
            try {
                session(seed);
            } catch (InterruptedException interrupted) {
                return;
            } catch (RuntimeException failed) {
                // The leader moved or is out of reach: fall back, then try again.
            }
            connected = false;
            synchronized (this) {
                for (Resource state : resources.values()) {
                    state.fallback = options.fallbackPermits();
                }
            }
            try {
                Thread.sleep(options.leaseInterval().toMillis());
            } catch (InterruptedException interrupted) {
                return;
            }
        }
    }

    private String leader(String seed) {
        ManagedChannel channel = Channels.open(seed);
        try {
            GetClusterResponse view = ClusterGrpc.newBlockingStub(channel)
                    .withDeadlineAfter(options.connectTimeout().toMillis(), TimeUnit.MILLISECONDS)
                    .getCluster(GetClusterRequest.getDefaultInstance());
            for (Member member : view.getMembersList()) {
                if (member.getRole() == MemberRole.MEMBER_ROLE_LEADER) {
                    return member.getGrpcAddr();
                }
            }
            return seed;
        } finally {
            channel.shutdownNow();
        }
    }

    private void session(String seed) throws InterruptedException {
        String leader = leader(seed);
        ManagedChannel channel = Channels.open(leader);
        BlockingQueue<Object> answers = new ArrayBlockingQueue<>(4);
        StreamObserver<LeaseRequest> requests = LimitsGrpc.newStub(channel).leases(new StreamObserver<>() {
            @Override
            public void onNext(LeaseResponse answer) {
                answers.offer(answer);
            }

            @Override
            public void onError(Throwable error) {
                answers.offer(error);
            }

            @Override
            public void onCompleted() {
                answers.offer(new IllegalStateException("the leader ended the lease session"));
            }
        });
        try {
            connected = true;
            long interval = options.leaseInterval().toNanos();
            while (!closed) {
                long sent = System.nanoTime();
                requests.onNext(request());
                Object answer = answers.poll(options.connectTimeout().toMillis(), TimeUnit.MILLISECONDS);
                if (!(answer instanceof LeaseResponse response)) {
                    throw new IllegalStateException("no lease answer: " + answer);
                }
                long endsIn = apply(response, sent);
                long sleep = Math.max(interval / 20, Math.min(endsIn, 2 * interval) - interval / 10);
                TimeUnit.NANOSECONDS.sleep(sleep);
            }
        } finally {
            requests.onCompleted();
            channel.shutdownNow();
        }
    }

    private synchronized LeaseRequest request() {
        LeaseRequest.Builder request = LeaseRequest.newBuilder().setClientId(clientId);
        for (Map.Entry<String, Resource> entry : resources.entrySet()) {
            Resource state = entry.getValue();
            LeaseDemand.Builder demand = LeaseDemand.newBuilder()
                    .setResource(entry.getKey())
                    .setDemand(state.wanted)
                    .setKeysVersion(state.keys == null ? 0 : state.keys.version);
            if (state.calls > 0) {
                demand.setStats(CallStats.newBuilder().setCalls(state.calls).setErrors(state.errors)
                        .setSlow(state.slow).setLatencySumUs(state.latencySumMicros));
                state.calls = state.errors = state.slow = state.latencySumMicros = 0;
            }
            state.wanted = 0;
            request.addDemands(demand);
        }
        return request.build();
    }

    /** Each grant replaces the lease not being spent; the nanoseconds until the first expires. */
    private synchronized long apply(LeaseResponse answer, long sent) {
        leasesReceived++;
        long now = System.nanoTime();
        List<Long> ends = new ArrayList<>();
        for (LeaseGrant grant : answer.getGrantsList()) {
            Resource state = resources.get(grant.getResource());
            if (state == null) {
                continue;
            }
            state.breaker = grant.getBreaker();
            state.slowCallNanos = TimeUnit.MILLISECONDS.toNanos(grant.getSlowCallMs());
            if (grant.hasKeyLimits()) {
                state.keys = grant.getKeyLimits().getVersion() == 0 ? null : new KeyShares(grant.getKeyLimits());
            }
            Slot current = state.current(now);
            if (grant.getTopUp() > 0 && current != null) {
                current.tokens += grant.getTopUp();
            }
            Slot slot = state.slots[0].isCurrent(now) ? state.slots[1] : state.slots[0];
            if (grant.getUnknownResource()) {
                slot.tokens = 0;
                slot.expires = 0;
                continue;
            }
            long starts = sent + TimeUnit.MILLISECONDS.toNanos(grant.getStartsInMs());
            if (current != null && current != slot) {
                starts = Math.min(starts, current.expires);
            }
            slot.starts = starts;
            slot.expires = sent + TimeUnit.MILLISECONDS.toNanos(grant.getValidMs());
            slot.tokens = grant.getPermits();
            ends.add(TimeUnit.MILLISECONDS.toNanos(grant.getValidMs()));
        }
        return ends.stream().min(Long::compare).orElse(options.leaseInterval().toNanos());
    }

    static LeveeException invalid(String message) {
        return LeveeException.of(ErrorCode.ERROR_CODE_INVALID_ARGUMENT, message);
    }
}
