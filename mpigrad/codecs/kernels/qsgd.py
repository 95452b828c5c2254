"""Kernels of the ``qsgd`` codec (fixed-width coding; Elias coding is in elias.py).

Level of |x| in a bucket of scale ``scale`` with s levels: r = |x| * s / scale,
l = floor(r), level = l + 1 with probability r - l (so E[level] = r), clamped to s.
Fixed code: level in the low bits - 1 bits, sign (x < 0, only for level > 0) on top.
"""

import numpy as np
from numba import njit

from .common import (BLOCK, ERR_BAD_CODE, ERR_BAD_SCALE, ERR_NONFINITE, ERR_RANGE, GROUPS,
                     OK, SUM_SQUARES, lane_sum, max_abs_bits, pack_block, pack_tail,
                     scaled_reciprocal, store, stream_key, uniform01, unpack_block, unpack_tail)

_F32_MAX_BITS = np.int32(0x7F7FFFFF)


@njit(cache=True)
def bucket_scales(x, xbits, bucket, use_l2, scales):
    """Fill ``scales`` with each bucket's max |x| (or l2 norm); return a status."""
    n = x.size
    for b in range(scales.size):
        start = b * bucket
        stop = min(start + bucket, n)
        top = max_abs_bits(xbits, start, stop)
        if top > _F32_MAX_BITS:
            return ERR_NONFINITE
        if use_l2:
            norm = np.float32(np.sqrt(lane_sum(x, start, stop, SUM_SQUARES)))
            if not np.isfinite(norm):
                return ERR_RANGE
            scales[b] = norm
        else:
            scales[b] = np.int32(top).view(np.float32)
    return OK


@njit(inline="always")
def level(magnitude, pre, inv, top, u):
    """Stochastic level (float32) of ``magnitude``: floor(r) or floor(r) + 1, at most top."""
    r = (magnitude * pre) * inv
    low = np.floor(r)
    up = low + np.float32(1.0) if u < r - low else low
    return min(up, top)


@njit(inline="always")
def _quantize(xs, first, scale, levels, sign_bit, key, codes):
    if scale == np.float32(0.0):
        codes[:] = 0
        return
    pre, inv = scaled_reciprocal(scale, levels)
    top = np.float32(levels)
    for i in range(xs.size):
        v = xs[i]
        q = np.uint8(level(abs(v), pre, inv, top, uniform01(key, first + i)))
        codes[i] = q | (sign_bit if (v < np.float32(0.0)) & (q > 0) else np.uint8(0))


@njit(cache=True)
def encode_fixed(x, bucket, bits, levels, scales, seed, counter, out):
    """Quantize ``x`` against ``scales`` and pack bits-wide codes into ``out``."""
    n = x.size
    key = stream_key(seed, counter)
    sign_bit = np.uint8(1 << (bits - 1))
    codes = np.empty(BLOCK, np.uint8)
    words = np.empty(GROUPS, np.uint64)
    pos = 0
    for start in range(0, n, BLOCK):
        stop = min(start + BLOCK, n)
        seg = start
        while seg < stop:
            b = seg // bucket
            seg_stop = min((b + 1) * bucket, stop)
            _quantize(x[seg:seg_stop], seg, scales[b], levels, sign_bit, key,
                      codes[seg - start:seg_stop - start])
            seg = seg_stop
        if stop - start == BLOCK:
            pack_block(codes, bits, out, pos, words)
            pos += bits * GROUPS
        else:
            pack_tail(codes, stop - start, bits, out, pos)


@njit(cache=True)
def check_scales(scales):
    """OK when every scale is finite and >= 0."""
    for b in range(scales.size):
        if not (np.isfinite(scales[b]) and scales[b] >= np.float32(0.0)):
            return ERR_BAD_SCALE
    return OK


@njit(cache=True)
def decode_fixed(src, bucket, bits, levels, scales, out, accumulate):
    """Unpack codes and write sign * level * scale / s to ``out``, or with ``accumulate``
    add it to ``out`` (float32 adds: ``out + decode`` bit for bit).

    Returns ERR_BAD_CODE (after writing ``out``) if a level exceeds ``levels``: where that
    can happen (s < 2**(bits-1) - 1), an accumulating caller runs ``check_levels`` first.
    """
    n = out.size
    level_mask = np.uint8((1 << (bits - 1)) - 1)
    sign_bit = np.uint8(1 << (bits - 1))
    worst = np.uint8(0)
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
            step = scales[b] / np.float32(levels)
            dst = out[seg:seg_stop]
            cs = codes[seg - start:seg_stop - start]
            for i in range(dst.size):
                c = cs[i]
                q = c & level_mask
                worst = max(worst, q)
                v = np.float32(q) * step
                store(dst, i, -v if c & sign_bit else v, accumulate)
            seg = seg_stop
    return OK if worst <= levels else ERR_BAD_CODE


@njit(cache=True)
def check_levels(src, n, bits, levels):
    """OK when no level of the ``n`` bits-wide codes at ``src`` exceeds ``levels``, else
    ERR_BAD_CODE; reads the codes only (the check ``decode_fixed`` makes after writing)."""
    level_mask = np.uint8((1 << (bits - 1)) - 1)
    worst = np.uint8(0)
    codes = np.empty(BLOCK, np.uint8)
    words = np.empty(GROUPS, np.uint64)
    pos = 0
    for start in range(0, n, BLOCK):
        count = min(BLOCK, n - start)
        if count == BLOCK:
            unpack_block(src, pos, bits, codes, words)
            pos += bits * GROUPS
        else:
            unpack_tail(src, pos, count, bits, codes)
        cs = codes[:count]
        for i in range(cs.size):
            worst = max(worst, cs[i] & level_mask)
    return OK if worst <= levels else ERR_BAD_CODE
