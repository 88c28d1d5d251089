"""Frames stored once: frame stacks and next observations (``frame_stack``, ``next_of``).

A buffer created with ``frame_stack={"obs": 0}`` treats field ``obs`` as a stack
of ``k = shape[0]`` frames along axis 0; one with ``next_of={"next_obs": "obs"}``
expects ``next_obs`` to be the next record's ``obs``. Neither option is trusted:
each is only a hint of where equal frames are likely. Both are opt-in; a buffer
without them stores exactly what it stored before (:attr:`BufferConfig.stored_schema`
is then its schema, and nothing here runs).

**Storage.** The fields of one *group* (a source field, e.g. ``obs``, with the
fields that are ``next_of`` it) keep their frames in one *frame ring* per group:
``frame_capacity`` frames ``[F, *frame_shape]``, frame ``i`` (a global, never
reused id) at slot ``i % F``. In the records, each of the group's fields is
stored as ``int64[k]``, the ids of its ``k`` frames (a field that is not
stacked is one frame: ``k = 1``). So the records stay fixed-size, in both tiers,
with their seqs and checksums, and the frames beside them.

**Pushes** (:meth:`Frames.encode`): every frame of every value pushed is looked up
by content among the frames written recently (the last ``window`` ids): where frames
usually repeat is checked first for the whole batch (a stack against its record's
other field shifted by a frame, against the record before it, against the same row
of the last push), the rest one by one, a 64-bit fingerprint finding a candidate;
either way the frame's bytes are compared with the candidate's, always, so a frame
is shared only with an *equal* frame, and a value read back is exactly the value
pushed. What is not found is written as a new frame. So the newest frame of a
stack is new and its other frames are its predecessor's; ``next_obs`` and the
next record's ``obs`` share every frame; a stack padded by repeating its first
frame (gymnasium's ``FrameStackObservation``) or with zero frames (SB3's
``VecFrameStack``) stores each distinct frame once; interleaved writers share
with their own predecessors, whatever the episode bookkeeping: no episode
identity is needed, and none is assumed.

**Lifetime.** A record refers to frames written before or with it. A frame is
kept while a live record (live in the FIFO's range: damaged records excepted)
refers to it: the ring's *head* is the smallest id the live records refer to
(a sliding-window minimum over seqs, kept as a monotone deque), its *tail* the
next id. A push refers only to frames at least ``tail - window`` (which are
still in the ring) and is admitted only if the ring then holds every frame a
record live before it or pushed by it refers to: ``tail + new - head <=
frame_capacity``, else :class:`StorageFullError` and nothing changes. The
check counts the records the push evicts as live: a crash before its commit
leaves them intact (see :mod:`.fifo`). The window is about 1/32 of the ring (at
least 64 frames, at most a quarter). The default capacity
(:func:`default_frame_capacity`) holds 1.25 new frames per record plus slack:
frame-stacked pixels need about one; data whose frames do not repeat needs
``frame_capacity`` set (``2 * k * (total_capacity + largest push)`` always
suffices).

**Files.** A buffer with a file keeps its rings in it (format 6: regions
``frames:<source>``, ``frameid:<source>`` and, persistent, ``framesum:<source>``,
a checksum per frame; see :mod:`.bufferfile`); one without keeps them in RAM.
Nothing about the rings is committed: at reopen the live records' ids say which
frames are live (:meth:`Frames.restore`) and each is checked
(:meth:`Frames.damaged`); frames written by a push that never committed lie
past every live id and are overwritten.

**Compression** (``compression=``, see :mod:`.codecs`): a compressed group keeps
its frames in an :class:`.arena.Arena` instead of a :class:`Ring`: each frame
compressed on its own, in a FIFO ring of bytes with each id's offset and length
(frames are written in id order and freed from the head in id order, so no
allocator is needed). Sharing works as before, looked up among the raw bytes of
the window's frames, kept in RAM (at most ``RAW_CACHE_BYTES``); a compressed
field without frame options is a group of its own (one value per record, ids
``int64[1]`` in the records, no lookups). Reads decompress each distinct frame of
a call once, for all the group's fields (``obs`` and ``next_obs`` share them).
The ring grows (doubling, from 1-2 MiB) as the live records need, up to
``compressed_bytes`` (default: its frames' plain bytes, so that it takes whatever
a plain ring would): RAM and the file's (sparse) pages follow what is stored.
Besides ``frame_capacity``, a push must fit its bytes in that limit
(StorageFullError otherwise, nothing written). Files with compressed groups are
format 7 (see :mod:`.bufferfile`).

Not thread-safe: the buffer holds its lock around every call.
"""

from __future__ import annotations

import collections
import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, cast

import numpy as np

from millpond.core.arena import ID_DTYPE, LEN_DTYPE, OFF_DTYPE, Arena, ring_limit
from millpond.core.checksum import CHECKSUM_DTYPE, record_checksums
from millpond.core.codecs import codec
from millpond.core.schema import Field, Schema
from millpond.core.stored import INDEX_DTYPE, FrameTable, StoredBatch
from millpond.errors import InvalidConfigError, StorageFullError

FRAMES_PREFIX = "frames:"
FRAME_ID_PREFIX = "frameid:"
FRAME_SUM_PREFIX = "framesum:"
BYTES_PREFIX = "framebytes:"  # a compressed group's ring of bytes (format 7)
FRAME_OFF_PREFIX = "frameoff:"
FRAME_LEN_PREFIX = "framelen:"
FRAME_LAP_PREFIX = "framelap:"  # a compressed ring's size now (0: its first)
RAW_CACHE_BYTES = 32 << 20  # a compressed group's recent frames kept raw, for lookups
WINDOW = 4096  # frames looked up for sharing (about 1/32 of the ring, at least 64)


