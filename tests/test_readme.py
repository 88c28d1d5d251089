"""The README's quickstart runs as written (the server one against a real daemon)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_starts_with_the_two_commands():
    first_block = re.search(r"```sh\n(.*?)```", README.read_text(), flags=re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands[:2] == ["make run", "make test"]


def test_in_process_quickstart_runs():
    exec(compile(python_blocks()[0], "README.md[0]", "exec"), {})


def test_server_quickstart_runs(server):
    code = python_blocks()[1].replace("localhost:50051", server.address)
    exec(compile(code, "README.md[1]", "exec"), {})


def test_asyncio_example_runs(server):
    block = next(b for b in python_blocks() if "millpond.aio.connect(" in b)
    code = block.replace("localhost:50051", server.address)
    exec(compile(code, "README.md", "exec"), {})


def test_rate_limit_example_runs():
    block = next(b for b in python_blocks() if "SampleToInsertRatio(" in b)
    exec(compile(block, "README.md", "exec"), {})


@pytest.mark.parametrize("marker", ["buf.sample_sequences(32, 20", "n_step=3, gamma=0.5"])
def test_episode_examples_run(marker):
    """The R2D2-style sequence example and the n-step example run as written."""
    block = next(b for b in python_blocks() if marker in b)
    exec(compile(block, "README.md", "exec"), {})



def test_pixels_example_runs():
    """Frames stored once and compressed: stored bytes a fraction of the plain ones."""
    block = next(b for b in python_blocks() if "frame_stack=" in b)
    exec(compile(block, "README.md", "exec"), {})

def test_learner_access_example_runs(tmp_path, monkeypatch):
    """(The offline dataset example: tests/test_datasets.py.)"""
    monkeypatch.chdir(tmp_path)  # it writes a file
    block = next(b for b in python_blocks() if "epoch_iterator(64" in b)
    exec(compile(block, "README.md", "exec"), {})


def test_sb3_example_builds_its_model_on_a_server(server):
    pytest.importorskip("stable_baselines3")  # the `sb3` extra (not in `test`)
    block = next(b for b in python_blocks() if "replay_buffer_class=ReplayBuffer" in b)
    scope: dict = {}
    code = textwrap.dedent(block).replace("localhost:50051", server.address)
    exec(compile(code, "README.md", "exec"), scope)
    assert len(scope["model"].replay_buffer.millpond_buffer) == 0  # a real buffer on the server


def limits_table() -> dict[str, str]:
    """The README security section's limits: ``{flag: default}``."""
    text = README.read_text()
    table = text[text.index("| limit | flag | default |"):]
    table = table[:table.index("\n\n")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in table.splitlines()[2:]]
    return {row[1].strip("`"): row[2] for row in rows}


def test_the_readme_lists_every_limit_with_its_flag_and_default():
    """Every limit of ``millpond serve`` (a cap, a size or a time a caller is held to) is
    in the README's security table, with the default the daemon uses."""
    from millpond_server.config import SERVE_OPTIONS

    listed = limits_table()
    limits = [opt for opt in SERVE_OPTIONS
              if opt.dest.startswith(("max_", "shm_max")) or opt.dest.endswith(("idle_s", "_s"))]
    assert limits
    for opt in limits:
        assert opt.flag in listed, f"{opt.flag} is not in the README's security table"
        if opt.default is not None:
            assert f"{opt.default:g}" in listed[opt.flag], opt.flag
