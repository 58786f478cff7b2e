package dev.levee.client;

/**
 * What a producer did.
 *
 * @param messagesSent messages whose batch was stored (durable)
 * @param messagesFailed messages whose batch failed: their callers got the error
 * @param batchesSent append requests stored (a batch split over shard leaders is one per leader)
 * @param batchesFailed append requests failed
 * @param retries resends
 */
public record ProducerStats(long messagesSent, long messagesFailed, long batchesSent, long batchesFailed, long retries) {}
