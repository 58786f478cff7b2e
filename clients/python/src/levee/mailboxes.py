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
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Deque, Dict, List, Optional, Sequence

import grpc
import grpc.aio

from . import validation
from .errors import LeveeError, from_rpc_error, make_error
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

    def __init__(self, stream: Any, credit_messages: int) -> None:
        self._credit_messages = credit_messages
        self._received: Deque[MailboxDelivery] = deque()
        self._added = 0
        self._confirmed = 0
        self._taken_messages = 0
        self._taken_bytes = 0
        self._acks: Dict[int, int] = {}
        self._ack_sequence = 0
        self._acked_sequence = 0
        super().__init__(stream)

    @classmethod
    async def open(cls, client: "Client", consumer: str, credit_messages: int) -> "Mailboxes":
        validation.check_consumer(consumer)
        validation.check_credit(credit_messages)
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
            raise from_rpc_error(error) from None
        return cls(stream, credit_messages)

    def _take(self, response: Any) -> None:
        self._received.extend(
            MailboxDelivery(d.mailbox, d.offset, d.payload) for d in response.deliveries
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
        await self._send_acks()
        numbers = list(mailboxes)
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
        stream ended cleanly."""
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
        """Sends the recorded acks and returns once they (and every ack before) are durable."""
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
        acks: List[queue_pb2.MailboxAck] = [
            queue_pb2.MailboxAck(mailbox=mailbox, offset=offset)
            for mailbox, offset in self._acks.items()
        ]
        self._acks.clear()
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
