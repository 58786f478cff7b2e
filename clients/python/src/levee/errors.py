"""Levee's errors: one `LeveeError` carrying the wire `ErrorCode`, one subclass per code.

Every error a Levee server returns is a gRPC status whose trailers carry `levee-error-code`
(the numeric code, in decimal) and `levee-error-reason` (see proto/levee/v1/errors.proto). A
status without them (raised by the gRPC library, a proxy or the transport) is mapped from its
gRPC status code, as the Rust client does. Errors the client finds itself (validation of what
the server would refuse) carry the same code and the same message the server would send.
"""

from __future__ import annotations

import enum
from typing import Dict, Optional, Type

import grpc

ERROR_CODE_METADATA_KEY = "levee-error-code"
ERROR_REASON_METADATA_KEY = "levee-error-reason"
GRPC_CORE_INTERNAL_DETAILS = "Internal error from Core"
"""The details grpc.aio gives the status it sets on a call whose send failed in its core."""


class ErrorCode(enum.IntEnum):
    """The stable codes of proto/levee/v1/errors.proto (a test pins them to the proto)."""

    UNSPECIFIED = 0
    INTERNAL = 1000
    INVALID_ARGUMENT = 1001
    UNAVAILABLE = 1002
    RESOURCE_EXHAUSTED = 1003
    DEADLINE_EXCEEDED = 1004
    NOT_FOUND = 1005
    ALREADY_EXISTS = 1006
    FAILED_PRECONDITION = 1007
    STORAGE_FAILED = 1008
    UNIMPLEMENTED = 1009
    FENCED = 3001
    SEQUENCE_GAP = 3002
    SEQUENCE_TOO_OLD = 3003
    OFFSET_OUT_OF_RANGE = 3004

    @property
    def reason(self) -> str:
        """The stable reason string sent in `levee-error-reason`, such as `INVALID_ARGUMENT`."""
        return self.name


class LeveeError(Exception):
    """A Levee error: a stable `code` to branch on and a `message` for people."""

    code: ErrorCode

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.reason} ({int(code)}): {message}")
        self.code = code
        self.message = message

    def __reduce__(self):  # keeps the code when pickled (multiprocessing, logging handlers)
        return (make_error, (int(self.code), self.message))


class InternalError(LeveeError):
    """A bug or an unexpected failure inside the server (INTERNAL)."""


class InvalidArgumentError(LeveeError):
    """The request is malformed or a field is out of range (INVALID_ARGUMENT)."""


class UnavailableError(LeveeError):
    """The server is shutting down, unreachable or not ready: retry later (UNAVAILABLE)."""


class ResourceExhaustedError(LeveeError):
    """A server-wide bound was hit: back off and retry (RESOURCE_EXHAUSTED)."""


class DeadlineExceededError(LeveeError):
    """The call's deadline passed before it completed (DEADLINE_EXCEEDED)."""


class NotFoundError(LeveeError):
    """The named object does not exist (NOT_FOUND)."""


class AlreadyExistsError(LeveeError):
    """The object to create exists already (ALREADY_EXISTS)."""


class FailedPreconditionError(LeveeError):
    """The system is not in a state to perform the request (FAILED_PRECONDITION)."""


class StorageFailedError(LeveeError):
    """The server's storage failed; it refuses writes until it recovers (STORAGE_FAILED)."""


class UnimplementedError(LeveeError):
    """The server does not implement the operation (UNIMPLEMENTED)."""


class FencedError(LeveeError):
    """A commit by a member that no longer owns the partition (FENCED)."""


class SequenceGapError(LeveeError):
    """An idempotent producer skipped sequence numbers (SEQUENCE_GAP)."""


class SequenceTooOldError(LeveeError):
    """An idempotent resend older than the server remembers (SEQUENCE_TOO_OLD)."""


class OffsetOutOfRangeError(LeveeError):
    """An offset past the end of a queue, or an ack of an undelivered offset."""


ERROR_CLASSES: Dict[ErrorCode, Type[LeveeError]] = {
    ErrorCode.INTERNAL: InternalError,
    ErrorCode.INVALID_ARGUMENT: InvalidArgumentError,
    ErrorCode.UNAVAILABLE: UnavailableError,
    ErrorCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.ALREADY_EXISTS: AlreadyExistsError,
    ErrorCode.FAILED_PRECONDITION: FailedPreconditionError,
    ErrorCode.STORAGE_FAILED: StorageFailedError,
    ErrorCode.UNIMPLEMENTED: UnimplementedError,
    ErrorCode.FENCED: FencedError,
    ErrorCode.SEQUENCE_GAP: SequenceGapError,
    ErrorCode.SEQUENCE_TOO_OLD: SequenceTooOldError,
    ErrorCode.OFFSET_OUT_OF_RANGE: OffsetOutOfRangeError,
}

# The gRPC status each code is sent with (errors.proto); used to map statuses without Levee's
# trailers, as the Rust client's `code_from_grpc` does.
_CODE_FROM_GRPC: Dict[grpc.StatusCode, ErrorCode] = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE: ErrorCode.OFFSET_OUT_OF_RANGE,
    grpc.StatusCode.UNAVAILABLE: ErrorCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED: ErrorCode.UNAVAILABLE,
    grpc.StatusCode.ABORTED: ErrorCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.NOT_FOUND: ErrorCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS: ErrorCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED: ErrorCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNIMPLEMENTED: ErrorCode.UNIMPLEMENTED,
}


def make_error(code: int, message: str) -> LeveeError:
    """The typed error of `code` (an unknown number is INTERNAL: the server is newer)."""
    try:
        known = ErrorCode(code)
    except ValueError:
        known = ErrorCode.INTERNAL
        message = f"unknown error code {code}: {message}"
    return ERROR_CLASSES.get(known, LeveeError)(known, message)


def client_closed_error(error: object) -> LeveeError:
    """UNAVAILABLE for a call on a closed `Client` (grpc.aio raises its own `UsageError`)."""
    return make_error(ErrorCode.UNAVAILABLE, f"the client is closed; create a new one ({error})")


def _metadata_code(metadata: object) -> Optional[int]:
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == ERROR_CODE_METADATA_KEY:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None


def from_rpc_error(error: grpc.RpcError) -> LeveeError:
    """Reads a Levee error back out of a failed call (sync or asyncio)."""
    status = error.code()  # type: ignore[attr-defined]
    details = error.details() or ""  # type: ignore[attr-defined]
    try:
        trailers = error.trailing_metadata()  # type: ignore[attr-defined]
    except Exception:  # an asyncio call that never got trailers
        trailers = None
    number = _metadata_code(trailers)
    if number is not None:
        return make_error(number, details)
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in details:
        # The gRPC library's own size check: Levee answers INVALID_ARGUMENT naming the limit.
        return make_error(
            ErrorCode.INVALID_ARGUMENT,
            f"{details}: the message is over the size limit for this call; send less per "
            "message (the limits are in the proto comments)",
        )
    if status == grpc.StatusCode.INTERNAL and details == GRPC_CORE_INTERNAL_DETAILS:
        # grpc.aio's own status for a stream whose write failed in its core (the connection
        # broke under it): as a broken connection, UNAVAILABLE.
        return make_error(
            ErrorCode.UNAVAILABLE, f"the connection to the server broke (gRPC: {details})"
        )
    code = _CODE_FROM_GRPC.get(status, ErrorCode.INTERNAL)
    return make_error(code, details or str(status))


__all__ = ["ErrorCode", "LeveeError", "make_error", "from_rpc_error"] + [
    cls.__name__ for cls in ERROR_CLASSES.values()
]
