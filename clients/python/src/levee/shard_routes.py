"""`ShardRoutes`: where a replicated cluster's plain-queue appends go (docs/CLUSTER.md, "Part 2"),
as the Rust client's `ShardRoutes` (crates/levee-client/src/routing.rs).

Any node takes any append and forwards each shard's part to the shard's leader; a client that
knows the shard map sends each part straight to its leader and saves the hop. The routes come
from `Cluster.GetCluster`: the cluster's shards, whether it replicates its queues, each shard's
leader and every member's API address. They are asked of the seed node (the `Client` the
producer was given) and, when it does not answer, of every other member known, until one
answers. It owns:

- the routing view: the shard count, the leader's node id per shard and each member's address,
  replaced whole by each answer (`refresh`); `refresh_if_due` asks again once the view is
  older than `REFRESH_INTERVAL_S` (in the background: the caller goes on with the view it
  has), `refresh_after_failure` at once after a failed send (at most every
  `REFRESH_AFTER_FAILURE_MIN_S`); one refresh runs at a time, and callers asking meanwhile
  wait for it;
- one `Client` per member, opened on first use (a member whose messages are routed to it, or
  asked when the seed is down) without waiting for a connection; so at most one per member.
  The seed's own address reuses the seed client. A member that leaves, or whose address
  changes, has its client closed once its calls in progress end. `close` closes them all
  (never the seed client, which its owner closes).

A cluster that does not replicate its queues (or a server without the Cluster service) is
asked once: routing stays off for good and everything goes to the seed, as without routes.
A route not known yet (no answer so far, or a shard without a known leader) goes to the seed,
or to the member that answered the last refresh when the seed did not.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Dict, List, Optional, Set, Tuple

from .client import Client, ClientOptions
from .errors import ErrorCode, LeveeError
from .routing import shard_of_bytes
from .v1 import cluster_pb2

log = logging.getLogger("levee.shard_routes")

REFRESH_INTERVAL_S = 1.0
"""How often the routes are asked for again while they are used."""
REFRESH_AFTER_FAILURE_MIN_S = 0.05
"""Least time between the end of a refresh and a refresh asked for by a failed send."""
REFRESH_CALL_TIMEOUT_S = 1.0
"""Deadline of each `GetCluster` call: a member that does not answer is given up on soon."""
CLOSE_GRACE_S = 30.0
"""Time the calls in progress on a departed member's client get before it is closed."""

NO_NODE = 0
"""The node id of a message sent to the seed (or the fallback member), not to a known leader."""


