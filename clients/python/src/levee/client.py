"""`Client`: one connection (one HTTP/2 channel) to a Levee server and the calls it offers.

Every call is a coroutine; errors are raised as `LeveeError` subclasses carrying the wire
`ErrorCode`. Inputs the server would refuse are refused here first, with the server's code and
message (see validation.py), so nothing invalid crosses the network.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import (
    Any,
    Awaitable,
    Iterable,
    List,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

import grpc
import grpc.aio

from . import validation
from .errors import ErrorCode, LeveeError, client_closed_error, from_rpc_error, make_error
from .v1 import admin_pb2, admin_pb2_grpc, cluster_pb2, cluster_pb2_grpc, hotkey_pb2
from .v1 import hotkey_pb2_grpc
from .v1 import queue_pb2, queue_pb2_grpc, topic_pb2, topic_pb2_grpc
from .validation import BytesLike, to_bytes

T = TypeVar("T")

# The largest message the channel sends or takes: above every call's server limit (16 MiB for
# queues and topics), so that the server, not the library, names the limit it enforces.
CHANNEL_MESSAGE_BYTES_MAX = 64 << 20
# A call failing this close to its deadline (or after) failed because of it.
DEADLINE_SLACK_S = 0.005


@dataclass(frozen=True)
class ClientOptions:
    """How a `Client` connects and what it checks before sending."""

    connect_timeout_s: float = 5.0
    """Most time to establish the connection."""
    request_timeout_s: float = 30.0
    """Deadline of each unary call."""
    message_bytes_max: int = validation.MESSAGE_BYTES_MAX_DEFAULT
    """The server's queue_message_bytes_max (default 1 MiB): larger payloads are refused here."""
    hot_key_bytes_max: int = validation.HOT_KEY_BYTES_MAX_DEFAULT
    """The server's hotkey_key_bytes_max (default 1024)."""


@dataclass(frozen=True)
class Record:
    """One message to publish: by key (XXH3_64(key) mod partitions) or to a given partition."""

    payload: bytes
    key: bytes = b""
    partition: Optional[int] = None
    sequence: int = 0
    """With a producer_id: this producer's sequence number on the message's partition."""
    delay_ms: int = 0
    """Deliver no earlier than this many ms from now (0: at once), at most 604800000 (7 days).
    A delayed message is stored durably at once and appended to its partition (getting its
    offset) when due; it cannot be published with a producer_id."""


@dataclass(frozen=True)
class Published:
    """Where a published message went."""

    partition: int
    offset: int
    """Its offset in the partition; 0 for a delayed message (it gets one when delivered)."""
    deliver_at_ms: int = 0
    """When a delayed message will be delivered (ms since the Unix epoch, by the server's
    clock); 0 for a message stored at once."""


@dataclass(frozen=True)
class QueueMessage:
    """One message to append: its queue, payload and (with a producer_id) sequence."""

    queue: bytes
    payload: bytes
    sequence: int = 0


AppendInput = Union[QueueMessage, Tuple[BytesLike, BytesLike], Tuple[BytesLike, BytesLike, int]]
PublishInput = Union[Record, Tuple[BytesLike, BytesLike]]


def _channel_options() -> List[Tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", CHANNEL_MESSAGE_BYTES_MAX),
        ("grpc.max_receive_message_length", CHANNEL_MESSAGE_BYTES_MAX),
        ("grpc.keepalive_time_ms", 30_000),
    ]


async def call(awaitable: Awaitable[T]) -> T:
    """Awaits a gRPC call, raising its failure as a `LeveeError`."""
    try:
        return await awaitable
    except grpc.RpcError as error:
        levee_error = from_rpc_error(error)
        remaining = getattr(awaitable, "time_remaining", lambda: None)()
        if (
            levee_error.code == ErrorCode.UNAVAILABLE
            and remaining is not None
            and remaining <= DEADLINE_SLACK_S
        ):
            # The call's deadline has passed: a server that gave up on it on its own (tonic
            # answers "Timeout expired" as CANCELLED, sent as UNAVAILABLE) means the same.
            raise make_error(
                ErrorCode.DEADLINE_EXCEEDED, f"the call's deadline passed ({levee_error.message})"
            ) from None
        raise levee_error from None
    except grpc.aio.UsageError as error:
        raise client_closed_error(error) from None


