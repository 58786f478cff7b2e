package dev.levee.client;

import dev.levee.v1.Commit;
import dev.levee.v1.CommitResult;
import dev.levee.v1.ConsumeResponse;
import dev.levee.v1.ErrorCode;
import dev.levee.v1.PartitionAssignment;
import dev.levee.v1.TopicDelivery;
import java.time.Duration;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;

/**
 * A consumer-group member that handles messages with bounded parallelism and commits strictly
 * in order (the cashback pattern: many handlers at once, no offset skipped).
 *
 * <p>{@link #run} joins the group on one stream, hands each delivered message to the handler
 * (at most parallelism at once, on the consumer's own threads; one at a time per partition when
 * ordered), and commits each partition's offsets in order: a commit never passes a message
 * whose handler has not finished. Credit is granted back as messages finish, so the server never
 * sends more than creditMessages unfinished messages (back-pressure end to end; everything held
 * here is bounded by it). When the stream breaks it rejoins with exponential backoff and the
 * group redelivers from the last commit (at-least-once). Commits refused as FENCED (the
 * partition moved) are counted and the partition's pending work is dropped. All state lives on
 * the thread that calls run; other threads only post events to it.
 *
 * <p>With {@link #following} the member follows the cluster: when its stream breaks and its
 * node does not answer within a second, it rejoins through the next member of the cluster, as
 * the Rust client's {@code GroupConsumer::following}.
 */
public final class GroupConsumer {
    /** The server's bound on commits per CommitBatch. */
    static final int COMMITS_PER_BATCH_MAX = 1024;
    static final long FINAL_COMMIT_WAIT_MS = 5000;
    /** How long leaving waits for the server to end the stream. */
    static final long LEAVE_WAIT_MS = 2000;
    /** Events beyond the credit's responses and the handlers' completions (ends, stop). */
    static final int EVENTS_EXTRA_MAX = 64;
    /**
     * How long a following member waits for its node to answer after its stream broke before
     * it rejoins through another member (the Rust client's {@code NODE_PROBE_TIMEOUT}).
     */
    static final Duration NODE_PROBE_TIMEOUT = Duration.ofSeconds(1);

    /** Handles one message; an exception is counted and the message still counts as finished. */
    @FunctionalInterface
    public interface Handler {
        void handle(ConsumerMessage message) throws Exception;
    }

    private final LeveeClient client;
    private final String topic;
    private final String group;
    private final ConsumerOptions options;
    private final String member;
    private final LinkedBlockingQueue<Object> events;
    private volatile boolean stopping;
    /** With {@link #following}: the cluster's members it rejoins through when its node is unreachable. */
    private volatile Following members;

    private long streamNumber;
    private Map<Integer, PartitionState> partitions = new HashMap<>();
    private int running;
    private long creditOwedMessages;
    private long creditOwedBytes;
    private int commitsAwaiting;

    private final AtomicLong handled = new AtomicLong();
    private final AtomicLong commits = new AtomicLong();
    private final AtomicLong fencedCommits = new AtomicLong();
    private final AtomicLong refusedCommits = new AtomicLong();
    private final AtomicLong assignments = new AtomicLong();
    private final AtomicLong streams = new AtomicLong();
    private final AtomicLong handlerErrors = new AtomicLong();

    private static final class PartitionState {
        final long epoch;
        long frontier;
        long committed;
        final ArrayDeque<ConsumerMessage> waiting = new ArrayDeque<>();
        int running;
        final Set<Long> finished = new HashSet<>();

        PartitionState(long epoch, long start) {
            this.epoch = epoch;
            this.frontier = start;
            this.committed = start;
        }
    }

    private record Response(long stream, ConsumeResponse response) {}

    private record Ended(long stream, LeveeException error) {}

    private record Finished(long stream, int partition, long epoch, List<Long> offsets, long payloadBytes) {}

    private static final Object STOP = new Object();

    /** A member of {@code group} on {@code topic}. */
    public GroupConsumer(LeveeClient client, String topic, String group, ConsumerOptions options) {
        options.validate();
        Validation.checkGroupOnTopic(group, topic);
        this.member = options.member != null ? options.member : "member-" + Producer.freshProducerId().substring(9);
        Validation.checkMember(member);
        this.client = client;
        this.topic = topic;
        this.group = group;
        this.options = options;
        this.events = new LinkedBlockingQueue<>(options.creditMessages + options.parallelism + EVENTS_EXTRA_MAX);
    }

    /**
     * This member, following the cluster (whose members it learns now, from its client's node):
     * when its stream breaks and its node does not answer within a second, it rejoins through
     * the next member of the cluster that does, as the Rust client's
     * {@code GroupConsumer::following}. In a cluster made with {@code --replicated-queues true}
     * any node takes the member's stream to the group's coordinator and commits go through the
     * topic's shard, so the member resumes after its last answered commit (messages handled
     * but not yet committed come again: at least once). Commits, ordering and back-pressure are
     * unchanged. Call before {@link #run}; the channels it opens to the other members are
     * closed when run returns.
     */
    public GroupConsumer following() {
        Following learned = Following.learnedFrom(client);
        Following before = members;
        members = learned;
        if (before != null) {
            before.close();
        }
        return this;
    }

