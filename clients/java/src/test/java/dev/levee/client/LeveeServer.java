package dev.levee.client;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.File;
import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Comparator;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.stream.Stream;

/**
 * A real {@code levee server} child process on free loopback ports, as the Rust and Python
 * tests start it: {@code --grpc-addr 127.0.0.1:0}, a temporary data directory, and the bound
 * addresses read from {@code --ready-file}. The binary is LEVEE_BIN, else
 * $CARGO_TARGET_DIR/debug/levee, else target/debug/levee at the repository root.
 */
final class LeveeServer implements AutoCloseable {
    private static final long READY_TIMEOUT_MS = 30_000;

    private final Path directory;
    private final Path dataDir;
    private final List<String> extra;
    private Process process;
    String grpcAddr = "";
    String peerAddr = "";

    LeveeServer(List<String> extra) throws IOException {
        this.directory = Files.createTempDirectory("levee-java-");
        this.dataDir = directory.resolve("data");
        this.extra = extra;
    }

    static String binary() {
        List<String> candidates = new ArrayList<>();
        candidates.add(System.getenv("LEVEE_BIN"));
        String target = System.getenv("CARGO_TARGET_DIR");
        if (target != null) {
            candidates.add(Path.of(target, "debug", "levee").toString());
        }
        candidates.add(Repository.root().resolve("target/debug/levee").toString());
        for (String candidate : candidates) {
            if (candidate != null && !candidate.isEmpty() && new File(candidate).canExecute()) {
                return new File(candidate).getAbsolutePath();
            }
        }
        throw new IllegalStateException("no levee binary: set LEVEE_BIN or build target/debug/levee");
    }

    LeveeServer start() throws Exception {
        return start("127.0.0.1:0");
    }

    LeveeServer start(String address) throws Exception {
        long deadline = System.currentTimeMillis() + READY_TIMEOUT_MS;
        while (true) {
            try {
                tryStart(address);
                return this;
            } catch (IllegalStateException error) {
                // A fixed address freed a moment ago may still be held: try again.
                if (address.endsWith(":0") || System.currentTimeMillis() > deadline
                        || !Files.readString(directory.resolve("server.log")).contains("already in use")) {
                    throw error;
                }
                Thread.sleep(100);
            }
        }
    }

    private void tryStart(String address) throws Exception {
        Path ready = directory.resolve("ready.json");
        Files.deleteIfExists(ready);
        List<String> command = new ArrayList<>(List.of(binary(), "server", "--grpc-addr", address, "--admin-addr",
                "127.0.0.1:0", "--data-dir", dataDir.toString(), "--ready-file", ready.toString()));
        command.addAll(extra);
        ProcessBuilder builder = new ProcessBuilder(command).redirectInput(ProcessBuilder.Redirect.from(new File("/dev/null")))
                .redirectOutput(ProcessBuilder.Redirect.DISCARD)
                .redirectError(ProcessBuilder.Redirect.to(directory.resolve("server.log").toFile()));
        builder.environment().keySet().removeIf(name -> name.startsWith("LEVEE_"));
        process = builder.start();
        long deadline = System.currentTimeMillis() + READY_TIMEOUT_MS;
        while (true) {
            if (Files.exists(ready)) {
                try {
                    JsonNode info = new ObjectMapper().readTree(Files.readString(ready));
                    if (info != null && info.hasNonNull("grpc_addr")) {
                        grpcAddr = info.get("grpc_addr").asText();
                        peerAddr = info.hasNonNull("peer_addr") ? info.get("peer_addr").asText() : "";
                        return;
                    }
                } catch (IOException partial) {
                    // written as we read: look again
                }
            }
            if (!process.isAlive() || System.currentTimeMillis() > deadline) {
                process.destroyForcibly().waitFor();
                throw new IllegalStateException("server did not become ready; logs:\n"
                        + Files.readString(directory.resolve("server.log")));
            }
            Thread.sleep(20);
        }
    }

    void stop() throws InterruptedException {
        if (process == null || !process.isAlive()) {
            return;
        }
        process.destroy(); // SIGTERM
        if (!process.waitFor(15, TimeUnit.SECONDS)) {
            process.destroyForcibly().waitFor();
        }
    }

    /** Pauses the process (SIGSTOP): it neither answers nor notices anything until killed. */
    void pause() throws Exception {
        if (process != null && process.isAlive()) {
            int status = new ProcessBuilder("kill", "-STOP", Long.toString(process.pid())).inheritIO().start().waitFor();
            if (status != 0) {
                throw new IllegalStateException("kill -STOP " + process.pid() + " exited with " + status);
            }
        }
    }

    /** Kills the process at once (SIGKILL, as kill -9) and waits for it to end. */
    void kill() throws InterruptedException {
        if (process != null && process.isAlive()) {
            process.destroyForcibly().waitFor(15, TimeUnit.SECONDS);
        }
    }

    void restart() throws Exception {
        String address = grpcAddr;
        stop();
        start(address);
    }

    @Override
    public void close() throws Exception {
        if (process != null && process.isAlive()) {
            process.destroyForcibly().waitFor(15, TimeUnit.SECONDS);
        }
        try (Stream<Path> paths = Files.walk(directory)) {
            paths.sorted(Comparator.reverseOrder()).forEach(path -> path.toFile().delete());
        }
    }
}
