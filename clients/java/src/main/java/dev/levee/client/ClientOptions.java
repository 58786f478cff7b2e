package dev.levee.client;

import java.time.Duration;

/** How a {@link LeveeClient} connects and what it checks before sending. Fluent setters. */
public final class ClientOptions {
    private Duration connectTimeout = Duration.ofSeconds(5);
    private Duration requestTimeout = Duration.ofSeconds(30);
    private int messageBytesMax = Validation.MESSAGE_BYTES_MAX_DEFAULT;
    private int hotKeyBytesMax = Validation.HOT_KEY_BYTES_MAX_DEFAULT;

    /** The defaults: connect within 5 s, 30 s per call, the server's default limits. */
    public static ClientOptions defaults() {
        return new ClientOptions();
    }

    ClientOptions copy() {
        ClientOptions copy = new ClientOptions();
        copy.connectTimeout = connectTimeout;
        copy.requestTimeout = requestTimeout;
        copy.messageBytesMax = messageBytesMax;
        copy.hotKeyBytesMax = hotKeyBytesMax;
        return copy;
    }

    /** Most time to establish the connection. */
    public ClientOptions connectTimeout(Duration value) {
        connectTimeout = value;
        return this;
    }

    /** Deadline of each unary call. */
    public ClientOptions requestTimeout(Duration value) {
        requestTimeout = value;
        return this;
    }

    /** The server's queue_message_bytes_max (default 1 MiB): larger payloads are refused here. */
    public ClientOptions messageBytesMax(int value) {
        messageBytesMax = value;
        return this;
    }

    /** The server's hotkey_key_bytes_max (default 1024). */
    public ClientOptions hotKeyBytesMax(int value) {
        hotKeyBytesMax = value;
        return this;
    }

    public Duration connectTimeout() {
        return connectTimeout;
    }

    public Duration requestTimeout() {
        return requestTimeout;
    }

    public int messageBytesMax() {
        return messageBytesMax;
    }

    public int hotKeyBytesMax() {
        return hotKeyBytesMax;
    }
}
