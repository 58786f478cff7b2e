"""`PushStream`: what the mailbox streams (`Subscription`, `Mailboxes`) share: a reader task
that takes the server's responses as they come (what it holds is bounded by the credit the
caller granted), an event for waiters, serialised writes, and the stream's end (the server's
error, or a clean end). Callers may wait in several tasks, and a wait cancelled by a timeout
loses nothing."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

import grpc
import grpc.aio

from .errors import ErrorCode, LeveeError, from_rpc_error, make_error


class PushStream:
    """Base of the streams the server pushes deliveries on; subclasses take each response in
    `_take`."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._changed = asyncio.Event()
        self._ended: Optional[LeveeError] = None  # set once the stream is over
        self._clean_end = False  # ended by the server without an error, or closed here
        self._write_lock = asyncio.Lock()
        self._reader = asyncio.ensure_future(self._read())

    def _take(self, response: Any) -> None:
        raise NotImplementedError

    async def _read(self) -> None:
        try:
            while True:
                response = await self._stream.read()
                if response is grpc.aio.EOF:
                    self._clean_end = True
                    self._ended = make_error(ErrorCode.UNAVAILABLE, "the subscription is closed")
                    return
                self._take(response)
                self._changed.set()
        except grpc.RpcError as error:
            self._ended = from_rpc_error(error)
        except asyncio.CancelledError:
            self._clean_end = True
            self._ended = make_error(ErrorCode.UNAVAILABLE, "the subscription is closed")
            raise
        finally:
            self._changed.set()

    async def _wait(self) -> None:
        """Waits for the next response (or the end); callers check their condition first."""
        self._changed.clear()
        await self._changed.wait()

    def _raise_if_ended(self) -> None:
        if self._ended is not None:
            raise self._ended

    async def _write(self, request: Any) -> None:
        self._raise_if_ended()
        async with self._write_lock:
            try:
                await self._stream.write(request)
                return
            except (grpc.RpcError, grpc.aio.UsageError, RuntimeError, asyncio.InvalidStateError):
                pass  # the reader learns why the stream ended
        await asyncio.wait({self._reader}, timeout=5)
        raise self._ended or make_error(ErrorCode.UNAVAILABLE, "the subscription is closed")

    async def close(self) -> None:
        """Ends the stream; messages not acked are delivered again to the next subscription."""
        self._stream.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
