package dev.levee.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import dev.levee.v1.ErrorCode;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;
import java.util.stream.Collectors;
import java.util.stream.LongStream;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * Streams that move by themselves ({@link LeveeClient#subscribeManyFollowing},
 * {@link LeveeClient#subscribeFollowing}) against three processes of a cluster that replicates
 * its queues, as crates/levee/tests/replicated.rs tests the Rust ones: a consumer acks through
 * node 2 on a many-queue stream (offsets 0 to 5 of eight queues over every shard) and on a
 * single-queue one (0 to 3), and removes one mailbox; node 2 is killed (kill -9); an ack on
 * each cut short by the kill
 * says so; both streams open themselves again through another node and resume right after
 * their confirmed acks, nothing acked delivered again.
 */
class FollowingClusterTest {
    private static final int SHARDS = 4;
    /** Messages in each queue before the kill (offsets 0 to 9); one more is appended after it. */
    private static final int MESSAGES_BEFORE = 10;
    private static final long MANY_ACKED = 5;
    private static final long SINGLE_ACKED = 3;
    /** Longest the test waits for the deliveries of one phase (a move included). */
    private static final long RECEIVE_MS = 40_000;

    private static byte[] bytes(String text) {
        return text.getBytes(StandardCharsets.UTF_8);
    }

    /** Eight queue names, two in each shard. */
    private static List<String> queuesOverEveryShard() {
        Map<Integer, List<String>> byShard = new TreeMap<>();
        for (int index = 0; index < 10_000 && byShard.values().stream().mapToInt(List::size).sum() < 2 * SHARDS; index++) {
            String queue = "follow-" + index;
            List<String> names = byShard.computeIfAbsent(Routing.shardOf(queue, SHARDS), ignored -> new ArrayList<>());
            if (names.size() < 2) {
                names.add(queue);
            }
        }
        List<String> queues = byShard.values().stream().flatMap(List::stream).collect(Collectors.toList());
        assertEquals(2 * SHARDS, queues.size(), "two queues in each shard");
        return queues;
    }

    /**
     * Takes deliveries of {@code many} until each mailbox got {@code wanted} of them (bounded
     * by count and time); each mailbox's offsets, in delivery order.
     */
    private static Map<Integer, List<Long>> receive(Mailboxes many, int mailboxes, int wanted) {
        Map<Integer, List<Long>> offsets = new TreeMap<>();
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(RECEIVE_MS);
        int total = 0;
        for (int taken = 0; taken < mailboxes * wanted * 2 && total < mailboxes * wanted
                && System.nanoTime() < deadline; taken++) {
            MailboxDelivery delivery = many.next(Duration.ofSeconds(1));
            if (delivery == null) {
                continue;
            }
            offsets.computeIfAbsent(delivery.mailbox(), ignored -> new ArrayList<>()).add(delivery.offset());
            total++;
        }
        return offsets;
    }

    /** Takes {@code wanted} deliveries of {@code single} (bounded by count and time); their offsets. */
    private static List<Long> receive(Subscription single, int wanted) {
        List<Long> offsets = new ArrayList<>();
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(RECEIVE_MS);
        for (int tries = 0; tries < wanted * 40 && offsets.size() < wanted && System.nanoTime() < deadline; tries++) {
            Delivery delivery = single.next(Duration.ofSeconds(1));
            if (delivery != null) {
                offsets.add(delivery.offset());
            }
        }
        return offsets;
    }

    private static List<Long> range(long first, long last) {
        return LongStream.rangeClosed(first, last).boxed().collect(Collectors.toList());
    }

    @Test
    @Timeout(value = 150, unit = TimeUnit.SECONDS)
    void given_streams_through_node_2_when_node_2_is_killed_should_move_and_resume_right_after_their_acks()
            throws Exception {
        List<LeveeServer> nodes = new ArrayList<>();
        List<LeveeClient> clients = new ArrayList<>();
        Mailboxes many = null;
        Subscription single = null;
        try {
            ReplicatedCluster.threeNodes(nodes, SHARDS);
            for (LeveeServer node : nodes) {
                clients.add(LeveeClient.connect(node.grpcAddr));
            }
            ReplicatedCluster.waitSettled(clients, SHARDS);
            List<String> queues = queuesOverEveryShard();
            String singleQueue = queues.get(0) + "-single";
            List<QueueMessage> messages = new ArrayList<>();
            for (int number = 0; number < MESSAGES_BEFORE; number++) {
                for (String queue : queues) {
                    messages.add(new QueueMessage(bytes(queue), bytes(queue + "/" + number)));
                }
                messages.add(new QueueMessage(bytes(singleQueue), bytes(singleQueue + "/" + number)));
            }
            clients.get(0).appendMessages(messages, "");

            LeveeClient second = clients.get(1);
            many = second.subscribeManyFollowing("app-server", 1_000);
            List<Integer> mailboxes = many.add(queues.stream().map(FollowingClusterTest::bytes).collect(Collectors.toList()));
            assertEquals(range(0, queues.size() - 1).stream().map(Long::intValue).collect(Collectors.toList()), mailboxes);
            // Everything taken before the kill, so nothing of the old stream is left to take.
            Map<Integer, List<Long>> before = receive(many, queues.size(), MESSAGES_BEFORE);
            for (int mailbox : mailboxes) {
                assertEquals(range(0, MESSAGES_BEFORE - 1), before.get(mailbox), "mailbox " + mailbox + " before the kill");
                many.ack(mailbox, MANY_ACKED);
            }
            many.flushAcks();
            // A mailbox removed before the move stays removed after it.
            int removed = mailboxes.get(mailboxes.size() - 1);
            many.remove(List.of(removed));
            single = second.subscribeFollowing(bytes(singleQueue), "app-server", 100);
            assertEquals(0, single.startOffset());
            assertEquals(range(0, MESSAGES_BEFORE - 1), receive(single, MESSAGES_BEFORE), "the single queue before the kill");
            single.ack(SINGLE_ACKED);

            nodes.get(1).kill();
            // Acks cut short by the kill say so once their stream is open again elsewhere, and
            // count for nothing: the streams resume after the acks confirmed before.
            many.ack(mailboxes.get(0), MANY_ACKED + 2);
            LeveeException flush = assertThrows(LeveeException.class, many::flushAcks);
            assertEquals(ErrorCode.ERROR_CODE_UNAVAILABLE, flush.code());
            assertTrue(flush.description().contains("went away before the acks were confirmed"), flush.description());
            Subscription cutShort = single;
            LeveeException ack = assertThrows(LeveeException.class, () -> cutShort.ack(SINGLE_ACKED + 2));
            assertEquals(ErrorCode.ERROR_CODE_UNAVAILABLE, ack.code());
            assertTrue(ack.description().contains("open again through another node from offset " + (SINGLE_ACKED + 1)),
                    ack.description());
            // One more message in each queue: only a stream that moved can deliver it.
            List<QueueMessage> after = new ArrayList<>();
            for (String queue : queues) {
                after.add(new QueueMessage(bytes(queue), bytes(queue + "/after")));
            }
            after.add(new QueueMessage(bytes(singleQueue), bytes(singleQueue + "/after")));
            // Some shards lose their leader with node 2: an idempotent producer's resends ride
            // out the election.
            try (Producer producer = new Producer(clients.get(0), ProducerOptions.defaults().idempotent(true))) {
                List<CompletableFuture<Long>> sent = new ArrayList<>();
                for (QueueMessage message : after) {
                    sent.add(producer.send(message.queue(), message.payload()));
                }
                for (CompletableFuture<Long> offset : sent) {
                    assertEquals(MESSAGES_BEFORE, offset.get(30, TimeUnit.SECONDS), "the message appended after the kill");
                }
            }

            Map<Integer, List<Long>> moved = receive(many, queues.size() - 1, MESSAGES_BEFORE - (int) MANY_ACKED);
            MailboxDelivery extra = many.next(Duration.ofMillis(500));
            assertEquals(null, extra, "nothing more after the move (the removed mailbox stays removed): " + moved);
            for (int mailbox : mailboxes) {
                assertEquals(mailbox == removed ? null : range(MANY_ACKED + 1, MESSAGES_BEFORE), moved.get(mailbox),
                        "mailbox " + mailbox + " after the move: right after its ack, nothing acked again");
            }
            List<Long> singleMoved = receive(single, MESSAGES_BEFORE - (int) SINGLE_ACKED);
            assertEquals(range(SINGLE_ACKED + 1, MESSAGES_BEFORE), singleMoved,
                    "the single queue after the move: right after its ack, nothing acked again");
            assertEquals(SINGLE_ACKED + 1, single.startOffset(), "the moved subscription starts after the ack");
            // The moved streams take acks through their new node.
            single.ack(MESSAGES_BEFORE);
            for (int mailbox : mailboxes.subList(0, mailboxes.size() - 1)) {
                many.ack(mailbox, MESSAGES_BEFORE);
            }
            many.flushAcks();
        } finally {
            if (many != null) {
                many.close();
            }
            if (single != null) {
                single.close();
            }
            for (LeveeClient client : clients) {
                client.close();
            }
            for (LeveeServer node : nodes) {
                node.close();
            }
        }
    }

    /**
     * Takes deliveries of {@code next} until it throws (bounded by count and time), each one's
     * payload one of {@code allowed}; what it threw.
     */
    private static LeveeException endOf(java.util.function.Supplier<byte[]> next, List<String> allowed) {
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(RECEIVE_MS);
        for (int tries = 0; tries < 100 && System.nanoTime() < deadline; tries++) {
            try {
                byte[] payload = next.get();
                if (payload != null) {
                    assertTrue(allowed.contains(new String(payload, StandardCharsets.UTF_8)), new String(payload, StandardCharsets.UTF_8));
                }
            } catch (LeveeException ended) {
                return ended;
            }
        }
        throw new AssertionError("the stream did not end within " + RECEIVE_MS + " ms");
    }

    @Test
    @Timeout(value = 120, unit = TimeUnit.SECONDS)
    void given_a_queue_deleted_while_following_streams_move_should_end_them_saying_so() throws Exception {
        List<LeveeServer> nodes = new ArrayList<>();
        List<LeveeClient> clients = new ArrayList<>();
        Mailboxes many = null;
        Subscription single = null;
        try {
            ReplicatedCluster.threeNodes(nodes, SHARDS);
            for (LeveeServer node : nodes) {
                clients.add(LeveeClient.connect(node.grpcAddr));
            }
            ReplicatedCluster.waitSettled(clients, SHARDS);
            clients.get(0).append(bytes("vanishing"), bytes("soon gone"));
            clients.get(0).append(bytes("staying"), bytes("here"));
            LeveeClient second = clients.get(1);
            single = second.subscribeFollowing(bytes("vanishing"), "vanishing-reader", 10);
            assertEquals("soon gone", new String(single.next(Duration.ofSeconds(30)).payload(), StandardCharsets.UTF_8));
            many = second.subscribeManyFollowing("vanishing-many", 10);
            assertEquals(List.of(0, 1), many.add(List.of(bytes("vanishing"), bytes("staying"))));
            Map<Integer, List<Long>> before = receive(many, 2, 1);
            assertEquals(Map.of(0, List.of(0L), 1, List.of(0L)), before);

            // Node 2 paused: the delete goes through nodes 1 and 3 and node 2's streams never
            // hear of it; then node 2 dies and the streams move. Opened again elsewhere they
            // ask whether the queues they delivered from still exist, and end as a server ends
            // a stream whose queue it deletes.
            nodes.get(1).pause();
            boolean deleted;
            try {
                deleted = clients.get(0).deleteQueue(bytes("vanishing"));
            } finally {
                nodes.get(1).kill();
            }
            assertTrue(deleted);
            // What the new streams sent before they ended may come first (a node that had not
            // applied the delete yet may deliver the message again: at least once).
            Subscription singleStream = single;
            Mailboxes manyStream = many;
            for (LeveeException ended : List.of(
                    endOf(() -> {
                        Delivery delivery = singleStream.next(Duration.ofSeconds(1));
                        return delivery == null ? null : delivery.payload();
                    }, List.of("soon gone")),
                    endOf(() -> {
                        MailboxDelivery delivery = manyStream.next(Duration.ofSeconds(1));
                        return delivery == null ? null : delivery.payload();
                    }, List.of("soon gone", "here")))) {
                assertEquals(ErrorCode.ERROR_CODE_FAILED_PRECONDITION, ended.code(), ended.toString());
                assertTrue(ended.description().contains("deleted while this stream moved"), ended.description());
            }
        } finally {
            if (many != null) {
                many.close();
            }
            if (single != null) {
                single.close();
            }
            for (LeveeClient client : clients) {
                client.close();
            }
            for (LeveeServer node : nodes) {
                node.close();
            }
        }
    }

    @Test
    @Timeout(value = 60, unit = TimeUnit.SECONDS)
    void given_following_streams_when_the_server_refuses_an_ack_should_end_them_as_plain_streams() throws Exception {
        try (LeveeServer server = new LeveeServer(List.of()).start();
                LeveeClient client = LeveeClient.connect(server.grpcAddr)) {
            client.append(bytes("refused"), bytes("only"));
            Mailboxes many = client.subscribeManyFollowing("app-server", 10);
            Subscription single = client.subscribeFollowing(bytes("refused"), "app-server-single", 10);
            try {
                int mailbox = many.add(List.of(bytes("refused"))).get(0);
                assertEquals(0, many.next(Duration.ofSeconds(5)).offset());
                many.ack(mailbox, 5);
                LeveeException flush = assertThrows(LeveeException.class, many::flushAcks);
                assertEquals(ErrorCode.ERROR_CODE_OFFSET_OUT_OF_RANGE, flush.code(), flush.toString());
                LeveeException next = assertThrows(LeveeException.class, () -> many.next(Duration.ofSeconds(1)));
                assertEquals(ErrorCode.ERROR_CODE_OFFSET_OUT_OF_RANGE, next.code(), "the stream ended, not moved");

                assertEquals(0, single.next(Duration.ofSeconds(5)).offset());
                LeveeException ack = assertThrows(LeveeException.class, () -> single.ack(5));
                assertEquals(ErrorCode.ERROR_CODE_OFFSET_OUT_OF_RANGE, ack.code(), ack.toString());
                Subscription closed = client.subscribeFollowing(bytes("refused"), "app-server-closed", 10);
                closed.close();
                Delivery buffered = closed.next(Duration.ofMillis(100)); // received before the close
                if (buffered != null) {
                    assertEquals(0, buffered.offset());
                }
                assertEquals(null, closed.next(Duration.ofMillis(100)), "a stream closed here is not opened again");
            } finally {
                many.close();
                single.close();
            }
        }
    }
}
