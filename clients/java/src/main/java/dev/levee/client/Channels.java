package dev.levee.client;

import dev.levee.v1.ErrorCode;
import io.grpc.ConnectivityState;
import io.grpc.Grpc;
import io.grpc.InsecureChannelCredentials;
import io.grpc.ManagedChannel;
import java.time.Duration;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;

/** Opens the HTTP/2 channels the client's parts use. */
final class Channels {
    /**
     * The largest message a channel takes: above every call's server limit (16 MiB for queues
     * and topics), so that the server, not the library, names the limit it enforces.
     */
    static final int CHANNEL_MESSAGE_BYTES_MAX = 64 << 20;
    static final long KEEPALIVE_S = 30;

    private Channels() {}

    static String target(String address) {
        int scheme = address.indexOf("://");
        return scheme >= 0 ? address.substring(scheme + 3) : address;
    }

    /** A channel to a server; it connects lazily and reconnects by itself. */
    static ManagedChannel open(String address) {
        return Grpc.newChannelBuilder(target(address), InsecureChannelCredentials.create())
                .maxInboundMessageSize(CHANNEL_MESSAGE_BYTES_MAX)
                .keepAliveTime(KEEPALIVE_S, TimeUnit.SECONDS)
                .build();
    }

    /** Waits until the channel is connected; UNAVAILABLE after the timeout. */
    static void awaitReady(ManagedChannel channel, String address, Duration timeout) {
        long deadline = System.nanoTime() + timeout.toNanos();
        while (true) {
            ConnectivityState state = channel.getState(true);
            if (state == ConnectivityState.READY) {
                return;
            }
            long left = deadline - System.nanoTime();
            if (left <= 0 || state == ConnectivityState.SHUTDOWN) {
                throw LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "cannot connect to the levee server at "
                        + address + " (" + state + "); check that it is running and listening there");
            }
            CountDownLatch changed = new CountDownLatch(1);
            channel.notifyWhenStateChanged(state, changed::countDown);
            try {
                changed.await(Math.min(left, TimeUnit.MILLISECONDS.toNanos(100)), TimeUnit.NANOSECONDS);
            } catch (InterruptedException interrupted) {
                Thread.currentThread().interrupt();
                throw LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "interrupted while connecting to " + address);
            }
        }
    }
}
