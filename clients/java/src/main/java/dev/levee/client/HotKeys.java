package dev.levee.client;

import com.google.protobuf.ByteString;
import dev.levee.v1.HotKeyClientMessage;
import dev.levee.v1.HotKeyEvent;
import dev.levee.v1.HotKeyServerMessage;
import dev.levee.v1.HotKeySource;
import dev.levee.v1.HotKeysGrpc;
import dev.levee.v1.KeyReport;
import dev.levee.v1.ReportBatch;
import io.grpc.ManagedChannel;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import io.grpc.stub.StreamObserver;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ArrayBlockingQueue;
import java.util.concurrent.Callable;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledThreadPoolExecutor;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.LongAdder;
import java.util.function.Consumer;
import java.util.logging.Level;
import java.util.logging.Logger;

/**
 * The app-server side of hot-key detection, for one app.
 *
 * <p>{@link #isHot} records one access in a local, pre-aggregated buffer and answers from the
 * local set of hot keys; it never waits on the network and never throws (trouble goes to the
 * log and to {@link #stats()}). Every report interval a background thread sends the buffer to
 * the servers, each key to one server chosen by rendezvous hashing over the servers connected
 * at that moment (identical to the Rust client: see {@link Routing}). Each server keeps one
 * long-lived session per app server and pushes hot and cool events on it; a session that
 * breaks is reopened with exponential backoff, and a server's first message on a new session
 * is a snapshot of the app's hot keys, which replaces what this client held from that server.
 *
 * <p>Bounds: the buffer holds at most bufferKeysMax distinct keys (further keys are dropped and
 * counted), each server's queue of report batches at most batchesQueuedPerServerMax (a batch
 * that does not fit, or that a broken session loses, is counted in keysUnsent and
 * batchesUnsent), loads in flight one per hot key.
 *
 * @param <V> the type of locally cached values
 */
public final class HotKeys<V> implements AutoCloseable {
    private static final Logger LOG = Logger.getLogger(HotKeys.class.getName());
    /** A report's count is a uint32: larger buffered counts saturate. */
    static final long REPORT_COUNT_MAX = 0xffffffffL;
    /** A buffered counter that was taken out of the buffer; adds to it fail and start a new one. */
    private static final long RETIRED = Long.MIN_VALUE / 2;

    private final HotKeysOptions options;
    /** Most servers a client holds links to over its life (seeds and members seen). */
    static final int SERVERS_MAX = 64;

    /** Every server seen (seeds, then members as they join); a link runs while active. */
    private volatile long[] seeds;
    /** The channel of the current members stream (closed with the client). */
    private volatile ManagedChannel membersChannel;
    private final List<Link> links = new java.util.concurrent.CopyOnWriteArrayList<>();
    private final ConcurrentHashMap<ByteKey, AtomicLong> buffer = new ConcurrentHashMap<>();
    private final AtomicInteger bufferKeys = new AtomicInteger();
    private final ConcurrentHashMap<ByteKey, LocalHot<V>> hot = new ConcurrentHashMap<>();
    private final ConcurrentHashMap<ByteKey, CompletableFuture<V>> flights = new ConcurrentHashMap<>();
    private final List<Consumer<HotKeyChange>> listeners = new CopyOnWriteArrayList<>();
    private final ScheduledExecutorService background;
    private final Object applyLock = new Object();
    private volatile boolean closed;
    private volatile boolean invalidLogged;

    private final LongAdder accessesRecorded = new LongAdder();
    private final LongAdder accessesDropped = new LongAdder();
    private final AtomicLong keysReported = new AtomicLong();
    private final AtomicLong keysUnsent = new AtomicLong();
    private final AtomicLong batchesUnsent = new AtomicLong();
    private final AtomicLong eventsReceived = new AtomicLong();
    private final AtomicLong sessionsOpened = new AtomicLong();
    private final AtomicLong callbackErrors = new AtomicLong();

    private static final class LocalHot<V> {
        volatile long untilNanos;
        volatile int server;
        volatile boolean hasValue;
        volatile V value;

