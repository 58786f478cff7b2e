package dev.levee.client;

import dev.levee.v1.ErrorCode;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.regex.Pattern;

/**
 * Client-side checks of what the server would refuse, with the server's code and message.
 *
 * <p>One home per bound (the values documented in proto/levee/v1/*.proto) and one check per
 * kind of name. Each check throws {@link LeveeException.InvalidArgument} with exactly the
 * message the server sends for the same input (the Python client's validation.py holds the
 * same texts; the conformance scenario errors_client_validation compares them).
 */
public final class Validation {
    public static final int QUEUE_NAME_BYTES_MAX = 255;
    public static final int TOPIC_BYTES_MAX = 200;
    public static final int PARTITIONS_MAX = 1024;
    public static final int GROUP_BYTES_MAX = 64;
    public static final int MEMBER_BYTES_MAX = 64;
    public static final int CONSUMER_BYTES_MAX = 64;
    public static final int PRODUCER_ID_BYTES_MAX = 64;
    public static final int PRODUCER_NAME_BYTES_MAX = 64;
    /** A group's commit queue is named "\0commit\0" + group + "\0" + topic: it must fit a queue name. */
    public static final int GROUP_AND_TOPIC_BYTES_MAX = QUEUE_NAME_BYTES_MAX - "\0commit\0".length() - 1;
    public static final int APP_BYTES_MAX = 128;
    public static final int HOT_KEY_BYTES_MAX_DEFAULT = 1024;
    public static final long HOT_DURATION_MS_MAX = 86_400_000L;
    public static final int MESSAGES_PER_REQUEST_MAX = 10_000;
    public static final int MESSAGE_BYTES_MAX_DEFAULT = 1 << 20;
    public static final int CREDIT_MESSAGES_MAX = 100_000;
    public static final int LEASE_MS_MIN = 1_000;
    public static final int LEASE_MS_MAX = 300_000;
    public static final int READ_MESSAGES_MAX = 10_000;
    public static final int READ_BYTES_MAX = 4 << 20;
    public static final int TOP_KEYS_LIMIT_MAX = 1_000;
    public static final int ECHO_PAYLOAD_BYTES_MAX = 65_536;
    /** A published message's delay: at most 7 days. */
    public static final long DELAY_MS_MAX = 7L * 24 * 3_600_000;

    static {
        if (GROUP_BYTES_MAX > GROUP_AND_TOPIC_BYTES_MAX || TOPIC_BYTES_MAX > GROUP_AND_TOPIC_BYTES_MAX) {
            throw new AssertionError("a group or a topic alone must fit GROUP_AND_TOPIC_BYTES_MAX");
        }
    }

    private static final Pattern APP_PATTERN = Pattern.compile("[A-Za-z0-9._-]{1,128}");
    private static final Pattern TOPIC_PATTERN = Pattern.compile("[A-Za-z0-9._-]{1,200}");

    private Validation() {}

    /** An INVALID_ARGUMENT error with this message. */
    public static LeveeException invalid(String message) {
        return LeveeException.of(ErrorCode.ERROR_CODE_INVALID_ARGUMENT, message);
    }

    /** Text as UTF-8 bytes. */
    public static byte[] utf8(String text) {
        return text.getBytes(StandardCharsets.UTF_8);
    }

    /** A queue named in an append, read, info or delete (the store's message). */
    public static void checkAppendQueue(byte[] queue) {
        if (queue.length == 0 || queue.length > QUEUE_NAME_BYTES_MAX) {
            throw invalid("queue name must be 1 to " + QUEUE_NAME_BYTES_MAX + " bytes, got "
                    + queue.length + " bytes; fix the request");
        }
    }

    /** Queue names starting with a zero byte are the server's own. */
    public static void checkNotReserved(byte[] queue) {
        if (queue.length > 0 && queue[0] == 0) {
            throw invalid("queue names starting with a zero byte are reserved for the server");
        }
    }

    /** A queue named by a subscription (the broker's message). */
    public static void checkSubscribeQueue(byte[] queue) {
        if (queue.length == 0 || queue.length > QUEUE_NAME_BYTES_MAX) {
            throw invalid("queue name must be 1 to " + QUEUE_NAME_BYTES_MAX + " bytes, got " + queue.length);
        }
        checkNotReserved(queue);
    }

    /** A payload against the server's queue_message_bytes_max. */
    public static void checkPayload(byte[] payload, int messageBytesMax) {
        if (payload.length > messageBytesMax) {
            throw invalid("message of " + payload.length + " bytes is over message_bytes_max ("
                    + messageBytesMax + "); fix the request");
        }
    }

    /** Messages in one request; {@code call} is {@code append} or {@code publish}. */
    public static void checkMessageCount(int count, String call) {
        if (count < 1 || count > MESSAGES_PER_REQUEST_MAX) {
            throw invalid("messages: send 1 to " + MESSAGES_PER_REQUEST_MAX + " messages per " + call
                    + ", got " + count);
        }
    }

    /** A published message's delay in ms: 0 (at once) to {@link #DELAY_MS_MAX}. */
    public static void checkDelayMs(long delayMs) {
        if (delayMs < 0) {
            throw invalid("delay_ms must not be negative, got " + delayMs + "; a delay is 0 to "
                    + DELAY_MS_MAX + " ms (7 days)");
        }
        if (delayMs > DELAY_MS_MAX) {
            throw invalid("delay_ms is at most " + DELAY_MS_MAX + " (7 days), got " + delayMs);
        }
    }

