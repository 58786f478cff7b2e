package dev.levee.client;

import com.google.protobuf.ByteString;
import dev.levee.v1.AdminGrpc;
import dev.levee.v1.AppendMessage;
import dev.levee.v1.AppendRequest;
import dev.levee.v1.ClusterGrpc;
import dev.levee.v1.CreateTopicRequest;
import dev.levee.v1.DeleteQueueRequest;
import dev.levee.v1.DescribeGroupRequest;
import dev.levee.v1.DescribeGroupResponse;
import dev.levee.v1.DescribeProducerRequest;
import dev.levee.v1.DescribeProducerResponse;
import dev.levee.v1.DescribeTopicRequest;
import dev.levee.v1.DescribeTopicResponse;
import dev.levee.v1.EchoRequest;
import dev.levee.v1.ErrorCode;
import dev.levee.v1.GetAppStatsRequest;
import dev.levee.v1.GetAppStatsResponse;
import dev.levee.v1.GetClusterRequest;
import dev.levee.v1.GetClusterResponse;
import dev.levee.v1.GetQueueInfoRequest;
import dev.levee.v1.GetQueueInfoResponse;
import dev.levee.v1.GetRulesRequest;
import dev.levee.v1.GetServerInfoRequest;
import dev.levee.v1.GetServerInfoResponse;
import dev.levee.v1.HotKeyEvent;
import dev.levee.v1.HotKeyRule;
import dev.levee.v1.HotKeysGrpc;
import dev.levee.v1.KeyCount;
import dev.levee.v1.ListAppsRequest;
import dev.levee.v1.ListHotKeysRequest;
import dev.levee.v1.ListQueuesRequest;
import dev.levee.v1.ListQueuesResponse;
import dev.levee.v1.ListTopicsRequest;
import dev.levee.v1.PublishMessage;
import dev.levee.v1.PublishRequest;
import dev.levee.v1.PublishResponse;
import dev.levee.v1.QueuesGrpc;
import dev.levee.v1.ReadRequest;
import dev.levee.v1.ReadResponse;
import dev.levee.v1.RemoveHotKeyRequest;
import dev.levee.v1.SetGroupRateRequest;
import dev.levee.v1.SetHotKeyRequest;
import dev.levee.v1.SetProducerRateRequest;
import dev.levee.v1.SetRetentionRequest;
import dev.levee.v1.SetRulesRequest;
import dev.levee.v1.TopKeysRequest;
import dev.levee.v1.TopicSummary;
import dev.levee.v1.TopicsGrpc;
import io.grpc.ManagedChannel;
import io.grpc.StatusRuntimeException;
import io.grpc.stub.AbstractStub;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.function.Supplier;

/**
 * One connection (one HTTP/2 channel) to a Levee server and the calls it offers: admin, hot-key
 * admin, queues, topics, consumer groups, producer rates and cluster status. Calls block until
 * answered (or the request timeout passes); errors are thrown as {@link LeveeException}
 * subclasses carrying the wire code. Inputs the server would refuse are refused here first,
 * with the server's code and message ({@link Validation}), so nothing invalid crosses the
 * network. Thread-safe; share one client per server.
 */
public final class LeveeClient implements AutoCloseable {
    /** A call failing this close to its deadline (or after) failed because of it. */
    private static final long DEADLINE_SLACK_NANOS = TimeUnit.MILLISECONDS.toNanos(5);

    private final ManagedChannel channel;
    private final boolean ownsChannel;
    private final String address;
    private final ClientOptions options;
    private final String producerName;

    private LeveeClient(ManagedChannel channel, boolean ownsChannel, String address, ClientOptions options,
            String producerName) {
        this.channel = channel;
        this.ownsChannel = ownsChannel;
        this.address = address;
        this.options = options;
        this.producerName = producerName;
    }

    /** Connects to {@code address} ({@code HOST:PORT}) with the default options. */
    public static LeveeClient connect(String address) {
        return connect(address, ClientOptions.defaults());
    }

    /** Connects to {@code address}; UNAVAILABLE when no connection can be made in time. */
    public static LeveeClient connect(String address, ClientOptions options) {
        ManagedChannel channel = Channels.open(address);
        try {
            Channels.awaitReady(channel, address, options.connectTimeout());
        } catch (LeveeException error) {
            channel.shutdownNow();
            throw error;
        }
        return new LeveeClient(channel, true, address, options.copy(), "");
    }

