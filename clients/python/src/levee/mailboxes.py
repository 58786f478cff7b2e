"""`Mailboxes`: one consumer's stream over many queues at once (an app server holding the
mailboxes of its connected users), with one credit and batched acks.

`add(queues)` numbers the queues it adds in order (0, 1, ...); every delivery names its
mailbox by that number, and the server pushes messages of any of them as they are appended.
Credit covers the whole stream: at most `credit_messages` delivered and not yet taken by
`next()`; taken messages give their credit back (once half the credit is taken, and whenever
`next()` is about to wait). Acks are cumulative per mailbox and buffered: `ack()` records one,
`next()` sends them (once `ACKS_BUFFERED_MAX` mailboxes wait, and whenever it is about to
wait), and `flush_acks()` sends them and returns once they are durable. Messages not acked are
delivered again to the next subscription of the same consumer, on this kind of stream or a
single-queue `Subscription` (they share the consumer's positions). What the reader holds is
bounded by the credit; the acks waiting by the mailboxes on the stream.

Opened with `Client.subscribe_many_following`, the stream follows the cluster: when its node
goes away (UNAVAILABLE, or a broken connection) it opens itself again through another member
(`following.Members`), adds every queue again under the same mailbox numbers (removed ones
removed again) and goes on, for up to 30 s per move. Delivery resumes after the consumer's last
confirmed ack: messages taken, or acked but not confirmed, are delivered again (at least once);
a `flush_acks` cut short raises UNAVAILABLE once the stream is open again. After a move, an ack
of a message taken before it is cut to what the new stream has delivered of its mailbox (the
server refuses an ack beyond that), so the rest comes again. What it keeps to move is bounded
by the mailboxes on the stream.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Deque, Dict, List, Optional, Sequence

import grpc
import grpc.aio

from . import validation
from .errors import ErrorCode, LeveeError, client_closed_error, from_rpc_error, make_error
from .stream import PushStream
from .v1 import common_pb2, queue_pb2
from .validation import BytesLike, to_bytes

if TYPE_CHECKING:
    from .client import Client

MAILBOXES_PER_REQUEST_MAX = 10_000
"""Most queues (or mailbox numbers, or acks) in one request: the server's bound."""
ACKS_BUFFERED_MAX = 1_024
"""Mailboxes with an ack waiting before `next()` sends them without being asked."""


@dataclass(frozen=True)
class MailboxDelivery:
    """One message of one mailbox."""

    mailbox: int
    offset: int
    payload: bytes


