"""The push log (core/pushlog.py): a push acknowledged once logged is never lost,
never seen missing, and stored exactly as a push stored at once.

Each test compares a buffer fed with ``push_logged`` (its last push left logged)
against one fed with ``push_batch``, through public methods, or reopens an
image of the file taken while the push was only logged: what a crash of the
process leaves (the file's pages are the page cache's, not the process's).
"""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from millpond.core import Schema, TieredBuffer
from millpond.core.bufferfile import MAGIC
from millpond.core.fifo import Fifo
from millpond.core.pushlog import LOG_PAYLOAD_BYTES, LOG_REGION
from millpond.core.ratelimit import MinSize
from support import engine, without_stats

SCHEMA = Schema.from_spec({"id": ("<i8", ()), "obs": ("<f4", (3,)), "done": ("|b1", ())})
HOT, TOTAL = 40, 100


def records(start: int, n: int) -> dict[str, np.ndarray]:
    i = np.arange(start, start + n)
    return {"id": i, "obs": np.stack([i, -i, 2 * i], axis=1).astype("<f4"), "done": i % 3 == 0}


def filled(path, pushes: int, logged: bool, **kwargs) -> TieredBuffer:
    """A persistent buffer after ``pushes`` pushes of 30 (records 0, 1, 2, ...): its last
    one left logged if ``logged``."""
    buf = engine(SCHEMA, HOT, TOTAL, path, persistent=True, **kwargs)
    for p in range(pushes):
        if logged and p == pushes - 1:
            after = buf.push_logged(records(30 * p, 30))
            assert after == (min(30 * pushes, TOTAL), 30 * pushes)
        else:
            buf.push_batch(records(30 * p, 30))
    return buf


def stored(buf: TieredBuffer) -> dict:
    """What the buffer serves: its records in order, sizes and counters."""
    return {"len": len(buf), "info": {**without_stats(buf.info()), "path": None},
            "contents": {k: v.tolist() for k, v in buf.contents().items()}}


def crash_image(buf: TieredBuffer, tmp_path, name: str = "image.buffer") -> str:
    """A copy of the buffer's file as it is now: what a crash of the process leaves."""
    image = str(tmp_path / name)
    shutil.copyfile(buf.path, image)
    return image


@pytest.mark.parametrize("pushes", [1, 3, 6])  # hot only; spilling to cold; evicting
def test_a_logged_push_reopened_from_a_crash_image_is_stored_whole(tmp_path, pushes):
    buf = filled(tmp_path / "a.buffer", pushes, logged=True)
    assert buf._logged is not None, "the premise: the push is only logged"
    image = crash_image(buf, tmp_path)
    expected = stored(filled(tmp_path / "b.buffer", pushes, logged=False))
    assert stored(TieredBuffer.open(image)) == expected


def test_a_logged_push_torn_by_a_machine_crash_is_dropped_and_the_rest_served(tmp_path):
    buf = filled(tmp_path / "a.buffer", 3, logged=True)
    expected = stored(filled(tmp_path / "b.buffer", 2, logged=False))
    offset = buf._fifo.file.meta["regions"][LOG_REGION][0]
    for where in (8, 64 + 5):  # its header (the record count); its payload
        image = crash_image(buf, tmp_path, f"torn-{where}.buffer")
        with open(image, "r+b") as f:
            f.seek(offset + where)
            byte = f.read(1)
            f.seek(offset + where)
            f.write(bytes([byte[0] ^ 0x40]))
        reopened = TieredBuffer.open(image)
        assert stored(reopened)["contents"] == expected["contents"]
        assert len(reopened) == 60
        reopened.release()


def test_an_append_interrupted_at_any_commit_is_redone_at_reopen(tmp_path, monkeypatch):
    """Images taken at each commit of the logged push's store all reopen with it whole."""
    buf = filled(tmp_path / "a.buffer", 4, logged=True)  # its store spills and evicts
    images = []
    commit = Fifo._commit

    def commit_and_copy(fifo, *args, **kwargs):
        images.append(crash_image(buf, tmp_path, f"step-{len(images)}.buffer"))
        commit(fifo, *args, **kwargs)

    monkeypatch.setattr(Fifo, "_commit", commit_and_copy)
    buf.settle()
    monkeypatch.undo()
    images.append(crash_image(buf, tmp_path, "after.buffer"))
    assert len(images) == 4  # before each of the 3 commits, and after the log is cleared
    expected = stored(filled(tmp_path / "b.buffer", 4, logged=False))["contents"]
    for image in images:
        assert stored(TieredBuffer.open(image))["contents"] == expected, image


