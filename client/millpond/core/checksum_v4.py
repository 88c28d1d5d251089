"""The per-record checksum of format version 4 files (read, and written to, as they are).

Files of format 5 on use :mod:`.checksum`; this one is kept so that files
made by an older millpond still open. What it cannot see is why it was
replaced (see there).

A record's checksum covers every field's bytes and its seq. It is computed
with whole-array numpy operations (XOR-folding each field's bytes as 64-bit
words, a rotation per field so fields cannot cancel out, the seq mixed in
with a multiplicative hash) and folded to 16 bits: any single flipped bit
changes it, and a torn record (part old, part new bytes) escapes with
probability 2**-16. Two bytes per record keep a CartPole record's overhead
(seq + checksum) at 6 of its 42 bytes.

For fields ``f_0 .. f_{m-1}`` in schema order::

    fold(f)  = XOR of the record's bytes of f as 64-bit words (native order;
               the last < 8 bytes make one more word, little-endian, zero-padded)
    acc      = XOR over i of rotl(fold(f_i), 7 * (m - i) mod 64)
               ^ seq * 0x9E3779B97F4A7C15 (mod 2**64)
    acc     ^= acc >> 32; acc ^= acc >> 16
    checksum = acc mod 2**16

(``rotl`` is linear over XOR: this is XOR-ing each field's fold into a
running value and rotating that by 7, field after field.) The cost is a few
numpy calls per field, whatever its size: a field's last bytes are read as
one 4-, 2- and 1-byte integer each, not byte by byte. The calls work in place
(on the daemon each one costs more than its arithmetic): a field of 1, 2 or 4
bytes is its own fold, shifted as it is widened, and its rotation's wrapped
part is skipped when it has no bits.
"""

from __future__ import annotations

import sys
from typing import Mapping

import numpy as np

CHECKSUM_DTYPE = np.dtype("<u2")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ROTATION = 7
# Rows of at most this many words are XOR-ed column by column: a reduce per
# row costs more than a few whole-column XORs.
_SHORT_ROW = 16
# A row of exactly this many bytes is one word: its fold, without a copy.
_ONE_WORD: dict[int, np.dtype] = {n: np.dtype(f"<u{n}") for n in (1, 2, 4, 8)}
_LITTLE_ENDIAN = sys.byteorder == "little"


def record_checksums(columns: Mapping[str, np.ndarray], seqs: np.ndarray) -> np.ndarray:
    """Checksums of ``k`` records: ``columns`` are ``[k, *shape]`` in schema order."""
    k = len(seqs)
    m = len(columns)
    acc = np.multiply(seqs, _GOLDEN, dtype=np.uint64, casting="unsafe")
    scratch = np.empty(k, np.uint64)
    for i, column in enumerate(columns.values()):
        fold, bits = _fold(np.ascontiguousarray(column).reshape(k, -1).view(np.uint8))
        if bits:  # else no bytes: its fold is 0
            _xor_rotated(acc, fold, bits, _ROTATION * (m - i) % 64, scratch)
    return _fold_to_16_bits(acc)


def _xor_rotated(acc: np.ndarray, fold: np.ndarray, bits: int, rotation: int,
                 scratch: np.ndarray) -> None:
    """``acc ^= rotl(fold, rotation)``; ``fold`` has at most ``bits`` bits (its dtype
    may be narrower than 64: it is widened as it is shifted)."""
    if rotation == 0:
        np.bitwise_xor(acc, fold, out=acc)
        return
    # rotl: the two shifted parts have no bit in common, so | is ^
    np.left_shift(fold, rotation, out=scratch, dtype=np.uint64)
    np.bitwise_xor(acc, scratch, out=acc)
    if bits + rotation > 64:  # else the part wrapped around is 0
        np.right_shift(fold, 64 - rotation, out=scratch, dtype=np.uint64)
        np.bitwise_xor(acc, scratch, out=acc)


def _fold_to_16_bits(acc: np.ndarray) -> np.ndarray:
    """``acc ^= acc >> 32; acc ^= acc >> 16``, its low 16 bits (``acc`` may be spoiled)."""
    if not _LITTLE_ENDIAN:
        acc ^= acc >> np.uint64(32)
        acc ^= acc >> np.uint64(16)
        return acc.astype(CHECKSUM_DTYPE)
    halves = acc.view(np.uint32).reshape(-1, 2)  # (low, high) of each word
    low = halves[:, 0] ^ halves[:, 1]  # the low 32 bits of acc ^ acc >> 32
    quarters = low.view(np.uint16).reshape(-1, 2)
    return np.bitwise_xor(quarters[:, 0], quarters[:, 1])


def _fold(raw: np.ndarray) -> tuple[np.ndarray, int]:
    """XOR of each row's 64-bit words (``raw``: [k, nbytes] uint8), and how many bits it
    may have (0 if nbytes is 0)."""
    nbytes = raw.shape[1]
    one_word = _ONE_WORD.get(nbytes)
    if one_word is not None:
        return raw.view(one_word)[:, 0], 8 * nbytes
    whole = nbytes // 8 * 8
    fold = np.zeros(len(raw), np.uint64)
    if whole:
        words = raw[:, :whole].view(np.uint64)
        if whole // 8 > _SHORT_ROW:  # long rows: numpy reduces along the row fast
            np.bitwise_xor.reduce(words, axis=1, out=fold)
        else:
            for j in range(whole // 8):
                fold ^= words[:, j]
    pos = whole
    for width, dtype in ((4, "<u4"), (2, "<u2"), (1, "u1")):  # the last < 8 bytes
        if nbytes - pos >= width:
            part = raw[:, pos : pos + width].view(dtype)[:, 0].astype(np.uint64)
            part <<= np.uint64(8 * (pos - whole))
            fold ^= part
            pos += width
    return fold, (64 if whole else 8 * nbytes)
