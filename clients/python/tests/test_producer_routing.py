"""Producer in a replicated cluster (docs/CLUSTER.md, "Part 2"), with three real `levee server`
processes: appends go straight to each shard's leader, and an idempotent producer rides out
a kill -9 of a shard leader (the seed node itself) with nothing lost or doubled. Also, with a
fake client: a resend is never overtaken by another request on its queues, so it stays within
the server's window of remembered requests."""

from __future__ import annotations

import asyncio
import time
from typing import Dict, Iterator, List, Tuple

import pytest

import levee
from levee import routing
from levee.v1 import cluster_pb2, queue_pb2

from conftest import run
from cluster_support import NODES, SHARDS, wait_settled
from support import LeveeServer, start_replicated_cluster

# How long a follower may take to hold what its shard's leader acknowledged.
CATCH_UP_TIMEOUT_S = 15.0


@pytest.fixture
def cluster() -> Iterator[List[LeveeServer]]:
    nodes = start_replicated_cluster(len(NODES), SHARDS)
    yield nodes
    for node in nodes:
        node.cleanup()


async def read_whole(client: levee.Client, queue: bytes) -> List[bytes]:
    """Every message of `queue` on the client's node, from offset 0 (offsets dense)."""
    stored: List[bytes] = []
    while True:
        try:
            read = await client.read(queue, len(stored), 10_000)
        except levee.NotFoundError:
            return stored
        if not read.payloads:
            return stored
        assert read.first_offset == len(stored), "offsets are dense"
        stored.extend(read.payloads)


async def check_every_node_holds(
    nodes: List[LeveeServer], acknowledged: Dict[bytes, Dict[int, bytes]]
) -> None:
    """Every node holds every acknowledged message once, at its acknowledged offset, and
    nothing else (the producers' payloads are unique)."""
    for node in nodes:
        async with await levee.Client.connect(node.grpc_addr) as client:
            for queue, expected in acknowledged.items():
                deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
                while len(stored := await read_whole(client, queue)) < len(expected):
                    assert time.monotonic() < deadline, f"{node.grpc_addr} lags on {queue!r}"
                    await asyncio.sleep(0.05)
                assert sorted(expected) == list(range(len(expected))), "acknowledged offsets dense"
                assert stored == [expected[offset] for offset in range(len(expected))], (
                    f"{node.grpc_addr}, queue {queue!r}: stored differs from acknowledged"
                )


