"""Client-side validation refuses exactly what the server refuses, with the same code and the
same message: each case is sent once through the client (refused before sending) and once
raw to a real server, and the two errors must be equal. A server whose message changes makes
these tests fail."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, List, Tuple

import grpc
import pytest

import levee
from levee.errors import from_rpc_error
from levee.v1 import (
    common_pb2, hotkey_pb2, hotkey_pb2_grpc, queue_pb2, queue_pb2_grpc, topic_pb2, topic_pb2_grpc,
)

from conftest import run

BIG = b"x" * ((1 << 20) + 1)
Case = Tuple[str, Callable[[levee.Client], Awaitable[Any]], Callable[[grpc.Channel], Any]]


def first_stream_error(responses: Any) -> None:
    for _ in responses:
        return


async def add_mailboxes(client: levee.Client, queues: list) -> None:
    # Opening needs the server; adding is refused before anything is sent.
    mailboxes = levee.Mailboxes(_ClosedStream(), 1)
    await mailboxes.add(queues)


class _ClosedStream:
    async def read(self):  # type: ignore[no-untyped-def]
        await asyncio.sleep(3600)

    async def write(self, request) -> None:  # type: ignore[no-untyped-def]
        raise AssertionError("nothing may be sent")

    def cancel(self) -> None:
        pass


CASES: List[Case] = [
    ("append empty queue", lambda c: c.append(b"", b"x"),
     lambda ch: queue_pb2_grpc.QueuesStub(ch).Append(queue_pb2.AppendRequest(
         messages=[queue_pb2.AppendMessage(queue=b"", payload=b"x")]))),
    ("append long queue", lambda c: c.append(b"q" * 256, b"x"),
     lambda ch: queue_pb2_grpc.QueuesStub(ch).Append(queue_pb2.AppendRequest(
         messages=[queue_pb2.AppendMessage(queue=b"q" * 256, payload=b"x")]))),
    ("append reserved queue", lambda c: c.append(b"\0q", b"x"),
     lambda ch: queue_pb2_grpc.QueuesStub(ch).Append(queue_pb2.AppendRequest(
         messages=[queue_pb2.AppendMessage(queue=b"\0q", payload=b"x")]))),
    ("append large payload", lambda c: c.append(b"q", BIG),
     lambda ch: queue_pb2_grpc.QueuesStub(ch).Append(queue_pb2.AppendRequest(
         messages=[queue_pb2.AppendMessage(queue=b"q", payload=BIG)]))),
    ("append no message", lambda c: c.append_messages([]),
     lambda ch: queue_pb2_grpc.QueuesStub(ch).Append(queue_pb2.AppendRequest())),
    ("append 10001 messages", lambda c: c.append_messages([(b"q", b"")] * 10001),
     lambda ch: queue_pb2_grpc.QueuesStub(ch).Append(queue_pb2.AppendRequest(
         messages=[queue_pb2.AppendMessage(queue=b"q")] * 10001))),
    ("append long producer id", lambda c: c.append_messages([(b"q", b"")], "p" * 65),
     lambda ch: queue_pb2_grpc.QueuesStub(ch).Append(queue_pb2.AppendRequest(
         messages=[queue_pb2.AppendMessage(queue=b"q")], producer_id="p" * 65))),
    ("producer name too long", lambda c: c.set_producer_rate("n" * 65, 1),
     lambda ch: topic_pb2_grpc.TopicsStub(ch).SetProducerRate(topic_pb2.SetProducerRateRequest(
         producer_name="n" * 65, messages_per_s=1))),
    ("publish delay too long", lambda c: c.publish("delays", [levee.Record(b"v", delay_ms=604_800_001)]),
     lambda ch: (topic_pb2_grpc.TopicsStub(ch).CreateTopic(topic_pb2.CreateTopicRequest(topic="delays", partitions=1)),
                 topic_pb2_grpc.TopicsStub(ch).Publish(topic_pb2.PublishRequest(topic="delays", messages=[
                     topic_pb2.PublishMessage(payload=b"v", delay_ms=604_800_001)])))),
    ("publish delayed with producer id", lambda c: c.publish("delays", [levee.Record(b"v", delay_ms=1000)], "p"),
     lambda ch: (topic_pb2_grpc.TopicsStub(ch).CreateTopic(topic_pb2.CreateTopicRequest(topic="delays", partitions=1)),
                 topic_pb2_grpc.TopicsStub(ch).Publish(topic_pb2.PublishRequest(topic="delays", producer_id="p", messages=[
                     topic_pb2.PublishMessage(payload=b"v", delay_ms=1000)])))),
    ("read empty queue", lambda c: c.read(b""),
     lambda ch: queue_pb2_grpc.QueuesStub(ch).Read(queue_pb2.ReadRequest(queue=b""))),
    ("read too many", lambda c: c.read(b"q", 0, 10001),
     lambda ch: queue_pb2_grpc.QueuesStub(ch).Read(queue_pb2.ReadRequest(queue=b"q", max_messages=10001))),
    ("read too many bytes", lambda c: c.read(b"q", 0, 0, (4 << 20) + 1),
     lambda ch: queue_pb2_grpc.QueuesStub(ch).Read(queue_pb2.ReadRequest(queue=b"q", max_bytes=(4 << 20) + 1))),
    ("delete empty queue", lambda c: c.delete_queue(b""),
     lambda ch: queue_pb2_grpc.QueuesStub(ch).DeleteQueue(queue_pb2.DeleteQueueRequest(queue=b""))),
    ("topic name", lambda c: c.create_topic("a b", 1),
     lambda ch: topic_pb2_grpc.TopicsStub(ch).CreateTopic(topic_pb2.CreateTopicRequest(topic="a b", partitions=1))),
    ("topic name too long", lambda c: c.create_topic("t" * 201, 1),
     lambda ch: topic_pb2_grpc.TopicsStub(ch).CreateTopic(topic_pb2.CreateTopicRequest(topic="t" * 201, partitions=1))),
    ("no partitions", lambda c: c.create_topic("ok", 0),
     lambda ch: topic_pb2_grpc.TopicsStub(ch).CreateTopic(topic_pb2.CreateTopicRequest(topic="ok", partitions=0))),
    ("too many partitions", lambda c: c.create_topic("ok", 1025),
     lambda ch: topic_pb2_grpc.TopicsStub(ch).CreateTopic(topic_pb2.CreateTopicRequest(topic="ok", partitions=1025))),
    ("group too long", lambda c: c.describe_group("g" * 65, "ok"),
     lambda ch: topic_pb2_grpc.TopicsStub(ch).DescribeGroup(topic_pb2.DescribeGroupRequest(group="g" * 65, topic="ok"))),
    ("app name", lambda c: c.set_hot_key_rules("a b", []),
     lambda ch: hotkey_pb2_grpc.HotKeysStub(ch).SetRules(hotkey_pb2.SetRulesRequest(app="a b"))),
    ("empty hot key", lambda c: c.set_hot_key("shop", b"", 10),
     lambda ch: hotkey_pb2_grpc.HotKeysStub(ch).SetHotKey(hotkey_pb2.SetHotKeyRequest(app="shop", key=b"", duration_ms=10))),
    ("long hot key", lambda c: c.set_hot_key("shop", b"k" * 1025, 10),
     lambda ch: hotkey_pb2_grpc.HotKeysStub(ch).SetHotKey(hotkey_pb2.SetHotKeyRequest(app="shop", key=b"k" * 1025, duration_ms=10))),
    ("hot duration", lambda c: c.set_hot_key("shop", b"k", 86_400_001),
     lambda ch: hotkey_pb2_grpc.HotKeysStub(ch).SetHotKey(hotkey_pb2.SetHotKeyRequest(app="shop", key=b"k", duration_ms=86_400_001))),
    ("top keys limit", lambda c: c.top_keys("shop", 1001),
     lambda ch: hotkey_pb2_grpc.HotKeysStub(ch).TopKeys(hotkey_pb2.TopKeysRequest(app="shop", limit=1001))),
    ("subscribe consumer", lambda c: c.subscribe(b"q", "c" * 65, 1),
     lambda ch: first_stream_error(queue_pb2_grpc.QueuesStub(ch).Subscribe(iter([queue_pb2.SubscribeRequest(
         start=queue_pb2.SubscribeStart(queue=b"q", consumer="c" * 65, credit=common_pb2.Credit(messages=1)))])))),
    ("subscribe reserved", lambda c: c.subscribe(b"\0q", "c", 1),
     lambda ch: first_stream_error(queue_pb2_grpc.QueuesStub(ch).Subscribe(iter([queue_pb2.SubscribeRequest(
         start=queue_pb2.SubscribeStart(queue=b"\0q", consumer="c", credit=common_pb2.Credit(messages=1)))])))),
    ("subscribe credit", lambda c: c.subscribe(b"q", "c", 0),
     lambda ch: first_stream_error(queue_pb2_grpc.QueuesStub(ch).Subscribe(iter([queue_pb2.SubscribeRequest(
         start=queue_pb2.SubscribeStart(queue=b"q", consumer="c", credit=common_pb2.Credit(messages=0)))])))),
    ("add a reserved mailbox", lambda c: add_mailboxes(c, [b"q", b"\0q"]),
     lambda ch: first_stream_error(queue_pb2_grpc.QueuesStub(ch).SubscribeMany(iter([
         queue_pb2.SubscribeManyRequest(start=queue_pb2.SubscribeManyStart(
             consumer="c", credit=common_pb2.Credit(messages=1))),
         queue_pb2.SubscribeManyRequest(add=queue_pb2.AddMailboxes(queues=[b"q", b"\0q"]))])))),
    ("member too long", lambda c: levee.MemberStream.open(c, "ok", "g", "m" * 65),
     lambda ch: first_stream_error(topic_pb2_grpc.TopicsStub(ch).Consume(iter([topic_pb2.ConsumeRequest(
         start=topic_pb2.ConsumeStart(topic="ok", group="g", member="m" * 65, credit=common_pb2.Credit(messages=1)))])))),
    ("lease too short", lambda c: levee.MemberStream.open(c, "ok", "g", "m", 1, 999),
     lambda ch: first_stream_error(topic_pb2_grpc.TopicsStub(ch).Consume(iter([topic_pb2.ConsumeRequest(
         start=topic_pb2.ConsumeStart(topic="ok", group="g", member="m", credit=common_pb2.Credit(messages=1), lease_ms=999))])))),
]


@pytest.mark.parametrize("name,through_client,raw", CASES, ids=[case[0] for case in CASES])
def test_given_invalid_input_then_client_refuses_it_as_the_server_does(server, name, through_client, raw) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(server.grpc_addr, options=[
            ("grpc.max_send_message_length", 64 << 20)]) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            raw(channel)
        from_server = from_rpc_error(raised.value)

    async def main() -> levee.LeveeError:
        # A client whose channel cannot reach anything: what it raises comes from itself.
        client = await levee.Client.connect(server.grpc_addr)
        await client.close()
        with pytest.raises(levee.LeveeError) as refused:
            await through_client(client)
        return refused.value

    from_client = run(main())
    assert (from_client.code, from_client.message) == (from_server.code, from_server.message)
    assert type(from_client) is type(from_server) is levee.InvalidArgumentError
