"""Compression codecs of large fields (``compression="zstd"`` or ``"lz4"``): the option,
checked, and the codecs themselves.

**Which library, and why.** Two codecs, one library each, both core dependencies of
millpond (a daemon must be able to open any buffer file it is given, whatever the client
that made it had installed; the wheels are small and exist for CPython 3.10-3.13 on
Linux, macOS and Windows):

* ``"lz4"``, python-lz4's block format (``lz4.block``): the fastest to decompress
  (0.65-0.85 us for an 84x84 Atari frame in a reader's loop on the 2-core development
  machine) and to compress (3-6 us), at 17-30x on Atari frames (230-410 bytes a frame).
  Levels: 0 (the default: LZ4's fast mode), 1-12 (LZ4 HC: a little smaller, much slower
  pushes).
* ``"zstd"``, python-zstandard (``zstandard``, its C backend): 1.2-1.5x smaller than lz4
  on Atari frames at its default level (160-340 bytes a frame), 1.2-1.7x slower to
  decompress (0.8-1.35 us a frame, many in one call). Levels -7 to 22; default -1:
  zstd's negative levels store literals without Huffman coding, and on these frames
  level -1 decompresses 1.2x (Pong) to 1.8x (Breakout) faster than zstd's own default,
  3, for 0-15% more bytes, and compresses in 3-4 instead of 5-6 us a frame (levels 1 and
  3 decompress alike; below -1 frames grow and decompress no faster). A level is the
  writer's choice only: frames of any level read alike (a buffer written at 3, the
  default before, reads as it did). So lz4 for the learner's speed, zstd for the most
  records in RAM.

Both release the GIL while they (de)compress, so large values are (de)compressed on
threads (see :mod:`.arena`). Both are maintained, with wheels for every CPython we support;
``blosc2`` was set aside: it is a far larger dependency (its own array container and
compute engine) for what are, here, single blobs of a few KB, where its shuffle filters
gain nothing on uint8 pixels. The standard library's ``compression.zstd`` exists only
from CPython 3.14. zlib (standard) decompresses a Pong frame in about 15 us (10-15x lz4).

Each value (a frame of a ``frame_stack``/``next_of`` field, or one record's value of
another field) is compressed on its own, so any one can be read without its
neighbours. A value that does not shrink is stored as it is (see :mod:`.arena`).

**The option** (:func:`check_compression`): ``compression="zstd"`` (or ``"lz4"``)
compresses every *large* field: one whose unit of storage (its frame, for a field with
frame options; its whole value per record otherwise) is at least :data:`MIN_BYTES`
(1 KiB); smaller fields stay plain (compressing a few dozen bytes costs more than it
saves). ``compression={"obs": "zstd", "state": ("lz4", 0)}`` or ``{"obs": {"codec":
"zstd", "level": 5}}`` names fields, each of which must be large; a ``next_of`` field
shares its source's frames, so it is named through its source. ``("zstd", 9)`` gives a
level with the codec. Normalized to a sorted tuple of ``(field, codec, level)``, one per
compressed source field.
"""

from __future__ import annotations

import itertools
import operator
import threading
from typing import Any, Callable, Mapping

import numpy as np

from millpond.errors import InvalidConfigError

MIN_BYTES = 1024  # the smallest unit of storage that is compressed
LEVELS = {"lz4": (0, 12, 0), "zstd": (-7, 22, -1)}  # codec: (lowest, highest, default)
CODECS = tuple(LEVELS)