        LocalHot(long untilNanos, int server) {
            this.untilNanos = untilNanos;
            this.server = server;
        }
    }

    private HotKeys(HotKeysOptions options) {
        options.validate();
        this.options = options;
        int servers = options.servers.size();
        this.seeds = new long[servers];
        for (int index = 0; index < servers; index++) {
            seeds[index] = Routing.serverSeed(options.servers.get(index));
        }
        ScheduledThreadPoolExecutor executor = new ScheduledThreadPoolExecutor(1, runnable -> {
            Thread thread = new Thread(runnable, "levee-hotkeys-" + options.app);
            thread.setDaemon(true);
            return thread;
        });
        executor.setRemoveOnCancelPolicy(true);
        this.background = executor;
        for (int index = 0; index < servers; index++) {
            links.add(new Link(index, options.servers.get(index)));
        }
    }

    /**
     * Starts reporting and listening in the background; returns at once (sessions open in the
     * background: see {@link HotKeysStats#serversConnected()}).
     */
    public static <V> HotKeys<V> start(HotKeysOptions options) {
        HotKeys<V> hotKeys = new HotKeys<>(options);
        for (var link : hotKeys.links) {
            hotKeys.background.execute(link::open);
        }
        long interval = options.reportInterval.toNanos();
        hotKeys.background.scheduleAtFixedRate(hotKeys::reportRound, interval, interval, TimeUnit.NANOSECONDS);
        if (options.followCluster) {
            hotKeys.background.execute(() -> hotKeys.watchMembers(0, options.reconnectBackoffMin.toNanos()));
        }
        return hotKeys;
    }

    // ---- following the cluster's members (on the background thread)

    /**
     * Opens a {@code WatchMembers} stream on a seed or a member learnt since (the
     * {@code turn}-th), each update becoming the set of servers; a stream that ends is opened
     * again elsewhere after {@code backoffNanos}, doubling.
     */
    private void watchMembers(int turn, long backoffNanos) {
        if (closed) {
            return;
        }
        java.util.TreeSet<String> candidates = new java.util.TreeSet<>(options.servers);
        for (Link link : links) {
            if (link.active) {
                candidates.add(link.address);
            }
        }
        String address = new ArrayList<>(candidates).get(turn % candidates.size());
        ManagedChannel channel;
        try {
            channel = Channels.open(address);
        } catch (RuntimeException unusable) {
            LOG.warning("cannot open a members stream to " + address + " (" + unusable + "); not following the cluster");
            return;
        }
        ManagedChannel previous = membersChannel;
        membersChannel = channel;
        if (previous != null) {
            previous.shutdownNow();
        }
        if (closed) {
            channel.shutdownNow();
            return;
        }
        long opened = System.nanoTime();
        dev.levee.v1.ClusterGrpc.newStub(channel).watchMembers(
                dev.levee.v1.WatchMembersRequest.getDefaultInstance(), new StreamObserver<>() {
                    private volatile boolean following = true;

                    @Override
                    public void onNext(dev.levee.v1.WatchMembersResponse update) {
                        List<String> members = new ArrayList<>();
                        for (dev.levee.v1.Member member : update.getMembersList()) {
                            members.add(member.getGrpcAddr());
                        }
                        for (String member : members) {
                            String host = member.contains(":") ? member.substring(0, member.lastIndexOf(':')) : member;
                            if (member.isEmpty() || host.equals("0.0.0.0") || host.equals("[::]")) {
                                LOG.warning("member address " + member + " is not one clients can reach; not following"
                                        + " the cluster (bind --grpc-addr to a reachable address, or followCluster(false))");
                                following = false;
                                channel.shutdownNow();
                                return;
                            }
                        }
                        if (following && !members.isEmpty()) {
                            background.execute(() -> followMembers(members));
                        }
                    }

                    @Override
                    public void onError(Throwable error) {
                        channel.shutdownNow();
                        if (!following || io.grpc.Status.fromThrowable(error).getCode() == io.grpc.Status.Code.UNIMPLEMENTED) {
                            return; // a fixed set of servers, as given
                        }
                        again();
                    }

                    @Override
                    public void onCompleted() {
                        channel.shutdownNow();
                        again();
                    }

                    private void again() {
                        long next = System.nanoTime() - opened > options.reconnectBackoffMax.toNanos()
                                ? options.reconnectBackoffMin.toNanos() : backoffNanos;
                        try {
                            background.schedule(() -> watchMembers(turn + 1,
                                    Math.min(next * 2, options.reconnectBackoffMax.toNanos())), next, TimeUnit.NANOSECONDS);
                        } catch (RuntimeException rejected) {
                            // shutting down
                        }
                    }
                });
    }