class _Guarded:
    """A stub's method: a call started on a closed channel raises UNAVAILABLE ("the client is
    closed"), as every other failure is a `LeveeError`, instead of grpc.aio's `UsageError`."""

    __slots__ = ("_method",)

    def __init__(self, method: Any) -> None:
        self._method = method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._method(*args, **kwargs)
        except grpc.aio.UsageError as error:
            raise client_closed_error(error) from None


class _GuardedChannel:
    """What the generated stubs are built on: the channel, each method guarded (`_Guarded`).
    The stubs' calls (unary ones here, the streams of `Subscription`, `Mailboxes`,
    `GroupConsumer`) all start through it."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel

    def unary_unary(self, *args: Any, **kwargs: Any) -> _Guarded:
        return _Guarded(self._channel.unary_unary(*args, **kwargs))

    def unary_stream(self, *args: Any, **kwargs: Any) -> _Guarded:
        return _Guarded(self._channel.unary_stream(*args, **kwargs))

    def stream_unary(self, *args: Any, **kwargs: Any) -> _Guarded:
        return _Guarded(self._channel.stream_unary(*args, **kwargs))

    def stream_stream(self, *args: Any, **kwargs: Any) -> _Guarded:
        return _Guarded(self._channel.stream_stream(*args, **kwargs))


def _message(item: AppendInput) -> QueueMessage:
    if isinstance(item, QueueMessage):
        return QueueMessage(to_bytes(item.queue), to_bytes(item.payload), item.sequence)
    if len(item) == 3:
        return QueueMessage(to_bytes(item[0]), to_bytes(item[1]), int(item[2]))  # type: ignore[misc]
    return QueueMessage(to_bytes(item[0]), to_bytes(item[1]))


def _record(item: PublishInput) -> Record:
    if isinstance(item, Record):
        return Record(
            to_bytes(item.payload), to_bytes(item.key), item.partition, item.sequence, item.delay_ms
        )
    key, payload = item
    return Record(to_bytes(payload), to_bytes(key))


class Client:
    """A connection to one Levee server. Create it with `await Client.connect(address)` inside
    a running event loop; close it with `await client.close()` (or `async with`)."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        address: str,
        options: ClientOptions,
        producer_name: str = "",
    ) -> None:
        self._channel = channel
        self.address = address
        self.options = options
        self._producer_name = producer_name
        # The stubs' calls on a closed channel raise UNAVAILABLE, not grpc.aio's UsageError.
        guarded = _GuardedChannel(channel)
        self._admin = admin_pb2_grpc.AdminStub(guarded)
        self._cluster = cluster_pb2_grpc.ClusterStub(guarded)
        self._hot_keys = hotkey_pb2_grpc.HotKeysStub(guarded)
        self._queues = queue_pb2_grpc.QueuesStub(guarded)
        self._topics = topic_pb2_grpc.TopicsStub(guarded)

    @classmethod
    async def connect(cls, address: str, options: Optional[ClientOptions] = None) -> "Client":
        """Connects to `address` (`HOST:PORT`); UNAVAILABLE when no connection can be made."""
        options = options or ClientOptions()
        target = address.split("://", 1)[1] if "://" in address else address
        channel = grpc.aio.insecure_channel(target, options=_channel_options())
        try:
            await asyncio.wait_for(channel.channel_ready(), options.connect_timeout_s)
        except (asyncio.TimeoutError, grpc.RpcError) as error:
            await channel.close()
            raise make_error(
                ErrorCode.UNAVAILABLE,
                f"cannot connect to the levee server at {address} ({type(error).__name__}); "
                "check that it is running and listening there",
            ) from None
        return cls(channel, address, options)

    @classmethod
    def connect_lazy(
        cls, address: str, options: Optional[ClientOptions] = None, producer_name: str = ""
    ) -> "Client":
        """A client of `address` that connects on its first call, without waiting: a call while
        the server cannot be reached fails with UNAVAILABLE. Must be made inside a running
        event loop."""
        options = options or ClientOptions()
        target = address.split("://", 1)[1] if "://" in address else address
        channel = grpc.aio.insecure_channel(target, options=_channel_options())
        return cls(channel, address, options, producer_name)

    def with_producer_name(self, producer_name: str) -> "Client":
        """This connection, naming its appends and publishes `producer_name` (1 to 64 bytes) so
        that an operator's rate limit for the name paces them."""
        validation.check_producer_name(producer_name)
        return Client(self._channel, self.address, self.options, producer_name)

    @property
    def producer_name(self) -> str:
        return self._producer_name

    async def close(self, grace_s: Optional[float] = None) -> None:
        """Closes the connection: calls in progress are cancelled, or given up to `grace_s`
        to finish. A call on a closed client (or on a `with_producer_name` copy, which shares
        the connection) raises `UnavailableError` ("the client is closed")."""
        await self._channel.close(grace_s)

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def _timeout(self) -> float:
        return self.options.request_timeout_s

    # ---- admin

    async def server_info(self) -> admin_pb2.GetServerInfoResponse:
        """The server's version, addresses, data directory and uptime."""
        return await call(
            self._admin.GetServerInfo(admin_pb2.GetServerInfoRequest(), timeout=self._timeout)
        )

    async def echo(self, payload: BytesLike = b"", delay_ms: int = 0) -> bytes:
        response = await call(
            self._admin.Echo(
                admin_pb2.EchoRequest(payload=to_bytes(payload), delay_ms=delay_ms),
                timeout=self._timeout,
            )
        )
        return response.payload

    # ---- cluster

    async def cluster(self, timeout_s: Optional[float] = None) -> cluster_pb2.GetClusterResponse:
        """This node's view of its cluster (`Cluster.GetCluster`): members, shards, the shard
        map with each shard's leader, whether it replicates its queues."""
        return await call(
            self._cluster.GetCluster(
                cluster_pb2.GetClusterRequest(),
                timeout=self._timeout if timeout_s is None else timeout_s,
            )
        )

    # ---- hot keys (admin side; app servers use HotKeys)

    async def set_hot_key_rules(self, app: str, rules: Sequence[hotkey_pb2.HotKeyRule]) -> None:
        """Replaces an app's rules (creating the app)."""
        validation.check_app(app)
        await call(
            self._hot_keys.SetRules(
                hotkey_pb2.SetRulesRequest(app=app, rules=list(rules)), timeout=self._timeout
            )
        )

    async def hot_key_rules(self, app: str) -> List[hotkey_pb2.HotKeyRule]:
        response = await call(
            self._hot_keys.GetRules(hotkey_pb2.GetRulesRequest(app=app), timeout=self._timeout)
        )
        return list(response.rules)

    async def hot_key_apps(self) -> List[str]:
        response = await call(
            self._hot_keys.ListApps(hotkey_pb2.ListAppsRequest(), timeout=self._timeout)
        )
        return list(response.apps)

    async def set_hot_key(self, app: str, key: BytesLike, duration_ms: int) -> None:
        """Sets `key` hot by hand for `duration_ms`; pushed like a detected hot key."""
        key = to_bytes(key)
        validation.check_app(app)
        validation.check_hot_key(app, key, self.options.hot_key_bytes_max)
        validation.check_hot_duration(app, duration_ms)
        await call(
            self._hot_keys.SetHotKey(
                hotkey_pb2.SetHotKeyRequest(app=app, key=key, duration_ms=duration_ms),
                timeout=self._timeout,
            )
        )

    async def remove_hot_key(self, app: str, key: BytesLike) -> bool:
        """Cools a hot key by hand; returns whether it was hot."""
        response = await call(
            self._hot_keys.RemoveHotKey(
                hotkey_pb2.RemoveHotKeyRequest(app=app, key=to_bytes(key)), timeout=self._timeout
            )
        )
        return response.was_hot

    async def hot_keys(self, app: str) -> List[hotkey_pb2.HotKeyEvent]:
        """The app's hot keys now, sorted by key."""
        response = await call(
            self._hot_keys.ListHotKeys(
                hotkey_pb2.ListHotKeysRequest(app=app), timeout=self._timeout
            )
        )
        return list(response.hot)

    async def top_keys(self, app: str, limit: int = 10) -> List[hotkey_pb2.KeyCount]:
        validation.check_top_keys_limit(limit)
        response = await call(
            self._hot_keys.TopKeys(
                hotkey_pb2.TopKeysRequest(app=app, limit=limit), timeout=self._timeout
            )
        )
        return list(response.keys)

    async def app_stats(self, app: str) -> hotkey_pb2.GetAppStatsResponse:
        return await call(
            self._hot_keys.GetAppStats(
                hotkey_pb2.GetAppStatsRequest(app=app), timeout=self._timeout
            )
        )

    # ---- queues

    async def append(self, queue: BytesLike, payload: BytesLike) -> int:
        """Appends one message; returns its offset once durable."""
        offsets = await self.append_messages([(queue, payload)])
        return offsets[0]

    async def append_messages(
        self, messages: Sequence[AppendInput], producer_id: str = ""
    ) -> List[int]:
        """Appends messages to any queues in one request; returns their offsets in order once
        durable. With `producer_id`, each message carries its sequence on its queue and a
        resend of the same sequences stores nothing twice."""
        items = [_message(item) for item in messages]
        validation.check_message_count(len(items), "append")
        validation.check_producer_id(producer_id)
        for item in items:
            validation.check_append_queue(item.queue)
            validation.check_not_reserved(item.queue)
            validation.check_payload(item.payload, self.options.message_bytes_max)
        request = queue_pb2.AppendRequest(
            messages=[
                queue_pb2.AppendMessage(queue=m.queue, payload=m.payload, sequence=m.sequence)
                for m in items
            ],
            producer_id=producer_id,
            producer_name=self._producer_name,
        )
        return await self.append_request(request)

    async def append_request(self, request: queue_pb2.AppendRequest) -> List[int]:
        """Sends a prepared AppendRequest as it is (the `Producer` checks its messages when
        they are queued); returns the offsets."""
        response = await call(self._queues.Append(request, timeout=self._timeout))
        return list(response.offsets)

    async def read(
        self, queue: BytesLike, offset: int = 0, max_messages: int = 0, max_bytes: int = 0
    ) -> queue_pb2.ReadResponse:
        """Messages of `queue` from `offset` (payloads, first_offset, next_offset, ...)."""
        queue = to_bytes(queue)
        validation.check_append_queue(queue)
        validation.check_read(max_messages, max_bytes)
        return await call(
            self._queues.Read(
                queue_pb2.ReadRequest(
                    queue=queue, offset=offset, max_messages=max_messages, max_bytes=max_bytes
                ),
                timeout=self._timeout,
            )
        )

    async def queue_info(self, queue: BytesLike) -> queue_pb2.GetQueueInfoResponse:
        queue = to_bytes(queue)
        validation.check_append_queue(queue)
        return await call(
            self._queues.GetQueueInfo(
                queue_pb2.GetQueueInfoRequest(queue=queue), timeout=self._timeout
            )
        )

    async def list_queues(
        self, prefix: BytesLike = b"", limit: int = 0, page_token: bytes = b""
    ) -> queue_pb2.ListQueuesResponse:
        return await call(
            self._queues.ListQueues(
                queue_pb2.ListQueuesRequest(
                    prefix=to_bytes(prefix), limit=limit, page_token=page_token
                ),
                timeout=self._timeout,
            )
        )

    async def delete_queue(self, queue: BytesLike) -> bool:
        """Deletes a queue and its messages; returns whether it existed."""
        queue = to_bytes(queue)
        validation.check_append_queue(queue)
        validation.check_not_reserved(queue)
        response = await call(
            self._queues.DeleteQueue(
                queue_pb2.DeleteQueueRequest(queue=queue), timeout=self._timeout
            )
        )
        return response.existed

    async def set_retention(self, prefix: BytesLike, max_age_ms: int = 0, max_bytes: int = 0) -> int:
        response = await call(
            self._queues.SetRetention(
                queue_pb2.SetRetentionRequest(
                    prefix=to_bytes(prefix), max_age_ms=max_age_ms, max_bytes=max_bytes
                ),
                timeout=self._timeout,
            )
        )
        return response.messages_removed

    async def subscribe(
        self, queue: BytesLike, consumer: str, credit_messages: int = 100
    ) -> "Subscription":
        """Opens `consumer`'s mailbox on `queue`; see `Subscription`."""
        from .subscription import Subscription

        return await Subscription.open(self, to_bytes(queue), consumer, credit_messages)

    async def subscribe_following(
        self, queue: BytesLike, consumer: str, credit_messages: int = 100
    ) -> "Subscription":
        """`subscribe` that moves by itself, as `subscribe_many_following` says: when its node
        goes away it opens itself again through another member and goes on from the
        consumer's last confirmed ack (`Subscription.start_offset` then says where); an ack
        cut short says so once the subscription is open again."""
        subscription = await self.subscribe(queue, consumer, credit_messages)
        try:
            await subscription._follow(self)
        except BaseException:
            await subscription.close()
            raise
        return subscription

    async def subscribe_many(self, consumer: str, credit_messages: int = 1000) -> "Mailboxes":
        """Opens `consumer`'s stream over many queues (added with `Mailboxes.add`)."""
        from .mailboxes import Mailboxes

        return await Mailboxes.open(self, consumer, credit_messages)

    async def subscribe_many_following(
        self, consumer: str, credit_messages: int = 1000
    ) -> "Mailboxes":
        """`subscribe_many` that moves by itself: when its node goes away (the stream fails
        with UNAVAILABLE or a broken connection) it opens the stream again through another
        member of the cluster (asked of this node, or of the members it knew), adds every
        queue again under the same mailbox numbers (removed ones removed again) and goes on,
        for up to 30 s per move. Delivery resumes after the consumer's last confirmed ack:
        messages taken or acked but not confirmed are delivered again (at least once); in a
        cluster that replicates its queues, no message whose ack was confirmed is delivered
        again (docs/CLUSTER.md, "Consumers' positions"). Other errors (FAILED_PRECONDITION,
        ...) end the stream as on `subscribe_many`. The members' connections it opens are
        closed with the stream."""
        mailboxes = await self.subscribe_many(consumer, credit_messages)
        try:
            await mailboxes._follow(self)
        except BaseException:
            await mailboxes.close()
            raise
        return mailboxes

    # ---- topics

    async def create_topic(self, topic: str, partitions: int) -> bool:
        """Creates a topic; returns True when it existed already with this partition count."""
        validation.check_topic(topic)
        validation.check_partitions(partitions)
        response = await call(
            self._topics.CreateTopic(
                topic_pb2.CreateTopicRequest(topic=topic, partitions=partitions),
                timeout=self._timeout,
            )
        )
        return response.existed

    async def describe_topic(self, topic: str) -> topic_pb2.DescribeTopicResponse:
        return await call(
            self._topics.DescribeTopic(
                topic_pb2.DescribeTopicRequest(topic=topic), timeout=self._timeout
            )
        )

    async def list_topics(self) -> List[topic_pb2.TopicSummary]:
        response = await call(
            self._topics.ListTopics(topic_pb2.ListTopicsRequest(), timeout=self._timeout)
        )
        return list(response.topics)

    async def publish(
        self, topic: str, messages: Iterable[PublishInput], producer_id: str = ""
    ) -> List[Published]:
        """Publishes messages ((key, payload) pairs or `Record`s); returns where each went once
        stored durably. A `Record` with a `delay_ms` is delivered that much later (its
        `Published` has offset 0 and `deliver_at_ms`); delayed messages cannot have a
        `producer_id`."""
        records = [_record(item) for item in messages]
        validation.check_message_count(len(records), "publish")
        for record in records:
            validation.check_delay_ms(record.delay_ms, producer_id)
        validation.check_producer_id(producer_id)
        for record in records:
            validation.check_payload(record.payload, self.options.message_bytes_max)
        request = topic_pb2.PublishRequest(
            topic=topic,
            messages=[
                topic_pb2.PublishMessage(
                    key=record.key,
                    payload=record.payload,
                    partition_plus_one=0 if record.partition is None else record.partition + 1,
                    sequence=record.sequence,
                    delay_ms=record.delay_ms,
                )
                for record in records
            ],
            producer_id=producer_id,
            producer_name=self._producer_name,
        )
        response = await call(self._topics.Publish(request, timeout=self._timeout))
        # Empty when no message was delayed, else one per message (0: stored at once).
        deliver_at = list(response.deliver_at_ms) or [0] * len(response.partitions)
        return [
            Published(p, o, d) for p, o, d in zip(response.partitions, response.offsets, deliver_at)
        ]

    async def publish_delayed(
        self, topic: str, messages: Iterable[PublishInput], delay_s: float
    ) -> List[Published]:
        """Publishes messages ((key, payload) pairs or `Record`s) to be delivered no earlier
        than `delay_s` seconds from now (at most 604800, 7 days; a `Record`'s own `delay_ms`
        is replaced); returns each message's partition and `deliver_at_ms` (ms since the Unix
        epoch, by the server's clock) once stored durably. A delayed message gets its offset
        when delivered (its `Published.offset` is 0)."""
        delay_ms = validation.delay_s_to_ms(delay_s)
        records = [replace(_record(item), delay_ms=delay_ms) for item in messages]
        return await self.publish(topic, records)

    async def describe_group(self, group: str, topic: str) -> topic_pb2.DescribeGroupResponse:
        validation.check_group(group)
        return await call(
            self._topics.DescribeGroup(
                topic_pb2.DescribeGroupRequest(group=group, topic=topic), timeout=self._timeout
            )
        )

    async def set_group_rate(self, group: str, messages_per_s: float) -> None:
        validation.check_group(group)
        await call(
            self._topics.SetGroupRate(
                topic_pb2.SetGroupRateRequest(group=group, messages_per_s=messages_per_s),
                timeout=self._timeout,
            )
        )

    async def set_producer_rate(self, producer_name: str, messages_per_s: float) -> None:
        validation.check_producer_name(producer_name)
        await call(
            self._topics.SetProducerRate(
                topic_pb2.SetProducerRateRequest(
                    producer_name=producer_name, messages_per_s=messages_per_s
                ),
                timeout=self._timeout,
            )
        )

    async def describe_producer(self, producer_name: str) -> topic_pb2.DescribeProducerResponse:
        validation.check_producer_name(producer_name)
        return await call(
            self._topics.DescribeProducer(
                topic_pb2.DescribeProducerRequest(producer_name=producer_name),
                timeout=self._timeout,
            )
        )

    # ---- raw stubs for the streaming helpers of this package

    @property
    def queues_stub(self) -> queue_pb2_grpc.QueuesStub:
        return self._queues

    @property
    def topics_stub(self) -> topic_pb2_grpc.TopicsStub:
        return self._topics


from .mailboxes import Mailboxes  # noqa: E402  (for the annotations above)
from .subscription import Subscription  # noqa: E402

__all__ = ["Client", "ClientOptions", "Record", "Published", "QueueMessage", "LeveeError"]
