"""The synchronous facade, for scripts: the same calls as the asyncio API, run on a private
event loop thread. `levee.sync.Client.connect(address)` returns a client whose methods block
and return plain values; subscriptions iterate with a plain `for`, group consumers run a plain
function as handler (on a pool of `parallelism` threads)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import threading
from typing import Any, Callable, Coroutine, Iterator, Optional, Sequence, TypeVar

from .client import Client as AsyncClient
from .client import ClientOptions
from .consumer import ConsumerOptions, ConsumerStats, GroupConsumer, Message
from .mailboxes import MailboxDelivery, Mailboxes
from .producer import Producer as AsyncProducer
from .producer import ProducerOptions, ProducerStats
from .subscription import Delivery
from .subscription import Subscription as AsyncSubscription
from .validation import BytesLike

T = TypeVar("T")


class _LoopThread:
    """An event loop on a daemon thread; `run` blocks the caller until a coroutine is done."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="levee-sync", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: Optional[float] = None) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)


class Client:
    """A blocking client. Every coroutine method of `levee.Client` is available here as a
    plain method with the same arguments and results."""

    def __init__(self, runner: _LoopThread, client: AsyncClient) -> None:
        self._runner = runner
        self._client = client

    @classmethod
    def connect(cls, address: str, options: Optional[ClientOptions] = None) -> "Client":
        runner = _LoopThread()
        try:
            client = runner.run(AsyncClient.connect(address, options))
        except BaseException:
            runner.stop()
            raise
        return cls(runner, client)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not inspect.iscoroutinefunction(attribute):
            return attribute

        @functools.wraps(attribute)
        def blocking(*args: Any, **kwargs: Any) -> Any:
            return self._runner.run(attribute(*args, **kwargs))

        return blocking

    @property
    def options(self) -> ClientOptions:
        return self._client.options

    def subscribe(self, queue: BytesLike, consumer: str, credit_messages: int = 100) -> "Subscription":
        return Subscription(
            self._runner, self._runner.run(self._client.subscribe(queue, consumer, credit_messages))
        )

    def subscribe_following(
        self, queue: BytesLike, consumer: str, credit_messages: int = 100
    ) -> "Subscription":
        """`subscribe` that moves to another member when its node goes away (see
        `levee.Client.subscribe_following`)."""
        return Subscription(
            self._runner,
            self._runner.run(self._client.subscribe_following(queue, consumer, credit_messages)),
        )

    def subscribe_many(self, consumer: str, credit_messages: int = 1000) -> "SyncMailboxes":
        return SyncMailboxes(
            self._runner, self._runner.run(self._client.subscribe_many(consumer, credit_messages))
        )

    def subscribe_many_following(
        self, consumer: str, credit_messages: int = 1000
    ) -> "SyncMailboxes":
        """`subscribe_many` that moves to another member when its node goes away (see
        `levee.Client.subscribe_many_following`)."""
        return SyncMailboxes(
            self._runner,
            self._runner.run(self._client.subscribe_many_following(consumer, credit_messages)),
        )

    def producer(self, options: Optional[ProducerOptions] = None) -> "Producer":
        return Producer(self._runner, self._runner.run(_make_producer(self._client, options)))

    def group_consumer(
        self, topic: str, group: str, options: Optional[ConsumerOptions] = None
    ) -> "SyncGroupConsumer":
        consumer = self._runner.run(_make_consumer(self._client, topic, group, options))
        return SyncGroupConsumer(self._runner, consumer)

    def close(self) -> None:
        try:
            self._runner.run(self._client.close(), 5)
        finally:
            self._runner.stop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _make_producer(client: AsyncClient, options: Optional[ProducerOptions]) -> AsyncProducer:
    return AsyncProducer(client, options)  # built inside the loop that will run it


async def _make_consumer(
    client: AsyncClient, topic: str, group: str, options: Optional[ConsumerOptions]
) -> GroupConsumer:
    return GroupConsumer(client, topic, group, options)


