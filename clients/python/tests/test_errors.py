"""The error codes are pinned to the proto, and statuses map to typed errors as the Rust
client maps them."""

from __future__ import annotations

import pickle

import grpc
import pytest

import levee
from levee.errors import ERROR_CLASSES, ErrorCode, from_rpc_error, make_error
from levee.v1 import errors_pb2

from conftest import run

# Every code ever published: a code is never renumbered or reused (as in levee-proto).
PINNED = {
    "UNSPECIFIED": 0, "INTERNAL": 1000, "INVALID_ARGUMENT": 1001, "UNAVAILABLE": 1002,
    "RESOURCE_EXHAUSTED": 1003, "DEADLINE_EXCEEDED": 1004, "NOT_FOUND": 1005,
    "ALREADY_EXISTS": 1006, "FAILED_PRECONDITION": 1007, "STORAGE_FAILED": 1008,
    "UNIMPLEMENTED": 1009, "FENCED": 3001, "SEQUENCE_GAP": 3002, "SEQUENCE_TOO_OLD": 3003,
    "OFFSET_OUT_OF_RANGE": 3004,
}


def test_given_proto_enum_then_client_codes_are_exactly_the_pinned_ones() -> None:
    from_proto = {
        name[len("ERROR_CODE_"):]: number
        for name, number in errors_pb2.ErrorCode.items()
    }
    assert from_proto == PINNED, "errors.proto changed: update ErrorCode and this table"
    assert {code.name: int(code) for code in ErrorCode} == PINNED


def test_given_every_code_then_a_typed_error_carries_it() -> None:
    for code in ErrorCode:
        if code == ErrorCode.UNSPECIFIED:
            continue
        error = make_error(int(code), "why")
        assert isinstance(error, levee.LeveeError)
        assert type(error) is ERROR_CLASSES[code]
        assert error.code == code and error.message == "why"
        assert str(error) == f"{code.name} ({int(code)}): why"
        copied = pickle.loads(pickle.dumps(error))
        assert type(copied) is type(error) and copied.code == code


def test_given_unknown_number_then_error_is_internal_and_names_it() -> None:
    error = make_error(4242, "new")
    assert error.code == ErrorCode.INTERNAL and "4242" in error.message


class FakeRpcError(grpc.RpcError):
    def __init__(self, status: grpc.StatusCode, details: str, trailers=()) -> None:  # type: ignore[no-untyped-def]
        self._status, self._details, self._trailers = status, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._status

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):  # type: ignore[no-untyped-def]
        return self._trailers


def test_given_levee_trailer_then_its_code_wins_over_the_grpc_status() -> None:
    error = from_rpc_error(FakeRpcError(
        grpc.StatusCode.FAILED_PRECONDITION, "moved",
        (("levee-error-code", "3001"), ("levee-error-reason", "FENCED"))))
    assert isinstance(error, levee.FencedError) and error.message == "moved"


@pytest.mark.parametrize("status,code", [
    (grpc.StatusCode.UNAVAILABLE, ErrorCode.UNAVAILABLE),
    (grpc.StatusCode.CANCELLED, ErrorCode.UNAVAILABLE),
    (grpc.StatusCode.DEADLINE_EXCEEDED, ErrorCode.DEADLINE_EXCEEDED),
    (grpc.StatusCode.OUT_OF_RANGE, ErrorCode.OFFSET_OUT_OF_RANGE),
    (grpc.StatusCode.UNIMPLEMENTED, ErrorCode.UNIMPLEMENTED),
    (grpc.StatusCode.UNKNOWN, ErrorCode.INTERNAL),
    (grpc.StatusCode.PERMISSION_DENIED, ErrorCode.FAILED_PRECONDITION),
])
def test_given_status_without_trailer_then_code_comes_from_grpc_status(status, code) -> None:  # type: ignore[no-untyped-def]
    assert from_rpc_error(FakeRpcError(status, "x")).code == code


def test_given_library_size_limit_then_error_is_invalid_argument() -> None:
    error = from_rpc_error(FakeRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (5 vs. 4)"))
    assert error.code == ErrorCode.INVALID_ARGUMENT and "size limit" in error.message


def test_given_grpc_core_failing_a_stream_write_then_error_is_unavailable_as_a_broken_connection() -> None:
    error = from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "Internal error from Core"))
    assert error.code == ErrorCode.UNAVAILABLE and "connection to the server broke" in error.message
    other = from_rpc_error(FakeRpcError(grpc.StatusCode.INTERNAL, "something else"))
    assert other.code == ErrorCode.INTERNAL


def test_given_a_closed_client_then_its_calls_raise_unavailable_saying_it_is_closed(server, unique) -> None:  # type: ignore[no-untyped-def]
    """Not grpc.aio's UsageError: the client's own error, for unary calls and streams alike,
    and for a `with_producer_name` copy sharing the closed connection."""
    queue = unique("closed")

    async def main() -> None:
        client = await levee.Client.connect(server.grpc_addr)
        named = client.with_producer_name("closed-client")
        await client.close()
        producer = levee.Producer(client)
        calls = {
            "server_info": lambda: client.server_info(),
            "append": lambda: client.append(queue, b"x"),
            "read": lambda: client.read(queue),
            "named append": lambda: named.append(queue, b"x"),
            "producer send": lambda: producer.send(queue, b"x"),
            "subscribe": lambda: client.subscribe(queue, "reader"),
            "subscribe_many": lambda: client.subscribe_many("reader"),
        }
        for name, start in calls.items():
            with pytest.raises(levee.UnavailableError, match="the client is closed; create a new one"):
                await start()
        await producer.close()

    run(main())