USES = {
    "len": len,
    "pushed": lambda b: b.pushed,
    "info": lambda b: {**without_stats(b.info()), "path": None},
    "sample": lambda b: {k: v.tolist() for k, v in b.sample(50, seed=3).items()},
    "read": lambda b: b.read(np.arange(b.info()["pushed"] - 5, b.info()["pushed"]))["id"].tolist(),
    "contents": lambda b: b.contents()["id"].tolist(),
    "push": lambda b: (b.push_batch(records(1000, 5)), b.contents()["id"].tolist()),
    "reset": lambda b: (b.reset(), b.push_batch(records(2000, 2)), b.contents()["id"].tolist(),
                        b.pushed),
    "draw_ahead": lambda b: b.draw_ahead(8, {f.name: np.empty((8, *f.shape), f.dtype)
                                            for f in SCHEMA}).state,
}


@pytest.mark.parametrize("use", USES)
def test_every_use_of_the_buffer_sees_the_logged_push(tmp_path, use):
    buf = filled(tmp_path / "a.buffer", 3, logged=True)
    assert buf._logged is not None
    reference = filled(tmp_path / "b.buffer", 3, logged=False)
    assert USES[use](buf) == USES[use](reference)


def test_release_and_reopen_keep_the_logged_push(tmp_path):
    buf = filled(tmp_path / "a.buffer", 3, logged=True)
    buf.release()
    assert TieredBuffer.open(tmp_path / "a.buffer").contents()["id"].tolist() == list(range(90))


def test_the_logged_push_is_a_copy_its_sender_may_reuse(tmp_path):
    """A shared-memory push's columns are the client's: it writes its next push there
    once answered."""
    buf = filled(tmp_path / "a.buffer", 1, logged=False)
    batch = records(30, 30)
    buf.push_logged(batch)
    for column in batch.values():
        column[...] = 0
    assert buf.contents()["id"].tolist() == list(range(60))


@pytest.mark.parametrize("kind", ["in memory", "sync every push", "prioritized", "rate limited",
                                  "use limited", "queue", "too large", "priorities given"])
def test_pushes_the_log_cannot_take_are_stored_at_once(tmp_path, kind):
    path, n, kwargs, priorities = tmp_path / "a.buffer", 30, {}, None
    persistent = kind != "in memory"
    if kind == "sync every push":
        kwargs = {"sync_every_push": True}
    elif kind in ("prioritized", "priorities given"):
        kwargs = {"prioritized": True}
        priorities = np.ones(n) if kind == "priorities given" else None
    elif kind == "rate limited":
        kwargs = {"rate_limiter": MinSize(1)}
    elif kind == "use limited":
        kwargs = {"max_times_sampled": 2}
    elif kind == "queue":
        kwargs = {"mode": "queue"}
    elif kind == "too large":
        n = LOG_PAYLOAD_BYTES // 8 + 1
    total = max(TOTAL, n)
    buf = engine(SCHEMA, HOT, total, path if persistent else None, persistent=persistent,
                 **kwargs)
    if kind == "rate limited":  # a limiter does not stop the log: pushes under it are
        assert buf.push_logged(records(0, n)) == (n, n)  # logged, once admitted
        assert buf._logged is not None
        return
    assert buf.push_logged(records(0, n), priorities) == (n, n)
    assert buf._logged is None
    assert buf.contents()["id"].tolist() == list(range(n))


def test_a_version_2_file_without_a_log_is_served_and_stores_at_once(tmp_path):
    path = tmp_path / "old.buffer"
    filled(path, 2, logged=False).release()
    with open(path, "r+b") as f:  # as version 2 wrote it: no push log region
        magic, _, header, length = struct.unpack("<8sIII", f.read(20))
        assert magic == MAGIC
        f.seek(128)
        meta = json.loads(f.read(length))
        del meta["regions"][LOG_REGION]
        blob = json.dumps(meta).encode()
        f.seek(0)
        f.write(struct.pack("<8sIII", MAGIC, 2, header, len(blob)))
        f.seek(128)
        f.write(blob)
    old = TieredBuffer.open(path)
    assert old.push_logged(records(60, 30)) == (90, 90)
    assert old._logged is None
    assert old.contents()["id"].tolist() == list(range(90))