class Subscription:
    """A blocking mailbox: `for delivery in subscription:` then `subscription.ack(offset)`."""

    def __init__(self, runner: _LoopThread, subscription: AsyncSubscription) -> None:
        self._runner = runner
        self._subscription = subscription

    @property
    def start_offset(self) -> int:
        """Where delivery started (again, after a following subscription moved)."""
        return self._subscription.start_offset

    def next(self, timeout_s: Optional[float] = None) -> Optional[Delivery]:
        """The next message; None once the stream ended. Raises TimeoutError after timeout_s
        (nothing is lost: the subscription stays usable)."""
        try:
            return self._runner.run(asyncio.wait_for(self._subscription.next(), timeout_s))
        except asyncio.TimeoutError:
            raise TimeoutError(f"no message within {timeout_s} s") from None

    def __iter__(self) -> Iterator[Delivery]:
        while True:
            delivery = self.next()
            if delivery is None:
                return
            yield delivery

    def ack(self, offset: int) -> None:
        self._runner.run(self._subscription.ack(offset))

    def close(self) -> None:
        self._runner.run(self._subscription.close())

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncMailboxes:
    """A blocking many-queue stream: `add`, `next(timeout_s)`, `ack`, `flush_acks`."""

    def __init__(self, runner: _LoopThread, mailboxes: Mailboxes) -> None:
        self._runner = runner
        self._mailboxes = mailboxes

    def add(self, queues: Sequence[BytesLike]) -> range:
        return self._runner.run(self._mailboxes.add(queues))

    def remove(self, mailboxes: Sequence[int]) -> None:
        self._runner.run(self._mailboxes.remove(mailboxes))

    def next(self, timeout_s: Optional[float] = None) -> Optional[MailboxDelivery]:
        try:
            return self._runner.run(asyncio.wait_for(self._mailboxes.next(), timeout_s))
        except asyncio.TimeoutError:
            raise TimeoutError(f"no message within {timeout_s} s") from None

    def ack(self, mailbox: int, offset: int) -> None:
        self._mailboxes.ack(mailbox, offset)

    def flush_acks(self) -> None:
        self._runner.run(self._mailboxes.flush_acks())

    def close(self) -> None:
        self._runner.run(self._mailboxes.close())

    def __enter__(self) -> "SyncMailboxes":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Producer:
    """A blocking producer: `send` returns the offset once durable; `send_async` returns a
    `concurrent.futures.Future` so one thread can pipeline many messages."""

    def __init__(self, runner: _LoopThread, producer: AsyncProducer) -> None:
        self._runner = runner
        self._producer = producer

    def send(self, queue: BytesLike, payload: BytesLike) -> int:
        return self._runner.run(self._producer.send(queue, payload))

    def send_async(self, queue: BytesLike, payload: BytesLike) -> "concurrent.futures.Future[int]":
        return asyncio.run_coroutine_threadsafe(self._producer.send(queue, payload), self._runner.loop)

    def stats(self) -> ProducerStats:
        return self._producer.stats()

    def flush(self) -> None:
        self._runner.run(self._producer.flush())

    def close(self) -> None:
        self._runner.run(self._producer.close())

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncGroupConsumer:
    """A blocking group consumer: `run(handler, stop)` runs `handler(message)` on a pool of
    `parallelism` threads until `stop` (a threading.Event) is set."""

    def __init__(self, runner: _LoopThread, consumer: GroupConsumer) -> None:
        self._runner = runner
        self._consumer = consumer
        self.member = consumer.member

    def following(self) -> "SyncGroupConsumer":
        """Makes this member follow the cluster, whose members it learns now (see
        `levee.GroupConsumer.following`): when its stream breaks and its node does not answer
        within 1 s, it rejoins through the next member of the cluster that does. Call it
        before `run`; the members' connections it opens are closed when `run` returns.
        Returns the consumer: `client.group_consumer(topic, group).following()`."""
        self._runner.run(self._consumer.following())
        return self

    def run(self, handler: Callable[[Message], None], stop: threading.Event) -> ConsumerStats:
        pool = concurrent.futures.ThreadPoolExecutor(self._consumer.options.parallelism)

        async def handle(message: Message) -> None:
            await asyncio.get_running_loop().run_in_executor(pool, handler, message)

        async def main() -> ConsumerStats:
            asyncio_stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            threading.Thread(
                target=lambda: (stop.wait(), loop.call_soon_threadsafe(asyncio_stop.set)),
                daemon=True,
            ).start()
            return await self._consumer.run(handle, asyncio_stop)

        try:
            return self._runner.run(main())
        finally:
            pool.shutdown(wait=True)

    def stats(self) -> ConsumerStats:
        return self._consumer.stats()
