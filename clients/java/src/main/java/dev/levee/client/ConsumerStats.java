package dev.levee.client;

/**
 * What a consumer did.
 *
 * @param handled messages handled
 * @param commits commits made durable
 * @param fencedCommits commits refused as FENCED (the partition moved)
 * @param refusedCommits commits refused otherwise
 * @param assignments assignments received
 * @param streams streams opened (joins)
 * @param handlerErrors handlers that threw (their message still counts as finished)
 */
public record ConsumerStats(long handled, long commits, long fencedCommits, long refusedCommits, long assignments,
        long streams, long handlerErrors) {}