    /** Makes {@code members} the servers: links of servers that left stop, new ones start. */
    private void followMembers(List<String> members) {
        try {
            followMembersNow(members);
        } catch (RuntimeException failed) {
            LOG.log(Level.WARNING, "following the cluster's members " + members + " failed", failed);
        }
    }

    private void followMembersNow(List<String> members) {
        if (closed) {
            return;
        }
        for (Link link : links) {
            if (link.active && !members.contains(link.address)) {
                LOG.info("hot-key server " + link.address + " left the cluster");
                link.retire();
            }
        }
        for (String member : members) {
            Link known = null;
            for (Link link : links) {
                if (link.address.equals(member)) {
                    known = link;
                }
            }
            if (known != null) {
                if (!known.active) {
                    known.active = true;
                    known.open();
                }
            } else if (links.size() < SERVERS_MAX) {
                LOG.info("hot-key server " + member + " joined the cluster");
                Link link;
                try {
                    link = new Link(links.size(), member);
                } catch (RuntimeException unusable) {
                    LOG.warning("cannot follow hot-key server " + member + ": " + unusable);
                    continue;
                }
                long[] grown = java.util.Arrays.copyOf(seeds, seeds.length + 1);
                grown[seeds.length] = Routing.serverSeed(member);
                links.add(link);
                seeds = grown;
                link.open();
            } else {
                LOG.warning("more than " + SERVERS_MAX + " servers seen; not following " + member);
            }
        }
    }

    // ---- the application's side: local, never blocking on the network, never throwing

    /** Records one access to {@code key} and says whether it is hot now. Never throws. */
    public boolean isHot(byte[] key) {
        try {
            ByteKey wrapped = new ByteKey(key);
            record(wrapped, 1);
            return hotNow(wrapped);
        } catch (RuntimeException error) {
            invalidKey(error);
            return false;
        }
    }

    /** {@link #isHot(byte[])} of the key's UTF-8 bytes. Never throws. */
    public boolean isHot(String key) {
        try {
            return isHot(key.getBytes(StandardCharsets.UTF_8));
        } catch (RuntimeException error) {
            invalidKey(error);
            return false;
        }
    }

    /** Whether {@code key} is hot now, without recording an access. Never throws. */
    public boolean isHotNow(byte[] key) {
        try {
            return hotNow(new ByteKey(key));
        } catch (RuntimeException error) {
            return false;
        }
    }

    private boolean hotNow(ByteKey key) {
        if (hot.isEmpty()) {
            return false;
        }
        LocalHot<V> entry = hot.get(key);
        return entry != null && entry.untilNanos - System.nanoTime() > 0;
    }

    /** Records {@code count} accesses to {@code key} (pre-aggregated by the caller). Never throws. */
    public void record(byte[] key, long count) {
        try {
            record(new ByteKey(key), Math.max(count, 0));
        } catch (RuntimeException error) {
            invalidKey(error);
        }
    }

