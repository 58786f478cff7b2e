package dev.levee.client;

import java.nio.charset.StandardCharsets;
import java.util.List;
import java.util.concurrent.TimeUnit;
import org.openjdk.jmh.annotations.Benchmark;
import org.openjdk.jmh.annotations.BenchmarkMode;
import org.openjdk.jmh.annotations.Level;
import org.openjdk.jmh.annotations.Mode;
import org.openjdk.jmh.annotations.OutputTimeUnit;
import org.openjdk.jmh.annotations.Scope;
import org.openjdk.jmh.annotations.Setup;
import org.openjdk.jmh.annotations.State;
import org.openjdk.jmh.annotations.TearDown;

/**
 * {@code HotKeys.isHot} latency (target p50 <= 100 ns): 10,000 distinct keys of 12 bytes, one
 * of them hot by a manual key on a real local server, reports flowing every 100 ms.
 * SampleTime mode gives the percentiles.
 */
@State(Scope.Benchmark)
@BenchmarkMode(Mode.SampleTime)
@OutputTimeUnit(TimeUnit.NANOSECONDS)
public class IsHotBenchmark {
    private static final int KEYS = 10_000;
    private LeveeServer server;
    private HotKeys<Object> hotKeys;
    private byte[][] keys;
    private int next;

    @Setup(Level.Trial)
    public void start() throws Exception {
        server = new LeveeServer(List.of()).start();
        try (LeveeClient client = LeveeClient.connect(server.grpcAddr)) {
            client.setHotKey("bench", "key-00000042".getBytes(StandardCharsets.UTF_8), 3_600_000);
        }
        hotKeys = HotKeys.start(new HotKeysOptions("bench", List.of(server.grpcAddr)));
        keys = new byte[KEYS][];
        for (int i = 0; i < KEYS; i++) {
            keys[i] = String.format("key-%08d", i).getBytes(StandardCharsets.UTF_8);
        }
        long deadline = System.currentTimeMillis() + 10_000;
        while (!hotKeys.isHotNow(keys[42]) && System.currentTimeMillis() < deadline) {
            Thread.sleep(10);
        }
        if (!hotKeys.isHotNow(keys[42])) {
            throw new IllegalStateException("the manual hot key did not arrive");
        }
    }

    @TearDown(Level.Trial)
    public void stop() throws Exception {
        hotKeys.close();
        server.close();
    }

    @Benchmark
    public boolean isHot() {
        int index = next;
        next = index + 1 == KEYS ? 0 : index + 1;
        return hotKeys.isHot(keys[index]);
    }
}
