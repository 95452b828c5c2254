"""Kernels of the ``uniform`` codec: per-bucket min/max, k-bit quantize + pack, unpack.

Scales are (lo, hi) float32 pairs, one per bucket; codes are q = round((x - lo) * R /
(hi - lo)) with R = 2**bits - 1 (or floor(t + u) for stochastic rounding), packed with
common.pack_block / pack_tail.
"""

import numpy as np
from numba import njit

from .common import (BLOCK, ERR_BAD_SCALE, ERR_NONFINITE, ERR_RANGE, GROUPS, OK, key_float,
                     key_range, keys_finite, pack_block, pack_tail, scaled_reciprocal, store,
                     stream_key, uniform01, unpack_block, unpack_tail)


@njit(cache=True)
def bucket_ranges(xbits, bucket, lohi):
    """Fill ``lohi`` (2 per bucket) with each bucket's min and max; return a status.

    ERR_NONFINITE for NaN/inf input, ERR_RANGE when hi - lo overflows float32.
    """
    n = xbits.size
    for b in range(lohi.size // 2):
        start = b * bucket
        lo_key, hi_key = key_range(xbits, start, min(start + bucket, n))
        if not keys_finite(lo_key, hi_key):
            return ERR_NONFINITE
        lo = key_float(lo_key)
        hi = key_float(hi_key)
        if not np.isfinite(hi - lo):
            return ERR_RANGE
        lohi[2 * b] = lo
        lohi[2 * b + 1] = hi
    return OK


@njit(inline="always")
def _quantize(xs, first, lo, hi, levels, stochastic, key, codes):
    """codes[i] for the values xs[i] of one bucket (x index ``first + i``)."""
    span = hi - lo
    if span == np.float32(0.0):
        codes[:] = 0
        return
    pre, inv = scaled_reciprocal(span, levels)
    top = np.float32(levels)
    if stochastic:
        for i in range(xs.size):
            t = ((xs[i] - lo) * pre) * inv
            codes[i] = np.uint8(min(np.floor(t + uniform01(key, first + i)), top))
    else:
        for i in range(xs.size):
            t = ((xs[i] - lo) * pre) * inv
            codes[i] = np.uint8(min(np.rint(t), top))


@njit(cache=True)
def encode(x, bucket, bits, lohi, stochastic, seed, counter, out):
    """Quantize ``x`` with the scales in ``lohi`` and pack the codes into ``out``."""
    n = x.size
    levels = (1 << bits) - 1
    key = stream_key(seed, counter)
    codes = np.empty(BLOCK, np.uint8)
    words = np.empty(GROUPS, np.uint64)
    pos = 0
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        seg = start
        while seg < stop:
            b = seg // bucket
            seg_stop = min((b + 1) * bucket, stop)
            _quantize(x[seg:seg_stop], seg, lohi[2 * b], lohi[2 * b + 1], levels, stochastic,
                      key, codes[seg - start:seg_stop - start])
            seg = seg_stop
        if stop - start == BLOCK:
            pack_block(codes, bits, out, pos, words)
            pos += bits * GROUPS
        else:
            pack_tail(codes, stop - start, bits, out, pos)


@njit(cache=True)
def check_ranges(lohi):
    """OK when every (lo, hi) pair is finite, ordered and hi - lo is finite."""
    for b in range(lohi.size // 2):
        lo = lohi[2 * b]
        hi = lohi[2 * b + 1]
        if not (np.isfinite(lo) and np.isfinite(hi) and lo <= hi and np.isfinite(hi - lo)):
            return ERR_BAD_SCALE
    return OK


@njit(cache=True)
def decode(src, bucket, bits, lohi, out, accumulate):
    """Unpack codes from ``src`` and write lo + q * (hi - lo) / R (at most hi) to ``out``,
    or with ``accumulate`` add it to ``out`` (float32 adds: ``out + decode`` bit for bit)."""
    n = out.size
    levels = np.float32((1 << bits) - 1)
    codes = np.empty(BLOCK, np.uint8)
    words = np.empty(GROUPS, np.uint64)
    pos = 0
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        if stop - start == BLOCK:
            unpack_block(src, pos, bits, codes, words)
            pos += bits * GROUPS
        else:
            unpack_tail(src, pos, stop - start, bits, codes)
        seg = start
        while seg < stop:
            b = seg // bucket
            seg_stop = min((b + 1) * bucket, stop)
            lo = lohi[2 * b]
            hi = lohi[2 * b + 1]
            step = (hi - lo) / levels
            dst = out[seg:seg_stop]
            cs = codes[seg - start:seg_stop - start]
            for i in range(dst.size):
                store(dst, i, min(lo + np.float32(cs[i]) * step, hi), accumulate)
            seg = seg_stop