@dataclass(frozen=True)
class FrameGroup:
    """A source field and the fields ``next_of`` it: one frame ring.

    ``axis``: the stack axis of the values (None: a value is one frame);
    ``k`` frames per value, each ``frame_shape``.
    """

    source: str
    fields: tuple[str, ...]  # the source first
    dtype: np.dtype
    axis: int | None
    k: int
    frame_shape: tuple[int, ...]
    codec: tuple[str, int] | None = None  # compressed (see .codecs, .arena): (codec, level)
    share: bool = True  # look frames up by content (False: a compressed field's blobs)

    @property
    def frame_nbytes(self) -> int:
        return math.prod(self.frame_shape) * self.dtype.itemsize


def default_frame_capacity(total_capacity: int) -> int:
    """Frames per ring when none is given: 1.25 per record, plus 64."""
    return total_capacity + total_capacity // 4 + 64


def check_frame_options(schema: Schema, total_capacity: int, frame_stack: Any, next_of: Any,
                        frame_capacity: Any, compressed: bool = False
                        ) -> tuple[tuple, tuple, int | None]:
    """The options normalized (sorted ``(name, axis)`` and ``(name, source)`` pairs,
    the capacity); InvalidConfigError for anything that does not fit ``schema``.
    ``compressed``: some field is compressed (it has a ring of its own: see
    :func:`frame_groups`), so ``frame_capacity`` applies to it."""
    stack = _pairs("frame_stack", frame_stack)
    nexts = _pairs("next_of", next_of)
    checked_stack = []
    for name, axis in stack:
        field = _field(schema, "frame_stack", name)
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise InvalidConfigError(f"frame_stack[{name!r}] must be an axis (an int), got {axis!r}")
        ndim = len(field.shape)
        if not -ndim <= axis < ndim:
            raise InvalidConfigError(f"frame_stack[{name!r}]: axis {axis} is not an axis of "
                                     f"{name}'s shape {field.shape}")
        checked_stack.append((name, int(axis) % ndim))
    sources: dict[str, str] = {}
    for name, source in nexts:
        target = _field(schema, "next_of", name)
        if not isinstance(source, str):
            raise InvalidConfigError(f"next_of[{name!r}] must name a field, got {source!r}")
        origin = _field(schema, f"next_of[{name!r}]", source)
        if name == source:
            raise InvalidConfigError(f"next_of[{name!r}] names the field itself")
        if (target.dtype, target.shape) != (origin.dtype, origin.shape):
            raise InvalidConfigError(
                f"next_of[{name!r}] = {source!r}: {name} is {target.dtype}{list(target.shape)}, "
                f"{source} is {origin.dtype}{list(origin.shape)}; they must match")
        if source in sources:
            raise InvalidConfigError(f"next_of: {sources[source]!r} and {name!r} both name "
                                     f"{source!r}; one field per source")
        sources[source] = name
    targets = {name for name, _ in nexts}
    for name in targets:
        if name in sources:
            raise InvalidConfigError(f"next_of: {name!r} is the next of a field and a source")
        if name in dict(checked_stack):
            raise InvalidConfigError(f"{name!r} is in next_of: its frames are its source's; "
                                     "give frame_stack for the source only")
    if not checked_stack and not nexts and not compressed:
        if frame_capacity is not None:
            raise InvalidConfigError("frame_capacity is for buffers with frame_stack, next_of "
                                     "or compression")
        return (), (), None
    if frame_capacity is None:
        frame_capacity = default_frame_capacity(total_capacity)
    if (isinstance(frame_capacity, bool) or not isinstance(frame_capacity, (int, np.integer))
            or not 1 <= frame_capacity <= 2**40):
        raise InvalidConfigError(f"frame_capacity must be a positive integer, got {frame_capacity!r}")
    return tuple(checked_stack), tuple(nexts), int(frame_capacity)


def _pairs(label: str, value: Any) -> tuple:
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (tuple, list)):
        items = [tuple(pair) for pair in value]
        if any(len(pair) != 2 for pair in items):
            raise InvalidConfigError(f"{label} must be a mapping, got {value!r:.80}")
    else:
        raise InvalidConfigError(f"{label} must be a mapping, got {value!r:.80}")
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise InvalidConfigError(f"{label} repeats a field")
    return tuple(sorted(items))


def _field(schema: Schema, label: str, name: Any) -> Field:
    if not isinstance(name, str) or name not in schema.names:
        raise InvalidConfigError(f"{label}: {name!r} is not a field of the buffer")
    return schema[name]


def compression_units(schema: Schema, frame_stack: Mapping[str, int],
                      next_of: Mapping[str, str]) -> tuple[dict[str, int], dict[str, str]]:
    """What :func:`.codecs.check_compression` needs: the bytes of each field's unit of
    storage (a frame for a group's source; the value for a field outside the groups),
    and each ``next_of`` field's source."""
    units = {}
    for field in schema:
        if field.name in next_of:
            continue
        axis = frame_stack.get(field.name)
        units[field.name] = field.nbytes // (1 if axis is None else field.shape[axis])
    return units, dict(next_of)


