"""`HotKeys`: the app-server side of hot-key detection.

`is_hot(key)` records one access in a local, pre-aggregated buffer and answers from the local
set of hot keys; it never waits on the network and never raises (trouble goes to the logs and
to `stats()`). Every `report_interval_s` a background thread sends the buffer to the servers,
each key to one server chosen by rendezvous hashing over the servers connected at that moment
(identical to the Rust client: see routing.py). Each server keeps one long-lived session per
app server and pushes hot and cool events on it; a session that breaks is reopened with
exponential backoff, and a server's first message on a new session is a snapshot of the app's
hot keys, which replaces what this client held from that server.

With `follow_cluster` (the default) the servers are seeds: the client follows the cluster's
members (`Cluster.WatchMembers`), holds a session with every member and routes over them, a
leaving member's keys moving alone to the others (as the Rust client; a server without the
Cluster service keeps the servers as given).

Bounds: the buffer holds at most `buffer_keys_max` distinct keys (further keys are dropped and
counted), each server's queue of report batches at most `batches_queued_per_server_max` (a
batch that does not fit, or that a broken session loses, is counted in `keys_unsent` and
`batches_unsent`), the routing-hash cache at most `buffer_keys_max` keys, loads in flight one
per key.

The background work runs on its own thread and event loop, so `is_hot` serves threads, asyncio
code and scripts alike, and a blocked application loop does not stop reporting.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import (
    Any,
    Awaitable,
    Callable,
    Dict,
    Generic,
    List,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
)

import grpc
import grpc.aio

from . import routing, validation
from .errors import ErrorCode, make_error
from .v1 import cluster_pb2, cluster_pb2_grpc, hotkey_pb2, hotkey_pb2_grpc
from .validation import BytesLike, to_bytes

log = logging.getLogger("levee.hotkeys")

V = TypeVar("V")

REPORT_INTERVAL_MIN_S = 0.001
REPORT_INTERVAL_MAX_S = 0.5
REPORT_BATCH_BYTES_MAX_DEFAULT = 4 << 20
REPORT_KEY_OVERHEAD_BYTES = 1 + 3 + 1 + 5 + 1 + 3
"""Protobuf bytes around each key of a report, at most (levee-proto's constant)."""
REPORT_BATCH_OVERHEAD_BYTES = 1 + 5
REPORT_BATCH_BYTES_MIN = (64 << 10) + REPORT_KEY_OVERHEAD_BYTES + REPORT_BATCH_OVERHEAD_BYTES
SERVERS_MAX = 64
"""Most servers a client holds links to over its life (seeds and members seen)."""
REPORT_COUNT_MAX = 2**32 - 1
"""A report's count is a uint32: larger buffered counts saturate."""


@dataclass(frozen=True)
class HotKeysOptions:
    """How a `HotKeys` reports and reconnects."""

    app: str
    """The app (namespace): 1 to 128 of [A-Za-z0-9._-]."""
    servers: Sequence[str]
    """The servers' gRPC addresses (HOST:PORT); keys are spread over them."""
    client_id: str = field(default_factory=lambda: f"pid-{os.getpid()}")
    report_interval_s: float = 0.1
    buffer_keys_max: int = 100_000
    batch_keys_max: int = 10_000
    batch_bytes_max: int = REPORT_BATCH_BYTES_MAX_DEFAULT
    batches_queued_per_server_max: int = 64
    reconnect_backoff_min_s: float = 0.1
    reconnect_backoff_max_s: float = 5.0
    connect_timeout_s: float = 5.0
    follow_cluster: bool = True
    """Treat `servers` as seeds: follow the cluster's members (the `Cluster.WatchMembers`
    stream), hold a session with every member and route keys over the members, following every
    change (as the Rust client). False: exactly `servers`, as given."""

    def validate(self) -> None:
        def invalid(message: str) -> Exception:
            return make_error(ErrorCode.INVALID_ARGUMENT, message)

        validation.check_app(self.app)
        if not self.servers:
            raise invalid("servers: give at least one server address")
        if not REPORT_INTERVAL_MIN_S <= self.report_interval_s <= REPORT_INTERVAL_MAX_S:
            raise invalid(
                f"report_interval must be 1 to 500 ms, got {self.report_interval_s * 1000:g} ms"
            )
        if self.buffer_keys_max < 1 or self.batch_keys_max < 1:
            raise invalid("buffer_keys_max and batch_keys_max must be at least 1")
        if self.batches_queued_per_server_max < 1:
            raise invalid("batches_queued_per_server_max must be at least 1")
        if self.batch_bytes_max < REPORT_BATCH_BYTES_MIN:
            raise invalid(
                f"batch_bytes_max must be at least {REPORT_BATCH_BYTES_MIN} (a key of the "
                f"largest size fits, with its framing), got {self.batch_bytes_max}"
            )
        if not 0 < self.reconnect_backoff_min_s <= self.reconnect_backoff_max_s:
            raise invalid(
                "reconnect_backoff_min must be above 0 and at most reconnect_backoff_max"
            )


@dataclass(frozen=True)
class HotKeyChange:
    """A key that turned hot (or had its hot period extended) or cooled."""

    key: bytes
    hot: bool
    hot_for_s: float
    """How long it stays hot from now (0 when it cooled)."""
    manual: bool
    """Whether an operator set it by hand."""


@dataclass
class HotKeysStats:
    """Counters of one `HotKeys`."""

    accesses_recorded: int = 0
    accesses_dropped: int = 0
    """Accesses dropped because the buffer held buffer_keys_max distinct keys (or empty keys)."""
    keys_reported: int = 0
    keys_unsent: int = 0
    """Keys not delivered: no server connected, a full server queue, or a session that broke."""
    batches_unsent: int = 0
    """Report batches lost (each counted with its keys in keys_unsent)."""
    events_received: int = 0
    sessions_opened: int = 0
    servers_connected: int = 0
    callback_errors: int = 0


class _LocalHot:
    __slots__ = ("until", "server", "value", "has_value")

    def __init__(self, until: float, server: int) -> None:
        self.until = until
        self.server = server
        self.value: Any = None
        self.has_value = False


class _Flight:
    """One load in flight for a key (the synchronous single-flight)."""

    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: Optional[BaseException] = None


def _unusable(address: str) -> bool:
    """An API address a client cannot use: empty, or unspecified (0.0.0.0, [::])."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return not address or host in ("0.0.0.0", "::")


def batch_length(sizes: Sequence[int], keys_max: int, bytes_max: int) -> int:
    """How many of the keys (given by their sizes) go in one message: at most keys_max, and as
    many as fit bytes_max with their framing (at least one, so a round always moves)."""
    total = REPORT_BATCH_OVERHEAD_BYTES
    for index, size in enumerate(sizes[:keys_max]):
        total += size + REPORT_KEY_OVERHEAD_BYTES
        if total > bytes_max:
            return max(index, 1)
    return min(len(sizes), keys_max)


class HotKeys(Generic[V]):
    """The hot-key client of one app on one app server. Start it with `HotKeys.start(options)`
    and stop it with `close()`; `V` is the type of locally cached values."""

    def __init__(self, options: HotKeysOptions) -> None:
        options.validate()
        self.options = options
        # Every server seen (seeds, then members as they join; at most SERVERS_MAX): a link
        # runs while its server is active, one task each.
        self._servers: List[str] = list(options.servers)
        self._active: List[bool] = [True] * len(self._servers)
        self._link_tasks: Dict[int, "asyncio.Task[None]"] = {}
        self._seeds = [routing.server_seed(address) for address in options.servers]
        self._lock = threading.Lock()
        self._buffer: Dict[bytes, int] = {}
        self._recorded = 0
        self._dropped = 0
        self._invalid_logged = False
        self._hot: Dict[bytes, _LocalHot] = {}
        self._hash_cache: Dict[bytes, int] = {}
        self._callbacks: List[Callable[[HotKeyChange], None]] = []
        self._flights: Dict[bytes, _Flight] = {}
        self._async_flights: Dict[Tuple[int, bytes], "asyncio.Future[Any]"] = {}
        self._queues: List[Optional["asyncio.Queue[Any]"]] = [None] * len(options.servers)
        self._stats = HotKeysStats()
        self._stopping = False
        self._loop = asyncio.new_event_loop()
        self._stopped: Optional[asyncio.Event] = None
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run_thread, name=f"levee-hotkeys-{options.app}", daemon=True
        )

    @classmethod
    def start(cls, options: HotKeysOptions) -> "HotKeys[V]":
        """Starts reporting and listening in the background; returns at once (sessions open in
        the background: see `stats().servers_connected`)."""
        hot_keys: HotKeys[V] = cls(options)
        hot_keys._thread.start()
        hot_keys._ready.wait()
        return hot_keys

    # ---- the application's side: local, never blocking on the network, never raising

    def is_hot(self, key: BytesLike) -> bool:
        """Records one access to `key` and says whether it is hot now. Never raises."""
        try:
            if type(key) is not bytes:
                key = to_bytes(key)
            with self._lock:
                self._recorded += 1
                buffer = self._buffer
                count = buffer.get(key)  # type: ignore[call-overload]
                if count is not None:
                    buffer[key] = count + 1  # type: ignore[index]
                elif key and len(buffer) < self.options.buffer_keys_max:
                    buffer[key] = 1  # type: ignore[index]
                else:
                    self._dropped += 1
            entry = self._hot.get(key)  # type: ignore[call-overload]
            return entry is not None and entry.until > time.monotonic()
        except Exception as error:  # never break the business path: count it, log it once
            self._invalid_key(error)
            return False

    def _invalid_key(self, error: Exception) -> None:
        with self._lock:
            self._dropped += 1
            first = not self._invalid_logged
            self._invalid_logged = True
        if first:
            log.error("hot keys: a key that is not bytes or str was dropped (%s)", error)

    def is_hot_now(self, key: BytesLike) -> bool:
        """Whether `key` is hot now, without recording an access. Never raises."""
        try:
            entry = self._hot.get(to_bytes(key))
            return entry is not None and entry.until > time.monotonic()
        except Exception:
            return False

    def record(self, key: BytesLike, count: int = 1) -> None:
        """Records `count` accesses to `key` (pre-aggregated by the caller). Never raises."""
        try:
            key = to_bytes(key)
            count = max(int(count), 0)
            with self._lock:
                self._recorded += count
                buffer = self._buffer
                total = buffer.get(key)
                if total is not None:
                    buffer[key] = total + count
                elif key and len(buffer) < self.options.buffer_keys_max:
                    buffer[key] = count
                else:
                    self._dropped += count
        except Exception as error:
            self._invalid_key(error)

    def hot_keys(self) -> List[bytes]:
        """The keys hot now, sorted."""
        now = time.monotonic()
        return sorted(key for key, entry in list(self._hot.items()) if entry.until > now)

    def get(self, key: BytesLike) -> Optional[V]:
        """The cached value of a hot key, if one was set or loaded while it is hot."""
        entry = self._hot.get(to_bytes(key))
        if entry is None or entry.until <= time.monotonic() or not entry.has_value:
            return None
        return entry.value  # type: ignore[no-any-return]

    def set(self, key: BytesLike, value: V) -> bool:
        """Caches `value` for `key` if the key is hot (it expires when the key cools); returns
        whether it was cached."""
        entry = self._hot.get(to_bytes(key))
        if entry is None or entry.until <= time.monotonic():
            return False
        entry.value = value
        entry.has_value = True
        return True

    def get_or_load_sync(self, key: BytesLike, load: Callable[[], V]) -> V:
        """Records an access and returns the key's value: from the local cache when the key is
        hot and cached, else from `load`. While a key is hot one load runs at a time however
        many threads ask, and its result is cached; cold keys always call `load`. A load that
        raises raises in every waiting caller and caches nothing."""
        key = to_bytes(key)
        if not self.is_hot(key):
            return load()
        entry = self._hot.get(key)
        if entry is not None and entry.has_value:
            return entry.value  # type: ignore[no-any-return]
        with self._lock:
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight()
        if not leader:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            return flight.value  # type: ignore[no-any-return]
        try:
            flight.value = load()
            self.set(key, flight.value)
            return flight.value  # type: ignore[no-any-return]
        except BaseException as error:
            flight.error = error
            raise
        finally:
            with self._lock:
                self._flights.pop(key, None)
            flight.done.set()

    async def get_or_load(self, key: BytesLike, load: Callable[[], Awaitable[V]]) -> V:
        """As `get_or_load_sync`, for coroutines: one load per hot key within an event loop."""
        key = to_bytes(key)
        if not self.is_hot(key):
            return await load()
        entry = self._hot.get(key)
        if entry is not None and entry.has_value:
            return entry.value  # type: ignore[no-any-return]
        loop = asyncio.get_running_loop()
        flight_key = (id(loop), key)
        existing = self._async_flights.get(flight_key)
        if existing is not None:
            return await asyncio.shield(existing)  # type: ignore[no-any-return]
        future: "asyncio.Future[Any]" = loop.create_future()
        self._async_flights[flight_key] = future
        try:
            value = await load()
            self.set(key, value)
            future.set_result(value)
            return value
        except BaseException as error:
            future.set_exception(error)
            future.exception()  # retrieved: no "never retrieved" warning without waiters
            raise
        finally:
            self._async_flights.pop(flight_key, None)

    def on_change(self, callback: Callable[[HotKeyChange], None]) -> None:
        """Calls `callback` on every hot and cool event, from the background thread: keep it
        quick. A callback that raises is logged and counted, never stops the session."""
        self._callbacks.append(callback)

    def stats(self) -> HotKeysStats:
        with self._lock:
            recorded, dropped = self._recorded, self._dropped
        stats = HotKeysStats(**vars(self._stats))
        stats.accesses_recorded = recorded
        stats.accesses_dropped = dropped
        stats.servers_connected = sum(1 for queue in self._queues if queue is not None)
        return stats

    def server_of(self, key: BytesLike) -> int:
        """The server (index into the servers seen: the seeds, then members as they joined) that
        `key` is reported to while all are connected."""
        return routing.rendezvous(routing.key_hash(to_bytes(key)), self._seeds) or 0

    def flush(self, timeout_s: float = 5.0) -> None:
        """Sends what is buffered now (else it goes at the next report interval)."""
        if self._loop.is_closed() or self._stopping:
            return
        if threading.current_thread() is self._thread:  # from a callback: do not wait on itself
            self._loop.create_task(self._flush_async())
            return
        try:
            asyncio.run_coroutine_threadsafe(self._flush_async(), self._loop).result(timeout_s)
        except Exception:
            log.exception("flush failed")

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what is buffered, then stops the background thread."""
        if self._stopping:
            return
        self.flush(timeout_s)
        self._stopping = True
        if self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def __enter__(self) -> "HotKeys[V]":
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
        for index in range(len(self._servers)):
            self._link_tasks[index] = asyncio.ensure_future(self._link(index))
        tasks = [asyncio.ensure_future(self._reporter())]
        if self.options.follow_cluster:
            tasks.append(asyncio.ensure_future(self._membership()))
        await self._stopped.wait()
        for task in tasks:
            task.cancel()
        tasks.extend(self._link_tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Let the gRPC library deliver the closed channels' last completions to this loop
        # before it closes (else it logs "Event loop is closed" from its poller thread).
        await asyncio.sleep(0.05)

    async def _reporter(self) -> None:
        while True:
            await asyncio.sleep(self.options.report_interval_s)
            try:
                await self._flush_async()
            except Exception:
                log.exception("hot-key report round failed")

    def _hash(self, key: bytes) -> int:
        cached = self._hash_cache.get(key)
        if cached is None:
            if len(self._hash_cache) >= self.options.buffer_keys_max:
                self._hash_cache.clear()
            cached = self._hash_cache[key] = routing.key_hash(key)
        return cached

    async def _flush_async(self) -> None:
        with self._lock:
            drained, self._buffer = self._buffer, {}
        if not drained:
            return
        queues = list(self._queues)
        per_server: List[List[Tuple[bytes, int]]] = [[] for _ in queues]
        unsent = 0
        connected = [index for index, queue in enumerate(queues) if queue is not None]
        for key, count in drained.items():
            if len(queues) == 1:
                server: Optional[int] = connected[0] if connected else None
            else:
                server = routing.rendezvous(
                    self._hash(key), self._seeds, lambda index: queues[index] is not None
                )
            if server is None:
                unsent += 1
            else:
                per_server[server].append((key, min(count, REPORT_COUNT_MAX)))
        if unsent:
            self._stats.keys_unsent += unsent
        for server, reports in enumerate(per_server):
            queue = queues[server]
            while reports and queue is not None:
                length = batch_length(
                    [len(key) for key, _ in reports[: self.options.batch_keys_max]],
                    self.options.batch_keys_max,
                    self.options.batch_bytes_max,
                )
                chunk, reports = reports[:length], reports[length:]
                message = hotkey_pb2.HotKeyClientMessage(
                    report=hotkey_pb2.ReportBatch(
                        keys=[hotkey_pb2.KeyReport(key=key, count=count) for key, count in chunk]
                    )
                )
                try:
                    queue.put_nowait((message, len(chunk)))
                    self._stats.keys_reported += len(chunk)
                except asyncio.QueueFull:
                    self._stats.keys_unsent += len(chunk)
                    self._stats.batches_unsent += 1

    async def _link(self, server: int) -> None:
        backoff = self.options.reconnect_backoff_min_s
        while True:
            opened = time.monotonic()
            try:
                await self._session(server)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning(
                    "hot-key session to %s failed (%s); reconnecting in %.0f ms",
                    self._servers[server],
                    error,
                    backoff * 1000,
                )
            if time.monotonic() - opened > self.options.reconnect_backoff_max_s:
                backoff = self.options.reconnect_backoff_min_s
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.options.reconnect_backoff_max_s)

    async def _session(self, server: int) -> None:
        address = self._servers[server]
        target = address.split("://", 1)[1] if "://" in address else address
        channel = grpc.aio.insecure_channel(
            target, options=[("grpc.max_send_message_length", 64 << 20)]
        )
        queue: "asyncio.Queue[Any]" = asyncio.Queue(self.options.batches_queued_per_server_max)
        writer: "Optional[asyncio.Task[None]]" = None
        try:
            await asyncio.wait_for(channel.channel_ready(), self.options.connect_timeout_s)
            stream = hotkey_pb2_grpc.HotKeysStub(channel).Session()
            await stream.write(
                hotkey_pb2.HotKeyClientMessage(
                    hello=hotkey_pb2.Hello(app=self.options.app, client_id=self.options.client_id)
                )
            )
            first = True
            while True:
                message = await stream.read()
                if message is grpc.aio.EOF:
                    return
                if first:
                    # The server accepted the Hello: reports may go to it from now on.
                    first = False
                    self._stats.sessions_opened += 1
                    self._queues[server] = queue
                    writer = asyncio.ensure_future(self._write_reports(stream, queue))
                kind = message.WhichOneof("kind")
                if kind == "snapshot":
                    self._apply(server, message.snapshot.hot, snapshot=True)
                elif kind == "events":
                    self._apply(server, message.events.events, snapshot=False)
        finally:
            self._queues[server] = None
            if writer is not None:
                writer.cancel()
            while not queue.empty():  # batches this session will never send
                _, keys = queue.get_nowait()
                self._stats.keys_unsent += keys
                self._stats.keys_reported -= keys
                self._stats.batches_unsent += 1
            await channel.close()

    # ---- following the cluster's members

    async def _membership(self) -> None:
        """Asks a seed (or a member learnt since) for the members and makes every update the
        set of servers; a stream that ends is opened again elsewhere, with backoff."""
        backoff = self.options.reconnect_backoff_min_s
        turn = 0
        while True:
            candidates = sorted(
                {address for index, address in enumerate(self._servers) if self._active[index]}
                | set(self.options.servers)
            )
            address = candidates[turn % len(candidates)]
            turn += 1
            opened = time.monotonic()
            try:
                if not await self._watch_members(address):
                    return
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("server %s does not list members; not following", address)
                    return
                log.debug("member stream from %s ended: %s", address, error)
            except Exception as error:
                log.debug("member stream from %s ended: %s", address, error)
            if time.monotonic() - opened > self.options.reconnect_backoff_max_s:
                backoff = self.options.reconnect_backoff_min_s
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.options.reconnect_backoff_max_s)

    async def _watch_members(self, address: str) -> bool:
        """One `WatchMembers` stream; False when the cluster cannot be followed."""
        target = address.split("://", 1)[1] if "://" in address else address
        channel = grpc.aio.insecure_channel(target)
        try:
            await asyncio.wait_for(channel.channel_ready(), self.options.connect_timeout_s)
            updates = cluster_pb2_grpc.ClusterStub(channel).WatchMembers(
                cluster_pb2.WatchMembersRequest()
            )
            async for update in updates:
                members = [member.grpc_addr for member in update.members]
                unusable = next((member for member in members if _unusable(member)), None)
                if unusable is not None:
                    log.warning(
                        "member address %r is not one clients can reach; not following the "
                        "cluster (bind --grpc-addr to a reachable address, or set "
                        "follow_cluster False)", unusable,
                    )
                    return False
                if members:
                    self._follow_members(members)
            return True
        finally:
            await channel.close()

    def _follow_members(self, members: Sequence[str]) -> None:
        """Makes `members` the servers: links of servers that left stop, new ones start."""
        for index, address in enumerate(self._servers):
            if self._active[index] and address not in members:
                log.info("hot-key server %s left the cluster", address)
                self._active[index] = False
                task = self._link_tasks.pop(index, None)
                if task is not None:
                    task.cancel()
        for member in members:
            if member in self._servers:
                index = self._servers.index(member)
                if self._active[index]:
                    continue
                self._active[index] = True
            elif len(self._servers) < SERVERS_MAX:
                log.info("hot-key server %s joined the cluster", member)
                self._servers.append(member)
                self._active.append(True)
                self._seeds.append(routing.server_seed(member))
                self._queues.append(None)
                index = len(self._servers) - 1
            else:
                log.warning("more than %d servers seen; not following %s", SERVERS_MAX, member)
                continue
            self._link_tasks[index] = asyncio.ensure_future(self._link(index))

    async def _write_reports(self, stream: Any, queue: "asyncio.Queue[Any]") -> None:
        while True:
            message, keys = await queue.get()
            try:
                await stream.write(message)
            except Exception:
                self._stats.keys_unsent += keys
                self._stats.keys_reported -= keys
                self._stats.batches_unsent += 1
                raise

    def _apply(self, server: int, events: Any, snapshot: bool) -> None:
        now = time.monotonic()
        changes: List[HotKeyChange] = []
        hot = self._hot
        if snapshot:
            keep = {event.key for event in events}
            for key, entry in list(hot.items()):
                if entry.server == server and key not in keep:
                    del hot[key]
                    changes.append(HotKeyChange(key, False, 0.0, False))
        for event in events:
            if event.app != self.options.app:
                continue
            key = bytes(event.key)
            if event.hot:
                hot_for_s = event.hot_for_ms / 1000.0
                until = now + hot_for_s
                existing = hot.get(key)
                if existing is None:
                    hot[key] = _LocalHot(until, server)
                else:
                    existing.until = max(existing.until, until)
                    existing.server = server
                changes.append(
                    HotKeyChange(
                        key, True, hot_for_s, event.source == hotkey_pb2.HOT_KEY_SOURCE_MANUAL
                    )
                )
            elif hot.pop(key, None) is not None:
                changes.append(HotKeyChange(key, False, 0.0, False))
        for key, entry in list(hot.items()):
            if entry.until <= now:
                hot.pop(key, None)
        self._stats.events_received += len(events)
        for change in changes:
            for callback in list(self._callbacks):
                try:
                    callback(change)
                except Exception:
                    self._stats.callback_errors += 1
                    log.exception("hot-key callback failed")