def test_given_a_replicated_cluster_then_each_message_goes_straight_to_its_shard_leader(cluster, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    sent: List[Tuple[str, List[bytes]]] = []
    append_request = levee.Client.append_request

    async def recording(self: levee.Client, request: queue_pb2.AppendRequest) -> List[int]:
        sent.append((self.address, [message.queue for message in request.messages]))
        return await append_request(self, request)

    monkeypatch.setattr(levee.Client, "append_request", recording)
    queues = [f"orders-{number}".encode() for number in range(24)]

    async def main() -> None:
        leaders = await wait_settled(cluster)
        address_of = {node_id: node.grpc_addr for node_id, node in zip(NODES, cluster)}
        assert len(set(leaders.values())) > 1, "the shards' leaders spread over the nodes"
        acknowledged: Dict[bytes, Dict[int, bytes]] = {queue: {} for queue in queues}
        async with await levee.Client.connect(cluster[0].grpc_addr) as client:
            producer = levee.Producer(client, levee.ProducerOptions(idempotent=True))
            sends = [(queues[n % len(queues)], b"order-%d" % n) for n in range(960)]
            futures = [await producer.enqueue(queue, payload) for queue, payload in sends]
            for (queue, payload), offset in zip(sends, await asyncio.gather(*futures)):
                assert offset not in acknowledged[queue], "an offset acknowledged twice"
                acknowledged[queue][offset] = payload
            await producer.close()
            stats = producer.stats()
            assert (stats.messages_sent, stats.messages_failed) == (960, 0), stats
            assert stats.messages_to_leaders == 960, stats
            assert producer._routes is not None and producer._routes.members_open() <= 2

            # Every request went to the leader of each of its messages' shards.
            assert {address for address, _ in sent} == {address_of[n] for n in leaders.values()}
            for address, request_queues in sent:
                for queue in request_queues:
                    leader = leaders[routing.shard_of_bytes(queue, SHARDS)]
                    assert address == address_of[leader], f"{queue!r} sent to {address}"

            # With the option off, everything goes through the seed, which forwards.
            sent.clear()
            direct = levee.Producer(client, levee.ProducerOptions(route_to_shard_leaders=False))
            offsets = await asyncio.gather(*[direct.send(queue, b"direct") for queue in queues])
            await direct.close()
            assert {address for address, _ in sent} == {cluster[0].grpc_addr}
            assert direct.stats().messages_to_leaders == 0
            for queue, offset in zip(queues, offsets):
                assert offset == len(acknowledged[queue])
                acknowledged[queue][offset] = b"direct"
        await check_every_node_holds(cluster, acknowledged)

    run(main())


def test_given_the_seed_node_leading_a_shard_is_killed_under_appends_then_nothing_acknowledged_is_lost_or_doubled(cluster) -> None:  # type: ignore[no-untyped-def]
    """Node 1, the producer's seed and a shard's leader, is killed (SIGKILL) while an
    idempotent producer appends to queues of every shard: its routes come from the other
    members from then on, its resends reach the shard's new leader, and every message is
    acknowledged; the two survivors hold each exactly once at its acknowledged offset."""
    queues = [f"events-{number}".encode() for number in range(16)]
    killed_after_s, appending_s, messages_max = 1.0, 4.0, 20_000

    async def main() -> None:
        leaders = await wait_settled(cluster)
        victim = 1
        assert victim in leaders.values(), "the seed node leads a shard"
        assert {routing.shard_of_bytes(q, SHARDS) for q in queues} == set(range(SHARDS))
        options = levee.ClientOptions(request_timeout_s=5.0)
        client = await levee.Client.connect(cluster[0].grpc_addr, options)
        # The default resends (10, from 10 ms doubling up to 100 ms: about 0.75 s) ride out
        # the failover.
        producer = levee.Producer(client, levee.ProducerOptions(idempotent=True))
        loop = asyncio.get_running_loop()
        started = loop.time()
        killed_at = None
        sends: List[Tuple[bytes, bytes, "asyncio.Future[int]", float]] = []
        while loop.time() - started < appending_s and len(sends) < messages_max:
            if killed_at is None and loop.time() - started >= killed_after_s:
                cluster[0].stop(kill=True)
                killed_at = loop.time()
            for _ in range(8):
                queue, payload = queues[len(sends) % len(queues)], b"event-%d" % len(sends)
                sends.append((queue, payload, await producer.enqueue(queue, payload), loop.time()))
            await asyncio.sleep(0.005)
        assert killed_at is not None
        outcomes = await asyncio.gather(*[send[2] for send in sends], return_exceptions=True)
        await producer.close()
        await client.close()
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        assert not failures, f"{len(failures)} of {len(sends)} sends failed: {failures[:3]}"
        after_kill = sum(1 for send in sends if send[3] > killed_at + 1.0)
        assert after_kill > 100, f"appends go on after the election ({after_kill} sent after)"
        assert producer.stats().retries > 0, "the kill made sends fail and be resent"
        acknowledged: Dict[bytes, Dict[int, bytes]] = {queue: {} for queue in queues}
        for (queue, payload, _, _), offset in zip(sends, outcomes):
            assert isinstance(offset, int)
            assert offset not in acknowledged[queue], "an offset acknowledged twice"
            acknowledged[queue][offset] = payload
        await check_every_node_holds(cluster[1:], acknowledged)

    run(main())


class _FlakyClient:
    """Stands in for a `Client`: no Cluster service, and the first request that carries
    queue `a` fails with UNAVAILABLE after reaching the "disk"."""

    def __init__(self) -> None:
        self.options = levee.ClientOptions()
        self.producer_name = ""
        self.address = "fake:1"
        self.requests: List[queue_pb2.AppendRequest] = []
        self.failed = False

    async def cluster(self, timeout_s: float) -> cluster_pb2.GetClusterResponse:
        raise levee.errors.make_error(levee.ErrorCode.UNIMPLEMENTED, "no Cluster service")

    async def append_request(self, request: queue_pb2.AppendRequest) -> List[int]:
        self.requests.append(request)
        await asyncio.sleep(0.002)
        if not self.failed and any(message.queue == b"a" for message in request.messages):
            self.failed = True
            raise levee.errors.make_error(levee.ErrorCode.UNAVAILABLE, "connection reset")
        return [message.sequence for message in request.messages]


def test_given_a_failed_batch_then_no_other_request_touches_its_queues_before_its_resend() -> None:
    async def main() -> None:
        client = _FlakyClient()
        producer = levee.Producer(client, levee.ProducerOptions(  # type: ignore[arg-type]
            idempotent=True, batch_messages_max=4, retry_backoff_s=0.02))
        futures = [await producer.enqueue(b"ab"[n % 2:n % 2 + 1], b"%d" % n) for n in range(200)]
        offsets = await asyncio.gather(*futures)
        await producer.close()
        assert offsets[0::2] == list(range(100)) and offsets[1::2] == list(range(100))
        touching_a = [request for request in client.requests
                      if any(message.queue == b"a" for message in request.messages)]
        first, resend = touching_a[0], touching_a[1]
        assert resend == first, "the next request on queue a is the failed one, resent whole"
        assert producer.stats().retries == 1
        sequences = [m.sequence for r in touching_a[1:] for m in r.messages if m.queue == b"a"]
        assert sequences == list(range(100)), "queue a's messages once each, in order"

    run(main())
