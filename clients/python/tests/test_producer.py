"""Producer: batches many callers into few requests, never stores twice when idempotent, and
never loses a failed batch silently."""

from __future__ import annotations

import asyncio

import pytest

import levee

from conftest import run


def test_given_concurrent_sends_then_few_batches_carry_them_in_order_of_offsets(server, unique) -> None:  # type: ignore[no-untyped-def]
    queue = unique("batched").encode()

    async def main() -> None:
        async with await levee.Client.connect(server.grpc_addr) as client:
            producer = levee.Producer(client, levee.ProducerOptions(batch_messages_max=200))
            offsets = await asyncio.gather(*[producer.send(queue, b"m%d" % n) for n in range(1000)])
            await producer.close()
            assert sorted(offsets) == list(range(1000))
            stats = producer.stats()
            assert stats.messages_sent == 1000 and stats.batches_failed == 0
            assert 5 <= stats.batches_sent <= 100, stats
            read = await client.read(queue, 0, 10_000)
            by_offset = {offset: b"m%d" % n for n, offset in enumerate(offsets)}
            assert list(read.payloads) == [by_offset[offset] for offset in range(1000)]

    run(main())


def test_given_idempotent_producer_with_batches_in_flight_then_nothing_is_stored_twice(server, unique) -> None:  # type: ignore[no-untyped-def]
    queues = [unique(f"idempotent-{n}").encode() for n in range(3)]

    async def main() -> None:
        async with await levee.Client.connect(server.grpc_addr) as client:
            producer = levee.Producer(client, levee.ProducerOptions(
                idempotent=True, batch_messages_max=50, requests_in_flight_max=8))
            futures = [await producer.enqueue(queues[n % 3], b"%d" % n) for n in range(3000)]
            offsets = await asyncio.gather(*futures)
            await producer.close()
            assert producer.producer_id.startswith("producer-")
            for index, queue in enumerate(queues):
                mine = sorted(offsets[index::3])
                assert mine == list(range(1000))
                assert (await client.queue_info(queue)).next_offset == 1000, "stored once each"
            assert producer.stats().messages_failed == 0

    run(main())


def test_given_invalid_message_then_send_raises_at_once_and_others_are_unaffected(server, unique) -> None:  # type: ignore[no-untyped-def]
    queue = unique("valid")

    async def main() -> None:
        async with await levee.Client.connect(server.grpc_addr) as client:
            async with levee.Producer(client) as producer:
                with pytest.raises(levee.InvalidArgumentError, match="over message_bytes_max"):
                    await producer.send(queue, b"x" * ((1 << 20) + 1))
                with pytest.raises(levee.InvalidArgumentError, match="reserved"):
                    await producer.send(b"\0x", b"")
                assert await producer.send(queue, b"fine") == 0

    run(main())


