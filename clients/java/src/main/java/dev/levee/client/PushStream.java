package dev.levee.client;

import dev.levee.v1.ErrorCode;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.locks.Condition;
import java.util.concurrent.locks.ReentrantLock;
import java.util.function.Consumer;

/**
 * What the mailbox streams ({@link Subscription}, {@link Mailboxes}) share: the server's
 * responses taken as they come on gRPC's thread (what is held is bounded by the credit the
 * caller granted), a condition for waiters, serialised writes, and the stream's end (the
 * server's error, or a clean end). A wait that times out loses nothing.
 *
 * <p>A stream is one gRPC call at a time: a stream that follows the cluster ({@link Following})
 * starts a new call through another node when its node goes away ({@link #move}), and what
 * arrives from an earlier call is ignored.
 */
abstract class PushStream<RequestT, ResponseT> {
    /** Most moves one call of a following stream makes before it gives up. */
    static final int MOVES_PER_CALL_MAX = 8;

    /**
     * After a move, how many {@code GetQueueInfo} calls the stream makes at once to learn whether
     * a queue it delivered from was deleted meanwhile ({@link #endIfDeleted}).
     */
    static final int INFO_CHECKS_AT_ONCE = 64;

    protected final ReentrantLock lock = new ReentrantLock();
    protected final Condition changed = lock.newCondition();
    private final Object writeLock = new Object();
    /** Held while the stream moves to another node. */
    private final Object moveLock = new Object();
    /** The call now (under {@link #lock}). */
    private Call current;
    /** Calls started so far (under {@link #lock}): tells a move that another caller moved it. */
    private long calls;
    /** Set once the current call is over. */
    protected LeveeException ended;
    /** Ended by the server without an error, or closed here. */
    protected boolean cleanEnd;
    /** Closed by the application: never opened again. */
    private volatile boolean closedHere;
    /** How the stream opens again elsewhere, when it follows the cluster; else null. */
    protected Following following;

    /** One gRPC call of the stream: passes on what arrives while it is the current one. */
    private final class Call implements ClientResponseObserver<RequestT, ResponseT> {
        private ClientCallStreamObserver<RequestT> requests;
        private volatile boolean abandoned;

        @Override
        public void beforeStart(ClientCallStreamObserver<RequestT> requestStream) {
            this.requests = requestStream;
        }

        @Override
        public void onNext(ResponseT response) {
            lock.lock();
            try {
                if (current == this) {
                    take(response);
                    changed.signalAll();
                }
            } finally {
                lock.unlock();
            }
        }

        @Override
        public void onError(Throwable error) {
            end(this, abandoned || closedHere ? null : WireErrors.from(error));
        }

        @Override
        public void onCompleted() {
            end(this, null);
        }

        void cancel(String why) {
            abandoned = true;
            synchronized (writeLock) {
                if (requests != null) {
                    requests.cancel(why, null);
                }
            }
        }
    }

    /** Takes one response, under {@link #lock}. */
    protected abstract void take(ResponseT response);

    /** Forgets what the previous call held, under {@link #lock}, as a new call starts. */
    protected abstract void reset();

    /**
     * Opens the stream again through {@code member} as it was (see {@link Following}),
     * waiting at most {@code waitNanos}; throws when that member does not take it.
     */
    protected abstract void reopenThrough(LeveeClient member, long waitNanos);

