package dev.levee.client;

import com.google.common.util.concurrent.FutureCallback;
import com.google.common.util.concurrent.Futures;
import com.google.common.util.concurrent.MoreExecutors;
import com.google.protobuf.ByteString;
import dev.levee.v1.AppendMessage;
import dev.levee.v1.AppendRequest;
import dev.levee.v1.AppendResponse;
import dev.levee.v1.ErrorCode;
import dev.levee.v1.QueuesGrpc;
import java.security.SecureRandom;
import java.util.ArrayList;
import java.util.EnumSet;
import java.util.HashMap;
import java.util.HashSet;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ConcurrentSkipListMap;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.ScheduledThreadPoolExecutor;
import java.util.concurrent.Semaphore;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.concurrent.atomic.AtomicLong;

/**
 * Batches appends from many callers (threads) into few requests.
 *
 * <p>A message waits at most the linger for others to join its batch; a batch closes at
 * batchMessagesMax messages or batchBytesMax payload bytes, and (with sendWhenIdle, the default)
 * as soon as no request is in flight, so a lightly loaded producer adds no linger while a busy
 * one batches what arrives during each round trip. Each caller's future completes with its
 * message's offset once the batch is durable. At most queuedMessagesMax messages wait: further
 * sends block for room (back-pressure).
 *
 * <p>With idempotent, the producer takes a fresh producer id and numbers each queue's messages;
 * a batch whose request failed in a way that may not have reached the disk (UNAVAILABLE,
 * DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, or a SEQUENCE_GAP left by a batch still in flight) is
 * resent with the same numbers, up to retriesMax times (default 10, retryBackoff apart doubling
 * up to retryBackoffMax: 10 ms to 100 ms by default, as the Rust producer's, enough to ride out
 * a shard leader's failover in a cluster), and the server stores nothing twice. A batch sharing
 * a queue with a batch in flight waits for it (the server takes a producer's sequences on a
 * queue only in order). That rule also keeps every resend answerable: the server answers a resend with its original offsets only while it is
 * among the last 8 requests of the producer that touched its queues (SEQUENCE_TOO_OLD beyond),
 * and since no batch touching a queue is sent while an earlier one touching it is unanswered
 * (being resent included), a resent batch is always the newest request on each of its queues.
 * (The Rust producer, whose batches on one queue may be in flight together, gets the same by
 * sending no new batch while one is being resent.) Failed batches are never silent: each
 * caller's future fails, and stats count them.
 *
 * <p>An idempotent batch that finally fails (its resends spent, or an error not worth a resend)
 * has used its queues' sequences, though the server may never have stored them: every later
 * batch on those queues under the same producer id would meet a SEQUENCE_GAP for ever. So such
 * a failure makes the producer take a fresh producer id for every batch numbered after it,
 * restarting every queue's sequence at 0 (as when sequenceQueuesMax is reached); batches
 * already numbered and in flight keep their old id and their resends. A batch that failed with
 * an error that leaves it unknown whether it was stored (a request timed out, or its node went
 * away: DEADLINE_EXCEEDED, UNAVAILABLE) may still be stored later, under its old id; no later
 * batch collides with it, since each carries the fresh id. A later batch on a failed batch's
 * queue is numbered only once that batch has failed (it waits for it), so it always gets the
 * fresh id.
 *
 * <p>With routeToShardLeaders (the default), in a cluster that replicates its queues
 * (docs/CLUSTER.md, "Part 2"), the producer learns the cluster's shards, each shard's leader
 * and every member's address from GetCluster, every second and soon after a failed send,
 * asking its client's node first and, when that node is down, every other member it knows. It
 * splits each batch by the leader of each message's shard ({@link Routing#shardOf(byte[],
 * int)}) and sends each part as one request straight to that leader, over one channel per
 * member (closed when the member leaves, and on close); each caller still gets its own
 * message's offset. A message whose shard has no leader known goes through the producer's
 * client (or the member that answered the last refresh, when that node did not): any node
 * forwards it. A resend goes to the leader known when it is sent, after a refresh. A part that
 * fails names the node it went to. Against a lone server, or a cluster that does not replicate
 * its queues, nothing changes: every batch is one request through the producer's client.
 */
