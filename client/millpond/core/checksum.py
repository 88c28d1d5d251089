"""Per-record checksums, computed for many records at once.

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
one 4-, 2- and 1-byte integer each, not byte by byte.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

CHECKSUM_DTYPE = np.dtype("<u2")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ROTATION = 7
# Rows of at most this many words are XOR-ed column by column: a reduce per
# row costs more than a few whole-column XORs.
_SHORT_ROW = 16


def record_checksums(columns: Mapping[str, np.ndarray], seqs: np.ndarray) -> np.ndarray:
    """Checksums of ``k`` records: ``columns`` are ``[k, *shape]`` in schema order."""
    k = len(seqs)
    m = len(columns)
    acc = np.asarray(seqs).astype(np.uint64)
    acc *= _GOLDEN
    for i, column in enumerate(columns.values()):
        fold = _fold(np.ascontiguousarray(column).reshape(k, -1).view(np.uint8))
        if fold is None:
            continue  # no bytes: its fold is 0
        rotation = _ROTATION * (m - i) % 64
        if rotation:  # rotl: the two shifted parts have no bit in common, so | is ^
            acc ^= fold << np.uint64(rotation)
            acc ^= fold >> np.uint64(64 - rotation)
        else:
            acc ^= fold
    acc ^= acc >> np.uint64(32)
    acc ^= acc >> np.uint64(16)
    return acc.astype(CHECKSUM_DTYPE)  # the low 16 bits


def _fold(raw: np.ndarray) -> np.ndarray | None:
    """XOR of each row's 64-bit words (``raw``: [k, nbytes] uint8); None if nbytes is 0."""
    nbytes = raw.shape[1]
    whole = nbytes // 8 * 8
    fold = None
    if whole:
        words = raw[:, :whole].view(np.uint64)
        if whole // 8 > _SHORT_ROW:  # long rows: numpy reduces along the row fast
            fold = np.bitwise_xor.reduce(words, axis=1)
        elif whole == 8:
            fold = words[:, 0].copy()
        else:
            fold = words[:, 0] ^ words[:, 1]
            for j in range(2, whole // 8):
                fold ^= words[:, j]
    pos = whole
    for width, dtype in ((4, "<u4"), (2, "<u2"), (1, "u1")):  # the last < 8 bytes
        if nbytes - pos >= width:
            part = raw[:, pos : pos + width].view(dtype)[:, 0].astype(np.uint64)
            if pos > whole:
                part <<= np.uint64(8 * (pos - whole))
            if fold is None:
                fold = part
            else:
                fold ^= part
            pos += width
    return fold
