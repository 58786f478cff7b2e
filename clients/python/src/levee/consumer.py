"""Consumer groups: `MemberStream` (one raw Consume stream) and `GroupConsumer` (a member that
handles messages with bounded parallelism and commits strictly in order).

`GroupConsumer` joins the group on one stream, hands each delivered message to a handler (at
most `parallelism` at once; one at a time per partition when `ordered`), and commits each
partition's offsets in order: a partition's commit never passes a message whose handler has not
finished, so a later message finishing first never skips an earlier one. Credit is granted back
as messages finish, so the server never sends more than `credit_messages` unfinished messages
(back-pressure end to end; everything held here is bounded by it). When the stream breaks it
rejoins with exponential backoff, and the group redelivers from the last commit
(at-least-once). Commits refused as FENCED (the partition moved) are counted and the
partition's pending work is dropped.

`await consumer.following()` makes the member follow the cluster, as the Rust client's
`GroupConsumer::following`: when its stream breaks and its node does not answer within
`NODE_PROBE_TIMEOUT_S`, it rejoins through the next member of the cluster that does
(`following.Members`, learned when following is turned on).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    AsyncIterator,
    Awaitable,
    Callable,
    Deque,
    Dict,
    List,
    Optional,
    Set,
    Tuple,
)

import grpc
import grpc.aio

from . import validation
from .errors import ErrorCode, LeveeError, from_rpc_error, make_error
from .v1 import common_pb2, topic_pb2

if TYPE_CHECKING:
    from .client import Client
    from .following import Members

REQUESTS_QUEUED_MAX = 64
"""Requests waiting for the stream's writer."""
COMMITS_PER_BATCH_MAX = 1024
"""The server's bound on commits per CommitBatch."""
FINAL_COMMIT_WAIT_S = 5.0
LEAVE_WAIT_S = 2.0
"""How long leaving waits for the server to end the stream."""
NODE_PROBE_TIMEOUT_S = 1.0
"""How long a following consumer waits for its node to answer `server_info` after its stream
broke before it rejoins through another member (the Rust client's `NODE_PROBE_TIMEOUT`)."""


@dataclass(frozen=True)
class Message:
    """One delivered message of an owned partition."""

    partition: int
    offset: int
    payload: bytes
    epoch: int


@dataclass(frozen=True)
class CommitResult:
    """The server's answer to one commit: code UNSPECIFIED (0) when durable."""

    partition: int
    next_offset: int
    code: ErrorCode
    message: str


class MemberStream:
    """One member's raw Consume stream: the start, assignments, deliveries, credit, commits
    and heartbeats exactly as the wire has them. `GroupConsumer` builds on it; use it directly
    to control every step (the conformance runner does)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._write_lock = asyncio.Lock()

    @classmethod
    async def open(
        cls,
        client: "Client",
        topic: str,
        group: str,
        member: str,
        credit_messages: int = 1000,
        lease_ms: int = 10_000,
    ) -> "MemberStream":
        """Joins `group` on `topic` as `member`; the first `read()` is the assignment."""
        validation.check_group_on_topic(group, topic)
        validation.check_member(member)
        validation.check_credit(credit_messages)
        validation.check_lease_ms(lease_ms)
        stream = client.topics_stub.Consume()
        self = cls(stream)
        await self.write(
            topic_pb2.ConsumeRequest(
                start=topic_pb2.ConsumeStart(
                    topic=topic,
                    group=group,
                    member=member,
                    credit=common_pb2.Credit(messages=credit_messages, bytes=0),
                    lease_ms=lease_ms,
                )
            )
        )
        return self

    async def write(self, request: topic_pb2.ConsumeRequest) -> None:
        async with self._write_lock:
            try:
                await self._stream.write(request)
            except grpc.RpcError as error:
                raise from_rpc_error(error) from None
            except (grpc.aio.UsageError, RuntimeError, asyncio.InvalidStateError):
                raise await self._ended() from None

    async def _ended(self) -> LeveeError:
        try:
            while await self._stream.read() is not grpc.aio.EOF:
                pass
        except grpc.RpcError as error:
            return from_rpc_error(error)
        except Exception:
            pass
        return make_error(ErrorCode.UNAVAILABLE, "the consume stream closed")

    async def read(self) -> Optional[topic_pb2.ConsumeResponse]:
        """The next response; None when the server ended the stream cleanly."""
        try:
            response = await self._stream.read()
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        return None if response is grpc.aio.EOF else response

    async def grant(self, messages: int, payload_bytes: int = 0) -> None:
        await self.write(
            topic_pb2.ConsumeRequest(
                credit=common_pb2.Credit(messages=messages, bytes=min(payload_bytes, 2**32 - 1))
            )
        )

    async def commit(self, commits: List[topic_pb2.Commit]) -> None:
        """Sends one CommitBatch; its answer arrives as a response's commit_results."""
        await self.write(
            topic_pb2.ConsumeRequest(commit=topic_pb2.CommitBatch(commits=commits))
        )

    async def heartbeat(self) -> None:
        await self.write(topic_pb2.ConsumeRequest(heartbeat=topic_pb2.Heartbeat()))

    def close(self) -> None:
        """Ends the stream at once (the server drops the member when it notices)."""
        self._stream.cancel()

    async def leave(self) -> None:
        """Leaves the group: closes this side of the stream; the server then ends it (read
        until None to know the member is gone)."""
        try:
            async with self._write_lock:
                await self._stream.done_writing()
        except (grpc.RpcError, grpc.aio.UsageError, RuntimeError, asyncio.InvalidStateError):
            self._stream.cancel()