class Mailboxes(PushStream):
    """A consumer's stream over many queues; `async for delivery in mailboxes`."""

    def __init__(self, stream: Any, credit_messages: int, consumer: str = "") -> None:
        self._consumer = consumer
        self._credit_messages = credit_messages
        # Following the cluster: every queue added, in mailbox order, and the mailboxes
        # removed (to set a new stream up the same); None otherwise.
        self._queues: Optional[List[bytes]] = None
        self._removed: List[int] = []
        # Following: the offset after the last message delivered, by mailbox, over every
        # stream (after a move, a queue deleted meanwhile is told by it).
        self._delivered_until: Dict[int, int] = {}
        self._start()
        super().__init__(stream)

    def _start(self) -> None:
        """The state of a new stream."""
        self._received: Deque[MailboxDelivery] = deque()
        self._added = 0
        self._confirmed = 0
        self._taken_messages = 0
        self._taken_bytes = 0
        self._acks: Dict[int, int] = {}
        self._ack_sequence = 0
        self._acked_sequence = 0
        # Following: the offset after the last one received on this stream, by mailbox (what
        # an ack may reach after a move).
        self._received_until: Dict[int, int] = {}

    @classmethod
    async def open(cls, client: "Client", consumer: str, credit_messages: int) -> "Mailboxes":
        validation.check_consumer(consumer)
        validation.check_credit(credit_messages)
        stream = await cls._open_stream(client, consumer, credit_messages)
        return cls(stream, credit_messages, consumer)

    @staticmethod
    async def _open_stream(client: "Client", consumer: str, credit_messages: int) -> Any:
        """A new SubscribeMany stream through `client`, started."""
        stream = client.queues_stub.SubscribeMany()
        try:
            await stream.write(
                queue_pb2.SubscribeManyRequest(
                    start=queue_pb2.SubscribeManyStart(
                        consumer=consumer,
                        credit=common_pb2.Credit(messages=credit_messages, bytes=0),
                    )
                )
            )
        except grpc.RpcError as error:
            stream.cancel()
            raise from_rpc_error(error) from None
        except grpc.aio.UsageError as error:
            stream.cancel()
            raise client_closed_error(error) from None
        except BaseException:
            stream.cancel()
            raise
        return stream

    async def _follow(self, seed: "Client") -> None:
        self._queues = []
        await super()._follow(seed)

    async def _reopen_through(self, member: "Client") -> bool:
        await self._detach(moving=True)
        stream = await self._open_stream(member, self._consumer, self._credit_messages)
        self._start()
        self._attach(stream)
        await self._add_once(self._queues or [])
        await self._remove_once(self._removed)
        queues, removed = self._queues or [], set(self._removed)
        delivered: Dict[bytes, int] = {}
        for mailbox, until in self._delivered_until.items():
            if mailbox not in removed:
                name = queues[mailbox]
                delivered[name] = max(until, delivered.get(name, 0))
        await self._end_if_deleted(member, delivered)
        return True

    def _take(self, response: Any) -> None:
        self._received.extend(
            MailboxDelivery(d.mailbox, d.offset, d.payload) for d in response.deliveries
        )
        if self._queues is not None:
            for delivery in response.deliveries:
                self._received_until[delivery.mailbox] = delivery.offset + 1
                self._delivered_until[delivery.mailbox] = max(
                    delivery.offset + 1, self._delivered_until.get(delivery.mailbox, 0)
                )
        self._confirmed = max(self._confirmed, response.mailboxes_added)
        self._acked_sequence = max(self._acked_sequence, response.acked_sequence)

    async def add(self, queues: Sequence[BytesLike]) -> range:
        """Adds `queues` (each at most once per stream) and returns once the server registered
        them: their mailbox numbers, in order. Delivery of each starts after the consumer's
        last ack on it."""
        names = [to_bytes(queue) for queue in queues]
        for index, name in enumerate(names):
            try:
                validation.check_subscribe_queue(name)
            except LeveeError as error:  # the server names the queue by its place in the add
                position = index % MAILBOXES_PER_REQUEST_MAX
                raise make_error(error.code, f"queues[{position}]: {error.message}") from None
        first = self._added
        if self._queues is not None:
            self._queues.extend(names)
        # Not `_moved_instead`: the queues recorded are taken back only when the add was
        # refused, not when a move failed (the stream may still move later, with them).
        moves_seen = self._moves
        try:
            return await self._add_once(names)
        except LeveeError as error:
            if self._follows(error):
                # Opened again elsewhere with every queue added, these included.
                await self._moved(error, moves_seen, 0)
                return range(first, self._added)
            if self._queues is not None:
                del self._queues[first:]
            raise

    async def _add_once(self, names: List[bytes]) -> range:
        first = self._added
        for start in range(0, len(names), MAILBOXES_PER_REQUEST_MAX):
            chunk = names[start : start + MAILBOXES_PER_REQUEST_MAX]
            await self._write(
                queue_pb2.SubscribeManyRequest(add=queue_pb2.AddMailboxes(queues=chunk))
            )
            self._added += len(chunk)
        while self._confirmed < self._added:
            self._raise_if_ended()
            await self._wait()
        return range(first, self._added)

    async def remove(self, mailboxes: Sequence[int]) -> None:
        """Stops delivery from `mailboxes` (numbers are not reused). Acks recorded before are
        sent first; messages of theirs already received are still returned by `next()`."""
        numbers = list(mailboxes)
        if self._queues is not None:
            self._removed.extend(numbers)
        # When the stream moved instead, it opened again elsewhere with these removed.
        await self._moved_instead(lambda: self._remove_once(numbers))

    async def _remove_once(self, numbers: List[int]) -> None:
        await self._send_acks()
        for start in range(0, len(numbers), MAILBOXES_PER_REQUEST_MAX):
            await self._write(
                queue_pb2.SubscribeManyRequest(
                    remove=queue_pb2.RemoveMailboxes(
                        mailboxes=numbers[start : start + MAILBOXES_PER_REQUEST_MAX]
                    )
                )
            )

    async def next(self) -> Optional[MailboxDelivery]:
        """The next message of any mailbox, waiting until one is appended; None once the
        stream ended cleanly. A following stream whose node went away opens itself again
        elsewhere and goes on from the consumer's last confirmed acks."""
        return await self._through_moves(self._next_once)

    async def _next_once(self) -> Optional[MailboxDelivery]:
        while not self._received:
            # About to wait: give back all the credit taken and send the acks.
            await self._grant_credit()
            await self._send_acks()
            if self._received:
                break
            if self._ended is not None:
                if self._clean_end:
                    return None
                raise self._ended
            await self._wait()
        delivery = self._received.popleft()
        self._taken_messages += 1
        self._taken_bytes += len(delivery.payload)
        if self._taken_messages >= (self._credit_messages + 1) // 2:
            await self._grant_credit()
        if len(self._acks) >= ACKS_BUFFERED_MAX:
            await self._send_acks()
        return delivery

    def __aiter__(self) -> AsyncIterator[MailboxDelivery]:
        return self

    async def __anext__(self) -> MailboxDelivery:
        delivery = await self.next()
        if delivery is None:
            raise StopAsyncIteration
        return delivery

    def ack(self, mailbox: int, offset: int) -> None:
        """Records that every message of `mailbox` up to and including `offset` is done (it
        must have been delivered); sent by `next()` or `flush_acks()`."""
        self._acks[mailbox] = max(offset, self._acks.get(mailbox, offset))

    async def flush_acks(self) -> None:
        """Sends the recorded acks and returns once they (and every ack before) are durable.
        On a following stream whose node went away meanwhile, raises UNAVAILABLE once the
        stream is open again: the acks not confirmed are lost with the old stream, and their
        messages are delivered again."""
        if await self._moved_instead(self._flush_acks_once):
            raise make_error(
                ErrorCode.UNAVAILABLE,
                "the stream's node went away before the acks were confirmed; the stream is "
                "open again through another node and delivers the unconfirmed messages again",
            )

    async def _flush_acks_once(self) -> None:
        await self._send_acks()
        while self._acked_sequence < self._ack_sequence:
            self._raise_if_ended()
            await self._wait()

    async def _grant_credit(self) -> None:
        if self._taken_messages == 0:
            return
        credit = common_pb2.Credit(
            messages=self._taken_messages, bytes=min(self._taken_bytes, 2**32 - 1)
        )
        self._taken_messages = self._taken_bytes = 0
        await self._write(queue_pb2.SubscribeManyRequest(credit=credit))

    async def _send_acks(self) -> None:
        if not self._acks:
            return
        acked = self._acks.items()
        if self._moves:
            # A message taken before a move may not be delivered by this stream yet: each ack
            # reaches what this stream delivered of its mailbox (the rest comes again).
            acked = {
                mailbox: min(offset, self._received_until[mailbox] - 1)
                for mailbox, offset in acked
                if mailbox in self._received_until
            }.items()
        acks: List[queue_pb2.MailboxAck] = [
            queue_pb2.MailboxAck(mailbox=mailbox, offset=offset) for mailbox, offset in acked
        ]
        self._acks = {}
        if not acks:
            return
        for start in range(0, len(acks), MAILBOXES_PER_REQUEST_MAX):
            self._ack_sequence += 1
            await self._write(
                queue_pb2.SubscribeManyRequest(
                    ack=queue_pb2.MailboxAcks(
                        acks=acks[start : start + MAILBOXES_PER_REQUEST_MAX],
                        sequence=self._ack_sequence,
                    )
                )
            )

    async def __aenter__(self) -> "Mailboxes":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
