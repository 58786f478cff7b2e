"""`PushStream`: what the mailbox streams (`Subscription`, `Mailboxes`) share: a reader task
that takes the server's responses as they come (what it holds is bounded by the credit the
caller granted), an event for waiters, serialised writes, and the stream's end (the server's
error, or a clean end). Callers may wait in several tasks, and a wait cancelled by a timeout
loses nothing.

A stream that follows the cluster (`Client.subscribe_following`,
`Client.subscribe_many_following`) also moves: when its node goes away (`node_went_away`),
the first caller that sees it starts a move, one task that opens the stream again through
another member (`following.Members.reopen`, the subclass's `_reopen_through`) and counts it
in `_moves`; every caller that saw the same end waits for that one move (a caller cancelled
meanwhile does not cancel it), then goes on on the new stream.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Dict, List, Optional, TypeVar

import grpc
import grpc.aio

from .errors import ErrorCode, LeveeError, from_rpc_error, make_error

if TYPE_CHECKING:
    from .client import Client
    from .following import Members

T = TypeVar("T")

INFO_CHECKS_AT_ONCE = 64
"""After a move, how many `GetQueueInfo` calls the stream makes at once to learn whether a
queue it delivered from was deleted meanwhile (`PushStream._end_if_deleted`)."""
MOVES_PER_CALL_MAX = 10
"""Most moves one call of a following stream makes before it gives up (its new node going
away each time)."""


class PushStream:
    """Base of the streams the server pushes deliveries on; subclasses take each response in
    `_take`."""

    def __init__(self, stream: Any) -> None:
        self._changed = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self._closed = False  # closed here: never moves again
        # Following the cluster: the members to move to, the moves made, the move under way.
        self._members: "Optional[Members]" = None
        self._moves = 0
        # Why each move happened (the end that caused it), newest last, at most a few kept.
        self._move_causes: List[str] = []
        self._move: "Optional[asyncio.Task[None]]" = None
        self._attach(stream)

    def _attach(self, stream: Any) -> None:
        """Reads `stream` from now on (a new one after a move)."""
        self._stream = stream
        self._ended: Optional[LeveeError] = None  # set once the stream is over
        self._clean_end = False  # ended by the server without an error, or closed here
        self._reader = asyncio.ensure_future(self._read(stream))

    async def _detach(self, moving: bool = False) -> None:
        """Ends the stream read now and waits for its reader. `moving`: it ends because the
        stream moves, which callers must not take for a clean end."""
        self._stream.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        if moving:
            self._clean_end = False
            self._ended = make_error(
                ErrorCode.UNAVAILABLE, "the stream is moving to another node of the cluster"
            )

    def _take(self, response: Any) -> None:
        raise NotImplementedError

    async def _read(self, stream: Any) -> None:
        try:
            while True:
                response = await stream.read()
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

    # ---- following the cluster

    async def _end_if_deleted(self, member: "Client", delivered: Dict[bytes, int]) -> None:
        """After a move through `member`: ends the stream when a queue it delivered from was
        deleted while it moved (`delivered`: each such queue and the offset after the last
        message delivered from it). A delete the old stream did not live to see is not seen
        by the new one either (the queue is then one that does not exist, or a new one under
        the name), so the stream asks: a queue that does not exist, or whose next offset is
        below what was delivered, was deleted, and the stream ends with FAILED_PRECONDITION as
        a server ends one whose queue it deletes. (A queue created again with more messages
        than were delivered is not told apart.)"""
        names = list(delivered)
        for start in range(0, len(names), INFO_CHECKS_AT_ONCE):
            chunk = names[start : start + INFO_CHECKS_AT_ONCE]
            infos = await asyncio.gather(
                *(member.queue_info(name) for name in chunk), return_exceptions=True
            )
            for name, info in zip(chunk, infos):
                gone = (
                    isinstance(info, LeveeError) and info.code == ErrorCode.NOT_FOUND
                ) or (not isinstance(info, BaseException) and info.next_offset < delivered[name])
                if isinstance(info, BaseException) and not gone:
                    raise info
                if gone:
                    await self._detach()
                    self._clean_end = False
                    self._ended = make_error(
                        ErrorCode.FAILED_PRECONDITION,
                        f"queue '{name.decode(errors='replace')}' was deleted while this "
                        "stream moved to another node: its messages and the consumer's "
                        "position on it are gone; open the stream again to read a queue "
                        "created again under the name, from offset 0",
                    )
                    return

    async def _follow(self, seed: "Client") -> None:
        """Makes this stream, opened through `seed`, follow the cluster (its members are
        learned now, so it can move once the seed is gone)."""
        from .following import Members

        self._members = await Members.learned_from(seed)

    def _follows(self, error: LeveeError) -> bool:
        """Whether `error` ends this stream in a way it moves after: its node went away, or
        any error while a move is under way (a stream tried during the move and refused,
        seen by another caller: the move goes on to the next member)."""
        from .following import node_went_away

        if self._members is None or self._closed:
            return False
        return node_went_away(error) or (self._move is not None and not self._move.done())

    async def _reopen_through(self, member: "Client") -> bool:
        """Opens the stream again through `member` with everything it had asked for (its
        queues): attached when it returns True. Subclasses that follow implement it."""
        raise NotImplementedError

    async def _through_moves(self, once: Callable[[], Awaitable[T]]) -> T:
        """`once()`'s answer; on a following stream whose node went away, `once()` again on
        the stream moved (up to `MOVES_PER_CALL_MAX` moves). Other errors raise."""
        moves_made = 0
        while True:
            moves_seen = self._moves
            try:
                return await once()
            except LeveeError as error:
                if not self._follows(error):
                    raise
                await self._moved(error, moves_seen, moves_made)
                moves_made += 1

    async def _moved_instead(self, once: Callable[[], Awaitable[None]]) -> bool:
        """Runs `once()`; True when, on a following stream, its node went away instead and the
        stream moved (the caller says what that means for what it asked; `once()` is not run
        again). Other errors, and a move that failed, raise."""
        moves_seen = self._moves
        try:
            await once()
        except LeveeError as error:
            if not self._follows(error):
                raise
            await self._moved(error, moves_seen, 0)
            return True
        return False

    async def _moved(self, cause: LeveeError, moves_seen: int, moves_made: int) -> None:
        """Moves the stream after it ended with `cause` (as seen when `_moves` was
        `moves_seen`), unless another caller moved it since; raises `cause`, told, when it
        could not move, or when this call already moved `moves_made` times."""
        if self._moves != moves_seen:
            return
        if moves_made >= MOVES_PER_CALL_MAX:
            raise make_error(
                cause.code,
                f"{cause.message}; the stream moved {moves_made} times in this call and its "
                "node went away each time",
            )
        if self._move is None or self._move.done():
            self._move = asyncio.ensure_future(self._run_move(cause))
        move = self._move
        try:
            await asyncio.shield(move)
        except asyncio.CancelledError:
            if move.cancelled():  # by `close`, not this caller's cancellation
                raise make_error(ErrorCode.UNAVAILABLE, "the subscription is closed") from None
            raise

    async def _run_move(self, cause: LeveeError) -> None:
        from .following import REOPEN_WITHIN_S

        members = self._members
        assert members is not None, "only a following stream moves"
        self._move_causes = (self._move_causes + [f"{cause.code.name}: {cause.message}"])[-4:]
        await self._detach(moving=True)

        async def through(member: "Client") -> Optional[bool]:
            return True if await self._reopen_through(member) else None

        moved = await members.reopen(through)
        if moved is None or self._closed:
            await self._detach(moving=True)
            self._ended = make_error(
                cause.code,
                f"{cause.message}; the stream's node went away and no member of the cluster "
                f"took the stream again within {REOPEN_WITHIN_S:.0f} s",
            )
            raise self._ended
        self._moves += 1

    async def close(self) -> None:
        """Ends the stream; messages not acked are delivered again to the next subscription."""
        self._closed = True
        if self._move is not None and not self._move.done():
            self._move.cancel()
            await asyncio.gather(self._move, return_exceptions=True)
        await self._detach()
        if self._members is not None:
            await self._members.close()
