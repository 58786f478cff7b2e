package dev.levee.client;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertSame;
import static org.junit.jupiter.api.Assertions.assertThrows;

import dev.levee.v1.ErrorCode;
import io.grpc.Metadata;
import io.grpc.Status;
import java.time.Duration;
import java.util.HashSet;
import java.util.List;
import java.util.Set;
import org.junit.jupiter.api.Test;

/** Client-side checks give the server's code and message; wire errors map to their typed class. */
class ValidationTest {
    private static LeveeException refused(Runnable check) {
        LeveeException error = assertThrows(LeveeException.class, check::run);
        assertEquals(ErrorCode.ERROR_CODE_INVALID_ARGUMENT, error.code());
        assertSame(LeveeException.InvalidArgument.class, error.getClass());
        return error;
    }

    @Test
    void given_names_out_of_range_when_checked_should_give_the_servers_messages() {
        assertEquals("queue name must be 1 to 255 bytes, got 0 bytes; fix the request",
                refused(() -> Validation.checkAppendQueue(new byte[0])).description());
        assertEquals("queue names starting with a zero byte are reserved for the server",
                refused(() -> Validation.checkNotReserved(new byte[] {0, 1})).description());
        assertEquals("topic 'a b': a name is 1 to 200 ASCII letters, digits, '.', '_' or '-'",
                refused(() -> Validation.checkTopic("a b")).description());
        assertEquals("group must be 1 to 64 bytes, got 65", refused(() -> Validation.checkGroup("g".repeat(65))).description());
        assertEquals("app 'shop': empty key; report keys of 1 to 1024 bytes",
                refused(() -> Validation.checkHotKey("shop", new byte[0], 1024)).description());
        assertEquals("message of 11 bytes is over message_bytes_max (10); fix the request",
                refused(() -> Validation.checkPayload(new byte[11], 10)).description());
        assertEquals("messages: send 1 to 10000 messages per append, got 0",
                refused(() -> Validation.checkMessageCount(0, "append")).description());
        assertEquals("credit.messages must be 1 to 100000, got 100001",
                refused(() -> Validation.checkCredit(100_001)).description());
        assertEquals("lease_ms must be 1000 to 300000 (or 0 for 10000), got 999",
                refused(() -> Validation.checkLeaseMs(999)).description());
        assertEquals("delay_ms is at most 604800000 (7 days), got 604800001",
                refused(() -> Validation.checkDelayMs(604_800_001L)).description());
        assertEquals("a delayed message cannot have a producer_id (delayed messages are not deduplicated); "
                + "publish it without one", refused(() -> Validation.checkDelayWithoutProducerId(1, "p")).description());
    }

    @Test
    void given_names_in_range_when_checked_should_pass() {
        Validation.checkAppendQueue(new byte[255]);
        Validation.checkTopic("orders.v1_eu-west");
        Validation.checkGroupOnTopic("g".repeat(64), "t".repeat(Validation.GROUP_AND_TOPIC_BYTES_MAX - 64));
        Validation.checkLeaseMs(0);
        Validation.checkDelayMs(0);
        Validation.checkDelayMs(Validation.DELAY_MS_MAX);
        Validation.checkDelayWithoutProducerId(0, "p");
        assertEquals(1_500L, Validation.delayMs(Duration.ofNanos(1_500_999_999L)));
        assertEquals("delay_ms is at most 604800000 (7 days), got " + Long.MAX_VALUE,
                refused(() -> Validation.delayMs(Duration.ofSeconds(Long.MAX_VALUE))).description());
        Validation.checkApp("shop-1.eu");
        assertEquals("INVALID_ARGUMENT (1001): app name must be 1 to 128 bytes of letters, digits, '-', '_' or '.', got 'a/b'",
                refused(() -> Validation.checkApp("a/b")).getMessage());
    }

    @Test
    void given_every_error_code_when_typed_should_have_its_own_class() {
        Set<Class<?>> classes = new HashSet<>();
        for (ErrorCode code : ErrorCode.values()) {
            if (code == ErrorCode.UNRECOGNIZED || code == ErrorCode.ERROR_CODE_UNSPECIFIED) {
                continue;
            }
            LeveeException error = LeveeException.of(code.getNumber(), "x");
            assertEquals(code, error.code());
            classes.add(error.getClass());
        }
        assertEquals(14, classes.size());
        assertEquals(ErrorCode.ERROR_CODE_INTERNAL, LeveeException.of(4999, "x").code());
    }

    @Test
    void given_a_status_with_the_levee_trailer_when_read_should_take_the_trailers_code() {
        Metadata trailers = new Metadata();
        trailers.put(WireErrors.ERROR_CODE_KEY, "3001");
        LeveeException error = WireErrors.fromStatus(Status.FAILED_PRECONDITION.withDescription("moved"), trailers);
        assertSame(LeveeException.Fenced.class, error.getClass());
        assertEquals("moved", error.description());
        LeveeException transport = WireErrors.fromStatus(Status.UNAVAILABLE.withDescription("io"), new Metadata());
        assertSame(LeveeException.Unavailable.class, transport.getClass());
    }

    @Test
    void given_a_connection_broken_under_a_call_when_read_should_be_unavailable() {
        // grpc-java's report of a peer that died mid-call: retryable, unlike the server's own
        // INTERNAL (which carries Levee's code).
        LeveeException closed = WireErrors.fromStatus(Status.INTERNAL.withDescription("channel closed"), new Metadata());
        assertSame(LeveeException.Unavailable.class, closed.getClass());
        LeveeException reset = WireErrors.fromStatus(
                Status.INTERNAL.withCause(new java.io.IOException("Connection reset by peer")), new Metadata());
        assertSame(LeveeException.Unavailable.class, reset.getClass());
        Metadata trailers = new Metadata();
        trailers.put(WireErrors.ERROR_CODE_KEY, "1000");
        LeveeException server = WireErrors.fromStatus(Status.INTERNAL.withDescription("channel closed"), trailers);
        assertSame(LeveeException.Internal.class, server.getClass());
        LeveeException bug = WireErrors.fromStatus(Status.INTERNAL.withDescription("a bug"), new Metadata());
        assertSame(LeveeException.Internal.class, bug.getClass());
    }

    @Test
    void given_reports_over_the_byte_limit_when_batched_should_split_by_bytes_and_keys() {
        var small = dev.levee.v1.KeyReport.newBuilder().setKey(com.google.protobuf.ByteString.copyFrom(new byte[1000])).build();
        List<dev.levee.v1.KeyReport> reports = java.util.Collections.nCopies(100, small);
        assertEquals(10, HotKeys.batchLength(reports, 0, 10, 1 << 20));
        int fit = HotKeys.batchLength(reports, 0, 100, HotKeysOptions.REPORT_BATCH_BYTES_MIN);
        assertEquals(64, fit); // (65556 - 6) / (1000 + 14)
        assertEquals(1, HotKeys.batchLength(reports, 99, 100, 10));
    }
}
