package dev.levee.client;

/**
 * A key that turned hot (or had its hot period extended) or cooled.
 *
 * @param key the key
 * @param hot whether it is hot now
 * @param hotForMs how long it stays hot from now (0 when it cooled)
 * @param manual whether an operator set it by hand
 */
public record HotKeyChange(byte[] key, boolean hot, long hotForMs, boolean manual) {}