@dataclass(frozen=True)
class ConsumerOptions:
    """How a `GroupConsumer` runs."""

    member: Optional[str] = None
    """This member's id (default: a fresh one). A second stream with the same id replaces the first."""
    parallelism: int = 16
    """Handlers running at once."""
    ordered: bool = True
    """One message at a time per partition, in offset order. Commits stay in order either way."""
    credit_messages: int = 1000
    """Messages delivered but not finished, at most (1 to 100000)."""
    commit_interval_s: float = 0.1
    lease_s: float = 10.0
    """The server drops the member if it hears nothing for this long; heartbeats every third."""
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0

    def validate(self) -> None:
        if (
            self.parallelism < 1
            or not 1 <= self.credit_messages <= validation.CREDIT_MESSAGES_MAX
            or self.commit_interval_s <= 0
            or not 1.0 <= self.lease_s <= 300.0
        ):
            raise make_error(
                ErrorCode.INVALID_ARGUMENT,
                "parallelism must be at least 1, credit_messages 1 to 100000, "
                "commit_interval_s above 0 and lease_s 1 to 300",
            )


@dataclass
class ConsumerStats:
    """What a consumer did."""

    handled: int = 0
    commits: int = 0
    fenced_commits: int = 0
    refused_commits: int = 0
    assignments: int = 0
    streams: int = 0
    handler_errors: int = 0


@dataclass
class _Partition:
    epoch: int
    frontier: int
    committed: int
    waiting: Deque[Message] = field(default_factory=deque)
    running: int = 0
    finished: Set[int] = field(default_factory=set)


Handler = Callable[[Message], Awaitable[None]]


