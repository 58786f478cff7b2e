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
    private final ArrayDeque<Delivery> received = new ArrayDeque<>();
    /** Handed to the caller and not yet acked: offset and payload bytes, for the credit. */
    private final ArrayDeque<long[]> unacked = new ArrayDeque<>();
    private long ackedOffset;
    private long startOffset = -1;

    private Subscription(LeveeClient client) {
        this.client = client;
    }

    static Subscription open(LeveeClient client, byte[] queue, String consumer, int creditMessages) {
        Validation.checkSubscribeQueue(queue);
        Validation.checkConsumer(consumer);
        Validation.checkCredit(creditMessages);
        Subscription subscription = new Subscription(client);
        QueuesGrpc.newStub(client.channel()).subscribe(subscription);
        subscription.write(SubscribeRequest.newBuilder().setStart(SubscribeStart.newBuilder()
                .setQueue(ByteString.copyFrom(queue)).setConsumer(consumer)
                .setCredit(Credit.newBuilder().setMessages(creditMessages))).build());
        long deadline = System.nanoTime() + client.options().requestTimeout().toNanos();
        subscription.lock.lock();
        try {
            while (subscription.startOffset < 0) {
                if (subscription.ended != null) {
                    throw subscription.cleanEnd
                            ? LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "the server closed the subscription")
                            : subscription.ended.copy();
                }
                if (!subscription.await(deadline)) {
                    subscription.close();
                    throw LeveeException.of(ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED,
                            "the server did not start the subscription in time");
                }
            }
        } finally {
            subscription.lock.unlock();
        }
        return subscription;
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

    /** Where delivery started: the offset after the consumer's last ack. */
    public long startOffset() {
        return startOffset;
    }

    /**
     * The next message, waiting at most {@code timeout} for one to be appended; null on timeout
     * or once the stream has ended cleanly. Throws the server's error when it ended the stream
     * with one.
     */
    public Delivery next(Duration timeout) {
        long deadline = System.nanoTime() + timeout.toNanos();
        lock.lock();
        try {
            while (true) {
                Delivery delivery = received.poll();
                if (delivery != null) {
                    unacked.add(new long[] {delivery.offset(), delivery.payload().length});
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
     * credit back; returns once the server made the ack durable.
     */
    public void ack(long offset) {
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
        write(SubscribeRequest.newBuilder().setAck(Ack.newBuilder().setOffset(offset)).build());
        awaitAnswer(() -> ackedOffset > offset, client.options().requestTimeout().toNanos(), "the ack of " + offset + " was");
        // The credit goes once the ack is answered: a refused ack ends the stream, and a write
        // after that would hide the server's error behind the transport's.
        if (messages > 0) {
            write(SubscribeRequest.newBuilder().setCredit(Credit.newBuilder().setMessages((int) messages)
                    .setBytes((int) Math.min(payloadBytes, 0xffffffffL))).build());
        }
    }
}
