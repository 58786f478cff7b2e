"""The test support itself: a server that fails to start leaves no temporary directory behind."""

from __future__ import annotations

import os

import pytest

from support import LeveeServer


def test_given_a_server_that_fails_to_start_then_its_temporary_directory_is_removed() -> None:
    server = LeveeServer(extra=["--no-such-flag"])
    temporary = os.path.dirname(server.data_dir)
    assert os.path.isdir(temporary)
    with pytest.raises(RuntimeError, match="did not become ready"):
        server.start()
    assert not os.path.exists(temporary), "a server that never started is cleaned up"
