"""Client-side checks of what the server would refuse, with the server's code and message.

One home per bound (the values are those documented in proto/levee/v1/*.proto) and one check
per kind of name. Each check raises `InvalidArgumentError` with exactly the message the server
sends for the same input, so that a caller sees the same error whether the client or the
server caught it (tests/test_validation.py compares both against a real server).
"""

from __future__ import annotations

import math
import re
from typing import Union

from .errors import ErrorCode, LeveeError, make_error

BytesLike = Union[bytes, bytearray, memoryview, str]

QUEUE_NAME_BYTES_MAX = 255
TOPIC_BYTES_MAX = 200
PARTITIONS_MAX = 1024
GROUP_BYTES_MAX = 64
MEMBER_BYTES_MAX = 64
CONSUMER_BYTES_MAX = 64
PRODUCER_ID_BYTES_MAX = 64
PRODUCER_NAME_BYTES_MAX = 64
GROUP_AND_TOPIC_BYTES_MAX = QUEUE_NAME_BYTES_MAX - len(b"\0commit\0") - 1
APP_BYTES_MAX = 128
HOT_KEY_BYTES_MAX_DEFAULT = 1024
HOT_DURATION_MS_MAX = 86_400_000
MESSAGES_PER_REQUEST_MAX = 10_000
MESSAGE_BYTES_MAX_DEFAULT = 1 << 20
CREDIT_MESSAGES_MAX = 100_000
LEASE_MS_MIN = 1_000
LEASE_MS_MAX = 300_000
READ_MESSAGES_MAX = 10_000
READ_BYTES_MAX = 4 << 20
TOP_KEYS_LIMIT_MAX = 1_000
DELAY_MS_MAX = 604_800_000

assert GROUP_BYTES_MAX <= GROUP_AND_TOPIC_BYTES_MAX and TOPIC_BYTES_MAX <= GROUP_AND_TOPIC_BYTES_MAX

_APP_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}\Z")
_TOPIC_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,200}\Z")


