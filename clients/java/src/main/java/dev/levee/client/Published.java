package dev.levee.client;

/**
 * Where a published message went.
 *
 * @param partition the partition
 * @param offset its offset in the partition
 */
public record Published(int partition, long offset) {}