    private void record(ByteKey key, long count) {
        accessesRecorded.add(count);
        AtomicLong counter = buffer.get(key);
        if (counter != null && counter.getAndAdd(count) >= 0) {
            return;
        }
        if (key.bytes.length == 0) {
            accessesDropped.add(count);
            return;
        }
        ByteKey owned = key.copy();
        while (true) {
            if (bufferKeys.get() >= options.bufferKeysMax) {
                accessesDropped.add(count);
                return;
            }
            AtomicLong fresh = new AtomicLong(count);
            AtomicLong existing = buffer.putIfAbsent(owned, fresh);
            if (existing == null) {
                bufferKeys.incrementAndGet();
                return;
            }
            if (existing.getAndAdd(count) >= 0) {
                return;
            }
            buffer.remove(owned, existing); // retired meanwhile: replace it
        }
    }

    private void invalidKey(RuntimeException error) {
        accessesDropped.increment();
        if (!invalidLogged) {
            invalidLogged = true;
            LOG.log(Level.SEVERE, "hot keys: an invalid key was dropped", error);
        }
    }

    /** The keys hot now. */
    public List<byte[]> hotKeys() {
        long now = System.nanoTime();
        List<byte[]> keys = new ArrayList<>();
        hot.forEach((key, entry) -> {
            if (entry.untilNanos - now > 0) {
                keys.add(key.bytes.clone());
            }
        });
        keys.sort(java.util.Arrays::compareUnsigned);
        return keys;
    }

    /** The cached value of a hot key, or null. */
    public V get(byte[] key) {
        LocalHot<V> entry = hot.get(new ByteKey(key));
        if (entry == null || entry.untilNanos - System.nanoTime() <= 0 || !entry.hasValue) {
            return null;
        }
        return entry.value;
    }

    /** Caches {@code value} for {@code key} if the key is hot (it goes when the key cools); returns whether it was cached. */
    public boolean set(byte[] key, V value) {
        LocalHot<V> entry = hot.get(new ByteKey(key));
        if (entry == null || entry.untilNanos - System.nanoTime() <= 0) {
            return false;
        }
        entry.value = value;
        entry.hasValue = true;
        return true;
    }

    /**
     * Records an access and returns the key's value: from the local cache when the key is hot
     * and cached, else from {@code loader}. While a key is hot one load runs at a time however
     * many threads ask, and its result is cached; cold keys always call the loader. A loader
     * that throws throws in every waiting caller (wrapped in a RuntimeException unless it is
     * one) and caches nothing.
     */
    public V getOrLoad(byte[] key, Callable<V> loader) {
        if (!isHot(key)) {
            return callLoader(loader);
        }
        ByteKey wrapped = new ByteKey(key).copy();
        LocalHot<V> entry = hot.get(wrapped);
        if (entry != null && entry.hasValue) {
            return entry.value;
        }
        CompletableFuture<V> mine = new CompletableFuture<>();
        CompletableFuture<V> flight = flights.putIfAbsent(wrapped, mine);
        if (flight != null) {
            try {
                return flight.get();
            } catch (InterruptedException interrupted) {
                Thread.currentThread().interrupt();
                throw new IllegalStateException("interrupted while waiting for a load", interrupted);
            } catch (ExecutionException failed) {
                Throwable cause = failed.getCause();
                throw cause instanceof RuntimeException ? (RuntimeException) cause : new RuntimeException(cause);
            }
        }
        try {
            V value = callLoader(loader);
            set(key, value);
            mine.complete(value);
            return value;
        } catch (RuntimeException error) {
            mine.completeExceptionally(error);
            throw error;
        } finally {
            flights.remove(wrapped, mine);
        }
    }

    private static <V> V callLoader(Callable<V> loader) {
        try {
            return loader.call();
        } catch (RuntimeException error) {
            throw error;
        } catch (Exception error) {
            throw new RuntimeException(error);
        }
    }

    /**
     * Calls {@code listener} on every hot and cool event, from a background thread: keep it
     * quick. A listener that throws is logged and counted, never stops the session.
     */
    public void onChange(Consumer<HotKeyChange> listener) {
        listeners.add(listener);
    }

    /** Calls {@code listener} with each key that turns hot (or is extended). */
    public void onHot(Consumer<byte[]> listener) {
        onChange(change -> {
            if (change.hot()) {
                listener.accept(change.key());
            }
        });
    }

