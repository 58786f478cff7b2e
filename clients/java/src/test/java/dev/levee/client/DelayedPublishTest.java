package dev.levee.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertSame;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.List;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * Delayed publishing against a real server: a delayed message is stored at once but reaches
 * its partition only when due, and its {@link Published#deliverAtMs} says when.
 */
class DelayedPublishTest {
    private static final long DELAY_MS = 2_000;
    /** The server runs on this machine's clock; allow a little for rounding and scheduling. */
    private static final long CLOCK_SLACK_MS = 50;

    private static LeveeServer server;

    @BeforeAll
    static void startServer() throws Exception {
        server = new LeveeServer(List.of()).start();
    }

    @AfterAll
    static void stopServer() throws Exception {
        server.close();
    }

    private static byte[] utf8(String text) {
        return text.getBytes(StandardCharsets.UTF_8);
    }

    private static long nextOffset(LeveeClient client, String topic) {
        return client.describeTopic(topic).getPartitions(0).getNextOffset();
    }

    @Test
    @Timeout(60)
    void given_a_delayed_message_when_published_should_reach_its_partition_only_when_due() throws Exception {
        String topic = "java-delayed";
        try (LeveeClient client = LeveeClient.connect(server.grpcAddr)) {
            client.createTopic(topic, 1);
            long before = System.currentTimeMillis();
            List<Published> published = client.publishDelayed(topic,
                    List.of(PublishRecord.keyed(utf8("a"), utf8("later"))), Duration.ofMillis(DELAY_MS));
            long after = System.currentTimeMillis();
            assertEquals(1, published.size());
            Published delayed = published.get(0);
            assertEquals(0, delayed.partition());
            assertEquals(0L, delayed.offset(), "a delayed message gets its offset when delivered");
            assertTrue(delayed.delayed());
            assertTrue(delayed.deliverAtMs() >= before + DELAY_MS - CLOCK_SLACK_MS
                    && delayed.deliverAtMs() <= after + DELAY_MS + CLOCK_SLACK_MS,
                    "deliver at " + delayed.deliverAtMs() + ", published between " + before + " and " + after);

            // Not in the partition yet; a message published at once goes before it.
            assertEquals(0L, nextOffset(client, topic));
            List<Published> now = client.publish(topic, List.of(PublishRecord.keyed(utf8("b"), utf8("now"))), "");
            assertEquals(List.of(new Published(0, 0, 0)), now);
            assertFalse(now.get(0).delayed());
            assertEquals(1L, nextOffset(client, topic));

            // It arrives when due, not before.
            long deadline = delayed.deliverAtMs() + 10_000;
            while (nextOffset(client, topic) < 2) {
                assertTrue(System.currentTimeMillis() < deadline, "the delayed message never arrived");
                Thread.sleep(50);
            }
            assertTrue(System.currentTimeMillis() >= delayed.deliverAtMs() - CLOCK_SLACK_MS,
                    "arrived before it was due at " + delayed.deliverAtMs());
            assertEquals(2L, nextOffset(client, topic));
        }
    }

    @Test
    @Timeout(60)
    void given_delayed_and_immediate_messages_in_one_publish_should_answer_a_deliver_at_time_for_each() {
        String topic = "java-delayed-mixed";
        try (LeveeClient client = LeveeClient.connect(server.grpcAddr)) {
            client.createTopic(topic, 1);
            long before = System.currentTimeMillis();
            List<Published> published = client.publish(topic, List.of(
                    PublishRecord.keyed(utf8("a"), utf8("in a minute")).withDelay(Duration.ofMinutes(1)),
                    PublishRecord.keyed(utf8("b"), utf8("now-1")),
                    new PublishRecord(utf8("c"), utf8("now-2"), 0, 0, 0)), "");
            assertEquals(List.of(0L, 0L, 1L), published.stream().map(Published::offset).toList());
            assertTrue(published.get(0).deliverAtMs() >= before + 60_000 - CLOCK_SLACK_MS, published.toString());
            assertEquals(0L, published.get(1).deliverAtMs());
            assertEquals(0L, published.get(2).deliverAtMs());
            assertEquals(2L, nextOffset(client, topic));

            // A zero delay publishes at once.
            List<Published> atOnce = client.publishDelayed(topic, List.of(PublishRecord.keyed(utf8("d"), utf8("now-3"))),
                    Duration.ZERO);
            assertEquals(List.of(new Published(0, 2, 0)), atOnce);
        }
    }

    @Test
    void given_a_delay_out_of_range_or_a_producer_id_when_publishing_should_refuse_before_sending() {
        try (LeveeClient client = LeveeClient.connect(server.grpcAddr)) {
            List<PublishRecord> one = List.of(PublishRecord.keyed(utf8("a"), utf8("x")));
            LeveeException negative = assertThrows(LeveeException.class,
                    () -> client.publishDelayed("java-delayed-refused", one, Duration.ofMillis(-1)));
            assertSame(LeveeException.InvalidArgument.class, negative.getClass());
            assertEquals("delay_ms must not be negative, got -1; a delay is 0 to 604800000 ms (7 days)",
                    negative.description());
            LeveeException tooLong = assertThrows(LeveeException.class,
                    () -> client.publishDelayed("java-delayed-refused", one, Duration.ofDays(7).plusMillis(1)));
            assertEquals("delay_ms is at most 604800000 (7 days), got 604800001", tooLong.description());
            LeveeException idempotent = assertThrows(LeveeException.class, () -> client.publish("java-delayed-refused",
                    List.of(new PublishRecord(utf8("a"), utf8("x"), -1, 0, 1_000)), "producer-1"));
            assertSame(LeveeException.InvalidArgument.class, idempotent.getClass());
            assertEquals("a delayed message cannot have a producer_id (delayed messages are not deduplicated); "
                    + "publish it without one", idempotent.description());
        }
    }
}
