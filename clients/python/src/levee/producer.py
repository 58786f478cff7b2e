"""`Producer`: batches appends from many callers into few requests.

A message waits at most `linger_s` for others to join its batch; a batch closes at
`batch_messages_max` messages or `batch_bytes_max` payload bytes, and (with `send_when_idle`,
the default) as soon as no request is in flight, so a lightly loaded producer adds no linger
while a busy one batches what arrives during each round trip. Each caller gets its message's
offset once the batch is durable. At most `queued_messages_max` messages wait: further sends
wait for room (back-pressure).

In a cluster that replicates its queues (docs/CLUSTER.md, "Part 2"), with
`route_to_shard_leaders` (the default), the producer learns the shard map, each shard's leader
and the members' addresses from `GetCluster` (`ShardRoutes`: before its first batch, then every
second while it sends and at once after a failed send; from the seed node, the client it was
given, or from any other member when the seed does not answer). Each batch is split by the
leader of each message's shard (`shard_of` of its queue's name): one request per leader, sent
over one connection per member (opened on first use, closed by `close`), the answers mapped
back to the callers. A message whose shard has no known leader goes through the seed (or the
member that last answered), which forwards it. Elsewhere (a lone server, a cluster that does
not replicate its queues, the option off) every batch goes whole to the seed, as it always did.

With `idempotent`, the producer takes a fresh producer id and numbers each queue's messages;
a batch whose request failed in a way that may not have reached the disk (UNAVAILABLE,
DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, or a SEQUENCE_GAP left by a batch still in flight) is
resent with the same numbers, and the server stores nothing twice. A resend goes to the leader
known at the time: the routes are refreshed after the failure, and the request goes to its
first message's shard leader (which forwards any other shard's messages it carries). Since the
server takes a producer's sequences on a queue only in order, a batch that shares a queue with
a batch in flight waits for it (batches of other queues still go in parallel); a SEQUENCE_GAP
while an earlier batch is in flight is resent once the earlier batches are answered, without
counting against `retries_max`; other retryable failures are resent up to `retries_max` times
(default 10) with a backoff from `retry_backoff_s` (10 ms) doubling up to `retry_backoff_max_s`
(100 ms): about 0.75 s in all, enough to ride out a shard leader's failover in a cluster, as
the Rust producer's defaults.

The server answers a resend with its original offsets only while it is among the last 8
requests of this producer that touched its queues (`RUNS_KEPT`; SEQUENCE_TOO_OLD beyond). The
Rust producer, which lets batches of one queue overlap, keeps a resend inside that window by
sending no new batch while one is being resent. This producer gets the same from the rule
above: a batch stays in flight until every part of it is answered (its resends included), and
no other batch touching one of its queues is sent meanwhile, so each resend is still the
latest request of this producer on each of its queues, while batches of other queues go on.
The sequence counters are bounded: past `sequence_queues_max` queues the producer takes a new
id (sequences restart at 0 under it). Failed batches are never silent: each caller gets the
error, and `stats()` counts them.

A batch that fails for good (an error that is not retried, such as INVALID_ARGUMENT, or its
resends exhausted) has taken its sequences, yet the server may never have stored it: under the
same id the server would answer every later batch of its queues with SEQUENCE_GAP, as it waits
for the failed batch's first sequence. So every batch numbered after such a failure takes a
fresh producer id, its sequences restarting at 0 on every queue (the same path as past
`sequence_queues_max`); the batches already numbered and in flight keep their id and their
resends. A batch that failed with an error after which it may still be stored (UNAVAILABLE,
DEADLINE_EXCEEDED: the request may have reached the server) may indeed be stored later, once,
under the old id; the later batches, under another id, never collide with it (the server takes
their sequences whatever became of it), though its messages may then sit after theirs. Its
callers got the error: sending those messages again is theirs to decide.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Deque, Dict, List, Optional, Tuple

from . import validation
from .errors import ErrorCode, LeveeError, make_error
from .shard_routes import NO_NODE, ShardRoutes
from .v1.queue_pb2 import AppendMessage, AppendRequest
from .validation import BytesLike, to_bytes

if TYPE_CHECKING:
    from .client import Client

RETRYABLE_CODES = frozenset(
    {
        ErrorCode.UNAVAILABLE,
        ErrorCode.DEADLINE_EXCEEDED,
        ErrorCode.SEQUENCE_GAP,
        ErrorCode.RESOURCE_EXHAUSTED,
    }
)


@dataclass(frozen=True)
class ProducerOptions:
    """How a `Producer` batches."""

    linger_s: float = 0.001
    send_when_idle: bool = True
    batch_messages_max: int = 1000
    batch_bytes_max: int = 4 << 20
    queued_messages_max: int = 100_000
    requests_in_flight_max: int = 8
    idempotent: bool = False
    retries_max: int = 10
    """With `idempotent`: resends of one batch before its callers get the error (10, with the
    backoffs below: about 0.75 s in all, a shard leader's failover in a cluster)."""
    retry_backoff_s: float = 0.010
    """The pause before the first resend; each next pause doubles, up to
    `retry_backoff_max_s`."""
    retry_backoff_max_s: float = 0.100
    """The longest pause between two resends of a batch."""
    sequence_queues_max: int = 100_000
    route_to_shard_leaders: bool = True
    """In a cluster that replicates its queues: send each batch's messages straight to their
    shards' leaders (learned from `GetCluster` every second and after a failed send), saving
    the hop a node takes forwarding them. Elsewhere it changes nothing."""

    def validate(self) -> None:
        if not 1 <= self.batch_messages_max <= validation.MESSAGES_PER_REQUEST_MAX:
            raise make_error(
                ErrorCode.INVALID_ARGUMENT,
                f"batch_messages_max must be 1 to {validation.MESSAGES_PER_REQUEST_MAX}, "
                f"got {self.batch_messages_max}",
            )
        for name in ("batch_bytes_max", "queued_messages_max", "requests_in_flight_max",
                     "sequence_queues_max"):
            if getattr(self, name) < 1:
                raise make_error(
                    ErrorCode.INVALID_ARGUMENT, f"{name} must be at least 1, got {getattr(self, name)}"
                )
        if self.linger_s < 0 or self.retries_max < 0:
            raise make_error(
                ErrorCode.INVALID_ARGUMENT, "linger_s and retries_max must not be negative"
            )
        if not 0 <= self.retry_backoff_s <= self.retry_backoff_max_s:
            raise make_error(
                ErrorCode.INVALID_ARGUMENT,
                "retry_backoff_s must be at least 0 and at most retry_backoff_max_s, got "
                f"{self.retry_backoff_s} and {self.retry_backoff_max_s}",
            )


@dataclass
class ProducerStats:
    """What a producer did."""

    messages_sent: int = 0
    """Messages whose batch was stored (durable)."""
    messages_failed: int = 0
    """Messages whose batch failed: their callers got the error."""
    batches_sent: int = 0
    """Requests answered with offsets (a batch split by shard leader is one request per
    leader)."""
    batches_failed: int = 0
    retries: int = 0
    messages_to_leaders: int = 0
    """Messages stored by a request sent straight to their shard's leader as the producer knew
    it (`route_to_shard_leaders` in a cluster that replicates its queues); the others went
    through a node that forwarded them."""


@dataclass
class _Pending:
    queue: bytes
    payload: bytes
    answer: "asyncio.Future[int]"


@dataclass
class _Group:
    """The part of a batch that goes to one node, as one request: its callers and their
    numbered messages, in the same order."""

    pending: List[_Pending]
    messages: List[AppendMessage]


def fresh_producer_id() -> str:
    return f"producer-{os.urandom(8).hex()}"


class Producer:
    """Batches appends through `client`. Use inside one event loop; `await producer.close()`
    (or `async with`) sends what is queued and waits for it."""

    def __init__(self, client: "Client", options: Optional[ProducerOptions] = None) -> None:
        self._client = client
        self.options = options or ProducerOptions()
        self.options.validate()
        self._queued: Deque[_Pending] = deque()
        # Messages queued or in flight, at most queued_messages_max; senders wait for room.
        self._held = 0
        self._room = asyncio.Event()
        self._wake = asyncio.Event()
        self._in_flight = 0
        self._slots = asyncio.Semaphore(self.options.requests_in_flight_max)
        self._tasks: "set[asyncio.Task[None]]" = set()
        self._runner: "Optional[asyncio.Task[None]]" = None
        self._closing = False
        self._producer_id = fresh_producer_id() if self.options.idempotent else ""
        self._sequences: Dict[bytes, int] = {}
        self._stats = ProducerStats()
        # Batches in flight by number (increasing), each with an event set once answered;
        # at most requests_in_flight_max.
        self._batches: Dict[int, asyncio.Event] = {}
        self._batch_number = 0
        # Idempotent: the batch in flight for each queue (bounded by the batches in flight).
        self._queue_batches: Dict[bytes, int] = {}
        self._routes = ShardRoutes(client) if self.options.route_to_shard_leaders else None

    @property
    def producer_id(self) -> str:
        """The idempotent producer id now ("" when not idempotent). A fresh one is taken past
        `sequence_queues_max` queues and after a batch fails for good."""
        return self._producer_id

    def stats(self) -> ProducerStats:
        return ProducerStats(**vars(self._stats))

    async def send(self, queue: BytesLike, payload: BytesLike) -> int:
        """Appends `payload` to `queue`; returns its offset once its batch is durable."""
        return await (await self.enqueue(queue, payload))

    async def enqueue(self, queue: BytesLike, payload: BytesLike) -> "asyncio.Future[int]":
        """Queues a message, waiting only for room; returns a future of its offset. Lets one
        caller pipeline many messages without a task per message."""
        if type(queue) is not bytes:
            queue = to_bytes(queue)
        if type(payload) is not bytes:
            payload = to_bytes(payload)
        if (
            not 0 < len(queue) <= validation.QUEUE_NAME_BYTES_MAX
            or queue[0] == 0
            or len(payload) > self._client.options.message_bytes_max
        ):
            validation.check_append_queue(queue)
            validation.check_not_reserved(queue)
            validation.check_payload(payload, self._client.options.message_bytes_max)
        if self._closing:
            raise make_error(ErrorCode.UNAVAILABLE, "the producer is closed")
        while self._held >= self.options.queued_messages_max:
            self._room.clear()
            await self._room.wait()
        self._held += 1
        loop = asyncio.get_running_loop()
        answer: "asyncio.Future[int]" = loop.create_future()
        self._queued.append(_Pending(queue, payload, answer))
        if self._runner is None:
            self._runner = loop.create_task(self._run())
        self._wake.set()
        return answer

    async def _run(self) -> None:
        options = self.options
        while True:
            if not self._queued:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            deadline = asyncio.get_running_loop().time() + options.linger_s
            # Linger for more unless the line is idle (send_when_idle) or the batch is full.
            while (
                len(self._queued) < options.batch_messages_max
                and not self._closing
                and not (options.send_when_idle and self._in_flight == 0)
            ):
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch: List[_Pending] = []
            payload_bytes = 0
            while self._queued and len(batch) < options.batch_messages_max:
                size = len(self._queued[0].payload)
                if batch and payload_bytes + size > options.batch_bytes_max:
                    break
                batch.append(self._queued.popleft())
                payload_bytes += size
            if options.idempotent:
                # The server takes a producer's sequences on a queue only in order: a batch
                # sharing a queue with one in flight would meet a SEQUENCE_GAP, so it waits for
                # it (meanwhile what arrives makes the next batch larger).
                queues = {pending.queue for pending in batch}
                earlier = {
                    self._queue_batches[queue] for queue in queues if queue in self._queue_batches
                }
                for number in earlier:
                    done = self._batches.get(number)
                    if done is not None:
                        await done.wait()
            await self._slots.acquire()
            self._in_flight += 1
            messages = self._number(batch)
            self._batch_number += 1
            self._batches[self._batch_number] = asyncio.Event()
            if options.idempotent:
                for pending in batch:
                    self._queue_batches[pending.queue] = self._batch_number
            task = asyncio.get_running_loop().create_task(
                self._send_batch(batch, messages, self._producer_id, self._batch_number)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _number(self, batch: List[_Pending]) -> list:
        if not self.options.idempotent:
            return [AppendMessage(queue=p.queue, payload=p.payload) for p in batch]
        new_queues = {p.queue for p in batch if p.queue not in self._sequences}
        if len(self._sequences) + len(new_queues) > self.options.sequence_queues_max:
            # Bounded counters: a new id restarts every queue's sequence at 0.
            self._renew_producer_id()
        numbered = []
        for pending in batch:
            sequence = self._sequences.get(pending.queue, 0)
            self._sequences[pending.queue] = sequence + 1
            numbered.append(
                AppendMessage(queue=pending.queue, payload=pending.payload, sequence=sequence)
            )
        return numbered

    def _renew_producer_id(self) -> None:
        """A fresh producer id for the batches numbered from now on: every queue's sequence
        restarts at 0 under it (batches already numbered keep theirs)."""
        self._producer_id = fresh_producer_id()
        self._sequences.clear()

    def _failed_for_good(self, producer_id: str) -> None:
        """A batch numbered under `producer_id` failed for good: its sequences were taken but
        may never be stored, and the server would answer each later batch of its queues under
        this id with SEQUENCE_GAP. The batches numbered next take a fresh id (once per id: a
        later failure under an id already replaced changes nothing)."""
        if producer_id and producer_id == self._producer_id:
            self._renew_producer_id()

    async def _send_batch(
        self, batch: List[_Pending], messages: list, producer_id: str, number: int
    ) -> None:
        try:
            groups = await self._split(batch, messages)
            if len(groups) == 1:
                await self._send_group(groups[0], producer_id, number)
            else:
                # Every group runs to its end before the batch is released, whatever happens.
                ends = await asyncio.gather(
                    *(self._send_group(group, producer_id, number) for group in groups),
                    return_exceptions=True,
                )
                for end in ends:
                    if isinstance(end, BaseException):
                        raise end
        except BaseException as error:  # cancelled or a bug: no caller is left waiting
            self._failed_for_good(producer_id)
            for pending in batch:
                if not pending.answer.done():
                    pending.answer.set_exception(
                        make_error(ErrorCode.UNAVAILABLE, f"the producer stopped: {error!r}")
                    )
            raise
        finally:
            self._batches.pop(number).set()
            for pending in batch:
                if self._queue_batches.get(pending.queue) == number:
                    del self._queue_batches[pending.queue]
            self._in_flight -= 1
            self._slots.release()
            self._held -= len(batch)
            self._room.set()
            self._wake.set()

    async def _split(self, batch: List[_Pending], messages: list) -> List[_Group]:
        """The batch as one group per node it goes to: by each message's shard leader when
        routing (a message's queue decides its shard, so a queue's messages stay together and
        in order), else one group for the seed."""
        routes = self._routes
        if routes is not None:
            await routes.refresh_if_due()
        if routes is None or not routes.routing:
            return [_Group(batch, messages)]
        groups: Dict[int, _Group] = {}
        for pending, message in zip(batch, messages):
            leader = routes.leader_of(pending.queue)
            group = groups.get(leader)
            if group is None:
                group = groups[leader] = _Group([], [])
            group.pending.append(pending)
            group.messages.append(message)
        return list(groups.values())

    def _target(self, group: _Group) -> Tuple[int, "Client"]:
        """Where a group goes now: its first message's shard leader as known (that node
        forwards any other shard's messages), else the seed."""
        if self._routes is None:
            return NO_NODE, self._client
        return self._routes.route(group.pending[0].queue)

    async def _send_group(self, group: _Group, producer_id: str, number: int) -> None:
        """Sends one group (resending it when idempotent) and answers its callers."""
        # Built once: a resend carries the same request.
        request = AppendRequest(
            messages=group.messages,
            producer_id=producer_id,
            producer_name=self._client.producer_name,
        )
        backoff = self.options.retry_backoff_s
        attempt = 0
        while True:
            # A resend goes to the leader known now (the view is refreshed after a failure).
            node, client = self._target(group)
            try:
                offsets = await client.append_request(request)
                break
            except LeveeError as error:
                if self._routes is not None:
                    await self._routes.refresh_after_failure()
                earlier = [
                    done for batch_number, done in self._batches.items() if batch_number < number
                ]
                if producer_id and error.code == ErrorCode.SEQUENCE_GAP and earlier:
                    # An earlier batch of this producer is still on its way: once it is
                    # answered the gap is filled (or will never be), so wait, then resend.
                    await asyncio.wait([asyncio.ensure_future(e.wait()) for e in earlier])
                    self._stats.retries += 1
                    continue
                retryable = bool(producer_id) and error.code in RETRYABLE_CODES
                if not retryable or attempt >= self.options.retries_max:
                    self._failed_for_good(producer_id)
                    self._stats.batches_failed += 1
                    self._stats.messages_failed += len(group.pending)
                    for pending in group.pending:
                        if not pending.answer.done():
                            pending.answer.set_exception(type(error)(error.code, error.message))
                    return
                attempt += 1
                self._stats.retries += 1
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.options.retry_backoff_max_s)
        self._stats.batches_sent += 1
        self._stats.messages_sent += len(group.pending)
        if node != NO_NODE and self._routes is not None:
            self._stats.messages_to_leaders += sum(
                1 for pending in group.pending if self._routes.leader_of(pending.queue) == node
            )
        for pending, offset in zip(group.pending, offsets):
            if not pending.answer.done():
                pending.answer.set_result(offset)

    async def flush(self) -> None:
        """Waits until every message queued so far is answered."""
        while self._queued or self._tasks:
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
            else:
                await asyncio.sleep(0.0005)

    async def close(self) -> None:
        """Sends what is queued, waits for the answers, then stops."""
        self._closing = True
        self._wake.set()
        if self._runner is not None:
            await self._runner
        await self.flush()
        if self._routes is not None:
            await self._routes.close()

    async def __aenter__(self) -> "Producer":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
