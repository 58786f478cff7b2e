"""Levee's Python client.

- `Client`: one connection to a server (asyncio), with the admin, hot-key admin, queue and
  topic calls; `levee.sync.Client` is the same for scripts, blocking.
- `HotKeys`: the app-server side of hot-key detection: `is_hot` (local, never raising), a local
  value cache with single-flight loading, hot/cool callbacks, batched reports, rendezvous
  routing over several servers identical to the Rust client's.
- `Producer`: batches appends from many callers; optionally idempotent.
- `Subscription`: one consumer's mailbox on one queue (`async for`), with credits and acks;
  `Mailboxes`: one stream over many queues (up to a million), one credit, batched acks;
  `Client.subscribe_following` / `subscribe_many_following` open ones that move to another
  member of the cluster by themselves when their node goes away.
- `GroupConsumer`: a consumer-group member: bounded parallelism, commits strictly in order.
  `MemberStream` is its raw Consume stream.
- `LeveeError` and its subclasses carry the wire `ErrorCode`.
- `topic_partition(key, partitions)`: the partition a key is published to (XXH3).
"""

from .client import Client, ClientOptions, Published, QueueMessage, Record
from .consumer import CommitResult, ConsumerOptions, ConsumerStats, GroupConsumer, MemberStream, Message
from .errors import *  # noqa: F401,F403  (LeveeError, ErrorCode and one class per code)
from .errors import ErrorCode, LeveeError
from .hotkeys import HotKeyChange, HotKeys, HotKeysOptions, HotKeysStats
from .limiter import Limiter, LimiterOptions, LimiterStats
from .mailboxes import MailboxDelivery, Mailboxes
from .producer import Producer, ProducerOptions, ProducerStats
from .routing import topic_partition
from .subscription import Delivery, Subscription

__version__ = "0.1.0"

__all__ = [
    "Client",
    "ClientOptions",
    "CommitResult",
    "ConsumerOptions",
    "ConsumerStats",
    "Delivery",
    "ErrorCode",
    "GroupConsumer",
    "HotKeyChange",
    "HotKeys",
    "HotKeysOptions",
    "HotKeysStats",
    "LeveeError",
    "Limiter",
    "LimiterOptions",
    "LimiterStats",
    "MailboxDelivery",
    "Mailboxes",
    "MemberStream",
    "Message",
    "Producer",
    "ProducerOptions",
    "ProducerStats",
    "Published",
    "QueueMessage",
    "Record",
    "Subscription",
    "topic_partition",
]