    /** A delay as whole milliseconds (truncated), checked by {@link #checkDelayMs}. */
    public static long delayMs(Duration delay) {
        long millis;
        try {
            millis = delay.toMillis();
        } catch (ArithmeticException overflow) {
            millis = delay.isNegative() ? Long.MIN_VALUE : Long.MAX_VALUE;
        }
        checkDelayMs(millis);
        return millis;
    }

    /** A delayed message cannot go with an idempotent producer's id. */
    public static void checkDelayWithoutProducerId(long delayMs, String producerId) {
        if (delayMs > 0 && !producerId.isEmpty()) {
            throw invalid("a delayed message cannot have a producer_id (delayed messages are not "
                    + "deduplicated); publish it without one");
        }
    }

    private static void checkLength(String field, String value, int maximum) {
        int length = utf8(value).length;
        if (length < 1 || length > maximum) {
            throw invalid(field + " must be 1 to " + maximum + " bytes, got " + length);
        }
    }

    /** An idempotent producer's id (empty means not idempotent and is not checked). */
    public static void checkProducerId(String producerId) {
        if (!producerId.isEmpty()) {
            checkLength("producer_id", producerId, PRODUCER_ID_BYTES_MAX);
        }
    }

    public static void checkProducerName(String producerName) {
        checkLength("producer_name", producerName, PRODUCER_NAME_BYTES_MAX);
    }

    public static void checkConsumer(String consumer) {
        checkLength("consumer", consumer, CONSUMER_BYTES_MAX);
    }

    public static void checkGroup(String group) {
        checkLength("group", group, GROUP_BYTES_MAX);
    }

    public static void checkMember(String member) {
        checkLength("member", member, MEMBER_BYTES_MAX);
    }

    public static void checkTopic(String topic) {
        if (!TOPIC_PATTERN.matcher(topic).matches()) {
            throw invalid("topic '" + topic + "': a name is 1 to " + TOPIC_BYTES_MAX
                    + " ASCII letters, digits, '.', '_' or '-'");
        }
    }

    public static void checkGroupOnTopic(String group, String topic) {
        checkGroup(group);
        checkTopic(topic);
        int length = utf8(group).length + topic.length();
        if (length > GROUP_AND_TOPIC_BYTES_MAX) {
            throw invalid("group '" + group + "' on topic '" + topic
                    + "': the two names together must be at most " + GROUP_AND_TOPIC_BYTES_MAX
                    + " bytes, got " + length + "; use a shorter group name");
        }
    }

    public static void checkPartitions(long partitions) {
        if (partitions < 1 || partitions > PARTITIONS_MAX) {
            throw invalid("partitions must be 1 to " + PARTITIONS_MAX + ", got " + partitions);
        }
    }

    public static void checkCredit(long messages) {
        if (messages < 1 || messages > CREDIT_MESSAGES_MAX) {
            throw invalid("credit.messages must be 1 to " + CREDIT_MESSAGES_MAX + ", got " + messages);
        }
    }

    public static void checkLeaseMs(long leaseMs) {
        if (leaseMs != 0 && (leaseMs < LEASE_MS_MIN || leaseMs > LEASE_MS_MAX)) {
            throw invalid("lease_ms must be " + LEASE_MS_MIN + " to " + LEASE_MS_MAX
                    + " (or 0 for 10000), got " + leaseMs);
        }
    }

    public static void checkApp(String app) {
        if (!APP_PATTERN.matcher(app).matches()) {
            throw invalid("app name must be 1 to " + APP_BYTES_MAX
                    + " bytes of letters, digits, '-', '_' or '.', got '" + app + "'");
        }
    }

    public static void checkHotKey(String app, byte[] key, int keyBytesMax) {
        if (key.length == 0) {
            throw invalid("app '" + app + "': empty key; report keys of 1 to " + keyBytesMax + " bytes");
        }
        if (key.length > keyBytesMax) {
            throw invalid("app '" + app + "': key of " + key.length
                    + " bytes is longer than the maximum " + keyBytesMax
                    + "; shorten it or raise key_bytes_max");
        }
    }

    public static void checkHotDuration(String app, long durationMs) {
        if (durationMs < 1 || durationMs > HOT_DURATION_MS_MAX) {
            throw invalid("app '" + app + "': hot duration must be between 1 and "
                    + HOT_DURATION_MS_MAX + " ms, got " + durationMs);
        }
    }

    public static void checkRead(long maxMessages, long maxBytes) {
        if (maxMessages > READ_MESSAGES_MAX) {
            throw invalid("max_messages must be 1 to " + READ_MESSAGES_MAX + " (or 0 for 100), got " + maxMessages);
        }
        if (maxBytes > READ_BYTES_MAX) {
            throw invalid("max_bytes must be at most " + READ_BYTES_MAX + " (or 0 for 1048576), got " + maxBytes);
        }
    }

    public static void checkTopKeysLimit(long limit) {
        if (limit < 1 || limit > TOP_KEYS_LIMIT_MAX) {
            throw invalid("limit must be 1 to " + TOP_KEYS_LIMIT_MAX + ", got " + limit);
        }
    }
}