    /**
     * Starts a new call with {@code opener} (which calls the gRPC stub with the observer it is
     * given), ending the previous one; the stream's state is {@link #reset}.
     */
    protected void start(Consumer<ClientResponseObserver<RequestT, ResponseT>> opener) {
        Call call = new Call();
        Call previous;
        lock.lock();
        try {
            if (closedHere) {
                throw LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "the stream is closed");
            }
            previous = current;
            current = call;
            calls++;
            ended = null;
            cleanEnd = false;
            reset();
        } finally {
            lock.unlock();
        }
        if (previous != null) {
            previous.cancel("the stream moved to another node");
        }
        opener.accept(call);
    }

    /** Ends the current call here (a try that failed): it is abandoned, not closed. */
    protected void abandon(String why) {
        Call call;
        lock.lock();
        try {
            call = current;
        } finally {
            lock.unlock();
        }
        if (call != null) {
            call.cancel(why);
            end(call, LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, why));
        }
    }

    /** Calls started so far: pass it to {@link #move} after a failure. */
    protected long calls() {
        lock.lock();
        try {
            return calls;
        } finally {
            lock.unlock();
        }
    }

    /** Whether the stream opens itself again elsewhere after {@code error}. */
    protected boolean movesAfter(LeveeException error) {
        return following != null && !closedHere && Following.nodeWentAway(error);
    }

    /**
     * After {@code cause} ended call number {@code seenCalls}: opens the stream again through
     * another member (unless another caller did already), or throws {@code cause} when it does
     * not follow the cluster, or no member took it in time.
     */
    protected void move(LeveeException cause, long seenCalls) {
        if (!movesAfter(cause)) {
            throw cause;
        }
        synchronized (moveLock) {
            if (calls() != seenCalls) {
                return;
            }
            following.reopen(this::reopenThrough, cause);
        }
    }

    private void end(Call call, LeveeException error) {
        lock.lock();
        try {
            if (current == call && ended == null) {
                cleanEnd = error == null;
                ended = error != null ? error
                        : LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "the stream is closed");
            }
            changed.signalAll();
        } finally {
            lock.unlock();
        }
    }

    /**
     * After a move through {@code member}: ends the stream with FAILED_PRECONDITION, as a server
     * ends one whose queue it deletes, when a queue it delivered from was deleted while it
     * moved ({@code queues} and, at the same places, {@code deliveredUntil}: the offset after
     * the last message delivered from each). A delete the old call did not live to see is not
     * seen by the new one either (the queue is then one that does not exist, or a new one under
     * the name), so the stream asks: a queue that does not exist, or whose next offset is below
     * what was delivered, was deleted. (A queue created again with more messages than were
     * delivered is not told apart.) Another failure of the calls is thrown, as the member
     * refusing the stream.
     */
    protected void endIfDeleted(LeveeClient member, java.util.List<byte[]> queues, java.util.List<Long> deliveredUntil) {
        dev.levee.v1.QueuesGrpc.QueuesFutureStub stub = dev.levee.v1.QueuesGrpc.newFutureStub(member.channel());
        long timeoutMillis = member.options().requestTimeout().toMillis();
        for (int start = 0; start < queues.size(); start += INFO_CHECKS_AT_ONCE) {
            int end = Math.min(queues.size(), start + INFO_CHECKS_AT_ONCE);
            java.util.List<java.util.concurrent.Future<dev.levee.v1.GetQueueInfoResponse>> asked = new java.util.ArrayList<>();
            for (int index = start; index < end; index++) {
                asked.add(stub.withDeadline(io.grpc.Deadline.after(timeoutMillis, TimeUnit.MILLISECONDS))
                        .getQueueInfo(dev.levee.v1.GetQueueInfoRequest.newBuilder()
                                .setQueue(com.google.protobuf.ByteString.copyFrom(queues.get(index))).build()));
            }
            long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(timeoutMillis);
            for (int index = start; index < end; index++) {
                byte[] queue = queues.get(index);
                boolean gone;
                try {
                    gone = waitFor(asked.get(index - start), deadline).getNextOffset() < deliveredUntil.get(index);
                } catch (LeveeException failed) {
                    if (failed.code() != ErrorCode.ERROR_CODE_NOT_FOUND) {
                        asked.forEach(call -> call.cancel(true));
                        throw failed;
                    }
                    gone = true;
                }
                if (gone) {
                    asked.forEach(call -> call.cancel(true));
                    endDeleted(queue);
                    return;
                }
            }
        }
    }

    /** Ends the stream because {@code queue} was deleted while it moved. */
    private void endDeleted(byte[] queue) {
        Call call;
        lock.lock();
        try {
            call = current;
            cleanEnd = false;
            ended = LeveeException.of(ErrorCode.ERROR_CODE_FAILED_PRECONDITION, "queue '"
                    + new String(queue, java.nio.charset.StandardCharsets.UTF_8)
                    + "' was deleted while this stream moved to another node: its messages and the "
                    + "consumer's position on it are gone; open the stream again to read a queue created "
                    + "again under the name, from offset 0");
            changed.signalAll();
        } finally {
            lock.unlock();
        }
        if (call != null) {
            call.cancel("a queue of the stream was deleted while it moved");
        }
    }

    /** The answer of {@code call}, waited for until {@code deadlineNanos}; its failure as a {@link LeveeException}. */
    private static <T> T waitFor(java.util.concurrent.Future<T> call, long deadlineNanos) {
        try {
            return call.get(Math.max(0, deadlineNanos - System.nanoTime()), TimeUnit.NANOSECONDS);
        } catch (java.util.concurrent.ExecutionException failed) {
            throw WireErrors.from(failed.getCause());
        } catch (java.util.concurrent.TimeoutException late) {
            call.cancel(true);
            throw LeveeException.of(ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED, "no answer to GetQueueInfo in time");
        } catch (InterruptedException interrupted) {
            Thread.currentThread().interrupt();
            throw LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "interrupted while asking whether a queue was deleted");
        }
    }

    /** Throws the stream's end, if it has ended. Call under {@link #lock}. */
    protected void raiseIfEnded() {
        if (ended != null) {
            throw ended.copy();
        }
    }

    /**
     * Waits (under {@link #lock}) for the next response or the end, until {@code deadlineNanos};
     * false once the deadline passed.
     */
    protected boolean await(long deadlineNanos) {
        long left = deadlineNanos - System.nanoTime();
        if (left <= 0) {
            return false;
        }
        try {
            changed.await(left, TimeUnit.NANOSECONDS);
        } catch (InterruptedException interrupted) {
            Thread.currentThread().interrupt();
            throw LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "interrupted while waiting on the stream");
        }
        return true;
    }

    /**
     * Waits until {@code done} holds (checked under {@link #lock}), throwing the stream's end
     * if it ends first and DEADLINE_EXCEEDED naming {@code what} after {@code timeoutNanos}.
     */
    protected void awaitAnswer(java.util.function.BooleanSupplier done, long timeoutNanos, String what) {
        long deadline = System.nanoTime() + timeoutNanos;
        lock.lock();
        try {
            while (!done.getAsBoolean()) {
                raiseIfEnded();
                if (!await(deadline)) {
                    throw LeveeException.of(ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED, what + " not answered in time");
                }
            }
        } finally {
            lock.unlock();
        }
    }

    /** Sends one request on the current call; throws the call's end if it is over. */
    protected void write(RequestT request) {
        Call call;
        lock.lock();
        try {
            raiseIfEnded();
            call = current;
        } finally {
            lock.unlock();
        }
        synchronized (writeLock) {
            try {
                call.requests.onNext(request);
            } catch (RuntimeException error) {
                throw WireErrors.from(error);
            }
        }
    }

    /** Closes the sending side: the server ends the stream once it has seen everything. */
    protected void finishWriting() {
        Call call;
        lock.lock();
        try {
            call = current;
        } finally {
            lock.unlock();
        }
        synchronized (writeLock) {
            try {
                call.requests.onCompleted();
            } catch (RuntimeException ignored) {
                // already ended
            }
        }
    }

    /**
     * Ends the stream now (a following stream is not opened again, and its channels to other
     * members are closed); messages not acked are delivered again to the next subscription.
     */
    public void close() {
        closedHere = true;
        Call call;
        lock.lock();
        try {
            call = current;
        } finally {
            lock.unlock();
        }
        if (call != null) {
            call.cancel("closed by the client");
            end(call, null);
        }
        if (following != null) {
            following.close();
        }
    }
}
