"""GroupConsumer: commits strictly in order whatever order handlers finish in, and never runs
more handlers than its parallelism."""

from __future__ import annotations

import asyncio

import levee

from conftest import eventually, run


async def committed(client: levee.Client, group: str, topic: str) -> list:
    return [p.committed_offset for p in (await client.describe_group(group, topic)).partitions]


def test_given_messages_finished_out_of_order_then_commit_waits_for_the_earliest(server, unique) -> None:  # type: ignore[no-untyped-def]
    topic, group = unique("ordered"), unique("group")

    async def main() -> None:
        async with await levee.Client.connect(server.grpc_addr) as client:
            await client.create_topic(topic, 1)
            await client.publish(topic, [(b"k", b"%d" % n) for n in range(3)])
            consumer = levee.GroupConsumer(client, topic, group, levee.ConsumerOptions(commit_interval_s=0.01))
            messages = []
            async for message in consumer:
                messages.append(message)
                if len(messages) == 3:
                    break
            assert [m.offset for m in messages] == [0, 1, 2]
            consumer.done(messages[2])
            consumer.done(messages[1])
            await asyncio.sleep(0.2)
            assert await committed(client, group, topic) == [0], "offset 0 is not finished"
            consumer.done(messages[0])
            await eventually(lambda: consumer.stats().commits >= 1)
            stats = await consumer.close()
            assert stats.handled == 3 and stats.fenced_commits == 0
            assert await committed(client, group, topic) == [3]

    run(main())


def test_given_unordered_consumer_then_parallelism_is_used_and_bounded(server, unique) -> None:  # type: ignore[no-untyped-def]
    topic, group = unique("parallel"), unique("group")

    async def main() -> None:
        async with await levee.Client.connect(server.grpc_addr) as client:
            await client.create_topic(topic, 1)
            await client.publish(topic, [(b"k", b"%d" % n) for n in range(30)])
            running, most, handled = 0, 0, []
            stop = asyncio.Event()

            async def handle(message: levee.Message) -> None:
                nonlocal running, most
                running += 1
                most = max(most, running)
                await asyncio.sleep(0.02 if message.offset % 3 == 0 else 0.005)
                running -= 1
                handled.append(message.offset)
                if len(handled) == 30:
                    stop.set()

            consumer = levee.GroupConsumer(client, topic, group, levee.ConsumerOptions(
                parallelism=3, ordered=False, commit_interval_s=0.01))
            stats = await asyncio.wait_for(consumer.run(handle, stop), 20)
            assert most == 3, f"at most 3 at once, and 3 were used: {most}"
            assert handled != sorted(handled), "handlers finished out of order"
            assert stats.handled == 30
            assert await committed(client, group, topic) == [30]

    run(main())


def test_given_unknown_topic_then_run_raises_not_found(server, unique) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with await levee.Client.connect(server.grpc_addr) as client:
            consumer = levee.GroupConsumer(client, unique("missing"), "g")

            async def handle(message: levee.Message) -> None:
                pass

            try:
                await asyncio.wait_for(consumer.run(handle), 10)
            except levee.NotFoundError as error:
                assert error.code == levee.ErrorCode.NOT_FOUND
            else:
                raise AssertionError("an unknown topic must end run()")

    run(main())


def test_given_server_restart_then_consumer_rejoins_and_finishes_from_the_last_commit(fresh_server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        client = await levee.Client.connect(fresh_server.grpc_addr)
        await client.create_topic("restarts", 2)
        await client.publish("restarts", [(b"k%d" % n, b"%d" % n) for n in range(40)])
        seen: set = set()
        stop = asyncio.Event()
        restarted = asyncio.Event()

        async def handle(message: levee.Message) -> None:
            seen.add((message.partition, message.offset))
            if len(seen) == 40:
                stop.set()
            await asyncio.sleep(0.005)

        consumer = levee.GroupConsumer(client, "restarts", "g", levee.ConsumerOptions(
            parallelism=2, commit_interval_s=0.01, backoff_initial_s=0.05, backoff_max_s=0.2,
            credit_messages=4))

        async def restart_midway() -> None:
            await eventually(lambda: len(seen) >= 10)
            await asyncio.get_running_loop().run_in_executor(None, fresh_server.restart)
            restarted.set()

        restarter = asyncio.ensure_future(restart_midway())
        stats = await asyncio.wait_for(consumer.run(handle, stop), 30)
        await restarter
        assert restarted.is_set() and len(seen) == 40
        assert stats.streams >= 2, stats
        assert stats.handled >= 40, "at least once: some may be handled twice after the restart"
        assert await committed(client, "g", "restarts") == [
            p.next_offset for p in (await client.describe_topic("restarts")).partitions]
        await client.close()

    run(main())