    /**
     * A client of {@code address} whose channel connects on first use and reconnects by itself
     * (a producer's route to a cluster member: a member that is down fails its calls with
     * UNAVAILABLE instead of failing here). It owns its channel.
     */
    static LeveeClient lazy(String address, ClientOptions options, String producerName) {
        return new LeveeClient(Channels.open(address), true, address, options.copy(), producerName);
    }

    /**
     * This connection, naming its appends and publishes {@code producerName} (1 to 64 bytes) so
     * that an operator's rate limit for the name paces them.
     */
    public LeveeClient withProducerName(String producerName) {
        Validation.checkProducerName(producerName);
        return new LeveeClient(channel, false, address, options, producerName);
    }

    /** This connection with another deadline per call. */
    public LeveeClient withRequestTimeout(Duration requestTimeout) {
        return new LeveeClient(channel, false, address, options.copy().requestTimeout(requestTimeout), producerName);
    }

    public String address() {
        return address;
    }

    public ClientOptions options() {
        return options;
    }

    public String producerName() {
        return producerName;
    }

    ManagedChannel channel() {
        return channel;
    }

    /** Closes the connection (a client made by {@code with...} leaves it to its parent). */
    @Override
    public void close() {
        if (ownsChannel) {
            channel.shutdownNow();
            try {
                channel.awaitTermination(5, TimeUnit.SECONDS);
            } catch (InterruptedException interrupted) {
                Thread.currentThread().interrupt();
            }
        }
    }

    <S extends AbstractStub<S>> S deadline(S stub) {
        return stub.withDeadlineAfter(options.requestTimeout().toNanos(), TimeUnit.NANOSECONDS);
    }

    /** Runs a blocking call, throwing its failure as a LeveeException. */
    <T> T call(Supplier<T> invocation) {
        long deadline = System.nanoTime() + options.requestTimeout().toNanos();
        try {
            return invocation.get();
        } catch (StatusRuntimeException error) {
            LeveeException levee = WireErrors.from(error);
            if (levee.code() == ErrorCode.ERROR_CODE_UNAVAILABLE && deadline - System.nanoTime() <= DEADLINE_SLACK_NANOS) {
                // A server that gave up on the call at its deadline (tonic answers "Timeout
                // expired" as CANCELLED) means the same as the deadline passing here.
                throw LeveeException.of(ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED,
                        "the call's deadline passed (" + levee.description() + ")");
            }
            throw levee;
        }
    }

    private AdminGrpc.AdminBlockingStub admin() {
        return deadline(AdminGrpc.newBlockingStub(channel));
    }

    private HotKeysGrpc.HotKeysBlockingStub hotKeys() {
        return deadline(HotKeysGrpc.newBlockingStub(channel));
    }

    private QueuesGrpc.QueuesBlockingStub queues() {
        return deadline(QueuesGrpc.newBlockingStub(channel));
    }

    private TopicsGrpc.TopicsBlockingStub topics() {
        return deadline(TopicsGrpc.newBlockingStub(channel));
    }

    // ---- admin

    /** The server's version, addresses, data directory and uptime. */
    public GetServerInfoResponse serverInfo() {
        return call(() -> admin().getServerInfo(GetServerInfoRequest.getDefaultInstance()));
    }

    /** Answers with {@code payload} after {@code delayMs} (at most 65536 bytes, 60000 ms). */
    public byte[] echo(byte[] payload, int delayMs) {
        if (payload.length > Validation.ECHO_PAYLOAD_BYTES_MAX) {
            throw Validation.invalid("payload: at most " + Validation.ECHO_PAYLOAD_BYTES_MAX + " bytes, got "
                    + payload.length + "; send a smaller payload");
        }
        EchoRequest request = EchoRequest.newBuilder().setPayload(ByteString.copyFrom(payload)).setDelayMs(delayMs).build();
        return call(() -> admin().echo(request)).getPayload().toByteArray();
    }

