package dev.levee.client;

/**
 * What a producer did.
 *
 * @param messagesSent messages whose batch was stored (durable)
 * @param messagesFailed messages whose batch failed: their callers got the error
 * @param batchesSent batches stored
 * @param batchesFailed batches failed
 * @param retries resends
 */
public record ProducerStats(long messagesSent, long messagesFailed, long batchesSent, long batchesFailed, long retries) {}
