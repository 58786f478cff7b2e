package dev.levee.client;

/**
 * One message of a subscribed queue.
 *
 * @param offset its offset in the queue
 * @param payload the message
 */
public record Delivery(long offset, byte[] payload) {}