    /** The cluster's members, leader and terms, as this node sees them (a single node is a cluster of one). */
    public GetClusterResponse clusterStatus() {
        return call(() -> deadline(ClusterGrpc.newBlockingStub(channel)).getCluster(GetClusterRequest.getDefaultInstance()));
    }

    // ---- hot keys: the admin side (app servers use HotKeys)

    /** Replaces an app's rules (creating the app). */
    public void setHotKeyRules(String app, List<HotKeyRule> rules) {
        Validation.checkApp(app);
        call(() -> hotKeys().setRules(SetRulesRequest.newBuilder().setApp(app).addAllRules(rules).build()));
    }

    /** An app's rules, every field set; NOT_FOUND for an unknown app. */
    public List<HotKeyRule> hotKeyRules(String app) {
        return call(() -> hotKeys().getRules(GetRulesRequest.newBuilder().setApp(app).build())).getRulesList();
    }

    /** The apps this server knows, sorted. */
    public List<String> hotKeyApps() {
        return call(() -> hotKeys().listApps(ListAppsRequest.getDefaultInstance())).getAppsList();
    }

    /** Sets {@code key} hot by hand for {@code durationMs}; pushed like a detected hot key. */
    public void setHotKey(String app, byte[] key, long durationMs) {
        Validation.checkApp(app);
        Validation.checkHotKey(app, key, options.hotKeyBytesMax());
        Validation.checkHotDuration(app, durationMs);
        call(() -> hotKeys().setHotKey(SetHotKeyRequest.newBuilder().setApp(app).setKey(ByteString.copyFrom(key))
                .setDurationMs(durationMs).build()));
    }

    /** Cools a hot key by hand; returns whether it was hot. */
    public boolean removeHotKey(String app, byte[] key) {
        return call(() -> hotKeys().removeHotKey(RemoveHotKeyRequest.newBuilder().setApp(app)
                .setKey(ByteString.copyFrom(key)).build())).getWasHot();
    }

    /** The app's hot keys now, sorted by key. */
    public List<HotKeyEvent> hotKeys(String app) {
        return call(() -> hotKeys().listHotKeys(ListHotKeysRequest.newBuilder().setApp(app).build())).getHotList();
    }

    /** The app's keys with the highest window counts, highest first (1 to 1000). */
    public List<KeyCount> topKeys(String app, int limit) {
        Validation.checkTopKeysLimit(limit);
        return call(() -> hotKeys().topKeys(TopKeysRequest.newBuilder().setApp(app).setLimit(limit).build())).getKeysList();
    }

    /** The app's counters on this server. */
    public GetAppStatsResponse appStats(String app) {
        return call(() -> hotKeys().getAppStats(GetAppStatsRequest.newBuilder().setApp(app).build()));
    }

    // ---- queues

    /** Appends one message; returns its offset once durable. */
    public long append(byte[] queue, byte[] payload) {
        return appendMessages(List.of(new QueueMessage(queue, payload)), "").get(0);
    }

    /**
     * Appends messages to any queues in one request; returns their offsets in order once
     * durable. With {@code producerId}, each message carries its sequence on its queue and a
     * resend of the same sequences stores nothing twice.
     */
    public List<Long> appendMessages(List<QueueMessage> messages, String producerId) {
        Validation.checkMessageCount(messages.size(), "append");
        Validation.checkProducerId(producerId);
        AppendRequest.Builder request = AppendRequest.newBuilder().setProducerId(producerId).setProducerName(producerName);
        for (QueueMessage message : messages) {
            Validation.checkAppendQueue(message.queue());
            Validation.checkNotReserved(message.queue());
            Validation.checkPayload(message.payload(), options.messageBytesMax());
            request.addMessages(AppendMessage.newBuilder().setQueue(ByteString.copyFrom(message.queue()))
                    .setPayload(ByteString.copyFrom(message.payload())).setSequence(message.sequence()));
        }
        return appendRequest(request.build());
    }

    /** Sends a prepared AppendRequest as it is; returns the offsets. */
    public List<Long> appendRequest(AppendRequest request) {
        return call(() -> queues().append(request)).getOffsetsList();
    }

