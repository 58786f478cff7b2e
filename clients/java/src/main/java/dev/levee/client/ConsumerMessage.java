package dev.levee.client;

/**
 * One delivered message of an owned partition.
 *
 * @param partition the partition
 * @param offset its offset
 * @param payload the message
 * @param epoch the partition's epoch when delivered
 */
public record ConsumerMessage(int partition, long offset, byte[] payload, long epoch) {}