def frame_groups(schema: Schema, frame_stack: Mapping[str, int],
                 next_of: Mapping[str, str],
                 compression: Mapping[str, tuple[str, int]] | None = None
                 ) -> tuple[FrameGroup, ...]:
    """The groups of checked options, in schema order of their sources. A compressed
    field outside them (``compression``: ``{field: (codec, level)}``) is a group of its
    own, of one value per record, not looked up by content (values of different records
    rarely repeat whole)."""
    compression = compression or {}
    sources = set(frame_stack) | set(next_of.values())
    groups = []
    for field in schema:
        if field.name not in sources:
            if field.name in compression:
                groups.append(FrameGroup(field.name, (field.name,), field.dtype, None, 1,
                                         field.shape, compression[field.name], share=False))
            continue
        axis = frame_stack.get(field.name)
        if axis is None:
            k, frame_shape = 1, field.shape
        else:
            k = field.shape[axis]
            frame_shape = field.shape[:axis] + field.shape[axis + 1:]
        targets = tuple(name for name, source in next_of.items() if source == field.name)
        groups.append(FrameGroup(field.name, (field.name, *targets), field.dtype, axis, k,
                                 frame_shape, compression.get(field.name)))
    return tuple(groups)


def stored_schema(schema: Schema, groups: tuple[FrameGroup, ...]) -> Schema:
    """``schema`` with each group's fields as ``int64[k]`` frame ids."""
    if not groups:
        return schema
    ids = {name: group.k for group in groups for name in group.fields}
    return Schema([Field(f.name, ID_DTYPE, (ids[f.name],)) if f.name in ids else f
                   for f in schema])


def default_compressed_bytes(group: FrameGroup, capacity: int) -> int:
    """The most bytes a compressed ring may grow to when none are given: the plain
    bytes of its ``capacity`` frames, so that it takes every push a plain ring would,
    whatever the data. It grows from 1-2 MiB as the live records need (see
    :class:`.arena.Arena`): its RAM and file pages follow what is stored (the file's
    region is sparse)."""
    return capacity * group.frame_nbytes


def arena_nbytes(group: FrameGroup, capacity: int, compressed_bytes: int | None) -> int:
    """The limit of a compressed group's ring: ``compressed_bytes`` (or the default),
    rounded up by a hair (:func:`.arena.ring_limit`)."""
    if compressed_bytes is None:
        compressed_bytes = default_compressed_bytes(group, capacity)
    return ring_limit(compressed_bytes, group.frame_nbytes)


def frame_regions(groups: tuple[FrameGroup, ...], capacity: int, checksums: bool,
                  compressed_bytes: int | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The file regions of the rings: ``{name: (dtype string, shape)}``. A compressed
    group's ring (``framebytes:``) comes after every other region: see
    :mod:`.bufferfile`, which leaves those regions sparse."""
    regions: dict[str, tuple[str, tuple[int, ...]]] = {}
    arenas: dict[str, tuple[str, tuple[int, ...]]] = {}
    for group in groups:
        if group.codec is not None:
            arenas[BYTES_PREFIX + group.source] = (
                "|u1", (arena_nbytes(group, capacity, compressed_bytes),))
            regions[FRAME_OFF_PREFIX + group.source] = (OFF_DTYPE.str, (capacity,))
            regions[FRAME_LAP_PREFIX + group.source] = (OFF_DTYPE.str, (1,))
            regions[FRAME_LEN_PREFIX + group.source] = (LEN_DTYPE.str, (capacity,))
        else:
            regions[FRAMES_PREFIX + group.source] = (group.dtype.str,
                                                     (capacity, *group.frame_shape))
        regions[FRAME_ID_PREFIX + group.source] = (ID_DTYPE.str, (capacity,))
        if checksums:
            regions[FRAME_SUM_PREFIX + group.source] = (CHECKSUM_DTYPE.str, (capacity,))
    return {**regions, **arenas}


# Odd 64-bit multipliers of a frame's 8-byte words: a frame's fingerprint is their dot
# product with its words (mod 2**64), computed for a batch's frames at once.
_KEYS = np.random.default_rng(0x6D696C6C706F6E64).integers(1, 2**63, 1 << 12, np.uint64) | 1


def _words(values: np.ndarray, n: int, k: int) -> np.ndarray:
    """``n`` values of ``k`` frames as their bytes, ``[n, k, words]``: 8-byte words where
    a frame's bytes divide into them, else bytes (a copy only if ``values`` is not
    contiguous, e.g. a stack along another axis than 0)."""
    raw = np.ascontiguousarray(values).reshape(n, k, -1).view(np.uint8)
    return raw.view(np.uint64) if raw.shape[2] % 8 == 0 else raw


def _rows_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Which rows (first axis) of ``a`` and ``b`` are equal, word for word."""
    if not a.size:
        return np.ones(len(a), bool)
    # (as 2-D rows: the slices of a stack compare as one run of words per row)
    return (a.reshape(len(a), -1) == b.reshape(len(b), -1)).all(axis=1)


def _fingerprint_grid(words: np.ndarray, needed: np.ndarray) -> list[list[int]]:
    """The fingerprints of the frames ``needed`` (``[n, k]`` bool) of values ``words``
    (``[n, k, w]``, as :func:`_words` makes them), as nested lists (0 where not needed):
    a 64-bit fingerprint of a frame's bytes, equal for equal frames (a candidate found by
    one is still compared)."""
    grid = np.zeros(needed.shape, np.uint64)
    if needed.all():
        grid[...] = _fingerprints(words.reshape(-1, words.shape[2])).reshape(needed.shape)
    elif needed.any():
        grid[needed] = _fingerprints(words[needed])
    return cast("list[list[int]]", grid.tolist())