    /** Messages of {@code queue} from {@code offset} (0: the server's defaults for the maxima). */
    public ReadResponse read(byte[] queue, long offset, int maxMessages, int maxBytes) {
        Validation.checkAppendQueue(queue);
        Validation.checkRead(maxMessages, maxBytes);
        return call(() -> queues().read(ReadRequest.newBuilder().setQueue(ByteString.copyFrom(queue)).setOffset(offset)
                .setMaxMessages(maxMessages).setMaxBytes(maxBytes).build()));
    }

    /** A queue's first and next offsets and retention. */
    public GetQueueInfoResponse queueInfo(byte[] queue) {
        Validation.checkAppendQueue(queue);
        return call(() -> queues().getQueueInfo(GetQueueInfoRequest.newBuilder().setQueue(ByteString.copyFrom(queue)).build()));
    }

    /** One page of queue names. */
    public ListQueuesResponse listQueues(byte[] prefix, int limit, byte[] pageToken) {
        return call(() -> queues().listQueues(ListQueuesRequest.newBuilder().setPrefix(ByteString.copyFrom(prefix))
                .setLimit(limit).setPageToken(ByteString.copyFrom(pageToken)).build()));
    }

    /** Deletes a queue and its messages; returns whether it existed. */
    public boolean deleteQueue(byte[] queue) {
        Validation.checkAppendQueue(queue);
        Validation.checkNotReserved(queue);
        return call(() -> queues().deleteQueue(DeleteQueueRequest.newBuilder().setQueue(ByteString.copyFrom(queue)).build()))
                .getExisted();
    }

    /** Sets the retention of queues starting with {@code prefix}; returns the messages removed now. */
    public long setRetention(byte[] prefix, long maxAgeMs, long maxBytes) {
        return call(() -> queues().setRetention(SetRetentionRequest.newBuilder().setPrefix(ByteString.copyFrom(prefix))
                .setMaxAgeMs(maxAgeMs).setMaxBytes(maxBytes).build())).getMessagesRemoved();
    }

    /** Opens {@code consumer}'s mailbox on {@code queue}; see {@link Subscription}. */
    public Subscription subscribe(byte[] queue, String consumer, int creditMessages) {
        return Subscription.open(this, queue, consumer, creditMessages);
    }

    /**
     * {@link #subscribe} that moves by itself, as {@link #subscribeManyFollowing} says: when its
     * node goes away it opens itself again through another member and goes on from the
     * consumer's last confirmed ack ({@link Subscription#startOffset} then says where); an ack
     * cut short returns if the reopened subscription starts after it, and throws UNAVAILABLE
     * otherwise, once the subscription is open again.
     */
    public Subscription subscribeFollowing(byte[] queue, String consumer, int creditMessages) {
        return Subscription.openFollowing(this, queue, consumer, creditMessages);
    }

    /** Opens {@code consumer}'s stream over many queues (added with {@link Mailboxes#add}). */
    public Mailboxes subscribeMany(String consumer, int creditMessages) {
        return Mailboxes.open(this, consumer, creditMessages);
    }

    /**
     * {@link #subscribeMany} that moves by itself: when its node goes away (the stream fails
     * with UNAVAILABLE, which a broken connection reads as) it learns the cluster's members
     * (GetCluster through this client's node, else through the members it knew), opens the
     * stream again through the next member, adds every queue again under the same mailbox
     * numbers (removed ones removed again) and goes on, for up to 30 s per move (then the call
     * throws UNAVAILABLE saying so). Delivery resumes after the consumer's last confirmed acks:
     * messages taken, or acked but not confirmed, are delivered again (at least once), and a
     * {@link Mailboxes#flushAcks} cut short throws UNAVAILABLE once the stream is open again; in
     * a cluster that replicates its queues, no message whose ack was confirmed is delivered
     * again (docs/CLUSTER.md, "Consumers' positions"). Other errors end the stream as on
     * {@link #subscribeMany}. The stream keeps a channel to each member it moves through,
     * closed with it.
     */
    public Mailboxes subscribeManyFollowing(String consumer, int creditMessages) {
        return Mailboxes.openFollowing(this, consumer, creditMessages);
    }

    // ---- topics and groups

    /** Creates a topic; returns true when it existed already with this partition count. */
    public boolean createTopic(String topic, int partitions) {
        Validation.checkTopic(topic);
        Validation.checkPartitions(partitions);
        return call(() -> topics().createTopic(CreateTopicRequest.newBuilder().setTopic(topic).setPartitions(partitions)
                .build())).getExisted();
    }