    /** Calls {@code listener} with each key that cools. */
    public void onCool(Consumer<byte[]> listener) {
        onChange(change -> {
            if (!change.hot()) {
                listener.accept(change.key());
            }
        });
    }

    /** The counters now. */
    public HotKeysStats stats() {
        long connected = 0;
        for (Link link : links) {
            if (link.connected()) {
                connected++;
            }
        }
        return new HotKeysStats(accessesRecorded.sum(), accessesDropped.sum(), keysReported.get(), keysUnsent.get(),
                batchesUnsent.get(), eventsReceived.get(), sessionsOpened.get(), connected, callbackErrors.get());
    }

    /** The server (index into the servers) that {@code key} is reported to while all are connected. */
    public int serverOf(byte[] key) {
        return Math.max(Routing.rendezvous(Routing.keyHash(key), seeds, null), 0);
    }

    /** Sends what is buffered now (else it goes at the next report interval). */
    public void flush() {
        if (closed) {
            return;
        }
        try {
            background.submit(this::reportRound).get(5, TimeUnit.SECONDS);
        } catch (InterruptedException interrupted) {
            Thread.currentThread().interrupt();
        } catch (Exception error) {
            LOG.log(Level.WARNING, "hot keys: flush failed", error);
        }
    }

    /** Sends what is buffered, then closes the sessions and stops the background thread. */
    @Override
    public void close() {
        if (closed) {
            return;
        }
        flush();
        closed = true;
        ManagedChannel members = membersChannel;
        if (members != null) {
            members.shutdownNow();
        }
        background.shutdownNow();
        for (Link link : links) {
            link.shutdown();
        }
        try {
            background.awaitTermination(5, TimeUnit.SECONDS);
        } catch (InterruptedException interrupted) {
            Thread.currentThread().interrupt();
        }
    }

    // ---- the background thread: report rounds

    private void reportRound() {
        try {
            List<List<KeyReport>> perServer = new ArrayList<>(links.size());
            for (int index = 0; index < links.size(); index++) {
                perServer.add(new ArrayList<>());
            }
            long unsent = 0;
            for (Map.Entry<ByteKey, AtomicLong> entry : buffer.entrySet()) {
                AtomicLong counter = entry.getValue();
                long count = counter.getAndSet(0);
                if (count <= 0) {
                    // Idle for a whole round: take the key out of the buffer.
                    if (counter.compareAndSet(0, RETIRED) && buffer.remove(entry.getKey(), counter)) {
                        bufferKeys.decrementAndGet();
                    }
                    continue;
                }
                byte[] key = entry.getKey().bytes;
                int server = links.size() == 1 ? (links.get(0).connected() ? 0 : -1)
                        : Routing.rendezvous(Routing.keyHash(key), seeds, index -> links.get(index).connected());
                if (server < 0) {
                    unsent++;
                    continue;
                }
                perServer.get(server).add(KeyReport.newBuilder().setKey(ByteString.copyFrom(key))
                        .setCount((int) Math.min(count, REPORT_COUNT_MAX)).build());
            }
            if (unsent > 0) {
                keysUnsent.addAndGet(unsent);
            }
            for (int server = 0; server < links.size(); server++) {
                List<KeyReport> reports = perServer.get(server);
                int from = 0;
                while (from < reports.size()) {
                    int length = batchLength(reports, from, options.batchKeysMax, options.batchBytesMax);
                    List<KeyReport> chunk = reports.subList(from, from + length);
                    from += length;
                    links.get(server).enqueue(HotKeyClientMessage.newBuilder()
                            .setReport(ReportBatch.newBuilder().addAllKeys(chunk)).build(), chunk.size());
                }
            }
        } catch (RuntimeException error) {
            LOG.log(Level.WARNING, "hot keys: a report round failed", error);
        }
    }

