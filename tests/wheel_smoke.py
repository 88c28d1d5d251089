"""`make test-wheel`: the wheel in dist/ works on its own, away from this source tree.

Run by the Makefile after `make dist` (``python tests/wheel_smoke.py dist``), not collected by
pytest. It checks that the wheel holds both packages, the generated protocol, py.typed and
the ``millpond`` command, and carries the version of millpond/_version.py; then installs it
with its dependencies (no extra) into a fresh venv in a temporary directory, and from there,
with no PYTHONPATH and the working directory outside the tree, so that nothing here can
stand in for what the wheel lacks: ``millpond --version``, ``millpond serve`` on a free port
with a temporary data directory, a client of that venv creating a buffer, pushing and
sampling over gRPC (and over the same-host fast path), ``millpond health`` and ``info``,
the buffer's deletion, and the daemon stopped by SIGTERM, exiting 0.

Exit status 0 when all of it held; else 1, with what failed and the daemon's log.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 30.0  # for the daemon to write its address, and to stop

# What the wheel must hold (beside every module of both packages).
REQUIRED = (
    "millpond/__init__.py", "millpond/_version.py", "millpond/py.typed",
    "millpond/v1/replay_pb2.py", "millpond/v1/replay_pb2.pyi", "millpond/v1/replay_pb2_grpc.py",
    "millpond/core/bufferfile.py", "millpond/remote/shm/__init__.py",
    "millpond_server/__main__.py", "millpond_server/cli.py",
)

# Run by the venv's Python in the temporary directory: argv[1] the address, argv[2] the
# version the wheel must report.
CLIENT = r'''
import sys
import numpy as np
import millpond
from importlib.metadata import version

address, expected = sys.argv[1], sys.argv[2]
assert "site-packages" in millpond.__file__, millpond.__file__
assert millpond.__version__ == version("millpond") == expected, (millpond.__version__, expected)
for shm, transport in ((False, "grpc"), ("auto", "shm")):
    client = millpond.connect(address, shm=shm, timeout=20)
    name = f"smoke-{transport}"
    buf = client.create_buffer(name, hot_capacity=64, total_capacity=256,
                               fields={"obs": ("float32", (4,)), "action": ("int64", ()),
                                       "reward": ("float32", ())})
    n = 100
    buf.push_batch(obs=np.arange(4 * n, dtype=np.float32).reshape(n, 4),
                   action=np.arange(n), reward=np.ones(n, np.float32))
    batch = buf.sample(32, seed=1)
    assert batch["obs"].shape == (32, 4) and batch["obs"].dtype == np.float32, batch["obs"]
    assert np.array_equal(batch["obs"][:, 0], batch["action"] * 4), batch
    assert len(buf) == n and client.transport == transport, (len(buf), client.transport)
    buf.close()  # this handle created the buffer: Close deletes it
    assert name not in [b["name"] for b in client.list_buffers()]
    client.close()
print("client: ok")
'''


def wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def check_wheel(wheel: Path, expected: str) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in REQUIRED if name not in names]
    for package, source in (("millpond", ROOT / "client/millpond"),
                            ("millpond_server", ROOT / "server/millpond_server")):
        missing += [f"{package}/{p.relative_to(source)}" for p in source.rglob("*.py")
                    if "__pycache__" not in p.parts
                    and f"{package}/{p.relative_to(source)}" not in names]
    assert not missing, f"{wheel.name} lacks {missing}"
    info = f"millpond-{expected}.dist-info"
    entry_points = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert re.search(r"^millpond\s*=\s*millpond_server\.cli:main$", entry_points, re.M), entry_points
    # Nothing of the checkout beside the packages: its root __init__.py (the import guard for
    # the folder holding a checkout) above all, which installed would be a top-level module
    strays = [name for name in names if not name.startswith(("millpond/", "millpond_server/", info))]
    assert not strays, f"{wheel.name} holds {strays}"


def run(args: list, cwd: Path, env: dict, timeout: float = 60) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited {done.returncode}:\n"
                             f"{done.stdout}{done.stderr}")
    return done.stdout


def wait_for(path: Path, process: subprocess.Popen) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if process.poll() is not None:
            raise AssertionError(f"millpond serve exited {process.returncode} before serving")
        time.sleep(0.05)  # polling a file the daemon writes once, with a deadline
    raise AssertionError(f"millpond serve wrote no address in {DEADLINE_S} s")


def smoke(wheel: Path, tmp: Path) -> None:
    sys.path.insert(0, str(ROOT / "client"))
    from millpond._version import __version__ as expected

    assert wheel_version(wheel) == expected, f"{wheel.name}: version is not {expected}"
    check_wheel(wheel, expected)
    print(f"wheel: {wheel.name} holds both packages, the protocol, py.typed, the command")

    venv = tmp / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    run([sys.executable, "-m", "venv", venv], tmp, env)
    run([venv / "bin/python", "-m", "pip", "install", "--quiet", wheel], tmp, env, timeout=300)
    size = sum(p.stat().st_size for p in venv.rglob("*") if p.is_file() and not p.is_symlink())
    print(f"venv: {size / 2**20:.0f} MiB with the wheel and its dependencies")
    bin_ = venv / "bin"

    out = run([bin_ / "millpond", "--version"], tmp, env).strip()
    assert out == f"millpond {expected}", out
    out = run([bin_ / "python", "-m", "millpond_server", "--version"], tmp, env).strip()
    assert out == f"millpond {expected}", out
    print(f"command: {out}")

    address_file, log = tmp / "address", tmp / "serve.log"
    with open(log, "w") as log_file:
        daemon = subprocess.Popen(
            [bin_ / "millpond", "serve", "--port", "0", "--data-dir", tmp / "data",
             "--address-file", address_file],
            cwd=tmp, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        address = wait_for(address_file, daemon)
        run([bin_ / "millpond", "health", "--address", address], tmp, env)
        (tmp / "client.py").write_text(CLIENT)
        print(run([bin_ / "python", "client.py", address, expected], tmp, env).strip())
        run([bin_ / "millpond", "info", "--address", address], tmp, env)
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(DEADLINE_S)
        assert code == 0, f"millpond serve exited {code} on SIGTERM"
        print("daemon: served, and stopped on SIGTERM with 0")
    except BaseException:
        print(log.read_text(), file=sys.stderr)
        raise
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


def main() -> int:
    dist = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "dist")
    wheels = sorted(dist.glob("millpond-*.whl"))
    if len(wheels) != 1:
        print(f"wheel smoke: expected one millpond wheel in {dist}, found {wheels}", file=sys.stderr)
        return 1
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="millpond-wheel-"))
    try:
        smoke(wheels[0].resolve(), tmp)
    except AssertionError as exc:
        print(f"wheel smoke: FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wheel smoke: ok in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