    public DescribeTopicResponse describeTopic(String topic) {
        return call(() -> topics().describeTopic(DescribeTopicRequest.newBuilder().setTopic(topic).build()));
    }

    public List<TopicSummary> listTopics() {
        return call(() -> topics().listTopics(ListTopicsRequest.getDefaultInstance())).getTopicsList();
    }

    /**
     * Publishes messages; returns where each went, in order. A record with a {@link
     * PublishRecord#delayMs delay} is stored durably at once and delivered to its partition
     * when due (its {@link Published} has offset 0 and its {@link Published#deliverAtMs}); a
     * request with a delayed message cannot have a producer id.
     */
    public List<Published> publish(String topic, List<PublishRecord> records, String producerId) {
        Validation.checkMessageCount(records.size(), "publish");
        Validation.checkProducerId(producerId);
        PublishRequest.Builder request = PublishRequest.newBuilder().setTopic(topic).setProducerId(producerId)
                .setProducerName(producerName);
        for (PublishRecord record : records) {
            Validation.checkPayload(record.payload(), options.messageBytesMax());
            Validation.checkDelayMs(record.delayMs());
            Validation.checkDelayWithoutProducerId(record.delayMs(), producerId);
            request.addMessages(PublishMessage.newBuilder().setKey(ByteString.copyFrom(record.key()))
                    .setPayload(ByteString.copyFrom(record.payload()))
                    .setPartitionPlusOne(record.partition() < 0 ? 0 : record.partition() + 1)
                    .setSequence(record.sequence())
                    .setDelayMs(record.delayMs()));
        }
        PublishResponse response = call(() -> topics().publish(request.build()));
        // deliver_at_ms is empty when no message was delayed, else one per message.
        boolean anyDelayed = response.getDeliverAtMsCount() > 0;
        List<Published> published = new ArrayList<>(response.getOffsetsCount());
        for (int i = 0; i < response.getOffsetsCount(); i++) {
            published.add(new Published(response.getPartitions(i), response.getOffsets(i),
                    anyDelayed ? response.getDeliverAtMs(i) : 0));
        }
        return published;
    }

    /**
     * Publishes {@code records} to {@code topic} to be delivered no earlier than {@code delay}
     * from now (whole milliseconds, at most 7 days; it replaces each record's own delay), without
     * a producer id; returns each message's partition and {@link Published#deliverAtMs} (ms
     * since the Unix epoch, by the server's clock) once stored durably. A delayed message gets
     * its offset when delivered. A zero delay publishes at once.
     */
    public List<Published> publishDelayed(String topic, List<PublishRecord> records, Duration delay) {
        long delayMs = Validation.delayMs(delay);
        List<PublishRecord> delayed = new ArrayList<>(records.size());
        for (PublishRecord record : records) {
            delayed.add(new PublishRecord(record.key(), record.payload(), record.partition(), record.sequence(), delayMs));
        }
        return publish(topic, delayed, "");
    }

    public DescribeGroupResponse describeGroup(String group, String topic) {
        Validation.checkGroup(group);
        return call(() -> topics().describeGroup(DescribeGroupRequest.newBuilder().setGroup(group).setTopic(topic).build()));
    }

    public void setGroupRate(String group, double messagesPerSecond) {
        Validation.checkGroup(group);
        call(() -> topics().setGroupRate(SetGroupRateRequest.newBuilder().setGroup(group)
                .setMessagesPerS(messagesPerSecond).build()));
    }

    /** Limits the appends and publishes named {@code producerName} to a rate (0: no limit). */
    public void setProducerRate(String producerName, double messagesPerSecond) {
        Validation.checkProducerName(producerName);
        call(() -> topics().setProducerRate(SetProducerRateRequest.newBuilder().setProducerName(producerName)
                .setMessagesPerS(messagesPerSecond).build()));
    }

    public DescribeProducerResponse describeProducer(String producerName) {
        Validation.checkProducerName(producerName);
        return call(() -> topics().describeProducer(DescribeProducerRequest.newBuilder().setProducerName(producerName).build()));
    }
}