class GroupConsumer:
    """A consumer-group member. Either `await consumer.run(handler)` (bounded parallelism) or
    `async for message in consumer:` followed by `consumer.done(message)` for each message.
    `await consumer.following()` first makes it rejoin through another member of the cluster
    when its node goes away."""

    def __init__(
        self,
        client: "Client",
        topic: str,
        group: str,
        options: Optional[ConsumerOptions] = None,
    ) -> None:
        self._client = client
        # The node the member joins through: the client's, or with `following` the member of
        # the cluster it moved to.
        self._node = client
        self._members: "Optional[Members]" = None
        self.topic = topic
        self.group = group
        self.options = options or ConsumerOptions()
        self.options.validate()
        validation.check_group_on_topic(group, topic)
        self.member = self.options.member or f"member-{os.urandom(8).hex()}"
        validation.check_member(self.member)
        self._stats = ConsumerStats()
        self._partitions: Dict[int, _Partition] = {}
        self._stream: Optional[MemberStream] = None
        self._stopping = asyncio.Event()
        self._changed = asyncio.Event()
        self._ready_changed = asyncio.Event()
        self._handler: Optional[Handler] = None
        self._slots = 0  # handlers running now (run mode)
        self._ready: Deque[Message] = deque()  # iterator mode, bounded by the credit
        self._credit_owed = [0, 0]
        self._commits_awaiting = 0
        self._runner: "Optional[asyncio.Task[ConsumerStats]]" = None
        self._stream_number = 0
        # Iterator mode: messages handed out and not yet done, with their stream's number
        # (bounded by the credit).
        self._handed_out: Dict[Tuple[int, int, int], int] = {}
        self._error: Optional[BaseException] = None

    def stats(self) -> ConsumerStats:
        return ConsumerStats(**vars(self._stats))

    async def following(self) -> "GroupConsumer":
        """Makes this member follow the cluster, whose members it learns now from its client's
        node (as the Rust client's `GroupConsumer::following`): when its stream breaks and its
        node does not answer within `NODE_PROBE_TIMEOUT_S` (1 s), it rejoins through the next
        member of the cluster that does (the first node again when none does), with the
        usual backoff. In a cluster with replicated queues the group's coordinator is the
        topic's shard leader and commits go through the shard's log, so the member resumes
        after its last answered commit whichever node it rejoins through (docs/CLUSTER.md,
        "Consumer groups on the shards"); messages handled but not yet committed come again
        (at least once). Call it before `run` or iterating; the members' connections it opens
        are closed when the consumer finishes (`run` returns, `close`). Returns the consumer."""
        if self._members is None:
            from .following import Members

            self._members = await Members.learned_from(self._client)
        return self

    # ---- the two ways to consume

    async def run(
        self, handler: Handler, stop: Optional[asyncio.Event] = None
    ) -> ConsumerStats:
        """Runs `handler` on every message until `stop` is set (or `stop()` is called),
        rejoining after broken streams; on stop waits for running handlers, commits what
        finished and leaves. Errors retrying cannot fix (unknown topic, invalid input) raise."""
        self._handler = handler
        if stop is not None:
            watcher = asyncio.ensure_future(self._watch(stop))
        try:
            return await self._loop()
        finally:
            if stop is not None:
                watcher.cancel()

    async def _watch(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.stop()

    def stop(self) -> None:
        """Asks the consumer to finish: no new message is started."""
        self._stopping.set()
        self._changed.set()

    def __aiter__(self) -> AsyncIterator[Message]:
        if self._runner is None:
            self._runner = asyncio.ensure_future(self._loop())
        return self

    async def __anext__(self) -> Message:
        if self._runner is None:
            self._runner = asyncio.ensure_future(self._loop())
        runner = self._runner
        while True:
            self._ready_changed.clear()
            if self._ready:
                return self._ready.popleft()
            if runner.done():
                runner.result()  # raises the consumer's error
                raise StopAsyncIteration
            waiter = asyncio.ensure_future(self._ready_changed.wait())
            await asyncio.wait({waiter, runner}, return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
            waiter.cancel()

    def done(self, message: Message) -> None:
        """Marks a message from `async for` finished; commits follow in offset order."""
        stream = self._handed_out.pop((message.partition, message.offset, message.epoch), None)
        if stream is None:
            return  # not handed out by this consumer, or marked done already
        self._finish(message.partition, message.epoch, [message.offset], len(message.payload), stream)

    async def close(self) -> ConsumerStats:
        """Stops (iterator mode): commits what is done and leaves the group; closes the
        connections a following consumer opened."""
        self.stop()
        if self._runner is not None:
            return await self._runner
        await self._close_members()
        return self.stats()

    async def _close_members(self) -> None:
        members, self._members = self._members, None
        if members is not None:
            await members.close()

    # ---- internals

    def _finish(
        self, partition: int, epoch: int, offsets: List[int], payload_bytes: int, stream: int
    ) -> None:
        self._stats.handled += len(offsets)
        if stream != self._stream_number:
            return  # delivered on an earlier stream: its credit and commits died with it
        self._credit_owed[0] += len(offsets)
        self._credit_owed[1] += payload_bytes
        state = self._partitions.get(partition)
        if state is not None and state.epoch == epoch:
            state.running = max(0, state.running - 1)
            state.finished.update(offsets)
            while state.frontier in state.finished:
                state.finished.discard(state.frontier)
                state.frontier += 1
        self._changed.set()

    async def _loop(self) -> ConsumerStats:
        try:
            return await self._rejoining()
        finally:
            await self._close_members()

    async def _rejoining(self) -> ConsumerStats:
        backoff = self.options.backoff_initial_s
        while True:
            self._stats.streams += 1
            handled_before = self._stats.handled
            try:
                await self._one_stream()
                return self.stats()
            except LeveeError as error:
                if error.code in (ErrorCode.INVALID_ARGUMENT, ErrorCode.NOT_FOUND):
                    raise
            if self._stopping.is_set():
                return self.stats()
            if self._members is not None and not await self._node_answers():
                self._node = await self._members.next_member(NODE_PROBE_TIMEOUT_S)
            if self._stats.handled > handled_before:
                backoff = self.options.backoff_initial_s
            try:
                await asyncio.wait_for(self._stopping.wait(), backoff)
                return self.stats()
            except asyncio.TimeoutError:
                pass
            backoff = min(backoff * 2, self.options.backoff_max_s)

    async def _node_answers(self) -> bool:
        try:
            await asyncio.wait_for(self._node.server_info(), NODE_PROBE_TIMEOUT_S)
        except (LeveeError, asyncio.TimeoutError):
            return False
        return True

    async def _one_stream(self) -> None:
        self._stream_number += 1
        self._handed_out.clear()
        self._partitions = {}
        self._ready.clear()
        self._credit_owed = [0, 0]
        self._commits_awaiting = 0
        stream = await MemberStream.open(
            self._node,
            self.topic,
            self.group,
            self.member,
            self.options.credit_messages,
            int(self.options.lease_s * 1000),
        )
        self._stream = stream
        reader = asyncio.ensure_future(self._read(stream))
        ticker = asyncio.ensure_future(self._tick(stream))
        try:
            while True:
                self._changed.clear()
                self._dispatch()
                if self._credit_owed[0]:
                    messages, payload_bytes = self._credit_owed
                    self._credit_owed = [0, 0]
                    await stream.grant(messages, payload_bytes)
                if self._stopping.is_set() and self._idle():
                    await self._final_commit(stream)
                    # Leave, and wait (a little) for the server to end the stream, so that the
                    # member is gone from the group when run() returns.
                    await stream.leave()
                    await asyncio.wait({reader}, timeout=LEAVE_WAIT_S)
                    return
                if reader.done():
                    reader.result()  # the stream's error
                    raise make_error(ErrorCode.UNAVAILABLE, "the consume stream closed")
                if ticker.done():
                    ticker.result()
                waiter = asyncio.ensure_future(self._changed.wait())
                await asyncio.wait({waiter, reader, ticker}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        finally:
            for task in (reader, ticker):
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: its error, if any, was handled above
                task.cancel()
            stream.close()
            self._stream = None

    def _idle(self) -> bool:
        if self._handler is not None:
            return all(state.running == 0 for state in self._partitions.values())
        return True  # iterator mode: messages not yet done are redelivered later

    async def _read(self, stream: MemberStream) -> None:
        while True:
            response = await stream.read()
            if response is None:
                raise make_error(ErrorCode.UNAVAILABLE, "the consume stream closed")
            self._take(response)
            self._changed.set()

    def _take(self, response: topic_pb2.ConsumeResponse) -> None:
        if response.HasField("assignment"):
            self._stats.assignments += 1
            kept: Dict[int, _Partition] = {}
            for assigned in response.assignment.partitions:
                state = self._partitions.get(assigned.partition)
                if state is None or state.epoch != assigned.epoch:
                    state = _Partition(
                        epoch=assigned.epoch,
                        frontier=assigned.start_offset,
                        committed=assigned.start_offset,
                    )
                kept[assigned.partition] = state
            self._partitions = kept
            kept_ready: Deque[Message] = deque()
            for message in self._ready:
                if self._owns(message):
                    kept_ready.append(message)
                else:  # revoked before the caller took it: hand its credit back
                    self._handed_out.pop((message.partition, message.offset, message.epoch), None)
                    self._credit_owed[0] += 1
                    self._credit_owed[1] += len(message.payload)
            self._ready = kept_ready
        for delivery in response.deliveries:
            state = self._partitions.get(delivery.partition)
            if state is None or state.epoch != delivery.epoch:
                # Delivered for a partition revoked meanwhile: hand the credit back.
                self._credit_owed[0] += 1
                self._credit_owed[1] += len(delivery.payload)
                continue
            idle = not state.waiting and state.running == 0 and not state.finished
            if idle and delivery.offset > state.frontier:
                state.frontier = delivery.offset  # retention removed the messages between
            state.waiting.append(
                Message(delivery.partition, delivery.offset, delivery.payload, delivery.epoch)
            )
        if response.commit_results:
            self._commits_awaiting = max(0, self._commits_awaiting - 1)
            for result in response.commit_results:
                if result.code == 0:
                    self._stats.commits += 1
                elif result.code == ErrorCode.FENCED:
                    self._stats.fenced_commits += 1
                    self._partitions.pop(result.partition, None)
                else:
                    self._stats.refused_commits += 1

    def _owns(self, message: Message) -> bool:
        state = self._partitions.get(message.partition)
        return state is not None and state.epoch == message.epoch

    def _dispatch(self) -> None:
        if self._stopping.is_set():
            return
        for partition, state in self._partitions.items():
            if self._handler is None:
                # Iterator mode: hand every delivered message out in order.
                while state.waiting:
                    state.running += 1
                    message = state.waiting.popleft()
                    key = (message.partition, message.offset, message.epoch)
                    self._handed_out[key] = self._stream_number
                    self._ready.append(message)
                    self._ready_changed.set()
                continue
            while state.waiting and (not self.options.ordered or state.running == 0):
                if self._slots >= self.options.parallelism:
                    return
                if self.options.ordered:
                    job = list(state.waiting)
                    state.waiting.clear()
                else:
                    job = [state.waiting.popleft()]
                state.running += 1
                self._slots += 1
                asyncio.ensure_future(self._handle(job, self._stream_number))

    async def _handle(self, job: List[Message], stream: int) -> None:
        assert self._handler is not None
        offsets: List[int] = []
        payload_bytes = 0
        try:
            for message in job:
                try:
                    await self._handler(message)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    # A handler that raises still finishes its message (at-most-once for it),
                    # as the Rust client's handlers return nothing; it is counted.
                    self._stats.handler_errors += 1
                offsets.append(message.offset)
                payload_bytes += len(message.payload)
        finally:
            self._slots -= 1
            self._finish(job[0].partition, job[0].epoch, offsets, payload_bytes, stream)

    def _commits_due(self) -> List[topic_pb2.Commit]:
        due: List[topic_pb2.Commit] = []
        for partition, state in self._partitions.items():
            if state.frontier > state.committed and len(due) < COMMITS_PER_BATCH_MAX:
                state.committed = state.frontier
                due.append(
                    topic_pb2.Commit(
                        partition=partition, epoch=state.epoch, next_offset=state.frontier
                    )
                )
        return due

    async def _tick(self, stream: MemberStream) -> None:
        loop = asyncio.get_running_loop()
        heartbeat_every = self.options.lease_s / 3
        next_heartbeat = loop.time() + heartbeat_every
        while True:
            await asyncio.sleep(self.options.commit_interval_s)
            due = self._commits_due()
            if due:
                self._commits_awaiting += 1
                await stream.commit(due)
            if loop.time() >= next_heartbeat:
                await stream.heartbeat()
                next_heartbeat = loop.time() + heartbeat_every

    async def _final_commit(self, stream: MemberStream) -> None:
        due = self._commits_due()
        if due:
            self._commits_awaiting += 1
            await stream.commit(due)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FINAL_COMMIT_WAIT_S
        while True:
            self._changed.clear()
            left = deadline - loop.time()
            if self._commits_awaiting <= 0 or left <= 0:
                return
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return