def test_given_server_gone_then_every_caller_gets_the_error_and_it_is_counted(fresh_server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        client = await levee.Client.connect(fresh_server.grpc_addr, levee.ClientOptions(request_timeout_s=2))
        producer = levee.Producer(client, levee.ProducerOptions(idempotent=True, retries_max=2))
        assert await producer.send("q", b"before") == 0
        fresh_server.stop()
        outcomes = await asyncio.gather(*[producer.send("q", b"after") for _ in range(20)],
                                        return_exceptions=True)
        assert all(isinstance(outcome, levee.UnavailableError) for outcome in outcomes), outcomes
        stats = producer.stats()
        assert stats.messages_failed == 20 and stats.batches_failed >= 1 and stats.retries >= 2
        await producer.close()
        await client.close()

    run(main())


def test_given_an_idempotent_batch_refused_for_good_then_later_batches_of_its_queue_take_a_fresh_id_and_are_stored_in_order(server, unique) -> None:  # type: ignore[no-untyped-def]
    """The refused batch took sequence 1 but was never stored: under the same id every later
    batch of the queue would meet SEQUENCE_GAP (the server waits for sequence 1), so the
    batches numbered after the failure take a fresh id, their sequences restarting at 0."""
    queue = unique("refused").encode()

    async def main() -> None:
        # The client lets through a payload the server refuses (its limit is 1 MiB).
        options = levee.ClientOptions(message_bytes_max=2 << 20)
        async with await levee.Client.connect(server.grpc_addr, options) as client:
            producer = levee.Producer(client, levee.ProducerOptions(idempotent=True, retries_max=2))
            assert await producer.send(queue, b"first") == 0
            first_id = producer.producer_id
            with pytest.raises(levee.InvalidArgumentError):
                await producer.send(queue, b"x" * ((1 << 20) + 1))
            assert producer.producer_id != first_id, "a fresh id after the batch failed for good"
            assert await producer.send(queue, b"second") == 1
            futures = [await producer.enqueue(queue, b"m%d" % n) for n in range(200)]
            assert await asyncio.gather(*futures) == list(range(2, 202))
            await producer.close()
            stats = producer.stats()
            assert stats.messages_failed == 1 and stats.batches_failed == 1, stats
            read = await client.read(queue, 0, 1000)
            assert list(read.payloads) == [b"first", b"second"] + [b"m%d" % n for n in range(200)]

    run(main())


def test_given_an_idempotent_batch_whose_resends_ran_out_then_later_batches_are_stored_once_the_server_is_back(fresh_server) -> None:  # type: ignore[no-untyped-def]
    """A batch that failed for good while the server was down took its sequences; once the
    server is back, later sends go on under a fresh id instead of meeting SEQUENCE_GAP."""

    async def main() -> None:
        client = await levee.Client.connect(fresh_server.grpc_addr, levee.ClientOptions(request_timeout_s=2))
        producer = levee.Producer(client, levee.ProducerOptions(idempotent=True, retries_max=2))
        assert await producer.send("q", b"before") == 0
        first_id = producer.producer_id
        fresh_server.stop()
        with pytest.raises(levee.UnavailableError):
            await producer.send("q", b"lost")
        assert producer.producer_id != first_id
        fresh_server.start(fresh_server.grpc_addr)
        # Until the connection is back a send may fail UNAVAILABLE again (each failure a fresh
        # id); SEQUENCE_GAP would fail the test.
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            try:
                offset = await producer.send("q", b"after")
                break
            except levee.UnavailableError:
                assert asyncio.get_running_loop().time() < deadline, "the server did not come back"
                await asyncio.sleep(0.1)
        assert offset == 1
        assert await producer.send("q", b"last") == 2
        await producer.close()
        read = await client.read("q", 0, 10)
        assert list(read.payloads) == [b"before", b"after", b"last"]
        await client.close()

    run(main())


def test_given_bad_options_then_producer_refuses_them(server) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with await levee.Client.connect(server.grpc_addr) as client:
            with pytest.raises(levee.InvalidArgumentError, match="batch_messages_max"):
                levee.Producer(client, levee.ProducerOptions(batch_messages_max=10_001))
            with pytest.raises(levee.InvalidArgumentError, match="retry_backoff_max_s"):
                levee.Producer(client, levee.ProducerOptions(
                    retry_backoff_s=0.2, retry_backoff_max_s=0.1))

    run(main())


class DownClient:
    """A client whose every append fails with UNAVAILABLE (a node going away), noting when."""

    def __init__(self) -> None:
        self.options = levee.ClientOptions()
        self.producer_name = ""
        self.sent_at: list = []

    async def cluster(self, timeout_s: float) -> None:
        raise levee.errors.make_error(levee.ErrorCode.UNIMPLEMENTED, "no Cluster service")

    async def append_request(self, request) -> list:  # type: ignore[no-untyped-def]
        self.sent_at.append(asyncio.get_running_loop().time())
        raise levee.errors.make_error(levee.ErrorCode.UNAVAILABLE, "connection refused")


def test_given_defaults_then_an_idempotent_batch_is_resent_ten_times_over_about_three_quarters_of_a_second() -> None:
    """As the Rust producer: 10 resends, 10 ms apart doubling up to 100 ms (10, 20, 40, 80,
    then 100 six times: 0.75 s), long enough to ride out a shard leader's failover."""
    async def main() -> None:
        client = DownClient()
        producer = levee.Producer(client, levee.ProducerOptions(idempotent=True))  # type: ignore[arg-type]
        with pytest.raises(levee.UnavailableError):
            await producer.send(b"q", b"x")
        await producer.close()
        assert producer.stats().retries == 10 and len(client.sent_at) == 11
        pauses = [later - earlier for earlier, later in zip(client.sent_at, client.sent_at[1:])]
        assert all(pause >= 0.009 for pause in pauses), pauses
        assert pauses[-1] < 0.3, f"the pauses stop doubling at 100 ms: {pauses}"
        assert 0.74 <= client.sent_at[-1] - client.sent_at[0] < 2.0, pauses

    run(main())


class BlockedClient:
    """A client whose appends wait until released: what the producer holds meanwhile shows."""

    def __init__(self) -> None:
        self.options = levee.ClientOptions()
        self.producer_name = ""
        self.release = asyncio.Event()
        self.requests: list = []

    async def append_request(self, request) -> list:  # type: ignore[no-untyped-def]
        self.requests.append(request)
        await self.release.wait()
        return list(range(len(request.messages)))


def test_given_full_queue_then_senders_wait_for_room() -> None:
    async def main() -> None:
        client = BlockedClient()
        producer = levee.Producer(client, levee.ProducerOptions(  # type: ignore[arg-type]
            queued_messages_max=3, requests_in_flight_max=1, batch_messages_max=2))
        futures = [await producer.enqueue(b"q", b"%d" % n) for n in range(3)]
        fourth = asyncio.ensure_future(producer.enqueue(b"q", b"3"))
        await asyncio.sleep(0.05)
        assert not fourth.done(), "a fourth message waits while three are held"
        assert [len(r.messages) for r in client.requests] == [2], \
            "one request in flight (a full batch of two); the third message waits for the slot"
        client.release.set()
        futures.append(await asyncio.wait_for(fourth, 5))
        offsets = await asyncio.gather(*futures)
        await producer.close()
        assert sum(len(r.messages) for r in client.requests) == 4
        assert offsets[:2] == [0, 1], "the blocked client answers 0.. per request"

    run(main())
