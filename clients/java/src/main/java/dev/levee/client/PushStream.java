package dev.levee.client;

import dev.levee.v1.ErrorCode;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.locks.Condition;
import java.util.concurrent.locks.ReentrantLock;

/**
 * What the mailbox streams ({@link Subscription}, {@link Mailboxes}) share: the server's
 * responses taken as they come on gRPC's thread (what is held is bounded by the credit the
 * caller granted), a condition for waiters, serialised writes, and the stream's end (the
 * server's error, or a clean end). A wait that times out loses nothing.
 */
abstract class PushStream<RequestT, ResponseT> implements ClientResponseObserver<RequestT, ResponseT> {
    protected final ReentrantLock lock = new ReentrantLock();
    protected final Condition changed = lock.newCondition();
    private final Object writeLock = new Object();
    private ClientCallStreamObserver<RequestT> requests;
    /** Set once the stream is over. */
    protected LeveeException ended;
    /** Ended by the server without an error, or closed here. */
    protected boolean cleanEnd;
    private volatile boolean closedHere;

    /** Takes one response, under {@link #lock}. */
    protected abstract void take(ResponseT response);

    @Override
    public void beforeStart(ClientCallStreamObserver<RequestT> requestStream) {
        this.requests = requestStream;
    }

    @Override
    public void onNext(ResponseT response) {
        lock.lock();
        try {
            take(response);
            changed.signalAll();
        } finally {
            lock.unlock();
        }
    }

    @Override
    public void onError(Throwable error) {
        end(closedHere ? null : WireErrors.from(error));
    }

    @Override
    public void onCompleted() {
        end(null);
    }

    private void end(LeveeException error) {
        lock.lock();
        try {
            if (ended == null) {
                cleanEnd = error == null;
                ended = error != null ? error
                        : LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "the stream is closed");
            }
            changed.signalAll();
        } finally {
            lock.unlock();
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

    /** Sends one request; throws the stream's end if it is over. */
    protected void write(RequestT request) {
        lock.lock();
        try {
            raiseIfEnded();
        } finally {
            lock.unlock();
        }
        synchronized (writeLock) {
            try {
                requests.onNext(request);
            } catch (RuntimeException error) {
                throw WireErrors.from(error);
            }
        }
    }

    /** Closes the sending side: the server ends the stream once it has seen everything. */
    protected void finishWriting() {
        synchronized (writeLock) {
            try {
                requests.onCompleted();
            } catch (RuntimeException ignored) {
                // already ended
            }
        }
    }

    /** Ends the stream now; messages not acked are delivered again to the next subscription. */
    public void close() {
        closedHere = true;
        synchronized (writeLock) {
            requests.cancel("closed by the client", null);
        }
        end(null);
    }
}
