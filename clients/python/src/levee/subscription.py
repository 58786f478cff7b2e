"""`Subscription`: one consumer's mailbox stream on one queue, with credits and acks.

The server pushes messages as they are appended, never more than the credit granted, starting
after the consumer's last ack; messages delivered but not acked are delivered again to the next
subscription of the same consumer. `ack(offset)` is cumulative, returns once durable, and
grants the acked messages' credit back. The stream machinery (a reader bounded by the credit,
waits that a timeout may cancel without loss) is `PushStream`'s.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Deque, Optional, Tuple

import grpc
import grpc.aio

from . import validation
from .errors import ErrorCode, from_rpc_error, make_error
from .stream import PushStream
from .v1 import common_pb2, queue_pb2

if TYPE_CHECKING:
    from .client import Client


@dataclass(frozen=True)
class Delivery:
    """One message of the subscribed queue."""

    offset: int
    payload: bytes


class Subscription(PushStream):
    """A consumer's subscription to one queue; `async for delivery in subscription`."""

    def __init__(self, stream: Any, first: Any) -> None:
        self.start_offset: int = first.start_offset
        """Where delivery started: the offset after the consumer's last ack."""
        self._received: Deque[Delivery] = deque(
            Delivery(d.offset, d.payload) for d in first.deliveries
        )
        # Handed to the caller and not yet acked: (offset, payload bytes), for the credit.
        self._unacked: Deque[Tuple[int, int]] = deque()
        self._acked_offset: int = first.acked_offset
        super().__init__(stream)

    @classmethod
    async def open(
        cls, client: "Client", queue: bytes, consumer: str, credit_messages: int
    ) -> "Subscription":
        validation.check_subscribe_queue(queue)
        validation.check_consumer(consumer)
        validation.check_credit(credit_messages)
        stream = client.queues_stub.Subscribe()
        start = queue_pb2.SubscribeRequest(
            start=queue_pb2.SubscribeStart(
                queue=queue,
                consumer=consumer,
                credit=common_pb2.Credit(messages=credit_messages, bytes=0),
            )
        )
        try:
            await stream.write(start)
            first = await stream.read()
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        if first is grpc.aio.EOF:
            raise make_error(ErrorCode.UNAVAILABLE, "the server closed the subscription")
        if not first.HasField("start_offset"):
            stream.cancel()
            raise make_error(
                ErrorCode.INTERNAL, "the server's first subscription message has no start_offset"
            )
        return cls(stream, first)

    def _take(self, response: Any) -> None:
        self._received.extend(Delivery(d.offset, d.payload) for d in response.deliveries)
        if response.acked_offset > self._acked_offset:
            self._acked_offset = response.acked_offset

    async def next(self) -> Optional[Delivery]:
        """The next message, waiting until one is appended; None once the stream has ended
        cleanly. Raises the server's error when it ended the stream with one."""
        while True:
            if self._received:
                delivery = self._received.popleft()
                self._unacked.append((delivery.offset, len(delivery.payload)))
                return delivery
            if self._ended is not None:
                if self._clean_end:
                    return None
                raise self._ended
            await self._wait()

    def __aiter__(self) -> AsyncIterator[Delivery]:
        return self

    async def __anext__(self) -> Delivery:
        delivery = await self.next()
        if delivery is None:
            raise StopAsyncIteration
        return delivery

    async def ack(self, offset: int) -> None:
        """Marks every delivered message up to and including `offset` done and grants their
        credit back; returns once the server made the ack durable."""
        messages = 0
        payload_bytes = 0
        while self._unacked and self._unacked[0][0] <= offset:
            payload_bytes += self._unacked.popleft()[1]
            messages += 1
        await self._write(queue_pb2.SubscribeRequest(ack=queue_pb2.Ack(offset=offset)))
        while self._acked_offset <= offset:
            self._raise_if_ended()
            await self._wait()
        # The credit goes once the ack is answered: a refused ack ends the stream, and a write
        # after that would hide the server's error behind the transport's.
        if messages:
            await self._write(
                queue_pb2.SubscribeRequest(
                    credit=common_pb2.Credit(
                        messages=messages, bytes=min(payload_bytes, 2**32 - 1)
                    )
                )
            )

    async def __aenter__(self) -> "Subscription":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