    /**
     * How many of the reports from {@code from} go in one message: at most keysMax, and as many
     * as fit bytesMax with their framing (at least one, so a round always moves).
     */
    static int batchLength(List<KeyReport> reports, int from, int keysMax, int bytesMax) {
        long total = HotKeysOptions.REPORT_BATCH_OVERHEAD_BYTES;
        int end = Math.min(reports.size(), from + keysMax);
        for (int index = from; index < end; index++) {
            total += reports.get(index).getKey().size() + HotKeysOptions.REPORT_KEY_OVERHEAD_BYTES;
            if (total > bytesMax) {
                return Math.max(index - from, 1);
            }
        }
        return end - from;
    }

    // ---- events from the servers

    private void apply(int server, List<HotKeyEvent> events, boolean snapshot) {
        List<HotKeyChange> changes = new ArrayList<>();
        synchronized (applyLock) {
            long now = System.nanoTime();
            if (snapshot) {
                Set<ByteKey> keep = new HashSet<>();
                for (HotKeyEvent event : events) {
                    keep.add(new ByteKey(event.getKey().toByteArray()));
                }
                for (Map.Entry<ByteKey, LocalHot<V>> entry : hot.entrySet()) {
                    if (entry.getValue().server == server && !keep.contains(entry.getKey())) {
                        hot.remove(entry.getKey());
                        changes.add(new HotKeyChange(entry.getKey().bytes.clone(), false, 0, false));
                    }
                }
            }
            for (HotKeyEvent event : events) {
                if (!event.getApp().equals(options.app)) {
                    continue;
                }
                ByteKey key = new ByteKey(event.getKey().toByteArray());
                if (event.getHot()) {
                    long until = now + TimeUnit.MILLISECONDS.toNanos(event.getHotForMs());
                    LocalHot<V> existing = hot.get(key);
                    if (existing == null) {
                        hot.put(key, new LocalHot<>(until, server));
                    } else {
                        if (until - existing.untilNanos > 0) {
                            existing.untilNanos = until;
                        }
                        existing.server = server;
                    }
                    changes.add(new HotKeyChange(key.bytes.clone(), true, event.getHotForMs(),
                            event.getSource() == HotKeySource.HOT_KEY_SOURCE_MANUAL));
                } else if (hot.remove(key) != null) {
                    changes.add(new HotKeyChange(key.bytes.clone(), false, 0, false));
                }
            }
            hot.entrySet().removeIf(entry -> entry.getValue().untilNanos - now <= 0);
        }
        eventsReceived.addAndGet(events.size());
        for (HotKeyChange change : changes) {
            for (Consumer<HotKeyChange> listener : listeners) {
                try {
                    listener.accept(change);
                } catch (RuntimeException error) {
                    callbackErrors.incrementAndGet();
                    LOG.log(Level.WARNING, "hot keys: a listener failed", error);
                }
            }
        }
    }

    /** One server: its channel, the current session, its bounded queue of report batches, reconnects. */
    private final class Link {
        private final int index;
        private final String address;
        private final ManagedChannel channel;
        private final ArrayBlockingQueue<Batch> queue = new ArrayBlockingQueue<>(options.batchesQueuedPerServerMax);
        private volatile Session session;
        /** False once the server left the cluster: no session, no reconnect, no reports. */
        volatile boolean active = true;
        private long backoffNanos = options.reconnectBackoffMin.toNanos();
        /** The scheduled reopening after a session ended, if any. */
        private volatile java.util.concurrent.ScheduledFuture<?> reconnect;

        Link(int index, String address) {
            this.index = index;
            this.address = address;
            this.channel = Channels.open(address);
        }

        boolean connected() {
            Session current = session;
            return active && current != null && current.accepted;
        }

        /** The server left the cluster: its session ends and is not reopened. */
        void retire() {
            active = false;
            java.util.concurrent.ScheduledFuture<?> pending = reconnect;
            if (pending != null) {
                pending.cancel(false);
            }
            Session current = session;
            if (current != null) {
                current.cancel();
            }
        }

