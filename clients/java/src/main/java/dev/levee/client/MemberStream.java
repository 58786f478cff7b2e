package dev.levee.client;

import dev.levee.v1.Commit;
import dev.levee.v1.CommitBatch;
import dev.levee.v1.ConsumeRequest;
import dev.levee.v1.ConsumeResponse;
import dev.levee.v1.ConsumeStart;
import dev.levee.v1.Credit;
import dev.levee.v1.Heartbeat;
import dev.levee.v1.TopicsGrpc;
import io.grpc.stub.ClientCallStreamObserver;
import io.grpc.stub.ClientResponseObserver;
import java.util.List;

/**
 * One member's raw Consume stream: the start, assignments, deliveries, credit, commits and
 * heartbeats exactly as the wire has them. {@link GroupConsumer} builds on it; use it directly
 * to control every step (the conformance runner does). Responses go to a {@link Listener} on
 * gRPC's thread, in order; what arrives is bounded by the credit granted.
 */
public final class MemberStream implements AutoCloseable {
    /** Receives a stream's responses and its end. */
    public interface Listener {
        /** One response, in arrival order. */
        void onResponse(ConsumeResponse response);

        /** The stream ended: with the server's error, or null when it ended cleanly. */
        void onEnd(LeveeException error);
    }

    private final Object writeLock = new Object();
    private ClientCallStreamObserver<ConsumeRequest> requests;
    private volatile boolean closedHere;

    private MemberStream() {}

    /** Joins {@code group} on {@code topic} as {@code member}; the first response is the assignment. */
    public static MemberStream open(LeveeClient client, String topic, String group, String member, int creditMessages,
            int leaseMs, Listener listener) {
        Validation.checkGroupOnTopic(group, topic);
        Validation.checkMember(member);
        Validation.checkCredit(creditMessages);
        Validation.checkLeaseMs(leaseMs);
        MemberStream stream = new MemberStream();
        TopicsGrpc.newStub(client.channel()).consume(new ClientResponseObserver<ConsumeRequest, ConsumeResponse>() {
            @Override
            public void beforeStart(ClientCallStreamObserver<ConsumeRequest> requestStream) {
                stream.requests = requestStream;
            }

            @Override
            public void onNext(ConsumeResponse response) {
                listener.onResponse(response);
            }

            @Override
            public void onError(Throwable error) {
                listener.onEnd(stream.closedHere ? null : WireErrors.from(error));
            }

            @Override
            public void onCompleted() {
                listener.onEnd(null);
            }
        });
        stream.write(ConsumeRequest.newBuilder().setStart(ConsumeStart.newBuilder().setTopic(topic).setGroup(group)
                .setMember(member).setCredit(Credit.newBuilder().setMessages(creditMessages)).setLeaseMs(leaseMs)).build());
        return stream;
    }

    /** Sends one request. */
    public void write(ConsumeRequest request) {
        synchronized (writeLock) {
            try {
                requests.onNext(request);
            } catch (RuntimeException error) {
                throw WireErrors.from(error);
            }
        }
    }

    /** Grants more credit: messages and payload bytes. */
    public void grant(long messages, long payloadBytes) {
        write(ConsumeRequest.newBuilder().setCredit(Credit.newBuilder().setMessages((int) Math.min(messages, Integer.MAX_VALUE))
                .setBytes((int) Math.min(payloadBytes, 0xffffffffL))).build());
    }

    /** Sends one CommitBatch; its answer arrives as a response's commit_results. */
    public void commit(List<Commit> commits) {
        write(ConsumeRequest.newBuilder().setCommit(CommitBatch.newBuilder().addAllCommits(commits)).build());
    }

    /** Renews the member's lease. */
    public void heartbeat() {
        write(ConsumeRequest.newBuilder().setHeartbeat(Heartbeat.getDefaultInstance()).build());
    }

    /** Leaves the group: closes this side; the server then ends the stream. */
    public void leave() {
        synchronized (writeLock) {
            try {
                requests.onCompleted();
            } catch (RuntimeException error) {
                requests.cancel("leaving", null);
            }
        }
    }

    /** Ends the stream at once (the server drops the member when it notices). */
    @Override
    public void close() {
        closedHere = true;
        synchronized (writeLock) {
            requests.cancel("closed by the client", null);
        }
    }
}
