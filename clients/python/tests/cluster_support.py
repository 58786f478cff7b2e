"""Helpers for tests against a replicated cluster of real processes (`support.start_replicated_cluster`):
wait until its shards are placed and led as the cluster prefers."""

from __future__ import annotations

import asyncio
import time
from typing import Dict, List

import levee
from levee import routing
from levee.v1 import cluster_pb2

from support import LeveeServer

SHARDS = 4
NODES = [1, 2, 3]
SETTLE_TIMEOUT_S = 30.0
"""How long the cluster may take to place its shards, or to elect a shard's new leader."""


async def wait_settled(nodes: List[LeveeServer]) -> Dict[int, int]:
    """Waits until every node sees every shard on all three nodes, no change under way, and
    led by its preferred replica (which claims the lead soon after the cluster forms); returns
    each shard's leader."""
    clients = [await levee.Client.connect(node.grpc_addr) for node in nodes]
    try:
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            views = [await client.cluster(1.0) for client in clients]
            leaders = {shard: routing.shard_replicas(shard, NODES)[0] for shard in range(SHARDS)}
            if all(settled(view, leaders) for view in views):
                return leaders
            assert time.monotonic() < deadline, f"the shards did not settle: {views[0]}"
            await asyncio.sleep(0.1)
    finally:
        for client in clients:
            await client.close()


def settled(view: cluster_pb2.GetClusterResponse, leaders: Dict[int, int]) -> bool:
    return (
        view.replicated_queues
        and view.shards == SHARDS
        and len(view.shard_map) == SHARDS
        and all(
            sorted(placement.voters) == NODES
            and not placement.changing
            and placement.leader_id == leaders[placement.shard]
            for placement in view.shard_map
        )
    )