    public String member() {
        return member;
    }

    public ConsumerStats stats() {
        return new ConsumerStats(handled.get(), commits.get(), fencedCommits.get(), refusedCommits.get(),
                assignments.get(), streams.get(), handlerErrors.get());
    }

    /** Asks the consumer to finish: no new message is started; run returns once committed and left. */
    public void stop() {
        stopping = true;
        events.offer(STOP);
    }

    /**
     * Runs {@code handler} on every message until {@link #stop} is called, rejoining after broken
     * streams; on stop waits for running handlers, commits what finished and leaves. Errors
     * retrying cannot fix (unknown topic, invalid input) throw.
     */
    public ConsumerStats run(Handler handler) {
        ExecutorService workers = Executors.newFixedThreadPool(options.parallelism, runnable -> {
            Thread thread = new Thread(runnable, "levee-consumer-" + member);
            thread.setDaemon(true);
            return thread;
        });
        Following following = members;
        LeveeClient through = client;
        try {
            long backoff = options.backoffInitial.toNanos();
            while (true) {
                streams.incrementAndGet();
                long handledBefore = handled.get();
                try {
                    oneStream(through, handler, workers);
                    return stats();
                } catch (LeveeException error) {
                    if (error.code() == ErrorCode.ERROR_CODE_INVALID_ARGUMENT || error.code() == ErrorCode.ERROR_CODE_NOT_FOUND) {
                        throw error;
                    }
                }
                if (stopping) {
                    return stats();
                }
                if (following != null && !Following.answers(through, NODE_PROBE_TIMEOUT)) {
                    through = following.nextMember(NODE_PROBE_TIMEOUT);
                }
                if (handled.get() > handledBefore) {
                    backoff = options.backoffInitial.toNanos();
                }
                if (waitEvent(backoff) == STOP) {
                    return stats();
                }
                backoff = Math.min(backoff * 2, options.backoffMax.toNanos());
            }
        } finally {
            workers.shutdown();
            if (following != null) {
                following.close();
            }
        }
    }

    private Object waitEvent(long nanos) {
        try {
            return events.poll(nanos, TimeUnit.NANOSECONDS);
        } catch (InterruptedException interrupted) {
            Thread.currentThread().interrupt();
            stopping = true;
            return STOP;
        }
    }

    private void post(Object event) {
        try {
            events.put(event);
        } catch (InterruptedException interrupted) {
            Thread.currentThread().interrupt();
        }
    }

    private void oneStream(LeveeClient through, Handler handler, ExecutorService workers) {
        long number = ++streamNumber;
        partitions = new HashMap<>();
        creditOwedMessages = 0;
        creditOwedBytes = 0;
        commitsAwaiting = 0;
        MemberStream stream = MemberStream.open(through, topic, group, member, options.creditMessages,
                (int) options.lease.toMillis(), new MemberStream.Listener() {
                    @Override
                    public void onResponse(ConsumeResponse response) {
                        post(new Response(number, response));
                    }

                    @Override
                    public void onEnd(LeveeException error) {
                        post(new Ended(number, error));
                    }
                });
        long commitEvery = options.commitInterval.toNanos();
        long heartbeatEvery = options.lease.toNanos() / 3;
        long nextCommit = System.nanoTime() + commitEvery;
        long nextHeartbeat = System.nanoTime() + heartbeatEvery;
        try {
            while (true) {
                dispatch(handler, workers, number);
                if (creditOwedMessages > 0) {
                    stream.grant(creditOwedMessages, creditOwedBytes);
                    creditOwedMessages = 0;
                    creditOwedBytes = 0;
                }
                if (stopping && running == 0) {
                    finalCommit(stream, number);
                    stream.leave();
                    awaitEnd(number);
                    return;
                }
                long now = System.nanoTime();
                if (now - nextCommit >= 0) {
                    sendCommits(stream);
                    nextCommit = now + commitEvery;
                }
                if (now - nextHeartbeat >= 0) {
                    stream.heartbeat();
                    nextHeartbeat = now + heartbeatEvery;
                }
                Object event = waitEvent(Math.max(0, Math.min(nextCommit, nextHeartbeat) - System.nanoTime()));
                if (event != null) {
                    handle(event, number);
                }
            }
        } finally {
            stream.close();
        }
    }

