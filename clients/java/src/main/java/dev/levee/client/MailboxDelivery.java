package dev.levee.client;

/**
 * One message of one mailbox of a {@link Mailboxes} stream.
 *
 * @param mailbox the mailbox's number (the order of {@link Mailboxes#add})
 * @param offset its offset in the queue
 * @param payload the message
 */
public record MailboxDelivery(int mailbox, long offset, byte[] payload) {}
