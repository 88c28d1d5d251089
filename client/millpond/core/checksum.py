"""Per-record checksums, computed for many records at once (format version 5 on).

A record's checksum is 32 bits of a position-dependent, non-linear hash of
every field's bytes and of its seq. It is computed with whole-array numpy
operations over many records at a time, never a Python call per record.

The record as words: each field's bytes, in schema order, are read as
little-endian 64-bit words, the field's last partial word zero-padded; the
seq is one more word. With ``N`` words ``c_0 .. c_{N-1}`` (the seq last)::

    k_j  = splitmix64(j)                        a fixed key per word position
    x_j  = c_j XOR k_j
    acc  = sum over j of  x_j * ((x_j >> 32) | 1)       (mod 2**64)
    h    = fmix64(acc)                          (MurmurHash3's finalizer)
    checksum = h >> 32

Why this one: each word is keyed by its position and multiplied by a value
that depends on its own high half, so the sum is neither linear nor
position-blind. The XOR fold it replaces (format 4,
:mod:`.checksum_v4`) could not see two swapped words of a field, two words
changed by the same XOR delta, or a sign bit flipped in two words, and let 1
in 65,536 random corruptions through; here a random corruption escapes with
probability about 2**-32, whatever its shape. A bit flipped in a word changes
that word's term by an odd multiple of a power of two below 2**64 when it is
in the low half (never by 0), and a torn record (part old, part new bytes) is
a random change.

Why one algorithm for all records, and numpy: records are 40 bytes
(CartPole, a million a second) or 56 KB (Atari). A maintained hash per
record (crc32c, xxh3) is a Python call per record and field, which costs
more than the whole push for small records (10,000 CartPole records: 60,000
calls); a vectorized hash costs four passes over the bytes in cache-sized
blocks, the same code for both ends. Measured on the 2-core development
machine (``make bench ARGS="--only integrity"``, beside the format 4 fold in
the same run): 4 GB/s for CartPole batches (0.64x the fold), 9 GB/s for Atari
ones (0.2x the fold, which was one pass at memory speed); persistent
in-process pushes at 0.7-1.0x (CartPole) and 0.45-0.8x (Atari: there the
hash is up to half of a push); pushes to the daemon (format 5 beside
format 4, ``--sync none``) at about 0.6x over shared memory and 0.75x over
gRPC for Atari, 0.75-0.85x for CartPole. A maintained hash per record for
large records (xxh3) could cut the Atari cost, at the price of a second
algorithm and a dependency; the engine keeps to numpy and the standard
library.

How: small fields (and the seq, and the last partial word of large ones) are
copied word by word into one scratch matrix ``[words, records]`` and hashed
in one go; large fields are hashed in place, a block of rows at a time (a few
hundred KiB: the passes stay in the CPU's cache).
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Mapping

import numpy as np

CHECKSUM_DTYPE = np.dtype("<u4")
# A field of more than this many whole words is hashed in place, block by block.
_SMALL_WORDS = 8
# Words per block: scratch of a few hundred KiB, in cache.
_BLOCK_WORDS = 1 << 16
# Records per pass over the small words (their scratch matrix stays in cache too).
_CHUNK_RECORDS = 1 << 14
_U64 = np.dtype("<u8")
_THIRTY_TWO = np.uint64(32)
_ONE = np.uint64(1)
_FMIX = (np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53))
_THIRTY_THREE = np.uint64(33)


_local = threading.local()  # each thread's scratch (buffers push from several threads)


def _scratch(name: str, shape: tuple[int, int]) -> np.ndarray:
    """A reused uint64 array of ``shape`` (fresh memory would be paged in on every call)."""
    size = shape[0] * shape[1]
    pool = _local.__dict__
    flat = pool.get(name)
    if flat is None or len(flat) < size:
        flat = pool[name] = np.empty(size, np.uint64)
    return flat[:size].reshape(shape)


def _splitmix64(j: np.ndarray) -> np.ndarray:
    z = (j.astype(np.uint64) + _ONE) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class _Plan:
    """How one schema's records become words (by field sizes only)."""

    def __init__(self, sizes: tuple[int, ...]):
        # small: (field, row in the scratch matrix, whole words, tail bytes)
        self.small: list[tuple[int, int, int, int]] = []
        # large: (field, key offset, whole words, scratch row of the tail or -1)
        self.large: list[tuple[int, int, int, int]] = []
        position, rows, keys = 0, 0, []
        for i, nbytes in enumerate(sizes):
            whole, tail = divmod(nbytes, 8)
            words = whole + (1 if tail else 0)
            if whole > _SMALL_WORDS:
                self.large.append((i, position, whole, rows if tail else -1))
                if tail:
                    keys.append(position + whole)
                    rows += 1
            elif words:
                self.small.append((i, rows, whole, tail))
                keys.extend(range(position, position + words))
                rows += words
            position += words
        keys.append(position)  # the seq
        self.seq_row = rows
        self.rows = rows + 1
        everything = _splitmix64(np.arange(position + 1))
        self.keys = everything  # by word position
        self.small_keys = everything[np.array(keys)][:, None]  # by scratch row


