"""The generated protocol code matches proto/ (nobody edited one without the other)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ["replay_pb2.py", "replay_pb2.pyi", "replay_pb2_grpc.py"]


def test_generated_code_is_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools")  # the `dev` extra (not in `test`)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         str(ROOT / "proto/millpond/v1/replay.proto")],
        check=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "millpond/v1" / name).read_text()
        committed = (ROOT / "client/millpond/v1" / name).read_text()
        assert fresh == committed, f"client/millpond/v1/{name} is stale: run `make proto`"
