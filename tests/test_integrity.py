"""Every record checked: what a client does to its memory, a flipped bit in the metadata or a
commit slot, and a crash at any step of a push never make the daemon serve a wrong record,
lose an acknowledged one, or refuse to start for want of a check."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from support import ServerProcess

import millpond
from millpond.core import TieredBuffer

# ---- 1. a client rewriting its push segment ---------------------------------------------

PUSHES = 600

REWRITER = textwrap.dedent("""
    import os, subprocess, sys
    import numpy as np
    import millpond

    address, pushes = sys.argv[1], int(sys.argv[2])
    buf = millpond.connect(address, shm=True).buffer("torn")
    assert buf.transport == "shm", buf.transport
    n = 48  # more than the hot ring: the batch's head goes straight to the cold tier
    batch = {"frame": np.zeros((n, 8192), np.uint8), "id": np.arange(n, dtype=np.int64)}
    buf.push_batch(**batch)  # the push segment exists now

    def segment_fd():
        # This process's own push segment, found as any actor could.
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "millpond-push" in line:
                    return os.open(f"/proc/self/map_files/{line.split()[0]}", os.O_RDWR)
        raise SystemExit("no push segment mapped")

    # A helper process rewrites the segment in a tight loop (no GIL shared with the pushes).
    fd = segment_fd()
    helper = subprocess.Popen([sys.executable, "-c", HELPER, str(fd)], pass_fds=[fd],
                              stdout=subprocess.PIPE)
    os.close(fd)
    assert helper.stdout.readline() == b"rewriting\\n"
    try:
        for _ in range(pushes):
            buf.push_batch(**batch)
    finally:
        helper.kill()
        helper.wait()
    print(buf.info()["pushed"])
""").replace("HELPER", repr(textwrap.dedent("""
    import mmap, os, sys
    import numpy as np
    fd = int(sys.argv[1])
    view = np.frombuffer(mmap.mmap(fd, os.fstat(fd).st_size), np.uint8)
    value = 0
    view[::4096] = value
    print("rewriting", flush=True)
    while True:
        view[::4096] = value  # a byte in every page, a pass every microsecond or so
        value = (value + 1) % 251
""")))


@pytest.mark.daemon
@pytest.mark.parametrize("cold_io", ["mapped", "direct"])
def test_a_client_rewriting_its_segment_cannot_make_records_fail_their_checks(tmp_path, cold_io):
    """The daemon checksums its own copy: whatever the client's memory held when it was
    copied (torn client data, maybe), the stored record passes its check, and the daemon
    starts again with every record."""
    data = tmp_path / "data"
    env = {"MILLPOND_COLD_IO": cold_io}
    with ServerProcess(data, env=env) as server:
        millpond.connect(server.address).create_buffer(
            "torn", hot_capacity=16, total_capacity=4096,
            fields={"frame": ("uint8", (8192,)), "id": ("int64", ())})
        # (The client waits for replies without spinning: its core is the helper's.)
        done = subprocess.run([sys.executable, "-c", REWRITER, server.address, str(PUSHES)],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "MILLPOND_SHM_SPIN_US": "0"})
        assert done.returncode == 0, done.stderr
        pushed = int(done.stdout.split()[-1])
        assert pushed == (PUSHES + 1) * 48
    stored = TieredBuffer.open(data / "torn.buffer")  # raises if a record fails its check
    assert len(stored) == 4096 and stored.info().damaged == 0
    stored.release()
    with ServerProcess(data, env=env) as server:  # and the daemon starts with all of them
        buf = millpond.connect(server.address).buffer("torn")
        assert len(buf) == 4096 and buf.info()["damaged"] == 0