class ShardRoutes:
    """A replicated cluster's shard leaders, as a client learns them through `seed`. Use inside
    one event loop; nothing is known until the first `refresh`."""

    def __init__(self, seed: Client) -> None:
        self._seed = seed
        self._member_options = ClientOptions(
            connect_timeout_s=REFRESH_CALL_TIMEOUT_S,
            request_timeout_s=seed.options.request_timeout_s,
            message_bytes_max=seed.options.message_bytes_max,
            hot_key_bytes_max=seed.options.hot_key_bytes_max,
        )
        # The view: 0 shards while routes are not known or queues are not replicated.
        self._shards = 0
        self._leaders: List[int] = []
        self._addresses: Dict[int, str] = {}
        # The member that answered the last refresh, when the seed did not (NO_NODE: the seed).
        self._fallback = NO_NODE
        # Clients of members, by node id, opened on first use; at most one per member.
        self._clients: Dict[int, Client] = {}
        # Clients of departed members being closed (each ends within CLOSE_GRACE_S).
        self._closing: "Set[asyncio.Task[None]]" = set()
        self._refreshing: "Optional[asyncio.Task[None]]" = None
        self._refreshed_at: Optional[float] = None
        # Set once the cluster says it does not replicate its queues: nothing more to learn.
        self._off = False
        self._closed = False

    @property
    def routing(self) -> bool:
        """Whether messages are routed by shard: the cluster replicates its queues and its
        shard map is known. When not, every message goes to one node."""
        return self._shards != 0

    @property
    def shards(self) -> int:
        """The cluster's shards as known (0: not known, or queues not replicated)."""
        return self._shards

    def leader_of(self, queue: bytes) -> int:
        """The node id of `queue`'s shard leader as known; `NO_NODE` when none is."""
        if self._shards == 0:
            return NO_NODE
        leader = self._leaders[shard_of_bytes(queue, self._shards)]
        return leader if leader in self._addresses else NO_NODE

    def route(self, queue: bytes) -> Tuple[int, Client]:
        """Where `queue`'s appends go: its shard leader's node id and client when known, else
        (`NO_NODE`) the seed, or the member that answered the last refresh when it did not."""
        leader = self.leader_of(queue)
        if leader == NO_NODE:
            return NO_NODE, self._fallback_client()
        return leader, self._member(leader)

    def members_open(self) -> int:
        """How many members' clients are open (the seed's not counted)."""
        return sum(1 for client in self._clients.values() if client is not self._seed)

    async def refresh_if_due(self) -> None:
        """Waits for the first refresh; afterwards starts one in the background once the view
        is older than `REFRESH_INTERVAL_S`, and returns at once."""
        if self._off or self._closed:
            return
        if self._refreshed_at is None:
            await self.refresh()
            return
        age = asyncio.get_running_loop().time() - self._refreshed_at
        if age >= REFRESH_INTERVAL_S and self._refreshing is None:
            self._start_refresh()

    async def refresh_after_failure(self) -> None:
        """Refreshes after a failed send, unless a refresh ended a moment ago."""
        if self._off or self._closed:
            return
        if self._refreshed_at is not None and self._refreshing is None:
            age = asyncio.get_running_loop().time() - self._refreshed_at
            if age < REFRESH_AFTER_FAILURE_MIN_S:
                return
        await self.refresh()

    async def refresh(self) -> None:
        """Asks for the shard map and leaders again (joining a refresh under way). Failures
        are logged, never raised: the view stays as it was."""
        if self._off or self._closed:
            return
        task = self._refreshing if self._refreshing is not None else self._start_refresh()
        # Waiting does not cancel the refresh if this caller is cancelled, nor raise its end.
        await asyncio.wait({task})

    def _start_refresh(self) -> "asyncio.Task[None]":
        task = asyncio.get_running_loop().create_task(self._ask())
        self._refreshing = task

        def finished(done: "asyncio.Task[None]") -> None:
            if self._refreshing is done:
                self._refreshing = None
            if not done.cancelled() and done.exception() is not None:
                log.warning("refreshing the shard routes failed: %r", done.exception())

        task.add_done_callback(finished)
        return task

    async def _ask(self) -> None:
        """The seed first, then every other member known, until one answers."""
        try:
            asked: List[Tuple[int, Client]] = [(NO_NODE, self._seed)]
            asked += [
                (node, self._member(node))
                for node, address in sorted(self._addresses.items())
                if address != self._seed.address
            ]
            failures = []
            for node, client in asked:
                try:
                    cluster = await client.cluster(REFRESH_CALL_TIMEOUT_S)
                except LeveeError as error:
                    if node == NO_NODE and error.code == ErrorCode.UNIMPLEMENTED:
                        log.info("the server has no Cluster service: appends go to it alone")
                        self._turn_off()
                        return
                    failures.append(f"{client.address}: {error}")
                    continue
                self._learn(cluster, node)
                return
            log.info("no member answered GetCluster; the shard routes stay as they were: %s",
                     "; ".join(failures))
        finally:
            self._refreshed_at = asyncio.get_running_loop().time()

    def _learn(self, cluster: cluster_pb2.GetClusterResponse, answering: int) -> None:
        if self._closed:
            return
        self._fallback = answering
        if not cluster.replicated_queues:
            if cluster.shards != 0:
                # Fixed when the cluster was created: it will never replicate its queues.
                self._turn_off()
            else:
                self._shards = 0
            return
        if cluster.shards == 0:
            self._shards = 0
            return
        leaders = [NO_NODE] * cluster.shards
        for placement in cluster.shard_map:
            if placement.shard < cluster.shards:
                leaders[placement.shard] = placement.leader_id
        addresses = {
            member.node_id: member.grpc_addr for member in cluster.members if member.grpc_addr
        }
        for node in list(self._clients):
            if addresses.get(node) != self._addresses.get(node):
                self._retire(node)
        self._shards, self._leaders, self._addresses = cluster.shards, leaders, addresses
        if answering not in addresses:
            self._fallback = NO_NODE

    def _turn_off(self) -> None:
        self._off = True
        self._shards = 0
        self._fallback = NO_NODE
        for node in list(self._clients):
            self._retire(node)
        self._addresses = {}

    def _member(self, node: int) -> Client:
        """The client of member `node` (known in the view), opened on first use."""
        client = self._clients.get(node)
        if client is None:
            address = self._addresses[node]
            if address == self._seed.address:
                client = self._seed
            else:
                client = Client.connect_lazy(
                    address, self._member_options, self._seed.producer_name
                )
            self._clients[node] = client
        return client

    def _fallback_client(self) -> Client:
        if self._fallback != NO_NODE and self._fallback in self._addresses:
            return self._member(self._fallback)
        return self._seed

    def _retire(self, node: int) -> None:
        """Forgets member `node`'s client, closing it once its calls in progress end."""
        client = self._clients.pop(node)
        if client is self._seed:
            return
        task = asyncio.get_running_loop().create_task(client.close(CLOSE_GRACE_S))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Stops refreshing and closes every member's client (calls in progress are given
        `CLOSE_GRACE_S`); the seed client stays open."""
        self._closed = True
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.gather(self._refreshing, return_exceptions=True)
        for node in list(self._clients):
            self._retire(node)
        await asyncio.gather(*list(self._closing), return_exceptions=True)
