"""`Members`: what a stream that follows the cluster (`Client.subscribe_following`,
`Client.subscribe_many_following`, `GroupConsumer.following`) keeps to open itself again through another node when its
node goes away, as the Rust client's (crates/levee-client/src/following.rs): the cluster's
members, learned from the node the stream was opened through (the seed) or, when it does not
answer, from the members known, and tried in turn.

It owns one `Client` per member it learned (connected on first use; the seed's own address
reuses the seed, which its owner closes), at most `MEMBERS_MAX`; a member that leaves has its
client closed unless the stream runs through it. `close` closes them all. A move
(`reopen`) takes at most `REOPEN_WITHIN_S`, each attempt through one member at most
`OPEN_ATTEMPT_TIMEOUT_S` of it.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Dict, List, Optional, Set, TypeVar

from .client import Client, ClientOptions
from .errors import ErrorCode, LeveeError

T = TypeVar("T")

REOPEN_WITHIN_S = 30.0
"""Longest a following stream tries to open itself again (one move) before it gives up."""
REOPEN_PAUSE_S = 0.1
"""Pause between two rounds over the members while none takes the stream."""
OPEN_ATTEMPT_TIMEOUT_S = 10.0
"""Longest one attempt to open the stream through one member takes (its node may be a black
hole); the server itself answers a shard without a quorum within about 2 s."""
LEARN_CALL_TIMEOUT_S = 1.0
"""Deadline of each `GetCluster` call asking for the members, and of connecting to one."""
MEMBERS_MAX = 64
"""Most members a following stream keeps a client of (a cluster has up to 5 voters; learners
beyond this many are not tried)."""


def node_went_away(error: LeveeError) -> bool:
    """Whether `error` means the stream's node went away (UNAVAILABLE, which is also what a
    broken connection reads as), not a refusal of what was asked."""
    return error.code == ErrorCode.UNAVAILABLE


class Members:
    """The members a following stream may move to. Use inside one event loop."""

    def __init__(self, seed: Client) -> None:
        self._seed = seed
        self._options = ClientOptions(
            connect_timeout_s=LEARN_CALL_TIMEOUT_S,
            request_timeout_s=seed.options.request_timeout_s,
            message_bytes_max=seed.options.message_bytes_max,
            hot_key_bytes_max=seed.options.hot_key_bytes_max,
        )
        # The members last learned, in the order the cluster lists them.
        self._known: List[Client] = []
        # Clients opened here, by address (never the seed); at most MEMBERS_MAX + 1 (the
        # member the stream runs through, kept after it left).
        self._clients: Dict[str, Client] = {}
        # The client the stream runs through now.
        self._current: Client = seed
        # The member to try first at the next move.
        self._next = 0
        # Clients of departed members being closed (at most the members ever replaced).
        self._closing: "Set[asyncio.Task[None]]" = set()

    @classmethod
    async def learned_from(cls, seed: Client) -> "Members":
        """The members as `seed` says now."""
        members = cls(seed)
        await members.learn()
        return members

    async def learn(self) -> None:
        """Learns the members again: from the seed, else from any member known; keeps the
        last list known when none answers."""
        for client in [self._seed, *self._known]:
            try:
                cluster = await client.cluster(LEARN_CALL_TIMEOUT_S)
            except LeveeError:
                continue
            addresses = [member.grpc_addr for member in cluster.members if member.grpc_addr]
            if addresses:
                self._replace(addresses[:MEMBERS_MAX])
                return
        if not self._known:
            self._known = [self._seed]

    def _replace(self, addresses: List[str]) -> None:
        known: List[Client] = []
        for address in addresses:
            if address == self._seed.address:
                known.append(self._seed)
                continue
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = Client.connect_lazy(address, self._options)
            known.append(client)
        self._known = known
        self._close_departed()

    def _close_departed(self) -> None:
        """Closes the clients of members no longer known, but the one the stream runs on."""
        kept = {client.address for client in self._known} | {self._current.address}
        for address in [address for address in self._clients if address not in kept]:
            closing = asyncio.ensure_future(self._clients.pop(address).close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    async def next_member(self, probe_s: float) -> Client:
        """The member to rejoin through once the current one stopped answering (a following
        `GroupConsumer`, as the Rust `Members::next_member`): learns the members again, then
        the first that answers `server_info` within `probe_s`, trying them in turn from the
        one after the last taken (the current one last); the seed when none answers."""
        await self.learn()
        count = len(self._known)
        candidates = [self._known[(self._next + step) % count] for step in range(count)]
        candidates.sort(key=lambda member: member is self._current)  # stable: current last
        chosen = self._seed
        for member in candidates:
            try:
                await asyncio.wait_for(member.server_info(), probe_s)
            except (LeveeError, asyncio.TimeoutError):
                continue
            self._next = (self._known.index(member) + 1) % count
            chosen = member
            break
        self._current = chosen
        self._close_departed()
        return chosen

    async def reopen(self, open_through: Callable[[Client], Awaitable[Optional[T]]]) -> Optional[T]:
        """Tries `open_through` on each member in turn (the one after the last that took the
        stream first), learning the members again before each round, until one opens the
        stream (its answer) or `REOPEN_WITHIN_S` has passed (None). An attempt that raises a
        `LeveeError` or takes over `OPEN_ATTEMPT_TIMEOUT_S` counts as refused."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REOPEN_WITHIN_S
        while True:
            await self.learn()
            count = len(self._known)
            for step in range(count):
                left = deadline - loop.time()
                if left <= 0:
                    return None
                index = (self._next + step) % count
                member = self._known[index]
                try:
                    opened = await asyncio.wait_for(
                        open_through(member), min(left, OPEN_ATTEMPT_TIMEOUT_S)
                    )
                except (LeveeError, asyncio.TimeoutError):
                    opened = None
                if opened is not None:
                    self._next = (index + 1) % count
                    self._current = member
                    self._close_departed()
                    return opened
            if loop.time() + REOPEN_PAUSE_S >= deadline:
                return None
            await asyncio.sleep(REOPEN_PAUSE_S)

    async def close(self) -> None:
        """Closes every member's client opened here (never the seed)."""
        clients, self._clients = list(self._clients.values()), {}
        self._known = []
        for client in clients:
            await client.close()
        await asyncio.gather(*self._closing, return_exceptions=True)