    private void handle(Object event, long number) {
        if (event instanceof Response) {
            Response response = (Response) event;
            if (response.stream() == number) {
                take(response.response());
            }
        } else if (event instanceof Ended) {
            Ended ended = (Ended) event;
            if (ended.stream() == number) {
                throw ended.error() != null ? ended.error()
                        : LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "the consume stream closed");
            }
        } else if (event instanceof Finished) {
            finish((Finished) event, number);
        }
    }

    private void take(ConsumeResponse response) {
        if (response.hasAssignment()) {
            assignments.incrementAndGet();
            Map<Integer, PartitionState> kept = new HashMap<>();
            for (PartitionAssignment assigned : response.getAssignment().getPartitionsList()) {
                PartitionState state = partitions.get(assigned.getPartition());
                if (state == null || state.epoch != assigned.getEpoch()) {
                    state = new PartitionState(assigned.getEpoch(), assigned.getStartOffset());
                }
                kept.put(assigned.getPartition(), state);
            }
            partitions = kept;
        }
        for (TopicDelivery delivery : response.getDeliveriesList()) {
            PartitionState state = partitions.get(delivery.getPartition());
            if (state == null || state.epoch != delivery.getEpoch()) {
                // Delivered for a partition revoked meanwhile: hand the credit back.
                creditOwedMessages++;
                creditOwedBytes += delivery.getPayload().size();
                continue;
            }
            boolean idle = state.waiting.isEmpty() && state.running == 0 && state.finished.isEmpty();
            if (idle && delivery.getOffset() > state.frontier) {
                state.frontier = delivery.getOffset(); // retention removed the messages between
            }
            state.waiting.add(new ConsumerMessage(delivery.getPartition(), delivery.getOffset(),
                    delivery.getPayload().toByteArray(), delivery.getEpoch()));
        }
        if (response.getCommitResultsCount() > 0) {
            commitsAwaiting = Math.max(0, commitsAwaiting - 1);
            for (CommitResult result : response.getCommitResultsList()) {
                if (result.getCodeValue() == 0) {
                    commits.incrementAndGet();
                } else if (result.getCode() == ErrorCode.ERROR_CODE_FENCED) {
                    fencedCommits.incrementAndGet();
                    partitions.remove(result.getPartition());
                } else {
                    refusedCommits.incrementAndGet();
                }
            }
        }
    }

    private void dispatch(Handler handler, ExecutorService workers, long number) {
        if (stopping) {
            return;
        }
        for (PartitionState state : partitions.values()) {
            while (!state.waiting.isEmpty() && (!options.ordered || state.running == 0)) {
                if (running >= options.parallelism) {
                    return;
                }
                List<ConsumerMessage> job = new ArrayList<>();
                if (options.ordered) {
                    job.addAll(state.waiting);
                    state.waiting.clear();
                } else {
                    job.add(state.waiting.poll());
                }
                state.running++;
                running++;
                workers.execute(() -> runJob(handler, job, number));
            }
        }
    }

    private void runJob(Handler handler, List<ConsumerMessage> job, long number) {
        List<Long> offsets = new ArrayList<>(job.size());
        long payloadBytes = 0;
        for (ConsumerMessage message : job) {
            try {
                handler.handle(message);
            } catch (Exception error) {
                // A handler that throws still finishes its message, as the Rust client's
                // handlers return nothing; it is counted.
                handlerErrors.incrementAndGet();
            }
            offsets.add(message.offset());
            payloadBytes += message.payload().length;
        }
        ConsumerMessage first = job.get(0);
        post(new Finished(number, first.partition(), first.epoch(), offsets, payloadBytes));
    }

    private void finish(Finished finished, long number) {
        handled.addAndGet(finished.offsets().size());
        running--;
        if (finished.stream() != number) {
            return; // delivered on an earlier stream: its credit and commits died with it
        }
        creditOwedMessages += finished.offsets().size();
        creditOwedBytes += finished.payloadBytes();
        PartitionState state = partitions.get(finished.partition());
        if (state != null && state.epoch == finished.epoch()) {
            state.running = Math.max(0, state.running - 1);
            state.finished.addAll(finished.offsets());
            while (state.finished.remove(state.frontier)) {
                state.frontier++;
            }
        }
    }

    private List<Commit> commitsDue() {
        List<Commit> due = new ArrayList<>();
        for (Map.Entry<Integer, PartitionState> entry : partitions.entrySet()) {
            PartitionState state = entry.getValue();
            if (state.frontier > state.committed && due.size() < COMMITS_PER_BATCH_MAX) {
                state.committed = state.frontier;
                due.add(Commit.newBuilder().setPartition(entry.getKey()).setEpoch(state.epoch)
                        .setNextOffset(state.frontier).build());
            }
        }
        return due;
    }

    private void sendCommits(MemberStream stream) {
        List<Commit> due = commitsDue();
        if (!due.isEmpty()) {
            commitsAwaiting++;
            stream.commit(due);
        }
    }

    private void finalCommit(MemberStream stream, long number) {
        sendCommits(stream);
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(FINAL_COMMIT_WAIT_MS);
        while (commitsAwaiting > 0) {
            long left = deadline - System.nanoTime();
            if (left <= 0) {
                return;
            }
            Object event = waitEvent(left);
            if (event instanceof Ended && ((Ended) event).stream() == number) {
                return;
            }
            if (event != null && event != STOP) {
                handle(event, number);
            }
        }
    }

    private void awaitEnd(long number) {
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(LEAVE_WAIT_MS);
        while (true) {
            long left = deadline - System.nanoTime();
            if (left <= 0) {
                return;
            }
            Object event = waitEvent(left);
            if (event instanceof Ended && ((Ended) event).stream() == number) {
                return;
            }
        }
    }
}
