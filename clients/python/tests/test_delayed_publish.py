"""Delayed publishing: a delayed message is stored at once (offset answered 0, with the time it
is due) but reaches its partition only when due; refused client-side with a negative delay or
a producer id."""

from __future__ import annotations

import asyncio
import time

import pytest

import levee
import levee.sync

from conftest import run

DELAY_S = 1.5
# deliver_at_ms is now + delay by the server's clock, the same machine's as this test's.
CLOCK_SLACK_MS = 50


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def next_offset(client: levee.Client, topic: str) -> int:
    return (await client.describe_topic(topic)).partitions[0].next_offset


def test_given_a_delayed_message_then_it_reaches_its_partition_only_when_due(server, unique) -> None:  # type: ignore[no-untyped-def]
    topic, group = unique("delayed"), unique("group")

    async def main() -> None:
        async with await levee.Client.connect(server.grpc_addr) as client:
            await client.create_topic(topic, 1)
            before = now_ms()
            published = await client.publish(topic, [
                levee.Record(b"later", b"a", delay_ms=int(DELAY_S * 1000)),
                (b"b", b"now-1"),
                levee.Record(b"now-2", b"c"),
            ])
            after = now_ms()
            assert [(p.partition, p.offset) for p in published] == [(0, 0), (0, 0), (0, 1)]
            assert published[1].deliver_at_ms == published[2].deliver_at_ms == 0
            due = published[0].deliver_at_ms
            delay_ms = int(DELAY_S * 1000)
            assert before + delay_ms - CLOCK_SLACK_MS <= due <= after + delay_ms + CLOCK_SLACK_MS
            assert await next_offset(client, topic) == 2, "the delayed message is not in yet"

            while await next_offset(client, topic) == 2:
                assert now_ms() < due + 10_000, "the delayed message never arrived"
                await asyncio.sleep(0.02)
            assert now_ms() >= due - CLOCK_SLACK_MS, "delivered before it was due"
            assert await next_offset(client, topic) == 3

            consumer = levee.GroupConsumer(client, topic, group)
            payloads = []
            async for message in consumer:
                payloads.append((message.offset, message.payload))
                consumer.done(message)
                if len(payloads) == 3:
                    break
            await consumer.close()
            assert payloads == [(0, b"now-1"), (1, b"now-2"), (2, b"later")]

    run(main())


def test_given_publish_delayed_then_every_message_waits_and_the_sync_client_has_it(server, unique) -> None:  # type: ignore[no-untyped-def]
    topic = unique("delayed-sync")
    with levee.sync.Client.connect(server.grpc_addr) as client:
        client.create_topic(topic, 4)
        before = now_ms()
        published = client.publish_delayed(topic, [(b"k1", b"x"), (b"k2", b"y")], 60)
        after = now_ms()
        assert [p.partition for p in published] == [
            levee.topic_partition(b"k1", 4), levee.topic_partition(b"k2", 4)]
        assert [p.offset for p in published] == [0, 0]
        for p in published:
            assert before + 60_000 - CLOCK_SLACK_MS <= p.deliver_at_ms <= after + 60_000 + CLOCK_SLACK_MS
        assert [p.next_offset for p in client.describe_topic(topic).partitions] == [0, 0, 0, 0]
        # No delay: stored at once, as a plain publish.
        stored = client.publish_delayed(topic, [(b"k1", b"z")], 0)
        assert stored == [levee.Published(levee.topic_partition(b"k1", 4), 0, 0)]


@pytest.mark.parametrize("delay_s", [-1, -0.001, float("nan"), float("inf"), 604_800.001])
def test_given_a_delay_out_of_range_then_publish_delayed_refuses_it(server, delay_s) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        # Closed: what it raises comes from the client itself.
        client = await levee.Client.connect(server.grpc_addr)
        await client.close()
        with pytest.raises(levee.InvalidArgumentError, match="delay_s is a delay from now in seconds"):
            await client.publish_delayed("t", [(b"k", b"v")], delay_s)

    run(main())


def test_given_a_negative_delay_ms_then_publish_refuses_it(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        client = await levee.Client.connect(server.grpc_addr)
        await client.close()
        with pytest.raises(levee.InvalidArgumentError, match="delay_ms .* got -5"):
            await client.publish("t", [levee.Record(b"v", delay_ms=-5)])

    run(main())
