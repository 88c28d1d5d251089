"""The cold tier's two ways of moving large rows, through the mapping and through the fd
(preadv/pwrite), give the same buffer: same samples for a seed, same contents, same
file after a reopen. Large rows take the fd only in a tier larger than the memory
available, so this forces each way with ``MILLPOND_COLD_IO``."""

from __future__ import annotations

import numpy as np
import pytest
from support import engine

from millpond.core import Schema, TieredBuffer

SCHEMA = Schema.from_spec({"frame": ("uint8", (40, 40, 3)), "id": ("int64", ())})  # 4,800 B


def frames(ids: np.ndarray) -> dict:
    frame = np.repeat((ids % 251).astype(np.uint8)[:, None], 4800, axis=1).reshape(-1, 40, 40, 3)
    frame[:, 0, 0, 0] = (ids % 256).astype(np.uint8)
    return {"frame": frame, "id": ids}


def run(path, persistent: bool) -> list:
    """A buffer's life: spills, evictions, batches larger than the hot ring, seeded samples."""
    buf = engine(SCHEMA, 7, 50, path, persistent=persistent)
    seen, start = [], 0
    for n in (3, 5, 11, 30, 2, 64, 9):
        buf.push_batch(frames(np.arange(start, start + n)))
        start += n
        batch = buf.sample(min(12, len(buf)), seed=n)
        np.testing.assert_array_equal(batch["frame"], frames(batch["id"])["frame"])
        seen.append({k: v.tobytes() for k, v in batch.items()})
    contents = buf.contents()
    np.testing.assert_array_equal(contents["id"], np.arange(start - 50, start))
    seen.append({k: v.tobytes() for k, v in contents.items()})
    if persistent:
        buf.release()
        again = TieredBuffer.open(path)  # every record's checksum checked
        seen.append({k: v.tobytes() for k, v in again.sample(20, seed=1).items()})
        again.close()
    else:
        buf.close()
    return seen


@pytest.mark.parametrize("persistent", [False, True])
def test_direct_and_mapped_io_give_the_same_buffer(tmp_path, monkeypatch, persistent):
    results = {}
    for mode in ("mapped", "direct"):
        monkeypatch.setenv("MILLPOND_COLD_IO", mode)
        results[mode] = run(tmp_path / f"{mode}.buffer", persistent)
    assert results["direct"] == results["mapped"]