class Codec:
    """One codec at one level: ``compress(bytes) -> bytes``,
    ``decompress(buffer, nbytes) -> bytes`` (``nbytes``: the value's size, known to the
    reader) and ``decompress_many(data, starts, lengths, nbytes)``, the values stored at
    ``data[start:start + length]`` (those of length ``nbytes`` raw: as they are), as a list
    of bytes-like parts, each at most ``nbytes`` long (a part of another length is a blob
    that lied: the caller checks), or the codec's error. Thread-safe: zstd's
    (de)compressor objects are kept per thread. ``decompress_many`` is a reader's hot loop
    (hundreds of 84x84 frames a sample), so it is made tight: lz4 without keywords or a
    test per value (0.62 instead of 0.75 ms for 850 Atari frames), zstd in one GIL-free
    call (:func:`_zstd_many`). ``gil_per_value``: ``decompress_many`` takes the GIL back
    after each value (lz4), so that threads running it at once hand the GIL to each other
    at every value."""

    def __init__(self, name: str, level: int):
        self.name, self.level = name, level
        self.gil_per_value = name == "lz4"
        self._local = threading.local()
        self.compress: Callable[[bytes], bytes]
        self.decompress: Callable[[Any, int], bytes]
        self.decompress_many: Callable[[memoryview, list[int], list[int], int], list[Any]]
        if name == "lz4":
            block = _module("lz4.block", "lz4")
            if level:
                def compress(raw: bytes) -> bytes:
                    return block.compress(raw, mode="high_compression", compression=level,
                                          store_size=False)
            else:
                def compress(raw: bytes) -> bytes:
                    return block.compress(raw, store_size=False)

            def decompress(data: Any, nbytes: int) -> bytes:
                return block.decompress(data, uncompressed_size=nbytes)

            def many(data: memoryview, starts: list[int], lengths: list[int],
                     nbytes: int) -> list[Any]:
                unpack = block.decompress  # (source, uncompressed_size): positional is faster
                if nbytes in lengths:  # raw values among them (rare: noise that does not shrink)
                    return [data[at:at + n] if n == nbytes else unpack(data[at:at + n], nbytes)
                            for at, n in zip(starts, lengths)]
                return list(map(unpack, map(data.__getitem__,
                                            map(slice, starts, map(operator.add, starts, lengths))),
                                itertools.repeat(nbytes)))
            self.compress, self.decompress, self.decompress_many = compress, decompress, many
        else:
            zstd = _module("zstandard", "zstandard")
            local = self._local

            def zcompress(raw: bytes) -> bytes:
                c = getattr(local, "c", None)
                if c is None:
                    c = local.c = zstd.ZstdCompressor(level=level, write_checksum=False,
                                                      write_content_size=True,
                                                      write_dict_id=False)
                return c.compress(raw)

            def zdecompress(data: Any, nbytes: int) -> bytes:
                return _zstd_decompressor().decompress(data, max_output_size=nbytes)
            self.compress, self.decompress, self.decompress_many = zcompress, zdecompress, _zstd_many

    def __repr__(self) -> str:
        return f"Codec({self.name!r}, {self.level})"


_LOCAL = threading.local()


def _zstd_decompressor() -> Any:
    """This thread's zstd decompressor (they are not thread-safe)."""
    d = getattr(_LOCAL, "zstd", None)
    if d is None:
        import zstandard
        d = _LOCAL.zstd = zstandard.ZstdDecompressor()
    return d


def _zstd_many(data: memoryview, starts: list[int], lengths: list[int], nbytes: int
               ) -> list[Any]:
    """zstd blobs ``data[start:start + length]`` decompressed (those of ``nbytes`` raw: as
    they are), each exactly ``nbytes`` or ZstdError: python-zstandard's
    ``multi_decompress_to_buffer`` with every output's size given (it allocates those sizes,
    whatever a blob's header says, and fails a blob that decompresses to any other), one C
    call with the GIL released: 1.2-1.5x faster than a call per blob on 850 Atari frames,
    each of which also takes the GIL back."""
    import zstandard

    n = len(starts)
    if not n:
        return []
    at = np.asarray(starts, np.uint64)
    size = np.asarray(lengths, np.uint64)
    packed = size != nbytes
    count = int(np.count_nonzero(packed))
    if count:
        segments = np.stack([at[packed], size[packed]], axis=1) if count < n else \
            np.stack([at, size], axis=1)
        found = _zstd_decompressor().multi_decompress_to_buffer(
            zstandard.BufferWithSegments(data, segments.tobytes()),
            decompressed_sizes=np.full(count, nbytes, np.uint64).tobytes())
        if count == n:
            return list(map(found.__getitem__, range(count)))
    out: list[Any] = [data[a:a + length] for a, length in zip(starts, lengths)]
    if count:
        for j, i in enumerate(np.flatnonzero(packed).tolist()):
            out[i] = found[j]
    return out


