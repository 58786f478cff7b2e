package dev.levee.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertInstanceOf;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;

import dev.levee.v1.ErrorCode;
import dev.levee.v1.ReadResponse;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * An idempotent producer against a real server whose messages may be at most 1 KiB (the
 * client allows more, so the server refuses a longer one): a batch that finally fails without
 * being stored leaves no gap in its queue's sequences, since the producer takes a fresh
 * producer id for every batch numbered after it.
 */
class ProducerSequenceTest {
    private static final int SERVER_MESSAGE_BYTES_MAX = 1024;
    /** How long one append may take to be answered (resends included). */
    private static final long ANSWER_S = 15;

    private static LeveeServer server;

    @BeforeAll
    static void startServer() throws Exception {
        server = new LeveeServer(List.of("--queue-message-bytes-max", Integer.toString(SERVER_MESSAGE_BYTES_MAX))).start();
    }

    @AfterAll
    static void stopServer() throws Exception {
        server.close();
    }

    private static byte[] utf8(String text) {
        return text.getBytes(StandardCharsets.UTF_8);
    }

    @Test
    @Timeout(60)
    void given_an_idempotent_batch_that_finally_failed_when_sending_more_to_its_queue_should_store_them_in_order()
            throws Exception {
        byte[] queue = utf8("java-seq-after-failure");
        try (LeveeClient client = LeveeClient.connect(server.grpcAddr);
                Producer producer = new Producer(client, ProducerOptions.defaults().idempotent(true).retriesMax(3)
                        .retryBackoff(Duration.ofMillis(5)).retryBackoffMax(Duration.ofMillis(20)))) {
            assertEquals(0L, producer.send(queue, utf8("m0")).get(ANSWER_S, TimeUnit.SECONDS));
            String before = producer.producerId();

            // Sequence 1 on the queue: the server refuses it (too long) and stores nothing.
            CompletableFuture<Long> refused = producer.send(queue, new byte[SERVER_MESSAGE_BYTES_MAX * 2]);
            ExecutionException failure = assertThrows(ExecutionException.class,
                    () -> refused.get(ANSWER_S, TimeUnit.SECONDS));
            LeveeException error = assertInstanceOf(LeveeException.class, failure.getCause());
            assertEquals(ErrorCode.ERROR_CODE_INVALID_ARGUMENT, error.code(), error.getMessage());

            // Later messages to the same queue: one at a time, then several at once.
            List<CompletableFuture<Long>> answers = new ArrayList<>();
            answers.add(producer.send(queue, utf8("m1")));
            assertEquals(1L, answers.get(0).get(ANSWER_S, TimeUnit.SECONDS));
            for (int i = 2; i <= 6; i++) {
                answers.add(producer.send(queue, utf8("m" + i)));
            }
            for (int i = 0; i < answers.size(); i++) {
                assertEquals(i + 1L, answers.get(i).get(ANSWER_S, TimeUnit.SECONDS), "offset of m" + (i + 1));
            }
            assertNotEquals(before, producer.producerId(), "a fresh producer id after the failed batch");
            assertEquals(1, producer.stats().batchesFailed());

            ReadResponse read = client.read(queue, 0, 100, 0);
            List<String> stored = new ArrayList<>();
            read.getPayloadsList().forEach(payload -> stored.add(payload.toStringUtf8()));
            assertEquals(List.of("m0", "m1", "m2", "m3", "m4", "m5", "m6"), stored);
        }
    }
}