@lru_cache(maxsize=256)
def _plan(sizes: tuple[int, ...]) -> _Plan:
    return _Plan(sizes)


def record_checksums(columns: Mapping[str, np.ndarray], seqs: np.ndarray) -> np.ndarray:
    """Checksums (``CHECKSUM_DTYPE``) of ``k`` records: ``columns`` are ``[k, *shape]``
    in schema order, ``seqs`` their seqs."""
    k = len(seqs)
    raws = [_bytes(column, k) for column in columns.values()]
    plan = _plan(tuple(raw.shape[1] for raw in raws))
    acc = np.zeros(k, np.uint64)
    seqs = np.asarray(seqs)
    for lo in range(0, k, _CHUNK_RECORDS):
        hi = min(k, lo + _CHUNK_RECORDS)
        words = _scratch("words", (plan.rows, hi - lo))
        _small_words(plan, raws, seqs, lo, hi, words)
        _mix(words, plan.small_keys, acc[lo:hi], axis=0)
    for i, offset, whole, _ in plan.large:
        _hash_rows(raws[i], whole, plan.keys[offset : offset + whole], acc)
    return _finish(acc)


def _bytes(column: np.ndarray, k: int) -> np.ndarray:
    """``column``'s rows as ``[k, nbytes]`` uint8 (a view if it is contiguous)."""
    column = np.ascontiguousarray(column)
    if not column.size:
        return np.zeros((k, 0), np.uint8)
    return column.reshape(k, -1).view(np.uint8)


def _small_words(plan: _Plan, raws: list[np.ndarray], seqs: np.ndarray, lo: int, hi: int,
                 words: np.ndarray) -> None:
    """Fill ``words`` (``[rows, hi - lo]``) with records ``lo..hi``'s small words."""
    for i, row, whole, tail in plan.small:
        raw = raws[i][lo:hi]
        if whole:
            words[row : row + whole] = raw[:, : 8 * whole].view(_U64).T
        if tail:
            words[row + whole] = _tail_word(raw, 8 * whole)
    for i, _, whole, tail_row in plan.large:
        if tail_row >= 0:
            words[tail_row] = _tail_word(raws[i][lo:hi], 8 * whole)
    words[plan.seq_row] = seqs[lo:hi]


def _tail_word(raw: np.ndarray, start: int) -> np.ndarray:
    """Bytes ``start:`` (fewer than 8) of each row as one little-endian word, zero-padded."""
    nbytes = raw.shape[1] - start
    if nbytes in (1, 2, 4):
        return raw[:, start:].view(f"<u{nbytes}")[:, 0]
    word = np.zeros(len(raw), np.uint64)
    pos = start
    for width in (4, 2, 1):
        if raw.shape[1] - pos >= width:
            part = raw[:, pos : pos + width].view(f"<u{width}")[:, 0].astype(np.uint64)
            part <<= np.uint64(8 * (pos - start))
            word |= part
            pos += width
    return word


def _mix(words: np.ndarray, keys: np.ndarray, acc: np.ndarray, axis: int,
         x: np.ndarray | None = None, scratch: np.ndarray | None = None) -> None:
    """``acc += sum over axis of x * ((x >> 32) | 1)``, ``x = words ^ keys`` (into ``x``,
    default ``words``)."""
    x = np.bitwise_xor(words, keys, out=words if x is None else x)
    m = np.right_shift(x, _THIRTY_TWO, out=scratch)
    np.bitwise_or(m, _ONE, out=m)
    if axis == 1:  # long rows: multiply and sum in one pass
        acc += np.einsum("ij,ij->i", x, m)
        return
    np.multiply(x, m, out=x)
    acc += x.sum(axis=axis, dtype=np.uint64)


def _hash_rows(raw: np.ndarray, whole: int, keys: np.ndarray, acc: np.ndarray) -> None:
    """Add the terms of each row's first ``whole`` words (``raw``: [k, nbytes] uint8) to ``acc``."""
    k = len(raw)
    rows = max(1, _BLOCK_WORDS // whole)
    x = _scratch("x", (min(k, rows), whole))
    m = _scratch("m", (min(k, rows), whole))
    for lo in range(0, k, rows):
        hi = min(k, lo + rows)
        _mix(raw[lo:hi, : 8 * whole].view(_U64), keys, acc[lo:hi], axis=1, x=x[: hi - lo],
             scratch=m[: hi - lo])


def _finish(acc: np.ndarray) -> np.ndarray:
    """fmix64 of each sum, its high 32 bits (``acc`` is spoiled)."""
    h = acc
    h ^= h >> _THIRTY_THREE
    h *= _FMIX[0]
    h ^= h >> _THIRTY_THREE
    h *= _FMIX[1]
    h ^= h >> _THIRTY_THREE
    return (h >> _THIRTY_TWO).astype(CHECKSUM_DTYPE)