def _module(name: str, package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:  # a hand-made environment: pip install millpond has them
        raise InvalidConfigError(
            f"compression needs the {package!r} package, a dependency of millpond that is "
            f"not installed here: pip install {package}") from exc


def codec(name: str, level: int) -> Codec:
    """The codec of a checked ``(name, level)``."""
    return Codec(name, level)


def check_codec(label: str, spec: Any) -> tuple[str, int]:
    """``(codec, level)`` of one field's setting: ``"zstd"``, ``("zstd", 5)``,
    ``{"codec": "zstd", "level": 5}``; InvalidConfigError otherwise."""
    level: Any = None
    if isinstance(spec, str):
        name = spec
    elif isinstance(spec, Mapping):
        unknown = set(spec) - {"codec", "level"}
        if unknown or "codec" not in spec:
            raise InvalidConfigError(f"{label} must be {{'codec': ..., 'level': ...}}, "
                                     f"got {dict(spec)!r:.80}")
        name, level = spec["codec"], spec.get("level")
    elif isinstance(spec, (tuple, list)) and len(spec) == 2:
        name, level = spec
    else:
        raise InvalidConfigError(f"{label} must be a codec name ({' or '.join(CODECS)}), "
                                 f"optionally with a level; got {spec!r:.80}")
    if name not in LEVELS:
        raise InvalidConfigError(f"{label}: unknown codec {name!r}; millpond has "
                                 f"{', '.join(CODECS)}")
    low, high, default = LEVELS[name]
    if level is None:
        level = default
    if isinstance(level, bool) or not isinstance(level, int) or not low <= level <= high:
        raise InvalidConfigError(f"{label}: {name} levels are integers {low} to {high}, "
                                 f"got {level!r}")
    return name, int(level)


def check_compression(compression: Any, units: Mapping[str, int],
                      sources: Mapping[str, str]) -> tuple[tuple[str, str, int], ...]:
    """The option normalized: ``((field, codec, level), ...)`` sorted, one per compressed
    unit. ``units``: each field that can be compressed on its own (the sources of frame
    groups, the other fields) and its unit's bytes; ``sources``: a ``next_of`` field's
    source."""
    if compression is None or compression == () or compression == {}:
        return ()
    if isinstance(compression, str) or (isinstance(compression, (tuple, list))
                                         and len(compression) == 2
                                         and isinstance(compression[0], str)
                                         and not isinstance(compression[1], (str, tuple, list))):
        name, level = check_codec("compression", compression)
        return tuple((field, name, level) for field, nbytes in sorted(units.items())
                     if nbytes >= MIN_BYTES)
    if isinstance(compression, Mapping):
        items = list(compression.items())
    elif isinstance(compression, (tuple, list)) and all(
            isinstance(item, (tuple, list)) and len(item) in (2, 3) for item in compression):
        # the normalized form itself (a config read back): ((field, codec, level), ...)
        items = [(item[0], tuple(item[1:]) if len(item) == 3 else item[1]) for item in compression]
    else:
        raise InvalidConfigError(f"compression must be a codec name ({' or '.join(CODECS)}) "
                                 f"or a mapping field -> codec, got {compression!r:.80}")
    out: dict[str, tuple[str, int]] = {}
    for field, spec in items:
        if not isinstance(field, str) or (field not in units and field not in sources):
            raise InvalidConfigError(f"compression: {field!r} is not a field of the buffer")
        if field in sources:
            raise InvalidConfigError(
                f"compression[{field!r}]: {field} is next_of {sources[field]!r} and shares its "
                f"frames; give compression for {sources[field]!r}")
        if field in out:
            raise InvalidConfigError(f"compression repeats {field!r}")
        if units[field] < MIN_BYTES:
            raise InvalidConfigError(
                f"compression[{field!r}]: its values (frames) are {units[field]} bytes; "
                f"millpond compresses units of at least {MIN_BYTES} bytes (smaller ones cost "
                "more than they save): leave it plain")
        out[field] = check_codec(f"compression[{field!r}]", spec)
    return tuple(sorted((field, name, level) for field, (name, level) in out.items()))
