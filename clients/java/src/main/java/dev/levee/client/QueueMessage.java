package dev.levee.client;

/**
 * One message to append: its queue, payload and (with a producer id) its sequence on the queue.
 *
 * @param queue the queue's name, 1 to 255 bytes
 * @param payload the message
 * @param sequence with a producer id: this producer's sequence number on the queue
 */
public record QueueMessage(byte[] queue, byte[] payload, long sequence) {
    /** A message without a sequence. */
    public QueueMessage(byte[] queue, byte[] payload) {
        this(queue, payload, 0);
    }
}
