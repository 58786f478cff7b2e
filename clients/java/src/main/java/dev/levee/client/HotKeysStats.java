package dev.levee.client;

/**
 * Counters of one {@link HotKeys}.
 *
 * @param accessesRecorded accesses recorded by isHot and record
 * @param accessesDropped accesses dropped: the buffer held bufferKeysMax distinct keys, or an empty key
 * @param keysReported keys queued to a server's session
 * @param keysUnsent keys not delivered: no server connected, a full server queue, or a session that broke
 * @param batchesUnsent report batches lost (each counted with its keys in keysUnsent)
 * @param eventsReceived hot and cool events received
 * @param sessionsOpened sessions the servers accepted
 * @param serversConnected servers connected now
 * @param callbackErrors listeners that threw
 */
public record HotKeysStats(long accessesRecorded, long accessesDropped, long keysReported, long keysUnsent,
        long batchesUnsent, long eventsReceived, long sessionsOpened, long serversConnected, long callbackErrors) {}
