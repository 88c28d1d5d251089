"""The examples run end to end (their ``--short`` versions), and learning moves the right way.

Each runs as a user would run it: ``python examples/NAME.py --short``, a
subprocess that starts its own ``millpond serve``. Each prints a last line of
``key=value`` figures, checked here. ``make examples`` runs the same.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Each example trains, and starts its own daemon.
pytestmark = [pytest.mark.daemon, pytest.mark.slow,
              pytest.mark.usefixtures("private_tmpdir")]  # SB3 logs go there


@pytest.fixture(scope="module", autouse=True)
def frameworks():
    """The examples need torch and gymnasium (checked when they run, not at collection)."""
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")


def run(name: str, *args: str, timeout: float = 100) -> dict[str, float]:
    """Run an example; its last line's ``key=value`` pairs as floats."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    last = proc.stdout.strip().splitlines()[-1]
    return {key: float(value) for key, value in (pair.split("=") for pair in last.split())}


@pytest.mark.timeout(120)
def test_sb3_dqn_learns_with_its_buffer_on_a_server():
    pytest.importorskip("stable_baselines3")
    figures = run("sb3_dqn.py", "--short")
    assert figures["after"] > figures["before"] + 20


@pytest.mark.timeout(120)
def test_apex_dqn_actors_and_learner_improve_the_policy():
    figures = run("apex_dqn.py", "--short")
    assert figures["best"] > figures["first"] + 20


@pytest.mark.timeout(150)
def test_apex_pong_stores_frames_once():
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    figures = run("apex_pong.py", "--short", timeout=140)
    assert figures["updates"] > 0 and figures["steps"] >= 1_000
    assert figures["stored"] * 7.5 <= figures["plain"]  # about one new 84x84 frame each


@pytest.mark.timeout(120)
def test_offline_bc_from_an_exported_dataset():
    figures = run("offline_bc.py", "--short")
    assert figures["loss_after"] < figures["loss_before"] - 0.1
    assert figures["return"] > 100