public final class Producer implements AutoCloseable {
    private static final Set<ErrorCode> RETRYABLE = EnumSet.of(ErrorCode.ERROR_CODE_UNAVAILABLE,
            ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED, ErrorCode.ERROR_CODE_SEQUENCE_GAP, ErrorCode.ERROR_CODE_RESOURCE_EXHAUSTED);
    private static final long IDLE_POLL_MS = 50;
    private static final SecureRandom RANDOM = new SecureRandom();

    private final LeveeClient client;
    private final ProducerOptions options;
    private final LinkedBlockingQueue<Pending> queued = new LinkedBlockingQueue<>();
    private final Semaphore room;
    private final Semaphore slots;
    private final AtomicInteger inFlight = new AtomicInteger();
    private final Thread sender;
    private final ScheduledThreadPoolExecutor retries;
    /** With routeToShardLeaders: the shard leaders and a route to each member (else null). */
    private final ShardRoutes routes;
    private volatile boolean closing;
    private volatile String producerId;
    /**
     * Idempotent: an idempotent batch finally failed, so the next batch numbered takes a fresh
     * producer id (set by whichever thread learns of the failure, taken by the sender thread).
     */
    private final AtomicBoolean freshIdNeeded = new AtomicBoolean();
    /** Idempotent: each queue's next sequence (bounded by sequenceQueuesMax). Sender thread only. */
    private final Map<ByteKey, Long> sequences = new HashMap<>();
    /** Batches in flight by number, each with a future completed once answered. */
    private final ConcurrentSkipListMap<Long, CompletableFuture<Void>> batches = new ConcurrentSkipListMap<>();
    /** Idempotent: the batch in flight for each queue (bounded by the batches in flight). */
    private final ConcurrentHashMap<ByteKey, Long> queueBatches = new ConcurrentHashMap<>();
    private long batchNumber;
    private Pending carried;

    private final AtomicLong messagesSent = new AtomicLong();
    private final AtomicLong messagesFailed = new AtomicLong();
    private final AtomicLong batchesSent = new AtomicLong();
    private final AtomicLong batchesFailed = new AtomicLong();
    private final AtomicLong retryCount = new AtomicLong();

    private record Pending(ByteKey queue, byte[] payload, CompletableFuture<Long> answer) {}

    /** A batch in flight: its number and how many of its parts are not answered yet. */
    private static final class Flight {
        final long number;
        final AtomicInteger partsLeft;

        Flight(long number, int parts) {
            this.number = number;
            this.partsLeft = new AtomicInteger(parts);
        }
    }

    /** One request of a batch: the whole batch, or its messages led by one node. */
    private record Part(Flight flight, List<Pending> messages, AppendRequest request) {}

    /** A producer appending through {@code client}. */
    public Producer(LeveeClient client, ProducerOptions options) {
        options.validate();
        this.client = client;
        this.options = options;
        this.room = new Semaphore(options.queuedMessagesMax);
        this.slots = new Semaphore(options.requestsInFlightMax);
        this.producerId = options.idempotent ? freshProducerId() : "";
        this.routes = options.routeToShardLeaders ? new ShardRoutes(client) : null;
        this.retries = new ScheduledThreadPoolExecutor(1, runnable -> {
            Thread thread = new Thread(runnable, "levee-producer-retries");
            thread.setDaemon(true);
            return thread;
        });
        this.sender = new Thread(this::run, "levee-producer");
        this.sender.setDaemon(true);
        this.sender.start();
    }

    static String freshProducerId() {
        byte[] bytes = new byte[8];
        RANDOM.nextBytes(bytes);
        return "producer-" + HexFormat.of().formatHex(bytes);
    }

    /** The idempotent producer id now ("" when not idempotent). */
    public String producerId() {
        return producerId;
    }

    /** The routes, when routing to shard leaders (else null); for tests. */
    ShardRoutes routes() {
        return routes;
    }

