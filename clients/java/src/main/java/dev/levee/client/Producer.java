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
 * resent with the same numbers, and the server stores nothing twice. A batch sharing a queue
 * with a batch in flight waits for it (the server takes a producer's sequences on a queue only
 * in order). Failed batches are never silent: each caller's future fails, and stats count them.
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
    private volatile boolean closing;
    private volatile String producerId;
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

    /** A producer appending through {@code client}. */
    public Producer(LeveeClient client, ProducerOptions options) {
        options.validate();
        this.client = client;
        this.options = options;
        this.room = new Semaphore(options.queuedMessagesMax);
        this.slots = new Semaphore(options.requestsInFlightMax);
        this.producerId = options.idempotent ? freshProducerId() : "";
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
        AppendRequest.Builder request = AppendRequest.newBuilder().setProducerName(client.producerName());
        if (options.idempotent) {
            numberBatch(batch, request, number);
            request.setProducerId(producerId);
        } else {
            for (Pending pending : batch) {
                request.addMessages(AppendMessage.newBuilder().setQueue(ByteString.copyFrom(pending.queue().bytes))
                        .setPayload(ByteString.copyFrom(pending.payload())));
            }
        }
        send(batch, request.build(), number, 0, options.retryBackoff.toNanos());
    }

    private void numberBatch(List<Pending> batch, AppendRequest.Builder request, long number) {
        Set<ByteKey> fresh = new HashSet<>();
        for (Pending pending : batch) {
            if (!sequences.containsKey(pending.queue())) {
                fresh.add(pending.queue());
            }
        }
        if (sequences.size() + fresh.size() > options.sequenceQueuesMax) {
            // Bounded counters: a new id restarts every queue's sequence at 0.
            producerId = freshProducerId();
            sequences.clear();
        }
        for (Pending pending : batch) {
            long sequence = sequences.getOrDefault(pending.queue(), 0L);
            sequences.put(pending.queue(), sequence + 1);
            queueBatches.put(pending.queue(), number);
            request.addMessages(AppendMessage.newBuilder().setQueue(ByteString.copyFrom(pending.queue().bytes))
                    .setPayload(ByteString.copyFrom(pending.payload())).setSequence(sequence));
        }
    }

    private void send(List<Pending> batch, AppendRequest request, long number, int attempt, long backoffNanos) {
        QueuesGrpc.QueuesFutureStub stub = client.deadline(QueuesGrpc.newFutureStub(client.channel()));
        Futures.addCallback(stub.append(request), new FutureCallback<AppendResponse>() {
            @Override
            public void onSuccess(AppendResponse response) {
                batchesSent.incrementAndGet();
                messagesSent.addAndGet(batch.size());
                for (int i = 0; i < batch.size(); i++) {
                    batch.get(i).answer().complete(response.getOffsets(i));
                }
                finished(batch, number);
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
                            .whenComplete((ignored, failed) -> send(batch, request, number, attempt, backoffNanos));
                    return;
                }
                if (!idempotent || !RETRYABLE.contains(error.code()) || attempt >= options.retriesMax) {
                    batchesFailed.incrementAndGet();
                    messagesFailed.addAndGet(batch.size());
                    for (Pending pending : batch) {
                        pending.answer().completeExceptionally(error.copy());
                    }
                    finished(batch, number);
                    return;
                }
                retryCount.incrementAndGet();
                retries.schedule(() -> send(batch, request, number, attempt + 1, backoffNanos * 2), backoffNanos,
                        TimeUnit.NANOSECONDS);
            }
        }, MoreExecutors.directExecutor());
    }

    private void finished(List<Pending> batch, long number) {
        CompletableFuture<Void> done = batches.remove(number);
        for (Pending pending : batch) {
            queueBatches.remove(pending.queue(), number);
        }
        inFlight.decrementAndGet();
        slots.release();
        room.release(batch.size());
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
    }
}
