"""`Limiter`: cluster-wide limits decided locally (docs/LIMITS.md), as the Rust client's.

`try_acquire(resource, permits)` spends permits from the lease this client holds for the
resource: no network, never raises. A background thread keeps one `Limits.Leases` session with
the cluster's leader (found through any node's `GetCluster`) and, a little before each lease
ends, asks for each resource's lease of the next period, sized from the permits the application
asked for in the last period; the grants of a period never pass the resource's budget, so the
cap can only be missed from below.

While no lease is held (the first period of a resource; while the leader cannot be reached) a
resource answers from its fallback: `fallback_permits` per lease period for this client alone
(0 by default: refuse), counted in `stats().fallback_decisions`.

Beside the permits: `try_acquire_key` holds a key to this client's share of the rule's per-key
limits (the server sends the limits and how many clients share them); `call(resource)` takes a
permit and reports how the call ended (the counts go with the next lease request, for the
rule's breaker and adaptive budget); `breaker(resource)` says what the last grant said of the
rule's breaker.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from itertools import islice
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import grpc
import grpc.aio

from .errors import ErrorCode, make_error
from .v1 import cluster_pb2, cluster_pb2_grpc, limits_pb2, limits_pb2_grpc
from .validation import BytesLike, to_bytes

log = logging.getLogger("levee.limiter")

RESOURCES_MAX = 1_000
"""Most resources one limiter follows (the server takes at most 1000 demands a request)."""
KEYS_TRACKED_MAX = 100_000
"""Keys one resource's per-key table holds at once."""
ACQUIRE_POLL_S = 0.005
DAY_NS = 86_400 * 1_000_000_000
EVICTION_SAMPLES = 32
"""Keys looked at for a recovered one when a per-key table is full."""

BREAKER_UNSPECIFIED = limits_pb2.BREAKER_STATUS_UNSPECIFIED
BREAKER_CLOSED = limits_pb2.BREAKER_STATUS_CLOSED
BREAKER_OPEN = limits_pb2.BREAKER_STATUS_OPEN
BREAKER_HALF_OPEN = limits_pb2.BREAKER_STATUS_HALF_OPEN


@dataclass
class LimiterOptions:
    """How a `Limiter` connects and falls back."""

    servers: Sequence[str]
    """Any of the cluster's nodes, HOST:PORT (the limiter finds the leader)."""
    lease_interval_s: float = 0.1
    """The server's lease period."""
    fallback_permits: int = 0
    """Permits per lease period a resource may use while no lease is held (0: refuse)."""
    connect_timeout_s: float = 2.0

    def validate(self) -> None:
        if not self.servers:
            raise make_error(ErrorCode.INVALID_ARGUMENT, "servers: give at least one server")
        if not 0.01 <= self.lease_interval_s <= 10.0:
            raise make_error(
                ErrorCode.INVALID_ARGUMENT,
                f"lease_interval_s must be 0.01 to 10, got {self.lease_interval_s}; the "
                "server's lease period is 0.1",
            )
        if self.fallback_permits < 0:
            raise make_error(
                ErrorCode.INVALID_ARGUMENT,
                f"fallback_permits must be 0 or more, got {self.fallback_permits}",
            )


@dataclass
class LimiterStats:
    """What a limiter did so far."""

    admitted: int = 0
    refused: int = 0
    key_refused: int = 0
    """Permits refused by a key's share of a per-key limit (also in `refused`)."""
    fallback_decisions: int = 0
    """Decisions taken from the fallback (no lease held)."""
    leases_received: int = 0
    connected: bool = False


class _Slot:
    __slots__ = ("tokens", "starts", "expires")

    def __init__(self) -> None:
        self.tokens = 0
        self.starts = 0.0
        self.expires = 0.0

    def is_current(self, now: float) -> bool:
        return self.starts <= now < self.expires


