"""NumPy versions of the shared kernel primitives (kernels/common.py), for the twins.

Each function computes, with whole-array NumPy operations, exactly the numbers its
Numba counterpart does: same float32 operation order, same RNG, same bit layout.
"""

from __future__ import annotations

import numpy as np

from ..kernels.common import BLOCK, GROUPS

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_U = np.uint64


def _mix64_int(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _U(30))) * _U(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U(27))) * _U(0x94D049BB133111EB)
    return z ^ (z >> _U(31))


def stream_key(seed: int, counter: int) -> int:
    return _mix64_int((seed * _GOLDEN + _mix64_int((counter + _GOLDEN) & _MASK64)) & _MASK64)


def uniform01(key: int, first: int, count: int) -> np.ndarray:
    """float32 draws for indices first .. first + count - 1 of stream ``key``."""
    index = np.arange(first, first + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        r = _mix64(_U(key) + index * _U(_GOLDEN))
    return (r >> _U(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))


def order_keys(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.int32)
    return bits ^ ((bits >> np.int32(31)) & np.int32(0x7FFFFFFF))


def key_floats(keys: np.ndarray) -> np.ndarray:
    return (keys ^ ((keys >> np.int32(31)) & np.int32(0x7FFFFFFF))).astype(np.int32).view(np.float32)


def bucket_starts(n: int, bucket: int) -> np.ndarray:
    return np.arange(0, n, bucket)


def per_element(values: np.ndarray, n: int, bucket: int) -> np.ndarray:
    """Repeat one value per bucket over the bucket's elements."""
    counts = np.full(values.size, bucket)
    if values.size:
        counts[-1] = n - bucket * (values.size - 1)
    return np.repeat(values, counts)


def lane_sums(terms: np.ndarray, bucket: int) -> np.ndarray:
    """Per-bucket float64 sums of ``terms`` in kernels.common.lane_sum's order."""
    n = terms.size
    nb = -(-n // bucket)
    width = -(-bucket // 8) * 8
    table = np.zeros((nb, width))
    full = n // bucket
    table[:full, :bucket] = terms[:full * bucket].reshape(full, bucket)
    if n % bucket:
        table[full, :n % bucket] = terms[full * bucket:]
    lanes = np.cumsum(table.reshape(nb, width // 8, 8), axis=1)[:, -1, :]
    return ((lanes[:, 0] + lanes[:, 1]) + (lanes[:, 2] + lanes[:, 3])) + (
        (lanes[:, 4] + lanes[:, 5]) + (lanes[:, 6] + lanes[:, 7]))


def scaled_reciprocal(span: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """(pre, inv) arrays as kernels.common.scaled_reciprocal computes them (span > 0)."""
    tiny = span < np.float32(2.0 ** -100)
    pre = np.where(tiny, np.float32(2.0 ** 100), np.float32(1.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = (np.float32(levels) / (span * pre)).astype(np.float32)
    return pre, inv


def msb_pack(values: np.ndarray, nbits: np.ndarray | int) -> np.ndarray:
    """Concatenate fields (value, width) MSB-first into bytes, zero-padded (put_bits order)."""
    values = np.asarray(values, dtype=np.uint64)
    widths = np.broadcast_to(np.asarray(nbits, dtype=np.int64), values.shape).ravel()
    values = values.ravel()
    owner = np.repeat(np.arange(values.size), widths)
    offset = np.cumsum(widths) - widths
    k = np.arange(owner.size) - offset[owner]
    shift = (widths[owner] - 1 - k).astype(np.uint64)
    return np.packbits(((values[owner] >> shift) & _U(1)).astype(np.uint8))


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Blocked byte planes for whole blocks, then an MSB-first tail (kernels.common)."""
    full = codes.size // BLOCK
    blocks = codes[:full * BLOCK].reshape(full, 8, GROUPS).astype(np.uint64)
    shifts = (bits * np.arange(8, dtype=np.uint64))[None, :, None]
    words = np.bitwise_or.reduce(blocks << shifts, axis=1)
    planes = words[:, None, :] >> (8 * np.arange(bits, dtype=np.uint64))[None, :, None]
    head = (planes & _U(0xFF)).astype(np.uint8).ravel()
    return np.concatenate([head, msb_pack(codes[full * BLOCK:], bits)])


def unpack_codes(src: np.ndarray, n: int, bits: int) -> np.ndarray:
    full = n // BLOCK
    planes = src[:full * bits * GROUPS].reshape(full, bits, GROUPS).astype(np.uint64)
    words = np.bitwise_or.reduce(planes << (8 * np.arange(bits, dtype=np.uint64))[None, :, None], axis=1)
    shifts = (bits * np.arange(8, dtype=np.uint64))[None, :, None]
    head = ((words[:, None, :] >> shifts) & _U((1 << bits) - 1)).astype(np.uint8).ravel()
    rest = n - full * BLOCK
    tail_bits = np.unpackbits(src[full * bits * GROUPS:])[:rest * bits].reshape(rest, bits)
    weights = (1 << np.arange(bits - 1, -1, -1)).astype(np.uint8)
    tail = (tail_bits * weights).sum(axis=1, dtype=np.uint8) if rest else np.zeros(0, np.uint8)
    return np.concatenate([head, tail])


def omega_fields(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Elias omega codes of ``v >= 1`` as (values, widths) of shape (len(v), depth + 1)."""
    v = np.asarray(v, dtype=np.int64)
    groups = []
    current = v.copy()
    while (current > 1).any():
        length = np.where(current > 1, _bit_length(current), 0)
        groups.append((current, length))
        current = np.where(current > 1, length - 1, 1)
    values = np.zeros((v.size, len(groups) + 1), np.uint64)
    widths = np.zeros((v.size, len(groups) + 1), np.int64)
    for column, (value, width) in enumerate(reversed(groups)):
        values[:, column] = value
        widths[:, column] = width
    widths[:, -1] = 1
    return values, widths


def _bit_length(v: np.ndarray) -> np.ndarray:
    out = np.zeros(v.shape, np.int64)
    rest = v.copy()
    while (rest > 0).any():
        out += rest > 0
        rest >>= 1
    return out
