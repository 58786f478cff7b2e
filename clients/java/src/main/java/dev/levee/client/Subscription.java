package dev.levee.client;

import com.google.protobuf.ByteString;
import dev.levee.v1.Ack;
import dev.levee.v1.Credit;
import dev.levee.v1.ErrorCode;
import dev.levee.v1.QueuesGrpc;
import dev.levee.v1.SubscribeRequest;
import dev.levee.v1.SubscribeResponse;
import dev.levee.v1.SubscribeStart;
import java.time.Duration;
import java.util.ArrayDeque;
import java.util.List;

/**
 * One consumer's mailbox stream on one queue, with credits and acks.
 *
 * <p>The server pushes messages as they are appended, never more than the credit granted,
 * starting after the consumer's last ack; messages delivered but not acked are delivered again
 * to the next subscription of the same consumer. {@link #ack} is cumulative, returns once
 * durable, and grants the acked messages' credit back. What is held is bounded by the credit.
 * Thread-safe.
 */
public final class Subscription extends PushStream<SubscribeRequest, SubscribeResponse> implements AutoCloseable {
    private final LeveeClient client;
    private final byte[] queue;
    private final String consumer;
    private final int creditMessages;
    private final ArrayDeque<Delivery> received = new ArrayDeque<>();
    /** Handed to the caller and not yet acked: offset and payload bytes, for the credit. */
    private final ArrayDeque<long[]> unacked = new ArrayDeque<>();
    private long ackedOffset;
    private long startOffset = -1;
    /**
     * The offset after the last message handed out, over every call (0 before any; under
     * {@link #lock}): after a move, a queue deleted meanwhile is told by it.
     */
    private long deliveredUntil;

    private Subscription(LeveeClient client, byte[] queue, String consumer, int creditMessages) {
        this.client = client;
        this.queue = queue.clone();
        this.consumer = consumer;
        this.creditMessages = creditMessages;
    }

    static Subscription open(LeveeClient client, byte[] queue, String consumer, int creditMessages) {
        Validation.checkSubscribeQueue(queue);
        Validation.checkConsumer(consumer);
        Validation.checkCredit(creditMessages);
        Subscription subscription = new Subscription(client, queue, consumer, creditMessages);
        subscription.begin(client, client.options().requestTimeout().toNanos());
        return subscription;
    }

    /** {@link #open}, following the cluster: see {@link LeveeClient#subscribeFollowing}. */
    static Subscription openFollowing(LeveeClient client, byte[] queue, String consumer, int creditMessages) {
        Subscription subscription = open(client, queue, consumer, creditMessages);
        subscription.following = Following.learnedFrom(client);
        return subscription;
    }

