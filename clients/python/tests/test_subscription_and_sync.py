"""Mailboxes with `async for`, and the synchronous facade for scripts."""

from __future__ import annotations

import threading

import pytest

import levee
import levee.sync

from conftest import run


def test_given_async_for_then_messages_arrive_in_order_and_acks_are_durable(server, unique) -> None:  # type: ignore[no-untyped-def]
    queue = unique("mailbox")

    async def main() -> None:
        async with await levee.Client.connect(server.grpc_addr) as client:
            await client.append_messages([(queue, b"%d" % n) for n in range(5)])
            received = []
            async with await client.subscribe(queue, "reader", credit_messages=2) as mailbox:
                async for delivery in mailbox:
                    received.append(delivery.payload)
                    await mailbox.ack(delivery.offset)
                    if len(received) == 5:
                        break
            assert received == [b"0", b"1", b"2", b"3", b"4"]
            again = await client.subscribe(queue, "reader")
            assert again.start_offset == 5, "acked messages are never delivered again"
            await again.close()

    run(main())


def test_given_sync_client_then_calls_block_and_return_plain_values(server, unique) -> None:  # type: ignore[no-untyped-def]
    queue, topic, group = unique("sync-q"), unique("sync-t"), unique("sync-g")
    with levee.sync.Client.connect(server.grpc_addr) as client:
        assert client.server_info().grpc_addr == server.grpc_addr
        assert client.append(queue, b"a") == 0
        assert list(client.read(queue).payloads) == [b"a"]
        with pytest.raises(levee.NotFoundError):
            client.read(unique("absent"))
        with client.producer() as producer:
            assert producer.send(queue, b"b") == 1
            futures = [producer.send_async(queue, b"c%d" % n) for n in range(10)]
            assert sorted(future.result() for future in futures) == list(range(2, 12))
        with client.subscribe(queue, "scripts") as mailbox:
            first = mailbox.next(timeout_s=5)
            assert first is not None and first.payload == b"a"
            mailbox.ack(first.offset)
        with client.subscribe_many("scripts") as mailboxes:  # positions shared with subscribe
            assert mailboxes.add([queue]) == range(0, 1)
            delivery = mailboxes.next(timeout_s=5)
            assert delivery is not None and (delivery.mailbox, delivery.offset) == (0, 1)
            mailboxes.ack(0, delivery.offset)
            mailboxes.flush_acks()
        with client.subscribe_following(queue, "scripts") as mailbox:  # a lone server: one member
            assert mailbox.start_offset == 2
            following = mailbox.next(timeout_s=5)
            assert following is not None and following.offset == 2
            mailbox.ack(following.offset)
        with client.subscribe_many_following("scripts") as mailboxes:
            assert mailboxes.add([queue]) == range(0, 1)
            delivery = mailboxes.next(timeout_s=5)
            assert delivery is not None and (delivery.mailbox, delivery.offset) == (0, 3)
        client.create_topic(topic, 2)
        client.publish(topic, [(b"k%d" % n, b"v") for n in range(10)])
        handled = []
        stop = threading.Event()

        def handle(message: levee.Message) -> None:
            handled.append(message.offset)
            if len(handled) == 10:
                stop.set()

        consumer = client.group_consumer(topic, group, levee.ConsumerOptions(parallelism=2))
        stats = consumer.run(handle, stop)
        assert stats.handled == 10
