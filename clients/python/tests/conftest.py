"""Fixtures: a real server for the whole session (tests use unique names), fresh servers for
tests that restart or stop one."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import pytest

from support import LeveeServer

T = TypeVar("T")


@pytest.fixture(scope="session")
def server() -> Iterator[LeveeServer]:
    process = LeveeServer().start()
    yield process
    process.cleanup()


@pytest.fixture
def fresh_server() -> Iterator[LeveeServer]:
    process = LeveeServer().start()
    yield process
    process.cleanup()


@pytest.fixture
def unique() -> Callable[[str], str]:
    """Names no other test uses on the shared server."""
    suffix = uuid.uuid4().hex[:10]
    return lambda name: f"{name}-{suffix}"


def run(coroutine: Awaitable[T]) -> T:
    return asyncio.run(coroutine)  # type: ignore[arg-type]


async def eventually(condition: Callable[[], Any], timeout_s: float = 10.0, step_s: float = 0.02) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(step_s)
