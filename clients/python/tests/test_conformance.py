"""Every scenario of conformance/scenarios/ against a fresh real server, with this client; and
every one that can run there (one server, none stopped: `runs_on_a_cluster`) against a new
three-node cluster that replicates its queues, talking to node 1, 2 and 3 in turn, as the Rust
runner does (crates/levee/tests/conformance.rs)."""

from __future__ import annotations

import pathlib
from typing import Tuple

import pytest

from conformance_runner import SCENARIOS, load, run_scenario, runs_on_a_cluster

SCENARIO_FILES = sorted(SCENARIOS.glob("*.json"))
CLUSTER_SCENARIO_FILES = [path for path in SCENARIO_FILES if runs_on_a_cluster(load(path))]
# The scenarios the Rust runner runs on a cluster too (13 of 17 when written).
CLUSTER_SCENARIOS_MIN = 13


def test_scenarios_exist() -> None:
    assert len(SCENARIO_FILES) >= 10, f"expected the conformance scenarios in {SCENARIOS}"


@pytest.mark.parametrize("path", SCENARIO_FILES, ids=lambda path: path.stem)
def test_scenario(path: pathlib.Path) -> None:
    run_scenario(path)


def test_enough_scenarios_run_on_a_cluster() -> None:
    names = [path.stem for path in CLUSTER_SCENARIO_FILES]
    assert len(names) >= CLUSTER_SCENARIOS_MIN, f"only {names} run on a cluster"


@pytest.mark.parametrize(
    "entry_and_path",
    [(index % 3, path) for index, path in enumerate(CLUSTER_SCENARIO_FILES)],
    ids=lambda entry_and_path: f"{entry_and_path[1].stem}-node{entry_and_path[0] + 1}",
)
def test_scenario_on_a_three_node_cluster(entry_and_path: Tuple[int, pathlib.Path]) -> None:
    entry, path = entry_and_path
    assert run_scenario(path, entry)
