"""`Subscription`: one consumer's mailbox stream on one queue, with credits and acks.

The server pushes messages as they are appended, never more than the credit granted, starting
after the consumer's last ack; messages delivered but not acked are delivered again to the next
subscription of the same consumer. `ack(offset)` is cumulative, returns once durable, and
grants the acked messages' credit back. The stream machinery (a reader bounded by the credit,
waits that a timeout may cancel without loss, moving to another node) is `PushStream`'s.

Opened with `Client.subscribe_following`, the subscription follows the cluster: when its node
goes away it opens itself again through another member and goes on from the consumer's last
confirmed ack (`start_offset` then says where); an ack cut short by the move returns normally
if the subscription opened again after it, and raises UNAVAILABLE otherwise (the messages after
the last confirmed ack are delivered again). After a move, an ack of a message taken before it
is cut to what the new stream has delivered (the server refuses an ack beyond that), so the
rest comes again.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Deque, Optional, Tuple

import grpc
import grpc.aio

from . import validation
from .errors import ErrorCode, client_closed_error, from_rpc_error, make_error
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

    def __init__(self, stream: Any, first: Any, opened: Tuple[bytes, str, int]) -> None:
        self._start(first)
        # What the subscription was opened with (queue, consumer, credit): to open it again.
        self._opened = opened
        # The offset after the last message delivered, over every stream (after a move, a
        # queue deleted meanwhile is told by it); 0 before any.
        self._delivered_until = self._received_until if first.deliveries else 0
        super().__init__(stream)

    def _start(self, first: Any) -> None:
        """The state of a stream that begins with the server's `first` response."""
        self.start_offset: int = first.start_offset
        """Where delivery started: the offset after the consumer's last ack."""
        self._received: Deque[Delivery] = deque(
            Delivery(d.offset, d.payload) for d in first.deliveries
        )
        # The offset after the last one received on this stream (what an ack may reach).
        self._received_until: int = first.start_offset
        if first.deliveries:
            self._received_until = first.deliveries[-1].offset + 1
        # Handed to the caller and not yet acked: (offset, payload bytes), for the credit.
        self._unacked: Deque[Tuple[int, int]] = deque()
        self._acked_offset: int = first.acked_offset

    @classmethod
    async def open(
        cls, client: "Client", queue: bytes, consumer: str, credit_messages: int
    ) -> "Subscription":
        validation.check_subscribe_queue(queue)
        validation.check_consumer(consumer)
        validation.check_credit(credit_messages)
        stream, first = await cls._open_stream(client, queue, consumer, credit_messages)
        return cls(stream, first, (queue, consumer, credit_messages))

    @staticmethod
    async def _open_stream(
        client: "Client", queue: bytes, consumer: str, credit_messages: int
    ) -> Tuple[Any, Any]:
        """A new Subscribe stream through `client` and the server's first response."""
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
            stream.cancel()
            raise from_rpc_error(error) from None
        except grpc.aio.UsageError as error:
            stream.cancel()
            raise client_closed_error(error) from None
        except BaseException:
            stream.cancel()
            raise
        if first is grpc.aio.EOF:
            raise make_error(ErrorCode.UNAVAILABLE, "the server closed the subscription")
        if not first.HasField("start_offset"):
            stream.cancel()
            raise make_error(
                ErrorCode.INTERNAL, "the server's first subscription message has no start_offset"
            )
        return stream, first

    async def _reopen_through(self, member: "Client") -> bool:
        await self._detach(moving=True)
        stream, first = await self._open_stream(member, *self._opened)
        self._start(first)
        self._attach(stream)
        if self._delivered_until > 0:
            await self._end_if_deleted(member, {self._opened[0]: self._delivered_until})
        self._delivered_until = max(self._delivered_until, self._received_until)
        return True

    def _take(self, response: Any) -> None:
        self._received.extend(Delivery(d.offset, d.payload) for d in response.deliveries)
        if response.deliveries:
            self._received_until = max(self._received_until, response.deliveries[-1].offset + 1)
            self._delivered_until = max(self._delivered_until, self._received_until)
        if response.acked_offset > self._acked_offset:
            self._acked_offset = response.acked_offset

    async def next(self) -> Optional[Delivery]:
        """The next message, waiting until one is appended; None once the stream has ended
        cleanly. Raises the server's error when it ended the stream with one. A following
        subscription whose node went away opens itself again elsewhere and goes on from the
        consumer's last confirmed ack."""
        return await self._through_moves(self._next_once)

    async def _next_once(self) -> Optional[Delivery]:
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
        credit back; returns once the server made the ack durable. On a following
        subscription whose node went away meanwhile: returns if the subscription opened again
        after `offset`, else raises UNAVAILABLE once it is open again (the messages after its
        last confirmed ack are delivered again)."""
        if not await self._moved_instead(lambda: self._ack_once(offset)):
            return
        if offset < self.start_offset:
            return  # confirmed after all: the stream opened again after it
        raise make_error(
            ErrorCode.UNAVAILABLE,
            f"the subscription's node went away before the ack of offset {offset} was "
            "confirmed; the subscription is open again through another node from offset "
            f"{self.start_offset} and delivers the unconfirmed messages again",
        )

    async def _ack_once(self, offset: int) -> None:
        if self._moves:
            # A message taken before a move may not be delivered by this stream yet: the ack
            # reaches what it delivered (the rest comes again).
            if offset < self.start_offset:
                return
            offset = min(offset, self._received_until - 1)
            if offset < self.start_offset:
                return
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