    /** Starts a call through {@code through} and waits (at most {@code waitNanos}) for its start. */
    private void begin(LeveeClient through, long waitNanos) {
        start(observer -> QueuesGrpc.newStub(through.channel()).subscribe(observer));
        write(SubscribeRequest.newBuilder().setStart(SubscribeStart.newBuilder()
                .setQueue(ByteString.copyFrom(queue)).setConsumer(consumer)
                .setCredit(Credit.newBuilder().setMessages(creditMessages))).build());
        long deadline = System.nanoTime() + waitNanos;
        lock.lock();
        try {
            while (startOffset < 0) {
                if (ended != null) {
                    throw cleanEnd
                            ? LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "the server closed the subscription")
                            : ended.copy();
                }
                if (!await(deadline)) {
                    abandon("the server did not start the subscription in time");
                    throw LeveeException.of(ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED,
                            "the server did not start the subscription in time");
                }
            }
        } finally {
            lock.unlock();
        }
    }

    @Override
    protected void reopenThrough(LeveeClient member, long waitNanos) {
        begin(member, waitNanos);
        long until;
        lock.lock();
        try {
            until = deliveredUntil;
        } finally {
            lock.unlock();
        }
        if (until > 0) {
            endIfDeleted(member, List.of(queue), List.of(until));
        }
    }

    @Override
    protected void reset() {
        received.clear();
        unacked.clear();
        ackedOffset = 0;
        startOffset = -1;
    }

    @Override
    protected void take(SubscribeResponse response) {
        if (startOffset < 0 && response.hasStartOffset()) {
            startOffset = response.getStartOffset();
        }
        for (dev.levee.v1.Delivery delivery : response.getDeliveriesList()) {
            received.add(new Delivery(delivery.getOffset(), delivery.getPayload().toByteArray()));
        }
        ackedOffset = Math.max(ackedOffset, response.getAckedOffset());
    }

    /**
     * Where delivery started: the offset after the consumer's last ack (after a following
     * subscription moved: where the reopened one started).
     */
    public long startOffset() {
        lock.lock();
        try {
            return startOffset;
        } finally {
            lock.unlock();
        }
    }

    /**
     * The next message, waiting at most {@code timeout} for one to be appended; null on timeout
     * or once the stream has ended cleanly. Throws the server's error when it ended the stream
     * with one. A following subscription whose node went away opens itself again elsewhere
     * (which may take up to 30 s beyond the timeout) and goes on from the consumer's last
     * confirmed ack.
     */
    public Delivery next(Duration timeout) {
        long deadline = System.nanoTime() + timeout.toNanos();
        for (int moves = 0; ; moves++) {
            long calls = calls();
            try {
                return nextOnce(deadline);
            } catch (LeveeException error) {
                if (moves >= MOVES_PER_CALL_MAX) {
                    throw error;
                }
                move(error, calls);
            }
        }
    }

    private Delivery nextOnce(long deadline) {
        lock.lock();
        try {
            while (true) {
                Delivery delivery = received.poll();
                if (delivery != null) {
                    unacked.add(new long[] {delivery.offset(), delivery.payload().length});
                    deliveredUntil = Math.max(deliveredUntil, delivery.offset() + 1);
                    return delivery;
                }
                if (ended != null) {
                    if (cleanEnd) {
                        return null;
                    }
                    throw ended.copy();
                }
                if (!await(deadline)) {
                    return null;
                }
            }
        } finally {
            lock.unlock();
        }
    }

    /**
     * Marks every delivered message up to and including {@code offset} done and grants their
     * credit back; returns once the server made the ack durable. On a following subscription
     * whose node went away before the ack was confirmed, it returns once the subscription is
     * open again through another node if that one starts after {@code offset} (the ack was
     * confirmed after all), and throws UNAVAILABLE otherwise (the unconfirmed messages are
     * delivered again).
     */
    public void ack(long offset) {
        long calls = calls();
        try {
            ackOnce(offset);
        } catch (LeveeException error) {
            move(error, calls);
            long restarted = startOffset();
            if (offset < restarted) {
                return;
            }
            throw LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "the subscription's node went away before the "
                    + "ack of offset " + offset + " was confirmed; the subscription is open again through another "
                    + "node from offset " + restarted + " and delivers the unconfirmed messages again");
        }
    }

    private void ackOnce(long offset) {
        long messages = 0;
        long payloadBytes = 0;
        lock.lock();
        try {
            while (!unacked.isEmpty() && unacked.peek()[0] <= offset) {
                payloadBytes += unacked.poll()[1];
                messages++;
            }
        } finally {
            lock.unlock();
        }
        long calls = calls();
        write(SubscribeRequest.newBuilder().setAck(Ack.newBuilder().setOffset(offset)).build());
        awaitAnswer(() -> ackedOffset > offset || calls() != calls, client.options().requestTimeout().toNanos(),
                "the ack of " + offset + " was");
        if (calls() != calls) {
            // Another caller moved the subscription meanwhile: this ack went with the old call.
            throw LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "the subscription moved to another node");
        }
        // The credit goes once the ack is answered: a refused ack ends the stream, and a write
        // after that would hide the server's error behind the transport's.
        if (messages > 0) {
            write(SubscribeRequest.newBuilder().setCredit(Credit.newBuilder().setMessages((int) messages)
                    .setBytes((int) Math.min(payloadBytes, 0xffffffffL))).build());
        }
    }
}