    public ProducerStats stats() {
        return new ProducerStats(messagesSent.get(), messagesFailed.get(), batchesSent.get(), batchesFailed.get(),
                retryCount.get());
    }

    /**
     * Queues a message, blocking only for room; the future completes with its offset once its
     * batch is durable, or fails with the batch's LeveeException. Invalid input throws here.
     */
    public CompletableFuture<Long> send(byte[] queue, byte[] payload) {
        Validation.checkAppendQueue(queue);
        Validation.checkNotReserved(queue);
        Validation.checkPayload(payload, client.options().messageBytesMax());
        if (closing) {
            throw LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "the producer is closed");
        }
        try {
            room.acquire();
        } catch (InterruptedException interrupted) {
            Thread.currentThread().interrupt();
            throw LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "interrupted while waiting for room in the producer");
        }
        CompletableFuture<Long> answer = new CompletableFuture<>();
        queued.add(new Pending(new ByteKey(queue.clone()), payload.clone(), answer));
        return answer;
    }

    private void run() {
        try {
            while (true) {
                Pending first = carried != null ? carried : queued.poll(IDLE_POLL_MS, TimeUnit.MILLISECONDS);
                carried = null;
                if (first == null) {
                    if (closing && queued.isEmpty()) {
                        return;
                    }
                    continue;
                }
                List<Pending> batch = collect(first);
                dispatch(batch);
            }
        } catch (InterruptedException interrupted) {
            Thread.currentThread().interrupt();
        } finally {
            failQueued("the producer stopped");
        }
    }

    private List<Pending> collect(Pending first) throws InterruptedException {
        List<Pending> batch = new ArrayList<>();
        batch.add(first);
        long bytes = first.payload().length;
        long deadline = System.nanoTime() + options.linger.toNanos();
        while (batch.size() < options.batchMessagesMax) {
            Pending next = queued.poll();
            if (next == null) {
                boolean idle = options.sendWhenIdle && inFlight.get() == 0;
                long left = deadline - System.nanoTime();
                if (idle || closing || left <= 0) {
                    break;
                }
                next = queued.poll(left, TimeUnit.NANOSECONDS);
                if (next == null) {
                    break;
                }
            }
            if (bytes + next.payload().length > options.batchBytesMax) {
                carried = next;
                break;
            }
            batch.add(next);
            bytes += next.payload().length;
        }
        return batch;
    }

    private void dispatch(List<Pending> batch) throws InterruptedException {
        if (options.idempotent) {
            // A batch sharing a queue with one in flight would meet a SEQUENCE_GAP: wait for it.
            // This also keeps every resend within the server's window: a batch being resent is
            // its producer's newest request on each of its queues (class docs).
            Set<Long> earlier = new HashSet<>();
            for (Pending pending : batch) {
                Long number = queueBatches.get(pending.queue());
                if (number != null) {
                    earlier.add(number);
                }
            }
            for (Long number : earlier) {
                CompletableFuture<Void> done = batches.get(number);
                if (done != null) {
                    try {
                        done.get();
                    } catch (java.util.concurrent.ExecutionException ignored) {
                        // answered either way
                    }
                }
            }
        }
        slots.acquire();
        inFlight.incrementAndGet();
        long number = ++batchNumber;
        batches.put(number, new CompletableFuture<>());
        List<AppendMessage> messages = new ArrayList<>(batch.size());
        if (options.idempotent) {
            numberBatch(batch, messages, number);
        } else {
            for (Pending pending : batch) {
                messages.add(AppendMessage.newBuilder().setQueue(ByteString.copyFrom(pending.queue().bytes))
                        .setPayload(ByteString.copyFrom(pending.payload())).build());
            }
        }
        String id = options.idempotent ? producerId : "";
        ShardRoutes.View view = routes == null ? null : routes.view();
        if (view == null || !view.routing()) {
            Flight flight = new Flight(number, 1);
            send(new Part(flight, batch, request(messages, id)), 0, options.retryBackoff.toNanos());
            return;
        }
        // One request per shard leader, each keeping its messages' order (a queue's messages all
        // go to one leader, so each queue's order is kept).
        Map<Long, List<Integer>> byLeader = new LinkedHashMap<>();
        for (int index = 0; index < batch.size(); index++) {
            long leader = view.route(batch.get(index).queue().bytes).nodeId;
            byLeader.computeIfAbsent(leader, ignored -> new ArrayList<>()).add(index);
        }
        Flight flight = new Flight(number, byLeader.size());
        for (List<Integer> indexes : byLeader.values()) {
            List<Pending> pendings = new ArrayList<>(indexes.size());
            List<AppendMessage> partMessages = new ArrayList<>(indexes.size());
            for (int index : indexes) {
                pendings.add(batch.get(index));
                partMessages.add(messages.get(index));
            }
            send(new Part(flight, pendings, request(partMessages, id)), 0, options.retryBackoff.toNanos());
        }
    }

    private AppendRequest request(List<AppendMessage> messages, String id) {
        return AppendRequest.newBuilder().setProducerName(client.producerName()).setProducerId(id)
                .addAllMessages(messages).build();
    }

    private void numberBatch(List<Pending> batch, List<AppendMessage> messages, long number) {
        Set<ByteKey> fresh = new HashSet<>();
        for (Pending pending : batch) {
            if (!sequences.containsKey(pending.queue())) {
                fresh.add(pending.queue());
            }
        }
        // A batch that finally failed left its queues' sequences with a gap the server may
        // never see filled; bounded counters: either way, a new id restarts every queue at 0.
        if (freshIdNeeded.getAndSet(false) || sequences.size() + fresh.size() > options.sequenceQueuesMax) {
            producerId = freshProducerId();
            sequences.clear();
        }
        for (Pending pending : batch) {
            long sequence = sequences.getOrDefault(pending.queue(), 0L);
            sequences.put(pending.queue(), sequence + 1);
            queueBatches.put(pending.queue(), number);
            messages.add(AppendMessage.newBuilder().setQueue(ByteString.copyFrom(pending.queue().bytes))
                    .setPayload(ByteString.copyFrom(pending.payload())).setSequence(sequence).build());
        }
    }

    /**
     * Where a part goes now: without routes, or in a cluster that does not replicate its
     * queues, the producer's client; else its first message's shard leader as known now (the
     * node forwards any other message of the part it does not lead), or, with no leader known,
     * the seed (the member that answered the last refresh when the seed did not).
     */
    private ShardRoutes.Route target(Part part) {
        if (routes == null) {
            return null;
        }
        ShardRoutes.View view = routes.view();
        return view.routing() ? view.route(part.messages().get(0).queue().bytes) : routes.seed();
    }

    private void send(Part part, int attempt, long backoffNanos) {
        ShardRoutes.Route route = target(part);
        LeveeClient through = route == null ? client : route.client;
        QueuesGrpc.QueuesFutureStub stub = through.deadline(QueuesGrpc.newFutureStub(through.channel()));
        List<Pending> batch = part.messages();
        AppendRequest request = part.request();
        long number = part.flight().number;
        Futures.addCallback(stub.append(request), new FutureCallback<AppendResponse>() {
            @Override
            public void onSuccess(AppendResponse response) {
                if (route != null) {
                    route.appends.incrementAndGet();
                }
                batchesSent.incrementAndGet();
                messagesSent.addAndGet(batch.size());
                for (int i = 0; i < batch.size(); i++) {
                    batch.get(i).answer().complete(response.getOffsets(i));
                }
                finished(part);
            }

            @Override
            public void onFailure(Throwable failure) {
                LeveeException error = WireErrors.from(failure);
                boolean idempotent = !request.getProducerId().isEmpty();
                List<CompletableFuture<Void>> earlier = new ArrayList<>(batches.headMap(number).values());
                if (idempotent && error.code() == ErrorCode.ERROR_CODE_SEQUENCE_GAP && !earlier.isEmpty()) {
                    // An earlier batch is still on its way: once it is answered the gap is filled.
                    retryCount.incrementAndGet();
                    CompletableFuture.allOf(earlier.toArray(new CompletableFuture[0]))
                            .whenComplete((ignored, failed) -> send(part, attempt, backoffNanos));
                    return;
                }
                // The shard's leader may have moved (or its node died): learn where it is now.
                CompletableFuture<Void> refreshed = routes == null ? CompletableFuture.completedFuture(null)
                        : routes.refreshSoon();
                if (!idempotent || !RETRYABLE.contains(error.code()) || attempt >= options.retriesMax) {
                    if (idempotent) {
                        // Its sequences may never be stored: later batches take a fresh id.
                        // Asked before finished() frees its queues, so a batch waiting on one
                        // of them is numbered after (class docs).
                        freshIdNeeded.set(true);
                    }
                    batchesFailed.incrementAndGet();
                    messagesFailed.addAndGet(batch.size());
                    // A routed request names the node it went to last (the client's own address
                    // names the seed).
                    LeveeException failed = route == null || route.nodeId == 0 ? error
                            : LeveeException.of(error.code(), error.description() + " (the append went to node "
                                    + route.nodeId + " at " + route.address
                                    + (attempt > 0 ? ", after " + attempt + " resends" : "") + ")");
                    for (Pending pending : batch) {
                        pending.answer().completeExceptionally(failed.copy());
                    }
                    finished(part);
                    return;
                }
                retryCount.incrementAndGet();
                // Resent after the pause and once the routes are refreshed, to the leader then known.
                retries.schedule(() -> refreshed.whenCompleteAsync(
                        (ignored, failed) -> send(part, attempt + 1, nextBackoff(backoffNanos, options.retryBackoffMax.toNanos())), retries),
                        backoffNanos, TimeUnit.NANOSECONDS);
            }
        }, MoreExecutors.directExecutor());
    }

    /**
     * The pause after {@code backoffNanos}: doubled up to {@code capNanos} (retryBackoffMax),
     * never shorter than it was (a first pause above the cap stays).
     */
    static long nextBackoff(long backoffNanos, long capNanos) {
        long doubled = backoffNanos > Long.MAX_VALUE / 2 ? Long.MAX_VALUE : backoffNanos * 2;
        return Math.max(backoffNanos, Math.min(doubled, capNanos));
    }

    /** A part answered: its queues are free; the batch is done once every part is. */
    private void finished(Part part) {
        long number = part.flight().number;
        for (Pending pending : part.messages()) {
            queueBatches.remove(pending.queue(), number);
        }
        room.release(part.messages().size());
        if (part.flight().partsLeft.decrementAndGet() > 0) {
            return;
        }
        CompletableFuture<Void> done = batches.remove(number);
        inFlight.decrementAndGet();
        slots.release();
        if (done != null) {
            done.complete(null);
        }
    }

    private void failQueued(String why) {
        List<Pending> left = new ArrayList<>();
        if (carried != null) {
            left.add(carried);
            carried = null;
        }
        queued.drainTo(left);
        for (Pending pending : left) {
            messagesFailed.incrementAndGet();
            pending.answer().completeExceptionally(LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, why));
            room.release();
        }
    }

    /** Waits until every message queued so far is answered. */
    public void flush() {
        while (!queued.isEmpty() || carried != null || !batches.isEmpty()) {
            CompletableFuture<Void> last = batches.isEmpty() ? null : batches.lastEntry().getValue();
            try {
                if (last != null) {
                    last.get(100, TimeUnit.MILLISECONDS);
                } else {
                    Thread.sleep(1);
                }
            } catch (InterruptedException interrupted) {
                Thread.currentThread().interrupt();
                return;
            } catch (Exception ignored) {
                // answered or still going: look again
            }
        }
    }

    /** Sends what is queued, waits for the answers, then stops. */
    @Override
    public void close() {
        closing = true;
        try {
            sender.join();
        } catch (InterruptedException interrupted) {
            Thread.currentThread().interrupt();
        }
        flush();
        retries.shutdownNow();
        if (routes != null) {
            routes.close();
        }
    }
}
