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
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;

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
    /**
     * Most mailboxes (removed ones included) a following stream remembers to add again after a
     * move: the server's bound on mailboxes over all streams.
     */
    public static final int FOLLOWED_MAILBOXES_MAX = 4_000_000;
    /** Longest a move waits for a member's connection when the stream has no queue to add. */
    private static final long READY_WAIT_NANOS = Duration.ofSeconds(1).toNanos();

    private final LeveeClient client;
    private final String consumer;
    private final int creditMessages;
    private final ArrayDeque<MailboxDelivery> received = new ArrayDeque<>();
    private final Map<Integer, Long> acks = new LinkedHashMap<>();
    /** Of a following stream: every queue added, in mailbox order, to add them again after a move. */
    private final List<byte[]> queuesAdded = new ArrayList<>();
    /**
     * Of a following stream: the mailbox numbers removed (each once, each a number added), to
     * remove them again after a move.
     */
    private final Set<Integer> mailboxesRemoved = new LinkedHashSet<>();
    /**
     * The mailboxes removed before the current call started (under {@link #lock}): after a
     * move, their deliveries sent before the remove again reached the server are dropped.
     */
    private Set<Integer> removedBeforeMove = Set.of();
    /**
     * Of a following stream: the offset after the last message handed out, by mailbox, over
     * every call (under {@link #lock}): after a move, a queue deleted meanwhile is told by it.
     */
    private final Map<Integer, Long> deliveredUntil = new LinkedHashMap<>();
    /** Deliveries dropped and their payload bytes (under {@link #lock}), whose credit goes back. */
    private long droppedMessages;
    private long droppedBytes;
    private int added;
    private long confirmed;
    private long takenMessages;
    private long takenBytes;
    private long ackSequence;
    private long ackedSequence;

    private Mailboxes(LeveeClient client, String consumer, int creditMessages) {
        this.client = client;
        this.consumer = consumer;
        this.creditMessages = creditMessages;
    }

    static Mailboxes open(LeveeClient client, String consumer, int creditMessages) {
        Validation.checkConsumer(consumer);
        Validation.checkCredit(creditMessages);
        Mailboxes mailboxes = new Mailboxes(client, consumer, creditMessages);
        mailboxes.begin(client);
        return mailboxes;
    }

    /** {@link #open}, following the cluster: see {@link LeveeClient#subscribeManyFollowing}. */
    static Mailboxes openFollowing(LeveeClient client, String consumer, int creditMessages) {
        Mailboxes mailboxes = open(client, consumer, creditMessages);
        mailboxes.following = Following.learnedFrom(client);
        return mailboxes;
    }

    /** Starts a call through {@code through}. */
    private void begin(LeveeClient through) {
        start(observer -> QueuesGrpc.newStub(through.channel()).subscribeMany(observer));
        write(SubscribeManyRequest.newBuilder().setStart(SubscribeManyStart.newBuilder().setConsumer(consumer)
                .setCredit(Credit.newBuilder().setMessages(creditMessages))).build());
    }

    @Override
    protected void reopenThrough(LeveeClient member, long waitNanos) {
        if (queuesAdded.isEmpty()) {
            // Nothing to wait an answer for: a member that is down must not take the stream.
            Channels.awaitReady(member.channel(), member.address(), Duration.ofNanos(Math.min(waitNanos, READY_WAIT_NANOS)));
        }
        begin(member);
        try {
            addOnce(queuesAdded, waitNanos);
            removeOnce(new ArrayList<>(mailboxesRemoved));
        } catch (LeveeException failed) {
            abandon("the stream could not add its queues again: " + failed.description());
            throw failed;
        }
        List<byte[]> delivered = new ArrayList<>();
        List<Long> until = new ArrayList<>();
        lock.lock();
        try {
            for (Map.Entry<Integer, Long> entry : deliveredUntil.entrySet()) {
                if (!mailboxesRemoved.contains(entry.getKey())) {
                    delivered.add(queuesAdded.get(entry.getKey()));
                    until.add(entry.getValue());
                }
            }
        } finally {
            lock.unlock();
        }
        endIfDeleted(member, delivered, until);
    }

    @Override
    protected void reset() {
        // Acks recorded and not sent go with the old call: their messages come again.
        removedBeforeMove = Set.copyOf(mailboxesRemoved);
        droppedMessages = 0;
        droppedBytes = 0;
        received.clear();
        acks.clear();
        added = 0;
        confirmed = 0;
        takenMessages = 0;
        takenBytes = 0;
        ackSequence = 0;
        ackedSequence = 0;
    }

    @Override
    protected void take(SubscribeManyResponse response) {
        for (dev.levee.v1.MailboxDelivery delivery : response.getDeliveriesList()) {
            if (removedBeforeMove.contains(delivery.getMailbox())) {
                // Sent between the add and the remove of a move: the application removed it.
                droppedMessages++;
                droppedBytes += delivery.getPayload().size();
                continue;
            }
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
     * them: their mailbox numbers, in order. A following stream whose node went away opens
     * itself again elsewhere with every queue added, these included.
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
        if (following != null) {
            if (queuesAdded.size() + queues.size() > FOLLOWED_MAILBOXES_MAX) {
                throw LeveeException.of(ErrorCode.ERROR_CODE_RESOURCE_EXHAUSTED, "a following stream remembers at most "
                        + FOLLOWED_MAILBOXES_MAX + " mailboxes (removed ones included) to add again after a move; it has "
                        + queuesAdded.size() + " and this add has " + queues.size() + "; open another stream");
            }
            queues.forEach(queue -> queuesAdded.add(queue.clone()));
        }
        long calls = calls();
        try {
            addOnce(queues, timeoutNanos());
        } catch (LeveeException error) {
            if (!movesAfter(error)) {
                if (following != null) {
                    queuesAdded.subList(first, queuesAdded.size()).clear();
                }
                throw error;
            }
            move(error, calls);
        }
        List<Integer> numbers = new ArrayList<>(added - first);
        for (int number = first; number < added; number++) {
            numbers.add(number);
        }
        return numbers;
    }

    private void addOnce(List<byte[]> queues, long waitNanos) {
        for (int start = 0; start < queues.size(); start += MAILBOXES_PER_REQUEST_MAX) {
            AddMailboxes.Builder add = AddMailboxes.newBuilder();
            for (byte[] queue : queues.subList(start, Math.min(queues.size(), start + MAILBOXES_PER_REQUEST_MAX))) {
                add.addQueues(ByteString.copyFrom(queue));
            }
            write(SubscribeManyRequest.newBuilder().setAdd(add).build());
            added += add.getQueuesCount();
        }
        awaitAnswer(() -> confirmed >= added, waitNanos, "the add of mailboxes was");
    }

    /**
     * Stops delivery from {@code mailboxes}; acks recorded before are sent first. A following
     * stream whose node went away opens itself again elsewhere with these removed.
     */
    public synchronized void remove(List<Integer> mailboxes) {
        if (following != null) {
            for (int mailbox : mailboxes) {
                if (mailbox >= 0 && mailbox < queuesAdded.size()) {
                    mailboxesRemoved.add(mailbox);
                }
            }
        }
        long calls = calls();
        try {
            removeOnce(mailboxes);
        } catch (LeveeException error) {
            move(error, calls);
        }
    }

    private void removeOnce(List<Integer> mailboxes) {
        sendAcks();
        for (int start = 0; start < mailboxes.size(); start += MAILBOXES_PER_REQUEST_MAX) {
            write(SubscribeManyRequest.newBuilder().setRemove(RemoveMailboxes.newBuilder()
                    .addAllMailboxes(mailboxes.subList(start, Math.min(mailboxes.size(), start + MAILBOXES_PER_REQUEST_MAX))))
                    .build());
        }
    }

    /**
     * The next message of any mailbox, waiting at most {@code timeout}; null on timeout or once
     * the stream ended cleanly. A following stream whose node went away opens itself again
     * elsewhere (which may take up to 30 s beyond the timeout) and goes on from the consumer's
     * last confirmed acks: messages taken or acked but not confirmed are delivered again.
     */
    public synchronized MailboxDelivery next(Duration timeout) {
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

    private MailboxDelivery nextOnce(long deadline) {
        MailboxDelivery delivery;
        while (true) {
            lock.lock();
            try {
                delivery = received.poll();
                // Deliveries dropped give their credit back as if taken.
                takenMessages += droppedMessages;
                takenBytes += droppedBytes;
                droppedMessages = 0;
                droppedBytes = 0;
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
        if (following != null) {
            lock.lock();
            try {
                deliveredUntil.merge(delivery.mailbox(), delivery.offset() + 1, Math::max);
            } finally {
                lock.unlock();
            }
        }
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

    /**
     * Sends the recorded acks and returns once they (and every ack before) are durable. On a
     * following stream whose node went away before they were confirmed, it throws UNAVAILABLE
     * once the stream is open again through another node (the unconfirmed messages are
     * delivered again).
     */
    public synchronized void flushAcks() {
        long calls = calls();
        try {
            sendAcks();
            awaitAnswer(() -> ackedSequence >= ackSequence, timeoutNanos(), "the acks were");
        } catch (LeveeException error) {
            move(error, calls);
            throw LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "the stream's node went away before the acks "
                    + "were confirmed; the stream is open again through another node and delivers the unconfirmed "
                    + "messages again");
        }
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