class _KeyShares:
    """A key's share of a per-key limit: N per period among k clients is N per k periods for
    this client, a burst of N / 10k (at least 1); GCRA per key in whole nanoseconds (as the
    Rust engine), at most KEYS_TRACKED_MAX keys."""

    def __init__(self, limits: "limits_pb2.KeyLimits") -> None:
        self.version = limits.version
        self.clients = max(1, limits.clients)
        self.period_ns = max(1, limits.period_ms) * 1_000_000
        self.default = self._rule(limits.default_permits) if limits.default_permits else None
        self.limit_all = limits.default_permits > 0
        self.listed = {bytes(limit.key): self._rule(limit.permits) for limit in limits.keys}
        self.tat: Dict[bytes, int] = {}

    def _rule(self, permits: int) -> Optional[Tuple[int, int]]:
        """(nanoseconds per permit, burst) of this client's share; None when it rounds to
        nothing."""
        share_period_ns = self.period_ns * self.clients
        share = permits
        if share_period_ns > DAY_NS:
            share = permits * DAY_NS // share_period_ns
            share_period_ns = DAY_NS
        if share <= 0:
            return None
        burst = min(max(1, permits // (self.clients * 10)), share)
        return (-(-share_period_ns // share), burst)

    def try_acquire(self, key: bytes, permits: int, now_ns: int) -> bool:
        if key in self.listed:
            rule = self.listed[key]
        elif self.limit_all:
            rule = self.default
        else:
            return True
        if rule is None:
            return False
        interval, burst = rule
        if permits > burst:
            return False
        tat = self.tat.get(key)
        if tat is None and len(self.tat) >= KEYS_TRACKED_MAX:
            # Drop recovered keys among a few (they answer as fresh ones); else refuse.
            for known in [known for known, at in islice(self.tat.items(), EVICTION_SAMPLES)
                          if at <= now_ns]:
                del self.tat[known]
            if len(self.tat) >= KEYS_TRACKED_MAX:
                return False
        start = now_ns if tat is None or tat < now_ns else tat
        # GCRA: admitted while the theoretical arrival time stays within the burst.
        new_tat = start + interval * permits
        if new_tat - now_ns > interval * burst:
            return False
        self.tat[key] = new_tat
        return True


class _Resource:
    def __init__(self, fallback: int) -> None:
        self.slots = [_Slot(), _Slot()]
        self.wanted = 0
        self.fallback = fallback
        self.calls = 0
        self.errors = 0
        self.slow = 0
        self.latency_sum_us = 0
        self.slow_call_s = 0.0
        self.breaker = BREAKER_UNSPECIFIED
        self.keys: Optional[_KeyShares] = None

    def current(self, now: float) -> Optional[_Slot]:
        for slot in self.slots:
            if slot.is_current(now):
                return slot
        return None


class Limiter:
    """Cluster-wide limits, decided locally from leases. Start it with `Limiter.start(options)`
    and stop it with `close()`; every method is safe from any thread."""

    def __init__(self, options: LimiterOptions) -> None:
        options.validate()
        self.options = options
        self._lock = threading.Lock()
        self._resources: Dict[str, _Resource] = {}
        self._stats = LimiterStats()
        self._client_id = (int(time.time_ns()) ^ (threading.get_ident() << 20)) & ((1 << 63) - 1) or 1
        self._loop = asyncio.new_event_loop()
        self._stopped: Optional[asyncio.Event] = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run_thread, name="levee-limiter", daemon=True)

    @classmethod
    def start(cls, options: LimiterOptions) -> "Limiter":
        """Starts the lease session in the background; returns at once."""
        limiter = cls(options)
        limiter._thread.start()
        limiter._ready.wait()
        return limiter

    @property
    def client_id(self) -> int:
        return self._client_id

    # ---- the application's side: local, never raising

    def _resource(self, resource: str) -> Optional[_Resource]:
        state = self._resources.get(resource)
        if state is None and len(self._resources) < RESOURCES_MAX:
            state = _Resource(self.options.fallback_permits)
            self._resources[resource] = state
        return state

    def _decide(self, state: Optional[_Resource], permits: int, now: float) -> bool:
        if state is None:
            admitted = False
        else:
            state.wanted += permits
            slot = state.current(now)
            if slot is not None:
                admitted = slot.tokens >= permits
                if admitted:
                    slot.tokens -= permits
            else:
                self._stats.fallback_decisions += 1
                admitted = state.fallback >= permits
                if admitted:
                    state.fallback -= permits
        if admitted:
            self._stats.admitted += permits
        else:
            self._stats.refused += permits
        return admitted

    def try_acquire(self, resource: str, permits: int = 1) -> bool:
        """Takes `permits` of `resource` if the lease (or the fallback) has them. Never blocks;
        a resource first asked for here is leased from the next period on. Negative permits are
        refused (counted nowhere)."""
        if permits < 0:
            return False
        with self._lock:
            return self._decide(self._resource(resource), permits, time.monotonic())

    def try_acquire_key(self, resource: str, key: BytesLike, permits: int = 1) -> bool:
        """Takes `permits` of `key`: its share of the rule's per-key limits, then the lease. A
        key refused by its limit is counted refused and not as demand."""
        if permits < 0:
            return False
        key = to_bytes(key)
        with self._lock:
            now = time.monotonic()
            state = self._resource(resource)
            if state is not None and state.keys is not None:
                if not state.keys.try_acquire(key, permits, time.monotonic_ns()):
                    self._stats.refused += permits
                    self._stats.key_refused += permits
                    return False
            return self._decide(state, permits, now)

    def acquire(self, resource: str, permits: int = 1, timeout_s: float = 1.0) -> bool:
        """Takes `permits`, waiting up to `timeout_s` for a later lease (blocking); the demand
        is counted again for each lease period it waits."""
        if permits < 0:
            return False
        if self.try_acquire(resource, permits):
            return True
        deadline = time.monotonic() + timeout_s
        wanted_again = time.monotonic() + self.options.lease_interval_s
        while time.monotonic() < deadline:
            time.sleep(min(ACQUIRE_POLL_S, max(0.0, deadline - time.monotonic())))
            with self._lock:
                now = time.monotonic()
                state = self._resource(resource)
                if state is None:
                    return False
                if now >= wanted_again:
                    state.wanted += permits
                    wanted_again = now + self.options.lease_interval_s
                slot = state.current(now)
                if slot is not None and slot.tokens >= permits:
                    slot.tokens -= permits
                elif slot is None and state.fallback >= permits:
                    state.fallback -= permits
                else:
                    continue
                self._stats.refused -= permits
                self._stats.admitted += permits
                return True
        return False

    def record(self, resource: str, succeeded: bool, latency_s: float) -> None:
        """Reports a call that ended (for the rule's breaker and adaptive budget)."""
        with self._lock:
            state = self._resource(resource)
            if state is None:
                return
            state.calls += 1
            if not succeeded:
                state.errors += 1
                return
            if state.slow_call_s and latency_s > state.slow_call_s:
                state.slow += 1
            state.latency_sum_us += int(latency_s * 1_000_000)

    @contextmanager
    def call(self, resource: str) -> Iterator[bool]:
        """`with limiter.call("db") as admitted:` takes one permit; when admitted, the block's
        outcome is reported (an exception is a failure) with its latency."""
        admitted = self.try_acquire(resource, 1)
        started = time.monotonic()
        if not admitted:
            yield False
            return
        try:
            yield True
        except BaseException:
            self.record(resource, False, time.monotonic() - started)
            raise
        self.record(resource, True, time.monotonic() - started)

    def breaker(self, resource: str) -> int:
        """The rule's breaker as the last grant said (a `limits_pb2.BreakerStatus`)."""
        with self._lock:
            state = self._resources.get(resource)
            return state.breaker if state is not None else BREAKER_UNSPECIFIED

    def stats(self) -> LimiterStats:
        with self._lock:
            return LimiterStats(**vars(self._stats))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the lease session."""
        if self._stopped is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(timeout_s)

    def __enter__(self) -> "Limiter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the background thread

    def _run_thread(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stopped = asyncio.Event()
        self._ready.set()
        task = asyncio.ensure_future(self._sessions())
        await self._stopped.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.05)

    async def _sessions(self) -> None:
        turn = 0
        while True:
            seed = self.options.servers[turn % len(self.options.servers)]
            turn += 1
            try:
                await self._session(seed)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.debug("limits lease session through %s ended: %s", seed, error)
            with self._lock:
                self._stats.connected = False
                for state in self._resources.values():
                    state.fallback = self.options.fallback_permits
            await asyncio.sleep(self.options.lease_interval_s)

    async def _leader(self, seed: str) -> str:
        channel = grpc.aio.insecure_channel(seed)
        try:
            view = await asyncio.wait_for(
                cluster_pb2_grpc.ClusterStub(channel).GetCluster(cluster_pb2.GetClusterRequest()),
                self.options.connect_timeout_s,
            )
        finally:
            await channel.close()
        for member in view.members:
            if member.role == cluster_pb2.MEMBER_ROLE_LEADER:
                return member.grpc_addr
        return seed

    async def _session(self, seed: str) -> None:
        leader = await self._leader(seed)
        channel = grpc.aio.insecure_channel(
            leader, options=[("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000)]
        )
        try:
            stream = limits_pb2_grpc.LimitsStub(channel).Leases()
            with self._lock:
                self._stats.connected = True
            interval = self.options.lease_interval_s
            while True:
                sent = time.monotonic()
                await stream.write(self._request())
                answer = await asyncio.wait_for(
                    stream.read(), self.options.connect_timeout_s + interval
                )
                if answer is grpc.aio.EOF:
                    return
                ends_in = self._apply(answer, sent)
                # The next request goes a little before these leases end: its answer is the
                # next period's lease, so there is no gap.
                await asyncio.sleep(max(interval / 20, min(ends_in, 2 * interval) - interval / 10))
        finally:
            await channel.close()

    def _request(self) -> "limits_pb2.LeaseRequest":
        demands: List[limits_pb2.LeaseDemand] = []
        with self._lock:
            for name, state in self._resources.items():
                stats = None
                if state.calls:
                    stats = limits_pb2.CallStats(
                        calls=state.calls, errors=state.errors, slow=state.slow,
                        latency_sum_us=state.latency_sum_us,
                    )
                    state.calls = state.errors = state.slow = state.latency_sum_us = 0
                demands.append(limits_pb2.LeaseDemand(
                    resource=name, demand=state.wanted, stats=stats,
                    keys_version=state.keys.version if state.keys is not None else 0,
                ))
                state.wanted = 0
        return limits_pb2.LeaseRequest(client_id=self._client_id, demands=demands)

    def _apply(self, answer: "limits_pb2.LeaseResponse", sent: float) -> float:
        """Each grant replaces the lease not being spent; returns the seconds until the first
        of them expires."""
        ends_in = self.options.lease_interval_s
        with self._lock:
            self._stats.leases_received += 1
            now = time.monotonic()
            ends: List[float] = []
            for grant in answer.grants:
                state = self._resources.get(grant.resource)
                if state is None:
                    continue
                state.breaker = grant.breaker
                state.slow_call_s = grant.slow_call_ms / 1000.0
                if grant.HasField("key_limits"):
                    state.keys = _KeyShares(grant.key_limits) if grant.key_limits.version else None
                current = state.current(now)
                if grant.top_up and current is not None:
                    current.tokens += grant.top_up
                slot = next((s for s in state.slots if not s.is_current(now)), state.slots[0])
                if grant.unknown_resource:
                    slot.tokens, slot.expires = 0, 0.0
                    continue
                starts = sent + grant.starts_in_ms / 1000.0
                if current is not None and current is not slot:
                    starts = min(starts, current.expires)
                slot.starts = starts
                slot.expires = sent + grant.valid_ms / 1000.0
                slot.tokens = grant.permits
                ends.append(grant.valid_ms / 1000.0)
            if ends:
                ends_in = min(ends)
        return ends_in