def _fingerprints(frames: np.ndarray) -> np.ndarray:
    """:func:`_fingerprint_grid` of frames ``[m, w]``."""
    if frames.dtype != np.uint64:  # frames whose bytes are not whole words
        return np.array([zlib.crc32(frame.tobytes()) for frame in frames], np.uint64)
    keys = _KEYS
    if frames.shape[1] > len(keys):  # (large frames: the multipliers repeat, times 3, 5, ...)
        width = frames.shape[1]
        keys = np.resize(keys, width) * (np.arange(width, dtype=np.uint64)
                                         // np.uint64(len(_KEYS)) * np.uint64(2) + np.uint64(1))
    return frames @ keys[:frames.shape[1]]


class Ring:
    """One group's frames: ``frames[F, *frame_shape]``, the id each slot holds
    (``ids``, -1: none yet) and, in a persistent file, each frame's checksum."""

    def __init__(self, frames: np.ndarray, ids: np.ndarray, sums: np.ndarray | None):
        self.frames, self.ids, self.sums = frames, ids, sums
        self.capacity = len(frames)

    @classmethod
    def in_memory(cls, group: FrameGroup, capacity: int) -> "Ring":
        return cls(np.empty((capacity, *group.frame_shape), group.dtype),
                   np.full(capacity, -1, ID_DTYPE), None)

    def write(self, first: int, frames: Sequence[np.ndarray]) -> None:
        """Store frames with ids ``first, first + 1, ...`` (the frames, then their ids and
        checksums)."""
        n, cap = len(frames), self.capacity
        done = 0
        while done < n:
            slot = (first + done) % cap
            k = min(n - done, cap - slot)
            np.stack(frames[done:done + k], out=self.frames[slot:slot + k])  # (one copy)
            ids = np.arange(first + done, first + done + k, dtype=np.int64)
            self.ids[slot:slot + k] = ids
            if self.sums is not None:
                self.sums[slot:slot + k] = record_checksums({"frame": self.frames[slot:slot + k]},
                                                            ids.astype(np.uint64))
            done += k

    def frame(self, frame_id: int) -> np.ndarray:
        return self.frames[frame_id % self.capacity]

    def copy_out(self, frame_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Copies of frames ``frame_ids``, of the ids their slots hold (another id: the
        frame is gone) and of their stored checksums (None: a ring in RAM keeps none)."""
        slots = frame_ids % self.capacity
        return (self.frames[slots], self.ids[slots],
                None if self.sums is None else self.sums[slots])

    def put(self, frame_ids: np.ndarray, frames: np.ndarray, sums: np.ndarray) -> None:
        """Store frames with ids ``frame_ids`` (no two in one slot) and their checksums:
        a snapshot's copy of another ring's frames (see :mod:`.snapshot`)."""
        slots = frame_ids % self.capacity
        self.frames[slots] = frames
        self.ids[slots] = frame_ids
        if self.sums is not None:
            self.sums[slots] = sums

    def release(self) -> None:
        self.frames = np.empty((0,), np.uint8)
        self.ids = np.empty(0, ID_DTYPE)
        self.sums = None


class _State:
    """A ring's bookkeeping: ``tail`` (next id), the live records' smallest ids
    (monotone deque of ``(seq, min id)``), the recent frames by fingerprint and, for a
    compressed ring, their raw bytes by id (``raws``: the ring holds them compressed)."""

    def __init__(self) -> None:
        self.tail = 0
        self.mins: collections.deque[tuple[int, int]] = collections.deque()
        self.recent: dict[int, int] = {}
        self.raws: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        # the last push's successor values' ids (its first target, or without one its
        # source), [rows, k]: where the next push's sources likely continue
        self.prev: np.ndarray | None = None
        self.likely = 1  # the prediction that served the last push most (see Frames._modes)

    def head(self, first: int, pushed: int) -> int:
        """The smallest id a record in ``[first, pushed)`` refers to (``tail``: none)."""
        mins = self.mins
        while mins and mins[0][0] < first:
            mins.popleft()
        while mins and mins[-1][0] >= pushed:  # taken off a stack, or never committed
            mins.pop()
        return mins[0][1] if mins else self.tail

    def add(self, seqs: np.ndarray, lows: np.ndarray) -> None:
        mins = self.mins
        for seq, low in zip(seqs.tolist(), lows.tolist()):
            while mins and mins[-1][1] >= low:
                mins.pop()
            mins.append((seq, low))


class _Lookup:
    """One push's lookups of frames by content in a group's ring: the id of an equal
    frame among the recent ones (ids ``oldest`` on, whose bytes ``held(id)`` gives) or
    among this push's new frames, else a new id, the frame appended to ``new``."""

    def __init__(self, state: _State, oldest: int, held: Callable[[int], bytes | None]):
        self.tail, self.recent, self.oldest, self.held = state.tail, state.recent, oldest, held
        self.found: dict[int, int] = {}  # this push's new frames by fingerprint
        self.new: list[tuple[np.ndarray, int]] = []

    def id_of(self, key: int, frame: np.ndarray) -> int:
        """The id of ``frame`` (``key``: its fingerprint)."""
        hit = self.found.get(key)
        if hit is None:
            hit = self.recent.get(key)
            if hit is not None and not self.oldest <= hit < self.tail:
                hit = None
        if hit is not None:
            held = self.new[hit - self.tail][0].tobytes() if hit >= self.tail else self.held(hit)
            if held == frame.tobytes():  # bytes compared: -0.0 is not 0.0, NaN is itself
                return hit
        self.found[key] = hit = self.tail + len(self.new)
        self.new.append((frame, key))
        return hit


class Frames:
    """The frame rings of a buffer's groups and what pushes and reads do with them.

    ``rings``: one :class:`Ring` per group (in RAM, or views of the buffer's file), or
    an :class:`.arena.Arena` for a compressed group.
    """

    def __init__(self, groups: tuple[FrameGroup, ...], rings: "list[Ring | Arena]",
                 window: int = WINDOW):
        self.groups = groups
        self.rings = rings
        self.capacity = rings[0].capacity
        self.window = max(1, min(window, max(min(64, self.capacity // 4), self.capacity // 32)))
        # A compressed group keeps its window's frames raw in RAM: at most RAW_CACHE_BYTES.
        self.windows = [self.window if g.codec is None else
                        max(1, min(self.window, max(64, RAW_CACHE_BYTES // g.frame_nbytes)))
                        for g in groups]
        self.states = [_State() for _ in groups]
        self.group_of = {name: i for i, g in enumerate(groups) for name in g.fields}

    @classmethod
    def in_memory(cls, groups: tuple[FrameGroup, ...], capacity: int,
                  compressed_bytes: int | None = None) -> "Frames":
        rings: list[Ring | Arena] = []
        for g in groups:
            if g.codec is None:
                rings.append(Ring.in_memory(g, capacity))
            else:
                rings.append(Arena.in_memory(capacity, arena_nbytes(g, capacity, compressed_bytes),
                                             codec(*g.codec), g.frame_nbytes))
        return cls(groups, rings)

    @classmethod
    def in_file(cls, groups: tuple[FrameGroup, ...], region: Any,
                writer: Any = None) -> "Frames":
        """Rings viewing the file's regions (``region(name)``: the array, or None;
        ``writer(name)``: a function writing bytes at an offset of region ``name``,
        for compressed rings)."""
        rings: list[Ring | Arena] = []
        for g in groups:
            ids = region(FRAME_ID_PREFIX + g.source)
            if g.codec is not None:
                data = region(BYTES_PREFIX + g.source)
                offs = region(FRAME_OFF_PREFIX + g.source)
                lens = region(FRAME_LEN_PREFIX + g.source)
                lap = region(FRAME_LAP_PREFIX + g.source)
                if data is None or ids is None or offs is None or lens is None or lap is None:
                    raise InvalidConfigError(f"the buffer file has no compressed frame ring "
                                             f"for {g.source!r}")
                rings.append(Arena(data, ids, offs, lens, region(FRAME_SUM_PREFIX + g.source),
                                   codec(*g.codec), g.frame_nbytes,
                                   None if writer is None else writer(BYTES_PREFIX + g.source),
                                   lap_store=lap))
                continue
            frames = region(FRAMES_PREFIX + g.source)
            if frames is None or ids is None:
                raise InvalidConfigError(f"the buffer file has no frame ring for {g.source!r}")
            rings.append(Ring(frames, ids, region(FRAME_SUM_PREFIX + g.source)))
        return cls(groups, rings)

    # ---- pushes ---------------------------------------------------------------------

    def encode(self, batch: Mapping[str, np.ndarray], n: int, first: int, pushed: int
               ) -> dict[str, np.ndarray]:
        """The stored form of a validated batch of ``n`` records (seqs ``pushed`` on),
        its new frames written to the rings. ``first``: the FIFO's oldest live seq.
        StorageFullError, with nothing written, if a ring cannot hold them (see the
        module doc)."""
        stored = dict(batch)
        plans = []
        for i, group in enumerate(self.groups):
            state, ring = self.states[i], self.rings[i]
            head = state.head(first, pushed)
            ids, new, likely = self._plan(i, group, batch, n, head)
            low = min([head] + [int(a.min()) for a in ids.values() if a.size])
            if state.tail + len(new) - low > self.capacity:
                raise StorageFullError(
                    f"the frame store of {group.source!r} holds {self.capacity:,} frames; "
                    f"the live records refer to {state.tail - head:,} and this push adds "
                    f"{len(new):,}: give the buffer a larger frame_capacity (frames do not "
                    "repeat as often as the default assumes)")
            raws, prepared = None, None
            if isinstance(ring, Arena):
                raws = [np.ascontiguousarray(frame).tobytes() for frame, _ in new]
                prepared = ring.prepare(ring.compress_many(raws), low, state.tail, group.source)
            plans.append((ids, new, likely, raws, prepared))
        seqs = np.arange(pushed, pushed + n, dtype=np.int64)
        for i, (ids, new, likely, raws, prepared) in enumerate(plans):
            state, ring = self.states[i], self.rings[i]
            if new:
                if isinstance(ring, Arena):
                    assert prepared is not None
                    ring.write(state.tail, prepared)
                else:
                    ring.write(state.tail, [frame for frame, _ in new])
                if self.groups[i].share:
                    for j, (_, key) in enumerate(new):
                        state.recent[key] = state.tail + j
                        if raws is not None:
                            state.raws[state.tail + j] = raws[j]
                    window = self.windows[i]
                    while len(state.raws) > window:  # (ids in order: the oldest first)
                        state.raws.popitem(last=False)
                state.tail += len(new)
                self._forget(i, state)
            if n:
                state.add(seqs, np.min(np.stack([a.min(axis=1) for a in ids.values()]), axis=0))
                group = self.groups[i]
                state.prev = ids[group.fields[1] if len(group.fields) > 1 else group.source]
                state.likely = likely
            stored.update(ids)
        return stored

    def _plan(self, i: int, group: FrameGroup, batch: Mapping[str, np.ndarray], n: int,
              head: int) -> tuple[dict[str, np.ndarray], list[tuple[np.ndarray, int]], int]:
        """Each value's frame ids, the frames to write (with their keys), and which
        prediction served the sources most (see :meth:`_modes`).

        Where frames usually repeat is checked first, for the whole batch at once (bytes
        compared, row by row: a prediction is never trusted): a target's first ``k - 1``
        frames against its record's source's last ``k - 1`` (``next_of`` of a stack);
        a source value against the target of the record before it (one stream's
        consecutive records) or else of the same row of the previous push (streams
        stepping together); without targets, a stack's first ``k - 1`` frames against
        the last ``k - 1`` of those values. The other frames are looked up one by one
        among the recent ones by a 64-bit fingerprint of their bytes, and shared only
        with a candidate whose bytes are equal."""
        state = self.states[i]
        k, tail = group.k, state.tail
        source, targets = group.source, group.fields[1:]
        if not n:
            return {name: np.empty((0, k), np.int64) for name in group.fields}, [], state.likely
        if not group.share:  # each value is new
            ids = {source: np.arange(tail, tail + n, dtype=np.int64).reshape(n, 1)}
            return ids, [(np.asarray(v), 0) for v in batch[source]], state.likely
        oldest = tail - self.windows[i]
        if isinstance(self.rings[i], Arena):  # a frame before the head may be overwritten already
            oldest = max(oldest, head)
        values = {name: batch[name].reshape((n, 1) + group.frame_shape) if group.axis is None
                  else batch[name] if group.axis == 0  # (the stack axis already first)
                  else np.moveaxis(batch[name], 1 + group.axis, 1) for name in group.fields}
        words = {name: _words(value, n, k) for name, value in values.items()}
        # 1. the predictions, checked in bulk: each row against the likelier one first
        src = words[source]
        shift = {t: _rows_equal(words[t][:, :-1], src[:, 1:]) if k > 1 else np.zeros(n, bool)
                 for t in targets}
        ahead = targets[0] if targets else None  # the field holding a source's successor
        if ahead is None and k == 1:
            mode = np.zeros(n, np.int8)  # (single frames without a next_of: nothing to predict)
        else:
            mode = self._modes(i, words, source, ahead, n, k, oldest)
        likely = 2 if (mode == 2).sum() > (mode == 1).sum() else 1
        if len(targets) == 1 and ahead is not None and (k == 1 or shift[ahead].all()):
            ids, new = self._shifted(i, values, words, mode, oldest)
            return ids, new, likely
        # 2. the frames looked up one by one, in record order: their fingerprints at once
        rest = 0 if ahead is not None else 1  # frames a predicted source still looks up
        needed = {source: np.repeat((mode == 0)[:, None], k, axis=1)}
        needed[source][:, k - rest:] |= True
        for t in targets:
            needed[t] = np.repeat(~shift[t][:, None], k, axis=1)
            needed[t][:, -1] = True
        keys = {name: _fingerprint_grid(words[name], mask) for name, mask in needed.items()}
        # 3. the ids, record by record (lists: cheaper than rows of arrays here)
        lookup = _Lookup(self.states[i], oldest, lambda hit: self._held(i, hit))
        prev = state.prev.tolist() if state.prev is not None else []
        lists: dict[str, list[list[int]]] = {name: [] for name in group.fields}
        shifted = {t: mask.tolist() for t, mask in shift.items()}
        for r, m in enumerate(mode.tolist()):
            for name in group.fields:
                if name == source:
                    if not m:
                        out, first = [0] * k, 0
                    else:
                        before = (prev[r] if m == 2 else
                                  lists[ahead][r - 1] if ahead is not None else lists[source][r - 1])
                        out = list(before) if ahead is not None else before[1:] + [0]
                        first = k - rest
                elif shifted[name][r]:
                    out, first = lists[source][r][1:] + [0], k - 1
                else:
                    out, first = [0] * k, 0
                row, frames = keys[name][r], values[name][r]
                for j in range(first, k):
                    out[j] = lookup.id_of(row[j], frames[j])
                lists[name].append(out)
        ids = {name: np.array(rows, np.int64).reshape(n, k) for name, rows in lists.items()}
        return ids, lookup.new, likely

    def _shifted(self, i: int, values: Mapping[str, np.ndarray],
                 words: Mapping[str, np.ndarray], mode: np.ndarray, oldest: int
                 ) -> tuple[dict[str, np.ndarray], list[tuple[np.ndarray, int]]]:
        """:meth:`_plan`'s ids and new frames where the group's one target is, in every
        record, its source shifted by a frame (bytes compared already), as one episode's
        records are: only the targets' newest frames and the sources that continue no
        predecessor (``mode`` 0) are looked up; the other ids follow, for the batch at
        once."""
        group = self.groups[i]
        source, target = group.fields
        n, k = len(mode), group.k
        lookup = _Lookup(self.states[i], oldest, lambda hit: self._held(i, hit))
        # A run of records starts at a source looked up (mode 0) or continuing the last
        # push (mode 2: the ids of state.prev's row), and goes on with records continuing
        # the one before (mode 1): then the j-th frame of record r's source is the
        # start's frame r - start + j while that is < k, and else record r + j - k's
        # newest frame (its target's last).
        rows = np.arange(n)
        base = np.zeros((n, k), np.int64)
        continuing = mode == 2
        if continuing.any():
            base[continuing] = cast(np.ndarray, self.states[i].prev)[rows[continuing]]
        alone = np.flatnonzero(mode == 0)
        if len(alone):
            keys = _fingerprints(words[source][alone].reshape(len(alone) * k, -1)).tolist()
            frames = values[source][alone].reshape((len(alone) * k,) + group.frame_shape)
            base[alone] = np.array([lookup.id_of(key, frame) for key, frame in zip(keys, frames)],
                                   np.int64).reshape(len(alone), k)
        newest = np.array([lookup.id_of(key, frame) for key, frame in
                           zip(_fingerprints(words[target][:, -1]).tolist(),
                               values[target][:, -1])], np.int64)
        starts = np.maximum.accumulate(np.where(mode != 1, rows, 0))[:, None]
        at = rows[:, None] + np.arange(k) - k  # (the record whose newest frame it is)
        later = at >= starts
        ids = np.where(later, newest[np.maximum(at, 0)],
                       base[starts, np.where(later, 0, at + k - starts)])
        shifted = np.concatenate([ids[:, 1:], newest[:, None]], axis=1)
        return {source: ids, target: shifted}, lookup.new

    def _modes(self, i: int, words: Mapping[str, np.ndarray], source: str,
               ahead: str | None, n: int, k: int, oldest: int) -> np.ndarray:
        """Where each source value continues (bytes compared): 1, the successor of the
        record before it in the batch; 2, that of the same row of the last push; 0,
        neither. (A successor: the ``ahead`` target, or without one the source itself
        shifted by a frame.) The kind that served the last push is tried first."""
        state = self.states[i]
        src = words[source]
        mode = np.zeros(n, np.int8)
        prev = state.prev
        for kind in ((2, 1) if state.likely == 2 else (1, 2)):
            rows: slice | np.ndarray
            if kind == 1:
                if n < 2 or mode[1:].all():
                    continue
                rows = slice(1, n)  # (all compared, as slices: cheaper than a copy of some)
                held = words[ahead][:-1] if ahead is not None else src[:-1]
            else:
                if prev is None:
                    continue
                m = min(n, len(prev))
                # rows still open whose predecessor's frames are all in the window
                open_ = np.flatnonzero((mode[:m] == 0) & (prev[:m].min(axis=1) >= oldest))
                if not len(open_):
                    continue
                rows = slice(0, m) if len(open_) == m else open_
                frames = self._held_frames(i, prev[rows].reshape(-1))
                if frames is None:
                    continue
                held = _words(frames, len(open_), k)
            same = (_rows_equal(src[rows], held) if ahead is not None
                    else _rows_equal(src[rows, :-1], held[:, 1:]))
            part = mode[rows]
            mode[rows] = np.where((part == 0) & same, kind, part)
        return mode

    def _held(self, i: int, frame_id: int) -> bytes | None:
        """The bytes of frame ``frame_id`` of ring ``i`` (within the window: see
        :meth:`_plan`), None if a compressed ring no longer keeps them raw."""
        ring = self.rings[i]
        if isinstance(ring, Arena):
            return self.states[i].raws.get(frame_id)
        return ring.frame(frame_id).tobytes()

    def _held_frames(self, i: int, frame_ids: np.ndarray) -> np.ndarray | None:
        """Frames ``frame_ids`` of ring ``i`` (within the window), None if a compressed
        ring no longer keeps one of them raw."""
        ring = self.rings[i]
        if not isinstance(ring, Arena):
            return ring.frames.take(frame_ids % ring.capacity, axis=0)
        raws = self.states[i].raws
        held = [raws.get(frame_id) for frame_id in frame_ids.tolist()]
        if any(raw is None for raw in held):
            return None
        group = self.groups[i]
        return np.frombuffer(b"".join(cast("list[bytes]", held)), group.dtype).reshape(
            (len(held),) + group.frame_shape)

    def _forget(self, i: int, state: _State) -> None:
        """Drop lookups of frames older than the window (now and then: amortized)."""
        window = self.windows[i]
        if len(state.recent) > 4 * window:
            oldest = state.tail - window
            state.recent = {key: i for key, i in state.recent.items() if i >= oldest}

    # ---- reads ----------------------------------------------------------------------

    def decode(self, name: str, ids: np.ndarray, out: np.ndarray) -> None:
        """Field ``name`` of ``m`` records from their frame ids ``[m, k]`` into ``out``
        (``[m, *shape]``)."""
        self.decode_fields({name: (ids, out)})

    def decode_fields(self, fields: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """:meth:`decode` of several fields (``{name: (ids, out)}``): the fields of one
        compressed group decompress each distinct frame once."""
        by_group: dict[int, list[str]] = {}
        for name in fields:
            by_group.setdefault(self.group_of[name], []).append(name)
        for i, names in by_group.items():
            group, ring = self.groups[i], self.rings[i]
            if isinstance(ring, Ring):
                for name in names:
                    ids, out = fields[name]
                    self._place(group, ring.frames, np.remainder(ids.reshape(-1), ring.capacity),
                                len(ids), out)
                continue
            flat = [fields[name][0].reshape(-1) for name in names]
            wanted, inverse = np.unique(np.concatenate(flat), return_inverse=True)
            frames = ring.read(wanted).view(group.dtype).reshape((len(wanted),) + group.frame_shape)
            at = 0
            for name, part in zip(names, flat):
                ids, out = fields[name]
                self._place(group, frames, inverse[at:at + len(part)], len(ids), out)
                at += len(part)

    @staticmethod
    def _place(group: FrameGroup, frames: np.ndarray, rows: np.ndarray, m: int,
               out: np.ndarray) -> None:
        """Values of ``m`` records from ``frames[rows]`` (``rows``: ``m * k``) into ``out``."""
        if group.axis is None:
            frames.take(rows, axis=0, mode="clip", out=out.reshape((m,) + group.frame_shape))
            return
        if group.axis == 0 and out.flags.c_contiguous:
            frames.take(rows, axis=0, mode="clip",
                        out=out.reshape((m * group.k,) + group.frame_shape))
            return
        taken = frames.take(rows, axis=0, mode="clip").reshape((m, group.k) + group.frame_shape)
        out[...] = np.moveaxis(taken, 1, 1 + group.axis)

    def stored_form(self, result: Mapping[str, np.ndarray]) -> StoredBatch:
        """A read's ``result`` as a :class:`.stored.StoredBatch`: its group fields are frame
        refs (``id + 1``, 0 for a zero frame: see :meth:`.fifo.Fifo.stored_reads`), each
        group's distinct frames go in one table (as stored: a compressed group's blobs are
        not decompressed), the fields index it; other arrays stay as they are."""
        batch = StoredBatch({name: array for name, array in result.items()
                             if name not in self.group_of})
        for i, group in enumerate(self.groups):
            names = [name for name in group.fields if name in result]
            if not names:
                continue
            flat = [result[name].reshape(-1) for name in names]
            wanted, inverse = np.unique(np.concatenate(flat), return_inverse=True)
            if len(wanted) and wanted[0] == 0:  # zero frames: index -1
                wanted, inverse = wanted[1:], inverse - 1
            wanted = wanted - 1
            ring = self.rings[i]
            if isinstance(ring, Arena):
                data, lens = ring.blobs(wanted)
                batch.tables[group.source] = FrameTable(
                    group.codec[0] if group.codec else None, data=data,
                    lens=lens.astype(LEN_DTYPE, copy=False))
            else:
                batch.tables[group.source] = FrameTable(
                    None, frames=ring.frames.take(np.remainder(wanted, ring.capacity), axis=0))
            at = 0
            for name, part in zip(names, flat):
                refs = result[name]
                batch.refs[name] = (group.source, group.axis,
                                    inverse[at:at + len(part)].astype(INDEX_DTYPE)
                                    .reshape(refs.shape))
                at += len(part)
        return batch

    def live_frames(self, first: int, pushed: int) -> list[int]:
        """Frames each ring holds for the live records (``tail - head``)."""
        return [state.tail - state.head(first, pushed) for state in self.states]

    def stored_nbytes(self, first: int, pushed: int) -> int:
        """Bytes of the frames the live records refer to (a compressed ring: the bytes of
        the ring they take, and their index)."""
        total = 0
        for state, group, ring in zip(self.states, self.groups, self.rings):
            head = state.head(first, pushed)
            if isinstance(ring, Arena):
                total += ring.stored_nbytes(head, state.tail)
            else:
                total += (state.tail - head) * group.frame_nbytes
        return total

    # ---- reopen ---------------------------------------------------------------------

    def restore(self, seqs: np.ndarray, ids: Mapping[str, np.ndarray]) -> None:
        """Rebuild the bookkeeping from the live, undamaged records ``seqs`` (oldest
        first) and their stored ids (``{field: [len(seqs), k]}``)."""
        for i, group in enumerate(self.groups):
            state = self.states[i] = _State()
            ring = self.rings[i]
            if len(seqs):
                columns = [ids[name] for name in group.fields]
                state.tail = max(int(c.max()) for c in columns) + 1
                state.add(seqs, np.min(np.stack([c.min(axis=1) for c in columns]), axis=0))
            if isinstance(ring, Arena):
                ring.restore(state.tail)

    def damaged(self, seqs: np.ndarray, ids: Mapping[str, np.ndarray]) -> np.ndarray:
        """Which of ``seqs`` (with their stored ids) refer to a frame that is not in its
        ring (another id in its slot) or fails its checksum: a bool mask."""
        bad = np.zeros(len(seqs), bool)
        for i, group in enumerate(self.groups):
            for name in group.fields:
                refs = ids[name]
                wanted = np.unique(refs)
                if not len(wanted):
                    continue
                wrong = self.failing(i, wanted)
                if wrong.any():
                    bad |= np.isin(refs, wanted[wrong]).any(axis=1)
        return bad

    def failing(self, i: int, wanted: np.ndarray) -> np.ndarray:
        """Which frames ``wanted`` (ids) of ring ``i`` are not in it (another id in their
        slot, or for a compressed ring an offset or length that cannot be) or fail their
        checksum (a ring that keeps them): a bool mask."""
        ring = self.rings[i]
        if isinstance(ring, Arena):
            return ring.damaged(wanted)
        slots = wanted % ring.capacity
        wrong = (wanted < 0) | (ring.ids[slots] != wanted)
        if ring.sums is not None:
            ok = np.flatnonzero(~wrong)
            for lo in range(0, len(ok), 4096):
                part = ok[lo:lo + 4096]
                sums = record_checksums({"frame": ring.frames[slots[part]]},
                                        wanted[part].astype(np.uint64))
                wrong[part] |= sums != ring.sums[slots[part]]
        return wrong

    def release(self) -> None:
        for ring in self.rings:
            ring.release()