        void open() {
            if (closed || !active) {
                return;
            }
            java.util.concurrent.ScheduledFuture<?> pending = reconnect;
            if (pending != null) {
                pending.cancel(false);
            }
            Session previous = session;
            Session fresh = new Session(this);
            session = fresh;
            if (previous != null) {
                previous.cancel(); // at most one live session per link (a no-op once it ended)
            }
            try {
                HotKeysGrpc.newStub(channel).session(fresh);
                fresh.send(HotKeyClientMessage.newBuilder().setHello(dev.levee.v1.Hello.newBuilder().setApp(options.app)
                        .setClientId(options.clientId)).build());
            } catch (RuntimeException error) {
                fresh.ended(error);
            }
        }

        void enqueue(HotKeyClientMessage message, int keys) {
            Session current = session;
            if (current == null || !current.accepted || !queue.offer(new Batch(message, keys))) {
                keysUnsent.addAndGet(keys);
                batchesUnsent.incrementAndGet();
                return;
            }
            keysReported.addAndGet(keys);
            current.drain();
        }

        /** A session ended: drop what it will never send, and reconnect after the backoff. */
        void sessionEnded(Session ended, Throwable error) {
            if (session != ended) {
                return;
            }
            boolean wasAccepted = ended.accepted;
            ended.accepted = false;
            Batch batch;
            while ((batch = queue.poll()) != null) {
                keysUnsent.addAndGet(batch.keys);
                keysReported.addAndGet(-batch.keys);
                batchesUnsent.incrementAndGet();
            }
            if (closed || !active) {
                return;
            }
            if (wasAccepted) {
                backoffNanos = options.reconnectBackoffMin.toNanos();
            }
            LOG.log(Level.FINE, "hot-key session to " + address + " ended (" + error + "); reconnecting");
            long delay = backoffNanos;
            backoffNanos = Math.min(backoffNanos * 2, options.reconnectBackoffMax.toNanos());
            channel.resetConnectBackoff();
            try {
                reconnect = background.schedule(this::open, delay, TimeUnit.NANOSECONDS);
            } catch (RuntimeException rejected) {
                // shutting down
            }
        }

        void shutdown() {
            Session current = session;
            if (current != null) {
                current.cancel();
            }
            channel.shutdownNow();
        }
    }

    private record Batch(HotKeyClientMessage message, int keys) {}

    /** One session on a server: the Hello, then report batches while the stream takes them. */
    private final class Session implements ClientResponseObserver<HotKeyClientMessage, HotKeyServerMessage> {
        private final Link link;
        private ClientCallStreamObserver<HotKeyClientMessage> requests;
        volatile boolean accepted;
        private boolean over;

        Session(Link link) {
            this.link = link;
        }

        @Override
        public void beforeStart(ClientCallStreamObserver<HotKeyClientMessage> requestStream) {
            requests = requestStream;
            requestStream.setOnReadyHandler(this::drain);
        }

        synchronized void send(HotKeyClientMessage message) {
            if (!over) {
                requests.onNext(message);
            }
        }

        /** Sends queued batches while the transport takes them (flow control). */
        synchronized void drain() {
            while (accepted && !over && requests.isReady()) {
                Batch batch = link.queue.poll();
                if (batch == null) {
                    return;
                }
                requests.onNext(batch.message());
            }
        }

        synchronized void cancel() {
            if (!over) {
                over = true;
                requests.cancel("hot keys closed", null);
            }
        }

        @Override
        public void onNext(HotKeyServerMessage message) {
            if (!accepted) {
                // The server accepted the Hello: reports may go to it from now on.
                accepted = true;
                sessionsOpened.incrementAndGet();
            }
            if (message.hasSnapshot()) {
                apply(link.index, message.getSnapshot().getHotList(), true);
            } else if (message.hasEvents()) {
                apply(link.index, message.getEvents().getEventsList(), false);
            }
            drain();
        }

        @Override
        public void onError(Throwable error) {
            ended(error);
        }

        @Override
        public void onCompleted() {
            ended(null);
        }

        void ended(Throwable error) {
            synchronized (this) {
                over = true;
            }
            link.sessionEnded(this, error);
        }
    }
}
