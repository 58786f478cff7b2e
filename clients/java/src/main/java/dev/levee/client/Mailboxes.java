package dev.levee.client;

import com.google.protobuf.ByteString;
import dev.levee.v1.AddMailboxes;
import dev.levee.v1.Credit;
import dev.levee.v1.ErrorCode;
import dev.levee.v1.MailboxAck;
import dev.levee.v1.MailboxAcks;
import dev.levee.v1.QueuesGrpc;
import dev.levee.v1.RemoveMailboxes;
import dev.levee.v1.SubscribeManyRequest;
import dev.levee.v1.SubscribeManyResponse;
import dev.levee.v1.SubscribeManyStart;
import java.time.Duration;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * One consumer's stream over many queues at once (an app server holding the mailboxes of its
 * connected users), with one credit and batched acks.
 *
 * <p>{@link #add} numbers the queues it adds in order (0, 1, ...); every delivery names its
 * mailbox by that number. Credit covers the whole stream: taken messages give their credit back
 * (once half the credit is taken, and whenever {@link #next} is about to wait). Acks are
 * cumulative per mailbox and buffered: {@link #ack} records one, {@link #next} sends them (once
 * {@link #ACKS_BUFFERED_MAX} mailboxes wait, and whenever it is about to wait), and
 * {@link #flushAcks} sends them and returns once they are durable. Thread-safe.
 */
public final class Mailboxes extends PushStream<SubscribeManyRequest, SubscribeManyResponse> implements AutoCloseable {
    /** Most queues (or mailbox numbers, or acks) in one request: the server's bound. */
    public static final int MAILBOXES_PER_REQUEST_MAX = 10_000;
    /** Mailboxes with an ack waiting before {@link #next} sends them without being asked. */
    public static final int ACKS_BUFFERED_MAX = 1_024;

    private final LeveeClient client;
    private final int creditMessages;
    private final ArrayDeque<MailboxDelivery> received = new ArrayDeque<>();
    private final Map<Integer, Long> acks = new LinkedHashMap<>();
    private int added;
    private long confirmed;
    private long takenMessages;
    private long takenBytes;
    private long ackSequence;
    private long ackedSequence;

    private Mailboxes(LeveeClient client, int creditMessages) {
        this.client = client;
        this.creditMessages = creditMessages;
    }

    static Mailboxes open(LeveeClient client, String consumer, int creditMessages) {
        Validation.checkConsumer(consumer);
        Validation.checkCredit(creditMessages);
        Mailboxes mailboxes = new Mailboxes(client, creditMessages);
        QueuesGrpc.newStub(client.channel()).subscribeMany(mailboxes);
        mailboxes.write(SubscribeManyRequest.newBuilder().setStart(SubscribeManyStart.newBuilder().setConsumer(consumer)
                .setCredit(Credit.newBuilder().setMessages(creditMessages))).build());
        return mailboxes;
    }

    @Override
    protected void take(SubscribeManyResponse response) {
        for (dev.levee.v1.MailboxDelivery delivery : response.getDeliveriesList()) {
            received.add(new MailboxDelivery(delivery.getMailbox(), delivery.getOffset(), delivery.getPayload().toByteArray()));
        }
        confirmed = Math.max(confirmed, response.getMailboxesAdded());
        ackedSequence = Math.max(ackedSequence, response.getAckedSequence());
    }

    private long timeoutNanos() {
        return client.options().requestTimeout().toNanos();
    }

    /**
     * Adds {@code queues} (each at most once per stream) and returns once the server registered
     * them: their mailbox numbers, in order.
     */
    public synchronized List<Integer> add(List<byte[]> queues) {
        for (int index = 0; index < queues.size(); index++) {
            try {
                Validation.checkSubscribeQueue(queues.get(index));
            } catch (LeveeException error) { // the server names the queue by its place in the add
                throw LeveeException.of(error.code(), "queues[" + (index % MAILBOXES_PER_REQUEST_MAX) + "]: " + error.description());
            }
        }
        int first = added;
        for (int start = 0; start < queues.size(); start += MAILBOXES_PER_REQUEST_MAX) {
            AddMailboxes.Builder add = AddMailboxes.newBuilder();
            for (byte[] queue : queues.subList(start, Math.min(queues.size(), start + MAILBOXES_PER_REQUEST_MAX))) {
                add.addQueues(ByteString.copyFrom(queue));
            }
            write(SubscribeManyRequest.newBuilder().setAdd(add).build());
            added += add.getQueuesCount();
        }
        awaitAnswer(() -> confirmed >= added, timeoutNanos(), "the add of mailboxes was");
        List<Integer> numbers = new ArrayList<>(added - first);
        for (int number = first; number < added; number++) {
            numbers.add(number);
        }
        return numbers;
    }

    /** Stops delivery from {@code mailboxes}; acks recorded before are sent first. */
    public synchronized void remove(List<Integer> mailboxes) {
        sendAcks();
        for (int start = 0; start < mailboxes.size(); start += MAILBOXES_PER_REQUEST_MAX) {
            write(SubscribeManyRequest.newBuilder().setRemove(RemoveMailboxes.newBuilder()
                    .addAllMailboxes(mailboxes.subList(start, Math.min(mailboxes.size(), start + MAILBOXES_PER_REQUEST_MAX))))
                    .build());
        }
    }

    /**
     * The next message of any mailbox, waiting at most {@code timeout}; null on timeout or once
     * the stream ended cleanly.
     */
    public synchronized MailboxDelivery next(Duration timeout) {
        long deadline = System.nanoTime() + timeout.toNanos();
        MailboxDelivery delivery;
        while (true) {
            lock.lock();
            try {
                delivery = received.poll();
            } finally {
                lock.unlock();
            }
            if (delivery != null) {
                break;
            }
            // About to wait: give back all the credit taken and send the acks.
            grantCredit();
            sendAcks();
            lock.lock();
            try {
                if (received.isEmpty()) {
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
        takenMessages++;
        takenBytes += delivery.payload().length;
        if (takenMessages >= (creditMessages + 1) / 2) {
            grantCredit();
        }
        if (acks.size() >= ACKS_BUFFERED_MAX) {
            sendAcks();
        }
        return delivery;
    }

    /** Records that every message of {@code mailbox} up to and including {@code offset} is done. */
    public synchronized void ack(int mailbox, long offset) {
        acks.merge(mailbox, offset, Math::max);
    }

    /** Sends the recorded acks and returns once they (and every ack before) are durable. */
    public synchronized void flushAcks() {
        sendAcks();
        awaitAnswer(() -> ackedSequence >= ackSequence, timeoutNanos(), "the acks were");
    }

    private void grantCredit() {
        if (takenMessages == 0) {
            return;
        }
        Credit credit = Credit.newBuilder().setMessages((int) takenMessages)
                .setBytes((int) Math.min(takenBytes, 0xffffffffL)).build();
        takenMessages = 0;
        takenBytes = 0;
        write(SubscribeManyRequest.newBuilder().setCredit(credit).build());
    }

    private void sendAcks() {
        if (acks.isEmpty()) {
            return;
        }
        List<MailboxAck> pending = new ArrayList<>(acks.size());
        acks.forEach((mailbox, offset) -> pending.add(MailboxAck.newBuilder().setMailbox(mailbox).setOffset(offset).build()));
        acks.clear();
        for (int start = 0; start < pending.size(); start += MAILBOXES_PER_REQUEST_MAX) {
            ackSequence++;
            write(SubscribeManyRequest.newBuilder().setAck(MailboxAcks.newBuilder()
                    .addAllAcks(pending.subList(start, Math.min(pending.size(), start + MAILBOXES_PER_REQUEST_MAX)))
                    .setSequence(ackSequence)).build());
        }
    }
}
