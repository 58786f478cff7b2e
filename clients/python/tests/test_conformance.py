"""Every scenario of conformance/scenarios/ against a fresh real server, with this client."""

from __future__ import annotations

import pathlib

import pytest

from conformance_runner import SCENARIOS, run_scenario

SCENARIO_FILES = sorted(SCENARIOS.glob("*.json"))


def test_scenarios_exist() -> None:
    assert len(SCENARIO_FILES) >= 10, f"expected the conformance scenarios in {SCENARIOS}"


@pytest.mark.parametrize("path", SCENARIO_FILES, ids=lambda path: path.stem)
def test_scenario(path: pathlib.Path) -> None:
    run_scenario(path)
