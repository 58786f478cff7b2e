package dev.levee.client;

import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import org.openjdk.jmh.annotations.Benchmark;
import org.openjdk.jmh.annotations.BenchmarkMode;
import org.openjdk.jmh.annotations.Level;
import org.openjdk.jmh.annotations.Mode;
import org.openjdk.jmh.annotations.OperationsPerInvocation;
import org.openjdk.jmh.annotations.OutputTimeUnit;
import org.openjdk.jmh.annotations.Scope;
import org.openjdk.jmh.annotations.Setup;
import org.openjdk.jmh.annotations.State;
import org.openjdk.jmh.annotations.TearDown;

/**
 * Producer throughput to a local server (target >= 300,000 messages/s): each invocation sends
 * 100,000 messages of 100 bytes to 16 queues through one batching Producer and waits until all
 * are durable. Score = messages per second.
 */
@State(Scope.Benchmark)
@BenchmarkMode(Mode.Throughput)
@OutputTimeUnit(TimeUnit.SECONDS)
public class ProducerBenchmark {
    private static final int MESSAGES = 100_000;
    private static final int QUEUES = 16;
    private LeveeServer server;
    private LeveeClient client;
    private Producer producer;
    private byte[][] queues;
    private final byte[] payload = new byte[100];

    @Setup(Level.Trial)
    public void start() throws Exception {
        server = new LeveeServer(List.of()).start();
        client = LeveeClient.connect(server.grpcAddr);
        producer = new Producer(client, ProducerOptions.defaults());
        queues = new byte[QUEUES][];
        for (int i = 0; i < QUEUES; i++) {
            queues[i] = ("bench-" + i).getBytes();
        }
    }

    @TearDown(Level.Trial)
    public void stop() throws Exception {
        producer.close();
        client.close();
        server.close();
    }

    @Benchmark
    @OperationsPerInvocation(MESSAGES)
    public long send() {
        List<CompletableFuture<Long>> answers = new ArrayList<>(MESSAGES);
        for (int i = 0; i < MESSAGES; i++) {
            answers.add(producer.send(queues[i % QUEUES], payload));
        }
        long last = 0;
        for (CompletableFuture<Long> answer : answers) {
            last = answer.join();
        }
        return last;
    }
}