def to_bytes(value: BytesLike) -> bytes:
    """Names and payloads may be given as bytes or text (encoded as UTF-8)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"expected bytes or str, got {type(value).__name__}")


def invalid(message: str) -> LeveeError:
    return make_error(ErrorCode.INVALID_ARGUMENT, message)


def check_append_queue(queue: bytes) -> None:
    """A queue named in an append, read, info or delete (the store's message)."""
    if not queue or len(queue) > QUEUE_NAME_BYTES_MAX:
        raise invalid(
            f"queue name must be 1 to {QUEUE_NAME_BYTES_MAX} bytes, got {len(queue)} bytes; "
            "fix the request"
        )


def check_not_reserved(queue: bytes) -> None:
    if queue[:1] == b"\0":
        raise invalid("queue names starting with a zero byte are reserved for the server")


def check_subscribe_queue(queue: bytes) -> None:
    """A queue named by a subscription (the broker's message)."""
    if not queue or len(queue) > QUEUE_NAME_BYTES_MAX:
        raise invalid(f"queue name must be 1 to {QUEUE_NAME_BYTES_MAX} bytes, got {len(queue)}")
    check_not_reserved(queue)


def check_payload(payload: bytes, message_bytes_max: int) -> None:
    if len(payload) > message_bytes_max:
        raise invalid(
            f"message of {len(payload)} bytes is over message_bytes_max ({message_bytes_max}); "
            "fix the request"
        )


def check_message_count(count: int, call: str) -> None:
    """`call` is `append` or `publish`."""
    if not 1 <= count <= MESSAGES_PER_REQUEST_MAX:
        raise invalid(
            f"messages: send 1 to {MESSAGES_PER_REQUEST_MAX} messages per {call}, got {count}"
        )


def _check_length(field: str, value: str, maximum: int) -> None:
    length = len(value.encode("utf-8"))
    if not 1 <= length <= maximum:
        raise invalid(f"{field} must be 1 to {maximum} bytes, got {length}")


def check_producer_id(producer_id: str) -> None:
    """An idempotent producer's id (empty means not idempotent and is not checked)."""
    if producer_id:
        _check_length("producer_id", producer_id, PRODUCER_ID_BYTES_MAX)


def check_producer_name(producer_name: str) -> None:
    _check_length("producer_name", producer_name, PRODUCER_NAME_BYTES_MAX)


def check_consumer(consumer: str) -> None:
    _check_length("consumer", consumer, CONSUMER_BYTES_MAX)


def check_group(group: str) -> None:
    _check_length("group", group, GROUP_BYTES_MAX)


def check_member(member: str) -> None:
    _check_length("member", member, MEMBER_BYTES_MAX)


def check_topic(topic: str) -> None:
    if not _TOPIC_PATTERN.match(topic) or not topic.isascii():
        raise invalid(
            f"topic '{topic}': a name is 1 to {TOPIC_BYTES_MAX} ASCII letters, digits, '.', "
            "'_' or '-'"
        )


def check_group_on_topic(group: str, topic: str) -> None:
    check_group(group)
    check_topic(topic)
    length = len(group.encode("utf-8")) + len(topic)
    if length > GROUP_AND_TOPIC_BYTES_MAX:
        raise invalid(
            f"group '{group}' on topic '{topic}': the two names together must be at most "
            f"{GROUP_AND_TOPIC_BYTES_MAX} bytes, got {length}; use a shorter group name"
        )


def check_partitions(partitions: int) -> None:
    if not 1 <= partitions <= PARTITIONS_MAX:
        raise invalid(f"partitions must be 1 to {PARTITIONS_MAX}, got {partitions}")


def check_credit(messages: int) -> None:
    if not 1 <= messages <= CREDIT_MESSAGES_MAX:
        raise invalid(f"credit.messages must be 1 to {CREDIT_MESSAGES_MAX}, got {messages}")


def check_lease_ms(lease_ms: int) -> None:
    if lease_ms != 0 and not LEASE_MS_MIN <= lease_ms <= LEASE_MS_MAX:
        raise invalid(
            f"lease_ms must be {LEASE_MS_MIN} to {LEASE_MS_MAX} (or 0 for 10000), got {lease_ms}"
        )


def check_app(app: str) -> None:
    if not _APP_PATTERN.match(app) or not app.isascii():
        raise invalid(
            f"app name must be 1 to {APP_BYTES_MAX} bytes of letters, digits, '-', '_' or '.', "
            f"got '{app}'"
        )


def check_hot_key(app: str, key: bytes, key_bytes_max: int) -> None:
    if not key:
        raise invalid(f"app '{app}': empty key; report keys of 1 to {key_bytes_max} bytes")
    if len(key) > key_bytes_max:
        raise invalid(
            f"app '{app}': key of {len(key)} bytes is longer than the maximum {key_bytes_max}; "
            "shorten it or raise key_bytes_max"
        )


def check_hot_duration(app: str, duration_ms: int) -> None:
    if not 1 <= duration_ms <= HOT_DURATION_MS_MAX:
        raise invalid(
            f"app '{app}': hot duration must be between 1 and {HOT_DURATION_MS_MAX} ms, "
            f"got {duration_ms}"
        )


def check_read(max_messages: int, max_bytes: int) -> None:
    if max_messages > READ_MESSAGES_MAX:
        raise invalid(
            f"max_messages must be 1 to {READ_MESSAGES_MAX} (or 0 for 100), got {max_messages}"
        )
    if max_bytes > READ_BYTES_MAX:
        raise invalid(
            f"max_bytes must be at most {READ_BYTES_MAX} (or 0 for 1048576), got {max_bytes}"
        )


def check_top_keys_limit(limit: int) -> None:
    if not 1 <= limit <= TOP_KEYS_LIMIT_MAX:
        raise invalid(f"limit must be 1 to {TOP_KEYS_LIMIT_MAX}, got {limit}")


def check_delay_ms(delay_ms: int, producer_id: str = "") -> None:
    """A published message's delay (ms from now; 0: not delayed), and that a delayed one is
    not published with a producer_id."""
    if delay_ms < 0:
        raise invalid(f"delay_ms is a delay from now, 0 (none) or more, got {delay_ms}")
    if delay_ms > DELAY_MS_MAX:
        raise invalid(f"delay_ms is at most {DELAY_MS_MAX} (7 days), got {delay_ms}")
    if delay_ms > 0 and producer_id:
        raise invalid(
            "a delayed message cannot have a producer_id (delayed messages are not "
            "deduplicated); publish it without one"
        )


def delay_s_to_ms(delay_s: float) -> int:
    """A delay of 0 to 7 days given in seconds, as the wire's whole ms."""
    valid = (
        isinstance(delay_s, (int, float))
        and not isinstance(delay_s, bool)
        and math.isfinite(delay_s)
        and delay_s >= 0
        and round(delay_s * 1000) <= DELAY_MS_MAX
    )
    if not valid:
        raise invalid(
            f"delay_s is a delay from now in seconds, 0 to {DELAY_MS_MAX // 1000} (7 days), "
            f"got {delay_s!r}"
        )
    return round(delay_s * 1000)
