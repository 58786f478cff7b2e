"""ShardRoutes with a fake seed: what a GetCluster answer routes where, a cluster that does not
replicate its queues asked once, members' clients opened once and closed when they leave."""

from __future__ import annotations

from typing import List

import pytest

import levee
from levee import routing
from levee.shard_routes import NO_NODE, ShardRoutes
from levee.v1 import cluster_pb2

from conftest import run

SEED_ADDRESS = "127.0.0.1:7070"


class _Seed:
    """Stands in for the seed `Client`: answers GetCluster with the views given, in turn."""

    def __init__(self, views: List[cluster_pb2.GetClusterResponse]) -> None:
        self.options = levee.ClientOptions()
        self.producer_name = ""
        self.address = SEED_ADDRESS
        self.views = views
        self.calls = 0

    async def cluster(self, timeout_s: float) -> cluster_pb2.GetClusterResponse:
        self.calls += 1
        return self.views[min(self.calls, len(self.views)) - 1]


def view(leaders: List[int], members: List[int], replicated: bool = True) -> cluster_pb2.GetClusterResponse:
    # Node 1 is the seed; the others listen on ports nothing answers at.
    addresses = {1: SEED_ADDRESS, 2: "127.0.0.1:9", 3: "127.0.0.1:11"}
    return cluster_pb2.GetClusterResponse(
        shards=len(leaders),
        replicated_queues=replicated,
        members=[cluster_pb2.Member(node_id=n, grpc_addr=addresses[n]) for n in members],
        shard_map=[cluster_pb2.ShardPlacement(shard=s, leader_id=l) for s, l in enumerate(leaders)],
    )


def queue_of_shard(shard: int, shards: int) -> bytes:
    return next(q for n in range(1000)
                if routing.shard_of_bytes(q := b"q-%d" % n, shards) == shard)


def test_given_a_replicated_view_then_queues_go_to_their_shard_leader_and_unknown_ones_to_the_seed() -> None:
    async def main() -> None:
        seed = _Seed([view([1, 2, 0, 3], [1, 2, 3]), view([1, 2, 0, 1], [1, 2])])
        routes = ShardRoutes(seed)  # type: ignore[arg-type]
        await routes.refresh_if_due()
        assert routes.routing and routes.shards == 4
        assert routes.route(queue_of_shard(0, 4)) == (1, seed), "the seed's own address: its client"
        leader, second = routes.route(queue_of_shard(1, 4))
        assert leader == 2 and second.address == "127.0.0.1:9"
        assert routes.route(queue_of_shard(1, 4))[1] is second, "one client per member"
        assert routes.route(queue_of_shard(2, 4)) == (NO_NODE, seed), "no leader: the seed"
        third = routes.route(queue_of_shard(3, 4))[1]
        assert routes.members_open() == 2
        await routes.refresh()
        assert seed.calls == 2
        assert routes.route(queue_of_shard(3, 4)) == (1, seed)
        assert routes.members_open() == 1, "node 3 left: its client is closed"
        await routes.close()
        assert routes.members_open() == 0
        for client in (second, third):
            with pytest.raises(levee.UnavailableError, match="the client is closed"):
                await client.echo()

    run(main())


def test_given_a_cluster_that_does_not_replicate_its_queues_then_it_is_asked_once() -> None:
    async def main() -> None:
        seed = _Seed([view([1] * 16, [1], replicated=False)])
        routes = ShardRoutes(seed)  # type: ignore[arg-type]
        for _ in range(3):
            await routes.refresh_if_due()
            await routes.refresh_after_failure()
        assert seed.calls == 1 and not routes.routing
        assert routes.route(b"anything") == (NO_NODE, seed)
        await routes.close()

    run(main())
